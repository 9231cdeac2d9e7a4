"""A frozen teacher beside the model (trainkit/teacher.py) and a loss of several terms on train rows
(task=distil: loss/ce, loss/kd): the terms of W=2 x K=2 equal one process's (FSDP), also with an uneven last
window (DDP), a resume mid-row logs the same row (on the same and on another world size) without the teacher's
own dir, a resume that changes the objective or the teacher is refused, a teacher of other data is refused before
anything is written, the teacher is in no checkpoint or model.pt and is counted in the summary."""

import importlib.metadata
import json
import math
import os
import re
import shutil
import subprocess

import pytest
import torch
from torch import nn

from helpers import ROOT, compose_cfg, make_parent, max_diff, rows, run_in_process, weights
from trainkit.dist import Dist
from trainkit.errors import ConfigError
from trainkit.metrics import TrainMeter
from trainkit.parallel import CommStats
from trainkit.precision import autocast_for
from trainkit.progress import Progress
from trainkit.tasks.distil import Distil
from trainkit.teacher import Frozen, build_task

CPU = Dist(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
# SGD (equivalence on any CPU); rows every 3 steps, a checkpoint at step 4: mid-row. 45 training samples: windows
# of 16, 16 and 13 (an epoch every 3 steps): the last one's samples are uneven on 2 ranks (7 and 6 at b=8).
RUN = [
    "+experiment=digits_distil",
    "debug.limit.train=0.0417",
    "optim=sgd",
    "optim.lr=0.05",
    "sched=constant",
    "model.width=32",
    "data.batch_size=16",
    "trainer.max_steps=6",
    "trainer.log_every=3",
    "trainer.eval_every=6",
    "trainer.test=false",
    "checkpoint.every=4",
    "checkpoint.keep=5",
]
TERMS = ("loss", "loss/ce", "loss/kd")


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    """The 1-process run and its teacher: a cnn trained 2 steps where git cannot be found (no PATH), a chain of 2
    runs whose first one's provenance.json says so."""
    base = tmp_path_factory.mktemp("distil")
    parent = base / "teacher"
    path = os.environ["PATH"]
    os.environ["PATH"] = str(base / "nowhere")
    try:
        run_in_process(parent, "model=cnn", "model.width=8", "trainer.max_steps=2", "trainer.test=false")
    finally:
        os.environ["PATH"] = path
    out = run_in_process(base / "one", *RUN, f"task.teacher.from={parent}")
    return base, parent, out


def test_a_chain_of_2_is_traced_in_provenance_json_and_a_run_without_git_goes_on(one):
    base, parent, _ = one
    first, second = (json.loads((d / "provenance.json").read_text()) for d in (parent, base / "one"))
    assert first["git"] == {"commit": None, "why": "git is not installed"} and first["parents"] == {}
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert second["git"]["commit"] == commit and second["world_size"] == 1 == first["world_size"]
    assert second["versions"]["torch"] == importlib.metadata.version("torch") and "hydra-core" in second["versions"]
    teacher = second["parents"]["task.teacher.from"]
    assert teacher["run_dir"] == str(parent.resolve()) and teacher["provenance"] == first  # nested: the whole chain
    assert isinstance(second["command"], str) and "resumes" not in second  # in process: no Hydra overrides


def _train_rows(run_dir):
    return [r for r in rows(run_dir) if "loss" in r]


def close(a: dict, b: dict) -> bool:
    """Two rows' loss and terms, to rounding: a micro-batch's sums are float32 (the task's loss_sum; the meter adds
    them in float64), rounded at ~1e-7 of the loss's scale; kd, a small difference of larger numbers, moves by more
    than 1e-6 of itself (2e-6 at 2 FSDP ranks x K=2 with an uneven window). A mean of the ranks' own means is
    off by 2e-4 here."""
    return all(a[k] == pytest.approx(b[k], rel=1e-6, abs=1e-6 * a["loss"]) for k in TERMS)


def test_the_terms_are_rows_of_their_own_and_the_teacher_is_summarised_but_kept_nowhere(one):
    base, parent, out = one
    first, last = _train_rows(base / "one")
    for row in (first, last):
        assert set(TERMS) <= set(row) and row["loss"] == pytest.approx(0.5 * row["loss/ce"] + 0.5 * row["loss/kd"])
    teacher = torch.load(parent / "model.pt", weights_only=True)
    summary = json.loads((base / "one" / "summary.json").read_text())
    assert summary["teacher_params"] == sum(
        t.numel() for k, t in teacher.items() if "running" not in k and "num_b" not in k
    )
    assert "teacher: " in out and "frozen" in out
    # No teacher tensor in model.pt or a checkpoint: they hold the student's state alone
    student = weights(base / "one")
    checkpoint = torch.load(base / "one" / "checkpoints" / "step_00000004.pt", weights_only=True)
    assert checkpoint["model"].keys() == student.keys() and all(k.startswith(("1.", "4.", "7.")) for k in student)
    assert (base / "one" / "teacher" / "model.pt").is_file()  # its copy in the run dir, beside, not inside
    assert max_diff(torch.load(base / "one" / "teacher" / "model.pt", weights_only=True), teacher) == 0


@pytest.mark.slow
def test_2_fsdp_ranks_x_k2_log_the_terms_one_process_logs(one, tmp_path):
    base, parent, _ = one
    two = ["parallel=fsdp", "data.batch_size=4", "accumulation.steps=2"]
    run_in_process(tmp_path / "two", *RUN, f"task.teacher.from={parent}", *two, nproc=2)
    for a, b in zip(_train_rows(base / "one"), _train_rows(tmp_path / "two"), strict=True):
        assert a["step"] == b["step"] and close(a, b)
    assert max_diff(weights(base / "one"), weights(tmp_path / "two")) < 1e-6


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_resume_mid_row_logs_the_same_row_without_the_teacher_s_dir(one, tmp_path, nproc):
    """Step 4's checkpoint (rows at 3 and 6) resumed in a copy of the run dir whose teacher's dir is gone: the
    row at step 6 is the uninterrupted run's (1 process: bit for bit; 2 ranks: the loss sums merged)."""
    base, parent, _ = one
    resumed = tmp_path / "resumed"
    shutil.copytree(base / "one", resumed)
    for name in ("model.pt", "model_best.pt", "checkpoints/step_00000006.pt", "checkpoints/best.pt"):
        (resumed / name).unlink()
    gone = parent.with_name("gone")
    parent.rename(gone)  # the teacher's own dir: away while the resume runs
    try:
        two = ["parallel=ddp", "data.batch_size=4", "accumulation.steps=2"] if nproc == 2 else []
        run_in_process(resumed, *RUN, f"task.teacher.from={parent}", *two, nproc=nproc)
    finally:
        gone.rename(parent)
    record = json.loads((resumed / "provenance.json").read_text())
    assert record["resumes"][-1]["step"] == 4 and record["resumes"][-1]["world_size"] == nproc
    assert record["parents"]["task.teacher.from"]["provenance"]["git"]["commit"] is None  # the start's, kept
    a, b = _train_rows(base / "one")[-1], _train_rows(resumed)[-1]
    assert a["step"] == b["step"] == 6
    if nproc == 1:
        assert all(a[k] == b[k] for k in TERMS) and max_diff(weights(base / "one"), weights(resumed)) == 0
    else:
        assert close(a, b)


def test_the_teacher_stays_frozen_and_a_terms_shape_is_checked():
    frozen = Frozen(nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2), nn.Dropout(0.5)), parent=None)  # type: ignore[arg-type]
    assert not frozen.training and not any(m.training for m in frozen.modules())  # as built: the wrapper too
    frozen.train()
    assert not frozen.training and not any(m.training for m in frozen.modules())
    x = torch.randn(4, 3, requires_grad=True)
    assert not frozen(x).requires_grad and not any(p.requires_grad for p in frozen.parameters())
    task = Distil(frozen, temperature=2.0, alpha=0.25)
    out, y = torch.randn(4, 2, requires_grad=True), torch.tensor([0, 1, 1, 0])
    loss, ce, kd = task.loss_sum(out, (y, x))
    assert loss.item() == pytest.approx(0.75 * ce.item() + 0.25 * kd.item()) and loss.requires_grad
    other = Distil(Frozen(nn.Linear(3, 5), parent=None), temperature=2.0)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"task.teacher: its outputs have shape \[4, 5\], the model's \[4, 2\]"):
        other.loss_sum(out, (y, x))
    meter = TrainMeter(CPU, CommStats(), terms=("ce",))  # a declared term the loss_sum does not return
    meter.add_step(torch.tensor(1.0), 4, 4, losses=[task.loss_sum(out, (y, x)).detach()])
    with pytest.raises(ConfigError, match=r"shape \(3,\): its loss_terms \('ce',\) need \(2,\)"):
        meter.row()


