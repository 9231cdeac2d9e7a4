"""data=image_folder (issue 27): torchvision's ImageFolder, exact under DDP and a resume, the folder's
classes in the config, and one-line refusals of a folder that cannot be used."""

import hashlib
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from helpers import ROOT, max_diff, rows, run_in_process, run_train, weights
from trainkit.data import image_folder as imagefolder
from trainkit.errors import ConfigError
from trainkit.loading import SeededBatches, TrainBatches, TrainLoader

CLASSES = ("ant", "bee", "cat")
SIZES = {"train": 12, "val": 4, "test": 4}  # images per class


def make_folder(root: Path, sizes: dict[str, int] = SIZES, classes=CLASSES) -> Path:
    """20x20 RGB images of random pixels (random crops of them differ), `sizes[split]` per class."""
    rng = np.random.RandomState(0)
    for split, n in sizes.items():
        for name in classes:
            (root / split / name).mkdir(parents=True, exist_ok=True)
            for i in range(n):
                Image.fromarray(rng.randint(0, 256, (20, 20, 3), dtype=np.uint8)).save(root / split / name / f"{i}.png")
    return root


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return make_folder(tmp_path_factory.mktemp("images"))


def run_args(folder: Path) -> list[str]:
    # An MLP (no BatchNorm, no dropout: nothing that depends on the per-rank split) on 36 train images of
    # 16x16, a global batch of 12: 3 steps an epoch, 6 steps = 2 epochs, a checkpoint at step 4 (mid-epoch).
    return [
        "data=image_folder",
        f"data.root={folder}",
        "data.image_size=16",
        "model=mlp",
        "model.width=16",
        "optim=sgd",  # an equivalence: SGD (tests/helpers.py)
        "accumulation.global_batch_size=12",
        "data.batch_size=3",
        "data.num_workers=0",
        "trainer.max_steps=6",
        "trainer.log_every=2",  # the row of steps 3-4 ends at the checkpoint, 5-6 follows the resume
        "trainer.eval_every=100",
        "checkpoint.every=4",
    ]


@pytest.fixture(scope="module")
def single(folder, tmp_path_factory) -> Path:
    """One process, K=4 micro-batches of 3."""
    run_dir = tmp_path_factory.mktemp("single")
    run_in_process(run_dir, *run_args(folder))
    return run_dir


def image_hashes(train, world_size: int, micro_batch: int, epochs=(0, 1)) -> dict[tuple[int, int], str]:
    """{(epoch, sample index): SHA-256 of the augmented image it was loaded as} over every rank's
    micro-batches, loaded as TrainLoader's SeededBatches loads them (seed 0)."""
    loaded, found = SeededBatches(train, seed=0), {}
    for epoch in epochs:
        for rank in range(world_size):
            batches = TrainBatches(len(train), world_size, rank, micro_batch, seed=0)
            batches.set_epoch(epoch)
            for batch in batches:
                for i, (x, _) in zip(batch[1], loaded.__getitems__(batch), strict=True):
                    found[epoch, i] = hashlib.sha256(x.numpy().tobytes()).hexdigest()
    return found


def test_augmented_images_are_a_function_of_seed_epoch_and_sample_alone(folder):
    train, *_ = imagefolder.splits(str(folder), 16)
    one = image_hashes(train, 1, 12)
    assert one == image_hashes(train, 2, 3)  # every sample's crop and flip on 1 and on 2 ranks
    assert len(one) == 2 * len(train)
    assert sum(one[0, i] != one[1, i] for i in range(len(train))) == len(train)  # new crops every epoch
    # Through trainkit's loader with 2 worker processes (rule 15): the same images again.
    d = SimpleNamespace(world_size=1, rank=0, device=torch.device("cpu"))
    loader = TrainLoader(train, d, 12, num_workers=2, seed=0, micro_batches=3)  # type: ignore[arg-type]
    order = loader.sampler
    for epoch in (0, 1):
        batches = list(loader.epoch(epoch))
        order.set_epoch(epoch)
        indices = order.order()
        images = torch.cat([x for x, _ in batches])
        assert [hashlib.sha256(x.numpy().tobytes()).hexdigest() for x in images] == [one[epoch, i] for i in indices]


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_ranks_k2_equal_one_process_k4_at_the_same_global_batch(folder, single, tmp_path, mode):
    run_in_process(tmp_path, *run_args(folder), f"parallel={mode}", nproc=2)
    a, b = rows(single), rows(tmp_path)
    assert [r["samples"] for r in a] == [r["samples"] for r in b] == [24, 48, 72]
    for x, y in zip(a, b, strict=True):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5)
    error = max_diff(weights(tmp_path), weights(single))
    print(f"max |2 ranks - one process| {error:.2e}")
    assert error < 1e-5  # SGD: reduction-order rounding alone (~1e-8 relative); 1e-5 is far above it


