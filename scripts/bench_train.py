"""Training throughput: trainkit's loop (src/train.py's train()) against plain PyTorch loops, side by side in one
process, on the same model, data, optimizer, schedule, clipping and precision.

    .venv/bin/python scripts/bench_train.py [--steps 3000] [--every 10] [--clock cpu] [--threads 1] [--pin]
        [--suite [--seconds 20]] [--paths] [--breakdown] [--compile] [overrides ...]
    e.g. ... model=cnn data=fake trainer.precision=bf16      (on a GPU: trainer.device=cuda)
    ... +experiment=pydoc_gpt --steps 400: the character GPT on CPython's documentation (task=lm)
    ... --suite: the table of docs/performance.md, the default mlp, the cnn and a 1-D conv net at K=1 and K=4
    ... --compile model=cnn: also trainkit with trainer.compile=true and with optim.compile=true (each its own run,
        compilation left out), and the optimizer step alone, eager against compiled, interleaved
    OMP_NUM_THREADS=1 torchrun --nproc_per_node=2 scripts/bench_train.py accumulation.steps=4
        (2-rank DDP: trainkit's loop against plain DDP loops with the same no_sync accumulation)

The plain loops: **tensor**, the fastest a person writes for a data set that fits in memory (the split's tensors on
the device once, a permutation per epoch, slices: airbench's loop), and **dataloader**, the tutorial's (a DataLoader
that shuffles). Neither keeps metrics or evaluates.

How a figure holds on a shared machine: the loops run interleaved in one process. train() runs its --steps steps
and, after every --every of them (at its optimizer's zero_grad), each plain loop runs its next --every steps, the
same steps (samples, schedule) as trainkit's; each segment is timed by the process's CPU time (--clock cpu:
time.process_time; wall time on a GPU, --clock auto). Segments a few milliseconds apart see the same machine: a
load that slows one slows its neighbours alike. The first quarter of the run is warm-up, untimed. The figure is
trainkit's speed over a plain loop's, the plain loop's time over trainkit's summed over every timed segment, and
beside it the range of that ratio over 8 consecutive parts of the run. Blocks of whole runs, this script's method
before (the loops alternating, one run each per block), moved a row's median by up to 0.09 between two runs on
this 2-core machine under another job's load; interleaved, the same rows moved by 0.01 (docs/performance.md).
The timed steps include trainkit's own (the meter's sums every 256 steps, one log row); its evaluation, test pass
and checkpoints come after the last timed segment. One intra-op thread by default (--threads): OpenMP threads that
wait on each other on a shared machine made single blocks 10x slower or faster. With one thread per process and no
loader workers, CPU time is the loop's own work; under torchrun it leaves out the time a rank waits on the other.

--paths: the data path as rows, side by side in one process (the same interleaving): trainkit with its train split
on the device (data.on_device=true: the driver), trainkit through its DataLoader (data.on_device=false: a second
train() in a thread that runs only while the driver waits for it, one step at a time), the tensor-slicing loop and the
DataLoader loop; per step each one's time and its time/data_wait (the share of its step spent getting the step's
batches: trainkit's TrainWindows.epoch and fetch, the tensor loop's epoch gather and slices, the DataLoader loop's
next() and copy), the same clock as the steps' (the timers themselves, ~1 us each on --clock cpu, are in the steps).

--breakdown: where trainkit's extra time goes. The Python function calls per step of trainkit and the tensor loop
(cProfile over the same steps: a count, the same on any machine), and the CPU time of each hook train() calls per
step (each wrapped and timed in a real run, less the wrapper's own cost).
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
import threading
import time
from collections.abc import Callable, Iterator
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
from trainkit import config, dist, metrics, optim  # noqa: E402
from trainkit.loading import TrainWindows  # noqa: E402
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


def plain_steps(cfg, d: dist.Dist, steps: int) -> Iterator[int]:
    """The loop a tutorial would write: shuffle, forward, mean loss, backward, clip, step, schedule;
    under torchrun DDP with DistributedSampler and no_sync() around the window's micro-batches but its
    last; an epoch's end ends a window (`or the last batch`). The loss is the task's (classification:
    cross-entropy; lm: over the loss-bearing tokens), a mean per micro-batch / K as tutorials do. Yields each
    step's samples (all ranks) after its zero_grad."""
    torch.manual_seed(cfg.seed)
    train_set, *_ = instantiate(cfg.data.splits)  # (train, val, test)
    model = instantiate(cfg.model).to(d.device)
    if d.distributed:
        model = DDP(model, device_ids=[d.device.index] if d.device.type == "cuda" else None)
    optimizer = optim.build(cfg.optim, model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, optim.multiplier(cfg.sched, steps))
    task = instantiate(cfg.task)
    sampler = DistributedSampler(train_set) if d.distributed else None
    loader = DataLoader(
        train_set, cfg.data.batch_size, shuffle=sampler is None, sampler=sampler, num_workers=cfg.data.num_workers
    )
    autocast = autocast_for(cfg.trainer.precision, d.device)
    max_norm = cfg.trainer.clip_grad_norm or math.inf
    K = config.accumulation_steps(cfg, d.world_size)
    batches, epoch, left = iter(loader), 0, len(loader)
    for _ in range(steps):
        if not left:  # the epoch's end ends a window (a short one), as trainkit's: as many optimizer steps
            epoch, left = epoch + 1, len(loader)
            if sampler is not None:
                sampler.set_epoch(epoch)
            batches = iter(loader)
        window, samples = min(K, left), 0
        for k in range(window):
            with waiting("dataloader"):
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
        yield samples


