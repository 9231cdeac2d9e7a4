"""Predict with a finished training run: `python src/predict.py run_dir=outputs/<date>/<time>` or
`torchrun --nproc_per_node=N src/predict.py run_dir=... [split=val|test|train]`. Config: conf/predict.yaml.

Rebuilds model and data from <run_dir>/.hydra/config.yaml, loads <run_dir>/model.pt (weights=ema:
model_ema.pt, the EMA of the weights; best: model_best.pt; or a path), predicts
each rank's contiguous shard, gathers the shards back into dataset order, and rank 0 writes
predictions.csv and metrics.json into this job's own run dir: the same files for any N. A task whose model
outputs embeddings (task=contrastive) declares `embeddings`: embeddings.pt, {"index", "split", and the task's
per-sample tensors, e.g. "embedding" (N, D) and "label" (N,)}, index-aligned in dataset order, for any N (the
input of retrieval, or of a probe outside trainkit: torch.load(path, weights_only=True)).

The columns are the task's (`predictions`: task=classification's target, prediction and, with
predict.probs=true, prob_<c>; task=regression's target and prediction), the metrics its own of the whole
split. A task that predicts its own way takes the job over (`predict_job`): task=lm decodes data=addition's
answers greedily and samples a text run (data=pydoc_text, tokens) from `prompt=`, `max_new_tokens=`,
`temperature=` (0: greedy), `top_k=`, `seed=`, `num_samples=` into samples.txt, the same for any N
(trainkit/tasks/lm_predict.py). The corpus is not needed.
"""

import inspect
from pathlib import Path
from typing import cast

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from trainkit import config, dist, heldout, options
from trainkit import teacher as teachers
from trainkit.batch import size, to_device
from trainkit.errors import ConfigError
from trainkit.inference import predict
from trainkit.precision import autocast_for
from trainkit.rundir import load_run_config, run_model, say_predicting, split_batches, write_predictions

OWN_KEYS = ("run_dir", "split", "weights", "batch_size", "predict", "trainer", "parallel", "hydra")  # read here
DEFAULTS = Path(__file__).parent.parent / "conf" / "predict.yaml"


def task_results(task, out: dict, probs: bool, device: torch.device) -> tuple[dict, list[list]]:
    """index and the task's own columns (`task.predictions`) per sample, in dataset order ([] for a task without
    predictions), and the task's metrics of the whole split (named <split>/<metric> by the caller) from the
    gathered outputs, computed on `device` as an evaluation is (where a task keeps its state: a teacher, a bank)."""
    rows = []
    if hasattr(task, "predictions"):
        columns = task.predictions(out["logits"], out["targets"], **({"probs": True} if probs else {}))
        values = zip(*(column.tolist() for column in columns.values()), strict=True)
        rows = [["index", *columns]] + [[i, *(_cell(v) for v in row)] for i, row in enumerate(values)]
    logits, targets = (to_device(out[key], device) for key in ("logits", "targets"))
    sums = task.eval_sums(None, logits, targets)  # the whole split at once: the same on any N
    return task.eval_metrics(sums.tolist()) | {"samples": size(out["targets"])}, rows  # (y, x): samples, not 2


def _cell(value) -> str:
    return str(value) if isinstance(value, int) else f"{value:.6g}"


def run(cfg: DictConfig, run_cfg: DictConfig, task, d: dist.Dist, out_dir: Path) -> float | None:
    autocast = autocast_for(cfg.trainer.precision, d.device)
    dataset, loader, batch_size = split_batches(cfg, run_cfg, d, "prediction")
    model, weights = run_model(cfg, run_cfg)
    model.to(d.device).eval()  # as predict() runs it: prepare_eval's embeddings are the eval mode's
    say_predicting(cfg, weights, len(dataset), batch_size, d, out_dir)
    if (prepare := getattr(task, "prepare_eval", None)) is not None:  # e.g. task=contrastive's kNN bank
        prepare(model, d, autocast)
    out = predict(model, loader, d, autocast, task)  # gathered, on every rank
    metrics, rows = task_results(task, out, cfg.predict.probs, d.device)
    embedded = task.embeddings(out["logits"], out["targets"]) if hasattr(task, "embeddings") else None
    write_predictions(cfg, out_dir, metrics, rows, d, embedded)
    return metrics.get(getattr(task, "monitor", "val/loss").split("/")[-1])


@hydra.main(config_path="../conf", config_name="predict", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    return config.one_job(lambda: predict_run(cfg, out_dir), out_dir)  # a known failure: one line, no traceback


def predict_run(cfg: DictConfig, out_dir: Path) -> float | None:
    """Load the run's config and check the settings (before the process group: fail fast, on every
    rank alike), join the process group, predict into `out_dir`."""
    run_cfg = load_run_config(cfg, "predict", heldout.SPLITS)
    # task.teacher (task=distil): the run's copy, moved to the device once it is known (task_results runs there)
    task, teacher = teachers.build_task(run_cfg.task, Path(cfg.run_dir), torch.device("cpu"), own=True)
    if (own := getattr(task, "predict_job", None)) is not None:  # task=lm: decoding answers, sampling text
        return own(cfg, run_cfg, out_dir)
    defaults = cast(DictConfig, OmegaConf.load(DEFAULTS))
    others = [str(key) for key in defaults if key not in OWN_KEYS and key in cfg]  # another task's settings
    if given := [f"{key}={cfg[key]}" for key in others if cfg[key] != defaults[key]]:
        raise ConfigError(  # a setting that would be silently ignored
            f"{', '.join(given)}: sampling settings need a text run (data=pydoc_text); run_dir={cfg.run_dir} "
            f"is a run of data={run_cfg.data.name}"
        )
    if not hasattr(task, "predictions") and not hasattr(task, "embeddings"):
        raise ConfigError(f"run_dir={cfg.run_dir}: its task ({type(task).__name__}) declares no predictions")
    if cfg.predict.probs and "probs" not in inspect.signature(getattr(task, "predictions", run)).parameters:
        raise ConfigError(f"predict.probs=true: the predictions of {type(task).__name__} have no class probabilities")
    options.check_run(Path(cfg.run_dir), run_cfg)  # the split is rebuilt here
    d = dist.init(cfg.parallel.backend, cfg.trainer.device, cfg.parallel.timeout_s)
    if teacher is not None:
        teacher.to(d.device)
    value = run(cfg, run_cfg, task, d, out_dir)
    dist.teardown(finished=True)  # before the interpreter exits, see teardown
    return value


if __name__ == "__main__":
    config.run_cli(main)
