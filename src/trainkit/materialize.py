"""Models too large for one rank: a model room builds the module on the meta device (shapes, no memory) when the
engine lets it (`deferring()`: parallel=fsdp) and sets `materialize_pending`; parallel.wrap shards it, then the
model's `materialize(device)` makes each rank's tensors and loads its shard of the weights (model=hf: from the
safetensors files, through torch.distributed.checkpoint's Hugging Face reader, which reads each rank's rows alone).
No rank ever holds the whole model. A room that does not defer builds as always; the engine reads only the hook."""

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

_deferring = False


@contextmanager
def deferred(on: bool) -> Iterator[None]:
    """While building the model: may its weights wait for parallel.wrap (on: parallel=fsdp without model.init,
    whose weights load into a whole model before wrapping)?"""
    global _deferring
    before, _deferring = _deferring, on
    try:
        yield
    finally:
        _deferring = before


def deferring() -> bool:
    """A model room asks: may I build on the meta device and load after sharding (my `materialize`)?"""
    return _deferring


def pending(model: nn.Module) -> bool:
    """Built on the meta device, its weights not yet loaded: the room set `materialize_pending` (not inferred from
    the tensors: a device that is no CPU may wear the meta label, tests/another_device.py's does)."""
    return bool(getattr(model, "materialize_pending", False))
