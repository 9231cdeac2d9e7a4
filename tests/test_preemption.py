"""Preemption costs no step (trainkit/stop.py): SIGTERM / SIGUSR1 / submitit's SIGUSR2 and trainer.max_time stop
every rank after the same step, after its checkpoint, with one line and a documented status; the same
command resumes, and the two parts together equal the uninterrupted run bit for bit (every metrics row,
without its timings, and model.pt), no step repeated. Under torchrun, self-launched and under submitit
(tests/test_launchers.py: a preempted job of a submitit sweep is requeued and resumes)."""

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from helpers import (
    ROOT,
    _env,
    cli_in_process,
    compose_cfg,
    exit_status,
    rows,
    run_distributed,
    run_in_process,
    weights,
)
from trainkit import config, stop
from trainkit.config import ConfigError
from trainkit.dist import Dist

# The default job (digits, mlp). A stop comes at the ranks' next check, at most a quarter second of training after
# the signal (stop.PERIOD): some 80 steps here, 250 at 1000 steps/s. The signals come at step 100 (signalling_mlp),
# or, sent by the test, after the first rows of a run of 100000 steps.
RUN = ["trainer.max_steps=400", "trainer.log_every=50", "trainer.eval_every=200", "checkpoint.every=0"]
LINE = r"stopped by {} at step (\d+); checkpoint written; the same command resumes"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    """RUN on 2 ranks in torchrun's environment (forked ranks of this process), never stopped."""
    run_dir = tmp_path_factory.mktemp("uninterrupted") / "run"
    run_in_process(run_dir, *RUN, nproc=2)
    return run_dir


def assert_resumed_exactly(run_dir: Path, uninterrupted: Path, step: int) -> None:
    """The stopped-then-resumed run dir equals the uninterrupted run, every row and every weight."""
    steps = [r["step"] for r in rows(run_dir)]
    assert steps == sorted(set(steps)), steps  # no step repeated across the two parts
    assert rows(run_dir, timings=False) == rows(uninterrupted, timings=False)
    finished, reference = weights(run_dir), weights(uninterrupted)
    assert all(torch.equal(finished[k], reference[k]) for k in reference)


def stopped_at(text: str, reason: str) -> int:
    [step] = re.findall(LINE.format(re.escape(reason)), text)
    return int(step)


def assert_checkpoint_of(run_dir: Path, step: int) -> None:
    assert (run_dir / "checkpoints" / f"step_{step:08d}.pt").is_file()
    assert not (run_dir / "model.pt").exists()  # not finished


def start(*args: str, torchrun: bool = False) -> subprocess.Popen:
    """src/train.py (or torchrun --nproc_per_node=2 src/train.py) with args, in a session of its own."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"] if torchrun else []
    cmd = [*(launcher or [sys.executable]), str(ROOT / "src/train.py"), *args]
    return subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=_ctrl_c_as_in_a_terminal,
    )


def _ctrl_c_as_in_a_terminal() -> None:
    """SIGINT's default action in the child, whatever this process inherited: a shell's background job (`make
    test &`) ignores SIGINT, and Python, like trainkit, keeps a signal ignored that it was started with."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def wait_for_rows(proc: subprocess.Popen, metrics: Path, count: int = 2, timeout: float = 300) -> None:
    """Until `metrics` holds `count` rows: the run is training."""
    deadline = time.monotonic() + timeout
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= count):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)


def finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_max_time_takes_durations_with_their_unit_and_refuses_anything_else_in_one_line():
    assert stop.seconds("k", "3h50m") == 13800 and stop.seconds("k", "90s") == 90 and stop.seconds("k", "45m") == 2700
    assert stop.seconds("k", "1d12h") == 129600 and stop.seconds("k", "1.5h") == 5400
    assert stop.seconds("k", "03:50:00") == 13800 and stop.seconds("k", "1-00:00:10") == 86410  # SLURM's form
    assert stop.seconds("k", None) is None
    for bad in ("90", "3h50", "0s", "soon", "-5m", "1:2"):  # a bare 90: SLURM reads minutes, Python seconds
        with pytest.raises(ConfigError, match=rf"^trainer.max_time={re.escape(bad)} is not a positive duration "):
            config.check(compose_cfg(f"trainer.max_time='{bad}'"))


