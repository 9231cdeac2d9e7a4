"""data=pydoc_text: CPython's own reference documentation as a character corpus, embedded (no download).

Every Python installation ships `pydoc_data.topics` (what `help("for")` prints): 79 documents of
real English prose and code, 465k characters under Python 3.11. Documents are taken in the order of
their names; the split is by document, fixed and seed-independent: in the order of the SHA-256 of
their names, a document joins the validation split while that split stays within 10 % of the
characters (20 of 79 documents, 10.0 % of the characters under 3.11), then another the test split
while that stays within 10 % (of the documents left); the rest train.

A sample is a block of `block_size` input characters and the `block_size` characters that follow
each (next-character targets). A block never crosses its document's end: one that reaches it is
shorter, its inputs padded with PAD and its targets with IGNORE, so padding bears no loss and a
batch's loss-bearing characters vary (the lm task normalises over them exactly). The val blocks tile
each document (each target character exactly once: its first character is never a target); the
train blocks start at random positions in their document (RandomBlocks, data.random_offsets) or
tile it too.

The vocabulary is the corpus's characters in sorted order, then PAD. It is written into the run dir
(`vocab.json`), so predict.py encodes prompts and decodes samples without the corpus; the corpus's
checksum goes into the checkpoint identity (a resume under a Python whose corpus differs is refused).

With `data.tokenizer` (a folder or a Hub id: trainkit/data/tokenizer.py) the documents are that tokenizer's tokens
instead: each `BOS ids EOS` where it has them, blocks padded with its pad id (else EOS), `data.vocab_size` its
len(), val/acc per token and no bits per character (`data.per_token`). `data.train_tokenizer=N` makes the folder
where it does not exist: a byte-level BPE of N ids trained on the train documents (rank 0 first: heldout.load), with
<s>, </s> and <pad>. The run dir gets the tokenizer's files (tokenizer/) instead of vocab.json, the checkpoint
identity its SHA-256.
"""

import functools
import hashlib
import json
import math
import platform
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import MISSING, OmegaConf
from torch.utils.data import Dataset

from trainkit.data import tokenizer as hf_tokenizer
from trainkit.data.addition import IGNORE
from trainkit.errors import ConfigError
from trainkit.loading import InMemory
from trainkit.rng import sample_seed
from trainkit.schema import Data

VOCAB_FILE = "vocab.json"  # in the run dir
VAL_SHARE = 0.1  # at most this share of the characters is held out for validation
TEST_SHARE = 0.1  # and at most this share, of other documents, for the test split


@dataclass
class Splits:
    _target_: str = MISSING
    block_size: int = MISSING
    random_offsets: bool = MISSING
    tokenizer: str | None = None
    train_tokenizer: int | None = None


@dataclass
class Schema(Data):
    """conf/data/pydoc_text.yaml's keys and their types."""

    splits: Splits = field(default_factory=Splits)
    vocab_size: int = MISSING
    block_size: int = MISSING
    random_offsets: bool = True  # train blocks start at random positions in their document
    tokenizer: str | None = None  # a Hugging Face tokenizer's folder or Hub id; null: the characters
    train_tokenizer: int | None = None  # N: where data.tokenizer's folder is missing, train a byte-level BPE of N ids
    per_character: bool = True  # task=lm: val/acc per character, and val/bpc
    per_token: bool = False  # task=lm: val/acc per token (data.tokenizer's)


@dataclass(frozen=True)
class Vocabulary:
    """Characters in sorted order; the id after the last character is the padding token."""

    chars: str

    @property
    def pad(self) -> int:
        return len(self.chars)

    @property
    def size(self) -> int:
        return len(self.chars) + 1

    def encode(self, text: str) -> list[int]:
        index = {c: i for i, c in enumerate(self.chars)}
        return [index[c] for c in text]

    def decode(self, tokens) -> str:
        return "".join(self.chars[t] for t in tokens if 0 <= t < len(self.chars))

    def unknown(self, text: str) -> str:
        """The distinct characters of `text` that are not in the vocabulary, in order of appearance."""
        return "".join(dict.fromkeys(c for c in text if c not in self.chars))

    def to_json(self, source: str) -> str:
        return json.dumps({"chars": self.chars, "pad": self.pad, "source": source}, indent=1) + "\n"

    @classmethod
    def load(cls, run_dir: Path) -> "Vocabulary | None":
        """The vocabulary a text run trained with, or None for a run without one."""
        path = Path(run_dir) / VOCAB_FILE
        return cls(json.loads(path.read_text())["chars"]) if path.is_file() else None


