"""Every task trains, evaluates, checkpoints, resumes and predicts on a device that is not the CPU, and a step
that neither logs, evaluates nor saves never makes the host wait on the device (docs/design.md, rule 22).

On a CPU-only machine a tensor made without a device is invisible: on the first GPU tried, every evaluation
crashed on one `torch.tensor(len(target))`. These runs put the model and the batches on tests/another_device.py's
DEVICE, which refuses a tensor on the wrong device as CUDA does and counts the calls that make the host wait on a
GPU, while computing every number as the CPU does (so a run there must end with the CPU run's weights, bit for
bit). Why that and not torch's `meta` device or FakeTensorMode: its docstring. The tasks are found by discovery
(conf/task/*.yaml): a fork's task is run by the first experiment that uses it, else as the default job's task.
On a machine with a GPU, `test_quiet_steps_do_not_wait_on_cuda` checks the same runs under
`torch.cuda.set_sync_debug_mode("warn")` (scripts/gpu_check.sh runs it).
"""

import warnings
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import cross_entropy

import train
from another_device import CPU, DEVICE, on_another_device
from helpers import ROOT, run_in_process, weights
from test_experiments import EXPERIMENTS, compose_experiment, parent_overrides
from trainkit import dist
from trainkit.accumulate import EpochLayout
from trainkit.data.pydoc_text import is_text_run
from trainkit.dist import Dist
from trainkit.loading import InMemory, TrainLoader

TASKS = sorted(p.stem for p in (ROOT / "conf" / "task").glob("*.yaml"))
SHORT = ["trainer.max_steps=3", "trainer.log_every=3", "trainer.eval_every=2", "checkpoint.every=2"]
SHORT += ["checkpoint.keep=5"]  # step 2's checkpoint is resumed from
# What the runs also go through: the EMA (val_raw/*), early stopping's counter, the test pass (on by default)
ALSO = ["trainer.ema.decay=0.5", "trainer.early_stopping.patience=5"]
SMALL = {  # an experiment's data made small: seconds on the emulated device (every op runs through Python)
    "addition": ["data.num_train=64", "data.num_val=24", "data.batch_size=8", "model.n_layer=1", "model.n_embd=16"],
    "digits_views": ["data.splits.val_fraction=0.05", "data.splits.test_fraction=0.05", "data.batch_size=16"],
    "digits": ["data.splits.val_fraction=0.05", "data.splits.test_fraction=0.05"],
    "diabetes": [],
    "pydoc_text": [
        "data.block_size=16",
        "data.batch_size=4",
        "debug=limit",
        "debug.limit.val=0.02",
        "debug.limit.test=0.02",
    ],
}


def _task_target(name: str) -> str:
    return OmegaConf.load(ROOT / "conf" / "task" / f"{name}.yaml")._target_


def _one_run(name: str) -> bool:
    """An experiment that is one run (not a sweep or a search)."""
    text = (ROOT / "conf" / "experiment" / f"{name}.yaml").read_text()
    return "mode: MULTIRUN" not in text and "hparams_search" not in text


def overrides_for(task: str, tmp: Path) -> list[str]:
    """The first one-process experiment whose task is `task` (a parent made for it where it builds on one), made
    small; the default job (task=<task>) where no experiment uses it. `task` +experiment=<name>: that one."""
    if task.startswith("+experiment="):
        name = task.removeprefix("+experiment=")
        cfg = compose_experiment(name)
        prepared = [f"data.tokenizer={tmp / 'tokenizer'}"] if cfg.data.get("train_tokenizer") else []  # not in data/
        if "num_hidden_layers" in cfg.model.get("config", {}) and not cfg.get("parents"):  # a transformers config
            prepared += ["model.config.num_hidden_layers=1", "model.config.hidden_size=32"]
        return [task, *SMALL[cfg.data.name], *prepared, *parent_overrides(name, tmp)]
    for name in filter(_one_run, EXPERIMENTS):
        cfg = compose_experiment(name)
        one_process = cfg.parallel.mode not in ("ddp", "fsdp") and not cfg.parallel.get("nproc_per_node")
        if cfg.task._target_ == _task_target(task) and cfg.data.name in SMALL and one_process:
            if "init" in cfg.model and OmegaConf.is_missing(cfg.model.init, "from"):
                continue  # a fine-tune or probe of another experiment's run: that run's task is covered there
            return [f"+experiment={name}", *SMALL[cfg.data.name], *parent_overrides(name, tmp)]
    return [f"task={task}", *SMALL["digits"]]


