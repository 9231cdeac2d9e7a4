"""Contrastive learning, SimCLR-style (+experiment=digits_simclr): two random views of every sample, NT-Xent
over the global batch (task=contrastive: its loss couples the batch, trainkit/coupled.py makes it exact at
any allocation), evaluated by k-nearest-neighbour accuracy of the encoder's embeddings (val/knn_acc).

Here: the task, its kNN evaluation, the digits views data set (data=digits_views) and a small encoder with a
projection head (model=simclr)."""

import math
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from trainkit.batch import to_device
from trainkit.data import InMemory, digits, eval_loader
from trainkit.dist import Dist
from trainkit.errors import ConfigError
from trainkit.inference import gather
from trainkit.parallel import EqualBatches


class Contrastive:
    """NT-Xent (Chen et al. 2020): a batch of N samples gives 2N views; each view's positive is its sample's
    other view, its negatives the other 2N - 2 views of the *global* batch. loss_sum is the sum over samples
    of the mean of its two views' losses, so the loop's mean over samples is SimCLR's mean over views.

    Batches: {"views": (n, 2, *shape), "label": (n,)} to train (the labels are not used), (image, label) pairs
    to evaluate. The model gets the views as (2n, *shape), a sample's two views side by side; in train mode it
    returns projections, in eval mode the encoder's embeddings (model=simclr).

    Evaluation: every val/test image is classified by its `knn_k` nearest (cosine) embeddings of the labelled
    `bank` (the train split without augmentation), a vote weighted by similarity; the bank's embeddings are
    computed on every rank's contiguous shard and gathered (prepare_eval), so val/knn_acc is exact at any world
    size."""

    couples_batch = True  # loss_sum gets the outputs of the whole global window (trainkit/coupled.py)
    items_name = None  # items are samples
    eval_width = 2  # correct, samples
    metrics = {"knn_acc": "max"}
    monitor = "val/knn_acc"

    def __init__(self, bank: Dataset | None, temperature: float = 0.2, knn_k: int = 10, bank_batch_size: int = 256):
        if bank is None:
            raise ConfigError(
                "task.bank=null: task=contrastive evaluates by kNN against a labelled split, e.g. "
                "+experiment=digits_simclr's (digits' train split)"
            )
        if not temperature > 0:
            raise ConfigError(f"task.temperature={temperature} must be > 0")
        if not (isinstance(knn_k, int) and knn_k >= 1):
            raise ConfigError(f"task.knn_k={knn_k} must be an integer >= 1")
        self.bank, self.temperature, self.knn_k, self.bank_batch_size = bank, temperature, knn_k, bank_batch_size
        self.bank_embeddings = self.bank_labels = torch.empty(0)

    def unpack(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(batch, dict):  # training: both views of each sample, side by side
            return batch["views"].flatten(0, 1), batch["label"]
        return batch[0], batch[1]

    def loss_sum(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nt_xent(output, self.temperature).sum() / 2

    def items(self, target: torch.Tensor) -> torch.Tensor:
        return torch.tensor(len(target))

    @torch.inference_mode()
    def prepare_eval(self, model: nn.Module, d: Dist, autocast) -> None:
        """The bank's embeddings and labels, in dataset order, on every rank (the model in eval mode)."""
        loader = eval_loader(self.bank, d, self.bank_batch_size, 0)
        embedded, labels = [], []
        for x, y in EqualBatches(loader, d.world_size):  # FSDP: every rank as many forwards
            with autocast():
                embedded.append(model(to_device(x, d.device)).float())
            labels.append(y.to(d.device))
        self.bank_embeddings = F.normalize(gather(torch.cat(embedded), d), dim=1)
        self.bank_labels = gather(torch.cat(labels), d)

    def eval_sums(self, inputs: torch.Tensor, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        predicted = knn_predict(output.float(), self.bank_embeddings, self.bank_labels, self.knn_k)
        correct = (predicted == target).sum().double()
        return torch.stack([correct, torch.tensor(float(len(target)), dtype=torch.float64, device=correct.device)])

    def eval_metrics(self, sums: list[float]) -> dict[str, float]:
        correct, samples = sums
        return {"knn_acc": correct / samples}


def nt_xent(output: torch.Tensor, temperature: float) -> torch.Tensor:
    """Each view's NT-Xent loss: rows 2i and 2i+1 of `output` are sample i's two views (float32)."""
    z = F.normalize(output.float(), dim=1)
    similarity = (z @ z.T / temperature).masked_fill(torch.eye(len(z), dtype=torch.bool, device=z.device), -math.inf)
    rows = torch.arange(len(z), device=z.device)
    return torch.logsumexp(similarity, dim=1) - similarity[rows, rows ^ 1]


def knn_predict(queries: torch.Tensor, bank: torch.Tensor, labels: torch.Tensor, k: int) -> torch.Tensor:
    """Each query's class by its k most cosine-similar rows of `bank` (normalised), a vote weighted by similarity."""
    similarity, nearest = (F.normalize(queries, dim=1) @ bank.T).topk(min(k, len(bank)), dim=1)
    votes = torch.zeros(len(queries), int(labels.max()) + 1, device=queries.device)
    return votes.scatter_add_(1, labels[nearest], similarity).argmax(dim=1)


class DigitsViews(Dataset):
    """Two random views of each image: a random affine map (rotated by up to `rotation` degrees, scaled by a
    factor in [1 - scale, 1 + scale], shifted by up to `shift` pixels each way; bilinear, zero outside), intensity
    scaled by a factor in [1 - contrast, 1 + contrast], Gaussian noise of `noise`. Rotation and scale are what
    make the encoder's embedding better than the pixels for kNN (README: Contrastive learning); a shift alone
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
        angle, scale, dy, dx, contrast = (2 * torch.rand(5) - 1).tolist()
        angle, scale = math.radians(self.rotation * angle), 1 + self.scale * scale
        h, w = image.shape[-2:]
        cos, sin = math.cos(angle) / scale, math.sin(angle) / scale
        # affine_grid's coordinates run from -1 to 1 across the image: a pixel is 2 / size of them
        theta = torch.tensor([[[cos, -sin, 2 * self.shift * dx / w], [sin, cos, 2 * self.shift * dy / h]]])
        grid = F.affine_grid(theta, [1, *image.shape], align_corners=False)
        view = F.grid_sample(image[None], grid, align_corners=False)[0]
        view = view * (1 + self.contrast * contrast)
        return view + self.noise * torch.randn_like(view)


def digits_views(val_fraction: float = 0.2, test_fraction: float = 0.2) -> tuple[Dataset, Dataset, Dataset]:
    """data=digits_views: digits' splits; train yields two views of each image, val and test the images."""
    train, val, test = digits(val_fraction, test_fraction)
    return DigitsViews(*cast(InMemory, train).tensors), val, test


def digits_bank(val_fraction: float = 0.2, test_fraction: float = 0.2) -> Dataset:
    """task.bank for data=digits_views: digits' train split as it is (images, labels), no augmentation."""
    return digits(val_fraction, test_fraction)[0]


class SimCLR(nn.Module):
    """An encoder and a projection head. Train mode: the head's projections (what NT-Xent reads); eval mode: the
    encoder's embeddings (what kNN reads). The encoder: with `channels`, three 3x3 convolutions (channels, 2x,
    4x; GroupNorm, a 2x2 max-pool after the second) and a linear layer to `width`; else an MLP of `depth`
    layers. LayerNorm and GroupNorm, not BatchNorm: a sample's embedding depends on it alone, so the coupled
    loss is exact at any allocation."""

    def __init__(self, in_shape, width=256, depth=2, dim=64, dropout=0.0, channels: int | None = None):
        super().__init__()
        layers: list[nn.Module] = []
        features = math.prod(in_shape)
        if channels:
            c, groups = channels, min(8, channels)
            for c_in, c_out, pool in ((in_shape[0], c, False), (c, 2 * c, True), (2 * c, 4 * c, False)):
                layers += [nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.GroupNorm(groups, c_out), nn.ReLU()]
                layers += [nn.MaxPool2d(2)] if pool else []
            features = 4 * c * (in_shape[1] // 2) * (in_shape[2] // 2)
        layers.append(nn.Flatten())
        for _ in range(1 if channels else depth):
            layers += [nn.Linear(features, width), nn.LayerNorm(width), nn.ReLU(), nn.Dropout(dropout)]
            features = width
        self.encoder = nn.Sequential(*layers)
        self.head = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        embedding = self.encoder(x)
        return self.head(embedding) if self.training else embedding
