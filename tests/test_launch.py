"""`python src/train.py parallel.nproc_per_node=2`: train.py starts its own workers through torch's
elastic agent. The run equals the torchrun run, a sweep's jobs each own their workers, a worker's
failure is one line and leaves no process behind (also on SIGTERM of the parent), and a dead worker
restarts the group, which resumes from the newest checkpoint."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from helpers import CRASH_RUN as RUN
from helpers import ROOT, _env, compose_cfg, faulty, max_diff, rows, run_train, weights
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


def start_train(run_dir: Path, *overrides: str) -> subprocess.Popen:
    cmd = [sys.executable, str(ROOT / "src/train.py"), f"hydra.run.dir={run_dir}", *overrides]
    return subprocess.Popen(
        cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def ended(proc: subprocess.Popen, timeout: float = 300) -> tuple[str, str]:
    """Wait for the parent; fail if any process of its session (a worker) outlived it."""
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    time.sleep(0.5)  # the kernel reaps an orphan's exit a moment later
    left = session(proc.pid)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"workers left behind: {left}\n{out}\n{err}"
    return out, err


@pytest.fixture(scope="module")
def torchrun_run(crash_run_two_ranks) -> Path:
    """The uninterrupted run in torchrun's environment (2 forked ranks, tests/helpers.py; conftest.py
    runs it once for this file and test_checkpoint.py)."""
    return crash_run_two_ranks


def never(directory: Path) -> Path:
    """A kill marker that exists: helpers.Faulty never kills."""
    (directory / "never").touch()
    return directory / "never"


@pytest.mark.slow
def test_a_self_launched_run_equals_the_torchrun_run(torchrun_run, tmp_path):
    proc = run_train(tmp_path / "run", *RUN, *faulty("kill", 31, 1, never(tmp_path)), "parallel.nproc_per_node=2")
    assert proc.stdout.count("trainkit | ddp x2 on cpu") == 1  # parallel=auto picked ddp; rank 0 alone prints
    assert rows(tmp_path / "run", timings=False) == rows(torchrun_run, timings=False)
    assert max_diff(weights(tmp_path / "run"), weights(torchrun_run)) <= 1e-7
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] == ["run"]  # no second run dir
    assert OmegaConf.load(tmp_path / "run" / ".hydra" / "config.yaml").parallel.nproc_per_node == 2


@pytest.mark.slow
def test_a_worker_killed_once_restarts_the_group_which_resumes_to_the_uninterrupted_weights(torchrun_run, tmp_path):
    marker = tmp_path / "killed"
    # Rank 1 dies (SIGKILL) in step 11, after checkpoint 10. resume=null: a restart still continues the run.
    proc = run_train(
        tmp_path / "run",
        *RUN,
        *faulty("kill", 31, 1, marker),
        "parallel.nproc_per_node=2",
        "parallel.max_restarts=1",
        "checkpoint.resume=null",
    )
    assert marker.exists() and "at step 10" in proc.stdout
    assert max_diff(weights(tmp_path / "run"), weights(torchrun_run)) == 0
    assert rows(tmp_path / "run", timings=False) == rows(torchrun_run, timings=False)


@pytest.mark.slow
def test_a_sweep_runs_its_jobs_one_after_another_each_on_workers_of_its_own(tmp_path):
    # Job 0: rank 1's loss turns NaN, a failure of the workers, recorded in the job's dir; job 1 runs.
    proc = run_train(
        tmp_path / "unused",
        "-m",
        f"hydra.sweep.dir={tmp_path}",
        "parallel.nproc_per_node=2",
        *TINY,
        "trainer.max_steps=3",
        *faulty("nan,none", 2, 1, "/none", name="mlp"),
        check=False,
    )
    assert proc.returncode == 1, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and errors[0].startswith("error: job 0 (parallel.nproc_per_node=2 "), proc.stderr
    assert errors[0].endswith(
        "): non-finite loss or gradient at step 2 (trainer.on_nonfinite=raise; skip drops such windows)"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0", "1", "multirun.yaml"]
    assert (tmp_path / "0" / "error.txt").is_file() and not (tmp_path / "0" / "model.pt").exists()
    assert [r["step"] for r in rows(tmp_path / "1") if "loss" in r] == [1, 2, 3]
    assert (tmp_path / "1" / "model.pt").is_file()
    assert proc.stdout.count("trainkit | ddp x2") == 2


@pytest.mark.slow
def test_a_job_trained_here_with_two_threads_then_forked_workers_do_not_hang(tmp_path):
    # Job 0 trains in this process, its OpenMP pool at 2 threads; job 1 forks its workers from it (forced:
    # OMP_NUM_THREADS > 1 would spawn them). A forked worker at 2 threads would hang in its first matmul.
    env = {**_env(), "OMP_NUM_THREADS": "2", "TRAINKIT_START_METHOD": "fork"}
    cmd = [sys.executable, str(ROOT / "src/train.py"), "-m", f"hydra.sweep.dir={tmp_path}", *TINY]
    cmd += ["parallel.nproc_per_node=null,2", "trainer.max_steps=2"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "single x1" in proc.stdout and "ddp x2" in proc.stdout
    assert (tmp_path / "0" / "model.pt").is_file() and (tmp_path / "1" / "model.pt").is_file()


@pytest.mark.slow
def test_a_worker_that_raises_or_sigterm_of_the_parent_ends_the_job_in_one_line_and_leaves_no_process(tmp_path):
    # Two self-launched jobs at once on this machine: each rendezvous has a free port of its own. Started
    # together (their start-ups overlap, and so may their rendezvous); `long` outlives `raises`.
    long = start_train(tmp_path / "long", "parallel.nproc_per_node=2", *TINY, "trainer.max_steps=1000000")
    raises = start_train(
        tmp_path / "raises", "parallel.nproc_per_node=2", *TINY, *faulty("raise", 3, 1, "/none", "mlp")
    )
    out, err = ended(raises)
    assert raises.returncode == 1, err
    [line] = err.splitlines()  # not the agent's ChildFailedError report, nor rank 0's failed collective
    assert line.startswith("error: rank 1: RuntimeError: helpers.Faulty: a bug on rank 1 at forward 3 (traceback: ")
    error_file = Path(line.removesuffix(")").rpartition("(traceback: ")[2])
    assert "Traceback" in error_file.read_text()  # torch's error file (record) keeps the worker's traceback
    shutil.rmtree(error_file.parents[3])  # the launch's log dir, kept for it

    assert long.stdout is not None
    while not long.stdout.readline().startswith("step"):  # its workers train
        assert long.poll() is None
    assert long.poll() is None
    long.send_signal(signal.SIGTERM)
    out, err = ended(long, timeout=60)
    assert long.returncode == 128 + signal.SIGTERM
    assert err.strip() == "error: stopped by SIGTERM; the workers were ended"


@pytest.mark.slow
def test_help_shows_the_launch_forms_and_the_groups_a_run_picks_from(tmp_path):
    out = run_train(tmp_path, "--help").stdout
    assert "python src/train.py -m parallel.nproc_per_node=2 accumulation.steps=1,2,4" in out
    assert "python src/train.py --cfg job --resolve" in out
    assert "\n  model: cnn, gpt, mlp, resnet18\n" in out and "schema" not in out  # conf/'s groups only
    assert 'README.md explains each group and key ("The config tree")' in out


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
