"""task=regression on data=diabetes (+experiment=diabetes_mlp): val/rmse and val/r2 exact at any world size
from all-reduced sums, the directions the task declares (checkpoint.mode=auto), 2 ranks = 1 process, the best
checkpoint by a max and by a min metric, and predict.py's own columns."""

import json
import math

import pytest
import torch
from sklearn.metrics import mean_squared_error, r2_score

from helpers import max_diff, rows, run_in_process, weights
from trainkit.data.diabetes import diabetes
from trainkit.errors import ConfigError
from trainkit.selection import monitored
from trainkit.tasks.classification import Classification
from trainkit.tasks.regression import Regression

# SGD (see helpers: equivalence runs), a few evaluations, no checkpoints but the end's.
RUN = ["+experiment=diabetes_mlp", "optim=sgd", "optim.lr=0.05", "trainer.max_steps=24", "trainer.eval_every=4"]


def test_metrics_from_summed_shards_equal_the_whole_split():
    """R^2 is no mean of per-sample values: per-rank R^2 averaged is wrong, sums added are exact."""
    g = torch.Generator().manual_seed(0)
    target = torch.randn(37, generator=g) * 3 + 5
    output = (target + torch.randn(37, generator=g)).unsqueeze(1)  # the model's (N, 1)
    task = Regression()
    whole = task.eval_metrics(task.eval_sums(None, output, target).tolist())
    shards = [slice(0, 12), slice(12, 25), slice(25, 37)]  # 3 ranks' contiguous shards
    summed = sum(task.eval_sums(None, output[s], target[s]) for s in shards)
    assert task.eval_metrics(summed.tolist()) == pytest.approx(whole, rel=1e-12)
    assert whole["r2"] == pytest.approx(r2_score(target, output.squeeze(1)), rel=1e-6)
    assert whole["rmse"] == pytest.approx(math.sqrt(mean_squared_error(target, output.squeeze(1))), rel=1e-6)
    assert whole["loss"] == pytest.approx(whole["rmse"] ** 2)
    per_rank = [task.eval_metrics(task.eval_sums(None, output[s], target[s]).tolist())["r2"] for s in shards]
    assert abs(sum(per_rank) / 3 - whole["r2"]) > 1e-3  # what a mean of means would have reported


@pytest.mark.parametrize(
    ("monitor", "mode", "expected"),
    [
        ("auto", "auto", ("val/r2", "max")),
        ("val/rmse", "auto", ("val/rmse", "min")),
        ("val/r2", "min", ("val/r2", "min")),
    ],
)
def test_the_task_declares_each_metric_s_direction(monitor, mode, expected):
    assert monitored(monitor, mode, Regression()) == expected


def test_an_undeclared_direction_is_refused_not_guessed():
    class Undeclared:  # a fork's task that names no metrics: val/loss, minimised; anything else is refused
        pass

    assert monitored("auto", "auto", Undeclared()) == ("val/loss", "min")
    assert monitored("val/rmse", "min", Undeclared()) == ("val/rmse", "min")
    with pytest.raises(ConfigError, match="checkpoint.mode=auto: task Undeclared declares no direction for"):
        monitored("val/rmse", "auto", Undeclared())

    class Sideways(Classification):
        metrics = {"loss": "min", "acc": "up"}

    with pytest.raises(ConfigError, match="task Sideways: metric acc is 'up': its direction must be max or min"):
        monitored("auto", "auto", Sideways())


def test_diabetes_splits_are_fixed_disjoint_and_standardised_by_train():
    train, val, test = diabetes()
    assert (len(train), len(val), len(test)) == (266, 88, 88)
    x, y = train.tensors
    torch.testing.assert_close(x.mean(0), torch.zeros(10), atol=1e-6, rtol=0)
    torch.testing.assert_close(y.std(), torch.tensor(1.0), atol=1e-6, rtol=0)
    patients = torch.cat([split.tensors[0] for split in (train, val, test)])
    assert len(torch.unique(patients, dim=0)) == 442  # every patient in one split only
    torch.testing.assert_close(diabetes()[1].tensors[0], val.tensors[0], atol=0, rtol=0)  # whatever the seed


@pytest.fixture(scope="module")
def best_by_r2(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("r2") / "run"
    return run_dir, run_in_process(run_dir, *RUN)


def test_best_checkpoint_by_a_max_and_by_a_min_metric(best_by_r2, tmp_path):
    """val/r2 (max) and val/rmse (min) each pick their own best evaluation: mode auto from the task."""
    r2_dir, out = best_by_r2
    rmse_dir = tmp_path / "rmse"
    run_in_process(rmse_dir, *RUN, "checkpoint.monitor=val/rmse")
    for run_dir, key, pick in ((r2_dir, "val/r2", max), (rmse_dir, "val/rmse", min)):
        evals = [r for r in rows(run_dir) if key in r]
        best = pick(evals, key=lambda r: r[key])
        assert evals[-1][f"best/{key}"] == best[key] and evals[-1]["best/step"] == best["step"]
        assert best["step"] != evals[-1]["step"] or len({r[key] for r in evals}) == 1
    assert "val rmse" in out and "test r2" in out and "val acc" not in out  # the task's metrics in its lines


@pytest.mark.slow
def test_2_ranks_train_what_one_process_trains_and_predict_writes_the_task_s_columns(best_by_r2, tmp_path):
    one, _ = best_by_r2
    two = tmp_path / "two"
    run_in_process(two, *RUN, "data.batch_size=16", nproc=2)  # the same global batch of 32
    assert max_diff(weights(one), weights(two)) < 1e-5  # SGD: reduction-order rounding only
    last = [r for r in rows(one) if "val/r2" in r][-1], [r for r in rows(two) if "val/r2" in r][-1]
    assert last[0]["val/r2"] == pytest.approx(last[1]["val/r2"], abs=1e-5)

    out = tmp_path / "predicted"
    run_in_process(out, f"run_dir={one}", script="predict")
    lines = (out / "predictions.csv").read_text().splitlines()
    assert lines[0] == "index,target,prediction" and len(lines) == 1 + 88
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["r2"] == pytest.approx(last[0]["val/r2"], abs=1e-5) and metrics["samples"] == 88
    with pytest.raises(ConfigError, match="predict.probs=true: the predictions of Regression have no class prob"):
        run_in_process(tmp_path / "probs", f"run_dir={one}", "predict.probs=true", script="predict")
