"""Tokenize text files into a corpus for data=tokens (trainkit/data/corpus.py):

    python scripts/prepare_text.py FILES_OR_DIRS --out DIR [--tokenizer bytes|bpe|<HF tokenizer> --vocab-size N]
        [--val-fraction F] [--test-fraction F] [--glob '*.py' ...] [--exclude test ...] [--seed S] [--pydoc]

writes DIR/train.bin, val.bin, test.bin, tokenizer.json and meta.json, and prints the throughput.

The split is by document (a file is one): val takes --val-fraction of them, test --test-fraction,
train the rest, each rounded, and a fraction above 0 takes at least one document while train keeps
one (val before test): 3 files at the default 0.1 give train 1 / val 1 / test 1, 2 files train 1 /
val 1 / no test. One file is refused unless --val-fraction 0 --test-fraction 0. data=tokens reads an
empty split as one the corpus does not have: no val.bin documents, no evaluation; no test.bin
documents, no test pass (each said once at the start).
"""

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from trainkit.data.corpus import prepare  # noqa: E402
from trainkit.errors import ConfigError  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", nargs="*", help="text files, or folders searched recursively")
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--tokenizer",
        default="bytes",
        help="bytes, bpe (trained on the train files), or a Hugging Face tokenizer's folder or Hub id (its files are "
        "saved beside the corpus)",
    )
    parser.add_argument("--vocab-size", type=int, default=4096, help="bpe: the vocabulary's size")
    parser.add_argument("--val-fraction", type=float, default=0.1, help="of the documents (see the split above)")
    parser.add_argument(
        "--test-fraction", type=float, default=None, help="of the documents (default: as val; see the split above)"
    )
    parser.add_argument("--glob", action="append", help="in folders (default: *.py and *.txt)")
    parser.add_argument("--exclude", action="append", default=[], help="skip folders of this name")
    parser.add_argument("--seed", type=int, default=0, help="of the split's permutation")
    parser.add_argument("--pydoc", action="store_true", help="CPython's documentation as documents, one a topic")
    args = parser.parse_args(argv)
    if not args.inputs and not args.pydoc:
        parser.error("give text files or folders, or --pydoc")
    with tempfile.TemporaryDirectory() as folder:
        return prepared(args, args.inputs + (pydoc_files(Path(folder)) if args.pydoc else []))


def pydoc_files(folder: Path) -> list[str]:
    """pydoc_data.topics written into `folder`, a file a topic (<name>.txt): documents as prepare() reads them (the
    corpus's checksum names them relative to the folder, so it is the same whichever temp folder held them)."""
    from trainkit.data.pydoc_text import documents

    paths = []
    for name, text in documents().items():
        (path := folder / f"{name}.txt").write_bytes(text.encode())
        paths.append(str(path))
    return paths


def prepared(args: argparse.Namespace, inputs: list[str]) -> int:
    try:
        meta = prepare(
            inputs,
            args.out,
            args.tokenizer,
            args.vocab_size,
            args.val_fraction,
            args.test_fraction,
            args.seed,
            tuple(args.glob or ("*.py", "*.txt")),
            tuple(args.exclude),
        )
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    documents = meta["documents"]
    print(
        f"{args.out}: {sum(documents.values())} documents ("
        + ", ".join(f"{s} {n}" for s, n in documents.items())
        + f"), {meta['source_bytes'] / 1e6:.1f} MB, {meta['tokenizer']} tokenizer (vocabulary "
        f"{meta['vocab_size']}), tokens "
        + ", ".join(f"{s} {n:,}" for s, n in meta["tokens"].items())
        + f"; {meta['seconds']:.1f} s, {meta['mb_per_s']:.2f} MB/s"
    )
    for split, consequence in (("val", "no evaluation"), ("test", "no test pass")):
        if documents[split] == 0:
            print(f"{split}: no document (--{split}-fraction, or too few files): data=tokens makes {consequence}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
