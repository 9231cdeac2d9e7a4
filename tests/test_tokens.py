"""data=tokens: scripts/prepare_text.py's corpus (both tokenizers round-trip text, a split by document),
the memory-mapped splits, random blocks that do not depend on the world size, 2 ranks x K2 = one
process, an exact resume mid-epoch, a resume on another tokenizer or corpus refused, bad roots in one line."""

import json
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import max_diff, rows, run_distributed, run_in_process, weights
from trainkit.data import tokens
from trainkit.data.corpus import prepare
from trainkit.errors import ConfigError
from trainkit.loading import SeededBatches, TrainBatches

SAMPLE = "def f(x):\n    return x ** 2  # carré, 平方 ✓\n\n\tclass A: pass\n"


def write_sources(folder: Path) -> Path:
    """12 small generated .py / .txt files (and one .md that the default globs skip), in two folders."""
    rng = np.random.RandomState(0)
    words = ["def", "return", "self", "value", "import", "class", "for", "in", "if", "else", "None", "é", "→"]
    for i in range(12):
        lines = [" ".join(rng.choice(words, size=rng.randint(3, 9))) for _ in range(rng.randint(20, 40))]
        path = folder / ("pkg" if i % 2 else "lib") / f"f{i:02d}.{'py' if i % 3 else 'txt'}"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"# file {i}\n" + "\n".join(lines) + "\n")
    (folder / "lib" / "skip.md").write_text("not a source\n")
    return folder


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """{"bytes": dir, "bpe": dir}: the same sources prepared with each tokenizer (val and test 2 files each)."""
    base = tmp_path_factory.mktemp("tokens")
    sources = write_sources(base / "src")
    for kind in ("bytes", "bpe"):
        prepare([str(sources)], str(base / kind), kind, vocab_size=300, val_fraction=1 / 6, progress=False)
    return {kind: base / kind for kind in ("bytes", "bpe")}


def test_both_tokenizers_round_trip_text_and_the_split_is_by_document(corpora):
    for kind, root in corpora.items():
        meta = json.loads((root / "meta.json").read_text())
        codec = tokens.Codec.load(root)
        assert codec is not None and codec.size == meta["vocab_size"] == (257 if kind == "bytes" else 300)
        assert codec.decode(codec.encode(SAMPLE)) == SAMPLE
        assert meta["documents"] == {"train": 8, "val": 2, "test": 2} and meta["dtype"] == "uint16"
        ids = np.fromfile(root / "train.bin", dtype=np.uint16)
        assert len(ids) == meta["tokens"]["train"] and (ids == codec.eot).sum() == 8  # each document ends once
        first = ids[: int(np.argmax(ids == codec.eot))].tolist()
        assert codec.decode(first).startswith("# file ")  # a whole document, in sorted order
        assert meta["sha256"]["tokenizer"] == tokens.sha256_file(root / "tokenizer.json")
    bpe = tokens.Codec.load(corpora["bpe"])
    assert bpe is not None and len(bpe.encode("return value")) < len("return value")  # it learned merges
    both = [json.loads((root / "meta.json").read_text())["sha256"]["sources"] for root in corpora.values()]
    assert both[0] == both[1]  # the same files in the same split


def test_splits_are_memory_mapped_and_tile_val(corpora):
    train, val, test = tokens.splits(str(corpora["bytes"]), block_size=16)
    assert all(isinstance(s.tokens, np.memmap) for s in (train, val, test))  # never read whole
    sent = pickle.dumps(train)  # to a spawned loader worker: the file's name, not its tokens
    assert len(sent) < 2000 and isinstance(pickle.loads(sent).tokens, np.memmap)
    assert torch.equal(pickle.loads(pickle.dumps(val))[3][1], val[3][1])
    meta = json.loads((corpora["bytes"] / "meta.json").read_text())
    assert len(train) == (meta["tokens"]["train"] - 1) // 16 and train.draws_random and not val.draws_random
    ys = torch.stack([val[i][1] for i in range(len(val))])
    real = ys != -100
    assert real.sum() == meta["tokens"]["val"] - 1  # every val token but the first is a target once
    assert torch.equal(ys[real], torch.from_numpy(np.asarray(val.tokens[1:], dtype=np.int64)))
    assert train.summary.startswith(f"data: {corpora['bytes'].resolve()} (bytes tokenizer")
    sources = {p.read_text() for p in (corpora["bytes"].parent / "src").rglob("f*")}
    for kind, root in corpora.items():  # what the dataset reads is the documents' tokens (its dtype)
        codec, data = tokens.Codec.load(root), tokens.splits(str(root), block_size=16)
        assert codec is not None
        counts = json.loads((root / "meta.json").read_text())["documents"]
        for name, split in zip(tokens.SPLITS, data, strict=True):
            ends = np.flatnonzero(np.asarray(split.tokens) == codec.eot)
            assert len(ends) == counts[name] and ends[-1] == len(split.tokens) - 1, (kind, name)
            assert codec.decode(split.tokens[: ends[0]].tolist()) in sources, kind
    assert set(train.files) == {"meta.json", "tokenizer.json"}


