"""FSDP2 (parallel=fsdp) on 2 gloo ranks: exact accumulation with local gradient accumulation,
reduce-scatter rounds counted where they happen, padded evaluation, sharded (DCP) checkpoints
that resume bit for bit and on another world size, and a gathered model.pt."""

import contextlib
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from torch import nn
from torch.utils.data import TensorDataset

from helpers import (
    SYNC_BN,
    assert_equal,
    compose_cfg,
    max_diff,
    rows,
    run_distributed,
    run_in_process,
    small_resnet,
    weights,
    without_timings,
)
from trainkit import config
from trainkit.accumulate import sync_context, syncs_now
from trainkit.checkpoint import Checkpointer, full_state_dict, restore, snapshot
from trainkit.config import ConfigError
from trainkit.dist import Dist
from trainkit.evaluate import evaluate
from trainkit.loading import eval_loader
from trainkit.metrics import TrainMeter
from trainkit.models.resnet import resnet18
from trainkit.parallel import EqualBatches, fsdp_units, resolve_mode, wrap
from trainkit.schedules import warmup_cosine
from trainkit.tasks.classification import Classification

CPU = Dist(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))


def padded_bytes(state: dict, world_size: int) -> int:
    """What one reduce-scatter round of every parameter sends in: the full gradient, dim 0 padded
    to a multiple of the world size."""
    return sum(
        math.ceil(t.shape[0] / world_size) * world_size * t[0].numel() * t.element_size()
        for t in state.values()
        if t.is_floating_point()
    )


# --- units, config ---------------------------------------------------------------------------


def test_shard_units_by_default_and_by_class_name():
    model = resnet18(3, 10)
    assert [type(m).__name__ for m in fsdp_units(model)] == [
        "Conv2d",
        "BatchNorm2d",
        "Sequential",
        "Sequential",
        "Sequential",
        "Sequential",
        "Linear",
    ]
    assert [type(m).__name__ for m in fsdp_units(model, ["BasicBlock"])] == ["BasicBlock"] * 8
    assert fsdp_units(model, []) == []  # the root alone
    with pytest.raises(ConfigError, match=r"parallel.shard_units: no submodule of class Block in ResNet \(it has: "):
        fsdp_units(model, ["Block"])


def test_fsdp_needs_torchrun_and_refuses_fp16():
    with pytest.raises(ConfigError, match="parallel=fsdp needs several processes"):
        resolve_mode("fsdp", 1, under_torchrun=False)
    assert resolve_mode("fsdp", 2, under_torchrun=True) == "fsdp"
    with pytest.raises(ConfigError, match="trainer.precision=fp16 is not supported with parallel=fsdp"):
        config.check(compose_cfg("parallel=fsdp", "trainer.precision=fp16"))
    config.check(compose_cfg("parallel=fsdp", "parallel.shard_units=[BasicBlock]"))


def test_a_checkpoint_of_the_other_layout_is_refused():
    state = {"sharded": True, "path": "checkpoints/step_00000004", "ranks": [{}, {}]}
    with pytest.raises(
        ConfigError,
        match=r"step_00000004 was written with parallel=fsdp \(a DCP directory\), "
        r"this run has parallel=single/ddp",
    ):
        restore(state, nn.Linear(2, 2), None, None, None, None, CPU)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # DCP without a process group
def test_sharded_checkpoints_keep_last_n_and_skip_leftovers(tmp_path):
    """The DCP layout without a process group (DCP saves non-distributed then): directories,
    keep-last-N, an interrupted save's leftover, and a directory without .metadata."""
    directory = tmp_path / "checkpoints"
    checkpointer = Checkpointer(directory, every=1, keep=2, d=CPU, sharded=True)
    model = nn.Linear(3, 2)
    for step in (1, 2, 3):
        checkpointer.save(
            step,
            {
                "model": model.state_dict(),
                "optimizer": {},
                "progress": {"step": step},
                "ranks": {"rng": torch.get_rng_state()},
            },
        )
    assert sorted(p.name for p in directory.iterdir()) == ["step_00000002", "step_00000003"]
    assert sorted(p.name for p in (directory / "step_00000003").iterdir()) == [".metadata", "__0_0.distcp", "state.pt"]
    (directory / "step_00000004.tmp").mkdir()  # killed mid-save
    (directory / "step_00000005").mkdir()  # no .metadata: not readable, the next newest is taken
    state = checkpointer.load("auto")
    assert state["progress"]["step"] == 3 and state["sharded"] and "model" not in state
    assert not (directory / "step_00000004.tmp").exists()
    assert Checkpointer(directory, 1, 1, CPU).load(str(directory / "step_00000002"))["progress"]["step"] == 2