def test_a_mid_epoch_resume_equals_the_uninterrupted_run_bitwise(folder, single, tmp_path):
    (tmp_path / "checkpoints").mkdir()
    checkpoint = tmp_path / "checkpoints" / "step_00000004.pt"
    shutil.copy(single / "checkpoints" / checkpoint.name, checkpoint)
    shutil.copy(single / "metrics.jsonl", tmp_path / "metrics.jsonl")
    out = run_in_process(tmp_path, *run_args(folder), f"checkpoint.resume={checkpoint}")
    assert "at step 4" in out
    a, b = weights(tmp_path), weights(single)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert rows(tmp_path, timings=False) == rows(single, timings=False)  # the losses after the resume too


def test_classes_come_from_train_and_index_alike_in_every_split(folder, tmp_path):
    splits = imagefolder.splits(str(folder), 16, mean=[0.5] * 3, std=[0.25] * 3)
    assert len(splits) == 3 and [len(s) for s in splits] == [36, 12, 12]
    for split in splits:
        assert split.classes == list(CLASSES) and split.class_to_idx == splits[0].class_to_idx
        assert all(CLASSES[target] == Path(path).parent.name for path, target in split.samples)
    assert splits[0].draws_random == "torch" and not splits[1].draws_random and not splits[2].draws_random
    assert "computed" not in splits[0].summary
    assert splits[1][0][0].shape == (3, 16, 16)
    with pytest.raises(ConfigError, match=r"data.mean=\[0.5\] and data.std=\[0.25, 0.25, 0.25\] must have 3 values"):
        imagefolder.splits(str(folder), 16, mean=[0.5], std=[0.25] * 3)
    # No test/: no test split; the train split says why (trainkit.heldout says it once, see below).
    two = make_folder(tmp_path / "two", {"train": 2, "val": 1})
    assert len(imagefolder.splits(str(two), 16)) == 2
    assert imagefolder.splits(str(two), 16)[0].no_test == f"data.root={two} has no test/ dir"
    assert splits[0].no_test is None


def test_a_folder_without_test_says_so_once_naming_the_missing_dir(tmp_path):
    """Issue 32: "no test split" was said twice, the second time with the wrong cause ("its data.splits
    returns train, val"), and eval.py said that cause too."""
    two = make_folder(tmp_path / "images", {"train": 2, "val": 1})
    args = ["data=image_folder", f"data.root={two}", "data.image_size=16", "model=mlp", "data.num_workers=0"]
    out = run_in_process(tmp_path / "run", *args, "trainer.max_steps=1", "checkpoint.every=0")
    said = f"trainer.test: data=image_folder has no test split (data.root={two} has no test/ dir): no test pass"
    assert out.count("no test split") == 1 and said in out and "(6 train / 3 val / no test)" in out
    with pytest.raises(ConfigError) as refused:
        run_in_process(tmp_path / "eval", f"run_dir={tmp_path / 'run'}", script="eval")  # split=test
    assert str(refused.value) == (
        f"split=test: data=image_folder of {tmp_path / 'run'} has no test split (data.root={two} has no test/ dir)"
    )


