"""Checkpoints that resume bit for bit: atomic single-file saves, keep-last-N, auto-resume.

A checkpoint is `checkpoints/step_<N>.pt`, written by rank 0 as `<name>.tmp`, fsynced, then
renamed: the rename is the commit marker, so a crash mid-save leaves the previous checkpoint
as the newest complete one. Old checkpoints are deleted only after the new one is complete.
Files are read with `weights_only=True` (tensors and plain containers only), so everything in
a checkpoint is a tensor or a plain Python value, RNG states included.

torch.distributed.checkpoint is not used for single/DDP: it unpickles its metadata and
non-tensor items with weights_only=False, and DDP's replicated state fits one file.
"""
import os
import re
from pathlib import Path

import torch

from trainkit.config import ConfigError, RunError
from trainkit.dist import Dist
from trainkit.rng import rng_state, set_rng_state

_NAME = re.compile(r"^step_(\d+)\.pt$")


class Checkpointer:
    """Saves every `every` optimizer steps (0: only at the end), keeps the last `keep`."""

    def __init__(self, directory: Path, every: int, keep: int, d: Dist):
        if not isinstance(keep, int) or keep < 1:
            raise ConfigError(f"checkpoint.keep={keep} must be a positive integer (the newest is always kept)")
        if not isinstance(every, int) or every < 0:
            raise ConfigError(f"checkpoint.every={every} must be an integer >= 0 (0: only at the end)")
        self.directory, self.every, self.keep, self.d = Path(directory), every, keep, d

    def due(self, step: int, last_step: int) -> bool:
        return step == last_step or (self.every > 0 and step % self.every == 0)

    def complete(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        if not self.directory.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.directory.iterdir() if (m := _NAME.match(p.name))]
        return [p for _, p in sorted(found)]

    def save(self, step: int, state: dict) -> Path:
        """Rank 0 writes; every rank must call it: `state["ranks"]` (each rank's own part) is
        gathered into a list indexed by rank."""
        state = dict(state, ranks=self.d.gather_object(state["ranks"]))
        path = self.directory / f"step_{step:08d}.pt"
        if self.d.is_main:
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".tmp")
            with open(tmp, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)  # atomic: the checkpoint exists complete, or not at all
            _fsync_dir(self.directory)
            for old in self.complete()[:-self.keep]:
                old.unlink()
        self.d.barrier()  # nobody runs ahead (e.g. to exit) before the checkpoint is complete
        return path

    def load(self, resume) -> dict | None:
        """resume: null (start fresh), auto (newest complete checkpoint here, else fresh) or a
        path. Partial leftovers are reported and removed; an unreadable file falls back to the
        next newest."""
        if resume is None:
            return None
        if resume != "auto":
            path = Path(resume)
            if not path.is_file():
                raise ConfigError(f"checkpoint.resume={resume}: no such checkpoint file")
            return self._read(path)
        if self.directory.is_dir():
            for leftover in self.directory.glob("*.tmp"):
                self.d.print0(f"warning: ignoring the incomplete checkpoint {leftover} (a save was interrupted)")
                if self.d.is_main:
                    leftover.unlink(missing_ok=True)
        for path in reversed(self.complete()):
            try:
                return self._read(path)
            except (RuntimeError, EOFError, OSError) as error:
                self.d.print0(f"warning: skipping unreadable checkpoint {path}: {str(error).splitlines()[0]}")
        return None

    def _read(self, path: Path) -> dict:
        state = torch.load(path, map_location="cpu", weights_only=True)
        state["path"] = str(path)
        return state


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_compatible(saved: dict, current: dict) -> None:
    """Refuse a resume that cannot continue the same run exactly, naming the difference.

    `saved` and `current` map setting names to values (see train.py's `run_identity`)."""
    for key in current:
        if saved.get(key) != current[key]:
            raise ConfigError(f"checkpoint.resume: the checkpoint was written with {key}={saved.get(key)}, "
                              f"this run has {key}={current[key]}; exact resume needs the same "
                              "(start a new run dir, or pass checkpoint.resume=null)")


def load_model(module: torch.nn.Module, state_dict, source) -> None:
    """load_state_dict with a one-line error naming the keys that do not fit (torch's message
    lists every key on its own line)."""
    try:
        module.load_state_dict(state_dict)
    except (RuntimeError, TypeError, AttributeError):
        expected = module.state_dict()
        state_dict = state_dict if isinstance(state_dict, dict) else {}
        problems = {
            "missing": [k for k in expected if k not in state_dict],
            "unexpected": [k for k in state_dict if k not in expected],
            "other shape": [k for k in expected if k in state_dict and hasattr(state_dict[k], "shape")
                            and state_dict[k].shape != expected[k].shape],
        }
        brief = "; ".join(f"{what} {', '.join(keys[:3])}{' ...' if len(keys) > 3 else ''}"
                          for what, keys in problems.items() if keys)
        raise ConfigError(f"{source} does not fit the model: {brief or 'not a state_dict'}") from None


def snapshot(model, optimizer, scheduler, scaler, meter, progress: dict, epoch_generator: torch.Tensor,
             identity: dict, wandb_run_id: str | None) -> dict:
    """Everything an uninterrupted run would still have in memory. `model` is the unwrapped
    module; `epoch_generator` the loader generator's state when this epoch's iterator was made.
    Under "ranks": what differs between ranks (RNG streams, the unreduced loss sums)."""
    if not all(torch.isfinite(p).all() for p in model.parameters()):
        raise RunError(f"refusing to checkpoint non-finite weights at step {progress['step']}")
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(), "progress": dict(progress),
            "loader_generator": epoch_generator, "identity": identity, "wandb_run_id": wandb_run_id,
            "ranks": {"rng": rng_state(), "meter": meter.state_dict()}}


def restore(state: dict, model, optimizer, scheduler, scaler, meter, d: Dist) -> None:
    """Load a checkpoint's state into the objects of a fresh run (`model` unwrapped)."""
    saved_world = len(state["ranks"])
    if saved_world != d.world_size:
        raise ConfigError(f"checkpoint.resume: {state['path']} was written by {saved_world} ranks, this run has "
                          f"{d.world_size}; per-rank RNG streams cannot be mapped exactly (use the same world size)")
    load_model(model, state["model"], state["path"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    scaler.load_state_dict(state["scaler"])
    meter.load_state_dict(state["ranks"][d.rank]["meter"])
    set_rng_state(state["ranks"][d.rank]["rng"])
