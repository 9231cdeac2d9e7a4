"""The config tree's schema, registered in Hydra's ConfigStore: Hydra checks every value's type as it
composes the config, so `model.width=abc` or a misspelt key is refused before anything runs.
Ranges and rules between keys are config.check's.

The groups trainkit reads itself (trainer, checkpoint, accumulation, parallel, logger) are typed
nodes of the root schema. optim and sched are `_target_` nodes whose keys are a constructor's
arguments: each built-in option names its schema in its yaml (`defaults: [/schema/optim/sgd@_here_,
_self_]`). model, data and task are the rooms' options: their schemas live beside their code
(trainkit/models, data, tasks) and trainkit/options.py types them as the run starts; `Data` below is
the base of every data set's schema: the keys the engine reads.
"""

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf


@dataclass
class EarlyStopping:
    patience: int | None = None  # null: off; N evaluations without an improvement of checkpoint.monitor
    min_delta: float = 0.0  # an improvement is by more than this


@dataclass
class EMA:
    decay: float | None = None  # null: off; e.g. 0.999


@dataclass
class Profile:
    steps: list[int] | None = None  # null: off | [first, last] optimizer steps, both included (trainkit/profile.py)
    warmup: int = 1  # steps traced before the window and discarded
    top: int = 15  # operators in the table rank 0 prints
    record_shapes: bool = False
    profile_memory: bool = False  # allocations in the trace; CUDA: memory history from the start, a dump on OOM
    with_stack: bool = False


@dataclass
class Trainer:
    epochs: int = 20
    max_steps: int | None = None
    clip_grad_norm: float | None = 1.0
    precision: str = "fp32"
    device: str = "auto"
    eval_every: int = 200
    log_every: int = 50
    on_nonfinite: str = "raise"
    compile: Any = False  # false | true | default | reduce-overhead | max-autotune | max-autotune-no-cudagraphs
    tf32: bool = True  # CUDA: fp32 matrix products and convolutions on TF32 tensor cores (trainkit/precision.py)
    deterministic: bool = False  # deterministic kernels, cuBLAS's workspace, cuDNN's flags (trainkit/determinism.py)
    test: bool = True  # at the end: the best (else last) weights on the test split
    early_stopping: EarlyStopping = field(default_factory=EarlyStopping)
    ema: EMA = field(default_factory=EMA)
    max_time: str | None = None  # a wall-clock budget of this process, e.g. 3h50m: checkpoint and stop
    profile: Profile = field(default_factory=Profile)


class Checkpoint:
    every: int = 200
    keep: int = 2
    resume: str | None = "auto"
    monitor: str | None = "auto"  # auto: the task's (val/acc; lm: val/loss) | an evaluation key | null: no best
    mode: str = "auto"  # auto: from the key (loss, bpc: min; else max) | max | min


# checkpoint.async (written in the background: trainkit/checkpoint.py), read as cfg.checkpoint["async"]: a keyword
# cannot be declared by syntax, so the field joins before @dataclass; no generated __init__/__repr__/__eq__, whose
# code would name it (OmegaConf reads the fields and their defaults, Train's default_factory the class attributes).
Checkpoint.__annotations__["async"] = bool
setattr(Checkpoint, "async", False)
Checkpoint = dataclass(init=False, repr=False, eq=False)(Checkpoint)  # type: ignore[misc]


@dataclass
class Accumulation:
    strategy: str = "no_sync"
    steps: int | None = None  # null: 1, or derived from global_batch_size
    global_batch_size: int | None = None


@dataclass
class Parallel:
    mode: str = "auto"
    backend: str = "auto"
    timeout_s: float = 600
    sync_bn: bool = False
    bucket_cap_mb: float | None = None  # DDP
    comm_hook: str = "none"  # DDP
    static_graph: bool = False  # DDP
    reduce_dtype: str = "fp32"  # FSDP
    shard_units: list[str] | None = None  # FSDP
    reshard_after_forward: bool = True  # FSDP
    replicate: int = 1  # FSDP: R > 1 is HSDP (R replicas x W/R shards)
    nproc_per_node: Any = None  # null (one process) | N | auto: the workers train.py starts itself
    max_restarts: int = 0  # restarts of those workers, resuming from the newest checkpoint


