"""trainkit: the small modules that src/train.py assembles. None of them imports train.py."""
