"""The model summary rank 0 prints at start, and the rows' `mem/peak_gb` and `mfu`.

describe() runs on the unwrapped model before wrapping (no DDP/FSDP hooks, no collective): the
parameter count (total, trainable, per top-level module; a tied weight counts once, in the first
module that holds it), the size of parameters and buffers at their dtype, and the FLOPs of one
sample: torch.utils.flop_counter.FlopCounterMode over one forward of `dataset[0]` in eval mode
under no_grad (nothing trains, BatchNorm's running statistics stay; the torch, numpy and python
generators are put back after the sample and the forward: the run's draws are the same).
Training FLOPs are 3x the forward's (backward: 2x, the PaLM / nanoGPT convention).

FlopCounterMode counts 0 for the CPU kernel of scaled_dot_product_attention in torch 2.14.1
(aten._scaled_dot_product_flash_attention_for_cpu has no formula): trainkit gives it torch's own
sdpa_flop_count, as the CUDA kernels have. A model with a formula of its own (`flops_per_token(length)`
and its `flops_formula` text) has it shown beside the count: model=gpt's is nanoGPT's 6N + 12·L·H·Q·T,
which ignores bias and LayerNorm FLOPs and counts bias and LayerNorm parameters as 6 FLOPs each: the two
agree to ~13/(12·n_embd).

Rows: `mem/peak_gb`, the peak since the process started (10^9 bytes; the max over ranks, one
all-reduce per logged row): on CUDA torch.cuda.max_memory_allocated, on CPU the process's peak RSS
(ru_maxrss, KiB on Linux). On a GPU of PEAK_TFLOPS `mfu`: training FLOPs per sample x the row's
samples/s (all ranks) over world size x the device's dense peak at trainer.precision. A data set
of variable-length sequences (data=addition): the FLOPs of dataset[0]'s length, an estimate.
"""

import contextlib
import math
import random
import resource
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils import flop_counter

from trainkit import heldout
from trainkit.batch import to_device, unpack
from trainkit.dist import Dist
from trainkit.loading import TrainWindows, collate_fn
from trainkit.materialize import pending

# Dense peaks in TFLOP/s (no sparsity) by a substring of torch.cuda.get_device_name(), first match
# wins: bf16/fp16 tensor cores, and fp32 without TF32 (torch's matmul default). The vendors' data sheets.
PEAK_TFLOPS: list[tuple[str, dict[str, float]]] = [
    ("H200", {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9}),
    ("H100 PCIe", {"bf16": 756.0, "fp16": 756.0, "fp32": 51.2}),
    ("H100 NVL", {"bf16": 835.0, "fp16": 835.0, "fp32": 60.0}),
    ("H100", {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9}),  # SXM ("NVIDIA H100 80GB HBM3")
    ("A100", {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5}),
    ("L40S", {"bf16": 362.1, "fp16": 362.1, "fp32": 91.6}),
    ("A10G", {"bf16": 70.0, "fp16": 70.0, "fp32": 31.2}),
    ("A10", {"bf16": 125.0, "fp16": 125.0, "fp32": 31.2}),
    ("L4", {"bf16": 121.0, "fp16": 121.0, "fp32": 30.3}),
    ("V100", {"fp16": 125.0, "fp32": 15.7}),  # no bf16 tensor cores
    ("T4", {"fp16": 65.0, "fp32": 8.1}),
    ("RTX 4090", {"bf16": 165.2, "fp16": 165.2, "fp32": 82.6}),
    ("RTX 3090", {"bf16": 71.0, "fp16": 71.0, "fp32": 35.6}),
]


def peak_flops(device_name: str, precision: str) -> float | None:
    """The device's dense peak FLOP/s at the precision; None: not in the table."""
    for key, peaks in PEAK_TFLOPS:
        if key in device_name:
            return peaks[precision] * 1e12 if precision in peaks else None
    return None


def parameters(model: nn.Module) -> dict:
    """Total and trainable parameters, and per top-level module; a tied weight counts once (where first met)."""
    seen: set[int] = set()
    per_module: dict[str, int] = {}
    for name, child in [*model.named_children(), ("(root)", None)]:
        params = list(child.parameters() if child is not None else model.parameters(recurse=False))
        fresh = [p for p in params if id(p) not in seen]
        seen |= {id(p) for p in fresh}
        if params:  # 0: its weights are tied to an earlier module's (GPT's lm_head: wte)
            per_module[name] = sum(p.numel() for p in fresh)
    unique = list(model.parameters())  # parameters() already drops repeats
    return {
        "total": sum(p.numel() for p in unique),
        "trainable": sum(p.numel() for p in unique if p.requires_grad),
        "per_module": per_module,
    }


