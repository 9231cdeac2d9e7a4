"""What comes after an optimizer step (a log row, an evaluation, a checkpoint, a stop), decided once per step, so
that the steps in between cost the loop one comparison."""

from dataclasses import dataclass
from typing import Protocol


class Signals(Protocol):
    """What the cadence asks of trainkit.stop.Stopper: a signal's flag, read every step, and its decision."""

    received: int

    def due(self, last: bool = False) -> str | None: ...


@dataclass
class Due:
    """After one step: which of the bookkeeping's parts run. `stop`: the reason (a signal, the time budget) every
    rank stops for after checkpointing this step, else None. `save` grows when an evaluation stops the run early."""

    log: bool
    evaluate: bool
    save: bool
    stop: str | None

    def __bool__(self) -> bool:
        return self.log or self.evaluate or self.save


class Cadence:
    """The steps after which train() does more than train: multiples of each non-zero interval (trainer.log_every,
    trainer.eval_every, checkpoint.every; eval_every 0: no evaluation) and the run's `total`; every step where
    `each_step` (a live progress bar, the profiler's window, a Stopper that counts steps or time). A signal is
    its own flag (Signals.received), read every step. The cost the steps in between are spared is measured in
    docs/performance.md."""

    def __init__(
        self,
        total: int,
        log_every: int,
        eval_every: int,
        save_every: int,
        stopper: Signals,
        each_step: bool = False,
        start: int = 0,
    ):
        self.total, self.each_step, self.stopper = total, each_step, stopper
        self.log_every, self.eval_every, self.save_every = log_every, eval_every, save_every
        self.every = [n for n in (log_every, eval_every, save_every) if n > 0]
        self.calm_until = self.next(start)  # the first step after() looks at closely (start: a resume's step)

    def next(self, step: int) -> int:
        """The first step after `step` that needs the bookkeeping (never past the run's last)."""
        if self.each_step:
            return step + 1
        return min([self.total, *(step // n * n + n for n in self.every)])

    def after(self, step: int) -> Due | None:
        """None after most steps: nothing but the next step (one comparison). Else what comes after `step`: an
        empty Due (false) where only the progress bar, the profiler or the Stopper had to look."""
        if step < self.calm_until and not self.stopper.received:
            return None
        self.calm_until = self.next(step)
        last = step == self.total
        stop = self.stopper.due(last=last)  # on any rank: every rank checkpoints this step and stops (an all-reduce)
        evaluate = self.eval_every > 0 and (last or step % self.eval_every == 0)
        saves = last or (self.save_every > 0 and step % self.save_every == 0) or stop is not None
        return Due(log=last or step % self.log_every == 0, evaluate=evaluate, save=saves, stop=stop)
