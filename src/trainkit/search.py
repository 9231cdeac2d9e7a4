"""An Optuna study through Hydra's sweeper (hydra-optuna-sweeper 1.3.0, pinned in pyproject.toml), with
what a study of trainkit runs needs on top of the plugin:

- one study for every rank. Under torchrun every worker runs the sweeper; each drawing its own trial gave
  ranks different parameters (lightning-hydra-template #639). Rank 0 asks Optuna and tells it the result;
  the other ranks never touch the study: they receive each batch of trials through torchrun's store.
- job N is trial N. Hydra numbers a command's jobs from 0, so a continued study's first job would train in
  trial 0's dir and resume its checkpoint with the new trial's settings (LHT #535; a resume may change
  optim.* by design). A dir beyond the study's trials that already holds a run is refused.
- a failed trial (its job's one-line error, kept as the trial's user attribute "error") or a NaN objective
  is a FAIL trial and the study goes on; the plugin crashes on NaN (Hydra #2237) and stops at the first
  failure (max_failure_rate 0).
- direction auto follows checkpoint.mode: the objective a job returns is the run's best monitored value.
- a seeded sampler continues at seed + the trials so far: with the seed itself, a continued study
  would draw its random start-up trials again.
"""

import json
import math
import os
import sys
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import optuna
from hydra.core.utils import JobReturn, JobStatus
from hydra.plugins.launcher import Launcher
from hydra.utils import instantiate
from hydra_plugins.hydra_optuna_sweeper._impl import OptunaSweeperImpl
from omegaconf import DictConfig, OmegaConf

from trainkit import dist
from trainkit.errors import ConfigError
from trainkit.selection import monitored

ERROR_FILE = "error.txt"  # a failed job's one-line error (trainkit.config.record_failure)
DIRECTIONS = {"max": "maximize", "min": "minimize"}


class TrialFailed(RuntimeError):
    """A trial's job failed, or returned NaN or nothing: its one line, for the sweeper's FAIL."""


def objective(cfg: DictConfig) -> tuple[str, str]:
    """(the objective's key, maximize | minimize): checkpoint.monitor (auto: the task's) and its
    checkpoint.mode; no monitor: the last val/acc, maximised. train.py returns the run's best value."""
    task = instantiate(cfg.task)
    monitor, mode = monitored(cfg.checkpoint.monitor, cfg.checkpoint.mode, task, cfg.trainer.ema.decay is not None)
    return (monitor, DIRECTIONS[mode]) if monitor else ("val/acc", "maximize")


def outcome(ret: JobReturn, job_dir: Path) -> str | None:
    """Why a trial failed, in one line, or None: the job's recorded error, a NaN, no objective."""
    if ret.status == JobStatus.FAILED:
        return f"{type(ret._return_value).__name__}: {ret._return_value}".splitlines()[0][:300]
    value = ret._return_value
    if value is None:
        error = job_dir / ERROR_FILE
        if error.is_file():
            return error.read_text().strip()
        return "the run returned no objective (no validation split?)"
    if not isinstance(value, (int, float)) or math.isnan(value):
        return f"the objective is {value!r}, not a number"
    return None


class Lockstep:
    """torchrun's store (the elastic agent's, which outlives the workers' restarts): rank 0 publishes each
    batch of trials as (first job number, overrides), the other ranks read them; None ends the study."""

    def __init__(self) -> None:
        from torch.distributed import TCPStore

        # A trial may train for hours: a follower waits that long for the next batch.
        wait = timedelta(days=7)
        self.store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=wait)
        round_ = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.prefix = f"trainkit/search/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{round_}"
        self.batches = 0

    def publish(self, batch: dict | None) -> None:
        self.store.set(f"{self.prefix}/{self.batches}", json.dumps(batch))
        self.batches += 1

    def receive(self) -> dict | None:
        batch = json.loads(self.store.get(f"{self.prefix}/{self.batches}"))
        self.batches += 1
        return batch


def lockstep_ranks() -> bool:
    """Several processes run this sweeper at once: torchrun's workers (one study, through its store)."""
    if dist.env_world_size() == 1:
        return False
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        raise ConfigError(
            f"an Optuna study in {dist.env_world_size()} processes needs torchrun (its ranks agree on each trial "
            "through torchrun's store); or run the study in one process with parallel.nproc_per_node=N trials"
        )
    return True