@functools.cache
def documents() -> dict[str, str]:
    """{name: text} of the running Python's pydoc_data.topics, in the order of the names."""
    from pydoc_data.topics import topics

    return {name: topics[name] for name in sorted(topics)}


def source() -> str:
    return f"pydoc_data.topics of Python {platform.python_version()}"


def checksum(docs: dict[str, str]) -> str:
    digest = hashlib.sha256()
    for name, text in docs.items():
        digest.update(f"{name}\0{text}\0".encode())
    return digest.hexdigest()


@functools.cache
def vocabulary() -> Vocabulary:
    return Vocabulary("".join(sorted(set("".join(documents().values())))))


def vocab_size(tokenizer: str | None = None, train_tokenizer: int | None = None) -> int:
    """${pydoc_vocab_size:${data.tokenizer},${data.train_tokenizer}} (data.vocab_size): the corpus's characters and the
    padding token; with a tokenizer its len(); one still to train (data.train_tokenizer): the size asked for (splits
    refuses a corpus that gives another)."""
    if tokenizer is None:
        return vocabulary().size
    if train_tokenizer is not None and not Path(str(tokenizer)).is_dir():
        return train_tokenizer
    return hf_tokenizer.size(hf_tokenizer.load(tokenizer))


def split_names(docs: dict[str, str]) -> tuple[list[str], list[str], list[str]]:
    """(train, val, test) document names, each in corpus order: fixed by the names and lengths alone.
    In the order of the names' SHA-256, a document joins val while val stays within VAL_SHARE of the
    characters (the val documents of before the test split existed), then, of the documents left, test
    while it stays within TEST_SHARE; the rest train."""
    budget = {"val": VAL_SHARE * sum(map(len, docs.values())), "test": TEST_SHARE * sum(map(len, docs.values()))}
    held: dict[str, set[str]] = {"val": set(), "test": set()}
    ordered = sorted(docs, key=lambda n: hashlib.sha256(n.encode()).hexdigest())
    for split in ("val", "test"):
        total = 0
        for name in ordered:
            if name not in held["val"] and total + len(docs[name]) <= budget[split]:
                held[split].add(name)
                total += len(docs[name])
    kept = held["val"] | held["test"]
    return (
        [n for n in docs if n not in kept],
        [n for n in docs if n in held["val"]],
        [n for n in docs if n in held["test"]],
    )


class _Split:
    """What train.py records of a data set beyond its config (set on the train split): `identity`
    (into the checkpoint identity), `files` (written into the run dir) and `summary` (printed once).
    `names`: the split's documents, in corpus order; `characters`: theirs in all."""

    identity: dict = {}
    files: dict[str, str] = {}
    summary = ""
    names: list[str]
    characters: int


class Blocks(_Split, InMemory):
    """(inputs, targets) blocks that tile each document of one split, as two (N, block_size) long
    tensors (in memory: TrainLoader indexes them a batch at a time)."""

    def __init__(
        self, docs: dict[str, str], names: list[str], vocab: "Vocabulary | hf_tokenizer.Documents", block_size: int
    ):
        inputs, targets = [], []
        for name in names:
            tokens = torch.tensor(vocab.encode(docs[name]))
            predicted = len(tokens) - 1  # every character but the first is a target once
            padded = math.ceil(predicted / block_size) * block_size
            x = torch.full((padded,), vocab.pad)
            y = torch.full((padded,), IGNORE)
            x[:predicted], y[:predicted] = tokens[:-1], tokens[1:]  # the tail of the last block: padding
            inputs.append(x.view(-1, block_size))
            targets.append(y.view(-1, block_size))
        super().__init__(torch.cat(inputs), torch.cat(targets))
        self.names, self.characters = names, sum(len(docs[n]) for n in names)