def experiments_of(model: str) -> list[str]:
    """The one-process experiments of conf/model/<model>.yaml: a model room with code paths of its own (model=hf: its
    wrapper, a built-on-meta model's loading, peft's adapters) runs each of them, made small."""
    target = OmegaConf.load(ROOT / "conf" / "model" / f"{model}.yaml")._target_
    return [name for name in filter(_one_run, EXPERIMENTS) if compose_experiment(name).model._target_ == target]


@pytest.fixture
def device(monkeypatch):
    """trainer.device=auto (the default) resolves to DEVICE, =cpu to the CPU; runs on DEVICE go inside
    on_another_device(), which yields their host syncs (another_device.Syncs). Attention by the math kernel on
    both: on the CPU torch picks a fused one, on a device it has no kernel for the math one (2e-7 apart)."""
    monkeypatch.setattr(dist, "resolve_device", lambda spec, *args, **kwargs: CPU if spec == "cpu" else DEVICE)
    with sdpa_kernel(SDPBackend.MATH):
        yield


@pytest.fixture
def quiet_steps(monkeypatch):
    """The optimizer steps after which the loop neither logs, evaluates nor saves (train.Cadence said nothing),
    and each step's start marked in `marks` (a callable: the step number)."""
    quiet: set[int] = set()
    marks = []

    class Recorded(train.Cadence):
        def after(self, step):
            due = super().after(step)
            if not due:
                quiet.add(step - 1)  # the step that ran is step - 1 (0-based), its number after it is `step`
            return due

    def marked(step_once):
        def run(s, windows, window, step):
            for mark in marks:
                mark(step)
            return step_once(s, windows, window, step)

        return run

    monkeypatch.setattr(train, "Cadence", Recorded)
    monkeypatch.setattr(train, "bare_step", marked(train.bare_step))
    monkeypatch.setattr(train, "optimizer_step", marked(train.optimizer_step))
    return quiet, marks


# transformers' own forward of a causal LM reads one value per forward (whether position_ids pack several sequences,
# or whether a padding mask is all ones): a wait trainkit cannot remove (docs/hf.md).
LIBRARY_WAITS = ("(transformers/masking_utils.py:",)


def waits(syncs, quiet: set[int]) -> dict[int, list]:
    """{quiet step: the host syncs it made}, only those that made any; a library's own (LIBRARY_WAITS) left out."""
    made = {step: [s for s in syncs.at(step) if not any(w in s[1] for w in LIBRARY_WAITS)] for step in sorted(quiet)}
    return {step: events for step, events in made.items() if events}


