"""The rooms' options: conf/model, conf/data, conf/task and conf/sched. Each yaml's `_target_` names a callable in a
module of its room (trainkit/models, data, tasks, schedules), and that module may declare what the engine asks of
it:

- `Schema`: a dataclass of the yaml's keys; `typed` merges the node into it, so a value of the wrong type or an
  unknown key is refused in one line naming it, and the schema's defaults fill in what the yaml leaves out.
  Without one, the schema is the `_target_`'s signature (`derived`: a parameter's annotation is its key's type,
  its default the key's default, `???` where it has none: `check` refuses one left unset; a data set's is
  trainkit.schema.Data with `splits` its function's signature):
  an option whose keys are its constructor's arguments writes them once, in the signature (a schedule's: its
  keyword arguments after the `step` and `total_steps` the engine passes, CALLED_WITH). A module declares
  `Schema` where the yaml holds more than the arguments (a data set's own keys beside `splits`) or its defaults
  differ from the constructor's; a signature with **kwargs has no closed set of keys: no schema is derived.
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
import inspect
from pathlib import Path
from types import ModuleType
from typing import Any

from hydra.utils import get_object
from omegaconf import MISSING, DictConfig, OmegaConf

from trainkit.errors import ConfigError
from trainkit.schema import Data

TARGETS = {
    "model": "model._target_",
    "data": "data.splits._target_",
    "task": "task._target_",
    "sched": "sched._target_",
}
CALLED_WITH = {"sched": ("step", "total_steps")}  # a room's arguments the engine passes at the call, no yaml keys


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
        module = module_of(cfg, group)
        schema = getattr(module, "Schema", None) if module is not None else None
        if module is not None and schema is None:
            target, keys = OmegaConf.select(cfg, TARGETS[group]), _hydra_keys(cfg[group], group)
            schema = derived(target, group == "data", keys, CALLED_WITH.get(group, ()))
        if schema is None or OmegaConf.get_type(cfg[group]) is schema:
            continue
        if group == "model" and "init" in cfg.model:  # model.init (trainkit/parent.py): the engine's key, not the
            schema = _with_init(schema)  # model's (config.check types it; `from` is no dataclass field name)
            if OmegaConf.get_type(cfg[group]) is schema:
                continue
        cfg[group] = _merged(schema, cfg[group], group)
    # data.eval_sets: each node typed by its `_target_`'s signature, as data.splits is
    sets = cfg.data.get("eval_sets") if "data" in cfg else None
    if not isinstance(sets, DictConfig):
        return
    for name, node in sets.items():
        target = node.get("_target_") if isinstance(node, DictConfig) else None  # else heldout.check refuses it
        schema = derived(target, False, _hydra_keys(node, "eval_sets")) if isinstance(target, str) else None
        if schema is not None and OmegaConf.get_type(node) is not schema:
            sets[name] = _merged(schema, node, f"data.eval_sets.{name!s}")


def _merged(schema: type, node: DictConfig, where: str) -> Any:
    """`node` merged into `schema`; OmegaConf's refusal with its full_key prefixed by `where`."""
    try:
        return OmegaConf.merge(OmegaConf.structured(schema), node)
    except Exception as error:
        if getattr(error, "full_key", None):
            error.full_key = f"{where}.{error.full_key}"  # type: ignore[attr-defined]
        raise


HYDRA_KEYS = ("_partial_", "_recursive_", "_convert_", "_args_")  # instantiate's own keys, typed where a yaml has them


def _hydra_keys(node: DictConfig, group: str) -> tuple[str, ...]:
    called = node.get("splits") if group == "data" else node
    return tuple(key for key in HYDRA_KEYS if isinstance(called, DictConfig) and key in called)


@functools.cache
def derived(
    target: str, data: bool = False, hydra_keys: tuple[str, ...] = (), called_with: tuple[str, ...] = ()
) -> type | None:
    """The schema of an option without `Schema`: the keys of `target`'s signature, typed by their annotations
    (Any where there is none, or where OmegaConf cannot type it, e.g. a Dataset), their defaults (MISSING where
    there is none: the yaml sets it); for a data set (data=True) Data with `splits` typed so. None where the
    signature takes **kwargs (any key goes) or cannot be read. `called_with`: parameters the engine passes, no keys."""
    try:
        parameters = inspect.signature(get_object(target), eval_str=True).parameters.values()
    except (ValueError, TypeError, NameError, ImportError, AttributeError):
        return None
    if any(p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL) for p in parameters):
        return None
    fields: list[Any] = [("_target_", str, MISSING), *((key, Any, MISSING) for key in hydra_keys)]
    for p in parameters:
        if p.name in called_with:
            continue
        default = MISSING if p.default is p.empty else p.default
        if isinstance(default, (list, dict)):  # a dataclass field's mutable default: a factory
            default = dataclasses.field(default_factory=functools.partial(type(default), default))
        kind = p.annotation if p.annotation is not p.empty and _typeable(p.annotation, default) else Any
        fields.append((p.name, kind, default))
    call = dataclasses.make_dataclass(f"{target}:signature", fields)
    if not data:
        return call
    splits = ("splits", call, dataclasses.field(default_factory=call))
    return dataclasses.make_dataclass(f"{target}:data", [splits], bases=(Data,))


def _typeable(annotation, default) -> bool:
    """Can OmegaConf type a key by this annotation, with this default (None needs an Optional one)?"""
    try:
        OmegaConf.structured(dataclasses.make_dataclass("probe", [("key", annotation, default)]))
    except Exception:  # omegaconf's ValidationError and the like: an annotation it does not know
        return False
    return True


@functools.cache
def _with_init(schema: type) -> type:
    """The model's Schema with trainkit's `init` key beside its own."""
    return dataclasses.make_dataclass(schema.__name__, [("init", Any, None)], bases=(schema,))


def check(cfg: DictConfig) -> None:
    """Each option's own `check(cfg)`: model, data, task, sched; then every key still unset (`???`)."""
    for group in TARGETS:
        if (refuse := getattr(module_of(cfg, group), "check", None)) is not None:
            refuse(cfg)
    for group in TARGETS:
        _refuse_unset(cfg, group)


def _refuse_unset(cfg: DictConfig, group: str) -> None:
    """A key the yaml leaves `???` (a signature's argument without a default: `derived`) would fail as the option
    is built or, for a schedule, at its first call. After the options' own checks: theirs say more (task.teacher)."""
    if unset := sorted(OmegaConf.missing_keys(cfg[group])):
        target = OmegaConf.select(cfg, TARGETS[group], throw_on_missing=False)
        raise ConfigError(
            f"{unset[0]} is not set: {TARGETS[group]}={target} takes it without a default; set it in its yaml or on "
            "the command line"
        )


def check_run(run_dir: Path, run_cfg: DictConfig) -> None:
    """Each option's `check_run(run_dir, run_cfg)`: a finished run read back by eval.py or predict.py."""
    for group in TARGETS:
        if (refuse := getattr(module_of(run_cfg, group), "check_run", None)) is not None:
            refuse(run_dir, run_cfg)
