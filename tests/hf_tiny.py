"""Tiny Hugging Face things for tests, made locally in a few milliseconds (no network): a byte-level BPE tokenizer,
a tiny Llama, labelled text sets in every file format data=hf reads, a tiny image set, and the environment of an
offline machine.

    from hf_tiny import hf_offline, tiny_llama, tiny_tokenizer, text_classification_files
"""

import json
from pathlib import Path

from trainkit.data.hf import quiet

CLASSES = ("loops", "functions", "errors")  # the text set's labels, by the pydoc topic each row's words come from
TOPICS = {"loops": ("for", "while"), "functions": ("function", "lambda"), "errors": ("try", "raise")}
ROWS = 60  # text rows: 20 a class, in class order round robin


def corpus(characters: int = 6000) -> str:
    """A few KB of CPython's own documentation (pydoc_data.topics, no download): the tokenizer's training text."""
    from pydoc_data.topics import topics

    return "".join(topics[name] for name in ("for", "while", "function", "try", "raise", "lambda"))[:characters]


LLAMA = dict(  # 2 layers of width 32: tests/test_hf.py's and test_hf_export.py's model
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=True,  # stored once by save_pretrained: the tie must survive the meta device and the export
)


def tiny_llama(folder: Path, vocab_size: int, seed: int = 123) -> Path:
    """A tiny Llama (LLAMA) of `vocab_size` ids, its weights drawn from `seed`, saved with save_pretrained (config.json,
    model.safetensors) in `folder`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", vocab_size=vocab_size, **LLAMA)).save_pretrained(
        folder
    )
    return Path(folder)


def tiny_tokenizer(folder: Path, vocab_size: int = 300) -> Path:
    """A byte-level BPE of `vocab_size` ids trained on corpus(), saved as a transformers tokenizer (bos "<s>", eos
    "</s>", pad "<pad>"; BOS added by its call, as Llama's) in `folder` (made once: an existing one is reused)."""
    from trainkit.data import tokenizer

    folder = Path(folder)
    if not (folder / "tokenizer.json").is_file():
        tokenizer.train([corpus()], vocab_size, folder)
    return folder


def text_rows() -> list[dict]:
    """ROWS labelled rows: words of a class's pydoc topics (deterministic), label its name."""
    from pydoc_data.topics import topics

    rows = []
    for i in range(ROWS):
        label = CLASSES[i % len(CLASSES)]
        words = " ".join(topics[t] for t in TOPICS[label]).split()
        start = (i * 7) % (len(words) - 30)
        rows.append({"text": " ".join(words[start : start + 5 + i % 20]), "label": label})
    return rows


def text_classification_files(folder: Path) -> dict[str, Path]:
    """The text rows in every form data=hf reads: {"jsonl", "json", "csv", "parquet", "arrow": a file, "disk": a
    save_to_disk folder (label a ClassLabel), "folder": a folder of train.parquet and validation.parquet}."""
    import datasets
    import pyarrow as pa

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rows = text_rows()
    made = {name: folder / f"text.{name}" for name in ("jsonl", "json", "csv", "parquet", "arrow")}
    made |= {"disk": folder / "text_disk", "folder": folder / "text_folder"}
    if all(path.exists() for path in made.values()):
        return made
    made["jsonl"].write_text("".join(json.dumps(row) + "\n" for row in rows))
    made["json"].write_text(json.dumps(rows))
    table = pa.Table.from_pylist(rows)
    with pa.OSFile(str(made["arrow"]), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)  # an Arrow stream file, as datasets' own cache files are
    plain = datasets.Dataset.from_list(rows)
    with quiet():
        plain.to_csv(str(made["csv"]), index=False)
        plain.to_parquet(str(made["parquet"]))
        labelled = plain.cast_column("label", datasets.ClassLabel(names=list(CLASSES)))
        labelled.save_to_disk(str(made["disk"]))
        made["folder"].mkdir(exist_ok=True)
        plain.select(range(48)).to_parquet(str(made["folder"] / "train.parquet"))
        plain.select(range(48, ROWS)).to_parquet(str(made["folder"] / "validation.parquet"))
    return made


def image_classification_disk(folder: Path, count: int = 24, size: int = 8) -> Path:
    """A save_to_disk folder of `count` RGB images of size x size (an Image column "image", a ClassLabel "label" of 2
    classes: dark and bright), deterministic."""
    import datasets
    import numpy as np
    from PIL import Image

    folder = Path(folder)
    if (folder / "dataset_info.json").is_file():
        return folder
    rng = np.random.RandomState(0)
    images, labels = [], []
    for i in range(count):
        label = i % 2
        pixels = rng.randint(0, 128, (size, size, 3)) + 127 * label
        images.append(Image.fromarray(pixels.astype(np.uint8), "RGB"))
        labels.append(label)
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["dark", "bright"])})
    with quiet():
        datasets.Dataset.from_dict({"image": images, "label": labels}, features=features).save_to_disk(str(folder))
    return folder


def hf_offline(monkeypatch, home: Path) -> None:
    """This process as on a machine without network: HF_HUB_OFFLINE=1, HF_DATASETS_OFFLINE=1, HF_HOME and
    HF_DATASETS_CACHE under `home`. huggingface_hub and datasets read these variables once, at their import: their
    module constants are set too (a test's process imported them already)."""
    import datasets
    import huggingface_hub.constants

    home = Path(home)
    for name, value in {
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HOME": str(home),
        "HF_DATASETS_CACHE": str(home / "datasets"),
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", home / "datasets")