def _rank_blocks(rank, world_size, root):
    """The inputs rank `rank` trains on in epoch 1 (its DistributedSampler shard), by sample index."""
    train, _, _ = tokens.splits(root, block_size=16)
    seeded, out, batches = SeededBatches(train, seed=3), {}, TrainBatches(len(train), world_size, rank, 4, seed=3)
    batches.set_epoch(1)
    for batch in batches:
        for index, (x, _) in zip(batch[1], seeded.__getitems__(batch), strict=True):
            out[index] = x
    return out


def test_training_blocks_do_not_depend_on_the_world_size(corpora):
    root = str(corpora["bytes"])
    alone = _rank_blocks(0, 1, root)
    ranks = run_distributed(_rank_blocks, 2, root, group=False)
    assert set(ranks[0]) | set(ranks[1]) == set(alone)
    for shard in ranks:
        for index, x in shard.items():
            assert torch.equal(x, alone[index]), index
    assert len({tuple(x.tolist()) for x in alone.values()}) > len(alone) // 2  # random starts, not one block


def lm(root: Path, *extra: str) -> list[str]:
    return [
        "data=tokens",
        f"data.root={root}",
        "model=gpt",
        "optim=sgd",
        "model.n_layer=1",
        "model.n_head=2",
        "model.n_embd=16",
        "data.block_size=16",
        "trainer.log_every=1",
        "trainer.eval_every=1000",
        "sched.warmup_steps=2",
        *extra,
    ]


def test_two_ranks_k2_equal_one_process_at_the_same_global_batch(corpora, tmp_path):
    root = corpora["bpe"]
    run_in_process(tmp_path / "one", *lm(root, "trainer.max_steps=4", "checkpoint.every=0", "data.batch_size=8"))
    two = ["data.batch_size=2", "accumulation.steps=2", "parallel=ddp"]
    run_in_process(tmp_path / "two", *lm(root, "trainer.max_steps=4", "checkpoint.every=0", *two), nproc=2)
    single, ranks = rows(tmp_path / "one"), rows(tmp_path / "two")
    assert len(single) == len(ranks) == 4
    for a, b in zip(single, ranks, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), a["step"]
    error = max_diff(weights(tmp_path / "one"), weights(tmp_path / "two"))
    assert error < 1e-5  # SGD: the all-reduce's summation order alone (~1e-8); 1e-5 is ~1000x that
    assert (tmp_path / "two" / "tokenizer.json").read_bytes() == (root / "tokenizer.json").read_bytes()


@pytest.fixture(scope="module")
def six_steps(corpora, tmp_path_factory):
    """6 steps of batch 4 on the bytes corpus (an epoch has 10+ steps), a checkpoint every 3."""
    run_dir = tmp_path_factory.mktemp("six")
    run_in_process(run_dir, *lm(corpora["bytes"], "trainer.max_steps=6", "checkpoint.every=3", "data.batch_size=4"))
    return run_dir


def resume_from_step_3(six_steps: Path, target: Path, root: Path) -> None:
    (target / "checkpoints").mkdir(parents=True)
    shutil.copy(six_steps / "checkpoints" / "step_00000003.pt", target / "checkpoints")
    shutil.copy(six_steps / "metrics.jsonl", target / "metrics.jsonl")
    checkpoint = f"checkpoint.resume={target / 'checkpoints' / 'step_00000003.pt'}"
    run_in_process(target, *lm(root, "trainer.max_steps=6", "checkpoint.every=3", "data.batch_size=4", checkpoint))


def test_a_resume_mid_epoch_is_bitwise_the_uninterrupted_run(corpora, six_steps, tmp_path):
    resume_from_step_3(six_steps, tmp_path, corpora["bytes"])
    a, b = weights(tmp_path), weights(six_steps)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("change", ["tokenizer", "corpus"])