@pytest.mark.parametrize(
    ("teacher", "message"),
    [
        ({"from": "???"}, "task.teacher.from is required"),
        ({"from": "/nonexistent", "weights": "last"}, r"task.teacher.from=/nonexistent does not exist"),
        ({"from": "PARENT", "weights": "ema"}, r"has no model_ema.pt \(task.teacher.weights=ema\)"),
        ({"from": "PARENT", "weighs": "last"}, r"task.teacher.weighs: not a key of task.teacher"),
        ({"from": "PARENT/model.pt"}, r"is a weights file: building its model needs a run dir"),
    ],
)
def test_a_bad_teacher_is_one_line(one, teacher, message):
    from omegaconf import OmegaConf

    from trainkit.teacher import build_task

    _, parent, _ = one
    node = {key: str(value).replace("PARENT", str(parent)) for key, value in teacher.items()}
    cfg = OmegaConf.create({"_target_": "trainkit.tasks.distil.Distil", "teacher": node})
    with pytest.raises(ConfigError, match=message):
        build_task(cfg, None, torch.device("cpu"), own=False)


def test_the_kd_term_is_t_squared_times_the_kl_by_hand_and_the_teacher_computes_as_its_module():
    """T=3 on a fixed batch of 3: kd = T^2 x sum over samples of KL(softmax(t / T) || softmax(s / T)), computed by
    hand in float64; ce the plain summed cross-entropy. The teacher's logits are its module's, exactly, under the
    run's precision (no autocast of another dtype, none turned off): fp32 and bf16."""
    module = nn.Linear(4, 3)
    with torch.no_grad():
        module.weight.copy_(torch.tensor([[0.5, -1.0, 0.25, 2.0], [1.5, 0.5, -0.5, 0.0], [-1.0, 1.0, 1.0, -0.5]]))
        module.bias.copy_(torch.tensor([0.1, -0.2, 0.3]))
    x = torch.tensor([[1.0, 0.0, -1.0, 0.5], [0.5, 2.0, 0.0, -1.0], [-1.5, 0.5, 1.0, 1.0]])
    student = torch.tensor([[2.0, -1.0, 0.5], [0.0, 0.3, -0.7], [1.2, 1.1, -2.0]])
    label = torch.tensor([0, 2, 1])
    frozen = Frozen(module, parent=None)  # type: ignore[arg-type]
    ce, kd = Distil(frozen, temperature=3.0, alpha=0.3).loss_sum(student, (label, x))[1:].tolist()

    def log_softmax(row: list[float]) -> list[float]:
        top = max(row)
        total = math.log(sum(math.exp(v - top) for v in row)) + top
        return [v - total for v in row]

    teacher = module(x).double().tolist()
    hand_kd, hand_ce = 0.0, 0.0
    for t_row, s_row, y in zip(teacher, student.double().tolist(), label.tolist(), strict=True):
        log_p, log_q = log_softmax([v / 3 for v in t_row]), log_softmax([v / 3 for v in s_row])
        hand_kd += 9 * sum(math.exp(a) * (a - b) for a, b in zip(log_p, log_q, strict=True))
        hand_ce -= log_softmax(s_row)[y]
    assert kd == pytest.approx(hand_kd, rel=1e-5) and hand_kd > 0.1  # a KL of its own size, not ~0
    assert ce == pytest.approx(hand_ce, rel=1e-6)
    for precision in ("fp32", "bf16"):
        with autocast_for(precision, torch.device("cpu"))():
            got, plain = frozen(x), module(x)
        assert got.dtype == plain.dtype and torch.equal(got, plain), precision


