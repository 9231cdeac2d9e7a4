"""data=diabetes: scikit-learn's bundled diabetes data, a regression data set without a download (task=regression)."""

import numpy as np
import torch
from torch.utils.data import Dataset

from trainkit.loading import InMemory, held_out


def diabetes(val_fraction: float = 0.2, test_fraction: float = 0.2) -> tuple[Dataset, Dataset, Dataset]:
    """scikit-learn's bundled diabetes data (442 patients, 10 features, a disease-progression score one
    year later): (train, val, test) by one fixed permutation as digits', for task=regression. Features and
    target are standardised with the training split's mean and standard deviation (so val/rmse is in
    standard deviations of the score: 1.0 is the mean's, and val/r2 is unchanged by the scaling)."""
    from sklearn.datasets import load_diabetes

    features, target = load_diabetes(return_X_y=True)
    n_val, n_test = held_out(len(target), val_fraction, test_fraction)
    order = np.random.RandomState(0).permutation(len(target))
    x, y = torch.tensor(features[order]), torch.tensor(target[order])
    held = n_val + n_test
    x = (x - x[held:].mean(0)) / x[held:].std(0)
    y = (y - y[held:].mean()) / y[held:].std()
    x, y = x.float(), y.float()
    return InMemory(x[held:], y[held:]), InMemory(x[:n_val], y[:n_val]), InMemory(x[n_val:held], y[n_val:held])
