"""Train a model: `python src/train.py`, `torchrun --nproc_per_node=N src/train.py parallel=ddp`
(or parallel=fsdp), sweeps with `python src/train.py -m accumulation.steps=1,2,4,8`. Config tree: conf/.

Reads top to bottom: the optimizer step (window_batches, bare_step, optimizer_step); train(): data, resume point,
model (a parent's weights, parameter groups by name), its step parts (trainkit/steps.py), what the run dir records
(trainkit/records.py), the loop (what comes after each step: trainkit/cadence.py), the end (weights, the test
pass); then the entry point (main, run).
"""

import functools
import math
import time
from pathlib import Path
from typing import Any, cast

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from trainkit import checkpoint, config, debug, dist, errors, heldout, launch, optim, parent, records, steps, stop
from trainkit import teacher as teachers
from trainkit.accumulate import sync_context, syncs_now
from trainkit.autobatch import AutoBatch
from trainkit.batch import to_device
from trainkit.cadence import Cadence
from trainkit.determinism import use_deterministic
from trainkit.evaluate import evaluate_averaged
from trainkit.halving import EvalBatches
from trainkit.loading import TrainWindows
from trainkit.loggers import make_logger
from trainkit.parallel import full_tensor, resolve_mode, unwrap
from trainkit.profile import Profiler
from trainkit.progress import Progress, done_line, headline
from trainkit.rng import seed_all, seed_step
from trainkit.search import pruning
from trainkit.selection import Selection, monitored
from trainkit.steps import StepParts
from trainkit.summary import announce, describe


def window_batches(s: StepParts, windows: TrainWindows, window: int, step: int) -> tuple[list, Any, Any]:
    """The window's micro-batches on this rank, its loss-bearing items (samples; tokens for a sequence task) over
    all ranks, and the scale that makes the summed gradients their mean; dropout's stream seeded for the step."""
    began = time.perf_counter()  # time/data_wait: the share of time the loop waits on the loader
    micro = windows.fetch(window)
    s.meter.data_wait += time.perf_counter() - began
    # Dropout draws from (seed, step, rank) alone, not from where batches were loaded (rule 15): no RNG state to resume
    seed_step(s.seed, step, s.d.rank, s.d.device)
    items: int | torch.Tensor = windows.samples[window]  # its real samples, all ranks
    if s.task.items_name:  # counted in the data (fetched first, so known before the first backward): one
        counts = sum(s.task.items(s.unpack(batch)[1]) for batch in micro)  # all-reduce of a number per step
        items = s.d.all_reduce_sum(counts.to(s.d.device, torch.float64, non_blocking=True))  # a GPU: no wait
    # The gradient: the mean over the window's items of all ranks (a short window's too); DDP and FSDP average: x W
    return micro, items, s.d.world_size / items


def bare_step(s: StepParts, windows: TrainWindows, window: int, step: int) -> None:
    """The optimizer step where nothing needs more than a plain loop's (one process, no fp16 loss scaling, no
    skipped windows, a fixed micro-batch, a loss per micro-batch: StepParts.bare): optimizer_step less the calls
    that do nothing there (what they cost a small model's step: docs/performance.md)."""
    micro, items, scale = window_batches(s, windows, window, step)
    losses = []
    for batch in micro:
        x, y = s.unpack(batch if windows.on_device else to_device(batch, s.d.device))
        with s.autocast():
            loss_sum = s.task.loss_sum(s.model(x), y)  # summed over the batch's items (loss_terms: [loss, *terms])
        ((loss_sum[0] if s.terms else loss_sum) * scale).backward()
        losses.append(loss_sum.detach())
    grad_norm = torch.nn.utils.clip_grad_norm_(s.parameters, s.max_norm)
    s.optimizer.step()
    s.scheduler.step()
    if s.ema.enabled:
        s.ema.update()
    s.optimizer.zero_grad(set_to_none=True)
    s.meter.add_step(grad_norm, windows.samples[window], items, losses=losses)


