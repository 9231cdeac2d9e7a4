"""Gradient accumulation: which samples form an optimizer step, which micro-step syncs, and the
loss normalisation that makes training world-size invariant."""

import contextlib
import functools
import math
from dataclasses import dataclass

import torch
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel as DDP

from trainkit.errors import ConfigError


@dataclass(frozen=True)
class EpochLayout:
    """How one epoch splits into optimizer steps ("windows") of up to K micro-batches per rank.

    DistributedSampler gives rank r the positions r, r+W, r+2W, ... of the epoch's permutation,
    padded to a multiple of W. Local micro-batch j of all ranks together therefore covers the
    global positions [j*b*W, (j+1)*b*W), and optimizer step s covers exactly [s*G, (s+1)*G) with
    G = W*K*b: the same samples for every (W, K, b) with the same product. Positions >= N are
    padding repeats: loading.TrainBatches leaves them out of the micro-batches. The last window of
    an epoch may be short (fewer micro-batches, fewer samples); `window_samples` counts its real
    samples so its gradient is their exact mean (Lightning and Accelerate divide it by K
    instead). drop_last drops that window.
    """

    num_samples: int
    world_size: int
    batch_size: int
    steps: int  # K

    @property
    def global_batch(self) -> int:
        return self.world_size * self.steps * self.batch_size

    @functools.cached_property  # computed once per layout (a frozen dataclass's __dict__): read every step
    def local_samples(self) -> int:
        return math.ceil(self.num_samples / self.world_size)

    @functools.cached_property
    def micro_batches(self) -> int:
        return math.ceil(self.local_samples / self.batch_size)

    def windows(self, drop_last: bool) -> int:
        """Optimizer steps per epoch."""
        if drop_last:
            return self.num_samples // self.global_batch
        return math.ceil(self.micro_batches / self.steps)

    def epoch_steps(self, drop_last: bool) -> int:
        """Optimizer steps per epoch; a one-line refusal where data.drop_last drops every sample."""
        if (steps := self.windows(drop_last)) == 0:
            raise ConfigError(
                f"data.drop_last=true drops every sample: the global batch {self.global_batch} "
                f"is larger than the {self.num_samples} training samples"
            )
        return steps

    def micro_steps(self, window: int) -> int:
        return min(self.steps, self.micro_batches - window * self.steps)

    def window_samples(self, window: int) -> int:
        """Real (non-padding) samples in the window, summed over all ranks."""
        start = window * self.steps * self.batch_size
        end = min(start + self.steps * self.batch_size, self.local_samples)
        return min(self.num_samples, end * self.world_size) - start * self.world_size


def syncs_now(strategy: str, micro_step: int, micro_steps: int) -> bool:
    """no_sync: only the window's last micro-step syncs; sync_each_batch: every one does."""
    return strategy == "sync_each_batch" or micro_step == micro_steps - 1


def sync_context(model: torch.nn.Module, sync: bool):
    """Skip the gradient sync (DDP's all-reduce, FSDP2's reduce-scatter) for this micro-step
    unless `sync`.

    Wrap forward AND backward: DDP arms its reducer in forward, so a backward-only no_sync()
    still all-reduces (tests/test_ddp.py shows it). A null context without DDP or FSDP.
    """
    if isinstance(model, FSDPModule):
        return _fsdp_sync(model, sync)
    if sync or not isinstance(model, DDP):
        return _NULL
    return model.no_sync()


_NULL = contextlib.nullcontext()  # reusable: one for every micro-step that syncs or has nothing to skip


@contextlib.contextmanager
def _fsdp_sync(model: FSDPModule, sync: bool):
    """FSDP2's no_sync: without gradient sync, each unit keeps its *unsharded* gradient and
    accumulates into it locally (a full gradient's memory until the window's last micro-step,
    which reduce-scatters the sum once); not the last backward, so FSDP does not finalise it.
    Both flags are back to True (FSDP's default) after the micro-step."""
    model.set_requires_gradient_sync(sync)
    model.set_is_last_backward(sync)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
        model.set_is_last_backward(True)
