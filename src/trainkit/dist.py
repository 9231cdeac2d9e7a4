"""Process group setup and teardown, rank facts, rank-0-first, print0.

Rank 0 is decided once here (`Dist.is_main`, `print0`); no other module asks for the rank.
"""

import contextlib
import ctypes
import datetime
import functools
import os
import random
import re
import sys
import warnings
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist

from trainkit.errors import ConfigError, is_worker, report


@dataclass(frozen=True)
class Dist:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return dist.is_initialized()

    def print0(self, *args, **kwargs) -> None:
        """Print from rank 0 only (the others would repeat every line W times)."""
        if self.is_main:
            print(*args, **kwargs, flush=True)

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    @contextlib.contextmanager
    def rank0_first(self):
        """Rank 0 runs the body first (e.g. downloads data), the others wait, then run it too."""
        if not self.is_main:
            self.barrier()
        try:
            yield
        finally:  # also on error: the others then fail the same way instead of waiting
            if self.is_main:
                self.barrier()

    def broadcast_from_main(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.distributed:
            dist.broadcast(tensor, src=0)
        return tensor

    def gather_object(self, obj) -> list:
        """[obj of rank 0, obj of rank 1, ...] on every rank."""
        if not self.distributed:
            return [obj]
        gathered = [None] * self.world_size
        dist.all_gather_object(gathered, obj)
        return gathered

    def any(self, flag: bool | torch.Tensor) -> bool:
        """True on every rank when the flag is set on any rank (so all ranks take one branch)."""
        return self.any_each(torch.as_tensor(flag).reshape(1))[0]

    def any_each(self, flags: torch.Tensor) -> list[bool]:
        """any() for each of several flags, in one all-reduce."""
        flags = flags.to(device=self.device, dtype=torch.int32)
        if self.distributed:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return [bool(f) for f in flags.tolist()]

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.distributed:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor


def _torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


@dataclass(frozen=True)
class SubmititTask:
    """This task's place in a submitit job (hydra/launcher=submitit_local|slurm: one task per GPU)."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    master_addr: str
    master_port: int


@functools.cache
def submitit_task() -> SubmititTask | None:
    """The submitit job this process is a task of; None under torchrun (its environment wins,
    e.g. torchrun started inside a SLURM job) or outside submitit. submitit is imported only here."""
    if _torchrun() or "SUBMITIT_EXECUTOR" not in os.environ:
        return None
    import submitit

    env = submitit.JobEnvironment()
    # Every task derives the same port from the job id; each job of a sweep (SLURM array task,
    # local controller) has its own id, so concurrent jobs on one node do not meet.
    port = random.Random(env.job_id).randint(20000, 60000)
    per_node = env.num_tasks // env.num_nodes  # submitit's tasks_per_node: the same on every node
    return SubmititTask(env.global_rank, env.local_rank, env.num_tasks, per_node, env.hostnames[0], port)


def launched_distributed() -> bool:
    """Started as one of a job's processes, by torchrun or by submitit."""
    return _torchrun() or submitit_task() is not None


@dataclass(frozen=True)
class Place:
    """This process's place in its job, before any process group exists."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int  # processes on this node


def place() -> Place:
    """From submitit's or torchrun's environment; one process without either."""
    if task := submitit_task():
        return Place(task.rank, task.local_rank, task.world_size, task.local_world_size)
    env = os.environ
    return Place(
        int(env.get("RANK", 0)),
        int(env.get("LOCAL_RANK", 0)),
        int(env.get("WORLD_SIZE", 1)),
        int(env.get("LOCAL_WORLD_SIZE", 1)),
    )


def env_rank() -> int:
    """The rank before any process group exists (for printing errors from rank 0 only)."""
    return place().rank


DEVICES = "auto, cpu, cuda, cuda:<index>"


def resolve_device(spec: str, local_rank: int = 0, local_world_size: int = 1, launched: bool = False) -> torch.device:
    """trainer.device -> this process's device, always with an index on CUDA (torch.cuda.set_device
    refuses a bare "cuda"). auto: cuda when CUDA is present, else cpu. cuda: cuda:<local rank>, one GPU
    per process as torchrun and submitit start them. cuda:N: that GPU, one process only (under a
    launcher every rank would take the same GPU). Raises ConfigError before anything touches CUDA."""
    if spec == "cpu" or (spec == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    match = re.fullmatch(r"cuda(?::(\d+))?", "cuda" if spec == "auto" else spec)
    if match is None:
        raise ConfigError(f"trainer.device={spec} is not one of: {DEVICES}")
    if not torch.cuda.is_available():
        raise ConfigError(
            f"trainer.device={spec}: no CUDA device is visible (torch.cuda.is_available() is false); "
            "use trainer.device=cpu or auto"
        )
    if match[1] is not None and launched:
        raise ConfigError(
            f"trainer.device={spec} under a launcher puts every rank on one GPU; use trainer.device=cuda "
            "(each rank takes cuda:<local rank>)"
        )
    # Every process of a node sees the same count, so all fail together (and rank 0 says why), not
    # only the ranks past the last GPU.
    index = local_rank if match[1] is None else int(match[1])
    needed = max(local_world_size, index + 1) if match[1] is None else index + 1
    if needed > (count := torch.cuda.device_count()):
        wanted = f"{needed} processes on this node" if match[1] is None else f"cuda:{index}"
        raise ConfigError(
            f"trainer.device={spec}: {wanted} but {count} CUDA device(s) visible "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})"
        )
    return torch.device("cuda", index)


def resolve_backend(backend: str, device: torch.device) -> str:
    """parallel.backend: auto picks NCCL for CUDA devices, gloo otherwise; NCCL cannot run on CPU."""
    if backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ConfigError(f"parallel.backend={backend} is not one of: auto, gloo, nccl")
    if backend == "nccl" and device.type != "cuda":
        raise ConfigError(f"parallel.backend=nccl needs a CUDA device, this rank's is {device}; use gloo or auto")
    return backend


def env_world_size() -> int:
    """The job's world size before any process group exists (torchrun's, submitit's, else 1)."""
    return place().world_size


