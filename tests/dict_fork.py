"""A fork's parts as a user writes them, for tests/test_batches.py: batches that are dicts with a mask, a model
that takes the dict, and a task with its own metric (val/mae, lower is better) that says what the model gets.
Nothing here is known to the engine: data.splits._target_, model._target_ and task._target_ point here."""

import torch
from torch import nn
from torch.utils.data import Dataset

from trainkit.data.diabetes import diabetes


class MaskedPatients(Dataset):
    """scikit-learn's diabetes as {"features", "mask", "target"} samples: every third patient misses a feature
    (masked out), so the model must read the mask; nothing random is drawn."""

    draws_random = False

    def __init__(self, split):
        self.features, self.target = split.tensors
        self.mask = torch.ones_like(self.features, dtype=torch.bool)
        self.mask[::3, 2] = False

    def __len__(self) -> int:
        return len(self.target)

    def __getitem__(self, index: int) -> dict:
        return {"features": self.features[index], "mask": self.mask[index], "target": self.target[index]}


def splits(val_fraction: float = 0.2, test_fraction: float = 0.2):
    return tuple(MaskedPatients(split) for split in diabetes(val_fraction, test_fraction))


class MaskedMLP(nn.Module):
    def __init__(self, in_shape, num_classes: int, width: int = 16, depth: int = 1, dropout: float = 0.0):
        super().__init__()
        layers: list[nn.Module] = []
        features = in_shape[0]
        for _ in range(depth):
            layers += [nn.Linear(features, width), nn.ReLU()]
            features = width
        self.net = nn.Sequential(*layers, nn.Linear(features, num_classes))

    def forward(self, batch: dict) -> torch.Tensor:
        return self.net(batch["features"] * batch["mask"])


class MeanAbsolute:
    """Squared error to train; val/mae (min) and val/loss from all-reduced sums."""

    items_name = None  # items are samples
    eval_width = 3
    metrics = {"loss": "min", "mae": "min"}
    monitor = "val/mae"

    def unpack(self, batch: dict):
        return batch, batch["target"]  # the model reads features and mask, the loss the target

    def loss_sum(self, output, target):
        return (output.squeeze(-1) - target).pow(2).sum()

    def items(self, target):
        return torch.tensor(len(target))

    def eval_sums(self, inputs, output, target):
        error = output.squeeze(-1).double() - target.double()
        return torch.stack([error.pow(2).sum(), error.abs().sum(), error.new_tensor(float(len(target)))])

    def eval_metrics(self, sums):
        squared, absolute, samples = sums
        return {"loss": squared / samples, "mae": absolute / samples}

    def predictions(self, output, target):
        return {"target": target, "prediction": output.squeeze(-1)}
