"""train() in-process: what is called once per optimizer step, the step count, the overrides."""

import math
import time
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from helpers import ROOT, run_in_process
from helpers import rows as metrics_rows
from train import train
from trainkit.dist import Dist
from trainkit.rng import seed_all
from trainkit.schedules import warmup_cosine

CPU = Dist(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))


def run(tmp_path, *overrides):
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=list(overrides))
    tmp_path.mkdir(parents=True, exist_ok=True)
    acc = train(cfg, CPU, "single", tmp_path)
    return acc, metrics_rows(tmp_path)  # training and validation rows (the test row: helpers.final_test_row)


def spy(owner, name):
    """Count calls of owner.name while still running it (a spy, not a mock)."""
    return mock.patch.object(owner, name, autospec=True, side_effect=getattr(owner, name))


@pytest.mark.parametrize("steps,drop_last,expected_per_epoch", [(4, False, 3), (1, False, 11), (4, True, 2)])
def test_optimizer_scheduler_and_clipping_run_once_per_optimizer_step(tmp_path, steps, drop_last, expected_per_epoch):
    # 1079 samples / micro-batch 100 = 11 micro-batches per epoch: ceil(11/K) steps, or with
    # drop_last the whole global batches only: 1079 // (100 K).
    epochs = 2
    with (
        spy(torch.optim.AdamW, "step") as opt_step,
        spy(torch.optim.lr_scheduler.LambdaLR, "step") as sched_step,
        mock.patch("torch.nn.utils.clip_grad_norm_", wraps=torch.nn.utils.clip_grad_norm_) as clip,
    ):
        _, rows = run(
            tmp_path,
            "data.batch_size=100",
            f"accumulation.steps={steps}",
            f"trainer.epochs={epochs}",
            f"data.drop_last={drop_last}",
            "trainer.log_every=1",
            "sched.warmup_steps=2",
        )
    total = epochs * expected_per_epoch
    assert expected_per_epoch == (1079 // (100 * steps) if drop_last else math.ceil(11 / steps))
    assert opt_step.call_count == clip.call_count == total
    assert sched_step.call_count == total + 1  # LambdaLR also steps once when it is built
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, total + 1))
    # The logged LR of step s is the schedule at s-1: the scheduler moved once per optimizer step.
    for r in rows:
        assert r["lr"] == pytest.approx(3e-3 * warmup_cosine(r["step"] - 1, total_steps=total, warmup_steps=2))
    samples = [r["samples"] for r in rows]
    assert samples[-1] == epochs * (1079 if not drop_last else expected_per_epoch * 100 * steps)


def test_max_steps_ends_the_run_mid_epoch(tmp_path):
    _, rows = run(tmp_path, "trainer.max_steps=7", "trainer.log_every=3", "trainer.eval_every=100")
    assert [r["step"] for r in rows] == [3, 6, 7]
    assert "val/acc" in rows[-1] and "val/acc" not in rows[0]


@pytest.mark.parametrize(
    "overrides",
    [
        ["model=cnn", "model.width=8"],
        ["model=resnet18", "data=fake", "data.splits.train_size=64", "data.splits.val_size=32", "data.batch_size=16"],
        ["model=mlp", "model.width=16", "model.depth=1", "optim=sgd", "sched=constant", "trainer.clip_grad_norm=null"],
        ["accumulation.global_batch_size=64", "data.batch_size=16", "accumulation=sync_each_batch"],
        ["trainer.precision=bf16"],
    ],
)
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
    acc, rows = run(
        tmp_path / "run",
        "data=mnist",
        f"data.root={tmp_path / 'data'}",
        "data.num_workers=0",
        "trainer.epochs=2",
        "data.batch_size=16",
    )
    # 64 training images: val a fixed 6 of them (10 %), 58 train (4 steps an epoch); test: the 16 of t10k.
    assert rows[-1]["step"] == 8 and rows[-1]["samples"] == 2 * 58 and 0 <= acc <= 1


def test_experiment_overlay(tmp_path):
    """+experiment=digits_cnn_ddp: cnn, micro-batch 16, global batch 64 (K = 4 on one process)."""
    _, rows = run(tmp_path, "+experiment=digits_cnn_ddp", "trainer.max_steps=2", "trainer.log_every=1")
    assert [r["samples"] for r in rows] == [64, 128]
    assert "0.weight" in torch.load(tmp_path / "model.pt", weights_only=True)


def test_without_a_validation_split_training_runs_and_skips_evaluation(tmp_path):
    acc, rows = run(
        tmp_path, "data.splits.val_fraction=0", "trainer.max_steps=5", "trainer.eval_every=2", "checkpoint.every=100"
    )
    assert acc is None and [r["step"] for r in rows] == [5] and "val/acc" not in rows[0]
    assert (tmp_path / "model.pt").exists() and (tmp_path / "checkpoints" / "step_00000005.pt").exists()


