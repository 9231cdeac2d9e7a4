"""data=fake: torchvision's FakeData, random images of any size (benchmarks, FSDP experiments)."""

from torch.utils.data import Dataset


def fake(train_size: int, val_size: int, shape: list[int], num_classes: int, test_size: int = 0) -> tuple[Dataset, ...]:
    """torchvision FakeData: (train, val, test), each other images (FakeData seeds image i from
    i + random_offset: the offsets 0, train_size and train_size + val_size never overlap)."""
    from torchvision import datasets, transforms

    def split(size, offset):
        dataset = datasets.FakeData(size, tuple(shape), num_classes, transforms.ToTensor(), random_offset=offset)
        dataset.draws_random = False  # it seeds (index + offset) itself and puts the state back
        return dataset

    return split(train_size, 0), split(val_size, train_size), split(test_size, train_size + val_size)
