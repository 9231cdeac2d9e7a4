"""data=tokens: a tokenized corpus on disk, of any size (scripts/prepare_text.py writes it), read with np.memmap.

`data.root` holds train.bin, val.bin, test.bin (token ids, np.uint16, or uint32 past 65535 ids; each
document followed by the end-of-text token), tokenizer.json and meta.json (prepare_text.py). The split
is by document and fixed when the corpus is prepared (a seeded permutation of the sorted file list).
The .bin files are memory-mapped: a corpus larger than memory trains alike. The train split is read whole (int64, 4x a
uint16 .bin, a copy per rank) only where it goes to the device (data.on_device; auto: where it fits, false: never).

A train sample is a block of `block_size` tokens and the `block_size` tokens that follow each, at a
position drawn uniformly from the whole split (nanoGPT's sampling: a block may cross a document's
end-of-text token, which it learns to predict). The position comes from torch's generator, which
TrainLoader seeds per (seed, epoch, sample index): the same blocks on any world size and after a
resume. An epoch has (tokens - 1) // block_size samples (as many blocks as tile the split: "one epoch"
then sees about every token once). val and test tile their split: each token but the first is a
target exactly once, the last tile padded (input end-of-text, target IGNORE: no loss).

The tokenizer: `bytes` (UTF-8 bytes, ids 0-255, end-of-text 256), a byte-level BPE trained with HF
`tokenizers` (end-of-text id 0), or `hf`: a Hugging Face tokenizer (prepare_text.py --tokenizer <folder or Hub id>;
its save_pretrained files beside meta.json, each document `BOS ids EOS` where it has them: trainkit/data/tokenizer.py;
meta.json's `eot` its EOS, null without one, `bos` its BOS). meta.json's sha256 of train.bin and of tokenizer.json
go into the checkpoint identity: a resume on another corpus or another tokenizer file is refused (BPE training is
not guaranteed identical across runs: the saved file's hash is the identity, not its settings). The
run dir gets copies of meta.json and tokenizer.json, so predict.py samples without the corpus.
"""

import functools
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from omegaconf import MISSING, OmegaConf
from torch.utils.data import Dataset

from trainkit.data.addition import IGNORE
from trainkit.errors import ConfigError
from trainkit.rng import sample_seed
from trainkit.schema import Data

META_FILE, TOKENIZER_FILE = "meta.json", "tokenizer.json"  # in data.root, and copied into the run dir
SPLITS = ("train", "val", "test")
EOT_TEXT = "<|endoftext|>"  # the BPE's end-of-text token (id 0)
BYTES_EOT = 256  # the bytes tokenizer's end-of-text id


@dataclass
class Splits:
    _target_: str = MISSING
    root: str = MISSING
    block_size: int = MISSING
    random_offsets: bool = MISSING


@dataclass
class Schema(Data):
    """conf/data/tokens.yaml's keys and their types."""

    splits: Splits = field(default_factory=Splits)
    root: str = MISSING  # scripts/prepare_text.py's --out
    vocab_size: int = MISSING
    block_size: int = MISSING
    random_offsets: bool = True
    per_token: bool = True  # task=lm: val/acc per token (no val/bpc: a BPE token is no character)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


