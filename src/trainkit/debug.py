"""debug=fast|overfit|limit|anomaly (conf/debug/): the run made small or watched, for finding a bug fast.

Why these pieces live here:
- A mode's settings (`debug.set`, e.g. trainer.max_steps=4) are applied over the composed config when the
  run starts (`configure`), not written as global keys in its yaml: `+experiment=...` is appended to the
  defaults list after every entry of conf/train.yaml, so an experiment's trainer.max_steps=2000 would win
  over debug=fast's. A key named on the command line (trainer.max_steps=10) still wins over the mode's.
- Fewer samples (`splits`) are taken from each split's own order before any sharding, so they are the
  same samples at any world size (rules 2, 3). They are evenly spaced over that order (index i * n // k),
  not its first k: a data set sorted by class (an image folder) or by length (addition's problems) would
  keep one class or one length in its first samples; for a shuffled split (digits) it is as good as any.
- debug=overfit trains one global batch G again and again: the train split becomes those G samples (one
  window per epoch, every rank its shard of them as usual, K accumulation as usual), and val and test are
  the same G samples, so val loss ~ train loss (in eval mode: no dropout, BatchNorm's running statistics).
- debug=anomaly (`anomaly`): torch's anomaly detection names the backward function that returned a NaN;
  trainkit says that as one line (a RankError: the rank that met it says it, the others see their
  collective fail) instead of a traceback.
The train split's size is in checkpoint.run_identity: a limited run does not resume a full one's checkpoint.
"""

import contextlib
import functools
import inspect
import math
import re
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import Dataset, Subset, TensorDataset

from trainkit.dist import Dist
from trainkit.errors import ConfigError, RankError
from trainkit.loading import InMemory, length

SPLITS = ("train", "val", "test")


def configure(cfg: DictConfig) -> None:
    """Check the debug section and apply its `set` over `cfg`, except the keys the command line names
    (Hydra's task overrides, `key=value`). What the command line kept is dropped from `set`, so a second
    call (in a worker that train.py started) applies the same values again."""
    section = cfg.debug
    for split in SPLITS:
        fraction = section.limit[split]
        if not 0 < fraction <= 1:
            raise ConfigError(f"debug.limit.{split}={fraction:g} must be a fraction in (0, 1]")
    if section.eval_batches is not None and section.eval_batches < 1:
        raise ConfigError(f"debug.eval_batches={section.eval_batches} must be null or a positive integer")
    named = {re.split(r"[=~]", override.lstrip("+~"), maxsplit=1)[0] for override in _command_line()}
    applied: dict[str, Any] = {}
    for key, value in _leaves(OmegaConf.to_container(section.set), ""):
        if any(key == name or key.startswith(name + ".") for name in named):
            continue
        if OmegaConf.select(cfg, key, default=KeyError) is KeyError:
            raise ConfigError(f"debug.set.{key}: {key} is not a setting")
        OmegaConf.update(cfg, key, value, merge=False)
        _nest(applied, key, value)
    section.set = applied


_CALLER: list[str] | None = None  # command_line's overrides, for a caller without @hydra.main


@contextlib.contextmanager
def command_line(overrides: Sequence[str]) -> Iterator[None]:
    """For a caller that composes the config itself (hydra.compose: the tests, a notebook): the
    overrides it composed with, so that its keys win over a mode's as on the command line."""
    global _CALLER
    before, _CALLER = _CALLER, list(overrides)
    try:
        yield
    finally:
        _CALLER = before


def _command_line() -> list[str]:
    """The run's command-line overrides: Hydra's task overrides under @hydra.main, else command_line's."""
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        return list(HydraConfig.get().overrides.task)
    return _CALLER or []


def _nest(node: dict, key: str, value: Any) -> None:
    *parents, last = key.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value


