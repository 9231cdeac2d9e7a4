"""train() in-process: what is called once per optimizer step, the step count, the overrides."""
import json
import math
from unittest import mock

import pytest
import torch
from hydra import compose, initialize_config_dir

from helpers import ROOT
from train import train
from trainkit.dist import Dist
from trainkit.schedules import warmup_cosine

CPU = Dist(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))


def run(tmp_path, *overrides):
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=list(overrides))
    tmp_path.mkdir(parents=True, exist_ok=True)
    acc = train(cfg, CPU, "single", tmp_path)
    return acc, [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def spy(owner, name):
    """Count calls of owner.name while still running it (a spy, not a mock)."""
    return mock.patch.object(owner, name, autospec=True, side_effect=getattr(owner, name))


@pytest.mark.parametrize("steps,drop_last,expected_per_epoch", [(4, False, 4), (1, False, 15), (4, True, 3)])
def test_optimizer_scheduler_and_clipping_run_once_per_optimizer_step(tmp_path, steps, drop_last, expected_per_epoch):
    # 1438 samples / micro-batch 100 = 15 micro-batches per epoch: ceil(15/K) steps, or with
    # drop_last the whole global batches only: 1438 // (100 K).
    epochs = 2
    with spy(torch.optim.AdamW, "step") as opt_step, \
            spy(torch.optim.lr_scheduler.LambdaLR, "step") as sched_step, \
            mock.patch("torch.nn.utils.clip_grad_norm_", wraps=torch.nn.utils.clip_grad_norm_) as clip:
        _, rows = run(tmp_path, "data.batch_size=100", f"accumulation.steps={steps}", f"trainer.epochs={epochs}",
                      f"data.drop_last={drop_last}", "trainer.log_every=1", "sched.warmup_steps=2")
    total = epochs * expected_per_epoch
    assert expected_per_epoch == (1438 // (100 * steps) if drop_last else math.ceil(15 / steps))
    assert opt_step.call_count == clip.call_count == total
    assert sched_step.call_count == total + 1  # LambdaLR also steps once when it is built
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, total + 1))
    # The logged LR of step s is the schedule at s-1: the scheduler moved once per optimizer step.
    for r in rows:
        assert r["lr"] == pytest.approx(3e-3 * warmup_cosine(r["step"] - 1, total_steps=total, warmup_steps=2))
    samples = [r["samples"] for r in rows]
    assert samples[-1] == epochs * (1438 if not drop_last else expected_per_epoch * 100 * steps)


def test_max_steps_ends_the_run_mid_epoch(tmp_path):
    _, rows = run(tmp_path, "trainer.max_steps=7", "trainer.log_every=3", "trainer.eval_every=100")
    assert [r["step"] for r in rows] == [3, 6, 7]
    assert "val/acc" in rows[-1] and "val/acc" not in rows[0]


@pytest.mark.parametrize("overrides", [
    ["model=cnn", "model.width=8"],
    ["model=resnet18", "data=fake", "data.splits.train_size=64", "data.splits.val_size=32", "data.batch_size=16"],
    ["model=mlp", "model.width=16", "model.depth=1", "optim=sgd", "sched=constant", "trainer.clip_grad_norm=null"],
    ["accumulation.global_batch_size=64", "data.batch_size=16", "accumulation=sync_each_batch"],
    ["trainer.precision=bf16"],
])
def test_overrides_train(tmp_path, overrides):
    acc, rows = run(tmp_path, "trainer.max_steps=4", "trainer.log_every=2", *overrides)
    assert 0 <= acc <= 1 and rows[-1]["step"] == 4
    assert all(math.isfinite(r["loss"]) for r in rows if "loss" in r)


def test_cnn_learns_digits(tmp_path):
    acc, _ = run(tmp_path, "model=cnn", "trainer.epochs=3", "trainer.eval_every=1000")
    assert acc >= 0.95


def write_idx(path, array):
    """The MNIST file format: a big-endian magic (dtype uint8, ndim), the dims, the bytes."""
    import numpy as np

    header = np.array([0x0800 + array.ndim, *array.shape], dtype=">i4").tobytes()
    path.write_bytes(header + array.astype(np.uint8).tobytes())


def test_mnist_loads_from_data_root(tmp_path):
    """The torchvision path on tiny MNIST-format files made here (tests never download)."""
    import numpy as np

    raw = tmp_path / "data" / "MNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for prefix, n in (("train", 64), ("t10k", 16)):
        write_idx(raw / f"{prefix}-images-idx3-ubyte", rng.integers(0, 256, (n, 28, 28)))
        write_idx(raw / f"{prefix}-labels-idx1-ubyte", rng.integers(0, 10, n))
    acc, rows = run(tmp_path / "run", "data=mnist", f"data.root={tmp_path / 'data'}", "data.num_workers=0",
                    "trainer.epochs=2", "data.batch_size=16")
    assert rows[-1]["step"] == 8 and rows[-1]["samples"] == 128 and 0 <= acc <= 1


def test_experiment_overlay(tmp_path):
    """+experiment=digits_cnn_ddp: cnn, micro-batch 16, global batch 64 (K = 4 on one process)."""
    _, rows = run(tmp_path, "+experiment=digits_cnn_ddp", "trainer.max_steps=2", "trainer.log_every=1")
    assert [r["samples"] for r in rows] == [64, 128]
    assert "0.weight" in torch.load(tmp_path / "model.pt", weights_only=True)
