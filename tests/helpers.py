"""Test helpers: run a function on W gloo ranks; run the real entry points as a user would."""

import contextlib
import importlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# fork: a forked worker starts in ~0.3 s with torch and the test module already imported; a spawned
# one imports torch anew (~5 s a process, ~10 s for two on two busy cores). TRAINKIT_TEST_START=spawn
# goes back to fresh interpreters (e.g. to rule fork out when a distributed test misbehaves).
START = os.environ.get("TRAINKIT_TEST_START", "fork")
# DDP's constructor imports torch._dynamo on first use (1 s alone, 3-5 s on a loaded machine), between its
# collectives: in forked ranks that had not imported it, one rank waited that long for the other, and a test's
# short group timeout (test_autobatch's 5 s) ended the wait. Imported by run_distributed before it forks, once a
# process: not at the import of this module, which every run of a helpers.* _target_ pays (2 s a process).
# A collective on a loaded machine takes milliseconds to seconds; a hung one fails after this, and
# run_distributed ends the processes after `timeout` (every test's own work is well under a minute).
GROUP_TIMEOUT = timedelta(seconds=120)


def _print_warning(message, category, filename, lineno, file=None, line=None):
    print(warnings.formatwarning(message, category, filename, lineno, line), end="", file=sys.stderr, flush=True)


def _worker(rank, world_size, port, fn, args, result_dir, group):
    # One intra-op thread, set first: a forked child must not use the parent's OpenMP pool (it hangs).
    torch.set_num_threads(1)
    # Python warnings to stderr, as in a process of its own (a forked child inherits pytest's
    # recording of them, which never reaches the test).
    warnings.showwarning = _print_warning
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if group:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=GROUP_TIMEOUT)
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, Path(result_dir) / f"{rank}.pt")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world_size: int = 2, *args, group: bool = True, timeout: float = 900):
    """Run fn(rank, world_size, *args) on `world_size` forked gloo processes (a real process
    group, real collectives; group=False: none, fn joins one itself); returns the list of per-rank
    return values. fn must be a module-level function (picklable, for TRAINKIT_TEST_START=spawn).
    A rank that hangs past `timeout` seconds ends them all and fails the test."""
    import torch._dynamo  # noqa: F401  (see GROUP_TIMEOUT's comment)

    with tempfile.TemporaryDirectory() as result_dir:
        context = mp.start_processes(
            _worker,
            args=(world_size, _free_port(), fn, args, result_dir, group),
            nprocs=world_size,
            join=False,
            start_method=START,
        )
        deadline = time.monotonic() + timeout
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                raise TimeoutError(f"run_distributed({fn.__name__}): ranks still running after {timeout:g} s")
        return [torch.load(Path(result_dir) / f"{r}.pt", weights_only=False) for r in range(world_size)]


def compose_cfg(*overrides: str, config_name: str = "train", with_hydra: bool = False):
    """conf/<config_name>.yaml composed with the overrides, as @hydra.main composes it (with_hydra: and the
    hydra node, e.g. hydra.sweeper)."""
    from hydra import compose, initialize_config_dir

    import trainkit.config  # noqa: F401  registers the schema in Hydra's ConfigStore, as train.py's import does

    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name, overrides=list(overrides), return_hydra_config=with_hydra)


