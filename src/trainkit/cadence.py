"""Which optimizer steps need the training loop's bookkeeping after them (a log row, an evaluation, a checkpoint,
the run's last step), so that the steps between them cost the loop one comparison."""


class Cadence:
    """The steps after which train() does more than train: multiples of each non-zero `every` (trainer.log_every,
    trainer.eval_every, checkpoint.every) and the run's `total`; every step where `each_step` (a live progress bar,
    the profiler's window, a Stopper that counts steps or time). The calls the loop made after every step for
    them (the bar, the profiler, the Stopper, checkpoint.due, three flags) cost ~7 us a step in the loop, 1 % of
    the default mlp's step (scripts/bench_train.py). A signal is its own flag (Stopper.received), read every step."""

    def __init__(self, total: int, *every: int, each_step: bool = False):
        self.total, self.every, self.each_step = total, [n for n in every if n > 0], each_step

    def next(self, step: int) -> int:
        """The first step after `step` that needs the bookkeeping (never past the run's last)."""
        if self.each_step:
            return step + 1
        return min([self.total, *(step // n * n + n for n in self.every)])
