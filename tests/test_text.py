"""data=pydoc_text: the corpus's fixed split by document, blocks inside documents, token-exact
accumulation on it (2 ranks x K2 = one process), sampling that does not depend on the ranks, and a
resume under another corpus refused."""

import random
import shutil

import pytest
import torch

from helpers import max_diff, rows, run_in_process, weights
from trainkit.config import ConfigError
from trainkit.data import pydoc_text as text
from trainkit.data.addition import IGNORE
from trainkit.loading import SeededBatches, TrainBatches


def test_the_split_is_by_document_fixed_disjoint_and_about_a_tenth():
    docs = text.documents()
    train, val, test = text.split_names(docs)
    assert train and val and not set(train) & set(val) and set(train) | set(val) | set(test) == set(docs)
    names = list(docs)
    random.Random(0).shuffle(names)  # the split depends on the names and lengths, not on their order
    shuffled = text.split_names({n: docs[n] for n in names})
    assert (sorted(shuffled[0]), sorted(shuffled[1])) == (sorted(train), sorted(val))  # test: test_test_split.py
    share = sum(len(docs[n]) for n in val) / sum(map(len, docs.values()))
    assert 0.08 < share <= 0.1
    train_set, val_set, _ = text.splits(64)
    assert (train_set.names, val_set.names) == (train, val)  # the blocks come from their split's documents
    assert ", ".join(val) in train_set.summary  # printed at the start of a run


def test_blocks_tile_each_document_and_never_cross_its_end():
    docs = {"a": "hello world", "b": "xy", "c": "abcdefghi", "d": "z"}  # 10, 1, 8 and 0 targets
    vocab = text.Vocabulary("".join(sorted(set("".join(docs.values())))))
    blocks = text.Blocks(docs, ["a", "b", "c", "d"], vocab, block_size=4)
    x, y = blocks.tensors
    assert x.shape == y.shape == (3 + 1 + 2, 4)  # ceil(10/4) + ceil(1/4) + ceil(8/4) + 0 blocks
    owners = ["a", "a", "a", "b", "c", "c"]
    for name in "abc":
        mine = [i for i, owner in enumerate(owners) if owner == name]
        real = y[mine] != IGNORE
        # Inputs and targets of a document's blocks, in order, are its text shifted by one: nothing else.
        assert vocab.decode(x[mine][real].tolist()) == docs[name][:-1]
        assert vocab.decode(y[mine][real].tolist()) == docs[name][1:]
        assert (x[mine][~real] == vocab.pad).all()  # padding: the pad input, and no loss (IGNORE)
    assert (y != IGNORE).sum(dim=1).tolist() == [4, 4, 2, 1, 4, 4]  # the short last blocks bear fewer


