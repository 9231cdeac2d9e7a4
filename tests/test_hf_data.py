"""data=hf, data.tokenizer on data=pydoc_text and prepare_text.py --tokenizer: Hugging Face data and tokenizers, made
locally (tests/hf_tiny.py), offline."""

import json
import math

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from helpers import cli_in_process, run_in_process
from hf_tiny import (
    CLASSES,
    hf_offline,
    image_classification_disk,
    text_classification_files,
    text_rows,
    tiny_tokenizer,
)
from trainkit.batch import collate
from trainkit.data import hf, pydoc_text, tokenizer
from trainkit.data.addition import IGNORE
from trainkit.errors import ConfigError


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """One tokenizer, the text set in every format, an image set; HF offline, its caches in this module's dir."""
    tmp = tmp_path_factory.mktemp("hf")
    with pytest.MonkeyPatch.context() as monkeypatch:
        hf_offline(monkeypatch, tmp / "home")
        yield {
            "tmp": tmp,
            "tok": tiny_tokenizer(tmp / "tok"),
            "files": text_classification_files(tmp / "files"),
            "images": image_classification_disk(tmp / "images"),
        }


def text(made, **keys):
    return hf.splits(**{"path": str(made["files"]["jsonl"]), "tokenizer": str(made["tok"]), "max_length": 16} | keys)


def test_every_file_format_loads_the_same_samples(made):
    """jsonl, json, csv, parquet, arrow and a save_to_disk folder give the same samples (its ClassLabel's ids name the
    same classes); a folder of data files gives its named validation split."""
    reference = text(made)
    names = reference[0].classes
    expected = [(x["input_ids"].tolist(), names[int(y)]) for x, y in reference[0]]
    for form in ("json", "csv", "parquet", "arrow", "disk"):
        train, val, test = text(made, path=str(made["files"][form]))
        assert (len(train), len(val), len(test)) == (48, 6, 6), form
        got = [(x["input_ids"].tolist(), train.classes[int(y)]) for x, y in train]
        assert got == expected, form
    assert text(made, path=str(made["files"]["disk"]))[0].classes == list(CLASSES)  # the ClassLabel's order
    assert names == sorted(CLASSES)  # plain strings: sorted
    train, val, test = text(made, path=str(made["files"]["folder"]), split_names={"val": "validation"})
    assert (len(train), len(val), len(test)) == (43, 12, 5)  # val named; test still held out of train (0.1 of 48)


def test_held_out_rows_are_a_fixed_partition_of_train_in_file_order(made):
    train, val, test = text(made, val_fraction=0.2, test_fraction=0.1)
    rows = [hf.TextRows.__len__(s) for s in (train, val, test)]
    assert rows == [42, 12, 6]
    order = np.random.RandomState(0).permutation(60)
    everything = text(made, val_fraction=0, test_fraction=0)[0]
    assert [x["input_ids"].tolist() for x, _ in val] == [
        everything[i][0]["input_ids"].tolist() for i in sorted(order[:12])
    ]
    train0, val0, test0 = text(made, val_fraction=0, test_fraction=0)
    assert (len(train0), len(val0), test0) == (60, 0, None) and "test_fraction=0" in train0.no_test


def test_text_samples_pad_on_the_right_to_max_length_with_the_attention_mask(made):
    """Each row: the tokenizer's encoding with its special tokens (BOS first), truncated to max_length, padded on the
    right with the pad id to exactly max_length; the mask 1 on the tokens, 0 on the padding; the label its id."""
    hf_tok = tokenizer.load(str(made["tok"]))
    train, _, _ = text(made, val_fraction=0, test_fraction=0, max_length=24)
    rows = text_rows()
    lengths = {i: len(hf_tok(rows[i]["text"])["input_ids"]) for i in (0, 1, 18, 59)}
    assert min(lengths.values()) < 24 < max(lengths.values())  # padded rows and truncated ones
    for i in lengths:
        x, y = train[i]
        ids = hf_tok(rows[i]["text"])["input_ids"][:24]
        assert ids[0] == hf_tok.bos_token_id == 1
        assert x["input_ids"].dtype == torch.long and x["input_ids"].shape == (24,)
        assert x["input_ids"].tolist() == ids + [hf_tok.pad_token_id] * (24 - len(ids))
        assert x["attention_mask"].tolist() == [1] * len(ids) + [0] * (24 - len(ids))
        assert y.dtype == torch.long and y.shape == () and train.classes[int(y)] == rows[i]["label"]
    assert train.draws_random is False


