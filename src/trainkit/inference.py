"""Distributed inference: each rank predicts its contiguous shard (loading.eval_loader), and
`gather` reassembles the per-rank results into dataset order, equal to a single-process run."""

import contextlib

import torch
import torch.distributed as dist

from trainkit.batch import emptied, joined, map_tensors, to_device, unpack
from trainkit.dist import Dist
from trainkit.halving import batches_of
from trainkit.loading import collate_fn


def gather(tensor: torch.Tensor, d: Dist) -> torch.Tensor:
    """Every rank's `tensor` concatenated along dim 0 in rank order, returned on every rank.

    Ranks may hold different numbers of rows (contiguous shards differ by one; with fewer
    samples than ranks some hold none). all_gather needs equal shapes on every backend (nccl
    too), so each rank pads to the largest shard and the padding is cut off again using the
    gathered shapes. An empty rank may pass any empty tensor of the right ndim and dtype (its
    trailing dims are taken from a non-empty rank). For contiguous shards, rank order is dataset
    order. Without a process group: `tensor` itself.
    """
    if not d.distributed:
        return tensor
    world = dist.get_world_size()
    shape = torch.tensor(tensor.shape, dtype=torch.long, device=tensor.device)
    shapes = [torch.empty_like(shape) for _ in range(world)]
    dist.all_gather(shapes, shape)
    sizes = [int(s[0]) for s in shapes]
    if max(sizes) == 0:  # nothing anywhere: skip the zero-size collective
        return tensor
    full_shape = shapes[sizes.index(max(sizes))].tolist()
    padded = tensor.new_zeros(full_shape)
    if len(tensor):  # an empty rank's trailing dims may differ (e.g. 0 x 0): nothing to copy
        padded[: len(tensor)] = tensor
    chunks = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(chunks, padded)
    return torch.cat([chunk[:size] for chunk, size in zip(chunks, sizes, strict=True)])


@torch.inference_mode()
def predict(
    model: torch.nn.Module, loader, d: Dist, autocast=contextlib.nullcontext, task=None
) -> dict[str, torch.Tensor]:
    """The model's outputs (floating point as float32) and the targets of the whole data set, in dataset
    order, on every rank (CPU tensors; `logits` and `targets`, each of the batches' structure). `loader`
    reads this rank's contiguous shard (loading.eval_loader); `model` is the plain module, equal on every rank
    (no DDP wrapper: shards differ in batch count); `task` says what of a batch the model gets (its
    `unpack`; without: (x, y) pairs). halving.EvalBatches as `loader`: a batch that ran out of memory runs
    again at half the size."""
    model.eval()
    outputs, targets = [], []
    batches = batches_of(loader)
    for batch in batches.over(model):
        x, y = unpack(task, to_device(batch, d.device))
        with batches.catching(), autocast():
            out = model(x)
        if batches.fits():  # all ranks together; else the same samples again, in smaller batches
            outputs.append(map_tensors(_float32, out))  # float32 whatever the autocast dtype: ranks must agree
            targets.append(y)
    batches.check()  # not even a batch of 1 fitted: every rank raises
    if not outputs:  # an empty shard (fewer samples than ranks) still joins every collective: shapes from no sample
        dataset = loader.dataset
        x, y = unpack(task, to_device(emptied(collate_fn(dataset)([dataset[0]])), d.device))
        with autocast():
            outputs, targets = [map_tensors(_float32, model(x))], [y]
    gathered = (map_tensors(lambda t: gather(t, d).cpu(), joined(part)) for part in (outputs, targets))
    return dict(zip(("logits", "targets"), gathered, strict=True))


def _float32(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.float() if tensor.is_floating_point() else tensor


@torch.inference_mode()
def generate(model: torch.nn.Module, loader, d: Dist, end: int, ignore: int, autocast=contextlib.nullcontext):
    """Greedy decoding of every sequence's answer, in dataset order, on every rank: a (N, L) long
    tensor of generated tokens, each row cut after its end token (-1 beyond).

    A row's prompt is its input up to the first loss-bearing target (targets are `ignore`
    before the answer). Rows of a batch are decoded together per prompt length (one forward per
    new token, the whole prefix each time: no cache, the models here are small), until every
    row has produced `end` or the model's block_size is full. `loader` reads this rank's
    contiguous shard; results are gathered like predict()'s (and batches halve like its)."""
    model.eval()
    limit = int(model.block_size)  # type: ignore[arg-type]  # sequence models carry their block_size
    rows = []
    batches = batches_of(loader)
    for x, y in batches.over(model):
        with batches.catching():
            out = _decode(model, x.to(d.device), y.to(d.device), limit, end, ignore, autocast)
        if batches.fits():  # all ranks together; else the same samples again, in smaller batches
            rows.append(out)
    batches.check()
    local = torch.cat(rows) if rows else torch.empty(0, limit, dtype=torch.long, device=d.device)
    return gather(local, d).cpu()


def _decode(model, x, y, limit: int, end: int, ignore: int, autocast) -> torch.Tensor:
    """generate()'s tokens for one batch."""
    prompt_lengths = (y != ignore).int().argmax(dim=1) + 1
    out = torch.full((len(x), limit), -1, dtype=torch.long, device=x.device)
    for length in prompt_lengths.unique().tolist():
        group = (prompt_lengths == length).nonzero().squeeze(1)
        tokens, done = x[group, :length], torch.zeros(len(group), dtype=torch.bool, device=x.device)
        for step in range(limit - length):
            with autocast():
                following = model(tokens)[:, -1].argmax(dim=-1)
            out[group[~done], step] = following[~done]
            done |= following == end
            if done.all():
                break
            tokens = torch.cat([tokens, following[:, None]], dim=1)
    return out
