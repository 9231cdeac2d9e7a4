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
whose samples_per_s then counts CPU seconds). Each loop reads that clock only where its timed span
starts and ends (trainkit's meter also around the evaluations, rows and checkpoints it leaves out):
time/data_wait's span, twice a step, stays on perf_counter, as in a real run, because process_time
is a system call (~0.8 us against 0.06) that would charge trainkit ~1.5 us a step that a run does
not pay (metrics.timed_by). On a 2-core machine shared with 5 other jobs (load
5-8) wall-clock blocks ranged 0.58-1.38 around the same median, CPU-time blocks 1.01-1.22, and five
runs of 20 blocks gave medians 1.07-1.10 on the default job. --clock wall is what a quiet machine
shows. One intra-op thread by default (--threads): on a shared machine, OpenMP threads that wait on
each other made single blocks 10x slower or faster (a range of 0.13-28.9 with 2 threads under load,
0.96-1.04 with one). With one thread per process and no loader workers, CPU time is the loop's own
work; under torchrun it leaves out the time a rank waits on the other's all-reduce.

--breakdown also times single steps of both loops (alternating blocks, each step's CPU time from one
zero_grad to the next, and from zero_grad to the model's forward: the loop's own Python before it) and
prints their quantiles: the quickest tenth of the steps moves little when the machine slows a block, the
block medians do; and the CPU time each hook train() calls costs per step.

trainkit's time is its last metrics row (log_every = steps / 2). What the ratio shows is what
trainkit adds per step: the sampler without padding, the per-sample seeds (for a data set that
draws only), the metrics sums and the exact loss normalisation; the plain loop's DataLoader (trainkit
indexes an in-memory data set itself) is why trainkit comes out ahead on the small models.
"""

import argparse
import contextlib
import io
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
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from train import train  # noqa: E402
from trainkit import config, dist, metrics, optim, schedules  # noqa: E402
from trainkit.precision import autocast_for  # noqa: E402

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
clock = time.perf_counter  # what both loops are timed by (--clock)


def conv1d(in_shape, num_classes: int, width: int = 32, depth: int = 2, dropout: float = 0.0) -> torch.nn.Module:
    """A small 1-D CNN over the flattened input (digits: 64 positions, one channel), the third benchmark
    model (a plain step of ~2 ms on one core): `model=mlp model._target_=__main__.conv1d` (mlp's keys)."""
    layers: list[torch.nn.Module] = [torch.nn.Flatten(), torch.nn.Unflatten(1, (1, math.prod(in_shape)))]
    channels = 1
    for _ in range(depth):
        layers += [torch.nn.Conv1d(channels, width, 5, padding=2), torch.nn.ReLU(), torch.nn.Dropout(dropout)]
        channels = width
    return torch.nn.Sequential(
        *layers, torch.nn.AdaptiveAvgPool1d(1), torch.nn.Flatten(), torch.nn.Linear(width, num_classes)
    )


def plain_loop(cfg, d: dist.Dist, steps: int) -> float:
    """The loop a tutorial would write: shuffle, forward, mean loss, backward, clip, step, schedule;
    under torchrun DDP with DistributedSampler and no_sync() around the window's micro-batches but its
    last; an epoch's end ends a window (`or the last batch`). The loss is the task's (classification:
    cross-entropy; lm: over the loss-bearing tokens), a mean per micro-batch / K as tutorials do."""
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
    batches, samples, started, epoch, left = iter(loader), 0, 0.0, 0, len(loader)
    for step in range(steps):
        if step == steps // 2:
            if d.device.type == "cuda":
                torch.cuda.synchronize()
            samples, started = 0, clock()
        if not left:  # the epoch's end ends a window (a short one), as trainkit's: as many optimizer steps
            epoch, left = epoch + 1, len(loader)
            if sampler is not None:
                sampler.set_epoch(epoch)
            batches = iter(loader)
        window = min(K, left)
        for k in range(window):
            x, y = next(batches)
            x, y = x.to(d.device, non_blocking=True), y.to(d.device, non_blocking=True)
            with model.no_sync() if d.distributed and k < window - 1 else contextlib.nullcontext():
                with autocast():
                    loss = task.loss_sum(model(x), y) / (task.items(y) if task.items_name else len(y)) / K
                loss.backward()
            samples += len(y) * d.world_size
        left -= window
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    if d.device.type == "cuda":
        torch.cuda.synchronize()
    return samples / (clock() - started)


def tensor_loop(cfg, d: dist.Dist, steps: int) -> float:
    """The fastest plain loop a person writes for a data set that fits in memory (airbench's and the
    small-model papers' loops): the split's tensors on the device once, a random permutation per epoch
    (one gather), micro-batches as slices of it, forward, loss, backward, clip, step, schedule,
    zero_grad; no metrics, no evaluation. An epoch's last window may be short (K=4 on digits' 34
    micro-batches: 8 of 4 and one of 2), as trainkit's and the usual `or last batch` idiom's: windows
    that ran on into the next epoch took 8.5 optimizer steps an epoch to trainkit's 9 (-6 % of the
    steps; the default mlp's clip and AdamW step are a fifth of its K=4 step). The loss is the task's
    sum over the micro-batch's items times 1 / (items x K): one scalar op, as a mean loss / K. Under
    torchrun rank r takes every W-th sample of the permutation and DDP's no_sync() wraps the window's
    micro-batches but its last. Needs tensors (InMemory)."""
    torch.manual_seed(cfg.seed)
    train_set, *_ = instantiate(cfg.data.splits)  # (train, val, test)
    inputs, targets = (t.to(d.device) for t in train_set.tensors)
    model = instantiate(cfg.model).to(d.device)
    if d.distributed:
        model = DDP(model, device_ids=[d.device.index] if d.device.type == "cuda" else None)
    optimizer = optim.build(cfg.optim, model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedules.multiplier(cfg.sched, steps))
    task = instantiate(cfg.task)
    autocast = autocast_for(cfg.trainer.precision, d.device)
    max_norm = cfg.trainer.clip_grad_norm or math.inf
    K, b = config.accumulation_steps(cfg, d.world_size), cfg.data.batch_size
    generator = torch.Generator(d.device).manual_seed(cfg.seed)
    micro: list = []  # this epoch's micro-batches, (x, y) slices, next first
    samples, started = 0, 0.0
    model.train()
    for step in range(steps):
        if step == steps // 2:
            if d.device.type == "cuda":
                torch.cuda.synchronize()
            samples, started = 0, clock()
        if not micro:  # a new epoch: one permutation, one gather per tensor, then slices
            order = torch.randperm(len(targets), device=d.device, generator=generator)[d.rank :: d.world_size]
            x_epoch, y_epoch = inputs[order], targets[order]
            micro = [(x_epoch[i : i + b], y_epoch[i : i + b]) for i in range(0, len(order), b)][::-1]
        window = min(K, len(micro))  # the epoch's end ends a window (a short one), as trainkit's
        for k in range(window):
            x, y = micro.pop()
            with model.no_sync() if d.distributed and k < window - 1 else contextlib.nullcontext():
                with autocast():
                    loss = task.loss_sum(model(x), y) * (1 / (len(y) * K))
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


# What train() calls per optimizer step beyond the plain loop's forward, loss, backward, clip, step, schedule
# and zero_grad (--breakdown): (where, attribute, what). Context managers are timed at entry and exit (not
# their bodies), generators and iterators per item; the rest per call.
HOOKS = [
    ("trainkit.loading:TrainLoader", "epoch", "data: the window's micro-batches (per item)"),
    ("trainkit.metrics:TrainMeter", "waiting_for_data", "meter: time/data_wait's clock"),
    ("trainkit.metrics:TrainMeter", "add_micro_step", "meter: the micro-batch's loss sum"),
    ("trainkit.metrics:TrainMeter", "add_step", "meter: the step's sums"),
    ("trainkit.metrics:TrainMeter", "paused", "meter: paused() around evaluation / rows"),
    ("train", "seed_step", "rng: seed_step (dropout's stream)"),
    ("train", "sync_context", "accumulate: sync_context"),
    ("train", "syncs_now", "accumulate: syncs_now"),
    ("trainkit.autobatch:AutoBatch", "micro_steps", "autobatch: micro_steps (per item)"),
    ("trainkit.autobatch:AutoBatch", "catching", "autobatch: catching()"),
    ("trainkit.autobatch:AutoBatch", "retry", "autobatch: retry()"),
    ("trainkit.guard:StepGuard", "start_window", "guard: start_window"),
    ("trainkit.guard:StepGuard", "decide", "guard: decide"),
    ("trainkit.guard:StepGuard", "check", "guard: check (logged steps)"),
    ("torch.amp:GradScaler", "scale", "GradScaler.scale (fp32: off)"),
    ("torch.amp:GradScaler", "unscale_", "GradScaler.unscale_"),
    ("torch.amp:GradScaler", "update", "GradScaler.update"),
    ("train", "full_tensor", "parallel: full_tensor"),
    ("torch.optim.lr_scheduler:LRScheduler", "get_last_lr", "scheduler.get_last_lr"),
    ("trainkit.ema:EMA", "update", "ema.update (off)"),
    ("trainkit.progress:Progress", "step", "progress: step"),
    ("trainkit.profile:Profiler", "step", "profiler: step (off)"),
    ("trainkit.stop:Stopper", "due", "stop: Stopper.due"),
    ("trainkit.checkpoint:Checkpointer", "due", "checkpoint: due"),
    ("trainkit.metrics:TrainMeter", "row", "rows: meter.row (per row)"),
    ("trainkit.summary:Efficiency", "row", "rows: efficiency.row (per row)"),
    ("trainkit.progress:Progress", "train_line", "rows: console line (per row)"),
    ("trainkit.metrics:MetricsLogger", "log", "rows: metrics.jsonl (per row)"),
]


def breakdown(cfg, d: dist.Dist, steps: int, repeats: int = 3) -> list[tuple[str, float]]:
    """(what, CPU us per optimizer step) of each of HOOKS in train()'s own run of `steps` steps, less
    the timing wrapper's own cost (measured around a call that does nothing); the median of `repeats` runs."""
    import importlib
    import inspect

    totals: dict[str, list[float]] = {what: [] for *_, what in HOOKS}
    spent: dict[str, float] = {}

    def timed(what, method):
        def call(*args, **kwargs):
            started = clock()
            result = method(*args, **kwargs)
            spent[what] += clock() - started - overhead
            if hasattr(result, "__enter__"):
                return _TimedContext(result, what)
            if inspect.isgenerator(result) or type(result).__name__ == "chain":
                return _timed_items(result, what)
            return result

        return call

    class _TimedContext:
        def __init__(self, inner, what):
            self.inner, self.what = inner, what

        def __enter__(self):
            started = clock()
            value = self.inner.__enter__()
            spent[self.what] += clock() - started - overhead
            return value

        def __exit__(self, *exc):
            started = clock()
            result = self.inner.__exit__(*exc)
            spent[self.what] += clock() - started - overhead
            return result

    def _timed_items(items, what):
        items = iter(items)
        while True:
            started = clock()
            try:
                item = next(items)
            except StopIteration:
                return
            finally:
                spent[what] += clock() - started - overhead
            yield item

    started = clock()  # the wrapper's cost: two clock reads and the bookkeeping around a call
    for _ in range(10000):
        begin = clock()
        spent[""] = spent.get("", 0.0) + clock() - begin
    overhead = (clock() - started) / 10000
    originals = []
    for where, name, what in HOOKS:
        module_name, _, owner_name = where.partition(":")
        owner = importlib.import_module(module_name) if module_name != "train" else sys.modules["train"]
        owner = getattr(owner, owner_name) if owner_name else owner
        originals.append((owner, name, owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)))
        setattr(owner, name, timed(what, getattr(owner, name)))
    try:
        for _ in range(repeats):
            spent.clear()
            spent.update({what: 0.0 for what in totals})
            trainkit_loop(cfg, d, steps)
            for what in totals:
                totals[what].append(spent[what] / steps * 1e6)
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)
    return [(what, statistics.median(values)) for what, values in totals.items()]


