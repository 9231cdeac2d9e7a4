"""Named evaluation sets (data.eval_sets): each one's val split evaluated beside val at every evaluation
(val/<name>/*), every sample once on any number of ranks (auto's halving too), monitorable by
checkpoint.monitor, tested beside test (test/<name>/*); no part of the run's identity; refused in one line."""

import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hydra.utils import instantiate

from helpers import cli_in_process, compose_cfg, final_test_row, rows, run_in_process
from trainkit.data.digits import digits
from trainkit.loading import InMemory


def held(size: int = 359, with_test: bool = True):
    """data.eval_sets.<name>._target_=test_eval_sets.held: other images than val's as a named set's val (the first
    `size` of digits' test split), digits' val split as its test split; with_test=false: (train, val) only."""
    train, val, test = digits()
    named = InMemory(*(t[:size] for t in test.tensors))
    return (train, named, val) if with_test else (train, named)


def one_split():
    return (digits()[0],)


SETS = "data.eval_sets={same: {_target_: trainkit.data.digits.digits}, held: {_target_: test_eval_sets.held}}"
# SGD at a high learning rate, an evaluation every 3 steps: val/held/loss is lowest at step 12, val/loss and
# val/acc are best at step 15, so a monitor that ignored the set (or took max for a loss) picks another step.
RUN = [
    "optim=sgd",
    "optim.lr=0.5",
    "sched=constant",
    "trainer.max_steps=15",
    "trainer.eval_every=3",
    "trainer.log_every=3",
    "checkpoint.every=0",
    SETS,
    "checkpoint.monitor=val/held/loss",
]


@pytest.fixture(scope="module")
def one(tmp_path_factory) -> tuple[Path, str]:
    run = tmp_path_factory.mktemp("one")
    return run, run_in_process(run, *RUN, "data.batch_size=48")


def measured(overrides: list[str], weights: Path, dataset) -> tuple[float, float]:
    """(loss, acc) of `weights` over the whole data set at once, in this process: every sample once."""
    model = instantiate(compose_cfg(*overrides).model)
    model.load_state_dict(torch.load(weights, weights_only=True))
    model.eval()
    x, y = dataset.tensors
    with torch.no_grad():
        logits = model(x)
    return F.cross_entropy(logits, y, reduction="none").double().mean().item(), (
        logits.argmax(1) == y
    ).double().mean().item()


def assert_every_sample_once(row: dict, key: str, got: tuple[float, float]) -> None:
    # float32 per-sample losses at another batch size differ in their last bits: 1e-6. A sample counted twice or a
    # shard left out moves the accuracy off k/359 (359 = 3 x 119 + 2: no world size here divides it).
    assert row[f"{key}/loss"] == pytest.approx(got[0], rel=1e-6) and row[f"{key}/acc"] == got[1], (row, got)


def assert_named_rows(run: Path, overrides: list[str]) -> None:
    evaluations = [r for r in rows(run) if "val/loss" in r]
    assert evaluations and all(
        r.keys() >= {"val/same/loss", "val/same/acc", "val/held/loss", "val/held/acc"} for r in evaluations
    )
    for r in evaluations:  # the same data as val: the same batches, the same sums
        assert (r["val/same/loss"], r["val/same/acc"]) == (r["val/loss"], r["val/acc"])
    _, val, test = digits()
    assert_every_sample_once(evaluations[-1], "val/held", measured(overrides, run / "model.pt", held()[1]))
    row = final_test_row(run)
    assert row.keys() == {"step", "epoch"} | {f"test{s}/{m}" for s in ("", "/same", "/held") for m in ("loss", "acc")}
    assert (row["test/same/loss"], row["test/same/acc"]) == (row["test/loss"], row["test/acc"])
    assert_every_sample_once(row, "test/held", measured(overrides, run / "model_best.pt", val))  # held's test: val


def test_named_sets_are_evaluated_beside_val_and_tested_beside_test(one):
    run, out = one
    assert "data.eval_sets: same (359 val / 359 test), held (359 val / 359 test)" in out
    assert_named_rows(run, [*RUN, "data.batch_size=48"])
    assert "| val/held loss " in out and ", test/held acc " in out.splitlines()[-1]  # the lines and done: name them


