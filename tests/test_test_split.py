"""The test split (trainer.test): every built-in data set's (train, val, test) splits are disjoint and
fixed; train.py's test pass counts every test sample once at any world size; src/eval.py reproduces
train.py's test row; a data set of one's own that returns (train, val) still trains."""

import json
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hydra.utils import instantiate

from helpers import ROOT, compose_cfg, final_test_row, rows, run_in_process, run_train
from test_experiments import _skip_md5, write_fake_cifar10
from trainkit.data import addition
from trainkit.data import pydoc_text as text
from trainkit.data.digits import _bundled_digits, digits
from trainkit.data.fake import fake
from trainkit.data.vision import carve, torchvision_splits
from trainkit.errors import ConfigError


def two_splits(val_fraction: float = 0.2, test_fraction: float = 0.2):
    """data.splits._target_=test_test_split.two_splits: a fork's data function written before the test
    split existed (it returns train, val; data=digits' schema still hands it both fractions)."""
    train, val, _ = digits(val_fraction, test_fraction)
    return train, val


def test_digits_splits_partition_the_images_fixed_and_val_as_before():
    from sklearn.datasets import load_digits

    train, val, test = digits()
    assert (len(train), len(val), len(test)) == (1079, 359, 359)
    images = torch.tensor(load_digits().images / 16.0, dtype=torch.float32).view(-1, 64)
    # Together the three splits are the 1797 images, each once: disjoint (as a multiset of rows).
    held = torch.cat([s.tensors[0].view(-1, 64) for s in (train, val, test)])
    assert torch.equal(held.unique(dim=0, return_counts=True)[1], images.unique(dim=0, return_counts=True)[1])
    assert torch.equal(held.unique(dim=0), images.unique(dim=0))
    again = digits()
    assert all(torch.equal(a.tensors[0], b.tensors[0]) for a, b in zip(again, (train, val, test), strict=True))
    # val is the first 20 % of the fixed permutation, whatever the test fraction (the val of before).
    order = np.random.RandomState(0).permutation(len(images))
    assert torch.equal(val.tensors[0].view(-1, 64), images[order[:359]])
    assert torch.equal(digits(0.2, 0.0)[1].tensors[0], val.tensors[0])
    with pytest.raises(ConfigError, match="leave no training samples"):
        digits(0.6, 0.4)


def test_addition_splits_are_disjoint_fixed_and_each_stratified():
    kwargs = {"max_digits": 2, "num_train": 2000, "num_val": 300, "num_test": 300}
    train, val, test = addition.splits(**kwargs)
    assert (len(train), len(val), len(test)) == (2000, 300, 300)
    problems = [{tuple(p) for p in s.pairs.tolist()} for s in (train, val, test)]
    assert sum(map(len, problems)) == 2600 and len(set.union(*problems)) == 2600  # distinct, disjoint
    assert all((a.pairs == b.pairs).all() for a, b in zip(addition.splits(**kwargs), (train, val, test), strict=True))
    for split in (val, test):  # every pair of operand lengths (1+1 has only 100 problems) in val and test
        lengths = {(len(str(a)), len(str(b))) for a, b in split.pairs.tolist()}
        assert lengths == {(1, 1), (1, 2), (2, 1), (2, 2)}


def test_pydoc_text_splits_by_document_fixed_and_the_vocabulary_covers_the_test_split():
    docs = text.documents()
    train, val, test = text.split_names(docs)
    assert train and val and test and not (set(train) & set(val) or set(train) & set(test) or set(val) & set(test))
    assert set(train) | set(val) | set(test) == set(docs)
    names = list(docs)
    random.Random(0).shuffle(names)  # fixed by the names and lengths, not their order
    assert [sorted(s) for s in text.split_names({n: docs[n] for n in names})] == [
        sorted(train),
        sorted(val),
        sorted(test),
    ]
    share = sum(len(docs[n]) for n in test) / sum(map(len, docs.values()))
    assert 0.08 < share <= 0.1
    assert text.vocabulary().unknown("".join(docs[n] for n in test)) == ""  # the whole corpus's characters
    _, _, test_set = text.splits(64)
    assert test_set.names == test


def test_fake_test_images_are_other_images():
    splits = fake(train_size=4, val_size=3, shape=[1, 4, 4], num_classes=10, test_size=3)
    images = [split[i][0] for split in splits for i in range(len(split))]
    assert [len(s) for s in splits] == [4, 3, 3]
    assert all(not torch.equal(a, b) for i, a in enumerate(images) for b in images[i + 1 :])
    again = fake(train_size=4, val_size=3, shape=[1, 4, 4], num_classes=10, test_size=3)[2]
    assert all(torch.equal(again[i][0], splits[2][i][0]) for i in range(3))


