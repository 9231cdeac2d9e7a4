"""W&B from rank 0: offline without credentials (never a prompt), the full nested config."""

import pytest

from helpers import run_train
from trainkit.metrics import wandb_mode


@pytest.mark.parametrize(
    "env,netrc,expected",
    [
        ({}, None, "offline"),
        ({"WANDB_MODE": "disabled"}, None, "disabled"),
        ({"WANDB_API_KEY": "x" * 40}, None, "online"),
        ({}, "machine api.wandb.ai\n  login user\n  password secret\n", "online"),
        ({}, "machine example.com\n  login user\n  password secret\n", "offline"),
    ],
)
def test_wandb_mode(monkeypatch, tmp_path, env, netrc, expected):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    if netrc:
        (tmp_path / ".netrc").write_text(netrc)
        (tmp_path / ".netrc").chmod(0o600)
    assert wandb_mode() == expected


@pytest.mark.slow
def test_wandb_run_offline_with_the_nested_config(tmp_path):
    run_train(tmp_path, "logger=wandb", "trainer.max_steps=3", "trainer.log_every=1")
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    wandb_file = next(runs[0].glob("*.wandb"))
    data = wandb_file.read_bytes()
    for key in (b"accumulation", b"global_batch_size", b"trainer", b"clip_grad_norm", b"val/acc", b"grad_norm"):
        assert key in data, key
