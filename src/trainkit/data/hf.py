"""data=hf: a Hugging Face `datasets` data set, from local files or the Hub, map-style (memory-mapped Arrow).

`data.path`: a file (.parquet, .json / .jsonl, .csv, .arrow), a folder that `save_to_disk` wrote (`load_from_disk`),
a folder of data files (datasets names their splits by the file names: train.parquet, validation.jsonl, ...), or a
Hub name (`data.subset`: its configuration; offline, HF_HUB_OFFLINE=1: from the cache alone, else one line naming the
name and the cache). Every access is random (`__getitem__` by index), so trainkit's sampler orders it: the same
samples in the same order at any allocation and after a resume; loading draws nothing (draws_random = False).

Splits. `data.split_names` maps train / val / test to the data set's split names; a val or test name null holds that
split out of the train split by `data.val_fraction` / `data.test_fraction` (trainkit.loading.held_out; a fixed
permutation of seed 0, as data=digits: val its first rows, test the next, train the rest, each then in file order).
A fraction of 0 for a split without a name: val empty (no evaluation), no test split.

What a sample is, by what the config names:
- `data.pack: true` (task=lm): `data.text_column`'s documents through `data.tokenizer`, each `BOS ids EOS`
  (trainkit/data/tokenizer.py), a split's documents concatenated and cut into tiles of `data.block_size` inputs and
  the `data.block_size` tokens that follow each (tokens.Tiles: every token but the first a target once, the last
  tile padded with the tokenizer's pad id and IGNORE targets): (x LongTensor[block], y LongTensor[block]).
- text classification (`data.text_column` and `data.label_column`): ({"input_ids": LongTensor[max_length],
  "attention_mask": LongTensor[max_length]}, label LongTensor[]): the tokenizer's encoding with its special tokens,
  truncated to `data.max_length` and padded on the right with its pad id (else its EOS; a tokenizer with neither is
  refused) to exactly that length, so batches stack.
- image classification (`data.image_column`): (FloatTensor[3, H, W], label): every image read as RGB, resized to
  `data.image_size` square (null: the first train image's size, which every image must have), scaled to [0, 1] and
  normalised by `data.mean` / `data.std` (null: 0.5, ViT's image processors' default).
Labels: a ClassLabel column's ids (`data.num_classes` its names), else the train split's distinct values in sorted
order (their index the label); a val or test label the train split lacks is refused.

The tokenized form is made once by `datasets.Dataset.map` into its cache beside the data set's Arrow files
(cache-<fingerprint>.arrow), named by a fingerprint of the data set's own, the tokenizer's SHA-256 and the settings;
a packed split's token stream beside it (trainkit-<fingerprint>.bin, written atomically, memory-mapped). heldout.load
builds the splits on rank 0 first, so the others read what rank 0 wrote; a second run reads it too (no tokenizing).
"""

import contextlib
import hashlib
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import MISSING, DictConfig, OmegaConf
from torch.utils.data import Dataset

from trainkit.data import tokenizer as hf_tokenizer
from trainkit.data.corpus import token_dtype
from trainkit.data.tokens import Tiles
from trainkit.errors import ConfigError
from trainkit.loading import held_out
from trainkit.schema import Data

FORMATS = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".csv": "csv", ".arrow": "arrow"}
ROLES = ("train", "val", "test")
LM = "trainkit.tasks.lm.LanguageModel"  # task=lm's _target_: the task that reads packed blocks
VERSION = 1  # of the tokenized form: part of its fingerprint (a change of how it is made must not read an old one)


@dataclass
class SplitNames:
    train: str = "train"
    val: str | None = None  # null: held out of train by val_fraction
    test: str | None = None  # null: held out of train by test_fraction


@dataclass
class Keys:
    """The splits function's arguments: data.splits' keys, and data's beside them (the yaml interpolates them)."""

    path: str | None = None  # (required) a file, a folder, or a Hub name
    subset: str | None = None  # a Hub data set's configuration (load_dataset's `name`)
    split_names: SplitNames = field(default_factory=SplitNames)
    val_fraction: float = 0.1  # of the train split, where split_names.val is null
    test_fraction: float = 0.1  # of the train split, where split_names.test is null
    text_column: str | None = "text"
    label_column: str | None = "label"
    image_column: str | None = None  # set: image classification
    tokenizer: str | None = None  # a folder or a Hub id (trainkit/data/tokenizer.py)
    max_length: int = 128  # text classification: tokens per sample (truncated, padded)
    pack: bool = False  # true: task=lm's blocks
    block_size: int = 128  # pack: inputs per block
    image_size: int | None = None  # null: the first train image's size
    mean: list[float] | None = None  # null: 0.5 per channel
    std: list[float] | None = None
    cache_dir: str | None = None  # null: $HF_DATASETS_CACHE (datasets' default)


