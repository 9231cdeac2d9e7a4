"""Which evaluation was best (checkpoint.monitor, checkpoint.mode) and whether to stop early
(trainer.early_stopping): decided from the evaluation's metrics alone.

Those metrics are all-reduced sums (evaluate.py): the same floats on every rank, at any world size,
so every rank takes the same decisions with no communication of its own — no rank stops or saves
"best" alone (Lightning's EarlyStopping stops when any rank says so, its ModelCheckpoint decides on
each rank's local metric: PL #20141, #4319). The state is a checkpoint entry, so a resume takes
the decisions the uninterrupted run takes (PL #1463, #1464: patience and best lost on resume)."""

import math
from collections.abc import Iterable

from trainkit.errors import ConfigError, RunError


def monitored(
    monitor: str | None, mode: str, task, averaged: bool = False, sets: Iterable[str] = ()
) -> tuple[str | None, str]:
    """(key, "max" | "min") from checkpoint.monitor / checkpoint.mode: auto is the task's own key
    (`task.monitor`, e.g. "val/acc"), and mode auto the direction the task declares for that metric
    (`task.metrics`, e.g. {"acc": "max"}). A key that is none of the task's metrics is refused before
    training, and so is mode auto for a metric whose direction the task does not declare (a guess from the
    name kept the worst val/rmse); `averaged` (trainer.ema.decay): the live weights' val_raw/* are keys too;
    `sets` (data.eval_sets' names): each named set's val/<name>/* (val_raw/<name>/*), the direction its metric's.
    A task that declares no metrics has val/loss, minimised."""
    declared = getattr(task, "metrics", None) or {"loss": "min"}
    for name, way in declared.items():
        if way not in ("max", "min"):
            raise ConfigError(f"task {type(task).__name__}: metric {name} is {way!r}: its direction must be max or min")
    sets = list(sets)
    if clash := next((s for s in sets for name in declared if f"{s}/{name}" in declared), None):
        # e.g. a set named loss beside distil's loss/ce: val/loss/ce would be two metrics
        raise ConfigError(
            f"data.eval_sets.{clash}: its val/{clash}/<metric> keys are the task's own metrics: rename it"
        )
    if monitor == "auto":
        monitor = getattr(task, "monitor", "val/loss")
    if monitor is None:
        return None, mode
    parts = ["", *(f"/{name}" for name in sets)]  # val/*, then each named set's val/<name>/*
    splits = [f"{split}{part}" for split in ("val", "val_raw")[: 1 + averaged] for part in parts]
    directions = {f"{split}/{name}": way for split in splits for name, way in declared.items()}
    keys = list(directions)
    if monitor not in keys and getattr(task, "metrics", None) is not None:
        split, _, rest = monitor.partition("/")
        name, _, metric = rest.partition("/")
        if split in ("val", "val_raw") and metric in declared and name not in sets:
            raise ConfigError(
                f"checkpoint.monitor={monitor}: data.eval_sets has no set {name} "
                f"(its sets: {', '.join(sets) or 'none'})"
            )
        raise ConfigError(f"checkpoint.monitor={monitor} is not a metric of this run's evaluation ({', '.join(keys)})")
    if mode == "auto":
        if monitor not in keys:
            raise ConfigError(
                f"checkpoint.mode=auto: task {type(task).__name__} declares no direction for checkpoint.monitor="
                f"{monitor}; set checkpoint.mode=max or min (or declare it in the task's metrics)"
            )
        mode = directions[monitor]
    if mode not in ("max", "min"):
        raise ConfigError(f"checkpoint.mode={mode} is not one of: auto, max, min")
    return monitor, mode


