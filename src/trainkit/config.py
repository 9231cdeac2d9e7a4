"""Config checks and one-line errors, the OmegaConf resolvers, and the schema Hydra composes with."""

import contextlib
import dataclasses
import datetime
import functools
import importlib.metadata
import os
import re
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hydra.errors import (
    ConfigCompositionException,
    HydraException,
    MissingConfigException,
    OverrideParseException,
)
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    InterpolationResolutionError,
    OmegaConfBaseException,
    UnsupportedInterpolationType,
    ValidationError,
)
from packaging.requirements import Requirement  # named in pyproject (check_torch)
from packaging.version import InvalidVersion, Version

from trainkit import dist, heldout, launch, loggers, optim, options, parent, schema, stop
from trainkit.errors import ConfigError, RankError, RunError, Stopped, user_error
from trainkit.precision import PRECISIONS


def remove_if_empty(directory: Path) -> None:
    """Hydra makes the run dir before the task starts: a refused run leaves none behind."""
    with contextlib.suppress(OSError):
        directory.rmdir()  # only when empty


ERROR_FILE = "error.txt"  # a failed run's (or sweep job's) one-line error, in its run dir


def record_failure(run_dir: Path, error: ConfigError | RunError, sweep: bool) -> None:
    """Rank 0, on a known failure. Refused settings leave no run dir (Hydra made it before the task
    started) and a used one as it was, except in a sweep: there the job's dir keeps the error and
    its overrides, so the sweep's end and scripts/report.py name the job. A run that failed while
    training (RunError) keeps its error beside its metrics."""
    if isinstance(error, ConfigError) and not sweep:
        remove_if_empty(run_dir)
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / ERROR_FILE).write_text(f"{error}\n")
    overrides = run_dir / ".hydra" / "overrides.yaml"
    if sweep and not overrides.exists():
        from hydra.core.hydra_config import HydraConfig

        overrides.parent.mkdir(exist_ok=True)
        OmegaConf.save(HydraConfig.get().overrides.task, overrides)
    if sweep:
        print(f"job failed: {error}", flush=True)  # now, on stdout; stderr gets it at the sweep's end


