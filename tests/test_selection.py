"""The best checkpoint and early stopping: the same decisions on 1 process and on 2 ranks, after a
resume (also under FSDP, also on another world size), and a best checkpoint that the keep-last-N
rotation never deletes."""

import math
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_equal, compose_cfg, final_test_row, max_diff, rows, run_in_process
from trainkit.errors import ConfigError
from trainkit.selection import Selection, monitored
from trainkit.tasks.classification import Classification
from trainkit.tasks.lm import LanguageModel

# SGD at a high learning rate on digits: val/acc climbs, dips and ties (every 4 steps an evaluation),
# so the best step lies mid-run, a later evaluation ties it (a tie keeps the earlier step) and three
# evaluations in a row bring no improvement (early stopping). Global batch 16: 1 x 16 or 2 x 8.
RUN = [
    "optim=sgd",
    "optim.lr=0.5",
    "sched=constant",
    "trainer.max_steps=48",
    "trainer.eval_every=4",
    "trainer.log_every=4",
    "trainer.test=false",
    "data.splits.test_fraction=0",  # the trajectory above is that of digits' 1438 training images
    "checkpoint.every=8",
    "accumulation.global_batch_size=16",
]
ONE, TWO = "data.batch_size=16", "data.batch_size=8"
# Equivalence tolerance: SGD's update is lr x gradient, so 2 ranks' reduction-order rounding (~1e-7
# relative in a gradient) stays of that order in the weights after 48 steps (measured below 1e-6).
ATOL = 1e-5


def evaluations(run_dir: Path, key: str = "val/acc") -> list[tuple[int, float]]:
    return [(r["step"], r[key]) for r in rows(run_dir) if key in r]


def expected_best(run_dir: Path, key: str = "val/acc") -> tuple[int, float]:
    """The first step of the highest `key` in the rows: the rule, computed here on its own."""
    evals = evaluations(run_dir, key)
    value = max(v for _, v in evals)
    return next(s for s, v in evals if v == value), value


def checkpoint_at(path: Path) -> dict:
    return torch.load(path, weights_only=True)


def test_the_rule_nan_is_never_best_a_tie_keeps_the_earlier_and_min_delta_counts_from_the_last_improvement():
    best = Selection("val/acc", "max", patience=2, min_delta=0.05)
    decisions = [best.update({"val/acc": v}, step) for step, v in enumerate([math.nan, 0.5, 0.5, 0.53, 0.54], 1)]
    assert decisions == [False, True, False, True, True]  # NaN never best; the tie at step 3 keeps step 2
    assert (best.best, best.best_step) == (0.54, 5)
    # min_delta: 0.53 and 0.54 improve on the best but not by more than 0.05 on 0.5, the last value that did
    assert best.waited == 3 and best.stopped
    assert "no improvement of val/acc by more than 0.05 for 3 evaluations (best 0.54 at step 5)" in best.stop_reason()
    again = Selection("val/acc", "max", patience=4, min_delta=0.05)
    assert again.load_state_dict(best.state_dict()) is None and not again.stopped  # a larger patience trains on
    other = Selection("val/loss", "min", patience=None, min_delta=0.0)
    assert "starts anew" in other.load_state_dict(best.state_dict()) and other.best is None
    lowest = Selection("val/loss", "min", patience=None, min_delta=0.0)
    assert [lowest.update({"val/loss": v}, s) for s, v in enumerate([2.0, 1.0, 1.5], 1)] == [True, True, False]
    # min_delta when lower is better: 0.97 improves on 1.0 by less than 0.05, 0.90 by more; 0.88 not on 0.90
    lower = Selection("val/loss", "min", patience=3, min_delta=0.05)
    values = [1.0, 0.97, 0.9, 0.93, 0.88]
    waited = [(lower.update({"val/loss": v}, s), lower.waited)[1] for s, v in enumerate(values, 1)]
    assert waited == [0, 1, 0, 1, 2] and (lower.best, lower.best_step) == (0.88, 5) and not lower.stopped
    with pytest.raises(ConfigError, match="checkpoint.monitor=val/loss is not a metric of this run's evaluation"):
        lowest.update({"val/acc": 1.0}, 4)


@pytest.mark.parametrize(
    ("monitor", "mode", "task", "averaged", "expected"),
    [
        ("auto", "auto", Classification(), False, ("val/acc", "max")),
        ("auto", "auto", LanguageModel(), False, ("val/loss", "min")),
        ("val/bpc", "auto", LanguageModel(per_character=True), False, ("val/bpc", "min")),
        ("val_raw/acc", "auto", Classification(), True, ("val_raw/acc", "max")),  # with an EMA: the live weights'
        ("val/loss", "max", Classification(), False, ("val/loss", "max")),
        (None, "auto", Classification(), False, (None, "auto")),
    ],
)
def test_monitor_and_mode_default_from_the_task_and_the_key(monitor, mode, task, averaged, expected):
    assert monitored(monitor, mode, task, averaged) == expected


