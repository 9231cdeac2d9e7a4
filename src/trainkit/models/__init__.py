"""The models room (conf/model/<name>.yaml: one file here per model family). Yours goes here too.

A model is an `nn.Module` that a yaml's `_target_` builds (a class or a function returning one); its keys are
the constructor's arguments, usually interpolated from the data (`num_classes: ${data.num_classes}`). It gets
what the task's `unpack` says the model gets (a tensor, or a dict / tuple the forward takes apart) and returns
what the task's `loss_sum` reads. What the engine reads from it, all optional:
- `shard_units`: the class names of its repeated blocks, parallel=fsdp's units (default: torch's rule).
- BatchNorm layers: converted to SyncBN with parallel.sync_bn; activation checkpointing through
  trainkit.recompute (`Staged`, `checkpointed`) keeps the step the same bit for bit.
- `flops_per_token(length)` and `flops_formula`: a formula the summary prints beside its FLOP count.
- `layer_of(name)`: the layer of a parameter (0 on the input side, the head last): `optim.layer_decay`'s order
  (GPT's; model=timm sets it from timm's group_matcher).
- `materialize_pending` and `materialize(device)`: a model built on the meta device when trainkit.materialize's
  `deferring()` allows it (parallel=fsdp), its weights loaded by `materialize` after sharding, each rank its shard
  (model=hf's pretrained weights: no rank holds the whole model).
- `adapt_init(name, parent_tensor)`: model.init's hook for a parent's tensor of another shape: the tensor in this
  model's shape, or None (refused in one line). GPT's: a shorter context's position table into its longer one.

The yaml's keys are written once, as the `_target_`'s arguments: their annotations are the keys' types and their
defaults the keys' defaults (trainkit/options.py derives the schema from the signature), so `model.width=abc` or a
misspelt key is refused in one line. Annotate what OmegaConf can type (int, float, bool, str, list[int],
`int | None`, ...); a parameter without one (or with a type it cannot check) takes any value.

Its module may declare (trainkit/options.py reads them; the engine imports no file here by name):
- `Schema`: a dataclass of the yaml's keys, instead of the derived one (a signature with **kwargs, or defaults of
  the yaml that are not the constructor's: models/timm.py).
- `check(cfg)`: refuse a config the model cannot work with, raising trainkit.errors.ConfigError naming the key.
- `export(model, run_cfg, directory, merge, out) -> str`: src/export.py's, the finished run's model (its weights
  loaded) written into `directory` in its library's own format (model=hf: a Hugging Face directory), returning
  what was written and how it loads; `check_export(run_cfg, merge)` refuses before the model is built. A model
  without `export` is refused by export.py in one line.
"""
