"""A finished training run, read back by src/predict.py, src/eval.py and src/export.py: its composed config and its
weights (model.pt, model_best.pt, model_ema.pt or a file), with one-line errors for what is missing.
Shared here because no entry point imports another."""

import json
from pathlib import Path
from typing import Any, cast

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from trainkit import config, heldout, provenance
from trainkit.checkpoint import load_model, save_whole
from trainkit.dist import Dist
from trainkit.errors import ConfigError
from trainkit.halving import EvalBatches
from trainkit.parent import WEIGHTS, model_node  # weights=<name>: in the run dir


def load_run_config(cfg: DictConfig, script: str, splits: tuple[str, ...] = ()) -> DictConfig:
    """The training run's composed config; one-line errors for what is missing or wrong."""
    if OmegaConf.is_missing(cfg, "run_dir"):
        raise ConfigError(f"run_dir is required: python src/{script}.py run_dir=<dir of a training run>")
    run_dir = Path(cfg.run_dir)
    if not run_dir.is_dir():
        raise ConfigError(f"run_dir={run_dir} does not exist")
    for name in (".hydra/config.yaml", "model.pt"):  # model.pt appears when training has finished
        if not (run_dir / name).is_file():
            raise ConfigError(f"run_dir={run_dir} has no {name}: not a finished training run")
    if "split" in cfg and cfg.split not in splits:  # export.py reads no split
        raise ConfigError(f"split={cfg.split} is not one of: {', '.join(splits)}")
    if cfg.get("batch_size") is not None and (not isinstance(cfg.batch_size, int) or cfg.batch_size < 1):
        raise ConfigError(f"batch_size={cfg.batch_size} must be null or a positive integer")
    run_cfg = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
    if not isinstance(run_cfg, DictConfig):
        raise ConfigError(f"run_dir={run_dir}: .hydra/config.yaml is not a training run's config")
    config.typed(run_cfg)  # the options' schemas (and their modules' resolvers, which the config may use)
    return run_cfg


