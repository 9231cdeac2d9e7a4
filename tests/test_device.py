"""trainer.device and the CUDA-only decisions that follow from it, tested on a machine without a GPU.

Device resolution is plain logic: only torch.cuda's availability and device count are patched.
What needs a real GPU (set_device, NCCL, torch's SyncBN, bf16 FSDP) runs in scripts/gpu_check.sh.
"""

import io
import random
from functools import partial

import numpy as np
import pytest
import torch

from helpers import run_train, together
from trainkit import dist
from trainkit.config import ConfigError
from trainkit.dist import Dist, Place, resolve_backend, resolve_device
from trainkit.loading import InMemory, TrainLoader, eval_loader
from trainkit.parallel import mixed_precision
from trainkit.rng import rng_state, seed_all, set_rng_state

CPU, CUDA1 = torch.device("cpu"), torch.device("cuda", 1)


@pytest.fixture
def gpus(monkeypatch):
    """gpus(n): this process sees n CUDA devices (0: no CUDA)."""

    def see(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)

    return see


def test_without_cuda_auto_and_cpu_are_the_cpu_and_cuda_is_refused(gpus):
    gpus(0)
    assert resolve_device("auto") == resolve_device("cpu") == CPU
    for spec in ("cuda", "cuda:0"):
        with pytest.raises(ConfigError, match=f"trainer.device={spec}: no CUDA device is visible"):
            resolve_device(spec)


@pytest.mark.parametrize("spec", ["gpu", "CUDA", "cuda:", "cuda:x", "cuda:-1", "cuda:0:1", "mps", ""])
def test_any_other_device_string_names_the_accepted_forms(gpus, spec):
    gpus(2)
    with pytest.raises(ConfigError, match=f"^trainer.device={spec} is not one of: auto, cpu, cuda, cuda:<index>$"):
        resolve_device(spec)


def test_cuda_is_the_local_ranks_gpu_always_with_an_index(gpus):
    gpus(4)  # torch.cuda.set_device and DDP's device_ids need the index
    assert resolve_device("cuda") == resolve_device("auto") == torch.device("cuda", 0)
    assert resolve_device("cuda", local_rank=3, local_world_size=4, launched=True) == torch.device("cuda", 3)
    assert resolve_device("auto", local_rank=1, local_world_size=4, launched=True) == CUDA1


def test_cuda_n_is_honoured_in_one_process_and_refused_under_a_launcher(gpus):
    gpus(2)
    assert resolve_device("cuda:1") == CUDA1
    with pytest.raises(ConfigError, match="trainer.device=cuda:1 under a launcher puts every rank on one GPU"):
        resolve_device("cuda:1", local_rank=1, local_world_size=2, launched=True)
    with pytest.raises(ConfigError, match=r"trainer.device=cuda:2: cuda:2 but 2 CUDA device\(s\) visible"):
        resolve_device("cuda:2")


def test_more_processes_on_a_node_than_gpus_fails_on_every_rank_alike(gpus):
    gpus(2)
    for local_rank in range(4):  # rank 0 too, so it can say why
        with pytest.raises(ConfigError, match=r"4 processes on this node but 2 CUDA device\(s\) visible"):
            resolve_device("cuda", local_rank, local_world_size=4, launched=True)


def test_backend_follows_the_device_and_nccl_needs_cuda():
    assert resolve_backend("auto", torch.device("cuda", 0)) == "nccl"
    assert resolve_backend("auto", CPU) == "gloo"
    assert resolve_backend("gloo", CUDA1) == "gloo"  # gloo also reduces CUDA tensors
    with pytest.raises(ConfigError, match="parallel.backend=nccl needs a CUDA device"):
        resolve_backend("nccl", CPU)
    with pytest.raises(ConfigError, match="parallel.backend=mpi is not one of: auto, gloo, nccl"):
        resolve_backend("mpi", CPU)


# Task 3 of a 2-node x 2-task job: global rank 3, local rank 1 (what submitit's own JobEnvironment reads).
SUBMITIT_ENVS = {
    "slurm": {
        "SLURM_JOB_ID": "4242",
        "SLURM_NTASKS": "4",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_NODEID": "1",
        "SLURM_PROCID": "3",
        "SLURM_LOCALID": "1",
        "SLURM_JOB_NODELIST": "gpu[07-08]",
    },
    "local": {
        "SUBMITIT_LOCAL_JOB_ID": "4242",
        "SUBMITIT_LOCAL_NTASKS": "4",
        "SUBMITIT_LOCAL_JOB_NUM_NODES": "2",
        "SUBMITIT_LOCAL_NODEID": "1",
        "SUBMITIT_LOCAL_GLOBALID": "3",
        "SUBMITIT_LOCAL_LOCALID": "1",
    },
}


