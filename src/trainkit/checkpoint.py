"""Checkpoints that resume bit for bit: atomic saves, keep-last-N, auto-resume.

Single / DDP: `checkpoints/step_<N>.pt`, written by rank 0 as `<name>.tmp`, fsynced, then
renamed. FSDP: the directory `checkpoints/step_<N>/`, written as `step_<N>.tmp/`: every rank
writes its shards of the model, optimizer and EMA state with torch.distributed.checkpoint (DCP,
whose `.metadata`, written last by rank 0, commits the shard files), rank 0 adds `state.pt`
(everything else) and renames the directory. Either way the rename is the commit marker, so a
crash mid-save leaves the previous checkpoint as the newest complete one. Old checkpoints are
deleted only after the new one is complete. `.pt` files are read with `weights_only=True`
(tensors and plain containers only), so everything in them is a tensor or a plain Python
value, RNG states included.

DCP is not used for single/DDP by default: it unpickles its `.metadata` (and non-tensor items)
without weights_only, and DDP's replicated state fits one file. Resume DCP checkpoints you trust only.

checkpoint.async=true: every mode writes DCP directories, through DCP's async_save. The step waits while
the state is copied to host memory; the write runs in a background thread; rank 0 renames the directory
as soon as it completed on every rank (single/DDP: rank 0 alone writes, as the file). One write is in
flight at a time: the next save waits for it (a best of the same step's state is that write, hard-linked),
and so do the run's end and a save the run stops after.
A write that fails is said in one line and removed; the previous checkpoint stays the newest.
"""

import math
import os
import pickle
import re
import shutil
import threading
import warnings
from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path
from typing import cast

import numpy as np
import torch
import torch.distributed as tdist
import torch.distributed.checkpoint as dcp
from omegaconf import DictConfig, OmegaConf
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from trainkit import options
from trainkit.dist import Dist
from trainkit.errors import ConfigError, RunError
from trainkit.rng import rng_state, seed_all, set_rng_state

_NAME = re.compile(r"^step_(\d+)(\.pt)?$")
# DCP without a process group (one process; rank 0 alone under checkpoint.async in single/DDP) says it assumes
# one process at every save and load: what is meant, said at every checkpoint.
warnings.filterwarnings("ignore", "torch.distributed is disabled, unavailable or uninitialized", UserWarning)


def step_name(step: int, sharded: bool = False) -> str:
    """A step's checkpoint name: `step_00000012.pt` (one file), `step_00000012` (FSDP's DCP directory).
    Zero-padded, so names sort by step; parse_step reads it back (scripts/compare_runs.py too)."""
    return f"step_{step:08d}{'' if sharded else '.pt'}"


def parse_step(name: str, sharded: bool | None = None) -> int | None:
    """The step of a checkpoint name (step_name's inverse), None for any other name (best.pt, a .tmp);
    sharded: only directory names (True), only file names (False), either (None)."""
    match = _NAME.match(name)
    if match is None or (sharded is not None and sharded == bool(match.group(2))):
        return None
    return int(match.group(1))


# The entries of a state that hold DTensors under FSDP: each rank writes its shards (DCP); the EMA's "ema".
SHARDED = ("model", "optimizer", "ema")


def complete(directory: Path) -> list[Path]:
    """The complete checkpoints in `directory` (files and DCP directories), oldest first."""
    if not directory.is_dir():
        return []
    found = [
        (step, p)
        for p in directory.iterdir()
        if (step := parse_step(p.name, sharded=p.is_dir())) is not None and (p.is_file() or p.is_dir())
    ]
    return [p for _, p in sorted(found)]