def test_the_train_line_shows_every_loss_term(one, capsys):
    """Every `loss/<term>` of the row (the engine names none), after the loss; a row without terms as before."""
    *_, out = one
    assert re.search(r"step +3/6 \| epoch 0 \| loss \d+\.\d{4} \| loss/ce \d+\.\d{4} \| loss/kd \d+\.\d{4} \| lr ", out)
    row = {"loss": 1.0, "loss/a": 2.0, "loss/b": 3.0, "lr": 0.1, "grad_norm": 0.5, "samples_per_s": 100.0}
    with Progress(True, 6, 0) as console:
        console.train_line(3, 6, 0, row)
        console.train_line(6, 6, 0, {k: v for k, v in row.items() if not k.startswith("loss/")})
    first, second = capsys.readouterr().out.splitlines()
    assert "| loss 1.0000 | loss/a 2.0000 | loss/b 3.0000 | lr 1.00e-01 |" in first
    assert "| loss 1.0000 | lr 1.00e-01 |" in second


@pytest.fixture(scope="module")
def other_teachers(tmp_path_factory):
    """Finished runs' dirs (config and initial weights, no training) of other data: diabetes; digits with 12
    classes."""
    base = tmp_path_factory.mktemp("other_teachers")
    diabetes = make_parent(base / "diabetes", "data=diabetes", "model.width=8")
    twelve = make_parent(base / "twelve", "model=cnn", "model.width=8", "data.num_classes=12")
    return diabetes, twelve


