"""Linear warmup, then flat (sched=constant) or a cosine decay (sched=cosine): step -> multiplier of optim.lr."""

import math


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