class Checkpointer:
    """Saves every `every` optimizer steps (0: only at the end), keeps the last `keep`.
    sharded: FSDP's layout (a DCP directory per checkpoint) instead of one file. background
    (checkpoint.async): DCP directories in every mode, written by DCP's async_save in a thread;
    `with checkpointer:` waits for the write in flight whatever ends the block (timeout_s: its collectives')."""

    def __init__(
        self,
        directory: Path,
        every: int,
        keep: int,
        d: Dist,
        sharded: bool = False,
        background: bool = False,
        timeout_s: float = 600,
    ):
        if not isinstance(keep, int) or keep < 1:
            raise ConfigError(f"checkpoint.keep={keep} must be a positive integer (the newest is always kept)")
        if not isinstance(every, int) or every < 0:
            raise ConfigError(f"checkpoint.every={every} must be an integer >= 0 (0: only at the end)")
        self.directory, self.every, self.keep, self.d, self.sharded = Path(directory), every, keep, d, sharded
        self.unreadable: set[str] = set()  # names load() skipped as damaged
        self.background, self.directories = background, sharded or background  # directories: the DCP layout
        self.writing: Write | None = None  # the background write in flight (every rank knows of it)
        self.lost: str | None = None  # why the newest step's background write failed (cleared by the next)
        # The background write's collectives on a group of their own: on the training's group they could interleave
        # with the main thread's (a mismatch, a hang). Gloo: DCP's async_save needs a CPU backend (NCCL: refused).
        self.group: tdist.ProcessGroup | None = None
        if background and d.distributed:  # every rank builds the Checkpointer at the same point
            self.group = cast(tdist.ProcessGroup, tdist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s)))

    @classmethod
    def of(cls, cfg: DictConfig, run_dir: Path, d: Dist, mode: str) -> "Checkpointer":
        """The run's Checkpointer from its config (checkpoint.*; parallel.timeout_s bounds a background write)."""
        c = cfg.checkpoint
        return cls(run_dir / "checkpoints", c.every, c.keep, d, mode == "fsdp", c["async"], cfg.parallel.timeout_s)

    def complete(self) -> list[Path]:
        """Complete checkpoints (files and DCP directories), oldest first."""
        return complete(self.directory)

    def save(self, step: int, state: dict, last: bool = False) -> Path:
        """Every rank must call it: `state["ranks"]` (each rank's own part) is gathered into a
        list indexed by rank; rank 0 writes it (and, unless sharded, everything else). In the
        background: after the previous write completed; `last`: the run stops after it, so it waits
        for this write too (RunError if it failed)."""
        self.wait()  # one write in flight: the previous one's commit (and rotation) first
        path = self._write(self.directory / step_name(step, self.directories), state)
        if self.background:
            if last:
                self.finish()
            return path
        if self.d.is_main:
            self._rotate()
        self.d.barrier()  # nobody runs ahead (e.g. to exit) before the checkpoint is complete
        return path

    def _rotate(self) -> None:
        for old in self.complete()[: -self.keep]:  # never `best`: not a step_<N> name
            _remove(old)

    @property
    def best(self) -> Path:
        """checkpoints/best.pt (checkpoints/best/ in the DCP layout): the best evaluation's checkpoint,
        outside the keep-last-N rotation."""
        return self.directory / ("best" if self.directories else "best.pt")

    def found_best(self, directory: Path | None = None) -> Path:
        """The best checkpoint in `directory` (this run's checkpoints/): this layout's, else the other
        layout's (a run resumed with checkpoint.async switched)."""
        base = Path(directory or self.directory)
        here, other = base / self.best.name, base / self._other_best().name
        return here if here.exists() or not other.exists() else other

    def _other_best(self) -> Path:
        return self.directory / ("best.pt" if self.directories else "best")

    def save_best(self, state: dict) -> Path:
        """Replace checkpoints/best with `state`, as save() writes a step (every rank calls it). In the
        background, `state` the step's save in flight holds (a best at a checkpoint's step): that write, once
        committed, becomes best too (hard links, rank 0): no second copy, and no wait for the first."""
        write = self.writing
        if write is not None and write.source is state:  # every rank alike (the writing thread never changes it)
            with write.lock:
                write.best, done = self.best, write.decided
            if done and write.error is None and self.d.is_main:  # committed already: linked here
                self._best_of(write.path)
            return self.best
        self.wait()
        path = self._write(self.best, state)
        if not self.background:
            if self.d.is_main:
                _remove(self._other_best())  # a resume that switched checkpoint.async: one best
            self.d.barrier()
        return path

    def adopt_best(self, resumed: Path, step: int | None) -> None:
        """A run resumed from another run dir's checkpoint takes that dir's checkpoints/best along
        when it holds the resumed run's best step (else model_best.pt would be missing at the end)."""
        source = self.found_best(Path(resumed).parent)
        if step is None:  # the same on every rank (the resumed selection state)
            return
        # Rank 0 alone looks and copies, then every rank waits: a rank that looked after the copy
        # would skip the barrier the others wait at.
        here = self.found_best()
        elsewhere = source.parent.resolve() != self.directory.resolve()
        if self.d.is_main and elsewhere and self._step_of(here) != step and self._step_of(source) == step:
            self.directory.mkdir(parents=True, exist_ok=True)
            copy = self.directory / source.name  # its layout's name: best.pt or best/
            tmp = copy.with_name(copy.name + ".tmp")
            if source.is_dir():
                shutil.copytree(source, tmp)
            else:
                shutil.copy2(source, tmp)
            _remove(here)
            _remove(copy)
            os.replace(tmp, copy)
        self.d.barrier()

    def _step_of(self, path: Path) -> int | None:
        """The step of a checkpoint file or DCP directory, None when there is none."""
        if path.is_dir():  # its state.pt alone (the shards are the bulk)
            if not (path / ".metadata").is_file():
                return None
            return torch.load(path / "state.pt", map_location="cpu", weights_only=True)["progress"]["step"]
        return self._read(path)["progress"]["step"] if path.is_file() else None

    def write_weights(self, model, ema, selected, best_step: int | None, run_dir: Path) -> list[Path]:
        """At the end (every rank calls it; FSDP gathers to rank 0): model.pt, the last weights,
        model_ema.pt with an EMA (before model.pt, which marks a finished run), then model_best.pt
        (write_best: the model, or the EMA, then holds the best evaluation's weights). `selected`: the
        EMA whose weights the monitor measured (ema.measured_by; with val_raw/* one that is off). The paths written.
        In the background: after the last write completed (RunError if it failed: no model.pt, so the same
        command resumes from the previous checkpoint and finishes the run)."""
        self.finish()
        final = full_state_dict(model)
        final_ema = ema.full_state_dict(model) if ema.enabled else {}
        if self.d.is_main:
            if final_ema:
                save_whole(final_ema, run_dir / "model_ema.pt")
            save_whole(final, run_dir / "model.pt")
        wrote = [run_dir / name for name in ("model.pt", "model_ema.pt")[: 1 + ema.enabled]]
        if best_step is not None:
            wrote += self.write_best(model, selected, best_step, run_dir / "model_best.pt")
        return wrote

    def write_best(self, model, ema, step: int, path: Path) -> list[Path]:
        """Put checkpoints/best's evaluated weights in place and write them, full, to `path`
        (model_best.pt): with an EMA (trainer.ema.decay) its average becomes the best one's (`ema`:
        an ema.EMA, duck-typed: that module imports this one), else the model's weights do.
        [path], or [] and a warning when checkpoints/best is not step `step`'s. Every rank calls it."""
        best = self.found_best()
        state = self._read(best) if self._step_of(best) == step else None
        if state is None or (ema.enabled and state.get("ema") is None):
            self.d.print0(f"warning: {best} is not step {step}'s (or holds no EMA): no {path.name}")
            return []
        if ema.enabled:
            ema.load_state_dict(state["ema"])
        elif isinstance(model, FSDPModule):
            shards = get_model_state_dict(model)  # type: ignore[arg-type]  # the shards to load into
            dcp.load({"model": shards}, checkpoint_id=best)
            set_model_state_dict(model, shards)  # type: ignore[arg-type]
        else:
            load_model(model, state["model"], best)
        weights = ema.full_state_dict(model)  # FSDP: every rank joins, rank 0 gets them
        if self.d.is_main:
            save_whole(weights, path)
        return [path]

    def _write(self, path: Path, source: dict) -> Path:
        state = dict(source, ranks=self.d.gather_object(source["ranks"]))
        tmp = path.with_name(path.name + ".tmp")
        if self.d.is_main:
            self.directory.mkdir(parents=True, exist_ok=True)
        if self.background:
            self._start(path, tmp, state, source)
            return path
        if self.sharded:
            self._save_sharded(path, tmp, state)
        elif self.d.is_main:
            _write(tmp, state)
            os.replace(tmp, path)  # atomic: the checkpoint exists complete, or not at all
        if self.d.is_main:
            _fsync_dir(self.directory)
        return path

    def _save_sharded(self, path: Path, tmp: Path, state: dict) -> None:
        if self.d.is_main:
            _remove(tmp)  # a leftover of an interrupted save
        self.d.barrier()
        # Each rank writes its own shards; DCP saves a tensor that every rank holds alike (not a
        # DTensor: BatchNorm buffers) once, here from rank 0, whose buffers model.pt keeps too.
        # dcp.save returns on rank 0 after every rank's write finished (DCP gathers their
        # results before rank 0 writes .metadata): that is the barrier before the rename.
        sharded = {key: state.pop(key) for key in SHARDED if state.get(key) is not None}
        dcp.save(sharded, checkpoint_id=tmp, planner=DefaultSavePlanner(dedup_save_to_lowest_rank=True))
        state["sharded_entries"], state["fsdp"] = list(sharded), True  # what _read finds in the shards
        if self.d.is_main:
            _write(tmp / "state.pt", state)
            _commit(tmp, path)

    def _start(self, path: Path, tmp: Path, state: dict, source: dict) -> None:
        """checkpoint.async: copy the model, optimizer and EMA state to host memory, and write it to
        `tmp` in the background (FSDP: every rank its shards; single/DDP: rank 0 alone, as the file);
        rank 0 writes state.pt (the small rest) now and renames `tmp` once the write completed."""
        if self.d.is_main:
            _remove(tmp)  # a leftover of an interrupted save
            tmp.mkdir()
        if self.sharded:
            self.d.barrier()  # nobody writes into the leftover rank 0 removes
        entries = {key: state.pop(key) for key in SHARDED if state.get(key) is not None}
        state["sharded_entries"], state["fsdp"] = list(entries), self.sharded
        if not self.sharded:  # DCP keeps tensors and drops empty containers: their places go to state.pt
            tensors: dict[str, torch.Tensor] = {}
            state["skeleton"], entries = _split(entries, "", tensors), tensors
        if self.d.is_main:
            _write(tmp / "state.pt", state)
        write = Write(path, is_step=path != self.best, source=source)
        if self.sharded or self.d.is_main:
            # async_save returns once its stager copied every tensor (to new host memory: the next steps change
            # the weights in place); its thread then runs dcp.save, whose collectives (FSDP) use self.group.
            # A thread, not AsyncCheckpointerType.PROCESS: no second interpreter, no shared-memory staging, the
            # group is this process's; the write is I/O and serialization, which leave the GIL to training.
            future = dcp.async_save(
                entries,
                checkpoint_id=tmp,
                planner=DefaultSavePlanner(dedup_save_to_lowest_rank=True),  # DDP: rank 0's buffers, as model.pt
                process_group=self.group,
                no_dist=not (self.sharded and self.d.distributed),
            )
            assert isinstance(future, Future)  # not an AsyncSaveResponse: no async_stager of ours
            write.future = future
            future.add_done_callback(lambda done: self._written(write, done, tmp))
        else:
            write.committed.set()  # nothing to write on this rank
        self.writing = write

    def _written(self, write: "Write", done: Future, tmp: Path) -> None:
        """In the writing thread, as soon as the write completed (every rank's: DCP gathers their results before
        rank 0 writes .metadata): rank 0 commits it (rename, rotation); a failure is one line, its tmp removed."""
        try:
            done.result()
            if self.d.is_main:
                _commit(tmp, write.path)
                if write.is_step:
                    self._rotate()
                else:
                    _remove(self._other_best())  # a resume that switched checkpoint.async: one best
        except BaseException as error:  # DCP's CheckpointException is one: said, not raised in this thread
            with write.lock:
                write.error, write.decided = _failure(error), True
            if self.d.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
                newest = [p.name for p in self.complete()[-1:]] or ["none"]
                self.d.print0(
                    f"warning: checkpoint {write.path.name} failed to write ({write.error}); "
                    f"the newest checkpoint stays {newest[0]}"
                )
        else:
            with write.lock:  # from here save_best of the same state links it itself
                best, write.decided = write.best, True
            if best is not None and self.d.is_main:
                self._best_of(write.path)
        finally:
            write.committed.set()

    def _best_of(self, path: Path) -> None:
        """checkpoints/best made from the committed step directory `path`: its files hard-linked (copied where
        the filesystem has no links), committed as a step is; the step's rotation leaves it whole."""
        tmp = self.best.with_name(self.best.name + ".tmp")
        try:
            _remove(tmp)
            shutil.copytree(path, tmp, copy_function=_link)
            _commit(tmp, self.best)
            _remove(self._other_best())  # a resume that switched checkpoint.async: one best
        except OSError as error:
            shutil.rmtree(tmp, ignore_errors=True)
            self.d.print0(f"warning: checkpoint best failed to write ({_failure(error)})")

    def wait(self) -> bool:
        """Until the write in flight completed and was committed (or failed); on this rank alone. False:
        it failed here (FSDP: every rank learns of any rank's failure; single/DDP: rank 0 alone writes)."""
        write, self.writing = self.writing, None
        if write is None:
            return True
        write.committed.wait()
        if write.is_step:
            self.lost = None if write.error is None else f"{write.path.name} ({write.error})"
        return write.error is None

    def finish(self) -> None:
        """Every rank: wait for the write in flight; RunError on every rank when the newest step's write failed
        (the run would end with its newest checkpoint older than said)."""
        self.wait()
        if self.background and self.d.any(self.lost is not None):
            newest = [p.name for p in self.complete()[-1:]] or ["none"]
            raise RunError(
                f"the checkpoint {self.lost or 'of the last step'} failed to write; the newest is {newest[0]}: "
                "the same command resumes from it"
            )

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, kind, error, traceback) -> None:
        """Whatever ends the run (a crash too): the write in flight completes, or fails with its line,
        before the process goes. The ends every rank reaches together waited already (finish)."""
        self.wait()

    def load(self, resume) -> dict | None:
        """resume: null (start fresh), auto (newest complete checkpoint here, else fresh) or a
        path (a .pt file or a DCP directory). Partial leftovers are reported and removed; an
        unreadable checkpoint falls back to the next newest."""
        if resume is None:
            return None
        if resume != "auto":
            path = Path(resume)
            if not (path.is_file() or (path / ".metadata").is_file()):
                raise ConfigError(f"checkpoint.resume={resume}: no such checkpoint file (or DCP directory)")
            return self._read(path)
        if self.directory.is_dir():
            for leftover in self.directory.glob("*.tmp"):
                self.d.print0(f"warning: ignoring the incomplete checkpoint {leftover} (a save was interrupted)")
                if self.d.is_main:
                    _remove(leftover)
            for old in self.directory.glob("*.old"):  # a directory's replacement interrupted between its renames
                if self.d.is_main and old.with_suffix("").exists():
                    _remove(old)
                elif self.d.is_main:
                    os.replace(old, old.with_suffix(""))
        self.d.barrier()  # the others list the checkpoints after rank 0 put them in order (every rank: no if)
        for path in reversed(self.complete()):
            try:
                return self._read(path)
            except (RuntimeError, EOFError, OSError, ValueError, pickle.UnpicklingError) as error:
                self.unreadable.add(path.name)
                self.d.print0(f"warning: skipping unreadable checkpoint {path}: {str(error).splitlines()[0]}")
        return None

    def claim(self, run_dir: Path, resumed: dict | None) -> None:
        """One run per run dir. A run continues the newest (readable) checkpoint of its own dir,
        or starts in a dir that holds no run (no checkpoint, no model.pt); anything else would
        mix two runs' checkpoints and metrics, so it is refused before anything is written."""
        if resumed is not None and Path(resumed["path"]).resolve().parent == self.directory.resolve():
            readable = [
                p
                for p in self.complete()
                if p.resolve() != Path(resumed["path"]).resolve() and p.name not in self.unreadable
            ]
            newer = [p.name for p in readable if _step(p) > resumed["progress"]["step"]]
            if newer:
                raise ConfigError(
                    f"checkpoint.resume={resumed['path']}: this run dir has newer checkpoints "
                    f"({', '.join(newer)}); continuing an older one here would mix two runs "
                    "(resume it into a new hydra.run.dir)"
                )
            return
        held = [p.name for p in self.complete()[-1:]] + ["model.pt"] * (run_dir / "model.pt").is_file()
        if held:
            how = "resume it with checkpoint.resume=auto, or " if resumed is None else ""
            raise ConfigError(
                f"hydra.run.dir={run_dir} already holds a run ({', '.join(held)}): {how}choose another hydra.run.dir"
            )

    def _read(self, path: Path) -> dict:
        """The checkpoint's state; for a DCP directory all but the model and optimizer state,
        which restore() loads from the shards."""
        directory = path.is_dir()
        if directory and not (path / ".metadata").is_file():
            raise OSError(f"no .metadata in {path}")
        state = torch.load(path / "state.pt" if directory else path, map_location="cpu", weights_only=True)
        # sharded: written by FSDP (a DCP directory without the key: FSDP's, before checkpoint.async)
        state["path"], state["sharded"] = str(path), state.pop("fsdp", directory)
        entries = state.pop("sharded_entries", ())
        if directory and not state["sharded"]:  # checkpoint.async's single/DDP directory: read whole, as the file
            return state | _fill(state.pop("skeleton"), _tensors(path))
        for key in entries:
            if key not in ("model", "optimizer"):  # restore() loads those two
                state[key] = ShardedEntry(path, key)
        return state


