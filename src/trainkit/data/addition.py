"""data=addition: `a+b=c` problems as character sequences, embedded (no download).

A problem of operands with 1..max_digits digits is the string `a+b=` followed by the answer
and an end token, every number written least-significant digit first: the known trick that
makes addition learnable by small causal models (each answer digit then depends only on digits
already seen: the operands' digits of its place and the carry). Reversing the operands too puts
the units digits at the same place for every operand length (with the answer alone reversed,
a 2-layer GPT learned 3x3 problems but not 2x2 ones: 0.10 exact match after 3000 steps).
`zero_pad` (data.zero_pad) writes every number at a fixed width with leading zeros, operands of max_digits and
answers of max_digits + 1 digits (3 digits: `5+17=22` is `500+710=2200$`): each place then sits at one position
and every answer ends at one, so no problem asks the model where an operand or the answer ends (unpadded, a seed of
`+experiment=addition_gpt` could stall at 0.10 exact match on 3x1 and 3x2 problems; with padded operands alone,
at 0.44 on 1x1, the only problems with one-digit answers; docs/text.md).
The model reads the sequence shifted by one; only the answer tokens and the end token bear a
loss (targets elsewhere are IGNORE). Batches are padded to their longest sequence.

The train, val and test splits are fixed and disjoint, the same for every seed, and stratified by
operand-length pair: every pair gets its share of each split (drawn naively, all 100 one-digit
+ one-digit problems would land in training and the val score would hide them).
"""

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch
from omegaconf import MISSING
from torch.utils.data import Dataset

from trainkit.errors import ConfigError
from trainkit.schema import Data

VOCAB = "0123456789+=$."  # $: end of the answer, .: padding
END, PAD = VOCAB.index("$"), VOCAB.index(".")
IGNORE = -100  # the target of a position that bears no loss (F.cross_entropy's ignore_index)
_SPLIT_SEED = 1234  # fixed: the splits never depend on the run's seed


@dataclass
class Splits:
    _target_: str = MISSING
    max_digits: int = MISSING
    num_train: int = MISSING
    num_val: int = MISSING
    block_size: int | None = None
    num_test: int = 0
    zero_pad: bool = False


@dataclass
class Schema(Data):
    """conf/data/addition.yaml's keys and their types."""

    splits: Splits = field(default_factory=Splits)
    max_digits: int = 3
    num_train: int = 20000
    num_val: int = 1800
    num_test: int = 1800
    zero_pad: bool = False
    vocab_size: int = MISSING
    block_size: int = MISSING


def encode(text: str) -> list[int]:
    return [VOCAB.index(c) for c in text]


def decode(tokens) -> str:
    return "".join(VOCAB[t] for t in tokens)


def longest_input(max_digits: int) -> int:
    """The longest input: `a+b=` and the reversed answer with its end token, less one (shifted)."""
    return 2 * max_digits + 2 + (max_digits + 1) + 1 - 1


