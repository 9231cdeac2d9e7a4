"""data.batch_size=auto: the largest micro-batch that fits, found while training.

Start at global batch / W (K = 1). When a forward or backward runs out of memory on any rank,
every rank halves the micro-batch and doubles K together and the same window runs again; the run
is then the one that used the found micro-batch from the start (windows are (W, K, b)-invariant,
dropout draws depend on (seed, step, rank) alone).

The ranks agree through an all-reduce of a flag at points where no rank can be inside another
collective; a rank that runs out of memory takes the next one in place of the others, so all learn
it at once. Where the points are:
- DDP: at the end of the forward before a syncing backward (a hook on the unwrapped model, before
  DDP arms its gradient sync) and, with K > 1, just before that forward too (DDP broadcasts
  BatchNorm's buffers as it starts): one or two tiny all-reduces a window, for the whole run. A rank
  that runs out of memory in the syncing backward, after the others started syncing gradients,
  cannot retry: it ends the run (the others see the collective fail, within parallel.timeout_s).
- Modules whose forward or backward run collectives (FSDP2's units all-gather and reduce-scatter,
  SyncBN layers all-reduce statistics): before each of those (forward pre-hook; gradient hooks on
  the outputs, before FSDP's pre-backward all-gather, and on the inputs, before its post-backward
  reduce-scatter) and before FSDP's end-of-backward callback. So under FSDP even an out-of-memory in
  the syncing backward is retried. That is a host sync per layer: only while searching, until two
  windows fit (the second after the optimizer allocated its state); an out-of-memory after the
  search ends the run with one error.

Evaluation and predict.py halve their own batch on out of memory, also all ranks together
(trainkit.halving); an evaluation batch does not change the training micro-batch.
"""

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
from omegaconf import DictConfig
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils._pytree import tree_leaves
from torch.utils.hooks import RemovableHandle

from trainkit import config
from trainkit.dist import Dist
from trainkit.errors import RankError, RunError, out_of_memory
from trainkit.parallel import unwrap
from trainkit.syncbn import SyncBatchNorm

SEARCH_WINDOWS = 2  # windows that must fit before a search with per-layer points ends
_NULL = contextlib.nullcontext()


