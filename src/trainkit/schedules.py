"""LR schedules as pure functions: optimizer step -> multiplier of the base LR.

conf/sched/*.yaml binds their settings (`_partial_`); `multiplier` adds total_steps and train.py
hands the result to torch's LambdaLR, which calls it once per optimizer step.
"""

import functools
import math
from collections.abc import Callable

from hydra.utils import instantiate
from omegaconf import DictConfig

from trainkit.errors import ConfigError


def multiplier(sched: DictConfig, total_steps: int) -> Callable[[int], float]:
    """The configured schedule with its settings bound, as a plain functools.partial: Hydra's own
    partial checks its target policy on every call (~0.1 ms, as long as a small model's step)."""
    schedule = instantiate(sched, total_steps=total_steps)
    if isinstance(schedule, functools.partial):
        return functools.partial(schedule.func, *schedule.args, **schedule.keywords)
    return schedule


def constant(step: int, *, total_steps: int, warmup_steps: int = 0) -> float:
    """Linear warmup from 1/(warmup+1) to 1, then 1."""
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    return 1.0


def warmup_cosine(step: int, *, total_steps: int, warmup_steps: int = 0, min_ratio: float = 0.0) -> float:
    """Linear warmup, then cosine decay from 1 to min_ratio at total_steps."""
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def one_cycle(
    step: int,
    *,
    total_steps: int,
    pct_start: float = 0.3,
    div_factor: float = 25.0,
    final_div_factor: float = 1.0e4,
) -> float:
    """torch's OneCycleLR (cosine annealing, two phases) as a multiplier of optim.lr, the peak:
    from 1/div_factor up to 1 over the first pct_start of the steps, then down to
    1/(div_factor x final_div_factor) at the last step (and thereafter). Smith & Topin,
    "Super-Convergence" (2017); momentum is not cycled (it is the optimizer's)."""
    if not 0 < pct_start < 1 or div_factor <= 0 or final_div_factor <= 0:
        raise ConfigError(
            f"sched: pct_start={pct_start} must be in (0, 1), div_factor={div_factor} and "
            f"final_div_factor={final_div_factor} positive"
        )
    start, end = 1 / div_factor, 1 / (div_factor * final_div_factor)
    peak_step = float(pct_start * total_steps) - 1  # as torch counts: the peak at step pct x total - 1
    last_step = total_steps - 1
    if step <= peak_step:
        return _cosine(start, 1.0, step / peak_step if peak_step > 0 else 1.0)
    return _cosine(1.0, end, min(1.0, (step - peak_step) / (last_step - peak_step)))  # the divisor is > 0


def _cosine(start: float, end: float, progress: float) -> float:
    return end + (start - end) / 2 * (math.cos(math.pi * progress) + 1)
