"""Datasets and samplers: the train split is sharded by DistributedSampler, evaluation by
contiguous shards that never pad or repeat a sample."""

import copy
import importlib.util
import itertools
import math
from collections.abc import Iterable
from pathlib import Path
from typing import cast

import numpy as np
import torch
from omegaconf import OmegaConf
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, Subset, TensorDataset

from trainkit.batch import collate, emptied
from trainkit.dist import Dist
from trainkit.errors import ConfigError
from trainkit.rng import sample_seed, seed_all


def draws_random(dataset: Dataset) -> bool:
    """Whether loading a sample of `dataset` may draw from python's, numpy's or torch's global RNG
    (a random augmentation): its `draws_random` attribute ("torch": from torch's generator alone), and True
    for a data set without one (a user's data set may draw). SeededBatches seeds the generators before each
    sample only where it may."""
    return bool(getattr(dataset, "draws_random", True))


class InMemory(TensorDataset):
    """A TensorDataset that loads a batch with one indexing per tensor (DataLoader calls
    `__getitems__`) instead of one per sample: for the default job that was a fifth of a step."""

    draws_random = False  # tensors as they are: nothing to seed, and TrainLoader's fast path

    def __getitems__(self, indices: list[int]) -> list:
        return list(zip(*(tensor[indices] for tensor in self.tensors), strict=True))


def digits(val_fraction: float = 0.2, test_fraction: float = 0.2) -> tuple[Dataset, Dataset, Dataset]:
    """scikit-learn's bundled 8x8 digits, scaled to [0, 1]: (train, val, test), a fixed split whatever
    the seed. One fixed permutation: val is its first `val_fraction` (the same images as before the
    test split existed), test the next `test_fraction`, train the rest; never overlapping."""
    images, targets = _bundled_digits()
    n_val, n_test = _held_out(len(targets), val_fraction, test_fraction)
    order = np.random.RandomState(0).permutation(len(targets))
    x = torch.tensor(images[order] / 16.0, dtype=torch.float32).view(-1, 1, 8, 8)
    y = torch.tensor(targets[order], dtype=torch.long)
    held = n_val + n_test
    return InMemory(x[held:], y[held:]), InMemory(x[:n_val], y[:n_val]), InMemory(x[n_val:held], y[n_val:held])


def _bundled_digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits.csv.gz read as its load_digits reads it, without importing scikit-learn: that import
    cost 0.8 s of CPU at every start of the default job (scripts/bench_startup.py). load_digits itself where
    the file is not where scikit-learn keeps it."""
    spec = importlib.util.find_spec("sklearn")
    folders = spec.submodule_search_locations if spec is not None else None
    path = Path(folders[0]) / "datasets" / "data" / "digits.csv.gz" if folders else None
    if path is None or not path.is_file():
        from sklearn.datasets import load_digits

        return load_digits(return_X_y=True)
    table = np.loadtxt(path, delimiter=",")
    return table[:, :-1], table[:, -1].astype(int)


def diabetes(val_fraction: float = 0.2, test_fraction: float = 0.2) -> tuple[Dataset, Dataset, Dataset]:
    """scikit-learn's bundled diabetes data (442 patients, 10 features, a disease-progression score one
    year later): (train, val, test) by one fixed permutation as digits', for task=regression. Features and
    target are standardised with the training split's mean and standard deviation (so val/rmse is in
    standard deviations of the score: 1.0 is the mean's, and val/r2 is unchanged by the scaling)."""
    from sklearn.datasets import load_diabetes

    features, target = load_diabetes(return_X_y=True)
    n_val, n_test = _held_out(len(target), val_fraction, test_fraction)
    order = np.random.RandomState(0).permutation(len(target))
    x, y = torch.tensor(features[order]), torch.tensor(target[order])
    held = n_val + n_test
    x = (x - x[held:].mean(0)) / x[held:].std(0)
    y = (y - y[held:].mean()) / y[held:].std()
    x, y = x.float(), y.float()
    return InMemory(x[held:], y[held:]), InMemory(x[:n_val], y[:n_val]), InMemory(x[n_val:held], y[n_val:held])


