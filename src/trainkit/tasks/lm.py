"""task=lm: next-token prediction, the loss per loss-bearing token (data=addition, pydoc_text, tokens)."""

import math

import torch
import torch.nn.functional as F

from trainkit.data.addition import IGNORE, operand_lengths
from trainkit.errors import ConfigError


def check(cfg) -> None:
    """The data set is made of tokens."""
    if cfg.data.get("vocab_size") is None:
        raise ConfigError(
            f"task=lm needs a token data set (data.vocab_size, e.g. data=addition); data={cfg.data.name} has none"
        )


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
        answers = target.new_full((), len(target), dtype=torch.float64)  # made on the device: no copy to it
        sums = [loss.double(), bearing.sum().double(), right.sum().double(), answers]
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

    def predict_job(self, cfg, run_cfg, out_dir) -> float | None:
        """predict.py on this run: answers decoded greedily, or text sampled (trainkit/tasks/lm_predict.py)."""
        from trainkit.tasks import lm_predict  # hydra and the rundir helpers: predict.py's alone

        return lm_predict.predict_job(cfg, run_cfg, out_dir)

    def _pairs(self) -> list[tuple[int, int]]:
        return [(a, b) for a in range(1, (self.max_digits or 0) + 1) for b in range(1, (self.max_digits or 0) + 1)]
