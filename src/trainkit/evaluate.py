"""Evaluation: every validation sample counted exactly once, at any world size."""

import torch

from trainkit.batch import to_device, unpack
from trainkit.dist import Dist
from trainkit.halving import EvalSets, batches_of


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader, d: Dist, autocast, task, prefix: str = "val") -> dict[str, float]:
    """The task's loss and accuracy over the loader's contiguous shards (loading.eval_loader), from
    all-reduced sums and counts, never a mean of per-rank means, named `<prefix>/<metric>`
    (val/loss, val/acc, test/acc, ...). `loader`: any iterable of batches,
    or halving.EvalBatches (data.batch_size=auto: a batch that ran out of memory runs again at half
    the size; {} when even a batch of 1 did not fit, see EvalBatches.check).

    Pass the unwrapped module: a DDP forward may run collectives, and the shards (hence the
    number of batches) may differ by one sample between ranks. (An FSDP forward always
    all-gathers: train.py's EvalBatches pad with empty batches, as parallel.EqualBatches does.)
    """
    # DDP broadcasts rank 0's buffers (BatchNorm running stats) at the start of each forward, so
    # each rank's own last forward left its copy different: evaluate with rank 0's, which
    # model.pt keeps. (A no-op in single mode; with SyncBN they are equal already.)
    for buffer in model.buffers():
        d.broadcast_from_main(buffer)
    # removeprefix: a task of one's own written before the test split named its metrics val/<name>
    return {
        f"{prefix}/{key.removeprefix('val/')}": value
        for key, value in _evaluate(model, loader, d, autocast, task).items()
    }


def evaluate_sets(model: torch.nn.Module, loader, d: Dist, autocast, task, prefix: str = "val") -> dict[str, float]:
    """`evaluate` of `loader` as `<prefix>/*`; of halving.EvalSets: its split's as `<prefix>/*` and each named
    set's (data.eval_sets) as `<prefix>/<name>/*`, each on its own contiguous shards. {} where one found that
    nothing fit (data.batch_size=auto; EvalSets.check raises it)."""
    parts = loader.prefixed(prefix) if isinstance(loader, EvalSets) else [(prefix, loader)]
    metrics: dict[str, float] = {}
    for name, batches in parts:
        if not (measured := evaluate(model, batches, d, autocast, task, name)):
            return {}
        metrics |= measured
    return metrics


def evaluate_averaged(model: torch.nn.Module, ema, loader, d: Dist, autocast, task) -> dict[str, float]:
    """The weights the evaluation uses as val/* (and val/<name>/*: evaluate_sets): with an EMA (trainkit.ema.EMA,
    trainer.ema.decay) its average, and then the live weights as val_raw/* (val_raw/<name>/*); without, the live
    weights as val/*."""
    with ema.applied(model):  # the live weights come back bit for bit
        metrics = evaluate_sets(model, loader, d, autocast, task)
    if metrics and ema.enabled:
        metrics |= evaluate_sets(model, loader, d, autocast, task, "val_raw")
    return metrics


@torch.no_grad()  # not inference_mode: FSDP2 reads the version counter of the parameters it gathers, which
# inference tensors lack (an FSDP run resumed at its last step evaluates before any training forward)
def _evaluate(model, loader, d, autocast, task) -> dict[str, float]:
    """The task's metrics ({"loss": ..., "acc": ...}; evaluate names them by the split)."""
    was_training = model.training
    model.eval()
    if (prepare := getattr(task, "prepare_eval", None)) is not None:  # e.g. a kNN evaluation's bank
        prepare(model, d, autocast)
    sums = torch.zeros(task.eval_width, dtype=torch.float64, device=d.device)  # loss, correct, counts, ...
    batches = batches_of(loader)
    for batch in batches.over(model):
        with batches.catching():  # auto: an out of memory drops this attempt at the batch
            x, y = unpack(task, to_device(batch, d.device))  # what the model gets, what the task reads
            with autocast():
                output = model(x)
            batch_sums = task.eval_sums(x, output, y).to(d.device)
        if batches.fits():  # all ranks together; else the same samples come again, in smaller batches
            sums += batch_sums
    model.train(was_training)
    if batches.failure:  # every rank alike: not even a batch of 1 fitted
        return {}
    return task.eval_metrics(d.all_reduce_sum(sums).tolist())
