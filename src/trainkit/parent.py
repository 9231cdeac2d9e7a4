"""A run that builds on a finished run: its parent (a run dir, or a .pt file of weights). `Parent.open` finds the
weights and the config, `state_dict` reads the weights, `build_model` rebuilds the parent's model with them (a
teacher), `copy_into` keeps what a chained run needs of its parent in the chained run's own dir, and `load_into`
starts a new model from the parent's weights (`model.init.*`: renamed or dropped prefixes, keys excluded by glob,
strict or not; a tensor of another shape adapted by the model's own `adapt_init`, else refused).

Every rank reads the same file itself (no rank 0 read and broadcast): the weights are loaded before wrapping,
where a broadcast would need the process group's device tensors for every key and would differ between DDP
(which broadcasts rank 0's parameters anyway) and FSDP (which shards what each rank holds); a file read needs no
collective, so a missing file fails every rank alike before the first one, and the run dir is on a file
system all ranks see already (checkpoints, DCP). torch.load(weights_only=True): a parent may come from anyone.
"""

import fnmatch
import os
import shutil
import tempfile
from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf, open_dict

from trainkit.checkpoint import load_model
from trainkit.dist import env_rank
from trainkit.errors import ConfigError
from trainkit.materialize import deferred

WEIGHTS = {"last": "model.pt", "best": "model_best.pt", "ema": "model_ema.pt"}  # also eval.py's, predict.py's weights=
WHY_ABSENT = {
    "best": "the run kept no best checkpoint (checkpoint.monitor=null, or no evaluation)",
    "ema": "the run kept no EMA (trainer.ema.decay=null)",
    "last": "not a finished training run",
}
CONFIG = Path(".hydra") / "config.yaml"


def model_node(cfg: DictConfig) -> DictConfig:
    """cfg.model without trainkit's `init` key: what instantiate builds (its keys are the model's arguments)."""
    if "init" not in cfg.model:
        return cfg.model
    cfg = cfg.copy()  # interpolations (${data.shape}) still resolve against this copy's root
    with open_dict(cfg.model):
        del cfg.model["init"]
    return cfg.model


def build_model(cfg: DictConfig, mode: str) -> torch.nn.Module:
    """The run's model (cfg.model less model.init). parallel=fsdp without model.init: a room may build it on the
    meta device and load its weights shard by shard after wrapping (trainkit/materialize.py); model.init loads a
    parent's whole state_dict before wrapping, so its model is built whole."""
    with deferred(mode == "fsdp" and not cfg.model.get("init")):
        return instantiate(model_node(cfg))


class Parent:
    """A finished run (or a weights file) that another run builds on."""

    def __init__(self, run_dir: Path | None, weights_path: Path, config: DictConfig | None, key: str):
        self.run_dir, self.weights_path, self.config, self.key = run_dir, weights_path, config, key
        self._state: dict[str, torch.Tensor] | None = None

    @classmethod
    def open(cls, source: str | Path, weights: str = "last", *, key: str = "model.init") -> "Parent":
        """A run dir (its model.pt / model_best.pt / model_ema.pt by `weights`, and .hydra/config.yaml) or a .pt
        file (no config). `key`: the config key named in the one-line errors."""
        path = Path(source)
        if weights not in WEIGHTS:
            raise ConfigError(f"{key}.weights={weights} is not one of: {', '.join(WEIGHTS)}")
        if path.is_file():
            if weights != "last":
                raise ConfigError(f"{key}.weights={weights} names a file of a run dir; {key}.from={path} is a file")
            return cls(None, path, None, key)
        if not path.is_dir():
            raise ConfigError(f"{key}.from={source} does not exist (a finished run's dir or a .pt file)")
        file = path / WEIGHTS[weights]
        if not file.is_file():
            raise ConfigError(f"{key}.from={path} has no {file.name} ({key}.weights={weights}): {WHY_ABSENT[weights]}")
        config = OmegaConf.load(path / CONFIG) if (path / CONFIG).is_file() else None
        if config is not None and not isinstance(config, DictConfig):
            raise ConfigError(f"{key}.from={path}: {CONFIG} is not a training run's config")
        return cls(path, file, config, key)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The parent's weights (read once, on the CPU)."""
        if self._state is None:
            try:
                state = torch.load(self.weights_path, map_location="cpu", weights_only=True)  # never unpickle code
            except Exception as error:  # torch's message runs over many lines; the type tells corrupt from unsafe
                raise ConfigError(
                    f"{self.key}: {self.weights_path} is no state_dict that torch.load(weights_only=True) reads "
                    f"({type(error).__name__})"
                ) from None
            if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
                raise ConfigError(f"{self.key}: {self.weights_path} holds no state_dict (a dict of tensors)")
            self._state = state
        return self._state

    def build_model(self) -> torch.nn.Module:
        """The parent's own model (its cfg.model, without its own init: the weights are its result), loaded
        strictly, on the CPU."""
        if self.config is None:
            raise ConfigError(
                f"{self.key}.from={self.weights_path} is a weights file: building its model needs a run dir"
            )
        model = instantiate(model_node(self.config))
        load_model(model, self.state_dict(), f"{self.key}: {self.weights_path}")
        return model

    def copy_into(self, directory: Path) -> Path:
        """Copy the weights file and .hydra/config.yaml into `directory` (a run dir of its own: Parent.open reads
        it back, with the same `weights`), so the chained run works when the parent's dir is gone. Rank 0 writes
        (other ranks return at once); atomic: a temp dir renamed into place, replacing an older copy."""
        directory = Path(directory)
        if env_rank() != 0:
            return directory
        directory.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=directory.parent, prefix=f".{directory.name}."))
        shutil.copy2(self.weights_path, tmp / self.weights_path.name)
        if self.config is not None:
            (tmp / ".hydra").mkdir()
            OmegaConf.save(self.config, tmp / CONFIG)
        if directory.exists():  # a restarted start-up: the same parent again
            shutil.rmtree(directory)
        os.replace(tmp, directory)
        return directory