# --- two ranks in process: the accumulation, the counting, the evaluation ----------------------


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))  # 3: dim 0 padded to 4


def _two_ranks(rank, world_size, directory):
    d = Dist(rank, rank, world_size, torch.device("cpu"))
    out = {}
    K, windows = 3, 2
    for strategy in ("no_sync", "sync_each_batch"):
        fsdp, comm = wrap(_net(), "fsdp", d)
        ddp, _ = wrap(_net(), "ddp", d)
        reduced_inside, diffs = [], []
        for window in range(windows):
            for k in range(K):
                torch.manual_seed(100 * window + 10 * k + rank)  # different data on each rank
                x = torch.randn(5, 6)
                for model in (fsdp, ddp):
                    with sync_context(model, syncs_now(strategy, k, K)):
                        model(x).pow(2).sum().backward()
                if k < K - 1:  # no_sync: nothing reduced yet, the sharded .grad does not exist
                    reduced_inside.append(all(p.grad is not None for p in fsdp.parameters()))
            diffs += [
                (p.grad.full_tensor() - q.grad).abs().max().item()
                for p, q in zip(fsdp.parameters(), ddp.module.parameters(), strict=True)
            ]
            fsdp.zero_grad(set_to_none=True)
            ddp.zero_grad(set_to_none=True)
        out[strategy] = dict(syncs=comm.syncs, bytes=comm.bytes, reduced_inside=reduced_inside, diff=max(diffs))

    # Evaluation on contiguous shards of 9 and 8 samples, batch 4: 3 and 2 batches. Every FSDP
    # forward all-gathers, so rank 1 runs one empty batch more; the numbers equal one process's.
    torch.manual_seed(1)
    data = TensorDataset(torch.randn(17, 6), torch.randint(0, 3, (17,)))
    loader = EqualBatches(eval_loader(data, d, 4, 0), world_size)
    out["eval_batches"] = [len(x) for x, _ in loader]
    out["eval"] = evaluate(fsdp, loader, d, contextlib.nullcontext, Classification())
    full = full_state_dict(fsdp)  # gathered to rank 0
    sharded = [p.full_tensor() for p in fsdp.parameters()]  # a collective: on every rank
    if rank == 0:
        plain = _net()
        plain.load_state_dict(full)
        out["plain_equal"] = all(torch.equal(p, q) for p, q in zip(sharded, plain.parameters(), strict=True))
        with torch.no_grad():
            logits = plain(data.tensors[0])
        out["reference"] = {
            "val/loss": F.cross_entropy(logits, data.tensors[1], reduction="sum").item() / 17,
            "val/acc": (logits.argmax(1) == data.tensors[1]).sum().item() / 17,
        }
    out["full_keys"] = sorted(full)
    out["checkpoint"] = _checkpoint_round_trip(d, directory)
    return out


def _training_objects(d: Dist):
    torch.manual_seed(0)
    model, comm = wrap(nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)), "fsdp", d)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine_100)
    return model, optimizer, scheduler, torch.amp.GradScaler("cpu", enabled=False), TrainMeter(d, comm)


def warmup_cosine_100(step):
    return warmup_cosine(step, total_steps=100, warmup_steps=10)


