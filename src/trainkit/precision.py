"""Mixed precision: the autocast context that training, evaluation and inference share."""

import contextlib
from functools import partial

import torch

from trainkit.errors import ConfigError

PRECISIONS = ("fp32", "bf16", "fp16")

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast_for(precision: str, device: torch.device):
    """A zero-argument context factory: autocast for bf16/fp16, a null context for fp32."""
    if precision not in PRECISIONS:
        raise ConfigError(f"trainer.precision={precision} is not one of: {', '.join(PRECISIONS)}")
    if precision not in _DTYPES:
        return contextlib.nullcontext
    return partial(torch.autocast, device.type, dtype=_DTYPES[precision])
