"""The epoch layout: optimizer step s trains on global positions [s*G, (s+1)*G) for every
(W, K, b) with the same G, padding repeats are never loaded, and the step count per epoch is right."""

import math

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch.utils.data import TensorDataset

from helpers import compose_cfg, rows, run_in_process
from trainkit.accumulate import EpochLayout, syncs_now
from trainkit.checkpoint import check_compatible, run_identity
from trainkit.data.digits import digits
from trainkit.dist import Dist
from trainkit.errors import ConfigError
from trainkit.loading import TrainLoader, TrainWindows
from trainkit.rng import seed_all


def windows_as_trained(num_samples, world_size, batch_size, steps, drop_last, epoch=0, seed=0, shuffle=True):
    """Run the real train loader (TrainLoader: DistributedSampler's shard less its padding) on
    every rank and group its micro-batches the way train.py does; returns per optimizer step
    the sorted sample indices trained and the layout's count of real samples."""
    dataset = TensorDataset(torch.arange(num_samples))
    layout = EpochLayout(num_samples, world_size, batch_size, steps)
    per_rank = []
    for rank in range(world_size):
        d = Dist(rank, rank, world_size, torch.device("cpu"))
        loader = TrainLoader(dataset, d, batch_size, 0, seed, layout.micro_batches, shuffle=shuffle)
        per_rank.append([batch.tolist() for (batch,) in loader.epoch(epoch)])
    assert {len(batches) for batches in per_rank} == {layout.micro_batches}, "ranks must run the same micro-steps"
    result = []
    for window in range(layout.windows(drop_last)):
        micro = range(window * steps, window * steps + layout.micro_steps(window))
        trained = [i for batches in per_rank for j in micro for i in batches[j]]
        result.append((sorted(trained), layout.window_samples(window)))
    return result


