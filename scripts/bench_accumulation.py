"""Gradient accumulation with DDP: what skipping the sync of K-1 micro-batches saves, and the classic
mistake that saves nothing. The Accelerate guide's benchmark (baseline / no_sync misused / no_sync)
reproduced on this machine: W ranks (2 gloo ranks on CPU; one rank per GPU with nccl when there are
GPUs), every variant interleaved with the others and repeated, in one invocation.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_accumulation.py [--models mlp resnet18 gpt]
        [--repeats 8] [--steps N] [--warmup-rounds 1] [--clock auto|cpu|wall] [--mean] [--pin]
        [--quick] [--out PATH]

Variants, each K micro-batches per optimizer step, then clip (1.0), AdamW step, zero_grad:

- baseline: plain DDP, forward and backward of every micro-batch synced (K all-reduces per step);
- no_sync_backward_only: forward outside `model.no_sync()`, backward inside it for the first K-1
  micro-batches: the known mistake. DDP arms its reducer in forward, so it still all-reduces K times;
- no_sync: `model.no_sync()` around forward AND backward of the first K-1 micro-batches (one
  all-reduce per step);
- trainkit_sync_each_batch, trainkit: src/train.py's own loop, train() (the function `python
  src/train.py` runs), called on the same ranks with accumulation=sync_each_batch / no_sync and the
  same model, micro-batch, K and in-memory data. Its time and syncs are read from its metrics.jsonl
  (samples_per_s and comm/grad_syncs of its rows, one per step; gpt: per 4 steps). It also pays its
  per-step bookkeeping: the seeded sampler, the metrics sums, the rows.

The first three share trainkit.parallel.wrap()'s DDP (gradient_as_bucket_view, the counting comm
hook that gives every variant's syncs per optimizer step) and pre-built micro-batches, so only the
placement of no_sync differs; like trainkit's, they start afresh every block. Models, micro-batch
8 (gpt: 32) per rank: mlp (width 2048, depth 4 on 784 features: 14.2M parameters, a 57 MB all-reduce
per sync for ~0.7 GFLOP of compute per micro-batch: communication-bound), resnet18 (32x32, ImageNet
stem: 11.2M parameters, more compute per byte synced) and gpt (trainkit's 2-layer GPT on
data=addition: 0.1M parameters, small syncs, latency-bound). Scaling efficiency (mlp): W-rank
samples/s / (W x one-process samples/s), one process being the same loop without DDP, run by rank 0
while the others wait.

How it is timed: rounds; in each, every variant runs one block (--warmup untimed steps, mlp and
resnet18 2, gpt 4; then --steps timed steps: mlp and resnet18 8, gpt 16), in an order that reverses
every round (ABBA: what drifts during a round hits every variant alike); the first --warmup-rounds
rounds are dropped. A block's time is the median of its steps' (gpt: 4-step units') seconds per
micro-batch (--mean: their mean), by rank 0's clock: CPU time (time.process_time, all its threads;
for trainkit through its meter) on a CPU, wall time on GPUs (--clock). The figures are the rounds'
own pairs: speedup = the baseline's time / the variant's in the same round, the samples/s ratio,
median and quartiles over the rounds; trainkit's no_sync against its own sync_each_batch the same
way, and that over the hand-written loop's (own_vs_hand_written). --pin puts rank r on core r.

What holds on a 2-core machine shared with other jobs (mlp, 2 ranks): wall-clock rounds ranged
0.62-2.03 at load 6-8, CPU-time rounds 1.34-1.69. Three runs with these defaults (load 2-4.5) gave
trainkit's no_sync / sync_each_batch 1.512, 1.479, 1.454, the hand-written loop's 1.522, 1.468, 1.457,
and trainkit's over the hand-written loop's 0.994, 1.008, 0.998. The CPU-time speedup follows the load
(1.30 and 1.41 at load 5.5 and 4.2, one warm-up step, 4 timed): under contention the memory-bound
compute slows more than the all-reduce; the within-run comparison is what holds. Pinning (--pin)
made rounds 4x longer under load: a pinned rank cannot leave a busy core. The gpt variants of
trainkit also load their data per step (the addition problems are encoded and padded per sample,
~6 ms of a ~25 ms step), which the hand-written variants' pre-built micro-batches skip.

One thread per rank (torch.set_num_threads(1)). Prints markdown tables (median seconds per
micro-batch over the rounds, min-max, ratio to baseline, speedup, gradient syncs per optimizer step)
and writes every measurement as JSON to --out (default: bench_accumulation.json in the temp dir).
--quick: one round of one timed step each, the mlp at width 64 (CI; the numbers mean nothing).
"""

