"""src/train.py end to end on the bundled digits: the default job (what `python src/train.py` runs after Hydra
composed its config, in this process), W ranks against one process, a sweep under torchrun as a user runs it."""

import pytest
import torch
from hydra.utils import instantiate

from helpers import SYNC_BN, compose_cfg, rows, run_in_process, run_train, weights


@pytest.mark.slow
def test_default_job_reaches_95_percent_and_writes_the_contract_files(tmp_path):
    out = run_in_process(tmp_path)  # no override: the default job, its 680 steps
    assert "global batch 32 = 1 ranks x 32 micro-batch x 1 accumulation" in out
    metrics = rows(tmp_path)
    final = metrics[-1]
    assert final["val/acc"] >= 0.95
    assert final["step"] == 680 and final["samples"] == 20 * 1079  # 1079 training samples: 34 steps an epoch
    train_rows = [r for r in metrics if "loss" in r]
    for key in ("step", "epoch", "loss", "lr", "grad_norm", "samples", "comm/grad_syncs", "comm/grad_bytes"):
        assert all(key in r for r in train_rows), key
    assert all(r["comm/grad_syncs"] == 0 and r["comm/grad_bytes"] == 0 for r in train_rows)  # single
    assert (tmp_path / ".hydra" / "config.yaml").exists()
    # model.pt: the plain state_dict, loadable into the unwrapped model.
    model = instantiate(compose_cfg().model)
    model.load_state_dict(weights(tmp_path))


def assert_same_weights(a: dict, b: dict, atol: float):
    assert a.keys() == b.keys()
    print(f"max |weights - reference| {max(float((a[k].double() - b[k].double()).abs().max()) for k in a):.2e}")
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=atol, msg=key)


EPOCH = [
    "trainer.epochs=1",
    "data.drop_last=false",
    "optim=sgd",  # an equivalence: SGD (tests/helpers.py)
    "sched=cosine",
    "sched.warmup_steps=5",
    "trainer.clip_grad_norm=0.5",
    "trainer.log_every=5",
]


@pytest.fixture(scope="module")
def single_b32(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("single")
    run_in_process(run_dir, *EPOCH, "data.batch_size=32")
    return run_dir


@pytest.mark.slow
@pytest.mark.parametrize("strategy,syncs", [("no_sync", 1.0), ("sync_each_batch", 2.0)])
def test_two_ranks_k2_b8_equal_one_process_b32(single_b32, tmp_path, strategy, syncs):
    run_in_process(
        tmp_path,
        *EPOCH,
        "data.batch_size=8",
        "accumulation.steps=2",
        f"accumulation={strategy}",
        "parallel=ddp",
        nproc=2,
    )
    # One epoch of 1079 samples: 33 full global batches of 32 and a short last one of 23.
    assert rows(tmp_path)[-1]["step"] == rows(single_b32)[-1]["step"] == 34
    # SGD: reduction-order rounding alone, 4.5e-8 (no_sync) and 6.0e-8 measured; 1e-5 is ~170x that.
    assert_same_weights(weights(tmp_path), weights(single_b32), atol=1e-5)
    single_rows, ddp_rows = rows(single_b32), rows(tmp_path)
    for a, b in zip(single_rows, ddp_rows, strict=True):
        assert a["samples"] == b["samples"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)  # mean over all samples of all ranks
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)  # pre-clip: the scale shows
        assert a["lr"] == pytest.approx(b["lr"], rel=1e-12)
    assert all(r["comm/grad_syncs"] == syncs for r in ddp_rows if "loss" in r)
    param_bytes = sum(t.numel() * t.element_size() for t in weights(tmp_path).values())
    assert all(r["comm/grad_bytes"] == syncs * param_bytes for r in ddp_rows if "loss" in r)


# N = 1435 training samples: a multiple of neither 2 nor 3, so DistributedSampler pads every
# epoch; global batch 48, so each epoch ends on a short window (43 samples) that the next epoch's
# steps build on: plain SGD with momentum, a constant LR and no clipping let its scale show.
# The cnn (K = 1: BatchNorm normalises each micro-batch) runs SyncBN: the padding repeats must
# stay out of its statistics too. It stops 6 steps into epoch 2: later, max-pool ties over the
# digits' constant background flip on float noise (1e-7) and route a gradient elsewhere.
EXACT = [
    "data.splits.val_fraction=0.2015",
    "data.splits.test_fraction=0",  # no test split: 1797 - 362 validation samples train
    "trainer.epochs=2",
    "optim=sgd",
    "optim.lr=0.05",
    "sched=constant",
    "trainer.clip_grad_norm=null",
    "trainer.log_every=1",
    "trainer.eval_every=1000",
    "checkpoint.every=0",
    "model.width=8",
]
STEPS = {"mlp": 60, "cnn": 36}


@pytest.fixture(scope="module")
def single_exact(tmp_path_factory):
    runs = {}
    for model, steps in STEPS.items():
        runs[model] = tmp_path_factory.mktemp(f"exact_{model}")
        run_in_process(runs[model], *EXACT, f"model={model}", f"trainer.max_steps={steps}", "data.batch_size=48")
    return runs


