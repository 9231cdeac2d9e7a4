"""data=digits_views: digits for contrastive learning (task=contrastive, +experiment=digits_simclr); the train
split yields two random views of each image, val and test the images with their labels."""

from typing import cast

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from trainkit.data.digits import Schema, digits  # noqa: F401  Schema: digits' keys
from trainkit.loading import InMemory


class DigitsViews(Dataset):
    """Two random views of each image: shifted by up to `shift` pixels (zero padding), intensity scaled by a
    factor in [1 - contrast, 1 + contrast], Gaussian noise of `noise`. The draws come from torch's generator,
    which SeededBatches seeds per sample from (seed, epoch, index): the same views at any allocation."""

    draws_random = "torch"

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, shift=1, contrast=0.3, noise=0.1):
        self.images, self.labels, self.shift, self.contrast, self.noise = images, labels, shift, contrast, noise

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict:
        image = self.images[index]
        return {"views": torch.stack([self._view(image), self._view(image)]), "label": self.labels[index]}

    def _view(self, image: torch.Tensor) -> torch.Tensor:
        s, (h, w) = self.shift, image.shape[-2:]
        dy, dx = torch.randint(0, 2 * s + 1, (2,)).tolist()
        view = F.pad(image, (s, s, s, s))[..., dy : dy + h, dx : dx + w]
        view = view * (1 + self.contrast * (2 * torch.rand(()) - 1))
        return view + self.noise * torch.randn_like(view)


def digits_views(val_fraction: float = 0.2, test_fraction: float = 0.2) -> tuple[Dataset, Dataset, Dataset]:
    """data=digits_views: digits' splits; train yields two views of each image, val and test the images."""
    train, val, test = digits(val_fraction, test_fraction)
    return DigitsViews(*cast(InMemory, train).tensors), val, test


def digits_bank(val_fraction: float = 0.2, test_fraction: float = 0.2) -> Dataset:
    """task.bank for data=digits_views: digits' train split as it is (images, labels), no augmentation."""
    return digits(val_fraction, test_fraction)[0]