def test_a_signal_ignored_before_the_run_stays_ignored_and_the_others_stop_it():
    """A wrapper (nohup, a job script's trap '' USR1) ignored SIGUSR1 on purpose: the Stopper leaves it
    ignored; SIGTERM still stops the run. Every handler is as before afterwards."""
    assert threading.current_thread() is threading.main_thread()  # signal.signal works there only
    before = {sig: signal.getsignal(sig) for sig in stop.SIGNALS}
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    try:
        with stop.Stopper(None, Dist(0, 0, 1, torch.device("cpu"))) as stopper:
            assert signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGUSR1)
            assert stopper.due() is None  # ignored: the run goes on
            os.kill(os.getpid(), signal.SIGTERM)
            assert stopper.due() == "SIGTERM"
        stopper.restore()  # what exit_stopped does after the stop's line
        assert signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


@pytest.mark.slow
def test_a_signal_during_start_up_and_ctrl_c_mid_run_end_one_process_in_one_line_with_its_status(tmp_path):
    # SIGUSR1 as soon as Hydra made the run dir (the loop's Stopper is not there yet): nothing to checkpoint,
    # the line, 128 + 10, and no empty run dir. Ctrl-C mid-run: the line, 128 + 2, no traceback. SIGUSR1 in step
    # 17's forward, between log rows (50): the checkpoint of step 17 (the loop reads the signal's flag every step,
    # also where the cadence has nothing to do: trainkit/cadence.py; planted, not read there: seen failing).
    early, interrupted, signalled = tmp_path / "early", tmp_path / "interrupted", tmp_path / "signalled"
    starting = start(f"hydra.run.dir={early}", *RUN)
    running = start(f"hydra.run.dir={interrupted}", *RUN, "trainer.max_steps=100000")  # Ctrl-C lands mid-run
    model = ["model._target_=test_preemption.signalling_mlp", "+model.rank=0", "+model.at_forward=17"]
    model += [f"+model.signum={int(signal.SIGUSR1)}", f"+model.marker={tmp_path / 'sent'}"]
    in_step_17 = start(f"hydra.run.dir={signalled}", *RUN, *model)
    while not early.is_dir():
        assert starting.poll() is None, starting.communicate()
        time.sleep(0.005)
    starting.send_signal(signal.SIGUSR1)
    wait_for_rows(running, interrupted / "metrics.jsonl")
    running.send_signal(signal.SIGINT)
    (_, early_err), (_, interrupted_err) = finish(starting), finish(running)
    assert starting.returncode == 128 + signal.SIGUSR1, early_err
    assert early_err == "stopped by SIGUSR1 during start-up, before any step; the same command starts it again\n"
    assert not early.exists()
    assert running.returncode == 128 + signal.SIGINT, interrupted_err
    assert interrupted_err == f"error: {config.INTERRUPTED}\n"
    _, signalled_err = finish(in_step_17)
    assert in_step_17.returncode == 128 + signal.SIGUSR1, signalled_err
    assert stopped_at(signalled_err, "SIGUSR1") == 17
    assert_checkpoint_of(signalled, 17)


def signalling_mlp(
    rank: int | None, at_forward: int, signum: int, marker: str, parent: bool = False, **mlp_args
) -> torch.nn.Module:
    """model._target_=test_preemption.signalling_mlp: the mlp (the same weights, the same state_dict keys);
    rank `rank` (null: every rank, as a scheduler signals every task) sends itself `signum` before its
    `at_forward`-th training forward, once (`marker`; null: `<marker>.<rank>` a rank). parent=true: to its
    launcher instead (torchrun's agent, a self-launched worker's train.py), and its step goes on once the
    launcher passed the signal back to it: the stop comes at a known step, however slowly the launcher reacts."""
    from trainkit.models.mlp import mlp

    model, calls, here = mlp(**mlp_args), [0], int(os.environ.get("RANK", 0))
    once = Path(marker if rank is not None else f"{marker}.{here}")

    def hook(module, args):
        if module.training and rank in (None, here):
            calls[0] += 1
            if calls[0] == at_forward and not once.exists():
                once.touch()
                os.kill(os.getppid() if parent else os.getpid(), signum)
                deadline = time.monotonic() + 60  # a launcher that never passes it on: the test fails on the step
                while parent and not _noted(signum) and time.monotonic() < deadline:
                    time.sleep(0.01)

    model.register_forward_pre_hook(hook)
    return model


def _noted(signum: int) -> bool:
    """This process's loop noted `signum`: its handler is the Stopper's (trainkit/stop.py), which keeps the first."""
    return getattr(getattr(signal.getsignal(signum), "__self__", None), "received", 0) == signum


def signalled_at_step_100(marker: Path, signum: int, rank: int = 0, parent: bool = False) -> list[str]:
    """signalling_mlp's overrides: `rank` gets (parent: its launcher gets) `signum` in step 100 of RUN, once."""
    model = ["model._target_=test_preemption.signalling_mlp", f"+model.rank={rank}", "+model.at_forward=100"]
    return [*model, f"+model.signum={int(signum)}", f"+model.marker={marker}", f"+model.parent={str(parent).lower()}"]