@dataclass
class Splits(Keys):
    _target_: str = MISSING


@dataclass
class Schema(Data, Keys):
    """conf/data/hf.yaml's keys and their types."""

    splits: Splits = field(default_factory=Splits)
    vocab_size: int | None = None  # len(tokenizer); null without one
    per_token: bool = False  # task=lm: val/acc per token


@contextlib.contextmanager
def quiet():
    """datasets' progress bars off while it loads and maps (rank 0 alone would print them: rule 9; the others
    read the cache)."""
    import datasets

    shown = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if shown:
            datasets.enable_progress_bars()


def cache_dir(given: str | None) -> str | None:
    """Where datasets keeps what it builds: data.cache_dir, else $HF_DATASETS_CACHE read now (datasets reads it
    once, at its import), else datasets' default (None)."""
    return given or os.environ.get("HF_DATASETS_CACHE") or None


def load(path: str, subset: str | None = None, cache: str | None = None):
    """data.path as a DatasetDict ({split name: Dataset}, memory-mapped); one ConfigError where it is none."""
    import datasets

    given = Path(str(path)).expanduser()
    with quiet():
        if given.is_dir() and any((given / name).is_file() for name in ("dataset_dict.json", "state.json")):
            loaded = datasets.load_from_disk(str(given))
        elif given.is_file():
            if given.suffix not in FORMATS:
                raise ConfigError(
                    f"data.path={path}: a {given.suffix or 'suffix-less'} file is none of: {', '.join(FORMATS)}"
                )
            loaded = datasets.load_dataset(FORMATS[given.suffix], data_files=str(given), cache_dir=cache_dir(cache))
        elif given.is_dir():  # a folder of data files: datasets finds the splits by their names
            loaded = datasets.load_dataset(str(given), subset, cache_dir=cache_dir(cache))
        else:
            loaded = _hub(str(path), subset, cache)
    return datasets.DatasetDict({"train": loaded}) if isinstance(loaded, datasets.Dataset) else loaded


def _hub(name: str, subset: str | None, cache: str | None):
    """A Hub data set (offline: from the cache alone); one line naming it and the cache where it is not there."""
    import datasets

    try:
        return datasets.load_dataset(name, subset, cache_dir=cache_dir(cache))
    except Exception as error:  # ConnectionError, FileNotFoundError, DatasetNotFoundError, ... : the line says which
        where = cache_dir(cache) or datasets.config.HF_DATASETS_CACHE
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        hub = (
            f"no Hub data set of that name is in the cache {where} (offline: HF_HUB_OFFLINE=1)"
            if hf_tokenizer.offline()
            else f"as a Hub name it did not load (cache {where})"
        )
        raise ConfigError(f"data.path={name} is no local file or folder, and {hub}: {first}") from None


def _split(loaded, name: str, role: str, path: str):
    if name not in loaded:
        raise ConfigError(
            f"data.split_names.{role}={name} is not a split of {path}: its splits are {', '.join(loaded)}"
        )
    return loaded[name]


def _column(dataset, key: str, column: str | None, path: str) -> None:
    """A column the config names must be one of the data set's: one line listing them."""
    if column is not None and column not in dataset.column_names:
        raise ConfigError(
            f"data.{key}={column} is not a column of {path}: its columns are {', '.join(dataset.column_names)}"
        )


def kind(keys: Mapping) -> str:
    """What a sample is: "lm" (packed blocks), "image" or "text" (classification)."""
    return "lm" if keys["pack"] else "image" if keys["image_column"] is not None else "text"


def _columns(dataset, keys: Mapping, path: str) -> None:
    what = kind(keys)
    needed = {
        "lm": ("text_column",),
        "text": ("text_column", "label_column"),
        "image": ("image_column", "label_column"),
    }
    for key in needed[what]:
        if keys[key] is None:
            raise ConfigError(f"data.{key} is null: data=hf's {what} samples read it")
        _column(dataset, key, keys[key], path)


