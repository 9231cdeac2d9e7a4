"""conf/experiment/*.yaml: every experiment composes and trains (a new file is covered by the glob),
the accumulation sweep keeps its global batch, and the pieces the CIFAR-10 recipe adds: label
smoothing, the micro_batch resolver, reproducible augmentation."""

import contextlib
import importlib.util
import io
import os
import pickle
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

from helpers import ROOT, make_parent, run_in_process, run_train
from trainkit import config, teacher
from trainkit.config import ConfigError, micro_batch
from trainkit.data.vision import torchvision_splits
from trainkit.dist import Dist
from trainkit.loading import TrainLoader, draws_random
from trainkit.parent import load_into, model_node
from trainkit.tasks.classification import Classification

CONF = ROOT / "conf"  # a test of a fork's experiment composes a copy of it
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
CPU = Dist(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))


def parent_overrides(name: str, tmp_path: Path) -> list[str]:
    """An experiment that builds on finished runs declares them in its yaml (`parents: {key: [overrides of such a
    run]}`, e.g. {task.teacher.from: [model=cnn]}): each is made on the fly under `tmp_path` by helpers.make_parent
    (its config and initial weights, no training: a child's build checks the weights' names and shapes) and given
    as its key. A fork's experiment is covered by what it declares, without an edit of this file."""
    parents = compose_experiment(name).parents.items()
    return [f"{key}={make_parent(tmp_path / f'parent{i}', *overrides)}" for i, (key, overrides) in enumerate(parents)]


def write_fake_cifar10(root: Path, per_batch: int = 4, test: int = 6) -> Path:
    """A CIFAR-10 in torchvision's on-disk format (cifar-10-batches-py/: five pickled training
    batches, test_batch, batches.meta), with random images; `root` is what data.root takes."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    files = [(f"data_batch_{i}", per_batch) for i in range(1, 6)] + [("test_batch", test)]
    for name, n in files:
        data = rng.integers(0, 256, (n, 3 * 32 * 32), dtype=np.uint8)  # rows of R, G, B planes
        batch = {"batch_label": name, "labels": rng.integers(0, 10, n).tolist(), "data": data}
        (folder / name).write_bytes(pickle.dumps(batch))
    meta = {"label_names": ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]}
    (folder / "batches.meta").write_bytes(pickle.dumps(meta))
    return root


def _skip_md5():
    """torchvision checks each CIFAR file's md5 against the real data set: accept any present file."""
    import torchvision.datasets.cifar as cifar

    cifar.check_integrity = lambda path, md5=None: os.path.isfile(path)


def unverified_torchvision_splits(**kwargs):
    """data.splits._target_=test_experiments.unverified_torchvision_splits: trainkit's
    torchvision_splits on a generated CIFAR-10 (whose md5 sums cannot match)."""
    _skip_md5()
    return torchvision_splits(**kwargs)


@pytest.fixture(scope="module")
def cifar_root(tmp_path_factory) -> Path:
    return write_fake_cifar10(tmp_path_factory.mktemp("cifar"))


