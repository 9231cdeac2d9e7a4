"""Gradient accumulation with DDP: what skipping the sync of K-1 micro-batches saves, and the classic
mistake that saves nothing. The Accelerate guide's benchmark (baseline / no_sync misused / no_sync)
reproduced on this machine: W ranks (2 gloo ranks on CPU; one rank per GPU with nccl when there are
GPUs), every variant interleaved with the others and repeated, in one invocation.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_accumulation.py [--models mlp resnet18 gpt]
        [--repeats 3] [--quick] [--out PATH]

Variants, each K micro-batches per optimizer step, then clip (1.0), AdamW step, zero_grad:

- baseline: plain DDP, forward and backward of every micro-batch synced (K all-reduces per step);
- no_sync_backward_only: forward outside `model.no_sync()`, backward inside it for the first K-1
  micro-batches: the known mistake. DDP arms its reducer in forward, so it still all-reduces K times;
- no_sync: `model.no_sync()` around forward AND backward of the first K-1 micro-batches (one
  all-reduce per step);
- trainkit: src/train.py's own loop, train() (the function `python src/train.py` runs), called on the
  same ranks with accumulation=no_sync and the same model, micro-batch, K and in-memory data. Its time
  and syncs are read from its metrics.jsonl (samples_per_s and comm/grad_syncs of its rows, one every
  2 steps; the first row is the warm-up). It also pays its per-step bookkeeping: the seeded sampler,
  the all-ranks non-finite check (one all-reduce), the metrics sums, a log row every 2 steps.

The first three share trainkit.parallel.wrap()'s DDP (gradient_as_bucket_view, the counting comm
hook that gives every variant's syncs per optimizer step) and pre-built micro-batches, so only the
placement of no_sync differs. Models, micro-batch 8 (gpt: 32) per rank: mlp (width 2048, depth 4 on
784 features: 14.2M parameters, a 57 MB all-reduce per sync for ~0.7 GFLOP of compute per micro-batch:
communication-bound), resnet18 (32x32, ImageNet stem: 11.2M parameters, more compute per byte synced)
and gpt (trainkit's 2-layer GPT on data=addition: 0.1M parameters, small syncs, latency-bound).
Scaling efficiency (mlp): W-rank samples/s / (W x one-process samples/s), one process being the
same loop without DDP, run by rank 0 while the others wait.

One thread per rank (torch.set_num_threads(1)). Prints a markdown table (median seconds per
micro-batch over the repeats, min-max, ratio to baseline, gradient syncs per optimizer step) and
writes every measurement as JSON to --out (default: bench_accumulation.json in the temp dir).
--quick: one repeat of one timed step each (CI; the numbers mean nothing).
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
from trainkit.data import collate_fn  # noqa: E402
from trainkit.dist import Dist  # noqa: E402
from trainkit.parallel import wrap  # noqa: E402

VARIANTS = {
    "baseline": "baseline (sync every micro-batch)",
    "no_sync_backward_only": "no_sync around backward only",
    "no_sync": "no_sync around forward + backward",
    "trainkit": "trainkit (src/train.py)",
}
K = 4  # micro-batches per optimizer step
WARMUP = 2  # untimed optimizer steps first (trainkit: its first metrics row)


@dataclass(frozen=True)
class Model:
    overrides: tuple[str, ...]  # hydra overrides of conf/train.yaml
    steps: int  # timed optimizer steps per measurement


FAKE = ("data=fake", "data.splits._target_=bench_accumulation.tensor_splits", "data.splits.val_size=16")
MODELS = {
    "mlp": Model(
        ("model=mlp", "model.width=2048", "model.depth=4", *FAKE, "data.shape=[1,28,28]", "data.batch_size=8"), 4
    ),
    "resnet18": Model(("model=resnet18", *FAKE, "data.shape=[3,32,32]", "data.batch_size=8"), 4),
    "gpt": Model(("+experiment=addition_gpt", "data.batch_size=32", "data.num_val=16"), 16),
}
SCALING = ("mlp",)  # models that also get the one-process run


def tensor_splits(train_size: int, val_size: int, shape, num_classes: int):
    """data=fake's signature, in memory: random inputs and labels (no per-sample PIL work)."""
    g = torch.Generator().manual_seed(0)

    def split(n):
        return TensorDataset(torch.randn(n, *shape, generator=g), torch.randint(0, num_classes, (n,), generator=g))

    return split(train_size), split(val_size)


