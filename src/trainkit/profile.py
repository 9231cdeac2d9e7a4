"""trainer.profile: torch.profiler over a window of optimizer steps, one trace per rank.

`steps: [a, b]` profiles the optimizer steps a..b, both included, counted as the rows' `step` (step 1
is the first optimizer step); `warmup` steps before a run traced but discarded (the profiler's own
start-up cost stays out of the window). Every rank writes `<run dir>/profile/rank<r>.json.gz`
(ui.perfetto.dev and chrome://tracing open it as it is); after the window rank 0 prints the top
operators by self CPU time (and self CUDA time on a GPU) and the traces' paths. On CUDA the same
steps also record the allocator's history into `profile/memory_rank<r>.pickle`
(https://pytorch.org/memory_viz); with `profile_memory` the history runs from the start and an
out-of-memory error dumps `profile/memory_oom_rank<r>.pickle` first (an observer: the error is then
raised as before, so data.batch_size=auto still halves).

`prof.step()` runs once per optimizer step, not per micro-batch, so the profiler's steps are the
rows' steps. A resumed run does not profile the steps it resumed past (they were trained before);
what is left of the window is profiled. `steps: null` (the default) builds no profiler: the loop's
`profiler.step()` is then a method that returns at once.
"""

import contextlib
import os
import warnings
from pathlib import Path

import torch
from omegaconf import DictConfig

from trainkit.dist import Dist
from trainkit.errors import ConfigError

MEMORY_ENTRIES = 100_000  # allocator events kept in a memory snapshot (torch's memory_viz reads them)


def window(steps, total_steps: int) -> tuple[int, int] | None:
    """trainer.profile.steps as (first, last), both included, in optimizer steps; None: off. A window
    the run never reaches is a ConfigError before training."""
    if steps is None:
        return None
    steps = list(steps)
    if len(steps) != 2 or not all(isinstance(s, int) and not isinstance(s, bool) for s in steps):
        raise ConfigError(f"trainer.profile.steps={steps} must be null or [first, last] optimizer steps, e.g. [10, 12]")
    first, last = steps
    if not 1 <= first <= last:
        raise ConfigError(f"trainer.profile.steps=[{first}, {last}] must have 1 <= first <= last (optimizer steps)")
    if last > total_steps:
        raise ConfigError(
            f"trainer.profile.steps=[{first}, {last}] is past the end of this run's {total_steps} optimizer steps "
            "(trainer.max_steps / trainer.epochs)"
        )
    return first, last