@pytest.mark.parametrize(
    ("monitor", "task", "averaged"),
    [("val/bpc", LanguageModel(), False), ("val_raw/acc", Classification(), False), ("val/f1", Classification(), True)],
)
def test_a_monitor_the_evaluation_does_not_report_is_refused_before_training(monitor, task, averaged):
    with pytest.raises(ConfigError, match=f"checkpoint.monitor={monitor} is not a metric of this run's evaluation"):
        monitored(monitor, "auto", task, averaged)


def test_bad_values_are_one_line_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:  # train.py's run after Hydra composed: refused before any step
        run_in_process(tmp_path / "run", "checkpoint.monitor=val/accuracy")
    assert exited.value.code == 2 and not (tmp_path / "run" / "metrics.jsonl").exists()
    assert capsys.readouterr().err.strip() == (
        "error: checkpoint.monitor=val/accuracy is not a metric of this run's evaluation (val/loss, val/acc)"
    )
    with pytest.raises(ConfigError, match="checkpoint.mode=best is not one of: auto, max, min"):
        monitored("val/acc", "best", None)
    with pytest.raises(ConfigError, match="patience=0 must be null or a positive integer"):
        Selection("val/acc", "max", 0, 0.0)
    with pytest.raises(ConfigError, match="patience=3 needs a checkpoint.monitor"):
        Selection(None, "max", 3, 0.0)
    with pytest.raises(ConfigError, match="patience=3 needs a validation split"):
        Selection("val/acc", "max", 3, 0.0, evaluated=False)
    with pytest.raises(ConfigError, match="min_delta=-1 must be a number >= 0"):
        Selection("val/acc", "max", 3, -1)


@pytest.fixture(scope="module")
def best_runs(tmp_path_factory) -> dict[str, Path]:
    """RUN on 1 process (checkpoint.keep=1) and on 2 DDP ranks (every checkpoint kept), and the
    1-process run stopped at its best step."""
    import train

    root = tmp_path_factory.mktemp("best")
    one, two = root / "one", root / "two"
    objective = train.run(compose_cfg(*RUN, ONE, "checkpoint.keep=1"), one)
    run_in_process(two, *RUN, TWO, "checkpoint.keep=20", nproc=2)
    best_step, best_value = expected_best(one)
    assert objective == best_value  # train.py returns the best value (a sweeper's objective), not the last
    shortened = root / f"until_{best_step}"
    run_in_process(shortened, *RUN, ONE, f"trainer.max_steps={best_step}")
    return {"one": one, "two": two, "shortened": shortened}


def test_the_best_checkpoint_is_the_same_on_1_and_2_ranks_and_outlives_keep_1(best_runs):
    one, two = best_runs["one"], best_runs["two"]
    best_step, best_value = expected_best(one)
    assert best_step < 48 and any(v == best_value for s, v in evaluations(one) if s > best_step)  # a later tie
    assert expected_best(two) == (best_step, best_value)
    for run_dir in (one, two):
        last = rows(run_dir)[-1]
        assert (last["best/step"], last["best/val/acc"]) == (best_step, best_value)
        best = checkpoint_at(run_dir / "checkpoints" / "best.pt")
        assert best["progress"]["step"] == best_step and best["selection"]["best_step"] == best_step
        assert_equal(dict(torch.load(run_dir / "model_best.pt", weights_only=True)), dict(best["model"]), "best")
    # keep=1: the rotation kept the last step and never touched best
    assert sorted(p.name for p in (one / "checkpoints").iterdir()) == ["best.pt", "step_00000048.pt"]
    # model_best.pt is the model at the best step: a run stopped there wrote the same model.pt, bit for bit
    shortened = torch.load(best_runs["shortened"] / "model.pt", weights_only=True)
    assert_equal(dict(torch.load(one / "model_best.pt", weights_only=True)), dict(shortened), "best = up to it")
    assert max_diff(*(torch.load(d / "model_best.pt", weights_only=True) for d in (one, two))) < ATOL


def _resume_dir(source: Path, target: Path, step: int) -> Path:
    """A run dir as `source`'s was after step `step`: its checkpoint and best (written before it)."""
    (target / "checkpoints").mkdir(parents=True)
    for name in (f"step_{step:08d}.pt", "best.pt"):
        shutil.copy2(source / "checkpoints" / name, target / "checkpoints" / name)
    return target


