"""Forking: scripts/rename_package.sh renames the package in one step, and the fork trains."""

import shutil
import subprocess
import sys

import pytest

from helpers import ROOT, _env


@pytest.mark.slow
def test_a_renamed_fork_trains_and_mentions_the_old_name_nowhere(tmp_path):
    fork = tmp_path / "fork"  # this working tree as a fresh repository (uncommitted changes included)
    ignore = shutil.ignore_patterns(".git", ".venv", "outputs", "multirun", "*.egg-info", "__pycache__", ".*_cache")
    shutil.copytree(ROOT, fork, ignore=ignore)
    subprocess.run(["git", "init", "-q"], cwd=fork, check=True)
    subprocess.run(["git", "add", "-A"], cwd=fork, check=True)
    renamed = subprocess.run(
        ["bash", "scripts/rename_package.sh", "myproject"], cwd=fork, capture_output=True, text=True
    )
    assert renamed.returncode == 0, renamed.stderr
    assert (fork / "src" / "myproject" / "schema.py").is_file() and not (fork / "src" / "trainkit").exists()
    left = subprocess.run(["git", "grep", "-lw", "trainkit"], cwd=fork, capture_output=True, text=True).stdout
    assert left.split() == ["scripts/rename_package.sh"]
    env = _env() | {"PYTHONPATH": str(fork / "tests")}  # the fork's own package, from its src/
    run = [sys.executable, "src/train.py", f"hydra.run.dir={tmp_path / 'run'}", "trainer.max_steps=2"]
    proc = subprocess.run(run, cwd=fork, env=env, capture_output=True, text=True)
    assert proc.returncode == 0 and "done: 2 steps" in proc.stdout, proc.stderr
    again = subprocess.run(["bash", "scripts/rename_package.sh", "other"], cwd=fork, capture_output=True, text=True)
    assert again.returncode == 2 and "src/trainkit does not exist" in again.stderr