class SweepErrors(Callback):
    """Hydra callback (conf/hydra/default.yaml): a sweep whose jobs failed ends with one line per
    failed job on stderr and exit status 1. The jobs record their errors (record_failure) and
    return, so the other jobs run: Hydra's basic launcher would stop at the first exception, and
    submitit's launcher reports a failed task as a 40-line traceback."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if "trainkit_search" in str(OmegaConf.select(config, "hydra.sweeper._target_")):
            return  # an Optuna study: a failed trial is one of its results (trainkit.search.sweeper lists them)
        sweep_dir = Path(config.hydra.sweep.dir)
        failed = sorted(sweep_dir.glob(f"*/{ERROR_FILE}"), key=lambda p: (len(p.parent.name), p.parent.name))
        if not failed:
            return
        if dist.env_rank() == 0:
            for path in failed:
                overrides_file = path.parent / ".hydra" / "overrides.yaml"
                overrides = " ".join(OmegaConf.load(overrides_file)) if overrides_file.exists() else ""
                message = path.read_text().strip()
                print(f"error: job {path.parent.name} ({overrides}): {message}", file=sys.stderr, flush=True)
        raise SystemExit(1)  # Hydra catches a callback's exceptions, not SystemExit


@functools.cache
def run_stamp() -> str:
    """A timestamp every rank agrees on, so all torchrun workers share one Hydra run dir.

    Each worker runs @hydra.main and would evaluate ${now:} on its own clock. Under torchrun the
    first worker to ask publishes its stamp in the elastic agent's store (compare_set is atomic)
    and everyone reads it back; the agent's store outlives worker restarts, so a restarted round
    lands in the same dir and can resume. Other launchers: set hydra.run.dir explicitly.
    """
    stamp = datetime.datetime.now().strftime("%Y-%m-%d/%H-%M-%S")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return stamp
    from torch.distributed import TCPStore

    store = TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=datetime.timedelta(seconds=60),
    )
    key = f"trainkit/run_stamp/{os.environ.get('TORCHELASTIC_RUN_ID', '')}"
    return store.compare_set(key, "", stamp).decode()


# use_cache: a submitit task re-resolves hydra.sweep.dir in its own process; the cached stamp
# travels with the pickled config, so every job lands in the launching process's sweep dir.
OmegaConf.register_new_resolver("run_stamp", run_stamp, replace=True, use_cache=True)


def world_size(*, _root_: DictConfig) -> int:
    """${world_size:}: the job's world size, from wherever trainkit takes it (torchrun, submitit, the
    workers parallel.nproc_per_node starts; 1 alone)."""
    return launch.world_size(_root_)


OmegaConf.register_new_resolver("world_size", world_size, replace=True)


def micro_batch(global_batch: int, steps: int | None, world_size: int | str = 1) -> int:
    """${micro_batch:<global batch>,<K>,<world size>}: the per-device batch that keeps the global
    batch fixed whatever K (null: 1) and the world size (conf/experiment/accumulation_sweep.yaml)."""
    per_step = int(steps or 1) * int(world_size)
    if int(global_batch) % per_step:
        raise ConfigError(
            f"micro_batch: the global batch {global_batch} is not a multiple of K x world size = {steps} x {world_size}"
        )
    return int(global_batch) // per_step


OmegaConf.register_new_resolver("micro_batch", micro_batch, replace=True)


def nodes() -> int:
    """${nodes:}: the job's nodes, world size / processes per node (torchrun's LOCAL_WORLD_SIZE,
    submitit's tasks per node); 1 alone. parallel=hsdp's replicas."""
    place = dist.place()
    return max(1, place.world_size // place.local_world_size)


OmegaConf.register_new_resolver("nodes", nodes, replace=True)


def config_groups() -> str:
    """${config_groups:}: the groups a run picks from and their options, for --help (conf/hydra/default.yaml;
    Hydra's $APP_CONFIG_GROUPS lists the schema's groups and conf/shared/ too)."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.object_type import ObjectType

    loader = GlobalHydra.instance().config_loader()
    groups = sorted(set(loader.list_groups("")) - {"hydra", "schema", "shared"})
    return "\n".join(f"  {group}: {', '.join(loader.get_group_options(group, ObjectType.CONFIG))}" for group in groups)


OmegaConf.register_new_resolver("config_groups", config_groups, replace=True)
schema.register()  # the config tree's types, for @hydra.main and hydra.compose alike


def save(cfg: DictConfig, run_dir: Path, files: dict[str, str] | None = None) -> None:
    """Write .hydra/config.yaml (and, under @hydra.main, hydra.yaml and overrides.yaml) as Hydra
    would, and `files` ({name: text}, e.g. a corpus's vocabulary) into the run dir. trainkit writes
    them itself (hydra.output_subdir is null), rank 0 only, once the run is accepted: Hydra would
    write them before the task starts, so a refused resume would overwrite the config of the
    finished run in that dir."""
    from hydra.core.hydra_config import HydraConfig

    directory = Path(run_dir) / ".hydra"
    directory.mkdir(parents=True, exist_ok=True)
    (Path(run_dir) / ERROR_FILE).unlink(missing_ok=True)  # an earlier attempt's error: this one goes on
    OmegaConf.save(cfg, directory / "config.yaml")
    if HydraConfig.initialized():
        hydra_cfg = HydraConfig.get()
        OmegaConf.save(OmegaConf.create({"hydra": hydra_cfg}), directory / "hydra.yaml")
        OmegaConf.save(hydra_cfg.overrides.task, directory / "overrides.yaml")
    for name, content in (files or {}).items():  # a name may hold a folder (a tokenizer's files: tokenizer/...)
        (Path(run_dir) / name).parent.mkdir(parents=True, exist_ok=True)
        (Path(run_dir) / name).write_text(content)