def test_samples_are_map_style_and_the_tokenized_form_is_read_from_the_cache(made, monkeypatch):
    """__getitem__ by any index, the same each time; a second load reads the cache datasets.map wrote (nothing is
    tokenized again: the encoding functions fail if called); a batch through __getitems__ is the samples'."""
    train, _, _ = text(made, max_length=20)
    first = [train[i] for i in (7, 0, 7)]
    assert torch.equal(first[0][0]["input_ids"], first[2][0]["input_ids"])
    cached = sorted(p.name for p in made["tmp"].joinpath("home").rglob("cache-*.arrow"))
    for name in ("_encode_text", "_encode_lm"):
        monkeypatch.setattr(hf, name, lambda *a, **k: (_ for _ in ()).throw(AssertionError("tokenized again")))
    again, _, _ = text(made, max_length=20)
    assert torch.equal(again[7][0]["input_ids"], first[0][0]["input_ids"])
    assert sorted(p.name for p in made["tmp"].joinpath("home").rglob("cache-*.arrow")) == cached
    batch = again.__getitems__([3, 1])
    assert torch.equal(batch[0][0]["input_ids"], again[3][0]["input_ids"]) and torch.equal(batch[1][1], again[1][1])


def test_the_text_splits_tensor_form_builds_the_loaders_micro_batches(made):
    train, _, _ = text(made)
    assert train.device_bytes() == sum(t.nbytes for t in train.device_tensors())  # what on_device=auto weighs
    order = torch.tensor([5, 2, 9, 0, 11])
    built = list(train.device_batches(train.device_tensors(), order, 2, 0, 0))
    loaded = [collate(train.__getitems__(chunk.tolist())) for chunk in order.split(2)]
    assert len(built) == len(loaded) == 3
    for (bx, by), (lx, ly) in zip(built, loaded, strict=True):
        assert torch.equal(bx["input_ids"], lx["input_ids"]) and torch.equal(bx["attention_mask"], lx["attention_mask"])
        assert torch.equal(by, ly)


def test_packing_cuts_the_documents_stream_into_the_hand_computed_blocks(made, tmp_path):
    """Two documents, BOS ids EOS each, concatenated; blocks of 4 inputs and the 4 tokens after each; the last block
    padded with the pad id, its targets IGNORE; every token but the first a target exactly once."""
    path = tmp_path / "docs.jsonl"
    path.write_text(json.dumps({"text": "for x in y"}) + "\n" + json.dumps({"text": "while"}) + "\n")
    hf_tok = tokenizer.load(str(made["tok"]))
    a, b = (hf_tok(t, add_special_tokens=False)["input_ids"] for t in ("for x in y", "while"))
    stream = [1, *a, 2, 1, *b, 2]  # <s> = 1, </s> = 2
    train, val, test = hf.splits(
        path=str(path), tokenizer=str(made["tok"]), pack=True, block_size=4, val_fraction=0, test_fraction=0
    )
    assert len(train) == math.ceil((len(stream) - 1) / 4) and len(val) == 0 and test is None
    for i in range(len(train)):
        x, y = train[i]
        inputs, targets = stream[4 * i : 4 * i + 4], stream[4 * i + 1 : 4 * i + 5]
        assert x.tolist() == inputs + [0] * (4 - len(inputs))  # <pad> = 0
        assert y.tolist() == targets + [IGNORE] * (4 - len(targets))
    assert train.draws_random is False and train.tokens.tolist() == stream


def test_documents_get_bos_and_eos_as_the_tokenizer_has_them(made, tmp_path):
    hf_tok = tokenizer.load(str(made["tok"]))
    ids = hf_tok("for", add_special_tokens=False)["input_ids"]
    assert tokenizer.documents(hf_tok, ["for"]) == [[1, *ids, 2]]
    gpt2_style = tokenizer.load(str(_saved(made, tmp_path / "same", bos_token="</s>")))  # BOS is EOS: once, at the end
    assert tokenizer.documents(gpt2_style, ["for"]) == [[*ids, 2]]
    bare = tokenizer.load(str(_saved(made, tmp_path / "bare", bos_token=None, eos_token=None, pad_token=None)))
    assert tokenizer.documents(bare, ["for"]) == [ids] and tokenizer.pad_id(bare) == 0
    with pytest.raises(ConfigError, match="neither a pad nor an EOS token"):
        text(made, tokenizer=str(tmp_path / "bare"))


