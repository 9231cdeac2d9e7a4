"""Loader throughput: trainkit's train loader against a plain DataLoader over the same data set.

    .venv/bin/python scripts/bench_data.py --images [--num-images 2000] [--rounds 7] [--workers 0 2]
        [--quick] [--out result.json]

--images: a generated folder of JPEGs (64x64 random pixels, 10 classes, in a temporary dir removed at
the end) read by data=image_folder's torchvision ImageFolder at image_size 56 (RandomResizedCrop +
flip + ToTensor + Normalize). Three loaders, each built once (persistent workers) and warmed by one
epoch: `plain` (DataLoader, shuffle, batch 64), `trainkit` (TrainLoader: DistributedSampler's shard,
per-sample seeding of the RNGs) and `unseeded` (TrainLoader over the same set marked draws_random=False:
what trainkit costs without the per-sample seeds). A round times one epoch of each, in an order that
rotates between rounds; the figures are the medians over rounds (images/s, wall clock), and the ratios
the medians of the per-round ratios. `seeding cost` = 1 - trainkit / unseeded. On a shared machine
these wall-clock figures swing by several per cent from round to round, so the script also reports the
per-sample seeding's own CPU time against a sample's loading (in this process, process_time): the
figure that holds under load.

Each section is a function `bench_<name>(args) -> rows` and a flag; rows print as one side-by-side
table (a later `--tokens` section adds its own function and flag).
"""

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from trainkit import imagefolder  # noqa: E402
from trainkit.data import TrainLoader, length  # noqa: E402
from trainkit.rng import sample_seed, seed_all  # noqa: E402


def write_jpegs(root: Path, num_images: int, classes: int = 10, side: int = 64) -> None:
    from PIL import Image

    rng = np.random.RandomState(0)
    for i in range(num_images + classes):
        split = "train" if i < num_images else "val"  # val/ (one image a class) must exist; the benchmark reads train/
        directory = root / split / f"class{i % classes}"
        directory.mkdir(parents=True, exist_ok=True)
        pixels = rng.randint(0, 256, (side, side, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(directory / f"{i}.jpg", quality=90)


def epoch_rate(batches, count: int) -> float:
    """Images per second of one pass over `batches` (each batch's first tensor is the images)."""
    start, seen = time.perf_counter(), 0
    for x, _ in batches:
        seen += len(x)
    elapsed = time.perf_counter() - start
    assert seen == count, (seen, count)
    return seen / elapsed


def time_loaders(loaders: dict, count: int, rounds: int) -> dict[str, list[float]]:
    """{name: images/s per round}; `loaders` maps a name to a function epoch -> iterable of batches."""
    names, rates = list(loaders), {name: [] for name in loaders}
    for name in names:  # warm-up: worker start, file cache
        epoch_rate(loaders[name](0), count)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:  # a rotating order
            rates[name].append(epoch_rate(loaders[name](r + 1), count))
    return rates


def per_sample_costs(dataset, rounds: int) -> tuple[float, float]:
    """(us to load one sample, us to seed the RNGs for one) in this process, by CPU time: medians over
    rounds of a pass over the set each, robust where other jobs share the cores."""
    n, load, seed = length(dataset), [], []
    for _ in range(max(rounds, 1)):
        start = time.process_time()
        for i in range(n):
            dataset[i]
        load.append((time.process_time() - start) / n * 1e6)
        start = time.process_time()
        for i in range(n):
            seed_all(sample_seed(0, 1, i), cuda=False)
        seed.append((time.process_time() - start) / n * 1e6)
    return statistics.median(load), statistics.median(seed)


def bench_images(args) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_jpegs(root, args.num_images)
        train, *_ = imagefolder.splits(str(root), 56, mean=[0.5] * 3, std=[0.25] * 3)
        unseeded = copy.copy(train)
        unseeded.draws_random = False  # the same transforms; SeededBatches then seeds nothing
        d = SimpleNamespace(world_size=1, rank=0, device=torch.device("cpu"))
        b = args.batch_size
        for workers in args.workers:
            plain = DataLoader(
                train,
                batch_size=b,
                shuffle=True,
                num_workers=workers,
                persistent_workers=workers > 0,
                generator=torch.Generator().manual_seed(0),
            )

            def trainkit_loader(dataset, workers=workers):
                loader = TrainLoader(dataset, d, b, workers, seed=0, micro_batches=0)  # type: ignore[arg-type]
                return loader.epoch

            loaders = {
                "plain": lambda epoch, plain=plain: plain,
                "trainkit": trainkit_loader(train),
                "unseeded": trainkit_loader(unseeded),
            }
            rates = time_loaders(loaders, len(train), args.rounds)
            load_us, seed_us = per_sample_costs(train, 1 if args.quick else 3) if workers == 0 else (None, None)
            ratio = [t / p for t, p in zip(rates["trainkit"], rates["plain"], strict=True)]
            cost = [1 - t / u for t, u in zip(rates["trainkit"], rates["unseeded"], strict=True)]
            rows.append(
                {
                    "section": "images",
                    "workers": workers,
                    "plain": statistics.median(rates["plain"]),
                    "trainkit": statistics.median(rates["trainkit"]),
                    "unseeded": statistics.median(rates["unseeded"]),
                    "ratio": statistics.median(ratio),
                    "ratio_quartiles": statistics.quantiles(ratio, n=4) if len(ratio) > 1 else ratio * 3,
                    "seeding_cost": statistics.median(cost),
                    "seeding_cost_quartiles": statistics.quantiles(cost, n=4) if len(cost) > 1 else cost * 3,
                    "load_us": load_us,  # CPU time to load and augment one sample (0 workers' row)
                    "seed_us": seed_us,  # CPU time of the per-sample seeding (rng.seed_all) of one
                    "images": len(train),
                    "rounds": args.rounds,
                }
            )
    return rows


SECTIONS = {"images": bench_images}


def table(rows: list[dict]) -> str:
    lines = [
        "| data | workers | plain DataLoader (img/s) | trainkit (img/s) | trainkit unseeded (img/s) "
        "| trainkit / plain (quartiles) | seeding cost (quartiles) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        rq, cq = r["ratio_quartiles"], r["seeding_cost_quartiles"]
        lines.append(
            f"| {r['section']} | {r['workers']} | {r['plain']:.0f} | {r['trainkit']:.0f} | {r['unseeded']:.0f} "
            f"| {r['ratio']:.3f} ({rq[0]:.3f}-{rq[2]:.3f}) "
            f"| {100 * r['seeding_cost']:+.1f} % ({100 * cq[0]:+.1f}-{100 * cq[2]:+.1f}) |"
        )
    for r in rows:
        if r.get("seed_us") is not None:
            lines.append(
                f"\n{r['section']}: the per-sample seeding alone costs {r['seed_us']:.1f} us (CPU time) against "
                f"{r['load_us']:.0f} us to load and augment a sample: {100 * r['seed_us'] / r['load_us']:.1f} %"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", action="store_true", help="the image-folder section")
    parser.add_argument("--num-images", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 128 images, 1 round")
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    if args.quick:
        args.num_images, args.rounds = 128, 1
    chosen = [name for name in SECTIONS if getattr(args, name)]
    if not chosen:
        parser.error(f"choose a section: {', '.join('--' + name for name in SECTIONS)}")
    torch.set_num_threads(1)
    rows = [row for name in chosen for row in SECTIONS[name](args)]
    print(table(rows))
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
