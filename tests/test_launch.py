"""`python src/train.py parallel.nproc_per_node=2`: train.py starts its own workers through torch's
elastic agent. The run equals the torchrun run, a sweep's jobs each own their workers, a worker's
failure is one line and leaves no process behind (also on SIGTERM of the parent), a dead worker
restarts the group, which continues the run (its newest checkpoint, else where it started), and a
refusal or run failure (exit 2, 3) is never restarted."""

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from helpers import CRASH_RUN as RUN
from helpers import (
    ROOT,
    _env,
    cli_in_process,
    compose_cfg,
    faulty,
    final_test_row,
    max_diff,
    rows,
    run_in_process,
    weights,
)
from trainkit import config
from trainkit.config import ConfigError

TINY = ["model.width=16", "model.depth=1", "data.batch_size=8", "trainer.log_every=1"]


def session(pid: int) -> list[int]:
    """The processes still in the session `pid` leads (start_new_session=True): its workers, if any."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != pid:
            try:
                if os.getsid(int(entry.name)) == pid:
                    members.append(int(entry.name))
            except OSError:  # gone meanwhile
                pass
    return members


STARTED: list[subprocess.Popen] = []  # start_train's commands: a test that fails before ended() leaves none behind


@pytest.fixture(autouse=True)
def _end_what_was_started():
    yield
    while STARTED:
        proc = STARTED.pop()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def start_train(run_dir: Path, *overrides: str, **env: str) -> subprocess.Popen:
    cmd = [sys.executable, str(ROOT / "src/train.py"), f"hydra.run.dir={run_dir}", *overrides]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=_env() | env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    STARTED.append(proc)
    return proc


def ended(proc: subprocess.Popen, timeout: float = 300) -> tuple[str, str]:
    """Wait for the parent; fail if any process of its session (a worker) outlived it."""
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 0.5  # the kernel reaps an orphan's exit a moment later
    while (left := session(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.02)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"workers left behind: {left}\n{out}\n{err}"
    return out, err


@pytest.fixture(scope="module")
def torchrun_run(crash_run_two_ranks) -> Path:
    """The uninterrupted run in torchrun's environment (2 forked ranks, tests/helpers.py; conftest.py
    runs it once for this file and test_checkpoint.py)."""
    return crash_run_two_ranks


@pytest.mark.slow
def test_a_self_launched_run_killed_once_restarts_the_group_and_ends_with_the_torchrun_runs_weights(
    torchrun_run, tmp_path, capfd
):
    # Rank 1 dies (SIGKILL) in step 11, after checkpoint 10. resume=null: a restart still continues the run.
    # train.py's parent in this process (helpers.cli_in_process), its workers forked from here.
    marker = tmp_path / "killed"
    proc = cli_in_process(
        capfd,
        tmp_path / "run",
        *RUN,
        *faulty("kill", 31, 1, marker),
        "parallel.nproc_per_node=2",
        "parallel.max_restarts=1",
        "checkpoint.resume=null",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert marker.exists() and "at step 10" in proc.stdout
    assert proc.stderr.splitlines() == ["restarting the workers (restart 1 of 1) after: rank 1: died of SIGKILL"]
    assert proc.stdout.count("trainkit | ddp x2 on cpu") == 2  # parallel=auto picked ddp; rank 0 alone, each round
    # The self-launched run is the torchrun run, bit for bit, across the restart (rows every 3 steps; 12 is one).
    assert max_diff(weights(tmp_path / "run"), weights(torchrun_run)) == 0
    assert rows(tmp_path / "run", timings=False) == rows(torchrun_run, timings=False)
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] == ["run"]  # no worker made a run dir of its own
    assert OmegaConf.load(tmp_path / "run" / ".hydra" / "config.yaml").parallel.nproc_per_node == 2


@pytest.mark.slow
def test_a_worker_that_dies_while_the_other_is_starting_restarts_the_group_not_a_stop(tmp_path, capfd):
    # Rank 1 dies (SIGKILL) as its model is built; rank 0 is still in its start-up (stop.at_once's handlers)
    # when the agent ends it with SIGTERM: a consequence of the death, not the user's stop (issue 45).
    marker = tmp_path / "killed"
    proc = cli_in_process(
        capfd,
        tmp_path / "run",
        *TINY,
        "trainer.max_steps=2",
        *faulty("kill_starting", 0, 1, marker, "mlp"),
        "parallel.nproc_per_node=2",
        "parallel.max_restarts=1",
    )
    assert proc.returncode == 0 and marker.exists(), proc.stdout + proc.stderr
    assert proc.stderr.splitlines() == ["restarting the workers (restart 1 of 1) after: rank 1: died of SIGKILL"]
    assert proc.stdout.count("done: 2 steps") == 1


@pytest.mark.slow
def test_a_sweep_runs_its_jobs_one_after_another_each_on_workers_of_its_own(tmp_path):
    # Jobs 0 and 1 train in this process (nproc_per_node=null: rank 1's fault never comes), its OpenMP pool at 2
    # threads; jobs 2 and 3 fork their workers from it (forced: OMP_NUM_THREADS > 1 would spawn them), whose
    # first matmul would hang at 2 threads. Job 2: rank 1's loss turns NaN, a failure of the workers, recorded
    # in the job's dir; job 3 runs on workers of its own.
    env = {**_env(), "OMP_NUM_THREADS": "2", "TRAINKIT_START_METHOD": "fork"}
    cmd = [sys.executable, str(ROOT / "src/train.py"), "-m", f"hydra.sweep.dir={tmp_path}", *TINY]
    cmd += ["parallel.nproc_per_node=null,2", "trainer.max_steps=3", *faulty("nan,none", 2, 1, "/none", name="mlp")]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and errors[0].startswith("error: job 2 ("), proc.stderr
    assert "parallel.nproc_per_node=2 " in errors[0] and "+model.fault='nan' " in errors[0], errors
    assert errors[0].endswith(
        "): non-finite loss or gradient at step 2 (trainer.on_nonfinite=raise; skip drops such windows)"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0", "1", "2", "3", "multirun.yaml"]
    assert (tmp_path / "2" / "error.txt").is_file() and not (tmp_path / "2" / "model.pt").exists()
    for job in ("0", "1", "3"):
        assert [r["step"] for r in rows(tmp_path / job) if "loss" in r] == [1, 2, 3]
        assert (tmp_path / job / "model.pt").is_file()
    assert proc.stdout.count("trainkit | single x1") == 2 and proc.stdout.count("trainkit | ddp x2") == 2


@pytest.mark.slow
def test_self_launched_jobs_at_once_a_raising_worker_or_sigterm_end_one_in_one_line_and_the_others_go_on(tmp_path):
    # Each launch has its rendezvous store on a free port of its own. `long` and `raises` start together (their
    # start-ups overlap, and so may their rendezvous); `second` starts once `long` trains: on `long`'s port it
    # would join `long`'s store, and lose it when `long` ends. Every parent is checked for processes left behind.
    hold = tmp_path / "hold"  # rank 0 of `long` waits for it in step 2: the job lives on, at no cost in CPU
    long = start_train(
        tmp_path / "long",
        "parallel.nproc_per_node=2",
        *TINY,
        "trainer.max_steps=1000000",
        *faulty("wait", 2, 0, hold, "mlp"),
    )
    raises = start_train(
        tmp_path / "raises", "parallel.nproc_per_node=2", *TINY, *faulty("raise", 3, 1, "/none", "mlp")
    )
    assert long.stdout is not None
    while not long.stdout.readline().startswith("step"):  # its workers train
        assert long.poll() is None
    go_on = tmp_path / "go_on"  # rank 0 of the second job waits for it in step 2
    second = start_train(
        tmp_path / "second",
        "parallel.nproc_per_node=2",
        *TINY,
        "trainer.max_steps=3",
        *faulty("wait", 2, 0, go_on, "mlp"),
    )
    out, err = ended(raises)
    assert raises.returncode == 1, err
    [line] = err.splitlines()  # not the agent's ChildFailedError report, nor rank 0's failed collective
    assert line.startswith("error: rank 1: RuntimeError: helpers.Faulty: a bug on rank 1 at forward 3 (traceback: ")
    error_file = Path(line.removesuffix(")").rpartition("(traceback: ")[2])
    assert "Traceback" in error_file.read_text()  # torch's error file (record) keeps the worker's traceback
    shutil.rmtree(next(p for p in error_file.parents if p.name.startswith("trainkit-launch-")))  # kept for it

    assert second.stdout is not None
    while not second.stdout.readline().startswith("step"):  # step 1 is done
        assert second.poll() is None
    assert long.poll() is None
    long.send_signal(signal.SIGTERM)  # forwarded to the workers, which checkpoint first (trainkit/stop.py)
    hold.touch()  # its step 2 goes on: the stop comes at the ranks' next check
    out, err = ended(long, timeout=60)
    assert long.returncode == 128 + signal.SIGTERM
    assert re.fullmatch(r"stopped by SIGTERM at step \d+; checkpoint written; the same command resumes\n", err), err
    time.sleep(2)  # the second job's agent asks its store every 0.1 s: a lost store would fail it meanwhile
    go_on.touch()
    out, err = ended(second)
    assert second.returncode == 0, out + err
    assert (tmp_path / "second" / "model.pt").is_file()


def slow_test_pass_mlp(model_pt: str, started: str, **mlp_args) -> torch.nn.Module:
    """model._target_=test_launch.slow_test_pass_mlp: the mlp, whose evaluation forwards once `model_pt`
    exists (the final test pass: model.pt is written just before it) touch `started` and take 0.2 s each."""
    from trainkit.models.mlp import mlp

    def slowly(module, args):
        if not module.training and Path(model_pt).exists():
            Path(started).touch()
            time.sleep(0.2)

    model = mlp(**mlp_args)
    model.register_forward_pre_hook(slowly)
    return model


@pytest.mark.slow
def test_sigterm_during_the_final_test_pass_lets_the_workers_finish_and_the_run_ends_finished(tmp_path):
    # SIGTERM to the parent once the workers' test pass runs (6 batches of 32 on each rank, 1.2 s): it
    # comes after the last step, so the workers finish: test row, model.pt, model_best.pt, exit 0. The
    # agent would end them (SIGKILL after TORCH_ELASTIC_SHUTDOWN_TIMEOUT: here at once); it never gets it.
    run_dir, started = tmp_path / "run", tmp_path / "started"
    model = ["model._target_=test_launch.slow_test_pass_mlp", f"+model.model_pt={run_dir / 'model.pt'}"]
    model += [f"+model.started={started}", "data.batch_size=32", "trainer.max_steps=4"]
    proc = start_train(run_dir, "parallel.nproc_per_node=2", *model, TORCH_ELASTIC_SHUTDOWN_TIMEOUT="0")
    while not started.exists():
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    out, err = ended(proc, timeout=60)
    assert proc.returncode == 0, out + err
    assert "SIGTERM came after the last step: the run finished first (nothing to resume)" in out and not err
    assert "done: 4 steps" in out and final_test_row(run_dir)["step"] == 4
    assert (run_dir / "model.pt").is_file() and (run_dir / "model_best.pt").is_file()


@pytest.mark.slow
def test_help_shows_the_launch_forms_and_the_groups_a_run_picks_from(tmp_path, capfd):
    proc = cli_in_process(capfd, tmp_path, "--help")  # the interpreter's start (torch's import) is most of its 5 s
    assert proc.returncode == 0 and not proc.stderr, proc.stderr
    out = proc.stdout
    assert "python src/train.py -m parallel.nproc_per_node=2 accumulation.steps=1,2,4" in out
    assert "python src/train.py --cfg job --resolve" in out
    models = ", ".join(sorted(p.stem for p in (ROOT / "conf" / "model").glob("*.yaml")))  # a fork's own too
    assert f"\n  model: {models}\n" in out and "timm" in models and "schema" not in out  # conf/'s groups only
    assert 'README.md lists the groups and main keys ("The config tree")' in out
    assert "docs/config.md explains each group and key" in out


def test_nproc_per_node_that_contradicts_torchrun_is_refused(monkeypatch):
    monkeypatch.setitem(os.environ, "RANK", "0")
    monkeypatch.setitem(os.environ, "WORLD_SIZE", "2")
    monkeypatch.setitem(os.environ, "LOCAL_WORLD_SIZE", "2")
    config.check(compose_cfg("parallel.nproc_per_node=2"))  # agrees
    config.check(compose_cfg("parallel.nproc_per_node=auto"))  # the launcher's
    with pytest.raises(ConfigError, match=r"^parallel.nproc_per_node=4 contradicts torchrun, which started 2 proc"):
        config.check(compose_cfg("parallel.nproc_per_node=4"))
    with pytest.raises(ConfigError, match=r"^parallel.max_restarts=1 restarts the workers trainkit starts itself"):
        config.check(compose_cfg("parallel.max_restarts=1"))


@pytest.mark.slow
def test_a_refused_resume_or_a_non_finite_loss_ends_the_job_in_its_one_line_without_a_restart(tmp_path, capfd):
    # A known refusal (exit 2) or run failure (exit 3) would fail the same way again: never restarted.
    refused = cli_in_process(
        capfd,
        tmp_path / "refused",
        "parallel.nproc_per_node=2",
        "parallel.max_restarts=1",
        *TINY,
        "trainer.max_steps=4",
        "checkpoint.resume=no/such/dir/step_00000005.pt",
    )
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert refused.stderr.splitlines() == [
        "error: checkpoint.resume=no/such/dir/step_00000005.pt: no such checkpoint file (or DCP directory)"
    ]
    assert "trainkit |" not in refused.stdout and not (tmp_path / "refused").exists()  # nothing trained

    nan = cli_in_process(
        capfd,
        tmp_path / "nan",
        "parallel.nproc_per_node=2",
        "parallel.max_restarts=1",
        *TINY,
        "trainer.max_steps=3",
        *faulty("nan", 2, 1, "/none", "mlp"),
    )
    assert nan.returncode == 3, nan.stdout + nan.stderr
    assert nan.stderr.splitlines() == [
        "error: non-finite loss or gradient at step 2 (trainer.on_nonfinite=raise; skip drops such windows)"
    ]
    assert nan.stdout.count("trainkit | ddp x2") == 1  # the workers ran once


@pytest.mark.slow
def test_a_worker_that_exits_with_a_status_of_its_own_is_named(tmp_path, capfd):
    # Rank 1 calls os._exit(17) in step 2; rank 0's collective fails because of it (a consequence).
    proc = cli_in_process(
        capfd,
        tmp_path / "run",
        "parallel.nproc_per_node=2",
        *TINY,
        "trainer.max_steps=3",
        *faulty("exit", 2, 1, tmp_path / "exited", "mlp"),
    )
    assert proc.returncode == 17, proc.stdout + proc.stderr
    assert proc.stderr.splitlines() == ["error: rank 1: exited with status 17"]


@pytest.mark.slow
def test_a_resumed_run_restarted_before_its_first_checkpoint_continues_from_the_checkpoint_it_started_from(
    tmp_path, capfd
):
    marker = tmp_path / "killed"
    marker.touch()  # no kill in the runs that make the checkpoint and the reference
    run = [*TINY, "trainer.max_steps=6", "checkpoint.every=3", *faulty("kill", 2, 1, marker, "mlp")]
    run_in_process(tmp_path / "source", *run, nproc=2)  # checkpoints at steps 3 and 6
    resume = [f"checkpoint.resume={tmp_path / 'source' / 'checkpoints' / 'step_00000003.pt'}", "optim.lr=0.01"]
    run_in_process(tmp_path / "uninterrupted", *run, *resume, nproc=2)  # the resume as it goes without a death
    marker.unlink()
    # Rank 1 dies (SIGKILL) in step 5 of the resumed run, before its dir's first checkpoint (step 6): the
    # restarted round resumes step 3 of the source again, not a fresh run (a new lr: a fresh run differs).
    proc = cli_in_process(
        capfd, tmp_path / "run", *run, *resume, "parallel.nproc_per_node=2", "parallel.max_restarts=1"
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert marker.exists() and proc.stdout.count("at step 3") == 2, proc.stdout
    assert proc.stderr.splitlines() == ["restarting the workers (restart 1 of 1) after: rank 1: died of SIGKILL"]
    assert rows(tmp_path / "run", timings=False) == rows(tmp_path / "uninterrupted", timings=False)
    assert max_diff(weights(tmp_path / "run"), weights(tmp_path / "uninterrupted")) == 0
