"""Evaluation: every validation sample counted exactly once, at any world size."""

import torch

from trainkit.dist import Dist
from trainkit.tasks import Classification


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader, d: Dist, autocast, task: Classification) -> dict[str, float]:
    """The task's loss and accuracy over the loader's contiguous shards (data.eval_loader), from
    all-reduced sums and counts, never a mean of per-rank means.

    Pass the unwrapped module: a DDP forward may run collectives, and the shards (hence the
    number of batches) may differ by one sample between ranks. (An FSDP forward always
    all-gathers: train.py pads its eval loader with empty batches, parallel.EqualBatches.)
    """
    # DDP broadcasts rank 0's buffers (BatchNorm running stats) at the start of each forward, so
    # each rank's own last forward left its copy different: evaluate with rank 0's, which
    # model.pt keeps. (A no-op in single mode; with SyncBN they are equal already.)
    for buffer in model.buffers():
        d.broadcast_from_main(buffer)
    return _evaluate(model, loader, d, autocast, task)


@torch.inference_mode()
def _evaluate(model, loader, d, autocast, task) -> dict[str, float]:
    was_training = model.training
    model.eval()
    sums = torch.zeros(task.eval_width, dtype=torch.float64, device=d.device)  # loss, correct, counts, ...
    for x, y in loader:
        x, y = x.to(d.device, non_blocking=True), y.to(d.device, non_blocking=True)
        with autocast():
            output = model(x)
        sums += task.eval_sums(x, output, y).to(d.device)
    model.train(was_training)
    return task.eval_metrics(d.all_reduce_sum(sums).tolist())
