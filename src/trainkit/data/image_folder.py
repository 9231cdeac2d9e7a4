"""data=image_folder: a folder of class subfolders read by torchvision's own `datasets.ImageFolder`.

`data.root` holds `train/<class>/*` and `val/<class>/*`, and `test/<class>/*` when there is one. No
test/ means no test split (said once at the start, naming the missing dir: the train split's `no_test`,
trainkit.heldout; trainer.test then makes no test pass, eval.py split=test is refused): carving one
from train would silently shrink a user's training set and change it when test/ is added later.
Every image is read as RGB (ImageFolder's loader converts L, P, RGBA, CMYK alike), so `data.shape` is
always [3, image_size, image_size] and one model fits any folder.

`data.num_classes` comes from the folder through a resolver (`${image_folder_classes:${data.root}}`,
registered in config.py; `data.shape` is [3, image_size, image_size]), which also checks it: a missing
root, no train/ or val/, a class folder with no image, val/ or test/ with other classes than train/ are
one-line ConfigErrors before any run dir.

Transforms: train = RandomResizedCrop + RandomHorizontalFlip + ToTensor + Normalize; val and test =
Resize (data.resize, null: image_size x 8/7) + CenterCrop + ToTensor + Normalize. The random crop and
flip draw from torch's global generator, which SeededBatches seeds per (seed, epoch, sample index), so
any world size, micro-batch, worker count and a resume see the same crops. `data.mean`/`data.std` null:
computed from the train split's images under the eval transform (every image up to STATS_IMAGES, else
that many evenly spaced ones: fixed, seed-independent), in memory, nothing cached outside the run.

Unreadable images. Before any step (`check_images`, in splits: every process, rank 0 first) each
image's header is read (PIL's Image.open: the format's first bytes and its size, no pixel decoded,
8 threads): a file that is no image PIL reads (a text or HTML file named .jpg, an empty file, a
header cut short) is a one-line ConfigError naming it and how many more there are (exit 2, no run
dir). Its cost, measured on 2000 JPEGs (500x375 and 64x64) on this 2-core machine under a load of ~4:
105-155 us an image from a cold disk (one thread: 280-540), 55-190 us from the page cache (one
thread no faster): ImageNet's 1.28M train images add 2-3.5 min to a start, 1-4 min warm, per process
(ranks after rank 0 read warm). A full decode is not paid up front (2 ms for a 500x375 JPEG: 43 min
for ImageNet): an image whose header reads but whose pixels do not (a file cut short after its header)
fails where it is decoded, at the start for the computed data.mean/std (ConfigError), else
mid-training as one line naming it (UnreadableImage: exit 3, error.txt in the run dir; the steps since
the last checkpoint are lost, as at any failure, and the same command resumes once it is replaced).
"""

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import MISSING, OmegaConf

from trainkit.errors import ConfigError, RankError
from trainkit.schema import Data


@dataclass
class Splits:
    _target_: str = MISSING
    root: str | None = None
    image_size: int = MISSING
    resize: int | None = None
    mean: list[float] | None = None
    std: list[float] | None = None


@dataclass
class Schema(Data):
    """conf/data/image_folder.yaml's keys and their types."""

    splits: Splits = field(default_factory=Splits)
    root: str | None = None  # holds train/<class>/*, val/<class>/* and optionally test/<class>/*
    image_size: int = 224
    resize: int | None = None  # the eval transform's shorter side; null: image_size x 8/7
    mean: list[float] | None = None  # null: computed from the train images
    std: list[float] | None = None


STATS_IMAGES = 1000  # at most this many train images give the computed mean and std
SPLIT_DIRS = ("train", "val", "test")
CHECK_THREADS = 8  # reading headers waits on the disk: 2.5-3x faster than one thread from a cold one


class UnreadableImage(RankError):
    """An image that PIL cannot decode, met where it is loaded (the rank that loads it says it). Its
    text is one line, also from a DataLoader worker: torch re-raises a worker's exception as
    `type(text)` with text = "Caught <type> in DataLoader worker ... Original Traceback ...<type>: <line>",
    of which the last line is kept."""

    def __init__(self, message: str):
        if message.startswith(f"Caught {type(self).__name__} "):
            message = message.rstrip().splitlines()[-1].split(f"{type(self).__name__}: ", 1)[-1]
        super().__init__(message)


def _why(error: BaseException, path: str) -> str:
    """PIL's first line, without the file's name (the message names it)."""
    text = (str(error).strip().splitlines() or [type(error).__name__])[0].replace(repr(path), "").strip()
    return text[:120] or type(error).__name__