def size_bytes(model: nn.Module) -> int:
    """Parameters and buffers at their dtype (a tied weight once)."""
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def _cpu_sdpa(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return flop_counter.sdpa_flop_count(query_shape, key_shape, value_shape)


@contextlib.contextmanager
def rng_kept(device: torch.device):
    """The torch (CPU, and the device's), numpy and python generators as they were after the body."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)


def forward_flops(model: nn.Module, x, device: torch.device) -> int:
    """FlopCounterMode's count of one forward of x (what the model gets: a tensor, a dict, ...), in eval mode
    under no_grad; the model, its buffers and every RNG as they were."""
    modes = [(m, m.training) for m in model.modules()]
    mapping = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa}
    try:
        with rng_kept(device), torch.no_grad():
            model.eval()
            with flop_counter.FlopCounterMode(display=False, custom_mapping=mapping) as counter:
                model(x)
        return counter.get_total_flops()
    finally:
        for module, training in modes:
            module.training = training


def peak_memory_gb(d: Dist) -> float:
    """The peak memory since the process started, in 10^9 bytes, the max over ranks (one all-reduce)."""
    if d.device.type == "cuda":
        peak = float(torch.cuda.max_memory_allocated(d.device))
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0  # KiB on Linux
    value = torch.tensor([peak / 1e9], dtype=torch.float64, device=d.device)
    if d.distributed:
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value.item()


@dataclass
class Efficiency:
    """What the rows gain: mem/peak_gb, and mfu where the device's peak is known."""

    d: Dist
    train_flops_per_sample: float | None  # None: not measured
    peak_flops: float | None  # of one device, at trainer.precision; None: CPU or unknown
    facts: dict = field(default_factory=dict)  # the summary: summary.json, W&B, TensorBoard

    def row(self, samples_per_s: float) -> dict[str, float]:
        """Every rank, at each logged row (the all-reduce of the memory peak)."""
        row = {"mem/peak_gb": peak_memory_gb(self.d)}
        if self.peak_flops and self.train_flops_per_sample:
            row["mfu"] = self.train_flops_per_sample * samples_per_s / (self.peak_flops * self.d.world_size)
        return row


def _count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.3g}"


