"""Checkpoints: bitwise resume after a real crash, torchrun restarts, atomic saves, clear refusals,
non-finite losses handled on all ranks together, and a hung peer ending the job."""

import json
import math
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from torch.multiprocessing import ProcessExitedException

from helpers import CRASH_RUN as RUN
from helpers import (
    ROOT,
    _entry_point,
    assert_equal,
    cli_in_process,
    exit_status,
    faulty,
    run_distributed,
    run_in_process,
    run_train,
)
from helpers import rows as metrics_rows
from train import train
from trainkit.checkpoint import Checkpointer, load_model, parse_step, save_whole, snapshot, step_name
from trainkit.config import ConfigError
from trainkit.dist import Dist
from trainkit.errors import RunError

CPU = Dist(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))


def rows(run_dir: Path) -> list[dict]:
    return metrics_rows(run_dir, timings=False)


def assert_same_run(a: Path, b: Path):
    """Same final weights, same optimizer/scheduler/RNG state at step 20, same logged rows."""
    final_a, final_b = (torch.load(d / "model.pt", weights_only=True) for d in (a, b))
    assert final_a.keys() == final_b.keys()
    assert all(torch.equal(final_a[k], final_b[k]) for k in final_a)
    ckpt_a, ckpt_b = (torch.load(d / "checkpoints" / "step_00000020.pt", weights_only=True) for d in (a, b))
    for key in ("optimizer", "scheduler", "ranks", "progress"):
        assert_equal(ckpt_a[key], ckpt_b[key], key)
    assert rows(a) == rows(b)  # the same losses: the same batches were drawn after the resume


def _train_in_a_fork(rank: int, world_size: int, run_dir: str, overrides: tuple[str, ...]) -> str:
    return _entry_point("train", run_dir, overrides)  # what python src/train.py runs after composing


@pytest.mark.slow
def test_single_process_killed_after_step_10_resumes_bitwise(tmp_path):
    marker = tmp_path / "killed"
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    marker.with_name("never").touch()
    # The uninterrupted run and the resume in this process (what train.py runs after Hydra composed the
    # config); the crash in a forked process of its own, which SIGKILL ends.
    run_in_process(straight, *RUN, *faulty("kill", 31, 0, marker.with_name("never")))
    # The 31st micro-step is step 11's first: the process dies (SIGKILL) after checkpoint 10.
    with pytest.raises(ProcessExitedException) as died:
        run_distributed(_train_in_a_fork, 1, str(crashed), (*RUN, *faulty("kill", 31, 0, marker)), group=False)
    assert died.value.signal_name == "SIGKILL" and marker.exists()
    assert sorted(p.name for p in (crashed / "checkpoints").iterdir()) == ["step_00000010.pt"]
    out = run_in_process(crashed, *RUN, *faulty("kill", 31, 0, marker))  # resume=auto, nothing of the first
    assert "resumed from" in out and "at step 10" in out  # process left but its run dir
    assert_same_run(straight, crashed)


@pytest.mark.slow
def test_torchrun_restart_after_a_killed_worker_resumes_bitwise(crash_run_two_ranks, tmp_path):
    marker = tmp_path / "killed"
    crashed = tmp_path / "crashed"
    # Rank 1 is SIGKILLed in step 11; torchrun's elastic agent restarts both workers, which find
    # the run dir's checkpoint 10 by themselves and finish the job. conftest.py: the uninterrupted run.
    proc = run_train(crashed, *RUN, *faulty("kill", 31, 1, marker), nproc=2, torchrun=("--max-restarts=1",))
    assert marker.exists() and "resumed from" in proc.stdout
    restart_cost = marker.with_suffix(".resumed").stat().st_mtime - marker.stat().st_mtime
    print(f"restart cost (SIGKILL to the first resumed step): {restart_cost:.1f} s")
    assert_same_run(crash_run_two_ranks, crashed)


def compose_cfg(*overrides):
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return compose("train", overrides=list(overrides))


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("short")
    train(compose_cfg("trainer.max_steps=4", "checkpoint.every=2", "checkpoint.keep=1"), CPU, "single", run_dir)
    return run_dir


def test_keep_last_n_and_the_final_checkpoint(short_run):
    assert sorted(p.name for p in (short_run / "checkpoints").iterdir()) == ["best.pt", "step_00000004.pt"]


