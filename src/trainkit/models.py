"""Models, built by Hydra from conf/model/*.yaml (`_target_`)."""

import math
from collections.abc import Sequence
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.checkpoint import checkpoint


def mlp(in_shape, num_classes: int, width: int = 128, depth: int = 2, dropout: float = 0.0) -> nn.Module:
    """`depth` hidden layers of `width` units with ReLU; no normalisation layers."""
    layers: list[nn.Module] = [nn.Flatten()]
    features = math.prod(in_shape)
    for _ in range(depth):
        layers += [nn.Linear(features, width), nn.ReLU(), nn.Dropout(dropout)]
        features = width
    layers.append(nn.Linear(features, num_classes))
    return nn.Sequential(*layers)


def cnn(
    in_channels: int, num_classes: int, width: int = 32, dropout: float = 0.0, activation_checkpointing: bool = False
) -> nn.Module:
    """Three conv-BatchNorm-ReLU layers and a linear head: the small model with BatchNorm.
    `activation_checkpointing`: each conv-BatchNorm-ReLU stage is a checkpointed segment."""

    def stage(cin, cout):
        return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]

    stages = [stage(in_channels, width), stage(width, width), stage(width, 2 * width)]
    layers = [
        *stages[0],
        *stages[1],
        nn.MaxPool2d(2),
        *stages[2],
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Dropout(dropout),
        nn.Linear(2 * width, num_classes),
    ]
    if not activation_checkpointing:
        return nn.Sequential(*layers)
    starts = [next(i for i, layer in enumerate(layers) if layer is s[0]) for s in stages]
    return Staged(*layers, stages=[(start, start + len(s)) for start, s in zip(starts, stages, strict=True)])


def resnet18(
    in_channels: int, num_classes: int, small_input: bool = False, activation_checkpointing: bool = False
) -> nn.Module:
    """torchvision's ResNet-18 (random init; weights would need a download). `small_input`: the
    CIFAR stem, a 3x3 stride-1 conv and no max-pool; the ImageNet stem (7x7 stride 2, max-pool)
    would shrink a 32x32 image to 8x8 before the first block. `activation_checkpointing`: each of
    layer1..layer4 is a checkpointed segment (a Staged with the same children, so the same
    parameter names)."""
    from torchvision.models import resnet18 as tv_resnet18

    model = tv_resnet18(num_classes=num_classes)
    if small_input:
        model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    elif in_channels != 3:
        model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
    if activation_checkpointing:
        for name in ("layer1", "layer2", "layer3", "layer4"):
            setattr(model, name, Staged(*getattr(model, name)))
    return model


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention and an MLP, each residual. GPT's FSDP unit."""

    def __init__(self, n_embd: int, n_head: int, dropout: float):
        super().__init__()
        self.n_head, self.dropout = n_head, dropout
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.qkv, self.proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd), nn.Dropout(dropout)
        )
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        heads = (batch, length, self.n_head, width // self.n_head)  # explicit: an empty batch has 0 elements
        q, k, v = (t.reshape(heads).transpose(1, 2) for t in self.qkv(self.ln_1(x)).split(width, 2))
        attention = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        x = x + self.resid_dropout(self.proj(attention.transpose(1, 2).reshape(batch, length, width)))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A small nanoGPT-style causal transformer: token and position embeddings, `n_layer` Blocks,
    a final LayerNorm and a head tied to the token embedding. (B, T) tokens -> (B, T, vocab) logits."""

    # parallel=fsdp's units unless parallel.shard_units names others: one all-gather per Block; the
    # embeddings, tied to the head, and the final LayerNorm stay in the root (trainkit.parallel.fsdp_units).
    shard_units = ("Block",)

    def __init__(
        self,
        vocab_size: int,
        block_size: int,
        n_layer: int = 2,
        n_head: int = 4,
        n_embd: int = 64,
        dropout: float = 0.0,
        activation_checkpointing: bool = False,
    ):
        super().__init__()
        self.block_size, self.activation_checkpointing = block_size, activation_checkpointing
        self.wte, self.wpe = nn.Embedding(vocab_size, n_embd), nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying
        self.apply(_init_weights)
        for name, p in self.named_parameters():  # GPT-2: residual projections scaled by depth
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.drop(self.wte(tokens) + self.wpe(positions))
        checkpointing = self.activation_checkpointing and recomputing_pays(self)
        for block in self.blocks:
            x = checkpointed([block], x) if checkpointing else block(x)
        return self.lm_head(self.ln_f(x))


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def gpt(
    vocab_size: int,
    block_size: int,
    n_layer: int = 2,
    n_head: int = 4,
    n_embd: int = 64,
    dropout: float = 0.0,
    activation_checkpointing: bool = False,
) -> nn.Module:
    """`activation_checkpointing`: each Block is a checkpointed segment."""
    return GPT(vocab_size, block_size, n_layer, n_head, n_embd, dropout, activation_checkpointing)


# --- activation checkpointing (model.activation_checkpointing) ----------------------------------
#
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
