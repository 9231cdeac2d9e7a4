"""Bad input ends with one line naming the key, the value and what is allowed, exit status 2, no
traceback, and no run dir: whether Hydra refuses it as it composes (the schema's types, unknown
options and keys) or trainkit does before training (config.check, the data, the launcher).

The catalogue runs in this process, through the CLI's own path (config.run_cli around Hydra's compose
and train.run); a few cases run the real command end to end for the exit status and stderr."""

import os
import re
import shlex
import time

import pytest
from hydra import compose, initialize_config_dir

import train
from helpers import ROOT, exit_status, run_distributed, run_train
from trainkit import config

CATALOGUE = [
    # Types, checked by the schema (trainkit/schema.py) as Hydra composes.
    (["model.width=abc"], "model.width=abc must be an integer"),
    (["optim.lr=abc"], "optim.lr=abc must be a number"),
    (["sched.warmup_steps=abc"], "sched.warmup_steps=abc must be an integer"),
    (["trainer.max_steps=2.5"], "trainer.max_steps=2.5 must be an integer"),
    (["accumulation.global_batch_size=64.0"], "accumulation.global_batch_size=64.0 must be an integer"),
    (["parallel.timeout_s=null"], "parallel.timeout_s=null must be set (not null)"),
    (["parallel.sync_bn=maybe"], "parallel.sync_bn=maybe must be true or false"),
    (["logger.tags=3"], "logger.tags=3 must be a list"),
    (["parallel.shard_units=BasicBlock"], "parallel.shard_units=BasicBlock must be a list"),
    (["seed=abc"], "seed=abc must be an integer"),
    # Unknown options and keys.
    # (Unknown options of a group: test_an_unknown_option_lists_the_group_s_options, which a fork's option passes.)
    (["model.widht=3"], "model.widht is not a setting of model; its settings: _target_, in_shape, num_classes, width"),
    (["+model.extra=3"], "model.extra is not a setting of model; its settings: _target_, in_shape, num_classes, width"),
    # Ranges and choices (config.check), also of values that reach _target_ constructors.
    (["optim.lr=-1"], "optim.lr=-1.0 must be a number >= 0"),
    (["optim.weight_decay=-0.1"], "optim.weight_decay=-0.1 must be a number >= 0"),
    (["sched.warmup_steps=-5"], "sched.warmup_steps=-5 must be an integer >= 0"),
    (["model.width=0"], "model.width=0 must be a positive integer"),
    (["model.dropout=1.5"], "model.dropout=1.5 must be a number in [0, 1)"),
    (["accumulation.steps=0"], "accumulation.steps=0 must be null or a positive integer"),
    (["data.batch_size=-4"], "data.batch_size=-4 must be a positive integer"),
    (["trainer.precision=fp8"], "trainer.precision=fp8 is not one of: fp32, bf16, fp16"),
    (["accumulation.strategy=sometimes"], "accumulation.strategy=sometimes is not one of: no_sync, sync_each_batch"),
    (["parallel.comm_hook=int8"], "parallel.comm_hook=int8 is not one of: none, fp16, bf16"),
    (["checkpoint.keep=0"], "checkpoint.keep=0 must be a positive integer"),
    # Rules between keys, the data, checkpoints and the launcher.
    (
        ["accumulation.global_batch_size=100"],
        "accumulation.global_batch_size=100 is not a multiple of data.batch_size x world size = 32 x 1 = 32",
    ),
    (["data.drop_last=true", "data.batch_size=1500"], "data.drop_last=true drops every sample"),
    (["data.splits.val_fraction=1.0"], "data.splits.val_fraction=1.0 must be >= 0 and < 1"),
    (["data=mnist", "data.root=/nonexistent"], "data.root=/nonexistent holds no MNIST data"),
    (["data=fake", "model=gpt"], "model.vocab_size: Interpolation key 'data.vocab_size' not found"),
    (["checkpoint.resume=/nonexistent/ckpt.pt"], "checkpoint.resume=/nonexistent/ckpt.pt: no such checkpoint"),
    (["parallel=ddp"], "parallel=ddp needs several processes: parallel.nproc_per_node=N (or torchrun"),
    # parallel.nproc_per_node: its values, and what the N workers it starts would refuse, said before they start.
    (["parallel.nproc_per_node=0"], "parallel.nproc_per_node=0 must be null, a positive integer or auto"),
    (["parallel.nproc_per_node=abc"], "parallel.nproc_per_node=abc must be null, a positive integer or auto"),
    (["parallel.max_restarts=-1"], "parallel.max_restarts=-1 must be an integer >= 0"),
    (["parallel.max_restarts=1"], "parallel.max_restarts=1 restarts the workers this process starts: it needs"),
    (["parallel=single", "parallel.nproc_per_node=2"], "parallel=single with world size 2 would train 2 independent"),
    (
        ["+experiment=accumulation_sweep", "accumulation.steps=3", "parallel.nproc_per_node=2"],
        "data.batch_size: micro_batch: the global batch 32 is not a multiple of K x world size = 3 x 2",
    ),
    (
        ["parallel.static_graph=true", "accumulation.steps=2"],
        "parallel.static_graph=true with no_sync accumulation (K=2)",
    ),
    (["parallel.reduce_dtype=fp8"], "parallel.reduce_dtype=fp8 is not one of: fp32, bf16"),
    (["data.prefetch_factor=0"], "data.prefetch_factor=0 must be null or a positive integer"),
    (["data.on_device=yes"], "data.on_device=yes is not one of: auto, true, false"),
    (
        ["data.splits._target_=helpers.noisy_digits", "data.on_device=true"],
        "data.on_device=true: the train split cannot be on the device: NoisyDigits declares no tensor form",
    ),
    (["model.width=["], "no viable alternative at input '['"),
    # Options without a Schema of their own: the keys and types of their _target_'s signature (options.derived).
    (["+experiment=addition_gpt", "model.n_layer=two"], "model.n_layer=two must be an integer"),
    (["task.label_smoothing=abc"], "task.label_smoothing=abc must be a number"),
    (["+task.smoothing=0.1"], "task.smoothing is not a setting of task; its settings: _target_, label_smoothing"),
    (["data.splits.test_fraction=abc"], "data.splits.test_fraction=abc must be a number"),
    (["+data.splits.fraction=0.1"], "data.splits.fraction is not a setting of data.splits; its settings: _target_,"),
    # Seeds, unknown keys added with +, the logger, K against the global batch (issue 17).
    (["seed=-1"], "seed=-1 must be an integer in [0, 4294967295]"),
    (["seed=4294967296"], "seed=4294967296 must be an integer in [0, 4294967295]"),
    (
        ["+trainer.max_step=3"],
        "trainer.max_step is not a setting of trainer; its settings: epochs, max_steps, clip_grad_norm, precision",
    ),
    (["+foo=1"], "foo is not a setting of the root; its settings: seed, model, data, optim, sched, task, trainer"),
    (["+data.foo=1"], "data.foo is not a setting of data; its settings: name, splits, shape, num_classes"),
    (["logger.name=WandB"], "logger.name=WandB is not one of: none, wandb, tensorboard, mlflow"),
    (
        ["accumulation.global_batch_size=64", "accumulation.steps=1"],
        "accumulation.steps=1 disagrees with accumulation.global_batch_size=64: 64 / (data.batch_size x world size "
        "= 32 x 1) = 2 micro-batches per step; set one of them",
    ),
    (
        ["+experiment=accumulation_sweep", "accumulation.steps=3"],
        "data.batch_size: micro_batch: the global batch 32 is not a multiple of K x world size = 3 x 1",
    ),
    # The model, the data and the task disagree (each would fail at the first forward).
    (
        ["+experiment=addition_gpt", "data.block_size=5"],
        "data.block_size=5 is shorter than the longest problem of data.max_digits=3 (12 tokens)",
    ),
    (["+experiment=addition_gpt", "model.block_size=4"], "model.block_size=4 must be at least data.block_size=24"),
    (["data=pydoc_text", "model=gpt", "data.block_size=1"], "data.block_size=1 must be an integer >= 2"),
    (["+experiment=addition_gpt", "model.vocab_size=5"], "model.vocab_size=5 must be at least data.vocab_size=14"),
    (["task=lm"], "task=lm needs a token data set (data.vocab_size, e.g. data=addition); data=digits has none"),
    (
        ["+experiment=addition_gpt", "task=classification"],
        "task=classification needs data.num_classes; data=addition has none (a token data set: task=lm)",
    ),
    (["model.in_shape=[1,2]"], "model.in_shape=[1,2] must be equal to data.shape=[1,8,8]"),
    (["model.num_classes=5"], "model.num_classes=5 must be at least data.num_classes=10"),
    (["model=cnn", "model.in_channels=3"], "model.in_channels=3 must equal the channels of data.shape=[1,8,8]"),
]