def test_a_resume_after_the_best_step_keeps_it_and_ends_with_the_uninterrupted_best(best_runs, tmp_path):
    """Resumed after the best step: a run that forgot it would take a later, lower value as best."""
    two = best_runs["two"]
    best_step, _ = expected_best(two)
    resume_at = (best_step // 8 + 1) * 8  # the first checkpoint after the best step
    resumed = _resume_dir(two, tmp_path / "resumed", resume_at)
    out = run_in_process(resumed, *RUN, TWO, "checkpoint.keep=20", nproc=2)
    assert f"at step {resume_at}" in out
    assert rows(resumed, timings=False) == [r for r in rows(two, timings=False) if r["step"] > resume_at]
    for name in ("model_best.pt", "model.pt"):
        assert_equal(*(torch.load(d / name, weights_only=True) for d in (resumed, two)), name)


def test_early_stopping_stops_every_rank_at_one_step_and_a_resume_stops_there_too(tmp_path):
    stopping = [*RUN, "trainer.early_stopping.patience=3", "checkpoint.keep=20"]
    one, two = tmp_path / "one", tmp_path / "two"
    run_in_process(one, *stopping, ONE)
    out = run_in_process(two, *stopping, TWO, nproc=2)
    evals = evaluations(one)
    best_step, best_value = expected_best(one)
    # The rule on its own: the first evaluation that is the third in a row without a new best
    waited, stop_step, running = 0, None, -1.0
    for s, v in evals:
        waited = 0 if v > running else waited + 1
        running = max(running, v)
        if waited == 3:
            stop_step = s
            break
    assert stop_step is not None and stop_step < 48 and evals[-1][0] == stop_step
    assert evaluations(two)[-1][0] == stop_step and expected_best(two)[0] == best_step
    message = f"stopped early at step {stop_step}: no improvement of val/acc for 3 evaluations"
    assert message in out
    last = rows(two)[-1]
    assert last["step"] == stop_step and "loss" in last and last["best/step"] == best_step  # its last row
    for run_dir in (one, two):
        names = {p.name for p in (run_dir / "checkpoints").iterdir()}
        assert f"step_{stop_step:08d}.pt" in names and max(names - {"best.pt"}) == f"step_{stop_step:08d}.pt"
        assert (run_dir / "model.pt").is_file() and (run_dir / "model_best.pt").is_file()
    # A resume from a checkpoint before the stop stops at the very same step, with the same rows
    resume_at = (best_step // 8 + 1) * 8
    assert resume_at < stop_step
    resumed = _resume_dir(two, tmp_path / "resumed", resume_at)
    run_in_process(resumed, *stopping, TWO, nproc=2)
    assert rows(resumed, timings=False) == [r for r in rows(two, timings=False) if r["step"] > resume_at]
    assert_equal(*(torch.load(d / "model_best.pt", weights_only=True) for d in (resumed, two)), "model_best.pt")
    # A stopped run resumed trains nothing more, and says so
    before = rows(two)
    out = run_in_process(two, *stopping, TWO, nproc=2)
    assert f"nothing to train: {two / 'checkpoints' / f'step_{stop_step:08d}.pt'} stopped early" in out
    assert rows(two) == before


def test_early_stopping_counts_across_an_epoch_boundary_and_ends_the_run_not_only_its_epoch(tmp_path):
    """6 steps an epoch (a global batch of 256 of digits' 1438 images): patience 2 counts the evaluations
    after the best one across the end of an epoch, and the stop ends the run: no later epoch trains a step."""
    kept = ("optim", "sched", "trainer.test", "data.splits")
    stopping = [o for o in RUN if o.startswith(kept)] + ["accumulation.global_batch_size=256", "data.batch_size=256"]
    stopping += ["trainer.eval_every=2", "trainer.log_every=2", "trainer.max_steps=60", "checkpoint.every=0"]
    out = run_in_process(tmp_path, *stopping, "trainer.early_stopping.patience=2")
    stop_step = int(re.search(r"stopped early at step (\d+)", out)[1])  # type: ignore[index]
    assert stop_step < 60 and rows(tmp_path)[-1]["step"] == stop_step  # nothing trained after the stop
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["best.pt", f"step_{stop_step:08d}.pt"]
    best_step, _ = expected_best(tmp_path)
    after = [(r["step"], r["epoch"]) for r in rows(tmp_path) if "val/acc" in r and r["step"] > best_step]
    assert [step for step, _ in after] == [best_step + 2, stop_step]  # the rule: two evaluations without a new best
    assert math.floor(after[0][1] - 1e-9) < math.floor(after[1][1])  # an epoch ended between them (6 steps each)


@pytest.mark.slow
def test_fsdp_best_checkpoint_resumes_on_another_world_size_into_another_dir(tmp_path):
    """FSDP's best is a DCP directory, here with an EMA (its average in the shards); a resume on 1 rank
    from the 2-rank run's step (another run dir: checkpoint.resume=<path>) takes that best along and
    ends with the uninterrupted best."""
    fsdp = [*RUN, "parallel=fsdp", "checkpoint.keep=20", "trainer.ema.decay=0.8"]
    straight = tmp_path / "straight"
    run_in_process(straight, *fsdp, TWO, nproc=2)
    best_step, best_value = expected_best(straight)
    assert best_step < 40  # a checkpoint after it to resume from, and the best outlives the resume
    assert (straight / "checkpoints" / "best" / ".metadata").is_file()
    resume_at = (best_step // 8 + 1) * 8
    source = straight / "checkpoints" / f"step_{resume_at:08d}"
    resumed = tmp_path / "resumed"
    out = run_in_process(resumed, *fsdp, ONE, f"checkpoint.resume={source}", torchrun=True)
    assert "written by 2 ranks, now 1" in out
    last = rows(resumed)[-1]  # its rows start after the resumed step: the best is the state it took over
    assert (last["best/step"], last["best/val/acc"]) == (best_step, best_value)
    best = {name: torch.load(d / "model_best.pt", weights_only=True) for name, d in (("a", straight), ("b", resumed))}
    assert_equal(best["a"], best["b"], "the best weights: copied from the source dir's best, not retrained")
    ema = torch.load(straight / "model_ema.pt", weights_only=True)
    assert max_diff(best["a"], ema) > 0  # the best step's average, not the last


@pytest.mark.parametrize(("ema", "monitor"), [("null", "val/acc"), (0.5, "val/acc"), (0.5, "val_raw/acc")])
def test_the_best_weights_are_those_the_monitor_measured_and_the_test_pass_evaluates_them(tmp_path, ema, monitor):
    """model_best.pt holds the weights the best evaluation measured (with trainer.ema.decay: val/* the
    average's, that step's checkpoint's EMA; val_raw/* the live weights'): on the val split they give the
    best value (eval.py weights=best split=val), which train.py returns, not the last; the test row is theirs."""
    from hydra.utils import instantiate

    import train

    run = tmp_path / "run"
    overrides = [o for o in RUN if not o.startswith(("trainer.test", "data.splits.test", "trainer.max_steps"))]
    # digits with its test split: the best step lies mid-run here; a checkpoint at every evaluation
    overrides += ["trainer.max_steps=44", ONE, f"trainer.ema.decay={ema}", "checkpoint.every=4", "checkpoint.keep=20"]
    cfg = compose_cfg(*overrides, f"checkpoint.monitor={monitor}")
    objective = train.run(cfg, run)
    best_step, best_value = expected_best(run, monitor)
    assert best_step < 44 and evaluations(run, monitor)[-1][1] != best_value  # the last evaluation is not the best
    assert objective == best_value  # a sweeper's objective: the best monitored value
    best = torch.load(run / "model_best.pt", weights_only=True)
    at_best = checkpoint_at(run / "checkpoints" / f"step_{best_step:08d}.pt")
    averaged = monitor == "val/acc" and ema != "null"
    evaluated = at_best["ema"]["params"] | at_best["ema"]["buffers"] if averaged else at_best["model"]
    assert_equal(dict(best), dict(evaluated), "model_best.pt = the weights measured at the best step")
    row = final_test_row(run)
    splits = instantiate(cfg.data.splits)
    measured = {}
    for name in ("model_best.pt", "model.pt"):
        model = instantiate(cfg.model)
        model.load_state_dict(torch.load(run / name, weights_only=True))
        for split, (x, y) in (("val", splits[1].tensors), ("test", splits[2].tensors)):
            with torch.no_grad():
                logits = model.eval()(x)
            accuracy = (logits.argmax(1) == y).double().mean().item()
            measured[name, split] = (F.cross_entropy(logits, y).item(), accuracy)
    assert measured["model_best.pt", "val"][1] == best_value  # what eval.py weights=best split=val says
    assert measured["model_best.pt", "test"] != measured["model.pt", "test"]  # the check below can tell them apart
    assert row["test/acc"] == measured["model_best.pt", "test"][1]
    assert row["test/loss"] == pytest.approx(measured["model_best.pt", "test"][0], rel=1e-6)  # float32, other orders
