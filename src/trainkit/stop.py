"""Preemption costs no step: SIGTERM, SIGUSR1 (under submitit also its preemption signal, SIGUSR2) and
`trainer.max_time` end the run at an optimizer-step boundary, every rank after the same step and
after the checkpoint of that step; the same command resumes it.

Why this shape. A cluster ends a job with a signal (SLURM: SIGTERM at the time limit or a preemption,
`--signal=USR1@90` some time before; submitit: SIGUSR2 before the limit, then it requeues the job),
sometimes to one rank alone or to the ranks at different moments. A handler can only set a flag: the
signal lands mid-step, and half a step cannot be saved. The loop asks `due()` after every optimizer
step, and the ranks agree through one all-reduced flag (rule 18, docs/design.md): a rank that stopped alone
would hang the others in their next collective. They check together every PERIOD (a quarter second)
of training (see Stopper: one all-reduce a step would cost a fifth of a small model's step). A time
budget counts from this process's start: a resumed job gets a budget of its own, as a SLURM time
limit is per job.
"""

import contextlib
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, NoReturn, cast

import torch
import torch.distributed as tdist

from trainkit import dist
from trainkit.errors import ConfigError, Stopped, is_worker, report

STARTED = time.monotonic()  # at train.py's imports; a forked self-launched worker inherits its parent's (the job's)
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
PERIOD = 0.25  # seconds of training between two checks of the ranks (one all-reduce); every step alone

_UNITS = {"d": 86400, "h": 3600, "m": 60, "s": 1}
_DURATION = re.compile(r"(?:\d+(?:\.\d+)?[dhms])+")
_CLOCK = re.compile(r"(?:(\d+)-)?(\d+):(\d\d):(\d\d)")  # SLURM's [D-]HH:MM:SS


def seconds(key: str, value: Any) -> float | None:
    """A duration (`3h50m`, `90s`, `45m`, `2h`, `1d12h`, or SLURM's `[D-]HH:MM:SS`) in seconds; None for null.
    A bare number is refused: SLURM reads `--time=90` as minutes, Python code as seconds."""
    if value is None:
        return None
    text = str(value).strip()
    if clock := _CLOCK.fullmatch(text):
        days, hours, minutes, secs = (int(part or 0) for part in clock.groups())
        total = float(((days * 24 + hours) * 60 + minutes) * 60 + secs)
    elif _DURATION.fullmatch(text):
        total = sum(float(number) * _UNITS[unit] for number, unit in re.findall(r"(\d+(?:\.\d+)?)([dhms])", text))
    else:
        total = -1.0
    if total <= 0:
        raise ConfigError(
            f"{key}={value} is not a positive duration with its unit: e.g. 3h50m, 90s, 45m, 2h, 1d (or HH:MM:SS)"
        )
    return total


_FOUND: dict[signal.Signals, Any] = {}  # the handlers trainkit found before its own (submitit's): chained after a stop
_EXITING: list[Stopped] = []  # exit_stopped is under way: a second signal changes nothing


def stop_at_once() -> None:
    """From the start of the process (config.run_cli, a self-launched worker) until the loop's Stopper
    takes over, and again after it: SIGTERM, SIGUSR1 (and submitit's signal) end the process with the
    one line and 128 + the signal (at_once), not with the default action's silent death. A signal
    ignored on purpose (e.g. by a wrapper) stays ignored."""
    if threading.current_thread() is not threading.main_thread():  # signal.signal works there only
        return
    for sig in signals():
        previous = signal.getsignal(sig)
        if previous is not signal.SIG_IGN and previous is not at_once:
            _FOUND[sig] = previous
            signal.signal(sig, at_once)