def cli_in_process(overrides: list[str], run_dir, monkeypatch) -> int:
    """What `python src/train.py <overrides>` does, in this process: run_cli around Hydra's compose
    and train.run (which @hydra.main calls). Hydra makes the run dir before the task: so do we."""
    monkeypatch.setitem(os.environ, "HYDRA_FULL_ERROR", "0")  # run_cli sets it to 1 for its own handling

    def main():
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            cfg = compose("train", overrides=overrides)
        run_dir.mkdir()
        return train.run(cfg, run_dir)

    with pytest.raises(SystemExit) as exit:
        config.run_cli(main)
    return exit.value.code


@pytest.mark.parametrize("overrides,message", CATALOGUE, ids=[" ".join(o) for o, _ in CATALOGUE])
def test_bad_input_is_one_line_exit_2_and_no_run_dir(tmp_path, capsys, monkeypatch, overrides, message):
    run_dir = tmp_path / "run"
    status = cli_in_process(overrides, run_dir, monkeypatch)
    out, err = capsys.readouterr()
    assert status == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {message}"), err
    assert "Traceback" not in out + err
    assert not run_dir.exists()


@pytest.mark.parametrize(
    "group,built_in",
    [
        ("model", {"cnn", "gpt", "mlp", "resnet18", "timm"}),
        (
            "data",
            {"addition", "cifar10", "diabetes", "digits", "fake", "image_folder", "mnist", "pydoc_text", "tokens"},
        ),
    ],
)
def test_an_unknown_option_lists_the_group_s_options(tmp_path, capsys, monkeypatch, group, built_in):
    """The line lists conf/<group>/'s options, a fork's own among them: asserting the built-ins and the folder, not
    a fixed list, keeps this test green when a fork adds an option first thing."""
    run_dir = tmp_path / "run"
    assert cli_in_process([f"{group}=nope"], run_dir, monkeypatch) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    listed = re.fullmatch(rf"error: {group}=nope is not one of: (.+)", line)
    assert listed, line
    options = listed.group(1).split(", ")
    assert options == sorted(p.stem for p in (ROOT / "conf" / group).glob("*.yaml")) and built_in <= set(options)
    assert not run_dir.exists()