def test_how_often_we_evaluate_never_changes_the_trained_weights(tmp_path):
    # Dropout draws from the training RNG; evaluation (its loader included) must draw nothing.
    for every in (1, 1000):
        run(tmp_path / str(every), "model.dropout=0.1", "trainer.max_steps=20", f"trainer.eval_every={every}")
    a, b = (torch.load(tmp_path / str(every) / "model.pt", weights_only=True) for every in (1, 1000))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_each_epoch_trains_another_order(tmp_path):
    # lr 0: the weights never move, so a step's loss tells which samples its batch held. Epoch 1
    # must draw another order (sampler.set_epoch) over the same samples.
    _, rows = run(
        tmp_path,
        "optim=sgd",
        "optim.lr=0",
        "optim.momentum=0",
        "sched=constant",
        "data.batch_size=128",
        "trainer.epochs=2",
        "trainer.log_every=1",
        "trainer.eval_every=1000",
    )
    losses = [[r["loss"] for r in rows if "loss" in r and math.ceil(r["epoch"]) == e] for e in (1, 2)]
    assert len(losses[0]) == len(losses[1]) == 9 and losses[0] != losses[1]
    # The same samples: the epoch's summed loss (the last window is short: weigh by batch size).
    sizes = [128] * 8 + [1079 - 8 * 128]
    totals = [sum(loss * n for loss, n in zip(epoch, sizes, strict=True)) for epoch in losses]
    assert totals[0] == pytest.approx(totals[1], rel=1e-6)


def test_what_a_batch_draws_and_the_cpu_rng_after_it_depend_on_the_batch_alone():
    from torch.utils.data import Dataset

    from trainkit.loading import TrainLoader

    class Draws(Dataset):
        def __len__(self):
            return 10

        def __getitem__(self, i):
            return torch.rand(1)

    # In the main process too (num_workers=0): the batch's seed, not the training RNG's state,
    # decides, so a resumed run loads the same batches; training's CPU draws go on from it.
    loader = TrainLoader(Draws(), CPU, 4, 0, 0, 3)
    torch.manual_seed(1)
    first, after = torch.cat(list(loader.epoch(0))), torch.get_rng_state()
    torch.manual_seed(2)
    assert torch.equal(torch.cat(list(loader.epoch(0))), first)
    assert torch.equal(torch.get_rng_state(), after)
    assert not torch.equal(torch.cat(list(loader.epoch(1))), first)


def test_throughput_counts_training_time_only():
    from trainkit.metrics import TrainMeter
    from trainkit.parallel import CommStats

    meter = TrainMeter(CPU, CommStats())
    time.sleep(0.5)  # start-up: building data, model, resuming
    meter.start_clock()
    meter.add_step(torch.tensor(1.0), samples=1000, items=1000)
    with meter.paused():
        time.sleep(0.5)  # evaluation, a checkpoint
    assert meter.row()["samples_per_s"] > 1000 / 0.25


def test_a_run_s_throughput_leaves_its_evaluations_out(tmp_path):
    # Each evaluation sleeps 12 x 0.05 s (digits' val split in batches of 32); two steps of the mlp take a few ms.
    # Counted as training time, the rows would show under 64 / 0.6 = 107 samples/s.
    run_in_process(
        tmp_path,
        "model._target_=helpers.SlowEvaluation",
        "+model.seconds=0.05",
        "trainer.max_steps=6",
        "trainer.eval_every=2",
        "trainer.log_every=2",
        "trainer.test=false",
        "checkpoint.every=0",
    )
    logged = [row for row in metrics_rows(tmp_path) if "samples_per_s" in row]
    assert [row["step"] for row in logged] == [2, 4, 6] and min(row["samples_per_s"] for row in logged) > 1000


def test_data_wait_is_the_share_of_training_time_spent_waiting_on_the_loader(tmp_path):
    """time/data_wait: a loader that sleeps 4 ms a sample (32 ms a micro-batch of 8, the mlp's step ~1 ms) is
    most of a row's time; the in-memory digits almost none of it."""
    common = ["data.batch_size=8", "trainer.max_steps=6", "trainer.log_every=3", "trainer.eval_every=100"]
    common += ["trainer.test=false", "checkpoint.every=0"]
    _, slow = run(tmp_path / "slow", "data.splits._target_=helpers.slow_digits", *common)
    _, fast = run(tmp_path / "fast", *common)
    shares = [[row["time/data_wait"] for row in rows if "time/data_wait" in row] for rows in (slow, fast)]
    assert len(shares[0]) == len(shares[1]) == 2
    assert min(shares[0]) > 0.7 and max(shares[1]) < 0.3, shares


