"""hparams_search=digits_optuna: an Optuna study through Hydra's sweeper (trainkit.search). One study of
3 trials (each on 2 self-launched workers, one of them diverging) continued by a second command, the
two ranks of a torchrun study, and the sweeper's refusals."""

import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
import yaml
from hydra.core.utils import JobReturn, JobStatus

from helpers import ROOT, rows, run_train, together
from trainkit import search

# seed=3: the sampler's first three draws of optim.lr are 1e6 (SGD diverges: a failed trial), 0.05, 0.05.
STUDY = (
    "hparams_search=digits_optuna",
    "seed=3",
    "optim=sgd",
    "optim.lr=choice(0.05,1e6)",
    "trainer.clip_grad_norm=null",
    "trainer.max_steps=20",
    "trainer.eval_every=10",
    "checkpoint.every=10",
)


def trials(sweep: Path) -> list:
    return optuna.load_study(study_name="digits_optuna", storage=f"sqlite:///{sweep / 'study.db'}").trials


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    """Two commands on one study: 3 trials on 2 self-launched workers each, then 2 more in one process."""
    sweep = tmp_path_factory.mktemp("study") / "sweep"
    common = (*STUDY, f"hydra.sweep.dir={sweep}")
    first = run_train(sweep / "unused", *common, "hydra.sweeper.n_trials=3", "parallel.nproc_per_node=2")
    earlier = trials(sweep)
    second = run_train(sweep / "unused", *common, "hydra.sweeper.n_trials=2")
    return sweep, first, second, earlier


@pytest.mark.slow
def test_a_study_records_each_trial_with_its_objective_and_a_failed_one_with_its_error(study):
    sweep, first, _, earlier = study
    assert (sweep / "study.db").is_file()
    assert [t.params["optim.lr"] for t in earlier] == [1e6, 0.05, 0.05]  # seed=3's draws (see STUDY)
    failed, *done = earlier
    assert failed.state == optuna.trial.TrialState.FAIL
    assert failed.user_attrs["error"].startswith("non-finite loss or gradient in steps 1-10")
    assert "trial 0 failed: non-finite loss" in first.stderr  # and the study went on:
    for trial in done:
        assert trial.state == optuna.trial.TrialState.COMPLETE
        evaluations = [r for r in rows(sweep / str(trial.number)) if "val/acc" in r]
        assert trial.value == max(r["val/acc"] for r in evaluations) == evaluations[-1]["best/val/acc"]
        config = yaml.safe_load((sweep / str(trial.number) / ".hydra" / "config.yaml").read_text())
        assert (config["optim"]["lr"], config["model"]["width"]) == (0.05, trial.params["model.width"])
    best = max(done, key=lambda t: t.value)
    assert f"best trial {best.number}: {best.value:.6g}" in first.stdout
    assert first.returncode == 0  # a failed trial is a result of the study, not a failure of the command


@pytest.mark.slow
def test_a_second_command_continues_the_study_in_new_dirs_with_new_draws(study):
    sweep, _, second, earlier = study
    later = trials(sweep)[len(earlier) :]
    assert [t.number for t in later] == [3, 4]
    assert sorted(p.name for p in sweep.iterdir() if p.name.isdigit()) == ["0", "1", "2", "3", "4"]
    assert "resumed from" not in second.stdout  # job N trains trial N in N/: never an old trial's checkpoint
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in later)  # seed 3 + 3's draws: lr 0.05
    for trial in later:
        assert rows(sweep / str(trial.number))[0]["step"] == 10  # a fresh run, not one resumed at step 20
        config = yaml.safe_load((sweep / str(trial.number) / ".hydra" / "config.yaml").read_text())
        assert config["model"]["width"] == trial.params["model.width"]


@pytest.mark.slow
def test_a_continued_study_draws_new_trials(study):
    # The sampler continues at seed + 3 trials: with the seed itself it would draw trials 0 and 1 again.
    sweep, _, _, earlier = study
    later = trials(sweep)[len(earlier) :]
    assert [t.params for t in later] != [t.params for t in earlier[:2]]


