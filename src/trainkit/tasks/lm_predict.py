"""predict.py on a task=lm run (LanguageModel.predict_job): data=addition's answers decoded greedily
(predictions.csv: index,prompt,target,prediction,correct; metrics.json: the exact match, overall and per
operand-length pair), or text sampled from a character or token model (a text run: prompt=, temperature=,
...; data=tokens: through its tokenizer, trainkit/data/tokens.py) into samples.txt.

Each sample draws from its own generator, seeded from (seed, sample index): what sample i is does
not depend on how many ranks share the work or which one draws it. A sample is generated alone (a
batch of one): its logits then do not depend on which other samples share a batch either."""

import contextlib
import math
from pathlib import Path
from typing import cast

import torch
from omegaconf import DictConfig, OmegaConf

from trainkit import dist
from trainkit.data.addition import END, IGNORE
from trainkit.data.pydoc_text import VOCAB_FILE, Vocabulary, is_text_run
from trainkit.data.tokenizer import Prompts
from trainkit.data.tokens import META_FILE, Codec, is_tokens_run
from trainkit.dist import Dist
from trainkit.errors import ConfigError
from trainkit.inference import gather, generate
from trainkit.loading import shard_bounds
from trainkit.precision import autocast_for
from trainkit.rng import generation_seed
from trainkit.rundir import run_model, save_job, say_predicting, split_batches, write_predictions

SAMPLING_KEYS = ("prompt", "max_new_tokens", "temperature", "top_k", "num_samples")  # a text run's settings
SEPARATOR = "\n---------------\n"  # after each sample in samples.txt (nanoGPT's sample.py prints it)


def predict_job(cfg: DictConfig, run_cfg: DictConfig, out_dir: Path) -> float | None:
    """Check the settings (before the process group: every rank fails alike), join it, decode or sample."""
    run_dir = Path(cfg.run_dir)
    vocab = Vocabulary.load(run_dir) or Codec.load(run_dir) or Prompts.load(run_dir)  # a text run's, else None
    if vocab is not None:
        check(cfg.prompt, cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.num_samples, vocab)
    elif is_text_run(run_cfg):  # else it would be taken for an addition run and fail at the end
        raise ConfigError(f"run_dir={run_dir} is a text run (data={run_cfg.data.name}) without its {VOCAB_FILE}")
    elif is_tokens_run(run_cfg):
        raise ConfigError(f"run_dir={run_dir} is a tokens run without its {META_FILE}")
    else:  # a setting that would be silently ignored
        defaults = cast(DictConfig, OmegaConf.load(Path(__file__).parents[3] / "conf" / "predict.yaml"))
        if given := [f"{key}={cfg[key]}" for key in SAMPLING_KEYS if cfg[key] != defaults[key]]:
            raise ConfigError(
                f"{', '.join(given)}: sampling settings need a text run (data=pydoc_text); run_dir={run_dir} "
                f"is a run of data={run_cfg.data.name}"
            )
    d = dist.init(cfg.parallel.backend, cfg.trainer.device, cfg.parallel.timeout_s)
    accuracy = None
    if vocab is None:
        accuracy = answer_run(cfg, run_cfg, d, out_dir)
    else:
        sample_run(cfg, run_cfg, vocab, d, out_dir)
    dist.teardown(finished=True)  # before the interpreter exits, see teardown
    return accuracy


def answer_run(cfg: DictConfig, run_cfg: DictConfig, d: Dist, out_dir: Path) -> float:
    """data=addition: every problem's answer by greedy decoding, in dataset order."""
    dataset, loader, batch_size = split_batches(cfg, run_cfg, d, "prediction")
    model, weights = run_model(cfg, run_cfg)
    say_predicting(cfg, weights, len(dataset), batch_size, d, out_dir)
    autocast = autocast_for(cfg.trainer.precision, d.device)
    generated = generate(model.to(d.device), loader, d, END, IGNORE, autocast)  # gathered, every rank
    metrics, rows = sequence_results(dataset, generated)
    write_predictions(cfg, out_dir, metrics, rows, d)
    return metrics["accuracy"]


def sequence_results(dataset, generated: torch.Tensor) -> tuple[dict, list[list]]:
    """index,prompt,target,prediction,correct per problem (as people write them), and the exact
    match overall and per operand-length pair (data=addition)."""
    rows: list[list] = [["index", "prompt", "target", "prediction", "correct"]]
    by_lengths: dict[str, list[bool]] = {}
    for index, tokens in enumerate(generated.tolist()):
        prompt, target = dataset.problem(index)
        prediction = dataset.read_answer(tokens)
        rows.append([index, prompt, target, prediction, int(prediction == target)])
        digits = (len(n.lstrip("0") or "0") for n in prompt[:-1].split("+"))  # data.zero_pad's zeros do not count
        pair = "x".join(map(str, digits))
        by_lengths.setdefault(pair, []).append(prediction == target)
    correct = sum(row[-1] for row in rows[1:])
    metrics = {
        "accuracy": correct / len(generated),
        "samples": len(generated),
        "accuracy_by_operand_lengths": {k: sum(v) / len(v) for k, v in sorted(by_lengths.items())},
    }
    return metrics, rows


def sample_run(
    cfg: DictConfig, run_cfg: DictConfig, vocab: Vocabulary | Codec | Prompts, d: Dist, out_dir: Path
) -> None:
    """Text samples from a text run's model: samples.txt and stdout (rank 0)."""
    run_cfg.data.vocab_size = vocab.size  # the run's vocabulary, not this Python's corpus (${pydoc_vocab_size:})
    model, weights = run_model(cfg, run_cfg)
    d.print0(
        f"sample | run dir {cfg.run_dir} ({weights.name}) | {cfg.num_samples} sample(s) of "
        f"{cfg.max_new_tokens} tokens, temperature {cfg.temperature}, top_k {cfg.top_k}, seed {cfg.seed} | "
        f"{d.world_size} rank(s) on {d.device} | writing to {out_dir}"
    )
    texts = samples(model.to(d.device), cfg.prompt, cfg, vocab, d, autocast_for(cfg.trainer.precision, d.device))
    if d.is_main:
        save_job(cfg, out_dir, d)
        (out_dir / "samples.txt").write_text("".join(text + SEPARATOR for text in texts))
    d.print0("".join(text + SEPARATOR for text in texts), end="")
    d.print0(f"done: wrote {out_dir / 'samples.txt'}")


def check(prompt, max_new_tokens, temperature, top_k, num_samples, vocab: Vocabulary | Codec | Prompts) -> None:
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
    vocab: Vocabulary | Codec | Prompts,
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


def samples(
    model, prompt: str, cfg, vocab: Vocabulary | Codec | Prompts, d: Dist, autocast=contextlib.nullcontext
) -> list[str]:
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