def _entry_point(script: str, run_dir: str, overrides: tuple[str, ...]) -> str:
    """What src/<script>.py's @hydra.main runs after composing, in this process; returns its stdout."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        if script == "train":
            import train
            from trainkit import debug

            with debug.command_line(overrides):  # its keys win over a debug mode's, as on the command line
                train.run(compose_cfg(*overrides), Path(run_dir))
        else:  # predict, eval, export: what its main() runs, into run_dir (Hydra's output dir, made first as Hydra)
            from trainkit import dist as trainkit_dist

            entry = importlib.import_module(script)
            run = getattr(entry, f"{script}_run")  # predict_run, eval_run, export_run
            Path(run_dir).mkdir(parents=True, exist_ok=True)
            try:
                run(compose_cfg(*overrides, config_name=script), Path(run_dir))
            finally:
                trainkit_dist.teardown()
    return out.getvalue()


def _torchrun_worker(rank: int, world_size: int, script: str, run_dir: str, overrides: tuple[str, ...]) -> str:
    # torchrun's environment for this worker (MASTER_ADDR/PORT: run_distributed's): trainkit.dist.init
    # joins the process group from it as under torchrun.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    os.environ.update(LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0")
    return _entry_point(script, run_dir, overrides)


def exit_status(rank: int, world_size: int, run_dir: str, overrides: tuple[str, ...]) -> int | str | None:
    """A rank of run_distributed(exit_status, nproc, run_dir, overrides, group=False): train.py's run in torchrun's
    environment, returning the status it exits with (SystemExit's code; 0 if it returns)."""
    try:
        _torchrun_worker(rank, world_size, "train", run_dir, overrides)
    except SystemExit as exited:
        return exited.code
    return 0


def run_in_process(
    run_dir: Path, *overrides: str, nproc: int = 1, script: str = "train", torchrun: bool = False
) -> str:
    """What `python src/<script>.py` (nproc=1) or `torchrun --nproc_per_node=<nproc>` (nproc > 1, or
    torchrun=True) does after Hydra composed the config, without starting interpreters that import
    torch: this process, or `nproc` forked ranks. For the tests that are about what training computes;
    run_train keeps the command line itself (exit status, stderr, Hydra's run dir). Returns what the
    ranks printed to stdout, in rank order (torchrun's stdout holds them all); a failing rank raises."""
    if nproc == 1 and not torchrun:
        return _entry_point(script, str(run_dir), overrides)
    importlib.import_module(script)  # once here, not in every forked rank
    return "".join(run_distributed(_torchrun_worker, nproc, script, str(run_dir), overrides, group=False))


def cli_in_process(capfd: Any, run_dir: Path, *overrides: str, script: str = "train") -> subprocess.CompletedProcess:
    """`python src/train.py [flags] hydra.run.dir=<run_dir> overrides` (or src/<script>.py) in this process, where
    torch and trainkit are imported already: the script run as __main__ with that sys.argv; its exit status, stdout
    and stderr (from pytest's capfd, which also holds what workers forked from here print). For what train.py's
    parent does with its workers (trainkit/launch.py: restarts, the root cause's line and status) without an
    interpreter that imports torch (~5 s). A signal to the parent runs the real command (run_train): its handlers
    here would end this process on a bug (stop.at_once), as would the stop line of a signal during start-up."""
    import runpy

    flags = [o for o in overrides if o.startswith("-")]
    argv = [str(ROOT / "src" / f"{script}.py"), *flags, f"hydra.run.dir={run_dir}"]
    argv += [o for o in overrides if o not in flags]
    capfd.readouterr()  # what the test printed before
    code: int | str | None = 0
    with _process_state_kept():
        sys.argv = argv
        os.environ.update(HYDRA_FULL_ERROR="0")  # what _env() sets for a command: run_cli's one-line errors
        try:
            runpy.run_path(argv[0], run_name="__main__")
        except SystemExit as exited:
            code = exited.code
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(argv, 0 if code is None else code, out, err)


@contextlib.contextmanager
def _process_state_kept():
    """Puts back what a run of train.py's __main__ changes in this process: sys.argv, the environment (run_cli's
    HYDRA_FULL_ERROR), the signal handlers (run_cli's, the agent's), the root logger (Hydra's logging set-up),
    HydraConfig, and trainkit.stop's state (a stop under way, the handlers it found), which a later fork inherits."""
    import logging

    from hydra.core.hydra_config import HydraConfig

    from trainkit import stop

    handled = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
    argv, environ, handlers = sys.argv, dict(os.environ), {sig: signal.getsignal(sig) for sig in handled}
    root = logging.getLogger()
    level, log_handlers, hydra_cfg = root.level, list(root.handlers), HydraConfig.instance().cfg
    exiting, found = list(stop._EXITING), dict(stop._FOUND)
    try:
        yield
    finally:
        sys.argv = argv
        os.environ.clear()
        os.environ.update(environ)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        root.setLevel(level)
        root.handlers[:] = log_handlers
        HydraConfig.instance().cfg = hydra_cfg
        stop._EXITING[:] = exiting
        stop._FOUND.clear()
        stop._FOUND.update(found)


# Equivalence runs (two runs that must train alike: W ranks against one process, a resume on another
# world size, compiled against eager) step with SGD: its update is lr x gradient, so the gradients'
# reduction-order rounding (~1e-7 relative) stays that small in the weights, on any CPU. AdamW's
# m / (sqrt(v) + eps) makes a near-zero gradient's rounding a step of up to lr (test_fsdp_units' GPT:
# 5.2e-5 on a second machine, 3.6e-5 here), and hides a gradient off by a constant factor.

# A small BatchNorm model for the SyncBN equivalences: one process at b=32 against 2 ranks at b=16.
SYNC_BN = [
    "model=cnn",
    "model.width=8",
    "trainer.max_steps=12",
    "trainer.log_every=4",
    "optim=sgd",
    "trainer.clip_grad_norm=1.0",
]


# The run the crash tests kill and resume (test_checkpoint.py, test_launch.py): a BatchNorm model with
# dropout, AdamW + cosine, K=3, a checkpoint at step 10: mid-epoch (12 steps per epoch on one rank, 6 on
# two) and in the middle of a log row (rows every 3 steps).
CRASH_RUN = [
    "model=cnn",
    "model.width=8",
    "model.dropout=0.2",
    "optim=adamw",
    "sched=cosine",
    "sched.warmup_steps=3",
    "accumulation.steps=3",
    "data.batch_size=32",
    "trainer.max_steps=20",
    "trainer.log_every=3",
    "trainer.eval_every=100",
    "checkpoint.every=10",
    "checkpoint.keep=5",
]


def faulty(fault: str, at_forward: int, rank: int, marker: Path | str, name: str = "cnn") -> list[str]:
    """Overrides that wrap model=<name> in Faulty (below); `fault` may list several, 'a,b', for a sweep."""
    return [
        "model._target_=helpers.faulty_model",
        f"+model.name={name}",
        "+model.fault=" + ",".join(f"'{f}'" for f in fault.split(",")),
        f"+model.at_forward={at_forward}",
        f"+model.rank={rank}",
        f"+model.marker={marker}",
    ]


TIMINGS = (
    "samples_per_s",
    "tokens_per_s",
    "time/data_wait",
    "mem/peak_gb",
    "mfu",
)  # metrics.jsonl's clock and memory readings (mfu: from samples_per_s): never equal between runs


def without_timings(row: dict) -> dict:
    return {k: v for k, v in row.items() if k not in TIMINGS}


def rows(run_dir: Path, timings: bool = True, test: bool = False) -> list[dict]:
    """metrics.jsonl's rows of training and validation (timings=False: without the clock readings, to
    compare two runs); test=True: with the test row at the end (trainer.test), see final_test_row."""
    from trainkit.loggers import is_test_row

    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [row if timings else without_timings(row) for row in map(json.loads, lines) if test or not is_test_row(row)]


def final_test_row(run_dir: Path) -> dict:
    """The one row of the test pass at the end of a run (trainer.test: test/loss, test/acc, ...)."""
    from trainkit.loggers import is_test_row

    found = [row for row in rows(run_dir, test=True) if is_test_row(row)]
    assert len(found) == 1, found
    return found[0]


def weights(run_dir: Path) -> dict:
    """A finished run's model.pt."""
    return torch.load(Path(run_dir) / "model.pt", weights_only=True)


def max_diff(a: dict, b: dict) -> float:
    """The largest |difference| between two state_dicts with the same keys."""
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def _env():
    # PYTHONPATH: tests/ so that model._target_=helpers.faulty_model resolves; src/ so that a process that
    # does not start from src/train.py (a submitit task) imports this tree's trainkit, not the one an
    # editable install points to (a venv shared between worktrees).
    pythonpath = os.pathsep.join([str(ROOT / "tests"), str(ROOT / "src")])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HYDRA_FULL_ERROR="0", PYTHONPATH=pythonpath)
    env.pop("WANDB_API_KEY", None)
    return env


