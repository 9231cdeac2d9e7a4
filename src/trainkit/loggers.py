"""Where rank 0's rows go: metrics.jsonl in the run dir, always, and the backend `logger=<name>` picks.

A backend is one class of BACKENDS with the small interface below (`Backend`) and one yaml, conf/logger/<name>.yaml,
whose `name` is its key here; nothing else in trainkit names a backend. It is built as
`Backend(run_dir, cfg, resume_step, run_id)`: resume_step is the checkpoint's step a resumed run continues from
(None for a fresh run; rows past it are logged again), run_id the backend's own id of the run it continues (its
`run_id` as saved in the checkpoint under `logger_run_id`), None for a fresh run. A backend whose runs live in a
store (MLflow's tracking URI, a W&B project) says which with `store(run_dir, cfg)`; the checkpoint keeps it
beside the id (`logger_store`: backend and store), and a resume continues the run only in the same backend and
store: elsewhere (another store, W&B's run resumed with logger=mlflow) it starts a new run and says so in one line.
Only in its own run dir: a run branched from another run dir's checkpoint (checkpoint.resume=<its path> in a new
hydra.run.dir) is a new run, and a backend with `branched_from(parent)` records there the run it came from.
A backend may also refuse, with `check(cfg)`, a setting it would fail on late (config.check calls it).
"""

import contextlib
import fcntl
import json
import netrc
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol, cast
from urllib.parse import urlparse

from omegaconf import DictConfig, OmegaConf

from trainkit import provenance
from trainkit.errors import ConfigError

RUN_ID = "logger_run_id"  # the checkpoint's key for Backend.run_id
OLD_RUN_ID = "wandb_run_id"  # what checkpoints written before the rename hold
STORE = "logger_store"  # the checkpoint's key for {"backend": logger.name, "store": Backend.store(...)} of that id


class Backend(Protocol):
    run_id: str | None  # the backend's id of this run: a resumed run continues it (None: a backend without one)

    def __init__(self, run_dir: Path, cfg: DictConfig, resume_step: int | None, run_id: str | None) -> None: ...

    def log(self, row: dict) -> None:
        """One row: `step` and numbers (a training row, an evaluation, the test row)."""

    def summary(self, facts: dict) -> None:
        """The run's model summary (trainkit/summary.py), once, before the first step."""

    def close(self, failed: bool) -> None:
        """At the end of the run, also when it fails (failed: True)."""


def is_test_row(row: dict) -> bool:
    """The row of the test pass at the end of a run (test/loss, test/acc, ...)."""
    return any(key.startswith("test/") for key in row)


def check(cfg: DictConfig) -> None:
    """The chosen backend's own refusals (its optional `check(cfg)`), before the run dir is written."""
    chosen = BACKENDS.get(cfg.logger.name)
    if chosen is not None and (refuse := getattr(chosen, "check", None)) is not None:
        refuse(cfg)


def saved_run_id(state: dict) -> str | None:
    """The backend's run id a checkpoint holds (logger_run_id; wandb_run_id in checkpoints written before)."""
    return state.get(RUN_ID, state.get(OLD_RUN_ID))


class FileLogger:
    """metrics.jsonl (a row per line) and summary.json in the run dir: every run writes them, whatever the backend."""

    run_id: str | None = None  # no run to continue: the file keeps its rows up to the checkpoint

    def __init__(self, run_dir: Path, cfg: DictConfig, resume_step: int | None, run_id: str | None = None):
        self.run_dir = Path(run_dir)
        path = self.run_dir / "metrics.jsonl"
        # A fresh run starts the file anew (a previous attempt that died before its first
        # checkpoint left rows of steps that will be trained again); a resumed one keeps the rows
        # up to its checkpoint: those past it will be logged again, and the test row (trainer.test), which
        # every run that ends writes: a finished run resumed again has it once.
        kept = []
        if resume_step is not None and path.exists():
            rows = [(line, json.loads(line)) for line in path.read_text().splitlines()]
            kept = [line for line, row in rows if row["step"] <= resume_step and not is_test_row(row)]
        path.write_text("".join(line + "\n" for line in kept))
        self.file = open(path, "a")  # noqa: SIM115 (a long-lived handle, closed in close())

    def log(self, row: dict) -> None:
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()

    def summary(self, facts: dict) -> None:
        (self.run_dir / "summary.json").write_text(json.dumps(facts, indent=1) + "\n")

    def close(self, failed: bool) -> None:
        self.file.close()


