"""data=shards' read throughput (issue 60, item 7): trainkit's train loader over a shard set against webdataset's own
loader over the same shards and against the memory-mapped token corpus; and the cache a shard set read from an object
store holds (docs/performance.md, "Sharded data (data=shards)").

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_shards.py [--tokens] [--images] [--cache] [--corpus-mb 3]
        [--num-images 3000] [--batch-size 64] [--workers 0 2] [--rounds 5] [--window 4] [--quick] [--out rows.json]

No section named: all three. Everything is written into a temporary dir, removed at the end.

--tokens: a bytes-tokenizer corpus of the running Python's standard library .py files (without test/ and
site-packages), in sorted order each that still fits in --corpus-mb MB (trainkit.data.corpus.prepare), written by
scripts/make_shards.py (data=tokens, data.block_size=256: tiles, every token a target once) into shards of
--shard-size. Three loaders, each built once (persistent workers where there are any) at each of --workers:
- `trainkit`: data=shards' train split (trainkit.data.shards) through trainkit.loading.TrainWindows, train.py's
  path: its global order (epoch_order: shards permuted, samples permuted within windows of --window shards),
  a DataLoader over SeededBatches, one window's micro-batch fetched at a time (K=1);
- `webdataset`: the same shard files through webdataset's own pipeline, `WebDataset(urls, shardshuffle=<shards>,
  detshuffle=True)` (its workers split the shards among them), `.shuffle(1000)`, `.decode()` (its .npy decoder),
  the two members as tensors, `.batched(batch_size)` with torch's default collation, in a torch DataLoader
  (batch_size=None): the same tensors, batches of the same size;
- `memmap`: the corpus itself, data=tokens' tiles (random_offsets=false: the samples the shards hold) read from the
  memory-mapped train.bin through the same TrainWindows (data.on_device=false: the loader, not the split in memory).
--images: an image folder of scikit-learn's digits (8x8) upscaled to 32x32 RGB PNGs, --num-images of them (the
1797 digits again, each pass rolled by one more pixel), written by make_shards (data=image_folder,
data.image_size=32, mean 0.5 / std 0.25 given) into shards of --image-shard-count images; `trainkit` and
`webdataset` as above, both decoding with PIL to RGB and applying image_folder's train transform (RandomResizedCrop
32, flip, ToTensor, Normalize; trainkit also seeds torch's generator per sample: draws_random="torch").
--cache: the token shards uploaded (shard_store.upload) to an S3 server on localhost (moto, tests/s3_server.py, in
this process) and one epoch read through TrainWindows (0 workers) from the s3:// URL with data.window=--cache-window
and data.cache_limit = --cache-windows windows of the largest shard; the cache dir's size polled every 2 ms: its
largest, against shard size x window, and how often each shard was downloaded (once each: no thrashing).

Timing: wall clock (loader workers are other processes). Each loader is warmed by one epoch; a round times one epoch
of each in an order that rotates between rounds; the figures are the medians over rounds, the ratios the medians of
the per-round ratios (quartiles beside them); the ratios also by CPU time (this process's and its loader workers',
read from /proc: the figure that holds where other jobs share the cores, when wall-clock rounds swing by tens of
per cent).
"""

import argparse
import contextlib
import importlib.util
import io
import json
import os
import statistics
import sys
import sysconfig
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import OmegaConf
from torch.utils.data import DataLoader, default_collate

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from trainkit.data import shard_store, shards, tokens  # noqa: E402
from trainkit.data.corpus import prepare  # noqa: E402
from trainkit.data.image_folder import transforms_of  # noqa: E402
from trainkit.dist import Dist  # noqa: E402
from trainkit.loading import TrainWindows  # noqa: E402