def test_null_mean_and_std_are_the_train_images_statistics(folder):
    from torchvision import datasets, transforms

    train, *_ = imagefolder.splits(str(folder), 16)
    plain = datasets.ImageFolder(
        str(folder / "train"),
        transforms.Compose([transforms.Resize(18), transforms.CenterCrop(16), transforms.ToTensor()]),
    )
    pixels = torch.stack([x for x, _ in plain]).double().transpose(0, 1).flatten(1)
    mean, std = imagefolder.statistics(imagefolder.scan(str(folder)), 16, None)
    assert mean == pytest.approx(pixels.mean(1).tolist(), abs=1e-6)
    assert std == pytest.approx(pixels.std(1, correction=0).tolist(), abs=1e-6)
    assert f"mean {mean} std {std} (computed from 36 train images)" in train.summary


def broken(root: Path, how: str) -> Path:
    if how == "missing":
        return root / "nowhere"
    make_folder(root, {"train": 1, "val": 1})
    if how == "no train":
        shutil.rmtree(root / "train")
    elif how == "empty class":
        (root / "train" / "dog").mkdir()
    elif how == "no images":
        (root / "val" / "bee" / "0.png").rename(root / "val" / "bee" / "notes.txt")
    elif how == "val lacks a class":
        shutil.rmtree(root / "val" / "bee")
    elif how == "test has another class":
        make_folder(root, {"test": 1}, classes=("ant", "bee", "cat", "dog"))
    return root


@pytest.mark.parametrize(
    "how,message",
    [
        ("unset", "data.root is not set: pass data.root=<dir>"),
        ("missing", "nowhere is not a directory"),
        ("no train", "has no train/ directory"),
        ("empty class", "class folder train/dog holds no image"),
        ("no images", "class folder val/bee holds no image"),
        ("val lacks a class", "val/ lacks class 'bee' of train/"),
        ("test has another class", "test/ has class 'dog' that train/ lacks"),
    ],
)
def test_an_unusable_folder_is_one_line_naming_what_is_wrong(tmp_path, how, message):
    root = None if how == "unset" else str(broken(tmp_path / "root", how))
    with pytest.raises(ConfigError, match=message) as error:
        imagefolder.num_classes(root)  # ${image_folder_classes:${data.root}}: config.check resolves it
    assert "\n" not in str(error.value)


@pytest.mark.slow
def test_the_command_line_refuses_a_bad_folder_with_exit_2_one_line_and_no_run_dir(tmp_path):
    root = broken(tmp_path / "root", "val lacks a class")
    proc = run_train(tmp_path / "run", "data=image_folder", f"data.root={root}", check=False)
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()  # the key and value it is about, then why
    assert line == f"error: data.root={root}: val/ lacks class 'bee' of train/ (1 missing)"
    assert not (tmp_path / "run").exists()


def test_resnet18_fits_the_folder_with_no_other_keys(folder, tmp_path):
    run_in_process(
        tmp_path,
        "data=image_folder",
        f"data.root={folder}",
        "model=resnet18",
        "data.image_size=16",
        "data.num_workers=0",
        "trainer.max_steps=2",
    )
    state = weights(tmp_path)
    assert state["fc.weight"].shape == (3, 512) and state["conv1.weight"].shape[1] == 3


