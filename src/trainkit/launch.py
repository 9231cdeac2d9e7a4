"""`python src/train.py parallel.nproc_per_node=N`: this process starts its N local workers itself.

The engine is torchrun's: torch's elastic agent, called as a library (`elastic_launch`), with a
c10d rendezvous on a free localhost port of its own for every launch (the jobs of a sweep never
meet). Each worker runs the job with the config this process composed and checked and with its run
dir: nothing re-parses sys.argv (re-executing the script, as Lightning does, breaks Hydra's multirun)
and no worker makes a run dir of its own. A worker's failure comes back through torch's error files
as one line, printed here once; `parallel.max_restarts` restarts the group after a death, and the
restarted group continues the run (see start).
"""

import contextlib
import copy
import ctypes
import json
import logging
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
from omegaconf import DictConfig

from trainkit import dist, stop
from trainkit.checkpoint import complete
from trainkit.errors import WORKER, ConfigError, RunError, Stopped, is_worker
from trainkit.parallel import resolve_mode

PR_SET_PDEATHSIG = 1  # linux/prctl.h
# Those the elastic agent handles: it ends the workers with the signal it got (SIGKILL 30 s later).
AGENT_ENDS = (signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
# Those this process forwards to the workers itself (_forward) and waits: they stop at a step boundary after
# its checkpoint (trainkit/stop.py), or finish a run that came past its last step. The agent's SIGKILL could
# cut a long final test pass or the write of model.pt.
FORWARDED = stop.SIGNALS


def start_method() -> str:
    """fork: a worker starts in well under a second with torch, trainkit and the composed config already
    in memory; spawn imports them anew in each worker (seconds; docs/launching.md, "Start method: fork").
    Safe: nothing here initialises CUDA before the workers start (device_count asks NVML; see
    _launch_config), and a forked worker computes with one intra-op thread (torchrun's default): at more,
    an OpenMP pool this process has used (a sweep's job trained here) hangs its first parallel op.
    OMP_NUM_THREADS > 1 asks for more threads: spawn. TRAINKIT_START_METHOD chooses (e.g. to rule fork out)."""
    one_thread = os.environ.get("OMP_NUM_THREADS", "1") == "1"
    return os.environ.get("TRAINKIT_START_METHOD") or ("fork" if one_thread else "spawn")


def local_workers(cfg: DictConfig) -> int:
    """parallel.nproc_per_node as a number: null 1, auto the visible CUDA devices (1 without CUDA)."""
    n = cfg.parallel.nproc_per_node
    if n is None:
        return 1
    if n == "auto":  # device_count asks NVML: CUDA stays uninitialised in this process (fork is safe)
        return max(1, torch.cuda.device_count())
    return int(n)


def world_size(cfg: DictConfig) -> int:
    """The job's world size: the launcher's (torchrun, submitit, or this module for its workers), else
    the workers this process is about to start."""
    return dist.env_world_size() if dist.launched_distributed() else local_workers(cfg)


def wanted(cfg: DictConfig) -> bool:
    """Start workers here: N > 1 and no launcher has started this process."""
    return not dist.launched_distributed() and local_workers(cfg) > 1


def check(cfg: DictConfig) -> None:
    """parallel.nproc_per_node and parallel.max_restarts: their values, and no contradiction with a launcher."""
    n, restarts = cfg.parallel.nproc_per_node, cfg.parallel.max_restarts
    if n is not None and n != "auto" and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        raise ConfigError(f"parallel.nproc_per_node={n} must be null, a positive integer or auto")
    if not isinstance(restarts, int) or restarts < 0:
        raise ConfigError(f"parallel.max_restarts={restarts} must be an integer >= 0")
    if dist.launched_distributed() and not is_worker():
        launcher = "submitit" if dist.submitit_task() else "torchrun"
        here = dist.place().local_world_size
        if isinstance(n, int) and n != here:
            raise ConfigError(
                f"parallel.nproc_per_node={n} contradicts {launcher}, which started {here} process(es) on this "
                "node; leave it null (or auto) under a launcher"
            )
        if restarts:
            raise ConfigError(
                f"parallel.max_restarts={restarts} restarts the workers trainkit starts itself; under {launcher} "
                "its own setting does (torchrun --max-restarts=N)"
            )
    elif restarts and local_workers(cfg) < 2:
        raise ConfigError(
            f"parallel.max_restarts={restarts} restarts the workers this process starts: it needs "
            "parallel.nproc_per_node > 1"
        )
    if wanted(cfg):  # before any worker starts: e.g. parallel=single on N workers
        resolve_mode(cfg.parallel.mode, local_workers(cfg), True)


class WorkersFailed(Exception):
    """The workers' root cause, as the one line to print (or to record in a sweep's job dir)."""

    def __init__(self, error: ConfigError | RunError, code: int):
        super().__init__(str(error))
        self.error, self.code = error, code


def start(cfg: DictConfig, run_dir: Path, job: int, entry: Callable[..., Any]) -> Any:
    """Run entry(cfg, run_dir, job) on N local workers under torch's elastic agent; rank 0's return value.
    Raises WorkersFailed with the root cause when the group failed (after parallel.max_restarts restarts).

    The restarts are this loop's, not the agent's (its max_restarts=0): the agent restarts any failure,
    and a known one, a refused setting (exit 2) or a run failure such as a non-finite loss (exit 3),
    would only fail again, or be turned into another run by the restarted round's resume. Here the root
    cause decides: a known failure ends the job with its line, a death (a signal, an exit status of its
    own, an exception trainkit does not know) restarts the group. Each round is a new launch: a new
    rendezvous on a free port and a new run id, so its process group meets in a store of its own (an
    agent's restarts reuse one store, whose keys dist._store keeps apart by TORCHELASTIC_RESTART_COUNT)."""
    from hydra.core.hydra_config import HydraConfig
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    logs = tempfile.mkdtemp(prefix="trainkit-launch-")  # torch's error files; kept only to show a traceback
    handlers = {sig: signal.getsignal(sig) for sig in (*AGENT_ENDS, *FORWARDED)}  # the agent's, ours: put back
    sys.stdout.flush()  # a forked worker would print what is still buffered here once more
    sys.stderr.flush()
    keep_logs, restarts, this_round = False, cfg.parallel.max_restarts, cfg
    forwarded: list[int] = []  # the signals this process forwarded: the workers stop (or finish), no restart
    try:
        for sig in FORWARDED:
            signal.signal(sig, lambda signum, frame: _forward(signum, frame, forwarded))
        _quiet_agent()
        for restart in range(restarts + 1):
            round_logs = Path(logs) / f"round_{restart}"  # each round's error files apart (_root_cause)
            try:
                launch = elastic_launch(_launch_config(cfg, str(round_logs)), _worker)
                return launch(entry, this_round, run_dir, job, HydraConfig.instance().cfg, os.getpid())[0]
            except ChildFailedError as failed:
                cause = _root_cause(failed, round_logs, bool(forwarded))
                keep_logs = keep_logs or cause.traceback  # the line printed names the traceback's file
                if cause.stopped:  # a signal one worker got alone, or trainer.max_time: checkpointed, not restarted
                    raise Stopped(str(cause.error), cause.code) from None
                if cause.known or restart == restarts or forwarded:
                    raise WorkersFailed(cause.error, cause.code) from None
                print(
                    f"restarting the workers (restart {restart + 1} of {restarts}) after: {cause.error}",
                    file=sys.stderr,
                    flush=True,  # before the next round forks: a forked worker would print it again
                )
                this_round = restarted(cfg, run_dir)
        raise AssertionError("unreachable: the last round returned or raised")
    except SignalException as stopped:  # Ctrl-C, SIGHUP, SIGQUIT here: the agent has ended the workers with it
        print(f"error: stopped by {stopped.sigval.name}; the workers were ended", file=sys.stderr, flush=True)
        raise SystemExit(128 + stopped.sigval) from None
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        if not keep_logs:
            shutil.rmtree(logs, ignore_errors=True)


def _forward(signum: int, frame: Any, forwarded: list[int]) -> None:
    """SIGTERM, SIGUSR1 to this process: to each worker (its Stopper's flag), then back to waiting for them.
    Before any worker runs there is nothing to stop at a step boundary: the process stops at once."""
    workers = [p.pid for p in multiprocessing.active_children() if p.pid is not None]  # the agent's processes
    if not workers:
        stop.at_once(signum, frame)
    forwarded.append(signum)
    for pid in workers:
        with contextlib.suppress(ProcessLookupError):  # one that exited meanwhile
            os.kill(pid, signum)


def restarted(cfg: DictConfig, run_dir: Path) -> DictConfig:
    """The config of a restarted round: it continues the run, from the newest checkpoint of its run dir,
    else (a death before the first checkpoint) from where the first round started: checkpoint.resume's
    path (auto would find nothing and start afresh), or afresh (auto, null). checkpoint.resume=null can
    take auto: in a dir that held a run before, the first round was refused (exit 2, never restarted)."""
    if not complete(run_dir / "checkpoints"):  # train.py's Checkpointer writes them there
        return cfg
    again = copy.deepcopy(cfg)  # the job's own config stays as composed
    again.checkpoint.resume = "auto"
    return again


def _quiet_agent() -> None:
    """The agent logs each worker failure with its traceback and a dump of the failure: the error
    line printed here replaces them (torch's LOGLEVEL=INFO shows them again, with the agent's steps)."""
    if "LOGLEVEL" not in os.environ:
        for name in ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing"):
            quiet = logging.getLogger(name)
            quiet.propagate = False
            if not quiet.handlers:
                quiet.addHandler(logging.NullHandler())


def _launch_config(cfg: DictConfig, logs: str):
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig
    from torch.numa.binding import AffinityMode, NumaOptions

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=local_workers(cfg),
        run_id=uuid.uuid4().hex,
        rdzv_backend="c10d",  # LaunchConfig's default is etcd
        rdzv_endpoint="localhost:0",  # port 0: a free port for this launch (two sweep jobs never share one)
        rdzv_configs={"timeout": 60},  # the workers are local: they meet in well under a second
        max_restarts=0,  # LaunchConfig's default is 3; parallel.max_restarts is start's loop
        monitor_interval=0.1,
        start_method=start_method(),
        logs_specs=DefaultLogsSpecs(log_dir=logs),  # error files only: workers print to this console
        local_addr="localhost",  # no lookup of this machine's FQDN
        signals_to_handle=",".join(sig.name for sig in AGENT_ENDS),  # it ends the workers with them
        # A NUMA option given skips LaunchConfig's probe, torch.accelerator.is_available(): it calls
        # cuInit, after which CUDA fails in a forked worker. None again: no NUMA binding.
        numa_options=NumaOptions(affinity_mode=AffinityMode.NODE),
    )
    config.numa_options = None
    return config