class Problems(Dataset):
    """Each item: (input tokens, target tokens) as 1-d long tensors of one length; targets are
    IGNORE except under the answer and the end token. `collate_fn` pads a batch."""

    draws_random = False  # a problem is its operands: the loader seeds nothing per sample (data.draws_random)
    lengths: torch.Tensor  # each problem's input length (device_tensors)

    def __init__(self, pairs: np.ndarray, width: int = 0):
        self.pairs = pairs  # (N, 2) operands
        self.width = width  # data.zero_pad: operands of `width` digits and answers of width + 1; 0: as written

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, index: int):
        a, b = (int(v) for v in self.pairs[index])
        a_text, b_text, answer_text = self.written(a, b)
        prompt, answer = encode(f"{a_text[::-1]}+{b_text[::-1]}="), encode(answer_text[::-1] + "$")
        sequence = torch.tensor(prompt + answer)
        target = sequence[1:].clone()
        target[: len(prompt) - 1] = IGNORE  # positions that predict the prompt bear no loss
        return sequence[:-1], target

    def written(self, a: int, b: int) -> tuple[str, str, str]:
        """a, b and a + b as people write them, at the fixed width of data.zero_pad (`005`, `017`, `0022`)."""
        return str(a).zfill(self.width), str(b).zfill(self.width), str(a + b).zfill(self.width + 1 if self.width else 0)

    def problem(self, index: int) -> tuple[str, str]:
        """("a+b=", "c") as people write them (the model reads and writes them reversed)."""
        a_text, b_text, answer_text = self.written(*(int(v) for v in self.pairs[index]))
        return f"{a_text}+{b_text}=", answer_text

    def read_answer(self, tokens: list[int]) -> str:
        """Generated tokens up to the end token, as people write the answer (`?` for a non-digit)."""
        digits = list(itertools.takewhile(lambda t: t != END, tokens))
        return "".join(VOCAB[t] if 0 <= t < 10 else "?" for t in digits)[::-1]

    def device_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """data.on_device: every problem once, padded to the longest (collate_fn's padding); device_batches cuts a
        micro-batch to its own longest, as collate_fn pads it."""
        self.lengths = torch.tensor([len(self[i][0]) for i in range(len(self))], dtype=torch.long)
        return self.collate_fn([self[i] for i in range(len(self))])

    def device_bytes(self) -> int:
        """device_tensors' size: inputs and targets (int64) of every problem, padded to the longest input (`a+b=`, the
        answer and its end token, less one), counted from the operands without writing a problem out."""
        if not len(self):
            return 0
        a, b = self.pairs[:, 0], self.pairs[:, 1]
        answer = self.width + 1 if self.width else 0
        longest = _digits(a, self.width) + _digits(b, self.width) + _digits(a + b, answer) + 2
        return 2 * len(self) * int(longest.max()) * 8

    def device_batches(self, tensors, order: torch.Tensor, batch_size: int, epoch: int, seed: int, rows=None):
        """The micro-batches of `order` (this rank's epoch, on the host; `rows`: their problems where a debug subset
        names them) from the device's rows: one gather a tensor an epoch, then views cut to each micro-batch's
        longest (read from the host's lengths: no wait on the GPU)."""
        rows = order if rows is None else rows
        inputs, targets = (t[rows.to(t.device, non_blocking=True)] for t in tensors)
        longest = [int(n.max()) for n in self.lengths[rows].split(batch_size)]
        for x, y, n in zip(inputs.split(batch_size), targets.split(batch_size), longest, strict=True):
            yield x[:, :n], y[:, :n]

    @staticmethod
    def collate_fn(batch):
        """Pad to the batch's longest sequence: inputs with PAD, targets with IGNORE."""
        length = max((len(x) for x, _ in batch), default=1)
        inputs = torch.full((len(batch), length), PAD, dtype=torch.long)
        targets = torch.full((len(batch), length), IGNORE, dtype=torch.long)
        for row, (x, y) in enumerate(batch):
            inputs[row, : len(x)], targets[row, : len(y)] = x, y
        return inputs, targets


def _digits(numbers: np.ndarray, width: int) -> np.ndarray:
    """How many characters each number is written with, at least `width` (zfill's leading zeros)."""
    return np.maximum(np.char.str_len(numbers.astype(str)), width)


def operand_lengths(inputs: torch.Tensor) -> torch.Tensor:
    """(B, 2) digits of a and b, read from input rows (`a+b=...`, operands reversed): each operand's digits up to
    its last nonzero one (0 has one), so the zeros of data.zero_pad do not count."""
    plus = (inputs == VOCAB.index("+")).int().argmax(dim=1, keepdim=True)
    equals = (inputs == VOCAB.index("=")).int().argmax(dim=1, keepdim=True)
    position = torch.arange(inputs.shape[1], device=inputs.device).expand_as(inputs)
    nonzero = (inputs >= 1) & (inputs <= 9)
    in_a, in_b = position < plus, (position > plus) & (position < equals)
    last_a = torch.where(nonzero & in_a, position, 0).amax(dim=1, keepdim=True)
    last_b = torch.where(nonzero & in_b, position - plus, 1).amax(dim=1, keepdim=True)
    return torch.cat([last_a + 1, last_b], dim=1)