@pytest.mark.parametrize(
    "override,named",
    [
        ("data.batch_size=16", "global_batch=32, this run has global_batch=16"),
        ("model.width=64", "model.width=128, this run has model.width=64"),
        ("seed=1", "seed=0, this run has seed=1"),
    ],
)
def test_a_resume_that_cannot_be_exact_is_refused_naming_the_difference(short_run, tmp_path, override, named):
    resume = f"checkpoint.resume={short_run / 'checkpoints' / 'step_00000004.pt'}"
    with pytest.raises(ConfigError, match=named):
        train(compose_cfg("trainer.max_steps=8", resume, override), CPU, "single", tmp_path)


def test_checkpoint_names_come_from_one_pair_that_reads_them_back():
    assert (step_name(12), step_name(12, sharded=True)) == ("step_00000012.pt", "step_00000012")
    assert sorted(map(step_name, (100, 9, 10))) == list(map(step_name, (9, 10, 100)))  # names sort by step
    assert [parse_step(step_name(7, s)) for s in (False, True)] == [7, 7]
    assert parse_step("step_00000007.pt", sharded=True) is None and parse_step("step_00000007", sharded=False) is None
    assert [parse_step(n) for n in ("best.pt", "best", "step_00000007.pt.tmp", "step_x.pt")] == [None] * 4


def test_a_checkpoint_of_another_architecture_is_refused_naming_the_keys():
    with pytest.raises(ConfigError, match=r"step_1.pt does not fit the model: other shape weight$"):
        load_model(torch.nn.Linear(3, 2), torch.nn.Linear(4, 2).state_dict(), "step_1.pt")