def optimizer_step(s: StepParts, windows: TrainWindows, window: int, step: int) -> None:
    """One optimizer step on the global window of up to K micro-batches per rank: forward and backward under the
    sync decision, clip, decide on every rank together, step; counted in the meter (its loss, norm, samples)."""
    while True:  # data.batch_size=auto: a window that ran out of memory runs again (auto.retry)
        micro, items, scale = window_batches(s, windows, window, step)
        s.guard.start_window()  # on_nonfinite=skip, auto: a dropped window must leave no trace
        if s.coupled is not None:  # the loss couples the global batch: gradient caching (trainkit/coupled.py)
            s.coupled.run(micro, scale, s.strategy)
        else:
            for k, batch in s.auto.micro_steps(micro):  # auto: up to this rank's out of memory
                batch = batch if windows.on_device else to_device(batch, s.d.device)  # in memory: there already
                x, y = s.unpack(batch)  # what the model gets, what the loss reads
                # no_sync wraps forward AND backward: DDP arms its all-reduce in forward. (FSDP:
                # set_requires_gradient_sync(False), the unsharded gradients accumulate locally.)
                with sync_context(s.model, syncs_now(s.strategy, k, len(micro))), s.auto.catching():
                    with s.autocast():
                        loss_sum = s.task.loss_sum(s.model(x), y)  # summed over the batch's items ([loss, *terms])
                    s.scaler.scale((loss_sum[0] if s.terms else loss_sum) * scale).backward()
                    s.meter.add_micro_step(loss_sum)
        if not s.auto.retry():  # all ranks together (one all-reduced flag): none ran out of memory
            break
        # Drop what the attempt touched; the same window (samples, draws) again at half the micro-batch, twice K
        s.optimizer.zero_grad(set_to_none=True)
        s.guard.put_back_buffers()
        s.meter.drop_window()
        windows.refit(window)
    s.scaler.unscale_(s.optimizer)  # clip true gradients, once, after the sync
    grad_norm = full_tensor(torch.nn.utils.clip_grad_norm_(s.parameters, s.max_norm))  # FSDP: a DTensor
    # All ranks decide together: a rank skipping alone would hang the others. Only skip and fp16 need it
    # before the step (a host sync); raise checks per row (guard.check).
    outcome = s.guard.decide(s.meter, grad_norm, step + 1)
    if outcome == "step":
        s.scaler.step(s.optimizer)
        s.scaler.update()
        s.scheduler.step()  # only when the optimizer stepped: the schedule counts real steps
        s.ema.update()  # so too the average: a skipped window leaves no trace in it
    else:
        s.guard.undo(outcome)  # skip: buffers as before the window; fp16 overflow: the scale backs off
    s.optimizer.zero_grad(set_to_none=True)
    s.meter.add_step(grad_norm, windows.samples[window], items, skipped=outcome != "step")


