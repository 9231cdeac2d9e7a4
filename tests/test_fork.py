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
from trainkit.search import studies


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


RUN_EACH = """import json, runpy, sys
for sys.argv in json.loads(sys.argv[1]):
    runpy.run_path(sys.argv[0], run_name="__main__")
"""


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

    def run(*commands: tuple[str, ...]) -> subprocess.CompletedProcess:
        """`python src/<script>.py <overrides>` for each (script, *overrides), in order, in one interpreter of the
        fork: each script run as its __main__ with its command line, as python runs it (torch imported once)."""
        argvs = [[f"src/{script}.py", *overrides] for script, *overrides in commands]
        proc = subprocess.run(
            [sys.executable, "-c", RUN_EACH, json.dumps(argvs)], cwd=root, env=env, capture_output=True, text=True
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
    search = ("hparams_search=digits_optuna", "hydra.sweeper.n_trials=1", "hydra.sweeper.pruner=null")
    run(  # train.py's runs one after another in one interpreter; then eval.py and predict.py, each in its own
        ("train", *exp, f"hydra.run.dir={one}"),
        ("train", *exp, f"hydra.run.dir={two}", *two_ranks),
        ("train", *exp, f"hydra.run.dir={part}", "trainer.max_steps=8"),  # stops after step 8's checkpoint
        ("train", *exp, f"hydra.run.dir={part}"),  # the same run dir: resumed to step 12
        ("train", *exp, *search, f"hydra.sweep.dir={sweep}", "hydra.sweeper.study_name=patients"),
    )
    together(
        lambda: run(("eval", f"run_dir={one}", "weights=best", "split=val", f"hydra.run.dir={tmp_path / 'eval'}")),
        lambda: run(("predict", f"run_dir={one}", f"hydra.run.dir={tmp_path / 'predict'}")),
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

    study = studies.load("patients", f"sqlite:///{sweep / 'study.db'}")  # a trial on the fork's own metric
    assert study.direction == optuna.study.StudyDirection.MINIMIZE and len(study.trials) == 1
    for trial in study.trials:
        assert trial.value == min(row["val/mae"] for row in rows(sweep / str(trial.number)) if "val/mae" in row)


# Pulling the template's later fixes (docs/forking.md): a fork cloned from the template at commit A, with its own
# rooms, conf and tests, merges the template's commit B. B is what the template's later commits are made of: an
# engine module added and imported, an engine file and a room file the fork did not touch edited, conf/train.yaml
# and the tests changed.
FORK_TEST = """from helpers import rows, run_in_process


def test_the_fork_trains_its_own_task(tmp_path):
    run_in_process(tmp_path, "+experiment=patients", "trainer.max_steps=2", "trainer.eval_every=2", "trainer.test=0")
    assert rows(tmp_path)[-1]["val/mae"] > 0
"""


def _git(cwd, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    who = ["-c", "user.name=t", "-c", "user.email=t@example.com", "-c", "init.defaultBranch=main"]
    proc = subprocess.run(["git", *who, *args], cwd=cwd, capture_output=True, text=True)
    assert not check or proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def _edit(path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, (path, old)
    path.write_text(text.replace(old, new, 1))


def _later_engine_change(template) -> None:
    """Commit B: what a later fix of the template touches, none of it a file the fork added."""
    (template / "src/trainkit/later.py").write_text('"""An engine module the template added later."""\n\nLATER = 1\n')
    _edit(
        template / "src/train.py",
        "from trainkit.loggers import",
        "import trainkit.later  # noqa: F401\nfrom trainkit.loggers import",
    )
    _edit(
        template / "src/trainkit/checkpoint.py",
        '"""Checkpoints that resume',
        '"""Checkpoints (fixed later) that resume',
    )
    _edit(template / "src/trainkit/models/mlp.py", "a multilayer perceptron", "a multilayer perceptron (fixed later)")
    (template / "conf/train.yaml").write_text((template / "conf/train.yaml").read_text() + "# a later comment\n")
    (template / "tests/test_later.py").write_text(
        "import trainkit.later\n\n\ndef test_later():\n    assert trainkit.later.LATER\n"
    )
    _git(template, "add", "-A")
    _git(template, "commit", "-qm", "B: a later engine change")


@pytest.mark.parametrize(
    "fork_also", [pytest.param("nothing", marks=pytest.mark.slow), "an engine edit", "rename_package.sh"]
)
def test_a_fork_of_an_earlier_commit_merges_the_template_s_later_engine_change(tmp_path, fork_also):
    """docs/forking.md's flow: clone, `git remote rename origin template`, add rooms and conf, later `git fetch
    template && git merge template/main`. Clean, and the fork's tests pass, where the fork touched only its own
    files; a conflict where its history edits an engine line the template changed too, or renames the package."""
    template, fork = tmp_path / "template", tmp_path / "fork"
    ignore = shutil.ignore_patterns(".git", ".venv", "outputs", "multirun", "*.egg-info", "__pycache__", ".*_cache")
    shutil.copytree(ROOT, template, ignore=ignore)  # this working tree (uncommitted changes included) as commit A
    _git(template, "init", "-q")
    _git(template, "add", "-A")
    _git(template, "commit", "-qm", "A: the template")
    _git(tmp_path, "clone", "-q", str(template), str(fork))
    _git(fork, "remote", "rename", "origin", "template")
    for name, text in {**FORK_FILES, "tests/test_patients.py": FORK_TEST}.items():
        (fork / name).write_text(text.lstrip("\n"))
    if fork_also == "an engine edit":  # the conflict-maker: a line of the engine the template changes later
        _edit(fork / "src/trainkit/checkpoint.py", '"""Checkpoints that resume', '"""My checkpoints that resume')
    elif fork_also == "rename_package.sh":
        assert subprocess.run(["bash", "scripts/rename_package.sh", "myproject"], cwd=fork).returncode == 0
    _git(fork, "add", "-A")
    _git(fork, "commit", "-qm", "the fork's own task")
    _later_engine_change(template)

    _git(fork, "fetch", "-q", "template")
    merged = _git(fork, "merge", "--no-edit", "template/main", check=False)
    if fork_also != "nothing":
        assert merged.returncode != 0 and "CONFLICT" in merged.stdout, merged.stdout + merged.stderr
        _git(fork, "merge", "--abort")  # what docs/forking.md says to do when a conflict is not yours to solve now
        assert _git(fork, "status", "--porcelain").stdout == ""
        return
    assert merged.returncode == 0, merged.stdout + merged.stderr
    assert "(fixed later)" in (fork / "src/trainkit/models/mlp.py").read_text()
    assert (fork / "src/trainkit/data/patients.py").is_file()
    env = _env() | {"PYTHONPATH": os.pathsep.join([str(fork / "tests"), str(fork / "src")])}
    # Its own test, the template's new one, and the one that lists conf/model's and conf/data's options (the fork
    # added one to each): every test of a group's options is written to pass with a fork's own among them.
    tests = [
        "tests/test_patients.py",
        "tests/test_later.py",
        "tests/test_config_errors.py",
        "-k",
        "own or later or unknown",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--basetemp={tmp_path / 'pt'}", *tests],
        cwd=fork,
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0 and "\n4 passed" in proc.stdout, proc.stdout + proc.stderr
