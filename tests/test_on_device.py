"""data.on_device: the train split on the device once, micro-batches taken there by index (trainkit.loading.Resident),
trains what the DataLoader path trains, bit for bit: the default job at 1 rank and at 2 ranks x K=2, a resume
mid-epoch, data.shuffle=false, addition's padded sequences with the GPT. Each data set's device form yields the
loader's micro-batches (same samples, order, values, shapes); the key is checked; the loader path's batches copied
ahead are the batches without it."""

import numpy as np
import pytest
import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import OmegaConf
from test_tokens import write_sources
from torch.utils.data import TensorDataset

from helpers import ROOT, run_in_process, weights
from trainkit.accumulate import EpochLayout
from trainkit.batch import leaves
from trainkit.data import addition, digits_views, fake, pydoc_text, tokens
from trainkit.data.corpus import prepare
from trainkit.dist import Dist
from trainkit.errors import ConfigError
from trainkit.loading import Resident, TrainLoader, ahead, free_memory, residency, tensor_form

CPU = torch.device("cpu")


def _same_batches(dataset, world_size: int, batch_size: int, shuffle: bool = True) -> None:
    """Every rank's micro-batches on the device path equal the DataLoader path's, at several epochs and starts."""
    micro_batches = EpochLayout(len(dataset), world_size, batch_size, 2).micro_batches + 1  # one empty one at the end
    for rank in range(world_size):
        d = Dist(rank, rank, world_size, CPU)
        device, loader = (
            TrainLoader(dataset, d, batch_size, 0, 3, micro_batches, shuffle=shuffle, resident=resident)
            for resident in (True, False)
        )
        for epoch, start in [(0, 0), (1, 0), (1, 2), (2, micro_batches - 1)]:
            got, expected = list(device.epoch(epoch, start)), list(loader.epoch(epoch, start))
            assert len(got) == len(expected) == micro_batches - start
            for g, e in zip(got, expected, strict=True):
                assert len(leaves(g)) == len(leaves(e))
                for a, b in zip(leaves(g), leaves(e), strict=True):
                    assert a.dtype == b.dtype and torch.equal(a, b), (type(dataset).__name__, rank, epoch, start)


def device_forms() -> list:
    """addition (padded to each micro-batch's longest), FakeData (images made once), a corpus's random blocks
    (starts from per-sample seeds) and its tiles, a plain TensorDataset, digits' SimCLR views (drawn per sample from
    its seed, warped a micro-batch at a time), pydoc_text's random blocks (padded at their document's end)."""
    problems = addition.splits(max_digits=3, num_train=53, num_val=5)[0]
    images = fake.fake(train_size=21, val_size=2, shape=[3, 4, 4], num_classes=3)[0]
    stream = np.random.RandomState(0).randint(0, 50, size=301).astype(np.uint16)
    blocks, tiles = tokens.RandomBlocks(stream, 8), tokens.Tiles(stream, 8, eot=49)
    tensors = TensorDataset(torch.randn(19, 2), torch.arange(19))
    docs = {"a": "a few words of text, cut into blocks", "b": "xy", "c": "short", "d": "the last document here"}
    vocab = pydoc_text.Vocabulary("".join(sorted(set("".join(docs.values())))))
    text = pydoc_text.RandomBlocks(docs, list(docs), vocab, 8)  # documents about a block long: most blocks padded
    views = digits_views.digits_views()[0]
    views.images, views.labels = views.images[:23], views.labels[:23]  # a few: the views are made per sample
    return [problems, images, blocks, tiles, tensors, views, text]


@pytest.mark.parametrize("shuffle", [True, False])
def test_each_device_form_yields_the_loaders_micro_batches(shuffle):
    """Each data set's device form (device_forms): on 1 and 2 ranks, any epoch and start."""
    for dataset in device_forms():
        for world_size, batch_size in [(1, 4), (2, 3)]:
            _same_batches(dataset, world_size, batch_size, shuffle)