@pytest.mark.parametrize("task", TASKS + [f"+experiment={name}" for name in experiments_of("hf")])
def test_every_task_runs_its_every_path_on_another_device(task, device, quiet_steps, tmp_path):
    """Train (evaluations, EMA, early stopping's counter, a checkpoint, the best weights, the test pass), then
    predict.py on the device; the device's step-2 checkpoint resumed on the CPU ends with the device run's weights,
    bit for bit (what is computed does not depend on the device, and a checkpoint moves between them). The quiet
    steps waited on the device for nothing."""
    quiet, marks = quiet_steps
    overrides = [*overrides_for(task, tmp_path), *SHORT, *ALSO]
    with on_another_device() as syncs:
        marks.append(syncs.begin_step)
        out = run_in_process(tmp_path / "run", *overrides)
        marks.clear()
        text = is_text_run(OmegaConf.load(tmp_path / "run" / ".hydra" / "config.yaml"))  # sampled: a forward a token
        sampled = ["max_new_tokens=20"] if text else []
        run_in_process(tmp_path / "predict", f"run_dir={tmp_path / 'run'}", *sampled, script="predict")
    assert f" on {DEVICE} |" in out and "done: 3 steps" in out, out
    assert "data path: on the device" in out, out  # every shipped data set has a tensor form (data.on_device=auto)
    assert (tmp_path / "run" / "model_best.pt").is_file() and (tmp_path / "run" / "model_ema.pt").is_file()
    assert quiet, "no quiet step: the run checked nothing"
    assert not waits(syncs, quiet), waits(syncs, quiet)
    predicted = [*(tmp_path / "predict").glob("*.csv"), *(tmp_path / "predict").glob("samples.txt")]  # lm: samples
    assert predicted or (tmp_path / "predict" / "embeddings.pt").is_file()

    step2 = tmp_path / "run" / "checkpoints" / "step_00000002.pt"
    run_in_process(tmp_path / "cpu", *overrides, f"checkpoint.resume={step2}", "trainer.device=cpu")
    assert_bit_equal(weights(tmp_path / "cpu"), weights(tmp_path / "run"))


LAYOUTS = [["data.batch_size=8", "accumulation.steps=4"], ["data.batch_size=auto", "accumulation.global_batch_size=32"]]


@pytest.mark.parametrize("layout", LAYOUTS, ids=["K=4", "auto"])
def test_default_job_at_k_4_and_auto_from_a_cpu_checkpoint_then_eval_on_another_device(
    layout, device, quiet_steps, tmp_path
):
    """The other way: a CPU run's checkpoint resumed on the device ends with the CPU run's weights, at K=4 and with
    data.batch_size=auto (the found micro-batch is in the checkpoint); its quiet steps wait for nothing; then
    eval.py on the device."""
    quiet, marks = quiet_steps
    every_6 = ["trainer.max_steps=6", "trainer.log_every=6", "trainer.eval_every=6"]  # steps 3 and 5 quiet
    overrides = [*SMALL["digits"], *SHORT, *layout, *every_6]
    run_in_process(tmp_path / "cpu", *overrides, "trainer.device=cpu")
    quiet.clear()  # the device run's
    step2 = tmp_path / "cpu" / "checkpoints" / "step_00000002.pt"
    with on_another_device() as syncs:
        marks.append(syncs.begin_step)
        out = run_in_process(tmp_path / "run", *overrides, f"checkpoint.resume={step2}")
        marks.clear()
        run_in_process(tmp_path / "eval", f"run_dir={tmp_path / 'run'}", "split=test", script="eval")
    assert f" on {DEVICE} |" in out and "done: 6 steps" in out and "data path: on the device" in out, out
    assert_bit_equal(weights(tmp_path / "run"), weights(tmp_path / "cpu"))
    assert quiet and not waits(syncs, quiet), (quiet, waits(syncs, quiet))
    assert "test/acc" in (tmp_path / "eval" / "metrics.json").read_text()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: scripts/gpu_check.sh runs it")
@pytest.mark.parametrize("task", TASKS)
def test_quiet_steps_do_not_wait_on_cuda(task, quiet_steps, tmp_path):
    """The same runs on CUDA under torch.cuda.set_sync_debug_mode("warn"): no warning on a quiet step."""
    quiet, marks = quiet_steps
    per_step: dict[int, list[str]] = {}  # the sync warnings of each step, from its start to the next one's
    running: list[int] = []

    def mark(step: int) -> None:
        if running:
            per_step[running[-1]] = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
        caught.clear()
        running.append(step)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        marks.append(mark)
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run_in_process(tmp_path / "run", *overrides_for(task, tmp_path), *SHORT, "trainer.device=cuda")
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert quiet and not {step: per_step[step] for step in quiet if per_step.get(step)}, per_step


