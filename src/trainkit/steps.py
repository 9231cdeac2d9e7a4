"""What an optimizer step works with (StepParts), built once by train() after the model: the model wrapped for
the parallel mode, the optimizer on its parameter groups (decided by name before wrapping, carried to the wrapped
and, under FSDP, sharded parameters by name), the schedule, loss scaler, guard, meter and the plain values the
step reads. The step itself is in src/train.py (bare_step, optimizer_step)."""

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig

from trainkit import optim
from trainkit.autobatch import AutoBatch
from trainkit.batch import unpacker
from trainkit.coupled import CoupledWindows, couples
from trainkit.dist import Dist
from trainkit.ema import EMA
from trainkit.guard import StepGuard
from trainkit.metrics import TrainMeter
from trainkit.parallel import WRAP_SETTINGS, unwrap, wrap
from trainkit.precision import autocast_for, use_tf32
from trainkit.rng import seed_all
from trainkit.syncbn import batchnorm_caveat


@dataclass(kw_only=True)  # by keyword only: a new field cannot silently shift the others
class StepParts:
    """What an optimizer step works with. Settings the step reads are plain values, read once from the config
    (an OmegaConf attribute read costs more than a small model's step can spare: docs/performance.md)."""

    model: torch.nn.Module  # wrapped for the parallel mode
    parameters: list[torch.nn.Parameter]  # its trainable parameters, listed once (clipping's norm)
    task: Any
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    guard: StepGuard
    meter: TrainMeter
    auto: AutoBatch
    coupled: CoupledWindows | None
    autocast: Callable
    ema: EMA
    d: Dist
    seed: int
    strategy: str  # accumulation.strategy: no_sync | sync_each_batch
    max_norm: float  # trainer.clip_grad_norm; inf: measure the norm, clip nothing
    unpack: Callable  # batch -> (what the model gets, what the loss reads): the task's, else a pair's halves
    bare: bool  # nothing needs more than a plain loop's step: train.bare_step
    terms: bool  # the task declares loss_terms: its loss_sum is [loss, *terms], the loss is its first

    @property
    def stateful(self) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any, Any, TrainMeter]:
        """What a checkpoint holds of them (trainkit/checkpoint.py: state, resume)."""
        return unwrap(self.model), self.optimizer, self.scheduler, self.scaler, self.meter


def build(
    cfg: DictConfig,
    d: Dist,
    mode: str,
    net: torch.nn.Module,
    task,
    auto: AutoBatch,
    total_steps: int,
    groups: optim.Plan,
) -> StepParts:
    """`net` wrapped for the parallel mode, the optimizer on its wrapped (for FSDP: sharded) parameters in the
    groups decided by name before wrapping, and what else an optimizer step works with."""
    # parallel.*: shard_units, reshard_after_forward (FSDP), bucket_cap_mb, comm_hook, static_graph (DDP), ...
    wrapping = {key: cfg.parallel[key] for key in WRAP_SETTINGS} | {"compile": cfg.trainer.compile}
    model, comm = wrap(net, mode, d, cfg.parallel.sync_bn, precision=cfg.trainer.precision, **wrapping)
    seed_all(cfg.seed + d.rank)  # from here on, dropout masks (and any other draws) differ between ranks
    groups.freeze(unwrap(model))  # again, by name: SyncBN and FSDP2 made new Parameter objects
    if held := groups.hold_batchnorm(unwrap(model)):  # frozen BatchNorm keeps its running statistics
        d.print0(f"optim.groups: frozen BatchNorm in eval mode (optim.frozen_batchnorm=train: not): {', '.join(held)}")
    if caveat := batchnorm_caveat(unwrap(model), d.world_size, auto.K):  # the one exception to W x K x b
        d.print0(caveat)
    optimizer = optim.build(cfg.optim, unwrap(model), groups, d.device)  # by name: FSDP's shards, DDP's own
    if groups.routing:  # optim=muon: which parameters Muon takes, which AdamW
        d.print0(groups.routing)
    ema = EMA(unwrap(model), cfg.trainer.ema.decay, d)  # an average of the weights (FSDP: its shards); null: off
    lr_at = optim.multiplier(cfg.sched, total_steps)
    if rises := optim.survey(cfg.sched, lr_at, total_steps):  # a value < 0 or not finite: refused here
        d.print0(rises)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    autocast = autocast_for(cfg.trainer.precision, d.device)
    use_tf32(cfg.trainer.tf32, d.device)  # fp32 matrix products on TF32 tensor cores (CUDA; default on)
    scaler = torch.amp.GradScaler(d.device.type, enabled=cfg.trainer.precision == "fp16")
    guard = StepGuard(unwrap(model), cfg.trainer.on_nonfinite, scaler, d, keep=auto.enabled)
    auto.attach(model)  # the ranks agree on out of memory at the end of a window's last forward
    meter = TrainMeter(d, comm, task.items_name, getattr(task, "loss_terms", ()))  # terms: rows' loss/<term>
    # A loss over the whole global batch (a contrastive one): exact by gradient caching (trainkit/coupled.py)
    coupled = CoupledWindows(model, task, d, autocast, scaler, auto, meter) if couples(task) else None
    return StepParts(
        model=model,
        parameters=[p for p in model.parameters() if p.requires_grad],  # the frozen ones have no gradient
        task=task,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=scaler,
        guard=guard,
        meter=meter,
        auto=auto,
        coupled=coupled,
        autocast=autocast,
        ema=ema,
        d=d,
        seed=cfg.seed,
        strategy=cfg.accumulation.strategy,
        max_norm=cfg.trainer.clip_grad_norm or math.inf,
        unpack=unpacker(task),
        # no sync to skip (one process), no fp16 scaling, no window to skip or run again, no batch-coupled loss
        bare=mode == "single" and not scaler.is_enabled() and guard.deferred and not auto.enabled and coupled is None,
        terms=bool(meter.terms),
    )
