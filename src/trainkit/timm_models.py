"""model=timm: any architecture of timm's zoo by name (`model.name`), random init unless `pretrained`.

Why a module of its own: timm's models need three things trainkit's own models build in themselves.
- Units for parallel=fsdp: the model gets a `shard_units` attribute (trainkit.parallel.fsdp_units reads
  it), the classes of its repeated residual blocks present in it. The rule, by class name: a name ending
  in "Block" (ViT's Block, ConvNeXtBlock, ResNet's BasicBlock, Swin's SwinTransformerBlock, ...) or
  "Bottleneck" (ResNet-50 and up), or one of EfficientNet's block classes (_MORE_BLOCKS). A block inside
  another is a unit too (FSDP2 shards innermost first); what no block holds (stem, downsampling, the
  final norm and head) stays in the root. A model with none of them: trainkit's default units.
- Activation checkpointing: each outermost block is one checkpointed segment (trainkit.models'
  checkpointed: BatchNorm's running statistics put back after the recomputation, so the step is the
  same bit for bit). timm's own set_grad_checkpointing would update them twice.
- Arguments: timm's builders pass keyword arguments through to the model class, and which ones a class
  takes is known only by building it: `img_size` is tried and dropped where the class refuses it.
"""

import difflib
from contextlib import nullcontext
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

from trainkit.errors import ConfigError
from trainkit.models import _KeepBatchNormStats, recomputing_pays

_MORE_BLOCKS = ("InvertedResidual", "DepthwiseSeparableConv", "EdgeResidual")


def timm_model(
    name: str,
    num_classes: int,
    in_chans: int,
    img_size: int | None = None,
    pretrained: bool = False,
    activation_checkpointing: bool = False,
    kwargs: dict[str, Any] | None = None,
) -> nn.Module:
    """timm.create_model(name, ...) with the data's classes and channels; `img_size` where the
    architecture takes it (ViTs), `kwargs` passed as they are (e.g. drop_rate, patch_size).
    `pretrained`: timm downloads the weights (the network, or the Hugging Face hub cache)."""
    import timm

    if not timm.is_model(name):
        close = close_names(name, timm.list_models())
        hint = f"; close: {', '.join(close)}" if close else ""
        raise ConfigError(f"model.name={name} is not a timm model{hint} (all: timm.list_models('PATTERN'))")
    args: dict[str, Any] = dict(num_classes=num_classes, in_chans=in_chans, **(kwargs or {}))
    sized = args | ({"img_size": img_size} if img_size is not None else {})
    try:
        try:
            model = timm.create_model(name, pretrained, **sized)
        except TypeError as error:
            if img_size is None or "img_size" not in str(error):
                raise
            model = timm.create_model(name, pretrained, **args)  # the architecture takes any size (a CNN)
    except OSError as error:  # the hub's download or cache lookup (requests' errors are OSErrors too)
        first = str(error).strip().splitlines()[0][:160] if str(error).strip() else type(error).__name__
        raise ConfigError(
            f"model.pretrained=true: no weights for {name} ({first}); timm takes them from the Hugging Face "
            "hub: the network, or its cache filled beforehand (HF_HOME)"
        ) from None
    units = block_classes(model)
    model.shard_units = units or None  # type: ignore[assignment]  # None: trainkit's default units
    if activation_checkpointing:
        for block in outermost(model, units):
            checkpoint_forward(block)
    return model


def close_names(name: str, names: list[str], n: int = 5) -> list[str]:
    """The `n` names most like `name`, whole or by their start (vit_tinny: vit_tiny_patch16_224, ...)."""

    def like(other: str) -> float:
        return max(_ratio(name, other), _ratio(name, other[: len(name)]) - 0.01)  # ties: the whole name first

    return [other for other in sorted(names, key=like, reverse=True)[:n] if like(other) >= 0.6]


def _ratio(a: str, b: str) -> float:
    return difflib.SequenceMatcher(None, a, b).ratio()


def is_block(module: nn.Module) -> bool:
    kind = type(module).__name__
    return kind.endswith(("Block", "Bottleneck")) or kind in _MORE_BLOCKS


def block_classes(model: nn.Module) -> tuple[str, ...]:
    """The class names of the blocks in `model` (the rule in the module's docstring), sorted."""
    return tuple(sorted({type(m).__name__ for m in model.modules() if m is not model and is_block(m)}))


def outermost(model: nn.Module, classes: tuple[str, ...]) -> list[nn.Module]:
    """The modules of `classes` that no other of them contains."""
    found: list[nn.Module] = []
    inside: set[int] = set()
    for m in model.modules():
        if m is model or id(m) in inside or type(m).__name__ not in classes:
            continue
        found.append(m)
        inside.update(id(sub) for sub in m.modules())
    return found


def checkpoint_forward(block: nn.Module) -> None:
    """Make `block`'s forward one checkpointed segment in a training forward (an instance attribute:
    the parameter names, and FSDP2's hooks around __call__, stay as they are)."""
    plain = block.forward

    def forward(*args, **kwargs):
        if not recomputing_pays(block):
            return plain(*args, **kwargs)

        def contexts():  # forward's, and the recomputation's: BatchNorm's running statistics put back
            return nullcontext(), _KeepBatchNormStats([block])

        return checkpoint(plain, *args, use_reentrant=False, context_fn=contexts, **kwargs)

    block.forward = forward
