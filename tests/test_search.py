"""hparams_search=digits_optuna: an Optuna study through trainkit's own Hydra sweeper (trainkit.search).
One study of 3 trials (each on 2 self-launched workers: one diverging, one pruned by rank 1's pruner
alone) continued by a second command (one process, a trial pruned), a study stopped three ways (SIGTERM,
Ctrl-C, SIGKILL) and finished by the next command each time, the two ranks of a torchrun study, a refusal
through the command; in process (the sweeper with a launcher that trains nothing): a grid run to its end with
every trial pruned, the sweeper's other refusals; the grammar and the storages. The commands but torchrun's
start in a forkserver's fresh process that imported torch, Hydra and Optuna once (`command`)."""

import functools
import io
import math
import multiprocessing
import os
import re
import runpy
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import optuna
import pytest
import yaml
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import JobReturn, JobStatus
from hydra.utils import instantiate
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState

import helpers
from helpers import ROOT, compose_cfg, rows, run_train
from trainkit.errors import ConfigError
from trainkit.search import grammar, studies, sweeper


class PlantedPruner(optuna.pruners.BasePruner):
    """Prunes trial `trial` (None: every trial) on rank `rank` alone (the other ranks' pruners say go on): the
    ranks must still stop together (one all-reduce), not hang. Takes and ignores digits_optuna's median settings."""

    def __init__(self, rank: int, trial: int | None, **ignored):
        self.rank, self.trial = rank, trial

    def prune(self, study, trial) -> bool:
        return self.trial in (None, trial.number) and int(os.environ.get("RANK", "0")) == self.rank


def planted_pruner(rank: int, trial: int) -> tuple[str, ...]:
    target = "hydra.sweeper.pruner._target_=test_search.PlantedPruner"
    return target, f"+hydra.sweeper.pruner.rank={rank}", f"+hydra.sweeper.pruner.trial={trial}"


STOPS = (signal.SIGTERM, signal.SIGINT, signal.SIGKILL)  # stopping_mlp's, in this order, one a trial


def stopping_mlp(markers: str, at_forward: int, **mlp):
    """model=mlp whose process receives the next of STOPS at its at_forward-th training forward (a marker file
    in `markers` remembers each one sent). SIGINT as in a terminal: Python's KeyboardInterrupt (a test run in
    the background inherits SIGINT ignored)."""
    from trainkit.models.mlp import mlp as make_mlp

    net, calls = make_mlp(**mlp), [0]

    def hook(module, args):
        calls[0] += module.training
        sent = [s for s in STOPS if (Path(markers) / s.name).exists()]
        if calls[0] == at_forward and len(sent) < len(STOPS):
            stop = STOPS[len(sent)]
            (Path(markers) / stop.name).touch()
            signal.signal(signal.SIGINT, signal.default_int_handler)
            os.kill(os.getpid(), stop)

    net.register_forward_pre_hook(hook)
    return net


# seed=8: the sampler's first three draws of optim.lr are 1e6 (SGD diverges: a failed trial), 0.05, 0.05; a
# continued study (seed 8 + 3) draws 0.05 twice (optuna 5.0's TPESampler, its random start-up trials).
STUDY = (
    "hparams_search=digits_optuna",
    "seed=8",
    "optim=sgd",
    "optim.lr=choice(0.05,1e6)",
    "trainer.clip_grad_norm=null",
    "trainer.max_steps=20",
    "trainer.eval_every=10",
    "checkpoint.every=10",
)


