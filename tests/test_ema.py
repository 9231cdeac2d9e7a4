"""trainer.ema.decay: the average's rule (timm's warm-up, only steps taken, buffers copied), what it is
under DDP and FSDP (one process's, on each rank's own shards, with no communication), in checkpoints
(bitwise resume; resharded by DCP on another world size), in the rows (val/* the average, val_raw/*
the live weights, which it never touches), and predict.py weights=ema."""

import json

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from helpers import assert_equal, max_diff, rows, run_distributed, run_in_process, weights
from trainkit.data.digits import digits
from trainkit.dist import Dist
from trainkit.ema import EMA, warmed_up
from trainkit.errors import ConfigError
from trainkit.loading import InMemory, TrainBatches
from trainkit.parallel import wrap

CPU = Dist(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
DECAY = 0.5  # the warm-up (1 + n) / (10 + n) reaches it at n = 8: both branches of the min in 10 steps


# --- the rule on a tiny module ------------------------------------------------------------------


def test_the_nth_update_decays_by_min_decay_and_the_warm_up_and_buffers_are_copied():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 2, dtype=torch.float64), nn.BatchNorm1d(2, dtype=torch.float64))
    ema = EMA(model, DECAY, CPU)
    average = {k: v.clone() for k, v in model.state_dict().items() if "running" not in k and "tracked" not in k}
    for n in range(12):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        model(torch.randn(4, 2, dtype=torch.float64))  # train mode: the running statistics move
        ema.update()
        decay = min(DECAY, (1 + n) / (10 + n))
        assert warmed_up(DECAY, n) == decay
        live = model.state_dict()
        for k in average:  # the rule written out: decay x average + (1 - decay) x weights
            average[k] = decay * average[k] + (1 - decay) * live[k]
            assert torch.allclose(ema.average[k], average[k], rtol=0, atol=1e-12), (
                n,
                k,
            )  # float64 rounding of O(1) weights
        for k, b in ema.buffer_copy.items():
            assert torch.equal(b, live[k]), k  # copied, not averaged
    assert ema.updates == 12 and warmed_up(DECAY, 7) == 8 / 17 < DECAY == warmed_up(DECAY, 8)
    live = {k: v.clone() for k, v in model.state_dict().items()}
    with ema.applied(model):
        inside = {k: v.clone() for k, v in model.state_dict().items()}
    assert_equal(dict(model.state_dict()), live, "live weights back")
    assert_equal({k: inside[k] for k in ema.average}, ema.average, "the average inside")
    assert_equal({k: inside[k] for k in ema.buffer_copy}, ema.buffer_copy, "its buffers inside")
    # full_state_dict: the weights the evaluation uses, a copy (the live storage gets the live values back)
    assert_equal(ema.full_state_dict(model), inside, "the average's state_dict")
    assert_equal(EMA(model, None, CPU).full_state_dict(model), live, "EMA off: the live weights'")
    for bad in (1.0, -0.1, "0.9"):
        with pytest.raises(ConfigError, match=f"trainer.ema.decay={bad} must be null"):
            EMA(model, bad, CPU)  # type: ignore[arg-type]


# --- FSDP: the average on each rank's shards, updated without communication -------------------------


def _fsdp_update_without_a_process_group(rank, world_size):
    d = Dist(rank, rank, world_size, torch.device("cpu"))
    torch.manual_seed(0)
    # shard_units=[]: the root alone holds every parameter, and keeps them gathered after an eval forward
    model, _ = wrap(nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)), "fsdp", d, shard_units=[])
    params = list(model.parameters())
    ema = EMA(model, DECAY, d)
    layout = [  # before anything uses the average: an unsharded one would fail there, not here
        isinstance(a, DTensor) and a.placements == p.placements and a.device_mesh == p.device_mesh
        for a, p in zip(ema.average.values(), params, strict=True)
    ]
    if not all(layout):
        return {"layout": layout}
    optimizer = torch.optim.SGD(params, lr=0.5)
    model(torch.randn(4, 6) + rank).sum().backward()
    optimizer.step()
    model.eval()
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(1))  # the same on both ranks
    with torch.no_grad():
        live_out = model(x)  # the root keeps its gathered parameters after it
        with ema.applied(model):
            ema_out = model(x)
        after_out = model(x)
    reference = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)).eval()
    reference.load_state_dict({k: a.full_tensor() for k, a in ema.average.items()} | ema.buffer_copy)
    forwards = {
        "average": torch.allclose(ema_out, reference(x), rtol=1e-6, atol=1e-6),  # float32 rounding of one forward
        "live after": torch.equal(after_out, live_out),
        "differ": not torch.allclose(ema_out, live_out),
    }
    before = [a.to_local().clone() for a in ema.average.values()]
    live = [p.to_local().clone() for p in params]
    dist.destroy_process_group()  # a collective from here on raises: the update must need none
    ema.update()
    with ema.applied(model):  # the swap needs none either (reshard frees the root's gathered copy)
        swapped = [p.to_local().clone() for p in params]
    return {
        "forwards": forwards,
        "layout": layout,
        "update": [
            torch.allclose(a.to_local(), torch.lerp(b, p, 0.9), rtol=0, atol=1e-7)  # lerp: float32 rounding
            for a, b, p in zip(ema.average.values(), before, live, strict=True)
        ],
        "swapped": [torch.equal(s, a.to_local()) for s, a in zip(swapped, ema.average.values(), strict=True)],
        "restored": [torch.equal(p.to_local(), q) for p, q in zip(params, live, strict=True)],
        "shard_sizes": [a.to_local().shape[0] for a in ema.average.values()],
    }