class WandbLogger:
    """A W&B run in the run dir: offline unless the user has credentials or sets WANDB_MODE (wandb_mode)."""

    @staticmethod
    def store(run_dir: Path, cfg: DictConfig) -> str:
        """Where its runs are: the entity (the user's default: empty) and project."""
        return f"{cfg.logger.entity or ''}/{cfg.logger.project}"

    def __init__(self, run_dir: Path, cfg: DictConfig, resume_step: int | None, run_id: str | None):
        import wandb

        group, name, job_type = sweep_identity()
        self.run = wandb.init(
            project=cfg.logger.project,
            entity=cfg.logger.entity,
            group=cfg.logger.group or group,  # one W&B run per sweep job, grouped by the sweep
            name=name,
            job_type=job_type,
            tags=list(cfg.logger.tags),
            dir=str(run_dir),
            mode=wandb_mode(),  # type: ignore[arg-type]  # WANDB_MODE as the user set it
            config=cast(dict, OmegaConf.to_container(cfg, resolve=True)) | {"provenance": provenance.brief(run_dir)},
            id=run_id,
            resume="allow" if run_id else None,
        )
        self.run_id: str | None = self.run.id

    def branched_from(self, parent: dict) -> None:
        self.run.config.update({"branched_from": parent})

    def log(self, row: dict) -> None:
        self.run.log({k: v for k, v in row.items() if k != "step"}, step=row["step"])

    def summary(self, facts: dict) -> None:
        self.run.summary.update({f"model/{key}": value for key, value in facts.items()})

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class TensorBoardLogger:
    """A SummaryWriter into the run dir itself (a sweep: each job dir is one run). A resumed run
    appends a new event file whose purge_step makes TensorBoard drop the rows an earlier attempt
    logged past the checkpoint (this run logs them again), as metrics.jsonl drops them."""

    run_id: str | None = None  # each attempt its own event file

    def __init__(self, run_dir: Path, cfg: DictConfig, resume_step: int | None, run_id: str | None):
        from torch.utils.tensorboard import SummaryWriter

        step = resume_step or 0
        self.writer = SummaryWriter(str(run_dir), purge_step=step + 1 if resume_step is not None else None)
        config_text = OmegaConf.to_yaml(cfg, resolve=True)
        self.writer.add_text("config", "".join(f"    {line}\n" for line in config_text.splitlines()), step)  # Markdown

    def log(self, row: dict) -> None:
        for key, value in row.items():
            if key != "step":
                self.writer.add_scalar(key, value, row["step"])

    def summary(self, facts: dict) -> None:
        self.writer.add_text("summary", "".join(f"    {k}: {v}\n" for k, v in facts.items()), 0)

    def close(self, failed: bool) -> None:
        self.writer.close()


