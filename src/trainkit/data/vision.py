"""data=mnist, data=cifar10: torchvision's classification sets, read from a local root (data.root)."""

import copy
from dataclasses import dataclass, field

import numpy as np
from omegaconf import MISSING
from torch.utils.data import Dataset, Subset

from trainkit.errors import ConfigError
from trainkit.schema import Data


@dataclass
class Splits:
    _target_: str = MISSING
    name: str = MISSING
    root: str = MISSING
    download: bool = False
    augment: bool = False
    val_fraction: float = 0.1  # carved from the official training set; test: the official test set


@dataclass
class Schema(Data):
    """conf/data/mnist.yaml and cifar10.yaml's keys and their types."""

    splits: Splits = field(default_factory=Splits)
    root: str = MISSING
    download: bool = False
    augment: bool = False  # random training augmentation (CIFAR-10: crop + flip)


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
