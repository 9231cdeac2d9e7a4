"""Loader throughput: trainkit's train loader against a plain DataLoader over the same data set.

    .venv/bin/python scripts/bench_data.py --images --tokens [--num-images 2000] [--rounds 7] [--workers 0 2]
        [--quick] [--out result.json]

--images: a generated folder of JPEGs (64x64 random pixels, 10 classes, in a temporary dir removed at
the end) read by data=image_folder's torchvision ImageFolder at image_size 56 (RandomResizedCrop +
flip + ToTensor + Normalize). Four loaders, each built once (persistent workers) and warmed by one
epoch: `plain` (DataLoader, shuffle, batch 64), `trainkit` (TrainLoader: DistributedSampler's shard,
torch's generator seeded per sample, as image_folder's train split asks with draws_random="torch"),
`unseeded` (the same set marked draws_random=False: trainkit without the per-sample seeds) and
`every_rng` (marked True: python's, numpy's and torch's generators seeded, as for a data set that does
not say what it draws). A round times one epoch of each, in an order that rotates between rounds; the
figures are the medians over rounds (images/s, wall clock), the ratios the medians of the per-round
ratios; `seeding cost` = 1 - trainkit / unseeded. On a shared machine these wall-clock figures swing by
several per cent from round to round, so the script also reports the CPU time a sample costs in this
process with each seeding: the figure that holds under load.

--tokens: data=tokens' training blocks (256 tokens at a random offset drawn from torch's generator,
memory-mapped) of CPython's standard library without test/ (about 13 MB; --quick: its asyncio package),
prepared with the bytes tokenizer into a temporary dir; the same four loaders (samples/s x 256 = tokens/s).

Each section is a function `bench_<name>(args) -> rows` and a flag; rows print as one side-by-side table.
"""

import argparse
import copy
import json
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from trainkit.data import corpus, tokens  # noqa: E402
from trainkit.data import image_folder as imagefolder  # noqa: E402
from trainkit.loading import TrainLoader, length  # noqa: E402
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


def per_sample_costs(dataset, rounds: int) -> dict[str, float]:
    """CPU time (us, this process) to load one sample after seeding nothing, torch's generator alone
    (draws_random="torch") or every generator (rng.seed_all), as SeededBatches does: medians over rounds
    of a pass over the set each in a rotating order, robust where other jobs share the cores. (Seeding
    alone in a tight loop costs less than this: between two image decodes it also refills the caches.)"""
    seeders = {
        "none": lambda seed: None,
        "torch": torch.default_generator.manual_seed,
        "every_rng": lambda seed: seed_all(seed, cuda=False),
    }
    n, times = length(dataset), {name: [] for name in seeders}
    order = torch.randperm(n, generator=torch.Generator().manual_seed(0)).tolist()
    names = list(seeders)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            seeder, start = seeders[name], time.process_time()
            for i in order:
                seeder(sample_seed(0, r, i))
                dataset[i]
            times[name].append((time.process_time() - start) / n * 1e6)
    return {name: statistics.median(t) for name, t in times.items()}


def compare(section: str, train, args, per_sample: int = 1) -> list[dict]:
    """The four loaders over `train` at each of args.workers, timed side by side (see the docstring);
    per_sample: tokens a sample holds (the tokens section's rows report tokens/s too)."""
    rows = []
    unseeded, every_rng = copy.copy(train), copy.copy(train)
    unseeded.draws_random = False  # the same data; SeededBatches then seeds nothing
    every_rng.draws_random = True  # SeededBatches seeds python's, numpy's and torch's generators
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
            "every_rng": trainkit_loader(every_rng),
        }
        rates = time_loaders(loaders, len(train), args.rounds)
        costs = per_sample_costs(train, 1 if args.quick else args.rounds) if workers == 0 else None
        ratio = [t / p for t, p in zip(rates["trainkit"], rates["plain"], strict=True)]
        cost = [1 - t / u for t, u in zip(rates["trainkit"], rates["unseeded"], strict=True)]
        cost_all = [1 - t / u for t, u in zip(rates["every_rng"], rates["unseeded"], strict=True)]
        rows.append(
            {
                "section": section,
                "workers": workers,
                "plain": statistics.median(rates["plain"]),
                "trainkit": statistics.median(rates["trainkit"]),
                "unseeded": statistics.median(rates["unseeded"]),
                "every_rng": statistics.median(rates["every_rng"]),
                "every_rng_cost": statistics.median(cost_all),
                "ratio": statistics.median(ratio),
                "ratio_quartiles": statistics.quantiles(ratio, n=4) if len(ratio) > 1 else ratio * 3,
                "seeding_cost": statistics.median(cost),
                "seeding_cost_quartiles": statistics.quantiles(cost, n=4) if len(cost) > 1 else cost * 3,
                "cpu_us": costs,  # CPU time to load one sample, per seeding (0 workers' row)
                "samples": len(train),
                "tokens_per_sample": per_sample,
                "rounds": args.rounds,
            }
        )
    return rows


def bench_images(args) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_jpegs(root, args.num_images)
        train, *_ = imagefolder.splits(str(root), 56, mean=[0.5] * 3, std=[0.25] * 3)
        return compare("images", train, args)


def bench_tokens(args) -> list[dict]:
    """data=tokens' training blocks (random offsets in a memory-mapped train.bin, block 256) of CPython's
    standard library (without test/) prepared with the bytes tokenizer into a temporary dir."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    source = stdlib / "asyncio" if args.quick else stdlib  # --quick reads 256 blocks: one package holds them
    with tempfile.TemporaryDirectory() as tmp:
        corpus.prepare([str(source)], tmp, "bytes", patterns=("*.py",), exclude=("test", "site-packages"))
        train, *_ = tokens.splits(tmp, block_size=256)
        if args.quick:
            train = torch.utils.data.Subset(train, range(256))
            train.draws_random = True  # type: ignore[attr-defined]
        return compare("tokens", train, args, per_sample=256)


SECTIONS = {"images": bench_images, "tokens": bench_tokens}


def table(rows: list[dict]) -> str:
    lines = [
        "| data | workers | plain DataLoader (samples/s) | trainkit (samples/s) | trainkit unseeded (samples/s) "
        "| trainkit / plain (quartiles) | seeding cost (quartiles) | seeding every RNG: cost |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        rq, cq = r["ratio_quartiles"], r["seeding_cost_quartiles"]
        lines.append(
            f"| {r['section']} | {r['workers']} | {r['plain']:.0f} | {r['trainkit']:.0f} | {r['unseeded']:.0f} "
            f"| {r['ratio']:.3f} ({rq[0]:.3f}-{rq[2]:.3f}) "
            f"| {100 * r['seeding_cost']:+.1f} % ({100 * cq[0]:+.1f}-{100 * cq[2]:+.1f}) "
            f"| {100 * r['every_rng_cost']:+.1f} % |"
        )
    for r in rows:
        if (c := r.get("cpu_us")) is not None:
            lines.append(
                f"\n{r['section']}, CPU time a sample (this process): {c['none']:.0f} us unseeded, "
                f"{c['torch']:.0f} us seeding torch's generator ({100 * (c['torch'] / c['none'] - 1):+.1f} %), "
                f"{c['every_rng']:.0f} us seeding every generator ({100 * (c['every_rng'] / c['none'] - 1):+.1f} %)"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", action="store_true", help="the image-folder section")
    parser.add_argument("--tokens", action="store_true", help="the token-file section (CPython's stdlib, bytes)")
    parser.add_argument("--num-images", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run: 128 images, 256 token blocks of asyncio's source, 1 round"
    )
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