def test_fsdp_keeps_the_average_on_each_ranks_shards_and_updates_it_without_communication():
    ranks = run_distributed(_fsdp_update_without_a_process_group, 2)
    for result in ranks:
        assert all(result["layout"]), result  # DTensors of the parameters' mesh and placements, checked first
        assert all(result["forwards"].values()), result  # a forward under applied() uses the average, then the live
        assert all(result["update"]) and all(result["swapped"]) and all(result["restored"]), result
    # Each rank's own shards (dim 0 split as torch.chunk does: the last layer's 3 rows as 2 + 1).
    assert [r["shard_sizes"] for r in ranks] == [[4, 4, 4, 4, 2, 2], [4, 4, 4, 4, 1, 1]]


# --- end to end: one run's checkpoints of every step, its resume, DDP and FSDP -----------------------

SKIPPED = 3


def digits_with_a_nan(val_fraction: float = 0.2, test_fraction: float = 0.2):
    """data.splits._target_=test_ema.digits_with_a_nan: digits with one NaN training sample, in step 3's
    global batch of 32 (seed 0): at any world size, and after a resume, the same step is skipped (every
    rank with it, rule 17), its BatchNorm statistics NaN before the loss is known (the guard puts them back)."""
    train, val, test = digits(val_fraction, test_fraction)
    epoch = TrainBatches(len(train), 1, 0, 32, seed=0)  # the global order: W ranks' windows are its slices
    epoch.set_epoch(0)
    x = train.tensors[0].clone()
    x[epoch.order()[32 * (SKIPPED - 1)]] = float("nan")
    return InMemory(x, train.tensors[1]), val, test


# A BatchNorm model (buffers to copy), SGD (equivalences: tests/helpers.py), 10 steps of global batch 32
# with step 3's window NaN and skipped, rows and evaluations at 5 and 10.
RUN = [
    "data.splits._target_=test_ema.digits_with_a_nan",
    "model=cnn",
    "model.width=8",
    "optim=sgd",
    "trainer.max_steps=10",
    "trainer.log_every=5",
    "trainer.eval_every=5",
    "trainer.on_nonfinite=skip",
    f"trainer.ema.decay={DECAY}",
]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """One process, b=32, a checkpoint after every step."""
    tmp = tmp_path_factory.mktemp("ema_single")
    run_in_process(tmp / "run", *RUN, "checkpoint.every=1", "checkpoint.keep=20")
    return tmp / "run"


SYNC_BN_B16 = ["parallel.sync_bn=true", "data.batch_size=16"]  # BatchNorm over the global batch of 32, as one process


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ema_ddp")
    run_in_process(tmp / "run", *RUN, "parallel=ddp", *SYNC_BN_B16, nproc=2)
    return tmp / "run"


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory):
    """Two ranks, b=16, a DCP checkpoint at step 5."""
    tmp = tmp_path_factory.mktemp("ema_fsdp")
    overrides = ["parallel=fsdp", *SYNC_BN_B16, "checkpoint.every=5", "checkpoint.keep=5"]
    run_in_process(tmp / "run", *RUN, *overrides, nproc=2)
    return tmp / "run"