def tensor_steps(cfg, d: dist.Dist, steps: int) -> Iterator[int]:
    """The fastest plain loop a person writes for a data set that fits in memory (airbench's and the
    small-model papers' loops): the split's tensors on the device once, a random permutation per epoch
    (one gather), micro-batches as slices of it, forward, loss, backward, clip, step, schedule,
    zero_grad; no metrics, no evaluation. An epoch's last window may be short (K=4 on digits' 34
    micro-batches: 8 of 4 and one of 2), as trainkit's and the usual `or last batch` idiom's: windows
    that ran on into the next epoch took 8.5 optimizer steps an epoch to trainkit's 9 (-6 % of the
    steps; the default mlp's clip and AdamW step are a fifth of its K=4 step). The loss is the task's
    sum over the micro-batch's items times 1 / (items x K): one scalar op, as a mean loss / K. Under
    torchrun rank r takes every W-th sample of the permutation and DDP's no_sync() wraps the window's
    micro-batches but its last. Needs tensors (InMemory). Yields each step's samples (all ranks)."""
    torch.manual_seed(cfg.seed)
    train_set, *_ = instantiate(cfg.data.splits)  # (train, val, test)
    inputs, targets = (t.to(d.device) for t in train_set.tensors)
    model = instantiate(cfg.model).to(d.device)
    if d.distributed:
        model = DDP(model, device_ids=[d.device.index] if d.device.type == "cuda" else None)
    optimizer = optim.build(cfg.optim, model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, optim.multiplier(cfg.sched, steps))
    task = instantiate(cfg.task)
    autocast = autocast_for(cfg.trainer.precision, d.device)
    max_norm = cfg.trainer.clip_grad_norm or math.inf
    K, b = config.accumulation_steps(cfg, d.world_size), cfg.data.batch_size
    generator = torch.Generator(d.device).manual_seed(cfg.seed)
    micro: list = []  # this epoch's micro-batches, (x, y) slices, next first
    model.train()
    for _ in range(steps):
        if not micro:  # a new epoch: one permutation, one gather per tensor, then slices
            with waiting("tensor"):
                order = torch.randperm(len(targets), device=d.device, generator=generator)[d.rank :: d.world_size]
                x_epoch, y_epoch = inputs[order], targets[order]
                micro = [(x_epoch[i : i + b], y_epoch[i : i + b]) for i in range(0, len(order), b)][::-1]
        window, samples = min(K, len(micro)), 0  # the epoch's end ends a window (a short one), as trainkit's
        for k in range(window):
            with waiting("tensor"):
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
        yield samples


WAITED: dict[str, float] | None = None  # --paths: each loop's seconds spent getting its batches (None: not counted)


