"""An exponential moving average of the weights (trainer.ema.decay): evaluated as val/*, written as
model_ema.pt, one more entry in every checkpoint.

Why it is built this way:
- The average lives where the parameters live: plain tensors in single/DDP mode (every rank holds the
  same parameters, so the same average), and under FSDP2 each rank's own shards: the average is a
  DTensor of the parameter's mesh and placements, updated on the local shards alone, with no
  communication. Elementwise, every rank computes what one process computes for its elements, so W
  ranks average like one process (to the rounding of the weights themselves), and DCP reshards the
  average with the model on another world size.
- train.py updates it only after an optimizer step that was taken (outcome == "step"): a skipped window
  (on_nonfinite=skip, an fp16 overflow) leaves no trace in it and is not counted.
- The decay warms up as timm's ModelEmaV3: min(decay, (1 + n) / (10 + n)) after n updates (0.1 at the
  first), so the average forgets the random initialisation within a few steps instead of over 1/(1-decay).
- Buffers (BatchNorm's running statistics, its integer batch counter) are copied, not averaged: they are
  running averages of the activations already, and an integer counter has no average.
- `applied(module)` copies the average into the parameters' own storage (under FSDP2 the shard storage
  its all-gather reads) and the live values back afterwards, bit for bit: training goes on as if
  nothing happened. It is the one call for evaluating or selecting "the weights the evaluation uses";
  with the EMA off it changes nothing. `full_state_dict(module)` saves them (a copy: in single/DDP mode a
  state_dict taken inside applied() is a view of storage that gets the live values back).
"""

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from trainkit.checkpoint import ShardedEntry, full_state_dict
from trainkit.dist import Dist
from trainkit.errors import ConfigError


def warmed_up(decay: float, updates: int) -> float:
    """The decay of the update after `updates` updates (timm's warm-up)."""
    return min(decay, (1 + updates) / (10 + updates))


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter: its local shard under FSDP2 (a view of the shard storage, not a
    copy); asked each time, since FSDP2 may re-point a parameter's local tensor (e.g. on a load)."""
    return t.to_local() if isinstance(t, DTensor) else t


def _copy(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    if targets:  # _foreach_copy_ refuses an empty list (a model without buffers)
        torch._foreach_copy_(targets, sources)


def _reshard(module: nn.Module) -> None:
    """FSDP2: drop the all-gathered parameters (no communication). The root keeps its own after an
    evaluation forward, and its next forward would use them instead of gathering the swapped shards."""
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


class EMA:
    """The average of `module`'s parameters (the unwrapped module; under FSDP2 its sharded DTensors)
    and a copy of its buffers. decay=None: off, every method a no-op (train.py calls them alike)."""

    def __init__(self, module: nn.Module, decay: float | None, d: Dist):
        if decay is not None and not (isinstance(decay, (int, float)) and 0 <= decay < 1):
            raise ConfigError(f"trainer.ema.decay={decay} must be null (off) or in [0, 1), e.g. 0.999")
        self.module, self.decay, self.d = module, decay, d
        self.enabled = decay is not None
        self.updates = 0  # n: the optimizer steps averaged so far
        names = dict(module.named_parameters()) if self.enabled else {}
        self.params = list(names.values())  # the live parameters, as the optimizer holds them
        self.buffers = list(module.buffers()) if self.enabled else []
        with torch.no_grad():  # a DTensor's clone is a DTensor of the same placements, its shard cloned
            self.average = {name: p.detach().clone() for name, p in names.items()}
            self.buffer_copy = {name: b.detach().clone() for name, b in module.named_buffers()} if self.enabled else {}

    def update(self) -> None:
        """After an optimizer step that was taken: average := lerp(average, weights, 1 - decay_n), on
        each rank's own elements; buffers copied. Off: returns before entering no_grad (~2.5 us a step)."""
        if self.enabled:
            self._update()

    @torch.no_grad()
    def _update(self) -> None:
        weight = 1.0 - warmed_up(self.decay, self.updates)  # type: ignore[arg-type]  # enabled: a float
        torch._foreach_lerp_([_local(a) for a in self.average.values()], [_local(p) for p in self.params], weight)
        _copy(list(self.buffer_copy.values()), self.buffers)
        self.updates += 1

    @contextlib.contextmanager
    def applied(self, module: nn.Module) -> Iterator[None]:
        """The average (and its buffers) in `module` for the body; the live values back after it, bit
        for bit. No communication (FSDP2: the forward inside gathers the swapped-in shards)."""
        if not self.enabled:
            yield
            return
        if module is not self.module:
            raise ValueError("EMA.applied: not the module this EMA averages")
        _reshard(module)
        live = [_local(p) for p in self.params] + self.buffers
        with torch.no_grad():
            saved = [t.clone() for t in live]
            _copy(live, [_local(a) for a in self.average.values()] + list(self.buffer_copy.values()))
        try:
            yield
        finally:
            _reshard(module)
            with torch.no_grad():
                _copy(live, saved)

    def measured_by(self, monitor: str | None) -> "EMA":
        """The weights `monitor` (checkpoint.monitor) measures, as an EMA for applied() and write_best:
        this one for val/* (the average), one that is off for val_raw/* (the live weights). The best
        checkpoint's weights, model_best.pt and the test pass are then the ones the best value measured."""
        live = self.enabled and monitor is not None and monitor.startswith("val_raw/")
        return EMA(self.module, None, self.d) if live else self

    def full_state_dict(self, module: nn.Module) -> dict:
        """The full, plain state_dict of the weights the evaluation uses (model.pt's keys): the average
        with its buffers (model_ema.pt), or with the EMA off the live weights. A copy, never the live
        storage. FSDP: every rank calls it; rank 0 gets it gathered, the others {}."""
        with self.applied(module):
            return {k: v.clone() for k, v in full_state_dict(module).items()}

    def state_dict(self) -> dict | None:
        """The checkpoint's "ema" entry: the average (DTensors under FSDP: through DCP, resharded on
        load), the buffers and n. None when off."""
        return self._state() if self.enabled else None

    def _state(self) -> dict:
        return {"updates": torch.tensor(self.updates), "params": self.average, "buffers": self.buffer_copy}

    def load_state_dict(self, state: dict | ShardedEntry | None) -> None:
        """A checkpoint's "ema" entry (None: it has none; a ShardedEntry: in its DCP shards). Without
        one the average starts from the current (resumed) weights; with the EMA off it is ignored."""
        if not self.enabled:
            if state is not None:
                self.d.print0(
                    "checkpoint.resume: the checkpoint's EMA of the weights is ignored (trainer.ema.decay=null)"
                )
            return
        if state is None:
            self.d.print0(
                "checkpoint.resume: the checkpoint holds no EMA of the weights; the average starts from the "
                "resumed weights (its decay warm-up again)"
            )
            with torch.no_grad():
                _copy([_local(a) for a in self.average.values()], [_local(p) for p in self.params])
                _copy(list(self.buffer_copy.values()), self.buffers)
            return
        if isinstance(state, ShardedEntry):  # DCP loads the shards into this run's DTensors, resharded
            state = state.load(self._state())
        with torch.no_grad():
            for mine, saved in ((self.average, state["params"]), (self.buffer_copy, state["buffers"])):
                if mine.keys() != saved.keys():
                    raise ConfigError("checkpoint.resume: the checkpoint's EMA does not fit the model")
                for name, tensor in mine.items():
                    if tensor is not saved[name]:  # a ShardedEntry loaded into these tensors in place
                        _local(tensor).copy_(_local(saved[name]))
        self.updates = int(state["updates"])