class Profiler:
    """Built before training (a window past the run's end is refused there); `over(done)` is the
    profiling context of a run that starts after `done` optimizer steps; `step()` after each one."""

    def __init__(self, cfg: DictConfig, total_steps: int, d: Dist, run_dir: Path):
        self.steps = window(cfg.steps, total_steps)
        if cfg.warmup < 0 or cfg.top < 1:
            raise ConfigError(f"trainer.profile: warmup={cfg.warmup} must be >= 0 and top={cfg.top} >= 1")
        self.cfg, self.d, self.dir = cfg, d, Path(run_dir) / "profile"
        self.cuda = d.device.type == "cuda"
        self.prof: torch.profiler.profile | None = None
        self.done = 0  # optimizer steps done so far (the rows' step)
        self.begin = self.last = 0  # the steps this run profiles, both included
        self.recording = False  # CUDA: the allocator's history is being recorded

    def step(self) -> None:
        """Off, or past the window: nothing. (Replaced by _step while a window is ahead.)"""

    @contextlib.contextmanager
    def over(self, done: int):
        if self.steps is None:
            yield self
            return
        first, self.last = self.steps
        if self.last <= done:
            self.d.print0(f"profile: steps {first}..{self.last} were trained before the resume at step {done}: none")
            yield self
            return
        self.begin, self.done = max(first, done + 1), done
        if self.begin > first:
            self.d.print0(f"profile: resumed at step {done}: steps {first}..{done} are not profiled, {self.begin}..")
        before = self.begin - done - 1  # the profiler's steps before the window (its step 0 is this run's first)
        warmup = min(self.cfg.warmup, before)
        activities = [torch.profiler.ProfilerActivity.CPU] + [torch.profiler.ProfilerActivity.CUDA] * self.cuda
        self.dir.mkdir(parents=True, exist_ok=True)  # every rank: its own trace
        if not self.cuda:  # Kineto (torch's tracer) reports "ERROR ... gpuGetDeviceCount failed" on a CPU
            os.environ.setdefault("KINETO_LOG_LEVEL", "5")
        if self.cuda and self.cfg.profile_memory:
            self._record_memory()  # from the start: an out-of-memory dump shows how memory got there
            torch._C._cuda_attach_out_of_memory_observer(self._out_of_memory)  # type: ignore[attr-defined]
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Profiler won't be using warmup")  # warmup=0: by choice (steps: [1, b])
            warnings.filterwarnings("ignore", ".*Profiler clears events at the end of each cycle")  # one cycle
            active = self.last - self.begin + 1
            schedule = torch.profiler.schedule(wait=before - warmup, warmup=warmup, active=active, repeat=1)
            profiler = torch.profiler.profile(
                activities=activities,
                schedule=schedule,
                on_trace_ready=self._ready,
                record_shapes=self.cfg.record_shapes,
                profile_memory=self.cfg.profile_memory,
                with_stack=self.cfg.with_stack,
            )
        try:
            with profiler as self.prof:
                self.step = self._step  # type: ignore[method-assign]
                if self.done + 1 == self.begin and self.cuda:
                    self._record_memory()
                yield self
        finally:
            self.__dict__.pop("step", None)  # the class's: nothing
            self.prof = None
            self._stop_memory()

    def _step(self) -> None:
        self.done += 1
        if self.prof is not None:
            self.prof.step()  # past the window's last step: on_trace_ready (_ready) has run
        if self.done + 1 == self.begin and self.cuda:
            self._record_memory()
        if self.done >= self.last:  # the window is over: the remaining steps pay nothing
            self.__dict__.pop("step", None)

    def path(self, rank: int) -> Path:
        return self.dir / f"rank{rank}.json.gz"

    def _ready(self, prof: torch.profiler.profile) -> None:
        """The window's end (or the run's, inside it), on every rank: the trace, the memory snapshot, the table."""
        prof.export_chrome_trace(str(self.path(self.d.rank)))  # .gz: torch gzips it
        if self.cuda:
            torch.cuda.memory._dump_snapshot(str(self.dir / f"memory_rank{self.d.rank}.pickle"))
            self._stop_memory()
        if not self.d.is_main:
            return
        averages = prof.key_averages()
        lines = [f"profile: steps {self.begin}..{min(self.done, self.last)}, top {self.cfg.top} by self CPU time"]
        lines.append(averages.table(sort_by="self_cpu_time_total", row_limit=self.cfg.top))
        if self.cuda:
            lines.append(averages.table(sort_by="self_cuda_time_total", row_limit=self.cfg.top))
        traces = [str(self.path(r)) for r in range(self.d.world_size)]
        lines.append(f"profile: traces {', '.join(traces)} (open in https://ui.perfetto.dev or chrome://tracing)")
        if self.cuda:
            lines.append(f"profile: memory snapshots {self.dir}/memory_rank<r>.pickle (https://pytorch.org/memory_viz)")
        self.d.print0("\n".join(lines))

    def _record_memory(self) -> None:
        if not self.recording:
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_ENTRIES)
            self.recording = True

    def _stop_memory(self) -> None:
        if self.recording:
            torch.cuda.memory._record_memory_history(enabled=None)
            self.recording = False

    def _out_of_memory(self, device: int, alloc: int, device_alloc: int, device_free: int) -> None:
        """torch calls it before raising torch.OutOfMemoryError: the allocator's state at that moment."""
        if self.recording:
            torch.cuda.memory._dump_snapshot(str(self.dir / f"memory_oom_rank{self.d.rank}.pickle"))