def test_a_signal_that_one_rank_alone_gets_stops_every_rank_after_the_same_step_and_resumes_exactly(
    uninterrupted, tmp_path, capfd
):
    # Rank 1 alone gets SIGUSR1 at its step 100 (two forked ranks in torchrun's environment): both ranks
    # write the checkpoint of one step S and exit 138; rank 0 says so. Resumed, the run is the uninterrupted one.
    model = signalled_at_step_100(tmp_path / "signalled", signal.SIGUSR1, rank=1)
    import train  # noqa: F401  once here, not in every forked rank

    codes = run_distributed(exit_status, 2, str(tmp_path / "run"), (*RUN, *model), group=False)
    assert codes == [128 + signal.SIGUSR1] * 2  # every rank: the signal's documented status
    err = capfd.readouterr().err
    assert err.count("stopped by") == 1  # rank 0 alone
    step = stopped_at(err, "SIGUSR1")
    assert 100 <= step < 400
    assert_checkpoint_of(tmp_path / "run", step)
    assert rows(tmp_path / "run")[-1]["step"] <= step
    run_in_process(tmp_path / "run", *RUN, *model, nproc=2)  # the same command
    assert_resumed_exactly(tmp_path / "run", uninterrupted, step)


@pytest.mark.slow
def test_sigterm_to_torchrun_checkpoints_every_worker_at_one_step_and_the_same_command_resumes(uninterrupted, tmp_path):
    # torchrun's agent ends its workers with the signal it got (then SIGKILL after its shutdown timeout, 30 s).
    # Rank 0 sends it SIGTERM in step 100 and goes on once the agent passed it back.
    run_dir, model = tmp_path / "run", signalled_at_step_100(tmp_path / "signalled", signal.SIGTERM, parent=True)
    proc = start(f"hydra.run.dir={run_dir}", *RUN, *model, torchrun=True)
    out, err = finish(proc)
    assert proc.returncode != 0  # torchrun's own: it re-raises the SignalException (exit 1, torch's traceback)
    step = stopped_at(err, "SIGTERM")
    assert 100 <= step < 400
    assert_checkpoint_of(run_dir, step)
    run_in_process(run_dir, *RUN, *model, nproc=2)  # torchrun's environment, in this process
    assert_resumed_exactly(run_dir, uninterrupted, step)


@pytest.mark.slow
def test_max_time_then_sigusr1_stop_a_self_launched_run_never_restarted_and_the_same_command_resumes(
    uninterrupted, tmp_path, capfd
):
    # trainer.max_time: the budget is spent before the first step ends (it counts from the process's start): both
    # workers stop after the step of their first check, status 0. Resumed with a budget that lasts, SIGUSR1 to the
    # parent (from rank 0, in the second part's step 100), which forwards it to its workers (trainkit adds it to
    # the signals it handles): status 138. One line each time; parallel.max_restarts=1 must restart neither stop.
    # The third part ends the run. The first and third parts run train.py's parent in this process
    # (helpers.cli_in_process); the second is the real command, whose parent gets the signal.
    run_dir, workers = tmp_path / "run", ("parallel.nproc_per_node=2", "parallel.max_restarts=1")
    sent = tmp_path / "sent"
    workers += tuple(signalled_at_step_100(sent, signal.SIGUSR1, parent=True))
    sent.touch()  # not in the first part
    proc = cli_in_process(capfd, run_dir, *RUN, *workers, "trainer.max_time=1s")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [line] = proc.stderr.splitlines()  # no "restarting the workers"
    budget_spent = stopped_at(line, "trainer.max_time=1s")
    assert_checkpoint_of(run_dir, budget_spent)
    sent.unlink()
    signalled = start(f"hydra.run.dir={run_dir}", *RUN, *workers, "trainer.max_time=1h")
    out, err = finish(signalled)
    assert signalled.returncode == 128 + signal.SIGUSR1, err
    assert f"resumed from {run_dir / 'checkpoints'}" in out
    [line] = err.splitlines()  # no "rank 1: exited with status 138", no agent report, no restart
    step = stopped_at(line, "SIGUSR1")
    assert budget_spent + 100 <= step < 400
    assert_checkpoint_of(run_dir, step)
    assert cli_in_process(capfd, run_dir, *RUN, *workers, "trainer.max_time=1h").returncode == 0  # the same command
    assert_resumed_exactly(run_dir, uninterrupted, step)