def test_a_resume_on_another_tokenizer_or_corpus_is_refused(corpora, tmp_path, capsys, change):
    root = tmp_path / "corpus"  # changed in place: the same data.root, other contents
    shutil.copytree(corpora["bytes"], root)
    run_in_process(tmp_path / "a", *lm(root, "trainer.max_steps=3", "checkpoint.every=3", "data.batch_size=4"))
    meta = json.loads((root / "meta.json").read_text())
    if change == "tokenizer":  # another tokenizer file, the same train.bin and vocabulary
        (root / "tokenizer.json").write_text(json.dumps(json.loads((root / "tokenizer.json").read_text()), indent=2))
        meta["sha256"]["tokenizer"] = tokens.sha256_file(root / "tokenizer.json")
    else:  # other tokens, the same tokenizer
        ids = np.fromfile(root / "train.bin", dtype=np.uint16)
        ids[:50] = ids[50:100]
        ids.tofile(root / "train.bin")
        meta["sha256"]["train"] = tokens.sha256_file(root / "train.bin")
    (root / "meta.json").write_text(json.dumps(meta))
    with pytest.raises((ConfigError, SystemExit)) as error:
        resume_from_step_3(tmp_path / "a", tmp_path / "b", root)
    said = str(error.value) if error.type is ConfigError else capsys.readouterr().err
    key = "data.tokenizer=tokenizer.json" if change == "tokenizer" else "data.tokens=train.bin"
    assert f"checkpoint.resume: the checkpoint was written with {key} of {root.resolve()} (sha256 " in said
    assert len(said.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "spoil,message",
    [
        ("no_root", "is not a folder: prepare one with scripts/prepare_text.py"),
        ("no_meta", "has no meta.json: prepare it with scripts/prepare_text.py"),
        ("no_val", "has no val.bin (meta.json lists it): prepare it again"),
        ("dtype", "train.bin holds {size} bytes, meta.json says {tokens} tokens of uint32 ({double} bytes)"),
        ("short", "val.bin holds {vsize} bytes, meta.json says {vtokens} tokens of uint16"),
        ("vocab", "meta.json says vocab_size=512, tokenizer.json has 300"),
        ("tokenizer", "tokenizer.json is not the one meta.json names (its sha256 differs)"),
    ],
)
def test_bad_roots_and_mismatched_files_are_one_line(corpora, tmp_path, spoil, message):
    root = tmp_path / "corpus"
    shutil.copytree(corpora["bpe"], root)
    meta = json.loads((root / "meta.json").read_text())
    size, vsize = (root / "train.bin").stat().st_size, (root / "val.bin").stat().st_size
    if spoil == "no_root":
        shutil.rmtree(root)
    elif spoil == "no_meta":
        (root / "meta.json").unlink()
    elif spoil == "no_val":
        (root / "val.bin").unlink()
    elif spoil == "short":
        (root / "val.bin").write_bytes((root / "val.bin").read_bytes()[:-2])
    elif spoil == "tokenizer":
        (root / "tokenizer.json").write_text((root / "tokenizer.json").read_text() + " ")
    else:
        meta |= {"dtype": "uint32"} if spoil == "dtype" else {"vocab_size": 512}
    if spoil not in ("no_root", "no_meta"):
        (root / "meta.json").write_text(json.dumps(meta))
    expected = message.format(
        size=size, tokens=meta["tokens"]["train"], double=2 * size, vsize=vsize - 2, vtokens=meta["tokens"]["val"]
    )
    with pytest.raises(ConfigError) as error:
        tokens.splits(str(root), block_size=16)
    assert expected in str(error.value) and "\n" not in str(error.value)
    assert str(error.value).startswith(f"data.root={root}")


def test_predict_samples_a_tokens_run_through_its_tokenizer_without_the_corpus(corpora, tmp_path):
    root = tmp_path / "corpus"
    shutil.copytree(corpora["bpe"], root)
    run_in_process(tmp_path / "run", *lm(root, "trainer.max_steps=1", "checkpoint.every=0", "data.batch_size=4"))
    shutil.rmtree(root)  # the run dir's meta.json and tokenizer.json suffice
    settings = ["prompt=def value", "max_new_tokens=12", "num_samples=2"]
    run_in_process(tmp_path / "out", f"run_dir={tmp_path / 'run'}", *settings, script="predict")
    texts = (tmp_path / "out" / "samples.txt").read_text().split("\n---------------\n")[:-1]
    assert len(texts) == 2 and all(t.startswith("def value") for t in texts) and texts[0] != texts[1]
    (tmp_path / "run" / "meta.json").unlink()
    with pytest.raises(ConfigError, match="is a tokens run without its meta.json"):
        run_in_process(tmp_path / "out2", f"run_dir={tmp_path / 'run'}", *settings, script="predict")


