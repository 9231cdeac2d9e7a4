"""The splits data.splits returns (loaded, unpacked) and the test split's pass (trainer.test), and how it is said.

Every built-in data set returns (train, val, test); a data set of one's own may still return (train,
val), as before the test split existed: it trains as it did, its test split is None, and the run says
once that it makes no test pass (an error would break every fork's two-split function for a key that
is on by default). The test pass (test_pass) is `evaluate(..., prefix="test")` over the test split's EvalBatches:
the validation machinery, so every test sample counts once at any world size.

Named evaluation sets (data.eval_sets, {name: a node whose `_target_` returns what data.splits returns}): each
one's val split is evaluated beside val at every evaluation (val/<name>/*), its test split (where it has one)
in the test pass (test/<name>/*), by the same machinery (halving.EvalSets: every sample once, all-reduced sums);
its train split is not read. They are built once after the run's data, rank 0 first, and are no part of what
the run is (checkpoint.run_identity): a resume may add or drop one.
"""

from collections.abc import Sequence
from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig

from trainkit import debug
from trainkit.dist import Dist
from trainkit.errors import ConfigError
from trainkit.evaluate import evaluate_sets
from trainkit.halving import EvalBatches, EvalSets
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


def unpack(splits: Sequence[Any], name: str, key: str = "data.splits") -> tuple[Any, Any, Any | None]:
    """(train, val, test) of data.splits' value (`key`'s: a named set's); test is None for a (train, val) pair."""
    if not isinstance(splits, (tuple, list)) or len(splits) not in (2, 3):
        raise ConfigError(f"{key} of data={name} must return (train, val) or (train, val, test)")
    train, val, *rest = splits
    return train, val, (rest[0] if rest else None)


def check(data: DictConfig) -> None:
    """data.eval_sets (config.check, before the run dir): each name a plain identifier (its metrics are
    val/<name>/*), each node one with a `_target_`."""
    for name, node in (data.get("eval_sets") or {}).items():
        if not (isinstance(name, str) and name.isidentifier()):
            raise ConfigError(
                f"data.eval_sets.{name}: a named evaluation set's name must be a plain identifier (letters, digits, "
                "_; no /): its metrics are val/<name>/<metric>"
            )
        if not isinstance(node, DictConfig) or "_target_" not in node:
            raise ConfigError(
                f"data.eval_sets.{name} must be a node with a _target_ returning (train, val) or (train, val, test), "
                "as data.splits"
            )


def named(cfg: DictConfig, d: Dist, global_batch: int) -> dict[str, tuple[Any, Any | None]]:
    """data.eval_sets' {name: (val, test)}, built rank 0 first (a set may prepare files) and kept as debug=<mode>
    keeps the run's val and test; rank 0 says their sizes. An empty val split is refused in one line."""
    sets, said = {}, []
    for name, node in cfg.data.eval_sets.items():
        with d.rank0_first():
            splits = instantiate(node)
        _, val, test = unpack(splits, cfg.data.name, f"data.eval_sets.{name}")
        val, test = debug.held_out(cfg.debug, val, test, global_batch)
        if len(val) == 0:
            raise ConfigError(f"data.eval_sets.{name}: its validation split is empty")
        sets[name] = val, test
        said.append(f"{name} ({len(val)} val / {size(test)})")
    d.print0(f"data.eval_sets: {', '.join(said)}")
    return sets


def batches(
    cfg: DictConfig,
    d: Dist,
    val_batches: EvalBatches,
    test_set: Any | None,
    global_batch: int,
    eval_args: tuple[int, bool, bool],
) -> tuple[Any, Any | None]:
    """What the evaluations and the test pass measure: `val_batches`; the test split at the end (trainer.test,
    where the split has samples; auto: from val's fitting batch, see EvalBatches), else None; and beside them
    each named set's val and test (data.eval_sets: then halving.EvalSets of both). eval_args: EvalBatches'."""
    test_batches = None
    if cfg.trainer.test and test_set is not None and len(test_set) > 0:
        test_batches = EvalBatches(test_set, d, lambda: val_batches.batch_size, *eval_args, what="test")
    if not cfg.data.eval_sets:
        return val_batches, test_batches
    vals, tests = {}, {}
    for name, (val, test) in named(cfg, d, global_batch).items():  # each at val's batch; auto: halved on its own
        key = f"data.eval_sets.{name}"
        vals[name] = EvalBatches(val, d, val_batches.limit, *eval_args, what=f"evaluation of {key}")
        if cfg.trainer.test and test is not None and len(test) > 0:  # from its val's fitting batch, as test's
            tests[name] = EvalBatches(test, d, _batch_size_of(vals[name]), *eval_args, what=f"test of {key}")
    return EvalSets(val_batches, vals), (EvalSets(test_batches, tests) if test_batches is not None or tests else None)


def _batch_size_of(batches: EvalBatches):
    return lambda: batches.batch_size


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
    """The test split's metrics (`test/*`; each named set's `test/<name>/*`) on the weights `selected` applies (the
    monitor's best, else the last); {} without a test pass (batches None) or where nothing fit."""
    if batches is None:
        return {}
    with selected.applied(model):
        test = evaluate_sets(model, batches, d, autocast, task, prefix="test")
    batches.check()  # auto: out of memory at a test batch of 1 ends the run
    return test


def line(metrics: dict[str, float], split: str = "test", shown: tuple[str, ...] = ()) -> str:
    """`test loss ... | test acc ...` of evaluate's metrics (`shown`: progress.headline(task); (): all)."""
    return metrics_text(metrics, split, shown)
