"""Datasets and samplers: the train split is sharded by DistributedSampler, evaluation by
contiguous shards that never pad or repeat a sample."""

import itertools

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, TensorDataset

from trainkit.config import ConfigError
from trainkit.dist import Dist


def digits(val_fraction: float = 0.2) -> tuple[Dataset, Dataset]:
    """scikit-learn's bundled 8x8 digits, scaled to [0, 1]; a fixed split, whatever the seed."""
    from sklearn.datasets import load_digits

    images, targets = load_digits(return_X_y=True)
    order = np.random.RandomState(0).permutation(len(targets))
    n_val = round(len(targets) * val_fraction)
    x = torch.tensor(images[order] / 16.0, dtype=torch.float32).view(-1, 1, 8, 8)
    y = torch.tensor(targets[order], dtype=torch.long)
    return TensorDataset(x[n_val:], y[n_val:]), TensorDataset(x[:n_val], y[:n_val])


def fake(train_size: int, val_size: int, shape, num_classes: int) -> tuple[Dataset, Dataset]:
    """torchvision FakeData; the validation images are other images than the training ones."""
    from torchvision import datasets, transforms

    def split(size, offset):
        return datasets.FakeData(size, tuple(shape), num_classes, transforms.ToTensor(), random_offset=offset)

    return split(train_size, 0), split(val_size, train_size)


_NORMALIZE = {"MNIST": ((0.1307,), (0.3081,)),
              "CIFAR10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))}


def torchvision_splits(name: str, root: str, download: bool) -> tuple[Dataset, Dataset]:
    """A torchvision classification set (MNIST, CIFAR10) read from `root`."""
    from torchvision import datasets, transforms

    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize(*_NORMALIZE[name])])
    try:
        return tuple(getattr(datasets, name)(root, train=train, download=download, transform=transform)
                     for train in (True, False))
    except RuntimeError:  # torchvision: "Dataset not found or corrupted. You can use download=True..."
        raise ConfigError(f"data.root={root} holds no {name} data: put the files there, point data.root "
                          f"(or $TRAINKIT_DATA) at them, or pass data.download=true") from None


def shard_bounds(num_samples: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, end) of rank's contiguous shard; shard sizes differ by at most one."""
    base, extra = divmod(num_samples, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


class ContiguousSampler(Sampler[int]):
    """Rank r reads the contiguous block [start_r, end_r): every sample exactly once over all
    ranks, no padding duplicates (DistributedSampler pads and strides, which double-counts
    samples in metrics), and per-rank results concatenate back into dataset order."""

    def __init__(self, num_samples: int, world_size: int, rank: int):
        self.start, self.end = shard_bounds(num_samples, world_size, rank)

    def __iter__(self):
        return iter(range(self.start, self.end))

    def __len__(self) -> int:
        return self.end - self.start


class ResumableSampler(DistributedSampler):
    """DistributedSampler that can start an epoch part-way (`start`: local samples to skip), so
    a mid-epoch resume draws exactly the batches the uninterrupted run would have drawn, without
    loading the skipped ones."""

    start = 0

    def __iter__(self):
        return itertools.islice(super().__iter__(), self.start, None)

    def __len__(self) -> int:
        return self.num_samples - self.start


def train_loader(dataset: Dataset, d: Dist, batch_size: int, num_workers: int, seed: int):
    """The train loader and its DistributedSampler (num_replicas=1 in single mode, so every mode
    sees the same global batches). The sampler pads to a multiple of the world size; the loop
    gives padded samples zero weight (see accumulate.EpochLayout). Call sampler.set_epoch."""
    sampler = ResumableSampler(dataset, num_replicas=d.world_size, rank=d.rank, shuffle=True,
                                 seed=seed, drop_last=False)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=num_workers,
                        generator=torch.Generator().manual_seed(seed),  # not the global RNG
                        pin_memory=d.device.type == "cuda", persistent_workers=num_workers > 0)
    return loader, sampler


def eval_loader(dataset: Dataset, d: Dist, batch_size: int, num_workers: int) -> DataLoader:
    sampler = ContiguousSampler(len(dataset), d.world_size, d.rank)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=num_workers,
                      pin_memory=d.device.type == "cuda")
