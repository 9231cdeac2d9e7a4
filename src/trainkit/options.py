"""The rooms' options: conf/model, conf/data and conf/task. Each yaml's `_target_` names a callable in a module
of its room (trainkit/models, data, tasks), and that module may declare what the engine asks of it:

- `Schema`: a dataclass of the yaml's keys; `typed` merges the node into it, so a value of the wrong type or an
  unknown key is refused in one line naming it, and the schema's defaults fill in what the yaml leaves out.
- `check(cfg)`: refuses a config the option cannot work with (e.g. task=lm on a data set without tokens).
- `check_run(run_dir, run_cfg)`: eval.py and predict.py on a finished run of the option.
- resolvers its yaml uses, registered as the module is imported.

The module is found as hydra.utils.instantiate finds the callable, by the `_target_` string: the engine imports
no room by name, and a fork's option is its yaml and its module, registered nowhere else. (Hydra's ConfigStore
would check types as it composes, but only for schemas stored before composing, which would mean importing
every room up front; the groups trainkit reads itself are typed that way: trainkit/schema.py.)
"""

import dataclasses
import functools
import importlib
from pathlib import Path
from types import ModuleType
from typing import Any

from omegaconf import DictConfig, OmegaConf

from trainkit.errors import ConfigError

TARGETS = {"model": "model._target_", "data": "data.splits._target_", "task": "task._target_"}


def module_of(cfg: DictConfig, group: str) -> ModuleType | None:
    """The module of the group's `_target_` (None for a node without one, e.g. a run's saved config of a
    data set whose splits build no object)."""
    target = OmegaConf.select(cfg, TARGETS[group], throw_on_missing=False)
    if not isinstance(target, str) or "." not in target:
        return None
    name = target.rpartition(".")[0]
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name is not None and name.startswith(error.name):  # the module itself, not one it imports
            raise ConfigError(f"{TARGETS[group]}={target}: there is no module {name}") from None
        raise


def typed(cfg: DictConfig) -> None:
    """Each room node merged into its option's Schema, in place. OmegaConf's ValidationError or ConfigKeyError
    propagates with its full_key prefixed by the group (config.check turns it into one line)."""
    for group in TARGETS:
        schema = getattr(module_of(cfg, group), "Schema", None)
        if schema is None or OmegaConf.get_type(cfg[group]) is schema:
            continue
        if group == "model" and "init" in cfg.model:  # model.init (trainkit/parent.py): the engine's key, not the
            schema = _with_init(schema)  # model's (config.check types it; `from` is no dataclass field name)
            if OmegaConf.get_type(cfg[group]) is schema:
                continue
        try:
            node = OmegaConf.merge(OmegaConf.structured(schema), cfg[group])
        except Exception as error:
            if getattr(error, "full_key", None):
                error.full_key = f"{group}.{error.full_key}"  # type: ignore[attr-defined]
            raise
        cfg[group] = node


@functools.cache
def _with_init(schema: type) -> type:
    """The model's Schema with trainkit's `init` key beside its own."""
    return dataclasses.make_dataclass(schema.__name__, [("init", Any, None)], bases=(schema,))


def check(cfg: DictConfig) -> None:
    """Each option's own `check(cfg)`: model, data, task."""
    for group in TARGETS:
        if (refuse := getattr(module_of(cfg, group), "check", None)) is not None:
            refuse(cfg)


def check_run(run_dir: Path, run_cfg: DictConfig) -> None:
    """Each option's `check_run(run_dir, run_cfg)`: a finished run read back by eval.py or predict.py."""
    for group in TARGETS:
        if (refuse := getattr(module_of(run_cfg, group), "check_run", None)) is not None:
            refuse(run_dir, run_cfg)
