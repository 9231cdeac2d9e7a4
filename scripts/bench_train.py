"""Training throughput: trainkit's loop (src/train.py's train()) against a plain PyTorch loop,
side by side in one run, on the same model, data, optimizer, clipping and precision.

    OMP_NUM_THREADS=2 .venv/bin/python scripts/bench_train.py [--steps 400] [overrides ...]
    e.g. ... model=cnn data=fake trainer.precision=bf16      (on a GPU: trainer.device=cuda)
    ... --compile model=cnn: also trainkit with trainer.compile=true (the compiled steps are timed
        after the first half: compilation is left out)
    OMP_NUM_THREADS=1 torchrun --nproc_per_node=2 scripts/bench_train.py accumulation.steps=4
        (2-rank DDP: trainkit's loop against a plain DDP loop with the same no_sync accumulation)

trainkit's figure is the samples/s of its last metrics row (log_every = steps / 2), so start-up,
the final evaluation and checkpoint are left out; the plain loop is timed over the same second
half of its steps. The difference is what trainkit adds per step: the sampler without padding,
the per-sample seeds (for a data set that draws only: none for the default's in-memory digits),
the metrics sums and the exact loss normalisation.
"""

import argparse
import contextlib
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from train import train  # noqa: E402
from trainkit import config, dist, schedules  # noqa: E402
from trainkit.precision import autocast_for  # noqa: E402


def plain_loop(cfg, d: dist.Dist, steps: int) -> float:
    """The loop a tutorial would write: shuffle, forward, mean loss, backward, clip, step, schedule;
    under torchrun DDP with DistributedSampler and no_sync() around the first K-1 micro-batches."""
    torch.manual_seed(cfg.seed)
    train_set, _ = instantiate(cfg.data.splits)
    model = instantiate(cfg.model).to(d.device)
    if d.distributed:
        model = DDP(model, device_ids=[d.device.index] if d.device.type == "cuda" else None)
    optimizer = instantiate(cfg.optim)(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedules.multiplier(cfg.sched, steps))
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
            samples, started = 0, time.perf_counter()
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
                    loss = F.cross_entropy(model(x), y) / K
                loss.backward()
            samples += len(y) * d.world_size
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    if d.device.type == "cuda":
        torch.cuda.synchronize()
    return samples / (time.perf_counter() - started)


def trainkit_loop(cfg, d: dist.Dist, steps: int) -> float:
    """train() itself; its last row's samples/s (all ranks), read back from rank 0's metrics."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(d.gather_object(tmp)[0])  # rank 0's dir: it alone writes metrics.jsonl
        train(cfg, d, "ddp" if d.distributed else "single", run_dir)
        rate = 0.0
        if d.is_main:
            rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            rate = [r for r in rows if "samples_per_s" in r][-1]["samples_per_s"]
        d.barrier()  # rank 0 reads before any rank's TemporaryDirectory goes
        return d.gather_object(rate)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="also trainkit with trainer.compile=true")
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
    d = dist.init("auto", cfg.trainer.device)
    d.print0(
        f"{cfg.model._target_} on {cfg.data.name}, batch {cfg.data.batch_size}, {cfg.trainer.precision}, "
        f"{d.device}, {torch.get_num_threads()} threads, {d.world_size} rank(s), "
        f"K={config.accumulation_steps(cfg, d.world_size)}; "
        f"best of {args.repeats}, second half of {args.steps} steps"
    )
    plain, ours, compiled = [], [], []
    for _ in range(args.repeats):  # alternate, so that load on the machine hits both alike
        plain.append(plain_loop(cfg, d, args.steps))
        ours.append(trainkit_loop(cfg, d, args.steps))
        if args.compile:
            compiled.append(trainkit_loop(OmegaConf.merge(cfg, {"trainer": {"compile": True}}), d, args.steps))
    d.print0(f"plain loop   {max(plain):>10,.0f} samples/s")
    d.print0(f"trainkit     {max(ours):>10,.0f} samples/s")
    d.print0(f"ratio trainkit / plain: {max(ours) / max(plain):.2f}")
    if compiled:
        d.print0(
            f"trainkit, trainer.compile=true {max(compiled):>10,.0f} samples/s: {max(compiled) / max(ours):.2f}x eager"
        )
    dist.teardown(finished=True)


if __name__ == "__main__":
    main()
