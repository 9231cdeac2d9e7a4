"""The data sets room (conf/data/<name>.yaml: one file here per data set family). Yours goes here too.

A data set is what `data.splits._target_` returns: (train, val, test) map-style data sets (`__len__`,
`__getitem__`), or (train, val) when there is no test split. A named evaluation set's `_target_`
(`data.eval_sets.<name>`, trainkit/heldout.py) returns the same: its val and test are evaluated beside the run's.
A sample may be anything the default collation stacks: a tensor pair, a tuple of any length, a dict, a dataclass
or named tuple of tensors, nested; a data set with its own `collate_fn` attribute (padding sequences, say) batches
them itself. The task's `unpack` says what of a batch the model gets and what is the target. The engine reads, all
optional:
- `epoch_order(seed, epoch, global_batch)`: the train split's global order of an epoch (an int64 tensor of len()
  indices), in place of the permutation of (seed + epoch) when data.shuffle is true: global window s is its
  positions s·B..(s+1)·B-1, rank r takes positions r, r+W, ... (trainkit.loading.TrainBatches). It may depend on
  (seed, epoch) and, for shares per global batch, B: never on W, K or the micro-batch (data=shards: shard locality;
  a mixture's shares).
- `row(epoch, windows, global_batch)`: entries for each logged row after `windows` windows of `epoch` (a mixture's
  samples per source, `data/<source>`).
- `reads_remotely`: True where a read may fail for a while (an object store): trainkit.errors.DataUnavailable from
  a read is then agreed on by every rank before the step, which write the last step's checkpoint and stop.
- `draws_random`: False when loading a sample draws nothing from Python's, numpy's or torch's generators
  (then nothing is seeded per sample); "torch" when it draws from torch's alone. Without it, trainkit seeds
  all three per sample from (seed, epoch, index): the same draws at any allocation and after a resume.
- `device_tensors()`, `device_bytes()`, `device_batches(tensors, order, batch_size, epoch, seed, rows)`: the train
  split's tensor form, for data.on_device (trainkit.loading.residency, Resident). An InMemory or plain TensorDataset
  has one already (its tensors, their rows its samples). `device_tensors()` gives the host tensors the split lives in
  (moved to the device once: addition's problems padded to the longest, FakeData's images made once, a corpus's
  token stream); `device_bytes()` their size before they are made (auto compares it with the device's free memory;
  without it, the tensors' own). Without `device_batches`, the tensors' rows are the samples: each epoch gathers
  them by this rank's order once and the micro-batches are views. With it, the data set builds the micro-batches
  itself from the device tensors and this rank's epoch order (an int64 tensor on the host, from the resume's
  micro-batch on), each the loader path's micro-batch bit for bit (the same samples, values and shapes: addition
  cuts each to its longest, read from host-side lengths so the GPU is never waited on); what it draws comes from
  `trainkit.rng.sample_seed(seed, epoch, index)`, as `seeded` does (data=tokens' block starts). `rows` (None, or an
  int64 tensor beside `order`): the samples' rows in the data set where they differ from `order`, a debug subset's
  (debug.Kept: its positions in `order` still what the draws come from, as on the DataLoader path); a
  `device_batches` without it keeps such a subset on the DataLoader. A data set that draws on the host
  (`draws_random` true) without `device_batches` stays on the DataLoader (the startup line says why).
- trainkit.loading.InMemory (a TensorDataset loaded by one indexing per batch) and `held_out` (split sizes
  from fractions, refused in one line where they leave no training sample) are there to use.
The yaml's other keys: `shape` and `num_classes` (what the models interpolate), `batch_size`, `shuffle`,
`drop_last`, `num_workers`, ... (trainkit.schema.Data: the keys every data set has).

The keys of `splits` are written once, as the splits function's arguments: trainkit/options.py derives the data
node's schema from its signature (trainkit.schema.Data with `splits` typed by the annotations, defaulted by the
defaults): data/digits.py declares nothing else.

Its module may declare (trainkit/options.py reads them; the engine imports no file here by name):
- `Schema`: a dataclass subclassing trainkit.schema.Data, the yaml's keys and their types, where the data set has
  keys of its own beside `splits` (`vocab_size`, `block_size`: data/addition.py) or a signature with **kwargs.
- `SETTINGS`: names of the splits function's arguments that are settings, not data (a shard store's cache and
  retries): left out of the run's identity, so a resume may change them.
- `check(cfg)`: refuse a config it cannot work with (trainkit.errors.ConfigError naming the key).
- `check_run(run_dir, run_cfg)`: eval.py and predict.py call it on a finished run of this data set (e.g.
  data=pydoc_text: the vocabulary it trained with is this Python's).
- resolvers its yaml uses, registered when the module is imported (OmegaConf.register_new_resolver).
"""
