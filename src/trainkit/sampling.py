"""Sampling text from a trained character or token model (predict.py on a text run: prompt=, temperature=,
...; data=tokens: through its tokenizer, trainkit/tokens.py).

Each sample draws from its own generator, seeded from (seed, sample index): what sample i is does
not depend on how many ranks share the work or which one draws it. A sample is generated alone (a
batch of one): its logits then do not depend on which other samples share a batch either."""

import contextlib
import math

import torch

from trainkit.data import shard_bounds
from trainkit.dist import Dist
from trainkit.errors import ConfigError
from trainkit.inference import gather
from trainkit.rng import generation_seed
from trainkit.text import Vocabulary
from trainkit.tokens import Codec


def check(prompt, max_new_tokens, temperature, top_k, num_samples, vocab: Vocabulary | Codec) -> None:
    """One ConfigError naming the first bad setting."""
    if not isinstance(prompt, str) or not prompt:
        quote = f" (Hydra reads {prompt} as a number: quote it, \"prompt='{prompt}'\")" if prompt is not None else ""
        raise ConfigError(f"prompt={prompt} must be a non-empty string{quote}")
    if unknown := vocab.unknown(prompt):
        raise ConfigError(f"prompt={prompt!r} has characters outside the run's vocabulary: {unknown!r}")
    for key, value in (("max_new_tokens", max_new_tokens), ("num_samples", num_samples)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{key}={value} must be a positive integer")
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or not 0 <= temperature < math.inf:
        raise ConfigError(f"temperature={temperature} must be a finite number >= 0 (0: greedy)")
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1):
        raise ConfigError(f"top_k={top_k} must be null or a positive integer")


@torch.inference_mode()
def sample(
    model: torch.nn.Module,
    prompt: list[int],
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    vocab: Vocabulary | Codec,
    generator: torch.Generator,
    device: torch.device,
    autocast=contextlib.nullcontext,
) -> list[int]:
    """`max_new_tokens` tokens following `prompt`: greedy at temperature 0, else drawn from the
    softmax of logits / temperature, restricted to the `top_k` most likely. The context is the last
    block_size tokens; the padding token (and any id past the vocabulary) is never drawn."""
    model.eval()
    block_size = int(model.block_size)  # type: ignore[arg-type]  # sequence models carry their block_size
    tokens = torch.tensor([prompt], device=device)
    for _ in range(max_new_tokens):
        with autocast():
            logits = model(tokens[:, -block_size:])[0, -1].float()
        logits[vocab.pad :] = -torch.inf  # the model may have more ids than the vocabulary has characters
        if temperature == 0:
            following = logits.argmax().view(1)
        else:
            # In float64, from the largest logit (0 stays 0): a tiny temperature makes the distribution
            # one-hot instead of inf / inf = NaN (temperature=1e-45 failed in torch.multinomial).
            logits = (logits.double() - logits.max()) / temperature
            if top_k is not None and top_k < vocab.pad:
                logits[logits < torch.topk(logits, top_k).values[-1]] = -torch.inf
            following = torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)
        tokens = torch.cat([tokens, following[None]], dim=1)
    return tokens[0, len(prompt) :].tolist()


def samples(model, prompt: str, cfg, vocab: Vocabulary | Codec, d: Dist, autocast=contextlib.nullcontext) -> list[str]:
    """cfg.num_samples texts (prompt + continuation), in sample order, on every rank: each rank draws
    a contiguous share, each sample with its own generator from (cfg.seed, sample index)."""
    start, end = shard_bounds(cfg.num_samples, d.world_size, d.rank)
    mine = []
    for index in range(start, end):
        generator = torch.Generator(d.device).manual_seed(generation_seed(cfg.seed, index))
        mine.append(
            sample(
                model,
                vocab.encode(prompt),
                cfg.max_new_tokens,
                cfg.temperature,
                cfg.top_k,
                vocab,
                generator,
                d.device,
                autocast,
            )
        )
    local = torch.tensor(mine, dtype=torch.long, device=d.device).view(-1, cfg.max_new_tokens)
    return [prompt + vocab.decode(row) for row in gather(local, d).tolist()]
