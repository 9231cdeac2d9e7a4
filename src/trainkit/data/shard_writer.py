"""scripts/make_shards.py's work: a data set of the tree written as a shard set (the format: trainkit/data/shards.py).

Everything is written into a temp dir beside `out` and renamed into place at the end (to a URL: written locally, then
uploaded, the manifest last): a failed run leaves no half-written set, and a reader never sees shards without their
manifest. An `out` that holds files is refused unless overwrite=true.
"""

import hashlib
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from trainkit.data import shards
from trainkit.data.shard_store import Store, upload
from trainkit.data.tokens import sha256_file
from trainkit.errors import ConfigError

# The data keys that are no fact about the samples: what the loader does with them (trainkit.schema.Data's)
LOADER_KNOBS: tuple[str, ...] = ("name", "splits", "batch_size", "drop_last", "shuffle", "num_workers", "pin_memory")
LOADER_KNOBS += ("prefetch_factor", "on_device", "eval_sets")


def refuse_existing(out: str, overwrite: bool) -> None:
    """An `out` that holds a shard set or any file: refused unless overwrite=true (one line)."""
    if "://" in out:
        try:
            Store(out, key="out").read_text(shards.MANIFEST)
        except ConfigError:  # no shard set there
            return
        if not overwrite:
            raise ConfigError(f"out={out} holds a shard set: another URL, or overwrite=true to replace it")
        return
    path = Path(out).expanduser()
    if path.exists() and not path.is_dir():
        raise ConfigError(f"out={out} is a file: name a directory")
    if path.is_dir() and any(path.iterdir()) and not overwrite:
        raise ConfigError(f"out={out} exists and holds files: another dir, or overwrite=true to replace it")


def image_folder(split: Any, train: Any) -> bool:
    """A split of data=image_folder: written as its files' bytes (its transforms run when read)."""
    from torchvision.datasets import DatasetFolder

    return isinstance(split, DatasetFolder) and hasattr(train, "image_settings")


def collate_name(train: Any) -> str | None:
    """The train split's own collate_fn by qualified name (the reader imports it), None without one."""
    function = getattr(train, "collate_fn", None)
    if function is None:
        return None
    name = f"{function.__module__}.{function.__qualname__}"
    if "<" in name:
        raise ConfigError(f"the data set's collate_fn {name} has no importable name: shards name it for the reader")
    return name