class _PeerOutOfMemory(Exception):
    """Raised at an agreement point when another rank ran out of memory: the window is dropped."""


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
        self.fitted = 0  # windows that fitted
        self.agreeing = True  # the points are on (with per-layer points: while searching)
        self.armed = self.syncing = self.oom = self.agreed = self.end_queued = False
        self.ddp: DDP | None = None
        self.fsdp: FSDPModule | None = None
        self.layer_points: list[RemovableHandle] = []

    def attach(self, model: torch.nn.Module) -> None:
        """Place the agreement points on the wrapped `model` (see the module docstring)."""
        if not self.enabled:
            return
        inner = unwrap(model)
        self.ddp = model if isinstance(model, DDP) else None
        self.fsdp = model if isinstance(model, FSDPModule) else None
        if self.ddp is not None:
            inner.register_forward_hook(self._end_of_forward)
        if self.d.distributed:
            for module in inner.modules():
                if isinstance(module, (FSDPModule, SyncBatchNorm, torch.nn.SyncBatchNorm)):
                    self.layer_points += _points_around(module, self._point, self._before_backward)

    def micro_steps(self, micro: list) -> Iterator[tuple[int, Any]]:
        """(k, batch) of the window's micro-batches, until a rank runs out of memory."""
        return self._micro_steps(micro) if self.enabled else enumerate(micro)

    def _micro_steps(self, micro: list) -> Iterator[tuple[int, Any]]:
        self.oom = False
        for k, batch in enumerate(micro):
            self.syncing, self.agreed = self.sync_each or k == len(micro) - 1, False
            if self.agreeing and self.ddp is not None and self.syncing and k > 0:
                self._agree()  # DDP broadcasts buffers (BatchNorm's) as this forward starts: not alone
            if self.oom:
                break
            self.armed, self.end_queued = self.agreeing, False
            yield k, batch
            self.armed = False
            if self.oom:
                break

    def _agree(self, failed: bool = False) -> None:
        self.oom = self.d.any(failed)  # the one all-reduce: every rank takes the same branch

    def _point(self, *_) -> None:
        """An agreement point in a micro-step's forward or backward: raises on every rank when some
        rank ran out of memory before it."""
        if self.armed:
            self._agree()
            if self.oom:
                self.armed = False
                raise _PeerOutOfMemory

    def _end_of_forward(self, *_) -> None:  # DDP: the last point before its gradient sync
        if self.armed and self.syncing:
            self._point()
            self.agreed = True

    def _before_backward(self) -> None:
        """A point before a layer's backward; the first in a backward also queues the point before
        FSDP's end-of-backward callback (queued before FSDP queues it, so run before it)."""
        self._point()
        if self.armed and not self.end_queued:
            self.end_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._point()
        if self.fsdp is not None and self.syncing:
            self.agreed = True  # next: FSDP's reduce-scatters of the gradients not reduced yet

    def catching(self):
        """A micro-step's forward and backward: running out of memory ends this rank's window. Without
        data.batch_size=auto a reused null context (a generator per micro-step cost ~3 us)."""
        return self._catching() if self.enabled else _NULL

    @contextlib.contextmanager
    def _catching(self):
        try:
            yield
        except _PeerOutOfMemory:
            pass
        except Exception as error:
            if not out_of_memory(error):
                raise
            if self.d.distributed and (self.agreed or not self.agreeing):
                where = (
                    "in the gradient-syncing backward at micro-batch {b} (data.batch_size=auto)"
                    if self.agreed
                    else "at micro-batch {b} after the search (data.batch_size=auto with collectives in the layers "
                    f"retries only until {SEARCH_WINDOWS} windows fit)"
                ).format(b=self.batch_size)
                raise RankError(
                    f"out of memory {where}: the other ranks were already in a collective, no retry is possible; "
                    f"set data.batch_size={max(1, self.batch_size // 2)}"
                ) from error
            self.armed = False
            self._agree(failed=True)  # the point the others wait at, taken in their place
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def retry(self) -> bool:
        """After the window's micro-steps, on every rank: did any rank run out of memory? Then the
        micro-batch halves (the next divisor of global / W) and K doubles: run the window again."""
        if not self.enabled:
            return False
        if not self.oom:
            self._fitted()
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
        if self.fsdp is not None:
            self.fsdp.reset_iter_state()  # FSDP2's recovery from an aborted forward or backward
            _drop_unsharded_gradients(cast(torch.nn.Module, self.fsdp))
        return True

    def _fitted(self) -> None:
        self.fitted += 1
        if len(self.found) > 1:  # a search found a smaller micro-batch: say it once
            Ks = " -> ".join(str(self.per_rank // b) for b in self.found)
            self.d.print0(f"micro-batch {' -> '.join(map(str, self.found))} (out of memory), K {Ks}")
            self.found = [self.batch_size]
        if self.layer_points and self.fitted == SEARCH_WINDOWS:  # their host syncs cost too much to keep
            for handle in self.layer_points:
                handle.remove()
            self.layer_points, self.agreeing = [], False

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


def _points_around(module: torch.nn.Module, point: Callable, before_backward: Callable) -> list[RemovableHandle]:
    """Agreement points before each collective a module (FSDP unit, SyncBN layer) may run: before
    its forward (FSDP's pre-forward all-gathers); on its outputs' gradients (FSDP's pre-backward
    all-gathers, SyncBN's backward all-reduces); on its inputs' gradients (FSDP's post-backward
    reduce-scatters). Each registered where it runs before FSDP2's own hook of that place."""

    def on_inputs(module, args, kwargs) -> None:
        _on_gradients((args, kwargs), point)  # FSDP's pre-forward wrapped them: our hook runs first

    def on_outputs(module, args, output) -> None:
        _on_gradients(output, before_backward)  # before FSDP's post-forward registers its hooks

    return [
        module.register_forward_pre_hook(point, prepend=True),
        module.register_forward_pre_hook(on_inputs, with_kwargs=True),
        module.register_forward_hook(on_outputs, prepend=True),
    ]


def _on_gradients(tensors, hook: Callable) -> None:
    for t in tree_leaves(tensors):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            t.register_hook(lambda grad: hook())


def _drop_unsharded_gradients(model: torch.nn.Module) -> None:
    """The gradients a no_sync micro-step accumulated in FSDP2's unsharded parameters (which
    reset_iter_state leaves): the retried window starts from none."""
    for module in model.modules():
        if isinstance(module, FSDPModule) and (state := module._get_fsdp_state()):
            for group in state._fsdp_param_groups:
                for param in group.fsdp_params:
                    param.unsharded_accumulated_grad = None
                    if hasattr(param, "_unsharded_param"):
                        param._unsharded_param.grad = None