MAX_SEED = 2**32 - 1
STRATEGIES = ("no_sync", "sync_each_batch")
MODES = ("auto", "single", "ddp", "fsdp")
ON_NONFINITE = ("raise", "skip")
COMM_HOOKS = ("none", "fp16", "bf16")  # parallel.comm_hook (DDP gradient compression)
REDUCE_DTYPES = ("fp32", "bf16")  # parallel.reduce_dtype (FSDP)


def _one_of(key: str, value, allowed) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value} is not one of: {', '.join(map(str, allowed))}")


def _positive_int(key: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{key}={value} must be a positive integer")


def _optional_positive(key: str, value) -> None:
    if value is not None:
        _positive(key, value, "null or ")


def _positive(key: str, value, also: str = "") -> None:
    if not _is_number(value) or value <= 0:
        raise ConfigError(f"{key}={value} must be {also}a positive number")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _optional_positive_int(key: str, value) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ConfigError(f"{key}={value} must be null or a positive integer")


def _non_negative(key: str, value, integer: bool = False) -> None:
    kind = "an integer" if integer else "a number"
    if not (isinstance(value, int) if integer else _is_number(value)) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"{key}={value} must be {kind} >= 0")


def check(cfg: DictConfig) -> None:
    """Reject settings that would fail late or train silently wrong, naming the key. First the room options'
    types (trainkit/options.py), in place."""
    _check_known_keys(cfg)
    typed(cfg)
    launch.check(cfg)  # first: ${world_size:} below counts the workers parallel.nproc_per_node starts
    try:  # every interpolation resolves (e.g. model=gpt needs a data set with a vocabulary)
        OmegaConf.to_container(cfg, resolve=True)
    except InterpolationResolutionError as error:
        cause: BaseException | None = error  # a resolver's own ConfigError (e.g. ${micro_batch:}) says it best
        while cause is not None and not isinstance(
            cause, ConfigError | RunError
        ):  # RunError: a store's DataUnavailable
            cause = cause.__cause__ or cause.__context__  # OmegaConf re-raises it wrapped, twice
        text = str(cause) if cause is not None else str(error.msg).splitlines()[0]
        if isinstance(cause, RunError) or re.match(r"[\w.]+=", text):  # it names what it is about (data.path=...)
            raise ConfigError(text) from None
        raise ConfigError(f"{error.full_key}: {text}") from None
    if not 0 <= cfg.seed <= MAX_SEED:  # numpy's range; SeedSequence refuses negative seeds
        raise ConfigError(f"seed={cfg.seed} must be an integer in [0, {MAX_SEED}]")
    _one_of("trainer.precision", cfg.trainer.precision, PRECISIONS)
    _one_of("accumulation.strategy", cfg.accumulation.strategy, STRATEGIES)
    _one_of("parallel.mode", cfg.parallel.mode, MODES)
    _one_of("trainer.on_nonfinite", cfg.trainer.on_nonfinite, ON_NONFINITE)
    _one_of("logger.name", cfg.logger.name, loggers.NAMES)  # trainkit/loggers.py's backends
    loggers.check(cfg)  # the backend's own refusals (e.g. MLflow's file store), before the run dir is written
    batch_size = cfg.data.batch_size
    if batch_size != "auto" and (not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1):
        raise ConfigError(f"data.batch_size={batch_size} must be a positive integer or auto")
    _optional_positive_int("accumulation.steps", cfg.accumulation.steps)
    _positive_int("trainer.epochs", cfg.trainer.epochs)
    _positive_int("trainer.eval_every", cfg.trainer.eval_every)
    _positive_int("trainer.log_every", cfg.trainer.log_every)
    _optional_positive_int("trainer.max_steps", cfg.trainer.max_steps)
    _optional_positive("trainer.clip_grad_norm", cfg.trainer.clip_grad_norm)
    stop.seconds("trainer.max_time", cfg.trainer.max_time)  # a duration with its unit, e.g. 3h50m
    _optional_positive_int("accumulation.global_batch_size", cfg.accumulation.global_batch_size)
    if batch_size == "auto":
        _check_auto(cfg)
    _positive("parallel.timeout_s", cfg.parallel.timeout_s)
    _optional_positive("parallel.bucket_cap_mb", cfg.parallel.bucket_cap_mb)
    _one_of("parallel.comm_hook", cfg.parallel.comm_hook, COMM_HOOKS)
    _one_of("parallel.reduce_dtype", cfg.parallel.reduce_dtype, REDUCE_DTYPES)
    _positive_int("parallel.replicate", cfg.parallel.replicate)
    if cfg.parallel.replicate != 1 and cfg.parallel.mode != "fsdp":  # R replicas of a sharded model: FSDP2's mesh
        raise ConfigError(
            f"parallel.replicate={cfg.parallel.replicate} needs parallel=fsdp (HSDP: R replicas x W/R shards); "
            f"this run has parallel={cfg.parallel.mode}"
        )
    _non_negative("data.num_workers", cfg.data.num_workers, integer=True)
    _optional_positive_int("data.prefetch_factor", cfg.data.get("prefetch_factor"))
    heldout.check(cfg.data)  # data.eval_sets: plain names, nodes with a _target_
    on_device = cfg.data.get("on_device", "auto")  # Any in the schema (no Union of bool and str): checked here
    if on_device != "auto" and not isinstance(on_device, bool):
        raise ConfigError(f"data.on_device={on_device} is not one of: auto, true, false")
    # Values that _target_ constructors would reject with a traceback (or accept silently).
    for key in ("lr", "weight_decay", "momentum"):
        if key in cfg.optim:
            _non_negative(f"optim.{key}", cfg.optim[key])
    for key in ("width", "n_layer", "n_head", "n_embd"):  # the built-in models' sizes
        if key in cfg.model:
            _positive_int(f"model.{key}", cfg.model[key])
    if "n_head" in cfg.model and "n_embd" in cfg.model and cfg.model.n_embd % cfg.model.n_head:
        raise ConfigError(f"model.n_embd={cfg.model.n_embd} must be a multiple of model.n_head={cfg.model.n_head}")
    if "depth" in cfg.model:
        _non_negative("model.depth", cfg.model.depth, integer=True)
    if "dropout" in cfg.model and not (_is_number(cfg.model.dropout) and 0 <= cfg.model.dropout < 1):
        raise ConfigError(f"model.dropout={cfg.model.dropout} must be a number in [0, 1)")
    if "warmup_steps" in cfg.sched:
        _non_negative("sched.warmup_steps", cfg.sched.warmup_steps, integer=True)
    if "min_ratio" in cfg.sched and not (_is_number(cfg.sched.min_ratio) and 0 <= cfg.sched.min_ratio <= 1):
        raise ConfigError(f"sched.min_ratio={cfg.sched.min_ratio} must be a number in [0, 1]")
    optim.check(cfg.optim)  # optim.groups, layer_decay (the names are checked against the model as it is built)
    parent.check(cfg.model.get("init"))  # model.init (the parent itself is read as the model is built)
    for key in cfg.get("parents") or {}:  # an experiment's declared parents (tests make them): real keys
        if OmegaConf.select(cfg, str(key), default=_ABSENT, throw_on_missing=False) is _ABSENT:
            raise ConfigError(f"parents.{key}: there is no setting {key} (a key naming a run, e.g. model.init.from)")
    _check_agreement(cfg)
    if cfg.parallel.mode == "fsdp":
        _check_fsdp(cfg)