class RandomBlocks(_Split, Dataset):
    """A split sampled as nanoGPT samples, but inside documents (data.random_offsets=true, the
    train split): a document has as many samples as it has tiles (Blocks), each a block that starts
    at a position drawn uniformly from the document and is padded where it reaches the document's
    end. The position comes from torch's generator, which TrainLoader seeds from (seed, epoch,
    sample index): the same blocks on any allocation, and new ones every epoch. Fixed tiles saw the
    same blocks every epoch and ended 0.022 nats per character higher (a nanoGPT loop on this split,
    2000 steps of +experiment=pydoc_gpt)."""

    draws_random = True  # the start: SeededBatches seeds it per sample

    def __init__(
        self, docs: dict[str, str], names: list[str], vocab: "Vocabulary | hf_tokenizer.Documents", block_size: int
    ):
        self.tokens = [torch.tensor(vocab.encode(docs[name])) for name in names]
        self.owner = [d for d, t in enumerate(self.tokens) for _ in range(math.ceil((len(t) - 1) / block_size))]
        self.block_size, self.pad = block_size, vocab.pad
        self.names, self.characters = names, sum(len(docs[n]) for n in names)

    def __len__(self) -> int:
        return len(self.owner)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = self.tokens[self.owner[index]]
        start = int(torch.randint(len(tokens) - 1, ()))  # at least one target
        piece = tokens[start : start + self.block_size + 1]
        x, y = torch.full((self.block_size,), self.pad), torch.full((self.block_size,), IGNORE)
        x[: len(piece) - 1], y[: len(piece) - 1] = piece[:-1], piece[1:]
        return x, y

    def device_tensors(self) -> tuple[torch.Tensor]:
        """data.on_device: the split's documents as one stream."""
        return (torch.cat(self.tokens),)

    def device_bytes(self) -> int:
        return sum(len(t) for t in self.tokens) * 8

    def device_batches(self, tensors, order: torch.Tensor, batch_size: int, epoch: int, seed: int, rows=None):
        """The blocks of `order` (this rank's epoch; `rows`: their blocks where a debug subset names them) from the
        stream on the device, each start drawn as __getitem__ draws it under the loader's seeding (torch's generator
        seeded from (seed, epoch, index)): on the host once an epoch, then each micro-batch one gather, padded where
        its document ends, as __getitem__ pads."""
        (stream,) = tensors
        lengths = torch.tensor([len(t) for t in self.tokens])
        owners = torch.tensor(self.owner)[order if rows is None else rows]
        generator, starts = torch.Generator(), []
        for i, owner in zip(order.tolist(), owners.tolist(), strict=True):
            generator.manual_seed(sample_seed(seed, epoch, i))
            starts.append(int(torch.randint(int(lengths[owner]) - 1, (), generator=generator)))
        begun = torch.tensor(starts, dtype=torch.long)
        first = (lengths.cumsum(0) - lengths)[owners] + begun  # each block's first token in the stream
        room = lengths[owners] - begun - 1  # its targets before the document ends (at most block_size are kept)
        first, room = first.to(stream.device, non_blocking=True), room.to(stream.device, non_blocking=True)
        j = torch.arange(self.block_size, device=stream.device)
        for at, count in zip(first.split(batch_size), room.split(batch_size), strict=True):
            inside = j < count[:, None]
            where = (at[:, None] + j).clamp(max=len(stream) - 2)  # past a document's end: replaced below
            x = torch.where(inside, stream[where], self.pad)
            yield x, torch.where(inside, stream[where + 1], IGNORE)


def is_text_run(run_cfg) -> bool:
    """A run trained on this module's corpus (its run dir should hold the vocabulary)."""
    return run_cfg.data.get("splits", {}).get("_target_") == f"{__name__}.splits"


def splits(
    block_size: int = 64, random_offsets: bool = True, tokenizer: str | None = None, train_tokenizer: int | None = None
) -> tuple[Blocks | RandomBlocks, Blocks, Blocks]:
    """The train, val and test blocks of the running Python's corpus (train: RandomBlocks, or tiles
    where not `random_offsets`; val and test: always every character once, in tiles); the train split
    carries the corpus's checksum (`identity`), the vocabulary (`files`) and the splits' document names
    (`summary`). The vocabulary is the whole corpus's, so it covers the held-out documents too. With `tokenizer`:
    its tokens (trained first on the train documents where `train_tokenizer` asks and its folder is missing:
    heldout.load runs this on rank 0 first, the other ranks then load the folder)."""
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 2:
        raise ConfigError(f"data.block_size={block_size} must be an integer >= 2")
    docs = documents()
    train_names, val_names, test_names = split_names(docs)
    vocab: Vocabulary | hf_tokenizer.Documents = vocabulary()
    digest = checksum(docs)
    identity = {"data.corpus": {"sha256": digest, "source": source()}}  # compared by sha256 alone
    files, words = {VOCAB_FILE: vocabulary().to_json(source())}, f"vocabulary {vocab.size}"
    if tokenizer is not None:
        hf = _tokenizer(tokenizer, train_tokenizer, [docs[name] for name in train_names])
        vocab, sha = hf_tokenizer.Documents(hf), hf_tokenizer.sha256(hf)
        identity["data.tokenizer"] = {"sha256": sha, "source": f"data.tokenizer={tokenizer}"}
        files, words = hf_tokenizer.files(hf), f"tokenizer {tokenizer} ({vocab.size} ids, sha256 {sha[:12]})"
    train = (RandomBlocks if random_offsets else Blocks)(docs, train_names, vocab, block_size)
    val, test = (Blocks(docs, names, vocab, block_size) for names in (val_names, test_names))
    train.identity, train.files = identity, files
    train.summary = (
        f"data: {source()} (sha256 {digest[:12]}), {len(docs)} documents, "
        f"{sum(map(len, docs.values())):,} characters, {words}; train {len(train_names)} documents "
        f"({train.characters:,} characters), val {len(val_names)} ({val.characters:,}): {', '.join(val_names)}; "
        f"test {len(test_names)} ({test.characters:,}): {', '.join(test_names)}"
    )
    return train, val, test