def test_crash_during_save_resumes_from_the_previous_checkpoint(short_run, tmp_path):
    directory = tmp_path / "checkpoints"
    directory.mkdir()
    good = (short_run / "checkpoints" / "step_00000004.pt").read_bytes()
    (directory / "step_00000004.pt").write_bytes(good)
    (directory / "step_00000006.pt").write_bytes(good[: len(good) // 2])  # truncated
    (directory / "step_00000008.pt.tmp").write_bytes(good[:100])  # killed before the rename
    checkpointer = Checkpointer(directory, every=2, keep=2, d=CPU)
    state = checkpointer.load("auto")
    assert state["progress"]["step"] == 4
    assert not (directory / "step_00000008.pt.tmp").exists()  # leftovers are cleaned


class Unpicklable:
    def __reduce__(self):
        raise RuntimeError("stopped half-way")


def test_a_weights_file_stopped_mid_write_is_left_whole_or_absent(tmp_path):
    """model.pt marks a finished run: a write that fails half-way (here pickling, after the tensor's bytes) keeps
    the file as it was, or absent, never cut."""
    path = tmp_path / "model.pt"
    unpicklable = {"weight": torch.ones(1000), "then": Unpicklable()}
    with pytest.raises(RuntimeError, match="half-way"):
        save_whole(unpicklable, path)
    assert list(tmp_path.iterdir()) == []
    save_whole({"weight": torch.zeros(3)}, path)
    with pytest.raises(RuntimeError, match="half-way"):
        save_whole(unpicklable, path)
    assert torch.equal(torch.load(path, weights_only=True)["weight"], torch.zeros(3))
    assert [p.name for p in tmp_path.iterdir()] == ["model.pt"]


def test_a_snapshot_refuses_one_non_finite_tensor_among_finite_ones():
    """One NaN in one buffer of a model whose every other tensor is finite: no checkpoint holds it (one line)."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    states = (optimizer, scheduler, torch.amp.GradScaler("cpu", enabled=False), torch.optim.SGD([torch.ones(1)]))
    taken = snapshot(model, *states, {"step": 7}, {}, {}, None, CPU)  # finite: saved (the meter: any state_dict)
    assert taken["model"].keys() == model.state_dict().keys()
    model[1].running_var[1] = float("nan")
    with pytest.raises(RunError, match="^refusing to checkpoint non-finite weights or buffers at step 7$"):
        snapshot(model, *states, {"step": 7}, {}, {}, None, CPU)


def test_auto_without_checkpoint_starts_fresh_and_keep_must_be_positive(tmp_path):
    assert Checkpointer(tmp_path / "none", every=0, keep=1, d=CPU).load("auto") is None
    with pytest.raises(ConfigError, match="checkpoint.keep=0"):
        Checkpointer(tmp_path, every=0, keep=0, d=CPU)
    with pytest.raises(ConfigError, match="no such checkpoint file"):
        Checkpointer(tmp_path, every=0, keep=1, d=CPU).load(str(tmp_path / "missing.pt"))


TINY_CNN = ["model=cnn", "model.width=8", "trainer.max_steps=8"]
NAN = [*TINY_CNN, "trainer.log_every=1", "checkpoint.every=2"]


NON_FINITE = "non-finite loss or gradient at step {} (trainer.on_nonfinite=raise; skip drops such windows)"


@pytest.mark.slow
@pytest.mark.parametrize(
    "log_every,checkpoint_every,left",
    [(1, 2, ["step_00000002.pt", "step_00000004.pt"]), (8, 1, ["step_00000003.pt", "step_00000004.pt"])],
)
def test_nan_on_one_rank_raise_stops_every_rank_before_a_row_or_checkpoint_holds_it(
    tmp_path, capfd, log_every, checkpoint_every, left
):
    # on_nonfinite=raise checks no step on its own (no host sync per step): before each log row
    # and each checkpoint. Both catch step 5 (a row every step; a checkpoint every step). Two forked
    # ranks in torchrun's environment: each exits 3, rank 0 says why (a rank that went on alone would
    # wait for the other in its next collective: 60 s, then exit 1).
    overrides = (
        *TINY_CNN,
        "parallel.timeout_s=60",
        f"trainer.log_every={log_every}",
        f"checkpoint.every={checkpoint_every}",
        *faulty("nan", 5, 1, tmp_path / "m"),
    )
    assert run_distributed(exit_status, 2, str(tmp_path), overrides, group=False) == [3, 3]
    errors = [line for line in capfd.readouterr().err.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {NON_FINITE.format(5)}"]
    assert not (tmp_path / "model.pt").exists()
    last = torch.load(tmp_path / "checkpoints" / "step_00000004.pt", weights_only=True)
    assert all(torch.isfinite(t).all() for t in last["model"].values())
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == left
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(r["loss"]) and r["step"] <= 4 for r in rows if "loss" in r)


@pytest.mark.slow
def test_nan_raise_leaves_no_evaluation_row_of_a_non_finite_step(tmp_path, capsys):
    # Evaluation rows come every step, training rows every 8: the check before evaluation catches
    # step 3 (NaN weights would log val/loss NaN for steps 3..7 before the step-8 row raised).
    overrides = ("trainer.log_every=8", "trainer.eval_every=1", "checkpoint.every=0")
    with pytest.raises(SystemExit) as failed:
        run_in_process(tmp_path, *TINY_CNN, *overrides, *faulty("nan", 3, 0, tmp_path / "m"))
    assert failed.value.code == 3
    assert capsys.readouterr().err.strip() == f"error: {NON_FINITE.format(3)}"
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["val/loss"]) for r in rows)
    assert (tmp_path / "error.txt").read_text() == NON_FINITE.format(3) + "\n"  # for report.py


@pytest.mark.slow
def test_nan_on_one_rank_skip_drops_the_window_and_continues(tmp_path):
    run_in_process(tmp_path, *NAN, "trainer.on_nonfinite=skip", *faulty("nan", 5, 1, tmp_path / "m"), nproc=2)
    log = rows(tmp_path)
    assert [r["skipped_steps"] for r in log if "loss" in r] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert math.isnan(log[4]["loss"]) and all(math.isfinite(r["loss"]) for i, r in enumerate(log) if i != 4)
    assert log[-1]["step"] == 8
    weights = torch.load(tmp_path / "model.pt", weights_only=True)
    assert all(torch.isfinite(t).all() for t in weights.values())


@pytest.mark.slow
def test_a_hung_peer_ends_the_job_within_the_timeout(tmp_path, capfd):
    # Self-launched ranks: the timeout is the process group's, whoever started the ranks. train.py's parent in
    # this process (helpers.cli_in_process): the agent ends the hung worker forked from here.
    started = time.monotonic()
    overrides = ("parallel.nproc_per_node=2", "parallel.timeout_s=3", *faulty("hang", 3, 1, tmp_path / "m"))
    proc = cli_in_process(capfd, tmp_path, *NAN, *overrides)
    elapsed = time.monotonic() - started
    assert proc.returncode != 0
    assert "error: a collective failed, a peer rank died or hangs (parallel.timeout_s=3)" in proc.stderr
    assert elapsed < 60, elapsed  # start-up + the 3 s timeout + the agent's ending the hung worker (~5 s)


# --- off the happy path: skipped steps leave no trace, resumes that change settings ---------


def train_in(run_dir: Path, *overrides):
    run_dir.mkdir(parents=True, exist_ok=True)
    return train(compose_cfg(*overrides), CPU, "single", run_dir)


def checkpoint(run_dir: Path, step: int) -> dict:
    return torch.load(run_dir / "checkpoints" / f"step_{step:08d}.pt", weights_only=True)


SKIP = [
    "model=cnn",
    "model.width=8",
    "trainer.max_steps=6",
    "trainer.log_every=1",
    "checkpoint.every=1",
    "checkpoint.keep=10",
    "trainer.on_nonfinite=skip",
    "sched.warmup_steps=2",
]


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_a_skipped_window_leaves_no_trace_in_weights_buffers_optimizer_scaler_or_schedule(tmp_path, precision):
    # One NaN input sample in step 4's batch: the forward already wrote NaN into BatchNorm's
    # running statistics before the loss was known. fp16: the scaler must be closed for the step.
    train_in(tmp_path, *SKIP, f"trainer.precision={precision}", *faulty("nan_input", 4, 0, tmp_path / "m"))
    before, skipped, after = (checkpoint(tmp_path, s) for s in (3, 4, 6))
    for key in ("model", "optimizer", "scheduler", "scaler"):
        assert_equal(skipped[key], before[key], key)
    assert all(torch.isfinite(t).all() for t in after["model"].values() if t.is_floating_point())
    final = torch.load(tmp_path / "model.pt", weights_only=True)
    assert all(torch.isfinite(t).all() for t in final.values() if t.is_floating_point())
    assert [r["skipped_steps"] for r in rows(tmp_path) if "loss" in r] == [0, 0, 0, 1, 1, 1]
    assert after["scheduler"]["last_epoch"] == 5  # 6 steps, 5 taken


def test_fp16_overflow_is_gradscalers_skip_the_schedule_waits_and_the_row_leaves_it_out(tmp_path):
    # Step 3's gradient is infinite, its loss finite: GradScaler's overflow, not a non-finite
    # loss (on_nonfinite=raise must not stop the run). The scale backs off, the LR stays.
    train_in(
        tmp_path,
        *SKIP[:-2],
        "trainer.on_nonfinite=raise",
        "trainer.log_every=2",
        "sched.warmup_steps=4",
        "trainer.precision=fp16",
        *faulty("inf_grad", 3, 0, tmp_path / "m"),
    )
    log = [r for r in rows(tmp_path) if "loss" in r]
    assert [r["skipped_steps"] for r in log] == [0, 1, 1]
    assert all(math.isfinite(r["grad_norm"]) and math.isfinite(r["loss"]) for r in log)
    assert checkpoint(tmp_path, 2)["scaler"]["scale"] == 2.0**16
    assert checkpoint(tmp_path, 3)["scaler"]["scale"] == 2.0**15
    assert checkpoint(tmp_path, 3)["scheduler"]["last_epoch"] == checkpoint(tmp_path, 2)["scheduler"]["last_epoch"] == 2
    assert_equal(checkpoint(tmp_path, 3)["optimizer"], checkpoint(tmp_path, 2)["optimizer"], "optimizer")
    # The LR logged for step 4 is the schedule at 2 steps taken, as for step 3.
    assert checkpoint(tmp_path, 6)["scheduler"]["last_epoch"] == 5


@pytest.mark.slow
def test_a_refused_run_leaves_the_run_dir_as_it_was(tmp_path, capsys):
    run_in_process(tmp_path, "trainer.max_steps=5", "model.width=16")  # the finished run; then two refusals
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    mtimes = {p: p.stat().st_mtime_ns for p in before}
    # A resume that cannot be exact, refused by train.py's run (in this process: what it runs after composing) ...
    with pytest.raises(SystemExit) as refused:
        run_in_process(tmp_path, "trainer.max_steps=5", "model.width=64")
    assert refused.value.code == 2 and capsys.readouterr().err.strip() == (
        "error: checkpoint.resume: the checkpoint was written with model.width=16, this run has "
        "model.width=64; exact resume needs the same (or choose another hydra.run.dir)"
    )
    # ... and a fresh start in a used dir from the command line: Hydra, which runs the job in it, writes nothing there.
    proc = run_train(tmp_path, "trainer.max_steps=5", "model.width=16", "checkpoint.resume=null", check=False)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        f"error: hydra.run.dir={tmp_path} already holds a run (step_00000005.pt, model.pt): "
        "resume it with checkpoint.resume=auto, or choose another hydra.run.dir"
    ), proc.stderr
    after = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert after == before and {p: p.stat().st_mtime_ns for p in after} == mtimes


def test_resume_applies_changed_optimizer_settings_and_says_so(tmp_path, capsys):
    train_in(tmp_path, "trainer.max_steps=5", "sched=constant")
    train_in(
        tmp_path,
        "trainer.max_steps=8",
        "sched=constant",
        "optim.lr=1e-6",
        "optim.weight_decay=0.5",
        "trainer.log_every=1",
    )
    out = capsys.readouterr().out
    assert (
        "resume: applying the changed settings optim.lr=0.003 -> 1e-06, optim.weight_decay=0.01 -> 0.5, "
        "trainer.log_every=50 -> 1, trainer.max_steps=5 -> 8"
    ) in out
    assert [r["lr"] for r in rows(tmp_path) if r["step"] > 5] == [1e-6] * 3
    assert checkpoint(tmp_path, 8)["optimizer"]["param_groups"][0]["weight_decay"] == 0.5


def test_resume_with_max_steps_below_the_checkpoint_has_nothing_to_train(tmp_path, capsys):
    train_in(tmp_path, "trainer.max_steps=5")
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    # the finished run's objective, its best val/acc (a sweeper resuming it gets it again)
    assert train_in(tmp_path, "trainer.max_steps=3") == rows(tmp_path)[-1]["best/val/acc"]
    assert (
        f"nothing to train: {tmp_path / 'checkpoints' / 'step_00000005.pt'} is at step 5, past this run's 3 "
        "steps (trainer.max_steps / trainer.epochs)"
    ) in capsys.readouterr().out
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


def test_an_fp32_checkpoint_resumes_with_fp16_and_a_damaged_one_falls_back(short_run, tmp_path, capsys):
    directory = tmp_path / "checkpoints"
    directory.mkdir()
    (directory / "step_00000004.pt").write_bytes((short_run / "checkpoints" / "step_00000004.pt").read_bytes())
    (directory / "step_00000005.pt").write_bytes(b"not a zip file, not a pickle either")
    train_in(tmp_path, "trainer.max_steps=6", "trainer.precision=fp16", "checkpoint.every=2", "checkpoint.keep=1")
    out = capsys.readouterr().out
    assert "warning: skipping unreadable checkpoint" in out and "resumed from" in out and "at step 4" in out
    assert "trainer.precision=fp32 -> fp16" in out
    assert checkpoint(tmp_path, 6)["scaler"]["scale"] == 2.0**16


def test_a_save_that_fails_midway_leaves_the_previous_checkpoint_newest(short_run, tmp_path, monkeypatch):
    state = torch.load(short_run / "checkpoints" / "step_00000004.pt", weights_only=True)
    checkpointer = Checkpointer(tmp_path, every=2, keep=2, d=CPU)
    checkpointer.save(4, dict(state))

    def disk_full(obj, f):
        f.write(b"PK\x03\x04 half a checkpoint")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(OSError, match="No space left"):
        checkpointer.save(6, dict(state))
    assert [p.name for p in checkpointer.complete()] == ["step_00000004.pt"]
    assert checkpointer.load("auto")["progress"]["step"] == state["progress"]["step"]


# Digits whose training samples are augmented at random (noise and a shift), dropout, loader
# workers: 12 steps per epoch, checkpoints at the epoch boundary (12) and mid-epoch (17).
AUGMENTED = [
    "data.splits._target_=helpers.noisy_digits",
    "data.splits.test_fraction=0",  # no test split: the 1438 training samples of 12 steps an epoch
    "data.batch_size=128",
    "trainer.epochs=3",
    "model.dropout=0.1",
    "checkpoint.every=1",
    "checkpoint.keep=40",
    "trainer.log_every=4",
    "trainer.eval_every=12",
    "sched=constant",
    "sched.warmup_steps=5",
]


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_at_an_epoch_boundary_and_mid_epoch_is_bitwise_with_workers_and_augmentation(tmp_path, workers):
    straight = tmp_path / "straight"
    train_in(straight, *AUGMENTED, f"data.num_workers={workers}")
    final = checkpoint(straight, 36)
    for step in (12, 17):
        resumed = tmp_path / f"from_{step}"
        (resumed / "checkpoints").mkdir(parents=True)
        name = f"step_{step:08d}.pt"
        (resumed / "checkpoints" / name).write_bytes((straight / "checkpoints" / name).read_bytes())
        train_in(resumed, *AUGMENTED, f"data.num_workers={workers}")
        got = checkpoint(resumed, 36)
        for key in ("model", "optimizer", "scheduler", "ranks", "progress"):
            assert_equal(got[key], final[key], f"from {step}: {key}")
        assert rows(resumed) == [r for r in rows(straight) if r["step"] > step]