def test_the_script_writes_the_same_corpus_and_says_its_throughput(corpora, tmp_path):
    import subprocess
    import sys

    from helpers import ROOT

    sources = corpora["bytes"].parent / "src"
    out = tmp_path / "bytes"
    args = [str(sources), "--out", str(out), "--val-fraction", str(1 / 6)]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "prepare_text.py"), *args], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert " MB/s" in proc.stdout and "12 documents" in proc.stdout
    for name in ("train.bin", "val.bin", "test.bin", "tokenizer.json", "meta.json"):
        assert (out / name).read_bytes() == (corpora["bytes"] / name).read_bytes(), name
    with pytest.raises(ConfigError, match=f"^{tmp_path / 'none'} is neither a file nor a folder$"):
        prepare([str(tmp_path / "none")], str(out))  # the script prints it as one line, exit 2


def test_a_token_corpus_reports_accuracy_per_token_and_no_bits_per_character():
    from hydra.utils import instantiate

    from helpers import compose_cfg

    task = instantiate(compose_cfg("data=tokens", "data.vocab_size=300").task)
    # sums: loss 6.0 over 4 tokens, 1 of 2 sequences right, 3 of the 4 tokens right
    assert task.eval_metrics([6.0, 4.0, 1.0, 2.0, 3.0]) == {"loss": 1.5, "acc": 0.75}
    assert task.metrics == {"loss": "min", "acc": "max"}