def _tokenizer(name: str, train_tokenizer: int | None, train_texts: list[str]):
    """data.tokenizer's tokenizer; where data.train_tokenizer asks and its folder is missing, trained on the train
    documents first (refused where the corpus gives another size than asked: data.vocab_size said that size)."""
    if train_tokenizer is not None and not Path(name).is_dir():
        return hf_tokenizer.train(train_texts, train_tokenizer, Path(name))
    return hf_tokenizer.load(name)


# ${pydoc_vocab_size:${data.tokenizer},${data.train_tokenizer}} (conf/data/pydoc_text.yaml): the running Python's
# corpus's characters and the padding token, or the tokenizer's ids. ${pydoc_vocab_size:} (a run's config of before
# data.tokenizer) is the characters'.
OmegaConf.register_new_resolver("pydoc_vocab_size", vocab_size, replace=True)
# data.per_character, data.per_token: characters without a tokenizer, tokens with one
OmegaConf.register_new_resolver("pydoc_per_character", lambda tokenizer: tokenizer is None, replace=True)
OmegaConf.register_new_resolver("pydoc_per_token", lambda tokenizer: tokenizer is not None, replace=True)


def check(cfg) -> None:
    """data.tokenizer and data.train_tokenizer: a tokenizer that loads (a folder, or a Hub id in the cache), or one
    to train into a missing folder; a folder already there of another size than train_tokenizer asks is refused
    (a stale tokenizer would train silently); its tokens are no characters (no val/bpc)."""
    name, trained = cfg.data.get("tokenizer"), cfg.data.get("train_tokenizer")
    if name is None:
        if trained is not None:
            raise ConfigError(f"data.train_tokenizer={trained} needs data.tokenizer=<folder>: where it is saved")
        return
    if cfg.data.get("per_character"):
        raise ConfigError(f"data.per_character=true: data.tokenizer={name}'s tokens are no characters (data.per_token)")
    if trained is None or Path(str(name)).is_dir():
        held = hf_tokenizer.size(hf_tokenizer.load(name))
        if trained is not None and held != trained:
            raise ConfigError(
                f"data.tokenizer={name} holds a tokenizer of {held} ids, data.train_tokenizer={trained}: remove the "
                "folder to train it again, or set data.train_tokenizer=null to use it"
            )
    elif trained < hf_tokenizer.MIN_TRAINED:
        raise ConfigError(
            f"data.train_tokenizer={trained} must be >= {hf_tokenizer.MIN_TRAINED} (256 bytes, 3 special tokens)"
        )


def check_run(run_dir: Path, run_cfg) -> None:
    """Before eval.py or predict.py rebuild a finished run's split: it is this Python's corpus only where the
    run's vocabulary is this Python's (the documentation differs between Python versions)."""
    vocab = Vocabulary.load(run_dir)
    if vocab is not None and vocab != vocabulary():
        raise ConfigError(f"run_dir={run_dir}: its {VOCAB_FILE} is not this Python's corpus's vocabulary")
    ran = hf_tokenizer.Prompts.load(run_dir)  # a run through a tokenizer: data.tokenizer must still be that one
    name = run_cfg.data.get("tokenizer")
    here = hf_tokenizer.load(name) if ran is not None and name is not None and Path(str(name)).is_dir() else None
    if here is not None and ran is not None and hf_tokenizer.sha256(here) != hf_tokenizer.sha256(ran.tokenizer):
        raise ConfigError(f"run_dir={run_dir}: data.tokenizer={name} is not the tokenizer it trained with")