def _saved(made, folder, **special):
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(str(made["tok"]), **special).save_pretrained(folder)
    return folder


def test_vocab_size_is_len_of_the_tokenizer_added_tokens_included(made, tmp_path):
    from transformers import AutoTokenizer

    grown = AutoTokenizer.from_pretrained(str(made["tok"]))
    grown.add_tokens(["<extra_0>", "<extra_1>"])
    grown.save_pretrained(tmp_path / "grown")
    assert hf.vocab_size(str(made["tok"])) == 300 and hf.vocab_size(str(tmp_path / "grown")) == 302 == len(grown)
    assert hf.vocab_size(None) is None
    assert pydoc_text.vocab_size(str(tmp_path / "grown")) == 302 and pydoc_text.vocab_size() == 104


def test_image_samples_are_normalised_rgb_tensors_of_the_configured_size(made):
    from datasets import load_from_disk

    raw = load_from_disk(str(made["images"]))
    train, val, test = hf.splits(path=str(made["images"]), image_column="image", val_fraction=0.25, test_fraction=0)
    assert (len(train), len(val), test) == (18, 6, None)
    x, y = train[0]
    first = np.sort(np.random.RandomState(0).permutation(24)[6:])[0]  # train's first row
    pixels = torch.tensor(np.asarray(raw[int(first)]["image"]), dtype=torch.float32).permute(2, 0, 1)
    assert x.dtype == torch.float32 and torch.allclose(x, (pixels / 255 - 0.5) / 0.5)
    assert int(y) == raw[int(first)]["label"]
    small = hf.splits(path=str(made["images"]), image_column="image", image_size=4)[0]
    assert small[0][0].shape == (3, 4, 4)
    node = OmegaConf.create({"splits": {"path": str(made["images"]), "image_column": "image", "image_size": 4}})
    assert hf.shape(_parent_=node) == [3, 4, 4] and hf.num_classes(_parent_=node) == 2


def test_a_column_or_split_that_is_not_there_is_one_line_listing_what_is(made):
    with pytest.raises(ConfigError) as error:
        text(made, text_column="sentence")
    assert str(error.value).endswith(
        "data.text_column=sentence is not a column of "
        + str(made["files"]["jsonl"])
        + " (train): its columns are text, label"
    )
    with pytest.raises(ConfigError, match="data.split_names.val=dev is not a split of .*: its splits are train$"):
        text(made, split_names={"val": "dev"})


def test_a_named_split_with_hidden_labels_is_refused_in_one_line(made, tmp_path):
    """A Hub test split's labels are often hidden (GLUE's -1): training would read -1 as a class."""
    import datasets

    labelled = datasets.load_from_disk(str(made["files"]["disk"]))
    hidden = labelled.map(lambda row: {"label": -1})
    datasets.DatasetDict({"train": labelled, "test": hidden}).save_to_disk(str(tmp_path / "glue_like"))
    with pytest.raises(ConfigError, match=r"the test split has rows without a label \(-1\)"):
        text(made, path=str(tmp_path / "glue_like"), split_names={"test": "test"})


def test_data_pack_goes_with_task_lm_and_only_with_it(made):
    def check(pack, task):
        keys = {"path": str(made["files"]["jsonl"]), "tokenizer": str(made["tok"]), "pack": pack}
        hf.check(OmegaConf.create({"data": {"splits": keys}, "task": {"_target_": task}}))

    check(True, hf.LM)
    check(False, "trainkit.tasks.classification.Classification")
    with pytest.raises(ConfigError, match="task=lm reads blocks of tokens: set data.pack=true"):
        check(False, hf.LM)
    with pytest.raises(ConfigError, match="data.pack=true makes task=lm's blocks"):
        check(True, "trainkit.tasks.classification.Classification")