def test_torchvision_val_is_carved_from_the_official_train_set_and_test_is_the_official_test_set(tmp_path):
    train_idx, val_idx = carve(60000, 0.1)  # MNIST's size: a fixed 10 %, the rest trains
    assert len(val_idx) == 6000 and not set(train_idx) & set(val_idx) and len(set(train_idx) | set(val_idx)) == 60000
    assert (train_idx, val_idx) == carve(60000, 0.1)
    _skip_md5()
    root = write_fake_cifar10(tmp_path, per_batch=4, test=6)  # a stand-in: 20 training images, 6 test
    train, val, test = torchvision_splits("CIFAR10", str(root), download=False, augment=True)
    from torchvision import datasets

    official = datasets.CIFAR10(str(root), train=True)
    assert (len(train), len(val), len(test)) == (18, 2, 6)
    assert sorted(train.indices + val.indices) == list(range(20)) and val.indices == carve(20, 0.1)[1]
    assert train.dataset.data is official.data or np.array_equal(train.dataset.data, official.data)
    assert not val.draws_random and not test.draws_random and train.draws_random  # only train augments
    plain = torchvision_splits("CIFAR10", str(root), download=False)
    assert all(torch.equal(val[i][0], plain[1][i][0]) for i in range(2))  # val never augmented
    assert test.train is False and len(test) == 6


# The default job, 6 SGD steps at one global batch of 48 (equivalence runs step with SGD, helpers.py).
SHORT = ["trainer.max_steps=6", "checkpoint.every=0", "optim=sgd", "trainer.log_every=3"]


@pytest.fixture(scope="module")
def short_runs(tmp_path_factory):
    runs = {}
    for nproc in (1, 2, 3):
        runs[nproc] = tmp_path_factory.mktemp(f"short_{nproc}")
        run_in_process(runs[nproc], *SHORT, f"data.batch_size={48 // nproc}", nproc=nproc)
    return runs


def assert_every_test_sample_once(run, *overrides: str) -> dict:
    """The run's test row against its model.pt over the 359 test samples at once, each exactly once."""
    cfg = compose_cfg(*overrides)
    _, _, test = instantiate(cfg.data.splits)
    x, y = test.tensors
    assert len(test) == 359 and len(test) % 2 and len(test) % 3
    row = final_test_row(run)
    assert row.keys() == {"step", "epoch", "test/loss", "test/acc"}
    model = instantiate(cfg.model)
    model.load_state_dict(torch.load(run / "model_best.pt", weights_only=True))  # the weights the test pass took
    model.eval()
    with torch.no_grad():
        logits = model(x)
    loss = F.cross_entropy(logits, y, reduction="none").double().mean().item()
    # The same weights; float32 per-sample losses at another batch size differ in their last bits
    # (4.5e-8 relative measured, float32's eps 6e-8): 1e-6. A sample counted twice moves the mean by
    # (its loss - the mean) / 360 and the accuracy to a multiple of 1/360, which k/359 never is.
    assert row["test/loss"] == pytest.approx(loss, rel=1e-6)
    assert row["test/acc"] == (logits.argmax(1) == y).double().mean().item()
    return row


def test_the_test_pass_counts_every_test_sample_once_on_1_2_3_ranks(short_runs):
    # 359 test samples: 2 ranks get 180, 179; 3 ranks 120, 120, 119 (DistributedSampler pads to 360: one twice).
    got = {}
    for nproc, run in short_runs.items():
        got[nproc] = row = assert_every_test_sample_once(run)
        assert row["step"] == 6 and row["epoch"] == pytest.approx(6 / 23)  # 1079 samples / global batch 48: 23 steps
    # Across world sizes the weights agree to SGD's reduction-order rounding (~1e-7, helpers.py): the
    # loss to 1e-5 relative (a sample counted twice moves it by ~3e-3), the accuracy exactly (no
    # logit margin here is that thin).
    for nproc in (2, 3):
        assert got[nproc]["test/loss"] == pytest.approx(got[1]["test/loss"], rel=1e-5)
        assert got[nproc]["test/acc"] == got[1]["test/acc"]


def test_the_fsdp_test_pass_on_3_ranks_runs_unequal_shards_in_step(tmp_path):
    # Batches of 7: shards of 120, 120 and 119 make 18, 18 and 17 batches; every FSDP forward all-gathers,
    # so the short rank runs an empty batch (EvalBatches' padding) instead of hanging the others.
    overrides = [*SHORT, "data.batch_size=7", "parallel=fsdp"]  # evaluation batches: the training micro-batch
    run_in_process(tmp_path, *overrides, nproc=3)
    assert assert_every_test_sample_once(tmp_path, *overrides)["step"] == 6