def _checkpoint_round_trip(d: Dist, directory: str) -> dict:
    """snapshot -> Checkpointer.save (DCP) -> load -> restore into fresh objects: the same shards
    and optimizer state, and the BatchNorm buffers of rank 0 on every rank (DCP would save the
    replicated buffers from any one rank; model.pt and the evaluation use rank 0's)."""
    model, optimizer, scheduler, scaler, meter = _training_objects(d)
    for _ in range(2):
        model(torch.randn(4, 6) + d.rank).sum().backward()  # running statistics differ by rank
        optimizer.step()
        scheduler.step()
    rank0_mean = d.broadcast_from_main(model[1].running_mean.clone())
    checkpointer = Checkpointer(Path(directory), every=1, keep=1, d=d, sharded=True)
    checkpointer.save(
        2,
        snapshot(
            model, optimizer, scheduler, scaler, meter, {"step": 2, "epoch": 0, "window": 2}, {"seed": 0}, {}, None, d
        ),
    )
    fresh, fresh_optimizer, fresh_scheduler, *rest = _training_objects(d)
    restore(checkpointer.load("auto"), fresh, fresh_optimizer, fresh_scheduler, *rest, d)
    local = [p.to_local() for p in model.parameters()]
    moments = [s["exp_avg_sq"].to_local() for s in optimizer.state.values()]
    return {
        "params": all(torch.equal(a, b.to_local()) for a, b in zip(local, fresh.parameters(), strict=True)),
        "optimizer": all(
            torch.equal(a, s["exp_avg_sq"].to_local())
            for a, s in zip(moments, fresh_optimizer.state.values(), strict=True)
        ),
        "lr": fresh_optimizer.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"] != 0.1,
        "buffers": torch.equal(fresh[1].running_mean, rank0_mean) and not torch.equal(model[1].running_mean, rank0_mean)
        if d.rank
        else True,
    }


def test_fsdp_accumulates_locally_reduces_once_evaluates_like_one_process_and_checkpoints(tmp_path):
    ranks = run_distributed(_two_ranks, 2, str(tmp_path / "checkpoints"))
    param_bytes = padded_bytes(_net().state_dict(), 2)
    assert param_bytes == (6 * 16 + 16 + 4 * 16 + 4) * 4  # the last layer's 3 rows padded to 4
    for rank, result in enumerate(ranks):
        no_sync, each = result["no_sync"], result["sync_each_batch"]
        # The gradient of each window equals DDP's (which tests/test_ddp.py ties to closed form).
        assert no_sync["diff"] < 1e-6 and each["diff"] < 1e-6
        assert no_sync["syncs"] == 2 and each["syncs"] == 6  # 2 optimizer steps of K=3
        assert no_sync["bytes"] == 2 * param_bytes and each["bytes"] == 6 * param_bytes
        assert not any(no_sync["reduced_inside"]) and all(each["reduced_inside"])
        assert result["eval_batches"] == ([4, 4, 1] if rank == 0 else [4, 4, 0])
    reference = ranks[0]["reference"]
    for result in ranks:
        assert result["eval"]["val/acc"] == reference["val/acc"]
        assert result["eval"]["val/loss"] == pytest.approx(reference["val/loss"], rel=1e-6)
    assert ranks[0]["plain_equal"] and ranks[0]["full_keys"] == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert ranks[1]["full_keys"] == []  # the full state dict exists on rank 0 only
    for result in ranks:
        assert result["checkpoint"] == {"params": True, "optimizer": True, "lr": True, "buffers": True}


# --- end to end: what src/train.py runs under torchrun (forked ranks) ---------------------------------

# One epoch of digits with a validation split of 353 (train 1444): 45 global batches of 32 and a
# short last one of 4, SGD (an equivalence: tests/helpers.py), cosine warmup, clipping. The evaluation
# shards of 177 and 176 samples make 23 and 22 batches of 8: without the padding the FSDP evaluation
# would hang.
EPOCH = [
    "trainer.epochs=1",
    "data.splits.val_fraction=0.1965",
    "data.splits.test_fraction=0",  # no test split: 1797 - 353 validation samples train
    "optim=sgd",
    "sched=cosine",
    "sched.warmup_steps=5",
    "trainer.clip_grad_norm=0.5",
    "trainer.log_every=5",
    "trainer.eval_every=20",
    "parallel.timeout_s=60",
]
FSDP_K2_B8 = ["parallel=fsdp", "data.batch_size=8", "accumulation.steps=2"]


