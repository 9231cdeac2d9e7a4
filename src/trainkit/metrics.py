"""The training meter: the sums behind each log row (where the rows go: trainkit/loggers.py)."""

import contextlib
import time

import torch

from trainkit.errors import ConfigError

clock = time.perf_counter  # what TrainMeter's throughput (samples/s) is measured by; time/data_wait: perf_counter


@contextlib.contextmanager
def timed_by(other):
    """TrainMeter's throughput is timed by `other` meanwhile: scripts/bench_*.py time both of their loops by CPU
    time on a CPU. time/data_wait stays on perf_counter, the clock a real run reads twice a step (process_time
    is a system call, ~0.8 us against 0.06: a benchmark would charge the loop for what a run does not pay);
    its share is then wall over CPU seconds, which no benchmark reads."""
    global clock
    saved, clock = clock, other
    try:
        yield
    finally:
        clock = saved


PENDING = 256  # losses and norms kept as tensors before they are summed into the row's float64 sums


class _Span:
    """A reusable context manager (no generator per use: ~3 us each) that hands the clock time of its body
    to `add`."""

    __slots__ = ("add", "began")

    def __init__(self, add):
        self.add, self.began = add, 0.0

    def __enter__(self) -> None:
        self.began = clock()

    def __exit__(self, *exc) -> None:
        self.add(clock() - self.began)