def test_the_corpus_blocks_hold_every_character_of_their_documents_once():
    docs = text.documents()
    train, val, test = text.splits(64, random_offsets=False)
    for blocks in (train, val, test):
        x, y = blocks.tensors
        real = y != IGNORE
        assert real.sum() == sum(len(docs[n]) - 1 for n in blocks.names)
        assert len(x) == sum(-(-(len(docs[n]) - 1) // 64) for n in blocks.names)
        assert (real[:, :-1] >= real[:, 1:]).all()  # padding only at a block's end
    with pytest.raises(ConfigError, match=r"data.block_size=1 must be an integer >= 2"):
        text.splits(1)


def test_random_blocks_start_anywhere_in_their_document_and_never_cross_its_end():
    docs = {"a": "abcdefghijklmnopqrstuvwx", "b": "XYZ"}  # 23 and 2 targets: 6 and 1 blocks of 4
    vocab = text.Vocabulary("".join(sorted(set("".join(docs.values())))))
    blocks = text.RandomBlocks(docs, ["a", "b"], vocab, block_size=4)
    assert len(blocks) == 7 and blocks.draws_random  # as many as the tiles: the epoch's length is fixed
    seeded = SeededBatches(blocks, seed=0)  # what TrainLoader loads through: seeds per (seed, epoch, sample)
    starts = set()
    for epoch in range(40):
        for i, (x, y) in enumerate(seeded.__getitems__((epoch, list(range(7))))):
            doc = docs["a" if i < 6 else "b"]
            real = y != IGNORE
            shown = vocab.decode(x[real].tolist()) + vocab.decode(y[real].tolist())[-1]
            start = doc.find(shown)  # its characters, in order, from one place of its own document
            assert start >= 0 and real.any() and (x[~real] == vocab.pad).all()
            assert bool(real[:-1].all()) or start + len(shown) == len(doc)  # short only at the document's end
            starts.add((i < 6, start))
    assert {s for a, s in starts if a} == set(range(23))  # every start of "a" drawn in 40 epochs
    again = seeded.__getitems__((3, [2]))[0], seeded.__getitems__((3, [2]))[0]
    assert torch.equal(again[0][0], again[1][0])  # a function of (seed, epoch, index)
    other = [seeded.__getitems__((e, [2]))[0][0] for e in range(5)]
    assert len({tuple(t.tolist()) for t in other}) > 1  # and new blocks in another epoch


# A tiny GPT on the corpus, 6 steps of a global batch of 32 blocks of 128 characters (SGD, cosine
# warmup, clipping): the micro-batches hold different numbers of loss-bearing characters. SGD: an
# equivalence (tests/helpers.py); +experiment=pydoc_gpt's AdamW keys (betas) do not compose with it.
TEXT = [
    "seed=2",  # steps of differing character counts (seed 0: steps 2-6 hold 4096 each, test documents held out)
    "data=pydoc_text",
    "model=gpt",
    "optim=sgd",
    "model.n_layer=1",
    "model.n_head=2",
    "model.n_embd=32",
    "data.block_size=128",
    "trainer.max_steps=6",
    "trainer.log_every=1",
    "trainer.eval_every=1000",
    "checkpoint.every=0",
    "sched.warmup_steps=2",
]


@pytest.fixture(scope="module")
def single_text(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("text")
    run_in_process(run_dir, *TEXT, "data.batch_size=32")
    return run_dir


@pytest.mark.slow
def test_two_ranks_k2_b8_equal_one_process_b32_on_the_corpus(single_text, tmp_path):
    train, *_ = text.splits(128)
    loaded, counts = SeededBatches(train, seed=2), set()
    for rank in range(2):  # what the 2-rank run's micro-batches hold (random blocks: drawn per sample)
        for batch in list(TrainBatches(len(train), 2, rank, 8, seed=2))[:12]:
            counts.add(sum(int((y != IGNORE).sum()) for _, y in loaded.__getitems__(batch)))
    assert len(counts) > 2, counts  # token counts differ between micro-batches
    run_in_process(tmp_path, *TEXT, "data.batch_size=8", "accumulation.steps=2", "parallel=ddp", nproc=2)
    single, ranks = rows(single_text), rows(tmp_path)
    assert len(single) == len(ranks) == 6
    assert len({b["tokens"] - a["tokens"] for a, b in zip(single, single[1:], strict=False)}) > 1  # and between steps
    for a, b in zip(single, ranks, strict=True):
        assert (a["samples"], a["tokens"]) == (b["samples"], b["tokens"])
        for key in ("loss", "lr", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-5), (a["step"], key)
    assert single[-1]["val/loss"] == pytest.approx(ranks[-1]["val/loss"], rel=1e-5)
    assert single[-1]["val/bpc"] == pytest.approx(single[-1]["val/loss"] / torch.log(torch.tensor(2.0)).item())
    error = max_diff(weights(tmp_path), weights(single_text))
    print(f"max |weights - one process| {error:.2e}")
    assert error < 1e-5  # SGD: reduction-order rounding alone, 2.2e-8 measured; 1e-5 is ~400x that
    assert (tmp_path / "vocab.json").read_text() == (single_text / "vocab.json").read_text()


@pytest.mark.slow
def test_sampling_is_deterministic_and_the_same_on_1_and_2_ranks(single_text, tmp_path):
    def sample(name, *overrides, nproc=1):
        run_in_process(tmp_path / name, f"run_dir={single_text}", *overrides, nproc=nproc, script="predict")
        return (tmp_path / name / "samples.txt").read_text()

    settings = ["prompt=The", "max_new_tokens=24", "num_samples=3", "top_k=20"]
    one = sample("one", *settings)
    assert sample("two", *settings, nproc=2) == one  # rank 1 draws sample 2 alone: the same text
    texts = one.split("\n---------------\n")[:-1]
    assert len(texts) == 3 and all(t.startswith("The") and len(t) == 3 + 24 for t in texts)
    assert len(set(texts)) == 3  # each sample its own draws
    assert sample("again", *settings) == one
    assert sample("seed", *settings, "seed=1") != one
    greedy = sample("greedy", *settings, "temperature=0")
    assert len(set(greedy.split("\n---------------\n")[:-1])) == 1  # argmax: no draws
    assert sample("greedy_seed", *settings, "temperature=0", "seed=1") == greedy
    assert sample("cold", *settings, "temperature=1e-45") == greedy  # the limit of a falling temperature


@pytest.mark.slow
@pytest.mark.parametrize(
    "override,message",
    [
        ("prompt=costs $5", "prompt='costs $5' has characters outside the run's vocabulary: '$'"),
        ("temperature=-0.5", "temperature=-0.5 must be a finite number >= 0"),
        ("temperature=inf", "temperature=inf must be a finite number >= 0"),
        ("prompt=123", 'prompt=123 must be a non-empty string (Hydra reads 123 as a number: quote it, "prompt='),
        ("top_k=0", "top_k=0 must be null or a positive integer"),
    ],
)
def test_bad_sampling_settings_are_refused(single_text, tmp_path, override, message):
    with pytest.raises(ConfigError) as error:
        run_in_process(tmp_path, f"run_dir={single_text}", override, script="predict")
    assert str(error.value).startswith(message)


@pytest.mark.slow
def test_a_text_run_without_its_vocabulary_is_refused_naming_the_file(single_text, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(single_text, run_dir)
    (run_dir / "vocab.json").unlink()
    with pytest.raises(ConfigError) as error:
        run_in_process(tmp_path / "out", f"run_dir={run_dir}", script="predict")
    assert str(error.value) == f"run_dir={run_dir} is a text run (data=pydoc_text) without its vocab.json"


@pytest.mark.slow
def test_a_resume_under_another_corpus_is_refused_naming_the_pythons(single_text, tmp_path, capsys):
    (tmp_path / "checkpoints").mkdir()
    name = "step_00000006.pt"
    state = torch.load(single_text / "checkpoints" / name, weights_only=True)
    state["identity"]["data.corpus"] = {"sha256": "0" * 64, "source": "pydoc_data.topics of Python 3.99.0"}
    torch.save(state, tmp_path / "checkpoints" / name)
    with pytest.raises(SystemExit) as exit:
        run_in_process(tmp_path, *TEXT, "data.batch_size=32", "trainer.max_steps=8")
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit.value.code == 2 and len(lines) == 1
    assert lines[0].startswith(
        "error: checkpoint.resume: the checkpoint was written with data.corpus=pydoc_data.topics of Python 3.99.0 "
        f"(sha256 000000000000), this run has data.corpus={text.source()} (sha256 "
    )