@contextlib.contextmanager
def waiting(name: str):
    """Count the block's time as `name`'s data wait (--paths only: elsewhere the loops pay nothing for it)."""
    if WAITED is None:
        yield
        return
    started = clock()
    try:
        yield
    finally:
        WAITED[name] = WAITED.get(name, 0.0) + clock() - started


def synchronize(d: dist.Dist) -> None:
    if d.device.type == "cuda":
        torch.cuda.synchronize()


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


def advance(loop: Iterator[int], count: int) -> None:
    for _ in range(count):
        next(loop)


class Guest:
    """A loop that owns its loop, as a step generator: `run()` (--paths: trainkit's train() on another config;
    bench_hf.py: transformers' Trainer) in a thread that runs one optimizer step each time it is advanced, the driver
    waiting meanwhile (one runs at a time: process CPU time is then the running one's). Its steps end where it calls
    `stepped()`: at its zero_grad (interleaved's hook hands control back), or from the loop's own hook."""

    guests: dict[threading.Thread, "Guest"] = {}

    def __init__(self, run: Callable[[], object]):
        self.go, self.done, self.finished = threading.Semaphore(0), threading.Semaphore(0), False
        self.thread = threading.Thread(target=self._run, args=(run,), daemon=True)
        Guest.guests[self.thread] = self
        self.thread.start()

    def _run(self, run: Callable[[], object]) -> None:
        self.go.acquire()
        try:
            run()
        finally:
            self.finished = True
            self.done.release()

    def stepped(self) -> None:
        """At the guest's zero_grad: hand control back, wait for the next advance."""
        self.done.release()
        self.go.acquire()

    def __iter__(self):
        return self

    def __next__(self) -> int:
        if self.finished:
            raise StopIteration
        self.go.release()
        self.done.acquire()
        return 0

    def finish(self) -> None:
        while not self.finished:
            next(self, None)
        self.thread.join()


def trainkit_loader_steps(cfg, d: dist.Dist, steps: int) -> Guest:
    """--paths: trainkit through its DataLoader (data.on_device=false), stepped beside the driver."""
    return Guest(lambda: trainkit_loop(OmegaConf.merge(cfg, {"data": {"on_device": False}}), d, steps))


PLAIN = {"tensor": tensor_steps, "dataloader": plain_steps, "trainkit loader": trainkit_loader_steps}


