"""model=simclr: an encoder with a projection head for contrastive learning (task=contrastive)."""

import math
from dataclasses import dataclass

import torch
from omegaconf import MISSING
from torch import nn


@dataclass
class Schema:
    """conf/model/simclr.yaml's keys and their types."""

    _target_: str = MISSING
    in_shape: list[int] = MISSING
    width: int = 256
    depth: int = 2
    dim: int = 64
    dropout: float = 0.0


class SimCLR(nn.Module):
    """An MLP encoder with LayerNorm (exact at any allocation, unlike BatchNorm) and a projection head. Train
    mode: the head's projections (what NT-Xent reads); eval mode: the encoder's embeddings (what kNN reads)."""

    def __init__(self, in_shape, width: int = 256, depth: int = 2, dim: int = 64, dropout: float = 0.0):
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        features = math.prod(in_shape)
        for _ in range(depth):
            layers += [nn.Linear(features, width), nn.LayerNorm(width), nn.ReLU(), nn.Dropout(dropout)]
            features = width
        self.encoder = nn.Sequential(*layers)
        self.head = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        embedding = self.encoder(x)
        return self.head(embedding) if self.training else embedding
