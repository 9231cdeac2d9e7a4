"""A frozen teacher beside the model, for distillation: `task.teacher.from=<run dir>` (and
`task.teacher.weights=last|best|ema`). A task whose config holds a `teacher` node gets, as its constructor's
`teacher` argument, the module built from that run (trainkit/parent.py: the run's own model config, its
weights loaded strictly) instead of the node: frozen (eval mode, no gradients, its forward under no_grad,
whatever the loop does with the model), on the device, never wrapped by DDP / FSDP (each rank holds the whole
of it: a forward needs no collective), never in a checkpoint or model.pt (it is no part of the model).

Where it is read: a fresh run reads task.teacher.from and, once the run is accepted, copies it into its run dir
(`teacher/`: the weights, the config, the parent's provenance.json); a resume, eval.py and predict.py read
that copy, so they work when the teacher's own dir is gone. Every rank reads the same file: the weights are
small beside the model's, and no rank waits on another's broadcast."""

import shutil
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn

from trainkit.errors import ConfigError
from trainkit.parent import Parent

COPY = "teacher"  # the run dir's copy of its teacher
KEYS = ("from", "weights")
# What a teacher's inputs and outputs are, by its run's config: a run of other data reads other inputs (a traceback
# at its first forward) or gives other classes (a refusal only at the first step, after the run dir was written).
DATA_KEYS = ("name", "shape", "num_classes")


class Frozen(nn.Module):
    """The teacher as the task sees it: always in eval mode (train() leaves it there), no parameter requires a
    gradient, and its forward runs under no_grad. `parent`: the run it was built from (trainkit/parent.py)."""

    def __init__(self, module: nn.Module, parent: Parent):
        super().__init__()
        self.module = module.requires_grad_(False)
        self.parent = parent
        self.train(False)  # the wrapper too (nn.Module starts in training mode): it says what its modules are

    def train(self, mode: bool = True) -> "Frozen":
        return super().train(False)  # BatchNorm's running statistics, dropout off: a fixed function

    def forward(self, *args, **kwargs):
        with torch.no_grad():
            return self.module(*args, **kwargs)


def node(task_cfg: DictConfig) -> DictConfig | None:
    """The task's `teacher` node, None when it has none (or it is null)."""
    found = task_cfg.get("teacher") if isinstance(task_cfg, DictConfig) else None
    return found if isinstance(found, DictConfig) else None


def check_data(parent: Parent, data: DictConfig, source: Path) -> None:
    """The teacher ran on this run's data: its config's data.name, data.shape (what it reads) and
    data.num_classes (what it outputs) are this run's; else one line naming both, before the run writes anything
    (a task that needs its teacher's outputs to fit the model's, as task=distil, gets them in a task of the same
    data: the data decides the model's inputs and outputs)."""
    if parent.config is None:  # a weights file: build_model refuses it
        return
    nodes = (parent.config.get("data") or OmegaConf.create(), data)  # the teacher's cfg.data, this run's
    ran, runs = ({k: _plain(OmegaConf.select(node, k, default=None)) for k in DATA_KEYS} for node in nodes)
    if ran != runs:
        said = lambda d: f"data={d['name']} (data.shape={d['shape']}, data.num_classes={d['num_classes']})"  # noqa: E731
        raise ConfigError(
            f"{parent.key}.from={source}: the teacher ran on {said(ran)}, this run is on {said(runs)}: "
            "the teacher must be a run of the same data"
        )


def _plain(value):
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def build_task(
    task_cfg: DictConfig, run_dir: Path | None, device: torch.device, own: bool, data: DictConfig | None = None
) -> tuple[Any, Frozen | None]:
    """The task (instantiate(cfg.task)) and its frozen teacher on `device` (None without one). own: read the run
    dir's copy where it has one (a resume; eval.py and predict.py on the run), else task.teacher.from. data: this
    run's cfg.data, which the teacher's run must share (check_data); train.py checks it, before it writes."""
    wanted = node(task_cfg)
    if wanted is None:
        return instantiate(task_cfg), None
    if unknown := sorted(set(map(str, wanted)) - set(KEYS)):
        raise ConfigError(f"task.teacher.{unknown[0]}: not a key of task.teacher (its keys: {', '.join(KEYS)})")
    if OmegaConf.is_missing(wanted, "from") or wanted.get("from") is None:
        raise ConfigError("task.teacher.from is required: the run dir of a finished run (its model.pt), the teacher")
    copy = Path(run_dir) / COPY if run_dir is not None else None
    source = copy if own and copy is not None and copy.is_dir() else Path(str(wanted["from"]))
    parent = Parent.open(source, weights=str(wanted.get("weights", "last")), key="task.teacher")
    if data is not None:
        check_data(parent, data, source)
    frozen = Frozen(parent.build_model(), parent).to(device)
    return instantiate(task_cfg, teacher=frozen), frozen


def keep(frozen: Frozen | None, run_dir: Path) -> None:
    """Rank 0, once the run is accepted: the teacher copied into the run dir (unless read from there), with its
    run's provenance.json, so that a resume, eval.py and predict.py need nothing outside the run dir."""
    if frozen is None:
        return
    copy = Path(run_dir) / COPY
    if frozen.parent.run_dir is None or Path(frozen.parent.run_dir).resolve() == copy.resolve():
        return
    frozen.parent.copy_into(copy)  # atomic; an earlier attempt's copy replaced
    if (record := Path(frozen.parent.run_dir) / "provenance.json").is_file() and not (copy / record.name).exists():
        shutil.copy2(record, copy / record.name)
