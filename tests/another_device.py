"""A device that is not the CPU, on a machine that has only a CPU: where a GPU would refuse a tensor on the wrong
device or make the host wait, this one does too, and still computes every number as the CPU does.

On a CPU-only machine every tensor is on the CPU, so a tensor made without a device (`torch.tensor(len(target))`
beside a batch's sums: the crash every evaluation hit on the first GPU tried) is invisible. Here the model and the
batches live on `DEVICE`: each such tensor is an `OnDevice` wrapper around the CPU tensor that holds its values, and
every operation on one runs on those values (so a run computes what it computes on the CPU, bit for bit, and its
checks on numbers still hold). An operation that mixes one with a CPU tensor raises CUDA's "Expected all tensors to
be on the same device", with CUDA's one exception (a 0-dim CPU tensor as a scalar in a pointwise operation).

The wrapper wears the label of torch's `meta` device: a CUDA build of torch sends autograd on any other non-CPU
device type (a `privateuseone` backend registered from Python) through CUDA's hooks, which fail without a GPU.
Plain `meta` tensors would not do: they hold no values, so `.item()`, `.tolist()`, a metric, a checkpoint and every
decision on a number (early stopping, the best checkpoint) could not run. (torch's `load_state_dict` warns that a
copy into a meta parameter is a no-op: into an OnDevice one it is a real copy, as the tests' bit-equal weights show.)
FakeTensorMode treats a 0-dim CPU tensor as a scalar everywhere and let the crash through. A mode that only
refuses factory calls without `device=` misses a `.cpu()` tensor met again on the device, and refuses a model's
buffers built in `__init__` (moved by `.to(device)` later, as they should be). Attention takes torch's math kernel
here (the CPU a fused one): runs compared with the CPU's run under `sdpa_kernel(SDPBackend.MATH)`.

Host syncs: the calls that make the host wait on a GPU are counted (`Syncs`): a value read on the host (`.item()`,
`bool()`, `float()`, `.tolist()`, `.numpy()`), a copy to the host or from it without `non_blocking=True` (`.cpu()`,
`.to("cpu")`, `torch.tensor(x, device=gpu)`), and an operation whose output size depends on values (`nonzero`,
`masked_select`, indexing by a mask, `unique`). `torch.cuda.set_sync_debug_mode("warn")` warns at the same calls on a
real GPU.

Limits: one process (a gloo collective cannot send such a tensor: distributed paths run on the CPU elsewhere in the
suite); no torch.compile; autocast is not emulated (bf16/fp16 runs on a real GPU: scripts/gpu_check.sh).
"""

import contextlib
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, return_and_correct_aliasing
from torch.utils._pytree import tree_flatten, tree_map_only

DEVICE = torch.device("meta")
CPU = torch.device("cpu")
SRC = str(Path(__file__).resolve().parents[1] / "src")


def _here(device) -> bool:
    return device is not None and torch.device(device).type == DEVICE.type


