"""data=digits (the default): scikit-learn's bundled 8x8 digits, real data without a download."""

import importlib.util
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from trainkit.loading import InMemory, held_out


def digits(val_fraction: float = 0.2, test_fraction: float = 0.2) -> tuple[Dataset, Dataset, Dataset]:
    """scikit-learn's bundled 8x8 digits, scaled to [0, 1]: (train, val, test), a fixed split whatever
    the seed. One fixed permutation: val is its first `val_fraction` (the same images as before the
    test split existed), test the next `test_fraction`, train the rest; never overlapping."""
    images, targets = _bundled_digits()
    n_val, n_test = held_out(len(targets), val_fraction, test_fraction)
    order = np.random.RandomState(0).permutation(len(targets))
    x = torch.tensor(images[order] / 16.0, dtype=torch.float32).view(-1, 1, 8, 8)
    y = torch.tensor(targets[order], dtype=torch.long)
    held = n_val + n_test
    return InMemory(x[held:], y[held:]), InMemory(x[:n_val], y[:n_val]), InMemory(x[n_val:held], y[n_val:held])


def _bundled_digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits.csv.gz read as its load_digits reads it, without importing scikit-learn: that import
    cost 0.8 s of CPU at every start of the default job (scripts/bench_startup.py). load_digits itself where
    the file is not where scikit-learn keeps it."""
    spec = importlib.util.find_spec("sklearn")
    folders = spec.submodule_search_locations if spec is not None else None
    path = Path(folders[0]) / "datasets" / "data" / "digits.csv.gz" if folders else None
    if path is None or not path.is_file():
        from sklearn.datasets import load_digits

        return load_digits(return_X_y=True)
    table = np.loadtxt(path, delimiter=",")
    return table[:, :-1], table[:, -1].astype(int)