def test_a_resolver_not_registered_yet_is_one_line_that_says_why():
    """`--cfg job --resolve` resolves before the options' modules load (and register their resolvers)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import UnsupportedInterpolationType

    with pytest.raises(UnsupportedInterpolationType) as caught:
        OmegaConf.resolve(OmegaConf.create({"data": {"vocab_size": "${unregistered_vocab_size:}"}}))
    line = config._one_line(caught.value)
    assert line is not None and line.startswith("${unregistered_vocab_size:...}: no such resolver is registered yet")
    assert "without --resolve" in line


# End to end: Hydra's composition, config.check, and a refusal from inside train() (the data).
END_TO_END = [CATALOGUE[0], CATALOGUE[12], CATALOGUE[24]]


@pytest.mark.slow
@pytest.mark.parametrize("overrides,message", END_TO_END, ids=[" ".join(o) for o, _ in END_TO_END])
def test_bad_input_from_the_command_line(tmp_path, overrides, message):
    run_dir = tmp_path / "run"
    proc = run_train(run_dir, *overrides, check=False)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {message}"), proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not run_dir.exists()


@pytest.mark.slow
def test_hydra_full_error_shows_the_traceback(tmp_path, monkeypatch):
    monkeypatch.setitem(os.environ, "HYDRA_FULL_ERROR", "1")
    import helpers

    monkeypatch.setattr(helpers, "_env", lambda: dict(os.environ, OMP_NUM_THREADS="1"))
    proc = run_train(tmp_path, "optim.lr=abc", check=False)
    assert proc.returncode != 0 and "Traceback" in proc.stderr and "ValidationError" in proc.stderr


def test_explicit_single_under_torchrun_is_refused_in_one_line_from_rank_0(tmp_path, capfd):
    import train  # noqa: F401  once here, not in every forked rank

    # Two forked ranks in torchrun's environment (what train.py runs after composing): each exits 2, rank 0 says why.
    codes = run_distributed(exit_status, 2, str(tmp_path / "run"), ("parallel=single",), group=False)
    assert codes == [2, 2]
    err = capfd.readouterr().err
    assert err.count("error: parallel=single with world size 2 would train 2 independent replicas") == 1, err
    # Refused before joining the process group: rank 0 of 2 whose peer never starts exits 2 at once. (Refused inside
    # it, the rank that refused first closed its peer's connect: "Gloo connectFullMesh failed ... closed by peer",
    # a traceback instead of the line, seen once in a fresh clone's suite.)
    began = time.monotonic()
    assert run_distributed(_without_its_peer, 1, str(tmp_path / "alone"), group=False) == [2]
    assert time.monotonic() - began < 30  # joining would wait parallel.timeout_s=60 for the peer, then fail


def _without_its_peer(rank: int, world_size: int, run_dir: str) -> int | str | None:
    return exit_status(0, 2, run_dir, ("parallel=single", "parallel.timeout_s=60"))


NULL_GROUPS = [  # (overrides, the line): a group set to null, a search space unquoted inside a dict (issue 54, 6)
    (
        ["logger=null"],
        "logger=null: a config group takes one of its options' names ({logger}); logger=none turns it off",
    ),
    (
        ["hparams_search=digits_optuna", "hydra/sweeper/pruner=null"],
        "hydra/sweeper/pruner=null: a config group takes one of its options' names ({hydra/sweeper/pruner}); "
        "hydra.sweeper.pruner=null turns it off",
    ),
    (["model=null"], "model=null: a config group takes one of its options' names ({model})"),
    (
        ["hparams_search=digits_optuna", "hydra.sweeper.params={model.width:choice(32,64)}"],
        "hydra.sweeper.params={model.width:choice(32,64)}: choice(...) inside a dict is no value; quote it "
        "('hydra.sweeper.params={model.width:\"choice(32,64)\"}') or give it as its own override "
        "(-m model.width=choice(32,64))",
    ),
]


@pytest.mark.parametrize("overrides,message", NULL_GROUPS, ids=[" ".join(o) for o, _ in NULL_GROUPS])
def test_a_group_set_to_null_or_a_sweep_in_a_dict_is_one_line_naming_the_right_form(
    tmp_path, capsys, monkeypatch, overrides, message
):
    status = cli_in_process(overrides, tmp_path / "run", monkeypatch)
    out, err = capsys.readouterr()
    assert status == 2, err
    for group in re.findall(r"\(\{([\w/]+)\}\)", message):  # conf/<group>'s options, a fork's own among them
        message = message.replace(
            f"{{{group}}}", ", ".join(sorted(p.stem for p in (ROOT / "conf" / group).glob("*.yaml")))
        )
    assert err.strip().splitlines() == [f"error: {message}"] and "Traceback" not in out + err
    assert not (tmp_path / "run").exists()


IN_AN_EXPERIMENT = [  # (the experiment's yaml, the line): a wrong type inside a yaml, not on the command line (58, 8)
    ("trainer:\n  max_steps: abc\n", "In 'experiment/mine': trainer.max_steps=abc must be an integer"),
    ("parents: model.init.from\n", "In 'experiment/mine': parents=model.init.from must be a dict"),
    (
        "parents:\n  model.init.from: model=cnn\n",
        "In 'experiment/mine': parents.model.init.from=model=cnn must be a list",
    ),
]


@pytest.mark.parametrize("yaml,message", IN_AN_EXPERIMENT, ids=[m.partition(": ")[2] for _, m in IN_AN_EXPERIMENT])
def test_a_wrong_type_inside_an_experiment_names_the_file_the_key_the_value_and_the_type(
    tmp_path, capsys, monkeypatch, yaml, message
):
    """Hydra wraps OmegaConf's refusal of a yaml's value as "In 'experiment/mine': ValidationError raised while
    composing config:" and keeps the refusal (key, value, type) as the exception's context. The experiment comes
    from a conf dir of this test's own (hydra.searchpath), as a fork's conf/experiment/mine.yaml would."""
    (tmp_path / "conf" / "experiment").mkdir(parents=True)
    (tmp_path / "conf" / "experiment" / "mine.yaml").write_text(f"# @package _global_\n{yaml}")
    overrides = [f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "+experiment=mine"]
    status = cli_in_process(overrides, tmp_path / "run", monkeypatch)
    out, err = capsys.readouterr()
    assert status == 2 and err.strip().splitlines() == [f"error: {message}"], err
    assert "Traceback" not in out + err and not (tmp_path / "run").exists()


# docs/config.md's catalogue: `$ python src/train.py <overrides>` and the `error: ...` line it prints (58, 11).
DOCUMENTED = ROOT / "docs" / "config.md"
# A group's options in a line: after "is not one of: " (at the end), or in "its options' names (...)".
OPTION_LIST = re.compile(r"(?<=is not one of: )[\w, ]+$|(?<=options' names \()[\w, ]+(?=\))")


def documented_errors(page=DOCUMENTED) -> list[tuple[list[str], str]]:
    """Each command of the page's plain ``` blocks with the `error:` line documented under it: (overrides, line)."""
    found, fenced, command = [], False, None
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced, command = not fenced, None
        elif fenced and line.startswith("$ python src/train.py"):
            command = [word for word in shlex.split(line[2:])[2:] if word not in ("-m", "--multirun")]
        elif fenced and command is not None and line.startswith("error: "):
            found.append((command, line.removeprefix("error: ")))
            command = None
    return found