def write_predictions(
    cfg: DictConfig, out_dir: Path, metrics: dict, rows: list[list], d: Dist, embedded: dict | None = None
) -> None:
    """predictions.csv (rows: a header, then one row per sample in dataset order; none: no file), embeddings.pt
    (`embedded`: the task's per-sample tensors, with "index" and "split") and metrics.json in out_dir, rank 0;
    then the `done:` line of the metrics' numbers."""
    wrote = [name for name, what in (("predictions.csv", rows), ("embeddings.pt", embedded)) if what]
    if d.is_main:
        save_job(cfg, out_dir, d)
        if rows:
            with open(out_dir / "predictions.csv", "w") as f:
                f.writelines(",".join(map(str, row)) + "\n" for row in rows)
        if embedded:
            index = torch.arange(metrics["samples"])  # dataset order: row i is sample i of the split
            save_whole({"index": index, "split": str(cfg.split), **embedded}, out_dir / "embeddings.pt")
        (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    numbers = {key: value for key, value in metrics.items() if isinstance(value, float)}
    d.print0(
        f"done: {', '.join(f'{key} {value:.4f}' for key, value in numbers.items())}"
        f" on {metrics['samples']} {cfg.split} samples; wrote {out_dir / wrote[0]}"
        f"{''.join(f', {name}' for name in wrote[1:])} and metrics.json"
    )


def save_job(cfg: DictConfig, out_dir: Path, d: Dist) -> None:
    """Rank 0: a predict or eval job's config (.hydra/) and provenance.json (its code, command and world size, and
    the run it read, run_dir, with that run's own record)."""
    config.save(cfg, out_dir)
    provenance.write(out_dir, cfg, d.world_size)


def weights_path(run_dir: Path, weights: str) -> Path:
    """weights=last|best|ema (the run dir's model.pt, model_best.pt, model_ema.pt) or a path."""
    path = Path(run_dir) / WEIGHTS[weights] if weights in WEIGHTS else Path(weights)
    if not path.is_file():
        why = {
            "best": ": the run kept no best checkpoint (checkpoint.monitor=null, or no evaluation)",
            "ema": ": the run kept no EMA (trainer.ema.decay=null)",
        }.get(weights, "")
        raise ConfigError(f"weights={weights}: {path} does not exist{why}")
    return path


def load_weights(model: torch.nn.Module, path: Path) -> None:
    try:
        state = torch.load(path, weights_only=True, map_location="cpu")  # never unpickle code
    except Exception as error:
        # torch's message runs over many lines; the type is enough to tell corrupt from unsafe.
        raise ConfigError(
            f"{path} is no state_dict that torch.load(weights_only=True) reads ({type(error).__name__})"
        ) from None
    load_model(model, state, f"{path} (the run's model config)")


def run_model(cfg: DictConfig, run_cfg: DictConfig) -> tuple[torch.nn.Module, Path]:
    """The run's model (on the CPU) with the weights `cfg.weights` names, and their file."""
    model = instantiate(model_node(run_cfg))  # less model.init: the run's own weights load next
    weights = weights_path(Path(cfg.run_dir), cfg.weights)
    load_weights(model, weights)
    return model, weights


def say_predicting(cfg: DictConfig, weights: Path, samples: int, batch_size: int, d: Dist, out_dir: Path) -> None:
    """predict.py's first line: what it predicts with, on what, where it writes."""
    d.print0(
        f"predict | run dir {cfg.run_dir} ({weights.name}) | split={cfg.split} ({samples} samples) | "
        f"{d.world_size} rank(s) on {d.device}, batch {batch_size} per rank | writing to {out_dir}"
    )


WORLD_SIZE = "${world_size:}"  # the resolver of this job's world size (trainkit/config.py)


def run_batch_size(cfg: DictConfig, run_cfg: DictConfig, d: Dist) -> Any:
    """The run's data.batch_size, as its run resolved it: a value that follows the world size (an experiment's
    ${micro_batch:global,K,${world_size:}}) resolves at the run's own world size (its provenance.json's newest start;
    none: 1), not at this job's, which need not divide the global batch; said once. Else one line naming batch_size=."""
    from omegaconf.errors import InterpolationResolutionError

    raw = OmegaConf.to_container(run_cfg.data, resolve=False).get("batch_size")  # type: ignore[union-attr]
    world_size, merged = d.world_size, run_cfg
    if isinstance(raw, str) and WORLD_SIZE in raw:
        record = provenance.read(Path(cfg.run_dir)) or {}
        world_size = int(([record, *record.get("resumes", [])][-1]).get("world_size") or 1)
        node = OmegaConf.create({"data": {"batch_size": raw.replace(WORLD_SIZE, str(world_size))}})
        merged = cast(DictConfig, OmegaConf.merge(run_cfg, node))  # the run's other keys (global batch, K) as is
    try:
        batch_size = merged.data.batch_size
    except InterpolationResolutionError as error:
        why = str(error.__cause__ or error).splitlines()[0]
        raise ConfigError(
            f"run_dir={cfg.run_dir}: its data.batch_size ({raw}) does not resolve at its world size {world_size} "
            f"({why}); set batch_size=<samples per rank>"
        ) from None
    if world_size != d.world_size:
        d.print0(
            f"data.batch_size resolves at the run's own world size {world_size}: batch {batch_size} per rank "
            f"(not at this job's {d.world_size}; batch_size= sets another)"
        )
    return batch_size


def split_batches(cfg: DictConfig, run_cfg: DictConfig, d: Dist, what: str) -> tuple:
    """(the split's data set, its EvalBatches, the batch size per rank): cfg.split of the run's data,
    each rank a contiguous shard (every sample once, rank order is dataset order), at cfg.batch_size
    or the run's (auto: where the run's search started, halved alike)."""
    with d.rank0_first():  # rank 0 prepares (downloads) the data first
        splits = heldout.unpack(instantiate(run_cfg.data.splits), run_cfg.data.name)
    dataset = splits[heldout.SPLITS.index(cfg.split)]
    why = heldout.missing(dataset, splits[0]) if cfg.split == "test" else None  # val and train: never None
    if why is not None or dataset is None:
        raise ConfigError(f"split=test: data={run_cfg.data.name} of {cfg.run_dir} has no test split ({why})")
    if len(dataset) == 0:
        raise ConfigError(f"split={cfg.split} of {cfg.run_dir} holds no samples")
    batch_size = cfg.batch_size or run_batch_size(cfg, run_cfg, d)
    auto = batch_size == "auto"
    if auto:
        batch_size = max(1, run_cfg.accumulation.global_batch_size // d.world_size)
    return dataset, EvalBatches(dataset, d, batch_size, run_cfg.data.num_workers, halve=auto, what=what), batch_size
