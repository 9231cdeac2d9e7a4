"""The tasks room (conf/task/<name>.yaml: one file here per task). Yours goes here too.

A task says what is learned and how it is measured; train.py, evaluate.py, eval.py and predict.py are the
same for every task. It provides:
- `loss_sum(output, target)`: the summed loss of the batch's loss-bearing items (0 for an empty batch); the
  loop normalises it over the global window, so the result is exact at any world size and accumulation.
- `items(target)`: how many loss-bearing items the batch holds (a tensor); `items_name`: None when items
  are samples (counted without communication), else their name (e.g. "tokens", reported in the rows).
- `eval_sums(inputs, output, target)`: a float64 tensor of `eval_width` sums for one evaluation batch, and
  `eval_metrics(sums)`: the metrics {name: value} of the all-reduced sums of a whole split. Every metric is
  computed from sums, so it is exact at any world size also when it is no mean of per-item values (R^2 from
  the sums of y, y^2 and squared errors: tasks/regression.py).
- `metrics`: {name: "max" | "min"}, eval_metrics' keys and which way each is better (checkpoint.mode=auto,
  early stopping, a search's direction): a monitored key whose direction is not declared is refused, never
  guessed. `monitor`: checkpoint.monitor=auto's key, e.g. "val/r2" (without: val/loss).
Optional:
- `unpack(batch)`: (what the model gets, the target); default: a pair's first and second element.
- `headline`: the metrics the console's lines show (default: every declared one).
- `prepare_eval(model, d, autocast)`: called on every rank before each evaluation (collectives allowed:
  tasks/contrastive.py gathers its kNN bank there).
- `couples_batch = True`: the loss couples a batch's items (a contrastive loss): `loss_sum` gets the outputs
  of the whole global window at once, exact across micro-batches and ranks (trainkit/coupled.py).
- `predictions(output, target)`: predict.py's columns {name: tensor of one value per sample}.
- `embeddings(output, target)`: predict.py's embeddings.pt {name: tensor (N, ...)} of the split, e.g. an
  encoder's embedding and the label (task=contrastive): index-aligned in dataset order, the same on any N.
- `loss_terms = ("ce", "kd")`: the loss has terms. `loss_sum` then returns a 1-D tensor [loss, *terms], each
  summed over the batch's items as the loss is (the loop backpropagates element 0); train rows add
  `loss/<term>`, the mean over the row's items like `loss`, all-reduced, checkpointed and merged on a resume
  exactly like it. A task without loss_terms returns a scalar (and pays nothing).
- a `teacher` node in its yaml ({from: <run dir>, weights: last|best|ema}): its constructor's `teacher`
  argument is then the frozen module the engine built from that run, not the node (trainkit/teacher.py: eval
  mode, no_grad, on the device, never wrapped, in no checkpoint; task=distil).
- `predict_job(cfg, run_cfg, out_dir)`: a task that predicts its own way (task=lm: decoding, sampling).

The yaml's keys are the task's constructor arguments, written once: trainkit/options.py derives their schema from
its signature (annotations: types; defaults: defaults). Its module may declare `Schema` (a dataclass of the yaml's
keys and their types, where the signature cannot say them: tasks/contrastive.py's Dataset argument) and
`check(cfg)` (refuse a config it cannot work with, e.g. task=lm without a token data set): trainkit/options.py
reads them.
"""