def describe(
    model: nn.Module, dataset, task, d: Dist, precision: str, beside: dict[str, nn.Module | None] | None = None
) -> Efficiency:
    """The summary of the unwrapped model (rank 0 prints it), measured on the first training sample.
    The model goes to its device first (wrap() would move it there anyway) so the forward runs there.
    beside: frozen modules the task runs next to the model ({"teacher": ...}; None: absent), on the device
    already: their parameters, size and forward FLOPs per sample, as `<name>_params`, ... (no training FLOPs)."""
    if not pending(model):  # a model on the meta device (parallel=fsdp) is counted there; its FLOPs are not measured
        model.to(d.device)
    counts = parameters(model)
    facts: dict = {
        "params": counts["total"],
        "params_trainable": counts["trainable"],
        "params_per_module": counts["per_module"],
        "size_mb": size_bytes(model) / 1e6,
    }
    with rng_kept(d.device):  # a data set's augmentation may draw
        x, _ = unpack(task, to_device(collate_fn(dataset)([dataset[0]]), d.device))  # what the model gets
    # A sequence task (items are tokens) on a (1, context) tensor: FLOPs per position of its context
    per_token = task.items_name is not None and isinstance(x, torch.Tensor) and x.dim() == 2
    try:
        forward, why = float(forward_flops(model, x, d.device)), ""
    except Exception as error:  # the summary informs, it never stops a run; the run's first forward will say
        forward, why = 0.0, (str(error).strip().splitlines() or [type(error).__name__])[0][:120]
    train = 3 * forward  # 0: not measured
    kinds = {name: type(child).__name__ for name, child in model.named_children()}
    labels = {name: f"{name}:{kinds[name]}" if name.isdigit() else name for name in counts["per_module"]}  # Sequential
    modules = ", ".join(f"{labels[name]} {_count(n) if n else 'tied'}" for name, n in counts["per_module"].items())
    lines = [
        f"model: {_count(counts['total'])} parameters ({_count(counts['trainable'])} trainable): {modules} | "
        f"{facts['size_mb']:.2f} MB parameters and buffers"
    ]
    if why:
        lines.append(f"FLOPs: not measured ({why})")
    elif per_token:
        length = x.shape[1]
        facts |= {"flops_per_token": train / length, "flops_forward_per_token": forward / length, "context": length}
        line = f"FLOPs per token (context {length}): {_count(forward / length)} forward, "
        line += f"{_count(train / length)} training"
        if (formula := getattr(model, "flops_per_token", None)) is not None:  # its own (model=gpt: nanoGPT's)
            facts["flops_per_token_formula"] = formula(length)
            line += f" ({getattr(model, 'flops_formula', 'its formula')}: {_count(facts['flops_per_token_formula'])})"
        lines.append(line + " (FlopCounterMode, training = 3x forward)")
    else:
        facts |= {"flops_per_sample": train, "flops_forward_per_sample": forward}
        lines.append(f"FLOPs per sample: {_count(forward)} forward, {_count(train)} training (3x forward)")
    if train:
        facts["flops_per_sample"] = train
    for name, module in (beside or {}).items():
        if module is not None:
            lines.append(_beside(name, module, x, d.device, facts))
    peak = None
    if d.device.type == "cuda":
        name = torch.cuda.get_device_name(d.device)
        peak = peak_flops(name, precision)
        facts |= {"device": name, "peak_flops": peak}
        if peak is None:
            lines.append(f"mfu: no {precision} peak FLOP/s known for {name} (summary.PEAK_TFLOPS): no mfu")
        else:
            lines.append(f"mfu against {name}'s dense {precision} peak {peak / 1e12:g} TFLOP/s per device")
    d.print0("\n".join(lines))
    return Efficiency(d, train or None, peak, facts)


def _beside(name: str, module: nn.Module, x, device: torch.device, facts: dict) -> str:
    """A frozen module's summary line; its facts into `facts`."""
    count = parameters(module)["total"]
    try:
        forward = float(forward_flops(module, x, device))
    except Exception:  # the summary never stops a run
        forward = 0.0
    facts |= {f"{name}_params": count, f"{name}_size_mb": size_bytes(module) / 1e6}
    facts |= {f"{name}_flops_forward_per_sample": forward} if forward else {}
    flops = f" | {_count(forward)} FLOPs forward per sample" if forward else ""
    size = f"{size_bytes(module) / 1e6:.2f} MB"
    return f"{name}: {_count(count)} parameters, frozen (no gradient, in no checkpoint) | {size}{flops}"


def announce(
    cfg,
    d: Dist,
    mode: str,
    splits: tuple,
    windows: TrainWindows,
    total_steps: int,
    run_dir: Path,
    no_test: str | None,
) -> None:
    """Rank 0's first lines: the allocation, the model, the data and the batch arithmetic."""
    model_name = cfg.model.get("name") or cfg.model._target_.split(".")[-1]  # model=timm: its model.name
    train_set, val_set, test_set = splits
    layout, steps = windows.layout, windows.layout.windows(cfg.data.drop_last)
    d.print0(
        f"trainkit | {mode} x{d.world_size} on {d.device} | model={model_name} "
        f"data={cfg.data.name} ({len(train_set)} train / {len(val_set)} val / {heldout.size(test_set)}) | "
        f"precision={cfg.trainer.precision}\n"
        f"global batch {layout.global_batch} = {d.world_size} ranks x {layout.batch_size} micro-batch "
        f"x {layout.steps} accumulation ({cfg.accumulation.strategy}) | {steps} steps/epoch, "
        f"{total_steps} steps, {math.ceil(total_steps / steps)} epochs | run dir {run_dir}"
    )
    d.print0(f"data path: {windows.path}")  # on the device or a DataLoader, and why (data.on_device)
    if summary := getattr(train_set, "summary", ""):  # e.g. a corpus's source and its split's documents
        d.print0(summary)
    if cfg.trainer.test and no_test:  # a data set of one's own that returns (train, val) still trains
        d.print0(no_test)