class TrainMeter:
    """Sums since the last log row, kept as device tensors so the loop never waits on .item():
    the one host sync (and the one all-reduce of the loss) happens when a row is written.

    Items are what the loss is a mean over: samples, or tokens for a sequence task, whose row
    then also reports `items_name` (e.g. "tokens": seen so far, all ranks).

    Per step it does no tensor arithmetic: a micro-step's loss and a step's norm are kept as they are
    and summed (one stack, a float64 sum each) before a row, a finiteness check or a checkpoint reads
    them, and every PENDING of them (memory stays bounded): the per-step adds cost ~25 us, 3 % of the
    default job's step. Counts of samples (not tensors) are Python numbers.

    `terms`: the task's `loss_terms` (e.g. ("ce", "kd")): its loss_sum is then a vector [loss, *terms], each
    summed over the items; every sum here is that vector (the same code: stacked and summed along dim 0), and
    a row adds `loss/<term>`, each over the row's items as the loss is. Without terms: scalars, as before."""

    def __init__(self, d, comm, items_name: str | None = None, terms: tuple[str, ...] = ()):
        self.d, self.comm, self.items_name, self.terms = d, comm, items_name, tuple(terms)
        self.shape = (1 + len(self.terms),) if self.terms else ()  # of a loss sum: [loss, *terms], or a scalar
        self.samples = self.skipped = 0
        self.items: int | torch.Tensor = 0  # a tensor where the data counts them (tokens)
        self.window: list[torch.Tensor] = []  # this window's micro-step loss sums, this rank
        self._paused = _Span(self._pause)
        self._reset()

    def _reset(self):
        self.loss_sum = torch.zeros(self.shape, dtype=torch.float64, device=self.d.device)
        self.norm_sum = torch.zeros((), dtype=torch.float64, device=self.d.device)
        self.losses: list[torch.Tensor] = []  # not yet in loss_sum / norm_sum
        self.norms: list[torch.Tensor] = []
        self.row_items: int | torch.Tensor = 0
        self.steps = self.row_skipped = self.row_samples = 0
        self.data_wait = 0.0  # seconds the loop waited on the loader since the last row (train.window_batches adds)
        self.syncs, self.bytes = self.comm.syncs, self.comm.bytes
        self.started = clock()

    def start_clock(self) -> None:
        """Throughput counts from here (not from start-up)."""
        self.started = clock()
        self.row_samples = 0

    def paused(self) -> _Span:
        """Time spent in the body (evaluation, checkpoints) does not count as training time."""
        return self._paused

    def _pause(self, seconds: float) -> None:
        self.started += seconds

    @property
    def window_loss(self) -> torch.Tensor:
        """This rank's loss sum of the window so far (float64; with loss terms, of them too: a finiteness check)."""
        if not self.window:
            return torch.zeros((), dtype=torch.float64, device=self.d.device)
        return torch.stack(self.window).sum(dtype=torch.float64)

    def drop_window(self) -> None:
        """The window runs again (data.batch_size=auto): its losses so far count for nothing."""
        self.window = []

    def add_micro_step(self, loss_sum: torch.Tensor) -> None:
        """loss_sum: this rank's summed loss of one micro-batch's items."""
        self.window.append(loss_sum.detach())

    def add_step(
        self,
        grad_norm: torch.Tensor,
        samples: int,
        items: int | torch.Tensor,
        skipped: bool = False,
        losses: list[torch.Tensor] | None = None,
    ) -> None:
        """grad_norm: the global pre-clip norm; samples and items: the window's real samples and
        loss-bearing items, all ranks; skipped: the window was dropped (non-finite, or fp16 overflow);
        losses: the window's micro-step loss sums, detached, where they were not added one by one (add_micro_step)."""
        self.steps += 1
        self.samples += samples
        self.row_samples += samples
        self.items = self.items + items
        if skipped:
            self.skipped += 1
            self.row_skipped += 1
        else:
            self.losses += self.window if losses is None else losses
            self.norms.append(grad_norm.detach() if grad_norm.requires_grad else grad_norm)  # clip's: no graph
            self.row_items = self.row_items + items
            if len(self.losses) >= PENDING or len(self.norms) >= PENDING:
                self._sum()
        self.window = []

    def _sum(self) -> None:
        """The pending losses and norms into the float64 sums (the same steps in a resumed run: rows,
        checks and checkpoints call it at the steps they happen, and PENDING counts from the last)."""
        if self.losses:
            stacked = torch.stack(self.losses)
            if stacked.shape[1:] != self.shape:  # checked here, per row, not per micro-step
                need = f"its loss_terms {self.terms} need {self.shape}: [loss, *terms]" if self.terms else "a scalar"
                raise ConfigError(f"the task's loss_sum returned a tensor of shape {tuple(stacked.shape[1:])}: {need}")
            self.loss_sum += stacked.sum(0, dtype=torch.float64)
        if self.norms:
            self.norm_sum += torch.stack(self.norms).sum(dtype=torch.float64)
        self.losses, self.norms = [], []

    def finite(self) -> bool:
        """Are the sums since the last row finite on every rank? (One all-reduce, a host sync.)"""
        self._sum()
        ok = torch.isfinite(self.loss_sum).all() & torch.isfinite(self.norm_sum)
        return not self.d.any(~ok)

    def state_dict(self) -> dict:
        """The sums since the last row, so a resumed run logs the same rows."""
        self._sum()
        as_tensor = lambda n: torch.as_tensor(n, dtype=torch.float64, device=self.d.device)  # noqa: E731
        return {
            "loss_sum": self.loss_sum,
            "norm_sum": self.norm_sum,
            "row_items": as_tensor(self.row_items),
            "items": as_tensor(self.items),
            "steps": self.steps,
            "row_skipped": self.row_skipped,
            "samples": self.samples,
            "skipped": self.skipped,
            "syncs": self.comm.syncs - self.syncs,
            "bytes": self.comm.bytes - self.bytes,
        }

    def load_state_dict(self, state: dict) -> None:
        if state["loss_sum"].shape != self.shape:
            raise ConfigError(
                f"checkpoint.resume: the checkpoint's loss sums have shape {tuple(state['loss_sum'].shape)}, this "
                f"task's loss_terms {self.terms} need {self.shape}; resume with the task it was written with"
            )
        self.loss_sum.copy_(state["loss_sum"])
        self.norm_sum.copy_(state["norm_sum"])
        self.losses, self.norms = [], []
        for key in ("row_items", "items"):  # tensors where the data counts items, else exact integers
            value = state[key].to(self.d.device, torch.float64)
            setattr(self, key, value.clone() if self.items_name else int(value.item()))
        for key in ("steps", "row_skipped", "samples", "skipped"):
            setattr(self, key, state[key])
        self.syncs, self.bytes = self.comm.syncs - state["syncs"], self.comm.bytes - state["bytes"]

    def row(self) -> dict:
        """Means since the last row; an all-reduce, so every rank must call it at the same step."""
        self._sum()
        sums = self.d.all_reduce_sum(self.loss_sum).tolist()  # one all-reduce and host sync, also with terms
        loss_sum, *term_sums = sums if self.terms else [sums]
        counted = self.steps - self.row_skipped
        elapsed = clock() - self.started
        row_items = float(self.row_items)
        mean = lambda total: total / row_items if counted else float("nan")  # noqa: E731
        row = {
            "loss": mean(loss_sum),
            **{f"loss/{name}": mean(total) for name, total in zip(self.terms, term_sums, strict=True)},
            "grad_norm": self.norm_sum.item() / counted if counted else float("nan"),
            "samples": self.samples,
            **({self.items_name: int(self.items)} if self.items_name else {}),
            "comm/grad_syncs": (self.comm.syncs - self.syncs) / self.steps,
            "comm/grad_bytes": (self.comm.bytes - self.bytes) / self.steps,
            "samples_per_s": self.row_samples / elapsed,
            **({f"{self.items_name}_per_s": row_items / elapsed} if self.items_name else {}),
            "time/data_wait": self.data_wait / elapsed,
            "skipped_steps": self.skipped,
        }
        self._reset()
        return row
