"""All wrapping in one place: wrap(model) for single / DDP, plus counting of gradient syncs."""
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from trainkit.config import ConfigError
from trainkit.dist import Dist
from trainkit.syncbn import convert_sync_batchnorm


def resolve_mode(mode: str, world_size: int, under_torchrun: bool) -> str:
    """auto: single without torchrun, ddp under it. An explicit single with W > 1 is refused:
    it would silently train W independent replicas."""
    if mode == "auto":
        return "ddp" if under_torchrun else "single"
    if mode == "single" and world_size > 1:
        raise ConfigError(f"parallel=single with world size {world_size} would train {world_size} "
                          "independent replicas; use parallel=ddp (or auto) under torchrun")
    if mode != "single" and not under_torchrun:
        raise ConfigError(f"parallel={mode} needs torchrun (e.g. torchrun --nproc_per_node=2 "
                          "src/train.py ...); use parallel=single or auto without it")
    return mode


@dataclass
class CommStats:
    """Gradient synchronisations and bytes reduced, counted where they happen (a comm hook)."""

    syncs: int = 0
    bytes: int = 0


def _counting_allreduce(stats: CommStats, bucket: torch.distributed.GradBucket):
    """DDP's default all-reduce (sum / world size), counted. One backward reduces several
    buckets; the last one closes a synchronisation."""
    buffer = bucket.buffer()
    stats.bytes += buffer.numel() * buffer.element_size()
    if bucket.is_last():
        stats.syncs += 1
    return default_hooks.allreduce_hook(None, bucket)


def wrap(model: nn.Module, mode: str, d: Dist, sync_bn: bool = False) -> tuple[nn.Module, CommStats]:
    """Move the model to its device, convert BatchNorm to SyncBN (before wrapping) and wrap it
    for `mode`; returns the counters of its gradient syncs."""
    stats = CommStats()
    model = model.to(d.device)
    if sync_bn:
        model, sync_bn = _sync_batchnorm(model, d)
    if mode == "ddp":
        # With SyncBN the running statistics are identical on every rank already: DDP's
        # broadcast of rank 0's buffers before every forward would only cost time.
        model = DDP(model, device_ids=[d.device.index] if d.device.type == "cuda" else None,
                    forward_sync_buffers=not sync_bn)
        model.register_comm_hook(stats, _counting_allreduce)
    return model, stats


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
    """The plain module (no `module.` prefix in its state_dict)."""
    return model.module if isinstance(model, DDP) else model