import argparse
import contextlib
import io
import itertools
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import open_dict
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import TensorDataset

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "scripts")]  # scripts: tensor_splits as a Hydra _target_
from train import train  # noqa: E402
from trainkit import metrics  # noqa: E402
from trainkit.dist import Dist  # noqa: E402
from trainkit.loading import collate_fn  # noqa: E402
from trainkit.parallel import wrap  # noqa: E402

VARIANTS = {
    "baseline": "baseline (sync every micro-batch)",
    "no_sync_backward_only": "no_sync around backward only",
    "no_sync": "no_sync around forward + backward",
    "trainkit_sync_each_batch": "trainkit, accumulation=sync_each_batch",
    "trainkit": "trainkit, accumulation=no_sync",
}
TRAINKIT = {"trainkit": "no_sync", "trainkit_sync_each_batch": "sync_each_batch"}  # variant: strategy
K = 4  # micro-batches per optimizer step
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


@dataclass(frozen=True)
class Model:
    overrides: tuple[str, ...]  # hydra overrides of conf/train.yaml
    steps: int  # timed optimizer steps per block
    warmup: int = 2  # untimed optimizer steps at the start of every block (trainkit: its first metrics rows)
    unit: int = 1  # optimizer steps per timed unit (trainkit: per metrics row); a block's time is their median


FAKE = ("data=fake", "data.splits._target_=bench_accumulation.tensor_splits", "data.splits.val_size=16")
MODELS = {
    "mlp": Model(
        ("model=mlp", "model.width=2048", "model.depth=4", *FAKE, "data.shape=[1,28,28]", "data.batch_size=8"), 8, 2
    ),
    "resnet18": Model(("model=resnet18", *FAKE, "data.shape=[3,32,32]", "data.batch_size=8"), 8, 2),
    "gpt": Model(("+experiment=addition_gpt", "data.batch_size=32", "data.num_val=16"), 16, 4, 4),
}
SCALING = ("mlp",)  # models that also get the one-process run


def tensor_splits(train_size: int, val_size: int, shape, num_classes: int, test_size: int = 0):
    """data=fake's signature, in memory: random inputs and labels (no per-sample PIL work)."""
    g = torch.Generator().manual_seed(0)

    def split(n):
        return TensorDataset(torch.randn(n, *shape, generator=g), torch.randint(0, num_classes, (n,), generator=g))

    return split(train_size), split(val_size), split(test_size)


QUICK = {"mlp": ("model.width=64",), "resnet18": (), "gpt": ()}  # --quick: a smaller model, the same code


def make_config(
    name: str, warmup: int, steps: int, unit: int, world_size: int, strategy: str = "no_sync", quick: bool = False
):
    """The model's config for trainkit's run: a metrics row every `unit` steps (the first `warmup`
    steps are the warm-up, the others are timed); the same model, data and micro-batch for all variants."""
    overrides = [*MODELS[name].overrides, *(QUICK[name] if quick else ()), f"accumulation.steps={K}"]
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    with open_dict(cfg):
        cfg.trainer.update(max_steps=warmup + steps, log_every=unit, eval_every=warmup + steps)
        cfg.checkpoint.update(every=0, resume=None)
        cfg.accumulation.strategy = strategy
        cfg.parallel.mode = "ddp"
        if "train_size" in cfg.data.splits:  # one epoch per run
            cfg.data.splits.train_size = world_size * cfg.data.batch_size * K * (warmup + steps)
    return cfg


def micro_batches(cfg, d: Dist) -> list:
    """K micro-batches of this rank, collated once, on the device."""
    train_set, *_ = instantiate(cfg.data.splits)  # (train, val, test)
    b = cfg.data.batch_size
    collate = collate_fn(train_set)
    batches = []
    for k in range(K):
        start = (d.rank * K + k) * b
        x, y = collate([train_set[i] for i in range(start, start + b)])
        batches.append((x.to(d.device), y.to(d.device)))
    return batches


def synchronize(d: Dist, barrier: bool) -> None:
    if d.device.type == "cuda":
        torch.cuda.synchronize(d.device)
    if barrier:
        dist.barrier()


