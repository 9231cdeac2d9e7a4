"""Start-up cost of `python src/train.py parallel.nproc_per_node=2`: torch's elastic agent starting two
workers by fork or by spawn (TRAINKIT_START_METHOD), against one process and against torchrun. Each
command's seconds from its start to its first optimizer step (trainer.log_every=1: the first step line)
and to its end; the median of --repeats runs, the variants interleaved.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_launch.py [overrides ...] [--repeats 3] [--variants ...]
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAIN = str(ROOT / "src" / "train.py")
VARIANTS = {  # name: (command, environment)
    "plain": ([TRAIN], {}),
    "fork": ([TRAIN, "parallel.nproc_per_node=2"], {"TRAINKIT_START_METHOD": "fork"}),
    "spawn": ([TRAIN, "parallel.nproc_per_node=2"], {"TRAINKIT_START_METHOD": "spawn"}),
    "torchrun": (["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", TRAIN], {}),
}


def timed(command: list[str], env: dict, run_dir: Path, overrides: list[str]) -> tuple[float, float]:
    """(seconds to the first step line, seconds to the end) of one run."""
    cmd = [sys.executable, *command, f"hydra.run.dir={run_dir}", "trainer.log_every=1", *overrides]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **env}, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    first = None
    for line in proc.stdout:
        if first is None and line.startswith("step"):
            first = time.perf_counter() - start
    if proc.wait() != 0 or first is None:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode})")
    return first, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    args, overrides = parser.parse_known_args()
    overrides = overrides or ["trainer.max_steps=20"]
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in args.variants}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for name in args.variants:
                command, env = VARIANTS[name]
                times[name].append(timed(command, env, Path(tmp) / f"{name}_{repeat}", overrides))
    base = statistics.median(first for first, _ in times[args.variants[0]])
    print(f"| command ({' '.join(overrides)}) | to the first step (s) | vs {args.variants[0]} | to the end (s) |")
    print("|---|---:|---:|---:|")
    for name, runs in times.items():
        first, end = (statistics.median(column) for column in zip(*runs, strict=True))
        print(f"| {name} | {first:.1f} | {first - base:+.1f} | {end:.1f} |")


if __name__ == "__main__":
    main()
