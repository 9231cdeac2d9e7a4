"""task=distil: knowledge distillation (Hinton et al. 2015) from a frozen teacher, a finished run
(`task.teacher.from=<run dir>`, built and frozen by trainkit/teacher.py), into the model being trained
(+experiment=digits_distil: a cnn teacher, an mlp student).

The loss of a sample: (1 - alpha) x cross-entropy on its label + alpha x T^2 x KL(teacher || student) of the
two softmaxes at temperature T (T^2 keeps the soft term's gradient on the scale of the hard one's). Its terms,
`ce` and `kd`, are rows of their own (loss/ce, loss/kd on train rows; val/loss/ce, val/loss/kd), each summed
over the samples as the loss is: loss/ce is the plain cross-entropy, comparable with another run's loss."""

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import MISSING, OmegaConf
from torch import nn

from trainkit.errors import ConfigError


@dataclass
class Schema:
    """conf/task/distil.yaml's keys and their types (teacher: {from, weights}, checked by trainkit/teacher.py:
    `from` is no name a dataclass field can have)."""

    _target_: str = MISSING
    teacher: Any = None
    temperature: float = 4.0
    alpha: float = 0.5


def check(cfg) -> None:
    """The data set has classes, and a teacher run is named."""
    if cfg.data.get("num_classes") is None:
        raise ConfigError(f"task=distil needs data.num_classes; data={cfg.data.name} has none")
    teacher = cfg.task.get("teacher")
    if teacher is None or OmegaConf.is_missing(teacher, "from") or teacher.get("from") is None:
        raise ConfigError(
            "task=distil needs task.teacher.from=<run dir of a finished run>, e.g. of "
            "`python src/train.py model=cnn hydra.run.dir=outputs/digits_cnn` (docs/distillation.md)"
        )


class Distil:
    """Batches are (input, label) pairs; the loss reads (label, input): the teacher's logits of the input."""

    items_name = None  # items are samples
    loss_terms = ("ce", "kd")  # loss_sum: [loss, ce, kd], each summed over the batch's samples
    eval_width = 5
    metrics = {"loss": "min", "loss/ce": "min", "loss/kd": "min", "acc": "max"}
    headline = ("loss", "loss/ce", "loss/kd", "acc")
    monitor = "val/acc"

    def __init__(self, teacher: nn.Module, temperature: float = 4.0, alpha: float = 0.5):
        if not isinstance(teacher, nn.Module):
            raise ConfigError("task.teacher: task=distil needs a teacher run (task.teacher.from=<run dir>)")
        if not temperature > 0:
            raise ConfigError(f"task.temperature={temperature} must be > 0")
        if not 0 <= alpha <= 1:
            raise ConfigError(f"task.alpha={alpha} must be in [0, 1]")
        self.teacher, self.temperature, self.alpha = teacher, float(temperature), float(alpha)

    def unpack(self, batch) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        x, y = batch
        return x, (y, x)

    def _terms(self, output: torch.Tensor, target) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch's summed cross-entropy and T^2 x KL(teacher || student), float32 also under autocast."""
        label, x = target
        t = self.temperature
        ce = F.cross_entropy(output.float(), label, reduction="sum")
        logits = self.teacher(x)  # the teacher: eval mode, no_grad
        if logits.shape != output.shape:  # a teacher of other classes (or data) than the student's
            raise ConfigError(
                f"task.teacher: its outputs have shape {list(logits.shape)}, the model's {list(output.shape)}: "
                "the teacher must be a run on the same data"
            )
        soft = F.log_softmax(logits.float() / t, dim=1)
        kd = F.kl_div(F.log_softmax(output.float() / t, dim=1), soft, reduction="sum", log_target=True) * t * t
        return ce, kd

    def loss_sum(self, output: torch.Tensor, target) -> torch.Tensor:
        """[loss, ce, kd], each summed over the batch's samples (0 for an empty batch)."""
        ce, kd = self._terms(output, target)
        return torch.stack([(1 - self.alpha) * ce + self.alpha * kd, ce, kd])

    def items(self, target) -> torch.Tensor:
        return torch.tensor(len(target[0]), device=target[0].device)

    def eval_sums(self, inputs, output: torch.Tensor, target) -> torch.Tensor:
        """[loss, ce, kd, correct, samples] of one evaluation batch, float64."""
        correct = (output.argmax(dim=1) == target[0]).sum()
        samples = torch.tensor(len(target[0]), device=output.device)
        return torch.cat([self.loss_sum(output, target).double(), torch.stack([correct, samples]).double()])

    def eval_metrics(self, sums: list[float]) -> dict[str, float]:
        loss, ce, kd, correct, samples = sums
        return {"loss": loss / samples, "loss/ce": ce / samples, "loss/kd": kd / samples, "acc": correct / samples}

    def predictions(self, output: torch.Tensor, target) -> dict[str, torch.Tensor]:
        """predict.py's columns beside `index`: the label and the student's argmax."""
        return {"target": target[0], "prediction": output.argmax(dim=1)}
