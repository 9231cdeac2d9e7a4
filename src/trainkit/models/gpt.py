"""model=gpt: a small nanoGPT-style causal transformer (data=addition, pydoc_text, tokens; task=lm)."""

import math

import torch
import torch.nn.functional as F
from torch import nn

from trainkit.recompute import checkpointed, recomputing_pays


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

    def layer_of(self, name: str) -> int:
        """optim.layer_decay's order (trainkit/optim.py): the embeddings 0, block i i + 1, the final norm (and the
        head, tied to the token embedding: its parameter is wte's) n_layer + 1."""
        if name.startswith("blocks."):
            return int(name.split(".")[1]) + 1
        return 0 if name.startswith(("wte.", "wpe.")) else len(self.blocks) + 1

    def adapt_init(self, name: str, tensor: torch.Tensor) -> torch.Tensor | None:
        """model.init from a parent of a shorter context (trainkit/parent.py): its position rows first, the rows
        past them this model's own initialisation. Any other shape change: None (refused)."""
        own = self.wpe.weight
        if name != "wpe.weight" or tensor.shape[1:] != own.shape[1:] or len(tensor) > len(own):
            return None
        return torch.cat([tensor.to(own.dtype), own.detach()[len(tensor) :]])

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.drop(self.wte(tokens) + self.wpe(positions))
        checkpointing = self.activation_checkpointing and recomputing_pays(self)
        for block in self.blocks:
            x = checkpointed([block], x) if checkpointing else block(x)
        return self.lm_head(self.ln_f(x))

    flops_formula = "6N + 12·L·H·Q·T"  # the summary prints flops_per_token beside FlopCounterMode's count

    def flops_per_token(self, length: int) -> float:
        """nanoGPT's estimate_mfu: training FLOPs per token, 6N + 12·L·H·Q·T (H·Q = n_embd; N: the parameters
        less the position embedding, the tied token embedding counted once, as the head)."""
        n = sum(p.numel() for p in self.parameters()) - self.wpe.weight.numel()
        return float(6 * n + 12 * len(self.blocks) * self.wte.embedding_dim * length)


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


# conf/model/gpt.yaml's _target_ (and saved runs'): the class itself, its signature the keys' one place (options.py
# derives their schema from it).
gpt = GPT