def _worker(entry: Callable[..., Any], cfg: DictConfig, run_dir: Path, job: int, hydra_cfg: Any, parent: int) -> Any:
    """One worker: torchrun's environment is set (RANK, WORLD_SIZE, MASTER_ADDR, the agent's store)."""
    from hydra.core.hydra_config import HydraConfig

    os.environ[WORKER] = "1"
    if sys.platform == "linux":  # killed with this process's parent (SIGKILL of train.py leaves no worker)
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # it died before that
            os._exit(1)
    for sig in (*AGENT_ENDS, *FORWARDED):  # a forked worker inherits the agent's handlers and this process's
        signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    stop.stop_at_once()  # SIGTERM, SIGUSR1 before its loop: its one line to the parent, 128 + the signal
    HydraConfig.instance().cfg = hydra_cfg  # the job's overrides and sweep (.hydra/, W&B), also when spawned
    if start_method() == "fork":  # one intra-op thread: see start_method
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
    return entry(cfg, run_dir, job)


class _Cause(NamedTuple):
    kind: int  # 0: an error a worker said, 1: a death (a signal, an exit status of its own), 2: a consequence
    timestamp: int
    message: str
    code: int  # the worker's exit status
    ours: bool  # trainkit's own line (dist.fail), not an exception torch's `record` wrote
    error_file: str = ""
    stopped: bool = False  # trainkit/stop.py's line: a signal or trainer.max_time


