"""Where an Optuna study lives (hydra.sweeper.storage), for the sweeper, its trials' jobs and scripts/report.py.

- a database URL (`sqlite:///<sweep dir>/study.db`, the default; `postgresql://...`): Optuna's RDBStorage;
- a file path ending in `.log`: Optuna's JournalStorage on a file (appends under a lock file), which works
  on NFS where sqlite corrupts (optuna #815): a study on a cluster's shared disk, or in SLURM array jobs;
- null: in memory, in the sweeper's process alone.

A sqlite file written by an older Optuna (2.10, hydra-optuna-sweeper's) is refused in one line that says
how to upgrade it in place.

The sweeper's storage keeps Optuna's heartbeats (a database's RDBStorage; Optuna 5.1's JournalStorage has none,
optuna #6615): while a trial runs, its command writes one every heartbeat_interval seconds; a trial without one
for grace_period seconds lost its command (SIGKILL, a lost node) and the next command fails it
(optuna.storages.fail_stale_trials) and asks it again from its params (RetryHeartbeatStaleTrialCallback)."""

import contextlib
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.exceptions import ExperimentalWarning
from optuna.storages import RetryHeartbeatStaleTrialCallback
from optuna.storages._heartbeat import get_heartbeat_thread, is_heartbeat_enabled

from trainkit.errors import ConfigError

JOURNAL_SUFFIX = ".log"


def open_storage(url: str | None) -> Any:
    """What optuna.create_study / load_study take as storage: the URL itself, a JournalStorage, or None."""
    if url is None or not url.endswith(JOURNAL_SUFFIX):
        return url
    from optuna.storages.journal import JournalFileBackend, JournalFileOpenLock, JournalStorage

    # The open(O_CREAT | O_EXCL) lock: the one Optuna documents for NFS (the symlink lock needs symlinks)
    return JournalStorage(JournalFileBackend(url, lock_obj=JournalFileOpenLock(url)))


def schema_error(error: RuntimeError, url: str) -> ConfigError | None:
    """Optuna's refusal of a database another Optuna version set up, as one line (None: another error)."""
    found = re.search(r"set up by optuna ([\w.]+)", str(error))
    if "storage upgrade" not in str(error):
        return None
    by = f"optuna {found.group(1)}" if found else "another optuna version"
    return ConfigError(
        f"hydra.sweeper.storage={url} was written by {by} (hydra-optuna-sweeper's); upgrade it once, in place, with "
        f"`optuna storage upgrade --storage {url}` (copy it first to keep the old one), then run the command again"
    )


RETRIES = 3  # a trial lost this often (an OOM kill each time?) is not asked again: its FAIL trials say so


@dataclass(frozen=True)
class Heartbeat:
    interval: int  # seconds between a running trial's heartbeats
    grace_period: int | None  # seconds without one before the trial is lost (None: Optuna's 2 x interval)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Optuna's heartbeat API warns that it is experimental, and that it is meant for Study.optimize (the sweeper
    asks and tells, and runs optimize's heartbeat thread itself): said once here, not on every trial."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExperimentalWarning)
        warnings.filterwarnings("ignore", "Heartbeat of storage is supposed to be used with Study.optimize")
        yield


def storage(url: str | None, heartbeat: Heartbeat | None = None) -> Any:
    """Optuna's storage object for hydra.sweeper.storage (None: in memory); an old schema refused in one line.
    heartbeat: a database's storage keeps them, and asks a lost trial again (a journal has none)."""
    if url is None:
        return None
    try:
        opened = open_storage(url)
        if heartbeat is not None and isinstance(opened, str):
            with quiet():
                retry = RetryHeartbeatStaleTrialCallback(max_retry=RETRIES, inherit_intermediate_values=True)
                opened = optuna.storages.RDBStorage(
                    opened, heartbeat_interval=heartbeat.interval, grace_period=heartbeat.grace_period,
                    heartbeat_stale_trial_callback=retry,
                )  # fmt: skip
        return optuna.storages.get_storage(opened)
    except RuntimeError as error:
        if (said := schema_error(error, url)) is not None:
            raise said from None
        raise


def load(study_name: str, url: str, **kwargs: Any) -> optuna.Study:
    """optuna.load_study; KeyError when the study does not exist."""
    return optuna.load_study(study_name=study_name, storage=storage(url), **kwargs)


def heartbeats(storage: Any) -> bool:
    return is_heartbeat_enabled(storage)


def beating(storage: Any, trial_ids: list[int]) -> contextlib.ExitStack:
    """The trials' heartbeats while their jobs run: Study.optimize's own thread, one a trial (none without)."""
    stack = contextlib.ExitStack()
    for trial_id in trial_ids:
        thread = get_heartbeat_thread(trial_id, storage)
        thread.start()
        stack.callback(thread.join)
    return stack


def claim(storage: Any, trial_ids: list[int]) -> None:
    """A heartbeat for each trial now: trials this command finishes are not lost, however long ago they stopped."""
    if heartbeats(storage):
        for trial_id in trial_ids:
            storage.record_heartbeat(trial_id)


def fail_lost(study: optuna.Study) -> None:
    """optuna.storages.fail_stale_trials: the trials without a heartbeat for grace_period FAIL, each asked again
    as a WAITING trial with its params (the storage's RetryHeartbeatStaleTrialCallback)."""
    with quiet():
        optuna.storages.fail_stale_trials(study)


def retried_from(trial: optuna.trial.FrozenTrial) -> list[int]:
    """The lost trials this one asks again, oldest first (RetryHeartbeatStaleTrialCallback's history); [] else."""
    with quiet():
        return RetryHeartbeatStaleTrialCallback.retry_history(trial)