def interleaved(
    cfg, d: dist.Dist, steps: int, every: int, names: list[str], rotate: bool = False
) -> dict[str, list[float]]:
    """Each loop's seconds per segment of `every` optimizer steps, measured side by side in one run: train() runs
    its `steps` steps and, after each `every` of them (at its optimizer's zero_grad), each plain loop in `names`
    runs its next `every` steps, the same steps (samples, schedule) as trainkit's. Segments a few milliseconds
    apart see the same machine, which blocks of whole runs do not. The first quarter is run untimed by all.
    rotate: the plain loops' order turns by one each segment, so that with two of them each of the three loops
    follows each other one as often (a loop run after another thread's ran its first steps slower: bench_hf.py)."""
    plain = {name: PLAIN[name](cfg, d, steps) for name in names}
    loops = list(plain.items())
    seconds: dict[str, list[float]] = {name: [] for name in ["trainkit", *plain]}
    warm = max(every, steps // 4 // every * every)
    done, inside, last = 0, False, 0.0
    original = torch.optim.Optimizer.zero_grad

    def zero_grad(self, *args, **kwargs):  # every loop's, so that each pays the same call
        nonlocal done, inside, last
        original(self, *args, **kwargs)
        if (guest := Guest.guests.get(threading.current_thread())) is not None:
            return guest.stepped()  # a guest's step (--paths): back to the driver
        if inside:
            return
        done += 1
        if done < warm or done % every:
            return
        inside = True
        synchronize(d)
        now = clock()
        if done > warm:
            seconds["trainkit"].append(now - last)
        turn = done // every % len(loops) if rotate else 0
        for name, loop in loops[turn:] + loops[:turn]:
            started = clock()
            advance(loop, warm if done == warm else every)
            synchronize(d)
            if done > warm:
                seconds[name].append(clock() - started)
        if done == warm and WAITED is not None:  # the data waits of the timed segments only: not the warm-up's,
            WAITED.clear()  # the guests' included (their start, first epoch: on a loaded machine 13x the timed time)
        last, inside = clock(), False

    torch.optim.Optimizer.zero_grad = zero_grad  # type: ignore[method-assign]
    try:
        trainkit_loop(cfg, d, steps)
    finally:
        counted = dict(WAITED) if WAITED is not None else None  # the timed segments' data waits
        for loop in plain.values():
            if isinstance(loop, Guest):
                loop.finish()  # its evaluation and end, after the timed segments
        if WAITED is not None and counted is not None:  # nor a finishing guest's (outside every timed segment)
            WAITED.clear()
            WAITED.update(counted)
        torch.optim.Optimizer.zero_grad = original  # type: ignore[method-assign]
    return seconds


def segment_ratio(seconds: dict[str, list[float]], baseline: str, groups: int = 8) -> tuple[float, list[float]]:
    """trainkit's speed over the baseline's (its time over trainkit's, over the same steps) in all, and in each of
    `groups` runs of consecutive segments (how much it moves within the run)."""
    ours, theirs = seconds["trainkit"], seconds[baseline]
    bounds = [round(i * len(ours) / groups) for i in range(groups + 1)]
    parts = [sum(theirs[a:b]) / sum(ours[a:b]) for a, b in zip(bounds, bounds[1:], strict=False) if b > a]
    return sum(theirs) / sum(ours), parts


# What train() may call per optimizer step beyond the plain loop's forward, loss, backward, clip, step, schedule and
# zero_grad (--breakdown): (where, attribute, what). Context managers are timed at entry and exit (not their bodies),
# generators and iterators per item; the rest per call. The default job's step (train.bare_step) calls the first
# four; "(optimizer_step)": the general step's (DDP, FSDP, fp16, on_nonfinite=skip, auto, a coupled loss);
# "(bookkeeping steps)": after a step that logs, evaluates or saves (trainkit.cadence), or after every step.
HOOKS = [
    ("trainkit.loading:TrainWindows", "fetch", "data: the window's micro-batches"),
    ("trainkit.loading:TrainWindows", "epoch", "data: the epoch's start (per step)"),
    ("train", "seed_step", "rng: seed_step (dropout's stream)"),
    ("trainkit.metrics:TrainMeter", "add_micro_step", "meter: add_micro_step (optimizer_step)"),
    ("trainkit.metrics:TrainMeter", "add_step", "meter: add_step"),
    ("trainkit.metrics:TrainMeter", "paused", "meter: paused() around evaluation / rows"),
    ("train", "sync_context", "accumulate: sync_context (optimizer_step)"),
    ("train", "syncs_now", "accumulate: syncs_now (optimizer_step)"),
    ("trainkit.autobatch:AutoBatch", "micro_steps", "autobatch: micro_steps (optimizer_step)"),
    ("trainkit.autobatch:AutoBatch", "catching", "autobatch: catching() (optimizer_step)"),
    ("trainkit.autobatch:AutoBatch", "retry", "autobatch: retry() (optimizer_step)"),
    ("trainkit.guard:StepGuard", "start_window", "guard: start_window (optimizer_step)"),
    ("trainkit.guard:StepGuard", "decide", "guard: decide (optimizer_step)"),
    ("trainkit.guard:StepGuard", "check", "guard: check (logged steps)"),
    ("torch.amp:GradScaler", "scale", "GradScaler.scale (optimizer_step)"),
    ("torch.amp:GradScaler", "step", "GradScaler.step (optimizer_step)"),
    ("trainkit.ema:EMA", "update", "ema.update (on)"),
    ("trainkit.progress:Progress", "step", "progress: step (bookkeeping steps)"),
    ("trainkit.profile:Profiler", "step", "profiler: step (bookkeeping steps)"),
    ("trainkit.stop:Stopper", "due", "stop: Stopper.due (bookkeeping steps)"),
    ("trainkit.cadence:Cadence", "after", "cadence: after (every step: one comparison on most)"),
    ("trainkit.metrics:TrainMeter", "row", "rows: meter.row (per row)"),
    ("trainkit.summary:Efficiency", "row", "rows: efficiency.row (per row)"),
    ("trainkit.progress:Progress", "train_line", "rows: console line (per row)"),
    ("trainkit.loggers:FileLogger", "log", "rows: metrics.jsonl (per row)"),
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


def measure(cfg, d: dist.Dist, steps: int, every: int) -> dict[str, list[float]]:
    """interleaved() with the plain loops the data allows (tensor needs a TensorDataset)."""
    tensors = isinstance(instantiate(cfg.data.splits)[0], TensorDataset)
    with contextlib.redirect_stdout(io.StringIO()):  # the run's own lines
        return interleaved(cfg, d, steps, every, ["tensor", "dataloader"] if tensors else ["dataloader"])


def data_paths(cfg, d: dist.Dist, steps: int, every: int) -> str:
    """--paths: the table of the data paths, each loop's step and time/data_wait, side by side in one run."""
    global WAITED
    WAITED = {}
    fetch, start = TrainWindows.fetch, TrainWindows.epoch

    def timed(method):  # trainkit's data wait, per thread (the driver's, the guest's): the epoch's start and fetch
        def call(self, *args):
            with waiting("trainkit loader" if threading.current_thread() in Guest.guests else "trainkit"):
                return method(self, *args)

        return call

    TrainWindows.fetch, TrainWindows.epoch = timed(fetch), timed(start)  # type: ignore[method-assign]
    train_set = instantiate(cfg.data.splits)[0]
    # The plain loops the data allows: the tensor loop needs a TensorDataset, the DataLoader loop (x, y) pairs that
    # torch's collation stacks
    loops = ["tensor"] if isinstance(train_set, TensorDataset) else []
    loops += ["dataloader"] if not hasattr(train_set, "collate_fn") and isinstance(train_set[0], tuple) else []
    try:
        on_device = OmegaConf.merge(cfg, {"data": {"on_device": True}})
        with contextlib.redirect_stdout(io.StringIO()):
            seconds = interleaved(on_device, d, steps, every, [*loops, "trainkit loader"])
    finally:
        TrainWindows.fetch, TrainWindows.epoch = fetch, start  # type: ignore[method-assign]
        waited, WAITED = WAITED, None
    per_step = step_us(seconds, every)
    timed = {name: sum(values) for name, values in seconds.items()}
    names = {
        "trainkit": "trainkit, data on the device (data.on_device=true)",
        "trainkit loader": "trainkit, DataLoader (data.on_device=false)",
        "tensor": "tensor-slicing loop",
        "dataloader": "DataLoader loop",
    }
    base = next(name for name in ("tensor", "dataloader", "trainkit loader") if name in seconds)
    lines = [
        f"| data path | us per step | time/data_wait | speed / {names[base]} (8 parts) |",
        "|---|---:|---:|---|",
    ]
    for name, label in names.items():
        if name not in seconds:
            continue
        parts = segment_ratio({"trainkit": seconds[name], "base": seconds[base]}, "base")
        ratio = f"{parts[0]:.3f} ({min(parts[1]):.2f}-{max(parts[1]):.2f})"
        lines.append(f"| {label} | {per_step[name]:,.1f} | {waited.get(name, 0.0) / timed[name]:.3f} | {ratio} |")
    return "\n".join(lines)


def ratio_text(seconds: dict[str, list[float]], baseline: str) -> str:
    whole, parts = segment_ratio(seconds, baseline)
    return f"{whole:.3f} ({min(parts):.2f}-{max(parts):.2f})"


def step_us(seconds: dict[str, list[float]], every: int) -> dict[str, float]:
    """Each loop's CPU (wall) microseconds per optimizer step over the timed segments."""
    return {name: sum(values) / (len(values) * every) * 1e6 for name, values in seconds.items()}


def suite(d: dist.Dist, args) -> None:
    """One table row per SUITE model and K: trainkit / the tensor-slicing loop, and / the DataLoader loop. Each row
    runs about --seconds: its steps from a quick timing of the tensor loop's (at most --steps)."""
    lines = [
        "| model | K | trainkit / tensor-slicing loop (8 parts) | trainkit / DataLoader loop | tensor loop's step "
        "| steps |",
        "|---|---|---|---|---:|---:|",
    ]
    for name, model in SUITE.items():
        for K in (1, 4):
            cfg = composed(100, [*model, f"accumulation.steps={K}", *args.overrides])
            probe = tensor_steps(cfg, d, 100)
            advance(probe, 10)
            started = clock()
            advance(probe, 20)
            steps = min(args.steps, max(40 * args.every, int(args.seconds / ((clock() - started) / 20 * 3.5))))
            steps -= steps % args.every
            cfg = composed(steps, [*model, f"accumulation.steps={K}", *args.overrides])
            seconds = measure(cfg, d, steps, args.every)
            lines.append(
                f"| {name} | {K} | {ratio_text(seconds, 'tensor')} | {ratio_text(seconds, 'dataloader')} "
                f"| {step_us(seconds, args.every)['tensor'] / 1e3:.2f} ms | {steps} |"
            )
            d.print0(lines[-1])
    d.print0("\n".join(["", *lines]))


def profiled(run, first: int, last: int) -> dict[str, int]:
    """{function: calls} of Python functions called between the first-th and the last-th zero_grad of `run()`."""
    import cProfile
    import pstats

    profile, done, original = cProfile.Profile(), 0, torch.optim.Optimizer.zero_grad

    def zero_grad(self, *args, **kwargs):
        nonlocal done
        original(self, *args, **kwargs)
        done += 1
        if done == first:
            profile.enable()
        elif done == last:
            profile.disable()

    torch.optim.Optimizer.zero_grad = zero_grad  # type: ignore[method-assign]
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            run()
    finally:
        torch.optim.Optimizer.zero_grad = original  # type: ignore[method-assign]
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    return {f"{name} ({Path(file).name}:{line})": calls for (file, line, name), (_, calls, *_) in stats.items()}


def call_counts(cfg, d: dist.Dist, steps: int) -> list[tuple[str, float, float]]:
    """(function, calls per step in the tensor loop, in trainkit) of the Python functions whose counts differ, over
    the same steps of each (the second quarter of a run of `steps`), and of all: cProfile counts the same anywhere."""
    first, last = steps // 4, steps // 2
    tensor = profiled(lambda: advance(tensor_steps(cfg, d, steps), last), first, last)
    ours = profiled(lambda: trainkit_loop(cfg, d, steps), first, last)
    per_step = {f: (tensor.get(f, 0) / (last - first), ours.get(f, 0) / (last - first)) for f in {*tensor, *ours}}
    rows = [(f, a, b) for f, (a, b) in per_step.items() if abs(a - b) >= 0.05 and "bench_train.py" not in f]
    rows.sort(key=lambda row: row[1] - row[2])
    return [("all", sum(a for a, _ in per_step.values()), sum(b for _, b in per_step.values())), *rows]


def optimizer_steps(cfg, d: dist.Dist, steps: int = 400, every: int = 10) -> dict[str, float]:
    """--compile: the optimizer step alone (cfg.optim over the model's parameters, fixed gradients, the lr moved by
    the schedule), eager and compiled (optim.compile=true; its compilation left out), interleaved in segments of
    `every` steps as the loops are: us per step of each, by the --clock."""
    torch.manual_seed(cfg.seed)
    model = instantiate(cfg.model).to(d.device)
    parameters = [p for p in model.parameters() if p.requires_grad]
    stepping = {}
    for name, compiled in (("eager", False), ("compiled", True)):
        optimizer = optim.build(OmegaConf.merge(cfg.optim, {"compile": compiled}), model, device=d.device)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, optim.multiplier(cfg.sched, 2 * steps))
        stepping[name] = optimizer, scheduler
    for p in parameters:
        p.grad = torch.randn_like(p) * 1e-3
    seconds = {name: 0.0 for name in stepping}
    for segment in range(steps // every):
        for name, (optimizer, scheduler) in stepping.items():
            synchronize(d)
            started = clock()
            for _ in range(every):
                optimizer.step()
                scheduler.step()
            synchronize(d)
            if segment >= steps // every // 4:  # the first quarter warms up (and compiles)
                seconds[name] += clock() - started
    timed = steps - steps // every // 4 * every
    return {name: 1e6 * total / timed for name, total in seconds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--steps", type=int, default=3000, help="trainkit's optimizer steps (the first quarter untimed)"
    )
    parser.add_argument("--every", type=int, default=10, help="steps per segment, each loop in turn")
    parser.add_argument("--compile", action="store_true", help="also trainkit with trainer.compile=true, once")
    parser.add_argument("--suite", action="store_true", help="the table: mlp, cnn, conv1d at K=1 and K=4 (+ overrides)")
    parser.add_argument("--seconds", type=float, default=20, help="--suite: about this long a row")
    parser.add_argument("--paths", action="store_true", help="the data paths as rows, with time/data_wait")
    parser.add_argument("--breakdown", action="store_true", help="also calls per step and the hooks' CPU time")
    parser.add_argument("--threads", type=int, default=1, help="torch's intra-op threads, for all loops (default 1)")
    parser.add_argument(
        "--clock", choices=["auto", *CLOCKS], default="auto", help="process CPU time or wall time; auto: cpu on a CPU"
    )
    parser.add_argument("--pin", action="store_true", help="each process on one core (rank r on core r)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.every < 1 or args.steps < 8 * args.every:
        parser.error(f"--every must be >= 1 and --steps at least 8 segments (8 x --every = {8 * args.every})")
    args.steps -= args.steps % args.every
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
        f"K={config.accumulation_steps(cfg, d.world_size)}; {args.steps} steps, segments of {args.every} "
        f"interleaved, the last {args.steps - args.steps // 4 // args.every * args.every} timed by {args.clock} time"
    )
    if args.suite:
        suite(d, args)
        dist.teardown(finished=True)
        return
    if args.paths:
        d.print0(data_paths(cfg, d, args.steps, args.every))
        dist.teardown(finished=True)
        return
    seconds = measure(cfg, d, args.steps, args.every)
    per_step = step_us(seconds, args.every)
    for name, us in per_step.items():
        d.print0(f"{name:<12} {us:>10,.1f} us per step of {args.clock} time")
    if "tensor" in seconds:
        d.print0(f"ratio trainkit / tensor-slicing loop: {ratio_text(seconds, 'tensor')}")
    d.print0(f"ratio trainkit / DataLoader loop: {ratio_text(seconds, 'dataloader')}")
    if args.breakdown:
        baseline = "tensor" if "tensor" in seconds else "dataloader"
        if baseline == "tensor" and not d.distributed:
            d.print0("\n| function calls per step (cProfile) | tensor loop | trainkit |\n|---|---:|---:|")
            for function, plain, ours in call_counts(cfg, d, args.steps):
                d.print0(f"| {function} | {plain:.2f} | {ours:.2f} |")
        hooks = breakdown(cfg, d, args.steps)
        base_us = per_step[baseline]
        d.print0(
            f"\n| per optimizer step ({args.clock} time) | us | % of the {baseline} loop's step |\n|---|---:|---:|\n"
            + "".join(f"| {what} | {us:.1f} | {100 * us / base_us:.1f} |\n" for what, us in hooks)
            + f"| all hooks | {sum(us for _, us in hooks):.1f} | {100 * sum(us for _, us in hooks) / base_us:.1f} |\n"
            f"| trainkit's step less the {baseline} loop's | {per_step['trainkit'] - base_us:.1f} | "
            f"{100 * (per_step['trainkit'] / base_us - 1):.1f} |\n"
            f"| the {baseline} loop's step | {base_us:.1f} | 100 |"
        )
    if args.compile:
        eager = trainkit_loop(cfg, d, args.steps)
        d.print0(f"trainkit, eager                {eager:>10,.0f} samples/s")
        for compiled_key in ("trainer.compile", "optim.compile"):
            group, key = compiled_key.split(".")
            compiled = trainkit_loop(OmegaConf.merge(cfg, {group: {key: True}}), d, args.steps)
            d.print0(f"trainkit, {compiled_key}=true {compiled:>10,.0f} samples/s: {compiled / eager:.2f}x eager")
        step = optimizer_steps(cfg, d)
        d.print0(
            f"{cfg.optim._target_}.step alone: eager {step['eager']:,.1f} us, compiled {step['compiled']:,.1f} us: "
            f"{step['eager'] / step['compiled']:.2f}x eager's speed"
        )
    dist.teardown(finished=True)


if __name__ == "__main__":
    main()