def run_train(
    run_dir: Path,
    *overrides: str,
    nproc: int = 1,
    script: str = "src/train.py",
    check: bool = True,
    torchrun: tuple[str, ...] = (),
    timeout: float = 600,
) -> subprocess.CompletedProcess:
    """Run an entry point as a user would: python (nproc=1, no torchrun args) or torchrun."""
    launcher = [sys.executable]
    if nproc > 1 or torchrun:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *torchrun]
    flags = [o for o in overrides if o.startswith("-")]  # e.g. -m: before the overrides (argparse)
    cmd = [*launcher, str(ROOT / script), *flags, f"hydra.run.dir={run_dir}", *(o for o in overrides if o not in flags)]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def together(*runs: Callable[[], Any]) -> list[Any]:
    """Call a few independent runs at once (e.g. `lambda: run_train(...)`, each a process of its own) and
    return their results in order: their interpreters start side by side on the machine's cores."""
    with ThreadPoolExecutor(len(runs)) as pool:
        futures = [pool.submit(run) for run in runs]
        return [future.result() for future in futures]


def assert_equal(a, b, where: str):
    """Exact equality of nested checkpoint state: tensors bit for bit, everything else ==."""
    assert type(a) is type(b), where
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_equal(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


class Faulty(nn.Module):
    """A model that misbehaves once, on one rank, at its n-th training forward: the real faults
        the fault-tolerance tests need (no mocks). `fault`: "kill" (SIGKILL this worker, once: a
        marker file remembers it), "nan" (return NaN), "nan_input" (one NaN input sample: BatchNorm's
        running statistics turn NaN too), "inf_grad" (a finite loss whose gradient is infinite, as an
        fp16 overflow gives), "hang" (sleep as a stuck peer would), "wait" (until the marker file exists:
        a test decides when the step goes on), "raise" (an exception trainkit does not know, as a bug
        raises), "exit" (os._exit(17), once, as a library that ends the process with a status of its
        own would), "kill_starting" (SIGKILL this worker as the model is built, once, while the other
        ranks are still in their start-up: each waits there, without a collective, until the agent ends it),
        or "oom" / "oom_backward": every
    training forward (backward) of more than `oom_above` samples raises torch.OutOfMemoryError, as a
    device too small for that micro-batch would ("oom": the at_forward-th too); "rlimit": a real allocation
    of 64 MiB a sample fails above `oom_above` samples (an address-space limit); "oom_eval": every
    evaluation (eval mode) forward of more than `oom_above` samples raises torch.OutOfMemoryError."""

    def __init__(self, inner: nn.Module, fault: str, at_forward: int, rank: int, marker: str, oom_above: int = 0):
        super().__init__()
        self.inner, self.fault, self.at_forward, self.rank, self.marker = inner, fault, at_forward, rank, Path(marker)
        self.calls, self.oom_above, self.raises = 0, oom_above, False
        if fault == "kill_starting":
            _kill_starting(rank, self.marker)
        if fault == "oom_backward":  # in the backward of the first layer: the last a backward runs
            first = next(m for m in inner.modules() if not list(m.children()) and list(m.parameters()))
            first.register_forward_hook(lambda module, args, out: _OutOfMemoryInBackward.apply(out, self.raises))

    def forward(self, x):
        evaluating_here = not self.training and int(os.environ.get("RANK", 0)) == self.rank
        if self.fault == "oom_eval" and evaluating_here and len(x) > self.oom_above:
            raise torch.OutOfMemoryError(f"helpers.Faulty: out of memory at an evaluation batch of {len(x)}")
        if self.fault == "oom_backward":  # the same graph on every rank, as a real one
            self.raises = self.training and int(os.environ.get("RANK", 0)) == self.rank and len(x) > self.oom_above
        if not self.training or int(os.environ.get("RANK", 0)) != self.rank:
            return self.inner(x)
        self.calls += 1
        if self.fault == "oom" and (len(x) > self.oom_above or self.calls == self.at_forward):
            raise torch.OutOfMemoryError(f"helpers.Faulty: out of memory at a micro-batch of {len(x)}")
        if self.fault == "rlimit":
            _allocate_under_rlimit(len(x), self.oom_above, first=self.calls == 1)
        if self.fault == "nan_input" and self.calls == self.at_forward:
            x = x.clone()
            x[0] = float("nan")
        out = self.inner(x)
        if self.calls == 1 and self.marker.exists():  # the restarted worker's first step: when
            self.marker.with_suffix(".resumed").touch(exist_ok=True)  # the restart cost ends
        if self.calls != self.at_forward:
            return out
        if self.fault == "nan":
            return out * float("nan")
        if self.fault == "inf_grad":
            out.register_hook(lambda grad: grad * float("inf"))
        if self.fault == "hang":
            time.sleep(3600)
        while self.fault == "wait" and not self.marker.exists():
            time.sleep(0.05)
        if self.fault == "raise":
            raise RuntimeError(f"helpers.Faulty: a bug on rank {self.rank} at forward {self.calls}")
        if self.fault == "kill" and not self.marker.exists():
            self.marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)
        if self.fault == "exit" and not self.marker.exists():
            self.marker.touch()
            os._exit(17)
        return out


