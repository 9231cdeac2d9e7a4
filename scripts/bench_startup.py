"""Start-up: the wall time from a process's start to its first optimizer step, `python src/train.py`
against a plain script that imports torch and builds the same model (the default mlp: 64 -> 128 -> 128 ->
10, AdamW) and steps once on a random batch; alternating, the median of --repeats each.

    .venv/bin/python scripts/bench_startup.py [--repeats 5] [overrides ...]

Each process runs with an optimizer-step hook (torch.optim's global post-hook, installed by a two-line
prelude before the script runs) that prints the seconds since the process started (its start time from
/proc/self/stat) and the process's CPU time (user + system) so far, and ends it at once. On a shared
machine the wall time follows the load (import torch alone took 17 s at load 11 here, 2.2 s of CPU): the CPU
time is the figure that holds. `python -X importtime src/train.py` shows what each import costs.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Seconds since this process started: its start in clock ticks after boot (/proc/self/stat's 22nd field)
# against the machine's uptime, so the interpreter's own start-up counts too.
PRELUDE = """
import os
from torch.optim.optimizer import register_optimizer_step_post_hook
def _first_step(optimizer, args, kwargs):
    start = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
    cpu = os.times().user + os.times().system
    print(f"FIRST_STEP {float(open('/proc/uptime').read().split()[0]) - start:.3f} {cpu:.3f}", flush=True)
    os._exit(0)
register_optimizer_step_post_hook(_first_step)
"""

PLAIN = """
import torch
from torch import nn
model = nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
x, y = torch.randn(32, 1, 8, 8), torch.randint(0, 10, (32,))
nn.functional.cross_entropy(model(x), y).backward()
optimizer.step()
"""


def first_step(code: str, argv: list[str]) -> tuple[float, float]:
    """(wall, CPU) seconds from the start of a fresh `python -c <prelude + code>` to its first optimizer step."""
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), TQDM_DISABLE="1")
    proc = subprocess.run(
        [sys.executable, "-c", PRELUDE + code, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("FIRST_STEP ")]
    if not lines:
        raise SystemExit(f"no optimizer step (exit {proc.returncode}): {(proc.stdout + proc.stderr)[-2000:]}")
    wall, cpu = lines[0].split()[1:]
    return float(wall), float(cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("overrides", nargs="*", help="train.py's overrides (the plain script is the default mlp)")
    args = parser.parse_args()
    train = "import runpy, sys; sys.path.insert(0, 'src'); runpy.run_path('src/train.py', run_name='__main__')"
    times: dict[str, list[tuple[float, float]]] = {"plain script": [], "python src/train.py": []}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for name in sorted(times, reverse=repeat % 2 == 1):  # alternating: drift cancels
                run_dir = f"hydra.run.dir={tmp}/{repeat}"  # a fresh run each time
                code, argv = (PLAIN, []) if name == "plain script" else (train, [run_dir, *args.overrides])
                times[name].append(first_step(code, argv))
    medians = {}
    for name, values in times.items():
        medians[name] = [statistics.median(v[i] for v in values) for i in (0, 1)]
        print(
            f"{name:<22} to the first optimizer step: {medians[name][0]:.2f} s wall, {medians[name][1]:.2f} s CPU "
            f"(medians of {len(values)}; wall {min(v[0] for v in values):.2f}-{max(v[0] for v in values):.2f})"
        )
    (wall, cpu), (plain_wall, plain_cpu) = medians["python src/train.py"], medians["plain script"]
    print(f"difference: {wall - plain_wall:.2f} s wall, {cpu - plain_cpu:.2f} s CPU")


if __name__ == "__main__":
    main()