def _script():
    """scripts/prepare_text.py as a module (its main(argv) -> exit status), in this process."""
    import importlib.util

    from helpers import ROOT

    spec = importlib.util.spec_from_file_location("prepare_text", ROOT / "scripts" / "prepare_text.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def test_few_documents_give_val_one_each_and_an_empty_split_is_one_the_corpus_has_not(tmp_path, capsys):
    """Issue 32: 3 files at the default --val-fraction 0.1 wrote empty val.bin and test.bin (round(0.3) = 0)
    and data=tokens died in numpy's `cannot mmap an empty file`."""
    sources = write_sources(tmp_path / "src")
    files = sorted(sources.rglob("f0[0-2].*"))
    script = _script()
    documents = {}
    for n in (3, 2):
        assert script.main([*map(str, files[:n]), "--out", str(tmp_path / str(n))]) == 0
        documents[n] = json.loads((tmp_path / str(n) / "meta.json").read_text())["documents"]
    assert documents == {3: {"train": 1, "val": 1, "test": 1}, 2: {"train": 1, "val": 1, "test": 0}}
    assert capsys.readouterr().out.count("test: no document") == 1  # the 2 files' corpus says so
    assert script.main([str(files[0]), "--out", str(tmp_path / "1")]) == 2  # one document: refused in one line
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == (
        "error: 1 document: --val-fraction 0.1 leaves val none (the split is by document and train keeps one): give "
        "more files, or --val-fraction 0 --test-fraction 0 to train without evaluation"
    )
    # Asked for: one document, no val and no test. data=tokens reads the empty files as splits it has not.
    only = tmp_path / "only"
    assert script.main([str(files[0]), "--out", str(only), "--val-fraction", "0", "--test-fraction", "0"]) == 0
    train, val, test = tokens.splits(str(only), block_size=16)
    assert len(val) == 0 and test is None and "val.bin holds no token to predict: no evaluation" in train.summary
    assert train.no_test == f"test.bin of {only} holds no document"
    assert pickle.loads(pickle.dumps(val)).tokens.size == 0  # to a loader worker, as a mapped split goes
    out = run_in_process(tmp_path / "run", *lm(only, "trainer.max_steps=2", "checkpoint.every=0", "data.batch_size=4"))
    said = f"trainer.test: data=tokens has no test split (test.bin of {only} holds no document): no test pass"
    assert out.count("no test split") == 1 and said in out
    assert "done: 2 steps, no validation split" in out
    train, val, test = tokens.splits(str(tmp_path / "2"), block_size=16)  # 2 files: val, no test
    assert len(val) > 0 and test is None


def test_every_training_block_lies_in_the_split_and_every_start_is_drawn():
    """Issue 32: a block drawn one offset too far (its end past the split's last token) went unnoticed."""
    n, b = 40, 8  # 32 starts, 0 .. 31: the last block's last target is the split's last token
    blocks = tokens.RandomBlocks(np.arange(n, dtype=np.uint16), b)
    assert len(blocks) == (n - 1) // b
    starts = set()
    for seed in [*range(3 * n), 2**62 + 5, 2**63 - 1]:  # every residue, and the 63-bit seeds SeededBatches mixes
        x, y = blocks.seeded(0, seed)
        assert x.shape == y.shape == (b,) and torch.equal(y, x + 1), seed  # the next token of each, all in the split
        starts.add(int(x[0]))
    assert starts == set(range(n - b))
    torch.manual_seed(0)
    drawn = [blocks[0] for _ in range(400)]  # outside the train loader: torch's generator
    assert all(x.shape == (b,) and torch.equal(y, x + 1) for x, y in drawn)
    assert {int(x[0]) for x, _ in drawn} == set(range(n - b))


def test_a_uint32_corpus_reads_the_same_tokens_as_uint16(corpora, tmp_path, monkeypatch):
    """Issue 32: every corpus in the suite was uint16; one past 65,536 ids is uint32 on disk."""
    from trainkit.data import corpus

    assert corpus.token_dtype(1 << 16) == np.uint16 and corpus.token_dtype((1 << 16) + 1) == np.uint32
    monkeypatch.setattr(corpus, "token_dtype", lambda size: np.dtype(np.uint32))  # 257 ids written as a wide corpus
    sources = corpora["bytes"].parent / "src"
    prepare([str(sources)], str(tmp_path), "bytes", val_fraction=1 / 6, progress=False)
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["dtype"] == "uint32" and (tmp_path / "val.bin").stat().st_size == 4 * meta["tokens"]["val"]
    wide, narrow = tokens.splits(str(tmp_path), block_size=16), tokens.splits(str(corpora["bytes"]), block_size=16)
    for a, b in zip(wide, narrow, strict=True):
        assert a.tokens.dtype == np.uint32 and np.array_equal(a.tokens, b.tokens)
        assert np.array_equal(pickle.loads(pickle.dumps(a)).tokens, b.tokens)  # re-mapped in a loader worker
    for i in range(len(narrow[1])):
        assert all(torch.equal(p, q) for p, q in zip(wide[1][i], narrow[1][i], strict=True))
    assert all(torch.equal(wide[0].seeded(i, 7 * i)[0], narrow[0].seeded(i, 7 * i)[0]) for i in range(len(narrow[0])))


def test_pydoc_makes_cpythons_documentation_a_corpus_of_its_topics_the_same_from_any_temp_folder(tmp_path, capsys):
    """prepare_text.py --pydoc: pydoc_data.topics (data=pydoc_text's text) a document a topic, each byte-exact between
    its end-of-text tokens; the corpus (its checksum names the topics' files relative to their temp folder) is the
    same on a second run (+experiment=shards_mixture_gpt's docs source)."""
    from trainkit.data.pydoc_text import documents

    script = _script()
    for out in ("a", "b"):
        assert script.main(["--pydoc", "--out", str(tmp_path / out)]) == 0
    meta = json.loads((tmp_path / "a" / "meta.json").read_text())
    assert sum(meta["documents"].values()) == len(documents()) and meta["documents"]["val"] >= 1
    ids = np.concatenate([np.fromfile(tmp_path / "a" / f"{s}.bin", dtype=np.uint16) for s in tokens.SPLITS])
    ends = np.flatnonzero(ids == tokens.BYTES_EOT)  # ids < 256 are the bytes; each document followed by the EOT
    texts = [bytes(ids[a + 1 : b].astype(np.uint8)).decode() for a, b in zip([-1, *ends[:-1]], ends, strict=True)]
    assert ends[-1] == len(ids) - 1 and sorted(texts) == sorted(documents().values())
    assert (tmp_path / "a" / "meta.json").read_text() == (tmp_path / "b" / "meta.json").read_text()
    with pytest.raises(SystemExit):
        script.main(["--out", str(tmp_path / "c")])  # neither files nor --pydoc
    assert "give text files or folders, or --pydoc" in capsys.readouterr().err
