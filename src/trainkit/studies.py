"""Where an Optuna study lives (hydra.sweeper.storage), for the sweeper, its trials' jobs and scripts/report.py.

- a database URL (`sqlite:///<sweep dir>/study.db`, the default; `postgresql://...`): Optuna's RDBStorage;
- a file path ending in `.log`: Optuna's JournalStorage on a file (appends under a lock file), which works
  on NFS where sqlite corrupts (optuna #815): a study on a cluster's shared disk, or in SLURM array jobs;
- null: in memory, in the sweeper's process alone.

A sqlite file written by an older Optuna (2.10, hydra-optuna-sweeper's) is refused in one line that says
how to upgrade it in place."""

import re
from typing import Any

import optuna

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


def storage(url: str | None) -> Any:
    """Optuna's storage object for hydra.sweeper.storage (None: in memory); an old schema refused in one line."""
    if url is None:
        return None
    try:
        return optuna.storages.get_storage(open_storage(url))
    except RuntimeError as error:
        if (said := schema_error(error, url)) is not None:
            raise said from None
        raise


def load(study_name: str, url: str, **kwargs: Any) -> optuna.Study:
    """optuna.load_study; KeyError when the study does not exist."""
    return optuna.load_study(study_name=study_name, storage=storage(url), **kwargs)