def load_rgb(path: str):
    """ImageFolder's loader (PIL, converted to RGB), a failure one line naming the file."""
    from PIL import Image

    try:
        with open(path, "rb") as f:
            return Image.open(f).convert("RGB")
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as error:
        raise UnreadableImage(
            f"data.root: {path} is not an image PIL can read ({_why(error, path)}): replace or remove it"
        ) from None


def _header_error(path: Path) -> str | None:
    from PIL import Image

    try:
        with Image.open(path):
            return None
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as error:
        return _why(error, str(path))


@dataclass(frozen=True)
class Folder:
    """What a checked folder holds: its class names (sorted, as ImageFolder indexes them), and per split
    dir the (relative path, size) of every image (test: None when there is no test/)."""

    root: Path
    classes: list[str]
    files: dict[str, list[tuple[str, int]] | None]

    def digest(self) -> str:
        """SHA-256 of every image's relative path and size: a resume on a changed folder is refused."""
        h = hashlib.sha256()
        for split in SPLIT_DIRS:
            for path, size in self.files[split] or []:
                h.update(f"{path}\0{size}\n".encode())
        return h.hexdigest()


def _classes_and_files(root: Path, split: str) -> tuple[list[str], list[tuple[str, int]]]:
    from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes, has_file_allowed_extension

    directory = root / split
    try:
        classes, _ = find_classes(str(directory))
    except FileNotFoundError:  # torchvision: "Couldn't find any class folder in ..."
        raise ConfigError(f"data.root={root}: {split}/ holds no class folder ({split}/<class>/<image>)") from None
    files = []
    for name in classes:
        found = sorted(
            str(Path(dirpath, f).relative_to(root))
            for dirpath, _, names in os.walk(directory / name, followlinks=True)
            for f in names
            if has_file_allowed_extension(f, IMG_EXTENSIONS)
        )
        if not found:
            raise ConfigError(
                f"data.root={root}: class folder {split}/{name} holds no image ({', '.join(IMG_EXTENSIONS)})"
            )
        files += [(f, (root / f).stat().st_size) for f in found]
    return classes, files


def scan(root: str | None) -> Folder:
    """Check `root` (ConfigError, one line, for each way it is unusable) and list what it holds."""
    if root is None or str(root) == "":
        raise ConfigError("data.root is not set: pass data.root=<dir> holding train/<class>/* and val/<class>/*")
    path = Path(str(root)).expanduser()
    if not path.is_dir():
        raise ConfigError(f"data.root={root} is not a directory")
    if not (path / "train").is_dir():
        raise ConfigError(f"data.root={root} has no train/ directory (train/<class>/<image>)")
    if not (path / "val").is_dir():
        raise ConfigError(f"data.root={root} has no val/ directory (val/<class>/<image>)")
    classes, train_files = _classes_and_files(path, "train")
    files: dict[str, list[tuple[str, int]] | None] = {"train": train_files, "test": None}
    for split in ("val", "test"):
        if split == "test" and not (path / "test").is_dir():
            continue
        found, files[split] = _classes_and_files(path, split)
        if missing := [c for c in classes if c not in found]:
            raise ConfigError(
                f"data.root={root}: {split}/ lacks class {missing[0]!r} of train/ ({len(missing)} missing)"
            )
        if extra := [c for c in found if c not in classes]:
            raise ConfigError(f"data.root={root}: {split}/ has class {extra[0]!r} that train/ lacks")
    return Folder(path, classes, files)


def check_images(folder: Folder) -> None:
    """Read every image's header (see the module's docstring): one ConfigError naming the first file
    that is no image PIL reads, and how many there are."""
    paths = [path for split in SPLIT_DIRS for path, _ in folder.files[split] or []]
    with ThreadPoolExecutor(CHECK_THREADS) as pool:
        errors = list(pool.map(lambda path: _header_error(folder.root / path), paths, chunksize=64))
    bad = [(path, error) for path, error in zip(paths, errors, strict=True) if error is not None]
    if bad:
        (path, error), more = bad[0], len(bad) - 1
        others = f" ({more} more: {', '.join(p for p, _ in bad[1:4])}{', ...' if more > 3 else ''})" if more else ""
        raise ConfigError(
            f"data.root={folder.root}: {path} is not an image PIL can read ({error}){others}: replace or remove it"
        )


def num_classes(root: str | None) -> int:
    """${image_folder_classes:${data.root}}: the folder's classes (train/'s subfolders), after checking it."""
    return len(scan(root).classes)


def eval_resize(image_size: int, resize: int | None) -> int:
    """The eval transform's shorter side before the centre crop: `resize`, else image_size x 8/7 (224 -> 256)."""
    return int(resize) if resize is not None else round(image_size * 8 / 7)