@pytest.mark.slow
@pytest.mark.parametrize(
    "model,nproc,steps,batch", [("mlp", 2, 3, 8), ("mlp", 3, 2, 8), ("cnn", 2, 1, 24), ("cnn", 3, 1, 16)]
)
def test_odd_n_two_epochs_w_ranks_equal_one_process_step_by_step(single_exact, tmp_path, model, nproc, steps, batch):
    run_in_process(
        tmp_path,
        *EXACT,
        f"model={model}",
        f"trainer.max_steps={STEPS[model]}",
        f"data.batch_size={batch}",
        f"accumulation.steps={steps}",
        "parallel.sync_bn=true",
        nproc=nproc,
    )
    single_rows, ddp_rows = rows(single_exact[model]), rows(tmp_path)
    assert len(ddp_rows) == len(single_rows) == STEPS[model] and single_rows[29]["samples"] == 1435  # 30 steps/epoch
    for a, b in zip(single_rows, ddp_rows, strict=True):
        assert (a["step"], a["samples"]) == (b["step"], b["samples"])
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), a["step"]
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5), a["step"]
    # Running statistics too. SGD: reduction-order rounding alone, 1.2e-7 to 2.4e-7 measured; 1e-5 is 40x that.
    assert_same_weights(weights(tmp_path), weights(single_exact[model]), atol=1e-5)


@pytest.fixture(scope="module")
def single_cnn_b32(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("cnn")
    run_in_process(run_dir, *SYNC_BN, "data.batch_size=32")
    return weights(run_dir)


@pytest.mark.slow
@pytest.mark.parametrize("sync_bn", [True, False])
def test_sync_bn_two_ranks_b16_equal_batchnorm_one_process_b32(single_cnn_b32, tmp_path, sync_bn, capfd):
    overrides = [*SYNC_BN, "data.batch_size=16", f"parallel.sync_bn={sync_bn}"]
    # Forked ranks print Python's warnings to the stderr they share with this process (helpers._worker;
    # rank 0's only, as under torchrun): capfd reads them.
    run_in_process(tmp_path, *overrides, nproc=2)
    stderr = capfd.readouterr().err
    got = weights(tmp_path)
    buffers = [k for k in got if "running" in k or "num_batches_tracked" in k]
    assert len(buffers) == 9 and all(torch.equal(got[k], single_cnn_b32[k]) for k in buffers if "num_batches" in k)
    if sync_bn:  # statistics of the global batch of 32: the same weights and running statistics
        assert_same_weights(got, single_cnn_b32, atol=1e-5)  # SGD: rounding alone, 6.0e-8 measured
        assert "FutureWarning" not in stderr
    else:  # plain BatchNorm normalises each rank's 16 alone: the check above would fail
        assert max((got[k] - single_cnn_b32[k]).abs().max().item() for k in buffers) > 1e-3


@pytest.mark.slow
def test_sync_bn_resnet18_under_ddp(tmp_path):
    run_in_process(
        tmp_path,
        "model=resnet18",
        "data=fake",
        "data.splits.train_size=64",
        "data.splits.val_size=16",
        "data.batch_size=8",
        "trainer.max_steps=2",
        "parallel.sync_bn=true",
        "optim=sgd",  # a checkpoint without AdamW's two moments, no best checkpoint: 11M parameters, written less
        "checkpoint.monitor=null",
        nproc=2,
    )
    assert weights(tmp_path)["bn1.num_batches_tracked"].item() == 2


@pytest.fixture(scope="module")
def torchrun_sweep(tmp_path_factory):
    """`torchrun --nproc_per_node=2 src/train.py -m trainer.max_steps=2,3` with a model that raises a
    Python warning on every rank as it is built: (the finished process, its sweep dir). What a sweep under
    torchrun writes and what two ranks print: both tests in this file, so that the run is made once (a
    session fixture is made once per xdist worker, and the suite's files go to two)."""
    tmp = tmp_path_factory.mktemp("torchrun_sweep")
    overrides = ["parallel=ddp", "model._target_=helpers.warning_mlp", "trainer.max_steps=2,3"]
    proc = run_train(tmp / "unused", "-m", f"hydra.sweep.dir={tmp / 'sweep'}", *overrides, nproc=2)
    return proc, tmp / "sweep"


@pytest.mark.slow
def test_two_ranks_print_every_line_and_warning_once(torchrun_sweep):
    # Rank 0's warning shows once (Python's default filter: once per place in a process, here for both
    # jobs); rank 1's never. (test_console.py: what one process shows on a terminal and in a log.)
    proc, _ = torchrun_sweep
    assert proc.stderr.count("UserWarning: helpers.warning_mlp") == 1
    assert proc.stdout.count("done: 2 steps") == 1 and proc.stdout.count("done: 3 steps") == 1
    assert proc.stdout.count("trainkit | ddp x2") == 2  # one per job


@pytest.mark.slow
def test_a_sweep_under_torchrun_runs_every_job_on_every_rank_into_one_dir_each(torchrun_sweep):
    # Each job builds its own process group in the same workers: under a store prefix of its own.
    proc, sweep = torchrun_sweep
    jobs = sorted(p.name for p in sweep.iterdir() if p.is_dir())
    assert jobs == ["0", "1"]
    for job, steps in zip(jobs, (2, 3), strict=True):
        assert rows(sweep / job)[-1]["step"] == steps
        assert (sweep / job / "model.pt").is_file()
        assert f"max_steps: {steps}" in (sweep / job / ".hydra" / "config.yaml").read_text()
    assert proc.stdout.count("trainkit | ddp x2 on cpu") == 2  # each job on both ranks (rank 0 says so)