@dataclass
class Logger:
    name: str = "none"  # none | a backend of trainkit/loggers.py (wandb, tensorboard, ...)
    project: str = "trainkit"
    entity: str | None = None
    group: str | None = None
    tags: list[str] = field(default_factory=list)


@dataclass
class Limit:
    """debug.limit: the fraction of each split kept, in (0, 1]; 1: all of it (trainkit/debug.py)."""

    train: float = 1.0
    val: float = 1.0
    test: float = 1.0


@dataclass
class Debug:
    """The debug=<mode> section (conf/debug/, trainkit/debug.py); off by default."""

    mode: str | None = None  # the debug=<name> that set this section, for the lines the run prints
    set: dict[str, Any] = field(default_factory=dict)  # settings applied over the composed config's (an experiment's)
    limit: Limit = field(default_factory=Limit)
    eval_batches: int | None = None  # null: off | val and test: at most N global batches of samples
    overfit: bool = False  # train, val and test: one global batch of the train split
    anomaly: bool = False  # torch.autograd anomaly detection: the backward function that made a NaN is named


@dataclass
class Train:
    """The root (conf/train.yaml)."""

    seed: int = 0
    model: Any = MISSING
    data: Any = MISSING
    optim: Any = MISSING
    sched: Any = MISSING
    task: Any = MISSING
    trainer: Trainer = field(default_factory=Trainer)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    accumulation: Accumulation = field(default_factory=Accumulation)
    parallel: Parallel = field(default_factory=Parallel)
    logger: Logger = field(default_factory=Logger)
    debug: Debug = field(default_factory=Debug)
    # What an experiment builds on: {key naming a finished run: [overrides of a run that stands in for it]}, e.g.
    # {task.teacher.from: [model=cnn]}. Read by no run; tests make such a run for every experiment (a fork's too).
    parents: dict[str, list[str]] = field(default_factory=dict)


# The options of optim (the engine's group; sched= is a room: trainkit/schedules/). Required arguments: MISSING
# (the yaml sets them).


@dataclass
class AdamW:
    _target_: str = MISSING
    _partial_: bool = True
    lr: float = 1e-3
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # torch's default
    eps: float = 1e-8  # torch's default: added to sqrt(v), the floor under a parameter's step size
    decay_norms_and_biases: bool = True  # false: no weight decay for parameters of < 2 dims (trainkit/optim.py)
    # Parameter groups by name (trainkit/optim.py): [{params: <glob>, lr_scale, weight_decay, frozen}, ...]
    groups: list[Any] = field(default_factory=list)
    layer_decay: float | None = None  # lr x d^(L - layer) for a model with a layer order (GPT, timm)
    frozen_batchnorm: str = "eval"  # eval: BatchNorm whose parameters are all frozen keeps its statistics | train
    fused: Any = "auto"  # auto: the fused kernel on CUDA, torch's choice elsewhere | true | false (trainkit/optim.py)
    compile: bool = False  # the optimizer step compiled (torch.compile), its lr a tensor (trainkit/optim.py)


@dataclass
class SGD:
    _target_: str = MISSING
    _partial_: bool = True
    lr: float = 0.1
    momentum: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False
    decay_norms_and_biases: bool = True  # false: no weight decay for parameters of < 2 dims (trainkit/optim.py)
    # Parameter groups by name (trainkit/optim.py): [{params: <glob>, lr_scale, weight_decay, frozen}, ...]
    groups: list[Any] = field(default_factory=list)
    layer_decay: float | None = None  # lr x d^(L - layer) for a model with a layer order (GPT, timm)
    frozen_batchnorm: str = "eval"  # eval: BatchNorm whose parameters are all frozen keeps its statistics | train
    fused: Any = "auto"  # auto: the fused kernel on CUDA, torch's choice elsewhere | true | false (trainkit/optim.py)
    compile: bool = False  # the optimizer step compiled (torch.compile), its lr a tensor (trainkit/optim.py)


