"""Hugging Face tokenizers for the text data sets (`data.tokenizer`: data=pydoc_text, data=hf, scripts/prepare_text.py
--tokenizer DIR): one loaded from a folder or from the Hub's cache, or one trained here on a corpus (a byte-level BPE,
`data.train_tokenizer`), and the special tokens a document gets.

A document is `BOS ids EOS`: BOS where the tokenizer has one that is not its EOS (GPT-2's `<|endoftext|>` is both: it
goes between documents once), EOS where it has one. Block padding is the tokenizer's pad id, else its EOS (its target
is IGNORE: it bears no loss either way).
"""

import functools
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

from trainkit.errors import ConfigError

SPECIAL = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>"}  # a trained tokenizer's, ids 0, 1, 2
MIN_TRAINED = 256 + len(SPECIAL)  # a byte-level BPE holds every byte and the special tokens before any merge
DIR = "tokenizer"  # in the run dir: the tokenizer's files, as save_pretrained writes them


def offline() -> bool:
    """HF_HUB_OFFLINE (or HF_DATASETS_OFFLINE, TRANSFORMERS_OFFLINE) as huggingface_hub reads it, read now."""
    names = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
    return any(os.environ.get(name, "").upper() in ("1", "ON", "YES", "TRUE") for name in names)


def hub_cache() -> str:
    """Where huggingface_hub looks for a Hub id's files (for the error line)."""
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def load(name: str, key: str = "data.tokenizer"):
    """The tokenizer in folder `name`, else the Hub's of that id (offline, HF_HUB_OFFLINE=1: from the cache alone);
    one ConfigError naming `key`, the id and the cache where there is none."""
    folder = Path(str(name)).expanduser()
    if folder.is_dir():
        stamp = max((f.stat().st_mtime_ns for f in folder.iterdir()), default=0)  # a folder written again: reread
        return _load(str(folder.resolve()), stamp, key)
    return _load(str(name), 0, key)


@functools.lru_cache(maxsize=8)
def _load(name: str, stamp: int, key: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as error:
        if Path(name).is_dir():
            first = (str(error).strip().splitlines() or [type(error).__name__])[0]
            raise ConfigError(f"{key}={name}: no tokenizer in this folder ({first})") from None
        hub = (
            f"no Hub tokenizer of that id is in the cache {hub_cache()} (offline: HF_HUB_OFFLINE=1)"
            if offline()
            else f"as a Hub id it did not load (cache {hub_cache()})"
        )
        raise ConfigError(f"{key}={name} is no folder, and {hub}") from None


def bos_eos(tokenizer) -> tuple[int | None, int | None]:
    """The ids a document starts and ends with (None: none): BOS only where it is not also EOS."""
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    return (None if bos == eos else bos), eos


def documents(tokenizer, texts: list[str]) -> list[list[int]]:
    """Each text's ids as a document: `BOS ids EOS` (see the module's docstring), the tokenizer's own special tokens
    left out of the text's encoding (they are added here, once)."""
    bos, eos = bos_eos(tokenizer)
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    return [[bos] * (bos is not None) + ids + [eos] * (eos is not None) for ids in encoded]


def pad_id(tokenizer) -> int:
    """A block's padding input: the pad id, else EOS, else 0 (its target is IGNORE: any id bears no loss)."""
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if candidate is not None:
            return int(candidate)
    return 0


def size(tokenizer) -> int:
    """The ids a model's embedding needs: len(tokenizer), the added tokens included."""
    return len(tokenizer)


def sha256(tokenizer) -> str:
    """The tokenizer's identity (a checkpoint resumes only with the same one; the tokenized cache's name): the SHA-256
    of its tokenizer.json less the truncation and padding a call leaves on it (the last call's: a call that truncates
    changed it, the next that does not put it back)."""
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    state["truncation"] = state["padding"] = None
    return hashlib.sha256(json.dumps(state, sort_keys=True).encode()).hexdigest()


def files(tokenizer) -> dict[str, str]:
    """{f"tokenizer/<name>": text} of save_pretrained's files (the run dir's copy: predict.py and an export read it)."""
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        found = {}
        for path in sorted(Path(tmp).iterdir()):
            try:
                found[f"{DIR}/{path.name}"] = path.read_text()
            except UnicodeDecodeError:  # a binary file (a SentencePiece model): the fast tokenizer's JSON suffices
                continue
        return found


def train(texts: Iterable[str], vocab_size: int, folder: Path, key: str = "data.train_tokenizer"):
    """A byte-level BPE of `vocab_size` ids trained on `texts` (trainkit/data/corpus.py's trainer) with SPECIAL's
    tokens and BOS added by the tokenizer's call (as Llama's), saved into `folder` by save_pretrained atomically (a
    temporary folder beside it, renamed: a reader never sees half a tokenizer; where another process renamed its
    folder first, that one stays). Returns the tokenizer loaded back from `folder`."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    from trainkit.data.corpus import bpe

    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < MIN_TRAINED:
        raise ConfigError(
            f"{key}={vocab_size} must be an integer >= {MIN_TRAINED} (256 bytes and {len(SPECIAL)} special tokens)"
        )
    backend = bpe(texts, vocab_size, list(SPECIAL.values()))
    if backend.get_vocab_size() != vocab_size:
        raise ConfigError(f"{key}={vocab_size}: the corpus gives only {backend.get_vocab_size()} ids (too few merges)")
    bos = SPECIAL["bos_token"]
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, backend.token_to_id(bos))]
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, **SPECIAL)
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    tokenizer.save_pretrained(staging)
    try:
        staging.rename(folder)
    except OSError:  # made meanwhile by another process: keep that one
        shutil.rmtree(staging, ignore_errors=True)
    return load(str(folder))


class Documents:
    """What pydoc_text's blocks ask of a vocabulary (`encode`, `pad`), for a Hugging Face tokenizer: a document's ids
    (with BOS and EOS), the block padding."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.pad = pad_id(tokenizer)
        self.size = size(tokenizer)

    def encode(self, text: str) -> list[int]:
        return documents(self.tokenizer, [text])[0]


class Prompts:
    """What predict.py's sampling asks of a vocabulary (trainkit/tasks/lm_predict.py) for a run trained through a
    Hugging Face tokenizer (its run dir's tokenizer/): a prompt's ids (BOS first, as a document starts), a sample's
    text, `pad` (the first id never drawn: past the tokenizer's), `unknown` (none: a byte-level tokenizer encodes
    any text)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.pad = self.size = size(tokenizer)

    def encode(self, text: str) -> list[int]:
        bos, _ = bos_eos(self.tokenizer)
        return [bos] * (bos is not None) + self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, tokens) -> str:
        return self.tokenizer.decode([t for t in tokens if 0 <= t < self.pad], skip_special_tokens=True)

    def unknown(self, text: str) -> str:
        return ""

    @classmethod
    def load(cls, run_dir: Path) -> "Prompts | None":
        """The tokenizer a run trained through (its run dir's tokenizer/), else None."""
        folder = Path(run_dir) / DIR
        return cls(load(str(folder), key="run_dir")) if (folder / "tokenizer.json").is_file() else None