def test_eval_reproduces_train_pys_test_and_val_rows(short_runs, tmp_path):
    def evaluated(run, out: str, *overrides: str, nproc: int = 1) -> dict:
        run_in_process(tmp_path / out, f"run_dir={run}", *overrides, script="eval", nproc=nproc)
        return json.loads((tmp_path / out / "metrics.json").read_text())

    # At the run's world size and micro-batch: the same weights, batches and sums, hence exactly its numbers.
    for nproc in (1, 3):
        row = final_test_row(short_runs[nproc])
        assert evaluated(short_runs[nproc], f"test_{nproc}", nproc=nproc) == {
            k: row[k] for k in ("test/loss", "test/acc")
        }
    final_val = rows(short_runs[1])[-1]
    assert evaluated(short_runs[1], "val", "split=val", f"weights={short_runs[1] / 'model.pt'}") == {
        k: final_val[k] for k in ("val/loss", "val/acc")
    }
    # Another world size: float32 per-sample losses of other batches, 1e-6 as above; the accuracy exactly.
    row, other = final_test_row(short_runs[3]), evaluated(short_runs[3], "one_rank")
    assert other["test/acc"] == row["test/acc"] and other["test/loss"] == pytest.approx(row["test/loss"], rel=1e-6)


def test_predict_on_the_test_split_agrees_with_the_test_row(short_runs, tmp_path):
    row = final_test_row(short_runs[1])
    run_in_process(tmp_path, f"run_dir={short_runs[1]}", "split=test", script="predict")
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["samples"] == 359 and metrics["acc"] == row["test/acc"]
    # predict's loss: the float32 per-sample losses of the whole split at once, summed in float64 (1e-6 above).
    assert metrics["loss"] == pytest.approx(row["test/loss"], rel=1e-6)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["split=tests"], "split=tests is not one of: train, val, test"),
        (["weights=best"], "weights=best: .*model_best.pt does not exist: the run kept no best checkpoint"),
        (["weights=/nonexistent.pt"], "weights=/nonexistent.pt: /nonexistent.pt does not exist"),
    ],
)
def test_eval_refuses_in_one_line(short_runs, tmp_path, overrides, message):
    run = short_runs[1]
    if overrides == ["weights=best"]:  # as a run with checkpoint.monitor=null: no model_best.pt
        run = Path(shutil.copytree(run, tmp_path / "unselected"))
        (run / "model_best.pt").unlink()
    with pytest.raises(ConfigError, match=message):
        run_in_process(tmp_path / "out", f"run_dir={run}", *overrides, script="eval")


def test_eval_without_a_run_dir_exits_2_in_one_line(tmp_path):
    proc = run_train(tmp_path / "out", f"run_dir={tmp_path / 'absent'}", script="src/eval.py", check=False)
    assert proc.returncode == 2 and proc.stderr.strip() == f"error: run_dir={tmp_path / 'absent'} does not exist"


def test_a_two_split_data_function_still_trains_and_makes_no_test_pass(tmp_path):
    out = run_in_process(
        tmp_path / "run", "data.splits._target_=test_test_split.two_splits", "trainer.max_steps=2", "checkpoint.every=0"
    )
    note = "trainer.test: data=digits has no test split (its data.splits returns train, val): no test pass"
    assert out.count(note) == 1 and "(1079 train / 359 val / no test)" in out
    assert "test acc" not in out and re.search(r"done: 2 steps, val loss [\d.]+, val acc [\d.]+, best", out)
    assert rows(tmp_path / "run", test=True) == rows(tmp_path / "run")  # no test row
    for script in ("eval", "predict"):
        with pytest.raises(ConfigError, match="split=test: data=digits of .* has no test split"):
            run_in_process(tmp_path / script, f"run_dir={tmp_path / 'run'}", "split=test", script=script)


def test_a_finished_run_resumed_again_keeps_one_test_row(tmp_path):
    overrides = ["trainer.max_steps=3", "checkpoint.every=0"]
    run_in_process(tmp_path, *overrides)
    first = final_test_row(tmp_path)
    out = run_in_process(tmp_path, *overrides)  # resumes from the final checkpoint: nothing left to train
    assert "resumed from" in out and "test acc" in out
    assert final_test_row(tmp_path) == first  # once, the same weights: the same numbers
    assert rows(tmp_path, test=True)[-1] == first


def test_a_task_of_ones_own_that_names_its_metrics_val_gets_test_rows_too():
    import contextlib

    from trainkit.dist import Dist
    from trainkit.evaluate import evaluate
    from trainkit.models.mlp import mlp
    from trainkit.tasks.classification import Classification

    class Before(Classification):  # eval_metrics as a fork's task wrote it before the test split
        def eval_metrics(self, sums):
            return {f"val/{key}": value for key, value in super().eval_metrics(sums).items()}

    cpu = Dist(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    test = digits()[2]
    metrics = evaluate(mlp([1, 8, 8], 10), [test[:]], cpu, contextlib.nullcontext, Before(), prefix="test")
    assert set(metrics) == {"test/loss", "test/acc"}


def test_digits_are_read_as_scikit_learn_reads_them_without_importing_it():
    """The default job's data without scikit-learn's import (0.8 s of CPU at every start): the same arrays."""
    from sklearn.datasets import load_digits

    images, targets = _bundled_digits()
    expected_images, expected_targets = load_digits(return_X_y=True)
    assert np.array_equal(images, expected_images) and np.array_equal(targets, expected_targets)
    probe = "import sys; from trainkit.data.digits import digits; digits(); print('sklearn' in sys.modules)"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    assert subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True).stdout == "False\n"
