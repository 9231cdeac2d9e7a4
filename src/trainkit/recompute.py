"""Activation checkpointing (model.activation_checkpointing): the helpers a model's forward uses to run
its stages as checkpointed segments (trainkit/models/cnn.py, gpt.py, resnet.py), or to make a block of a
library's model one (timm.py, hf.py: outermost, checkpoint_forward)."""

from collections.abc import Sequence
from contextlib import nullcontext

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.checkpoint import checkpoint

# A checkpointed segment keeps only its input in forward and reruns its forward in backward to
# rebuild the activations its backward needs: less memory, one more forward per segment.
#
# Built into the models' forward (torch.utils.checkpoint, the way torch's own FSDP2 tests compose
# it), so it is in place before train.py's wrap(): single, DDP and FSDP2 alike, nothing in
# parallel.py depends on it. With FSDP2 a unit's hooks may run inside the segment (GPT's Block,
# resnet18's BasicBlock as units): in the backward recomputation FSDP2 skips its pre-forward
# all-gather and post-forward reshard (its PRE_BACKWARD state: the pre-backward hook has
# unsharded the unit already). Non-reentrant (use_reentrant=False): torch's recommendation, the
# variant FSDP2 and DDP support; it also stops recomputing once the tensors backward needs exist.


def recomputing_pays(module: nn.Module) -> bool:
    """Checkpoint only a training forward that builds a graph: eval and inference (no_grad) have no
    backward to save activations for, so they run each segment once."""
    return module.training and torch.is_grad_enabled()


def checkpointed(layers: Sequence[nn.Module], x: torch.Tensor) -> torch.Tensor:
    """`layers` applied in turn to x, as one checkpointed segment. preserve_rng_state (the default)
    replays the RNG state of the forward in the recomputation: the same dropout masks."""
    return checkpoint(
        _apply, layers, x, use_reentrant=False, context_fn=lambda: (nullcontext(), _KeepBatchNormStats(layers))
    )


def _apply(layers: Sequence[nn.Module], x: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        x = layer(x)
    return x


class _KeepBatchNormStats:
    """The recomputation's context: BatchNorm normalises with the batch statistics again (training
    mode) and its kernel updates the running statistics in place, a second time: put them (and
    num_batches_tracked) back as the forward left them. (Turning tracking off instead would change
    what batch_norm saves for backward, which checkpoint refuses.) A class, not a generator: a
    second backward through a retained graph recomputes, and enters it, again."""

    def __init__(self, layers: Sequence[nn.Module]):
        self.layers = layers
        self.saved: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __enter__(self) -> None:
        norms = [m for layer in self.layers for m in layer.modules() if isinstance(m, _BatchNorm)]
        self.saved = [(b, b.clone()) for m in norms for b in m.buffers(recurse=False)]

    def __exit__(self, *exc) -> None:
        with torch.no_grad():
            for buffer, value in self.saved:
                buffer.copy_(value)
        self.saved = []


class Staged(nn.Sequential):
    """An nn.Sequential whose `stages`, (start, stop) ranges of its layers, each run as one
    checkpointed segment in a training forward; by default all its layers are one segment. Its
    layers keep nn.Sequential's names (0, 1, ...): the state_dict is the same with and without
    checkpointing."""

    def __init__(self, *layers: nn.Module, stages: Sequence[tuple[int, int]] | None = None):
        super().__init__(*layers)
        self.stages = list(stages) if stages is not None else [(0, len(layers))]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not recomputing_pays(self):
            return super().forward(x)
        layers, done = list(self), 0
        for start, stop in self.stages:
            x = _apply(layers[done:start], x)
            x = checkpointed(layers[start:stop], x)
            done = stop
        return _apply(layers[done:], x)


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
