"""The stall of a checkpoint: how long the training loop is blocked per save, synchronous (checkpoint.async=false:
one torch.save'd file, written and fsynced before the loop goes on) against checkpoint.async=true (DCP's async_save:
the loop waits while the state is copied to host memory, the write runs in a thread), side by side in one run.

For each model, trainkit's Checkpointer saves the state a checkpoint holds in bulk (the model's and AdamW's state:
three times the parameters' bytes) `--saves` times in each mode, alternating, with training steps (forward,
backward, AdamW on random tokens) between saves: async, until its write completed (at least `--steps`). Printed
per model: the bytes a save writes, the median time save() took (the stall) and the ratio sync / async; for
async the time from the save to its commit (polled between steps), the training step's time while a write runs
against without one (what the writing thread costs the loop: on a CPU both share the cores), and the loop's
whole loss per save: the stall plus the steps' slowdown while the write runs (sync: the stall alone).

Models: `gpt100mb` (a GPT of 6 layers, width 576: ~24M parameters, ~96 MB fp32) and `pydoc_gpt`
(+experiment=pydoc_gpt's model: 4 layers, width 128, vocabulary 104, context 64).

    OMP_NUM_THREADS=1 python scripts/bench_checkpoint.py [--models gpt100mb pydoc_gpt] [--saves 5] [--steps 2]
        [--dir /tmp/somewhere] [--device cpu|cuda]
"""

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from trainkit.checkpoint import Checkpointer  # noqa: E402
from trainkit.dist import Dist  # noqa: E402
from trainkit.models.gpt import gpt  # noqa: E402

MODELS = {  # gpt()'s arguments
    "gpt100mb": {"vocab_size": 256, "block_size": 64, "n_layer": 6, "n_head": 8, "n_embd": 576},
    "pydoc_gpt": {"vocab_size": 104, "block_size": 64, "n_layer": 4, "n_head": 4, "n_embd": 128},
}


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, args: dict, device: torch.device) -> float:
    """One training step on random tokens (batch 4); its seconds."""
    began = time.perf_counter()
    x = torch.randint(args["vocab_size"], (4, args["block_size"]), device=device)
    loss = F.cross_entropy(model(x).flatten(0, 1), x.flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - began


def state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, at: int) -> dict:
    """What a checkpoint holds in bulk (checkpoint.snapshot's model and optimizer entries) and a little rest."""
    rest = {"progress": {"step": at}, "ranks": {"rng": torch.get_rng_state()}}
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), **rest}


def measure(name: str, saves: int, steps: int, directory: Path, device: torch.device) -> dict:
    torch.manual_seed(0)
    args = MODELS[name]
    model = gpt(**args).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step(model, optimizer, args, device)  # AdamW's state exists (and the first step's warm-up is behind)
    d = Dist(rank=0, local_rank=0, world_size=1, device=device)
    checkpointers = {
        mode: Checkpointer(directory / name / mode, every=1, keep=1, d=d, background=mode == "async")
        for mode in ("sync", "async")
    }
    stalls: dict[str, list[float]] = {"sync": [], "async": []}
    writes, during, alone = [], [], []
    at = 0
    for _ in range(saves):
        for mode, checkpointer in checkpointers.items():  # alternating: load on the machine hits both alike
            at += 1
            began = time.perf_counter()
            checkpointer.save(at, state(model, optimizer, at))
            stalls[mode].append(time.perf_counter() - began)
            writing = checkpointer.writing
            taken = 0
            while writing is not None and (taken < steps or not writing.committed.is_set()):
                during.append(step(model, optimizer, args, device))  # a step beside the write
                taken += 1
            checkpointer.wait()
            if writing is not None:
                writes.append(time.perf_counter() - began)
            for _ in range(steps if writing is None else 0):
                alone.append(step(model, optimizer, args, device))
    written = sum(p.stat().st_size for p in (directory / name / "sync").rglob("*.pt"))
    return {
        "model": name,
        "params": sum(p.numel() for p in model.parameters()),
        "mb": written / 1e6,
        "sync_s": statistics.median(stalls["sync"]),
        "async_s": statistics.median(stalls["async"]),
        "write_s": statistics.median(writes),
        "step_alone_s": statistics.median(alone) if alone else float("nan"),
        "step_writing_s": statistics.median(during) if during else float("nan"),
        "steps_writing": len(during) / saves,  # steps a write overlapped, per save
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--saves", type=int, default=5, help="saves in each mode, alternating (the median is shown)")
    parser.add_argument("--steps", type=int, default=2, help="training steps after each save (async: at least)")
    parser.add_argument("--dir", type=Path, default=None, help="where the checkpoints go (default: a temporary dir)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", "torch.distributed is disabled")
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        rows = [measure(name, args.saves, args.steps, Path(tmp), device) for name in args.models]
    print(f"checkpoint stall per save on {device} (median of {args.saves}): sync torch.save + fsync vs async_save")
    header = f"{'model':<10} {'params':>8} {'MB':>6} {'sync s':>7} {'async s':>7} {'ratio':>6} | async: {'commit s':>8}"
    print(f"{header} {'step s':>6} {'writing':>7} {'lost s':>6} {'sync/lost':>9}")
    for r in rows:
        lost = r["async_s"] + r["steps_writing"] * (r["step_writing_s"] - r["step_alone_s"])
        print(
            f"{r['model']:<10} {r['params'] / 1e6:>7.2f}M {r['mb']:>6.1f} {r['sync_s']:>7.3f} {r['async_s']:>7.3f} "
            f"{r['sync_s'] / r['async_s']:>5.1f}x |        {r['write_s']:>8.3f} {r['step_alone_s']:>6.3f} "
            f"{r['step_writing_s']:>7.3f} {lost:>6.3f} {r['sync_s'] / lost:>8.1f}x"
        )


if __name__ == "__main__":
    main()
