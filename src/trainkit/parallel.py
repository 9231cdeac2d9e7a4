"""All wrapping in one place: wrap(model) for single / DDP / FSDP2, plus counting of gradient syncs."""

import itertools
import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from trainkit.batch import emptied
from trainkit.dist import Dist
from trainkit.errors import ConfigError
from trainkit.loading import shard_bounds
from trainkit.materialize import pending
from trainkit.syncbn import convert_sync_batchnorm


def resolve_mode(mode: str, world_size: int, under_torchrun: bool) -> str:
    """auto: single alone, ddp under a launcher (torchrun, submitit, parallel.nproc_per_node's workers);
    ddp and fsdp need one. An explicit single with W > 1 is refused: it would silently train W
    independent replicas."""
    if mode == "auto":
        return "ddp" if under_torchrun else "single"
    if mode == "single" and world_size > 1:
        raise ConfigError(
            f"parallel=single with world size {world_size} would train {world_size} "
            "independent replicas; use parallel=ddp (or auto, or fsdp)"
        )
    if mode != "single" and not under_torchrun:
        raise ConfigError(
            f"parallel={mode} needs several processes: parallel.nproc_per_node=N (or torchrun "
            "--nproc_per_node=N src/train.py ...); use parallel=single or auto for one"
        )
    return mode


@dataclass
class CommStats:
    """Gradient synchronisations and bytes reduced, counted where they happen (a DDP comm hook,
    FSDP2's post-reduce-scatter hook)."""

    syncs: int = 0
    bytes: int = 0
    round_open: bool = False  # FSDP: a backward has reduce-scattered, its round is counted


# parallel.comm_hook: torch's DDP hooks, and the dtype the gradients travel in (None: their own).
_HOOKS = {
    "none": (default_hooks.allreduce_hook, None),
    "fp16": (default_hooks.fp16_compress_hook, torch.float16),
    "bf16": (default_hooks.bf16_compress_hook, torch.bfloat16),
}


def _counting(state: tuple, bucket: torch.distributed.GradBucket):
    """A DDP comm hook (torch's all-reduce, or its fp16/bf16 compression: sum / world size),
    counted. One backward reduces several buckets; the last one closes a synchronisation."""
    stats, hook, wire = state
    buffer = bucket.buffer()
    stats.bytes += buffer.numel() * (wire.itemsize if wire is not None else buffer.element_size())
    if bucket.is_last():
        stats.syncs += 1
    return hook(None, bucket)  # None: the default group


REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # parallel.reduce_dtype (FSDP)


# wrap()'s keyword arguments that are parallel.* keys of the same name (train.py passes them through)
WRAP_SETTINGS = (
    "shard_units",
    "reshard_after_forward",
    "bucket_cap_mb",
    "comm_hook",
    "static_graph",
    "reduce_dtype",
    "replicate",
)


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def compile_mode(value: bool | str, mode: str) -> str | None:
    """trainer.compile as torch.compile's mode: false -> None (eager), true -> "default", or a mode by name.
    CUDA graphs (reduce-overhead, max-autotune) are refused under FSDP: its units gather their parameters
    into new memory at every forward, which a recorded graph cannot follow."""
    if value is False or value is None:
        return None
    name = "default" if value is True else value
    if name not in COMPILE_MODES:
        raise ConfigError(f"trainer.compile={value} is not one of: false, true, {', '.join(COMPILE_MODES)}")
    if mode == "fsdp" and name in ("reduce-overhead", "max-autotune"):
        raise ConfigError(
            f"trainer.compile={name} captures CUDA graphs, which FSDP's per-forward parameter gathering breaks; "
            "under parallel=fsdp use true, default or max-autotune-no-cudagraphs"
        )
    return name