def _held_out(samples: int, val_fraction: float, test_fraction: float) -> tuple[int, int]:
    """(val, test) sizes of data.splits' fractions, refused in one line where they leave no training sample."""
    for key, value in (("val_fraction", val_fraction), ("test_fraction", test_fraction)):
        if not 0 <= value < 1:
            raise ConfigError(f"data.splits.{key}={value} must be >= 0 and < 1")
    n_val, n_test = round(samples * val_fraction), round(samples * test_fraction)
    if n_val + n_test >= samples:
        raise ConfigError(
            f"data.splits.val_fraction={val_fraction} + test_fraction={test_fraction} leave no training samples"
        )
    return n_val, n_test


def fake(train_size: int, val_size: int, shape, num_classes: int, test_size: int = 0) -> tuple[Dataset, ...]:
    """torchvision FakeData: (train, val, test), each other images (FakeData seeds image i from
    i + random_offset: the offsets 0, train_size and train_size + val_size never overlap)."""
    from torchvision import datasets, transforms

    def split(size, offset):
        dataset = datasets.FakeData(size, tuple(shape), num_classes, transforms.ToTensor(), random_offset=offset)
        dataset.draws_random = False  # it seeds (index + offset) itself and puts the state back
        return dataset

    return split(train_size, 0), split(val_size, train_size), split(test_size, train_size + val_size)


