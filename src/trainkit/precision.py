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


def use_tf32(enabled: bool, device: torch.device) -> None:
    """trainer.tf32 (default true): fp32 matrix products and convolutions on a GPU's TF32 tensor cores (Ampere and
    later: several times the fp32 rate; the products' inputs keep a 10-bit mantissa, the sums stay fp32), as
    nanoGPT and most recipes set it. false: IEEE fp32 throughout. Only CUDA has it: on the CPU nothing changes."""
    if device.type != "cuda":
        return
    precision = "tf32" if enabled else "ieee"
    torch.backends.cuda.matmul.fp32_precision = precision  # torch's API since 2.9 (allow_tf32 is its legacy one)
    torch.backends.cudnn.conv.fp32_precision = precision  # type: ignore[attr-defined]  # no stub