class Codec:
    """A corpus's tokenizer: encode / decode text, its vocabulary size and end-of-text id (`eot`: also the tiles'
    padding input; a Hugging Face tokenizer without EOS: its pad id, `pad`). Also what trainkit/tasks/lm_predict.py
    asks of a vocabulary (`pad`: the first id never drawn; `unknown`: nothing, the tokenizers encode any text). `bos`
    (kind hf): the id a prompt starts with, as each document does."""

    KINDS = ("bytes", "bpe", "hf")

    def __init__(self, kind: str, tokenizer_json: str | None = None, meta: dict | None = None):
        self.kind, self.bos = kind, None
        if kind == "bytes":
            self.size, self.eot, self._bpe = BYTES_EOT + 1, BYTES_EOT, None
        elif kind in ("bpe", "hf"):
            from tokenizers import Tokenizer

            self._bpe = Tokenizer.from_str(tokenizer_json or "")
            eot = self._bpe.token_to_id(EOT_TEXT) if kind == "bpe" else (meta or {}).get("eot")
            if kind == "hf":
                eot = (meta or {}).get("pad", 0) if eot is None else eot
                self.bos = (meta or {}).get("bos")
            if eot is None:
                raise ConfigError(f"{TOKENIZER_FILE} has no {EOT_TEXT} token: prepare it with scripts/prepare_text.py")
            self.size, self.eot = self._bpe.get_vocab_size(), eot
        else:
            raise ConfigError(f"tokenizer={kind} must be one of: {', '.join(self.KINDS)}")

    @property
    def pad(self) -> int:
        return self.size  # no padding token: every id may be drawn

    def encode(self, text: str) -> list[int]:
        if self._bpe is None:
            return list(text.encode("utf-8"))
        first = [] if self.bos is None else [self.bos]
        return first + self._bpe.encode(text, add_special_tokens=False).ids

    def decode(self, tokens) -> str:
        if self._bpe is None:
            return bytes(t for t in tokens if 0 <= t < 256).decode("utf-8", errors="replace")
        return self._bpe.decode([t for t in tokens if t != self.eot], skip_special_tokens=True)

    def unknown(self, text: str) -> str:
        return ""

    @classmethod
    def load(cls, folder: Path) -> "Codec | None":
        """The tokenizer of a corpus or of a run dir that holds its meta.json, else None."""
        meta_path = Path(folder) / META_FILE
        if not meta_path.is_file():
            return None
        meta = json.loads(meta_path.read_text())
        tokenizer = Path(folder) / TOKENIZER_FILE
        return cls(meta["tokenizer"], tokenizer.read_text() if meta["tokenizer"] != "bytes" else None, meta)


def is_tokens_run(run_cfg) -> bool:
    return run_cfg.data.get("splits", {}).get("_target_") == f"{__name__}.splits"


def read_meta(root) -> dict:
    """meta.json of `root`, one ConfigError where it or the folder is missing."""
    folder = Path(str(root))
    if not folder.is_dir():
        raise ConfigError(f"data.root={root} is not a folder: prepare one with scripts/prepare_text.py")
    path = folder / META_FILE
    if not path.is_file():
        raise ConfigError(f"data.root={root} has no {META_FILE}: prepare it with scripts/prepare_text.py")
    return json.loads(path.read_text())


def vocab_size(root) -> int:
    """${tokens_vocab_size:${data.root}} (data.vocab_size): meta.json's vocabulary size."""
    return int(read_meta(root)["vocab_size"])


def open_split(root, meta: dict, split: str) -> np.ndarray:
    """The split's tokens, memory-mapped (read-only), after checking the file's size against meta; an
    empty file (a split with no document) an empty array: numpy maps no empty file."""
    path = Path(str(root)) / f"{split}.bin"
    if not path.is_file():
        raise ConfigError(f"data.root={root} has no {split}.bin (meta.json lists it): prepare it again")
    dtype = np.dtype(meta["dtype"])
    tokens = int(meta["tokens"][split])
    if path.stat().st_size != tokens * dtype.itemsize:
        raise ConfigError(
            f"data.root={root}: {split}.bin holds {path.stat().st_size} bytes, meta.json says {tokens} tokens "
            f"of {dtype.name} ({tokens * dtype.itemsize} bytes): prepare it again"
        )
    if tokens == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=(tokens,))