def disagreement(documented: str, printed: str, page_text: str) -> str | None:
    """None when the documented line is what was printed: the same words, a prefix where the page ends it with
    "...", and a group's options listed as printed, less those of a fork's own: an option the page names
    (`name` or group=name) must be listed, one it never names (a fork's own) may be missing."""
    if documented.endswith("..."):
        return None if printed.startswith(documented.removesuffix("...")) else "printed another line"
    if OPTION_LIST.sub("{}", documented) != OPTION_LIST.sub("{}", printed):
        return "printed another line"
    for listed, options in zip(OPTION_LIST.findall(documented), OPTION_LIST.findall(printed), strict=True):
        listed_options = listed.split(", ")
        missing = [o for o in options.split(", ") if o not in listed_options]
        if listed_options != [o for o in options.split(", ") if o in listed_options]:
            return f"lists options the group lacks, or out of order: {listed}"
        if named := [o for o in missing if re.search(rf"`{re.escape(o)}`|={re.escape(o)}\b", page_text)]:
            return f"leaves out {', '.join(named)}"
    return None


def test_config_md_s_catalogue_is_what_each_command_prints(tmp_path, capsys, monkeypatch):
    """Every command of docs/config.md's catalogue, run in this process as the catalogue above is, prints the line
    documented under it (what it caught first: model=vit's line listed 4 of the 7 models)."""
    catalogue, page_text = documented_errors(), DOCUMENTED.read_text()
    assert len(catalogue) >= 10
    stale = []
    for i, (overrides, documented) in enumerate(catalogue):
        assert cli_in_process(overrides, tmp_path / f"run{i}", monkeypatch) == 2
        printed = capsys.readouterr().err.strip().removeprefix("error: ")
        if (why := disagreement(documented, printed, page_text)) is not None:
            stale.append(f"{' '.join(overrides)}: {why}\n  documented: {documented}\n  printed:    {printed}")
    assert not stale, "\n".join(stale)