def make_config(name: str, warmup: int, steps: int, world_size: int):
    """The model's config for trainkit's run: a metrics row every `warmup` steps (the first one
    is the warm-up, the others are timed); the same model, data and micro-batch for all variants."""
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=[*MODELS[name].overrides, f"accumulation.steps={K}"])
    with open_dict(cfg):
        cfg.trainer.update(max_steps=warmup + steps, log_every=warmup, eval_every=warmup + steps)
        cfg.checkpoint.update(every=0, resume=None)
        cfg.accumulation.strategy = "no_sync"
        cfg.parallel.mode = "ddp"
        if "train_size" in cfg.data.splits:  # one epoch per run
            cfg.data.splits.train_size = world_size * cfg.data.batch_size * K * (warmup + steps)
    return cfg


def micro_batches(cfg, d: Dist) -> list:
    """K micro-batches of this rank, collated once, on the device."""
    train_set, _ = instantiate(cfg.data.splits)
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


def manual_loop(cfg, d: Dist, variant: str, batches, warmup: int, steps: int, mode: str = "ddp") -> dict:
    """Variants 1-3 (and, mode=single, the one-process reference): seconds per micro-batch and
    gradient syncs per optimizer step over `steps` timed steps, after `warmup` steps."""
    torch.manual_seed(cfg.seed)
    model, comm = wrap(instantiate(cfg.model), mode, d)
    task = instantiate(cfg.task)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scale = 1 / (K * cfg.data.batch_size)
    distributed = mode == "ddp"

    def skip_sync(k):
        return cast(DDP, model).no_sync() if distributed and k < K - 1 else contextlib.nullcontext()

    def step():
        for k, (x, y) in enumerate(batches):
            if variant == "no_sync":
                with skip_sync(k):
                    (task.loss_sum(model(x), y) * scale).backward()
            elif variant == "no_sync_backward_only":
                loss = task.loss_sum(model(x), y) * scale
                with skip_sync(k):
                    loss.backward()
            else:
                (task.loss_sum(model(x), y) * scale).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    synchronize(d, distributed)
    syncs, started = comm.syncs, time.perf_counter()
    for _ in range(steps):
        step()
    synchronize(d, distributed)
    elapsed = time.perf_counter() - started
    return {"s_per_micro_batch": elapsed / (steps * K), "syncs_per_step": (comm.syncs - syncs) / steps}


def timed_rows(rows: list[dict], warmup: int, samples_per_micro_batch: int) -> dict:
    """Seconds per micro-batch and syncs per step over the metrics rows after the warm-up: each
    row's time is its samples / its samples_per_s."""
    elapsed = micro = syncs = steps = 0.0
    for before, row in itertools.pairwise(rows):
        if "samples_per_s" in row and row["step"] > warmup:
            samples, row_steps = row["samples"] - before["samples"], row["step"] - before["step"]
            elapsed += samples / row["samples_per_s"]
            micro += samples / samples_per_micro_batch
            syncs += row["comm/grad_syncs"] * row_steps
            steps += row_steps
    return {"s_per_micro_batch": elapsed / micro, "syncs_per_step": syncs / steps}


def trainkit_loop(cfg, d: Dist) -> dict | None:
    """Variant 4: src/train.py's train() in a fresh run dir; rank 0 reads its metrics.jsonl."""
    holder = [tempfile.mkdtemp(prefix="bench_accumulation_") if d.is_main else None]
    dist.broadcast_object_list(holder, src=0)
    run_dir = Path(str(holder[0]))
    with contextlib.redirect_stdout(io.StringIO()):  # its log lines
        train(cfg, d, "ddp", run_dir)
    result = None
    if d.is_main:
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        shutil.rmtree(run_dir)
        result = timed_rows(rows, cfg.trainer.log_every, d.world_size * cfg.data.batch_size)
    dist.barrier()
    return result


def one_process(cfg, d: Dist, batches, warmup: int, steps: int) -> dict | None:
    """The same loop without DDP, on rank 0 alone (the others wait at a barrier)."""
    result = manual_loop(cfg, d, "baseline", batches, warmup, steps, mode="single") if d.is_main else None
    dist.barrier()
    return result


