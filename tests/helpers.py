"""Test helpers: run a function on W gloo ranks; run the real entry points as a user would."""
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, result_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, Path(result_dir) / f"{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_distributed(fn, world_size: int = 2, *args):
    """Run fn(rank, world_size, *args) on `world_size` spawned gloo processes (a real process
    group, real collectives); returns the list of per-rank return values. fn must be a
    module-level function (spawn pickles it)."""
    with tempfile.TemporaryDirectory() as result_dir:
        mp.start_processes(_worker, args=(world_size, _free_port(), fn, args, result_dir),
                           nprocs=world_size, join=True, start_method="spawn")
        return [torch.load(Path(result_dir) / f"{r}.pt", weights_only=False) for r in range(world_size)]


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HYDRA_FULL_ERROR="0")
    env.pop("WANDB_API_KEY", None)
    return env


def run_train(run_dir: Path, *overrides: str, nproc: int = 1, script: str = "src/train.py",
              check: bool = True) -> subprocess.CompletedProcess:
    """Run an entry point as a user would: python (nproc=1) or torchrun (nproc>1)."""
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd = [*launcher, str(ROOT / script), f"hydra.run.dir={run_dir}", *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc

