"""How far apart two or more runs' weights are, step by step: the first run against each other one, at every step
where both kept a checkpoint (and at the end: model.pt).

    python scripts/compare_runs.py RUN_DIR OTHER_RUN_DIR [...]
    e.g. after  python src/train.py +experiment=digits_simclr checkpoint.every=10 checkpoint.keep=40
                ... parallel.nproc_per_node=2 accumulation.steps=2 (the same, another hydra.run.dir)

Prints max |difference| over all parameters and buffers per step: where two allocations of the same global
batch part, and how fast. Checkpoints written by FSDP (a directory per step) are not read: compare model.pt.
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from trainkit.checkpoint import parse_step  # noqa: E402  (the checkpoints' one name/parse pair)


def checkpoints(run: Path) -> dict[int | str, Path]:
    """step -> the run's checkpoint file holding the model's weights; "end" -> model.pt."""
    found: dict[int | str, Path] = {}
    for path in (run / "checkpoints").glob("*"):
        if (step := parse_step(path.name, sharded=False)) is not None and path.is_file():
            found[step] = path
    if (run / "model.pt").is_file():
        found["end"] = run / "model.pt"
    return found


def weights(path: Path) -> dict[str, torch.Tensor]:
    state = torch.load(path, map_location="cpu", weights_only=False)
    state = state.get("model", state)
    return {key.removeprefix("module."): value for key, value in state.items()}


def max_difference(a: dict, b: dict) -> float:
    if a.keys() != b.keys():
        raise SystemExit(f"error: the runs' models differ: {sorted(a.keys() ^ b.keys())[:5]} ...")
    return max(((a[key].double() - b[key].double()).abs().max().item() for key in a), default=0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories; the first is the reference")
    args = parser.parse_args()
    if len(args.runs) < 2:
        parser.error("give at least two run directories")
    found = [checkpoints(run) for run in args.runs]
    for run, each in zip(args.runs, found, strict=True):
        if not each:
            raise SystemExit(f"error: {run} holds no checkpoints/step_*.pt and no model.pt")
    steps = sorted((s for s in found[0] if isinstance(s, int)), key=int) + (["end"] if "end" in found[0] else [])
    print(f"{'step':>5} " + " ".join(f"{run.name[-14:]:>14}" for run in args.runs[1:]))
    for step in steps:
        reference = weights(found[0][step])
        row = [
            f"{max_difference(reference, weights(each[step])):14.2e}" if step in each else f"{'-':>14}"
            for each in found[1:]
        ]
        print(f"{step:>5} " + " ".join(row))


if __name__ == "__main__":
    main()