class MLflowLogger:
    """An MLflow run in the experiment logger.project of one store for every run of the project: MLFLOW_TRACKING_URI
    when set (a server, a database), else a sqlite database, outputs/mlflow.db under the dir the command started in
    (Hydra's original cwd), created by the first run (its artifacts beside it, outputs/mlartifacts/), which sweep jobs
    write at once and mlflow opens without switches: `mlflow ui --backend-store-uri sqlite:///<that path>`. The
    config as parameters (flattened keys) and config.yaml, the summary as summary.json (artifacts) and model/* tags.
    A resumed run continues the same MLflow run (run_id) when it is in this store, which keeps every value logged:
    rows an attempt logged past its checkpoint are there twice at their step, the later this run's. A run branched
    from another run's checkpoint names it in branched_from.* tags."""

    @staticmethod
    def store(run_dir: Path, cfg: DictConfig) -> str:
        return mlflow_store(Path(run_dir))

    @staticmethod
    def check(cfg: DictConfig) -> None:
        """MLflow 3 refuses its file store (./mlruns, file://...: maintenance mode) with a traceback, which would come
        after the run dir is written: said here, in one line, unless the user opted in (MLFLOW_ALLOW_FILE_STORE)."""
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        allowed = os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() in ("true", "1")  # MLflow's own parsing
        if uri and urlparse(uri).scheme in ("", "file") and not allowed:
            raise ConfigError(
                f"MLFLOW_TRACKING_URI={uri} is MLflow's file store, which MLflow no longer keeps up (it refuses it "
                "without MLFLOW_ALLOW_FILE_STORE=true): set it to a database (sqlite:///<path>/mlflow.db) or unset "
                f"it (logger=mlflow's store: {DEFAULT_STORE})"
            )

    def __init__(self, run_dir: Path, cfg: DictConfig, resume_step: int | None, run_id: str | None):
        from mlflow.entities import Param, RunStatus
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        uri = mlflow_store(Path(run_dir))
        with _creating(uri):  # the first job of a sweep creates the database; the others wait for it
            self.client = MlflowClient(uri)
            found = self.client.get_experiment_by_name(cfg.logger.project)
        if run_id is not None:
            try:
                self.client.update_run(run_id, status=RunStatus.to_string(RunStatus.RUNNING))
            except MlflowException:  # e.g. a checkpoint written before the store was kept, from another store
                print(f"logger: the checkpoint's run {run_id} is not in {uri}: a new mlflow run in {uri}", flush=True)
                run_id = None
        if run_id is None:
            experiment = found.experiment_id if found else self._experiment(cfg.logger.project, uri)
            group, name, _ = sweep_identity()
            tags = {tag: "" for tag in cfg.logger.tags} | ({"group": cfg.logger.group or group} if group else {})
            run_id = self.client.create_run(experiment, run_name=name, tags=tags).info.run_id
            config = cast(dict, OmegaConf.to_container(cfg, resolve=True))
            params = [Param(key, str(value)[:6000]) for key, value in _flat(config).items()]  # MLflow's limit
            for start in range(0, len(params), 100):  # log_batch's limit of parameters
                self.client.log_batch(run_id, params=params[start : start + 100])
            self.client.log_text(run_id, OmegaConf.to_yaml(cfg, resolve=True), "config.yaml")
        self.id: str = run_id
        self.run_id: str | None = run_id

    def _experiment(self, name: str, uri: str) -> str:
        """A new experiment (another job may have made it meanwhile); a sqlite store's artifacts beside its file
        (MLflow's default, ./mlruns, would be relative to wherever each command runs)."""
        from mlflow.exceptions import MlflowException

        database = _sqlite_path(uri)
        location = (database.parent / "mlartifacts").as_uri() if database is not None else None
        try:
            return self.client.create_experiment(name, artifact_location=location)
        except MlflowException:  # made by a job at once: the name is taken
            found = self.client.get_experiment_by_name(name)
            if found is None:
                raise
            return found.experiment_id

    def branched_from(self, parent: dict) -> None:
        from mlflow.entities import RunTag

        self.client.log_batch(self.id, tags=[RunTag(f"branched_from.{key}", str(v)) for key, v in parent.items()])

    def log(self, row: dict) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        numbers = {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float))}
        metrics = [Metric(key, float(value), now, row["step"]) for key, value in numbers.items()]
        self.client.log_batch(self.id, metrics=metrics)

    def summary(self, facts: dict) -> None:
        self.client.log_dict(self.id, facts, "summary.json")
        for key, value in facts.items():
            self.client.set_tag(self.id, f"model/{key}", value)

    def close(self, failed: bool) -> None:
        self.client.set_terminated(self.id, "FAILED" if failed else "FINISHED")


DEFAULT_STORE = Path("outputs") / "mlflow.db"  # logger=mlflow's database, under the dir the command started in


def mlflow_store(run_dir: Path) -> str:
    """logger=mlflow's tracking URI: MLFLOW_TRACKING_URI when set, else the project's sqlite database (DEFAULT_STORE
    under Hydra's original cwd: one store for every run and sweep job of the project), as an absolute path."""
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    from hydra.core.hydra_config import HydraConfig

    root = Path(HydraConfig.get().runtime.cwd) if HydraConfig.initialized() else Path.cwd()
    return f"sqlite:///{(root / DEFAULT_STORE).resolve()}"


def _sqlite_path(uri: str) -> Path | None:
    return Path(uri.removeprefix("sqlite:///")) if uri.startswith("sqlite:///") else None


