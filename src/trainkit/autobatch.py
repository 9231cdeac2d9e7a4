"""data.batch_size=auto: the largest micro-batch that fits, found while training.

Start at global batch / W (K = 1). When a forward or backward runs out of memory on any rank,
every rank halves the micro-batch and doubles K together and the same window runs again; the run
is then the one that used the found micro-batch from the start (windows are (W, K, b)-invariant,
dropout draws depend on (seed, step, rank) alone).

The ranks agree through an all-reduce of a flag where no rank can be inside another collective: at
the end of the forward before a syncing backward (a hook on the unwrapped model, before DDP arms its
gradient sync) and, with K > 1, just before that forward too (DDP broadcasts BatchNorm's buffers as
it starts); a rank that already ran out of memory takes the flag in their place. One all-reduce per
window at K = 1, two at K > 1 (per micro-step with sync_each_batch): only with data.batch_size=auto.
A rank that runs out of memory in a syncing backward, after the others started syncing gradients,
cannot retry: it ends the run (the others see the collective fail, within parallel.timeout_s).
"""

import contextlib

import torch
from omegaconf import DictConfig
from torch.nn.parallel import DistributedDataParallel as DDP

from trainkit import config
from trainkit.config import RankError, RunError
from trainkit.dist import Dist
from trainkit.parallel import unwrap


def out_of_memory(error: BaseException) -> bool:
    """A device's OutOfMemoryError, or the CPU allocator's "can't allocate memory"."""
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and "can't allocate memory" in str(error)
    )


class _PeerOutOfMemory(Exception):
    """Raised at the end of this rank's forward when another rank ran out of memory: the window is dropped."""


class AutoBatch:
    """The micro-batch b and K of a run; with data.batch_size=auto, the search for b.

    Use: `for k, batch in auto.micro_steps(micro)`, each micro-step's forward and backward in
    `with auto.catching():`, then `if auto.retry(): ...` (the same window with auto.batch_size)."""

    def __init__(self, cfg: DictConfig, d: Dist):
        self.d, self.enabled = d, cfg.data.batch_size == "auto"
        if not self.enabled:
            self.batch_size, self.K = cfg.data.batch_size, config.accumulation_steps(cfg, d.world_size)
            return
        self.per_rank = cfg.accumulation.global_batch_size // d.world_size  # config.check: it divides
        self.sync_each = cfg.accumulation.strategy == "sync_each_batch"  # every micro-step's backward syncs
        self.batch_size, self.K = self.per_rank, 1
        self.found = [self.batch_size]  # this search's micro-batches, for its one log line
        self.armed = self.failed = self.oom = False
        self.agreed: bool | None = None

    def attach(self, model: torch.nn.Module) -> None:
        """Take the agreement at the end of the wrapped `model`'s inner (unwrapped) forward, when armed."""
        if self.enabled:
            self.ddp = model if isinstance(model, DDP) else None
            unwrap(model).register_forward_hook(self._hook)

    def micro_steps(self, micro: list):
        """(k, batch) of the window's micro-batches, until a rank runs out of memory. The forward
        before a syncing backward (the last; with sync_each_batch each) takes the ranks' agreement
        in its hook; a rank that stopped early takes it here, in its place."""
        if not self.enabled:
            yield from enumerate(micro)
            return
        self.failed = self.oom = False
        for k, batch in enumerate(micro):
            if self.failed or self.oom:
                break
            syncing = self.sync_each or k == len(micro) - 1
            if syncing and k > 0:  # also before it: DDP broadcasts buffers (BatchNorm's) as that forward starts,
                self._agree(False)  # where a rank that already stopped could not join
                if self.oom:
                    break
            self.armed, self.agreed = syncing, None
            yield k, batch
        self.armed = False
        if self.agreed is None:  # this rank stopped before the forward that takes it
            self._agree(self.failed)

    def _agree(self, failed: bool) -> None:
        self.oom = self.d.any(failed)  # the one all-reduce: every rank takes the same branch
        self.agreed = True

    def _hook(self, module, args, output):
        if self.armed:
            self.armed = False
            self._agree(False)
            if self.oom:  # another rank ran out of memory: end this forward before DDP arms its sync
                raise _PeerOutOfMemory

    @contextlib.contextmanager
    def catching(self):
        """A micro-step's forward and backward: running out of memory ends this rank's window."""
        if not self.enabled:
            yield
            return
        try:
            yield
        except _PeerOutOfMemory:
            pass
        except Exception as error:
            if not out_of_memory(error):
                raise
            if self.agreed and self.d.distributed:
                raise RankError(
                    f"out of memory in the gradient-syncing backward at micro-batch {self.batch_size} "
                    "(data.batch_size=auto): the other ranks were already syncing, no retry is possible; "
                    f"set data.batch_size={max(1, self.batch_size // 2)}"
                ) from error
            self.failed = True
            if self.agreed:  # one process: nobody waits, retry after the last backward too
                self.oom = True
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def retry(self) -> bool:
        """After the window's micro-steps, on every rank: did any rank run out of memory? Then the
        micro-batch halves (the next divisor of global / W) and K doubles: run the window again."""
        if not self.enabled:
            return False
        if not self.oom:
            if len(self.found) > 1:  # the search is over: say it once
                Ks = " -> ".join(str(self.per_rank // b) for b in self.found)
                self.d.print0(f"micro-batch {' -> '.join(map(str, self.found))} (out of memory), K {Ks}")
                self.found = [self.batch_size]
            return False
        if self.batch_size == 1:
            raise RunError(
                "out of memory at micro-batch 1 (data.batch_size=auto): one sample does not fit; "
                "try a smaller model, trainer.precision=bf16 or activation checkpointing"
            )
        self._set(max(b for b in range(1, self.batch_size // 2 + 1) if self.per_rank % b == 0))
        self.found.append(self.batch_size)
        if self.ddp is not None:
            # DDP broadcasts its buffers at the start of the forward after a syncing one, a flag its
            # post-forward sets; a forward that raised never got there, and on some ranks only. As a
            # window's first forward does after the previous window's sync: broadcast, on every rank.
            self.ddp.require_forward_param_sync = True
        return True

    def _set(self, batch_size: int) -> None:
        self.batch_size, self.K = batch_size, self.per_rank // batch_size

    def state_dict(self) -> dict:
        return {"micro_batch": self.batch_size}

    def load_state_dict(self, state: dict | None) -> None:
        """Resume at the saved micro-batch (or the largest divisor of global / W below it: another
        world size), with no new search."""
        if self.enabled and state:
            fits = [b for b in range(1, self.per_rank + 1) if self.per_rank % b == 0 and b <= state["micro_batch"]]
            self._set(max(fits))
            self.found = [self.batch_size]
