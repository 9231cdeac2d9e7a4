"""SyncBatchNorm for every backend: torch's `nn.SyncBatchNorm` refuses CPU modules (gloo).

`SyncBatchNorm` normalises a training batch with the statistics of the *global* batch (the
concatenation of all ranks' batches in `process_group`), so W ranks x b samples behave like
one process with W*b samples: same output, same input gradient, same running statistics, and
local weight/bias gradients whose sum over ranks is the single-process gradient (DDP reduces
them like any other parameter gradient).

Communication, per layer and training micro-batch:
- forward: one all_gather of [count, mean, M2] per rank (1 + 2C numbers), merged with Chan's
  parallel-variance formula. Unlike sum/sum-of-squares this stays exact for large means
  (mean 1e4, std 1 in float32) and needs no agreed shift; unequal and empty per-rank batches
  are fine (a rank with 0 samples contributes count 0).
- backward: one all_reduce of [sum(dy), sum(dy * xhat)] (2C numbers), the two sums in the
  input gradient of batch norm.
- eval with running statistics: none (plain `F.batch_norm`). Without an initialised process
  group, or with world size 1, the layer is exactly `nn.BatchNorm*d`.

Gradient accumulation: statistics are per *micro-batch* across ranks, not per optimizer step
(a window of K micro-batches is K separate normalisations, as with plain BatchNorm and K
micro-batches). SyncBN communicates on every training forward and backward, also inside DDP's
`no_sync()` / FSDP2's `set_requires_gradient_sync(False)`: those skip the *gradient* sync,
not this one. Hence every rank must run the same number of micro-steps (a rank that runs an
extra forward hangs the others), which trainkit's accumulation loop guarantees.

`convert_sync_batchnorm` swaps the layers before wrapping (DDP/FSDP) and uses torch's
implementation for CUDA models, ours everywhere else.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.autograd.function import FunctionCtx, once_differentiable
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.lazy import LazyModuleMixin

ProcessGroup = dist.ProcessGroup | None


def _reduce_dims(x: Tensor) -> list[int]:
    """All dims but the channel dim 1: (N, C, *) -> [0, 2, 3, ...]."""
    return [0, *range(2, x.dim())]


def _per_channel(t: Tensor, ndim: int) -> Tensor:
    """(C,) -> (1, C, 1, ...) to broadcast against an ndim-dimensional input."""
    return t.view(1, -1, *([1] * (ndim - 2)))


class _SyncBatchNormFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: FunctionCtx,
        x: Tensor,
        weight: Tensor | None,
        bias: Tensor | None,
        running_mean: Tensor | None,
        running_var: Tensor | None,
        eps: float,
        momentum: float,
        group: ProcessGroup,
    ) -> Tensor:
        dims, ndim, channels = _reduce_dims(x), x.dim(), x.shape[1]
        # Half-precision inputs get float32 statistics, as in F.batch_norm; the few per-channel
        # numbers that travel and merge are float64 on CPU (exact counts, means kept to 1e-16).
        stat_dtype = torch.promote_types(x.dtype, torch.float32)
        acc_dtype = torch.float64 if x.device.type == "cpu" else stat_dtype
        count = x.numel() // channels

        # Local mean and M2 (sum of squared deviations) in two passes around a rough mean:
        # the sums of x - shift are small, so float32 keeps their digits even at mean 1e4.
        xs = x.to(stat_dtype)
        shift = xs.sum(dims) / max(count, 1)  # an empty rank: count 0, mean 0, M2 0
        centered = xs - _per_channel(shift, ndim)
        dev = centered.sum(dims).to(acc_dtype)
        local_mean = shift.to(acc_dtype) + dev / max(count, 1)
        local_m2 = (centered * centered).sum(dims).to(acc_dtype) - dev * dev / max(count, 1)

        # The one forward collective: every rank's [count, mean (C), M2 (C)].
        packed = torch.cat([local_mean.new_full((1,), count), local_mean, local_m2])
        gathered = [torch.empty_like(packed) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, packed, group=group)
        stats = torch.stack(gathered)
        counts, means, m2s = stats[:, :1], stats[:, 1 : channels + 1], stats[:, channels + 1 :]

        # Chan et al.: merge (n_r, mean_r, M2_r) without subtracting two large sums.
        total = counts.sum()
        if total.item() <= 1:  # every rank sees the same total, so every rank raises
            raise ValueError(
                "Expected more than 1 value per channel when training, "
                f"got {int(total.item())} across the process group"
            )
        mean = (counts * means).sum(0) / total
        m2 = m2s.sum(0) + (counts * (means - mean) ** 2).sum(0)
        invstd = torch.rsqrt(m2 / total + eps)  # normalise with the biased variance

        if running_mean is not None and running_var is not None:
            # ... but track the unbiased one, as BatchNorm does.
            running_mean.mul_(1 - momentum).add_(momentum * mean.to(running_mean.dtype))
            running_var.mul_(1 - momentum).add_(momentum * (m2 / (total - 1)).to(running_var.dtype))

        # xhat = (x - mean) * invstd, from `centered` so that no large numbers cancel; in place,
        # as `centered` is our own temporary (full-size allocations dominate the CPU time).
        offset = (mean - shift.to(acc_dtype)).to(stat_dtype)
        invstd = invstd.to(stat_dtype)
        xhat = centered.sub_(_per_channel(offset, ndim)).mul_(_per_channel(invstd, ndim))
        if weight is None:
            out = xhat.clone() if bias is None else xhat + _per_channel(bias.to(stat_dtype), ndim)
        elif bias is None:
            out = xhat * _per_channel(weight.to(stat_dtype), ndim)
        else:
            out = torch.addcmul(
                _per_channel(bias.to(stat_dtype), ndim), xhat, _per_channel(weight.to(stat_dtype), ndim)
            )

        ctx.save_for_backward(xhat, weight, invstd)  # type: ignore[arg-type]  # weight is None without affine
        ctx.total = total.to(stat_dtype)  # type: ignore[attr-defined]
        ctx.group = group  # type: ignore[attr-defined]
        ctx.x_dtype = x.dtype  # type: ignore[attr-defined]
        ctx.bias_dtype = None if bias is None else bias.dtype  # type: ignore[attr-defined]
        return out.to(x.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        xhat, weight, invstd = ctx.saved_tensors
        dims, ndim = _reduce_dims(xhat), xhat.dim()
        dy = grad_out.to(xhat.dtype)
        # Local sums: they are exactly bias.grad and weight.grad of this rank's samples.
        sum_dy = dy.sum(dims)
        sum_dy_xhat = (dy * xhat).sum(dims)

        grad_x = None
        if ctx.needs_input_grad[0]:
            # The one backward collective: every rank's dy reaches every rank's input through
            # the shared mean and variance.
            packed = torch.cat([sum_dy, sum_dy_xhat])
            dist.all_reduce(packed, group=ctx.group)
            mean_dy, mean_dy_xhat = (packed / ctx.total).chunk(2)
            scale = invstd if weight is None else invstd * weight.to(invstd.dtype)
            # grad_x = scale * (dy - mean(dy) - xhat * mean(dy * xhat)), one allocation.
            grad_x = dy - _per_channel(mean_dy, ndim)
            grad_x.addcmul_(xhat, _per_channel(-mean_dy_xhat, ndim))
            grad_x = grad_x.mul_(_per_channel(scale, ndim)).to(ctx.x_dtype)

        grad_weight = sum_dy_xhat.to(weight.dtype) if ctx.needs_input_grad[1] else None
        grad_bias = sum_dy.to(ctx.bias_dtype) if ctx.needs_input_grad[2] else None
        return grad_x, grad_weight, grad_bias, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """BatchNorm over (N, C, *) inputs whose training statistics span all ranks of
    `process_group` (default: the whole world). Same arguments and state_dict as
    `nn.BatchNorm*d`; see the module docstring for the communication it does."""

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: ProcessGroup = None,
        device: Any = None,
        dtype: Any = None,
        *,
        bias: bool = True,
    ) -> None:
        super().__init__(
            num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype, bias=bias
        )
        self.process_group = process_group

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def _synced(self) -> bool:
        return dist.is_available() and dist.is_initialized() and dist.get_world_size(self.process_group) > 1

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        use_batch_stats = self.training or self.running_mean is None
        if not use_batch_stats or not self._synced():
            return super().forward(input)  # plain BatchNorm: eval, or nobody to sync with

        # Momentum and num_batches_tracked exactly as _BatchNorm.forward does them.
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        update_running = self.training and self.track_running_stats
        return _SyncBatchNormFn.apply(
            input,
            self.weight,
            self.bias,
            self.running_mean if update_running else None,
            self.running_var if update_running else None,
            self.eps,
            factor,
            self.process_group,
        )


def _looks_like_batchnorm(module: nn.Module) -> bool:
    name = type(module).__name__
    return "BatchNorm" in name or "BN" in name


def convert_sync_batchnorm(module: nn.Module, process_group: ProcessGroup = None) -> tuple[nn.Module, list[str]]:
    """Replace every `_BatchNorm` layer (BatchNorm1d/2d/3d, subclasses) in `module` by a
    SyncBatchNorm sharing its parameters, buffers and settings; in place, except that a
    BatchNorm root is returned as a new object. CUDA models get torch's `nn.SyncBatchNorm`,
    everything else ours.

    Returns (module, skipped): `skipped` names the submodules that look like batch norms
    (class name contains "BatchNorm" or "BN") but are no `_BatchNorm`, or are uninitialised lazy
    ones; they are left alone so the caller can warn that they will not be synchronised.
    """
    skipped = [
        name
        for name, m in module.named_modules()
        if (_looks_like_batchnorm(m) and not isinstance(m, _BatchNorm))
        or (isinstance(m, _BatchNorm) and isinstance(m, LazyModuleMixin) and m.has_uninitialized_params())
    ]
    tensors = [*module.parameters(), *module.buffers()]
    if any(t.is_cuda for t in tensors):
        # torch's fused CUDA kernels; it skips the same custom modules (no _BatchNorm).
        return nn.SyncBatchNorm.convert_sync_batchnorm(module, process_group), skipped
    return _convert(module, process_group, set(skipped), ""), skipped


def _convert(module: nn.Module, group: ProcessGroup, skipped: set[str], name: str) -> nn.Module:
    out = module
    already_synced = isinstance(module, (SyncBatchNorm, nn.SyncBatchNorm))
    if isinstance(module, _BatchNorm) and not already_synced and name not in skipped:
        out = SyncBatchNorm(
            module.num_features,
            module.eps,
            module.momentum,
            module.affine,
            module.track_running_stats,
            group,
            bias=module.bias is not None,
        )
        # The same Parameter and buffer objects: values, device and dtype carry over, and
        # the state_dict keys stay those of nn.BatchNorm (model.pt loads into either).
        out.weight, out.bias = module.weight, module.bias
        out.running_mean, out.running_var = module.running_mean, module.running_var
        out.num_batches_tracked = module.num_batches_tracked
        out.training = module.training
    for child_name, child in module.named_children():
        qualified = f"{name}.{child_name}" if name else child_name
        out.add_module(child_name, _convert(child, group, skipped, qualified))
    return out


def batchnorm_caveat(model: nn.Module, world_size: int, steps: int) -> str | None:
    """The line a run says once at start where its BatchNorm layers normalise by a part of the global batch: each
    rank's micro-batch (world_size > 1 without SyncBN), each of the K micro-batches (steps > 1, SyncBN or not).
    Everything else trains what one process trains with the global batch; these statistics do not (a cnn on 2
    ranks ends 0.02-0.04 from one process, with parallel.sync_bn 1e-7). None where nothing differs: no BatchNorm
    in training mode (a frozen one held in eval normalises by its running statistics), or one rank and K = 1."""
    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, _BatchNorm) and m.training]
    if not layers:
        return None
    per_rank = world_size > 1 and not all(isinstance(m, (SyncBatchNorm, nn.SyncBatchNorm)) for _, m in layers)
    apart = [f"each of the {world_size} ranks' micro-batch"] if per_rank else []
    apart += [f"each of the {steps} micro-batches" + (" apart" if per_rank else "")] if steps > 1 else []
    if not apart:
        return None
    names = [name for name, _ in layers]
    return (
        f"note: BatchNorm ({', '.join(names[:4])}{' ...' if len(names) > 4 else ''}) normalises by the statistics of "
        f"{', and '.join(apart)}, not of the global batch: this run trains close to, not exactly, what one process "
        "trains with it"
        + ("; parallel.sync_bn=true computes them over the ranks" if per_rank else "")
        + ("; the micro-batches of a step stay apart (accumulation.steps=1 joins them)" if steps > 1 else "")
    )
