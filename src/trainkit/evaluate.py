"""Evaluation: every validation sample counted exactly once, at any world size."""

import torch
import torch.nn.functional as F

from trainkit.dist import Dist


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader, d: Dist, autocast) -> dict[str, float]:
    """Loss and accuracy over the loader's contiguous shards (data.eval_loader), from
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
    return _evaluate(model, loader, d, autocast)


@torch.inference_mode()
def _evaluate(model, loader, d, autocast) -> dict[str, float]:
    was_training = model.training
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=d.device)
    correct = torch.zeros((), dtype=torch.float64, device=d.device)
    for x, y in loader:
        x, y = x.to(d.device, non_blocking=True), y.to(d.device, non_blocking=True)
        with autocast():
            logits = model(x)
        loss_sum += F.cross_entropy(logits.float(), y, reduction="sum")
        correct += (logits.argmax(dim=1) == y).sum()
    model.train(was_training)
    totals = d.all_reduce_sum(torch.stack([loss_sum, correct]))
    count = len(loader.dataset)
    return {"val/loss": totals[0].item() / count, "val/acc": totals[1].item() / count}
