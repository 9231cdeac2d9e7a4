"""debug=fast|overfit|limit|anomaly (conf/debug/, trainkit/debug.py): each mode runs and does what it
says; the samples a mode keeps are the same at any world size; a mode's settings win over an
experiment's and lose to the command line's; a limited run does not resume a full run's checkpoint."""

import pytest

from helpers import cli_in_process, compose_cfg, faulty, max_diff, rows, run_in_process, weights
from trainkit import debug

SGD = ["optim=sgd", "trainer.clip_grad_norm=1.0"]
AUTO = ["data.batch_size=auto", "accumulation.global_batch_size=64"]


@pytest.mark.parametrize(
    "overrides,val",  # val: the samples kept, 2 global batches (32, 12 blocks, 64)
    [([], "64/359 val"), (["+experiment=pydoc_gpt"], "24/734 val"), (AUTO, "128/359 val")],
    ids=["mlp", "pydoc_gpt", "auto"],
)
def test_fast_runs_every_path_in_4_steps(tmp_path, overrides, val):
    out = run_in_process(tmp_path, "debug=fast", *overrides)
    logged = rows(tmp_path, test=True)
    assert [r["step"] for r in logged if "loss" in r] == [1, 2, 3, 4]  # pydoc_gpt's 2000 steps: debug.set wins
    assert [r["step"] for r in logged if "val/loss" in r] == [4]
    assert [r["step"] for r in logged if "test/loss" in r] == [4]
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == ["step_00000002.pt", "step_00000004.pt"]
    assert (tmp_path / "model.pt").exists()
    assert out.count("debug=fast:") == 1 and val in out  # what was kept, said once


def test_a_mode_wins_over_an_experiment_and_loses_to_the_command_line():
    overrides = ["+experiment=pydoc_gpt", "debug=fast", "trainer.log_every=3"]
    cfg = compose_cfg(*overrides)
    assert cfg.trainer.max_steps == 2000  # as Hydra composes it: the experiment comes after debug
    with debug.command_line(overrides):  # what Hydra's overrides.task holds under @hydra.main
        debug.configure(cfg)
    assert (cfg.trainer.max_steps, cfg.trainer.eval_every, cfg.trainer.log_every) == (4, 4, 3)
    assert "log_every" not in cfg.debug.set.trainer  # `set` keeps what was applied: a worker applies it again
    debug.configure(cfg)  # as in a worker train.py started (no command line there)
    assert cfg.trainer.log_every == 3


# debug=overfit with SGD: one rank at b=64 against 2 ranks x K=2 x b=16 (the global batch 64 both).
OVERFIT = ["debug=overfit", *SGD, "optim.lr=0.2", "trainer.max_steps=60", "trainer.eval_every=60"]