class _Signals:
    """A Stopper's face to the cadence: a signal arrives after step `at`, and due() names it from then on."""

    def __init__(self, at: int | None = None, agreed: int | None = None):
        self.at, self.agreed, self.received, self.step = at, agreed or at, 0, 0

    def due(self, last: bool = False) -> str | None:
        return "SIGTERM" if self.received and (self.agreed is None or self.step >= self.agreed) else None


def test_the_cadence_decides_once_per_step_what_comes_after_it():
    """What train() does after a step (trainkit/cadence.py), decided in one place: logs at multiples of log_every,
    evaluations at eval_every's, checkpoints at checkpoint.every's, all three after the run's last step; nothing
    looked at in between (None), every step where something needs every step (a live bar, the profiler, a counting
    Stopper); a signal read every step and checkpointed at once."""
    from trainkit.cadence import Cadence

    def decisions(cadence, signals, steps):
        out = {}
        for step in range(1, steps + 1):
            signals.received, signals.step = signals.received or int(signals.at == step), step
            if (due := cadence.after(step)) is not None:
                out[step] = "".join(k for k, on in (("l", due.log), ("e", due.evaluate), ("s", due.save)) if on)
                out[step] += "!" if due.stop else ""
        return out

    quiet = _Signals()  # log_every=3, eval_every=4, checkpoint.every=8
    assert decisions(Cadence(20, 3, 4, 8, quiet), quiet, 20) == {
        3: "l",
        4: "e",
        6: "l",
        8: "es",
        9: "l",
        12: "le",
        15: "l",
        16: "es",
        18: "l",
        20: "les",
    }
    assert decisions(Cadence(5, 3, 0, 0, quiet, each_step=True), quiet, 5) == {1: "", 2: "", 3: "l", 4: "", 5: "ls"}
    signalled = _Signals(at=5)  # arrives in step 5, between two events: saved and stopped at step 5
    assert decisions(Cadence(20, 10, 0, 0, signalled), signalled, 6) == {5: "s!", 6: "s!"}
    on_a_save = _Signals(at=8)  # arrives in step 8, whose log, evaluation and save were due anyway: all of them
    assert decisions(Cadence(20, 4, 4, 8, on_a_save), on_a_save, 8) == {4: "le", 8: "les!"}
    # The ranks agree on a signal a few steps after it arrived (Stopper's checks): the steps in between are looked
    # at every step, and a save due on one of them still happens (not only the stop's, later)
    agreed_later = _Signals(at=7, agreed=9)
    assert decisions(Cadence(20, 3, 4, 8, agreed_later), agreed_later, 9) == {
        3: "l",
        4: "e",
        6: "l",
        7: "",
        8: "es",
        9: "ls!",
    }


def test_the_meter_keeps_no_autograd_graph():
    """A micro-step's loss (it has a graph) and a norm that requires grad are kept detached until a row sums them;
    clip_grad_norm_'s norm (no graph) as it is."""
    from trainkit.metrics import TrainMeter
    from trainkit.parallel import CommStats

    meter = TrainMeter(CPU, CommStats())
    weight = torch.ones(2, requires_grad=True)
    meter.add_micro_step((weight * 3).sum())
    meter.add_step(weight.norm(), samples=2, items=2)
    clipped = torch.nn.utils.clip_grad_norm_([weight], 1.0)
    meter.add_micro_step((weight * 3).sum())
    meter.add_step(clipped, samples=2, items=2)
    assert not any(t.requires_grad for t in meter.losses + meter.norms) and meter.norms[1] is clipped
    assert meter.row()["grad_norm"] == pytest.approx((2**0.5 + 0.0) / 2)


