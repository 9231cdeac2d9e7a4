"""data=shards: a data set read from tar shards in a local dir or at an object-store URL (`data.path`), or a weighted
mixture of several (`data.sources`). scripts/make_shards.py writes them from any data set of the tree.

The format (version 1). A shard set is a dir or URL holding `manifest.json` and, per split, tar shards
`train-000000.tar`, `train-000001.tar`, ..., `val-000000.tar`, ... written by webdataset's ShardWriter (a shard closes
past make_shards' shard_size bytes or max_count samples; USTAR headers, mtime 0: the same source writes the same
bytes). One sample is one tar key, `<position in its split, 9 digits>`:
- a sample of an image folder (data=image_folder): the image file's ORIGINAL bytes (`<key>.jpg`, `.png`, ... as the
  file was named) and its class (`<key>.cls`, the class index as text): decoded and transformed when read, the train
  split's random crop and flip drawn per sample as image_folder draws them (draws_random="torch");
- any other sample: its tensors (a tuple, list or dict of them, nested; numpy arrays and Python numbers too) as `.npy`
  leaves, `<key>.<n>.npy` for its n-th leaf in order, no pickle; the structure is recorded once in the manifest.
manifest.json holds: `format`, `version`; per split its shards `[{name, samples, bytes, sha256}]`, `samples` and the
sample's `kind` ("image" / "tensors") and `structure`; the total `samples`; `source`: the data set it was written
from (`data`: its name, `config`: its resolved data config, `identity`: its train split's own, `no_test`); `keys`: the
data keys models interpolate (the source's resolved top-level data keys less `splits` and the loader's knobs:
shape, num_classes, vocab_size, block_size, per_token, ...); `task` (`name`, `_target_`: the config's task); the
source's `collate_fn` by qualified name, or null (data=addition pads: the reader imports it); `images` (image_size,
resize, mean, std) for an image folder; `write` (`seed`, `shuffled`: the train split is written in the order
numpy.random.default_rng(seed).permutation(samples) of the source's, so a shard is a random sample and not one class;
val and test in the source's order); `files` ({name: sha256}) the source's files kept under `files/` (a corpus's
tokenizer.json and meta.json: a run dir gets them as it would from the source).

Reading. Each split is a map-style data set: `[i]` finds its shard by a binary search over the cumulative counts,
gets the shard local through the store (trainkit/data/shard_store.py: a local dir as it is, a URL downloaded into a
cache held under data.cache_limit, retried data.retries times), reads the sample's members at their offsets (each
shard's tar headers are read once per process, 16 bytes a member kept; a few files stay open; a shard is never read
whole into memory) and decodes them. Picklable: loader workers index and open what they read themselves.

The global order (`epoch_order(seed, epoch, global_batch)`): the train split's shards permuted from (seed, epoch),
grouped into windows of `data.window` shards, the samples of each window permuted (seeded by (seed, epoch, window)),
the windows concatenated. It depends on (seed, epoch) alone, never on the world size, K or the micro-batch; rank r
reads positions r, r+W, ... of each global batch (as DistributedSampler does), so all ranks read the same window at
the same time: a rank's cache needs about two windows of shards (the one it reads, the next one prefetched: entering
window j, a remote set's reader asks the store for window j+1's shards). Shuffle quality: a global batch mixes the
samples of `window` shards (two where it straddles windows), not of the whole split; the write-time shuffle makes each
shard a uniform random sample of the split, which is what keeps a small window good (a window of 1 is already an
unbiased sample of the split; batches of one window are correlated only in sharing its shards across its steps). A
larger window costs cache, not time. data.shuffle=false: the engine's order, the shards as written. val and test: in
their stored order (the engine evaluates contiguous blocks per rank).

A weighted mixture, `data.sources: {name: {path, weight}}` (weights > 0, normalised; the sources agree on the task and
the model's keys). Its epoch is a sample budget, `data.epoch_samples` (default: the sum of the sources' train sizes),
cut into global windows of B samples (the last one short). Global window g (counting across epochs: g = epoch *
ceil(E/B) + w) draws c_i samples of source i: the cumulative targets p_i x (samples drawn) rounded by largest remainder,
every source's count never decreasing (carried remainders: the realised counts stay within one sample of p_i x drawn;
where a source's share of a window is under one sample, p_i x B < 1, a source that drew ahead can hold another back
by up to one more). The counts are computed from g = 0 and cached (numpy, extended as needed: ~4 us a window in
Python, about 4 s for 1e6 windows). Each source is an endless stream of its own epochs (source epoch e's order: the
source's shard-local order above, seeded from (seed, source index, e)); window g takes the next c_i samples of each
stream, interleaved by a permutation seeded from (seed, g), so every rank's slice mixes the sources. A mixture's index
is global (source i's offset + its local index); `row` gives the rows' `data/<source>`: the samples of each drawn so
far (all ranks). val and test: the sources' splits concatenated (per-source evaluation sets: data.eval_sets).

The run's identity holds each manifest's sha256 (`data.shards.<source or train>`) and the mixture's normalised weights
(`data.shards.mixture`): a resume on another shard set, another source list or other weights is refused; data.splits'
cache_dir, cache_limit, retries and backoff are settings (SETTINGS), which a resume may change. The run dir keeps each
manifest (`shards/<source or train>.manifest.json`) and the source's files.
"""