def wrap(
    model: nn.Module,
    mode: str,
    d: Dist,
    sync_bn: bool = False,
    *,
    precision: str = "fp32",
    shard_units=None,
    reshard_after_forward: bool = True,
    bucket_cap_mb: float | None = None,
    comm_hook: str = "none",
    static_graph: bool = False,
    reduce_dtype: str = "fp32",
    replicate: int = 1,
    compile: bool | str = False,
) -> tuple[nn.Module, CommStats]:
    """Move the model to its device, convert BatchNorm to SyncBN (before wrapping) and wrap it
    for `mode`; returns the counters of its gradient syncs. DDP only: `bucket_cap_mb` (None:
    torch's default, 25), `comm_hook` (none, or fp16/bf16 compression) and `static_graph` (the
    same parameters get gradients every step: DDP skips searching the graph for unused ones).
    FSDP only: `shard_units`, `reshard_after_forward`, `reduce_dtype` (fp32 or bf16: the dtype
    gradients are reduce-scattered in), `precision` (bf16 on CUDA: bf16 parameters in forward and
    backward) and `replicate` (R > 1: HSDP, see fsdp_mesh). `compile`: torch.compile in place before
    wrapping (the state_dict keeps its names), the whole model; under FSDP each shard unit's forward,
    per unit as torchtitan does (FSDP2's hooks disable dynamo: a module compiled with its hooks ran
    eager, torch 2.14.1). A mode (compile_mode) goes to torch.compile: reduce-overhead captures the
    step's kernels in CUDA graphs (a GPU's launch cost is then one replay a graph; torch records one
    graph per batch shape, so an epoch's short last micro-batch costs one more recording)."""
    compiled = compile_mode(compile, mode)  # None: eager
    stats = CommStats()
    deferred = pending(model)  # built on the meta device (parallel=fsdp): sharded first, then its weights loaded
    model = model if deferred else model.to(d.device)
    if sync_bn:
        model, sync_bn = _sync_batchnorm(model, d)
    if compiled and mode != "fsdp":
        model.compile(mode=compiled)
    if mode == "ddp":
        # With SyncBN the running statistics are identical on every rank already: DDP's
        # broadcast of rank 0's buffers before every forward would only cost time.
        # gradient_as_bucket_view: .grad lives in DDP's all-reduce buckets, not in a second copy.
        model = DDP(
            model,
            device_ids=[d.device.index] if d.device.type == "cuda" else None,
            forward_sync_buffers=not sync_bn,
            gradient_as_bucket_view=True,
            bucket_cap_mb=bucket_cap_mb,  # None: torch's default (25 MiB)
            static_graph=static_graph,
        )
        model.register_comm_hook((stats, *_HOOKS[comm_hook]), _counting)
    elif mode == "fsdp":
        mesh = fsdp_mesh(d, replicate)
        policy = mixed_precision(precision, d.device, reduce_dtype)
        for unit in reversed(fsdp_units(model, shard_units)):  # innermost first, as FSDP2 requires
            if compiled:  # its forward alone: FSDP2's hooks around it stay eager (they disable dynamo)
                unit.forward = torch.compile(unit.forward, mode=compiled)
            _shard(model, unit, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
        _shard(model, model, mesh=mesh, mp_policy=policy)  # the root: every parameter left over
        _count_reduce_scatters(model, stats, d.world_size // replicate, replicated=replicate > 1)
    if deferred:  # each rank makes its own shards and loads them (trainkit/materialize.py)
        unwrap(model).materialize(d.device)  # type: ignore[operator]
    return model, stats


def fsdp_mesh(d: Dist, replicate: int = 1) -> DeviceMesh:
    """FSDP2's device mesh (on the current device: dist.init set it). replicate=1: 1-D, every rank
    holds 1/W. R > 1 (HSDP): (R, W/R), dims ("replicate", "shard"): ranks r*S .. r*S+S-1 (S = W/R)
    shard one copy of the model among themselves, and the R copies are replicas. torchrun numbers
    ranks node by node, so with R = the number of nodes the parameter all-gathers and gradient
    reduce-scatters stay inside a node; only the 1/S gradient shards are all-reduced across nodes."""
    if replicate < 1 or d.world_size % replicate:
        raise ConfigError(
            f"parallel.replicate={replicate} must divide the world size {d.world_size} (R replicas x W/R shards each)"
        )
    if replicate == 1:
        return init_device_mesh(d.device.type, (d.world_size,))
    return init_device_mesh(
        d.device.type, (replicate, d.world_size // replicate), mesh_dim_names=("replicate", "shard")
    )


def mixed_precision(precision: str, device: torch.device, reduce_dtype: str = "fp32") -> MixedPrecisionPolicy:
    """FSDP2's policy. bf16 on CUDA: all-gather and compute in bf16; reduce, accumulate (no_sync) and
    keep the sharded parameters the optimizer steps in fp32. Elsewhere autocast alone (train.py)."""
    return MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if precision == "bf16" and device.type == "cuda" else None,
        reduce_dtype=REDUCE_DTYPES[reduce_dtype],
    )


def fsdp_units(model: nn.Module, class_names=None) -> list[nn.Module]:
    """The submodules that get their own fully_shard (one all-gather / reduce-scatter each),
    outermost first. None: the classes the model names itself (its `shard_units`, e.g. GPT's
    Block), else each child that has parameters, looking inside containers without a forward of
    their own (ModuleList, ModuleDict: FSDP2 cannot shard those); children that share a parameter
    (tied weights) stay in the root. A list of class names (e.g. [BasicBlock]): every submodule of
    those classes; [] shards the root alone."""
    if class_names is None:
        class_names = getattr(model, "shard_units", None)
    if class_names is None:
        return _untied(model, list(_children_with_parameters(model)))
    names = set(class_names)
    units = [m for m in model.modules() if m is not model and type(m).__name__ in names]
    if missing := names - {type(m).__name__ for m in units}:
        present = sorted({type(m).__name__ for m in model.modules() if m is not model})
        raise ConfigError(
            f"parallel.shard_units: no submodule of class {', '.join(sorted(missing))} in "
            f"{type(model).__name__} (it has: {', '.join(present)})"
        )
    if container := next((m for m in units if not _has_forward(m)), None):
        inside = sorted({type(m).__name__ for m in container.children()})
        raise ConfigError(
            f"parallel.shard_units: {_name(model, container)} ({type(container).__name__}) cannot be sharded: "
            f"a container without a forward of its own; name the classes it holds ({', '.join(inside)})"
        )
    return units


def _has_forward(module: nn.Module) -> bool:
    return type(module).forward is not nn.Module.forward


def _children_with_parameters(module: nn.Module):
    """The default units: children with parameters; a container is replaced by its own."""
    for child in module.children():
        if not any(True for _ in child.parameters()):
            continue
        if _has_forward(child):
            yield child
        else:
            yield from _children_with_parameters(child)


def _untied(model: nn.Module, units: list[nn.Module]) -> list[nn.Module]:
    """`units` less those sharing a parameter with another (GPT's tied embedding and head): FSDP2
    refuses a parameter in two units; the root holds them instead."""
    owners: dict[int, set[int]] = {}
    for i, unit in enumerate(units):
        for p in unit.parameters():
            owners.setdefault(id(p), set()).add(i)
    shared = {i for held in owners.values() if len(held) > 1 for i in held}
    return [unit for i, unit in enumerate(units) if i not in shared]


def _name(model: nn.Module, module: nn.Module) -> str:
    return next(name for name, m in model.named_modules() if m is module)


def _shard(model: nn.Module, unit: nn.Module, **kwargs) -> None:
    """fully_shard, with its refusal (e.g. a tied parameter in two units) as one line naming the unit."""
    try:
        fully_shard(unit, **kwargs)
    except ValueError as error:
        what = f"{_name(model, unit)} ({type(unit).__name__})" if unit is not model else type(unit).__name__
        raise ConfigError(
            f"parallel=fsdp: cannot shard {what}: {str(error).splitlines()[0]} (parallel.shard_units chooses the units)"
        ) from None


def _count_reduce_scatters(model: nn.Module, stats: CommStats, shards: int, replicated: bool = False) -> None:
    """Count FSDP2's gradient reduce-scatters (and HSDP's all-reduces) where they happen.

    `FSDPModule.set_all_reduce_hook` (public API) runs the hook right after each unit's
    reduce-scatter, with this rank's shard of the reduced gradient: the unit reduced
    shard x S bytes (S = `shards`, the ranks sharing one copy: its full gradient, dim 0 padded to a
    multiple of S). HSDP (`replicated`): FSDP2 runs the hook after its all-reduce of that shard
    across the replicas (torch's foreach_reduce), so the round sent shard x S + shard bytes: a
    reduce-scatter and an all-reduce, one gradient sync. One backward
    reduce-scatters every unit; its first hook call opens a round (one gradient sync), which
    stays open until autograd's final callback of that backward (the mechanism DDP and FSDP
    use themselves). No hook call: nothing was reduced (set_requires_gradient_sync(False)).
    """

    def close_round():
        stats.round_open = False

    def hook(shard: torch.Tensor) -> None:
        stats.bytes += shard.numel() * shard.element_size() * (shards + replicated)
        if not stats.round_open:
            stats.round_open = True
            stats.syncs += 1
            torch.autograd.Variable._execution_engine.queue_callback(close_round)

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_all_reduce_hook(hook)


def _sync_batchnorm(model: nn.Module, d: Dist) -> tuple[nn.Module, bool]:
    """BatchNorm -> SyncBN (torch's on CUDA, trainkit's elsewhere); False when there is nothing
    to synchronise (one process)."""
    if d.world_size == 1:
        d.print0("parallel.sync_bn=true: one process, so BatchNorm stays as it is (nothing to sync)")
        return model, False
    model, skipped = convert_sync_batchnorm(model)
    if skipped:
        d.print0(f"warning: parallel.sync_bn: left alone, not torch BatchNorm subclasses: {', '.join(skipped)}")
    return model, True


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module (no `module.` prefix in its state_dict). FSDP2 shards a module in place:
    it is its own plain module (its parameters are DTensor shards)."""
    return model.module if isinstance(model, DDP) else model


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor: FSDP2's clip_grad_norm_ returns the global norm as a DTensor."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


class EqualBatches:
    """The eval loader for FSDP: this rank's batches, then empty batches until every rank has run
    as many forwards as the rank with the largest contiguous shard.

    Every FSDP forward all-gathers parameters, so a rank that ran one forward less would hang the
    others; contiguous shards differ by one sample, hence their batch counts by up to one. An
    empty batch adds nothing to the loss and accuracy sums, so evaluate() stays exact."""

    def __init__(self, loader, world_size: int):
        self.loader, self.dataset = loader, loader.dataset
        start, end = shard_bounds(len(self.dataset), world_size, 0)  # rank 0's shard is a largest one
        self.batches = math.ceil((end - start) / loader.batch_size)

    def __iter__(self):
        ran = 0
        for batch in self.loader:
            ran += 1
            yield batch
        if ran < self.batches:  # an empty batch of the right shape and dtype, from one real sample
            empty = emptied(self.loader.collate_fn([self.dataset[0]]))
            yield from itertools.repeat(empty, self.batches - ran)
