"""A data set's own global order (`epoch_order`: a shard set's locality, a mixture's shares) and the agreement on a
remote read's failure (`reads_remotely`): the engine side of data=shards, on a toy data set (helpers.RemoteDigits)."""

import os

import pytest
import torch

from helpers import RemoteDigits, max_diff, run_distributed, run_in_process, weights
from trainkit.data.digits import digits
from trainkit.debug import Kept
from trainkit.errors import DataUnavailable
from trainkit.loading import TrainBatches, unavailable_line


def _global_windows(order, world_size: int, micro: int, steps: int, samples: int) -> list[list[int]]:
    """What each optimizer step trains on over all ranks: K = steps micro-batches of `micro` per rank."""
    per_rank = []
    for rank in range(world_size):
        batches = TrainBatches(samples, world_size, rank, micro, seed=5, global_order=order)
        batches.set_epoch(3)
        per_rank.append([indices for _, indices in batches])
    windows = []
    for w in range(-(-len(per_rank[0]) // steps)):
        windows.append(sorted(i for rank in per_rank for b in rank[w * steps : (w + 1) * steps] for i in b))
    return windows


def test_the_data_sets_order_is_the_global_order_at_any_world_size():
    """Global window s is positions [s·B, (s+1)·B) of the data set's order for W in 1, 2, 3 (B = W·K·b fixed at 12),
    each sample once an epoch; data.shuffle=false ignores it (the data set's own order)."""
    train = RemoteDigits(digits(0.2, 0.2)[0])
    samples = len(train)
    order = train.epoch_order(5, 3, 12)
    assert sorted(order.tolist()) == list(range(samples)) and not torch.equal(order, torch.arange(samples))
    expected = [sorted(order[s * 12 : (s + 1) * 12].tolist()) for s in range(-(-samples // 12))]
    make = lambda epoch: train.epoch_order(5, epoch, 12)  # noqa: E731  (what TrainWindows hands over)
    for world_size, micro, steps in ((1, 12, 1), (1, 4, 3), (2, 3, 2), (3, 2, 2), (3, 4, 1)):
        assert _global_windows(make, world_size, micro, steps, samples) == expected, (world_size, micro, steps)
    unshuffled = TrainBatches(samples, 2, 1, 4, seed=5, shuffle=False, global_order=make)
    assert unshuffled.order() == list(range(1, samples, 2))


def test_a_debug_subset_is_in_the_engines_order():
    """debug=limit's Kept forwards a data set's attributes, but not its order or rows (of the whole set)."""
    kept = Kept(RemoteDigits(digits(0.2, 0.2)[0]), range(40))
    assert kept.reads_remotely and not hasattr(kept, "epoch_order") and not hasattr(kept, "row")


def test_a_loader_workers_failure_is_its_one_line():
    """A worker's DataUnavailable reaches the main process with the worker's traceback as its text: the line is
    found in it."""
    loader = torch.utils.data.DataLoader(_Failing(), num_workers=1)
    with pytest.raises(DataUnavailable) as raised:
        next(iter(loader))
    assert "Traceback" in str(raised.value)
    assert unavailable_line(raised.value) == "s3://b/x.tar: unavailable after 2 tries (Connection refused)"
    assert unavailable_line(DataUnavailable("plain")) == "plain"


class _Failing(torch.utils.data.Dataset):
    def __len__(self):
        return 1

    def __getitem__(self, index):
        raise DataUnavailable("s3://b/x.tar: unavailable after 2 tries (Connection refused)")


def _status(rank: int, world_size: int, run_dir: str, overrides: tuple[str, ...], fail_after: int | None):
    from helpers import exit_status

    if fail_after is not None:
        os.environ.update(TRAINKIT_TEST_FAIL_AFTER=str(fail_after), TRAINKIT_TEST_FAIL_RANK="1")
    return exit_status(rank, world_size, run_dir, overrides)


RUN = ("data.splits._target_=helpers.remote_digits", "optim=sgd", "trainer.max_steps=8", "data.batch_size=8")
RUN += ("accumulation.steps=2", "trainer.eval_every=4", "logger=none", "parallel=ddp", "parallel.timeout_s=60")


def test_a_read_failing_on_one_rank_stops_every_rank_at_a_checkpoint_that_resumes(tmp_path, capfd):
    """Rank 1's store fails mid-run (after 48 samples): every rank writes the last step's checkpoint and exits 3
    with the one line (no hang in the step's collectives); the same command then resumes and ends on the
    uninterrupted run's weights, bit for bit. Without the agreement rank 0 waits in DDP's all-reduce (timeout)."""
    whole, failed = tmp_path / "whole", tmp_path / "failed"
    run_in_process(whole, *RUN, nproc=2)
    assert run_distributed(_status, 2, str(failed), RUN, 48, group=False, timeout=120) == [3, 3]
    lines = [line for line in capfd.readouterr().err.splitlines() if line]
    (written,) = (failed / "checkpoints").iterdir()  # the one checkpoint: of the last step before the failure
    step = int(written.name.removeprefix("step_").removesuffix(".pt"))
    assert 1 <= step < 8 and not (failed / "model.pt").exists()
    assert lines == [
        "error: s3://bucket/digits/train-000003.tar: unavailable after 2 tries (Connection refused); "
        f"checkpoint of step {step} written: the same command resumes once it is back"
    ]
    run_in_process(failed, *RUN, "checkpoint.resume=auto", nproc=2)
    assert max_diff(weights(failed), weights(whole)) == 0.0
