"""Tokenize text files into a corpus for data=tokens (trainkit/corpus.py):

    python scripts/prepare_text.py FILES_OR_DIRS --out DIR [--tokenizer bytes|bpe --vocab-size N]
        [--val-fraction F] [--test-fraction F] [--glob '*.py' ...] [--exclude test ...] [--seed S]

writes DIR/train.bin, val.bin, test.bin, tokenizer.json and meta.json, and prints the throughput.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from trainkit.corpus import prepare  # noqa: E402
from trainkit.errors import ConfigError  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", nargs="+", help="text files, or folders searched recursively")
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokenizer", choices=("bytes", "bpe"), default="bytes")
    parser.add_argument("--vocab-size", type=int, default=4096, help="bpe: the vocabulary's size")
    parser.add_argument("--val-fraction", type=float, default=0.1, help="of the documents")
    parser.add_argument("--test-fraction", type=float, default=None, help="of the documents (default: as val)")
    parser.add_argument("--glob", action="append", help="in folders (default: *.py and *.txt)")
    parser.add_argument("--exclude", action="append", default=[], help="skip folders of this name")
    parser.add_argument("--seed", type=int, default=0, help="of the split's permutation")
    args = parser.parse_args(argv)
    try:
        meta = prepare(
            args.inputs,
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
    print(
        f"{args.out}: {sum(meta['documents'].values())} documents, {meta['source_bytes'] / 1e6:.1f} MB, "
        f"{meta['tokenizer']} tokenizer (vocabulary {meta['vocab_size']}), tokens "
        + ", ".join(f"{s} {n:,}" for s, n in meta["tokens"].items())
        + f"; {meta['seconds']:.1f} s, {meta['mb_per_s']:.2f} MB/s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
