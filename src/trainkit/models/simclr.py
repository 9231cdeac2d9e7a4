"""model=simclr: an encoder with a projection head for contrastive learning (task=contrastive)."""

import math

import torch
from torch import nn


class SimCLR(nn.Module):
    """An encoder and a projection head. Train mode: the head's projections (what NT-Xent reads); eval mode: the
    encoder's embeddings (what kNN reads). The encoder: with `channels`, three 3x3 convolutions (channels, 2x,
    4x; GroupNorm, a 2x2 max-pool after the second) and a linear layer to `width`; else an MLP of `depth`
    layers. LayerNorm and GroupNorm, not BatchNorm: a sample's embedding depends on it alone, so the coupled
    loss is exact at any allocation."""

    def __init__(
        self,
        in_shape: list[int],
        width: int = 256,
        depth: int = 2,
        dim: int = 64,
        dropout: float = 0.0,
        channels: int | None = None,
    ):
        super().__init__()
        self.encoder = encoder(in_shape, width, depth, dropout, channels)
        self.head = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        embedding = self.encoder(x)
        return self.head(embedding) if self.training else embedding


def encoder(in_shape, width: int, depth: int, dropout: float, channels: int | None) -> nn.Sequential:
    """SimCLR's encoder (see SimCLR), also the one a probe or a fine-tune of its run builds (Probe)."""
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
    return nn.Sequential(*layers)
