"""data=fake: torchvision's FakeData, random images of any size (benchmarks, FSDP experiments)."""

from dataclasses import dataclass, field

from omegaconf import MISSING
from torch.utils.data import Dataset

from trainkit.schema import Data


@dataclass
class Splits:
    _target_: str = MISSING
    train_size: int = MISSING
    val_size: int = MISSING
    shape: list[int] = MISSING
    num_classes: int = MISSING
    test_size: int = 0


@dataclass
class Schema(Data):
    """conf/data/fake.yaml's keys and their types."""

    splits: Splits = field(default_factory=Splits)


def fake(train_size: int, val_size: int, shape, num_classes: int, test_size: int = 0) -> tuple[Dataset, ...]:
    """torchvision FakeData: (train, val, test), each other images (FakeData seeds image i from
    i + random_offset: the offsets 0, train_size and train_size + val_size never overlap)."""
    from torchvision import datasets, transforms

    def split(size, offset):
        dataset = datasets.FakeData(size, tuple(shape), num_classes, transforms.ToTensor(), random_offset=offset)
        dataset.draws_random = False  # it seeds (index + offset) itself and puts the state back
        return dataset

    return split(train_size, 0), split(val_size, train_size), split(test_size, train_size + val_size)
