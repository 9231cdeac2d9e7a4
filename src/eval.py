"""Evaluate a finished training run: `python src/eval.py run_dir=outputs/<date>/<time> [split=test|val|train]
[weights=last|best|ema|<path>]` or `torchrun --nproc_per_node=N src/eval.py run_dir=...`. Config: conf/eval.yaml.

Rebuilds model and data from <run_dir>/.hydra/config.yaml, loads the weights (model.pt, model_best.pt,
model_ema.pt or a file), evaluates the split with train.py's own `evaluate` (each rank a contiguous
shard, all-reduced sums: every sample once, at any N), and rank 0 writes metrics.json
({"test/loss": ..., "test/acc": ...}, named by the split) into this job's run dir and prints it: the
numbers train.py logged for those weights and that split.

An entry point of its own, not a mode of predict.py: predict writes per-sample predictions (and
samples from a text run, whose split it never evaluates); this writes the training metrics alone,
for every data set (text runs too), of any of the run's weights.
"""

import json
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig

from trainkit import config, dist, heldout, options
from trainkit import teacher as teachers
from trainkit.evaluate import evaluate
from trainkit.parent import model_node
from trainkit.precision import autocast_for
from trainkit.progress import headline
from trainkit.rundir import load_run_config, load_weights, save_job, split_batches, weights_path


def eval_run(cfg: DictConfig, out_dir: Path) -> dict[str, float]:
    """Check the settings (before the process group: every rank fails alike), join the process group,
    evaluate, write metrics.json into `out_dir` (rank 0)."""
    run_cfg = load_run_config(cfg, "eval", heldout.SPLITS)
    run_dir = Path(cfg.run_dir)
    weights = weights_path(run_dir, str(cfg.weights))
    options.check_run(run_dir, run_cfg)  # the split is rebuilt here (data=pydoc_text: from this Python's corpus)
    d = dist.init(cfg.parallel.backend, cfg.trainer.device, cfg.parallel.timeout_s)
    dataset, batches, batch_size = split_batches(cfg, run_cfg, d, "evaluation")
    model = instantiate(model_node(run_cfg))  # less model.init: the run's own weights load next
    load_weights(model, weights)
    precision = cfg.trainer.precision or run_cfg.trainer.precision
    d.print0(
        f"eval | run dir {run_dir} | weights {weights} | split={cfg.split} ({len(dataset)} samples) | "
        f"{d.world_size} rank(s) on {d.device}, batch {batch_size} per rank, {precision} | writing to {out_dir}"
    )
    task, _ = teachers.build_task(run_cfg.task, run_dir, d.device, own=True)  # task.teacher: the run's copy
    metrics = evaluate(model.to(d.device), batches, d, autocast_for(precision, d.device), task, prefix=cfg.split)
    batches.check()
    if d.is_main:
        save_job(cfg, out_dir, d)
        (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    d.print0(json.dumps(metrics))
    d.print0(f"done: {heldout.line(metrics, cfg.split, headline(task))}; wrote {out_dir / 'metrics.json'}")
    dist.teardown(finished=True)  # before the interpreter exits, see teardown
    return metrics


@hydra.main(config_path="../conf", config_name="eval", version_base="1.3")
def main(cfg: DictConfig) -> None:
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    config.one_job(lambda: eval_run(cfg, out_dir), out_dir)  # a known failure: one line, no traceback


if __name__ == "__main__":
    config.run_cli(main)
