"""data=shards' global orders (trainkit/data/shards.py's docstring says what they are and why): a shard set's order with
shard locality (`local_order`), and a weighted mixture's (`Mixture`: the counts of each source per global window,
`apportion`, and its sources' streams interleaved). Functions of (seed, epoch, ...) alone: never of the world size,
K or the micro-batch."""

import math
from collections import OrderedDict
from fractions import Fraction
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from trainkit.rng import _mix  # splitmix64 over a tuple: unrelated 63-bit seeds for distinct tuples, ~0.6 us a value

_SHARDS, _WINDOW, _INTERLEAVE = 0x7368617264, 0x77696E646F77, 0x6D6978  # "shard", "window", "mix": unrelated seeds


def shard_permutation(shards: int, key: tuple[int, ...]) -> torch.Tensor:
    generator = torch.Generator().manual_seed(_mix(_SHARDS, *key))
    return torch.randperm(shards, generator=generator)


def local_order(cumulative: np.ndarray, window: int, key: tuple[int, ...]) -> torch.Tensor:
    """A split's order with shard locality (the module's docstring): its shards permuted from `key` ((seed, epoch);
    a mixture's source: (seed, source, source epoch)), the samples of each window of `window` shards permuted from
    (key, window). ~20 ms for 1e6 samples in 250 shards, as much as one randperm of them (one randperm a window)."""
    counts = torch.from_numpy(np.diff(cumulative))
    if len(counts) == 0:
        return torch.zeros(0, dtype=torch.int64)
    permuted = shard_permutation(len(counts), key)
    counts, starts = counts[permuted], torch.from_numpy(cumulative[:-1])[permuted]
    ends = torch.cumsum(counts, 0)
    # each sample's index: its shard's first index, plus its place in that shard
    order = torch.arange(int(cumulative[-1])) + torch.repeat_interleave(starts - (ends - counts), counts)
    generator = torch.Generator()
    first = 0
    for j, last in enumerate(ends[window - 1 :: window].tolist() + ([int(ends[-1])] if len(ends) % window else [])):
        generator.manual_seed(_mix(_WINDOW, *key, j))
        order[first:last] = order[first:last][torch.randperm(last - first, generator=generator)]
        first = last
    return order


class Joined(Dataset):
    """Data sets one after the other (a mixture's val and test: its sources' splits concatenated)."""

    draws_random = False

    def __init__(self, parts: list[Any]):
        self.parts = parts
        self.offsets = np.concatenate([[0], np.cumsum([len(p) for p in parts])]).astype(np.int64)
        if parts and hasattr(parts[0], "collate_fn"):
            self.collate_fn = parts[0].collate_fn

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, index: int):
        if not 0 <= index < len(self):
            raise IndexError(index)
        part = int(np.searchsorted(self.offsets, index, side="right")) - 1
        return self.parts[part][index - int(self.offsets[part])]


# --- a weighted mixture ----------------------------------------------------------------------------------------------


def integer_weights(weights: list[float]) -> tuple[list[int], int]:
    """(a_i, D) with a_i / D the normalised weights, exactly (each weight read as a fraction of denominator <= 1e6):
    the counts are integer arithmetic, the same on every machine."""
    fractions = [Fraction(w).limit_denominator(10**6) for w in weights]
    total = sum(fractions)
    shares = [f / total for f in fractions]
    denominator = math.lcm(*(s.denominator for s in shares))
    return [int(s * denominator) for s in shares], denominator