def test_a_hub_name_or_tokenizer_id_not_in_the_offline_cache_is_one_line_exit_2_and_no_run_dir(made, tmp_path, capfd):
    jsonl, tok = str(made["files"]["jsonl"]), str(made["tok"])
    for overrides, named in (
        (["data.path=someorg/someset", f"data.tokenizer={tok}"], "data.path=someorg/someset"),
        ([f"data.path={jsonl}", "data.tokenizer=someorg/sometok"], "data.tokenizer=someorg/sometok"),
    ):
        proc = cli_in_process(capfd, tmp_path / "run", "data=hf", *overrides)
        assert proc.returncode == 2, proc.stderr
        line = proc.stderr.strip()
        assert len(line.splitlines()) == 1 and named in line and "offline" in line
        assert str(made["tmp"] / "home") in line  # the cache it looked in
        assert not (tmp_path / "run").exists()


def test_pydoc_text_with_a_tokenizer_has_its_tokens_and_vocabulary(made):
    hf_tok = tokenizer.load(str(made["tok"]))
    train, val, test = pydoc_text.splits(16, False, tokenizer=str(made["tok"]))
    x, y = val[0]
    assert x[0] == hf_tok.bos_token_id and x[1:].tolist() == y[:-1].tolist()  # a document starts with BOS
    name = train.names[0]
    ids = [1, *hf_tok(pydoc_text.documents()[name], add_special_tokens=False)["input_ids"], 2]
    blocks = math.ceil((len(ids) - 1) / 16)
    assert torch.cat([train[i][0] for i in range(blocks)])[: len(ids) - 1].tolist() == ids[:-1]
    assert (
        torch.cat([train[i][1] for i in range(blocks)])[: len(ids) - 1].tolist() == ids[1:]
    )  # ... EOS its last target
    assert set(train.files) == {"tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json"}
    assert train.identity["data.tokenizer"]["sha256"] == tokenizer.sha256(hf_tok)
    hf_tok(["for x in y"], truncation=True, max_length=2)  # a call that truncates leaves its setting on the backend
    assert tokenizer.sha256(hf_tok) == train.identity["data.tokenizer"]["sha256"]  # not the tokenizer's identity
    cfg = OmegaConf.create(
        {
            "data": {
                "tokenizer": str(made["tok"]),
                "per_character": "${pydoc_per_character:${.tokenizer}}",
                "per_token": "${pydoc_per_token:${.tokenizer}}",
            }
        }
    )
    assert (cfg.data.per_character, cfg.data.per_token) == (False, True)  # no bits per character for tokens


def test_pydoc_text_trains_its_tokenizer_once_into_the_folder_and_reuses_it(made, monkeypatch):
    folder = made["tmp"] / "pydoc_bpe300"
    assert pydoc_text.vocab_size(str(folder), 300) == 300  # before it exists: the size asked for
    train, _, _ = pydoc_text.splits(32, True, tokenizer=str(folder), train_tokenizer=300)
    trained = tokenizer.load(str(folder))
    assert len(trained) == 300 and (trained.bos_token, trained.eos_token, trained.pad_token) == ("<s>", "</s>", "<pad>")
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".pydoc_bpe300")]  # no staging folder left
    monkeypatch.setattr(tokenizer, "train", lambda *a, **k: pytest.fail("trained again"))
    again, _, _ = pydoc_text.splits(32, True, tokenizer=str(folder), train_tokenizer=300)
    assert again.identity == train.identity
    cfg = OmegaConf.create({"data": {"tokenizer": str(folder), "train_tokenizer": 512, "per_character": False}})
    with pytest.raises(ConfigError, match="holds a tokenizer of 300 ids, data.train_tokenizer=512: remove the folder"):
        pydoc_text.check(cfg)