def _long(piece: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(piece.astype(np.int64))


class _Split:
    """`identity`, `files`, `summary`: what train.py records of the train split (see text._Split);
    `no_test`: why the corpus has no test split (trainkit.heldout), None when it has one."""

    identity: dict = {}
    files: dict[str, str] = {}
    summary = ""
    no_test: str | None = None
    tokens: np.ndarray

    def __getstate__(self) -> dict:
        """Pickled (a spawned loader worker) as its file, re-mapped on arrival: numpy pickles a memmap's data."""
        state = self.__dict__.copy()
        if isinstance(self.tokens, np.memmap):  # else an empty split's array: pickled as it is
            state["tokens"] = (self.tokens.filename, self.tokens.dtype.str, len(self.tokens))
        return state

    def __setstate__(self, state: dict) -> None:
        if isinstance(state["tokens"], tuple):
            filename, dtype, count = state["tokens"]
            state = state | {"tokens": np.memmap(filename, dtype=np.dtype(dtype), mode="r", shape=(count,))}
        self.__dict__ |= state


class RandomBlocks(_Split, Dataset):
    """(tokens - 1) // block_size blocks per epoch, each at a start drawn from the sample's seed, a function
    of (seed, epoch, sample index) (trainkit.loading.SeededBatches: draws_random = "seed"); outside the
    train loader from torch's generator."""

    draws_random = "seed"

    def __init__(self, tokens: np.ndarray, block_size: int):
        self.tokens, self.block_size = tokens, block_size

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.block_size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._block(int(torch.randint(len(self.tokens) - self.block_size, ())))

    def seeded(self, index: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._block(seed % (len(self.tokens) - self.block_size))  # a 63-bit mixed seed: uniform enough

    def device_tensors(self) -> tuple[torch.Tensor]:
        """data.on_device: the split's token stream (int64), read whole once."""
        return (_long(np.asarray(self.tokens)),)

    def device_bytes(self) -> int:
        return len(self.tokens) * 8

    def device_batches(self, tensors, order: torch.Tensor, batch_size: int, epoch: int, seed: int, rows=None):
        """The blocks of `order` (this rank's epoch) at the starts `seeded` draws, each from its sample's seed
        (seed, epoch, index): computed on the host once an epoch, moved once, each micro-batch one gather. (`rows`,
        a debug subset's samples in the split: unused, any sample's block may start anywhere.)"""
        (tokens,) = tensors
        span = len(self.tokens) - self.block_size
        starts = torch.tensor([sample_seed(seed, epoch, i) % span for i in order.tolist()], dtype=torch.long)
        offsets = torch.arange(self.block_size + 1, device=tokens.device)
        for chunk in starts.to(tokens.device, non_blocking=True).split(batch_size):
            piece = tokens[chunk[:, None] + offsets]
            yield piece[:, :-1], piece[:, 1:]

    def _block(self, start: int) -> tuple[torch.Tensor, torch.Tensor]:  # the last start leaves 1 target
        piece = _long(self.tokens[start : start + self.block_size + 1])
        return piece[:-1], piece[1:]


class Tiles(_Split, Dataset):
    """Fixed non-overlapping blocks: every token but the first is a target once (the last tile padded)."""

    draws_random = False

    def __init__(self, tokens: np.ndarray, block_size: int, eot: int):
        self.tokens, self.block_size, self.eot = tokens, block_size, eot

    def __len__(self) -> int:
        return -(-(len(self.tokens) - 1) // self.block_size) if len(self.tokens) > 1 else 0

    def device_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """data.on_device (data.random_offsets=false): every tile at once, (inputs, targets) as __getitem__ has them."""
        predicted = max(len(self.tokens) - 1, 0)
        tokens = _long(np.asarray(self.tokens))
        x, y = torch.full((len(self) * self.block_size,), self.eot), torch.full((len(self) * self.block_size,), IGNORE)
        x[:predicted], y[:predicted] = tokens[:-1], tokens[1:]
        return x.view(-1, self.block_size), y.view(-1, self.block_size)

    def device_bytes(self) -> int:
        return 2 * len(self) * self.block_size * 8

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(index)
        start = index * self.block_size
        piece = _long(self.tokens[start : start + self.block_size + 1])
        x, y = torch.full((self.block_size,), self.eot), torch.full((self.block_size,), IGNORE)
        x[: len(piece) - 1], y[: len(piece) - 1] = piece[:-1], piece[1:]
        return x, y


@functools.cache
def _tokenizer_text(path: str, mtime: float) -> str:
    return Path(path).read_text()


def splits(root: str, block_size: int = 256, random_offsets: bool = True) -> tuple[Dataset, Dataset, Dataset | None]:
    """The train, val and test blocks of the corpus in `root` (train: random blocks, or tiles where
    not `random_offsets`); the train split carries the identity, the files and the summary. A val.bin
    without a document is an empty val split (the run trains without evaluation), a test.bin without
    one no test split (None; the train split's `no_test` says why, trainkit.heldout)."""
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 2:
        raise ConfigError(f"data.block_size={block_size} must be an integer >= 2")
    meta = read_meta(root)
    folder = Path(str(root))
    tokenizer_path = folder / TOKENIZER_FILE
    if not tokenizer_path.is_file():
        raise ConfigError(f"data.root={root} has no {TOKENIZER_FILE}: prepare it with scripts/prepare_text.py")
    tokenizer_text = _tokenizer_text(str(tokenizer_path), tokenizer_path.stat().st_mtime)
    tokenizer_sha = hashlib.sha256(tokenizer_text.encode()).hexdigest()
    if tokenizer_sha != meta["sha256"]["tokenizer"]:
        raise ConfigError(f"data.root={root}: {TOKENIZER_FILE} is not the one meta.json names (its sha256 differs)")
    codec = Codec(meta["tokenizer"], tokenizer_text if meta["tokenizer"] != "bytes" else None, meta)
    if codec.size != meta["vocab_size"]:
        raise ConfigError(
            f"data.root={root}: meta.json says vocab_size={meta['vocab_size']}, {TOKENIZER_FILE} has {codec.size}"
        )
    tokens = {split: open_split(root, meta, split) for split in SPLITS}
    if len(tokens["train"]) <= block_size:
        raise ConfigError(f"data.root={root}: train.bin's {len(tokens['train'])} tokens fill no block of {block_size}")
    train = (
        RandomBlocks(tokens["train"], block_size) if random_offsets else Tiles(tokens["train"], block_size, codec.eot)
    )
    val, test = Tiles(tokens["val"], block_size, codec.eot), Tiles(tokens["test"], block_size, codec.eot)
    if len(test) == 0:  # no document (prepare_text.py: too few files, or --test-fraction 0), or one empty file
        held = meta["documents"]["test"]
        holds = f"{held} document(s) but no token to predict" if held else "no document"
        train.no_test = f"test.bin of {root} holds {holds}"
    source = f"{folder.resolve()} ({meta['tokenizer']} tokenizer, sha256 {tokenizer_sha[:12]})"
    train.identity = {
        "data.tokens": {"sha256": meta["sha256"]["train"], "source": f"train.bin of {folder.resolve()}"},
        "data.tokenizer": {"sha256": tokenizer_sha, "source": f"{TOKENIZER_FILE} of {folder.resolve()}"},
    }
    train.files = {META_FILE: (folder / META_FILE).read_text(), TOKENIZER_FILE: tokenizer_text}
    if meta["tokenizer"] == "hf":  # the Hugging Face tokenizer whole (its config: special tokens), as data=pydoc_text's
        train.files |= {f"tokenizer/{name}": (folder / name).read_text() for name in meta.get("tokenizer_files", [])}
    counts = ", ".join(f"{s} {meta['documents'][s]} documents ({meta['tokens'][s]:,} tokens)" for s in SPLITS)
    train.summary = f"data: {source}, vocabulary {codec.size}, {meta['dtype']}; {counts}"
    if len(val) == 0:
        train.summary += "; val.bin holds no token to predict: no evaluation (prepare_text.py --val-fraction > 0)"
    return train, val, (None if len(test) == 0 else test)


# ${tokens_vocab_size:${data.root}} (conf/data/tokens.yaml): the vocabulary size in the corpus's meta.json.
OmegaConf.register_new_resolver("tokens_vocab_size", vocab_size, replace=True)
