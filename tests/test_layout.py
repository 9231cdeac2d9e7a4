"""The epoch layout: optimizer step s trains on global positions [s*G, (s+1)*G) for every
(W, K, b) with the same G, padding weighs 0, and the step count per epoch is right."""
import itertools
import math

import pytest
import torch
from torch.utils.data import DistributedSampler

from trainkit.accumulate import EpochLayout, syncs_now


def windows_as_trained(num_samples, world_size, batch_size, steps, drop_last, epoch=0, seed=0):
    """Run the real DistributedSampler on every rank and group its micro-batches the way
    train.py does; returns per optimizer step the multiset of (sample index, weight) and the
    layout's count of real samples."""
    dataset = range(num_samples)
    per_rank = []
    for rank in range(world_size):
        sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
        sampler.set_epoch(epoch)
        indices = list(sampler)
        per_rank.append([indices[i:i + batch_size] for i in range(0, len(indices), batch_size)])
    assert len({len(batches) for batches in per_rank}) == 1, "ranks must run the same micro-steps"
    layouts = [EpochLayout(num_samples, world_size, r, batch_size, steps) for r in range(world_size)]
    result = []
    for window in range(layouts[0].windows(drop_last)):
        trained = []
        for rank, layout in enumerate(layouts):
            for k in range(layout.micro_steps(window)):
                micro = window * steps + k
                batch = per_rank[rank][micro]
                weights = layout.sample_weights(micro, len(batch))
                weights = [1.0] * len(batch) if weights is None else weights.tolist()
                trained += [(i, w) for i, w in zip(batch, weights) if w]
        result.append((sorted(trained), layouts[0].window_samples(window)))
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
        assert len(trained) == real and len({i for i, _ in trained}) == real  # no duplicate trained
    covered = sorted(i for trained, _ in reference for i, _ in trained)
    if drop_last:  # only whole global batches: each sample at most once, the tail dropped
        assert len(reference) == num_samples // 12 and all(real == 12 for _, real in reference)
        assert len(covered) == len(set(covered)) == 12 * (num_samples // 12)
    else:  # every sample exactly once per epoch
        assert covered == list(range(num_samples))


@pytest.mark.parametrize("batches,steps,epochs", [(45, 1, 1), (45, 2, 2), (15, 4, 2), (8, 8, 3), (9, 8, 1)])
def test_steps_per_epoch_is_ceil_of_batches_over_k(batches, steps, epochs):
    layout = EpochLayout(num_samples=batches * 10, world_size=1, rank=0, batch_size=10, steps=steps)
    assert layout.micro_batches == batches
    assert epochs * layout.windows(drop_last=False) == epochs * math.ceil(batches / steps)
    micro = [layout.micro_steps(w) for w in range(layout.windows(drop_last=False))]
    assert sum(micro) == batches and all(0 < m <= steps for m in micro)


def test_short_last_window_counts_only_its_real_samples():
    layout = EpochLayout(num_samples=37, world_size=2, rank=1, batch_size=4, steps=2)
    # 19 local samples per rank (one padding on rank 1), 5 micro-batches, windows of 2.
    assert layout.windows(drop_last=False) == 3
    assert [layout.micro_steps(w) for w in range(3)] == [2, 2, 1]
    assert [layout.window_samples(w) for w in range(3)] == [16, 16, 5]
    assert layout.sample_weights(3, 4) is None
    assert layout.sample_weights(4, 3).tolist() == [1.0, 1.0, 0.0]  # positions 33, 35, 37 >= 37


def test_syncs_now():
    assert [syncs_now("no_sync", k, 4) for k in range(4)] == [False, False, False, True]
    assert all(syncs_now("sync_each_batch", k, 4) for k in range(4))
    assert syncs_now("no_sync", 0, 1)


def test_set_epoch_changes_order_and_shards_are_disjoint():
    dataset = range(101)
    orders = {}
    for epoch in (0, 1):
        shards = []
        for rank in range(2):
            sampler = DistributedSampler(dataset, num_replicas=2, rank=rank, seed=0)
            sampler.set_epoch(epoch)
            shards.append(list(sampler))
        layout = [EpochLayout(101, 2, r, 1, 1) for r in range(2)]
        real = [[i for j, i in enumerate(s) if layout[r].sample_weights(j, 1) is None
                 or layout[r].sample_weights(j, 1).item()] for r, s in enumerate(shards)]
        assert not set(real[0]) & set(real[1])
        assert sorted(real[0] + real[1]) == list(dataset)
        orders[epoch] = shards
    assert orders[0] != orders[1]