@pytest.mark.parametrize("pending", [2, 256])
def test_the_meters_row_is_the_exact_mean_and_a_resume_mid_row_logs_the_same(monkeypatch, pending):
    """loss: the sum of the kept windows' loss sums over their items; grad_norm: the mean of the kept steps'
    norms; a skipped or retried window counts in neither; the same when the meter sums its pending tensors
    every `pending` (PENDING) and when a checkpoint's state_dict is loaded into a fresh meter mid-row."""
    from trainkit import metrics
    from trainkit.parallel import CommStats

    monkeypatch.setattr(metrics, "PENDING", pending)
    losses = [[1.5, 2.25], [4.0, 0.5], [float("nan"), 1.0], [3.0, 0.125], [7.0, 1.0]]  # window 2 skipped
    norms, items = [0.5, 1.5, float("inf"), 2.0, 4.0], [10, 8, 9, 7, 6]

    def run(resume_after: int | None) -> tuple[dict, float]:
        meter = metrics.TrainMeter(CPU, CommStats())
        for step, (window, norm, n) in enumerate(zip(losses, norms, items, strict=True)):
            meter.add_micro_step(torch.tensor(99.0))  # a window that ran out of memory and runs again
            meter.drop_window()
            for loss in window:
                meter.add_micro_step(torch.tensor(loss, requires_grad=True) * 1)
            window_loss = meter.window_loss.item()
            meter.add_step(torch.tensor(norm), samples=n, items=n, skipped=step == 2)
            if step == resume_after:
                state = meter.state_dict()
                meter = metrics.TrainMeter(CPU, CommStats())
                meter.load_state_dict(state)
        return meter.row(), window_loss

    kept = [i for i in range(5) if i != 2]
    expected_loss = sum(sum(losses[i]) for i in kept) / sum(items[i] for i in kept)
    for resume_after in (None, 0, 2, 3):
        row, last_window = run(resume_after)
        assert row["loss"] == pytest.approx(expected_loss, rel=1e-15), resume_after
        assert row["grad_norm"] == pytest.approx(sum(norms[i] for i in kept) / 4, rel=1e-15)
        assert row["samples"] == sum(items) and row["skipped_steps"] == 1
        assert last_window == 8.0  # guard.decide's window loss: the retried attempt's 99 is gone


def test_each_steps_gradient_is_the_mean_over_its_windows_samples(tmp_path):
    # lr 0 keeps the initial weights, so every logged pre-clip gradient norm can be recomputed
    # here: the mean loss over the window's samples (DistributedSampler's order for epoch 0).
    # 1435 samples, K=3 x b=16: 29 windows of 48 and a short one of 43 (micro-batches 16, 16, 11).
    overrides = [
        "data.splits.val_fraction=0.2015",
        "data.splits.test_fraction=0",  # no test split: 1797 - 362 validation samples train
        "data.batch_size=16",
        "accumulation.steps=3",
        "optim=sgd",
        "optim.lr=0",
        "optim.momentum=0",
        "sched=constant",
        "trainer.clip_grad_norm=null",
        "trainer.max_steps=30",
        "trainer.log_every=1",
        "trainer.eval_every=1000",
    ]
    _, rows = run(tmp_path, *overrides)
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    seed_all(cfg.seed)
    model = instantiate(cfg.model)
    train_set, *_ = instantiate(cfg.data.splits)
    order = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(cfg.seed))
    for step in (1, 30):
        x, y = train_set[order[(step - 1) * 48 : step * 48]]
        model.zero_grad()
        loss = F.cross_entropy(model(x), y)  # the mean over the window's samples
        loss.backward()
        norm = torch.cat([p.grad.flatten() for p in model.parameters()]).norm().item()
        assert rows[step - 1]["grad_norm"] == pytest.approx(norm, rel=1e-5), step
        assert rows[step - 1]["loss"] == pytest.approx(loss.item(), rel=1e-5), step  # each step's losses reach the row


def test_the_bare_step_trains_what_the_general_step_trains_bit_for_bit(tmp_path):
    """train.bare_step is optimizer_step less the calls that do nothing in one process without fp16, skips or
    autobatch (StepParts.bare): where both apply, the same weights and rows, bit for bit. A BatchNorm model with
    dropout (seed_step's stream), K=2, clipping that bites, a cosine schedule and AdamW."""
    import train as entry
    from helpers import assert_equal, without_timings
    from helpers import weights as final_weights

    overrides = ["model=cnn", "model.width=8", "model.dropout=0.2", "optim=adamw", "sched=cosine"]
    overrides += ["sched.warmup_steps=2", "accumulation.steps=2", "data.batch_size=16", "trainer.clip_grad_norm=0.5"]
    overrides += ["trainer.max_steps=6", "trainer.log_every=2", "trainer.eval_every=3", "trainer.test=false"]
    steps = {}
    for name, step in (("bare", entry.bare_step), ("general", entry.optimizer_step)):
        with mock.patch.object(entry, "bare_step", side_effect=step) as taken:  # parts.bare: the bare step, or not
            run_in_process(tmp_path / name, *overrides, "checkpoint.every=0")
        steps[name] = taken.call_count
    assert steps == {"bare": 6, "general": 6}  # the run is one where the bare step applies
    assert_equal(final_weights(tmp_path / "bare"), final_weights(tmp_path / "general"), "model.pt")
    bare, general = ([without_timings(row) for row in metrics_rows(tmp_path / name)] for name in ("bare", "general"))
    assert bare == general
