"""Preparing a tokenized corpus for data=tokens (scripts/prepare_text.py): text files in, train/val/test
.bin files of token ids, tokenizer.json and meta.json out (the format trainkit/data/tokens.py reads).

The split is by document and fixed: a permutation seeded by --seed of the sorted file list, val its
first --val-fraction of the documents, test the next --test-fraction, train the rest (each split then
in sorted order). A held-out split asked for (fraction > 0) gets at least one document while train
keeps one, val before test: 3 files at the default 0.1 give 1 / 1 / 1, 2 files 1 train and 1 val (no
test: data=tokens then makes no test pass, said once); one document with --val-fraction > 0 is refused
(nothing would be left for val: --val-fraction 0 --test-fraction 0 trains on it without evaluation).
An empty split is written as an empty .bin: data=tokens reads it as a split the corpus does not have.
The BPE is trained on the train documents only (no held-out text shapes the vocabulary). Each
document is followed by the end-of-text token. `--tokenizer <folder or Hub id>`: a Hugging Face tokenizer instead
(kind `hf`), its save_pretrained files written beside meta.json (tokenizer.json among them), each document
`BOS ids EOS` where it has them (trainkit/data/tokenizer.py), meta.json's vocab_size its len(). Tokens are written
as they are encoded, a file at a time: memory holds one document, not the corpus.
"""

import hashlib
import json
import os
import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from trainkit.data import tokenizer as hf_tokenizer
from trainkit.data.tokens import BYTES_EOT, EOT_TEXT, META_FILE, SPLITS, TOKENIZER_FILE, Codec, sha256_file
from trainkit.errors import ConfigError


def find_files(inputs: list[str], patterns: list[str], exclude: list[str]) -> list[Path]:
    """The sorted text files named or under the folders named (recursively, matching `patterns`),
    without those whose path relative to their folder has a part in `exclude`."""
    found: set[Path] = set()
    for given in map(Path, inputs):
        if given.is_file():
            found.add(given)
        elif given.is_dir():
            for pattern in patterns:
                for path in given.rglob(pattern):
                    if path.is_file() and not set(path.relative_to(given).parts[:-1]) & set(exclude):
                        found.add(path)
        else:
            raise ConfigError(f"{given} is neither a file nor a folder")
    if not found:
        raise ConfigError(f"no files matching {' '.join(patterns)} in {' '.join(inputs)}")
    return sorted(found)


def split_sizes(n: int, val_fraction: float, test_fraction: float) -> tuple[int, int]:
    """(val, test) documents of `n`: each fraction of n rounded, and at least one for a fraction > 0
    while train keeps one (val first). A ConfigError where train or a val asked for gets none."""
    for key, value in (("--val-fraction", val_fraction), ("--test-fraction", test_fraction)):
        if not 0 <= value < 1:
            raise ConfigError(f"{key}={value} must be >= 0 and < 1")
    n_val, n_test = round(n * val_fraction), round(n * test_fraction)
    if n_val + n_test >= n:
        raise ConfigError(f"{n} files: --val-fraction and --test-fraction leave none to train on")
    if val_fraction > 0 and n_val == 0 and n - n_test >= 2:
        n_val = 1
    if test_fraction > 0 and n_test == 0 and n - n_val >= 2:
        n_test = 1
    if val_fraction > 0 and n_val == 0:
        raise ConfigError(
            f"{n} document{'s' if n > 1 else ''}: --val-fraction {val_fraction:g} leaves val none (the split is by "
            "document and train keeps one): give more files, or --val-fraction 0 --test-fraction 0 to train "
            "without evaluation"
        )
    return n_val, n_test


def split_files(files: list[Path], val_fraction: float, test_fraction: float, seed: int) -> dict[str, list[Path]]:
    order = np.random.RandomState(seed).permutation(len(files))
    n_val, n_test = split_sizes(len(files), val_fraction, test_fraction)
    picked = {"val": order[:n_val], "test": order[n_val : n_val + n_test], "train": order[n_val + n_test :]}
    return {split: [files[i] for i in sorted(picked[split])] for split in SPLITS}