class RootCause(NamedTuple):
    error: ConfigError | RunError  # the one line to print
    code: int  # the exit status
    traceback: bool  # torch's error file with the traceback is kept (the line names it)
    known: bool  # trainkit's own refusal or run failure (exit 2, 3): a restart would fail the same way
    stopped: bool = False  # not a failure: the workers stopped at a step boundary after a checkpoint (trainkit/stop.py)


def _root_cause(failed, logs: Path, forwarded: bool = False) -> RootCause:
    """The failure that explains the others. Read from every error file of the round (its own log
    dir), not only the failure the agent saw first: a rank whose collective failed may exit before the
    rank that raised. The first kind wins, then the earliest, then rank 0. A worker that exits without an
    error file (os._exit, a SystemExit of its own) died as a killed one did: a rank whose collective
    failed because of it is the consequence. `forwarded`: this process passed a signal to the workers
    (their stop lines are then the user's stop even beside a failure)."""
    causes = {}
    for rank, failure in failed.failures.items():
        if failure.exitcode < 0:
            causes[rank] = _Cause(1, failure.timestamp, f"died of {failure.signal_name()}", 1, False)
        else:
            causes[rank] = _Cause(
                1, failure.timestamp, f"exited with status {failure.exitcode}", failure.exitcode, False
            )
    attempt = next(logs.glob("*/attempt_0"), None)  # the agent's only attempt (it restarts nothing)
    for path in sorted(attempt.glob("*/error.json")) if attempt else []:
        data = json.loads(path.read_text())
        said, ours = data["message"], data.get("trainkit")
        kind = 2 if ours and ours["peer_failed"] else 0
        timestamp = int(said["extraInfo"]["timestamp"])
        stopped = bool(ours and ours.get("stopped"))
        causes[int(path.parent.name)] = _Cause(
            kind, timestamp, said["message"], ours["code"] if ours else 1, bool(ours), str(path), stopped
        )
    if not forwarded and not all(c.stopped or c.kind == 2 for c in causes.values()):
        # A rank failed on its own, and this process forwarded no signal: the others' stop lines answer the
        # agent's SIGTERM, with which it ends the survivors of a failure (in their start-up, or on the way out
        # of the loop before their own report): consequences, which must not turn a restart into a stop.
        causes = {r: c._replace(kind=2, stopped=False) if c.stopped else c for r, c in causes.items()}
    rank, cause = min(causes.items(), key=lambda item: (item[1].kind, item[1].timestamp, item[0]))
    traceback = cause.kind == 0 and not cause.ours  # an exception trainkit does not know: torch's record wrote it
    message = cause.message
    if traceback:  # its first line here, the traceback in torch's error file
        message = f"{message.strip().splitlines()[0][:300]} (traceback: {cause.error_file})"
    text = message if cause.ours else f"rank {rank}: {message}"  # trainkit's line names a rank where it matters
    error = ConfigError(text) if cause.code == 2 else RunError(text)
    known = cause.ours and cause.kind == 0 and (cause.code in (2, 3) or cause.stopped)
    return RootCause(error, cause.code, traceback, known, cause.stopped)