@pytest.mark.parametrize("num_samples", [1, 7, 31, 32, 33, 100, 101])
@pytest.mark.parametrize("drop_last", [False, True])
def test_same_global_batches_for_every_world_size_and_accumulation(num_samples, drop_last):
    reference = windows_as_trained(num_samples, 1, 12, 1, drop_last)  # one process, batch G = 12
    for world_size, steps, batch in [(2, 2, 3), (3, 4, 1), (4, 1, 3), (2, 3, 2), (6, 2, 1)]:
        assert world_size * steps * batch == 12
        got = windows_as_trained(num_samples, world_size, batch, steps, drop_last)
        assert got == reference, (world_size, steps, batch)
    for trained, real in reference:
        assert len(trained) == real and len(set(trained)) == real  # no padding repeat, no duplicate
    covered = sorted(i for trained, _ in reference for i in trained)
    if drop_last:  # only whole global batches: each sample at most once, the tail dropped
        assert len(reference) == num_samples // 12 and all(real == 12 for _, real in reference)
        assert len(covered) == len(set(covered)) == 12 * (num_samples // 12)
    else:  # every sample exactly once per epoch
        assert covered == list(range(num_samples))


@pytest.mark.parametrize("batches,steps,epochs", [(45, 1, 1), (45, 2, 2), (15, 4, 2), (8, 8, 3), (9, 8, 1)])
def test_steps_per_epoch_is_ceil_of_batches_over_k(batches, steps, epochs):
    layout = EpochLayout(num_samples=batches * 10, world_size=1, batch_size=10, steps=steps)
    assert layout.micro_batches == batches
    assert epochs * layout.windows(drop_last=False) == epochs * math.ceil(batches / steps)
    micro = [layout.micro_steps(w) for w in range(layout.windows(drop_last=False))]
    assert sum(micro) == batches and all(0 < m <= steps for m in micro)


def test_short_last_window_counts_only_its_real_samples():
    layout = EpochLayout(num_samples=37, world_size=2, batch_size=4, steps=2)
    # 19 local samples per rank (one padding on rank 1), 5 micro-batches, windows of 2.
    assert layout.windows(drop_last=False) == 3
    assert [layout.micro_steps(w) for w in range(3)] == [2, 2, 1]
    assert [layout.window_samples(w) for w in range(3)] == [16, 16, 5]
    sizes = [
        [
            len(b)
            for (b,) in TrainLoader(
                TensorDataset(torch.arange(37)), Dist(r, r, 2, torch.device("cpu")), 4, 0, 0, layout.micro_batches
            ).epoch(0)
        ]
        for r in range(2)
    ]
    assert sizes == [[4, 4, 4, 4, 3], [4, 4, 4, 4, 2]]  # rank 1's padding repeat is not loaded


def test_a_rank_whose_last_micro_batch_is_padding_runs_an_empty_one():
    # 5 samples on 2 ranks, batch 1: rank 1's third position is padding.
    layout = EpochLayout(num_samples=5, world_size=2, batch_size=1, steps=2)
    loader = TrainLoader(
        TensorDataset(torch.arange(5.0).view(5, 1)), Dist(1, 1, 2, torch.device("cpu")), 1, 0, 0, layout.micro_batches
    )
    shapes = [tuple(x.shape) for (x,) in loader.epoch(0)]
    assert shapes == [(1, 1), (1, 1), (0, 1)]
    assert [tuple(x.shape) for (x,) in loader.epoch(1, start=2)] == [(0, 1)]  # also when resumed there


def test_syncs_now():
    assert [syncs_now("no_sync", k, 4) for k in range(4)] == [False, False, False, True]
    assert all(syncs_now("sync_each_batch", k, 4) for k in range(4))
    assert syncs_now("no_sync", 0, 1)


def test_set_epoch_changes_order_and_shards_are_disjoint():
    orders = {epoch: windows_as_trained(101, 2, 1, 1, drop_last=False, epoch=epoch) for epoch in (0, 1)}
    for windows in orders.values():
        assert sorted(i for trained, _ in windows for i in trained) == list(range(101))
    assert orders[0] != orders[1]


@pytest.mark.parametrize("num_samples", [7, 33])
def test_data_shuffle_false_trains_the_data_set_in_order_at_any_allocation(num_samples):
    """data.shuffle=false: window s is samples s·G .. (s+1)·G-1 at every (W, K, b) and in every epoch."""
    in_order = [
        (list(range(s * 12, min((s + 1) * 12, num_samples))), min(12, num_samples - s * 12))
        for s in range(math.ceil(num_samples / 12))
    ]
    for world_size, steps, batch in [(1, 1, 12), (2, 2, 3), (3, 4, 1)]:
        for epoch in (0, 1):
            got = windows_as_trained(num_samples, world_size, batch, steps, False, epoch, shuffle=False)
            assert got == in_order, (world_size, steps, batch, epoch)


def test_a_resume_keeps_the_order_it_trained_in():
    """data.shuffle is in the run's identity; a checkpoint from before it was recorded trained shuffled."""

    train = TensorDataset(torch.arange(10))
    shuffled, in_order = (run_identity(compose_cfg(f"data.shuffle={s}"), 32, train) for s in ("true", "false"))
    older = {k: v for k, v in shuffled.items() if k != "data.shuffle"}
    check_compatible(older, shuffled)
    for saved, current in ((older, in_order), (in_order, shuffled)):
        with pytest.raises(ConfigError, match="written with data.shuffle=(True|False), this run has data.shuffle="):
            check_compatible(saved, current)


def test_train_py_takes_data_shuffle(tmp_path):
    """The first step's loss is that of the data set's first global batch, at the initial weights."""
    run_in_process(tmp_path, "data.shuffle=false", "trainer.max_steps=1", "trainer.log_every=1")
    seed_all(0)  # train.py's seed, before it builds the model
    model = instantiate(compose_cfg().model)
    x, y = digits()[0].tensors
    expected = torch.nn.functional.cross_entropy(model(x[:32]), y[:32]).item()
    assert rows(tmp_path)[0]["loss"] == pytest.approx(expected, rel=1e-6)


class Rows(torch.utils.data.Dataset):
    """A TensorDataset in all but type: TrainLoader loads it through its DataLoader."""

    draws_random = False

    def __init__(self, *tensors: torch.Tensor):
        self.tensors = tensors

    def __len__(self) -> int:
        return len(self.tensors[0])

    def __getitem__(self, index):
        return tuple(t[index] for t in self.tensors)


@pytest.mark.parametrize("shuffle", [True, False])
def test_the_in_memory_fast_path_loads_what_the_dataloader_loads(shuffle):
    """TrainLoader's fast path (tensors: one gather per epoch, views) yields the DataLoader path's micro-batches:
    the same samples in the same order on every rank, short and empty micro-batches alike, from any start."""
    x, y = torch.randn(37, 3), torch.arange(37)
    for world_size, batch_size in [(1, 4), (2, 4), (3, 5), (4, 10)]:
        micro_batches = EpochLayout(37, world_size, batch_size, 2).micro_batches + 1  # one empty one at the end
        for rank in range(world_size):
            d = Dist(rank, rank, world_size, torch.device("cpu"))
            fast, slow = (
                TrainLoader(data, d, batch_size, 0, 3, micro_batches, shuffle=shuffle)
                for data in (TensorDataset(x, y), Rows(x, y))
            )
            assert fast.in_memory and not slow.in_memory
            for epoch, start in [(0, 0), (1, 0), (1, 2), (2, micro_batches - 1)]:
                got, expected = list(fast.epoch(epoch, start)), list(slow.epoch(epoch, start))
                assert len(got) == len(expected) == micro_batches - start
                for (gx, gy), (ex, ey) in zip(got, expected, strict=True):
                    assert torch.equal(gx, ex) and torch.equal(gy, ey), (world_size, rank, epoch, start)


def test_train_windows_count_each_windows_real_samples_and_say_when_they_are_on_the_device():
    """TrainWindows' per-window figures, read every step, are the windows' own: `samples[w]` the real samples that
    window w's micro-batches hold on all ranks together (the loss normalisation), `fetch(w)` its micro-batches. And
    `on_device` (train.py then moves nothing) holds exactly where the micro-batches are on the device already: the
    device path's (taken there by index) and, on a device that is not the CPU, a DataLoader's copied ahead; on the
    CPU a DataLoader's are where it made them ("meta" stands for the other device)."""
    x, y = torch.randn(37, 3), torch.arange(37)
    for world_size, batch_size, steps in [(1, 4, 1), (1, 4, 3), (2, 4, 2), (3, 5, 2)]:
        per_rank = []
        for rank in range(world_size):
            for device, dataset, on_device in [
                ("meta", TensorDataset(x, y), True),
                ("meta", Rows(x, y), True),
                ("cpu", Rows(x, y), False),
            ]:
                d, size = Dist(rank, rank, world_size, torch.device(device)), (batch_size, steps)
                windows = TrainWindows(dataset, d, OmegaConf.create({"num_workers": 0}), 3, lambda size=size: size)
                windows.epoch(0)
                fetched = [windows.fetch(w) for w in range(len(windows.samples))]
                assert windows.on_device is on_device and windows.loader.in_memory is (type(dataset) is TensorDataset)
                moved = [t.device.type == "meta" for micro in fetched for b in micro for t in b]
                assert all(on_meta is (device == "meta") for on_meta in moved)
            per_rank.append([sum(len(b[1]) for b in micro) for micro in fetched])
        assert [sum(counts) for counts in zip(*per_rank, strict=True)] == windows.samples, (world_size, batch_size)
        assert sum(windows.samples) == 37