_ABSENT = object()


def _check_known_keys(cfg: DictConfig) -> None:
    """The root and the groups trainkit reads itself refuse unknown keys, also added with `+` (Hydra
    opens a typed node for `+key=...`: a misspelt `+trainer.max_step=3` would be ignored). The
    `_target_` groups are left to their constructors, which refuse arguments they do not take."""
    groups = [f.name for f in dataclasses.fields(schema.Train)]  # the root is checked first: these exist
    for path, node in [("", cfg), *((name, cfg[name]) for name in groups)]:
        kind = OmegaConf.get_type(node)
        if not (isinstance(node, DictConfig) and dataclasses.is_dataclass(kind)):
            continue  # an option of one's own (no schema): any keys
        known = [f.name for f in dataclasses.fields(kind)]
        if "_target_" in known:
            continue
        for key in node:
            if key not in known:
                where = f"{path}.{key!s}" if path else str(key)
                raise ConfigError(f"{where} is not a setting of {path or 'the root'}; its settings: {', '.join(known)}")


# (model key, data key, what the model's value must be): a pair that disagrees fails at the first
# forward with an index or shape error; named here instead.
_AGREE = [
    ("vocab_size", "vocab_size", "at least"),
    ("block_size", "block_size", "at least"),
    ("num_classes", "num_classes", "at least"),
    ("in_shape", "shape", "equal to"),
]


