"""An Optuna study as a Hydra sweeper (hydra/sweeper=optuna_study): trainkit's own, on Optuna 5 through its
public API (ask with the search space's distributions, tell), with what a study of trainkit runs needs:

- one study for every rank. Under torchrun every worker runs the sweeper; each drawing its own trial gave
  ranks different parameters (lightning-hydra-template #639). Rank 0 asks Optuna and tells it the result;
  the other ranks never touch the study: they receive each batch of trials through torchrun's store.
- job N is trial N. Hydra numbers a command's jobs from 0, so a continued study's first job would train in
  trial 0's dir and resume its checkpoint with the new trial's settings (LHT #535; a resume may change
  optim.* by design). A dir beyond the study's trials that already holds a run is refused.
- a failed trial (its job's one-line error, kept as the trial's user attribute "error") or a NaN objective
  is a FAIL trial and the study goes on (hydra-optuna-sweeper crashed on NaN, Hydra #2237).
- direction auto follows checkpoint.mode: the objective a job returns is the run's best monitored value.
- a seeded sampler continues at seed + the trials so far: with the seed itself, a continued study
  would draw its random start-up trials again.
- a trial stopped by a signal (its checkpoint written) or by Ctrl-C (at once) is marked "interrupted"; the
  same command first finishes it in its dir, from its newest checkpoint, then asks new trials. One whose
  command was killed (SIGKILL, a lost node: nothing runs to mark it) is found by Optuna's heartbeats
  (studies.py): the next command fails it and a new trial with its params finishes it from its checkpoint.
- the search space is checked (its grammar, each key and value composed into the job's config) before a
  storage or a dir exists: a refused command leaves nothing behind.
- a grid (GridSampler) ends when every point was asked: n_trials counts the points left; a complete grid
  trains nothing more. A study whose trials were all pruned ends with its summary and exit 0.
- hydra.sweeper.pruner: the jobs report their evaluations and stop when pruned (pruning.py); the
  sweeper tells Optuna PRUNED. Refused where a pruner cannot be right (see check_pruner).
The grammar of hydra.sweeper.params: grammar.py; the storage: studies.py."""

import functools
import itertools
import json
import math
import os
import sys
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import optuna
from hydra.core.plugins import Plugins
from hydra.core.utils import JobReturn, JobStatus
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from optuna.trial import TrialState

from trainkit import checkpoint, dist, options
from trainkit.errors import ConfigError
from trainkit.search import grammar, studies
from trainkit.search.pruning import PRUNED_AT
from trainkit.selection import monitored

ERROR_FILE = "error.txt"  # a failed job's one-line error (trainkit.config.record_failure)
DIRECTIONS = {"max": "maximize", "min": "minimize"}
INTERRUPTED = "interrupted"  # a trial's user attribute: stopped by a signal at its checkpoint, to be finished
OVERRIDES = "overrides"  # a trial's user attribute: the overrides its job ran with (to finish it later)
EVAL_EVERY = "trainer.eval_every"  # the study's user attribute under a pruner: its trials' evaluation steps
CTRL_C = "stopped by Ctrl-C: from its newest checkpoint"  # INTERRUPTED's value after a KeyboardInterrupt
CHECKPOINTS = "checkpoints"  # a run dir's checkpoints (train.py's Checkpointer)


def objective(cfg: DictConfig) -> tuple[str, str]:
    """(the objective's key, maximize | minimize): checkpoint.monitor (auto: the task's) and its
    checkpoint.mode; no monitor: the last value of the task's own key, its declared way. train.py returns the
    run's best value (else that last value)."""
    options.module_of(cfg, "data")  # imported: its resolvers (${pydoc_per_character:}), which the task's keys read
    task = instantiate(cfg.task)
    averaged, sets = cfg.trainer.ema.decay is not None, cfg.data.get("eval_sets") or {}
    monitor, mode = monitored(cfg.checkpoint.monitor, cfg.checkpoint.mode, task, averaged, sets)
    if monitor is None:
        monitor, mode = monitored("auto", "auto", task)
    return str(monitor), DIRECTIONS[mode]


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


class Grid(optuna.samplers.GridSampler):
    """hydra/sweeper/sampler=grid. GridSampler.after_trial calls study.stop() once the grid is done, which Optuna
    refuses outside Study.optimize (a RuntimeError at the last point's tell): the sweeper asks and tells, and ends
    the study itself when no point is left (grid_left)."""

    def after_trial(self, study: Any, trial: Any, state: TrialState, values: Any) -> None:
        pass


def grid_size(grid: dict[str, list]) -> int:
    return math.prod(len(values) for values in grid.values())