def classes(train, label_column: str) -> list:
    """The labels' names in id order: a ClassLabel's names, else the train split's distinct values, sorted."""
    from datasets import ClassLabel

    feature = train.features[label_column]
    if isinstance(feature, ClassLabel):
        return list(feature.names)
    values = train.unique(label_column)
    if any(v is None for v in values):
        raise ConfigError(f"data.label_column={label_column} has empty labels in the train split")
    try:
        return sorted(values)
    except TypeError:  # mixed types
        return sorted(values, key=str)


def _label_ids(dataset, label_column: str, names: list, role: str) -> dict | None:
    """{value: id} for a column of values (None for a ClassLabel's ids: the column holds them); a val or test value
    the train split lacks is refused."""
    from datasets import ClassLabel

    if isinstance(dataset.features[label_column], ClassLabel):
        if any(v < 0 for v in dataset.unique(label_column)):  # a Hub test split's hidden labels (GLUE's -1)
            raise ConfigError(
                f"data.label_column={label_column}: the {role} split has rows without a label (-1): name another "
                f"split (data.split_names.{role}) or hold one out of train (null)"
            )
        return None
    ids = {value: i for i, value in enumerate(names)}
    if unknown := [v for v in dataset.unique(label_column) if v not in ids]:
        raise ConfigError(
            f"data.label_column={label_column}: the {role} split has labels the train split lacks: "
            f"{', '.join(map(str, sorted(unknown, key=str)[:5]))}"
        )
    return ids