def _check_agreement(cfg: DictConfig) -> None:
    """The model fits the data, and the task the data (built-in options; one's own are trusted)."""
    model, data = cfg.model, cfg.data
    for model_key, data_key, relation in _AGREE:
        if model_key not in model or data.get(data_key) is None:
            continue
        mine, theirs = model[model_key], data[data_key]
        ok = mine >= theirs if relation == "at least" else list(mine) == list(theirs)
        if not ok:
            raise ConfigError(
                f"model.{model_key}={_override_text(mine)} must be {relation} data.{data_key}={_override_text(theirs)}"
            )
    for key in ("in_channels", "in_chans"):  # trainkit's models; timm's
        if key in model and data.get("shape") is not None and model[key] != data.shape[0]:
            raise ConfigError(
                f"model.{key}={model[key]} must equal the channels of data.shape={_override_text(data.shape)}"
            )
    if model.get("img_size") is not None and data.get("shape") is not None and model.img_size != data.shape[-1]:
        raise ConfigError(
            f"model.img_size={model.img_size} must equal the size of data.shape={_override_text(data.shape)}"
        )
    options.check(cfg)  # the options' own rules (e.g. task=lm needs a token data set)


def _check_auto(cfg: DictConfig) -> None:
    """data.batch_size=auto (trainkit/autobatch.py): b = global / W, halved where memory runs out."""
    acc, W = cfg.accumulation, world_size(_root_=cfg)
    if acc.global_batch_size is None:
        raise ConfigError("data.batch_size=auto needs accumulation.global_batch_size (it starts at global / W)")
    if acc.steps is not None:
        raise ConfigError(f"data.batch_size=auto sets K itself; accumulation.steps={acc.steps} must be null")
    if not isinstance(acc.global_batch_size, int) or acc.global_batch_size % W:
        raise ConfigError(
            f"data.batch_size=auto: accumulation.global_batch_size={acc.global_batch_size} is not a multiple "
            f"of the world size {W}"
        )
    if cfg.parallel.get("static_graph", False):  # K may grow past 1: see accumulation_steps
        raise ConfigError(
            "data.batch_size=auto is not supported with parallel.static_graph=true (a halving makes K > 1, "
            "which static_graph's no_sync cannot accumulate); set data.batch_size"
        )


def _check_fsdp(cfg: DictConfig) -> None:
    if cfg.trainer.precision == "fp16":
        # GradScaler checks each rank's gradient shard for inf/NaN on its own: ranks would
        # disagree on skipping a step. bf16 needs no scaler.
        raise ConfigError(
            "trainer.precision=fp16 is not supported with parallel=fsdp (GradScaler would decide "
            "per gradient shard); use trainer.precision=bf16"
        )


def accumulation_steps(cfg: DictConfig, world_size: int) -> int:
    """K: accumulation.steps, or derived from accumulation.global_batch_size (both set: they must
    agree, a K silently replaced would train another run than the one named), else 1."""
    global_batch = cfg.accumulation.global_batch_size
    K = cfg.accumulation.steps
    if global_batch is not None:
        per_step = cfg.data.batch_size * world_size
        if global_batch % per_step:
            raise ConfigError(
                f"accumulation.global_batch_size={global_batch} is not a multiple of "
                f"data.batch_size x world size = {cfg.data.batch_size} x {world_size} = {per_step}"
            )
        derived = global_batch // per_step
        if K is not None and derived != K:
            raise ConfigError(
                f"accumulation.steps={K} disagrees with accumulation.global_batch_size={global_batch}: "
                f"{global_batch} / (data.batch_size x world size = {cfg.data.batch_size} x {world_size}) = "
                f"{derived} micro-batches per step; set one of them"
            )
        K = derived
    K = K or 1
    if K > 1 and cfg.accumulation.strategy == "no_sync" and cfg.parallel.get("static_graph", False):
        raise ConfigError(
            f"parallel.static_graph=true with no_sync accumulation (K={K}) hits a torch bug: DDP asserts in the "
            "first no_sync backward (pytorch/pytorch#143580) and, patched, stops syncing (#187732); use K=1 or "
            "accumulation=sync_each_batch"
        )
    return K


