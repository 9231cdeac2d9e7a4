"""Batches of any shape (trainkit/batch.py): the engine moves, empties, cuts and joins them without reading a
field, and a fork whose batches are dicts (tests/dict_fork.py) trains exactly: 2 ranks x K=2 = 1 process under
DDP and FSDP (short windows, empty micro-batches and FSDP's padding forwards included), a bitwise resume, its
own metric picking the best checkpoint, eval.py and predict.py writing its metrics and columns."""

import json
from dataclasses import dataclass
from typing import NamedTuple

import pytest
import torch

from helpers import max_diff, rows, run_in_process, weights
from trainkit.batch import collate, emptied, joined, leaves, map_tensors, to_device, unpack
from trainkit.errors import ConfigError
from trainkit.tasks.classification import Classification


class Pair(NamedTuple):
    image: torch.Tensor
    label: torch.Tensor


@dataclass
class Sample:
    tokens: torch.Tensor
    extra: dict


def test_every_shape_is_walked_kept_and_joined():
    batch = {"a": Pair(torch.arange(6).view(3, 2), torch.arange(3)), "b": [torch.ones(3), "name"]}
    assert [t.tolist() for t in leaves(batch)] == [[[0, 1], [2, 3], [4, 5]], [0, 1, 2], [1.0, 1.0, 1.0]]
    doubled = map_tensors(lambda t: t * 2, batch)
    assert isinstance(doubled["a"], Pair) and doubled["a"].label.tolist() == [0, 2, 4] and doubled["b"][1] == "name"
    empty = emptied(batch)
    assert empty["a"].image.shape == (0, 2) and empty["a"].label.dtype == torch.long
    whole = joined([batch, empty, batch])
    assert whole["a"].label.tolist() == [0, 1, 2, 0, 1, 2] and whole["b"][0].shape == (6,)
    samples = [Sample(torch.tensor([i, i]), {"mask": torch.tensor(i > 0)}) for i in range(3)]
    collated = collate(samples)  # torch's default_collate refuses a dataclass
    assert (
        isinstance(collated, Sample)
        and collated.tokens.shape == (3, 2)
        and collated.extra["mask"].tolist()
        == [
            False,
            True,
            True,
        ]
    )
    assert to_device(collated, torch.device("cpu")).tokens.equal(collated.tokens)


def test_to_device_moves_what_is_elsewhere_and_keeps_what_is_there():
    # A tensor already on the device is kept as it is (no .to call per micro-batch); any other is moved, in every
    # shape: the "meta" device stands in for a second device on a CPU-only machine.
    x, y = torch.ones(2, 3), torch.arange(2)
    kept = to_device((x, y), torch.device("cpu"))
    assert type(kept) is tuple and kept[0] is x and kept[1] is y
    for batch in ((x, y), [x, y], {"x": x, "y": [y]}, Pair(x, y), Sample(x, {"mask": y})):
        moved = leaves(to_device(batch, torch.device("meta")))
        assert [t.device.type for t in moved] == ["meta", "meta"] and [t.shape for t in moved] == [x.shape, y.shape]
    assert type(to_device([x, y], torch.device("meta"))) is list


def test_a_pair_unpacks_by_default_and_any_other_shape_needs_the_task_to_say():
    x, y = torch.zeros(2, 3), torch.zeros(2)
    assert unpack(Classification(), (x, y)) == (x, y)
    with pytest.raises(ConfigError, match="task Classification gets batches of dict .*give it an unpack"):
        unpack(Classification(), {"x": x, "y": y})


FORK = [
    "data=diabetes",
    "data.splits._target_=dict_fork.splits",
    "model._target_=dict_fork.MaskedMLP",
    "model.width=16",
    "task._target_=dict_fork.MeanAbsolute",
    "optim=sgd",
    "optim.lr=0.05",
    "sched=constant",
    # 81 val samples (2 ranks: 41 and 40, at b=8 six and five batches: FSDP's padding forward), 273 train (2 ranks:
    # 137 and 136, at b=8 rank 1's 18th micro-batch is empty), global batch 32: windows 9 and 18 hold 17 samples
    "data.splits.val_fraction=0.183",
    "trainer.max_steps=20",
    "trainer.eval_every=5",
    "checkpoint.every=10",
]


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("one") / "run"
    return run_dir, run_in_process(run_dir, *FORK)


def test_a_dict_batch_fork_trains_and_its_metric_picks_the_best(one):
    run_dir, out = one
    evals = [r for r in rows(run_dir) if "val/mae" in r]
    best = min(evals, key=lambda r: r["val/mae"])  # MeanAbsolute declares mae: min
    assert evals[-1]["best/val/mae"] == best["val/mae"] and evals[-1]["best/step"] == best["step"]
    assert evals[-1]["val/mae"] < evals[0]["val/mae"]  # it learns
    assert "FLOPs per sample" in out and "val mae" in out and "test mae" in out  # the summary's forward took the dict


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_2_ranks_x_k2_train_what_one_process_trains(one, tmp_path, mode):
    run_dir, _ = one
    two = tmp_path / mode
    run_in_process(two, *FORK, f"parallel={mode}", "data.batch_size=8", "accumulation.steps=2", nproc=2)
    assert max_diff(weights(run_dir), weights(two)) < 1e-5  # SGD: reduction order's rounding
    evals = [[r["val/mae"] for r in rows(d) if "val/mae" in r] for d in (run_dir, two)]
    assert evals[0] == pytest.approx(evals[1], abs=1e-5)


def test_a_resumed_dict_fork_is_bitwise_the_uninterrupted_run(one, tmp_path):
    run_dir, _ = one
    resumed = tmp_path / "resumed"
    run_in_process(resumed, *FORK[:-3], "trainer.max_steps=10", "trainer.eval_every=5", "checkpoint.every=10")
    run_in_process(resumed, *FORK)  # from step 10 on
    assert max_diff(weights(run_dir), weights(resumed)) == 0


def test_eval_and_predict_write_the_fork_s_metrics_and_columns(one, tmp_path):
    run_dir, _ = one
    run_in_process(tmp_path / "eval", f"run_dir={run_dir}", "split=val", "weights=best", script="eval")
    best = [r for r in rows(run_dir) if "val/mae" in r][-1]["best/val/mae"]
    assert json.loads((tmp_path / "eval" / "metrics.json").read_text())["val/mae"] == pytest.approx(best, abs=1e-6)
    predict = (f"run_dir={run_dir}", "split=test", "weights=best")
    run_in_process(tmp_path / "predict", *predict, script="predict", nproc=3)  # 88 samples on 3 ranks
    lines = (tmp_path / "predict" / "predictions.csv").read_text().splitlines()
    assert lines[0] == "index,target,prediction" and [int(line.split(",")[0]) for line in lines[1:]] == list(range(88))
    test_row = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    predicted = json.loads((tmp_path / "predict" / "metrics.json").read_text())
    assert predicted["samples"] == 88 and set(predicted) == {"loss", "mae", "samples"}
    assert predicted["mae"] == pytest.approx(test_row["test/mae"], abs=1e-6)  # train.py's test pass: the best weights