def step_times(cfg, d: dist.Dist, args) -> dict[str, dict[str, list[list[float]]]]:
    """{loop: {"step": [[us] per block], "to forward": ...}} of single optimizer steps over each block's second half,
    the tensor loop and trainkit alternating: from one zero_grad's end to the next ("step"), and to the start of
    the model's first forward after it ("to forward": the loop's bookkeeping, data, seeds, contexts)."""
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

    marks: list[tuple[str, float]] = []
    depth = [0]  # forwards under way: only the outermost module's marks

    def zero_grad(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        marks.append(("zero_grad", clock()))
        return result

    def pre(module, inputs):
        depth[0] += 1
        if depth[0] == 1 and marks and marks[-1][0] == "zero_grad":
            marks.append(("forward", clock()))

    def post(module, inputs, output):
        depth[0] -= 1

    original = torch.optim.Optimizer.zero_grad
    torch.optim.Optimizer.zero_grad = zero_grad  # type: ignore[method-assign]
    handles = [register_module_forward_pre_hook(pre), register_module_forward_hook(post)]
    times: dict[str, dict[str, list[list[float]]]] = {
        name: {"step": [], "to forward": []} for name in ("tensor", "trainkit")
    }
    try:
        for block in range(args.warmup_blocks + args.blocks):
            for name in sorted(times, reverse=block % 2 == 1):
                marks.clear()
                (tensor_loop if name == "tensor" else trainkit_loop)(cfg, d, args.steps)
                if block < args.warmup_blocks:
                    continue
                ends = [i for i, (what, _) in enumerate(marks) if what == "zero_grad"][args.steps // 2 :]  # 2nd half
                pairs = list(zip(ends, ends[1:], strict=False))
                times[name]["step"].append([(marks[j][1] - marks[i][1]) * 1e6 for i, j in pairs])
                times[name]["to forward"].append(
                    [(marks[i + 1][1] - marks[i][1]) * 1e6 for i, _ in pairs if marks[i + 1][0] == "forward"]
                )
    finally:
        torch.optim.Optimizer.zero_grad = original  # type: ignore[method-assign]
        for handle in handles:
            handle.remove()
    return times


def step_lines(times: dict[str, dict[str, list[list[float]]]], clock_name: str) -> str:
    """The quantiles of single steps, the median over the blocks of each block's own, and trainkit's over the tensor
    loop's block next to it: a block the machine slowed moves all of its steps, not one loop's against the other's."""
    lines = [
        f"| single steps ({clock_name} time, us; medians over blocks) | tensor loop | trainkit | trainkit - tensor |",
        "|---|---:|---:|---:|",
    ]
    for what in ("step", "to forward"):
        for q in (10, 25, 50):
            per_block = {
                name: [statistics.quantiles(block, n=100)[q - 1] for block in blocks[what]]
                for name, blocks in times.items()
            }
            tensor, ours = per_block["tensor"], per_block["trainkit"]
            diff = statistics.median(b - a for a, b in zip(tensor, ours, strict=True))
            lines.append(
                f"| {what}, {q}th percentile | {statistics.median(tensor):.1f} | {statistics.median(ours):.1f} "
                f"| {diff:.1f} |"
            )
    return "\n".join(lines)


def compare(cfg, d: dist.Dist, args) -> dict[str, list[float]]:
    """The three loops' samples/s in alternating blocks (the order reverses every block: drift cancels)."""
    loops = {
        "tensor": lambda: tensor_loop(cfg, d, args.steps),
        "dataloader": lambda: plain_loop(cfg, d, args.steps),
        "trainkit": lambda: trainkit_loop(cfg, d, args.steps),
    }
    if not isinstance(instantiate(cfg.data.splits)[0], TensorDataset):
        loops.pop("tensor")  # a data set that is no tensors: the DataLoader loop only
    rates: dict[str, list[float]] = {name: [] for name in loops}
    for block in range(args.warmup_blocks + args.blocks):
        for name in sorted(loops, reverse=block % 2 == 1):
            rate = loops[name]()
            if block >= args.warmup_blocks:
                rates[name].append(rate)
        if args.verbose and block >= args.warmup_blocks:
            d.print0(f"block {block}: " + " ".join(f"{name} {values[-1]:.0f}" for name, values in rates.items()))
    return rates


def ratio_line(rates: dict[str, list[float]], baseline: str, short: bool = False) -> str:
    """trainkit's samples/s over the baseline's: the median of the blocks' ratios, its quartiles and range."""
    ratios = [ours / plain for ours, plain in zip(rates["trainkit"], rates[baseline], strict=True)]
    low, _, high = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    if short:
        return f"{statistics.median(ratios):.3f} ({low:.2f}-{high:.2f})"
    return (
        f"{statistics.median(ratios):.3f} (median of {len(ratios)} blocks; "
        f"quartiles {low:.2f}-{high:.2f}, range {min(ratios):.2f}-{max(ratios):.2f})"
    )


SUITE = {  # --suite: the issue-36 table (the three models at K=1 and K=4)
    "mlp (default)": [],
    "cnn": ["model=cnn"],
    "conv1d (width 48)": ["model._target_=__main__.conv1d", "model.width=48"],
}


def composed(steps: int, overrides: list[str]):
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return compose(
            "train",
            overrides=[
                f"trainer.max_steps={steps}",
                f"trainer.log_every={steps // 2}",
                f"trainer.eval_every={steps}",
                "checkpoint.every=0",
                *overrides,
            ],
        )


def suite(d: dist.Dist, args) -> None:
    """One table row per SUITE model and K: trainkit / the tensor-slicing loop, and / the DataLoader loop."""
    lines = [
        "| model | K | trainkit / tensor-slicing loop (quartiles) | trainkit / DataLoader loop | tensor loop's step |",
        "|---|---|---|---|---:|",
    ]
    for name, model in SUITE.items():
        for K in (1, 4):
            cfg = composed(args.steps, [*model, f"accumulation.steps={K}", *args.overrides])
            with contextlib.redirect_stdout(io.StringIO()):  # the runs' own lines
                rates = compare(cfg, d, args)
            step_ms = K * cfg.data.batch_size * d.world_size / statistics.median(rates["tensor"]) * 1e3
            lines.append(
                f"| {name} | {K} | {ratio_line(rates, 'tensor', True)} | {ratio_line(rates, 'dataloader', True)} "
                f"| {step_ms:.2f} ms |"
            )
            d.print0(lines[-1])
    d.print0("\n".join(["", *lines]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=20, help="alternations of the loops that count")
    parser.add_argument("--steps", type=int, default=400, help="optimizer steps per loop and block")
    parser.add_argument("--warmup-blocks", type=int, default=1, help="alternations run first and dropped")
    parser.add_argument("--compile", action="store_true", help="also trainkit with trainer.compile=true, once")
    parser.add_argument("--suite", action="store_true", help="the table: mlp, cnn, conv1d at K=1 and K=4 (+ overrides)")
    parser.add_argument("--breakdown", action="store_true", help="also the CPU time of each hook train() calls")
    parser.add_argument("--threads", type=int, default=1, help="torch's intra-op threads, for all loops (default 1)")
    parser.add_argument(
        "--clock", choices=["auto", *CLOCKS], default="auto", help="process CPU time or wall time; auto: cpu on a CPU"
    )
    parser.add_argument("--pin", action="store_true", help="each process on one core (rank r on core r)")
    parser.add_argument("--verbose", action="store_true", help="print every block's rates")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    cfg = composed(args.steps, args.overrides)
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
    if args.suite:
        suite(d, args)
        dist.teardown(finished=True)
        return
    rates = compare(cfg, d, args)
    for name, values in rates.items():
        d.print0(
            f"{name:<12} {statistics.median(values):>10,.0f} samples/s of {args.clock} time "
            f"(median of {len(values)} blocks)"
        )
    if "tensor" in rates:
        d.print0(f"ratio trainkit / tensor-slicing loop: {ratio_line(rates, 'tensor')}")
    d.print0(f"ratio trainkit / DataLoader loop: {ratio_line(rates, 'dataloader')}")
    if args.breakdown:
        baseline = "tensor" if "tensor" in rates else "dataloader"
        samples = config.accumulation_steps(cfg, d.world_size) * cfg.data.batch_size * d.world_size
        step_us = {name: samples / statistics.median(values) * 1e6 for name, values in rates.items()}
        d.print0("\n" + step_lines(step_times(cfg, d, args), args.clock))
        hooks = breakdown(cfg, d, args.steps)
        d.print0(
            f"\n| per optimizer step ({args.clock} time) | us | % of the {baseline} loop's step |\n|---|---:|---:|\n"
            + "".join(f"| {what} | {us:.1f} | {100 * us / step_us[baseline]:.1f} |\n" for what, us in hooks)
            + f"| all hooks | {sum(us for _, us in hooks):.1f} | "
            f"{100 * sum(us for _, us in hooks) / step_us[baseline]:.1f} |\n"
            f"| trainkit's step less the {baseline} loop's (medians) | {step_us['trainkit'] - step_us[baseline]:.1f} | "
            f"{100 * (step_us['trainkit'] / step_us[baseline] - 1):.1f} |\n"
            f"| the {baseline} loop's step | {step_us[baseline]:.1f} | 100 |"
        )
    if args.compile:
        compiled = trainkit_loop(OmegaConf.merge(cfg, {"trainer": {"compile": True}}), d, args.steps)
        eager = statistics.median(rates["trainkit"])
        d.print0(f"trainkit, trainer.compile=true {compiled:>10,.0f} samples/s: {compiled / eager:.2f}x eager")
    dist.teardown(finished=True)


if __name__ == "__main__":
    main()