def train(cfg: DictConfig, d: dist.Dist, mode: str, run_dir: Path) -> float | None:
    seed_all(cfg.seed)  # the same initial weights on every rank

    # Data. Every mode shards the train split the way DistributedSampler does (one shard in single mode), so
    # step s trains on the same samples at any world size; the sampler's padding repeats never reach a forward.
    train_set, val_set, test_set = heldout.load(cfg.data, d)  # rank 0 prepares (downloads) first; test may be None
    auto = AutoBatch(cfg, d)  # micro-batch b and K; data.batch_size=auto: b = global / W, halved on out of memory
    # debug=limit, overfit, fast: fewer samples, taken in the data set's order before any sharding (any world size)
    global_batch = d.world_size * auto.batch_size * auto.K  # auto: b x K stays as b halves
    train_set, val_set, test_set = debug.splits(cfg.debug, (train_set, val_set, test_set), global_batch, d)

    windows = TrainWindows(train_set, d, cfg.data, cfg.seed, lambda: (auto.batch_size, auto.K))  # b, K: auto's
    # At the training micro-batch; auto: halved on its own out of memory too. FSDP: every rank runs as many forwards.
    eval_args = (cfg.data.num_workers, auto.enabled, mode == "fsdp")
    val_batches = EvalBatches(val_set, d, lambda: auto.batch_size, *eval_args)
    no_test = heldout.skipped(test_set, cfg.data.name, train_set)  # why no test pass (trainer.test), or None
    # The test pass's batches (at the end; auto: from val's fitting batch), each named set's beside (data.eval_sets)
    val_batches, test_batches = heldout.batches(cfg, d, val_batches, test_set, global_batch, eval_args)
    steps_per_epoch = windows.layout.epoch_steps(cfg.data.drop_last)  # refused where drop_last drops every sample
    total_steps = cfg.trainer.max_steps or cfg.trainer.epochs * steps_per_epoch
    epochs = math.ceil(total_steps / steps_per_epoch)
    profiler = Profiler(cfg.trainer.profile, total_steps, d, run_dir)  # trainer.profile.steps: null, or in the run

    # Resume: everything the uninterrupted run would have had, down to every rank's RNG state (FSDP: DCP's shards)
    checkpointer = checkpoint.Checkpointer.of(cfg, run_dir, d, mode)  # checkpoint.async: DCP's async_save, in a thread
    resumed = checkpointer.load(cfg.checkpoint.resume)

    # Model, wrapped for the parallel mode; the optimizer is built on the wrapped (for FSDP: sharded) parameters.
    # What is learned: the loss of a batch's items, the evaluation sums; task.teacher: a frozen run beside the model
    # (a resume reads its copy in the run dir; a teacher of other data than cfg.data is refused here)
    task, teacher = teachers.build_task(cfg.task, run_dir, d.device, own=resumed is not None, data=cfg.data)
    net = parent.build_model(cfg, mode)  # cfg.model less model.init; fsdp: maybe on meta, loaded in wrap
    # model.init.from: a finished run's weights, before wrapping; not on a resume (its checkpoint holds the weights)
    chained = parent.load_into(net, cfg.model.get("init"), d.print0) if resumed is None else None
    groups = optim.plan(cfg.optim, net)  # by name, on the unwrapped model: carried to DDP's and FSDP's by name
    groups.freeze(net)  # before wrapping: DDP's buckets and FSDP's reduce-scatters hold only the trainable ones
    # Parameters, size, FLOPs per sample (per token): rank 0 prints them; rows gain mem/peak_gb (and mfu on a GPU)
    efficiency = describe(net, train_set, task, d, cfg.trainer.precision, beside={"teacher": teacher})
    parts = steps.build(cfg, d, mode, net, task, auto, total_steps, groups)  # the wrapped model, its optimizer, ...
    model, meter, ema, autocast = parts.model, parts.meter, parts.ema, parts.autocast
    step_once = bare_step if parts.bare else optimizer_step
    # The best evaluation (checkpoints/best) and early stopping: every rank decides alike from all-reduced metrics.
    monitor, direction = monitored(cfg.checkpoint.monitor, cfg.checkpoint.mode, task, ema.enabled, cfg.data.eval_sets)
    selected = ema.measured_by(monitor)  # what checkpoints/best and the test pass evaluate: val_raw/* the live weights
    early = cfg.trainer.early_stopping
    selection = Selection(monitor, direction, early.patience, early.min_delta, len(val_set) > 0, d)
    trial = pruning.Trial.of_job(selection.monitor, d)  # a study's trial with a pruner (hparams_search=), else None
    identity = checkpoint.run_identity(cfg, windows.layout.global_batch, train_set)  # what a resume must not change
    settings = checkpoint.run_settings(cfg)  # what a resume may change
    checkpointer.claim(run_dir, resumed)  # one run per run dir: never a mix of two
    start = checkpoint.resume(
        resumed, parts, checkpointer, selection, val_batches, windows, identity, settings, total_steps
    )
    if start is None:  # a run that stopped early, or is past this run's steps: nothing to train
        return selection.best  # None without a monitor
    records.write_start(cfg, run_dir, d, train_set, chained, teacher, resumed)  # only now: a refused run writes none
    announce(cfg, d, mode, (train_set, val_set, test_set), windows, total_steps, run_dir, no_test)  # rank 0's lines
    evaluation = functools.partial(evaluate_averaged, unwrap(model), ema, val_batches, d, autocast, task)

    step, val, stopping, pruned = start["step"], {}, None, False
    meter.start_clock()  # throughput counts training only, not start-up, evaluation or checkpoints
    with (
        make_logger(run_dir, cfg, d.is_main, resumed) as logger,
        Progress(d.is_main, total_steps, step, headline(task)) as console,
        stop.Stopper(cfg.trainer.max_time, d, cfg.parallel.timeout_s) as stopper,  # SIGTERM, SIGUSR1, max_time: a flag
        debug.anomaly(cfg.debug.anomaly, d),  # debug=anomaly: the backward function that returned NaN, named
        profiler.over(step),  # trainer.profile.steps: torch.profiler over those optimizer steps, every rank
        checkpointer,  # checkpoint.async: whatever ends the run, the write in flight completes first
    ):
        logger.summary(efficiency.facts)  # summary.json and the logger backend's summary
        kept = identity, settings, logger.run, selection, val_batches  # what a checkpoint holds beside the step's parts
        # The steps after which there is more to do than train; every step while these need it
        busy = console.bar is not None or profiler.steps is not None or stopper.counts
        every = cfg.trainer.log_every, cfg.trainer.eval_every if len(val_set) else 0, cfg.checkpoint.every
        cadence = Cadence(total_steps, *every, stopper, each_step=busy, start=step)
        for epoch in range(start["epoch"], epochs):
            first_window = start["window"] if epoch == start["epoch"] else 0
            windows.epoch(epoch, first_window)  # set_epoch: a new permutation per epoch
            model.train()
            for window in range(first_window, steps_per_epoch):
                if step >= total_steps:
                    break
                lrs = [float(group["lr"]) for group in parts.optimizer.param_groups]  # before the schedule moves them
                try:
                    step_once(parts, windows, window, step)
                except errors.DataUnavailable as missing:  # all ranks at once (TrainWindows.fetch): keep what ran, stop
                    at = checkpoint.position(step, epoch, window, steps_per_epoch)
                    checkpointer.save(step, checkpoint.state_of(parts, at, *kept), last=True)  # async: written
                    raise missing.resumable(step) from None
                step += 1
                if (due := cadence.after(step)) is None:  # most steps: nothing more to do (early stopping and
                    continue  # pruning decide at evaluations)
                console.step(step)
                profiler.step()  # once per optimizer step (not per micro-batch): its steps are the rows'
                stopping = due.stop  # a signal or the time budget, on any rank: every rank checkpoints and stops
                if not due:
                    continue
                parts.guard.check(meter, step)  # on_nonfinite=raise: no row, evaluation or checkpoint sees a NaN
                row: dict[str, float] = {}
                best_now = False
                if due.evaluate:
                    with meter.paused():  # evaluation, rows and checkpoints are not training time (samples/s)
                        if val := evaluation():  # {}: nothing fit
                            best_now = selection.update(val, step)  # val is all-reduced: every rank decides alike
                            val |= selection.row()
                # Pruned (every rank together: one all-reduce) ends like early stopping: its row and checkpoint
                pruned = trial is not None and due.evaluate and bool(val) and trial.prunes(val, step)
                stopped_early = selection.stopped or pruned  # early stopping: its last row and checkpoint at this step
                due.save |= stopped_early
                if due.log or stopped_early:  # outside paused(): the row's throughput is training time's
                    row |= meter.row() | optim.lr_row(parts.optimizer, lrs) | windows.row(window + 1)
                    row |= efficiency.row(row["samples_per_s"])  # mem/peak_gb (max over ranks: an all-reduce), mfu
                    console.train_line(step, total_steps, epoch, row)
                with meter.paused():
                    if due.evaluate and val:
                        row |= val
                        console.val_line(step, total_steps, val)
                    if pruned and trial:
                        console.print(trial.line(step))
                    elif stopped_early:
                        console.print(f"stopped early at step {step}: {selection.stop_reason()}")
                    if row:
                        logger.log({"step": step, "epoch": epoch + (window + 1) / steps_per_epoch} | row)
                    if due.save or best_now:
                        at = checkpoint.position(step, epoch, window + 1, steps_per_epoch)  # the window after it
                        state = checkpoint.state_of(parts, at, *kept)
                        if due.save:  # a stop's: written before the run stops (checkpoint.async: waited for)
                            checkpointer.save(step, state, last=stopping is not None)
                        if best_now:  # checkpoints/best: outside the rotation, which never deletes it
                            checkpointer.save_best(state)
                    val_batches.check()  # auto: out of memory at an evaluation batch of 1 ends the run, its step kept
                if stopping or stopped_early:
                    break
            if stopping or selection.stopped or pruned:
                break

        if stopping:  # a signal or trainer.max_time: its checkpoint is written, no model.pt
            raise stopper.stopped(stopping, step)
        if not val and len(val_set):  # resumed from the final checkpoint: nothing left to train
            val = evaluation()
            val_batches.check()
        # model.pt (the last weights), model_ema.pt, model_best.pt; from here on the evaluated weights are the best's
        wrote = checkpointer.write_weights(unwrap(model), ema, selected, selection.best_step, run_dir)
        # trainer.test: the test split once, by the validation machinery, on the monitor's weights (best, else last)
        if test := heldout.test_pass(unwrap(model), selected, test_batches, d, autocast, task):
            logger.log({"step": step, "epoch": step / steps_per_epoch} | test)  # one row (a resume replaces it)
            console.print(heldout.line(test, shown=headline(task)))
        console.print(done_line(step, val, selection, test, wrote, headline(task)))  # done: N steps, val, best, test
    return selection.best if selection.monitor else val.get(getattr(task, "monitor", "val/loss"))


