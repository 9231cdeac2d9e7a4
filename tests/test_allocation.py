"""The same experiment on any allocation (issue 18): a checkpoint resumes on another world size at
the same global batch (K adapts) and ends where the uninterrupted run ends, to reduction order."""

import math
import shutil
from pathlib import Path

import pytest

from helpers import rows, run_in_process, weights

# An MLP (no BatchNorm, no dropout: nothing that depends on the per-rank split) on digits, a global
# batch of 32 in micro-batches of 8: K=4 on one rank, K=2 on two. 12 steps, a checkpoint at step 6
# (mid-epoch: 34 windows an epoch) and rows every 4 steps.
RUN = [
    "model.width=32",
    "optim=sgd",  # an equivalence: SGD (tests/helpers.py)
    "accumulation.global_batch_size=32",
    "data.batch_size=8",
    "trainer.max_steps=12",
    "trainer.log_every=4",  # the row of steps 5-8 spans the resume: its loss sums travel
    "trainer.eval_every=100",
    "checkpoint.every=6",
]


def resume(source: Path, target: Path, checkpoint: str, *overrides: str, nproc: int, torchrun: bool = False) -> str:
    """Train in `target` from `source`'s checkpoint (copied, as a run moved to another allocation)."""
    (target / "checkpoints").mkdir(parents=True)
    copy = shutil.copytree if (source / "checkpoints" / checkpoint).is_dir() else shutil.copy
    copy(source / "checkpoints" / checkpoint, target / "checkpoints" / checkpoint)
    shutil.copy(source / "metrics.jsonl", target / "metrics.jsonl")
    return run_in_process(
        target,
        *RUN,
        *overrides,
        f"checkpoint.resume={target / 'checkpoints' / checkpoint}",
        nproc=nproc,
        torchrun=torchrun,
    )


def assert_same_run(resumed: Path, reference: Path):
    a, b = weights(resumed), weights(reference)
    assert a.keys() == b.keys()
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    print(f"max |resumed - uninterrupted| {diff:.2e}")
    # SGD: reduction-order rounding alone (<= 1.5e-8 measured); 1e-5 is ~700x that.
    assert diff < 1e-5
    for x, y in zip(rows(resumed), rows(reference), strict=True):  # the rows before and after the resume
        assert (x["step"], x["samples"]) == (y["step"], y["samples"])
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5)


AUGMENTED = "data.splits._target_=helpers.noisy_digits"  # random noise and shifts, per (seed, epoch, sample)


@pytest.fixture(scope="module", params=["plain", "augmented"])
def runs(request, tmp_path_factory) -> dict[str, Path | list[str]]:
    """The uninterrupted 12 steps on one rank and on two (DDP), each with its checkpoint at step 6;
    "augmented": every sample randomly augmented (what it draws must not depend on the allocation)."""
    tmp = tmp_path_factory.mktemp(request.param)
    data = [AUGMENTED] if request.param == "augmented" else []
    run_in_process(tmp / "one", *RUN, *data)
    run_in_process(tmp / "two", *RUN, *data, "parallel=ddp", nproc=2)
    return {"one": tmp / "one", "two": tmp / "two", "data": data}


@pytest.mark.slow
@pytest.mark.parametrize("saved,resumed", [("two", 1), ("one", 2)])
def test_a_ddp_checkpoint_resumes_on_another_world_size_and_ends_as_the_uninterrupted_run(
    runs, tmp_path, saved, resumed
):
    out = resume(runs[saved], tmp_path / "resumed", "step_00000006.pt", *runs["data"], nproc=resumed)
    written = 2 if saved == "two" else 1
    assert f"written by {written} ranks, now {resumed} (the same global batch)" in out
    assert f"{resumed} ranks x 8 micro-batch x {4 // resumed} accumulation" in out
    assert_same_run(tmp_path / "resumed", runs["one" if resumed == 1 else "two"])
    assert_same_run(tmp_path / "resumed", runs["two" if resumed == 1 else "one"])  # and the other allocation's


@pytest.mark.slow
def test_an_fsdp_checkpoint_of_one_rank_resumes_on_two(tmp_path):
    # (Two ranks onto one: tests/test_fsdp.py.) One rank under torchrun: parallel=fsdp needs it.
    run_in_process(tmp_path / "one", *RUN, "parallel=fsdp", torchrun=True)
    run_in_process(tmp_path / "two", *RUN, "parallel=fsdp", nproc=2)
    out = resume(tmp_path / "one", tmp_path / "resumed", "step_00000006", "parallel=fsdp", nproc=2)
    assert "written by 1 ranks, now 2 (the same global batch)" in out
    assert_same_run(tmp_path / "resumed", tmp_path / "two")
    assert_same_run(tmp_path / "resumed", tmp_path / "one")


def test_another_global_batch_is_refused_naming_the_key_that_adapts_k():
    from trainkit.checkpoint import check_compatible
    from trainkit.config import ConfigError

    with pytest.raises(
        ConfigError,
        match=r"global_batch=32, this run has global_batch=16; .* set "
        r"accumulation.global_batch_size=32 \(K adapts\)",
    ):
        check_compatible({"global_batch": 32}, {"global_batch": 16})


def test_a_nan_setting_resumes_and_an_older_checkpoint_without_the_train_split_size_too():
    from trainkit.checkpoint import check_compatible
    from trainkit.config import ConfigError

    check_compatible({"model.fault": math.nan}, {"model.fault": math.nan})  # NaN is never == itself
    check_compatible({"seed": 0}, {"seed": 0, "data.train_samples": 1079})  # written before it was recorded
    with pytest.raises(ConfigError, match="data.train_samples=270, this run has data.train_samples=1079"):
        check_compatible({"data.train_samples": 270}, {"data.train_samples": 1079})