@pytest.fixture(scope="module")
def single_b32(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("single")
    run_in_process(run_dir, *EPOCH, "data.batch_size=32")
    return run_dir


@pytest.fixture(scope="module")
def fsdp_no_sync(tmp_path_factory):
    """Also the uninterrupted run of the resume tests: checkpoints at 20, 40 and 46 stay."""
    run_dir = tmp_path_factory.mktemp("fsdp")
    run_in_process(run_dir, *EPOCH, *FSDP_K2_B8, "checkpoint.every=20", "checkpoint.keep=5", nproc=2)
    return run_dir


def _equivalence(single: Path, run_dir: Path, syncs: float) -> float:
    assert rows(run_dir)[-1]["step"] == rows(single)[-1]["step"] == 46
    got, expected = weights(run_dir), weights(single)
    diff = max_diff(got, expected)
    print(f"max |FSDP - single| = {diff:.2e}")
    assert diff < 1e-5  # SGD: reduction-order rounding alone, 4.5e-8 measured; 1e-5 is ~200x that
    for a, b in zip(rows(single), rows(run_dir), strict=True):
        assert a["step"] == b["step"] and a["samples"] == b["samples"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["lr"] == pytest.approx(b["lr"], rel=1e-12)
        if "val/loss" in a:  # the padded FSDP evaluation equals the one-process evaluation
            assert a["val/acc"] == b["val/acc"] and a["val/loss"] == pytest.approx(b["val/loss"], rel=1e-5)
    # Reduce-scatter rounds counted by FSDP's hook: 1 per optimizer step with no_sync, K with
    # sync_each_batch (the short last window has one micro-step: 1); each round reduces the
    # whole gradient (no padding needed here at W=2).
    for r in rows(run_dir):
        expected = syncs if r["step"] < 46 else 1.0
        assert r["comm/grad_syncs"] == expected and r["comm/grad_bytes"] == expected * padded_bytes(got, 2), r
    # model.pt: the gathered, plain state_dict of the unwrapped model.
    instantiate(compose_cfg(*EPOCH).model).load_state_dict(got)
    return diff


@pytest.mark.slow
def test_fsdp_two_ranks_k2_b8_no_sync_equal_one_process_b32(single_b32, fsdp_no_sync):
    _equivalence(single_b32, fsdp_no_sync, 1.0)


@pytest.mark.slow
def test_fsdp_two_ranks_k2_b8_sync_each_batch_equal_one_process_b32(single_b32, tmp_path):
    run_in_process(tmp_path, *EPOCH, *FSDP_K2_B8, "accumulation=sync_each_batch", nproc=2)
    _equivalence(single_b32, tmp_path, 2.0)


def _dcp(path: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(path, path.parent / f"{path.name}.consolidated")
    return torch.load(path.parent / f"{path.name}.consolidated", weights_only=False)


@pytest.mark.slow
def test_fsdp_resume_from_a_dcp_checkpoint_is_bitwise(fsdp_no_sync, tmp_path):
    step_20 = fsdp_no_sync / "checkpoints" / "step_00000020"
    out = run_in_process(tmp_path, *EPOCH, *FSDP_K2_B8, f"checkpoint.resume={step_20}", "checkpoint.every=20", nproc=2)
    assert f"resumed from {step_20} at step 20" in out
    straight, resumed = weights(fsdp_no_sync), weights(tmp_path)
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    a, b = (d / "checkpoints" / "step_00000046" for d in (fsdp_no_sync, tmp_path))
    assert_equal(_dcp(a), _dcp(b), "dcp")  # the model and optimizer shards, bit for bit
    state_a, state_b = (torch.load(p / "state.pt", weights_only=True) for p in (a, b))
    for key in ("scheduler", "progress", "ranks"):
        assert_equal(state_a[key], state_b[key], key)
    assert [without_timings(r) for r in rows(fsdp_no_sync)][4:] == [without_timings(r) for r in rows(tmp_path)]


@pytest.mark.slow
def test_fsdp_resume_on_one_rank_continues_the_two_rank_run(fsdp_no_sync, tmp_path):
    step_20 = fsdp_no_sync / "checkpoints" / "step_00000020"
    # The same global batch of 32: 1 rank x 8 x K=4. DCP reshards the model and optimizer state.
    out = run_in_process(
        tmp_path,
        *EPOCH,
        "parallel=fsdp",
        "data.batch_size=8",
        "accumulation.steps=4",
        f"checkpoint.resume={step_20}",
        torchrun=True,  # one rank under torchrun: parallel=fsdp needs it
    )
    assert "written by 2 ranks, now 1 (the same global batch); per-rank RNG streams re-seeded" in out
    diff = max_diff(weights(tmp_path), weights(fsdp_no_sync))
    print(f"max |resumed on 1 rank - 2 ranks| = {diff:.2e}")
    assert diff < 1e-5  # SGD: reduction-order rounding alone, 4.5e-8 measured; 1e-5 is ~200x that
    for a, b in zip(rows(fsdp_no_sync)[4:], rows(tmp_path), strict=True):
        assert a["step"] == b["step"] and a["samples"] == b["samples"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)


@pytest.mark.slow
def test_fsdp_with_sync_bn_two_ranks_b16_equal_batchnorm_one_process_b32(tmp_path):
    run_in_process(tmp_path / "single", *SYNC_BN, "data.batch_size=32")
    run_in_process(tmp_path / "fsdp", *SYNC_BN, "data.batch_size=16", "parallel=fsdp", "parallel.sync_bn=true", nproc=2)
    got, expected = weights(tmp_path / "fsdp"), weights(tmp_path / "single")
    assert [k for k in got if "running_mean" in k] == ["1.running_mean", "4.running_mean", "8.running_mean"]
    print(f"max |FSDP + SyncBN - single| = {max_diff(got, expected):.2e}")
    # Weights and running statistics of the global batch. SGD: rounding alone, 6.0e-8 measured; 1e-5 is ~170x.
    assert max_diff(got, expected) < 1e-5


@pytest.mark.slow
def test_fsdp_resnet18_by_basic_block_with_sync_bn_and_accumulation(tmp_path):
    """resnet18's structure (helpers.small_resnet: its BasicBlocks and BatchNorms at 1/250 of the parameters;
    test_experiments trains resnet18 itself by BasicBlock, fsdp_resnet18_fake) sharded per BasicBlock, SyncBN
    inside the units, K=2: BatchNorm moved once a micro-batch, one reduce-scatter round a step, a plain model.pt."""
    run_in_process(
        tmp_path,
        "model=resnet18",
        "model._target_=helpers.small_resnet",
        "model.small_input=true",
        "data=fake",
        "data.splits.train_size=64",
        "data.splits.val_size=12",
        "data.batch_size=4",
        "accumulation.steps=2",
        "trainer.max_steps=2",
        "parallel=fsdp",
        "parallel.shard_units=[BasicBlock]",
        "parallel.sync_bn=true",
        nproc=2,
    )
    got = weights(tmp_path)
    assert got["layer1.0.bn1.num_batches_tracked"].item() == 4  # 2 steps x K=2 micro-batches
    small_resnet(3, 10).load_state_dict(got)
    assert all(r["comm/grad_syncs"] == 1.0 for r in rows(tmp_path) if "loss" in r)


@pytest.mark.slow
def test_fsdp_reduce_dtype_bf16_halves_the_bytes_and_stays_near_fp32(fsdp_no_sync, tmp_path):
    run_in_process(tmp_path, *EPOCH, *FSDP_K2_B8, "parallel.reduce_dtype=bf16", nproc=2)
    for full, half in zip(rows(fsdp_no_sync), rows(tmp_path), strict=True):
        assert half["comm/grad_bytes"] == full["comm/grad_bytes"] / 2  # reduce-scattered in bf16
        assert half["loss"] == pytest.approx(full["loss"], rel=2e-2)
    diff = max_diff(weights(tmp_path), weights(fsdp_no_sync))
    print(f"max |bf16 reduce - fp32 reduce| = {diff:.2e}")
    # Each step's gradient rounded to bf16 once (8 bits of mantissa: 2^-9 relative), SGD's update
    # lr x that gradient: 9.7e-4 measured after 46 steps; 1e-2 is 10x that. (AdamW's normalised update
    # made a near-zero gradient's rounding a step of up to lr, 3e-3 a step: 5e-2 was needed.)
    assert 0 < diff < 1e-2