CPU = Dist(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
BLOCK, IMAGE_SIZE, MEAN, STD = 256, 32, [0.5] * 3, [0.25] * 3
SHUFFLE_BUFFER = 1000  # webdataset's usual .shuffle(1000) (its README, its docstring's default)


def make_shards(argv: list[str]) -> None:
    """scripts/make_shards.py in this process (its main(argv)), its one summary line printed."""
    spec = importlib.util.spec_from_file_location("make_shards", ROOT / "scripts" / "make_shards.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        status = module.main(argv, progress=False)
    if status != 0:
        raise SystemExit(f"make_shards {' '.join(argv)} exited with {status}")
    print(said.getvalue().strip().splitlines()[-1])


class Work:
    """The data sets, each made once in `root` when a section first asks for it."""

    def __init__(self, root: Path, args):
        self.root, self.args = root, args
        self.made: dict = {}

    def corpus(self) -> Path:
        if "corpus" not in self.made:
            stdlib, texts = Path(sysconfig.get_paths()["stdlib"]), self.root / "texts"
            budget = int(self.args.corpus_mb * 1e6)
            for path in sorted(stdlib.rglob("*.py")):  # in order, each file that still fits the budget
                relative = path.relative_to(stdlib)
                if {"test", "tests", "site-packages"} & set(relative.parts) or not path.is_file():
                    continue
                if path.stat().st_size > budget:
                    continue
                (texts / relative).parent.mkdir(parents=True, exist_ok=True)
                (texts / relative).write_bytes(path.read_bytes())
                budget -= path.stat().st_size
            prepare([str(texts)], str(self.root / "corpus"), "bytes", progress=False)
            self.made["corpus"] = self.root / "corpus"
        return self.made["corpus"]

    def token_shards(self) -> Path:
        if "token_shards" not in self.made:
            out = self.root / "token_shards"
            make_shards(
                ["data=tokens", f"data.root={self.corpus()}", f"data.block_size={BLOCK}", "splits=train"]
                + [f"shard_size={self.args.shard_size}", f"out={out}"]
            )
            self.made["token_shards"] = out
        return self.made["token_shards"]

    def image_shards(self) -> Path:
        if "image_shards" not in self.made:
            folder, out = write_digits(self.root / "images", self.args.num_images), self.root / "image_shards"
            make_shards(
                ["data=image_folder", f"data.root={folder}", f"data.image_size={IMAGE_SIZE}", "splits=train"]
                + [f"data.mean={MEAN}", f"data.std={STD}", f"max_count={self.args.image_shard_count}", f"out={out}"]
            )
            self.made["image_shards"] = out
        return self.made["image_shards"]


def write_digits(root: Path, count: int) -> Path:
    """train/<digit>/<i>.png: scikit-learn's digits upscaled to 32x32 RGB, `count` of them (the 1797 again and again,
    each pass rolled one pixel further); val/ holds one image a class (image_folder wants one)."""
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    pixels = (digits.images * (255 / 16)).astype(np.uint8)
    for i in range(count + 10):
        split, n = ("train", i) if i < count else ("val", i - count)
        image = np.roll(pixels[n % len(pixels)], n // len(pixels), axis=1)
        directory = root / split / str(digits.target[n % len(pixels)])
        directory.mkdir(parents=True, exist_ok=True)
        big = Image.fromarray(image).resize((IMAGE_SIZE, IMAGE_SIZE), Image.Resampling.BILINEAR).convert("RGB")
        big.save(directory / f"{i}.png")
    return root


# --- the loaders: each a function epoch -> iterable of (x, y) batches -------------------------------------------------


def trainkit_loader(dataset, workers: int, batch_size: int, on_device="auto"):
    """train.py's path: TrainWindows (the data set's epoch_order where it has one), K=1, a window fetched at a time."""
    data = OmegaConf.create(
        {"num_workers": workers, "pin_memory": False, "prefetch_factor": None, "shuffle": True, "on_device": on_device}
    )
    windows = TrainWindows(dataset, CPU, data, seed=0, size=lambda: (batch_size, 1))
    assert windows.path.startswith("DataLoader"), windows.path

    def epoch(number: int):
        windows.epoch(number)
        for window in range(len(windows.micro_steps)):
            yield from windows.fetch(window)

    epoch.dataloader = lambda: windows.loader.loader  # type: ignore[attr-defined]  # its workers' CPU time
    return epoch


def _tensors(sample):
    return tuple(torch.from_numpy(x) for x in sample)


def _decode_tokens(pipeline):
    return pipeline.decode().to_tuple("0.npy", "1.npy").map(_tensors)


def _decode_images(pipeline):
    augment, _ = transforms_of(IMAGE_SIZE, None, MEAN, STD)
    return pipeline.decode("pil").to_tuple("png", "cls").map_tuple(augment, int)


def webdataset_loader(folder: Path, decode, workers: int, batch_size: int):
    """webdataset's own pipeline over the shard files of `folder`'s train split (the module's docstring)."""
    import webdataset as wds

    manifest = json.loads((folder / shards.MANIFEST).read_text())
    urls = [str(folder / s["name"]) for s in manifest["splits"]["train"]["shards"]]
    pipeline = wds.WebDataset(urls, shardshuffle=len(urls), detshuffle=True, seed=0).shuffle(SHUFFLE_BUFFER)
    pipeline = decode(pipeline).batched(batch_size, collation_fn=default_collate)
    loader = DataLoader(pipeline, batch_size=None, num_workers=workers, persistent_workers=workers > 0)

    def epoch(number: int):
        return loader

    epoch.dataloader = lambda: loader  # type: ignore[attr-defined]
    return epoch


def cpu_seconds(dataloader: DataLoader) -> float:
    """CPU seconds used so far by this process and by the loader's (persistent) workers, read from /proc."""
    total = time.process_time()
    for worker in getattr(getattr(dataloader, "_iterator", None), "_workers", []):
        with contextlib.suppress(OSError):  # utime and stime: the 14th and 15th fields of /proc/<pid>/stat
            fields = Path(f"/proc/{worker.pid}/stat").read_text().rpartition(")")[2].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def epoch_rate(loader, epoch: int, count: int) -> tuple[float, float]:
    """Samples per second of one pass over `loader(epoch)`: of wall time, and of the CPU time of this process and
    the loader's workers together."""
    start, cpu, seen = time.perf_counter(), cpu_seconds(loader.dataloader()), 0
    for x, _ in loader(epoch):
        seen += len(x)
    elapsed, used = time.perf_counter() - start, cpu_seconds(loader.dataloader()) - cpu
    assert seen == count, (seen, count)
    return seen / elapsed, seen / max(used, 1e-9)


def time_loaders(loaders: dict, count: int, rounds: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """({name: samples/s per round}, the same by this process's CPU time): a warm-up epoch each (workers start),
    then rounds in a rotating order."""
    names = list(loaders)
    rates: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    for name in names:
        epoch_rate(loaders[name], 0, count)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            wall, used = epoch_rate(loaders[name], r + 1, count)
            rates[name].append(wall)
            cpu[name].append(used)
    return rates, cpu


def spread(values: list[float]) -> tuple[float, float, float]:
    """(median, lower quartile, upper quartile)."""
    q = statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
    return statistics.median(values), q[0], q[2]


def compare(section: str, folder: Path, decode, args, memmap=None) -> list[dict]:
    train: Any = shards.splits(path=str(folder), window=args.window)[0]  # a ShardSplit
    rows = []
    for workers in args.workers:
        loaders = {
            "trainkit": trainkit_loader(train, workers, args.batch_size),
            "webdataset": webdataset_loader(folder, decode, workers, args.batch_size),
        }
        if memmap is not None:
            loaders["memmap"] = trainkit_loader(memmap, workers, args.batch_size, on_device=False)
        rates, cpu = time_loaders(loaders, len(train), args.rounds)
        row = {"section": section, "workers": workers, "samples": len(train), "shards": len(train.names)}
        row |= {name: statistics.median(r) for name, r in rates.items()}
        for key, other in (("ratio", "webdataset"), ("of_memmap", "memmap")):
            if other in loaders:
                row[key], *row[f"{key}_quartiles"] = spread(
                    [t / o for t, o in zip(rates["trainkit"], rates[other], strict=True)]
                )
                # by the CPU time of the process and its workers: the figure that holds where other jobs share the
                # cores (an epoch's workers are persistent: started in the warm-up, before any timing)
                row[f"{key}_cpu"] = statistics.median([t / o for t, o in zip(cpu["trainkit"], cpu[other], strict=True)])
        row["rounds"] = args.rounds
        rows.append(row)
        del loaders  # their persistent workers end with them
    return rows


def bench_tokens(args, work: Work) -> list[dict]:
    memmap = tokens.splits(str(work.corpus()), block_size=BLOCK, random_offsets=False)[0]
    return compare("tokens", work.token_shards(), _decode_tokens, args, memmap)


def bench_images(args, work: Work) -> list[dict]:
    return compare("images", work.image_shards(), _decode_images, args)


def folder_bytes(folder: Path) -> int:
    total = 0
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(folder):
            with contextlib.suppress(FileNotFoundError):  # deleted by the cleanup meanwhile
                total += entry.stat().st_size
    return total


def bench_cache(args, work: Work) -> list[dict]:
    """One epoch of the token shards from an S3 URL: the cache dir's largest size and the downloads per shard."""
    sys.path.insert(0, str(ROOT / "tests"))
    from s3_server import serving

    folder = work.token_shards()
    manifest = json.loads((folder / shards.MANIFEST).read_text())
    sizes = [s["bytes"] for s in manifest["splits"]["train"]["shards"]]
    limit = int(args.cache_windows * args.cache_window * max(sizes))
    downloads: Counter = Counter()
    opened = shard_store._gopen

    def counted(url: str, *a, **kw):
        if url.endswith(".tar"):
            downloads[url.rpartition("/")[2]] += 1
        return opened(url, *a, **kw)

    with serving() as server, tempfile.TemporaryDirectory(dir=work.root) as cache:
        url = server.bucket("bench") + "/tokens"
        shard_store.upload(folder, url)
        shard_store._gopen = counted  # what the Store registers with webdataset
        try:
            train: Any = shards.splits(
                path=url, window=args.cache_window, cache_dir=cache, cache_limit=str(limit), retries=3, backoff=0.2
            )[0]
            where = train.store.cache_dir
            observed, done = [], threading.Event()

            def poll():
                while not done.wait(0.002):
                    observed.append(folder_bytes(where))

            poller = threading.Thread(target=poll, daemon=True)
            poller.start()
            start = time.perf_counter()
            seen = sum(len(x) for x, _ in trainkit_loader(train, 0, args.batch_size)(0))
            seconds = time.perf_counter() - start
            train.store.wait_prefetched()  # the next epoch's first window, asked for on entering the last one
            done.set()
            poller.join()
            observed.append(folder_bytes(where))
        finally:
            shard_store._gopen = opened
    assert seen == len(train), (seen, len(train))
    # Each shard once; the next epoch's first window (the first `window` shards of the permutation of (seed 0,
    # epoch 1)), asked for on entering the last window, once more where the cache no longer held it
    following = {train.names[i] for i in shards.shard_permutation(len(train.names), (0, 1))[: args.cache_window]}
    allowed = Counter(train.names) + Counter(following)
    return [
        {
            "section": "cache",
            "shards": len(sizes),
            "shard_bytes": max(sizes),
            "window": args.cache_window,
            "cache_limit": limit,
            "max_cache": max(observed),
            "end_cache": observed[-1],
            "polls": len(observed),
            "downloads": sum(downloads.values()),
            "downloaded_shards": len(downloads),
            "most_downloads": max(downloads.values(), default=0),
            "next_epoch": len(following),
            "next_epoch_downloads": sum(downloads[name] - 1 for name in following if downloads[name] > 1),
            "refetched": sum((downloads - allowed).values()),  # beyond those: a shard pushed out before it was read
            "unread": sum(1 for name in train.names if downloads[name] == 0),
            "samples": seen,
            "seconds": seconds,
        }
    ]


SECTIONS = {"tokens": bench_tokens, "images": bench_images, "cache": bench_cache}


def table(rows: list[dict]) -> str:
    lines = [
        "| data | workers | samples (shards) | trainkit, data=shards (samples/s) | webdataset (samples/s) "
        "| trainkit / webdataset (quartiles) | by CPU time | data=tokens memmap (samples/s) "
        "| trainkit / memmap (quartiles) | by CPU time |",
        "|---|---|---|---:|---:|---|---|---:|---|---|",
    ]

    def ratio(r: dict, key: str) -> str:
        if key not in r:
            return "- | -"
        q = r[f"{key}_quartiles"]
        return f"{r[key]:.3f} ({q[0]:.3f}-{q[1]:.3f}) | {r[f'{key}_cpu']:.3f}"

    for r in rows:
        if r["section"] == "cache":
            continue
        memmap = f"{r['memmap']:.0f}" if "memmap" in r else "-"
        lines.append(
            f"| {r['section']} | {r['workers']} | {r['samples']} ({r['shards']}) | {r['trainkit']:.0f} "
            f"| {r['webdataset']:.0f} | {ratio(r, 'ratio')} | {memmap} | {ratio(r, 'of_memmap')} |"
        )
    for r in rows:
        if r["section"] == "cache":
            mb = 1e6
            lines.append(
                f"\ncache (s3:// on localhost, 0 workers, window {r['window']}, {r['shards']} shards of at most "
                f"{r['shard_bytes'] / mb:.2f} MB, cache_limit {r['cache_limit'] / mb:.2f} MB): largest "
                f"{r['max_cache'] / mb:.2f} MB = {r['max_cache'] / (r['shard_bytes'] * r['window']):.2f} x shard "
                f"size x window ({r['polls']} polls), {r['end_cache'] / mb:.2f} MB at the end; {r['downloads']} "
                f"downloads: {r['shards'] - r['unread']} shards once, {r['refetched']} again (pushed out before "
                f"read), {r['next_epoch_downloads']} of the next epoch's first window ({r['next_epoch']} shards, asked "
                f"for in the last window; the rest still cached); the epoch {r['samples'] / r['seconds']:.0f} "
                f"samples/s (the server in this process)"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name in SECTIONS:
        parser.add_argument(f"--{name}", action="store_true", help=f"the {name} section (none named: all)")
    parser.add_argument("--corpus-mb", type=float, default=3.0, help="MB of stdlib source in the token corpus")
    parser.add_argument("--shard-size", default="4MB", help="the token shards' size (make_shards' shard_size)")
    parser.add_argument("--num-images", type=int, default=3000)
    parser.add_argument("--image-shard-count", type=int, default=200, help="images a shard (make_shards' max_count)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--window", type=int, default=4, help="data.window of the throughput sections")
    parser.add_argument("--cache-window", type=int, default=2, help="data.window of the cache section")
    parser.add_argument("--cache-windows", type=float, default=2.0, help="cache_limit in windows of the largest shard")
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run: 150 KB of source in 256 KB shards, 128 images, 1 round"
    )
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    if args.quick:
        args.corpus_mb, args.shard_size, args.num_images, args.image_shard_count = 0.15, "256KB", 128, 16
        args.rounds = 1
    chosen = [name for name in SECTIONS if getattr(args, name)] or list(SECTIONS)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="bench_shards-") as tmp:
        work = Work(Path(tmp), args)
        rows = [row for name in chosen for row in SECTIONS[name](args, work)]
    print(table(rows))
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