def _json(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def write_split(dataset: Any, split: str, folder: Path, images: bool, seed: int, shuffle: bool, limits, progress):
    """The split's shards in `folder`: [{name, samples}], its sample kind and structure."""
    import webdataset
    from tqdm import tqdm

    order = shards.write_order(len(dataset), seed, shuffle and split == "train")
    counts: dict[str, int] = {}
    structure = None
    shard_size, max_count = limits
    pattern = str(folder / f"{split}-%06d.tar")
    # mtime 0: the same source writes the same bytes (the shards' sha256)
    with webdataset.ShardWriter(
        pattern, maxcount=max_count, maxsize=shard_size, verbose=0, encoder=False, mtime=0
    ) as w:
        for position, index in enumerate(tqdm(order.tolist(), desc=f"{split}", unit=" samples", disable=not progress)):
            sample: dict[str, Any] = {"__key__": f"{position:09d}"}
            if images:
                path, target = dataset.samples[index]
                sample |= {Path(path).suffix.lower().lstrip(".") or "img": Path(path).read_bytes()}
                sample["cls"] = str(int(target)).encode()
            else:
                found, leaves = shards.flatten(dataset[index])
                if structure is None:
                    structure = found
                elif found != structure:
                    raise ConfigError(
                        f"{split} sample {index} is made otherwise than the first ({found} vs {structure})"
                    )
                sample |= {f"{n}.npy": shards.npy(leaf) for n, leaf in enumerate(leaves)}
            w.write(sample)
            name = Path(w.fname).name
            counts[name] = counts.get(name, 0) + 1
    return [{"name": name, "samples": n} for name, n in counts.items()], ("image" if images else "tensors"), structure


def write(
    cfg: DictConfig,
    task: str,
    sets: tuple,
    out: str,
    shard_size: int,
    max_count: int,
    wanted: list[str],
    seed: int = 0,
    shuffle: bool = True,
    overwrite: bool = False,
    progress: bool = True,
    say: Callable[[str], None] = print,
) -> dict:
    """Write `sets` ((train, val, test) of cfg.data; test may be None) as a shard set at `out`; returns its manifest."""
    train = sets[0]
    if getattr(train, "draws_random", True) and not image_folder(train, train):
        drawn = getattr(train, "draws_random", True)
        raise ConfigError(
            f"data={cfg.data.name}: its train split draws its samples at random each epoch (draws_random={drawn}): "
            "shards would fix one draw; write a data set whose samples are fixed"
        )
    data = OmegaConf.to_container(cfg.data, resolve=True)
    assert isinstance(data, dict)
    manifest: dict[str, Any] = {
        "format": shards.FORMAT,
        "version": shards.VERSION,
        "splits": {},
        "samples": 0,
        "source": {
            "data": cfg.data.name,
            "config": _json(data),
            "identity": _json(getattr(train, "identity", {})),
            "no_test": getattr(train, "no_test", None),
        },
        "keys": _json({k: v for k, v in data.items() if k not in LOADER_KNOBS}),
        "task": {"name": task, "_target_": cfg.task._target_},
        "collate_fn": collate_name(train),
        "write": {"seed": seed, "shuffled": shuffle, "order": "numpy.random.default_rng(seed).permutation(samples)"},
        "files": {},
    }
    if image_folder(train, train):
        manifest["images"] = _json(train.image_settings)
    remote = "://" in out
    local = Path(out).expanduser()
    if remote:
        stage = Path(tempfile.mkdtemp(prefix="make_shards-"))
    else:
        local.parent.mkdir(parents=True, exist_ok=True)
        stage = local.parent / f".{local.name}.shards-{uuid.uuid4().hex[:8]}"
        stage.mkdir()
    try:
        for split, dataset in zip(shards.SPLITS, sets, strict=True):
            if split not in wanted:
                continue
            if dataset is None:
                say(f"make_shards: data={cfg.data.name} has no {split} split ({getattr(train, 'no_test', None)})")
                continue
            written, kind, structure = write_split(
                dataset, split, stage, image_folder(dataset, train), seed, shuffle, (shard_size, max_count), progress
            )
            for shard in written:
                shard |= {"bytes": (stage / shard["name"]).stat().st_size, "sha256": sha256_file(stage / shard["name"])}
            samples = sum(s["samples"] for s in written)
            manifest["splits"][split] = {"shards": written, "samples": samples, "kind": kind, "structure": structure}
            manifest["samples"] += samples
        for name, text in getattr(train, "files", {}).items():  # a corpus's tokenizer: a run dir gets it
            (stage / "files" / name).parent.mkdir(parents=True, exist_ok=True)
            (stage / "files" / name).write_text(text)
            manifest["files"][name] = hashlib.sha256(text.encode()).hexdigest()
        text = json.dumps(manifest, indent=1) + "\n"
        if remote:
            upload(stage, out)  # the shards and files first,
            last = Path(tempfile.mkdtemp(prefix="make_shards-manifest-"))
            (last / shards.MANIFEST).write_text(text)
            upload(last, out)  # then the manifest: a reader never finds one without its shards
            shutil.rmtree(last)
            shutil.rmtree(stage)
        else:
            (stage / shards.MANIFEST).write_text(text)
            _into_place(stage, local)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return manifest


def _into_place(stage: Path, out: Path) -> None:
    """`stage` renamed to `out`; an `out` already there (overwrite=true) stays whole until the new one is in place."""
    if out.exists():
        old = stage.with_name(stage.name + ".old")
        os.rename(out, old)
        os.rename(stage, out)
        shutil.rmtree(old)
    else:
        os.rename(stage, out)