def test_overfit_drives_the_loss_to_zero_on_one_batch_at_any_world_size(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    run_in_process(one, *OVERFIT, "data.batch_size=64")
    out = run_in_process(two, *OVERFIT, "data.batch_size=16", "accumulation.steps=2", nproc=2)
    diff = max_diff(weights(one), weights(two))
    print(f"max |2 ranks - 1 rank| {diff:.2e}, last rows' loss {rows(one)[-1]['loss']:.4f}")
    assert diff < 1e-5  # SGD: reduction-order rounding alone (measured 2e-7 here); another batch: ~1e-1
    last = rows(one)[-1]  # steps 51-60; measured 0.0015 (the full train split at these settings: 0.3)
    assert last["loss"] < 0.05 and last["samples"] == 60 * 64
    assert last["val/loss"] < 0.05  # val is that batch: val loss ~ train loss
    assert "debug=overfit: 64/1079 train samples" in out


# debug=limit with SGD: 270 train samples, 9 steps of 32 on one rank, of 2 x 16 on two.
LIMIT = ["debug=limit", *SGD, "trainer.max_steps=9"]


def test_limit_keeps_the_same_samples_at_any_world_size(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    out = run_in_process(one, *LIMIT, "data.batch_size=32")
    assert "debug=limit: 270/1079 train, 36/359 val, 36/359 test" in out
    run_in_process(two, *LIMIT, "data.batch_size=16", nproc=2)
    a, b = rows(one, test=True), rows(two, test=True)
    assert a[-2]["samples"] == b[-2]["samples"] == 270  # one epoch of the kept train split
    assert max_diff(weights(one), weights(two)) < 1e-5  # other train samples: weights ~1e-2 apart
    for key in ("val/loss", "test/loss"):  # other val or test samples: ~1e-2 apart
        assert next(r[key] for r in a if key in r) == pytest.approx(next(r[key] for r in b if key in r), rel=1e-5)


@pytest.mark.parametrize("value", ["0", "1.5", "-0.25"])
def test_a_limit_outside_0_1_is_one_line(tmp_path, capsys, value):
    run_dir = tmp_path / "run"
    run_dir.mkdir()  # as Hydra makes it before the task: a refused run removes it
    with pytest.raises(SystemExit) as refused:
        run_in_process(run_dir, "debug=limit", f"debug.limit.train={value}")
    assert refused.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: debug.limit.train={float(value):g} must be a fraction in (0, 1]"]
    assert not run_dir.exists()


def test_a_limited_run_does_not_resume_a_full_one_nor_back(tmp_path, capsys):
    for first, then, said in [
        ([], ["debug=limit"], "1079, this run has data.train_samples=270"),
        (["debug=limit"], [], "270, this run has data.train_samples=1079"),
    ]:
        run_dir = tmp_path / str(len(first))
        run_in_process(run_dir, "trainer.max_steps=2", "trainer.test=false", *first)
        with pytest.raises(SystemExit) as refused:
            run_in_process(run_dir, "trainer.max_steps=3", "trainer.test=false", *then)
        assert refused.value.code == 2
        assert f"the checkpoint was written with data.train_samples={said}" in capsys.readouterr().err


NAN = faulty("nan", 2, 0, "/nonexistent", name="mlp")  # rank 0's second training forward returns NaN
NAMED = "debug=anomaly: the backward function LogSoftmaxBackward0 returned NaN in its 0th output"


@pytest.mark.filterwarnings("ignore:Error detected in")  # anomaly mode's forward traceback, a warning
def test_anomaly_names_the_backward_function_that_returned_nan(tmp_path, capsys):
    with pytest.raises(SystemExit) as failed:
        run_in_process(tmp_path, "debug=anomaly", *NAN, "trainer.max_steps=4")
    assert failed.value.code == 3
    err = capsys.readouterr().err
    assert f"error: {NAMED}" in err  # without anomaly: "non-finite loss or gradient in steps 1-4"


@pytest.mark.slow
def test_anomaly_on_one_ddp_rank_ends_both(tmp_path, capfd):
    """Rank 1 raises in backward while rank 0 is in the gradient all-reduce: rank 1 names the function,
    rank 0 sees its collective fail (not a hang), the launching process exits 3 with rank 1's line.
    (train.py's parent in this process, helpers.cli_in_process: its workers fork from here.)"""
    nan_on_1 = faulty("nan", 2, 1, "/nonexistent", name="mlp")
    proc = cli_in_process(
        capfd, tmp_path, "debug=anomaly", *nan_on_1, "trainer.max_steps=4", "parallel.nproc_per_node=2"
    )
    assert proc.returncode == 3, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: rank 1: {NAMED}"), proc.stderr


class _Indices:
    """A data set that is not InMemory (debug.take's Kept path): sample i is i."""

    def __len__(self) -> int:
        return 100

    def __getitem__(self, index: int) -> int:
        return index


def test_limit_keeps_evenly_spaced_samples_not_the_first_ones():
    """Issue 32: taking a split's first k samples passed every test (a shuffled digits split looks alike
    either way); a split sorted by class (an image folder) would keep one class."""
    import torch

    from trainkit.loading import InMemory

    class Said:
        def print0(self, text: str) -> None:
            self.text = text

    x = torch.arange(100.0).view(100, 1)
    by_class = InMemory(x, torch.arange(100) // 25)  # sorted by class: the first 25 samples are class 0
    said = Said()
    train, val, test = debug.splits(compose_cfg("debug=limit").debug, (by_class, _Indices(), None), 8, said)
    assert train.tensors[0].view(-1).tolist() == [i * 4 for i in range(25)]  # a quarter: every 4th sample
    assert sorted(set(train.tensors[1].tolist())) == [0, 1, 2, 3]  # every class
    assert [val[i] for i in range(len(val))] == [i * 10 for i in range(10)] and test is None  # a tenth, Kept
    assert said.text.startswith("debug=limit: 25/100 train, 10/100 val (evenly spaced")
    assert debug.kept(10, 3) == [0, 3, 6] and debug.kept(3, 5) == [0, 1, 2]