def test_a_monitor_on_a_named_set_picks_the_best_checkpoint_by_it(one):
    run, _ = one
    evaluations = [r for r in rows(run) if "val/loss" in r]
    lowest = min(evaluations, key=lambda r: r["val/held/loss"])["step"]
    assert lowest == 12  # the trajectory the test needs: val's own best elsewhere
    assert lowest != min(evaluations, key=lambda r: r["val/loss"])["step"] != 3
    assert max(evaluations, key=lambda r: r["val/acc"])["step"] != lowest
    assert evaluations[-1]["best/step"] == lowest and "best/val/held/loss" in evaluations[-1]
    best = torch.load(run / "checkpoints" / "best.pt", weights_only=True)
    assert best["progress"]["step"] == lowest and best["selection"]["monitor"] == "val/held/loss"
    assert best["selection"]["mode"] == "min"  # the task's direction for loss


def test_a_resume_may_add_a_named_set(one, tmp_path):
    run = Path(shutil.copytree(one[0], tmp_path / "run"))
    more = "data.eval_sets.more={_target_: test_eval_sets.held, size: 100, with_test: false}"
    out = run_in_process(run, *RUN, "data.batch_size=48", more)  # the finished run: evaluated and tested again
    assert "resumed from" in out and "val/more loss" in out.splitlines()[-1]
    assert "test/held/loss" in final_test_row(run) and "test/more/loss" not in final_test_row(run)  # it has no test


def test_named_sets_on_3_ranks_count_every_sample_once_also_halving_on_out_of_memory(tmp_path):
    # One process group: 3 ranks, auto's micro-batch 16, rank 1 out of memory in every evaluation forward above 4:
    # val and each named set halve 16 -> 8 -> 4 together; shards of 359: 120, 120, 119.
    faulty = ["model._target_=helpers.faulty_model", "+model.name=mlp", "+model.fault=oom_eval", "+model.rank=1"]
    overrides = [*RUN, "trainer.max_steps=3", *faulty, "+model.oom_above=4"]
    overrides += ["data.batch_size=auto", "accumulation.global_batch_size=48", "parallel.timeout_s=30"]
    out = run_in_process(tmp_path, *overrides, nproc=3)
    assert "evaluation of data.eval_sets.held batch 16 -> 8 -> 4 (out of memory)" in out
    assert_named_rows(tmp_path, overrides)
    final = torch.load(next((tmp_path / "checkpoints").glob("step_*")), weights_only=True)
    assert final["autobatch"]["eval_sets"] == {"same": 4, "held": 4}  # a resume starts at what each found


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["data.eval_sets={a/b: {_target_: trainkit.data.digits.digits}}"],
            "data.eval_sets.a/b: a named evaluation set's name must be a plain identifier",
        ),
        (["data.eval_sets.x=3"], "data.eval_sets.x must be a node with a _target_"),
        (
            ["data.eval_sets.x={_target_: trainkit.data.digits.digits, val_fractin: 0.1}"],
            "data.eval_sets.x.val_fractin is not a setting of data.eval_sets.x",
        ),
        (
            ["data.eval_sets.x={_target_: test_eval_sets.held, size: 0}"],
            "data.eval_sets.x: its validation split is empty",
        ),
        (
            ["data.eval_sets.x={_target_: test_eval_sets.one_split}"],
            "data.eval_sets.x of data=digits must return (train, val) or (train, val, test)",
        ),
        (["checkpoint.monitor=val/nope/loss"], "checkpoint.monitor=val/nope/loss: data.eval_sets has no set nope"),
    ],
    ids=["name", "node", "key", "empty", "splits", "monitor"],
)
def test_named_sets_are_refused_in_one_line(tmp_path, capfd, overrides, message):
    proc = cli_in_process(capfd, tmp_path / "run", *overrides)  # python src/train.py <overrides>, in this process
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: {message}"), proc.stderr
    assert not (tmp_path / "run").exists()
