"""Predict with a finished training run: `python src/predict.py run_dir=outputs/<date>/<time>` or
`torchrun --nproc_per_node=N src/predict.py run_dir=... [split=val|test|train]`. Config: conf/predict.yaml.

Rebuilds model and data from <run_dir>/.hydra/config.yaml, loads <run_dir>/model.pt (weights=ema:
model_ema.pt, the EMA of the weights; best: model_best.pt; or a path), predicts
each rank's contiguous shard, gathers the shards back into dataset order, and rank 0 writes
predictions.csv and metrics.json into this job's own run dir: the same files for any N.

A text run (data=pydoc_text: a vocab.json in its run dir; data=tokens: meta.json and tokenizer.json)
is sampled from instead: `prompt=`,
`max_new_tokens=`, `temperature=` (0: greedy), `top_k=`, `seed=`, `num_samples=`; rank 0 writes
samples.txt, the same for any N (trainkit/sampling.py). The corpus is not needed.
"""

import json
from pathlib import Path
from typing import cast

import hydra
import torch
import torch.nn.functional as F
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from trainkit import config, dist, heldout, sampling, text
from trainkit.addition import END, IGNORE
from trainkit.errors import ConfigError
from trainkit.inference import generate, predict
from trainkit.precision import autocast_for
from trainkit.rundir import load_run_config, load_weights, split_batches, weights_path
from trainkit.tasks import LanguageModel
from trainkit.text import VOCAB_FILE, Vocabulary
from trainkit.tokens import META_FILE, Codec, is_tokens_run

SAMPLING_KEYS = ("prompt", "max_new_tokens", "temperature", "top_k", "num_samples")  # a text run's settings
DEFAULTS = Path(__file__).parent.parent / "conf" / "predict.yaml"


def metrics_of(logits: torch.Tensor, targets: torch.Tensor) -> dict:
    """Loss and accuracy from the gathered full arrays, in dataset order: the same numbers for
    any world size (per-rank partial sums would be added in a W-dependent order)."""
    # Per-sample loss in float32 (as evaluate does), summed in float64 in a fixed order.
    loss = F.cross_entropy(logits, targets, reduction="none").double().sum().item()
    correct = (logits.argmax(dim=1) == targets).sum().item()
    return {"loss": loss / len(targets), "accuracy": correct / len(targets), "samples": len(targets)}


def class_rows(out: dict, probs: bool) -> list[list]:
    """index,target,prediction[,prob_0..prob_{C-1}]: a header, then one row per sample in dataset order."""
    logits, targets = out["logits"], out["targets"]
    header = ["index", "target", "prediction"] + ([f"prob_{c}" for c in range(logits.shape[1])] if probs else [])
    prob_rows = logits.softmax(dim=1).tolist() if probs else [[]] * len(targets)
    rows = zip(targets.tolist(), logits.argmax(dim=1).tolist(), prob_rows, strict=True)
    return [header] + [[i, t, p, *(f"{v:.6g}" for v in q)] for i, (t, p, q) in enumerate(rows)]


def task_results(task, out: dict) -> tuple[dict, list[list]]:
    """index and the task's own columns (`task.predictions`) per sample, in dataset order, and the task's
    metrics of the whole split (named <split>/<metric> by the caller) from the gathered outputs."""
    columns = task.predictions(out["logits"], out["targets"])
    values = zip(*(column.tolist() for column in columns.values()), strict=True)
    rows = [["index", *columns]] + [[i, *(f"{v:.6g}" for v in row)] for i, row in enumerate(values)]
    sums = task.eval_sums(None, out["logits"], out["targets"])  # the whole split at once: the same on any N
    return task.eval_metrics(sums.tolist()) | {"samples": len(out["targets"])}, rows


def sequence_results(dataset, generated: torch.Tensor) -> tuple[dict, list[list]]:
    """index,prompt,target,prediction,correct per problem (as people write them), and the exact
    match overall and per operand-length pair (data=addition)."""
    rows: list[list] = [["index", "prompt", "target", "prediction", "correct"]]
    by_lengths: dict[str, list[bool]] = {}
    for index, tokens in enumerate(generated.tolist()):
        prompt, target = dataset.problem(index)
        prediction = dataset.read_answer(tokens)
        rows.append([index, prompt, target, prediction, int(prediction == target)])
        pair = "x".join(str(len(n)) for n in prompt[:-1].split("+"))
        by_lengths.setdefault(pair, []).append(prediction == target)
    correct = sum(row[-1] for row in rows[1:])
    metrics = {
        "accuracy": correct / len(generated),
        "samples": len(generated),
        "accuracy_by_operand_lengths": {k: sum(v) / len(v) for k, v in sorted(by_lengths.items())},
    }
    return metrics, rows


