"""Export a finished run as its model library's own directory: `python src/export.py run_dir=outputs/<date>/<time>
out=<dir> [merge=true|false] [weights=last|best|ema|<path>] [overwrite=true]`. Config: conf/export.yaml.

Rebuilds the model from <run_dir>/.hydra/config.yaml, loads its weights (model.pt, model_best.pt, model_ema.pt or a
file) and hands it to its model's `export` (the room's module declares it: model=hf writes a Hugging Face directory,
config.json + model.safetensors + the tokenizer, that AutoModelFor...from_pretrained(out) loads; a LoRA run merged, or
with merge=false the adapter alone; trainkit/models/hf_export.py). A model without one is refused in one line.

`out` is written whole into a temp dir beside it, then renamed into place: a failed export leaves no half-written
model, and an `out` that already holds files is refused (overwrite=true replaces it). One process: the export reads
and writes files only, so torchrun is refused rather than have N ranks write one directory. This job's own dir
(outputs/export/<date>/<time>) keeps its config and provenance.json, which names the run it read.
"""

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from trainkit import config, dist, options, provenance
from trainkit.errors import ConfigError
from trainkit.rundir import load_run_config, run_model


def export_run(cfg: DictConfig, job_dir: Path) -> Path:
    """Check everything that can be checked before writing (one line each, nothing written), build the run's model
    with its weights, write `out`; returns it."""
    if dist.env_world_size() > 1:
        raise ConfigError("export.py runs on one process: python src/export.py run_dir=... out=... (not torchrun)")
    run_cfg = load_run_config(cfg, "export")
    run_dir, out = Path(cfg.run_dir), _out(cfg)
    for key in ("merge", "overwrite"):
        if not isinstance(cfg[key], bool):
            raise ConfigError(f"{key}={cfg[key]} must be true or false")
    module = options.module_of(run_cfg, "model")
    export = getattr(module, "export", None)
    if export is None:
        raise ConfigError(
            f"run_dir={run_dir}: its model (model._target_={run_cfg.model.get('_target_')}) declares no export; "
            "export.py writes model=hf runs as Hugging Face directories"
        )
    if out.resolve() == run_dir.resolve() or out.resolve() in run_dir.resolve().parents:
        raise ConfigError(f"out={out} would replace the run dir {run_dir}: name a directory of its own")
    if (check := getattr(module, "check_export", None)) is not None:
        check(run_cfg, cfg.merge)
    model, weights = run_model(cfg, run_cfg)
    with staged(out) as directory:
        line = export(model.eval(), run_cfg, directory, cfg.merge, str(out))
    config.save(cfg, job_dir)
    provenance.write(job_dir, cfg, 1)
    print(f"export | run dir {run_dir} ({weights.name}) | wrote {line}", flush=True)
    return out


def _out(cfg: DictConfig) -> Path:
    """`out`, refused where it is unset, a file, or a directory holding files (unless overwrite=true)."""
    if OmegaConf.is_missing(cfg, "out"):
        raise ConfigError("out is required: python src/export.py run_dir=<run> out=<dir to write>")
    out = Path(str(cfg.out)).expanduser()
    if out.exists() and not out.is_dir():
        raise ConfigError(f"out={out} is a file: name a directory")
    if out.is_dir() and any(out.iterdir()) and cfg.overwrite is not True:
        raise ConfigError(f"out={out} exists and holds files: another dir, or overwrite=true to replace it")
    return out


@contextlib.contextmanager
def staged(out: Path) -> Iterator[Path]:
    """A temp dir beside `out` to write into, renamed to `out` when the block ends without an error (an existing
    `out`: replaced, which overwrite=true allowed); on an error it is removed, with the parents made for it."""
    made = [p for p in reversed(out.parents) if not p.exists()]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.export-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()  # not tempfile.mkdtemp: its mode 0700 would become out's
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for parent in reversed(made):
            config.remove_if_empty(parent)
        raise
    if out.is_dir() and any(out.iterdir()):
        old = tmp.with_name(tmp.name + ".old")
        os.rename(out, old)  # the old model stays whole until the new one is in place
        os.rename(tmp, out)
        shutil.rmtree(old)
    else:
        os.replace(tmp, out)  # nothing there, or an empty dir: in one step


@hydra.main(config_path="../conf", config_name="export", version_base="1.3")
def main(cfg: DictConfig) -> None:
    job_dir = Path(HydraConfig.get().runtime.output_dir)
    config.one_job(lambda: export_run(cfg, job_dir), job_dir)  # a known failure: one line, no traceback


if __name__ == "__main__":
    config.run_cli(main)
