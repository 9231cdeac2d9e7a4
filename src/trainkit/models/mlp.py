"""model=mlp: a multilayer perceptron, the default job's model (no normalisation layers)."""

import math

from torch import nn


def mlp(in_shape: list[int], num_classes: int, width: int = 128, depth: int = 2, dropout: float = 0.0) -> nn.Module:
    """`depth` hidden layers of `width` units with ReLU; no normalisation layers."""
    layers: list[nn.Module] = [nn.Flatten()]
    features = math.prod(in_shape)
    for _ in range(depth):
        layers += [nn.Linear(features, width), nn.ReLU(), nn.Dropout(dropout)]
        features = width
    layers.append(nn.Linear(features, num_classes))
    return nn.Sequential(*layers)
