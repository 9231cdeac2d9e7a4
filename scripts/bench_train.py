"""Training throughput: trainkit's loop (src/train.py's train()) against a plain PyTorch loop,
side by side in one run, on the same model, data, optimizer, clipping and precision.

    OMP_NUM_THREADS=2 .venv/bin/python scripts/bench_train.py [--steps 400] [overrides ...]
    e.g. ... model=cnn data=fake trainer.precision=bf16      (on a GPU: trainer.device=cuda)

trainkit's figure is the samples/s of its last metrics row (log_every = steps / 2), so start-up,
the final evaluation and checkpoint are left out; the plain loop is timed over the same second
half of its steps. The difference is what trainkit adds per step: the sample weights, the
metrics sums, the all-ranks non-finite check (one host sync per step) and the sampler.
"""

import argparse
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
from torch.utils.data import DataLoader

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from train import train  # noqa: E402
from trainkit import dist, schedules  # noqa: E402
from trainkit.precision import autocast_for  # noqa: E402


def plain_loop(cfg, d: dist.Dist, steps: int) -> float:
    """The loop a tutorial would write: shuffle, forward, mean loss, backward, clip, step, schedule."""
    torch.manual_seed(cfg.seed)
    train_set, _ = instantiate(cfg.data.splits)
    model = instantiate(cfg.model).to(d.device)
    optimizer = instantiate(cfg.optim)(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedules.multiplier(cfg.sched, steps))
    loader = DataLoader(train_set, batch_size=cfg.data.batch_size, shuffle=True, num_workers=cfg.data.num_workers)
    autocast = autocast_for(cfg.trainer.precision, d.device)
    max_norm = cfg.trainer.clip_grad_norm or math.inf
    batches, samples, started = iter(loader), 0, 0.0
    for step in range(steps):
        if step == steps // 2:
            if d.device.type == "cuda":
                torch.cuda.synchronize()
            samples, started = 0, time.perf_counter()
        try:
            x, y = next(batches)
        except StopIteration:
            batches = iter(loader)
            x, y = next(batches)
        x, y = x.to(d.device, non_blocking=True), y.to(d.device, non_blocking=True)
        with autocast():
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        samples += len(y)
    if d.device.type == "cuda":
        torch.cuda.synchronize()
    return samples / (time.perf_counter() - started)


def trainkit_loop(cfg, d: dist.Dist, steps: int) -> float:
    with tempfile.TemporaryDirectory() as run_dir:
        train(cfg, d, "single", Path(run_dir))
        rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "samples_per_s" in r][-1]["samples_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=3)
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
    print(
        f"{cfg.model._target_} on {cfg.data.name}, batch {cfg.data.batch_size}, {cfg.trainer.precision}, "
        f"{d.device}, {torch.get_num_threads()} threads; best of {args.repeats}, second half of {args.steps} steps"
    )
    plain, ours = [], []
    for _ in range(args.repeats):  # alternate, so that load on the machine hits both alike
        plain.append(plain_loop(cfg, d, args.steps))
        ours.append(trainkit_loop(cfg, d, args.steps))
    print(f"plain loop   {max(plain):>10,.0f} samples/s")
    print(f"trainkit     {max(ours):>10,.0f} samples/s")
    print(f"ratio trainkit / plain: {max(ours) / max(plain):.2f}")


if __name__ == "__main__":
    main()