def assert_bit_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, different


def test_a_ranks_empty_micro_batches_on_a_split_on_the_device_are_on_the_device():
    """Rank 1 of 2, its share of the split on the device (data.on_device) one micro-batch short of the epoch's: the
    empty micro-batch it still runs is made on the device too, where the model meets it (the device refuses a CPU
    batch, as CUDA does). One process: a gloo collective cannot send the device's tensors, so no 2-rank run."""
    split = InMemory(torch.randn(9, 4), torch.arange(9) % 3)
    micro_batches = EpochLayout(9, 2, 2, 2).micro_batches  # 3: rank 0 holds 5 samples, rank 1 only 4
    with on_another_device():
        loader = TrainLoader(split, Dist(1, 1, 2, DEVICE), 2, 0, 0, micro_batches, resident=True)
        model = torch.nn.Linear(4, 3).to(DEVICE)
        for epoch in (0, 1):
            sizes = []
            for x, y in loader.epoch(epoch):
                cross_entropy(model(x), y, reduction="sum").backward()  # what the step does with it
                sizes.append(len(y))
            assert sizes == [2, 2, 0], sizes


def test_epochs_on_the_device_wait_for_nothing_at_their_boundaries(device, quiet_steps, tmp_path):
    """The split on the device (data.on_device) across epoch boundaries: each epoch's order goes to the device
    without making the host wait (the quiet step after which the next epoch begins waited for nothing)."""
    quiet, marks = quiet_steps
    # digits' train split of 90 samples at b=16, K=4: 2 windows an epoch (the second short: 16 + 10)
    small = ["data.splits.val_fraction=0.45", "data.splits.test_fraction=0.5", "model.width=8", "trainer.test=false"]
    every = ["trainer.max_steps=5", "trainer.log_every=5", "trainer.eval_every=5", "checkpoint.every=5"]
    with on_another_device() as syncs:
        marks.append(syncs.begin_step)
        out = run_in_process(tmp_path / "run", *small, *every, "data.batch_size=16", "accumulation.steps=4")
    assert f" on {DEVICE} |" in out and "done: 5 steps" in out and "data path: on the device" in out, out
    assert {1, 3} <= quiet, quiet  # the last steps of epochs 0 and 1: the next epoch's order copied after them
    assert not waits(syncs, quiet), waits(syncs, quiet)


def test_the_steps_frontier_on_another_device(device, quiet_steps, tmp_path):
    """Issue 61's switches on the device: optim=muon (Newton-Schulz on the device; a momentum warmup counted in its
    state) and trainer.deterministic=true; its quiet steps wait for nothing, and its step-2 checkpoint resumed on
    the CPU ends with its weights. (checkpoint.async=true is not run here: DCP's stager
    copies a tensor by its storage, which this device's wrapper tensors do not have; on a GPU, scripts/gpu_check.sh
    resumes an async checkpoint bit for bit.)"""
    quiet, marks = quiet_steps
    frontier = ["optim=muon", "optim.momentum_warmup=4", "trainer.deterministic=true"]
    overrides = [*SMALL["digits"], *SHORT, "trainer.max_steps=6", "trainer.log_every=6", *frontier]
    with on_another_device() as syncs:
        marks.append(syncs.begin_step)
        out = run_in_process(tmp_path / "run", *overrides)
        marks.clear()
    assert f" on {DEVICE} |" in out and "done: 6 steps" in out, out
    assert quiet and not waits(syncs, quiet), (quiet, waits(syncs, quiet))
    step2 = tmp_path / "run" / "checkpoints" / "step_00000002.pt"
    run_in_process(tmp_path / "cpu", *overrides, f"checkpoint.resume={step2}", "trainer.device=cpu")
    assert_bit_equal(weights(tmp_path / "cpu"), weights(tmp_path / "run"))