def run(cfg: DictConfig, run_cfg: DictConfig, d: dist.Dist, out_dir: Path) -> float | None:
    run_dir = Path(cfg.run_dir)
    autocast = autocast_for(cfg.trainer.precision, d.device)
    dataset, loader, batch_size = split_batches(cfg, run_cfg, d, "prediction")
    model = instantiate(run_cfg.model)
    weights = weights_path(Path(cfg.run_dir), cfg.weights)
    load_weights(model, weights)
    d.print0(
        f"predict | run dir {run_dir} ({weights.name}) | split={cfg.split} ({len(dataset)} samples) | "
        f"{d.world_size} rank(s) on {d.device}, batch {batch_size} per rank | writing to {out_dir}"
    )

    task = instantiate(run_cfg.task)
    if isinstance(task, LanguageModel):  # sequences: greedy decoding of answers
        generated = generate(model.to(d.device), loader, d, END, IGNORE, autocast)  # gathered, every rank
        metrics, rows = sequence_results(dataset, generated)
    elif hasattr(task, "predictions"):  # a task that says what its rows hold (e.g. task=regression)
        metrics, rows = task_results(task, predict(model.to(d.device), loader, d, autocast, task))
    else:
        out = predict(model.to(d.device), loader, d, autocast)  # gathered, on every rank
        metrics, rows = metrics_of(out["logits"], out["targets"]), class_rows(out, cfg.predict.probs)
    if d.is_main:
        config.save(cfg, out_dir)
        with open(out_dir / "predictions.csv", "w") as f:
            f.writelines(",".join(map(str, row)) + "\n" for row in rows)
        (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    numbers = {key: value for key, value in metrics.items() if isinstance(value, float)}  # accuracy; loss, rmse, r2
    d.print0(
        f"done: {', '.join(f'{key} {value:.4f}' for key, value in numbers.items())}"
        f" on {metrics['samples']} {cfg.split} samples; wrote {out_dir / 'predictions.csv'} and metrics.json"
    )
    return metrics.get("accuracy", metrics.get(getattr(task, "monitor", "/loss").split("/")[-1]))


SEPARATOR = "\n---------------\n"  # after each sample in samples.txt (nanoGPT's sample.py prints it)


def sample_run(cfg: DictConfig, run_cfg: DictConfig, vocab: Vocabulary | Codec, d: dist.Dist, out_dir: Path) -> None:
    """Text samples from a text run's model: samples.txt and stdout (rank 0)."""
    run_dir = Path(cfg.run_dir)
    run_cfg.data.vocab_size = vocab.size  # the run's vocabulary, not this Python's corpus (${pydoc_vocab_size:})
    model = instantiate(run_cfg.model)
    weights = weights_path(Path(cfg.run_dir), cfg.weights)
    load_weights(model, weights)
    d.print0(
        f"sample | run dir {run_dir} ({weights.name}) | {cfg.num_samples} sample(s) of "
        f"{cfg.max_new_tokens} tokens, temperature {cfg.temperature}, top_k {cfg.top_k}, seed {cfg.seed} | "
        f"{d.world_size} rank(s) on {d.device} | writing to {out_dir}"
    )
    texts = sampling.samples(
        model.to(d.device), cfg.prompt, cfg, vocab, d, autocast_for(cfg.trainer.precision, d.device)
    )
    if d.is_main:
        config.save(cfg, out_dir)
        (out_dir / "samples.txt").write_text("".join(text + SEPARATOR for text in texts))
    d.print0("".join(text + SEPARATOR for text in texts), end="")
    d.print0(f"done: wrote {out_dir / 'samples.txt'}")


@hydra.main(config_path="../conf", config_name="predict", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    return config.one_job(lambda: predict_run(cfg, out_dir), out_dir)  # a known failure: one line, no traceback


def predict_run(cfg: DictConfig, out_dir: Path) -> float | None:
    """Load the run's config and check the settings (before the process group: fail fast, on every
    rank alike), join the process group, predict (or sample, from a text run) into `out_dir`."""
    run_cfg = load_run_config(cfg, "predict", heldout.SPLITS)
    vocab = Vocabulary.load(Path(cfg.run_dir)) or Codec.load(Path(cfg.run_dir))  # a text run's, else None
    if vocab is not None:
        sampling.check(cfg.prompt, cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.num_samples, vocab)
    elif text.is_text_run(run_cfg):  # else it would be taken for an addition run and fail at the end
        raise ConfigError(f"run_dir={cfg.run_dir} is a text run (data={run_cfg.data.name}) without its {VOCAB_FILE}")
    elif is_tokens_run(run_cfg):
        raise ConfigError(f"run_dir={cfg.run_dir} is a tokens run without its {META_FILE}")
    else:  # a setting that would be silently ignored
        defaults = cast(DictConfig, OmegaConf.load(DEFAULTS))
        if given := [f"{key}={cfg[key]}" for key in SAMPLING_KEYS if cfg[key] != defaults[key]]:
            raise ConfigError(
                f"{', '.join(given)}: sampling settings need a text run (data=pydoc_text); run_dir={cfg.run_dir} "
                f"is a run of data={run_cfg.data.name}"
            )
    d = dist.init(cfg.parallel.backend, cfg.trainer.device, cfg.parallel.timeout_s)
    accuracy = None
    if vocab is None:
        accuracy = run(cfg, run_cfg, d, out_dir)
    else:
        sample_run(cfg, run_cfg, vocab, d, out_dir)
    dist.teardown(finished=True)  # before the interpreter exits, see teardown
    return accuracy


if __name__ == "__main__":
    config.run_cli(main)
