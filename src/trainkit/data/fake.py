"""data=fake: torchvision's FakeData, random images of any size (benchmarks, FSDP experiments)."""

import functools
import math

import torch
from torch.utils.data import Dataset


def fake(train_size: int, val_size: int, shape: list[int], num_classes: int, test_size: int = 0) -> tuple[Dataset, ...]:
    """torchvision FakeData: (train, val, test), each other images (FakeData seeds image i from
    i + random_offset: the offsets 0, train_size and train_size + val_size never overlap)."""
    from torchvision import datasets, transforms

    def split(size, offset):
        dataset = datasets.FakeData(size, tuple(shape), num_classes, transforms.ToTensor(), random_offset=offset)
        dataset.draws_random = False  # it seeds (index + offset) itself and puts the state back
        # data.on_device: every image made once (what the loader makes of each), its size known before
        dataset.device_tensors = functools.partial(_made, dataset)
        dataset.device_bytes = lambda: size * (math.prod(shape) * 4 + 8)
        return dataset

    return split(train_size, 0), split(val_size, train_size), split(test_size, train_size + val_size)


def _made(dataset) -> tuple[torch.Tensor, torch.Tensor]:
    """(images, targets) of every sample, as the default collation stacks them."""
    samples = [dataset[i] for i in range(len(dataset))]
    return torch.stack([x for x, _ in samples]), torch.tensor([y for _, y in samples])
