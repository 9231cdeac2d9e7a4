"""data=digits_views: digits for contrastive learning (task=contrastive, +experiment=digits_simclr); the train
split yields two random views of each image, val and test the images with their labels."""

import math
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.nn.functional as F
from omegaconf import MISSING
from torch.utils.data import Dataset

from trainkit.data.digits import digits
from trainkit.loading import InMemory
from trainkit.rng import sample_seed
from trainkit.schema import Data


@dataclass
class ViewSplits:
    """digits' split fractions and the strengths of the train split's random views (DigitsViews): written here, as
    digits_views' **strengths leave the signature without a closed set of keys to derive a schema from."""

    _target_: str = MISSING
    val_fraction: float = 0.2
    test_fraction: float = 0.2
    shift: float = 1.0
    rotation: float = 15.0
    scale: float = 0.15
    contrast: float = 0.3
    noise: float = 0.1


@dataclass
class Schema(Data):
    """conf/data/digits_views.yaml's keys and their types."""

    splits: ViewSplits = field(default_factory=ViewSplits)


class DigitsViews(Dataset):
    """Two random views of each image: a random affine map (rotated by up to `rotation` degrees, scaled by a
    factor in [1 - scale, 1 + scale], shifted by up to `shift` pixels each way; bilinear, zero outside), intensity
    scaled by a factor in [1 - contrast, 1 + contrast], Gaussian noise of `noise`. Rotation and scale are what
    make the encoder's embedding better than the pixels for kNN (docs/contrastive.md); a shift alone
    teaches little beyond them. The draws come from torch's generator, which SeededBatches seeds per sample from
    (seed, epoch, index): the same views at any allocation."""

    draws_random = "torch"

    def __init__(self, images, labels, shift=1.0, rotation=15.0, scale=0.15, contrast=0.3, noise=0.1):
        self.images, self.labels = images, labels
        self.shift, self.rotation, self.scale, self.contrast, self.noise = shift, rotation, scale, contrast, noise

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict:
        image = self.images[index]
        return {"views": torch.stack([self._view(image), self._view(image)]), "label": self.labels[index]}

    def _view(self, image: torch.Tensor) -> torch.Tensor:
        theta, factor = self._draw(image.shape)
        view = self._apply(image[None], theta[None], image.shape)[0] * factor
        return view + self.noise * torch.randn_like(view)

    def _draw(self, shape, generator: torch.Generator | None = None) -> tuple[torch.Tensor, float]:
        """A view's affine map (1, 2, 3) and intensity factor, from torch's generator (or `generator`)."""
        angle, scale, dy, dx, contrast = (2 * torch.rand(5, generator=generator) - 1).tolist()
        angle, scale = math.radians(self.rotation * angle), 1 + self.scale * scale
        h, w = shape[-2:]
        cos, sin = math.cos(angle) / scale, math.sin(angle) / scale
        # affine_grid's coordinates run from -1 to 1 across the image: a pixel is 2 / size of them
        theta = torch.tensor([[cos, -sin, 2 * self.shift * dx / w], [sin, cos, 2 * self.shift * dy / h]])
        return theta, 1 + self.contrast * contrast

    @staticmethod
    def _apply(images: torch.Tensor, thetas: torch.Tensor, shape) -> torch.Tensor:
        grid = F.affine_grid(thetas, [len(images), *shape], align_corners=False)
        return F.grid_sample(images, grid, align_corners=False)

    def device_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """data.on_device: the images and labels; device_batches makes the views there."""
        return self.images, self.labels

    def device_batches(self, tensors, order: torch.Tensor, batch_size: int, epoch: int, seed: int, rows=None):
        """The views on the device, each sample's draws as the loader path's (torch's generator seeded from (seed,
        epoch, index): the same views at any allocation), drawn on the host once an epoch (the affine maps, factors
        and noise: 5 + 64 numbers a view), then each micro-batch's warps in one batched grid_sample there. `rows`:
        the samples' images where a debug subset names them (its draws still by `order`, as the loader's)."""
        images, labels = tensors
        shape, thetas, factors, noise = images.shape[1:], [], [], []
        generator = torch.Generator()
        for i in order.tolist():
            generator.manual_seed(sample_seed(seed, epoch, i))
            for _ in range(2):  # _view's draws, in its order: the map and factor, then the noise
                theta, factor = self._draw(shape, generator)
                thetas.append(theta)
                factors.append(factor)
                noise.append(torch.randn(shape, generator=generator))
        device = images.device
        thetas_d = torch.stack(thetas).to(device, non_blocking=True) if thetas else images.new_zeros(0, 2, 3)
        factors_d = torch.tensor(factors, dtype=images.dtype).view(-1, *[1] * len(shape)).to(device, non_blocking=True)
        noise_d = (torch.stack(noise) if noise else images.new_zeros(0, *shape)).to(device, non_blocking=True)
        index = (order if rows is None else rows).to(device, non_blocking=True)
        for rows, at in zip(index.split(batch_size), range(0, len(order), batch_size), strict=True):
            views = slice(2 * at, 2 * (at + len(rows)))
            pairs = images[rows].repeat_interleave(2, dim=0)  # each image twice: its two views
            warped = self._apply(pairs, thetas_d[views], shape) * factors_d[views]
            warped = warped + self.noise * noise_d[views]
            yield {"views": warped.view(len(rows), 2, *shape), "label": labels[rows]}


def digits_views(
    val_fraction: float = 0.2, test_fraction: float = 0.2, **strengths: float
) -> tuple[Dataset, Dataset, Dataset]:
    """data=digits_views: digits' splits; train yields two views of each image (DigitsViews' `strengths`), val
    and test the images."""
    train, val, test = digits(val_fraction, test_fraction)
    return DigitsViews(*cast(InMemory, train).tensors, **strengths), val, test


def digits_bank(val_fraction: float = 0.2, test_fraction: float = 0.2) -> Dataset:
    """task.bank for data=digits_views: digits' train split as it is (images, labels), no augmentation."""
    return digits(val_fraction, test_fraction)[0]