class Write:
    """A background write (checkpoint.async): its future (on the ranks that write), and `committed`, set
    once the writing thread renamed it (rank 0) or found it failed (`error`, one line)."""

    def __init__(self, path: Path, is_step: bool, source: dict | None = None):
        self.path, self.is_step = path, is_step
        self.source = source  # the state saved: save_best of the same state rides on this write
        self.best: Path | None = None  # where save_best asked for it too
        self.decided = False  # the writing thread took `best` (or failed): a later save_best links it itself
        self.lock = threading.Lock()
        self.future: Future | None = None
        self.committed = threading.Event()
        self.error: str | None = None


def _failure(error: BaseException) -> str:
    """A failed write in one line: the error's first line (DCP's CheckpointException: the first failed rank's)."""
    where = ""
    if isinstance(error, CheckpointException) and error.failures:
        rank, (error, _) = next(iter(sorted(error.failures.items(), key=lambda item: item[0])))
        where = f"rank {rank}: " if tdist.is_initialized() and tdist.get_world_size() > 1 else ""
    return f"{where}{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"


_SLOT = "\x00dcp:"  # a tensor's place in a skeleton (a string no state_dict holds): its key in the DCP directory


def _split(obj, key: str, tensors: dict[str, torch.Tensor]):
    """`obj` with each tensor replaced by its slot, the tensors put in `tensors` under readable keys (model/fc.weight,
    optimizer/state/0/exp_avg): what single/DDP write with DCP, whose keys are strings and which keeps no empty
    container (an EMA of a model without buffers; an optimizer without state yet), with the rest (torch.load's with
    weights_only: plain containers, numbers, the optimizer's integer keys) in state.pt."""
    if isinstance(obj, torch.Tensor):
        tensors[key] = obj
        return _SLOT + key
    if isinstance(obj, dict):  # OrderedDict too (a model's state_dict)
        return type(obj)((k, _split(v, f"{key}/{k}" if key else str(k), tensors)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(_split(v, f"{key}/{i}", tensors) for i, v in enumerate(obj))
    return obj


def _fill(obj, tensors: dict):
    """_split's inverse: the skeleton with its tensors back."""
    if isinstance(obj, str) and obj.startswith(_SLOT):
        return tensors[obj[len(_SLOT) :]]
    if isinstance(obj, dict):
        return type(obj)((k, _fill(v, tensors)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(_fill(v, tensors) for v in obj)
    return obj


def _tensors(path: Path) -> dict:
    """Every tensor of a single/DDP DCP directory, by key, read without a state_dict to fill (as torch's
    dcp_to_torch_save reads; DCP unpickles its .metadata: trusted checkpoints only)."""
    tensors: dict = {}
    _load_state_dict(
        tensors, storage_reader=dcp.FileSystemReader(path), planner=_EmptyStateDictLoadPlanner(), no_dist=True
    )
    return tensors


class ShardedEntry:
    """An entry of a DCP checkpoint beside the model and optimizer (the EMA): what `_read` puts in its
    place; `load(like)` reads it into `like`, this run's state_dict of it, in place (its DTensors
    resharded to this run's world size). Every rank must call it."""

    def __init__(self, path: Path, key: str):
        self.path, self.key = path, key

    def load(self, like: dict) -> dict:
        dcp.load({self.key: like}, checkpoint_id=self.path)  # pickled .metadata: trusted checkpoints only
        return like


def _step(path: Path) -> int:
    step = parse_step(path.name)
    if step is None:
        raise ValueError(f"{path} is not a checkpoint name")
    return step


def save_whole(state: dict, path: Path) -> None:
    """torch.save to `path` atomically: a run stopped mid-write leaves the file whole or absent (model.pt marks a
    finished run: never a cut one)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        _write(tmp, state)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)


def _write(path: Path, state: dict) -> None:
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def _commit(tmp: Path, path: Path) -> None:
    """Rename a complete DCP directory `tmp` to `path`: the commit. A directory cannot replace another in one
    rename: the old one steps aside first (a crash between the renames leaves it as <name>.old, which load()
    puts back)."""
    _fsync_dir(tmp)
    old = path.with_name(path.name + ".old")
    _remove(old)
    if path.exists():  # best, or a step a resumed run reaches again
        os.replace(path, old)
    os.replace(tmp, path)
    _remove(old)
    _fsync_dir(path.parent)


def _link(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:  # a filesystem without hard links
        shutil.copy2(source, target)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def flatten(container, prefix: str = "") -> dict:
    """{"model.width": 128, ...} from nested dicts (for naming a differing setting)."""
    if not isinstance(container, dict):
        return {prefix: container}
    flat = {}
    for key, value in container.items():
        flat.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def changes(saved: dict, current: dict, prefixes: tuple[str, ...]) -> list[str]:
    """["optim.lr=0.003 -> 1e-06", ...]: settings under `prefixes` that differ from `saved`."""
    keys = sorted(k for k in saved.keys() | current.keys() if k.startswith(prefixes))
    return [f"{k}={saved.get(k)} -> {current.get(k)}" for k in keys if saved.get(k) != current.get(k)]


def run_identity(cfg: DictConfig, global_batch: int, train_set) -> dict:
    """What makes a checkpoint's run the same run, {setting: value}: a resume that changes any of it
    is refused (check_compatible). The world size and K are not in it (a resume may change them)."""
    identity = {
        "global_batch": global_batch,
        "seed": cfg.seed,
        "data.drop_last": cfg.data.drop_last,  # which windows an epoch has: the steps after a resume would train others
        "data.shuffle": cfg.data.get("shuffle", True),  # the epoch's order
        "optim._target_": cfg.optim._target_,
        "optim.decay_norms_and_biases": cfg.optim.get("decay_norms_and_biases", True),  # its parameter groups
        "optim.groups": OmegaConf.to_container(cfg.optim.groups, resolve=True) if cfg.optim.get("groups") else [],
        "optim.layer_decay": cfg.optim.get("layer_decay"),
        **flatten(OmegaConf.to_container(cfg.model, resolve=True), "model"),
        **flatten(data_splits(cfg), "data.splits"),
        **getattr(train_set, "identity", {}),  # what the data is beyond its config (a corpus's checksum)
        # What the run optimizes: the task's loss and all it reads (label smoothing; distil's alpha, temperature and
        # teacher; a contrastive temperature) and how an evaluation measures it (the best checkpoint and early
        # stopping compare evaluations across the run). Another value would continue another objective from this
        # one's weights, said nowhere, and .hydra/config.yaml would record it for the whole run: refused, naming
        # the key. task.teacher.from (and .weights) too: a resume reads the teacher's copy in the run dir
        # (trainkit/teacher.py), so another teacher would be silently ignored, not applied.
        **flatten(OmegaConf.to_container(cfg.task, resolve=True), "task"),
        "data.train_samples": len(train_set),  # last (a key above names a change first): e.g. debug=limit's
    }
    identity.pop("model.activation_checkpointing", None)  # memory against compute: the same run, bit for bit
    for key in [k for k in identity if k.startswith("model.init.")]:  # where step 0's weights came from: the
        del identity[key]  # checkpoint holds them (the parent may have moved or be gone: a resume never reads it)
    return identity


def data_splits(cfg: DictConfig) -> dict:
    """data.splits' arguments that say what the data is: less those its room names settings (`SETTINGS`: a shard
    set's cache dir, size limit and retries), which a resume may change."""
    splits = OmegaConf.to_container(cfg.data.splits, resolve=True)
    assert isinstance(splits, dict)
    settings = getattr(options.module_of(cfg, "data"), "SETTINGS", ())
    return {key: value for key, value in splits.items() if key not in settings}


def run_settings(cfg: DictConfig) -> dict:
    """Every setting of the run, flat ({"optim.lr": 0.003, ...}): a resume may change those under
    optim., sched. and trainer. (train.py names them, see `changes`)."""
    return flatten(OmegaConf.to_container(cfg, resolve=True))


BEFORE_RECORDED = {
    "data.shuffle": True,
    "optim.groups": [],
    "optim.layer_decay": None,
}  # what a checkpoint written before a key joined the identity ran with


def check_compatible(saved: dict, current: dict) -> None:
    """Refuse a resume that cannot continue the same run exactly, naming the difference.

    `saved` and `current` map setting names to values (train.py's `identity`). A value that names
    its source (`{"sha256": ..., "source": ...}`: a corpus and the Python it came from) is compared
    by its checksum alone and said with its source."""
    saved = BEFORE_RECORDED | saved
    for key in current:
        if key not in saved and (key == "data.train_samples" or key.startswith("task.")):
            continue  # a checkpoint written before trainkit recorded it: its config's keys still decide
        if not _same(_content(saved.get(key)), _content(current[key])):
            hint = (
                f"; on another world size set accumulation.global_batch_size={saved[key]} (K adapts)"
                if key == "global_batch"
                else ""
            )
            raise ConfigError(
                f"checkpoint.resume: the checkpoint was written with {key}={_said(saved.get(key))}, "
                f"this run has {key}={_said(current[key])}; exact resume needs the same "
                f"(or choose another hydra.run.dir){hint}"
            )


def recorded(resumed: dict) -> dict:
    """The identity a checkpoint was written with. One written before task.* joined the identity has the task's
    keys in its settings (every setting of its run): they decide, as the identity's would."""
    return {k: v for k, v in resumed.get("settings", {}).items() if k.startswith("task.")} | resumed["identity"]


def _same(a, b) -> bool:
    """==, and NaN equals NaN (e.g. +model.fault=nan: a float NaN is never == itself)."""
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def _content(value):
    return value["sha256"] if isinstance(value, dict) and "sha256" in value else value


def _said(value):
    return (
        f"{value['source']} (sha256 {value['sha256'][:12]})" if isinstance(value, dict) and "sha256" in value else value
    )


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
            "other shape": [
                k
                for k in expected
                if k in state_dict and hasattr(state_dict[k], "shape") and state_dict[k].shape != expected[k].shape
            ],
        }
        brief = "; ".join(
            f"{what} {', '.join(keys[:3])}{' ...' if len(keys) > 3 else ''}" for what, keys in problems.items() if keys
        )
        raise ConfigError(f"{source} does not fit the model: {brief or 'not a state_dict'}") from None


def snapshot(
    model,
    optimizer,
    scheduler,
    scaler,
    meter,
    progress: dict,
    identity: dict,
    settings: dict,
    logger_run: dict | None,
    d: Dist,
) -> dict:
    """Everything an uninterrupted run would still have in memory. `model` is the unwrapped
    module (for FSDP: its model and optimizer state are this rank's shards, saved with DCP);
    (The train loader needs nothing: its generator and batches are seeded from (seed, epoch).)
    Under "ranks": what differs between ranks (RNG streams, the unreduced loss sums)."""
    tensors = [p.to_local() if isinstance(p, DTensor) else p for p in (*model.parameters(), *model.buffers())]
    finite = [torch.isfinite(t).all() for t in tensors if t.is_floating_point()]  # one host sync, not one a tensor
    if d.any(not bool(torch.stack(finite).all()) if finite else False):  # all save, or none
        raise RunError(f"refusing to checkpoint non-finite weights or buffers at step {progress['step']}")
    if isinstance(model, FSDPModule):
        model_state, optimizer_state = get_state_dict(model, optimizer)  # type: ignore[arg-type]  # an nn.Module too
    else:
        model_state, optimizer_state = model.state_dict(), optimizer.state_dict()
    return {
        "model": model_state,
        "optimizer": optimizer_state,
        "scheduler": scheduler.state_dict(),
        "scaler": scaler.state_dict(),
        "progress": dict(progress),
        "identity": identity,
        "settings": settings,
        # the logger backend's run, continued by a resume in the same backend and store (trainkit/loggers.py)
        "logger_run_id": logger_run["id"] if logger_run else None,
        "logger_store": {k: logger_run[k] for k in ("backend", "store")} if logger_run else None,
        "ranks": {"rng": rng_state(d.device), "meter": meter.state_dict()},
    }


def position(step: int, epoch: int, window: int, steps_per_epoch: int) -> dict:
    """Where a checkpoint after `step` resumes: `window` of `epoch`, or the next epoch's first after its last."""
    done = window == steps_per_epoch
    return {"step": step, "epoch": epoch + done, "window": 0 if done else window}


def state_of(
    s, progress: dict, identity: dict, settings: dict, logger_run: dict | None, selection, val_batches
) -> dict:
    """What a checkpoint of the run holds, the counterpart of resume() (which loads each entry back): the step's
    objects (s: train.py's StepParts), the run's progress, and the state that grows with training: the best
    evaluation and early stopping (selection), the EMA, the micro-batches data.batch_size=auto found."""
    model, optimizer, scheduler, scaler, meter = s.stateful
    held = snapshot(model, optimizer, scheduler, scaler, meter, progress, identity, settings, logger_run, s.d)
    auto = s.auto.state_dict() | val_batches.state_dict()  # a resume starts at the found micro-batch
    return held | {"autobatch": auto, "selection": selection.state_dict(), "ema": s.ema.state_dict()}


def restore(state: dict, model, optimizer, scheduler, scaler, meter, d: Dist) -> None:
    """Load a checkpoint's state into the objects of a fresh run (`model` unwrapped).

    A checkpoint loads on any world size with the same global batch (train.py's identity; K
    adapts): step s trains on the same global samples whatever the world size (the epoch's
    windows are [sG, (s+1)G) of one permutation), the model and optimizer state are every rank's
    (single/DDP) or resharded by DCP (FSDP), and rank 0 carries on the loss sums of the current
    log row. What cannot be mapped is each rank's RNG streams (dropout draws per (seed, step,
    rank)): re-seeded from (seed, step, rank), deterministic, and said once."""
    sharded, saved_world = isinstance(model, FSDPModule), len(state["ranks"])
    if state["sharded"] != sharded:
        raise ConfigError(
            f"checkpoint.resume: {state['path']} was written with {_layout(state['sharded'])}, "
            f"this run has {_layout(sharded)}; resume with the same parallel mode"
        )
    configured = [{k: v for k, v in group.items() if k not in ("params", "lr")} for group in optimizer.param_groups]
    if sharded:
        model_state, optimizer_state = get_state_dict(model, optimizer)  # the shapes to load into
        # DCP reads .metadata with pickle (weights_only does not apply): trusted checkpoints only.
        dcp.load({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=state["path"])
        set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)
    else:
        load_model(model, state["model"], state["path"])
        optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    _apply_hyperparameters(optimizer, scheduler, configured)
    if state["scaler"] and scaler.is_enabled():  # fp16 on both sides (else a fresh scaler, or none)
        scaler.load_state_dict(state["scaler"])
    if saved_world == d.world_size:
        meter.load_state_dict(state["ranks"][d.rank]["meter"])
        set_rng_state(state["ranks"][d.rank]["rng"], d.device)
        return
    counts = state["ranks"][0]["meter"]  # step, sample and sync counts: the same on every rank
    loss_sum = (
        sum(r["meter"]["loss_sum"] for r in state["ranks"]) if d.is_main else torch.zeros_like(counts["loss_sum"])
    )
    meter.load_state_dict(dict(counts, loss_sum=loss_sum))  # the row's loss is their all-reduced sum
    seed_all(
        int(np.random.SeedSequence([state["identity"]["seed"], state["progress"]["step"], d.rank]).generate_state(1)[0])
    )
    d.print0(
        f"checkpoint.resume: written by {saved_world} ranks, now {d.world_size} (the same global batch); "
        "per-rank RNG streams re-seeded from (seed, step, rank)"
    )


def _apply_hyperparameters(optimizer, scheduler, configured: list[dict]) -> None:
    """The optimizer and schedule settings of this run's config, not the checkpoint's.

    load_state_dict brings back the saved param_groups (lr, betas, weight decay, ...), which
    would silently override a changed optim.* on resume. The configured values go back in, and
    each group's lr is recomputed as LambdaLR does: base lr x the (rebuilt) schedule at the
    restored step. With unchanged settings this reproduces the saved values exactly."""
    for group, settings in zip(optimizer.param_groups, configured, strict=True):
        group.update(settings)
    scheduler.base_lrs = [group["initial_lr"] for group in optimizer.param_groups]
    lrs = [
        base * schedule(scheduler.last_epoch)
        for base, schedule in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)
    ]
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    scheduler._last_lr = lrs  # what get_last_lr() reports (LambdaLR keeps it in this attribute)


def _layout(sharded: bool) -> str:
    return (
        "parallel=fsdp (a DCP directory)"
        if sharded
        else "parallel=single/ddp (one file, or checkpoint.async's directory)"
    )


def full_state_dict(model) -> dict:
    """The full, plain state_dict for model.pt (`model` unwrapped). FSDP: every rank must call
    it; the shards are gathered to rank 0 (on CPU), the other ranks get {}."""
    if isinstance(model, FSDPModule):
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(model, options=options)  # type: ignore[arg-type]  # an nn.Module too
    return model.state_dict()


def resume(
    resumed: dict | None,
    s,
    checkpointer,
    selection,
    val_batches,
    windows,
    identity: dict,
    settings: dict,
    total_steps: int,
) -> dict | None:
    """Where training starts: {step, epoch, window} of the next optimizer step; from a checkpoint, everything the
    uninterrupted run would have had, down to every rank's RNG state. None: the checkpoint has nothing to train.
    s: train.py's StepParts; selection, val_batches, windows: the run's Selection, EvalBatches and TrainWindows."""
    if not resumed:
        return {"step": 0, "epoch": 0, "window": 0}
    check_compatible(recorded(resumed), identity)
    if note := selection.load_state_dict(resumed.get("selection")):
        s.d.print0(f"resume: {note}")
    at = resumed["progress"]["step"]
    if selection.stopped or at > total_steps:  # a run that stopped early trains no more (PL #8278)
        why = f"is at step {at}, past this run's {total_steps} steps (trainer.max_steps / trainer.epochs)"
        s.d.print0(f"nothing to train: {resumed['path']} {selection.stopped_at(at) if selection.stopped else why}")
        return None
    model, optimizer, scheduler, scaler, meter = s.stateful
    restore(resumed, model, optimizer, scheduler, scaler, meter, s.d)
    checkpointer.adopt_best(Path(resumed["path"]), selection.best_step)  # resumed from another run dir
    s.ema.load_state_dict(resumed.get("ema"))  # none in the checkpoint: the average starts from the resumed weights
    s.auto.load_state_dict(resumed.get("autobatch"))  # auto: start at the micro-batch found before
    val_batches.load_state_dict(resumed.get("autobatch"))  # and the evaluation's
    windows.fit()
    s.d.print0(f"resumed from {resumed['path']} at step {resumed['progress']['step']}")
    if changed := changes(resumed.get("settings", {}), settings, ("optim.", "sched.", "trainer.")):
        s.d.print0(f"resume: applying the changed settings {', '.join(changed)}")
    return resumed["progress"]