def grid_left(study: optuna.Study, grid: dict[str, list]) -> int:
    """The grid's points no trial of the study has run, runs or waits to run (failed and pruned ones count as run,
    as GridSampler counts them)."""
    keys = sorted(grid)
    taken = {tuple(t.params[k] for k in keys) for t in study.get_trials(deepcopy=False) if set(keys) <= set(t.params)}
    points = itertools.product(*(grid[k] for k in keys))
    return sum(point not in taken for point in points)


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


def check_pruner(pruner: Any, storage: str | None, keys: Sequence[str], cfg: DictConfig) -> None:
    """Pruning that cannot be right is refused: the trials report from their own processes to a stored
    study, pruners compare values at equal steps of every trial, and need a monitored value. (Several
    objectives, which Optuna cannot prune, are refused for every study: Study._direction.)"""
    if pruner is None:
        return
    name = f"hydra.sweeper.pruner ({type(pruner).__name__})"
    if storage is None:
        raise ConfigError(f"{name} needs a stored study: hydra.sweeper.storage=null keeps it in this process's memory")
    if EVAL_EVERY in keys:
        raise ConfigError(
            f"{name} compares the trials' values at equal steps: {EVAL_EVERY} is searched, so they evaluate at "
            "different steps; fix it for the study"
        )
    if cfg.checkpoint.monitor is None:
        raise ConfigError(f"{name} prunes on checkpoint.monitor's value; checkpoint.monitor is null")


