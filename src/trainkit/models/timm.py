"""model=timm: any architecture of timm's zoo by name (`model.name`), random init unless `pretrained`.

Why a module of its own: timm's models need three things trainkit's own models build in themselves.
- Units for parallel=fsdp: the model gets a `shard_units` attribute (trainkit.parallel.fsdp_units reads
  it), the classes of its repeated residual blocks present in it. The rule, by class name: a name ending
  in "Block" (ViT's Block, ConvNeXtBlock, ResNet's BasicBlock, Swin's SwinTransformerBlock, ...) or
  "Bottleneck" (ResNet-50 and up), or one of EfficientNet's block classes (_MORE_BLOCKS). A block inside
  another is a unit too (FSDP2 shards innermost first); what no block holds (stem, downsampling, the
  final norm and head) stays in the root. A model with none of them: trainkit's default units.
- Activation checkpointing: each outermost block is one checkpointed segment (trainkit.recompute's
  checkpointed: BatchNorm's running statistics put back after the recomputation, so the step is the
  same bit for bit). timm's own set_grad_checkpointing would update them twice.
- Arguments: timm's builders pass keyword arguments through to the model class, and which ones a class
  takes is known only by building it: `img_size` is tried and dropped where the class refuses it.
- The data's input: an architecture that cannot take the data's size (convnext_atto or
  vit_tiny_patch16_224 on digits' 8x8: a kernel larger than what is left of the image) would fail in
  the run's first forward, after its run dir is made. `check_input` runs the model once on the meta
  device (shapes only, no arithmetic: 0.1-0.2 s for convnext_tiny or vit_base at 224, where a CPU
  forward of one sample took 1-3 s here) and refuses it in one line naming model.name, data.shape and
  the smallest square size it takes, before the run dir is claimed (exit 2; eval.py, predict.py alike).
"""

import difflib
from dataclasses import dataclass, field
from typing import Any

import torch
from omegaconf import MISSING
from torch import nn

from trainkit.errors import ConfigError
from trainkit.recompute import checkpoint_forward, outermost


@dataclass
class Schema:
    """conf/model/timm.yaml's keys and their types."""

    _target_: str = MISSING
    name: str = "resnet18"
    num_classes: int = MISSING
    in_chans: int = MISSING
    img_size: int | None = None  # where the architecture takes one (ViTs); CNNs take any
    pretrained: bool = False
    activation_checkpointing: bool = False
    kwargs: dict[str, Any] = field(default_factory=dict)


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
    takes_size = img_size is not None  # a ViT is built for one size; a CNN takes any
    try:
        try:
            model = timm.create_model(name, pretrained, **sized)
        except TypeError as error:
            if img_size is None or "img_size" not in str(error):
                raise
            takes_size = False
            model = timm.create_model(name, pretrained, **args)  # the architecture takes any size (a CNN)
    except OSError as error:  # the hub's download or cache lookup (requests' errors are OSErrors too)
        first = str(error).strip().splitlines()[0][:160] if str(error).strip() else type(error).__name__
        raise ConfigError(
            f"model.pretrained=true: no weights for {name} ({first}); timm takes them from the Hugging Face "
            "hub: the network, or its cache filled beforehand (HF_HOME)"
        ) from None
    if img_size is not None:  # the data's shape is [in_chans, img_size, img_size] (config.check)
        check_input(model, name, args, takes_size, in_chans, img_size)
    units = block_classes(model)
    model.shard_units = units or None  # type: ignore[assignment]  # None: trainkit's default units
    model.layer_of = layer_order(model)  # optim.layer_decay's order
    if activation_checkpointing:
        for block in outermost(model, units):
            checkpoint_forward(block)
    return model


def layer_order(model: nn.Module):
    """optim.layer_decay's layer of each parameter name (trainkit/optim.py), timm's own: its group_matcher's
    fine groups (stem 0, each block, the head last), as timm's param_groups_layer_decay numbers them; a model
    without a group_matcher: timm's auto_group_layers. Names it does not list: the last layer, as timm does."""
    from timm.models import group_parameters
    from timm.optim._param_groups import auto_group_layers

    if (matcher := getattr(model, "group_matcher", None)) is not None:
        layers = group_parameters(model, matcher(coarse=False), reverse=True)
    else:
        layers = auto_group_layers(model)
    last = max(layers.values())
    return lambda name: layers.get(name, last)


FIT_SIZES = (16, 32, 64, 128, 224, 256, 384, 512, 1024)  # the square sizes tried for "what would fit"


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:160]


def _meta_forward(name: str, args: dict, sized: bool, in_chans: int, size: int) -> str | None:
    """Build `name` on the meta device (no weights allocated, none initialised) and run one sample of
    in_chans x size x size through it (shapes only): None where it fits, else the error's first line."""
    import timm

    with torch.random.fork_rng(devices=[]):  # whatever a builder draws, the run's generator stays as it was
        kwargs: dict[str, Any] = args | ({"img_size": size} if sized else {})
        try:
            with torch.device("meta"):
                model = timm.create_model(name, False, **kwargs)
                model.eval()
                with torch.no_grad():
                    model(torch.zeros(1, in_chans, size, size))
        except Exception as error:  # what the run's first forward would raise
            return _first_line(error)
    return None


def check_input(model: nn.Module, name: str, args: dict, sized: bool, in_chans: int, img_size: int) -> None:
    """A ConfigError, one line, where timm's `name` cannot take data.shape=[in_chans, img_size, img_size]
    (see the module's docstring), naming the smallest of FIT_SIZES that fits. `sized`: built for
    img_size (a ViT). A failure on the meta device is confirmed by a forward of `model` itself (eval
    mode, no gradient: nothing in it changes) before it is said: a builder the meta device cannot run
    must not refuse a model that fits."""
    if _meta_forward(name, args, sized, in_chans, img_size) is None:
        return
    training = model.training
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            model.eval()(torch.zeros(1, in_chans, img_size, img_size))
        return
    except Exception as error:
        said = _first_line(error)
    finally:
        model.train(training)
    sizes = f"{FIT_SIZES[0]}, {FIT_SIZES[1]}, ..., {FIT_SIZES[-1]}"
    fit = next((s for s in FIT_SIZES if s > img_size and _meta_forward(name, args, sized, in_chans, s) is None), None)
    takes = f"the smallest square input it takes is {fit}x{fit} (of {sizes})" if fit else f"none of {sizes} fits it"
    raise ConfigError(
        f"model.name={name} does not take data.shape=[{in_chans},{img_size},{img_size}] ({said}): {takes}; "
        "larger images (an image folder's data.image_size) or another model.name"
    )


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