@contextlib.contextmanager
def _creating(uri: str) -> Iterator[None]:
    """A sqlite store is created (its schema migrated) by one process at a time: two sweep jobs starting together
    each migrating the same new file fail ("duplicate column name"). A lock file beside the database."""
    database = _sqlite_path(uri)
    if database is None:
        yield
        return
    database.parent.mkdir(parents=True, exist_ok=True)
    with open(database.with_name(database.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _flat(tree: dict, prefix: str = "") -> dict:
    """{"trainer": {"max_steps": 4}} -> {"trainer.max_steps": 4} (lists stay values)."""
    flat: dict = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat |= _flat(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


BACKENDS: dict[str, type[Backend]] = {"wandb": WandbLogger, "tensorboard": TensorBoardLogger, "mlflow": MLflowLogger}
NAMES = ("none", *BACKENDS)  # logger.name's values (config.check)


class Loggers:
    """Rank 0's logger: the file logger and the chosen backend. A context manager: the backend's close() runs
    also when training fails."""

    def __init__(
        self,
        run_dir: Path,
        cfg: DictConfig,
        resume_step: int | None,
        run_id: str | None,
        saved: dict | None = None,
        parent: dict | None = None,
    ):
        """saved: the checkpoint's record of where run_id lives ({"backend", "store"}; None: not recorded).
        parent: the logger run of another run dir's checkpoint this new run branches from (make_logger)."""
        chosen = BACKENDS.get(cfg.logger.name)  # none: the file alone
        self.backends: list[Backend] = [FileLogger(run_dir, cfg, resume_step)]
        self.where: dict | None = None
        if chosen is not None:
            store = getattr(chosen, "store", None)  # a backend of one's own may have none: None
            self.where = {"backend": cfg.logger.name, "store": store(run_dir, cfg) if store else None}
            if run_id is not None and saved is not None and saved != self.where:
                print(
                    f"logger: the checkpoint's run {run_id} is a {saved['backend']} run in {saved['store']}: "
                    f"a new {cfg.logger.name} run in {self.where['store']}",
                    flush=True,
                )
                run_id = None
            backend = chosen(run_dir, cfg, resume_step, run_id)
            if parent is not None and hasattr(backend, "branched_from"):  # a backend of one's own may not record it
                backend.branched_from(parent)
            self.backends.append(backend)

    @property
    def run_id(self) -> str | None:
        """The backend's run id, saved in checkpoints (logger_run_id) so a resumed run continues the same run."""
        return self.backends[-1].run_id

    @property
    def run(self) -> dict | None:
        """What a checkpoint keeps of the backend's run: {"id", "backend", "store"}; None without one."""
        if self.where is None or self.run_id is None:
            return None
        return {"id": self.run_id} | self.where

    def log(self, row: dict) -> None:
        for backend in self.backends:
            backend.log(row)

    def summary(self, facts: dict) -> None:
        for backend in self.backends:
            backend.summary(facts)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *_):
        for backend in self.backends:
            backend.close(failed=exc_type is not None)


class NullLogger:
    """What every rank but 0 gets: logging is a no-op there."""

    run_id = None
    run = None

    def log(self, row: dict) -> None:
        pass

    def summary(self, facts: dict) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *_):
        pass


def make_logger(run_dir: Path, cfg: DictConfig, is_main: bool, resume: dict | None = None) -> Loggers | NullLogger:
    """resume: the checkpoint a run continues from (its path, step and the backend's run id), or None. A checkpoint
    of another run dir is a branch: a new logger run, which records the checkpoint's run as its parent (continuing
    that run would mix two runs' rows in it, and leave this run, with its changed settings, without one)."""
    if not is_main:
        return NullLogger()
    if resume is None:
        return Loggers(run_dir, cfg, None, None)
    step, run_id, saved = resume["progress"]["step"], saved_run_id(resume), resume.get(STORE)
    if Path(resume["path"]).resolve().parent == (Path(run_dir) / "checkpoints").resolve():  # its own
        return Loggers(run_dir, cfg, step, run_id, saved)
    parent = {"run_id": run_id, **(saved or {}), "step": step, "checkpoint": resume["path"]} if run_id else None
    return Loggers(run_dir, cfg, step, None, parent=parent)


def wandb_mode() -> str:
    """WANDB_MODE when set; online with credentials (WANDB_API_KEY or a netrc login); else
    offline, so W&B never prompts for a login (a prompt would hang a batch job)."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    try:
        hosts = netrc.netrc().hosts
    except (OSError, netrc.NetrcParseError):
        hosts = {}
    return "online" if any("wandb" in host for host in hosts) else "offline"


def sweep_identity() -> tuple[str | None, str | None, str | None]:
    """(group, name, job type) of this job's run in a Hydra sweep: the sweep dir groups its
    jobs, the job's overrides name it (e.g. "accumulation.steps=4,trainer.max_steps=100"), and the
    values of the keys the sweep varies are its job type (W&B's 64 characters: the whole name cut
    there would drop a swept key that sorts late); (None, None, None) outside a sweep."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return None, None, None
    hydra = HydraConfig.get()
    name = hydra.job.override_dirname or f"job {hydra.job.num}"
    swept = swept_keys(Path(hydra.sweep.dir) / "multirun.yaml")
    varied = [o for o in hydra.overrides.task if o.split("=", 1)[0].lstrip("+~") in swept]
    return str(hydra.sweep.dir), name, (" ".join(varied) or name)[:64]


def swept_keys(multirun_yaml: Path) -> set[str]:
    """The keys a sweep varies: its command's sweep overrides (`a=1,2`, `b=range(3)`) and its
    sweeper's params, read back from the multirun.yaml Hydra writes before the jobs start."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if not multirun_yaml.exists():
        return set()
    saved = OmegaConf.load(multirun_yaml).hydra
    params = OmegaConf.select(saved, "sweeper.params", default=None) or {}
    overrides = [*saved.overrides.task, *(f"{key}={value}" for key, value in params.items())]
    return {o.key_or_group for o in OverridesParser.create().parse_overrides(overrides) if o.is_sweep_override()}