def _kill_starting(rank: int, marker: Path) -> None:
    """Once (the marker remembers it): `rank` dies in its start-up, the others wait for that death in
    theirs (before the loop: no collective can notice it first), until the elastic agent's SIGTERM."""
    if os.environ.get("TRAINKIT_WORKER") != "1":  # not the self-launching parent
        return
    mine = marker if int(os.environ.get("RANK", 0)) == rank else marker.with_name(f"{marker.name}.waited")
    if mine.exists():  # the restarted round
        return
    mine.touch()
    if mine == marker:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)  # the agent ends this rank (SIGTERM) as soon as it sees the death: well before


def _allocate_under_rlimit(samples: int, fitting: int, first: bool, per_sample: int = 64 << 20) -> None:
    """A real allocation failure: `samples` x 64 MiB, under an address-space limit (set at the first
    call) with room for `fitting` samples and 256 MiB to spare; the CPU allocator's "can't allocate"."""
    import resource

    if first:
        status = Path("/proc/self/status").read_text().splitlines()
        size = next(int(line.split()[1]) << 10 for line in status if line.startswith("VmSize:"))
        hard = resource.getrlimit(resource.RLIMIT_AS)[1]
        resource.setrlimit(resource.RLIMIT_AS, (size + (fitting + 4) * per_sample, hard))
    torch.empty(samples * per_sample, dtype=torch.uint8)


