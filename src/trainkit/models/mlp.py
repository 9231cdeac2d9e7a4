"""model=mlp: a multilayer perceptron, the default job's model (no normalisation layers)."""

import math
from dataclasses import dataclass

from omegaconf import MISSING
from torch import nn


@dataclass
class Schema:
    """conf/model/mlp.yaml's keys and their types."""

    _target_: str = MISSING
    in_shape: list[int] = MISSING
    num_classes: int = MISSING
    width: int = 128
    depth: int = 2
    dropout: float = 0.0


def mlp(in_shape, num_classes: int, width: int = 128, depth: int = 2, dropout: float = 0.0) -> nn.Module:
    """`depth` hidden layers of `width` units with ReLU; no normalisation layers."""
    layers: list[nn.Module] = [nn.Flatten()]
    features = math.prod(in_shape)
    for _ in range(depth):
        layers += [nn.Linear(features, width), nn.ReLU(), nn.Dropout(dropout)]
        features = width
    layers.append(nn.Linear(features, num_classes))
    return nn.Sequential(*layers)