_NORMALIZE = {"MNIST": ((0.1307,), (0.3081,)), "CIFAR10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))}


def _augmentation(name: str) -> list:
    """The training split's random augmentation (data.augment=true). torchvision's transforms draw
    from torch's global RNG, which SeededBatches seeds per sample from (seed, epoch, sample index):
    the same draws at any world size, micro-batch and worker, and after a resume."""
    from torchvision import transforms

    if name == "CIFAR10":  # the standard CIFAR recipe: pad 4 and crop back to 32, mirror half the images
        return [transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip()]
    raise ConfigError(f"data.augment=true: no augmentation is defined for {name} (only CIFAR10)")


def carve(num_samples: int, val_fraction: float) -> tuple[list[int], list[int]]:
    """(train, val) indices of an official training set: val is the first `val_fraction` of a fixed
    permutation (numpy's RandomState(0), whatever the run's seed), train the rest, each in file order."""
    if not 0 <= val_fraction < 1:
        raise ConfigError(f"data.splits.val_fraction={val_fraction} must be >= 0 and < 1")
    order = np.random.RandomState(0).permutation(num_samples)
    n_val = round(num_samples * val_fraction)
    return sorted(order[n_val:].tolist()), sorted(order[:n_val].tolist())


def torchvision_splits(
    name: str, root: str, download: bool, augment: bool = False, val_fraction: float = 0.1
) -> tuple[Dataset, Dataset, Dataset]:
    """A torchvision classification set (MNIST, CIFAR10) read from `root`: (train, val, test). test is
    the official test set; val is carved from the official training set (`carve`: a fixed 10 %), so
    model selection never sees the test set. `augment`: random augmentation of the training split
    (val and test are never augmented)."""
    from torchvision import datasets, transforms

    tensor = [transforms.ToTensor(), transforms.Normalize(*_NORMALIZE[name])]
    train_transform = transforms.Compose((_augmentation(name) if augment else []) + tensor)
    plain = transforms.Compose(tensor)
    try:
        train, test = (
            getattr(datasets, name)(root, train=is_train, download=download, transform=transform)
            for is_train, transform in ((True, train_transform), (False, plain))
        )
    except RuntimeError:  # torchvision: "Dataset not found or corrupted. You can use download=True..."
        raise ConfigError(
            f"data.root={root} holds no {name} data: put the files there, point data.root "
            f"(or $TRAINKIT_DATA) at them, or pass data.download=true"
        ) from None
    carved = copy.copy(train)  # the same images in memory, read without the augmentation
    carved.transform = plain
    train_idx, val_idx = carve(len(train), val_fraction)
    splits = (Subset(train, train_idx), Subset(carved, val_idx), test)
    for split, draws in zip(splits, (augment, False, False), strict=True):
        split.draws_random = draws  # without augmentation: no per-sample seeding to pay
    return splits


def micro_batch(global_batch: int, steps: int | None, world_size: int | str = 1) -> int:
    """${micro_batch:<global batch>,<K>,<world size>}: the per-device batch that keeps the global
    batch fixed whatever K (null: 1) and the world size (conf/experiment/accumulation_sweep.yaml)."""
    per_step = int(steps or 1) * int(world_size)
    if int(global_batch) % per_step:
        raise ConfigError(
            f"micro_batch: the global batch {global_batch} is not a multiple of K x world size = {steps} x {world_size}"
        )
    return int(global_batch) // per_step


# Registered at import: train.py and predict.py import this module before they read the config.
OmegaConf.register_new_resolver("micro_batch", micro_batch, replace=True)


def collate_fn(dataset: Dataset):
    """The data set's own `collate_fn` (e.g. padding sequences to the batch's longest), else
    torch's default (and dataclass samples field by field: trainkit.batch.collate)."""
    return getattr(dataset, "collate_fn", collate)


def length(dataset: Dataset) -> int:
    """len() of a map-style data set (torch's Dataset type declares no __len__)."""
    return len(dataset)  # type: ignore[arg-type]


def shard_bounds(num_samples: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, end) of rank's contiguous shard; shard sizes differ by at most one."""
    base, extra = divmod(num_samples, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


class ContiguousSampler(Sampler[int]):
    """Rank r reads the contiguous block [start_r, end_r): every sample exactly once over all
    ranks, no padding duplicates (DistributedSampler pads and strides, which double-counts
    samples in metrics), and per-rank results concatenate back into dataset order."""

    def __init__(self, num_samples: int, world_size: int, rank: int, skip: int = 0):
        self.start, self.end = shard_bounds(num_samples, world_size, rank)
        self.start = min(self.start + skip, self.end)  # skip: the block's first samples (done already)

    def __iter__(self):
        return iter(range(self.start, self.end))

    def __len__(self) -> int:
        return self.end - self.start


class TrainBatches(Sampler[tuple[int, list[int]]]):
    """This rank's micro-batches of one epoch: DistributedSampler's shard of the epoch's
    permutation without its padding repeats, cut into micro-batches of `(epoch, indices)`.

    DistributedSampler pads the epoch to a multiple of the world size by repeating samples at
    the end of some ranks' shards. They are cut off here, so they never reach a forward: neither
    the loss nor BatchNorm statistics see them, and W ranks train exactly what one process does.
    Such a rank's last micro-batch is one sample short, or missing (the loop then runs an empty
    batch: every rank must run the same micro-steps). `start` skips micro-batches (a mid-epoch
    resume) without loading them. The epoch goes with the indices: SeededBatches seeds the RNGs
    from (seed, epoch, sample index) before loading each sample of a data set that draws.
    """

    def __init__(self, num_samples: int, world_size: int, rank: int, batch_size: int, seed: int, shuffle: bool = True):
        """shuffle=False (data.shuffle): the epoch in the data set's order, global window s = samples s·B..(s+1)·B-1."""
        indices = range(num_samples)  # DistributedSampler only takes the len() of its "dataset"
        self.shard: DistributedSampler = DistributedSampler(
            indices,  # type: ignore[arg-type]
            num_replicas=world_size,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=False,
        )
        real = len(range(rank, num_samples, world_size))  # this rank's shard less the padding
        self.real, self.batches = real, math.ceil(real / batch_size)
        self.batch_size, self.epoch, self.start = batch_size, 0, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.shard.set_epoch(epoch)

    def order(self) -> list[int]:
        """This rank's samples of the epoch, in order, without the padding."""
        return list(itertools.islice(self.shard, self.real))

    def order_tensor(self) -> torch.Tensor:
        """order() as a tensor, computed as DistributedSampler does without its Python lists (~0.1 ms an
        epoch): the permutation of (seed + epoch), this rank's every W-th position from `rank` on (the
        padding repeats are appended past position N-1, so they are never among them)."""
        shard = self.shard
        if not shard.shuffle:
            return torch.arange(shard.rank, len(shard.dataset), shard.num_replicas)  # type: ignore[arg-type]
        generator = torch.Generator().manual_seed(shard.seed + shard.epoch)
        return torch.randperm(len(shard.dataset), generator=generator)[shard.rank :: shard.num_replicas]  # type: ignore[arg-type]

    def __iter__(self):
        indices = self.order()
        for j in range(self.start, self.batches):
            yield self.epoch, indices[j * self.batch_size : (j + 1) * self.batch_size]

    def __len__(self) -> int:
        return max(0, self.batches - self.start)


class SeededBatches(Dataset):
    """`dataset`, loaded a micro-batch at a time (TrainBatches' `(epoch, indices)`); for a data set
    that draws (`draws_random`), python's, numpy's and torch's CPU generators are seeded from
    (seed, epoch, sample index) before each sample.

    What a random augmentation draws for a sample is then a function of that sample alone (rule 15):
    not of the rank, the micro-batch or the loader worker that loads it (workers are persistent and
    their RNG streams are in no checkpoint), so W ranks x K micro-batches train on the samples one
    process does, and a resume, on any world size, draws what the uninterrupted run drew. Such a
    data set is loaded a sample at a time (a `__getitems__` would draw for the batch at once). In the
    main process (num_workers=0) the seeding re-seeds training's stream too: train.py re-seeds it
    per optimizer step after the batches are fetched (rng.seed_step), so dropout does not depend on
    where they were loaded. Nothing is saved and put back: that cost more than the rest of a small
    model's step (numpy's state alone ~60 us). The seeding costs ~8 us a sample (a CIFAR crop, flip
    and normalise ~120 us): a data set that draws nothing says so (`draws_random = False`) and pays nothing."""

    def __init__(self, dataset: Dataset, seed: int):
        self.dataset, self.seed, self.draws = dataset, seed, draws_random(dataset)
        # draws_random = "torch": a data set whose draws come from torch's generator alone (torchvision's
        # transforms) has only that one seeded: re-seeding numpy's and python's cost ~25 us a sample
        # more, 6 % of loading a 64x64 JPEG (scripts/bench_data.py --images).
        self.torch_only = getattr(dataset, "draws_random", True) == "torch"
        # draws_random = "seed": the data set draws from the sample's seed itself, `dataset.seeded(index, seed)`
        # (data=tokens' block offsets): no generator is seeded, which cost 50 % of loading such a block.
        self.from_seed = getattr(dataset, "draws_random", True) == "seed"

    def __len__(self) -> int:
        return length(self.dataset)

    def __getitem__(self, index):
        return self.dataset[index]

    def __getitems__(self, batch: tuple[int, list[int]]) -> list:
        epoch, indices = batch
        if not self.draws:  # nothing random: the data set's own batch loading, if it has one
            load_batch = getattr(self.dataset, "__getitems__", None)
            return load_batch(indices) if load_batch is not None else [self.dataset[i] for i in indices]
        samples = []
        for i in indices:
            # On the CPU: CUDA's streams (dropout on a GPU) go on untouched.
            if self.from_seed:
                samples.append(self.dataset.seeded(i, sample_seed(self.seed, epoch, i)))  # type: ignore[attr-defined]
                continue
            if self.torch_only:
                torch.default_generator.manual_seed(sample_seed(self.seed, epoch, i))
            else:
                seed_all(sample_seed(self.seed, epoch, i), cuda=False)
            samples.append(self.dataset[i])
        return samples


class TrainLoader:
    """The train loader: this rank's micro-batches (TrainBatches) and then, up to `micro_batches`
    per epoch, empty ones (the rank whose last micro-batch held only padding still runs it).

    An InMemory data set (tensors, nothing random to draw) or a plain TensorDataset skips the
    DataLoader (its machinery costs ~0.1 ms a batch, a tenth of the default job's step): its tensors go
    to the device once, each epoch gathers this rank's order once per tensor (one more copy of the
    shard), and the micro-batches are views of that (~1 us a batch; gathering each batch cost ~50 us
    of the default job's ~0.8 ms step). Any other data set goes through a DataLoader over
    SeededBatches (per-sample seeds where the data set draws)."""

    def __init__(
        self,
        dataset: Dataset,
        d: Dist,
        batch_size: int,
        num_workers: int,
        seed: int,
        micro_batches: int,
        pin_memory: bool = True,
        prefetch_factor: int | None = None,
        shuffle: bool = True,
    ):
        self.sampler = TrainBatches(length(dataset), d.world_size, d.rank, batch_size, seed, shuffle)
        self.collate = collate_fn(dataset)
        self.loader = DataLoader(
            SeededBatches(dataset, seed),
            batch_sampler=self.sampler,
            collate_fn=self.collate,
            num_workers=num_workers,
            generator=torch.Generator(),  # not the global RNG (it seeds the workers)
            pin_memory=pin_memory and d.device.type == "cuda",  # pinned memory speeds up copies to a GPU only
            prefetch_factor=prefetch_factor if num_workers else None,  # batches ahead per worker (null: torch's 2)
            persistent_workers=num_workers > 0,
        )
        self.dataset, self.seed, self.micro_batches, self.batch_size = dataset, seed, micro_batches, batch_size
        # A TensorDataset's items are its tensors' rows: nothing to draw, unless a subclass says otherwise.
        tensors = isinstance(dataset, InMemory) or type(dataset) is TensorDataset
        self.tensors = list(cast(TensorDataset, dataset).tensors) if tensors and not num_workers else []
        self.device = d.device  # where the tensors go at the first epoch (building a loader touches no device)
        self.in_memory = bool(self.tensors)

    def epoch(self, epoch: int, start: int = 0):
        """An iterator over the micro-batches of `epoch` from micro-batch `start` on. What it
        yields depends on (seed, epoch, start) alone, so a resumed run needs no loader state."""
        self.sampler.set_epoch(epoch)  # a new permutation every epoch, the same on every rank
        self.sampler.start = start
        batches: Iterable = ()
        if self.in_memory and start < self.sampler.batches:  # one gather per tensor, then views of it
            self.tensors = [t.to(self.device) for t in self.tensors]  # once: then already there
            order = self.sampler.order_tensor()[start * self.batch_size :].to(self.device)
            batches = zip(*(t[order].split(self.batch_size) for t in self.tensors), strict=True)
        elif not self.in_memory:
            self.loader.generator.manual_seed(self.seed + epoch)  # what the iterator draws (worker seeds)
            batches = self.loader
        return itertools.chain(batches, self._empty(max(self.sampler.batches, start)))

    def _empty(self, ran: int):
        if ran < self.micro_batches:
            empty = emptied(self.collate([self.dataset[0]]))  # the right structure, shapes and dtypes
            yield from itertools.repeat(empty, self.micro_batches - ran)


def eval_loader(dataset: Dataset, d: Dist, batch_size: int, num_workers: int, skip: int = 0) -> DataLoader:
    sampler = ContiguousSampler(length(dataset), d.world_size, d.rank, skip)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        collate_fn=collate_fn(dataset),
        num_workers=num_workers,
        generator=torch.Generator(),  # its iterator draws a seed: not from the training RNG
        pin_memory=d.device.type == "cuda",
    )
