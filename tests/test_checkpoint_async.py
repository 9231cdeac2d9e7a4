"""checkpoint.async=true: checkpoints written in the background by DCP's async_save equal the synchronous ones
and resume bit for bit (one process, DDP, FSDP2; also after a kill -9 mid-write); the step's state is copied
before the next steps change it; one write in flight, committed (renamed) only once complete; a failed write is
one line, the previous checkpoint stays the newest, and a run whose last write failed ends non-zero."""

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from hydra.errors import ConfigCompositionException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from helpers import ROOT, _entry_point, _env, assert_equal, compose_cfg, rows, run_distributed, run_in_process, weights
from train import train
from trainkit import checkpoint
from trainkit.checkpoint import Checkpointer
from trainkit.dist import Dist
from trainkit.errors import RunError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # DCP, one process
CPU = Dist(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
# AdamW: per-parameter state a resume must bring back (SGD without momentum has none); a best every evaluation.
RUN = ["optim=adamw", "trainer.max_steps=8", "checkpoint.every=2", "checkpoint.keep=10", "trainer.log_every=1"]
RUN += ["trainer.eval_every=4", "model.width=32", "sched=constant", "optim.lr=0.01", "trainer.ema.decay=0.9"]
ASYNC = "checkpoint.async=true"
ENTRIES = ("model", "optimizer", "ema", "scheduler", "scaler", "ranks", "progress", "selection", "autobatch")


def train_in(run_dir: Path, *overrides: str):
    run_dir.mkdir(parents=True, exist_ok=True)
    return train(compose_cfg(*overrides), CPU, "single", run_dir)


def names(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


def same_weights(a: Path, b: Path) -> None:
    got, expected = weights(a), weights(b)
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("sync")
    train_in(run_dir, *RUN)
    return run_dir


@pytest.fixture(scope="module")
def async_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("async")
    train_in(run_dir, *RUN, ASYNC)
    return run_dir


def test_the_key_is_typed():
    assert compose_cfg(ASYNC).checkpoint["async"] is True and compose_cfg().checkpoint["async"] is False
    with pytest.raises(ConfigCompositionException):
        compose_cfg("checkpoint.async=maybe")


def test_async_checkpoints_equal_the_synchronous_ones_and_resume_bitwise(sync_run, async_run, tmp_path):
    assert names(async_run) == ["best", *(f"step_{s:08d}" for s in (2, 4, 6, 8))]  # DCP directories
    assert sorted(p.name for p in (async_run / "checkpoints" / "step_00000004").iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "state.pt",
    ]
    reader = Checkpointer(async_run / "checkpoints", 2, 10, CPU)
    for step in (2, 4, 6, 8):  # each holds the state of its own step, not of a later one
        written = reader._read(async_run / "checkpoints" / f"step_{step:08d}")
        expected = torch.load(sync_run / "checkpoints" / f"step_{step:08d}.pt", weights_only=True)
        for key in ENTRIES:
            assert_equal(written[key], expected[key], f"step {step}: {key}")
    best = reader._read(async_run / "checkpoints" / "best")  # step 8's write, hard-linked (no second write)
    expected = torch.load(sync_run / "checkpoints" / "best.pt", weights_only=True)
    for key in ENTRIES:
        assert_equal(best[key], expected[key], f"best: {key}")
    shards = [async_run / "checkpoints" / name / "__0_0.distcp" for name in ("best", "step_00000008")]
    assert shards[0].stat().st_ino == shards[1].stat().st_ino
    same_weights(async_run, sync_run)
    assert rows(async_run, timings=False) == rows(sync_run, timings=False)
    # Resumed from the directory of step 4 (in a fresh run dir): the uninterrupted run, bit for bit.
    (tmp_path / "checkpoints").mkdir()
    shutil.copytree(async_run / "checkpoints" / "step_00000004", tmp_path / "checkpoints" / "step_00000004")
    train_in(tmp_path, *RUN, ASYNC)
    same_weights(tmp_path, sync_run)
    assert rows(tmp_path, timings=False) == [r for r in rows(sync_run, timings=False) if r["step"] > 4]


def test_a_resume_may_switch_async_on_one_ordering_and_rotation_over_both_layouts(sync_run, tmp_path):
    train_in(tmp_path, *RUN, "trainer.max_steps=4", "checkpoint.keep=2")  # step_2.pt, step_4.pt, best.pt
    assert names(tmp_path) == ["best.pt", "step_00000002.pt", "step_00000004.pt"]
    train_in(tmp_path, *RUN, "checkpoint.keep=2", ASYNC)  # resumes step_4.pt; writes directories from step 6
    assert names(tmp_path) == ["best", "step_00000006", "step_00000008"]  # keep 2 over both kinds; one best (8's)
    assert (tmp_path / "model_best.pt").is_file()
    same_weights(tmp_path, sync_run)
    assert rows(tmp_path, timings=False) == rows(sync_run, timings=False)


class Held(DefaultSavePlanner):
    """DCP's planner whose set-up (in the writing thread, before any byte) waits for `go`; `started` lists the
    checkpoints whose writes began, with whether the one before was committed by then."""

    go = threading.Event()
    started: list[tuple[str, list[str]]] = []
    fail: str | None = None

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False):
        name = Path(str(storage_meta.checkpoint_id)).name
        Held.started.append((name, sorted(p.name for p in Path(str(storage_meta.checkpoint_id)).parent.iterdir())))
        assert Held.go.wait(60)
        if name == Held.fail:
            raise OSError(28, "No space left on device\nsecond line")
        return super().set_up_planner(state_dict, storage_meta, is_coordinator)


@pytest.fixture
def held(monkeypatch):
    Held.go.clear()
    Held.started.clear()
    Held.fail = None
    monkeypatch.setattr(checkpoint, "DefaultSavePlanner", Held)
    yield Held
    Held.go.set()


def state_of(model: torch.nn.Module, step: int) -> dict:
    return {"model": model.state_dict(), "progress": {"step": step}, "ranks": {"rng": torch.get_rng_state()}}


def test_the_state_is_copied_and_the_next_save_waits_for_the_commit(tmp_path, held):
    model = torch.nn.Linear(64, 64)
    checkpointer = Checkpointer(tmp_path, every=1, keep=5, d=CPU, background=True)
    at_save = {k: v.clone() for k, v in model.state_dict().items()}
    checkpointer.save(1, state_of(model, 1))
    with torch.no_grad():  # the next steps change the weights in place while the write is held back
        for p in model.parameters():
            p.add_(1.0)
    time.sleep(0.1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001.tmp"]  # not renamed before it is written
    second = threading.Thread(target=checkpointer.save, args=(2, state_of(model, 2)))
    second.start()
    time.sleep(0.3)
    assert second.is_alive() and [name for name, _ in held.started] == ["step_00000001.tmp"]  # waits for the first
    held.go.set()
    second.join(30)
    checkpointer.wait()
    assert held.started[1] == ("step_00000002.tmp", ["step_00000001", "step_00000002.tmp"])  # after its commit
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001", "step_00000002"]
    first = checkpointer._read(tmp_path / "step_00000001")
    assert_equal(dict(first["model"]), at_save, "model")  # the state at the save, not the changed weights
    assert torch.equal(checkpointer._read(tmp_path / "step_00000002")["model"]["weight"], at_save["weight"] + 1)


def test_a_best_of_a_checkpoint_s_state_rides_on_its_write_in_flight_or_committed(tmp_path, held):
    model = torch.nn.Linear(4, 4)
    checkpointer = Checkpointer(tmp_path, every=1, keep=1, d=CPU, background=True)
    first = state_of(model, 1)
    checkpointer.save(1, first)
    checkpointer.save_best(first)  # in flight: the write becomes best too once committed, and it does not wait
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001.tmp"]
    held.go.set()
    checkpointer.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best", "step_00000001"]
    with torch.no_grad():
        model.weight.add_(1.0)
    second = state_of(model, 2)
    checkpointer.save(2, second)
    assert checkpointer.writing is not None and checkpointer.writing.committed.wait(30)
    checkpointer.save_best(second)  # committed already: linked at once
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best", "step_00000002"]  # keep=1: the best stays whole
    assert torch.equal(checkpointer._read(tmp_path / "best")["model"]["weight"], model.weight)
    assert [name for name, _ in held.started] == ["step_00000001.tmp", "step_00000002.tmp"]  # two writes, not four


def test_a_failed_write_is_one_line_and_the_previous_checkpoint_stays_newest(tmp_path, held, capsys):
    model = torch.nn.Linear(4, 4)
    checkpointer = Checkpointer(tmp_path, every=1, keep=5, d=CPU, background=True)
    held.go.set()
    held.fail = "step_00000002.tmp"
    checkpointer.save(1, state_of(model, 1))
    checkpointer.save(2, state_of(model, 2))
    assert not checkpointer.wait()
    assert capsys.readouterr().out.splitlines() == [
        "warning: checkpoint step_00000002 failed to write (OSError: [Errno 28] No space left on device); "
        "the newest checkpoint stays step_00000001"
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001"]  # its .tmp removed
    assert checkpointer.load("auto")["progress"]["step"] == 1
    with pytest.raises(RunError, match="^the checkpoint step_00000002 .* failed to write; the newest is step_00000001"):
        checkpointer.finish()  # the run's end after it: not a success
    checkpointer.save(3, state_of(model, 3))
    checkpointer.finish()  # a later write that succeeds: the run ends well
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001", "step_00000003"]


def test_a_run_whose_last_write_failed_ends_non_zero_and_the_same_command_finishes_it(sync_run, tmp_path, held):
    held.go.set()
    held.fail = "step_00000008.tmp"
    with pytest.raises(RunError, match="^the checkpoint step_00000008 .*; the newest is step_00000006: the same"):
        train_in(tmp_path, *RUN, ASYNC)
    assert not (tmp_path / "model.pt").exists() and "step_00000006" in names(tmp_path)
    held.fail = None
    train_in(tmp_path, *RUN, ASYNC)  # resumes step 6
    same_weights(tmp_path, sync_run)


def one_process(rank: int, world_size: int, run_dir: str, overrides: tuple[str, ...]) -> int | str | None:
    """What `python src/train.py` exits with (a forked process: the signal's handlers are its own)."""
    try:
        _entry_point("train", run_dir, overrides)
    except SystemExit as exited:
        return exited.code
    return 0


def test_a_signal_s_save_is_written_before_the_stop_and_its_failure_is_the_run_s(tmp_path, held, capfd):
    """SIGUSR1 in step 5 (`python src/train.py` in a forked process): the run stops after step 5's checkpoint,
    complete when the process exits (status 138); when that write fails, the run says so and exits 3, not "written"."""
    signalled = ["model._target_=test_preemption.signalling_mlp", "+model.rank=0", "+model.at_forward=5"]
    signalled += [f"+model.signum={int(signal.SIGUSR1)}", "model.width=32"]
    held.go.set()
    for fail, code in ((None, 128 + signal.SIGUSR1), ("step_00000005.tmp", 3)):
        held.fail = fail
        run_dir = tmp_path / str(code)
        overrides = (*RUN, ASYNC, *signalled, f"+model.marker={run_dir}.signalled")
        codes = run_distributed(one_process, 1, str(run_dir), overrides, group=False)
        err = capfd.readouterr().err
        assert codes == [code], err
        if fail is None:
            assert "stopped by SIGUSR1 at step 5; checkpoint written" in err
            assert names(run_dir) == ["best", "step_00000002", "step_00000004", "step_00000005"]
        else:
            assert (
                "error: the checkpoint step_00000005 (OSError: [Errno 28] No space left on device) failed to "
                "write; the newest is step_00000004: the same command resumes from it" in err
            ), err
            assert names(run_dir) == ["best", "step_00000002", "step_00000004"]


@pytest.mark.slow
def test_killed_while_a_write_is_in_flight_resumes_the_previous_checkpoint_bitwise(sync_run, tmp_path, capsys):
    """A real kill -9 of `python src/train.py` while step 6's write is in flight (held there by tests/held_write.py):
    its .tmp is left, step 4 is the newest complete checkpoint, and the same command resumes it."""
    marker = tmp_path / "held"
    run_dir = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "tests/held_write.py"), "step_00000006", str(marker), str(ROOT / "src/train.py")]
    proc = subprocess.Popen([*cmd, f"hydra.run.dir={run_dir}", *RUN, ASYNC], cwd=ROOT, env=_env())
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(30) == -signal.SIGKILL
    assert "step_00000006.tmp" in names(run_dir) and "step_00000004" in names(run_dir)
    train_in(run_dir, *RUN, ASYNC)
    out = capsys.readouterr().out
    assert "warning: ignoring the incomplete checkpoint" in out and "at step 4" in out
    same_weights(run_dir, sync_run)
    assert rows(run_dir, timings=False) == rows(sync_run, timings=False)


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])  # 2 and 4 s
def test_two_ranks_resume_from_an_async_checkpoint_as_the_uninterrupted_run(tmp_path, mode):
    run = [*RUN, ASYNC, f"parallel={mode}", "data.batch_size=16", "parallel.timeout_s=60"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_in_process(straight, *run, nproc=2)
    assert names(straight) == ["best", *(f"step_{s:08d}" for s in (2, 4, 6, 8))]
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(straight / "checkpoints" / "step_00000004", resumed / "checkpoints" / "step_00000004")
    out = run_in_process(resumed, *run, nproc=2)
    assert "at step 4" in out
    same_weights(resumed, straight)
    assert rows(resumed, timings=False) == [r for r in rows(straight, timings=False) if r["step"] > 4]
