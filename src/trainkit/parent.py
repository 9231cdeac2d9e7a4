"""A finished run another run builds on (a teacher; a start for model.init.from): its config, its weights, its
model rebuilt from its own config. A minimal stand-in with the API of branch `chain`'s loader (replaced by it)."""

import shutil
from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from trainkit import config
from trainkit.checkpoint import load_model
from trainkit.errors import ConfigError

WEIGHTS = {"last": "model.pt", "best": "model_best.pt", "ema": "model_ema.pt"}


class Parent:
    def __init__(self, run_dir: Path, weights_path: Path, cfg: DictConfig):
        self.run_dir, self.weights_path, self.config = run_dir, weights_path, cfg

    @classmethod
    def open(cls, source, weights: str = "last") -> "Parent":
        run_dir = Path(source)
        if weights not in WEIGHTS:
            raise ConfigError(f"weights={weights} is not one of: {', '.join(WEIGHTS)}")
        saved = run_dir / ".hydra" / "config.yaml"
        if not saved.is_file():
            raise ConfigError(f"{run_dir} has no .hydra/config.yaml: not a finished training run")
        path = run_dir / WEIGHTS[weights]
        if not path.is_file():
            raise ConfigError(f"{run_dir} has no {path.name} (weights={weights}): not a finished training run")
        cfg = OmegaConf.load(saved)
        assert isinstance(cfg, DictConfig)
        config.typed(cfg)
        return cls(run_dir, path, cfg)

    def state_dict(self) -> dict:
        return torch.load(self.weights_path, map_location="cpu", weights_only=True)

    def build_model(self) -> torch.nn.Module:
        model = instantiate(self.config.model)
        load_model(model, self.state_dict(), self.weights_path)
        return model

    def copy_into(self, directory) -> Path:
        directory = Path(directory)
        (directory / ".hydra").mkdir(parents=True, exist_ok=True)
        shutil.copy2(self.run_dir / ".hydra" / "config.yaml", directory / ".hydra" / "config.yaml")
        shutil.copy2(self.weights_path, directory / self.weights_path.name)
        return directory
