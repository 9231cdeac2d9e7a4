"""A batch of any shape: a tensor pair, a tuple or list of any length, a dict, a named tuple or a dataclass of
tensors, nested. The engine moves, empties, cuts and joins batches through these functions and never reads a
field; the task says what the model gets and what its loss reads (`unpack`).

Written here rather than taken from torch.utils._pytree: that module is private, and a dataclass batch would
need registering with it first; the walk below is the few lines the engine needs."""

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils.data.dataloader import default_collate

from trainkit.errors import ConfigError


def leaves(batch: Any) -> list[torch.Tensor]:
    """The batch's tensors in a fixed order (fields in declaration order, dict keys in insertion order)."""
    found: list[torch.Tensor] = []

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        found.append(tensor)
        return tensor

    map_tensors(keep, batch)
    return found


def size(batch: Any) -> int:
    """How many samples a batch of any shape holds (not how many fields): its tensors' length along dim 0, the
    dimension `emptied` cuts and `joined` concatenates; 0 for a batch without a tensor."""
    found = leaves(batch)
    return len(found[0]) if found else 0


def map_tensors(fn: Callable[[torch.Tensor], Any], batch: Any) -> Any:
    """The batch with `fn` applied to each tensor, its structure (and anything not a tensor) kept."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    kind = type(batch)
    if kind is tuple or kind is list:  # the common (x, y) first (is_dataclass costs ~0.5 us); exact: not a named tuple
        return kind([map_tensors(fn, value) for value in batch])
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return dataclasses.replace(batch, **{f.name: map_tensors(fn, getattr(batch, f.name)) for f in _fields(batch)})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a named tuple
        return type(batch)(*(map_tensors(fn, value) for value in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(map_tensors(fn, value) for value in batch)
    if isinstance(batch, Mapping):
        return type(batch)({key: map_tensors(fn, value) for key, value in batch.items()})  # type: ignore[call-arg]
    return batch


def to_device(batch: Any, device: torch.device) -> Any:
    """The batch on `device`; a tensor already there is kept as it is (what `.to` returns, without its ~0.6 us)."""
    return map_tensors(lambda t: t if t.device == device else t.to(device, non_blocking=True), batch)


def emptied(batch: Any) -> Any:
    """The batch with no sample: every tensor cut to length 0 (shapes and dtypes kept). An empty micro-batch (a
    rank whose shard ended) or an FSDP evaluation's extra forward runs it: it adds nothing to any sum."""
    return map_tensors(lambda t: t[:0], batch)


def joined(batches: list) -> Any:
    """Batches of one structure concatenated sample-wise (predict's per-batch outputs and targets)."""
    stacks = iter([torch.cat(ts) for ts in zip(*(leaves(b) for b in batches), strict=True)])
    return map_tensors(lambda _: next(stacks), batches[0])


def collate(samples: list) -> Any:
    """torch's default_collate (tensors, numbers, tuples, named tuples, dicts, nested), and a dataclass's fields
    collated one by one into the same dataclass (default_collate refuses dataclasses)."""
    first = samples[0]
    if dataclasses.is_dataclass(first) and not isinstance(first, type):
        fields = {f.name: collate([getattr(sample, f.name) for sample in samples]) for f in _fields(first)}
        return dataclasses.replace(first, **fields)
    return default_collate(samples)


def unpacker(task) -> Callable[[Any], tuple[Any, Any]]:
    """batch -> (what the model gets, what the task's loss reads): the task's `unpack(batch)`, else a pair's two
    halves (x, y); a batch of another shape without `unpack` is refused in one line. Looked up once per run."""
    if (split := getattr(task, "unpack", None)) is not None:
        return split

    def pair(batch: Any) -> tuple[Any, Any]:
        is_pair = type(batch) in (tuple, list) or isinstance(batch, (tuple, list)) and not hasattr(batch, "_fields")
        if is_pair and len(batch) == 2:  # (a namedtuple is a record, not a pair)
            return batch[0], batch[1]
        raise ConfigError(
            f"task {type(task).__name__} gets batches of {type(batch).__name__} (not an (input, target) pair): "
            "give it an unpack(batch) that returns (what the model gets, what its loss reads)"
        )

    return pair


def unpack(task, batch: Any) -> tuple[Any, Any]:
    """unpacker(task)(batch)."""
    return unpacker(task)(batch)


def _fields(batch: Any) -> list:
    return [f for f in dataclasses.fields(batch) if f.init]