def apportion(shares: list[int], denominator: int, drawn: int, before: list[int]) -> list[int]:
    """Cumulative counts after `drawn` samples: each source's floor or ceil of shares_i x drawn / denominator (the
    largest remainders take the ceils, ties to the first source), none below `before` (a count never decreases);
    where that cannot sum to `drawn` (a source's share of a window under one sample), the sources at their floor with
    the smallest remainders give one more back."""
    floors = [a * drawn // denominator for a in shares]
    remainders = [a * drawn % denominator for a in shares]
    counts = [max(f, b) for f, b in zip(floors, before, strict=True)]
    left = drawn - sum(counts)
    at_floor = [i for i in range(len(shares)) if counts[i] == floors[i]]
    if left >= 0:
        for i in sorted((i for i in at_floor if remainders[i]), key=lambda i: (-remainders[i], i))[:left]:
            counts[i] += 1
    else:
        for i in sorted((i for i in at_floor if counts[i] > before[i]), key=lambda i: (remainders[i], i))[:-left]:
            counts[i] -= 1
    return counts


class Mixture(Dataset):
    """The train split of `data.sources` (trainkit/data/shards.py's docstring), of the sources' train splits (`parts`,
    shards.ShardSplit): `len` the epoch's sample budget, an index the source's offset plus its local index."""

    identity: dict = {}
    files: dict[str, str] = {}
    summary = ""
    no_test: str | None = None

    def __init__(self, names: list[str], parts: list[Any], weights: list[float], epoch_samples: int | None):
        self.names, self.parts, self.weights = names, parts, weights
        self.offsets = np.concatenate([[0], np.cumsum([len(p) for p in parts])]).astype(np.int64)
        self.samples = int(epoch_samples) if epoch_samples is not None else int(self.offsets[-1])
        self.shares, self.denominator = integer_weights(weights)
        self.draws_random = parts[0].draws_random
        if hasattr(parts[0], "collate_fn"):
            self.collate_fn = parts[0].collate_fn
        for i, part in enumerate(parts):
            part.order_key = (i,)
        self.reads_remotely = any(p.remote for p in parts)
        self._tables: dict[int, tuple[np.ndarray, int]] = {}  # global batch: (cumulative counts, windows filled)
        self._streams: OrderedDict[tuple, torch.Tensor] = OrderedDict()

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, index: int):
        part = int(np.searchsorted(self.offsets, index, side="right")) - 1
        if not 0 <= part < len(self.parts):
            raise IndexError(index)
        return self.parts[part][index - int(self.offsets[part])]

    def windows(self, global_batch: int) -> int:
        return -(-self.samples // global_batch)

    def cumulative(self, global_batch: int, upto: int) -> np.ndarray:
        """[window g, source]: the samples of each source drawn by the first g global windows, for g <= upto (numpy,
        computed from g = 0 once and extended: apportion's ~4 us a window)."""
        table, filled = self._tables.get(global_batch, (np.zeros((1, len(self.parts)), dtype=np.int64), 0))
        if upto > filled:
            grown = np.zeros((max(upto + 1, 2 * len(table)), len(self.parts)), dtype=np.int64)
            grown[: filled + 1] = table[: filled + 1]
            per_epoch, before = self.windows(global_batch), grown[filled].tolist()
            for g in range(filled + 1, upto + 1):
                epochs, w = divmod(g, per_epoch)  # g windows drawn: whole epochs and w windows of the next
                drawn = epochs * self.samples + min(w * global_batch, self.samples)
                before = apportion(self.shares, self.denominator, drawn, before)
                grown[g] = before
            table, filled = grown, upto
            self._tables[global_batch] = table, filled
        return table[: upto + 1]

    def _stream(self, seed: int, source: int, first: int, end: int) -> torch.Tensor:
        """Samples [first, end) of source's endless stream of its own epochs, as global indices."""
        part, size = self.parts[source], len(self.parts[source])
        pieces = []
        for epoch in range(first // size, (end - 1) // size + 1 if end > first else first // size):
            key = (seed, source, epoch)
            if key not in self._streams:
                self._streams[key] = local_order(part.cumulative, part.window, key)
                if len(self._streams) > 4 * len(self.parts):
                    self._streams.popitem(last=False)
            pieces.append(self._streams[key])
        start = (first // size) * size
        joined = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)
        return joined[first - start : end - start] + int(self.offsets[source])

    def epoch_order(self, seed: int, epoch: int, global_batch: int) -> torch.Tensor:
        """The epoch's `samples` global indices: window g = epoch x windows + w takes each source's next counts from
        its stream, interleaved by a permutation of (seed, g)."""
        per_epoch = self.windows(global_batch)
        g0 = epoch * per_epoch
        counts = self.cumulative(global_batch, g0 + per_epoch)[g0:]
        for i, part in enumerate(self.parts):  # where each source's stream stands: its readers' prefetching
            part.hint.copy_(torch.tensor([int(part.hint[0]) + 1, seed, int(counts[0, i]) // len(part)]))
        streams = [self._stream(seed, i, int(counts[0, i]), int(counts[-1, i])) for i in range(len(self.parts))]
        drawn = (counts - counts[0]).tolist()
        generator, windows = torch.Generator(), []
        for w in range(per_epoch):
            window = torch.cat([s[drawn[w][i] : drawn[w + 1][i]] for i, s in enumerate(streams)])
            generator.manual_seed(_mix(_INTERLEAVE, seed, g0 + w))
            windows.append(window[torch.randperm(len(window), generator=generator)])
        return torch.cat(windows)

    def row(self, epoch: int, windows: int, global_batch: int) -> dict[str, float]:
        """data/<source>: each source's samples drawn (all ranks) after `windows` windows of `epoch`."""
        g = epoch * self.windows(global_batch) + windows
        counts = self.cumulative(global_batch, g)[g]
        return {f"data/{name}": float(c) for name, c in zip(self.names, counts.tolist(), strict=True)}