def test_a_catalogue_line_may_leave_out_an_option_a_fork_added_but_not_one_the_page_names():
    page = "| `model=` | `mlp`, `cnn` |\n| `model=timm`: ... |"
    printed = "model=vit is not one of: cnn, masked_mlp, mlp, timm"
    assert disagreement("model=vit is not one of: cnn, mlp, timm", printed, page) is None  # masked_mlp: a fork's
    assert disagreement("model=vit is not one of: cnn, mlp", printed, page) == "leaves out timm"
    assert disagreement("model=vit is not one of: mlp, cnn, timm", printed, page).startswith("lists options")
    assert disagreement("model=vit is not one of: cnn, gone, mlp, timm", printed, page).startswith("lists options")
    assert disagreement("model=vit is no option: cnn, mlp, timm", printed, page) == "printed another line"


def started_under(torch_version: str, monkeypatch) -> tuple[bool, int | None]:
    """config.run_cli (train.py's, eval.py's, predict.py's start) with torch.__version__ faked: whether the entry
    point ran, and the exit status (None: no exit)."""
    import torch

    monkeypatch.setattr(torch, "__version__", torch_version)
    monkeypatch.setitem(os.environ, "HYDRA_FULL_ERROR", "0")  # run_cli sets it to 1 for its own handling
    started = []
    try:
        config.run_cli(lambda: started.append(True))
    except SystemExit as exit:
        return bool(started), exit.code
    return bool(started), None