import functools
import hashlib
import io
import json
import math
import os
import re
import tarfile
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import MISSING, DictConfig, OmegaConf
from torch.utils.data import Dataset

from trainkit.data.shard_order import Joined, Mixture, local_order, shard_permutation
from trainkit.data.shard_store import Store
from trainkit.errors import ConfigError, RankError
from trainkit.schema import Data

FORMAT, VERSION, MANIFEST = "trainkit-shards", 1, "manifest.json"
SPLITS = ("train", "val", "test")
# The data keys a model or task reads, as conf/data/shards.yaml exposes them from the manifest; their value where the
# source has none (task=lm reads per_token and per_character as booleans)
MODEL_KEYS: dict[str, Any] = {
    "shape": None,
    "num_classes": None,
    "vocab_size": None,
    "block_size": None,
    "max_digits": None,
    "per_token": False,
    "per_character": False,
    "tokenizer": None,
}
# data.splits' keys that are settings, not data: the engine leaves them out of the run's identity (a resume may
# change where the cache is, its size, the retries)
SETTINGS = ("cache_dir", "cache_limit", "retries", "backoff")
OPEN_FILES = 8  # shard files a process keeps open
_NAME = re.compile(r"[A-Za-z0-9_.-]+")


@dataclass
class Source:
    path: str = MISSING  # a shard set: a dir or a URL
    weight: float = 1.0  # > 0; the weights are normalised


@dataclass
class Splits:
    _target_: str = MISSING
    path: str | None = None
    sources: dict[str, Source] | None = None
    window: int = 4
    epoch_samples: int | None = None
    cache_dir: str | None = None
    cache_limit: str = "4GB"
    retries: int = 5
    backoff: float = 1.0


@dataclass
class Schema(Data):
    """conf/data/shards.yaml's keys and their types."""

    splits: Splits = field(default_factory=Splits)
    path: str | None = None  # a shard set (scripts/make_shards.py's out): a dir or an object-store URL
    sources: dict[str, Source] | None = None  # or a weighted mixture of several
    window: int = 4  # shards whose samples a global batch mixes
    epoch_samples: int | None = None  # a mixture's epoch; null: the sum of the sources' train samples
    cache_dir: str | None = None  # a URL's local cache (null: the store's default)
    cache_limit: str = "4GB"
    retries: int = 5
    backoff: float = 1.0
    # Any, not Data's list: OmegaConf resolves an interpolation into a container type as the schema is merged, before
    # config.check reports a failing resolver in one line
    shape: Any = None
    vocab_size: int | None = None
    block_size: int | None = None
    max_digits: int | None = None
    per_token: bool = False
    per_character: bool = False
    tokenizer: str | None = None


# --- samples: a structure of tensors as .npy leaves ------------------------------------------------------------------


