"""Forking: scripts/rename_package.sh renames the package in one step, and the fork trains; a fork for a task
of its own adds files to the rooms and conf/ only, and trains, resumes, selects, evaluates, predicts and searches
by its own metric."""

import inspect
import json
import os
import shutil
import subprocess
import sys

import dict_fork
import optuna
import pytest
import torch

from helpers import ROOT, _env, rows, together
from trainkit import studies


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


# A fork for its own task, as the README's "Making it yours" says: files in the rooms and conf/ only. Dict
# batches with a mask, a model that reads the dict, a task with a metric of its own (val/mae, lower is better):
# tests/dict_fork.py's parts, each in its room.
FORK_FILES = {
    "src/trainkit/data/patients.py": "import torch\nfrom torch.utils.data import Dataset\n\n"
    "from trainkit.data.diabetes import diabetes\n\n\n"  # no Schema: splits' signature types its keys
    + inspect.getsource(dict_fork.MaskedPatients)
    + "\n\n"
    + inspect.getsource(dict_fork.splits),
    "src/trainkit/models/masked_mlp.py": "import torch\nfrom torch import nn\n\n\n"
    + inspect.getsource(dict_fork.MaskedMLP),
    "src/trainkit/tasks/mean_absolute.py": "import torch\n\n\n" + inspect.getsource(dict_fork.MeanAbsolute),
    "conf/data/patients.yaml": """
name: patients
splits:
  _target_: trainkit.data.patients.splits
shape: [10]
batch_size: 16
""",
    "conf/model/masked_mlp.yaml": """
_target_: trainkit.models.masked_mlp.MaskedMLP
in_shape: ${data.shape}
num_classes: 1
width: 16
""",
    "conf/task/mean_absolute.yaml": "_target_: trainkit.tasks.mean_absolute.MeanAbsolute\n",
    "conf/experiment/patients.yaml": """# @package _global_
defaults:
  - override /data: patients
  - override /model: masked_mlp
  - override /task: mean_absolute
  - override /optim: sgd
  - override /sched: constant
optim:
  lr: 0.02
trainer:
  max_steps: 12
  eval_every: 4
  log_every: 4
checkpoint:
  every: 4
""",
}


@pytest.fixture(scope="module")
def fork(tmp_path_factory):
    """This working tree copied as a fresh repository, the fork's files added; (its root, a runner)."""
    root = tmp_path_factory.mktemp("fork") / "project"
    ignore = shutil.ignore_patterns(".git", ".venv", "outputs", "multirun", "*.egg-info", "__pycache__", ".*_cache")
    shutil.copytree(ROOT, root, ignore=ignore)
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    subprocess.run(["git", "add", "-A"], cwd=root, check=True)
    commit = ["git", "-c", "user.name=fork", "-c", "user.email=fork@example.com", "commit", "-qm", "the template"]
    subprocess.run(commit, cwd=root, check=True)
    for name, text in FORK_FILES.items():
        (root / name).write_text(text.lstrip("\n"))
    env = _env() | {"PYTHONPATH": os.pathsep.join([str(root / "tests"), str(root / "src")])}

    def run(script: str, *overrides: str) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            [sys.executable, f"src/{script}.py", *overrides], cwd=root, env=env, capture_output=True, text=True
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc

    return root, run


def test_a_fork_adds_files_to_the_rooms_and_conf_and_touches_no_engine_file(fork):
    root, _ = fork
    status = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=all"], cwd=root, capture_output=True, text=True
    )
    changes = status.stdout.splitlines()
    assert sorted(line[3:] for line in changes) == sorted(FORK_FILES)
    assert all(line.startswith("?? ") for line in changes), changes  # new files only: no tracked file edited
    rooms = ("src/trainkit/models/", "src/trainkit/data/", "src/trainkit/tasks/", "conf/")
    assert all(name.startswith(rooms) for name in FORK_FILES)


@pytest.mark.slow
def test_the_fork_trains_exactly_resumes_selects_by_its_metric_evaluates_predicts_and_searches(fork, tmp_path):
    root, run = fork
    exp = ("+experiment=patients",)
    one, two, part, sweep = tmp_path / "one", tmp_path / "two", tmp_path / "part", tmp_path / "sweep"
    two_ranks = ("parallel.nproc_per_node=2", "accumulation.steps=2", "data.batch_size=4")  # 2 x 2 x 4 = 16
    together(  # independent runs side by side
        lambda: run("train", *exp, f"hydra.run.dir={one}"),
        lambda: run("train", *exp, f"hydra.run.dir={two}", *two_ranks),
        lambda: run("train", *exp, f"hydra.run.dir={part}", "trainer.max_steps=8"),  # stops after step 8's checkpoint
    )
    search = ("hparams_search=digits_optuna", "hydra.sweeper.n_trials=2", "hydra.sweeper.pruner=null")
    together(
        lambda: run("train", *exp, f"hydra.run.dir={part}"),  # the same run dir: resumed to step 12
        lambda: run("eval", f"run_dir={one}", "weights=best", "split=val", f"hydra.run.dir={tmp_path / 'eval'}"),
        lambda: run("predict", f"run_dir={one}", f"hydra.run.dir={tmp_path / 'predict'}"),
        lambda: run("train", *exp, *search, f"hydra.sweep.dir={sweep}", "hydra.sweeper.study_name=patients"),
    )
    weights = torch.load(one / "model.pt", weights_only=True)
    # one process's batch of 16: the same SGD steps (rounding of the reduction order alone)
    for key, value in torch.load(two / "model.pt", weights_only=True).items():
        torch.testing.assert_close(value, weights[key], rtol=0, atol=1e-6)
    resumed = torch.load(part / "model.pt", weights_only=True)
    assert all(torch.equal(resumed[key], value) for key, value in weights.items())

    evaluations = [row for row in rows(one) if "val/mae" in row]
    best = min(row["val/mae"] for row in evaluations)
    assert len(evaluations) == 3 and evaluations[-1]["best/val/mae"] == best  # declared min: the lowest kept
    assert json.loads((tmp_path / "eval" / "metrics.json").read_text())["val/mae"] == best
    lines = (tmp_path / "predict" / "predictions.csv").read_text().splitlines()
    assert lines[0] == "index,target,prediction" and len(lines) == 1 + 88  # diabetes' val split: 88 patients
    assert json.loads((tmp_path / "predict" / "metrics.json").read_text())["mae"] == evaluations[-1]["val/mae"]

    study = studies.load("patients", f"sqlite:///{sweep / 'study.db'}")  # two trials on the fork's own metric
    assert study.direction == optuna.study.StudyDirection.MINIMIZE and len(study.trials) == 2
    for trial in study.trials:
        assert trial.value == min(row["val/mae"] for row in rows(sweep / str(trial.number)) if "val/mae" in row)