@dataclass
class Muon:
    """optim=muon (trainkit/muon.py): torch's Muon for the hidden matrices, AdamW for the rest."""

    _target_: str = MISSING
    _partial_: bool = True
    lr: float = 1e-3  # both sides' (Muon's through adjust_lr_fn)
    weight_decay: float = 0.1  # both sides'
    momentum: float = 0.95  # Muon's (torch's default)
    nesterov: bool = True
    ns_steps: int = 5  # Newton-Schulz iterations
    adjust_lr_fn: str | None = "match_rms_adamw"  # | original | spectral_unclamped (torch.optim.Muon's)
    momentum_warmup: int = 0  # steps from momentum_start to momentum (0: off)
    momentum_start: float = 0.85
    adamw_lr_scale: float = 1.0  # the AdamW side's lr: optim.lr x this
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # the AdamW side's
    adamw_eps: float = 1e-8
    decay_norms_and_biases: bool = True  # false: no weight decay for parameters of < 2 dims (trainkit/optim.py)
    # Parameter groups by name (trainkit/optim.py): [{params: <glob>, lr_scale, weight_decay, frozen, optimizer}]
    groups: list[Any] = field(default_factory=list)
    layer_decay: float | None = None  # lr x d^(L - layer) for a model with a layer order (GPT, timm)
    frozen_batchnorm: str = "eval"  # eval: BatchNorm whose parameters are all frozen keeps its statistics | train
    fused: Any = "auto"  # the AdamW side's kernel: auto (fused on CUDA) | true | false (trainkit/optim.py)
    compile: bool = False  # the optimizer step compiled (torch.compile), its lr a tensor (trainkit/optim.py)


@dataclass
class Data:
    """The keys the engine reads from every data set (a data set's Schema subclasses it); `splits` builds its
    (train, val, test) datasets (a data set of one's own may return (train, val): it has no test split)."""

    name: str = MISSING
    splits: Any = MISSING
    shape: list[int] | None = None  # one sample's input shape (classification)
    num_classes: int | None = None
    batch_size: Any = MISSING  # per-device micro-batch, or auto (config.check: no Union in a structured config)
    drop_last: bool = False
    shuffle: bool = True  # false: every epoch in the data set's order (global window s: samples s·B to (s+1)·B-1)
    num_workers: int = 0
    pin_memory: bool = True  # with CUDA: page-locked batches, copied to the GPU asynchronously
    prefetch_factor: int | None = None  # with workers: batches loaded ahead per worker (null: torch's 2)
    on_device: Any = "auto"  # auto | true | false: the train split on the device, batches by index (config.check)
    # {name: a node whose _target_ returns what `splits` returns}: each val split evaluated beside val as
    # val/<name>/*, its test split tested as test/<name>/* (trainkit/heldout.py)
    eval_sets: dict[str, Any] = field(default_factory=dict)


def register() -> None:
    """Put the schemas in Hydra's ConfigStore (before @hydra.main composes)."""
    store = ConfigStore.instance()
    store.store(name="train_schema", node=Train)
    options: dict[str, dict[str, type]] = {
        "optim": {"adamw": AdamW, "sgd": SGD, "muon": Muon},
    }
    for group, nodes in options.items():
        for name, node in nodes.items():
            store.store(group=f"schema/{group}", name=name, node=node)
    # data.eval_sets' {} (conf/shared/data.yaml's defaults) open to new keys: `data.eval_sets={extra: ...}` and
    # `data.eval_sets.extra=...` add a set without `+` (Hydra merges an override into a closed {}: refused)
    names = OmegaConf.create({})
    OmegaConf.set_struct(names, False)
    store.store(group="schema/data", name="eval_sets", node=names)