class Study(OptunaSweeperImpl):
    """The plugin's sweeper (its keys, search space syntax, samplers and loop), rank 0 the study's only
    client; see the module's docstring."""

    def setup(self, *, hydra_context, task_function, config: DictConfig) -> None:
        super().setup(hydra_context=hydra_context, task_function=task_function, config=config)
        optuna.logging.disable_default_handler()  # optuna's lines through Hydra's log (uncoloured)
        optuna.logging.enable_propagation()
        self.leader = dist.env_rank() == 0
        self.lockstep = Lockstep() if lockstep_ranks() else None
        self.objective_key, self.direction = self._direction(config)
        self.pending: list[optuna.trial.Trial] = []
        if not self.leader:
            return
        Path(self.sweep_dir).mkdir(parents=True, exist_ok=True)  # the sqlite file's dir
        self.earlier = len(self._trials())  # the study's trials before this command
        self._refuse_stale_dirs()
        if self.storage:  # the objective's name, for scripts/report.py
            study = optuna.create_study(
                study_name=self.study_name, storage=self.storage, directions=self._get_directions(), load_if_exists=True
            )
            study.set_user_attr("objective", self.objective_key)
        seed = OmegaConf.select(config, "hydra.sweeper.sampler.seed")
        if seed is not None and self.earlier:
            self.sampler = instantiate(config.hydra.sweeper.sampler, seed=seed + self.earlier)
        assert self.launcher is not None  # the plugin's setup made it
        self.launcher = _Trials(self.launcher, self)

    def _direction(self, config: DictConfig) -> tuple[str, str]:
        key, wanted = objective(config)
        if self.direction == "auto":
            return key, wanted
        given = self.direction if isinstance(self.direction, str) else getattr(self.direction, "name", self.direction)
        if given not in DIRECTIONS.values():
            raise ConfigError(f"hydra.sweeper.direction={given} is not one of: auto, maximize, minimize")
        if given != wanted:
            raise ConfigError(
                f"hydra.sweeper.direction={given} contradicts checkpoint.mode: the objective, the run's best {key}, "
                f"is {wanted.removesuffix('e')}ed (leave direction auto)"
            )
        return key, wanted

    def _refuse_stale_dirs(self) -> None:
        """Job N trains in <sweep dir>/N: one of those past the study's trials that holds a run belongs to
        another study (a removed study file, another study_name in this dir)."""
        sweep = OmegaConf.to_container(self.config.hydra.sweep) if self.config else {}  # unresolved
        if not isinstance(sweep, dict) or sweep.get("subdir") != "${hydra.job.num}":
            return
        for path in sorted(Path(self.sweep_dir).iterdir()):
            if path.name.isdigit() and int(path.name) >= self.earlier and any(path.iterdir()):
                raise ConfigError(
                    f"{path} holds a run, but study {self.study_name} has {self.earlier} trials: a new trial "
                    f"would resume it; use another hydra.sweep.dir (or the study that trained it)"
                )

    def _configure_trials(self, trials: list, *args: Any) -> Sequence[Sequence[str]]:
        try:
            overrides = super()._configure_trials(trials, *args)
        except ValueError as error:  # optuna: a parameter asked with another distribution than the study's
            for trial in trials:
                trial.study.tell(trial, state=optuna.trial.TrialState.FAIL)
            raise ConfigError(
                f"hydra.sweeper.params: {error} Study {self.study_name} searched another space for it: "
                "change the space in a new study (hydra.sweeper.study_name, or another hydra.sweep.dir)"
            ) from None
        numbers = [trial.number for trial in trials]
        if numbers != list(range(numbers[0], numbers[0] + len(numbers))):
            raise ConfigError(f"trials {numbers} of study {self.study_name}: another command asks it at once")
        self.job_idx, self.pending = numbers[0], list(trials)  # job N is trial N, in <sweep dir>/N
        return overrides

    def sweep(self, arguments: list[str]) -> None:
        if not self.leader:  # torchrun's other ranks: rank 0's trials, in its order
            assert self.lockstep is not None and self.launcher is not None
            while (batch := self.lockstep.receive()) is not None:
                self.launcher.launch(batch["overrides"], initial_job_idx=batch["job_idx"])
            return
        try:
            super().sweep(arguments)
        except ValueError:  # optuna has no best trial to report when every trial failed: said below
            if self._completed():
                raise
        finally:
            if self.lockstep is not None:
                self.lockstep.publish(None)
        self._summary()

    def _trials(self) -> list:
        """The stored study's trials; none when it does not exist yet (or lives in memory)."""
        if not self.storage:
            return []
        try:
            return optuna.load_study(study_name=self.study_name, storage=self.storage).trials
        except KeyError:  # optuna 2.10: "Record does not exist."
            return []

    def _completed(self) -> list:
        return [t for t in self._trials() if t.state == optuna.trial.TrialState.COMPLETE]

    def _summary(self) -> None:
        """This command's failed trials, one line each, then the study's best; exit 1 when none completed."""
        trials = self._trials()
        failed = [t for t in trials[self.earlier :] if t.state == optuna.trial.TrialState.FAIL]
        for trial in failed:
            print(f"trial {trial.number} failed: {trial.user_attrs.get('error', '?')}", file=sys.stderr, flush=True)
        if not trials:  # an in-memory study (storage null): the plugin logged its best
            return
        ran = len(trials) - self.earlier
        said = f"study {self.study_name}: {ran} trials ({len(failed)} failed), {len(trials)} in all"
        if not (done := self._completed()):
            print(f"error: {said}; no trial completed", file=sys.stderr, flush=True)
            raise SystemExit(1)
        best = (max if self.direction == "maximize" else min)(done, key=lambda t: t.value)
        params = " ".join(f"{k}={v}" for k, v in best.params.items())
        print(f"{said}; best trial {best.number}: {best.value:.6g} with {params}", flush=True)


class _Trials(Launcher):
    """Rank 0's launcher: hands each batch to the other ranks (lockstep), launches it, and turns a failed
    job, a NaN or a missing objective into a failed JobReturn carrying its one line, which the plugin
    records as a FAIL trial (and the trial keeps the line as its user attribute "error")."""

    def __init__(self, launcher: Launcher, study: Study):
        self.launcher, self.study = launcher, study

    def setup(self, **kwargs: Any) -> None:
        self.launcher.setup(**kwargs)

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        if self.study.lockstep is not None:
            self.study.lockstep.publish({"job_idx": initial_job_idx, "overrides": [list(o) for o in job_overrides]})
        returns = self.launcher.launch(job_overrides, initial_job_idx=initial_job_idx)
        for n, (trial, ret) in enumerate(zip(self.study.pending, returns, strict=True)):
            if (error := outcome(ret, Path(self.study.sweep_dir) / str(initial_job_idx + n))) is not None:
                trial.set_user_attr("error", error)
                ret.status, ret._return_value = JobStatus.FAILED, TrialFailed(error)
        return returns