def remap(state: dict[str, torch.Tensor], mapping: dict[str, str | None]) -> dict[str, torch.Tensor]:
    """model.init.map: {prefix: new prefix, or null to drop}; the longest matching prefix decides, keys matching
    none stay as they are. E.g. {"head.": null} keeps the encoder, {"backbone.": "encoder."} renames."""
    out = {}
    for name, tensor in state.items():
        prefix = max((p for p in mapping if name.startswith(p)), key=len, default=None)
        if prefix is None:
            out[name] = tensor
        elif (new := mapping[prefix]) is not None:
            out[new + name[len(prefix) :]] = tensor
    return out


def _keys(keys: list[str]) -> str:
    return ", ".join(keys[:4]) + (f" ... ({len(keys)})" if len(keys) > 4 else "")


def tied_keys(model: torch.nn.Module) -> list[list[str]]:
    """The state_dict keys that name one tensor, in groups of 2 or more (GPT's wte.weight and lm_head.weight):
    loading either key loads all of them."""
    groups: dict[tuple, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if tensor.numel():  # empty tensors may share a null storage without being one tensor
            view = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor.shape, tensor.stride())
            groups.setdefault(view, []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def _refuse_half_ties(model: torch.nn.Module, ties: list[list[str]], excluded: list[str]) -> None:
    """model.init.exclude of one side of a tie alone would keep nothing fresh: the other side loads the tensor."""
    for names in ties:
        if (out := [k for k in names if k in excluded]) and len(out) < len(names):
            kept = ", ".join(k for k in names if k not in excluded)
            raise ConfigError(
                f"model.init.exclude: {', '.join(out)} is tied to {kept} (one tensor of {type(model).__name__}): "
                "exclude both or neither"
            )


INIT_KEYS = ("from", "weights", "strict", "map", "exclude")


def check(init) -> None:
    """model.init's keys and values (the parent itself is read as the model is built: a resume never reads it)."""
    if init is None:
        return
    if not OmegaConf.is_dict(init):
        raise ConfigError(f"model.init must be a mapping of {', '.join(INIT_KEYS)}")
    if unknown := [k for k in init if k not in INIT_KEYS]:
        raise ConfigError(
            f"model.init.{unknown[0]} is not a setting of model.init; its settings: {', '.join(INIT_KEYS)}"
        )
    if OmegaConf.is_missing(init, "from"):
        raise ConfigError("model.init.from is required: a finished run's dir or a .pt file (model.init.from=<dir>)")
    if (weights := init.get("weights", "last")) not in WEIGHTS:
        raise ConfigError(f"model.init.weights={weights} is not one of: {', '.join(WEIGHTS)}")
    if not isinstance(init.get("strict", True), bool):
        raise ConfigError(f"model.init.strict={init.strict} must be true or false")
    mapping = init.get("map") or {}
    if not OmegaConf.is_dict(mapping) and not isinstance(mapping, dict):
        raise ConfigError("model.init.map must be a mapping {prefix: new prefix, or null to drop}")
    if bad := [k for k, v in mapping.items() if v is not None and not isinstance(v, str)]:
        raise ConfigError(f"model.init.map.{bad[0]}={mapping[bad[0]]} must be a prefix or null (drop)")
    exclude = init.get("exclude") or []
    if not (OmegaConf.is_list(exclude) or isinstance(exclude, list)) or not all(isinstance(g, str) for g in exclude):
        raise ConfigError("model.init.exclude must be a list of globs over the model's keys (e.g. [head.*])")


def load_into(model: torch.nn.Module, init: DictConfig, print0=print) -> Parent | None:
    """model.init: the parent's weights into `model` (built, not yet wrapped), or None when model.init.from is
    null. model.init.exclude: keys (globs, on both sides) left out: the model's keep their initialisation, said in
    one line. Shapes must fit, or the model's `adapt_init(name, parent_tensor)` returns the tensor in its own shape
    (None: it cannot; refused). Strict: every other key of the model loaded and every (mapped) key of the parent
    used, else the keys left at their initialisation and those not used are said in one line each. No key at all
    loaded is refused either way (a wrong map), and so is an exclude of every key. Tied keys (one tensor under two
    names: GPT's wte.weight, lm_head.weight) load together: excluding one side alone is refused, and a parent
    holding one side loads both."""
    if init is None or init.get("from") is None:
        return None
    parent = Parent.open(init["from"], init.get("weights", "last"))
    mapping = OmegaConf.to_container(init.map, resolve=True) if init.get("map") else {}
    assert isinstance(mapping, dict)
    state = remap(parent.state_dict(), {str(k): v for k, v in mapping.items()})
    own = model.state_dict()
    source = f"model.init.from={parent.run_dir or parent.weights_path}"
    globs = [str(g) for g in init.get("exclude") or []]
    if idle := [g for g in globs if not any(fnmatch.fnmatchcase(k, g) for k in [*own, *state])]:
        raise ConfigError(f"model.init.exclude=[{', '.join(idle)}] matches no key of the model ({_keys(list(own))})")
    excluded = [k for k in own if any(fnmatch.fnmatchcase(k, g) for g in globs)]
    if len(excluded) == len(own):
        raise ConfigError(
            f"model.init.exclude=[{', '.join(globs)}] excludes every key of the model: nothing to load "
            "(model.init.from=null starts it fresh)"
        )
    ties = tied_keys(model)
    _refuse_half_ties(model, ties, excluded)
    state = {k: v for k, v in state.items() if not any(fnmatch.fnmatchcase(k, g) for g in globs)}
    adapted = []
    if shaped := [k for k in state if k in own and state[k].shape != own[k].shape]:
        adapt = getattr(model, "adapt_init", None)
        if adapt is None:
            said = "; ".join(f"{k} {list(state[k].shape)} vs {list(own[k].shape)}" for k in shaped[:3])
            raise ConfigError(
                f"{source}: other shape than the model's: {said}{' ...' if len(shaped) > 3 else ''} "
                f"(model.init.exclude keeps the model's own; {type(model).__name__} has no adapt_init)"
            )
        for k in shaped:
            tensor = adapt(k, state[k])
            if tensor is None or tensor.shape != own[k].shape:
                raise ConfigError(
                    f"{source}: {type(model).__name__}.adapt_init: {k} {list(state[k].shape)} does not fit "
                    f"{list(own[k].shape)} (model.init.exclude=[{k}] keeps the model's own)"
                )
            adapted.append(f"{k} {list(state[k].shape)} -> {list(own[k].shape)}")
            state[k] = tensor
    own = {k: v for k, v in own.items() if k not in excluded}
    # a key the parent lacks is loaded all the same when a key tied to it is (a parent saved with each tensor once)
    through_tie = {k for names in ties if any(n in state for n in names) for k in names}
    missing = [k for k in own if k not in state and k not in through_tie]
    unused = [k for k in state if k not in own]
    if len(missing) == len(own):
        raise ConfigError(f"{source}: no key of the model is in it (model.init.map renames prefixes: {mapping})")
    if init.get("strict", True) and (missing or unused):
        what = "; ".join(f"{w} {_keys(keys)}" for w, keys in (("missing", missing), ("unused", unused)) if keys)
        raise ConfigError(
            f"{source} does not fit the model: {what} (model.init.map drops or renames prefixes, "
            "model.init.strict=false loads the keys that fit)"
        )
    model.load_state_dict(state, strict=False)
    print0(f"model.init: {len(own) - len(missing)} of {len(own) + len(excluded)} tensors from {parent.weights_path}")
    if excluded:
        print0(f"model.init: left at their initialisation (model.init.exclude): {_keys(excluded)}")
    if adapted:
        print0(f"model.init: adapted by {type(model).__name__}.adapt_init: {'; '.join(adapted)}")
    if missing:
        print0(f"model.init: left at their initialisation: {_keys(missing)}")
    if unused:
        print0(f"model.init: not used: {_keys(unused)}")
    return parent