class ManualLoop:
    """Variants 1-3 (and, mode=single, the one-process reference), built afresh for every block
    from the same seed, as trainkit's run is. Models kept between blocks went on training on the
    same K micro-batches: the mlp's loss is 0 by step 15, then subnormal gradients (10^5 of its 14M
    by step 55) made a step's CPU time grow by half, and these variants' blocks by 2x against
    trainkit's fresh runs late in a benchmark."""

    def __init__(self, cfg, d: Dist, variant: str, batches, mode: str = "ddp"):
        torch.manual_seed(cfg.seed)
        self.model, self.comm = wrap(instantiate(cfg.model), mode, d)
        self.task = instantiate(cfg.task)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.scale = 1 / (K * cfg.data.batch_size)
        self.d, self.variant, self.batches, self.distributed = d, variant, batches, mode == "ddp"

    def skip_sync(self, k):
        return cast(DDP, self.model).no_sync() if self.distributed and k < K - 1 else contextlib.nullcontext()

    def step(self) -> None:
        model, task, scale = self.model, self.task, self.scale
        for k, (x, y) in enumerate(self.batches):
            if self.variant == "no_sync":
                with self.skip_sync(k):
                    (task.loss_sum(model(x), y) * scale).backward()
            elif self.variant == "no_sync_backward_only":
                loss = task.loss_sum(model(x), y) * scale
                with self.skip_sync(k):
                    loss.backward()
            else:
                (task.loss_sum(model(x), y) * scale).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def block(self, warmup: int, steps: int, unit: int) -> dict:
        """Seconds per micro-batch by both clocks (rank 0's): the median and the mean of the timed
        units of `unit` steps each, after `warmup` untimed steps; syncs per optimizer step."""
        for _ in range(warmup):
            self.step()
        synchronize(self.d, self.distributed)
        syncs, times = self.comm.syncs, {"wall": list[float](), "cpu": list[float]()}
        for _ in range(steps // unit):
            wall, cpu = time.perf_counter(), time.process_time()
            for _ in range(unit):
                self.step()
            times["wall"].append((time.perf_counter() - wall) / (unit * K))
            times["cpu"].append((time.process_time() - cpu) / (unit * K))
        synchronize(self.d, self.distributed)
        return {"syncs_per_step": (self.comm.syncs - syncs) / steps} | block_times(times)


def block_times(times: dict[str, list[float]]) -> dict:
    """A block's seconds per micro-batch per clock: the median of its units (robust to the units a
    preemption hit) and, as `<clock>_mean`, their mean."""
    medians = {clock: statistics.median(t) for clock, t in times.items()}
    return medians | {f"{clock}_mean": statistics.fmean(t) for clock, t in times.items()} | {"units": times}


def timed_rows(rows: list[dict], warmup: int, samples_per_micro_batch: int) -> tuple[list[float], float]:
    """Seconds per micro-batch of each metrics row after the warm-up (its samples / its
    samples_per_s) and syncs per step over them."""
    times, syncs, steps = [], 0.0, 0
    for before, row in itertools.pairwise(rows):
        if "samples_per_s" in row and row["step"] > warmup:
            samples, row_steps = row["samples"] - before["samples"], row["step"] - before["step"]
            times.append(samples / row["samples_per_s"] / (samples / samples_per_micro_batch))
            syncs += row["comm/grad_syncs"] * row_steps
            steps += row_steps
    return times, syncs / steps


def trainkit_loop(cfg, d: Dist, warmup: int, clock: str) -> dict | None:
    """Variants 4-5: src/train.py's train() in a fresh run dir; rank 0 reads its metrics.jsonl."""
    holder = [tempfile.mkdtemp(prefix="bench_accumulation_") if d.is_main else None]
    dist.broadcast_object_list(holder, src=0)
    run_dir = Path(str(holder[0]))
    with contextlib.redirect_stdout(io.StringIO()), metrics.timed_by(CLOCKS[clock]):  # its log lines
        train(cfg, d, "ddp", run_dir)
    result = None
    if d.is_main:
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        shutil.rmtree(run_dir)
        times, syncs = timed_rows(rows, warmup, d.world_size * cfg.data.batch_size)
        result = {"syncs_per_step": syncs} | block_times({clock: times})
    dist.barrier()
    return result


def measure_model(name: str, d: Dist, args) -> list[dict]:
    """Rounds of blocks: every variant runs one block per round, in an order that reverses every
    round (ABBA: what drifts during a round hits every variant alike); the first
    args.warmup_rounds rounds are not kept."""
    model = MODELS[name]
    warmup, steps, unit = (
        (1, 1, 1) if args.quick else (args.warmup or model.warmup, args.steps or model.steps, model.unit)
    )
    configs = {
        v: make_config(name, warmup, steps, unit, d.world_size, strategy, args.quick)
        for v, strategy in TRAINKIT.items()
    }
    batches = micro_batches(configs["trainkit"], d)
    names = list(VARIANTS) + (["one_process"] if name in SCALING else [])
    rows = []
    for r in range(args.warmup_rounds + args.repeats):
        for variant in names if r % 2 == 0 else names[::-1]:
            started = time.perf_counter()
            if variant in TRAINKIT:
                result = trainkit_loop(configs[variant], d, warmup, args.clock)
            elif variant == "one_process":
                single = ManualLoop(configs["trainkit"], d, "baseline", batches, "single") if d.is_main else None
                result = single.block(warmup, steps, unit) if single else None
                dist.barrier()  # the other ranks wait
            else:
                result = ManualLoop(configs["trainkit"], d, variant, batches).block(warmup, steps, unit)
            if d.is_main and result is not None:
                row = {"model": name, "variant": variant, "round": r - args.warmup_rounds, **result}
                row["s_per_micro_batch"] = result[args.clock + ("_mean" if args.mean else "")]
                row["block_s"] = time.perf_counter() - started
                print(
                    f"{name} {variant} round {row['round']}: {row['s_per_micro_batch']:.4f} s per micro-batch "
                    f"({args.clock}), {row['syncs_per_step']:g} syncs per step ({row['block_s']:.1f} s)",
                    file=sys.stderr,
                )
                if r >= args.warmup_rounds:
                    rows.append(row)
    return rows


def worker(rank: int, world_size: int, port: int, args, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if args.pin:  # rank r on core r: both sides of every comparison on the same core
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[rank % len(cores)]})
    cuda = torch.cuda.device_count() >= world_size
    device = torch.device(f"cuda:{rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world_size)
    d = Dist(rank, rank, world_size, device)
    try:
        rows = [row for name in args.models for row in measure_model(name, d, args)]
        if d.is_main:
            Path(out).write_text(json.dumps(rows))
    finally:
        dist.destroy_process_group()


def spread(values: list[float]) -> dict:
    """Median, quartiles and range of per-round figures."""
    low, _, high = statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
    return {"median": statistics.median(values), "q1": low, "q3": high, "min": min(values), "max": max(values)}


def summarize(rows: list[dict]) -> dict:
    """Per model and variant: median, min, max seconds per micro-batch over the rounds, syncs per step
    (the same in every round), and the figures of the rounds' own pairs: ratio (time / the baseline's
    time in the same round, median) and speedup (the baseline's time / its time: the samples/s ratio,
    with its quartiles); trainkit's no_sync against its sync_each_batch the same way (speedup_over_own,
    and own_vs_hand_written: that median / the hand-written no_sync's);
    per scaled model, the efficiency per variant (median of the rounds' one_process / variant time)."""
    summary: dict = {}
    by_round: dict = {}
    for row in rows:
        entry = summary.setdefault(row["model"], {}).setdefault(row["variant"], {"times": [], "syncs": set()})
        entry["times"].append(row["s_per_micro_batch"])
        entry["syncs"].add(row["syncs_per_step"])
        by_round.setdefault(row["model"], {}).setdefault(row["round"], {})[row["variant"]] = row["s_per_micro_batch"]
    for model, variants in summary.items():
        for entry in variants.values():
            times = entry.pop("times")
            entry.update(median=statistics.median(times), min=min(times), max=max(times), repeats=len(times))
            entry["syncs_per_step"] = entry.pop("syncs").pop() if len(entry["syncs"]) == 1 else None
        rounds = list(by_round[model].values())
        single = variants.pop("one_process", None)
        for variant, entry in variants.items():
            entry["ratio"] = statistics.median(t[variant] / t["baseline"] for t in rounds)
            entry["speedup"] = spread([t["baseline"] / t[variant] for t in rounds])
            if single:  # W x b samples in t_W vs b samples in t_1: (W b / t_W) / (W b / t_1)
                entry["scaling_efficiency"] = statistics.median(t["one_process"] / t[variant] for t in rounds)
                entry["one_process_s_per_micro_batch"] = single["median"]
        own = spread([t["trainkit_sync_each_batch"] / t["trainkit"] for t in rounds])
        variants["trainkit"]["speedup_over_own"] = own
        variants["trainkit"]["own_vs_hand_written"] = own["median"] / variants["no_sync"]["speedup"]["median"]
    return summary


def report(summary: dict, world_size: int, device: str, args) -> None:
    print(
        f"\n{world_size} ranks on {device}, K={K} micro-batches per optimizer step, one thread per rank"
        f"{', pinned one core each' if args.pin else ''}; {args.clock} seconds per micro-batch, median of "
        f"{args.repeats} rounds (variants interleaved, ABBA); speedup: the baseline's time / the variant's "
        "in the same round (samples/s ratio), median and quartiles over the rounds\n"
    )
    print("| model | " + " | ".join(VARIANTS) + " |")
    print("|---|" + "---:|" * len(VARIANTS))
    for model, variants in summary.items():
        cells = [f"{variants[v]['median']:.4f} s ({variants[v]['ratio']:.2f})" for v in VARIANTS]
        print(f"| {model} | " + " | ".join(cells) + " |")
    print(
        "\n| model | variant | s / micro-batch (median) | min–max | vs baseline | speedup (quartiles) | syncs / step |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for model, variants in summary.items():
        for v, label in VARIANTS.items():
            e, up = variants[v], variants[v]["speedup"]
            print(
                f"| {model} | {label} | {e['median']:.4f} | {e['min']:.4f}–{e['max']:.4f} | "
                f"{e['ratio']:.2f} | {up['median']:.3f} ({up['q1']:.3f}–{up['q3']:.3f}) | {e['syncs_per_step']:g} |"
            )
    print()
    for model, variants in summary.items():
        hand, own = variants["no_sync"]["speedup"], variants["trainkit"]["speedup_over_own"]
        print(
            f"no_sync / sync every micro-batch, {model} (samples/s): hand-written DDP loop {hand['median']:.3f} "
            f"(quartiles {hand['q1']:.3f}–{hand['q3']:.3f}), trainkit no_sync / sync_each_batch {own['median']:.3f} "
            f"(quartiles {own['q1']:.3f}–{own['q3']:.3f}); trainkit's / the hand-written loop's "
            f"{variants['trainkit']['own_vs_hand_written']:.3f}"
        )
    for model, variants in summary.items():
        if "scaling_efficiency" in variants["baseline"]:
            parts = ", ".join(f"{v} {variants[v]['scaling_efficiency']:.2f}" for v in VARIANTS)
            print(
                f"\nscaling efficiency, {model} ({world_size}-rank samples/s / ({world_size} x one-process, "
                f"{variants['baseline']['one_process_s_per_micro_batch']:.4f} s per micro-batch)): {parts}"
            )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--repeats", type=int, default=8, help="rounds kept: blocks per variant")
    parser.add_argument("--steps", type=int, default=0, help="timed optimizer steps per block (default: per model)")
    parser.add_argument("--warmup", type=int, default=0, help="untimed steps per block (default: per model)")
    parser.add_argument("--warmup-rounds", type=int, default=1, help="rounds run first and not kept")
    parser.add_argument(
        "--clock", choices=["auto", *CLOCKS], default="auto", help="rank 0's CPU or wall time; auto: cpu on CPUs"
    )
    parser.add_argument("--pin", action=argparse.BooleanOptionalAction, default=False, help="rank r on core r")
    parser.add_argument("--mean", action="store_true", help="a block's time: the mean of its units, not the median")
    parser.add_argument("--quick", action="store_true", help="one repeat, one timed step: a smoke test")
    parser.add_argument("--world-size", type=int, default=torch.cuda.device_count() or 2)
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "bench_accumulation.json")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.warmup_rounds = 1, 0
    world_size = args.world_size
    device = "cuda" if torch.cuda.device_count() >= world_size else "cpu"
    if args.clock == "auto":  # on GPUs the host's CPU time is not the step's time
        args.clock = "cpu" if device == "cpu" else "wall"
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "rows.json"
        mp.start_processes(
            worker, args=(world_size, free_port(), args, str(raw)), nprocs=world_size, join=True, start_method="spawn"
        )
        rows = json.loads(raw.read_text())
    summary = summarize(rows)
    report(summary, world_size, device, args)
    settings = {"world_size": world_size, "device": device, "K": K, "repeats": args.repeats, "quick": args.quick}
    settings |= {"clock": args.clock, "pin": args.pin, "warmup_rounds": args.warmup_rounds, "mean": args.mean}
    settings["models"] = {m: {"overrides": list(MODELS[m].overrides), "steps": MODELS[m].steps} for m in args.models}
    args.out.write_text(json.dumps({"settings": settings, "summary": summary, "rows": rows}, indent=1))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
