"""sched=onecycle: torch's OneCycleLR as a multiplier of optim.lr."""

import math

from trainkit.errors import ConfigError


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