def test_prepare_text_takes_a_hugging_face_tokenizer(made, tmp_path):
    """--tokenizer DIR: each file BOS ids EOS in train.bin, meta.json's vocab_size len(tokenizer), the tokenizer's
    files beside; data=tokens reads the corpus back and writes the tokenizer into a run dir."""
    from trainkit.data import corpus, tokens

    docs = tmp_path / "docs"
    docs.mkdir()
    bodies = ("for x in y:\n    pass\n", "while True:\n    break\n")
    for i, body in enumerate(bodies):
        (docs / f"{i}.txt").write_text(body)
    meta = corpus.prepare([str(docs)], str(tmp_path / "corpus"), str(made["tok"]), 0, 0.0, 0.0, progress=False)
    hf_tok = tokenizer.load(str(made["tok"]))
    assert meta["vocab_size"] == len(hf_tok) == 300 and meta["tokenizer"] == "hf" and meta["eot"] == 2
    assert (tmp_path / "corpus" / "tokenizer_config.json").is_file()
    written = np.fromfile(tmp_path / "corpus" / "train.bin", dtype=np.uint16).tolist()
    assert written == [t for body in bodies for t in (1, *hf_tok(body, add_special_tokens=False)["input_ids"], 2)]
    train, _, _ = tokens.splits(str(tmp_path / "corpus"), block_size=4, random_offsets=False)
    assert "tokenizer/tokenizer_config.json" in train.files
    codec = tokens.Codec.load(tmp_path / "corpus")
    assert codec.encode("for")[0] == 1 and codec.decode(codec.encode("for x")) == "for x"


TINY_GPT = ("model=gpt", "model.n_layer=1", "model.n_head=2", "model.n_embd=16", "optim=sgd", "trainer.log_every=1")


def test_train_py_trains_on_packed_hf_blocks_and_on_pydoc_text_through_a_tokenizer_it_trains(made, tmp_path, capfd):
    """train.py end to end, in this process: data=hf packed for task=lm (2 DDP ranks: the losses of one process), and
    data=pydoc_text with data.tokenizer and data.train_tokenizer (the keys +experiment=hf_lm_pydoc sets) on 2 ranks:
    the folder made by rank 0 at the run's start while rank 1 waits, data.vocab_size its size; each run dir holds the
    tokenizer's files; predict.py samples text through them."""
    jsonl, tok = str(made["files"]["jsonl"]), str(made["tok"])
    packed = (
        "data=hf",
        f"data.path={jsonl}",
        f"data.tokenizer={tok}",
        "data.pack=true",
        "task=lm",
        "data.block_size=16",
    )
    hf_run = tmp_path / "hf"
    proc = cli_in_process(capfd, hf_run, *packed, "trainer.max_steps=3", "data.batch_size=4", *TINY_GPT)
    assert proc.returncode == 0, proc.stderr
    assert "blocks of 16 tokens" in proc.stdout and "data=hf (198 train / 25 val / 22 test)" in proc.stdout
    assert (hf_run / "tokenizer" / "tokenizer.json").read_text() == (made["tok"] / "tokenizer.json").read_text()
    run_in_process(tmp_path / "hf2", *packed, "trainer.max_steps=3", "data.batch_size=2", *TINY_GPT, nproc=2)
    one, two = (_losses(run) for run in (hf_run, tmp_path / "hf2"))
    assert len(one) == 3 and one == pytest.approx(two, rel=1e-5)  # SGD: reduction order alone
    folder, pydoc_run = tmp_path / "pydoc_bpe300", tmp_path / "pydoc"
    out = run_in_process(
        pydoc_run, "data=pydoc_text", f"data.tokenizer={folder}", "data.train_tokenizer=300", "data.block_size=64",
        "trainer.max_steps=2", "data.batch_size=2", *TINY_GPT, nproc=2,
    )  # fmt: skip
    assert len(tokenizer.load(str(folder))) == 300 and "(300 ids, sha256" in out
    assert sorted(p.name for p in tmp_path.iterdir() if "pydoc_bpe300" in p.name) == ["pydoc_bpe300"]  # one, whole
    config = OmegaConf.load(pydoc_run / ".hydra" / "config.yaml")
    assert OmegaConf.select(config, "model.vocab_size") == 300
    assert config.task.per_token and not config.task.per_character
    assert (pydoc_run / "tokenizer" / "tokenizer.json").is_file() and not (pydoc_run / "vocab.json").exists()
    assert "val/bpc" not in (pydoc_run / "metrics.jsonl").read_text()
    run_in_process(tmp_path / "out", f"run_dir={pydoc_run}", "prompt=for", "max_new_tokens=4", script="predict")
    sampled = (tmp_path / "out" / "samples.txt").read_text()
    assert sampled.startswith("for") and sampled.endswith("\n---------------\n")


def _losses(run_dir) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row["loss"] for row in rows if "loss" in row]