def command(run_dir: Path, *overrides: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """`python src/train.py <overrides>` as helpers.run_train(..., check=False) runs it, in a process that a
    multiprocessing forkserver forks: a fresh interpreter (not this one: nothing of the tests' in-process runs is
    in it) that imported train.py's modules, torch, Hydra and Optuna once. The child runs src/train.py as __main__
    with its argv: Hydra's command line, the sweeper and its jobs, signals, the exit status (-N: killed by signal
    N), its own stdout and stderr; less the ~5 s (10 under load) an interpreter takes to import them anew."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["train", "optuna", "test_search"])  # once a pytest process: its first start
    flags = [o for o in overrides if o.startswith("-")]  # e.g. -m: before the overrides (argparse)
    argv = [
        str(ROOT / "src" / "train.py"),
        *flags,
        f"hydra.run.dir={run_dir}",
        *(o for o in overrides if o not in flags),
    ]
    with tempfile.TemporaryDirectory() as streams:
        out, err = Path(streams) / "stdout", Path(streams) / "stderr"
        process = context.Process(target=_run_as_main, args=(argv, str(out), str(err)))
        process.start()
        process.join(timeout)
        if process.exitcode is None:
            process.kill()
            process.join()
            raise TimeoutError(f"{' '.join(argv)} still running after {timeout:g} s")
        return subprocess.CompletedProcess(argv, process.exitcode, out.read_text(), err.read_text())


def _run_as_main(argv: list[str], out: str, err: str) -> None:
    """What `python <argv>` runs after the interpreter's start: in run_train's environment and directory, stdout
    and stderr unbuffered into files (PYTHONUNBUFFERED=1), argv[0] as __main__."""
    os.chdir(ROOT)
    os.environ.update(helpers._env())  # run_train's (this process's is the forkserver's, the tests' at its start)
    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    sys.stdout, sys.stderr = (io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), write_through=True) for fd in (1, 2))
    sys.argv = argv
    runpy.run_path(argv[0], run_name="__main__")


def trials(sweep: Path, name: str = "study.db", study: str = "digits_optuna") -> list:
    url = f"sqlite:///{sweep / name}" if name.endswith(".db") else str(sweep / name)  # .log: a journal file
    return studies.load(study, url).trials


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    """Two commands on one study: 3 trials on 2 self-launched workers each (trial 2 pruned by rank 1's
    pruner alone), then 2 more in one process (trial 4 pruned)."""
    sweep = tmp_path_factory.mktemp("study") / "sweep"
    common = (*STUDY, f"hydra.sweep.dir={sweep}")
    # parallel.timeout_s: ranks that disagreed on pruning would wait on each other's collectives; fail, not hang
    two_ranks = ("parallel.nproc_per_node=2", "parallel.timeout_s=120")
    first = command(sweep / "unused", *common, "hydra.sweeper.n_trials=3", *two_ranks, *planted_pruner(1, 2))
    earlier = trials(sweep)
    second = command(sweep / "unused", *common, "hydra.sweeper.n_trials=2", *planted_pruner(0, 4))
    assert first.returncode == second.returncode == 0, first.stderr + second.stderr
    return sweep, first, second, earlier


@pytest.mark.slow
def test_a_study_records_each_trial_with_its_objective_and_a_failed_one_with_its_error(study):
    sweep, first, _, earlier = study
    assert (sweep / "study.db").is_file()
    assert [t.params["optim.lr"] for t in earlier] == [1e6, 0.05, 0.05]  # seed=8's draws (see STUDY)
    failed, *done, pruned = earlier
    assert failed.state == optuna.trial.TrialState.FAIL
    assert failed.user_attrs["error"].startswith("non-finite loss or gradient in steps 1-10")
    assert "trial 0 failed: non-finite loss" in first.stderr  # and the study went on:
    assert "study digits_optuna: 3 trials (1 failed, 1 pruned), 3 in all" in first.stdout
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
    assert [t.state for t in later] == [TrialState.COMPLETE, TrialState.PRUNED]  # seed 8 + 3's draws: lr 0.05
    for trial in later:
        assert rows(sweep / str(trial.number))[0]["step"] == 10  # a fresh run, not one resumed at step 20
        config = yaml.safe_load((sweep / str(trial.number) / ".hydra" / "config.yaml").read_text())
        assert config["model"]["width"] == trial.params["model.width"]


@pytest.mark.slow
@pytest.mark.parametrize("number", [2, 4])  # 2: 2 self-launched ranks, rank 1's pruner alone; 4: one process
def test_a_pruned_trial_ends_like_an_early_stop_and_is_pruned_in_the_study(study, number):
    sweep, first, second, _ = study
    trial = trials(sweep)[number]
    assert trial.state == TrialState.PRUNED and trial.user_attrs["pruned_at"] == 10
    evaluations = [r for r in rows(sweep / str(number)) if "val/acc" in r]
    assert [r["step"] for r in evaluations] == [10]  # its first evaluation ended it (max_steps=20)
    assert trial.intermediate_values == {10: evaluations[0]["val/acc"]} and trial.value == evaluations[0]["val/acc"]
    assert (
        f"pruned at step 10: val/acc {trial.value:.4g} (hydra.sweeper.pruner=PlantedPruner)"
        in (first if number == 2 else second).stdout
    )
    assert (sweep / str(number) / "checkpoints" / "step_00000010.pt").is_file()
    assert (sweep / str(number) / "model_best.pt").is_file()


def test_a_continued_study_draws_new_trials(study):
    # The sampler continues at seed + 3 trials: with the seed itself it would draw trials 0 and 1 again.
    sweep, _, _, earlier = study
    later = trials(sweep)[len(earlier) :]
    assert [t.params for t in later] != [t.params for t in earlier[:2]]


@pytest.mark.slow
def test_report_tables_the_trials_and_plots_the_history(study):
    sweep = study[0]
    assert runpy.run_path(str(ROOT / "scripts" / "report.py"))["main"]([str(sweep)]) == 0  # its main, in process
    report = (sweep / "report.md").read_text()
    stored = trials(sweep)
    best = max((t for t in stored if t.value is not None), key=lambda t: t.value)
    assert f"Best trial {best.number} (job dir {best.number}/): val/acc {best.value:.6g}" in report
    table = [line for line in report.split("## Study", 1)[1].splitlines() if line.startswith("| ")]
    assert table[0].startswith("| trial | state | val/acc | model.width | optim.lr | optim.weight_decay | error |")
    assert len(table) == 1 + len(stored)
    assert "| 0 | fail | — |" in table[1] and "non-finite loss" in table[1]
    assert table[3].startswith(f"| 2 | pruned at step 10 | {stored[2].value:.6g} |")  # its last reported value
    assert (sweep / "report.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.slow
def test_a_searched_key_that_is_no_setting_is_one_line_before_a_storage_or_a_dir_exists(tmp_path):
    """A refusal of the sweeper through the command: exit status 2, one line, nothing written (the space is composed
    into the job's config by Hydra's loader first). Its other refusals, in process: test_the_sweeper_refuses_..."""
    sweep = tmp_path / "sweep"
    unknown = command(tmp_path / "x", *STUDY, f"hydra.sweep.dir={sweep}", "model.nokey=choice(1,2)")
    assert unknown.returncode == 2
    assert unknown.stderr.strip().splitlines() == [
        "error: model.nokey is not a setting of model; its settings: _target_, in_shape, num_classes, width, depth, "
        "dropout"
    ]
    assert not sweep.exists()


@pytest.mark.slow
def test_under_torchrun_every_rank_trains_the_trial_rank_0_asked_for(tmp_path):
    sweep, logs = tmp_path / "sweep", tmp_path / "logs"
    run_train(
        tmp_path / "unused",
        "hparams_search=digits_optuna",
        "hydra.sweeper.sampler.seed=null",  # rank 1 drawing its own trial would draw other values
        f"hydra.sweeper.storage={sweep}/study.log",  # Optuna's JournalStorage on a file (NFS, SLURM arrays)
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
    assert not (sweep / "study.db").exists()
    for (number, overrides), trial in zip(launched["0"], trials(sweep, "study.log"), strict=True):
        assert int(number) == trial.number and trial.state == optuna.trial.TrialState.COMPLETE
        assert f"optim.lr={trial.params['optim.lr']}" in overrides.split()


def test_a_nan_or_missing_objective_is_a_failed_trial_with_its_reason(tmp_path):
    def returned(value, status=JobStatus.COMPLETED) -> JobReturn:
        return JobReturn(status=status, _return_value=value)

    assert sweeper.outcome(returned(0.5), tmp_path) is None
    assert sweeper.outcome(returned(math.nan), tmp_path) == "the objective is nan, not a number"
    assert sweeper.outcome(returned(None), tmp_path) == "the run returned no objective (no validation split?)"
    (tmp_path / "error.txt").write_text("data: the training split of data=x is empty\n")
    assert sweeper.outcome(returned(None), tmp_path) == "data: the training split of data=x is empty"
    crashed = returned(KeyError("boom"), JobStatus.FAILED)
    assert sweeper.outcome(crashed, tmp_path) == "KeyError: 'boom'"


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ((), ("val/acc", "maximize")),
        (("checkpoint.monitor=val/loss",), ("val/loss", "minimize")),
        (("checkpoint.monitor=val/loss", "checkpoint.mode=max"), ("val/loss", "maximize")),
        (("checkpoint.monitor=null",), ("val/acc", "maximize")),  # train.py returns the last val/acc
        (("+experiment=pydoc_gpt",), ("val/loss", "minimize")),
        (("data=diabetes", "checkpoint.monitor=null"), ("val/r2", "maximize")),  # the task's key, its declared way
        (("data=diabetes", "checkpoint.monitor=val/rmse"), ("val/rmse", "minimize")),
    ],
)
def test_the_direction_follows_checkpoint_mode(overrides, expected):
    from helpers import compose_cfg

    assert sweeper.objective(compose_cfg(*overrides)) == expected


def test_a_study_in_several_processes_without_torchrun_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    with pytest.raises(sweeper.ConfigError, match="needs torchrun"):
        sweeper.lockstep_ranks()


@pytest.mark.slow
def test_a_trial_stopped_by_sigterm_ctrl_c_or_sigkill_is_finished_by_the_next_command_from_its_checkpoint(tmp_path):
    """Four commands of one study, 1 trial each: SIGTERM (trial 0 checkpoints at step 15), Ctrl-C (trial 1 stops at
    once: its newest checkpoint is step 10's), SIGKILL (trial 2's command dies: its heartbeats stop), then none."""
    sweep, markers = tmp_path / "sweep", tmp_path / "markers"
    markers.mkdir()
    overrides = (
        *STUDY[:2],
        "optim.lr=0.05",
        "trainer.max_steps=20",
        "trainer.eval_every=10",
        "checkpoint.every=10",
        "hydra.sweeper.n_trials=1",
        "hydra.sweeper.heartbeat_interval=1",  # a trial's command writes one a second; 2 s without one: gone
        "hydra.sweeper.grace_period=2",
        f"hydra.sweep.dir={sweep}",
        "model._target_=test_search.stopping_mlp",
        f"+model.markers={markers}",
        "+model.at_forward=15",  # a resumed trial trains at most 10 forwards: only a fresh one is stopped
    )
    stopped = command(tmp_path / "unused", *overrides)
    assert stopped.returncode == 128 + signal.SIGTERM
    assert stopped.stderr.strip().splitlines()[-2:] == [
        "stopped by SIGTERM at step 15; checkpoint written; the same command resumes",
        f"study digits_optuna: trial(s) 0 interrupted; the same command finishes them first, from their "
        f"checkpoints in {sweep / '0'}, then asks its new trials",
    ]
    (interrupted,) = trials(sweep)
    assert interrupted.state == TrialState.RUNNING and "interrupted" in interrupted.user_attrs

    ctrl_c = command(tmp_path / "unused", *overrides)  # finishes trial 0; trial 1 gets Ctrl-C
    assert "study digits_optuna: finishing trial 0, stopped at its checkpoint" in ctrl_c.stdout
    assert f"resumed from {sweep / '0' / 'checkpoints' / 'step_00000015.pt'} at step 15" in ctrl_c.stdout
    assert ctrl_c.returncode == 128 + signal.SIGINT
    assert ctrl_c.stderr.strip().splitlines()[-2:] == [
        f"study digits_optuna: trial(s) 1 interrupted; the same command finishes them first, from their "
        f"checkpoints in {sweep / '1'}, then asks its new trials",
        "error: stopped by SIGINT (Ctrl-C); the steps since the newest checkpoint are lost (SIGTERM checkpoints first)",
    ]
    finished, by_ctrl_c = trials(sweep)
    assert finished.state == TrialState.COMPLETE and finished.params == interrupted.params
    assert [r["step"] for r in rows(sweep / "0") if "val/acc" in r] == [10, 20]  # one run, resumed at 15
    assert finished.value == max(r["val/acc"] for r in rows(sweep / "0") if "val/acc" in r)
    assert by_ctrl_c.state == TrialState.RUNNING and "interrupted" in by_ctrl_c.user_attrs

    killed = command(tmp_path / "unused", *overrides)  # finishes trial 1; trial 2's command is killed
    killed_at = time.monotonic()
    assert "study digits_optuna: finishing trial 1, stopped by Ctrl-C: from its newest checkpoint" in killed.stdout
    assert f"resumed from {sweep / '1' / 'checkpoints' / 'step_00000010.pt'} at step 10" in killed.stdout
    assert killed.returncode == -signal.SIGKILL
    assert [t.state for t in trials(sweep)] == [TrialState.COMPLETE, TrialState.COMPLETE, TrialState.RUNNING]

    time.sleep(max(0.0, killed_at + 3 - time.monotonic()))  # past the grace period (a command starts in more)
    again = command(tmp_path / "unused", *overrides)
    assert again.returncode == 0, again.stderr
    checkpoint = sweep / "2" / "checkpoints" / "step_00000010.pt"
    assert "study digits_optuna: trial 2 lost its command (no heartbeat for 2 s): trial 3 finishes it" in again.stdout
    assert f"resumed from {checkpoint} at step 10" in again.stdout
    *_, lost, retried, new = trials(sweep)
    assert lost.state == TrialState.FAIL and retried.state == new.state == TrialState.COMPLETE
    assert retried.params == lost.params and retried.system_attrs["failed_trial"] == 2
    assert [r["step"] for r in rows(sweep / "3") if "val/acc" in r] == [20]  # trial 2's run, from its step 10
    assert retried.value == max(r["val/acc"] for r in rows(sweep / "2") + rows(sweep / "3") if "val/acc" in r)
    assert "study digits_optuna: 2 trials (0 failed, 0 pruned), 5 in all" in again.stdout


def distributions(*overrides: str) -> dict:
    return grammar.parse(list(overrides))[0]


@pytest.mark.parametrize(
    ("written", "expected"),
    [
        ("choice(32,64,'a b',true)", CategoricalDistribution([32, 64, "a b", True])),
        ("interval(32,256)", IntDistribution(32, 256)),  # two integers: an integer (Hydra made floats of them)
        ("interval(32,256.0)", FloatDistribution(32.0, 256.0)),
        ("interval(0,0.1)", FloatDistribution(0.0, 0.1)),
        ("tag(log,interval(1e-4,3e-2))", FloatDistribution(1e-4, 3e-2, log=True)),
        ("tag(log,interval(1,64))", IntDistribution(1, 64, log=True)),
        ("range(1,4)", IntDistribution(1, 3)),  # Hydra's range: the stop excluded (1, 2, 3), as the basic sweeper's
        ("range(0,10,3)", IntDistribution(0, 9, step=3)),
        ("range(5,0,-2)", IntDistribution(1, 5, step=2)),  # 5, 3, 1
        ("range(0.1,0.5,0.1)", FloatDistribution(0.1, 0.4, step=0.1)),
        ("tag(log,range(1,9))", IntDistribution(1, 8, log=True)),
    ],
)
def test_the_grammar_maps_each_form_to_its_distribution(written, expected):
    assert distributions(f"k={written}") == {"k": expected}
    shuffled = distributions("k=shuffle(range(1,4))")["k"]  # range's values as unordered choices
    assert isinstance(shuffled, CategoricalDistribution) and sorted(shuffled.choices) == [1, 2, 3]


def test_the_grammar_draws_range_as_the_basic_sweeper_lists_it_and_keeps_fixed_values_and_the_last_word():
    (override,) = OverridesParser.create().parse_overrides(["k=range(1,4)"])
    listed = list(override.sweep_iterator())
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    drawn = {study.ask(fixed_distributions=distributions("k=range(1,4)")).params["k"] for _ in range(60)}
    assert sorted(drawn) == listed == [1, 2, 3]
    space, fixed = grammar.parse(["a=choice(1,2)", "b=3", "a=0.5", "b=interval(0,1.5)"])  # params, command
    assert fixed == {"a": "0.5"} and space == {"b": FloatDistribution(0.0, 1.5)}
    assert grammar.override_text("optim.lr", 1.0) == "optim.lr=1.0"
    assert grammar.grid(distributions("a=range(1,4)", "b=choice(x,y)")) == {"a": [1, 2, 3], "b": ["x", "y"]}


def test_the_space_is_composed_at_each_value_and_a_grid_counts_the_points_no_trial_took():
    space = distributions("a=choice(1,2,3)", "b=interval(0,1.5)")
    corners = grammar.corners(space)  # every value once, the other key at its first
    assert corners == [{"a": 1, "b": 0.0}, {"a": 2, "b": 0.0}, {"a": 3, "b": 0.0}, {"a": 1, "b": 1.5}]
    grid = {"a": [1, 2, 3], "b": ["x"]}
    study = optuna.create_study()
    for a, state in ((1, TrialState.PRUNED), (2, TrialState.WAITING), (9, TrialState.COMPLETE)):  # 9: not a point
        dists = {"a": CategoricalDistribution([1, 2, 3, 9]), "b": CategoricalDistribution(["x"])}
        value = 0.5 if state == TrialState.COMPLETE else None
        study.add_trial(optuna.create_trial(state=state, params={"a": a, "b": "x"}, distributions=dists, value=value))
    assert sweeper.grid_left(study, grid) == 1  # a=3; a pruned or waiting point is taken
    with pytest.raises(ConfigError, match="grace_period=5 needs heartbeats"):
        sweeper.Study(sampler=None, heartbeat_interval=None, grace_period=5)


@pytest.mark.parametrize(
    ("written", "error"),
    [
        ("k=tag(log,choice(1,2))", "k=tag(log,choice(1,2)): tag(log, ...) takes interval(...) or an integer range"),
        ("k=tag(log,interval(0,1))", "k=tag(log,interval(0,1)): a log interval needs a low bound > 0"),
        ("k=interval(2,1)", "k=interval(2,1) is empty (interval(low, high) needs low < high)"),
        ("k=range(1,1)", "k=range(1,1) has no values"),
    ],
)
def test_the_grammar_refuses_what_optuna_cannot_draw(written, error):
    with pytest.raises(ConfigError) as refused:
        grammar.parse([written])
    assert str(refused.value) == f"hydra.sweeper.params: {error}"


def test_pruning_is_refused_where_it_cannot_be_right():
    pruner, cfg = optuna.pruners.MedianPruner(), compose_cfg()
    name = "hydra.sweeper.pruner (MedianPruner)"
    refusals = {
        (None, (), cfg): f"{name} needs a stored study: hydra.sweeper.storage=null keeps it in this process's memory",
        ("sqlite:///x.db", ("trainer.eval_every",), cfg): f"{name} compares the trials' values at equal steps: "
        "trainer.eval_every is searched, so they evaluate at different steps; fix it for the study",
        ("sqlite:///x.db", (), compose_cfg("checkpoint.monitor=null")): f"{name} prunes on checkpoint.monitor's "
        "value; checkpoint.monitor is null",
    }
    for (storage, keys, config), error in refusals.items():
        with pytest.raises(ConfigError) as refused:
            sweeper.check_pruner(pruner, storage, keys, config)
        assert str(refused.value) == error
    sweeper.check_pruner(pruner, "sqlite:///x.db", ("optim.lr",), cfg)  # allowed
    sweeper.check_pruner(None, None, ("trainer.eval_every",), cfg)  # no pruner: anything goes


def test_a_study_refuses_several_objectives_and_a_pruner_on_other_evaluation_steps(tmp_path):
    tk_study = sweeper.Study(sampler=None, direction=["maximize", "minimize"])
    with pytest.raises(ConfigError, match=r"direction=\['maximize', 'minimize'\]: a study of trainkit runs has one"):
        tk_study._direction(compose_cfg())
    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 'study.db'}", study_name="s")
    study.set_user_attr(sweeper.EVAL_EVERY, 10)
    tk_study = sweeper.Study(sampler=None, study_name="s")
    tk_study.config = compose_cfg("trainer.eval_every=20")
    with pytest.raises(ConfigError) as refused:
        tk_study._same_steps(study)
    assert str(refused.value) == (
        "hydra.sweeper.pruner compares the trials' values at equal steps: study s's trials evaluated every 10 "
        "steps, not trainer.eval_every=20; keep it, or start a new study"
    )


def test_a_study_written_by_optuna_2_10_gets_the_line_that_upgrades_it(tmp_path):
    url = f"sqlite:///{tmp_path / 'study.db'}"
    optuna.create_study(storage=url, study_name="s")
    with sqlite3.connect(tmp_path / "study.db") as db:  # the schema optuna 2.10.1 leaves (alembic's revision)
        db.execute("UPDATE alembic_version SET version_num = 'v2.6.0.a'")
        db.execute("UPDATE version_info SET library_version = '2.10.1'")
    with pytest.raises(ConfigError) as refused:
        studies.storage(url)
    assert str(refused.value) == (
        f"hydra.sweeper.storage={url} was written by optuna 2.10.1 (hydra-optuna-sweeper's); upgrade it once, in "
        f"place, with `optuna storage upgrade --storage {url}` (copy it first to keep the old one), then run the "
        "command again"
    )


def test_a_journal_storage_is_a_path_ending_in_log(tmp_path):
    storage = studies.storage(str(tmp_path / "study.log"))
    assert isinstance(storage, optuna.storages.JournalStorage)
    optuna.create_study(storage=storage, study_name="s").optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=2)
    assert len(studies.load("s", str(tmp_path / "study.log")).trials) == 2
    assert studies.storage(f"sqlite:///{tmp_path / 'study.db'}").__class__.__name__ != "JournalStorage"


def test_a_search_overlay_s_keys_win_over_train_yaml_and_lose_to_the_command_line(tmp_path):
    """hparams_search comes after _self_ in train.yaml's defaults: an overlay's trainer.* keys take effect."""
    (tmp_path / "hparams_search").mkdir()
    (tmp_path / "hparams_search" / "probe.yaml").write_text("# @package _global_\ntrainer:\n  eval_every: 7\n")
    path = f"hydra.searchpath=[file://{tmp_path}]"
    assert compose_cfg(path, "hparams_search=probe").trainer.eval_every == 7
    assert compose_cfg(path, "hparams_search=probe", "trainer.eval_every=3").trainer.eval_every == 3


def test_a_sampler_or_pruner_chosen_on_the_command_line_replaces_the_overlay_s_whole():
    """hparams_search=digits_optuna picks its sampler and pruner as options of their groups: another choice replaces
    them. (Written as settings in the overlay, they were merged into grid's: a partial TPESampler, Optuna's crash.)"""

    def built(*overrides):
        node = compose_cfg("hparams_search=digits_optuna", *overrides, with_hydra=True).hydra.sweeper
        return instantiate(node.sampler), instantiate(node.pruner)

    sampler, pruner = built()
    assert type(sampler) is optuna.samplers.TPESampler and sampler._n_startup_trials == 5
    assert type(pruner) is optuna.pruners.MedianPruner and pruner._n_warmup_steps == 200
    grid, pruner = built("hydra/sweeper/sampler=grid")
    assert isinstance(grid, functools.partial) and grid.func is optuna.samplers.GridSampler
    assert grid.keywords == {"seed": None} and type(pruner) is optuna.pruners.MedianPruner
    assert type(built("hydra/sweeper/sampler=random")[0]) is optuna.samplers.RandomSampler
    sampler, pruner = built("hydra/sweeper/pruner=hyperband")
    assert type(sampler) is optuna.samplers.TPESampler and type(pruner) is optuna.pruners.HyperbandPruner
    # A partial that is not a grid (grid's _partial_ under another _target_) is refused in one line, not at ask
    with pytest.raises(ConfigError, match=r"sampler: RandomSampler with _partial_: true, which only GridSampler"):
        sweeper.Study(sampler=functools.partial(optuna.samplers.RandomSampler)).setup(
            hydra_context=None, task_function=None, config=None
        )


# --- the sweeper's own decisions, in this process: a launcher that trains nothing stands in for the jobs ---------


class FakeLauncher:
    """Hydra's launcher as the sweeper sees it: launch(batch, initial_job_idx) -> one JobReturn a job. `jobs` says
    what each job does, in order: a number (its objective), "pruned" (the job's pruner stopped it: the trial's
    pruned_at, as pruning.Trial writes it), or "sigterm" (stopped by a signal after writing its checkpoint)."""

    def __init__(self, sweep: Path, storage: str, jobs: list):
        self.sweep, self.storage, self.jobs, self.launched = sweep, storage, list(jobs), []

    def launch(self, batch, initial_job_idx):
        returns = []
        for number, overrides in enumerate(batch, start=initial_job_idx):
            self.launched.append((number, list(overrides)))
            (self.sweep / str(number) / "checkpoints").mkdir(parents=True, exist_ok=True)
            checkpoint = self.sweep / str(number) / "checkpoints" / "step_00000005.pt"
            job = self.jobs.pop(0)
            if job == "sigterm":
                checkpoint.write_bytes(b"the step's checkpoint")  # written before the job exits
                raise SystemExit(128 + signal.SIGTERM)
            if job == "pruned":
                storage = studies.storage(self.storage)
                study_id = storage.get_study_id_from_name("s")
                trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, number)
                storage.set_trial_user_attr(trial_id, "pruned_at", 5)
                job = 0.25  # a pruned job returns its run's best value, as an early stop does
            returns.append(JobReturn(status=JobStatus.COMPLETED, _return_value=job))
        return returns


def fake_study(sweep: Path, jobs: list, n_trials: int, **settings) -> tuple[sweeper.Study, FakeLauncher]:
    """A command of study "s" in `sweep` (sqlite), its jobs played by FakeLauncher; the space is not composed.
    `settings`: more of hydra.sweeper's (a sampler of its own, a direction)."""
    storage = f"sqlite:///{sweep / 'study.db'}"
    settings = {"sampler": optuna.samplers.RandomSampler(seed=0), **settings}
    study = sweeper.Study(storage=storage, study_name="s", n_trials=n_trials, heartbeat_interval=None, **settings)
    config = compose_cfg(f"hydra.sweep.dir={sweep}", "trainer.max_steps=5", with_hydra=True)
    study.config, study.sweep_dir, study.leader, study.lockstep = config, sweep, True, None
    study.objective_key, study.direction = study._direction(config)
    study._check_space = lambda space, fixed: None  # type: ignore[method-assign]  # composing: tested above
    study.launcher = FakeLauncher(sweep, storage, jobs)  # type: ignore[assignment]
    return study, study.launcher


def test_a_trial_a_signal_stopped_keeps_its_checkpoint_and_the_next_command_finishes_it_there(tmp_path):
    """The cheap twin of the SIGTERM case of the slow test above: the interrupted trial stays RUNNING, marked, its
    dir and checkpoint kept; the next command first runs it again as job N in that dir (train.py resumes from the
    checkpoint there) with its own overrides, then asks new trials."""
    sweep = tmp_path / "sweep"
    first, launched = fake_study(sweep, ["sigterm"], n_trials=1)
    with pytest.raises(SystemExit):
        first.sweep(["optim.lr=choice(0.05,0.1)"])
    (interrupted,) = trials(sweep, study="s")
    assert (
        interrupted.state == TrialState.RUNNING and interrupted.user_attrs["interrupted"] == "stopped at its checkpoint"
    )
    assert (sweep / "0" / "checkpoints" / "step_00000005.pt").read_bytes() == b"the step's checkpoint"
    second, relaunched = fake_study(sweep, [0.5, 0.75], n_trials=1)
    second.sweep(["optim.lr=choice(0.05,0.1)"])
    assert relaunched.launched[0] == launched.launched[0]  # job 0 again: trial 0's dir, its overrides, no other
    assert (sweep / "0" / "checkpoints" / "step_00000005.pt").is_file()
    finished, new = trials(sweep, study="s")
    assert (finished.state, finished.value, finished.params) == (TrialState.COMPLETE, 0.5, interrupted.params)
    assert new.number == 1 and relaunched.launched[1][0] == 1 and new.state == TrialState.COMPLETE


def test_a_study_whose_trials_were_all_pruned_ends_with_its_line_in_this_process(tmp_path, capsys):
    """Every trial pruned (of a random sampler; a grid: test_a_grid_ends_...) is a study that did what it was asked."""
    sweep = tmp_path / "sweep"
    study, _ = fake_study(sweep, ["pruned", "pruned"], n_trials=2)
    study.sweep(["optim.lr=choice(0.05,0.1)"])  # returns: exit 0
    assert [t.state for t in trials(sweep, study="s")] == [TrialState.PRUNED] * 2
    assert capsys.readouterr().out.strip().splitlines()[-1] == (
        "study s: 2 trials (0 failed, 2 pruned), 2 in all; no trial completed: every trial was pruned, no best trial"
    )


def test_the_sweeper_refuses_another_studys_dir_and_a_contradicting_direction_and_fails_with_no_trial(tmp_path, capsys):
    """Each refusal is a ConfigError before a trial is asked (the command's one line and exit status 2, as
    test_a_searched_key_that_is_no_setting_... shows through a command); a study with no completed trial and a
    failed one ends with its line and exit status 1 (a failed trial of a real run: the study fixture's trial 0)."""
    other = tmp_path / "other"  # a dir that holds another study's run: its job 0 would resume it
    (other / "0").mkdir(parents=True)
    (other / "0" / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(ConfigError) as refused:
        fake_study(other, [0.5], n_trials=1)[0].sweep(["optim.lr=choice(0.05,0.1)"])
    assert str(refused.value) == (
        f"{other / '0'} holds a run, but study s has 0 trials: a new trial would resume it; use another "
        "hydra.sweep.dir (or the study that trained it)"
    )
    assert optuna.get_all_study_names(f"sqlite:///{other / 'study.db'}") == []  # no trial asked
    # (the sweeper's setup decides the direction, before a storage or a dir exists)
    with pytest.raises(ConfigError) as refused:
        fake_study(tmp_path / "direction", [], n_trials=1, direction="minimize")
    assert str(refused.value) == (
        "hydra.sweeper.direction=minimize contradicts checkpoint.mode: the objective, the run's best val/acc, is "
        "maximized (leave direction auto)"
    )
    reversed_ = tmp_path / "reversed"
    with pytest.raises(ConfigError) as refused:
        fake_study(reversed_, [], n_trials=1)[0].sweep(["optim.weight_decay=interval(0.1,0)"])
    assert str(refused.value) == (
        "hydra.sweeper.params: optim.weight_decay=interval(0.1,0) is empty (interval(low, high) needs low < high)"
    )
    assert not reversed_.exists()
    respaced = tmp_path / "respaced"  # the same study asked with another space for optim.lr
    fake_study(respaced, [0.5], n_trials=1)[0].sweep(["optim.lr=choice(0.05,0.1)"])
    with pytest.raises(ConfigError) as refused:
        fake_study(respaced, [], n_trials=1)[0].sweep(["optim.lr=interval(0.01,0.1)"])
    assert str(refused.value) == (
        "hydra.sweeper.params: optim.lr: Cannot set different distribution kind to the same parameter name. "
        "Study s searched another space for it: change the space in a new study (hydra.sweeper.study_name, "
        "or another hydra.sweep.dir)"
    )
    assert len(trials(respaced, study="s")) == 1  # refused before a trial was asked (none left running)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        fake_study(tmp_path / "failing", [math.nan], n_trials=1)[0].sweep(["optim.lr=choice(1e6)"])
    assert exited.value.code == 1  # a study with no completed trial has nothing to give: a failure
    assert capsys.readouterr().err.strip().splitlines()[-2:] == [
        "trial 0 failed: the objective is nan, not a number",
        "error: study s: 1 trials (1 failed, 0 pruned), 1 in all; no trial completed",
    ]


def test_a_grid_ends_when_its_points_are_run_and_then_trains_nothing(tmp_path, capsys):
    """hydra/sweeper/sampler=grid (GridSampler, partial): n_trials=5 on a grid of 2 points runs 2 trials and ends
    (not with Optuna's RuntimeError from GridSampler's study.stop() outside optimize); the same command again trains
    nothing (n_trials counts the points left). Every trial pruned: the summary, and sweep returns (exit 0)."""
    sweep, grid = tmp_path / "sweep", functools.partial(optuna.samplers.GridSampler, seed=None)
    whole_grid, launched = fake_study(sweep, ["pruned", "pruned"], n_trials=5, sampler=grid)
    whole_grid.sweep(["optim.lr=choice(0.05,0.1)"])
    out = capsys.readouterr().out
    assert [number for number, _ in launched.launched] == [0, 1]
    assert "study s: its grid of 2 points is complete" in out
    assert out.strip().splitlines()[-1] == (
        "study s: 2 trials (0 failed, 2 pruned), 2 in all; no trial completed: every trial was pruned, no best trial"
    )
    assert sorted(t.params["optim.lr"] for t in trials(sweep, study="s")) == [0.05, 0.1]
    complete, relaunched = fake_study(sweep, [], n_trials=5, sampler=grid)
    complete.sweep(["optim.lr=choice(0.05,0.1)"])
    out = capsys.readouterr().out
    assert relaunched.launched == [] and not (sweep / "2").exists()
    assert "study s: its grid of 2 points is complete: nothing to train" in out
    assert "study s: 0 trials (0 failed, 0 pruned), 2 in all" in out
