"""What freezing buys: the step time and the gradient bytes of a linear probe (the encoder frozen by
optim.groups) against full training of the same model, side by side in one run, as ratios.

Each variant is trainkit's own run (`python src/train.py parallel.nproc_per_node=2 ...`: two gloo workers, so
the gradients are really all-reduced), the variants interleaved in rounds so that load on the machine hits both
alike. A step's time is the global batch over the rows' samples/s (training time only: start-up and evaluation
left out), `comm/grad_bytes` is what DDP reduced per step. The model is random (no parent): the cost of a step
does not depend on where its weights came from.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_finetune.py [--rounds 3] [--steps 120] [--nproc 2] [overrides ...]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = ["model=simclr_probe", "data=digits"]  # SimCLR's conv encoder and a linear classifier on digits
VARIANTS = {
    "full": [],
    "probe": ['optim.groups=[{params: "encoder.*", frozen: true}]'],
}


def run(variant: str, run_dir: Path, args: argparse.Namespace) -> dict:
    """One trainkit run of the variant; its step time (median over rows after the first) and grad bytes."""
    cmd = [
        sys.executable,
        str(ROOT / "src" / "train.py"),
        f"hydra.run.dir={run_dir}",
        *MODEL,
        f"trainer.max_steps={args.steps}",
        f"trainer.log_every={args.every}",
        "trainer.eval_every=100000",  # evaluation only at the end, outside the timed steps
        "trainer.test=false",
        "checkpoint.every=0",
        *([f"parallel.nproc_per_node={args.nproc}"] if args.nproc > 1 else []),
        *VARIANTS[variant],
        *args.overrides,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [row for row in rows if "samples_per_s" in row]
    timed = rows[1:] or rows  # the first row holds the first steps' one-off costs
    global_batch = rows[0]["samples"] / rows[0]["step"]
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").is_file() else {}
    return {
        "step_ms": 1000 * statistics.median(global_batch / row["samples_per_s"] for row in timed),
        "grad_bytes": statistics.median(row["comm/grad_bytes"] for row in timed),
        "trainable": summary.get("params_trainable"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of both variants, interleaved")
    parser.add_argument("--steps", type=int, default=120, help="optimizer steps a run")
    parser.add_argument("--every", type=int, default=10, help="steps a row (the step times' sample)")
    parser.add_argument("--nproc", type=int, default=2, help="ranks (1: no gradient sync)")
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    parser.add_argument("overrides", nargs="*", help="train.py overrides for both variants (e.g. data.batch_size=64)")
    args = parser.parse_args()
    results: dict[str, list[dict]] = {variant: [] for variant in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            for variant in VARIANTS if i % 2 == 0 else reversed(VARIANTS):  # ABBA: neither always goes first
                results[variant].append(run(variant, Path(tmp) / f"{variant}{i}", args))
                print(
                    f"round {i + 1}/{args.rounds} {variant}: {results[variant][-1]['step_ms']:.2f} ms/step", flush=True
                )
    figures = {
        variant: {
            "step_ms": statistics.median(r["step_ms"] for r in runs),
            "grad_bytes": runs[0]["grad_bytes"],
            "trainable": runs[0]["trainable"],
            "step_ms_runs": [r["step_ms"] for r in runs],
        }
        for variant, runs in results.items()
    }
    full, probe = figures["full"], figures["probe"]
    ratios = {
        "step_time": probe["step_ms"] / full["step_ms"],
        "grad_bytes": probe["grad_bytes"] / full["grad_bytes"] if full["grad_bytes"] else None,
    }
    print(f"\n{' '.join(MODEL + args.overrides)}, {args.nproc} rank(s), {args.steps} steps x {args.rounds} rounds")
    print("| variant | trainable parameters | ms/step (median of rounds) | grad bytes/step |")
    print("|---|---|---|---|")
    for variant, fig in figures.items():
        print(f"| {variant} | {fig['trainable']:,} | {fig['step_ms']:.2f} | {fig['grad_bytes']:,.0f} |")
    said = f"{ratios['grad_bytes']:.4f}" if ratios["grad_bytes"] is not None else "n/a (one rank: nothing reduced)"
    print(f"ratio probe / full: step time {ratios['step_time']:.3f}, grad bytes {said}")
    if args.out:
        args.out.write_text(json.dumps({"figures": figures, "ratios": ratios, "settings": vars(args) | {"out": None}}))


if __name__ == "__main__":
    main()
