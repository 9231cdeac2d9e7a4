"""Models, built by Hydra from conf/model/*.yaml (`_target_`)."""

import math

import torch
import torch.nn.functional as F
from torch import nn


def mlp(in_shape, num_classes: int, width: int = 128, depth: int = 2, dropout: float = 0.0) -> nn.Module:
    """`depth` hidden layers of `width` units with ReLU; no normalisation layers."""
    layers: list[nn.Module] = [nn.Flatten()]
    features = math.prod(in_shape)
    for _ in range(depth):
        layers += [nn.Linear(features, width), nn.ReLU(), nn.Dropout(dropout)]
        features = width
    layers.append(nn.Linear(features, num_classes))
    return nn.Sequential(*layers)


def cnn(in_channels: int, num_classes: int, width: int = 32, dropout: float = 0.0) -> nn.Module:
    """Three conv-BatchNorm-ReLU layers and a linear head: the small model with BatchNorm."""

    def stage(cin, cout):
        return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]

    return nn.Sequential(
        *stage(in_channels, width),
        *stage(width, width),
        nn.MaxPool2d(2),
        *stage(width, 2 * width),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Dropout(dropout),
        nn.Linear(2 * width, num_classes),
    )


def resnet18(in_channels: int, num_classes: int, small_input: bool = False) -> nn.Module:
    """torchvision's ResNet-18 (random init; weights would need a download). `small_input`: the
    CIFAR stem, a 3x3 stride-1 conv and no max-pool; the ImageNet stem (7x7 stride 2, max-pool)
    would shrink a 32x32 image to 8x8 before the first block."""
    from torchvision.models import resnet18 as tv_resnet18

    model = tv_resnet18(num_classes=num_classes)
    if small_input:
        model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    elif in_channels != 3:
        model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
    return model


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention and an MLP, each residual. The natural
    FSDP unit (`parallel.shard_units=[Block]`)."""

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

    def __init__(
        self,
        vocab_size: int,
        block_size: int,
        n_layer: int = 2,
        n_head: int = 4,
        n_embd: int = 64,
        dropout: float = 0.0,
    ):
        super().__init__()
        self.block_size = block_size
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
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def gpt(
    vocab_size: int, block_size: int, n_layer: int = 2, n_head: int = 4, n_embd: int = 64, dropout: float = 0.0
) -> nn.Module:
    return GPT(vocab_size, block_size, n_layer, n_head, n_embd, dropout)