def _leaves(node: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    if isinstance(node, dict) and node:
        for key, value in node.items():
            yield from _leaves(value, f"{prefix}{key}.")
    elif prefix:
        yield prefix[:-1], node


def kept(num_samples: int, k: int) -> list[int]:
    """k of range(num_samples), evenly spaced (i * n // k: distinct, the first sample always among them)."""
    k = min(k, num_samples)
    return [i * num_samples // k for i in range(k)]


class Kept(Subset):
    """Samples of a data set (`kept`) that still answers for the data set's attributes (collate_fn,
    draws_random, a corpus's files and summary) and has its tensor form (data.on_device) for the kept samples: the
    form's rows at the kept positions; where the data set builds its micro-batches (`device_batches`), its whole form,
    each epoch's kept rows named to it (`rows`), the positions kept for what it draws from per-sample seeds, as the
    DataLoader path draws by them. Not taken by the kept positions from the whole set's rows: other samples."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("dataset", "indices"):  # unpickling: before they are set
            raise AttributeError(name)
        if name in ("epoch_order", "row"):  # the whole set's order and counts: a subset is in the engine's own order
            raise AttributeError(name)
        if name.startswith("device_"):
            return self._device_form(name)
        return getattr(self.dataset, name)

    @property
    def startup_name(self) -> str:
        """What the data path's line calls it (trainkit.loading.residency)."""
        rowless = " (its device_batches takes no rows)" if self._rowless() else ""
        return f"{type(self.dataset).__name__}'s subset kept by debug{rowless}"

    def _rowless(self) -> bool:
        build = getattr(self.dataset, "device_batches", None)
        return build is not None and "rows" not in inspect.signature(build).parameters

    def _device_form(self, name: str) -> Any:
        whole = getattr(self.dataset, name)  # AttributeError where the data set declares none
        if self._rowless():  # its micro-batches would take the whole set's rows by the kept positions
            raise AttributeError(name)
        if name == "device_batches":
            return functools.partial(_kept_batches, whole, self.indices)
        if hasattr(self.dataset, "device_batches"):  # device_tensors, device_bytes: the whole form's
            return whole
        if name == "device_tensors":
            return lambda: tuple(tensor[self.indices] for tensor in whole())
        if name == "device_bytes":  # rows of one size: the kept ones' share
            return lambda: whole() * len(self.indices) // length(self.dataset)
        return whole


def _kept_batches(build, indices: Sequence[int], tensors, order, batch_size, epoch, seed, rows=None):
    """`build` (the data set's device_batches) on the kept samples of `order`: their rows in the whole set."""
    kept = torch.as_tensor(indices)[order if rows is None else rows]  # rows: a subset's of a subset
    return build(tensors, order, batch_size, epoch, seed, rows=kept)


def take(dataset: Dataset, k: int) -> Dataset:
    """`k` evenly spaced samples of `dataset` (all of them: the data set itself). Plain tensors stay
    InMemory or a TensorDataset, of the kept rows (the train loader's fast path)."""
    n = length(dataset)
    if k >= n:
        return dataset
    indices = kept(n, k)
    if type(dataset) in (InMemory, TensorDataset):
        return type(dataset)(*(tensor[indices] for tensor in dataset.tensors))  # type: ignore[attr-defined]
    return Kept(dataset, indices)


def fraction(n: int, f: float) -> int:
    """ceil(f * n), with f * n's rounding (0.3 * 10 = 3.0000000000000004) not counted as a sample."""
    return math.ceil(round(f * n, 6))


def splits(section: DictConfig, sets: Sequence[Any], global_batch: int, d: Dist) -> tuple[Any, Any, Any]:
    """(train, val, test) as the debug section keeps them (test may be None); rank 0 says what was kept."""
    limited = any(section.limit[name] < 1 for name in SPLITS) or section.overfit or section.eval_batches is not None
    if not limited:
        return sets[0], sets[1], sets[2]
    full = [0 if s is None else length(s) for s in sets]
    limits = [section.limit[name] for name in SPLITS]
    out: list[Any] = [None if s is None else take(s, fraction(length(s), f)) for s, f in zip(sets, limits, strict=True)]
    if section.overfit:  # one global batch of the (limited) train split, and val and test are that batch too
        batch = take(out[0], global_batch)
        out = [batch, batch, None if sets[2] is None else batch]
    if section.eval_batches is not None:  # val and test: at most N global batches of samples
        out[1:] = [None if s is None else take(s, section.eval_batches * global_batch) for s in out[1:]]
    said = ", ".join(f"{length(s)}/{n} {name}" for s, n, name in zip(out, full, SPLITS, strict=True) if s is not None)
    said += " (evenly spaced in each split's order, the same at any world size)"
    if section.overfit:
        said = f"{length(out[0])}/{full[0]} train samples, one global batch, trained every step; val and test: it"
    settings = ", ".join(f"{k}={_said(v)}" for k, v in _leaves(OmegaConf.to_container(section.set), ""))
    d.print0(f"debug={section.mode or 'limit'}: {said}" + (f"; sets {settings}" if settings else ""))
    return out[0], out[1], out[2]


def held_out(section: DictConfig, val: Any, test: Any | None, global_batch: int) -> tuple[Any, Any | None]:
    """A named evaluation set's val and test (data.eval_sets) as the section keeps the run's: limit.val, limit.test,
    then at most eval_batches global batches (overfit keeps them as those leave them: not the trained batch)."""
    pairs = ((val, section.limit.val), (test, section.limit.test))
    kept = [None if s is None else take(s, fraction(length(s), f)) for s, f in pairs]
    if section.eval_batches is not None:
        kept = [None if s is None else take(s, section.eval_batches * global_batch) for s in kept]
    return kept[0], kept[1]


def _said(value: Any) -> str:
    return "null" if value is None else str(value)


NAN_IN_BACKWARD = re.compile(r"Function '(\w+)' returned nan values in its (\w+) output")


@contextlib.contextmanager
def anomaly(enabled: bool, d: Dist) -> Iterator[None]:
    """torch.autograd's anomaly detection for the loop (every rank): the first backward function that
    returns a NaN raises, named in one line. Slow (every backward node is checked, its forward's stack
    kept): said once."""
    if not enabled:
        yield
        return
    d.print0("debug=anomaly: autograd anomaly detection is on: slower (every backward function checked for NaN)")
    with torch.autograd.set_detect_anomaly(True):
        try:
            yield
        except RuntimeError as error:
            found = NAN_IN_BACKWARD.search(str(error))
            if found is None:
                raise
            raise RankError(
                f"debug=anomaly: the backward function {found[1]} returned NaN in its {found[2]} output "
                "(its forward call: the traceback anomaly mode printed above)"
            ) from error