class _OutOfMemoryInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, raises: bool):
        ctx.raises = raises
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if ctx.raises:
            raise torch.OutOfMemoryError("helpers.Faulty: out of memory in a backward")
        return grad, None


def faulty_model(
    name: str,
    fault: str,
    at_forward: int = 0,
    rank: int = 0,
    marker: str = "/nonexistent",
    oom_above: int = 0,
    **model_args,
) -> nn.Module:
    """trainkit.models.<name>.<name>(**model_args) (or a dotted `name`'s callable) wrapped in Faulty; from the
    command line: model=cnn model._target_=helpers.faulty_model +model.name=cnn +model.fault=kill ..."""
    from hydra.utils import get_object

    build = get_object(name if "." in name else f"trainkit.models.{name}.{name}")
    return Faulty(build(**model_args), fault, at_forward, rank, marker, oom_above)


class NoisyDigits(torch.utils.data.Dataset):
    """Digits with a random augmentation in __getitem__ (Gaussian noise from the global torch
    RNG, a shift from numpy's), as torchvision transforms draw: resume must reproduce it."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        import numpy as np

        x, y = self.dataset[index]
        return torch.roll(x + 0.1 * torch.randn_like(x), int(np.random.randint(-1, 2)), dims=-1), y


def noisy_digits(val_fraction: float = 0.2, test_fraction: float = 0.2):
    """data.splits._target_=helpers.noisy_digits: digits whose training split augments randomly."""
    from trainkit.data.digits import digits

    train, val, test = digits(val_fraction, test_fraction)
    return NoisyDigits(train), val, test


class SlowDigits(torch.utils.data.Dataset):
    """Digits that take 4 ms to load a sample: a loader the loop waits on (time/data_wait)."""

    draws_random = False

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        time.sleep(0.004)
        return self.dataset[index]


def slow_digits(val_fraction: float = 0.2, test_fraction: float = 0.2):
    """data.splits._target_=helpers.slow_digits: digits whose training split loads slowly."""
    from trainkit.data.digits import digits

    train, val, test = digits(val_fraction, test_fraction)
    return SlowDigits(train), val, test


class LeastSquares:
    """task._target_=helpers.LeastSquares: half the squared error per sample, the regression task
    a fork would write (tests/test_ddp.py checks training against its closed form)."""

    items_name, eval_width = None, 3  # items are samples

    def __init__(self, label_smoothing: float = 0.0):  # task=classification's keys (its schema)
        assert label_smoothing == 0

    def loss_sum(self, output, target):
        return 0.5 * (output.squeeze(-1) - target).pow(2).sum()

    def items(self, target):
        return torch.tensor(len(target))

    def eval_sums(self, inputs, output, target):
        loss = self.loss_sum(output, target).double()
        return torch.stack([loss, torch.zeros_like(loss), torch.tensor(len(target), dtype=torch.float64)])

    def eval_metrics(self, sums):
        return {"loss": sums[0] / sums[2]}


def regression_splits(samples: int = 21, features: int = 3, val_fraction: float = 0.0, test_fraction: float = 0.0):
    """y = X w + b exactly, float64; no validation split, no test split (train, val: a data function of
    one's own). (`val_fraction`, `test_fraction`: data=digits' keys, which its schema keeps when _target_
    is swapped; only val_fraction=0 is meaningful here, test_fraction is not read.)"""
    assert val_fraction == 0
    g = torch.Generator().manual_seed(0)
    x = torch.randn(samples, features, generator=g, dtype=torch.float64)
    y = x @ torch.linspace(1.0, -2.0, features, dtype=torch.float64) + 0.3
    return torch.utils.data.TensorDataset(x, y), torch.utils.data.TensorDataset(x[:0], y[:0])


def zero_linear(features: int = 3) -> nn.Module:
    """A float64 linear model starting at zero (gradient descent's closed form starts there too)."""
    model = nn.Linear(features, 1, dtype=torch.float64)
    nn.init.zeros_(model.weight)
    nn.init.zeros_(model.bias)
    return model


class TokenMeanPerMicroBatch:
    """task._target_=helpers.TokenMeanPerMicroBatch: the usual loop's loss, to measure what the
    exact per-token normalisation prevents. Each micro-batch's loss is the mean over its own
    tokens (weighted like a sample mean, so a full window gets mean over micro-batches and ranks
    of their token means): a token in a short micro-batch weighs more than one elsewhere."""

    items_name = None

    def __init__(self, max_digits: int = 3, per_character: bool = False, per_token: bool = False):  # task=lm's keys
        from trainkit.tasks.lm import LanguageModel

        self.lm = LanguageModel(max_digits=max_digits)
        self.eval_width = self.lm.eval_width

    def loss_sum(self, output, target):
        return self.lm.loss_sum(output, target) / self.lm.items(target).clamp(min=1) * len(target)

    def items(self, target):
        return torch.tensor(len(target))

    def eval_sums(self, inputs, output, target):
        return self.lm.eval_sums(inputs, output, target)

    def eval_metrics(self, sums):
        return self.lm.eval_metrics(sums)


def warning_mlp(**kwargs) -> nn.Module:
    """model._target_=helpers.warning_mlp: the mlp, built after a Python warning (on every rank)."""
    import warnings

    from trainkit.models.mlp import mlp

    warnings.warn("helpers.warning_mlp: a warning every rank raises", UserWarning, stacklevel=1)
    return mlp(**kwargs)


def put_mlp(**kwargs) -> nn.Module:
    """model._target_=helpers.put_mlp: the mlp, its output's first entry rewritten with Tensor.put_ (an operation
    torch has no deterministic kernel for, on the CPU too: trainer.deterministic=true refuses it)."""
    from trainkit.models.mlp import mlp

    model = mlp(**kwargs)
    model.register_forward_hook(lambda module, args, out: out.clone().put_(torch.tensor([0]), out.flatten()[:1]))
    return model


class SlowEvaluation(nn.Module):
    """model._target_=helpers.SlowEvaluation: the mlp, whose evaluation (eval mode) forwards each sleep `seconds`."""

    def __init__(self, seconds: float = 0.05, **kwargs):
        super().__init__()
        from trainkit.models.mlp import mlp

        self.seconds, self.net = seconds, mlp(**kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            time.sleep(self.seconds)
        return self.net(x)


DROPOUT_MASKS: list[torch.Tensor] = []  # what dropout_mlp's dropout layers drew in this process, in order


def _record_dropout_mask(module: nn.Module, args: tuple) -> None:
    """A forward pre-hook on nn.Dropout: the keep-mask its training forward is about to draw (the same
    draw on ones, the generator put back, so the forward itself then draws exactly this mask)."""
    if module.training:
        state = torch.get_rng_state()
        DROPOUT_MASKS.append(torch.nn.functional.dropout(torch.ones_like(args[0]), module.p) != 0)
        torch.set_rng_state(state)


def _check_dropout_mask(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
    if module.training:  # the recorded mask is the one the forward drew: zero wherever it drops
        assert not out[~DROPOUT_MASKS[-1]].any()


def dropout_mlp(**kwargs) -> nn.Module:
    """model._target_=helpers.dropout_mlp: the mlp, its dropout masks recorded in DROPOUT_MASKS."""
    from trainkit.models.mlp import mlp

    model = mlp(**kwargs)
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.register_forward_pre_hook(_record_dropout_mask)
            module.register_forward_hook(_check_dropout_mask)
    return model


def _dropout_masks_worker(rank: int, world_size: int, run_dir: str, overrides: tuple[str, ...]) -> list[torch.Tensor]:
    DROPOUT_MASKS.clear()
    _torchrun_worker(rank, world_size, "train", run_dir, overrides)
    return list(DROPOUT_MASKS)


def dropout_masks(run_dir: Path, *overrides: str, nproc: int = 2) -> list[list[torch.Tensor]]:
    """run_in_process(run_dir, "model._target_=helpers.dropout_mlp", *overrides, nproc=nproc): every
    rank's dropout masks, in the order drawn."""
    importlib.import_module("train")  # once here, not in every forked rank
    overrides = ("model._target_=helpers.dropout_mlp", *overrides)
    return run_distributed(_dropout_masks_worker, nproc, str(run_dir), overrides, group=False)


def make_parent(run_dir: Path, *overrides: str, seed: int = 0) -> Path:
    """A finished run's dir made in a second, without training: the composed config (.hydra/config.yaml) and the
    initial weights of its model (model.pt). What a run that builds on a run (task.teacher.from) reads."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from trainkit.parent import model_node

    cfg = compose_cfg(*overrides)
    torch.manual_seed(seed)
    model = instantiate(model_node(cfg))  # a parent that has a parent of its own: its model less model.init
    (Path(run_dir) / ".hydra").mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, Path(run_dir) / ".hydra" / "config.yaml")
    torch.save(model.state_dict(), Path(run_dir) / "model.pt")
    return Path(run_dir)


class RecordingSGD(torch.optim.SGD):
    """torch's SGD that records each of its steps' group lrs (optim._target_=helpers.RecordingSGD): what each
    parameter group stepped with, in this process."""

    lrs: list[list[float]] = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        RecordingSGD.lrs = []

    def step(self, closure=None):
        RecordingSGD.lrs.append([group["lr"] for group in self.param_groups])
        return super().step(closure)


def small_resnet(
    in_channels: int = 3, num_classes: int = 10, small_input: bool = True, activation_checkpointing: bool = False
) -> nn.Module:
    """model=resnet18 model._target_=helpers.small_resnet: resnet18's structure (torchvision's ResNet, its
    _make_layer: layer1..layer4 of two BasicBlocks, BatchNorm after each conv, a downsampling shortcut from layer2
    on; the CIFAR stem; layer1..layer4 checkpointed segments as resnet18's) at 4 to 32 channels, not 64 to 512: what
    sharding or checkpointing by BasicBlock does, with the same state_dict keys, at 1/250 of its 11 M parameters."""
    from torchvision.models.resnet import BasicBlock, ResNet

    from trainkit.recompute import Staged

    assert small_input  # the CIFAR stem: the tests' images are small
    model = ResNet.__new__(ResNet)  # ResNet's own attributes and forward, without its fixed widths
    nn.Module.__init__(model)
    model._norm_layer, model.inplanes, model.dilation, model.groups, model.base_width = nn.BatchNorm2d, 4, 1, 1, 64
    model.conv1 = nn.Conv2d(in_channels, 4, kernel_size=3, stride=1, padding=1, bias=False)
    model.bn1, model.relu, model.maxpool = nn.BatchNorm2d(4), nn.ReLU(inplace=True), nn.Identity()
    for i in range(4):
        layer = model._make_layer(BasicBlock, 4 << i, 2, stride=1 if i == 0 else 2)
        setattr(model, f"layer{i + 1}", Staged(*layer) if activation_checkpointing else layer)
    model.avgpool, model.fc = nn.AdaptiveAvgPool2d((1, 1)), nn.Linear(32, num_classes)
    return model


class RemoteDigits(torch.utils.data.Dataset):
    """Digits as a shard set in an object store looks to the engine: its own global order (`epoch_order`: blocks of
    64 samples, the blocks and the samples within each permuted from (seed, epoch)), `reads_remotely`, and a store
    that fails on rank $TRAINKIT_TEST_FAIL_RANK once that rank loaded $TRAINKIT_TEST_FAIL_AFTER samples (a server
    down mid-run: trainkit.errors.DataUnavailable, as trainkit.data.shard_store raises after its retries)."""

    draws_random = False
    reads_remotely = True

    def __init__(self, dataset):
        self.dataset, self.loaded = dataset, 0

    def __len__(self):
        return len(self.dataset)

    def epoch_order(self, seed: int, epoch: int, global_batch: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(1000 * seed + epoch)
        blocks = torch.arange(len(self)).split(64)
        return torch.cat(
            [
                blocks[b][torch.randperm(len(blocks[b]), generator=generator)]
                for b in torch.randperm(len(blocks), generator=generator)
            ]
        )

    def __getitem__(self, index):
        from trainkit.errors import DataUnavailable

        after = os.environ.get("TRAINKIT_TEST_FAIL_AFTER")
        rank = int(os.environ.get("RANK", "0"))
        if (
            after is not None
            and rank == int(os.environ.get("TRAINKIT_TEST_FAIL_RANK", "1"))
            and self.loaded >= int(after)
        ):
            raise DataUnavailable("s3://bucket/digits/train-000003.tar: unavailable after 2 tries (Connection refused)")
        self.loaded += 1
        return self.dataset[index]


def remote_digits(val_fraction: float = 0.2, test_fraction: float = 0.2):
    """data.splits._target_=helpers.remote_digits: digits read as from a store that may fail (RemoteDigits)."""
    from trainkit.data.digits import digits

    train, val, test = digits(val_fraction, test_fraction)
    return RemoteDigits(train), val, test