@pytest.fixture
def submitit_env(monkeypatch):
    def enter(executor: str) -> None:
        for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):  # not under torchrun
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("SUBMITIT_EXECUTOR", executor)
        for name, value in SUBMITIT_ENVS[executor].items():
            monkeypatch.setenv(name, value)
        dist.submitit_task.cache_clear()

    yield enter
    dist.submitit_task.cache_clear()  # the next test reads its own environment


@pytest.mark.parametrize("executor", SUBMITIT_ENVS)
def test_submitit_global_rank_joins_the_group_and_local_rank_picks_the_gpu(submitit_env, gpus, executor):
    submitit_env(executor)
    gpus(2)
    me = dist.place()
    assert me == Place(rank=3, local_rank=1, world_size=4, local_world_size=2)
    assert dist.env_rank() == 3 and dist.launched_distributed()
    assert resolve_device("cuda", me.local_rank, me.local_world_size, launched=True) == CUDA1
    if executor == "slurm":  # every task meets at the first node of the job
        assert dist.submitit_task().master_addr == "gpu07"


def test_torchrun_environment_wins_over_submitit(submitit_env, monkeypatch):
    submitit_env("slurm")
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "8")
    dist.submitit_task.cache_clear()
    assert dist.submitit_task() is None
    assert dist.place() == Place(rank=5, local_rank=0, world_size=8, local_world_size=1)


def _loaders(device: torch.device, pin_memory: bool = True):
    data = InMemory(torch.randn(8, 3), torch.arange(8))
    d = Dist(rank=0, local_rank=0, world_size=1, device=device)  # building a loader touches no device
    train = TrainLoader(data, d, batch_size=4, num_workers=0, seed=0, micro_batches=2, pin_memory=pin_memory)
    return train.loader.pin_memory, eval_loader(data, d, batch_size=4, num_workers=0).pin_memory


def test_batches_are_pinned_for_a_gpu_only():
    assert _loaders(torch.device("cuda", 0)) == (True, True)
    assert _loaders(torch.device("cuda", 0), pin_memory=False)[0] is False  # data.pin_memory=false
    assert _loaders(CPU) == (False, False)  # pinning would only cost time on a CPU


def test_fsdp_computes_in_bf16_parameters_on_cuda_only():
    assert mixed_precision("bf16", torch.device("cuda", 0)).param_dtype == torch.bfloat16
    assert mixed_precision("bf16", CPU).param_dtype is None  # autocast alone: gloo on CPU
    assert mixed_precision("fp32", torch.device("cuda", 0)).param_dtype is None
    assert mixed_precision("bf16", torch.device("cuda", 0)).reduce_dtype == torch.float32  # gradients reduced in fp32
    assert mixed_precision("bf16", CPU, "bf16").reduce_dtype == torch.bfloat16


def _draws() -> list:
    return [random.random(), np.random.rand(), torch.rand(()).item()]


def test_rng_state_round_trip_on_a_cpu_rank():
    seed_all(0, cuda=False)
    state = rng_state(CPU)
    assert state["cuda"] == []
    buffer = io.BytesIO()
    torch.save(state, buffer)
    expected = _draws()
    loaded = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)  # what a checkpoint gives back
    set_rng_state(loaded, CPU)
    assert _draws() == expected
    # A GPU run's state resumed on a CPU: its CUDA entry is left alone, the rest restored.
    set_rng_state(dict(loaded, cuda=[torch.zeros(16, dtype=torch.uint8)]), CPU)
    assert _draws() == expected


@pytest.mark.slow
def test_a_bad_or_unavailable_device_is_one_line_exit_2_and_no_run_dir(tmp_path):
    cases = {"gpu": "trainer.device=gpu is not one of: auto, cpu, cuda, cuda:<index>"}
    if not torch.cuda.is_available():  # on a GPU machine trainer.device=cuda trains (gpu_check.sh runs it)
        cases["cuda"] = (
            "trainer.device=cuda: no CUDA device is visible (torch.cuda.is_available() is false); "
            "use trainer.device=cpu or auto"
        )
    procs = together(
        *(
            partial(run_train, tmp_path / spec, f"trainer.device={spec}", "trainer.max_steps=2", check=False)
            for spec in cases
        )
    )
    for proc, (spec, message) in zip(procs, cases.items(), strict=True):
        run_dir = tmp_path / spec
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.strip().splitlines() == [f"error: {message}"], proc.stderr
        assert not run_dir.exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: scripts/gpu_check.sh runs it")
def test_cuda_rng_state_is_the_own_devices_and_round_trips():
    device = torch.device("cuda", torch.cuda.device_count() - 1)  # not cuda:0 where there are several
    state = rng_state(device)
    assert len(state["cuda"]) == 1  # not every visible GPU's: a resume may see fewer
    expected = torch.rand(4, device=device)
    set_rng_state(state, device)
    assert torch.equal(torch.rand(4, device=device), expected)