def _population(digits: int) -> tuple[int, int]:
    """[low, high) of the numbers with this many digits (0 counts as one digit)."""
    return (0 if digits == 1 else 10 ** (digits - 1)), 10**digits


def splits(
    max_digits: int = 3,
    num_train: int = 20000,
    num_val: int = 1800,
    block_size: int | None = None,
    num_test: int = 0,
    zero_pad: bool = False,
) -> tuple[Problems, Problems, Problems]:
    """Disjoint train/val/test problems, each stratified by operand-length pair, independent of the
    seed. Val's and test's shares are reserved first (each at most half of what a pair has left, so
    a small pair such as 1+1 has problems in both), training takes its share of the rest.
    `block_size` (the model's context, data.block_size): refused when the longest problem is longer.
    `zero_pad`: every operand written with max_digits digits and every answer with max_digits + 1."""
    if not (isinstance(max_digits, int) and 1 <= max_digits <= 6):
        raise ConfigError(f"data.max_digits={max_digits} must be an integer from 1 to 6")
    if block_size is not None and block_size < longest_input(max_digits):
        raise ConfigError(
            f"data.block_size={block_size} is shorter than the longest problem of data.max_digits={max_digits} "
            f"({longest_input(max_digits)} tokens)"
        )
    for key, value in (("data.num_train", num_train), ("data.num_val", num_val), ("data.num_test", num_test)):
        if not isinstance(value, int) or value < 0:
            raise ConfigError(f"{key}={value} must be an integer >= 0")
    lengths = list(itertools.product(range(1, max_digits + 1), repeat=2))
    sizes = [np.prod([np.subtract(*_population(n)[::-1]) for n in pair]) for pair in lengths]
    if num_train + num_val + num_test > sum(sizes):
        raise ConfigError(
            f"data.num_train + data.num_val + data.num_test = {num_train + num_val + num_test} exceeds the "
            f"{sum(sizes)} problems with up to data.max_digits={max_digits} digits"
        )
    val = _shares(num_val, sizes, [s // 2 for s in sizes])
    test = _shares(num_test, sizes, [(s - v) // 2 for s, v in zip(sizes, val, strict=True)])
    train = _shares(num_train, sizes, [s - v - t for s, v, t in zip(sizes, val, test, strict=True)])
    rng = np.random.default_rng(_SPLIT_SEED)
    parts: dict[str, list[np.ndarray]] = {"train": [], "val": [], "test": []}
    for (da, db), size, n_val, n_test, n_train in zip(lengths, sizes, val, test, train, strict=True):
        (a_low, a_high), (b_low, _) = _population(da), _population(db)
        chosen = rng.choice(int(size), size=n_val + n_test + n_train, replace=False)  # distinct: disjoint splits
        a, b = a_low + chosen % (a_high - a_low), b_low + chosen // (a_high - a_low)
        pairs = np.stack([a, b], axis=1)
        parts["val"].append(pairs[:n_val])
        parts["test"].append(pairs[n_val : n_val + n_test])
        parts["train"].append(pairs[n_val + n_test :])
    width = max_digits if zero_pad else 0
    train_set, val_set, test_set = (Problems(np.concatenate(parts[name]), width) for name in ("train", "val", "test"))
    return train_set, val_set, test_set


def _shares(total: int, sizes: list[int], caps: list[int]) -> list[int]:
    """`total` split as evenly as the caps allow over the strata (the small ones fill up first)."""
    shares, left = [0] * len(sizes), total
    for count, i in enumerate(sorted(range(len(sizes)), key=lambda i: caps[i])):
        shares[i] = min(caps[i], left // (len(sizes) - count))
        left -= shares[i]
    return shares
