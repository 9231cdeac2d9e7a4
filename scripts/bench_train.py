"""Training throughput: trainkit's loop (src/train.py's train()) against a plain PyTorch loop,
side by side in one process, on the same model, data, optimizer, clipping and precision.

    .venv/bin/python scripts/bench_train.py [--blocks 20] [--steps 400] [--warmup-blocks 1] [--clock cpu]
        [--threads 1] [--pin] [--verbose] [overrides ...]
    e.g. ... model=cnn data=fake trainer.precision=bf16      (on a GPU: trainer.device=cuda)
    ... +experiment=pydoc_gpt: the character GPT on CPython's documentation (task=lm)
    ... --compile model=cnn: also trainkit with trainer.compile=true (timed after its first half:
        compilation is left out)
    OMP_NUM_THREADS=1 torchrun --nproc_per_node=2 scripts/bench_train.py accumulation.steps=4
        (2-rank DDP: trainkit's loop against a plain DDP loop with the same no_sync accumulation)

A figure that holds on a shared machine: the two loops alternate in short blocks (--steps each,
plain first in even blocks, trainkit first in odd ones), each timed over the second half of its
block only (steady state: start-up, the first steps, the final evaluation and checkpoint are left
out), in one process with the same threads; the first --warmup-blocks pairs are run and dropped. The
figure is the median of the blocks' ratios, with their quartiles. Both loops are timed by the
process's CPU time by default (--clock cpu: time.process_time, for trainkit through its own meter,
whose samples_per_s then counts CPU seconds): on a 2-core machine shared with 5 other jobs (load
5-8) wall-clock blocks ranged 0.58-1.38 around the same median, CPU-time blocks 1.01-1.22, and five
runs of 20 blocks gave medians 1.07-1.10 on the default job. --clock wall is what a quiet machine
shows. One intra-op thread by default (--threads): on a shared machine, OpenMP threads that wait on
each other made single blocks 10x slower or faster (a range of 0.13-28.9 with 2 threads under load,
0.96-1.04 with one). With one thread per process and no loader workers, CPU time is the loop's own
work; under torchrun it leaves out the time a rank waits on the other's all-reduce.

trainkit's time is its last metrics row (log_every = steps / 2). What the ratio shows is what
trainkit adds per step: the sampler without padding, the per-sample seeds (for a data set that
draws only), the metrics sums and the exact loss normalisation; the plain loop's DataLoader (trainkit
indexes an in-memory data set itself) is why trainkit comes out ahead on the small models.
"""

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from train import train  # noqa: E402
from trainkit import config, dist, metrics, optim, schedules  # noqa: E402
from trainkit.precision import autocast_for  # noqa: E402

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
clock = time.perf_counter  # what both loops are timed by (--clock)


def plain_loop(cfg, d: dist.Dist, steps: int) -> float:
    """The loop a tutorial would write: shuffle, forward, mean loss, backward, clip, step, schedule;
    under torchrun DDP with DistributedSampler and no_sync() around the first K-1 micro-batches.
    The loss is the task's (classification: cross-entropy; lm: over the loss-bearing tokens), a mean
    per micro-batch / K as tutorials do."""
    torch.manual_seed(cfg.seed)
    train_set, *_ = instantiate(cfg.data.splits)  # (train, val, test)
    model = instantiate(cfg.model).to(d.device)
    if d.distributed:
        model = DDP(model, device_ids=[d.device.index] if d.device.type == "cuda" else None)
    optimizer = optim.build(cfg.optim, model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedules.multiplier(cfg.sched, steps))
    task = instantiate(cfg.task)
    sampler = DistributedSampler(train_set) if d.distributed else None
    loader = DataLoader(
        train_set, cfg.data.batch_size, shuffle=sampler is None, sampler=sampler, num_workers=cfg.data.num_workers
    )
    autocast = autocast_for(cfg.trainer.precision, d.device)
    max_norm = cfg.trainer.clip_grad_norm or math.inf
    K = config.accumulation_steps(cfg, d.world_size)
    batches, samples, started, epoch = iter(loader), 0, 0.0, 0
    for step in range(steps):
        if step == steps // 2:
            if d.device.type == "cuda":
                torch.cuda.synchronize()
            samples, started = 0, clock()
        for k in range(K):
            try:
                x, y = next(batches)
            except StopIteration:
                epoch += 1
                if sampler is not None:
                    sampler.set_epoch(epoch)
                batches = iter(loader)
                x, y = next(batches)
            x, y = x.to(d.device, non_blocking=True), y.to(d.device, non_blocking=True)
            with model.no_sync() if d.distributed and k < K - 1 else contextlib.nullcontext():
                with autocast():
                    loss = task.loss_sum(model(x), y) / (task.items(y) if task.items_name else len(y)) / K
                loss.backward()
            samples += len(y) * d.world_size
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    if d.device.type == "cuda":
        torch.cuda.synchronize()
    return samples / (clock() - started)


