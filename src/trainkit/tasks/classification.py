"""task=classification: per-sample cross-entropy and accuracy (the default job's)."""

import torch
import torch.nn.functional as F

from trainkit.errors import ConfigError


def check(cfg) -> None:
    """The data set has classes to predict."""
    if cfg.data.get("num_classes") is None:
        raise ConfigError(
            f"task=classification needs data.num_classes; data={cfg.data.name} has none (a token data set: task=lm)"
        )


class Classification:
    """Items are samples: per-sample cross-entropy; accuracy is argmax == target.

    `label_smoothing` (in [0, 1)) smooths the training targets only: val/loss stays the plain
    cross-entropy, comparable between runs with and without it."""

    items_name = None  # items are samples: the epoch layout counts them, no communication needed
    eval_width = 3  # len(eval_sums(...))
    metrics = {"loss": "min", "acc": "max"}  # eval_metrics' keys, which way each is better
    monitor = "val/acc"  # checkpoint.monitor=auto: what picks the best checkpoint

    def __init__(self, label_smoothing: float = 0.0):
        if not (isinstance(label_smoothing, (int, float)) and 0 <= label_smoothing < 1):
            raise ConfigError(f"task.label_smoothing={label_smoothing} must be a number in [0, 1)")
        self.label_smoothing = float(label_smoothing)

    def loss_sum(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The summed loss of the batch's items (0 for an empty batch)."""
        return F.cross_entropy(output, target, reduction="sum", label_smoothing=self.label_smoothing)

    def items(self, target: torch.Tensor) -> torch.Tensor:
        return torch.tensor(len(target), device=target.device)  # the batch's device: a GPU's, not the CPU

    def eval_sums(self, inputs: torch.Tensor, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """[loss sum, correct, samples] of one evaluation batch, float64 (evaluate all-reduces them)."""
        loss = F.cross_entropy(output.float(), target, reduction="sum")  # float32 also under autocast
        correct = (output.argmax(dim=1) == target).sum()
        return torch.stack([loss.double(), correct.double(), target.new_full((), len(target), dtype=torch.float64)])

    def eval_metrics(self, sums: list[float]) -> dict[str, float]:
        loss, correct, samples = sums
        return {"loss": loss / samples, "acc": correct / samples}

    def predictions(self, output: torch.Tensor, target: torch.Tensor, probs: bool = False) -> dict[str, torch.Tensor]:
        """predict.py's columns beside `index`: target, prediction (argmax) and, with predict.probs=true,
        prob_<c>, the softmax of each class."""
        columns = {"target": target, "prediction": output.argmax(dim=1)}
        return columns | ({f"prob_{c}": p for c, p in enumerate(output.softmax(dim=1).T)} if probs else {})
