"""Metrics from rank 0 only: metrics.jsonl in the run dir, the console, and W&B."""
import json
import netrc
import os
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf


class MetricsLogger:
    """Rank 0's logger. Use as a context manager: W&B's finish() runs even when training fails."""

    def __init__(self, run_dir: Path, cfg: DictConfig):
        self.file = open(Path(run_dir) / "metrics.jsonl", "a")
        self.wandb = _start_wandb(run_dir, cfg) if cfg.logger.name == "wandb" else None

    def log(self, row: dict) -> None:
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in row.items() if k != "step"}, step=row["step"])

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *_):
        self.file.close()
        if self.wandb is not None:
            self.wandb.finish(exit_code=0 if exc_type is None else 1)


class NullLogger:
    """What every rank but 0 gets: logging is a no-op there."""

    def log(self, row: dict) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *_):
        pass


def make_logger(run_dir: Path, cfg: DictConfig, is_main: bool):
    return MetricsLogger(run_dir, cfg) if is_main else NullLogger()


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


def _start_wandb(run_dir: Path, cfg: DictConfig):
    import wandb

    return wandb.init(project=cfg.logger.project, entity=cfg.logger.entity, group=cfg.logger.group,
                      tags=list(cfg.logger.tags), dir=str(run_dir), mode=wandb_mode(),
                      config=OmegaConf.to_container(cfg, resolve=True))


class TrainMeter:
    """Sums since the last log row, kept as device tensors so the loop never waits on .item():
    the one host sync (and the one all-reduce of the loss) happens when a row is written."""

    def __init__(self, d, comm):
        self.d, self.comm = d, comm
        self.samples = 0
        self._reset()

    def _reset(self):
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=self.d.device)
        self.norm_sum = torch.zeros((), dtype=torch.float64, device=self.d.device)
        self.steps = self.window_samples = 0
        self.syncs, self.bytes = self.comm.syncs, self.comm.bytes
        self.started = time.perf_counter()

    def add_micro_step(self, loss_sum: torch.Tensor) -> None:
        """loss_sum: this rank's summed per-sample loss of one micro-batch (padding weighs 0)."""
        self.loss_sum += loss_sum.detach()

    def add_step(self, grad_norm: torch.Tensor, samples: int) -> None:
        """grad_norm: the global pre-clip norm; samples: the window's real samples, all ranks."""
        self.norm_sum += grad_norm.detach()
        self.steps += 1
        self.window_samples += samples
        self.samples += samples

    def row(self) -> dict:
        """Means since the last row; an all-reduce, so every rank must call it at the same step."""
        loss = self.d.all_reduce_sum(self.loss_sum).item() / self.window_samples
        elapsed = time.perf_counter() - self.started
        row = {"loss": loss, "grad_norm": self.norm_sum.item() / self.steps, "samples": self.samples,
               "comm/grad_syncs": (self.comm.syncs - self.syncs) / self.steps,
               "comm/grad_bytes": (self.comm.bytes - self.bytes) / self.steps,
               "samples_per_s": self.window_samples / elapsed}
        self._reset()
        return row