@pytest.mark.slow
def test_bench_data_times_the_loaders_side_by_side_for_images_and_tokens(tmp_path, capsys, monkeypatch):
    """scripts/bench_data.py's smoke run, its main() in this process (it takes its arguments): the four loaders'
    rows of both sections, at 0 workers (no process to start)."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import bench_data

    out = tmp_path / "bench.json"
    threads = torch.get_num_threads()
    try:
        bench_data.main(["--images", "--tokens", "--quick", "--workers", "0", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)  # main's one thread, for this process's later tests too
    images, tokens = json.loads(out.read_text())
    assert (images["samples"], images["workers"], tokens["samples"], tokens["tokens_per_sample"]) == (128, 0, 256, 256)
    for row in (images, tokens):
        assert all(row[k] > 0 for k in ("plain", "trainkit", "unseeded"))
    stdout = capsys.readouterr().out
    assert "| images | 0 |" in stdout and "| tokens | 0 |" in stdout


def test_a_resume_on_a_changed_folder_is_refused_naming_it(folder, tmp_path, capsys):
    changed = shutil.copytree(folder, tmp_path / "images")
    args = [a if not a.startswith("data.root=") else f"data.root={changed}" for a in run_args(folder)]
    run_in_process(tmp_path / "run", *args, "trainer.max_steps=4")
    Image.new("RGB", (20, 20)).save(changed / "train" / "ant" / "0.png")  # another image, as many as before
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_status:
        run_in_process(tmp_path / "run", *args)  # checkpoint.resume=auto: the step-4 checkpoint
    assert exit_status.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert (
        line.startswith("error: checkpoint.resume: the checkpoint was written with data.folder=")
        and str(changed) in line
    )


def spoil(path: Path, how: str) -> None:
    if how == "not an image":  # e.g. an HTML error page saved as .jpg
        path.write_text("<html>404 Not Found</html>\n")
    else:  # "cut short": the header reads (Image.open), the pixels do not (ImageFolder's loader, mid-run)
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def test_an_unreadable_image_is_named_in_one_line_before_any_step(tmp_path, capsys):
    """Issue 32: a .jpg that is no JPEG was PIL's 76-line UnidentifiedImageError at the start, or mid-training
    (64 lines, no error.txt) where data.mean/std were given."""
    root = make_folder(tmp_path / "images", {"train": 2, "val": 1})
    spoil(root / "train" / "bee" / "1.png", "not an image")
    spoil(root / "val" / "cat" / "0.png", "not an image")
    with pytest.raises(ConfigError) as error:
        imagefolder.splits(str(root), 16, mean=[0.5] * 3, std=[0.25] * 3)
    assert str(error.value) == (
        f"data.root={root}: train/bee/1.png is not an image PIL can read (cannot identify image file) "
        "(1 more: val/cat/0.png): replace or remove it"
    )
    run_dir = tmp_path / "run"
    run_dir.mkdir()  # as Hydra makes it before the task: a refused run removes it
    with pytest.raises(SystemExit) as refused:
        run_in_process(run_dir, "data=image_folder", f"data.root={root}", "data.image_size=16", "model=mlp")
    assert refused.value.code == 2 and not run_dir.exists()
    assert capsys.readouterr().err.strip().splitlines() == [f"error: {error.value}"]
    # Cut short after its header: the check passes it; the computed mean/std decode it before any step.
    root = make_folder(tmp_path / "cut", {"train": 2, "val": 1})
    spoil(root / "train" / "cat" / "1.png", "cut short")
    with pytest.raises(ConfigError, match=r"^data.root: .*/train/cat/1.png is not an image PIL can read \("):
        imagefolder.splits(str(root), 16)


def test_an_image_cut_short_fails_mid_training_in_one_line_with_error_txt(tmp_path, capsys):
    root = make_folder(tmp_path / "images", {"train": 2, "val": 1})
    path = root / "train" / "cat" / "1.png"
    spoil(path, "cut short")
    given = ["data.mean=[0.5,0.5,0.5]", "data.std=[0.25,0.25,0.25]"]  # no decode at the start
    args = ["data=image_folder", f"data.root={root}", "data.image_size=16", "model=mlp", *given, "data.batch_size=3"]
    with pytest.raises(SystemExit) as failed:  # 2 steps: one epoch, every image; loaded in 2 worker processes
        run_in_process(tmp_path / "run", *args, "data.num_workers=2", "trainer.max_steps=2", "checkpoint.every=1")
    line = f"data.root: {path} is not an image PIL can read ("  # PIL's why: "image file is truncated (...)"
    assert failed.value.code == 3
    (error,) = capsys.readouterr().err.strip().splitlines()
    assert error.startswith(f"error: {line}") and error.endswith("): replace or remove it")
    assert (tmp_path / "run" / "error.txt").read_text().startswith(line)
    with pytest.raises(imagefolder.UnreadableImage) as raised:  # in this process (data.num_workers=0)
        imagefolder.load_rgb(str(path))
    assert str(raised.value) == error.removeprefix("error: ")