def at_once(signum: int, frame: Any) -> None:
    """Before the loop there is no step to finish or checkpoint: the line (a self-launched worker hands it
    to its parent), no run dir left that Hydra made empty, the signal's previous handler (submitit: requeue),
    and the exit, now. Not an exception: start-up code that catches one (OmegaConf re-raises them as its
    own) would turn it into another error; and every rank gets the signal (the launcher forwards it)."""
    reported = os.environ.get("TORCHELASTIC_ERROR_FILE")  # a self-launched worker's line to its parent
    if _EXITING or (is_worker() and reported and Path(reported).exists()):
        return  # the exit under way goes on: a stop's, or a failure's (e.g. of a survivor the agent stops)
    line = (
        f"stopped by {signal.Signals(signum).name} during start-up, before any step; the same command starts it again"
    )
    if is_worker():
        report(line, 128 + signum, peer_failed=False, stopped=True)
    elif dist.env_rank() == 0:
        print(line, file=sys.stderr, flush=True)
        _remove_if_empty(_hydra_run_dir())
    with contextlib.suppress(BaseException):  # submitit's SystemExit after its requeue
        _call(_FOUND.get(signal.Signals(signum)), signum)
    sys.stdout.flush()
    os._exit(128 + signum)


def _hydra_run_dir() -> Path | None:
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir) if HydraConfig.initialized() else None


def _remove_if_empty(run_dir: Path | None) -> None:
    with contextlib.suppress(OSError):
        if run_dir is not None:
            run_dir.rmdir()  # only when empty: Hydra made it before the task started


def _call(handler: Any, signum: int) -> None:
    if callable(handler):
        handler(signum, None)


def signals() -> tuple[signal.Signals, ...]:
    """SIGTERM, SIGUSR1 and, in a submitit task, submitit's preemption signal (SIGUSR2 unless
    SUBMITIT_PREEMPT_SIGNAL names another); submitit is imported only there."""
    if dist.submitit_task() is None:
        return SIGNALS
    from submitit.core.job_environment import JobEnvironment

    return tuple(dict.fromkeys((*SIGNALS, signal.Signals(JobEnvironment._usr_sig()))))


