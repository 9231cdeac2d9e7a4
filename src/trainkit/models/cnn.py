"""model=cnn: a small conv net with BatchNorm (SyncBN's and activation checkpointing's test model)."""

from torch import nn

from trainkit.recompute import Staged


def cnn(
    in_channels: int, num_classes: int, width: int = 32, dropout: float = 0.0, activation_checkpointing: bool = False
) -> nn.Module:
    """Three conv-BatchNorm-ReLU layers and a linear head: the small model with BatchNorm.
    `activation_checkpointing`: each conv-BatchNorm-ReLU stage is a checkpointed segment."""

    def stage(cin, cout):
        return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]

    stages = [stage(in_channels, width), stage(width, width), stage(width, 2 * width)]
    layers = [
        *stages[0],
        *stages[1],
        nn.MaxPool2d(2),
        *stages[2],
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Dropout(dropout),
        nn.Linear(2 * width, num_classes),
    ]
    if not activation_checkpointing:
        return nn.Sequential(*layers)
    starts = [next(i for i, layer in enumerate(layers) if layer is s[0]) for s in stages]
    return Staged(*layers, stages=[(start, start + len(s)) for start, s in zip(starts, stages, strict=True)])
