"""model=simclr_probe: a linear classifier on SimCLR's encoder (+experiment=digits_simclr_probe, _finetune)."""

from dataclasses import dataclass

import torch
from omegaconf import MISSING
from torch import nn

from trainkit.models.simclr import encoder


@dataclass
class Schema:
    """conf/model/simclr_probe.yaml's keys: SimCLR's encoder's (they must be its parent's) and the classes."""

    _target_: str = MISSING
    in_shape: list[int] = MISSING
    num_classes: int = MISSING
    width: int = 256
    depth: int = 2
    dropout: float = 0.0
    channels: int | None = None


class Probe(nn.Module):
    """SimCLR's encoder and a linear classifier on its embedding (model=simclr_probe): the linear probe of a
    +experiment=digits_simclr run (its encoder frozen: +experiment=digits_simclr_probe) or its fine-tune
    (+experiment=digits_simclr_finetune). The encoder's keys are the parent's (`encoder.*`): model.init loads
    them, dropping the parent's projection head (`head.*`)."""

    def __init__(self, in_shape, num_classes: int, width=256, depth=2, dropout=0.0, channels: int | None = None):
        super().__init__()
        self.encoder = encoder(in_shape, width, depth, dropout, channels)
        self.classifier = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.encoder(x))
