"""What is learned: a task turns a batch's model output and targets into the summed loss of its
loss-bearing items (the loop normalises it over the global window), counts those items, and
gives the evaluation sums. train.py and evaluate.py are the same for every task: forking for
another task means one class here (or in your project) and its conf/task/<name>.yaml.
`eval_metrics` names the metrics ("loss", "acc"; evaluate prefixes the split: val/, test/);
`monitor` is checkpoint.monitor=auto's (key, mode), `metric_names` what an explicit monitor is
checked against (a task without them: val/loss, min, and no check)."""

import math

import torch
import torch.nn.functional as F

from trainkit.addition import IGNORE, operand_lengths
from trainkit.errors import ConfigError


class Classification:
    """Items are samples: per-sample cross-entropy; accuracy is argmax == target.

    `label_smoothing` (in [0, 1)) smooths the training targets only: val/loss stays the plain
    cross-entropy, comparable between runs with and without it."""

    items_name = None  # items are samples: the epoch layout counts them, no communication needed
    eval_width = 3  # len(eval_sums(...))
    monitor = ("val/acc", "max")  # checkpoint.monitor=auto / checkpoint.mode=auto: what picks the best checkpoint
    metric_names = ("loss", "acc")  # eval_metrics' keys: a checkpoint.monitor is checked against them at start

    def __init__(self, label_smoothing: float = 0.0):
        if not (isinstance(label_smoothing, (int, float)) and 0 <= label_smoothing < 1):
            raise ConfigError(f"task.label_smoothing={label_smoothing} must be a number in [0, 1)")
        self.label_smoothing = float(label_smoothing)

    def loss_sum(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The summed loss of the batch's items (0 for an empty batch)."""
        return F.cross_entropy(output, target, reduction="sum", label_smoothing=self.label_smoothing)

    def items(self, target: torch.Tensor) -> torch.Tensor:
        return torch.tensor(len(target))

    def eval_sums(self, inputs: torch.Tensor, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """[loss sum, correct, samples] of one evaluation batch, float64 (evaluate all-reduces them)."""
        loss = F.cross_entropy(output.float(), target, reduction="sum")  # float32 also under autocast
        correct = (output.argmax(dim=1) == target).sum()
        return torch.stack([loss.double(), correct.double(), torch.tensor(len(target), dtype=torch.float64)])

    def eval_metrics(self, sums: list[float]) -> dict[str, float]:
        loss, correct, samples = sums
        return {"loss": loss / samples, "acc": correct / samples}


class LanguageModel:
    """Next-token prediction. Items are the loss-bearing tokens (targets other than IGNORE):
    per-token cross-entropy, whose count differs between micro-batches and ranks. val/acc is the
    exact match of whole answers: every loss-bearing token's teacher-forced argmax right (equal
    to greedy decoding's exact match: greedy first goes wrong where argmax does). With
    `max_digits` (data=addition) it also reports val/acc_<a>x<b> per pair of operand lengths.
    `per_character` (a character corpus, data=pydoc_text): val/acc is the share of characters
    whose argmax is right, and val/bpc the loss in bits per character (val/loss / ln 2). `per_token` (a
    tokenized corpus, data=tokens): val/acc is the share of tokens whose argmax is right (no bpc: a BPE
    token is no character)."""

    items_name = "tokens"
    monitor = ("val/loss", "min")  # checkpoint.monitor=auto: exact match is 0 for long, the loss moves from the start

    def __init__(self, max_digits: int | None = None, per_character: bool = False, per_token: bool = False):
        self.max_digits, self.per_character, self.per_token = max_digits, per_character, per_token
        self.eval_width = 5 + 2 * len(self._pairs())
        self.metric_names = ("loss", "acc", *(["bpc"] * per_character), *(f"acc_{a}x{b}" for a, b in self._pairs()))

    def loss_sum(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.flatten(0, 1), target.flatten(), ignore_index=IGNORE, reduction="sum")

    def items(self, target: torch.Tensor) -> torch.Tensor:
        return (target != IGNORE).sum()

    def eval_sums(self, inputs: torch.Tensor, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """[loss sum, tokens, correct answers, answers, correct tokens, then per operand-length pair:
        correct, answers]."""
        loss = self.loss_sum(output.float(), target)
        bearing = target != IGNORE
        hits = (output.argmax(dim=-1) == target) & bearing
        right = (hits | ~bearing).all(dim=1)
        sums = [loss.double(), bearing.sum().double(), right.sum().double(), torch.tensor(float(len(target)))]
        sums.append(hits.sum().double())
        if self.max_digits:
            lengths = operand_lengths(inputs)
            for a, b in self._pairs():
                pair = (lengths[:, 0] == a) & (lengths[:, 1] == b)
                sums += [(right & pair).sum().double(), pair.sum().double()]
        return torch.stack([s.to(torch.float64) for s in sums])

    def eval_metrics(self, sums: list[float]) -> dict[str, float]:
        loss, tokens, correct, answers, hits = sums[:5]
        metrics = {"loss": loss / tokens, "acc": correct / answers}
        if self.per_character or self.per_token:
            metrics["acc"] = hits / tokens
        if self.per_character:
            metrics["bpc"] = loss / tokens / math.log(2)
        for (a, b), (right, count) in zip(self._pairs(), zip(sums[5::2], sums[6::2], strict=True), strict=True):
            if count:
                metrics[f"acc_{a}x{b}"] = right / count
        return metrics

    def _pairs(self) -> list[tuple[int, int]]:
        return [(a, b) for a in range(1, (self.max_digits or 0) + 1) for b in range(1, (self.max_digits or 0) + 1)]