def one_job(run: Callable[[], Any], out_dir: Path) -> Any:
    """predict.py's and eval.py's job: run(), a known failure one line from rank 0 (exit 2 for a
    refusal, which leaves no empty output dir; 3 else), no traceback; the process group torn down."""
    try:
        return run()
    except Exception as error:
        if (known := user_error(error)) is None:
            raise
        if isinstance(known, ConfigError) and dist.env_rank() == 0:  # a refused run leaves no empty dir
            remove_if_empty(out_dir)
        dist.fail(str(known), 2 if isinstance(known, ConfigError) else 3)
    finally:
        dist.teardown()


@contextlib.contextmanager
def train_job(run_dir: Path, sweep: bool, timeout_s: float):
    """train.py's job: a known failure is one line from rank 0, no traceback (exit 2 for a refusal, 3 else); a
    sweep's job records it in its dir and returns, so the sweep goes on (SweepErrors names it at the end). A
    stop for a signal or trainer.max_time, after the checkpoint of its step, is not a failure. The process group
    is torn down whatever happens."""
    try:
        yield
    except Stopped as stopped:  # self-launched workers stopped in their start-up: no empty run dir
        stop.exit_stopped(stopped, run_dir)
    except launch.WorkersFailed as failed:  # the workers' root cause, from torch's error files: said once, here
        if not sweep:
            dist.fail(str(failed.error), failed.code)
        record_failure(run_dir, failed.error, sweep)
    except Exception as error:
        if (known := user_error(error)) is not None:
            if dist.env_rank() == 0:
                record_failure(run_dir, known, sweep)
            if not sweep:
                dist.fail(str(known), 2 if isinstance(known, ConfigError) else 3, isinstance(known, RankError))
        elif dist.lost_peer(error):
            dist.fail(
                f"a collective failed, a peer rank died or hangs (parallel.timeout_s={timeout_s:g}): "
                f"{str(error).strip().splitlines()[0][:300]}",
                1,
                peer_failed=True,
            )
        else:
            raise
    finally:
        dist.teardown()


def run_cli(main: Callable[[], Any]) -> None:
    """Call a @hydra.main entry point. A config Hydra cannot compose (a value of the wrong type, an
    unknown option or key, a malformed override) or a `_target_` called with arguments it does not
    take ends like config.check's errors: one line on stderr from rank 0, exit status 2.
    HYDRA_FULL_ERROR=1 shows Hydra's own report with the full traceback instead. A signal before the
    loop watches for it ends the process in one line with 128 + the signal, as does Ctrl-C (130)."""
    stop.stop_at_once()  # SIGTERM, SIGUSR1 from here on: one line, not the default action's silent death
    try:
        check_torch()
    except ConfigError as error:
        _refuse(str(error))
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        main()
        return
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra raises instead of printing its report: we print one line
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C: at once, not at a step boundary (SIGTERM and SIGUSR1 checkpoint first)
        from hydra.core.hydra_config import HydraConfig

        if os.environ.get("RANK", "0") == "0":
            print(f"error: {INTERRUPTED}", file=sys.stderr, flush=True)
            if HydraConfig.initialized():  # Hydra made the run dir before the task started
                remove_if_empty(Path(HydraConfig.get().runtime.output_dir))
        sys.exit(128 + signal.SIGINT)
    except ConfigError as error:  # refused outside a job: e.g. by the sweeper (trainkit.search.sweeper)
        _refuse(str(error))
    except (HydraException, OmegaConfBaseException, ValueError) as error:
        message = _null_group(error) if type(error) is ValueError else _one_line(error)
        if message is None:
            raise
        _refuse(message)