def test_a_debug_subset_on_the_device_is_its_kept_samples():
    """debug=limit/overfit/fast keep some samples of a split (debug.take, evenly spaced; overfit's of limit's): on the
    device they are the kept samples, the DataLoader path's micro-batches bit for bit, for each device form (a data
    set that builds its micro-batches is named the kept rows: device_batches' `rows`). A data set whose
    device_batches takes no `rows` stays on the DataLoader, the line naming debug's subset."""
    from trainkit.debug import take

    for dataset in device_forms():
        kept = take(dataset, 2 * len(dataset) // 3)
        for subset in (kept, take(kept, 7)):
            assert residency(subset, CPU, "auto", 0)[0], type(dataset).__name__
            if hasattr(subset, "device_bytes"):
                assert subset.device_bytes() == sum(t.nbytes for t in tensor_form(subset))
            for world_size, batch_size in [(1, 4), (2, 3)]:
                _same_batches(subset, world_size, batch_size)

    class Rowless(TensorDataset):  # builds its micro-batches from the order alone: a subset cannot name its rows
        draws_random = False

        def device_tensors(self):
            return self.tensors

        def device_batches(self, tensors, order, batch_size, epoch, seed):
            return zip(*(t[order].split(batch_size) for t in tensors), strict=True)

    why = "Rowless's subset kept by debug (its device_batches takes no rows) declares no tensor form (device_tensors)"
    assert residency(take(Rowless(torch.arange(8)), 3), CPU, "auto", 0) == (False, f"data.on_device=auto: {why}")


def test_residency_says_which_path_and_why():
    """auto: a tensor form that draws nothing on the host (or builds its draws: device_batches) and fits; workers
    asked for keep the loader; true where it cannot be: one line."""

    class Drawn(torch.utils.data.Dataset):
        draws_random = "torch"

        def __len__(self):
            return 4

        def __getitem__(self, i):
            return torch.rand(2)

    problems = addition.splits(max_digits=2, num_train=40, num_val=5)[0]
    assert residency(problems, CPU, "auto", 0)[0]
    assert residency(tokens.RandomBlocks(np.zeros(50, np.uint16), 4), CPU, "auto", 0)[0]  # draws from its seeds
    workers = "data.on_device=auto: data.num_workers=2 asks for loader workers"
    assert residency(problems, CPU, "auto", 2) == (False, workers)
    assert residency(problems, CPU, True, 2)[0]
    assert residency(problems, CPU, False, 0) == (False, "data.on_device=false")
    took, why = residency(Drawn(), CPU, "auto", 0)
    assert not took and why == "data.on_device=auto: Drawn declares no tensor form (device_tensors)"
    Drawn.device_tensors = lambda self: (torch.zeros(4, 2),)  # type: ignore[attr-defined]
    took, why = residency(Drawn(), CPU, "auto", 0)
    assert not took and "Drawn draws random augmentation on the host (draws_random=torch)" in why
    with pytest.raises(ConfigError, match="data.on_device=true: the train split cannot be on the device: Drawn draws"):
        residency(Drawn(), CPU, True, 0)
    too_big = TensorDataset(torch.zeros(4))
    too_big.device_bytes = lambda: 1 << 60  # type: ignore[attr-defined]
    took, why = residency(too_big, CPU, "auto", 0)
    assert not took and "is over 50% of it" in why
    assert residency(too_big, CPU, True, 0)[0]  # true: the user's call


def test_auto_takes_a_split_within_its_share_of_the_free_memory_shared_by_the_local_ranks(monkeypatch):
    """auto: a split within half the device's free memory goes there, one under the free memory but over half does
    not. On the CPU the node's local ranks share host memory and each makes its own copy: the half is theirs
    together (LOCAL_WORLD_SIZE). The fractions are far from each bound: the free memory moves between the calls."""
    split, free = TensorDataset(torch.zeros(4)), free_memory(CPU)
    assert free is not None

    def taken(fraction: float) -> tuple[bool, str]:
        split.device_bytes = lambda: int(fraction * free)  # type: ignore[attr-defined]
        return residency(split, CPU, "auto", 0)

    assert taken(0.3)[0]
    took, why = taken(0.8)
    assert not took and why.startswith("data.on_device=auto: the split's ") and why.endswith("free is over 50% of it")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    took, why = taken(0.3)
    assert not took and why.endswith("free is over 12% of it (50% among 4 local ranks, each its own copy)"), why
    assert taken(0.05)[0]


# conf/data's data sets made small; data=tokens on a corpus prepared here (those that need a download or a folder of
# images refuse to build here: skipped)
SMALL = {
    "addition": ["max_digits=2", "num_train=60", "num_val=20"],
    "fake": ["splits.train_size=16", "splits.val_size=4"],
    "tokens": ["block_size=16"],
}


def test_each_data_sets_device_bytes_are_the_bytes_its_device_tensors_take(tmp_path):
    """data.on_device=auto decides by `device_bytes()` before the tensors are made: it is their size, for each split
    of every data set in conf/data that declares it."""
    prepare([str(write_sources(tmp_path / "sources"))], str(tmp_path / "corpus"), "bytes", progress=False)
    declared = set()
    for path in sorted((ROOT / "conf" / "data").glob("*.yaml")):
        data = OmegaConf.merge(OmegaConf.load(path), OmegaConf.from_dotlist(SMALL.get(path.stem, [])))
        data.root = str(tmp_path / "corpus") if path.stem == "tokens" else data.get("root")
        try:
            sets = instantiate(OmegaConf.create({"data": data}).data.splits)  # its ${data.*} as in a composed run
        except InstantiationException as error:
            assert isinstance(error.__cause__, ConfigError), error  # no MNIST files, no image folder
            continue
        for split in (s for s in sets if hasattr(s, "device_bytes")):
            assert split.device_bytes() == sum(t.nbytes for t in tensor_form(split)), (path.stem, type(split).__name__)
            declared.add(f"{path.stem}.{type(split).__name__}")
    assert {"addition.Problems", "fake.FakeData", "pydoc_text.RandomBlocks", "tokens.RandomBlocks", "tokens.Tiles"} <= (
        declared
    ), declared


def test_the_loaders_batches_copied_ahead_are_the_same_batches_in_the_same_order():
    """The loader path's one-batch prefetch (ahead: on CUDA a copy stream, pinned memory, non_blocking; on the CPU a
    copy is the tensor itself) hands over the loader's batches, in order, the empty ones included."""
    dataset = addition.splits(max_digits=2, num_train=37, num_val=5)[0]
    d = Dist(0, 0, 1, CPU)
    plain = TrainLoader(dataset, d, 5, 0, 3, 9, resident=False)
    copied = TrainLoader(dataset, d, 5, 0, 3, 9, resident=False)
    copied.prefetch = True  # as on a GPU
    for epoch, start in [(0, 0), (1, 3)]:
        got, expected = list(copied.epoch(epoch, start)), list(plain.epoch(epoch, start))
        assert len(got) == len(expected) == 9 - start
        for (gx, gy), (ex, ey) in zip(got, expected, strict=True):
            assert torch.equal(gx, ex) and torch.equal(gy, ey)
    assert [t.tolist() for t in ahead([torch.ones(1), torch.zeros(1)], CPU)] == [[1.0], [0.0]]
    assert TrainLoader(dataset, d, 5, 2, 3, 9).loader.persistent_workers  # workers live across epochs


def test_a_resident_split_moves_its_tensors_once():
    dataset = TensorDataset(torch.randn(10, 2), torch.arange(10))
    resident = Resident(dataset, CPU)
    assert resident.tensors[0] is dataset.tensors[0]  # on the CPU the device is host memory: no copy at all


TINY = ["model.width=16", "optim=sgd", "trainer.eval_every=100", "trainer.log_every=100", "trainer.test=false"]
# digits' 1079 train samples at global batch 256: 5 steps an epoch (the last one short), 7 steps cross into epoch 1
ONE = [*TINY, "data.batch_size=128", "accumulation.steps=2", "trainer.max_steps=7"]
TWO = [*TINY, "data.batch_size=64", "accumulation.steps=2", "trainer.max_steps=7"]


def test_the_device_path_trains_the_loader_paths_weights_bit_for_bit(tmp_path):
    """The default job with data.on_device=true and =false (the DataLoader over the same split): equal weights at
    1 rank x K=2, at 2 ranks x K=2, with data.shuffle=false, and from a resume mid-epoch (step 3 of 5) on the device
    path of a run that went through the loader; so too for addition's padded sequences with a tiny GPT."""
    runs = {}
    for name, overrides, nproc in [
        ("one", ONE, 1),
        ("two", TWO, 2),
        ("in_order", [*ONE, "data.shuffle=false"], 1),
    ]:
        for on_device in ("true", "false"):
            run_dir = tmp_path / f"{name}_{on_device}"
            extra = ["checkpoint.every=3", "checkpoint.keep=3"] if (name, on_device) == ("one", "false") else []
            out = run_in_process(run_dir, *overrides, *extra, f"data.on_device={on_device}", nproc=nproc)
            path = "on the device, batches taken by index" if on_device == "true" else "DataLoader, no worker"
            assert f"data path: {path} (data.on_device={on_device}" in out
            runs[name, on_device] = weights(run_dir)
        for key in runs[name, "true"]:
            assert torch.equal(runs[name, "true"][key], runs[name, "false"][key]), (name, key)
    # A resume mid-epoch: the loader run's step-3 checkpoint, the rest of its epoch and the next on the device
    resumed = tmp_path / "resumed"
    checkpoint = tmp_path / "one_false" / "checkpoints" / "step_00000003.pt"
    run_in_process(resumed, *ONE, "data.on_device=true", f"checkpoint.resume={checkpoint}")
    for key, value in weights(resumed).items():
        assert torch.equal(value, runs["one", "false"][key]), ("resumed", key)
    gpt = [
        "+experiment=addition_gpt",
        "model.n_layer=1",
        "model.n_head=2",
        "model.n_embd=16",
        "data.num_train=300",
        "data.num_val=20",
        "data.batch_size=16",
        "accumulation.steps=2",
        "trainer.max_steps=12",  # 10 steps an epoch: the short last one and into the next
        *TINY[1:],
    ]
    for on_device in ("true", "false"):
        run_in_process(tmp_path / f"gpt_{on_device}", *gpt, f"data.on_device={on_device}")
    for key, value in weights(tmp_path / "gpt_true").items():
        assert torch.equal(value, weights(tmp_path / "gpt_false")[key]), ("gpt", key)