class Stopper:
    """`with Stopper(cfg.trainer.max_time, d) as stopper:` installs the handlers (they only note the
    signal) and puts the previous ones back at the end; `stopper.due()` after every optimizer step.

    The ranks agree at check steps they all know: each check's all-reduce also carries every rank's
    proposal for the next one, the steps that fill about PERIOD seconds at its measured pace, and all
    take the smallest. One all-reduce a step cost 19 % of the default job's step on 2 gloo ranks here,
    overlapped (started after step s, read after s+1) 20 %; one every PERIOD is lost in the noise
    (about 0.35 ms four times a second), and a stop lands about PERIOD of training after the signal."""

    def __init__(self, max_time: str | None, d: dist.Dist, grace_s: float = 600):
        """grace_s (parallel.timeout_s): a rank that has not reached the agreed stop this long after a
        signal is hung (e.g. the survivor of a failed peer, which torch's agent stops with SIGTERM):
        it ends as the signal would have ended it, not only after the agent's SIGKILL (30 s later)."""
        self.max_time, self.budget, self.d = max_time, seconds("trainer.max_time", max_time), d
        self.watchdog = threading.Timer(grace_s, os._exit, (1,))
        self.received = 0  # the first signal's number
        self.stopping = False  # due() said stop: the handlers stay until the process exits
        self.finished = False  # the last step is done: a signal no longer stops the run, which ends anyway
        self.previous: dict[signal.Signals, Any] = {}
        self.steps, self.next_check, self.checked = 0, 1, time.monotonic()  # steps since the last check
        # The flags stay on the CPU: on NCCL a device flag read each step would wait for the step's kernels.
        self.group: tdist.ProcessGroup | None = None
        self.alone = not d.distributed
        if d.distributed and tdist.get_backend() != "gloo":  # every rank builds the Stopper at the same point
            self.group = cast(tdist.ProcessGroup, tdist.new_group(backend="gloo"))

    def __enter__(self) -> "Stopper":
        if threading.current_thread() is threading.main_thread():  # signal.signal works there only
            for sig in signals():
                previous = signal.getsignal(sig)
                if previous is signal.SIG_IGN:  # ignored on purpose (e.g. by a wrapper): it stays ignored
                    continue
                self.previous[sig] = previous
                signal.signal(sig, self._note)
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if not self.stopping:  # a stop puts them back as it exits (exit_stopped), after its line
            self.restore()
        if kind is None and self.received and not self.stopping:  # e.g. during the final evaluation or test pass
            name = signal.Signals(self.received).name
            self.d.print0(f"{name} came after the last step: the run finished first (nothing to resume)")

    def restore(self) -> None:
        for sig, previous in self.previous.items():
            signal.signal(sig, previous)
        self.previous = {}

    def _note(self, signum: int, frame: Any) -> None:
        if not self.received and not self.finished:  # after the last step nothing may cut the final writes
            self.watchdog = threading.Timer(self.watchdog.interval, os._exit, (128 + signum,))
            self.watchdog.daemon = True
            self.watchdog.start()
        self.received = self.received or signum

    @property
    def counts(self) -> bool:
        """due() has work every step: it counts steps to the ranks' next check, or time against a budget."""
        return not self.alone or self.budget is not None

    def due(self, last: bool = False) -> str | None:
        """After each optimizer step, on every rank: why every rank stops after this step (a signal's
        name, `trainer.max_time=...`), the same on all of them, or None. `last`: the run's last step,
        which ends the run anyway (its model.pt is written)."""
        if last:  # every rank alike: the run ends anyway, normally (its model.pt is written), with no check
            self.finished = True
            self.watchdog.cancel()
            return None
        if self.alone and not self.received and self.budget is None:
            return None  # one process, no signal, no budget: nothing to check or agree on (~5 us a step)
        self.steps += 1
        if self.d.distributed and self.steps < self.next_check:
            return None
        now = time.monotonic()
        over = int(self.budget is not None and now - STARTED >= self.budget)
        seen = [self.received, over]
        if self.d.distributed:  # MAX: any rank's signal (the highest number), any rank's budget, the fewest steps
            pace = (now - self.checked) / self.steps
            flags = torch.tensor([*seen, -min(max(1, int(PERIOD / max(pace, 1e-6))), 10**6)], dtype=torch.int32)
            tdist.all_reduce(flags, op=tdist.ReduceOp.MAX, group=self.group)
            *seen, fewest = flags.tolist()
            self.steps, self.next_check, self.checked = 0, -fewest, now
        self.stopping = bool(seen[0] or seen[1])
        if self.stopping:
            self.watchdog.cancel()  # every rank reached the stop: its checkpoint is bounded by the collectives' timeout
        if seen[0]:
            return signal.Signals(seen[0]).name
        return f"trainer.max_time={self.max_time}" if seen[1] else None

    def stopped(self, reason: str, step: int) -> Stopped:
        """What train() raises after the checkpoint of `step`: exit status 128 + the signal's number (as a
        shell reports a process that signal ended), 0 for trainer.max_time (the budget was asked for; a
        torchrun --max-restarts must not restart it)."""
        signum = getattr(signal.Signals, reason, None)
        line = f"stopped by {reason} at step {step}; checkpoint written; the same command resumes"
        return Stopped(line, 128 + signum if signum else 0, lambda: self._chain(signum))

    def _chain(self, signum: signal.Signals | None) -> None:
        """The handler that signal had before ours, now: submitit's requeues the job (rank 0) and exits."""
        previous = self.previous.get(signum) if signum else None
        self.restore()
        if signum is not None:
            _call(_FOUND.get(signum) if previous is at_once else previous, signum)


def exit_stopped(stopped: Stopped, run_dir: Path | None = None) -> NoReturn:
    """run()'s end of a stopped run: the line from rank 0 (a self-launched worker hands it to its parent,
    which prints it), the signal's previous handler (submitit: requeue), then every rank past a barrier
    (none exits before rank 0 said its line and requeued: srun and torchrun end the others when one
    exits), and the exit status. A self-launched worker exits non-zero even for max_time: its parent
    reads the line and exits with the status."""
    _EXITING.append(stopped)
    if is_worker():
        report(str(stopped), stopped.code, peer_failed=False, stopped=True)
    elif dist.env_rank() == 0:
        print(str(stopped), file=sys.stderr, flush=True)
        _remove_if_empty(run_dir)  # self-launched workers stopped in their start-up
    chained: BaseException | None = None
    try:
        if stopped.chain is not None:
            stopped.chain()
    except BaseException as error:  # submitit's SystemExit after its requeue, or why it did not requeue
        chained = error
    if tdist.is_initialized():
        tdist.barrier()
    dist.teardown()
    if chained is not None:
        raise chained
    sys.exit(stopped.code or int(is_worker()))
