"""trainer.deterministic: the same seed gives the same run on a GPU, bit for bit, or a one-line refusal.

Without it a GPU run is reproducible only to reduction order: cuBLAS splits a matrix product's sum by a
workspace heuristic, cuDNN picks (and with benchmark=True times) convolution algorithms per run, and
scatter-adds, index_add and the backward of embedding, interpolation and pooling add with atomics in the order
threads arrive. true sets what torch documents for determinism (docs/gpu.md lists what is then bit-equal and
what is refused):
- torch.use_deterministic_algorithms(True): each operation's deterministic kernel, or a RuntimeError naming it
  (errors.user_error turns that into one line naming the key); uninitialized memory (torch.empty) filled with NaN, so
  a read of it shows;
- CUBLAS_WORKSPACE_CONFIG=:4096:8 (kept if set): cuBLAS reads it when its first handle is made, which is why
  `use_deterministic` runs before anything touches the device;
- cuDNN: deterministic=True, benchmark=False.
false puts torch's defaults back, so a process that runs several jobs (a sweep) never carries one job's setting
into the next. The CPU's kernels are deterministic for a fixed thread count already; the switch changes no
number there, but an operation without a deterministic kernel (put_) is refused there too.
"""

import os

import torch

CUBLAS_WORKSPACE = ":4096:8"  # torch's documented setting (":16:8" saves 24 MiB and may cost speed)


def use_deterministic(enabled: bool) -> None:
    """trainer.deterministic's settings for this process (before any kernel runs)."""
    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(enabled)
    torch.backends.cudnn.deterministic = enabled
    torch.backends.cudnn.benchmark = False  # torch's default; autotuning picks per run
