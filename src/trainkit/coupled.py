"""Losses that couple a batch's items (a contrastive loss scores every item against every other), exact over
the global batch at any allocation (rule 20): gradient caching (Gao et al. 2021, "GradCache") across the
micro-batches, the outputs gathered across the ranks. A task declares `couples_batch = True`; its `loss_sum`
then gets the outputs and targets of the whole global window at once (all micro-batches of all ranks, in no
particular order: such a loss must not depend on the order of the items).

One window, K micro-batches on each of W ranks:
1. A graph-free forward per micro-batch (train mode): this rank's outputs, no activations kept. Before each,
   the RNG state is kept, so that pass 2 draws the same dropout masks; afterwards the buffers (BatchNorm's
   running statistics) are put back, so that only pass 2 updates them, once, as the usual loop does.
2. Every rank's outputs gathered: the global batch. Every rank computes the same loss_sum of it, times
   scale = W / items (train.py's), and its gradient with respect to every output, and keeps its own rows:
   a rank's backward reaches the parameters through its own outputs only, and DDP / FSDP average the W
   ranks' gradients, hence the W: the mean over ranks of W x (one rank's part) is the whole gradient.
3. Per micro-batch, the forward with graph and backward(gradient=its rows), under the usual loop's sync
   decision (no_sync for all but the last): one micro-batch's activations live at a time.

The cost: a second forward per micro-batch (about a third more compute than the usual loop's forward and
backward), and the outputs of the global batch (small: embeddings). BatchNorm's batch statistics are those
of a micro-batch (with parallel.sync_bn, of one micro-batch of every rank): exact only at K=1 (`note`);
LayerNorm and GroupNorm models are exact at any W x K x b.
"""

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parallel import DistributedDataParallel as DDP

from trainkit.accumulate import sync_context, syncs_now
from trainkit.batch import to_device, unpack
from trainkit.dist import Dist
from trainkit.inference import gather
from trainkit.syncbn import SyncBatchNorm


def couples(task) -> bool:
    """Does the task's loss couple a batch's items (its `couples_batch`)?"""
    return bool(getattr(task, "couples_batch", False))


def note(model: nn.Module, K: int, world_size: int) -> str | None:
    """The line to say once at start where BatchNorm makes a coupled loss inexact (else None): its batch
    statistics are a micro-batch's (and a rank's, without SyncBN), not the global batch's."""
    sync_bn = any(isinstance(m, (SyncBatchNorm, nn.SyncBatchNorm)) for m in model.modules())
    if not any(isinstance(m, _BatchNorm) for m in model.modules()) or (K == 1 and (sync_bn or world_size == 1)):
        return None
    per = "micro-batch" + ("" if sync_bn or world_size == 1 else " of each rank")
    return (
        f"note: the task's loss couples the global batch, but BatchNorm normalises each {per} by its own "
        "statistics: exact with parallel.sync_bn and K=1, or with LayerNorm / GroupNorm at any allocation"
    )


class CoupledWindows:
    """The gradient of one window for a coupled loss (module docstring). Use in place of the usual micro-step
    loop: `windows.run(micro, scale, strategy)`, then `auto.retry()` as after it."""

    def __init__(self, model: nn.Module, task, d: Dist, autocast, scaler, auto, meter):
        self.model, self.task, self.d, self.autocast, self.scaler, self.auto, self.meter = (
            model,
            task,
            d,
            autocast,
            scaler,
            auto,
            meter,
        )
        # DDP's forward outside its backward protocol would change its state (require_forward_param_sync): the
        # graph-free pass takes the plain module (no collective in it). FSDP2's module is the plain one.
        self.plain = model.module if isinstance(model, DDP) else model
        self.buffers = list(self.plain.buffers())
        self.terms = bool(getattr(task, "loss_terms", ()))  # loss_sum: [loss, *terms] (the task contract)
        if line := note(self.plain, auto.K, d.world_size):
            d.print0(line)

    def run(self, micro: list, scale: float | torch.Tensor, strategy: str) -> None:
        """Accumulate the window's exact gradient (times the scaler's scale) into the parameters' .grad."""
        inputs, outputs, states = [], [], []
        saved = [b.clone() for b in self.buffers]  # pass 1 must not move BatchNorm's running statistics
        for _, batch in self.auto.micro_steps(micro):  # auto: until a rank runs out of memory
            x, y = unpack(self.task, to_device(batch, self.d.device))
            states.append(_rng_state(self.d.device))  # pass 2 draws the same dropout masks
            with self.auto.catching(), torch.no_grad(), self.autocast():
                outputs.append(self.plain(x))
            inputs.append((x, y))
        for buffer, before in zip(self.buffers, saved, strict=True):
            buffer.copy_(before)
        if self.auto.enabled and self.auto.oom:  # every rank knows: auto.retry() runs the window again
            return
        grads = self._output_gradients(outputs, [y for _, y in inputs], scale)
        for k, batch in self.auto.micro_steps(inputs):
            x, _ = batch
            _set_rng_state(states[k], self.d.device)
            # no_sync wraps forward AND backward, as in the usual loop (DDP arms its all-reduce in forward)
            with sync_context(self.model, syncs_now(strategy, k, len(inputs))), self.auto.catching():
                with self.autocast():
                    output = self.model(x)
                output.backward(gradient=grads[k].to(output.dtype))

    def _output_gradients(self, outputs: list, targets: list, scale) -> list[torch.Tensor]:
        """d(scale x loss_sum of the global batch) / d(this rank's outputs), one tensor per micro-batch (times
        the scaler's scale). Every rank computes the same loss of the same gathered outputs."""
        local = torch.cat(outputs).float()  # the loss in float32 also under autocast
        sizes = [len(local)]  # every rank's rows, in rank order; one process: no host sync for them
        if self.d.distributed:  # (gather pads to the largest rank's rows: its shapes wait on the device anyway)
            sizes = gather(torch.tensor([len(local)], device=local.device), self.d).tolist()
        everyone = gather(local, self.d).requires_grad_()
        target = gather(torch.cat(targets), self.d)
        loss_sum = self.task.loss_sum(everyone, target)  # loss_terms: [loss, *terms], the loss first
        self.scaler.scale((loss_sum[0] if self.terms else loss_sum) * scale).backward()
        # The loss of the global batch, once (not once per rank) in the meter's all-reduced sums
        self.meter.add_micro_step(loss_sum if self.d.rank == 0 else loss_sum * 0)  # 0 x nan: a rank's nan still shows
        start = sum(sizes[: self.d.rank])
        assert everyone.grad is not None
        return list(everyone.grad[start : start + len(local)].split([len(o) for o in outputs]))


def _rng_state(device: torch.device) -> tuple:
    """The generators dropout draws from: torch's CPU one, and this device's on CUDA."""
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def _set_rng_state(state: tuple, device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)
