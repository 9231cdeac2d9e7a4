"""The ground floor: the error types every module raises, which failures are known ones, and how a
worker hands its one line to the process that started it. Imports nothing of trainkit."""

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
from hydra.errors import InstantiationException


class ConfigError(ValueError):
    """A bad setting. Entry points print it as one line and exit with status 2."""


class RunError(RuntimeError):
    """The run cannot go on (e.g. a non-finite loss). Printed as one line, exit status 3."""


class RankError(RunError):
    """A RunError that one rank alone meets (the others see their collective fail): that rank prints
    it, since rank 0 cannot know it (and a launcher may end rank 0 before it says anything)."""


class DataUnavailable(RankError):
    """A sample's storage failed after its retries (a shard set's object store down): one line naming what and
    why, from the rank that met it. A data set that reads remotely (`reads_remotely`) has every rank learn of one
    rank's failure before the step (loading.TrainWindows.fetch), so all write the last step's checkpoint and stop
    (`resumable`): the same command resumes once the store is back."""

    def resumable(self, step: int) -> RunError:
        """The line every rank raises once all wrote the checkpoint of `step` (rank 0 says it)."""
        return RunError(f"{self}; checkpoint of step {step} written: the same command resumes once it is back")


class Stopped(Exception):
    """The run stopped on purpose at an optimizer-step boundary (a signal, trainer.max_time), after every
    rank wrote the checkpoint of that step: not a failure (never restarted). Its text is the one line
    rank 0 prints, `code` the exit status; `chain`, run after the line: the handler the signal had
    before trainkit's (submitit's requeue)."""

    def __init__(self, line: str, code: int, chain: Callable[[], None] | None = None):
        super().__init__(line)
        self.code, self.chain = code, chain


def out_of_memory(error: BaseException) -> bool:
    """A device's OutOfMemoryError, or the CPU allocator's "can't allocate memory"."""
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and "can't allocate memory" in str(error)
    )


_NO_DETERMINISTIC_KERNEL = "does not have a deterministic implementation, but you set 'torch.use_deterministic_"


def nondeterministic(error: BaseException) -> RunError | None:
    """torch's refusal of an operation without a deterministic kernel under trainer.deterministic=true (every rank
    meets it alike), as one line naming the key; None for any other error."""
    text = str(error)
    if not isinstance(error, RuntimeError) or _NO_DETERMINISTIC_KERNEL not in text:
        return None
    operation = text.split(_NO_DETERMINISTIC_KERNEL)[0].strip() or "an operation"
    return RunError(
        f"trainer.deterministic=true: {operation} has no deterministic kernel on this device (torch refuses it): "
        "replace the operation, or run with trainer.deterministic=false"
    )


def user_error(error: BaseException | None) -> ConfigError | RunError | None:
    """The ConfigError/RunError behind `error`, also when hydra.utils.instantiate wrapped it. A
    `_target_` called with arguments it does not take (e.g. `+model.x=1`) is a ConfigError too. An
    out-of-memory error that reached the entry point (nothing retried it) is this rank's RunError."""
    if error is not None and out_of_memory(error):
        first = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
        return RankError(
            f"out of memory: {first} (a smaller data.batch_size, data.batch_size=auto with "
            "accumulation.global_batch_size, or trainer.precision=bf16)"
        )
    if error is not None and (refused := nondeterministic(error)):
        return refused
    while error is not None and not isinstance(error, (ConfigError, RunError)):
        if isinstance(error, InstantiationException) and isinstance(error.__cause__, TypeError):
            target = str(error).split("'")[1] if "'" in str(error) else "a _target_"
            return ConfigError(f"{target}: {error.__cause__} (a config node's keys are its _target_'s arguments)")
        error = error.__cause__ if isinstance(error, InstantiationException) else None
    return error


WORKER = "TRAINKIT_WORKER"  # set in every worker that trainkit/launch.py starts


def is_worker() -> bool:
    """This process is a worker that launch.start began (its parent checked the config and prints failures)."""
    return os.environ.get(WORKER) == "1"


def report(message: str, code: int, peer_failed: bool, stopped: bool = False) -> None:
    """In a worker: write this rank's one-line error into torch's error file (its format) for the parent
    to print (launch.py reads it back). `peer_failed`: a consequence (a collective failed because
    another rank died); `stopped`: not an error, a Stopped run's line."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        data = {
            "message": {"message": message, "extraInfo": {"py_callstack": "", "timestamp": str(int(time.time()))}},
            "trainkit": {"code": code, "peer_failed": peer_failed, "stopped": stopped},
        }
        Path(path).write_text(json.dumps(data))
    if peer_failed:  # let the agent see the rank that died first: it stops this one then (and names that one)
        time.sleep(2)