@pytest.mark.parametrize("metadata", ["installed", "absent"])
def test_a_torch_older_than_the_floor_is_refused_in_one_line_at_start(capsys, monkeypatch, metadata):
    """pyproject.toml's torch floor, read from the installed package's metadata, else (a checkout run without
    `pip install`) from pyproject.toml itself: an older torch is one line naming both versions, exit 2."""
    import importlib.metadata

    required = next(r for r in importlib.metadata.requires("trainkit") or [] if r.startswith("torch>="))
    if metadata == "absent":

        def absent(name):
            raise importlib.metadata.PackageNotFoundError(name)

        monkeypatch.setattr(importlib.metadata, "requires", absent)
    assert started_under("2.10.0+cpu", monkeypatch) == (False, 2)
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"error: torch 2.10.0+cpu is installed; trainkit needs {required}: pip install"), line


def test_the_floor_s_release_and_its_builds_start():
    """The floor's release, a CUDA build of it and a source or nightly build of it (a pre-release by its number)
    pass; the check says nothing."""
    import importlib.metadata

    floor = next(r for r in importlib.metadata.requires("trainkit") or [] if r.startswith("torch>="))[7:]
    for version in (floor, f"{floor}.0+cu130", f"{floor}.0a0+git1234567", f"{floor}.0.dev20260101"):
        with pytest.MonkeyPatch.context() as monkeypatch:
            assert started_under(version, monkeypatch) == (True, None), version