def same(a, b) -> bool:
    """Rows equal, NaN (step 3's loss in the row of step 5) equal to NaN."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def checkpoint_at(run_dir, step: int) -> dict:
    return torch.load(run_dir / "checkpoints" / f"step_{step:08d}.pt", weights_only=True)


def ema_weights(run_dir) -> dict:
    return torch.load(run_dir / "model_ema.pt", weights_only=True)


def test_the_average_takes_each_step_taken_after_it_and_copies_the_buffers(single):
    """From the checkpoints of every step: average_s = lerp(average_{s-1}, weights_s, 1 - decay_n), n the
    steps taken before; the skipped step changes nothing and is not counted; buffers = the live ones."""
    states = {s: checkpoint_at(single, s) for s in range(1, 11)}
    assert [int(states[s]["ema"]["updates"]) for s in range(1, 11)] == [1, 2, 2, 3, 4, 5, 6, 7, 8, 9]
    assert_equal(states[SKIPPED]["ema"], states[SKIPPED - 1]["ema"], "the skipped step's EMA")
    for s in range(2, 11):
        ema, model, n = states[s]["ema"], states[s]["model"], int(states[s - 1]["ema"]["updates"])
        for k, average in ema["params"].items():
            expected = torch.lerp(states[s - 1]["ema"]["params"][k], model[k], 1 - warmed_up(DECAY, n))
            if s == SKIPPED:
                expected = states[s - 1]["ema"]["params"][k]
            # torch.lerp against the update's _foreach_lerp_ on the same float32 tensors: equal to a few ulp
            assert torch.allclose(average, expected, rtol=1e-6, atol=1e-7), (s, k)
        assert ema["buffers"].keys() == {k for k in model if "running" in k or "tracked" in k}
        for k, buffer in ema["buffers"].items():
            assert torch.equal(buffer, model[k]), (s, k)
    final = ema_weights(single)  # model_ema.pt: the last average with its buffers, model.pt's keys
    assert final.keys() == weights(single).keys()
    assert_equal(final, states[10]["ema"]["params"] | states[10]["ema"]["buffers"], "model_ema.pt")


def test_the_average_never_touches_the_live_weights_and_is_evaluated_as_val(single, tmp_path):
    """The same run without EMA: model.pt bit for bit, and its val/* are the EMA run's val_raw/*."""
    run_in_process(tmp_path, *RUN[:-1])
    assert_equal(weights(tmp_path), weights(single), "model.pt")
    assert not (tmp_path / "model_ema.pt").exists()
    with_ema, without = rows(single, timings=False), rows(tmp_path, timings=False)
    assert [r["step"] for r in with_ema] == [5, 10]
    for a, b in zip(with_ema, without, strict=True):
        assert same({k.replace("val_raw/", "val/"): v for k, v in a.items() if not k.startswith("val/")}, b)
        assert a["val/loss"] != a["val_raw/loss"]  # the average is evaluated, not the live weights


def test_a_resume_continues_the_average_bit_for_bit(single, tmp_path):
    out = run_in_process(tmp_path, *RUN, f"checkpoint.resume={_pt(single, 6)}")
    assert "EMA" not in out  # neither started over nor ignored
    assert_equal(ema_weights(tmp_path), ema_weights(single), "model_ema.pt")
    assert_equal(weights(tmp_path), weights(single), "model.pt")
    assert same(rows(tmp_path, timings=False), rows(single, timings=False)[1:])  # the row at 10
    assert_equal(checkpoint_at(tmp_path, 10)["ema"], checkpoint_at(single, 10)["ema"], "the final checkpoint's")


def test_a_checkpoint_without_an_average_starts_it_from_its_weights_and_with_ema_off_it_is_ignored(single, tmp_path):
    # EMA off from step 6 on: the checkpoint's average is ignored, said once; training is the same run.
    out = run_in_process(tmp_path / "off", *RUN[:-1], "checkpoint.every=2", f"checkpoint.resume={_pt(single, 6)}")
    assert out.count("the checkpoint's EMA of the weights is ignored (trainer.ema.decay=null)") == 1
    assert_equal(weights(tmp_path / "off"), weights(single), "model.pt")
    assert not (tmp_path / "off" / "model_ema.pt").exists()
    # And on again from that run's step 8, which has no average: it starts from step 8's weights, n = 0.
    step_8 = tmp_path / "off" / "checkpoints" / "step_00000008.pt"
    out = run_in_process(tmp_path / "on", *RUN, "trainer.max_steps=9", f"checkpoint.resume={step_8}")
    assert out.count("holds no EMA of the weights; the average starts from the resumed weights") == 1
    start, after = torch.load(step_8, weights_only=True)["model"], checkpoint_at(tmp_path / "on", 9)
    assert int(after["ema"]["updates"]) == 1
    for k, average in after["ema"]["params"].items():  # one update from step 8's weights, decay 0.1
        assert torch.allclose(average, torch.lerp(start[k], after["model"][k], 0.9), rtol=1e-6, atol=1e-7), k


def _pt(run_dir, step: int) -> str:
    return str(run_dir / "checkpoints" / f"step_{step:08d}.pt")


def test_two_ddp_ranks_average_like_one_process_and_fsdp_like_ddp(single, ddp, fsdp):
    # SGD: the weights of the three agree to reduction-order rounding (~1e-8 here, see the prints), the
    # average is a convex combination of them: 1e-5 is ~100x what was measured.
    for name, got, expected in (("DDP - single", ddp, single), ("FSDP - DDP", fsdp, ddp)):
        ema_diff = max_diff(ema_weights(got), ema_weights(expected))
        model_diff = max_diff(weights(got), weights(expected))
        print(f"max |{name}|: model_ema.pt {ema_diff:.2e}, model.pt {model_diff:.2e}")
        assert ema_diff < 1e-5 and model_diff < 1e-5
        assert rows(got)[-1]["skipped_steps"] == 1  # step 3, on every rank together
        for a, b in zip(rows(got), rows(expected), strict=True):
            for key in ("val/loss", "val_raw/loss", "loss"):
                assert a[key] == pytest.approx(b[key], rel=1e-5, nan_ok=True), (name, key)  # step 3's NaN in row 5
            assert a["val/acc"] == b["val/acc"] and a["val_raw/acc"] == b["val_raw/acc"], name
    # The buffers are the live ones (rank 0's, as in model.pt), at any world size.
    for run_dir in (single, ddp, fsdp):
        live, average = weights(run_dir), ema_weights(run_dir)
        assert all(torch.equal(live[k], average[k]) for k in live if "running" in k or "tracked" in k)


def test_fsdp_resumes_the_average_on_another_world_size_through_dcp(fsdp, tmp_path):
    step_5 = fsdp / "checkpoints" / "step_00000005"
    # The same global batch of 32 on 1 rank (BatchNorm over it, as SyncBN over 2 x 16); DCP reshards the average.
    out = run_in_process(
        tmp_path,
        *RUN,
        "parallel=fsdp",
        "data.batch_size=32",
        f"checkpoint.resume={step_5}",
        torchrun=True,
    )
    assert "written by 2 ranks, now 1" in out and "EMA" not in out
    diff = max_diff(ema_weights(tmp_path), ema_weights(fsdp))
    print(f"max |model_ema.pt resumed on 1 rank - 2 ranks| = {diff:.2e}")
    assert diff < 1e-5  # SGD: rounding alone, as above
    assert [r["val/acc"] for r in rows(tmp_path)] == [r["val/acc"] for r in rows(fsdp)][1:]


def test_fsdp_resumes_the_saved_average_itself(fsdp, tmp_path):
    """Resumed on 1 rank from the 2-rank run's last step (nothing left to train): model_ema.pt is the saved
    average, its shards gathered, bit for bit (an average ignored, or started anew from the resumed
    weights, would be other weights)."""
    step_10 = fsdp / "checkpoints" / "step_00000010"
    run_in_process(tmp_path, *RUN, "parallel=fsdp", "data.batch_size=32", f"checkpoint.resume={step_10}", torchrun=True)
    assert_equal(ema_weights(tmp_path), ema_weights(fsdp), "the resumed average")


def test_predict_weights_ema_predicts_with_the_average(single, tmp_path):
    run_in_process(tmp_path / "ema", f"run_dir={single}", "weights=ema", script="predict")
    run_in_process(tmp_path / "last", f"run_dir={single}", script="predict")
    final = rows(single)[-1]
    assert json.loads((tmp_path / "ema" / "metrics.json").read_text())["acc"] == final["val/acc"]
    assert json.loads((tmp_path / "last" / "metrics.json").read_text())["acc"] == final["val_raw/acc"]
    (tmp_path / "no_ema").mkdir()
    for name in ("model.pt", ".hydra"):
        (tmp_path / "no_ema" / name).symlink_to(single / name)
    with pytest.raises(
        ConfigError,
        match=r"weights=ema: .*/model_ema.pt does not exist: the run kept no EMA \(trainer.ema.decay=null\)",
    ):
        run_in_process(tmp_path / "p", f"run_dir={tmp_path / 'no_ema'}", "weights=ema", script="predict")


def test_the_bare_step_averages_as_the_full_step_does(tmp_path):
    # One process, on_nonfinite=raise: train.bare_step; on_nonfinite=skip (no step skipped here): optimizer_step.
    # The same finite steps: the same weights, average and rows, bit for bit (issue 45's audit: the EMA update
    # left out of bare_step passed every other test).
    run = ["model.width=16", "model.depth=1", "trainer.max_steps=4", "trainer.log_every=2", "trainer.ema.decay=0.5"]
    run += ["trainer.eval_every=100", "checkpoint.every=0"]
    out = {}
    for mode in ("raise", "skip"):
        run_in_process(tmp_path / mode, *run, f"trainer.on_nonfinite={mode}")
        out[mode] = ema_weights(tmp_path / mode), weights(tmp_path / mode), rows(tmp_path / mode, timings=False)
    assert_equal(out["raise"][0], out["skip"][0], "model_ema.pt")
    assert_equal(out["raise"][1], out["skip"][1], "model.pt")
    assert out["raise"][2] == out["skip"][2]
    assert max_diff(out["raise"][0], out["raise"][1]) > 1e-4  # the average is not the live weights