def init(backend: str = "auto", device: str = "auto", timeout_s: float = 600, job: int = 0) -> Dist:
    """Join the job's process group (torchrun's, or a submitit job's; none without either) and
    pick this rank's device. `job`: the job's number in a Hydra sweep (each job builds its own
    process group)."""
    task, me, launched = submitit_task(), place(), launched_distributed()
    if me.rank != 0:  # Python warnings once, from rank 0, not once per rank
        warnings.simplefilter("ignore")
    here = resolve_device(device, me.local_rank, me.local_world_size, launched)
    backend = resolve_backend(backend, here)  # checked, as the device, before the first CUDA call
    if here.type == "cuda":
        torch.cuda.set_device(here)  # NCCL, DDP and FSDP's device mesh use the current device
    if launched:
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(
            backend,
            init_method=f"tcp://{task.master_addr}:{task.master_port}" if task else None,
            store=None if task else _store(me.world_size, timeout, job),
            rank=me.rank,
            world_size=me.world_size,
            timeout=timeout,
            device_id=here if here.type == "cuda" else None,
        )
    return Dist(me.rank, me.local_rank, me.world_size, here)


def _store(world_size: int, timeout: datetime.timedelta, job: int) -> dist.Store | None:
    """torchrun's own store, under a prefix for this restart round and sweep job, or None
    (env:// default).

    torchrun --max-restarts keeps its store across restart rounds, and a Hydra sweep under
    torchrun builds one process group per job in the same workers. A process group that meets
    the keys of an earlier one fails with "Gloo connectFullMesh failed" (torch 2.14.1). A fresh
    prefix per round (TORCHELASTIC_RESTART_COUNT) and per job keeps them apart, and the launch's run
    id two launches that would share one store.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False, timeout=timeout
    )
    run = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    return dist.PrefixStore(f"{run}/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/job_{job}", store)


def lost_peer(error: BaseException) -> bool:
    """Did a collective fail because another rank died or stopped answering? (gloo and NCCL
    raise DistBackendError, or a RuntimeError naming themselves from inside autograd.)"""
    text = str(error).lower()
    return dist.is_initialized() and (isinstance(error, dist.DistError) or "gloo" in text or "nccl" in text)


def teardown(finished: bool = False) -> None:
    """Destroy the process group. `finished`: every rank completed the run (not on error paths:
    a rank that died or hangs would hold the others in the barrier for the whole timeout).

    A finished run ends with a barrier whose handle is kept until the process is gone. gloo's
    worker threads outlive destroy_process_group (FSDP's DeviceMesh, cached by DTensor, keeps the
    backend) and free a collective's tensors after waking its caller; freeing a tensor Python has
    seen takes the GIL, and a thread asking for it while the interpreter finalizes is ended by
    CPython 3.11 with pthread_exit, whose unwinding through the noexcept Work destructor calls
    std::terminate ("terminate called without an active exception", SIGABRT, after "done:").
    The barrier is the last collective and refers to every collective still held by a worker
    thread, so none of them is freed while its handle lives.
    """
    if dist.is_initialized():
        if finished:
            last = dist.barrier(async_op=True)
            last.wait()
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(last))  # never freed, not even at exit
        dist.destroy_process_group()


def fail(message: str, code: int = 2, this_rank: bool = False, peer_failed: bool = False) -> NoReturn:
    """Exit with a one-line error printed by rank 0 (the others exit quietly); `this_rank`: an error
    only this rank knows, printed by it and naming it. In a worker trainkit started itself every rank
    reports to the parent instead (`peer_failed`: a consequence of another rank's failure), which
    prints the root cause once: a rank dying here may otherwise print before the rank that knows why."""
    rank = env_rank()
    line = f"rank {rank}: {message}" if rank and this_rank else message
    if is_worker():
        report(line, code, peer_failed)
    elif rank == 0 or this_rank:
        print(f"error: {line}", file=sys.stderr, flush=True)
    teardown()
    sys.exit(code)
