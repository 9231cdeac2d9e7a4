"""Write scikit-learn's bundled digits (real data, no download) as an image folder for data=image_folder:

    python scripts/digits_folder.py OUT

OUT/{train,val,test}/<digit>/<index>.png: 8x8 grayscale PNGs (the 0..16 intensities scaled to 0..255), data=digits'
own fixed split (train 1079, val 359, test 359 images; <index> is the image's position in its split). The same bytes
on every run. An image folder to try data=image_folder and scripts/make_shards.py on
(conf/experiment/shards_digits_cnn.yaml).
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))


def write(out: Path) -> dict[str, int]:
    """The folder written into `out`; {split: images}."""
    from PIL import Image

    from trainkit.data.digits import digits

    written = {}
    for split, data in zip(("train", "val", "test"), digits(), strict=True):
        for index in range(len(data)):
            x, y = data[index]
            pixels = (x[0] * 255).round().byte().numpy()  # [8, 8]: digits() scales 0..16 to [0, 1]
            (folder := out / split / str(int(y))).mkdir(parents=True, exist_ok=True)
            Image.fromarray(pixels, mode="L").save(folder / f"{index:04d}.png")
        written[split] = len(data)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="the image folder to write (data.root)")
    args = parser.parse_args(argv)
    if (out := Path(args.out)).exists() and any(out.iterdir()):
        print(f"error: {out} exists and holds files: give another dir", file=sys.stderr)
        return 2
    written = write(out)
    print(f"{out}: " + ", ".join(f"{split} {n}" for split, n in written.items()) + " 8x8 PNGs in 10 class folders")
    return 0


if __name__ == "__main__":
    sys.exit(main())