class Selection:
    """The best value of `monitor` so far and its step, and the early-stopping counter: evaluations
    since the monitored value last improved by more than `min_delta` on the value it last improved
    to (so that many small steps still count, as Lightning's EarlyStopping measures them).

    A NaN is never best and never an improvement; a tie keeps the earlier step."""

    def __init__(
        self, monitor: str | None, mode: str, patience: int | None, min_delta: float, evaluated: bool = True, d=None
    ):
        """evaluated: whether the run has a validation split (without one, nothing is selected).
        d: the ranks (trainkit.dist.Dist), to check once per evaluation that they agree."""
        if patience is not None and (not isinstance(patience, int) or patience < 1):
            raise ConfigError(f"trainer.early_stopping.patience={patience} must be null or a positive integer")
        if not isinstance(min_delta, (int, float)) or not min_delta >= 0:
            raise ConfigError(f"trainer.early_stopping.min_delta={min_delta} must be a number >= 0")
        if patience is not None and not (monitor and evaluated):
            why = "a validation split (this data set has none)" if monitor else "a checkpoint.monitor (it is null)"
            raise ConfigError(f"trainer.early_stopping.patience={patience} needs {why}")
        monitor = monitor if evaluated else None
        self.monitor, self.patience, self.min_delta = monitor, patience, min_delta
        self.sign, self.d = 1 if mode == "max" else -1, d
        self.best: float | None = None
        self.best_step: int | None = None
        self.reference: float | None = None  # what an improvement for early stopping is measured against
        self.waited = 0  # evaluations since the last improvement by more than min_delta

    def update(self, metrics: dict[str, float], step: int) -> bool:
        """Take in one evaluation's metrics; True when it is the best so far."""
        if self.monitor is None:
            return False
        if self.monitor not in metrics:
            raise ConfigError(
                f"checkpoint.monitor={self.monitor} is not a metric of this run's evaluation "
                f"({', '.join(sorted(metrics))})"
            )
        value = metrics[self.monitor]
        if self.d is not None and len({repr(v) for v in self.d.gather_object(value)}) > 1:
            # Cheap insurance (one small gather per evaluation): a task whose metric is this rank's
            # own would otherwise have the ranks save or stop apart, and hang at the next collective.
            raise RunError(
                f"checkpoint.monitor={self.monitor} differs between ranks ({self.d.gather_object(value)}): "
                "an evaluation metric must come from all-reduced sums (trainkit/evaluate.py)"
            )
        finite = math.isfinite(value)
        improved = finite and (self.best is None or self.sign * (value - self.best) > 0)
        if improved:
            self.best, self.best_step = value, step
        if finite and (self.reference is None or self.sign * (value - self.reference) > self.min_delta):
            self.reference, self.waited = value, 0
        else:
            self.waited += 1
        return improved

    @property
    def stopped(self) -> bool:
        """Early stopping: `patience` evaluations in a row without an improvement."""
        return self.patience is not None and self.waited >= self.patience

    def stop_reason(self) -> str:
        best = f"best {self.best:.4g} at step {self.best_step}" if self.best is not None else "no finite value"
        by = f" by more than {self.min_delta:g}" if self.min_delta else ""
        evaluations = "1 evaluation" if self.waited == 1 else f"{self.waited} evaluations"
        return f"no improvement of {self.monitor}{by} for {evaluations} ({best})"

    def stopped_at(self, step: int) -> str:
        """What a resume of a stopped run says."""
        return f"stopped early at step {step}: {self.stop_reason()} (a larger early_stopping.patience trains on)"

    def row(self) -> dict[str, float]:
        """The best so far, for the evaluation rows: best/val/acc, best/step."""
        if self.best is None or self.best_step is None:
            return {}
        return {f"best/{self.monitor}": self.best, "best/step": self.best_step}

    def state_dict(self) -> dict:
        return {
            "monitor": self.monitor,
            "mode": "max" if self.sign > 0 else "min",
            "best": self.best,
            "best_step": self.best_step,
            "reference": self.reference,
            "waited": self.waited,
        }

    def load_state_dict(self, state: dict | None) -> str | None:
        """A checkpoint's entry (None: one written before selection existed). Returns a note to say
        when it cannot be continued (another monitor: the best so far is forgotten)."""
        if not state:
            return None
        mode = "max" if self.sign > 0 else "min"
        if (state["monitor"], state["mode"]) != (self.monitor, mode):
            return (
                f"checkpoint.monitor={self.monitor} (mode {mode}): the checkpoint selected by {state['monitor']} "
                f"(mode {state['mode']}); the best so far starts anew"
            )
        self.best, self.best_step = state["best"], state["best_step"]
        self.reference, self.waited = state["reference"], state["waited"]
        return None