@pytest.mark.slow
def test_report_tables_the_trials_and_plots_the_history(study):
    sweep = study[0]
    subprocess.run([sys.executable, str(ROOT / "scripts" / "report.py"), str(sweep)], check=True, timeout=120)
    report = (sweep / "report.md").read_text()
    stored = trials(sweep)
    best = max((t for t in stored if t.value is not None), key=lambda t: t.value)
    assert f"Best trial {best.number} (job dir {best.number}/): val/acc {best.value:.6g}" in report
    table = [line for line in report.split("## Study", 1)[1].splitlines() if line.startswith("| ")]
    assert table[0].startswith("| trial | state | val/acc | model.width | optim.lr | optim.weight_decay | error |")
    assert len(table) == 1 + len(stored)
    assert "| 0 | fail | — |" in table[1] and "non-finite loss" in table[1]
    assert (sweep / "report.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.slow
def test_the_sweeper_refuses_another_studys_dir_and_a_contradicting_direction_and_fails_with_no_trial(study):
    sweep = study[0]
    other_study = (f"hydra.sweep.dir={sweep}", "hydra.sweeper.study_name=x")
    contradicting = (f"hydra.sweep.dir={sweep}2", "hydra.sweeper.direction=minimize")
    diverging = (f"hydra.sweep.dir={sweep}3", "optim.lr=choice(1e6)", "hydra.sweeper.n_trials=1")
    shutil.copytree(sweep, f"{sweep}4")  # the same study, asked with another space for optim.lr
    respaced = (f"hydra.sweep.dir={sweep}4", "optim.lr=interval(0.01,0.1)")
    other, direction, failing, another_space = together(
        lambda: run_train(sweep / "x", *STUDY, *other_study, check=False),
        lambda: run_train(sweep / "x", *STUDY, *contradicting, check=False),
        lambda: run_train(sweep / "x", *STUDY, *diverging, check=False),
        lambda: run_train(sweep / "x", *STUDY, *respaced, check=False),
    )
    assert other.returncode == 2
    assert other.stderr.strip().splitlines() == [
        f"error: {sweep / '0'} holds a run, but study x has 0 trials: a new trial would resume it; use another "
        "hydra.sweep.dir (or the study that trained it)"
    ]
    assert direction.returncode == 2
    assert direction.stderr.strip().splitlines() == [
        "error: hydra.sweeper.direction=minimize contradicts checkpoint.mode: the objective, the run's best "
        "val/acc, is maximized (leave direction auto)"
    ]
    assert not (Path(f"{sweep}2") / "0").exists()
    assert failing.returncode == 1  # a study with no completed trial has nothing to give: a failure
    assert failing.stderr.strip().splitlines()[-2:] == [
        "trial 0 failed: non-finite loss or gradient in steps 1-10 (trainer.on_nonfinite=raise; skip drops "
        "such windows)",
        "error: study digits_optuna: 1 trials (1 failed), 1 in all; no trial completed",
    ]
    assert another_space.returncode == 2
    assert another_space.stderr.strip().splitlines() == [
        "error: hydra.sweeper.params: Cannot set different distribution kind to the same parameter name. Study "
        "digits_optuna searched another space for it: change the space in a new study (hydra.sweeper.study_name, "
        "or another hydra.sweep.dir)"
    ]
    asked = trials(Path(f"{sweep}4"))[-1]  # the trial asked before the parameter was refused: not left running
    assert asked.number == 5 and asked.state == optuna.trial.TrialState.FAIL


@pytest.mark.slow
def test_under_torchrun_every_rank_trains_the_trial_rank_0_asked_for(tmp_path):
    sweep, logs = tmp_path / "sweep", tmp_path / "logs"
    run_train(
        tmp_path / "unused",
        "hparams_search=digits_optuna",
        "hydra.sweeper.sampler.seed=null",  # rank 1 drawing its own trial would draw other values
        "parallel=ddp",
        "trainer.max_steps=10",
        "hydra.sweeper.n_trials=2",
        f"hydra.sweep.dir={sweep}",
        nproc=2,
        torchrun=("--log-dir", str(logs), "--redirects", "3"),
    )
    launched = {}  # rank: the overrides its launcher ran, job by job ("#N : ...", Hydra's basic launcher)
    for out in logs.rglob("stdout.log"):
        launched[out.parent.name] = re.findall(r"#(\d+) : (.*)", out.read_text())
    assert launched["0"] == launched["1"] and len(launched["0"]) == 2
    for (number, overrides), trial in zip(launched["0"], trials(sweep), strict=True):
        assert int(number) == trial.number and trial.state == optuna.trial.TrialState.COMPLETE
        assert f"optim.lr={trial.params['optim.lr']}" in overrides.split()


def test_a_nan_or_missing_objective_is_a_failed_trial_with_its_reason(tmp_path):
    def returned(value, status=JobStatus.COMPLETED) -> JobReturn:
        return JobReturn(status=status, _return_value=value)

    assert search.outcome(returned(0.5), tmp_path) is None
    assert search.outcome(returned(math.nan), tmp_path) == "the objective is nan, not a number"
    assert search.outcome(returned(None), tmp_path) == "the run returned no objective (no validation split?)"
    (tmp_path / "error.txt").write_text("data: the training split of data=x is empty\n")
    assert search.outcome(returned(None), tmp_path) == "data: the training split of data=x is empty"
    crashed = returned(KeyError("boom"), JobStatus.FAILED)
    assert search.outcome(crashed, tmp_path) == "KeyError: 'boom'"


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ((), ("val/acc", "maximize")),
        (("checkpoint.monitor=val/loss",), ("val/loss", "minimize")),
        (("checkpoint.monitor=val/loss", "checkpoint.mode=max"), ("val/loss", "maximize")),
        (("checkpoint.monitor=null",), ("val/acc", "maximize")),  # train.py returns the last val/acc
        (("+experiment=pydoc_gpt",), ("val/loss", "minimize")),
    ],
)
def test_the_direction_follows_checkpoint_mode(overrides, expected):
    from helpers import compose_cfg

    assert search.objective(compose_cfg(*overrides)) == expected


def test_a_study_in_several_processes_without_torchrun_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    with pytest.raises(search.ConfigError, match="needs torchrun"):
        search.lockstep_ranks()