def fingerprint(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _encode_lm(batch: dict, tokenizer, column: str) -> dict:
    """A batch of documents as their ids (`BOS ids EOS`): datasets.map's function for pack."""
    return {"input_ids": hf_tokenizer.documents(tokenizer, [t or "" for t in batch[column]])}


def _encode_text(batch: dict, tokenizer, column: str, label: str, ids: dict | None, length: int, pad: int) -> dict:
    """A batch of texts encoded with the tokenizer's special tokens, truncated to `length` and padded on the right
    to it (mask 0 there), and their labels' ids: datasets.map's function for text classification."""
    encoded = tokenizer([t or "" for t in batch[column]], truncation=True, max_length=length)["input_ids"]
    rows = [list(e) + [pad] * (length - len(e)) for e in encoded]
    masks = [[1] * len(e) + [0] * (length - len(e)) for e in encoded]
    labels = batch[label] if ids is None else [ids[v] for v in batch[label]]
    return {"input_ids": rows, "attention_mask": masks, "labels": labels}


def _tokenized(dataset, keys: Mapping, tokenizer, ids: dict | None):
    """The split's tokenized form: datasets.map into its cache, named by a fingerprint of the data set's own, the
    tokenizer's SHA-256 and the settings (given, not hashed from the function: a tokenizer's pickle is no stable
    name); read from the cache where it is there."""
    column = keys["text_column"]
    settings: dict[str, Any] = {"column": column, "tokenizer": hf_tokenizer.sha256(tokenizer)}
    if keys["pack"]:
        function: Callable[..., dict] = _encode_lm
        arguments = {"tokenizer": tokenizer, "column": column}
    else:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        function, arguments = _encode_text, {"tokenizer": tokenizer, "column": column, "ids": ids, "pad": pad}
        arguments |= {"label": keys["label_column"], "length": keys["max_length"]}
        settings |= {k: v for k, v in arguments.items() if k not in ("tokenizer", "ids")}
        settings["ids"] = sorted(ids.items(), key=str) if ids else None
    with quiet():
        return dataset.map(
            function,
            batched=True,
            fn_kwargs=arguments,
            remove_columns=dataset.column_names,
            new_fingerprint=fingerprint(VERSION, dataset._fingerprint, settings),
            load_from_cache_file=True,
            desc="tokenizing",
        )


def _stream(tokenized, indices: np.ndarray | None, dtype: np.dtype) -> np.ndarray:
    """The documents of `tokenized` (its rows `indices`, None: all) as one token stream, in row order: a file beside
    its cache (written once, atomically; memory-mapped), in memory where it has no cache file."""
    rows = tokenized if indices is None else tokenized.select(indices)
    table = rows.with_format("arrow")
    chunks = (
        table[start : start + 4096].column("input_ids").combine_chunks().flatten()
        for start in range(0, len(rows), 4096)
    )
    if not tokenized.cache_files:
        pieces = [chunk.to_numpy().astype(dtype) for chunk in chunks]
        return np.concatenate(pieces) if pieces else np.zeros(0, dtype=dtype)
    chosen = "all" if indices is None else hashlib.sha256(np.asarray(indices, dtype=np.int64).tobytes()).hexdigest()
    name = f"trainkit-stream-{fingerprint(VERSION, tokenized._fingerprint, chosen, dtype.name)}.bin"
    path = Path(tokenized.cache_files[0]["filename"]).parent / name
    if not path.is_file():
        partial = path.with_name(f".{name}.{os.getpid()}")
        with open(partial, "wb") as f:
            for chunk in chunks:
                f.write(chunk.to_numpy().astype(dtype).tobytes())
        os.replace(partial, path)  # a reader sees the whole stream or none
    if path.stat().st_size == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r")


class _Split:
    """What train.py records of the train split (see pydoc_text._Split) and why there is no test split."""

    identity: dict = {}
    files: dict[str, str] = {}
    summary = ""
    no_test: str | None = None


class TextRows(_Split, Dataset):
    """Text classification: the tokenized rows, each ({"input_ids", "attention_mask"}: LongTensor[max_length],
    label: LongTensor[]); a batch read with one Arrow access (`__getitems__`). Its tensor form (data.on_device): the
    three columns whole, the micro-batches gathered on the device."""

    draws_random = False

    def __init__(self, rows, width: int):
        self.rows, self.length, self.width = rows.with_format("arrow"), len(rows), width

    def __len__(self) -> int:
        return self.length

    def _columns(self, indices: list[int] | slice) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        table = self.rows[indices]  # one Arrow read of the rows (through the held-out split's indices)
        n = table.num_rows
        ids, mask = (
            torch.from_numpy(table.column(c).combine_chunks().flatten().to_numpy().astype(np.int64)).view(n, -1)
            for c in ("input_ids", "attention_mask")
        )
        return ids, mask, torch.from_numpy(table.column("labels").to_numpy().astype(np.int64))

    def __getitems__(self, indices: list[int]) -> list:
        ids, mask, labels = self._columns(list(indices))
        return [({"input_ids": i, "attention_mask": m}, y) for i, m, y in zip(ids, mask, labels, strict=True)]

    def __getitem__(self, index: int):
        if not 0 <= index < len(self):
            raise IndexError(index)
        return self.__getitems__([index])[0]

    def device_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self._columns(slice(0, len(self)))

    def device_bytes(self) -> int:
        return len(self) * (2 * self.width + 1) * 8

    def device_batches(self, tensors, order: torch.Tensor, batch_size: int, epoch: int, seed: int, rows=None):
        """The micro-batches of `order` (`rows`: their rows where a debug subset names them), as the loader's
        collation stacks them: one gather a micro-batch."""
        ids, mask, labels = tensors
        picked = (order if rows is None else rows).to(ids.device, non_blocking=True)
        for chunk in picked.split(batch_size):
            yield {"input_ids": ids[chunk], "attention_mask": mask[chunk]}, labels[chunk]


class ImageRows(_Split, Dataset):
    """Image classification: (FloatTensor[3, H, W], label LongTensor[]) decoded where loaded (RGB, resized to `size`,
    normalised); no random augmentation (draws_random = False)."""

    draws_random = False

    def __init__(self, rows, column: str, label: str, ids: dict | None, size: tuple[int, int], mean, std):
        self.rows, self.column, self.label, self.ids, self.size = rows, column, label, ids, size
        self.mean = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(index)
        row = self.rows[index]
        image = row[self.column].convert("RGB")
        if image.size != self.size[::-1]:  # PIL's size is (W, H)
            from PIL import Image

            image = image.resize(self.size[::-1], Image.Resampling.BILINEAR)
        x = torch.from_numpy(np.asarray(image, dtype=np.uint8).copy()).permute(2, 0, 1).float() / 255
        label = row[self.label] if self.ids is None else self.ids[row[self.label]]
        return (x - self.mean) / self.std, torch.tensor(label, dtype=torch.long)


def image_size(train, column: str, size: int | None) -> tuple[int, int]:
    """(H, W) of every image: data.image_size square, else the first train image's."""
    if size is not None:
        return size, size
    width, height = train[0][column].size
    return height, width


def _held_out(n: int, names: Mapping, val_fraction: float, test_fraction: float) -> dict[str, np.ndarray | None]:
    """The rows of the train split each role without a split name takes (None: all of it), the held-out ones by
    their fractions of a fixed permutation (seed 0, as data=digits), each in file order."""
    n_val, n_test = held_out(
        n, val_fraction if names["val"] is None else 0.0, test_fraction if names["test"] is None else 0.0
    )
    if n_val == n_test == 0:
        return {"train": None, "val": np.zeros(0, np.int64), "test": np.zeros(0, np.int64)}
    order = np.random.RandomState(0).permutation(n)
    parts = {"val": order[:n_val], "test": order[n_val : n_val + n_test], "train": order[n_val + n_test :]}
    return {role: np.sort(part) for role, part in parts.items()}


def _keys(keys: Mapping) -> dict[str, Any]:
    """The splits' keys as plain values (Keys' defaults where a caller leaves one out), checked."""
    node = keys if isinstance(keys, DictConfig) else OmegaConf.create(dict(keys))  # (a node: resolved from its root)
    given = OmegaConf.to_container(node, resolve=True)
    plain: dict[str, Any] = OmegaConf.to_container(OmegaConf.structured(Keys)) | given  # type: ignore[operator,assignment]
    plain["split_names"] = {"train": "train", "val": None, "test": None} | dict(plain["split_names"] or {})
    if not plain["path"]:
        raise ConfigError(
            "data.path is not set: a data file (parquet, json, jsonl, csv, arrow), a folder, or a Hub name"
        )
    if plain["split_names"]["train"] is None:
        raise ConfigError("data.split_names.train is null: the train split needs a name")
    for key, least in (("block_size", 2), ("max_length", 1)):
        value = plain[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ConfigError(f"data.{key}={value} must be an integer >= {least}")
    if plain["pack"] and plain["image_column"] is not None:
        raise ConfigError(f"data.pack=true packs text; data.image_column={plain['image_column']} names images")
    return plain


def _tokenizer(keys: Mapping, what: str):
    """data.tokenizer, loaded (None for images); text classification pads with its pad id, else its EOS."""
    if what == "image":
        return None
    if keys["tokenizer"] is None:
        raise ConfigError(f"data.tokenizer is null: data=hf's {what} samples are tokens (data.text_column)")
    tokenizer = hf_tokenizer.load(keys["tokenizer"])
    if what == "text" and tokenizer.pad_token_id is None and tokenizer.eos_token_id is None:
        raise ConfigError(
            f"data.tokenizer={keys['tokenizer']} has neither a pad nor an EOS token: text classification pads with one"
        )
    return tokenizer


def _build(what: str, base, chosen: np.ndarray | None, keys: Mapping, tokenizer, ids: dict | None, size):
    """One split of `base` (its rows `chosen`, None: all)."""
    if what == "image":
        mean, std = keys["mean"] or [0.5] * 3, keys["std"] or [0.5] * 3
        rows = base if chosen is None else base.select(chosen)
        return ImageRows(rows, keys["image_column"], keys["label_column"], ids, size, mean, std)
    tokenized = _tokenized(base, keys, tokenizer, ids)  # the whole split once: its held-out rows share it
    if what == "lm":
        dtype = token_dtype(hf_tokenizer.size(tokenizer))
        return Tiles(_stream(tokenized, chosen, dtype), keys["block_size"], hf_tokenizer.pad_id(tokenizer))
    return TextRows(tokenized if chosen is None else tokenized.select(chosen), keys["max_length"])


def splits(**keys: Any) -> tuple[Dataset, Dataset, Dataset | None]:
    """The train, val and test splits of data.path (test None where it has none: no name and test_fraction 0);
    the train split carries the identity, the files (the tokenizer's, the labels') and the summary."""
    keys = _keys(keys)
    path, names = keys["path"], keys["split_names"]
    loaded = load(path, keys["subset"], keys["cache_dir"])
    source = {role: _split(loaded, names[role], role, path) for role in ROLES if names[role] is not None}
    for role, dataset in source.items():
        _columns(dataset, keys, f"{path} ({names[role]})")
    what = kind(keys)
    tokenizer = _tokenizer(keys, what)
    labels = classes(source["train"], keys["label_column"]) if what != "lm" else None
    size = image_size(source["train"], keys["image_column"], keys["image_size"]) if what == "image" else None
    rows = _held_out(len(source["train"]), names, keys["val_fraction"], keys["test_fraction"])
    out: dict[str, Any] = {}
    for role in ROLES:
        named = names[role] is not None and role != "train"  # a split of its own: all of it
        base, chosen = (source[role], None) if named else (source["train"], rows[role])
        ids = _label_ids(base, keys["label_column"], labels, role) if labels is not None else None
        out[role] = _build(what, base, chosen, keys, tokenizer, ids, size)
    train, val, test = out["train"], out["val"], out["test"]
    if len(test) == 0:
        train.no_test = f"data.split_names.test is null and data.test_fraction={keys['test_fraction']} holds out none"
        test = None
    _describe(train, (val, test), keys, tokenizer, labels, source)
    return train, val, test


def _describe(train, held: tuple, keys: Mapping, tokenizer, labels: list | None, source: dict) -> None:
    """The train split's identity (the data set's fingerprints, the tokenizer's SHA-256), files (the tokenizer's,
    labels.json) and summary line."""
    train.identity = {
        "data.hf": {"sha256": fingerprint(*(d._fingerprint for d in source.values())), "source": str(keys["path"])}
    }
    train.files = {}
    words = [f"data: {keys['path']}" + (f" ({keys['subset']})" if keys["subset"] else "")]
    if tokenizer is not None:
        sha = hf_tokenizer.sha256(tokenizer)
        train.identity["data.tokenizer"] = {"sha256": sha, "source": f"data.tokenizer={keys['tokenizer']}"}
        train.files |= hf_tokenizer.files(tokenizer)
        words.append(f"tokenizer {keys['tokenizer']} ({hf_tokenizer.size(tokenizer)} ids, sha256 {sha[:12]})")
    if labels is not None:
        train.classes = labels
        train.files["labels.json"] = json.dumps([str(name) for name in labels]) + "\n"
        shown = ", ".join(map(str, labels[:10])) + (", ..." if len(labels) > 10 else "")
        words.append(f"{len(labels)} classes ({shown})")
    if keys["pack"]:
        words.append(f"blocks of {keys['block_size']} tokens: train {len(train.tokens):,} tokens")
    val, test = held
    names = keys["split_names"]
    counts = [f"train {len(train)}"] + [
        f"{role} {len(split) if split is not None else 0}"
        + (f" ({names[role]})" if names[role] else f" (held out of train, {keys[role + '_fraction']:g})")
        for role, split in (("val", val), ("test", test))
    ]
    train.summary = "; ".join(words) + "; " + ", ".join(counts) + (" samples" if not keys["pack"] else " blocks")


def _source_train(keys: Mapping):
    """The train split as data.path has it, its columns checked (what the resolvers read)."""
    loaded = load(keys["path"], keys["subset"], keys["cache_dir"])
    train = _split(loaded, keys["split_names"]["train"], "train", keys["path"])
    _columns(train, keys, f"{keys['path']} ({keys['split_names']['train']})")
    return train


def num_classes(*, _parent_) -> int | None:
    """${hf_num_classes:} (data.num_classes): the label column's classes (null for pack: no labels)."""
    keys = _keys(_parent_.splits)
    if kind(keys) == "lm":
        return None
    return len(classes(_source_train(keys), keys["label_column"]))


def shape(*, _parent_) -> list[int] | None:
    """${hf_shape:} (data.shape): [3, H, W] of an image sample (null for text: the models read tokens)."""
    keys = _keys(_parent_.splits)
    if kind(keys) != "image":
        return None
    return [3, *image_size(_source_train(keys), keys["image_column"], keys["image_size"])]


def vocab_size(tokenizer: str | None) -> int | None:
    """${hf_vocab_size:${data.tokenizer}} (data.vocab_size): len(tokenizer), null without one."""
    return None if tokenizer is None else hf_tokenizer.size(hf_tokenizer.load(tokenizer))


# conf/data/hf.yaml's: what the models read (data.num_classes, data.shape, data.vocab_size), from the data set itself
OmegaConf.register_new_resolver("hf_num_classes", num_classes, replace=True)
OmegaConf.register_new_resolver("hf_shape", shape, replace=True)
OmegaConf.register_new_resolver("hf_vocab_size", vocab_size, replace=True)


def check(cfg) -> None:
    """Before the run dir: the data set loads (a local path, or a Hub name in the cache), its splits and columns are
    there, the tokenizer loads, and data.pack goes with task=lm (blocks) and only with it."""
    keys = _keys(cfg.data.splits)
    what = kind(keys)
    task = OmegaConf.select(cfg, "task._target_", default=None)
    if task == LM and what != "lm":
        raise ConfigError(f"task=lm reads blocks of tokens: set data.pack=true (data=hf makes {what} samples)")
    if what == "lm" and task != LM:
        raise ConfigError(f"data.pack=true makes task=lm's blocks; this run's task is {task}")
    loaded = load(keys["path"], keys["subset"], keys["cache_dir"])
    for role, name in keys["split_names"].items():
        if name is not None:
            _columns(_split(loaded, name, role, keys["path"]), keys, f"{keys['path']} ({name})")
    _tokenizer(keys, what)