def script(name: str):
    """scripts/<name>.py as a module (its main(argv) -> exit status), in this process."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def reads_shards(name: str) -> bool:
    return "override /data: shards" in (CONF / "experiment" / f"{name}.yaml").read_text()


def make_shard_sets(base: Path) -> Path:
    """$TRAINKIT_DATA of the data=shards experiments with what their yaml's setup commands make, from generated
    stand-ins (a few kB, about a second): shards/pydoc_bytes and shards/cpython_bytes (two bytes corpora of
    generated files, the experiment's blocks of 128), shards/digits_folder (an image folder of 3 classes)."""
    from test_image_folder import make_folder
    from test_tokens import write_sources

    from trainkit.data.corpus import prepare

    texts = write_sources(base / "texts")  # two folders of 6 files: a corpus each
    for name, folder in (("pydoc_bytes", "lib"), ("cpython_bytes", "pkg")):
        prepare([str(texts / folder)], str(base / name), "bytes", val_fraction=1 / 6, progress=False)
    make_folder(base / "digits_folder", {"train": 3, "val": 1, "test": 1})
    sets = {
        "pydoc_bytes": ["data=tokens"],
        "cpython_bytes": ["data=tokens"],
        "digits_folder": ["data=image_folder", "data.image_size=16", "max_count=4"],
    }
    with contextlib.redirect_stdout(io.StringIO()):
        for name, args in sets.items():
            out = base / "shards" / name
            assert script("make_shards").main([*args, f"data.root={base / name}", f"out={out}"], progress=False) == 0
    return base


@pytest.fixture(scope="module")
def shard_sets(tmp_path_factory) -> Path:
    return make_shard_sets(tmp_path_factory.mktemp("shards_data"))


@pytest.fixture(autouse=True)
def tokens_data(request, tmp_path_factory, monkeypatch):
    """+experiment=cpython_code_gpt reads $TRAINKIT_DATA/cpython_bpe: a BPE corpus of generated files there; an
    experiment of data=shards reads the shard sets of make_shard_sets there. Every other experiment's
    $TRAINKIT_DATA is a temp dir too: what one prepares there (hf_lm_pydoc's tokenizer) is never written into the
    checkout's data/."""
    name = request.node.callspec.params.get("name", "") if hasattr(request.node, "callspec") else ""
    if name and reads_shards(name):
        monkeypatch.setenv("TRAINKIT_DATA", str(request.getfixturevalue("shard_sets")))
        return
    if "cpython_code_gpt" not in request.node.name:
        monkeypatch.setenv("TRAINKIT_DATA", str(tmp_path_factory.getbasetemp() / "trainkit_data"))
        return
    from test_tokens import write_sources

    from trainkit.data.corpus import prepare

    base = tmp_path_factory.mktemp("tokens_data")
    prepare([str(write_sources(base / "src"))], str(base / "cpython_bpe"), "bpe", 300, 1 / 6, progress=False)
    monkeypatch.setenv("TRAINKIT_DATA", str(base))


def small(data: str, cifar_root: Path) -> list[str]:
    """Overrides that make an experiment a 2-step run of seconds: less data, smaller batches."""
    common = ["trainer.max_steps=2", "trainer.eval_every=2", "checkpoint.every=0"]
    per_data = {
        "fake": ["data.splits.train_size=32", "data.splits.val_size=8", "data.batch_size=4"],
        "addition": ["data.num_train=200", "data.num_val=90", "data.batch_size=8"],
        "cifar10": [
            f"data.root={cifar_root}",
            "data.splits._target_=test_experiments.unverified_torchvision_splits",
            "data.num_workers=0",
            "accumulation.global_batch_size=8",  # the recipe's 128 would be one partial batch here
        ],
    }
    return common + per_data.get(data, [])


def compose_experiment(name: str, *overrides: str):
    with initialize_config_dir(str(CONF), version_base="1.3"):
        return compose("train", [f"+experiment={name}", *overrides])


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiment_composes_passes_the_checks_and_builds(name, cifar_root, tmp_path_factory):
    parents = parent_overrides(name, tmp_path_factory.mktemp("parents"))
    cfg = compose_experiment(name, *small("", cifar_root), *parents)
    config.check(cfg)
    model = instantiate(model_node(cfg))
    load_into(model, cfg.model.get("init"))  # a parent's weights fit
    teacher.build_task(cfg.task, None, torch.device("cpu"), own=False)  # the task, with its teacher where it has one
    assert 0 <= instantiate(cfg.sched, total_steps=10)(0) <= 1
    assert config.accumulation_steps(cfg, 1) >= 1


@pytest.fixture(scope="module")
def accumulation_sweep(tmp_path_factory, cifar_root) -> tuple[str, Path]:
    """`python src/train.py +experiment=accumulation_sweep`, 2 steps a job: its stdout and sweep dir, for the two
    tests below. One process: its per-device batch divided by the world size of torchrun's, submitit's or
    self-launched workers is test_launchers' (a submitit sweep of it) and test_config_errors' (a K it refuses)."""
    tmp = tmp_path_factory.mktemp("accumulation_sweep")
    overrides = ["+experiment=accumulation_sweep", *small("digits", cifar_root), f"hydra.sweep.dir={tmp / 'sweep'}"]
    return run_train(tmp / "unused", *overrides).stdout, tmp / "sweep"


@pytest.mark.slow
@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiment_trains_two_steps(name, cifar_root, tmp_path, request):
    cfg = compose_experiment(name)
    nproc = 2 if cfg.parallel.mode in ("ddp", "fsdp") or "ddp" in name else 1  # ddp/fsdp ones under torchrun
    sweep = tmp_path / "sweep"
    overrides = [f"+experiment={name}", *small(cfg.data.name, cifar_root), f"hydra.sweep.dir={sweep}"]
    overrides += parent_overrides(name, tmp_path)
    if name == "accumulation_sweep":  # its sweep, which the next test reads too
        stdout, sweep = request.getfixturevalue("accumulation_sweep")
    elif "mode: MULTIRUN" in (ROOT / "conf" / "experiment" / f"{name}.yaml").read_text():
        stdout = run_train(tmp_path / "run", *overrides, nproc=nproc).stdout  # a sweep: Hydra's launcher
    else:  # one run: what train.py runs after composing, in process or in forked ranks under torchrun's environment
        stdout = run_in_process(tmp_path / "run", *overrides, nproc=nproc)
    run_dirs = (
        [p for p in sweep.iterdir() if p.is_dir()] if sweep.is_dir() else [tmp_path / "run"]
    )  # a sweep: a dir a job
    assert stdout.count("done: 2 steps") == len(run_dirs), stdout
    assert all((run_dir / "model.pt").is_file() for run_dir in run_dirs)
    model = cfg.model._target_.split(".")[-1]
    assert f"x{nproc} on cpu | model={model} data={cfg.data.name} " in stdout


@pytest.mark.slow
def test_accumulation_sweep_runs_k_1_2_4_8_at_one_global_batch_without_dash_m(accumulation_sweep):
    stdout, sweep = accumulation_sweep
    layouts = re.findall(r"global batch (\d+) = 1 ranks x (\d+) micro-batch x (\d+) accumulation", stdout)
    assert [tuple(map(int, t)) for t in layouts] == [(32, 32, 1), (32, 16, 2), (32, 8, 4), (32, 4, 8)]
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0", "1", "2", "3"]
    for job, steps in enumerate((1, 2, 4, 8)):
        saved = OmegaConf.load(sweep / str(job) / ".hydra" / "config.yaml")
        assert saved.accumulation.steps == steps and saved.accumulation.global_batch_size == 32
        assert (sweep / str(job) / "model.pt").is_file()


def test_label_smoothing_is_in_the_training_loss_only():
    torch.manual_seed(0)
    output, target = torch.randn(5, 10), torch.randint(0, 10, (5,))
    task = Classification(label_smoothing=0.1)
    expected = F.cross_entropy(output, target, label_smoothing=0.1) * 5  # a sum over samples
    assert torch.allclose(task.loss_sum(output, target), expected)
    assert not torch.allclose(task.loss_sum(output, target), F.cross_entropy(output, target) * 5)
    assert task.loss_sum(output[:0], target[:0]).item() == 0.0  # an empty micro-batch
    plain = F.cross_entropy(output, target, reduction="sum").double()
    assert task.eval_sums(output, output, target)[0] == plain  # val/loss: plain cross-entropy
    assert Classification().label_smoothing == 0.0
    with pytest.raises(ConfigError, match="task.label_smoothing=1"):
        Classification(label_smoothing=1.0)


def test_micro_batch_keeps_the_global_batch_and_names_a_bad_split():
    cfg = OmegaConf.create({"g": 32, "k": 4, "b": "${micro_batch:${g},${k},${oc.env:TRAINKIT_TEST_WORLD,2}}"})
    assert cfg.b == 4
    assert micro_batch(128, 1, "1") == 128
    with pytest.raises(ConfigError, match="32 is not a multiple of K x world size = 3 x 1"):
        micro_batch(32, 3, 1)


def test_cifar_augmentation_is_random_reproducible_and_train_only(cifar_root):
    _skip_md5()
    train, val, _ = torchvision_splits("CIFAR10", str(cifar_root), download=False, augment=True)
    plain, plain_val, _ = torchvision_splits("CIFAR10", str(cifar_root), download=False)
    assert draws_random(train) and not any(map(draws_random, (val, plain, plain_val)))  # seeded per sample: train only
    torch.manual_seed(1)
    assert not torch.equal(train[0][0], plain[0][0])  # cropped/flipped: augmented
    assert all(torch.equal(val[i][0], plain_val[i][0]) for i in range(len(val)))  # validation: never

    def epoch(dataset, workers: int, start: int = 0):
        loader = TrainLoader(dataset, CPU, batch_size=4, num_workers=workers, seed=0, micro_batches=5)
        return [x for x, _ in loader.epoch(3, start=start)]

    batches = epoch(train, 0)
    assert not torch.equal(torch.cat(batches), torch.cat(epoch(plain, 0)))
    # The same draws in a loader worker and after a mid-epoch resume: torchvision's transforms draw
    # from torch's RNG, which SeededBatches seeds per sample from (seed, epoch, sample index).
    for got in (epoch(train, 2), [*batches[:2], *epoch(train, 0, start=2)]):
        assert all(torch.equal(a, b) for a, b in zip(got, batches, strict=True))


def test_augmentation_of_a_set_without_one_is_refused():
    with pytest.raises(ConfigError, match="no augmentation is defined for MNIST"):
        torchvision_splits("MNIST", "/nonexistent", download=False, augment=True)


def test_a_forks_experiment_that_builds_on_a_run_is_found_without_editing_this_file(tmp_path, monkeypatch):
    """A fork adds conf/experiment/<its own>.yaml that needs a finished run (a teacher here): the tests above make
    that run for it from what the yaml declares, not from a list in this file (which a fork never edits)."""
    import shutil

    import test_experiments

    conf = shutil.copytree(CONF, tmp_path / "conf")
    lines = (CONF / "experiment" / "digits_distil.yaml").read_text().splitlines()
    kept = [line for line in lines if not line.startswith("# ") or "@package" in line]  # no command line to read
    (conf / "experiment" / "fork_distil.yaml").write_text("\n".join(kept))
    monkeypatch.setattr(test_experiments, "CONF", conf)
    overrides = parent_overrides("fork_distil", tmp_path / "parents")
    assert [o.partition("=")[0] for o in overrides] == ["task.teacher.from"]
    cfg = compose_experiment("fork_distil", *small("", tmp_path), *overrides)
    config.check(cfg)
    teacher.build_task(cfg.task, None, torch.device("cpu"), own=False)


def test_a_parent_declared_under_a_key_that_is_no_setting_is_refused():
    cfg = compose_experiment("digits_simclr")
    cfg.parents = {"model.init.form": ["+experiment=digits_simclr"]}  # misspelt: no test would make its parent
    with pytest.raises(ConfigError, match=r"parents.model.init.form: there is no setting model.init.form"):
        config.check(cfg)


def test_digits_folder_writes_data_digits_split_as_pngs_an_image_folder_reads_back(tmp_path, capsys):
    """scripts/digits_folder.py (+experiment=shards_digits_cnn's folder): data=digits' train / val / test, each image
    a class folder's 8x8 PNG whose pixels are the digit's, 0..16 scaled to 0..255; an out that holds files refused."""
    from PIL import Image

    from trainkit.data.digits import digits

    folders = script("digits_folder")
    assert folders.main([str(tmp_path / "digits")]) == 0
    for split, data in zip(("train", "val", "test"), digits(), strict=True):
        files = sorted((tmp_path / "digits" / split).glob("*/*.png"))
        assert len(files) == len(data) and {f.parent.name for f in files} == {str(c) for c in range(10)}
        for path in files[:: len(files) // 7]:  # a few of each split, across the classes
            x, y = data[int(path.stem)]
            assert path.parent.name == str(int(y))
            assert np.array_equal(np.asarray(Image.open(path)), (x[0] * 255).round().byte().numpy())
    assert folders.main([str(tmp_path / "digits")]) == 2
    assert "exists and holds files" in capsys.readouterr().err