def token_dtype(vocab_size: int) -> np.dtype:
    """The .bin files' integer type: uint16 while every id fits (ids 0 .. vocab_size - 1), else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def read(path: Path) -> str:
    return path.read_bytes().decode("utf-8", errors="replace")


def bpe(texts: Iterable[str], vocab_size: int, special_tokens: list[str]):
    """A byte-level BPE (ByteLevel pre-tokenizer and decoder; `special_tokens` its first ids) trained on `texts`: a
    `tokenizers.Tokenizer` (also data.train_tokenizer's, trainkit/data/tokenizer.py)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def train_bpe(files: list[Path], vocab_size: int) -> str:
    """A byte-level BPE (end-of-text id 0) trained on `files`: its JSON."""
    return bpe((read(path) for path in files), vocab_size, [EOT_TEXT]).to_str()


def prepare(
    inputs: list[str],
    out: str,
    tokenizer: str = "bytes",
    vocab_size: int = 4096,
    val_fraction: float = 0.1,
    test_fraction: float | None = None,
    seed: int = 0,
    patterns: tuple[str, ...] = ("*.py", "*.txt"),
    exclude: tuple[str, ...] = (),
    progress: bool = True,
) -> dict:
    """Write the corpus into `out`; returns its meta (with the seconds and MB/s it took)."""
    from tqdm import tqdm

    started = time.perf_counter()
    files = find_files(inputs, list(patterns), list(exclude))
    split = split_files(files, val_fraction, val_fraction if test_fraction is None else test_fraction, seed)
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    kind, hf, extra = tokenizer, None, {}
    if tokenizer == "bpe":
        tokenizer_text = train_bpe(split["train"], vocab_size)
        (folder / TOKENIZER_FILE).write_text(tokenizer_text)
    elif tokenizer == "bytes":
        tokenizer_text = json.dumps({"kind": "bytes", "vocab_size": BYTES_EOT + 1, "eot": BYTES_EOT}) + "\n"
        (folder / TOKENIZER_FILE).write_text(tokenizer_text)
    else:  # a Hugging Face tokenizer: its files beside the corpus (data=tokens runs copy them)
        kind, hf = "hf", hf_tokenizer.load(tokenizer, key="--tokenizer")
        saved = hf.save_pretrained(folder)
        extra = {
            "tokenizer_source": tokenizer,
            "tokenizer_files": sorted(Path(f).name for f in saved if Path(f).name != TOKENIZER_FILE),
            "bos": hf_tokenizer.bos_eos(hf)[0],
            "pad": hf_tokenizer.pad_id(hf),
        }
        tokenizer_text = (folder / TOKENIZER_FILE).read_text()
    codec = Codec(kind, tokenizer_text if kind != "bytes" else None, {"eot": hf.eos_token_id} if hf else None)
    dtype = token_dtype(codec.size)
    sources = hashlib.sha256()  # names relative to the files' common folder: the same corpus wherever it lies
    common = Path(os.path.commonpath([path.parent for path in files]))
    tokens, size = {}, 0
    with tqdm(total=len(files), unit="file", disable=not progress) as bar:
        for name in SPLITS:
            count = 0
            with open(folder / f"{name}.bin", "wb") as f:
                for path in split[name]:
                    raw = path.read_bytes()
                    size += len(raw)
                    sources.update(f"{path.relative_to(common)}\0".encode() + raw + b"\0")
                    text = raw.decode("utf-8", errors="replace")
                    if hf is not None:  # BOS ids EOS, each where the tokenizer has it
                        ids = np.array(hf_tokenizer.documents(hf, [text])[0], dtype=dtype)
                    else:
                        ids = np.array(codec.encode(text) + [codec.eot], dtype=dtype)
                    f.write(ids.tobytes())
                    count += len(ids)
                    bar.update(1)
            tokens[name] = count
    seconds = time.perf_counter() - started
    meta = {
        "vocab_size": codec.size,
        "dtype": np.dtype(dtype).name,
        "tokenizer": kind,
        "tokenizer_file": TOKENIZER_FILE,
        "eot": hf.eos_token_id if hf is not None else codec.eot,  # hf: null where it has no EOS
        **extra,
        "documents": {name: len(split[name]) for name in SPLITS},
        "tokens": tokens,
        "sha256": {
            "tokenizer": sha256_file(folder / TOKENIZER_FILE),
            "sources": sources.hexdigest(),
            **{name: sha256_file(folder / f"{name}.bin") for name in SPLITS},
        },
        "source_bytes": size,
        "split_seed": seed,
    }
    (folder / META_FILE).write_text(json.dumps(meta, indent=1) + "\n")
    return meta | {"seconds": seconds, "mb_per_s": size / 1e6 / seconds}