def measure_model(name: str, d: Dist, args) -> list[dict]:
    warmup, steps = (1, 1) if args.quick else (WARMUP, MODELS[name].steps)
    cfg = make_config(name, warmup, steps, d.world_size)
    batches = micro_batches(cfg, d)
    names = list(VARIANTS) + (["one_process"] if name in SCALING else [])
    rows = []
    for repeat in range(args.repeats):
        for variant in names[repeat % len(names) :] + names[: repeat % len(names)]:  # rotate the order
            started = time.perf_counter()
            if variant == "trainkit":
                result = trainkit_loop(cfg, d)
            elif variant == "one_process":
                result = one_process(cfg, d, batches, warmup, steps)
            else:
                result = manual_loop(cfg, d, variant, batches, warmup, steps)
            if d.is_main and result is not None:
                rows.append({"model": name, "variant": variant, "repeat": repeat, **result})
                rows[-1]["wall_s"] = time.perf_counter() - started
                print(
                    f"{name} {variant} #{repeat}: {result['s_per_micro_batch']:.4f} s per micro-batch, "
                    f"{result['syncs_per_step']:g} syncs per step ({rows[-1]['wall_s']:.1f} s)",
                    file=sys.stderr,
                )
    return rows


def worker(rank: int, world_size: int, port: int, args, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
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


def summarize(rows: list[dict]) -> dict:
    """Per model and variant: median, min, max seconds per micro-batch, ratio to the baseline's
    median, syncs per step (the same in every repeat); per scaled model, the efficiency per variant."""
    summary: dict = {}
    for row in rows:
        entry = summary.setdefault(row["model"], {}).setdefault(row["variant"], {"times": [], "syncs": set()})
        entry["times"].append(row["s_per_micro_batch"])
        entry["syncs"].add(row["syncs_per_step"])
    for variants in summary.values():
        for entry in variants.values():
            times = entry.pop("times")
            entry.update(median=statistics.median(times), min=min(times), max=max(times), repeats=len(times))
            entry["syncs_per_step"] = entry.pop("syncs").pop() if len(entry["syncs"]) == 1 else None
        base = variants["baseline"]["median"]
        single = variants.pop("one_process", None)
        for entry in variants.values():
            entry["ratio"] = entry["median"] / base
            if single:  # W x b samples in t_W vs b samples in t_1: (W b / t_W) / (W b / t_1)
                entry["scaling_efficiency"] = single["median"] / entry["median"]
                entry["one_process_s_per_micro_batch"] = single["median"]
    return summary


def report(summary: dict, world_size: int, device: str, args) -> None:
    print(
        f"\n{world_size} ranks on {device}, K={K} micro-batches per optimizer step, one thread per rank; "
        f"seconds per micro-batch, median of {args.repeats} (variants interleaved)\n"
    )
    print("| model | " + " | ".join(VARIANTS) + " |")
    print("|---|" + "---:|" * len(VARIANTS))
    for model, variants in summary.items():
        cells = [f"{variants[v]['median']:.4f} s ({variants[v]['ratio']:.2f})" for v in VARIANTS]
        print(f"| {model} | " + " | ".join(cells) + " |")
    print("\n| model | variant | s / micro-batch (median) | min–max | vs baseline | syncs / step |")
    print("|---|---|---:|---:|---:|---:|")
    for model, variants in summary.items():
        for v, label in VARIANTS.items():
            e = variants[v]
            print(
                f"| {model} | {label} | {e['median']:.4f} | {e['min']:.4f}–{e['max']:.4f} | "
                f"{e['ratio']:.2f} | {e['syncs_per_step']:g} |"
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
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one repeat, one timed step: a smoke test")
    parser.add_argument("--world-size", type=int, default=torch.cuda.device_count() or 2)
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "bench_accumulation.json")
    args = parser.parse_args()
    if args.quick:
        args.repeats = 1
    world_size = args.world_size
    device = "cuda" if torch.cuda.device_count() >= world_size else "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "rows.json"
        mp.start_processes(
            worker, args=(world_size, free_port(), args, str(raw)), nprocs=world_size, join=True, start_method="spawn"
        )
        rows = json.loads(raw.read_text())
    summary = summarize(rows)
    report(summary, world_size, device, args)
    settings = {"world_size": world_size, "device": device, "K": K, "repeats": args.repeats, "quick": args.quick}
    settings["models"] = {m: {"overrides": list(MODELS[m].overrides), "steps": MODELS[m].steps} for m in args.models}
    args.out.write_text(json.dumps({"settings": settings, "summary": summary, "rows": rows}, indent=1))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