def _refuse(message: str) -> None:
    if os.environ.get("RANK", "0") == "0":  # every rank fails alike: say it once
        print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


PACKAGE = __name__.partition(".")[0]  # trainkit (a renamed fork's own name)


def check_torch() -> None:
    """An installed torch below pyproject.toml's floor: one line at start, not an AttributeError deep in a run.
    A pre-release or source build of the floor's release (2.11.0a0+git...) passes: its number sorts below 2.11."""
    import torch

    required = torch_requirement()
    try:
        release = Version(str(torch.__version__)).base_version  # 2.11.0+cu130 -> 2.11.0
    except InvalidVersion:
        return  # a build that names itself otherwise: nothing to compare
    if required is not None and not required.specifier.contains(release, prereleases=True):
        raise ConfigError(
            f"torch {torch.__version__} is installed; {PACKAGE} needs {required}: pip install -U '{required}' "
            "(a CUDA build: pytorch.org's command for your CUDA version; constraints.txt names the tested release)"
        )


def torch_requirement() -> Requirement | None:
    """pyproject.toml's `torch>=...`, as the installed package's metadata states it, else (a checkout run without
    `pip install`) as pyproject.toml itself does; None where neither can be read."""
    try:
        requirements = importlib.metadata.requires(PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        requirements = _source_requirements()
    found = (Requirement(text) for text in requirements)
    return next((r for r in found if r.name == "torch" and r.marker is None), None)


def _source_requirements() -> list[str]:
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    try:
        import tomllib  # Python 3.11
    except ImportError:
        return []
    if not pyproject.is_file():
        return []
    return tomllib.loads(pyproject.read_text())["project"].get("dependencies", [])


INTERRUPTED = "stopped by SIGINT (Ctrl-C); the steps since the newest checkpoint are lost (SIGTERM checkpoints first)"


_WANTED = {  # OmegaConf's type errors -> what the key takes
    "converted to Integer": "an integer",
    "converted to Float": "a number",
    "converted to Boolean": "true or false",
    "not a valid bool": "true or false",
    "to string": "a string",
    "ListConfig, list or tuple": "a list",
    "type hint 'typing.List": "a list",  # a yaml's value where the schema has a list, e.g. a parent's overrides
    "to Dict[": "a dict",  # e.g. an experiment's `parents: model.init.from`
    "is not Optional": "set (not null)",
}


def typed(cfg: DictConfig) -> None:
    """options.typed, a refused value in one line (as Hydra's own refusals of the schema's groups)."""
    try:
        options.typed(cfg)
    except (ValidationError, ConfigKeyError, ConfigAttributeError) as error:
        raise ConfigError(_refusal(error) or str(error).splitlines()[0]) from None


def _one_line(error: BaseException) -> str | None:
    """The key, the value and what is allowed, from Hydra's and OmegaConf's exceptions."""
    if isinstance(error, MissingConfigException) and error.options and error.missing_cfg_file:
        group, _, name = error.missing_cfg_file.rpartition("/")
        return f"{group}={name} is not one of: {', '.join(error.options)}"
    if (unquoted := _sweep_in_dict(error)) is not None:
        return unquoted
    if (refused := _refusal(error.__cause__)) is not None:
        return refused
    if (refused := _refused_in_a_yaml(error)) is not None:
        return refused
    if isinstance(error, ConfigCompositionException | OverrideParseException):
        return " ".join(str(error).split("\n")[0].split())
    if isinstance(error, UnsupportedInterpolationType):  # e.g. --cfg job --resolve: before the options load
        return (
            f"${{{str(error).split()[-1]}:...}}: no such resolver is registered yet (an option's module registers its "
            "own as the run loads it; `--cfg job` without --resolve prints the config)"
        )
    return None


_COMPOSING = re.compile(r"In '(.+?)': \w+ raised while composing config:")


def _refused_in_a_yaml(error: BaseException) -> str | None:
    """A wrong type inside a yaml (an experiment's `trainer: {max_steps: abc}`): Hydra names the file in its first
    line and OmegaConf's refusal only below it, raised while handling the refusal (its __context__, not __cause__)."""
    where = _COMPOSING.match(str(error)) if isinstance(error, ConfigCompositionException) else None
    if where is None or (refused := _refusal(error.__context__)) is None:
        return None
    return f"In '{where.group(1)}': {refused}"


def _null_group(error: ValueError) -> str | None:
    """`logger=null`, `hydra/sweeper/pruner=null`: Hydra's ValueError ("Config group override must be a string or a
    list. Got NoneType") names neither the group nor its options; the frame that raised it holds both."""
    from hydra.core.object_type import ObjectType

    traceback = error.__traceback__
    while traceback is not None and traceback.tb_next is not None:
        traceback = traceback.tb_next
    found = traceback.tb_frame.f_locals if traceback is not None else {}
    override, repo = found.get("override"), found.get("repo")
    if "Got NoneType" not in str(error) or override is None or repo is None:
        return None
    group = override.key_or_group
    options = repo.get_group_options(group, ObjectType.CONFIG)
    said = f"{group}=null: a config group takes one of its options' names ({', '.join(options)})"
    if "none" in options:
        return f"{said}; {group}=none turns it off"
    if group.startswith("hydra/"):  # a node of hydra's own that may be null (the sweeper's pruner)
        return f"{said}; {group.replace('/', '.')}=null turns it off"
    return said


def _sweep_in_dict(error: BaseException) -> str | None:
    """`'hydra.sweeper.params={model.width:choice(32,64)}'`: Hydra parses the choice into a sweep object, which
    OmegaConf cannot hold (its `tags=set(): Unexpected type annotation` named neither)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import Sweep

    cause = error.__cause__
    kind = getattr(cause, "object_type", None)
    if not (isinstance(error, ConfigCompositionException) and isinstance(kind, type) and issubclass(kind, Sweep)):
        return None
    line = str(error).removeprefix("Error merging override ").strip()
    try:
        (override,) = OverridesParser.create().parse_overrides([line])
    except Exception:
        return None
    value = override.value()
    swept = {k: v for k, v in value.items() if isinstance(v, Sweep)} if isinstance(value, dict) else {}
    if not swept:
        return None
    key, sweep = next(iter(swept.items()))
    written = re.search(rf"{re.escape(str(key))}\s*:\s*((?:choice|range|interval|tag|shuffle|glob)\(.*?\))[,}}]", line)
    text = written.group(1) if written else type(sweep).__name__
    function = text.split("(")[0]
    quoted = line.replace(text, f'"{text}"', 1)
    return (
        f"{line}: {function}(...) inside a dict is no value; quote it ('{quoted}') or give it as its own override "
        f"(-m {key}={text})"
    )


def _refusal(cause: BaseException | None) -> str | None:
    """OmegaConf's refusal of a key or a value, as `key=value must be ...` or `key is not a setting of ...`."""
    if isinstance(cause, ConfigKeyError | ConfigAttributeError) and cause.full_key:
        parent = cause.full_key.rpartition(".")[0] or "the root"
        keys = list(cause.parent_node.keys()) if isinstance(cause.parent_node, DictConfig) else []
        return f"{cause.full_key} is not a setting of {parent}; its settings: {', '.join(map(str, keys))}"
    if isinstance(cause, ValidationError) and cause.full_key:
        text = str(cause.msg).splitlines()[0]
        wanted = next((kind for pattern, kind in _WANTED.items() if pattern in text), None)
        value = _override_text(cause.value)
        return f"{cause.full_key}={value} must be {wanted}" if wanted else f"{cause.full_key}={value}: {text}"
    return None


def _override_text(value: Any) -> str:
    if isinstance(value, list | tuple | ListConfig):
        return "[" + ",".join(map(_override_text, value)) + "]"
    return "null" if value is None else str(value)
