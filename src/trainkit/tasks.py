"""What is learned: a task turns a batch's model output and targets into the summed loss of its
loss-bearing items (the loop normalises it over the global window), counts those items, and
gives the evaluation sums. train.py and evaluate.py are the same for every task: forking for
another task means one class here (or in your project) and its conf/task/<name>.yaml.

What a task declares about its evaluation (the engine reads no metric by name):
- `metrics`: {name: "max" | "min"}, the keys of `eval_metrics` and which way each is better
  (checkpoint.mode=auto, early stopping, a search's direction); a monitored key whose direction the task
  does not declare is refused, never guessed. Without `metrics`: val/loss alone, minimised.
- `monitor`: checkpoint.monitor=auto's key (without: val/loss).
- `headline` (optional): the metrics the console's lines show (default: every declared one).
- `prepare_eval(model, d, autocast)` (optional): called on every rank at the start of each evaluation, the
  plain module in eval mode, before the first `eval_sums` (collectives allowed: trainkit/contrastive.py gathers
  a kNN evaluation's bank of training embeddings there).
- `couples_batch = True` (optional): the loss couples a batch's items (a contrastive loss); `loss_sum` then
  gets the outputs and targets of the whole global window at once, exactly (trainkit/coupled.py).
Every metric is `eval_metrics` of all-reduced `eval_sums`, so it is exact at any world size also when
it is no mean of per-item values (R^2 below: sums of y, y^2 and squared errors)."""

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
        return torch.tensor(len(target))

    def eval_sums(self, inputs: torch.Tensor, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """[loss sum, correct, samples] of one evaluation batch, float64 (evaluate all-reduces them)."""
        loss = F.cross_entropy(output.float(), target, reduction="sum")  # float32 also under autocast
        correct = (output.argmax(dim=1) == target).sum()
        return torch.stack([loss.double(), correct.double(), torch.tensor(len(target), dtype=torch.float64)])

    def eval_metrics(self, sums: list[float]) -> dict[str, float]:
        loss, correct, samples = sums
        return {"loss": loss / samples, "acc": correct / samples}


class Regression:
    """One real-valued target per sample: the squared error per sample; val/loss is the mean squared
    error, val/rmse its root, val/r2 the coefficient of determination 1 - SSE / SST of the split, with SST
    from the all-reduced sums of y and y^2 (no per-rank means: exact at any world size). The model's
    output of shape (N, 1) is read as (N,)."""

    items_name = None  # items are samples
    eval_width = 4  # len(eval_sums(...))
    metrics = {"loss": "min", "rmse": "min", "r2": "max"}
    monitor = "val/r2"

    def loss_sum(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (output.reshape(target.shape) - target).pow(2).sum()

    def items(self, target: torch.Tensor) -> torch.Tensor:
        return torch.tensor(len(target))

    def eval_sums(self, inputs: torch.Tensor, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """[squared errors, samples, sum of y, sum of y^2], float64 (evaluate all-reduces them)."""
        y = target.double()
        error = (output.double().reshape(y.shape) - y).pow(2).sum()
        return torch.stack([error, y.new_tensor(float(len(y))), y.sum(), y.pow(2).sum()])

    def eval_metrics(self, sums: list[float]) -> dict[str, float]:
        error, samples, total, squares = sums
        spread = squares - total * total / samples  # SST: the squared deviations from the split's mean
        mse = error / samples
        return {"loss": mse, "rmse": math.sqrt(mse), "r2": 1 - error / spread if spread > 0 else math.nan}

    def predictions(self, output: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
        """predict.py's columns beside `index`, one row per sample."""
        return {"target": target, "prediction": output.reshape(target.shape)}


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
    monitor = "val/loss"  # checkpoint.monitor=auto: exact match is 0 for long, the loss moves from the start
    headline = ("loss", "acc", "bpc")  # the lines leave out the per-operand-pair accuracies

    def __init__(self, max_digits: int | None = None, per_character: bool = False, per_token: bool = False):
        self.max_digits, self.per_character, self.per_token = max_digits, per_character, per_token
        self.eval_width = 5 + 2 * len(self._pairs())
        pairs = {f"acc_{a}x{b}": "max" for a, b in self._pairs()}
        self.metrics = {"loss": "min", "acc": "max"} | ({"bpc": "min"} if per_character else {}) | pairs

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