def statistics(folder: Folder, image_size: int, resize: int | None) -> tuple[list[float], list[float]]:
    """Per-channel mean and std of the train images under the eval transform (no augmentation), over
    every image up to STATS_IMAGES, else that many evenly spaced in ImageFolder's order."""
    import torch
    from torchvision import datasets, transforms

    plain = transforms.Compose(
        [transforms.Resize(eval_resize(image_size, resize)), transforms.CenterCrop(image_size), transforms.ToTensor()]
    )
    train = datasets.ImageFolder(str(folder.root / "train"), transform=plain, loader=load_rgb)
    n = len(train)
    picks = range(n) if n <= STATS_IMAGES else [i * n // STATS_IMAGES for i in range(STATS_IMAGES)]
    total, squares, pixels = torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64), 0
    for i in picks:
        try:
            x = train[i][0].double().flatten(1)
        except UnreadableImage as error:  # before any step: a refusal, as check_images' are
            raise ConfigError(str(error)) from None
        total += x.sum(1)
        squares += (x * x).sum(1)
        pixels += x.shape[1]
    mean = total / pixels
    std = (squares / pixels - mean * mean).clamp_min(1e-12).sqrt()
    return [round(float(v), 6) for v in mean], [round(float(v), 6) for v in std]


def transforms_of(image_size: int, resize: int | None, mean: list[float], std: list[float]) -> tuple:
    """(train, eval) transforms: RandomResizedCrop + RandomHorizontalFlip, and Resize + CenterCrop; each then ToTensor
    and Normalize. data=shards applies them to an image folder's shards (trainkit/data/shards.py)."""
    from torchvision import transforms

    normalize = [transforms.ToTensor(), transforms.Normalize(mean, std)]
    augment = transforms.Compose(
        [transforms.RandomResizedCrop(image_size), transforms.RandomHorizontalFlip(), *normalize]
    )
    plain = transforms.Compose(
        [transforms.Resize(eval_resize(image_size, resize)), transforms.CenterCrop(image_size), *normalize]
    )
    return augment, plain


def splits(
    root: str | None,
    image_size: int,
    resize: int | None = None,
    mean: list[float] | None = None,
    std: list[float] | None = None,
) -> tuple:
    """(train, val, test) ImageFolders of `root` (train, val without a test/ dir), their transforms from
    the config. The train split carries the folder's checksum (`identity`) and a `summary` line."""
    from torchvision import datasets

    if not isinstance(image_size, int) or isinstance(image_size, bool) or image_size < 1:
        raise ConfigError(f"data.image_size={image_size} must be a positive integer")
    folder = scan(root)
    check_images(folder)
    computed = mean is None or std is None
    stats = statistics(folder, image_size, resize) if computed else ([], [])
    mean, std = list(mean if mean is not None else stats[0]), list(std if std is not None else stats[1])
    if len(mean) != 3 or len(std) != 3:
        raise ConfigError(f"data.mean={mean} and data.std={std} must have 3 values (RGB)")
    augment, plain = transforms_of(image_size, resize, mean, std)
    made = [
        datasets.ImageFolder(str(folder.root / split), augment if split == "train" else plain, loader=load_rgb)
        for split in SPLIT_DIRS
        if folder.files[split] is not None
    ]
    for split, dataset in zip(SPLIT_DIRS, made, strict=False):
        # train: RandomResizedCrop and RandomHorizontalFlip draw from torch's generator alone, so SeededBatches
        # seeds only that one per sample; the eval transform draws nothing: no per-sample seeding to pay.
        dataset.draws_random = "torch" if split == "train" else False
        assert dataset.classes == folder.classes, (split, dataset.classes)  # scan checked the names
    train = made[0]
    # What the transforms were made from (mean and std as computed): scripts/make_shards.py writes it with the images
    train.image_settings = {"image_size": image_size, "resize": resize, "mean": mean, "std": std}
    train.identity = {"data.folder": {"sha256": folder.digest(), "source": str(folder.root)}}
    # Why there is no test split, or None: trainkit.heldout says it once, with this cause.
    train.no_test = f"data.root={folder.root} has no test/ dir" if folder.files["test"] is None else None
    sizes = ", ".join(f"{s} {len(d)}" for s, d in zip(SPLIT_DIRS, made, strict=False))
    train.summary = (
        f"data: image folder {folder.root}: {len(folder.classes)} classes, {sizes}"
        + f"; normalised with mean {mean} std {std}"
        + (f" (computed from {min(len(train), STATS_IMAGES)} train images)" if computed else "")
    )
    return tuple(made)


# ${image_folder_classes:${data.root}} (conf/data/image_folder.yaml), which checks the folder too; use_cache: a
# config scans it once however often data.num_classes is read.
OmegaConf.register_new_resolver("image_folder_classes", num_classes, replace=True, use_cache=True)