def trainkit_loop(cfg, d: dist.Dist, steps: int) -> float:
    """train() itself; its last row's samples/s (all ranks), read back from rank 0's metrics."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(d.gather_object(tmp)[0])  # rank 0's dir: it alone writes metrics.jsonl
        with metrics.timed_by(clock):
            train(cfg, d, "ddp" if d.distributed else "single", run_dir)
        rate = 0.0
        if d.is_main:
            rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            rate = [r for r in rows if "samples_per_s" in r][-1]["samples_per_s"]
        d.barrier()  # rank 0 reads before any rank's TemporaryDirectory goes
        return d.gather_object(rate)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=20, help="alternations of the two loops that count")
    parser.add_argument("--steps", type=int, default=400, help="optimizer steps per loop and block")
    parser.add_argument("--warmup-blocks", type=int, default=1, help="alternations run first and dropped")
    parser.add_argument("--compile", action="store_true", help="also trainkit with trainer.compile=true, once")
    parser.add_argument("--threads", type=int, default=1, help="torch's intra-op threads, for both loops (default 1)")
    parser.add_argument(
        "--clock", choices=["auto", *CLOCKS], default="auto", help="process CPU time or wall time; auto: cpu on a CPU"
    )
    parser.add_argument("--pin", action="store_true", help="each process on one core (rank r on core r)")
    parser.add_argument("--verbose", action="store_true", help="print every block's rates")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(
            "train",
            overrides=[
                f"trainer.max_steps={args.steps}",
                f"trainer.log_every={args.steps // 2}",
                f"trainer.eval_every={args.steps}",
                "checkpoint.every=0",
                *args.overrides,
            ],
        )
    torch.set_num_threads(args.threads)
    d = dist.init("auto", cfg.trainer.device)
    global clock
    args.clock = args.clock if args.clock != "auto" else "cpu" if d.device.type == "cpu" else "wall"
    clock = CLOCKS[args.clock]  # on a GPU the host's CPU time is not the step's time
    if args.pin:
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[d.local_rank % len(cores)]})
    d.print0(
        f"{cfg.model._target_} on {cfg.data.name}, batch {cfg.data.batch_size}, {cfg.trainer.precision}, "
        f"{d.device}, {torch.get_num_threads()} threads, {d.world_size} rank(s), "
        f"K={config.accumulation_steps(cfg, d.world_size)}; {args.warmup_blocks} + {args.blocks} blocks of "
        f"{args.steps} steps each, timed over their second half by {args.clock} time"
    )
    loops = {"plain": lambda: plain_loop(cfg, d, args.steps), "trainkit": lambda: trainkit_loop(cfg, d, args.steps)}
    rates: dict[str, list[float]] = {"plain": [], "trainkit": []}
    for block in range(args.warmup_blocks + args.blocks):
        for name in sorted(loops, reverse=block % 2 == 1):  # plain first, then trainkit first: drift cancels
            rate = loops[name]()
            if block >= args.warmup_blocks:
                rates[name].append(rate)
        if args.verbose and block >= args.warmup_blocks:
            d.print0(
                f"block {block}: plain {rates['plain'][-1]:.0f} trainkit {rates['trainkit'][-1]:.0f} "
                f"ratio {rates['trainkit'][-1] / rates['plain'][-1]:.3f}"
            )
    ratios = [ours / plain for ours, plain in zip(rates["trainkit"], rates["plain"], strict=True)]
    for name, values in rates.items():
        d.print0(
            f"{name:<12} {statistics.median(values):>10,.0f} samples/s of {args.clock} time "
            f"(median of {len(values)} blocks)"
        )
    low, _, high = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    d.print0(
        f"ratio trainkit / plain: {statistics.median(ratios):.3f} (median of {len(ratios)} blocks; "
        f"quartiles {low:.2f}-{high:.2f}, range {min(ratios):.2f}-{max(ratios):.2f})"
    )
    if args.compile:
        compiled = trainkit_loop(OmegaConf.merge(cfg, {"trainer": {"compile": True}}), d, args.steps)
        eager = statistics.median(rates["trainkit"])
        d.print0(f"trainkit, trainer.compile=true {compiled:>10,.0f} samples/s: {compiled / eager:.2f}x eager")
    dist.teardown(finished=True)


if __name__ == "__main__":
    main()