def flatten(sample: Any) -> tuple[Any, list[np.ndarray]]:
    """(structure, leaves) of a sample: tensors, numpy arrays and Python numbers inside tuples, lists and dicts."""
    leaves: list[np.ndarray] = []

    def walk(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            x = x.detach().cpu()
            dtype = str(x.dtype).removeprefix("torch.")
            leaves.append((x.view(torch.int16) if x.dtype == torch.bfloat16 else x).contiguous().numpy())
            return {"tensor": dtype}
        if isinstance(x, np.ndarray | np.generic):
            leaves.append(np.asarray(x))
            return {"ndarray": np.asarray(x).dtype.str}
        if isinstance(x, bool | int | float):
            leaves.append(np.asarray(x))
            return {"scalar": type(x).__name__}
        if isinstance(x, tuple | list) and not hasattr(x, "_fields"):  # a named tuple would come back a tuple
            return {type(x).__name__: [walk(v) for v in x]}
        if isinstance(x, dict) and all(isinstance(k, str) for k in x):
            return {"dict": [[k, walk(v)] for k, v in x.items()]}
        raise ConfigError(
            f"a sample holds a {type(x).__name__}: shards store tensors, numpy arrays and numbers in tuples, lists "
            "and dicts with string keys"
        )

    return walk(sample), leaves


def rebuild(structure: Any, leaves: list[np.ndarray]) -> Any:
    """The sample `flatten` took apart."""
    taken = iter(leaves)

    def build(node: dict) -> Any:
        ((kind, spec),) = node.items()
        if kind == "tensor":
            tensor = torch.from_numpy(next(taken))
            return tensor.view(torch.bfloat16) if spec == "bfloat16" else tensor
        if kind == "ndarray":
            return next(taken)
        if kind == "scalar":
            return {"bool": bool, "int": int, "float": float}[spec](next(taken).item())
        if kind == "dict":
            return {k: build(v) for k, v in spec}
        return (tuple if kind == "tuple" else list)(build(v) for v in spec)

    return build(structure)


def npy(array: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.save(out, array, allow_pickle=False)
    return out.getvalue()


@functools.lru_cache(maxsize=256)
def _npy_header(header: bytes) -> tuple[np.dtype, tuple[int, ...], bool]:
    """(dtype, shape, fortran order) of a .npy header (magic, version, length, the dict), parsed once a process: numpy's
    read_array parses it with ast.literal_eval each time, ~50 us, 3/4 of reading a block of 256 tokens."""
    stream = io.BytesIO(header)
    version = np.lib.format.read_magic(stream)
    read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    shape, fortran, dtype = read(stream)
    return dtype, shape, fortran


def read_npy(data: bytes) -> np.ndarray:
    """The array of a .npy member (np.save's bytes, no pickle): a writable copy, as np.lib.format.read_array gives it;
    its header parsed once a process (_npy_header)."""
    version = data[6:8]
    if data[:6] != b"\x93NUMPY" or version not in (b"\x01\x00", b"\x02\x00"):  # v3 (utf8 names): numpy's own reader
        return np.lib.format.read_array(io.BytesIO(data), allow_pickle=False)
    wide = version == b"\x02\x00"  # a 4-byte header length
    start = 12 + int.from_bytes(data[8:12], "little") if wide else 10 + int.from_bytes(data[8:10], "little")
    dtype, shape, fortran = _npy_header(data[:start])
    if dtype.hasobject or dtype.itemsize == 0:
        return np.lib.format.read_array(io.BytesIO(data), allow_pickle=False)
    # count: a member shorter than its header says raises (ValueError, as read_array's)
    flat = np.frombuffer(data, dtype=dtype, count=math.prod(shape), offset=start).copy()
    return flat.reshape(shape[::-1]).transpose() if fortran else flat.reshape(shape)


def write_order(samples: int, seed: int, shuffle: bool) -> np.ndarray:
    """Which source sample each position of a written train split holds (the manifest's `write`)."""
    return np.random.default_rng(seed).permutation(samples) if shuffle else np.arange(samples)


# --- the manifest ----------------------------------------------------------------------------------------------------


READING: tuple[tuple[str, Any], ...] = (("retries", 5), ("backoff", 1.0))  # the manifest read as the shards are


def _store(location: str, key: str, settings: Mapping | None = None) -> Store:
    return Store(location, **dict(settings or {}), key=key)


@functools.lru_cache(maxsize=64)
def _manifest_text(location: str, key: str, stamp: int | None, retries: int, backoff: float) -> str:
    try:
        return _store(location, key, {"retries": retries, "backoff": backoff}).read_text(MANIFEST)
    except ConfigError as error:  # no such dir, or no manifest in it (the store's line names which)
        raise ConfigError(f"{error}: scripts/make_shards.py writes a shard set") from None


def manifest_text(location: str, key: str = "data.path", retries: int = 5, backoff: float = 1.0) -> str:
    """manifest.json's text (read once a process; a local one again where it changed), retried as data.retries says."""
    local = Path(location) / MANIFEST
    stamp = local.stat().st_mtime_ns if "://" not in location and local.is_file() else None
    return _manifest_text(location, key, stamp, retries, backoff)


def read_manifest(location: str, key: str = "data.path", retries: int = 5, backoff: float = 1.0) -> dict:
    try:
        manifest = json.loads(manifest_text(location, key, retries, backoff))
    except json.JSONDecodeError as error:
        raise ConfigError(f"{key}={location}: {MANIFEST} is no JSON ({error}): write the shard set again") from None
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise ConfigError(
            f"{key}={location}: {MANIFEST} is not a trainkit shard set of version {VERSION} "
            f"(format {manifest.get('format')!r}, version {manifest.get('version')!r}): write it again"
        )
    return manifest


def locations(path: str | None, sources: Mapping | None) -> list[tuple[str, str, str, float]]:
    """[(name, location, config key, weight)] of data.path or data.sources; one line where neither or both is set."""
    if (path is None) == (not sources):
        said = "both" if path is not None else "neither"
        raise ConfigError(
            f"data=shards: set data.path=<dir|url> or data.sources={{name: {{path, weight}}}} ({said} is set)"
        )
    if path is not None:
        return [("train", str(path), "data.path", 1.0)]
    found = []
    for name, source in dict(sources or {}).items():
        if not _NAME.fullmatch(str(name)):
            raise ConfigError(f"data.sources.{name}: a source's name is letters, digits, '_', '.' or '-'")
        if isinstance(source, DictConfig):
            source = {k: None if OmegaConf.is_missing(source, k) else source[k] for k in source}
        source = dict(source) if isinstance(source, Mapping) else {}
        if source.get("path") is None:
            raise ConfigError(f"data.sources.{name}.path is not set: a shard set's dir or URL")
        weight = source.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not weight > 0 or math.isinf(weight):
            raise ConfigError(f"data.sources.{name}.weight={weight} must be a number > 0")
        found.append((str(name), str(source["path"]), f"data.sources.{name}.path", float(weight)))
    return found


def agreed(manifests: dict[str, dict]) -> dict:
    """The first source's manifest, after checking that every source's samples fit the same model and task."""
    (first, reference), *others = manifests.items()

    def facts(m: dict) -> dict[str, Any]:
        keys = {key: m["keys"].get(key, default) for key, default in MODEL_KEYS.items()}
        return {"task": m["task"]["_target_"], **keys, "collate_fn": m.get("collate_fn"), "images": m.get("images")}

    for name, manifest in others:
        theirs, ours = facts(manifest), facts(reference)
        for fact in ours:
            if theirs[fact] != ours[fact]:
                raise ConfigError(
                    f"data.sources: {first} and {name} differ in {fact} ({ours[fact]} vs {theirs[fact]}): "
                    "a mixture's samples must fit one model"
                )
    return reference


def data_key(key: str, path: str | None = None, sources: Any = None, *, _root_: Any = None) -> Any:
    """${shards_key:<key>,${data.path},${data.sources}} (conf/data/shards.yaml): the manifest's data key, its
    MODEL_KEYS default where the source had none. The config's task is checked first: a model's key of another
    task's samples (num_classes of tokens) would fail to resolve with a message about the model."""
    found = locations(path, sources)
    retries, backoff = (
        OmegaConf.select(_root_, f"data.{k}", default=d) if _root_ is not None else d for k, d in READING
    )
    reference = agreed({name: read_manifest(location, k, retries, backoff) for name, location, k, _ in found})
    task = OmegaConf.select(_root_, "task._target_", default=None) if _root_ is not None else None
    refuse_task(task, reference, path or f"data.sources.{found[0][0]} ({found[0][1]})")
    value = reference["keys"].get(key, MODEL_KEYS.get(key))
    return MODEL_KEYS.get(key) if value is None else value


def refuse_task(task: str | None, manifest: dict, where: str) -> None:
    """One line where the config's task (its _target_) is not the one the samples were written for."""
    if task is not None and task != manifest["task"]["_target_"]:
        data, name = manifest["source"]["data"], manifest["task"]["name"]
        raise ConfigError(f"data=shards: {where} holds data={data} samples: set task={name}")


# --- a split of a shard set ------------------------------------------------------------------------------------------


def tar_members(fd: int, size: int) -> list[tuple[str, int, int]] | None:
    """[(name, data offset, size)] of a plain USTAR tar (what ShardWriter writes), reading the 512-byte headers alone
    (~1 us a member; tarfile takes ~20); None where a header is anything else (tarfile then reads it)."""
    found: list[tuple[str, int, int]] = []
    offset = 0
    while offset + 512 <= size:
        header = os.pread(fd, 512, offset)
        if header[0] == 0:  # the end-of-archive blocks
            return found
        if header[257:262] != b"ustar" or header[156:157] not in (b"0", b"\0"):
            return None  # pax, GNU long names, links: not ours
        name, prefix = header[:100].rstrip(b"\0").decode(), header[345:500].rstrip(b"\0").decode()
        length = int(header[124:136].rstrip(b"\0 ") or b"0", 8)
        found.append((f"{prefix}/{name}" if prefix else name, offset + 512, length))
        offset += 512 + -(-length // 512) * 512
    return found


class ShardSplit(Dataset):
    """One split of a shard set (the module's docstring). The train split's `epoch_order` is the global order; where
    the set is remote, reading a sample of window j asks the store for window j+1's shards (`_track`)."""

    identity: dict = {}
    files: dict[str, str] = {}
    summary = ""
    no_test: str | None = None

    def __init__(self, location: str, key: str, settings: Mapping, split: str, manifest: dict, window: int):
        info = manifest["splits"].get(split, {"shards": [], "samples": 0, "kind": "tensors", "structure": None})
        self.location, self.key, self.settings, self.split, self.window = location, key, dict(settings), split, window
        self.names = [s["name"] for s in info["shards"]]
        self.bytes = [s["bytes"] for s in info["shards"]]
        self.cumulative = np.concatenate([[0], np.cumsum([s["samples"] for s in info["shards"]])]).astype(np.int64)
        self.kind, self.structure = info["kind"], info["structure"]
        self.images = manifest.get("images")
        self.draws_random: bool | str = "torch" if self.kind == "image" and split == "train" else False
        if manifest.get("collate_fn"):
            from hydra.utils import get_object

            self.collate_fn = get_object(manifest["collate_fn"])
        self.order_key: tuple[int, ...] = ()  # a mixture's source: (source index,) before the source epoch
        # [generation, seed, epoch]: where the train order is (epoch_order writes it; shared with loader workers)
        self.hint = torch.zeros(3, dtype=torch.int64)
        if split == "train":  # shared memory: a persistent worker sees what the main process writes (fork or spawn)
            self.hint.share_memory_()
        self.remote = self.reads_remotely = "://" in location  # the engine: a failed read is agreed on by all ranks
        self._reset()

    def _reset(self) -> None:
        self._store: Store | None = None
        self._index: dict[int, tuple[list[str], np.ndarray]] = {}
        self._open: OrderedDict[int, int] = OrderedDict()
        self._transform: Any = None
        self._at: tuple[int, int, int, int | None] | None = None  # (generation, seed, epoch, window) read last
        self._plans: OrderedDict[tuple, torch.Tensor] = OrderedDict()

    def __getstate__(self) -> dict:
        """Pickled (a spawned loader worker) without its open files, indexes or store: each process makes its own."""
        state = self.__dict__.copy()
        for name in ("_store", "_index", "_open", "_transform", "_at", "_plans"):
            state.pop(name)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__ |= state
        self._reset()

    def __del__(self, close=os.close) -> None:  # `close` bound now: at the interpreter's exit `os` may be gone
        for fd in getattr(self, "_open", {}).values():
            close(fd)

    def __len__(self) -> int:
        return int(self.cumulative[-1])

    @property
    def store(self) -> Store:
        if self._store is None:
            self._store = _store(self.location, self.key, self.settings)
        return self._store

    def __getitem__(self, index: int):
        if not 0 <= index < len(self):
            raise IndexError(index)
        shard = int(np.searchsorted(self.cumulative, index, side="right")) - 1
        if self.remote and self.split == "train":
            self._track(shard)
        suffixes, where = self._members(shard)
        fd = self._fd(shard)
        row = where[index - int(self.cumulative[shard])]
        members = {s: os.pread(fd, int(n), int(o)) for s, (o, n) in zip(suffixes, row.reshape(-1, 2), strict=True)}
        return self._decode(members, index)

    def _fd(self, shard: int) -> int:
        fd = self._open.get(shard)
        if fd is not None:
            self._open.move_to_end(shard)
            return fd
        # A URL's shard downloaded into the cache (DataUnavailable), opened at once: the descriptor keeps reading it
        # when a cleanup (another rank's, or this process's prefetch) removes the file from the cache
        with self.store.open(self.names[shard]) as file:
            fd = os.dup(file.fileno())
        if (size := os.fstat(fd).st_size) != self.bytes[shard]:
            os.close(fd)
            raise RankError(
                f"{self.key}={self.location}: {self.names[shard]} holds {size} bytes, {MANIFEST} says "
                f"{self.bytes[shard]}: the shard set changed after it was written; write it again"
            )
        self._open[shard] = fd
        if len(self._open) > OPEN_FILES:
            os.close(self._open.popitem(last=False)[1])
        return fd

    def _members(self, shard: int) -> tuple[list[str], np.ndarray]:
        """(member suffixes, [sample, (offset, size) per member]) of the shard: its tar headers, read once."""
        if shard in self._index:
            return self._index[shard]
        fd = self._fd(shard)
        members = tar_members(fd, self.bytes[shard])
        if members is None:
            with os.fdopen(os.dup(fd), "rb") as file, tarfile.open(fileobj=file, mode="r:") as tar:
                members = [(m.name, m.offset_data, m.size) for m in tar if m.isfile()]
        first, samples = int(self.cumulative[shard]), int(self.cumulative[shard + 1] - self.cumulative[shard])
        rows: dict[int, dict[str, tuple[int, int]]] = {}
        for name, offset, size in members:
            key, _, suffix = name.partition(".")
            suffix = "image" if self.kind == "image" and suffix != "cls" else suffix
            rows.setdefault(int(key) - first, {})[suffix] = (offset, size)
        suffixes = sorted(rows.get(0, {}))
        if sorted(rows) != list(range(samples)) or any(sorted(r) != suffixes for r in rows.values()):
            raise RankError(
                f"{self.key}={self.location}: {self.names[shard]} does not hold the {samples} samples of "
                f"{len(suffixes)} members each that {MANIFEST} says: write the shard set again"
            )
        where = np.array([[v for s in suffixes for v in rows[i][s]] for i in range(samples)], dtype=np.int64)
        self._index[shard] = suffixes, where.reshape(samples, -1)
        return self._index[shard]

    def _decode(self, members: dict[str, bytes], index: int):
        if self.kind != "image":
            arrays = [read_npy(members[f"{n}.npy"]) for n in range(len(members))]
            return rebuild(self.structure, arrays)
        from PIL import Image

        from trainkit.data.image_folder import UnreadableImage, transforms_of

        if self._transform is None:
            settings = self.images or {}
            augment, plain = transforms_of(
                settings["image_size"], settings["resize"], settings["mean"], settings["std"]
            )
            self._transform = augment if self.split == "train" else plain
        try:
            image = Image.open(io.BytesIO(members["image"])).convert("RGB")
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as error:
            raise UnreadableImage(
                f"{self.key}={self.location}: sample {index} of {self.split} is no image PIL reads ({error})"
            ) from None
        return self._transform(image), int(members["cls"])

    # the global order and prefetching

    def epoch_order(self, seed: int, epoch: int, global_batch: int) -> torch.Tensor:
        """The train split's order of `epoch` (the module's docstring); `global_batch` plays no part in it."""
        self.hint.copy_(torch.tensor([int(self.hint[0]) + 1, seed, epoch]))
        return local_order(self.cumulative, self.window, (seed, *self.order_key, epoch))

    def _plan(self, seed: int, epoch: int) -> torch.Tensor:
        """Each shard's window in `epoch` (a few kept)."""
        key = (seed, *self.order_key, epoch)
        if key not in self._plans:
            self._plans[key] = torch.argsort(shard_permutation(len(self.names), key)) // self.window
            if len(self._plans) > 4:
                self._plans.popitem(last=False)
        return self._plans[key]

    def _track(self, shard: int) -> None:
        """Entering a window (the next one, or the next epoch's first), ask the store for the one after it. Each
        process follows its own reads from the epoch epoch_order last named; windows seen out of step are ignored
        (a micro-batch's samples straddle two windows)."""
        generation, seed, epoch = self.hint.tolist()
        if generation == 0:
            return
        if self._at is None or self._at[0] != generation:
            self._at = (generation, seed, epoch, None)
        _, seed, epoch, at = self._at
        window = int(self._plan(seed, epoch)[shard])
        last = (len(self.names) - 1) // self.window
        if at == window:
            return
        if at is not None and window != at + 1:
            if at != last or int(self._plan(seed, epoch + 1)[shard]) != 0:
                return
            epoch, window = epoch + 1, 0
        self._at = (generation, seed, epoch, window)
        following = (epoch, window + 1) if window < last else (epoch + 1, 0)
        plan = self._plan(seed, following[0])
        self.store.prefetch([self.names[s] for s in torch.nonzero(plan == following[1]).flatten().tolist()])


# --- splits ----------------------------------------------------------------------------------------------------------


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _source_files(store: Store, manifest: dict) -> dict[str, str]:
    return {name: store.read_text(f"files/{name}") for name in manifest.get("files", {})}


# A token corpus's meta.json (trainkit/data/tokens.py) describes its corpus too (documents, token counts, checksums):
# two corpora of one tokenizer differ there. Their vocabulary is these fields; the run dir keeps the first source's.
_META_VOCABULARY = ("vocab_size", "tokenizer", "eot", "bos", "pad", "dtype")


def _vocabulary(file: str, text: str) -> str:
    """What of a source's file must be the same in every source of a mixture: all of it, but of a meta.json its
    vocabulary (and its tokenizer's checksum)."""
    if Path(file).name != "meta.json":
        return text
    meta = json.loads(text)
    tokenizer_sha = meta.get("sha256", {}).get("tokenizer")
    return json.dumps([meta.get(key) for key in _META_VOCABULARY] + [tokenizer_sha])


def splits(
    path: str | None = None,
    sources: dict[str, Any] | None = None,
    window: int = 4,
    epoch_samples: int | None = None,
    cache_dir: str | None = None,
    cache_limit: str = "4GB",
    retries: int = 5,
    backoff: float = 1.0,
) -> tuple[Dataset, Dataset, Dataset | None]:
    """(train, val, test) of a shard set (`path`) or a mixture (`sources`); test None where the set has none. Usable
    with `path` alone (an evaluation set's _target_)."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ConfigError(f"data.window={window} must be an integer >= 1")
    if epoch_samples is not None and (not isinstance(epoch_samples, int) or epoch_samples < 1):
        raise ConfigError(f"data.epoch_samples={epoch_samples} must be null or an integer >= 1")
    if path is not None and epoch_samples is not None:
        raise ConfigError("data.epoch_samples sets a mixture's epoch (data.sources); a shard set's is its train split")
    settings = {"cache_dir": cache_dir, "cache_limit": cache_limit, "retries": retries, "backoff": backoff}
    found = locations(path, sources)
    manifests = {name: read_manifest(location, key, retries, backoff) for name, location, key, _ in found}
    reference = agreed(manifests)
    made = {
        name: [ShardSplit(location, key, settings, split, manifests[name], window) for split in SPLITS]
        for name, location, key, _ in found
    }
    identity: dict[str, Any] = {
        f"data.shards.{name}": {
            "sha256": _sha(manifest_text(location, key, retries, backoff)),
            "source": f"{MANIFEST} of {location}",
        }
        for name, location, key, _ in found
    }
    files = {
        f"shards/{name}.{MANIFEST}": manifest_text(location, key, retries, backoff) for name, location, key, _ in found
    }
    kept: dict[str, str] = {}
    for name, splits_of in made.items():
        for file, text in _source_files(splits_of[0].store, manifests[name]).items():
            if _vocabulary(file, kept.setdefault(file, text)) != _vocabulary(file, text):
                raise ConfigError(
                    f"data.sources: {name} carries another {file} than {found[0][0]} (its source's): a mixture's "
                    "samples must share it (one vocabulary)"
                )
    files |= kept
    no_test = [name for name, m in manifests.items() if m["splits"].get("test", {}).get("samples", 0) == 0]
    said = ", ".join(f"{s} {sum(len(parts[SPLITS.index(s)]) for parts in made.values())}" for s in SPLITS)
    train: Any
    val: Any
    test: Any
    if path is not None:
        train, val, test = made["train"]
        train.summary = (
            f"data: shards {path} (data={reference['source']['data']}): {len(train.names)} train shards, {said}; "
            f"window {window} shards (a global batch mixes their samples)"
        )
    else:
        names = [name for name, *_ in found]
        empty = [name for name in names if len(made[name][0]) == 0]
        if empty:
            raise ConfigError(f"data.sources.{empty[0]}: its shard set has no train samples")
        weights = [w for *_, w in found]
        train = Mixture(names, [made[n][0] for n in names], weights, epoch_samples)
        val = Joined([made[n][1] for n in names])
        tests = [made[n][2] for n in names if n not in no_test]
        test = Joined(tests) if tests else Joined([])
        shares = ", ".join(f"{n} {a / train.denominator:.4g}" for n, a in zip(names, train.shares, strict=True))
        identity["data.shards.mixture"] = ", ".join(
            f"{n}={a}/{train.denominator}" for n, a in zip(names, train.shares, strict=True)
        )
        train.summary = (
            f"data: a mixture of {len(names)} shard sets ({shares}), an epoch of {len(train)} samples; {said}; "
            f"window {window} shards a source"
        )
    train.identity, train.files = identity, files
    if len(test) == 0:
        why = reference["source"].get("no_test") or "its source had none"
        single = f"the shard set {path} has no test split ({why})"
        train.no_test = single if path is not None else "no source of data.sources has a test split"
    return train, val, (None if len(test) == 0 else test)


def check(cfg) -> None:
    """Before the run dir: data.path xor data.sources, the weights, the window, and the task the samples were
    written for (the manifest's)."""
    node = cfg.data.splits
    found = locations(node.get("path"), node.get("sources"))
    window = node.get("window", 4)
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ConfigError(f"data.window={window} must be an integer >= 1")
    retries, backoff = (node.get(key, default) for key, default in READING)
    manifests = {name: read_manifest(location, key, retries, backoff) for name, location, key, _ in found}
    reference = agreed(manifests)
    task = OmegaConf.select(cfg, "task._target_", default=None)
    refuse_task(task, reference, node.get("path") or f"data.sources.{found[0][0]} ({found[0][1]})")
    if node.get("sources") and cfg.data.get("shuffle", True) is False:
        raise ConfigError(
            "data.shuffle=false: a mixture's epoch is drawn by weight (data.sources); it has no stored order"
        )
    mode = OmegaConf.select(cfg, "debug.mode", default=None)
    if node.get("sources") and mode in ("limit", "fast", "overfit"):  # debug's subsets: the first samples, no weights
        raise ConfigError(
            f"debug={mode}: not with a mixture (data.sources draws each global batch by weight); "
            "debug a source alone: data.path=<its dir>"
        )


# ${shards_key:<key>,${data.path},${data.sources}} (conf/data/shards.yaml): what the models read, from the manifest
OmegaConf.register_new_resolver("shards_key", data_key, replace=True)