class OnDevice(torch.Tensor):
    """A tensor on DEVICE; `held` holds its values on the CPU."""

    held: torch.Tensor
    __torch_function__ = torch._C._disabled_torch_function_impl  # the ops themselves: __torch_dispatch__

    @staticmethod
    def __new__(cls, real: torch.Tensor):
        assert not isinstance(real, OnDevice) and real.device == CPU, real
        made = torch.Tensor._make_wrapper_subclass(
            cls,
            real.size(),
            strides=real.stride(),
            storage_offset=real.storage_offset(),
            dtype=real.dtype,
            layout=real.layout,
            device=DEVICE,
            requires_grad=real.requires_grad,
        )
        made.held = real
        return made

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"OnDevice({self.held!r})"

    def __reduce_ex__(self, protocol):
        return self.held.__reduce_ex__(protocol)  # torch.save: as the CPU tensor (what map_location="cpu" loads)

    def __tensor_flatten__(self):
        return ["held"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return OnDevice(inner["held"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _run(func, args, kwargs or {})


@dataclass
class Syncs:
    """Host syncs, each as (step, kind, where): `step` the optimizer step running when it happened (set by
    `begin_step`; None before the first), `where` the innermost line of the project's own code that made it."""

    events: list[tuple[int | None, str, str]] = field(default_factory=list)
    step: int | None = None

    def begin_step(self, step: int) -> None:
        self.step = step

    def record(self, kind: str) -> None:
        self.events.append((self.step, kind, _where()))

    def at(self, step: int) -> list[tuple[str, str]]:
        return [(kind, where) for s, kind, where in self.events if s == step]


_syncs: Syncs | None = None


def _record(kind: str) -> None:
    if _syncs is not None:
        _syncs.record(kind)


def _where() -> str:
    """The innermost frame in src/ (the engine, a room): the line to change; else the innermost outside torch."""
    frames = [f for f in traceback.extract_stack() if not f.filename.startswith(str(Path(__file__)))]
    ours = [f for f in frames if f.filename.startswith(SRC)]
    outside = [f for f in frames if "/torch/" not in f.filename]
    frame = (ours or outside or frames)[-1]
    where = f"{Path(frame.filename).name}:{frame.lineno}"
    if ours and outside and "/transformers/" in outside[-1].filename:  # inside a transformers model: its line too
        where += f" (transformers/{Path(outside[-1].filename).name}:{outside[-1].lineno})"
    return where


def _wrap(out):
    return tree_map_only(torch.Tensor, lambda t: t if isinstance(t, OnDevice) else OnDevice(t), out)


def _real(tree):
    return tree_map_only(OnDevice, lambda t: t.held, tree)


# Operations whose output size depends on the values: the host waits for them on a GPU.
_VALUE_SIZED = {
    "aten::nonzero",
    "aten::masked_select",
    "aten::_unique2",
    "aten::unique_dim",
    "aten::unique_consecutive",
    "aten::repeat_interleave",
}


def _run(func, args, kwargs):
    """One aten operation with an OnDevice argument, or made on DEVICE, run on the CPU values."""
    tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    here = [t for t in tensors if isinstance(t, OnDevice)]
    if func is torch.ops.aten._local_scalar_dense.default and here:  # .item(), bool(), float(), int()
        _record("item")
        return func(here[0].held)
    if func.overloadpacket in (torch.ops.aten._to_copy, torch.ops.aten.to):  # .to(device), .cpu(), .to(dtype)
        return _moved(func, args, kwargs)
    if func is torch.ops.aten.copy_.default:  # dst.copy_(src): a copy across devices is allowed, and may wait
        dst, src = args[0], args[1]
        if isinstance(dst, OnDevice) != isinstance(src, OnDevice) and not (args[2:] and args[2]):
            _record("copy_ across devices (not non_blocking)")
        func(_real(dst), _real(src), *args[2:], **kwargs)
        return dst
    plain = [t for t in tensors if not isinstance(t, OnDevice)]
    if here and plain:
        scalars = torch.Tag.pointwise in func.tags  # CUDA takes a 0-dim CPU tensor as a scalar there, only
        strays = [t for t in plain if not (scalars and t.dim() == 0 and t.device == CPU)]
        if strays:
            raise RuntimeError(
                f"Expected all tensors to be on the same device, but found at least two devices, {DEVICE} and "
                f"{strays[0].device}! ({func}, a tensor of shape {list(strays[0].shape)} on {strays[0].device})"
            )
    made_here = _here(kwargs.get("device"))
    if not here and not made_here:
        return func(*args, **kwargs)
    name = func._schema.name
    if here and (name in _VALUE_SIZED or (name == "aten::index" and _indexed_by_mask(args))):
        _record(f"{name.removeprefix('aten::')} (its size depends on values)")
    out = func(*_real(args), **_real(kwargs | ({"device": CPU} if made_here else {})))
    if made_here and not here:
        return _wrap(out)
    if func.is_view and torch.is_inference_mode_enabled() and not any(t.is_inference() for t in here):
        # A view of a normal tensor (a parameter's expand: ViT's class token) inside inference mode: its wrapper
        # made there would be an inference tensor that cannot share the base's version counter (CUDA's is no
        # new tensor). Made outside inference mode, as the base is.
        with torch.inference_mode(False):
            return return_and_correct_aliasing(func, args, kwargs, _wrap(out))
    return return_and_correct_aliasing(func, args, kwargs, _wrap(out))


def _moved(func, args, kwargs):
    """aten._to_copy and aten.to's overloads (inference mode dispatches them undecomposed): a copy between the
    devices, or a change of dtype where the tensor is."""
    source, schema = args[0], func._schema
    bound = {arg.name: value for arg, value in zip(schema.arguments, args, strict=False)} | kwargs
    other = bound.get("other")
    target = other.device if isinstance(other, torch.Tensor) else bound.get("device")
    dtype = other.dtype if isinstance(other, torch.Tensor) else bound.get("dtype")
    on = isinstance(source, OnDevice)
    to_device = _here(target) or (target is None and on)
    if (on != to_device) and not bound.get("non_blocking"):  # a blocking copy between host and device
        _record("copy to the device (not non_blocking)" if to_device else "copy to the host (.cpu(), .to(cpu))")
    moved = _real(source).to(dtype=dtype or source.dtype, copy=True)
    return OnDevice(moved) if to_device else moved


def _indexed_by_mask(args) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else []))


class _Dispatch(TorchDispatchMode):
    """Operations on plain tensors that are made on DEVICE (`torch.zeros(3, device=DEVICE)`)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _here(kwargs.get("device")) or any(isinstance(t, OnDevice) for t in tree_flatten((args, kwargs))[0]):
            return _run(func, args, kwargs)
        return func(*args, **kwargs)


_TO_HOST = {torch.Tensor.tolist: "tolist", torch.Tensor.numpy: "numpy", torch.Tensor.__array__: "numpy"}
_FROM_DATA = (torch.tensor, torch.as_tensor, torch.asarray, torch.Tensor.new_tensor)


class _Functions(TorchFunctionMode):
    """What torch does in Python or C++ before an aten operation: a device's module and kernels are looked up
    (`.to(DEVICE)`), data is copied from Python (`torch.tensor(x, device=DEVICE)`), values read (`.tolist()`)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _TO_HOST and isinstance(args[0], OnDevice):
            _record(_TO_HOST[func])
            return func(args[0].held, *args[1:], **kwargs)
        if func is torch.Tensor.to:
            device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
            source = args[0]
            if _here(device):
                if isinstance(source, OnDevice):
                    return source if dtype in (None, source.dtype) else OnDevice(source.held.to(dtype))
                if not non_blocking:
                    _record("copy to the device (not non_blocking)")
                return OnDevice(source.to(CPU, dtype))
        if func in _FROM_DATA:
            device = kwargs.get("device")
            if device is None and func is torch.Tensor.new_tensor and isinstance(args[0], OnDevice):
                device = DEVICE
            if device is None and func in (torch.as_tensor, torch.asarray) and isinstance(args[0], OnDevice):
                return func(*args, **kwargs)  # already there
            if _here(device):
                _record("copy to the device (torch.tensor(x, device=...))")  # a blocking copy of the host's x
                made = func(*args, **(kwargs | {"device": CPU}))
                return OnDevice(made.held if isinstance(made, OnDevice) else made)
        return func(*args, **kwargs)


@contextlib.contextmanager
def on_another_device() -> Iterator[Syncs]:
    """Within: DEVICE works as a GPU would (`.to(DEVICE)`, `torch.zeros(..., device=DEVICE)`); yields the Syncs."""
    global _syncs
    _syncs = syncs = Syncs()
    made = torch.Generator

    class Generator(made):  # type: ignore[misc,valid-type]
        """A generator on DEVICE (predict.py's sampling: torch.Generator(d.device)) draws on the host, where its
        values are; CUDA has generators of its own, meta none ("META device type not an accelerator")."""

        def __new__(cls, device="cpu"):
            return made(CPU if _here(device) else device)

    torch.Generator = Generator  # type: ignore[misc]
    try:
        with _Functions(), _Dispatch():
            yield syncs
    finally:
        _syncs = None
        torch.Generator = made  # type: ignore[misc]