class Study:
    """The sweeper behind hydra_plugins.trainkit_search (its keys: conf/hydra/sweeper/optuna_study.yaml)."""

    def __init__(
        self,
        sampler: Any,
        direction: Any = "auto",
        storage: str | None = None,
        study_name: str | None = None,
        n_trials: int = 20,
        n_jobs: int = 1,
        max_failure_rate: float = 1.0,
        params: DictConfig | None = None,
        custom_search_space: str | None = None,
        pruner: Any = None,
        heartbeat_interval: int | None = 60,
        grace_period: int | None = None,
        **unknown: Any,
    ):
        if unknown:
            keys = "sampler, direction, storage, study_name, n_trials, n_jobs, max_failure_rate, params, "
            raise ConfigError(
                f"hydra.sweeper.{next(iter(unknown))} is not a setting of hydra/sweeper=optuna_study; its settings: "
                f"{keys}custom_search_space, pruner, heartbeat_interval, grace_period"
            )
        if not 0 <= max_failure_rate <= 1:
            raise ConfigError(f"hydra.sweeper.max_failure_rate={max_failure_rate} must be between 0 and 1")
        optional = (("heartbeat_interval", heartbeat_interval), ("grace_period", grace_period))
        for key, value in (("n_trials", n_trials), ("n_jobs", n_jobs), *(kv for kv in optional if kv[1] is not None)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"hydra.sweeper.{key}={value} must be a positive integer")
        if heartbeat_interval is None and grace_period is not None:
            raise ConfigError(f"hydra.sweeper.grace_period={grace_period} needs heartbeats: heartbeat_interval is null")
        self.heartbeat = studies.Heartbeat(heartbeat_interval, grace_period) if heartbeat_interval else None
        self.sampler, self.direction, self.storage_url = sampler, direction, storage
        self.study_name = study_name or "study"
        self.n_trials, self.n_jobs, self.max_failure_rate = n_trials, n_jobs, max_failure_rate
        self.params = cast(dict[str, Any], OmegaConf.to_container(params) if params else {})
        self.extend = instantiate({"_target_": custom_search_space, "_partial_": True}) if custom_search_space else None
        self.pruner = pruner

    def setup(self, *, hydra_context, task_function, config: DictConfig) -> None:
        # (here, not in __init__, which Hydra's instantiate runs: its errors come wrapped, not in one line)
        if isinstance(self.sampler, functools.partial) and self.sampler.func is not optuna.samplers.GridSampler:
            raise ConfigError(  # grid.yaml's _partial_ under another sampler's settings: Optuna would crash at ask
                f"hydra.sweeper.sampler: {getattr(self.sampler.func, '__name__', self.sampler.func)} with _partial_: "
                f"true, which only GridSampler takes (the sweeper gives it the grid): pick a sampler by "
                f"hydra/sweeper/sampler=<name>"
            )
        optuna.logging.disable_default_handler()  # optuna's lines through Hydra's log (uncoloured)
        optuna.logging.enable_propagation()
        self.config, self.sweep_dir, self.hydra_context = config, Path(config.hydra.sweep.dir), hydra_context
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )
        self.leader = dist.env_rank() == 0
        self.lockstep = Lockstep() if lockstep_ranks() else None
        self.objective_key, self.direction = self._direction(config)

    def _open(self) -> None:
        """The storage (and the sweep dir its file lives in), after the search space was checked."""
        self.sweep_dir.mkdir(parents=True, exist_ok=True)  # the sqlite file's dir
        self.storage = studies.storage(self.storage_url, self.heartbeat) or optuna.storages.InMemoryStorage()
        self.earlier = len(self._trials())  # the study's trials before this command
        self._refuse_stale_dirs()
        seed = OmegaConf.select(self.config, "hydra.sweeper.sampler.seed")
        if seed is not None and self.earlier:
            self.sampler = instantiate(self.config.hydra.sweeper.sampler, seed=seed + self.earlier)

    def _check_space(self, space: grammar.Space, fixed: dict[str, str]) -> None:
        """Each key and value of the space composed into the job's config as the launcher will (an unknown key, a
        value of the wrong type: refused in one line), before a trial is asked or anything is written."""
        loader, fixed_overrides = self.hydra_context.config_loader, [f"{k}={v}" for k, v in fixed.items()]
        for drawn in grammar.corners(space):
            overrides = [grammar.override_text(k, v) for k, v in drawn.items()]
            loader.load_sweep_config(self.config, overrides + fixed_overrides)

    def _direction(self, config: DictConfig) -> tuple[str, str]:
        key, wanted = objective(config)
        if self.direction == "auto":
            return key, wanted
        if not isinstance(self.direction, str):  # Optuna's several objectives: a trainkit run returns one
            raise ConfigError(
                f"hydra.sweeper.direction={list(self.direction)}: a study of trainkit runs has one objective, the "
                f"run's best {key} (train.py's return value); give one direction, or auto"
            )
        if self.direction not in DIRECTIONS.values():
            raise ConfigError(f"hydra.sweeper.direction={self.direction} is not one of: auto, maximize, minimize")
        if self.direction != wanted:
            raise ConfigError(
                f"hydra.sweeper.direction={self.direction} contradicts checkpoint.mode: the objective, the run's best "
                f"{key}, is {wanted.removesuffix('e')}ed (leave direction auto)"
            )
        return key, wanted

    def _refuse_stale_dirs(self) -> None:
        """Job N trains in <sweep dir>/N: one of those past the study's trials that holds a run belongs to
        another study (a removed study file, another study_name in this dir)."""
        sweep = OmegaConf.to_container(self.config.hydra.sweep)  # unresolved
        if not isinstance(sweep, dict) or sweep.get("subdir") != "${hydra.job.num}":
            return
        for path in sorted(self.sweep_dir.iterdir()):
            if path.name.isdigit() and int(path.name) >= self.earlier and any(path.iterdir()):
                raise ConfigError(
                    f"{path} holds a run, but study {self.study_name} has {self.earlier} trials: a new trial "
                    f"would resume it; use another hydra.sweep.dir (or the study that trained it)"
                )

    def _trials(self) -> list:
        """The stored study's trials; none when it does not exist yet."""
        try:
            return optuna.load_study(study_name=self.study_name, storage=self.storage).trials
        except KeyError:  # "Record does not exist."
            return []

    def sweep(self, arguments: list[str]) -> None:
        if not self.leader:  # torchrun's other ranks: rank 0's trials, in its order
            assert self.lockstep is not None
            while (batch := self.lockstep.receive()) is not None:
                self.launcher.launch(batch["overrides"], initial_job_idx=batch["job_idx"])
            return
        try:
            self._study(arguments)
        finally:
            if self.lockstep is not None:
                self.lockstep.publish(None)

    def _study(self, arguments: list[str]) -> None:
        space, fixed = grammar.parse([f"{k}={v}" for k, v in self.params.items()] + list(arguments))
        check_pruner(self.pruner, self.storage_url, list(space), self.config)
        is_grid = isinstance(self.sampler, functools.partial) and self.sampler.func is optuna.samplers.GridSampler
        grid = grammar.grid(space) if is_grid else None
        self._check_space(space, fixed)
        self._open()
        if grid is not None:
            assert isinstance(self.sampler, functools.partial)  # (the seed's sampler, _open, is one too)
            self.sampler = Grid(grid, *self.sampler.args, **self.sampler.keywords)
        study = optuna.create_study(
            study_name=self.study_name, storage=self.storage, sampler=self.sampler, direction=self.direction,
            load_if_exists=True,
        )  # fmt: skip
        study.set_user_attr("objective", self.objective_key)  # for scripts/report.py
        self._same_space(study, space)
        if self.pruner is not None:
            self._same_steps(study)
        interrupted = self._interrupted(study)
        studies.claim(self.storage, [trial._trial_id for trial in interrupted])  # this command finishes them
        retries = self._lost(study)
        for trial in interrupted:  # finished first, each in its own dir, from its checkpoint
            print(f"study {self.study_name}: finishing trial {trial.number}, {trial.user_attrs[INTERRUPTED]}")
            self._run(study, [trial.number], [trial.user_attrs[OVERRIDES]])
        left = grid_left(study, grid) if grid is not None else math.inf
        if left == 0:
            assert grid is not None
            print(f"study {self.study_name}: its grid of {grid_size(grid)} points is complete: nothing to train")
        to_go = min(self.n_trials, left) + retries  # a lost trial's retry (a WAITING trial, asked first): on top
        while to_go > 0:
            to_go += self._lost(study)  # another command's trial, lost meanwhile
            batch = [self._ask(study, space, fixed) for _ in range(int(min(to_go, self.n_jobs)))]
            numbers = [trial.number for trial in batch]
            if numbers != list(range(numbers[0], numbers[0] + len(numbers))):
                raise ConfigError(f"trials {numbers} of study {self.study_name}: another command asks it at once")
            self._run(study, numbers, [trial.user_attrs[OVERRIDES] for trial in batch])
            to_go -= len(batch)
        if grid is not None and left and grid_left(study, grid) == 0:
            print(f"study {self.study_name}: its grid of {grid_size(grid)} points is complete")
        self._summary(study)

    def _lost(self, study: optuna.Study) -> int:
        """Optuna's heartbeats: the trials whose command is gone fail, each asked again (a WAITING trial) and
        finished from its checkpoint (_resume); how many were found."""
        if not studies.heartbeats(self.storage):
            return 0
        before = {t.number for t in study.get_trials(deepcopy=False, states=(TrialState.WAITING,))}
        studies.fail_lost(study)
        found = 0
        for trial in study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
            if trial.number in before or not (history := studies.retried_from(trial)):
                continue
            grace = self.heartbeat.grace_period or 2 * self.heartbeat.interval if self.heartbeat else 0
            print(
                f"study {self.study_name}: trial {history[-1]} lost its command (no heartbeat for {grace} s): "
                f"trial {trial.number} finishes it",
                flush=True,
            )
            found += 1
        return found

    def _same_steps(self, study: optuna.Study) -> None:
        """A pruner compares the trials' values at equal steps: the study's trials all evaluate alike."""
        every = self.config.trainer.eval_every
        if (before := study.user_attrs.get(EVAL_EVERY, every)) != every:
            raise ConfigError(
                f"hydra.sweeper.pruner compares the trials' values at equal steps: study {self.study_name}'s trials "
                f"evaluated every {before} steps, not trainer.eval_every={every}; keep it, or start a new study"
            )
        study.set_user_attr(EVAL_EVERY, every)

    def _same_space(self, study: optuna.Study, space: grammar.Space) -> None:
        """A parameter the study searched as another kind (a choice, now an interval) is refused before any
        trial is asked (Optuna would refuse it with the trial asked and left running)."""
        for trial in study.get_trials(deepcopy=False):
            for key, new in space.items():
                if key not in trial.distributions:
                    continue
                try:
                    optuna.distributions.check_distribution_compatibility(trial.distributions[key], new)
                except ValueError as error:
                    raise ConfigError(
                        f"hydra.sweeper.params: {key}: {error} Study {self.study_name} searched another space for "
                        "it: change the space in a new study (hydra.sweeper.study_name, or another hydra.sweep.dir)"
                    ) from None

    def _ask(self, study: optuna.Study, space: grammar.Space, fixed: dict[str, str]) -> optuna.Trial:
        with studies.quiet():
            trial = study.ask(fixed_distributions=space)  # a WAITING trial first: a lost one's retry, its params
        if OVERRIDES in trial.user_attrs:  # a retry: the lost trial's own overrides
            return trial
        try:
            if self.extend is not None:  # custom_search_space(config, trial): suggests more parameters
                self.extend(self.config, trial)
        except Exception:
            study.tell(trial, state=TrialState.FAIL)
            raise
        drawn = [grammar.override_text(k, v) for k, v in trial.params.items()]
        trial.set_user_attr(OVERRIDES, drawn + [f"{k}={v}" for k, v in fixed.items()])
        return trial

    def _interrupted(self, study: optuna.Study) -> list:
        running = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        return [trial for trial in running if INTERRUPTED in trial.user_attrs]

    def _run(self, study: optuna.Study, numbers: list[int], overrides: list[list[str]]) -> None:
        """Launch one batch (job N: trial N, in <sweep dir>/N) and tell the study each result."""
        overrides = [jobs + self._resume(number) for number, jobs in zip(numbers, overrides, strict=True)]
        if self.lockstep is not None:
            self.lockstep.publish({"job_idx": numbers[0], "overrides": overrides})
        try:
            with studies.beating(self.storage, [self._id(n) for n in numbers]):
                returns = self.launcher.launch(overrides, initial_job_idx=numbers[0])
        except (SystemExit, KeyboardInterrupt) as stop:  # a signal (its checkpoint written), Ctrl-C: the command ends
            how = "stopped at its checkpoint" if isinstance(stop, SystemExit) else CTRL_C
            for number in numbers:
                self.storage.set_trial_user_attr(self._id(number), INTERRUPTED, how)
            runs = ", ".join(str(self.sweep_dir / str(n)) for n in numbers)
            print(
                f"study {self.study_name}: trial(s) {', '.join(map(str, numbers))} interrupted; the same command "
                f"finishes them first, from their checkpoints in {runs}, then asks its new trials",
                file=sys.stderr,
                flush=True,
            )
            raise
        except Exception as refused:  # the launcher's own refusal (e.g. a job's config): no trial left RUNNING
            for number in numbers:
                self.storage.set_trial_user_attr(self._id(number), "error", str(refused).splitlines()[0][:300])
                study.tell(number, state=TrialState.FAIL)
            raise
        failed = 0
        for number, ret in zip(numbers, returns, strict=True):
            if (error := outcome(ret, self.sweep_dir / str(number))) is not None:
                self.storage.set_trial_user_attr(self._id(number), "error", error)
                study.tell(number, state=TrialState.FAIL)
                failed += 1
            elif PRUNED_AT in self.storage.get_trial(self._id(number)).user_attrs:  # stopped at the pruner's word
                study.tell(number, state=TrialState.PRUNED)
            else:
                study.tell(number, float(ret._return_value))
        if failed / len(numbers) > self.max_failure_rate:
            raise ConfigError(
                f"study {self.study_name}: {failed} of {len(numbers)} trials failed, more than "
                f"hydra.sweeper.max_failure_rate={self.max_failure_rate:g}"
            )

    def _resume(self, number: int) -> list[str]:
        """A lost trial's retry trains in its own dir from the newest checkpoint of the trials it retries (none
        when its own dir has one: it was interrupted in turn, and resumes there)."""
        history = studies.retried_from(self.storage.get_trial(self._id(number)))
        if not history or checkpoint.complete(self.sweep_dir / str(number) / CHECKPOINTS):
            return []
        for earlier in reversed(history):
            if found := checkpoint.complete(self.sweep_dir / str(earlier) / CHECKPOINTS):
                return [f"checkpoint.resume={found[-1]}"]
        return []

    def _id(self, number: int) -> int:
        """Trial `number`'s id in the storage (Optuna's public BaseStorage API)."""
        study_id = self.storage.get_study_id_from_name(self.study_name)
        return self.storage.get_trial_id_from_study_id_trial_number(study_id, number)

    def _summary(self, study: optuna.Study) -> None:
        """This command's failed trials, one line each, then the study's best. None completed: exit 1 when a trial
        failed; every trial pruned is a study that did what it was asked (exit 0, no best trial)."""
        trials = study.get_trials(deepcopy=False)
        mine = trials[self.earlier :]
        failed = [t for t in mine if t.state == TrialState.FAIL]
        pruned = [t for t in mine if t.state == TrialState.PRUNED]
        for trial in failed:
            print(f"trial {trial.number} failed: {trial.user_attrs.get('error', '?')}", file=sys.stderr, flush=True)
        said = f"study {self.study_name}: {len(mine)} trials ({len(failed)} failed, {len(pruned)} pruned), "
        said += f"{len(trials)} in all"
        done = [t for t in trials if t.state == TrialState.COMPLETE]
        if not done and any(t.state == TrialState.FAIL for t in trials):
            print(f"error: {said}; no trial completed", file=sys.stderr, flush=True)
            raise SystemExit(1)
        if not done:
            print(f"{said}; no trial completed: every trial was pruned, no best trial", flush=True)
            return
        best = study.best_trial
        params = " ".join(f"{k}={v}" for k, v in best.params.items())
        print(f"{said}; best trial {best.number}: {best.value:.6g} with {params}", flush=True)
