"""The splits data.splits returns (loaded, unpacked) and the test split's pass (trainer.test), and how it is said.

Every built-in data set returns (train, val, test); a data set of one's own may still return (train,
val), as before the test split existed: it trains as it did, its test split is None, and the run says
once that it makes no test pass (an error would break every fork's two-split function for a key that
is on by default). The test pass (test_pass) is `evaluate(..., prefix="test")` over the test split's EvalBatches:
the validation machinery, so every test sample counts once at any world size.
"""

from collections.abc import Sequence
from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig

from trainkit.dist import Dist
from trainkit.errors import ConfigError
from trainkit.evaluate import evaluate
from trainkit.progress import metrics_text

SPLITS = ("train", "val", "test")  # the order of what data.splits returns


def load(data: DictConfig, d: Dist) -> tuple[Any, Any, Any | None]:
    """data.splits' (train, val, test), built on rank 0 first (it may download or prepare files); test is None for a
    (train, val) pair. An empty training split is refused in one line."""
    with d.rank0_first():
        splits = instantiate(data.splits)
    train, val, test = unpack(splits, data.name)
    if len(train) == 0:
        raise ConfigError(f"data: the training split of data={data.name} is empty")
    return train, val, test


def unpack(splits: Sequence[Any], name: str) -> tuple[Any, Any, Any | None]:
    """(train, val, test) of data.splits' value; test is None for a (train, val) pair."""
    if not isinstance(splits, (tuple, list)) or len(splits) not in (2, 3):
        raise ConfigError(f"data.splits of data={name} must return (train, val) or (train, val, test)")
    train, val, *rest = splits
    return train, val, (rest[0] if rest else None)


def missing(test_set: Any | None, train_set: Any = None) -> str | None:
    """Why there is no test split, where the test split is None or empty, else None: the data set's own
    word where its train split has a `no_test` (an image folder without test/, a corpus whose test.bin
    holds no document), else what data.splits returned."""
    if test_set is not None and len(test_set) > 0:
        return None
    if why := getattr(train_set, "no_test", None):
        return why
    return "its data.splits returns train, val" if test_set is None else "its test split is empty"


def skipped(test_set: Any | None, name: str, train_set: Any = None) -> str | None:
    """Why a run with trainer.test=true makes no test pass (said once at its start), or None when it makes one."""
    why = missing(test_set, train_set)
    return None if why is None else f"trainer.test: data={name} has no test split ({why}): no test pass"


def size(test_set: Any | None) -> str:
    """The start-up line's `T test`."""
    return "no test" if test_set is None else f"{len(test_set)} test"


def test_pass(model: Any, selected: Any, batches: Any, d: Dist, autocast: Any, task: Any) -> dict[str, float]:
    """The test split's metrics (`test/*`) on the weights `selected` applies (the monitor's best, else the last);
    {} without a test pass (batches None) or where nothing fit."""
    if batches is None:
        return {}
    with selected.applied(model):
        test = evaluate(model, batches, d, autocast, task, prefix="test")
    batches.check()  # auto: out of memory at a test batch of 1 ends the run
    return test


def line(metrics: dict[str, float], split: str = "test", shown: tuple[str, ...] = ()) -> str:
    """`test loss ... | test acc ...` of evaluate's metrics (`shown`: progress.headline(task); (): all)."""
    return metrics_text(metrics, split, shown)