@hydra.main(config_path="../conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    hydra_cfg = cast(DictConfig, HydraConfig.get())  # a DictConfig at run time
    job = OmegaConf.select(hydra_cfg, "job.num", default=0)  # its number in a sweep; absent in a run
    return run(cfg, Path(hydra_cfg.runtime.output_dir), job, sweep=hydra_cfg.mode == RunMode.MULTIRUN)


def run(cfg: DictConfig, run_dir: Path, job: int = 0, sweep: bool = False) -> float | None:
    """Check the config, join the process group (or start the N workers that do), train. A known failure is one
    line from rank 0; a sweep's job records it in its dir and the sweep goes on (config.train_job)."""
    with config.train_job(run_dir, sweep, cfg.parallel.timeout_s):
        debug.configure(cfg)  # debug=<mode>: its settings over an experiment's (the command line's win)
        config.check(cfg)
        use_deterministic(cfg.trainer.deterministic)  # before any kernel runs (cuBLAS reads its setting once)
        if launch.wanted(cfg):  # parallel.nproc_per_node=N, no launcher: N workers run this job, as torchrun's would
            return launch.start(cfg, run_dir, job, run)
        # Refused before the group: a rank that refused inside it left its peer's connect with "closed by peer"
        mode = resolve_mode(cfg.parallel.mode, dist.env_world_size(), dist.launched_distributed())
        d = dist.init(cfg.parallel.backend, cfg.trainer.device, cfg.parallel.timeout_s, job)
        objective = train(cfg, d, mode, run_dir)  # the best monitored value (else the last val/acc): a sweeper's
        dist.teardown(finished=True)  # before the interpreter exits, see teardown
        return objective
    return None  # a sweep's job that failed: recorded in its dir


if __name__ == "__main__":
    config.run_cli(main)