def test_a_teacher_of_other_data_is_refused_before_anything_is_written(other_teachers, tmp_path, capsys):
    diabetes, twelve = other_teachers
    student = compose_cfg("+experiment=digits_distil", f"task.teacher.from={twelve}")
    with pytest.raises(ConfigError, match=r"data.num_classes=12.* data.num_classes=10"):
        build_task(student.task, None, torch.device("cpu"), own=False, data=student.data)
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as exited:
        run_in_process(run_dir, *RUN, f"task.teacher.from={diabetes}")
    err = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and len(err) == 1 and not run_dir.exists()
    said = r"task.teacher.from=\S*diabetes: the teacher ran on data=diabetes .*, this run is on data=digits"
    assert re.search(said, err[0]), err[0]


@pytest.mark.parametrize("change", ["task.alpha=0.9", "task.temperature=2.0", "task.teacher.from=OTHER"])
def test_a_resume_that_changes_the_objective_or_the_teacher_is_refused(one, other_teachers, tmp_path, capsys, change):
    """task.* is what the run optimizes (the loss, its teacher): part of the run's identity, as the model is. A
    resume in the run's own dir (its teacher/ copy there) with another value: one line naming the key, the run dir
    as it was (.hydra/config.yaml keeps the run's values)."""
    base, parent, _ = one
    resumed = tmp_path / "resumed"
    shutil.copytree(base / "one", resumed)
    for name in ("model.pt", "model_best.pt", "checkpoints/step_00000006.pt", "checkpoints/best.pt"):
        (resumed / name).unlink()
    config = (resumed / ".hydra" / "config.yaml").read_text()
    if "OTHER" in change:  # a teacher that fits the run: still another one
        change = change.replace("OTHER", str(make_parent(tmp_path / "other", "model=cnn", "model.width=8")))
    key, value = change.split("=")
    teacher = [f"task.teacher.from={parent}"] * (key != "task.teacher.from")
    overrides = [o for o in RUN if not o.startswith(key)] + teacher
    with pytest.raises(SystemExit) as exited:
        run_in_process(resumed, *overrides, change, "trainer.max_steps=8")
    err = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and len(err) == 1, err
    assert re.search(rf"written with {re.escape(key)}=\S+, this run has {re.escape(change)};", err[0]), err[0]
    assert (resumed / ".hydra" / "config.yaml").read_text() == config


def test_a_checkpoint_written_before_task_joined_the_identity_is_judged_by_its_settings():
    from trainkit.checkpoint import check_compatible, recorded

    old = {"identity": {"seed": 0}, "settings": {"seed": 0, "task.alpha": 0.5, "optim.lr": 0.1}}
    check_compatible(recorded(old), {"seed": 0, "task.alpha": 0.5})
    with pytest.raises(ConfigError, match=r"written with task.alpha=0.5, this run has task.alpha=0.9;"):
        check_compatible(recorded(old), {"seed": 0, "task.alpha": 0.9})
    check_compatible(recorded({"identity": {"seed": 0}}), {"seed": 0, "task.alpha": 0.9})  # none recorded: not judged


def test_2_ddp_ranks_with_uneven_samples_log_the_terms_one_process_logs(one, tmp_path):
    """45 samples: each epoch's last window (13) is 7 and 6 samples on the 2 ranks; the rows' loss, loss/ce and
    loss/kd are means over all ranks' samples (float64 sums), one process's to rounding; SGD."""
    base, parent, _ = one
    run_in_process(tmp_path / "two", *RUN, f"task.teacher.from={parent}", "parallel=ddp", "data.batch_size=8", nproc=2)
    a, b = _train_rows(base / "one"), _train_rows(tmp_path / "two")
    assert [r["step"] for r in a] == [r["step"] for r in b] == [3, 6] and a[-1]["samples"] == b[-1]["samples"] == 90
    for x, y in zip(a, b, strict=True):
        assert close(x, y), (x, y)
    assert max_diff(weights(base / "one"), weights(tmp_path / "two")) < 1e-6
