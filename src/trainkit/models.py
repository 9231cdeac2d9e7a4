"""Models, built by Hydra from conf/model/*.yaml (`_target_`)."""

import math

from torch import nn


def mlp(in_shape, num_classes: int, width: int = 128, depth: int = 2, dropout: float = 0.0) -> nn.Module:
    """`depth` hidden layers of `width` units with ReLU; no normalisation layers."""
    layers: list[nn.Module] = [nn.Flatten()]
    features = math.prod(in_shape)
    for _ in range(depth):
        layers += [nn.Linear(features, width), nn.ReLU(), nn.Dropout(dropout)]
        features = width
    layers.append(nn.Linear(features, num_classes))
    return nn.Sequential(*layers)


def cnn(in_channels: int, num_classes: int, width: int = 32, dropout: float = 0.0) -> nn.Module:
    """Three conv-BatchNorm-ReLU layers and a linear head: the small model with BatchNorm."""

    def stage(cin, cout):
        return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]

    return nn.Sequential(
        *stage(in_channels, width),
        *stage(width, width),
        nn.MaxPool2d(2),
        *stage(width, 2 * width),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Dropout(dropout),
        nn.Linear(2 * width, num_classes),
    )


def resnet18(in_channels: int, num_classes: int) -> nn.Module:
    """torchvision's ResNet-18 (random init; weights would need a download)."""
    from torchvision.models import resnet18 as tv_resnet18

    model = tv_resnet18(num_classes=num_classes)
    if in_channels != 3:
        model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
    return model
