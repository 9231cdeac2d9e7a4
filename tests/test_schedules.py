import itertools
import math

import pytest
import torch

from trainkit.config import ConfigError
from trainkit.schedules import constant, one_cycle, warmup_cosine


def test_constant_with_and_without_warmup():
    assert [constant(s, total_steps=10) for s in range(3)] == [1.0, 1.0, 1.0]
    assert [constant(s, total_steps=10, warmup_steps=3) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]


def test_warmup_cosine_shape():
    f = lambda s: warmup_cosine(s, total_steps=110, warmup_steps=10, min_ratio=0.1)  # noqa: E731
    assert f(0) == pytest.approx(1 / 11)
    assert f(9) == pytest.approx(10 / 11)
    assert f(10) == pytest.approx(1.0)  # peak right after warmup
    assert f(60) == pytest.approx(0.55)  # half way: (1 + 0.1) / 2
    assert f(110) == pytest.approx(0.1)  # the end: min_ratio
    assert f(500) == pytest.approx(0.1)  # past the end it stays there
    values = [f(s) for s in range(10, 111)]
    assert all(a >= b for a, b in itertools.pairwise(values))  # monotone decay


def test_warmup_cosine_without_warmup_matches_closed_form():
    for s in range(0, 51, 5):
        expected = 0.5 * (1 + math.cos(math.pi * s / 50))
        assert warmup_cosine(s, total_steps=50) == pytest.approx(expected)


@pytest.mark.parametrize("total, pct", [(100, 0.3), (7, 0.25), (10, 0.15), (2, 0.3), (1, 0.3)])
def test_one_cycle_matches_torchs_one_cycle_lr(total, pct):
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=0.1)
    torchs = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=0.1, total_steps=total, pct_start=pct, div_factor=10.0, cycle_momentum=False
    )
    for step in range(total):
        expected = torchs.get_last_lr()[0]
        assert 0.1 * one_cycle(step, total_steps=total, pct_start=pct, div_factor=10.0) == pytest.approx(expected)
        optimizer.step()
        if step < total - 1:  # torch's raises past its last step
            torchs.step()
    assert one_cycle(total + 5, total_steps=total) == pytest.approx(1 / 25e4)  # past the end it stays there


def test_one_cycle_rejects_a_bad_setting_naming_it():
    with pytest.raises(ConfigError, match="pct_start=1.5"):
        one_cycle(0, total_steps=10, pct_start=1.5)
    assert one_cycle(0, total_steps=10, pct_start=0.1) == 1.0  # the peak at step 0 (torch's divides by zero)


@pytest.mark.parametrize("decay_all", [True, False])
def test_decay_norms_and_biases_false_exempts_the_vectors_from_weight_decay(decay_all):
    from helpers import compose_cfg
    from trainkit import optim

    cfg = compose_cfg("optim=adamw", "optim.weight_decay=0.5", f"optim.decay_norms_and_biases={decay_all}")
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.LayerNorm(3))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(1.0)  # nonzero (a LayerNorm's bias starts at 0): the decay shows
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = optim.build(cfg.optim, model)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # AdamW's step is then the decay alone
    optimizer.step()
    for name, p in model.named_parameters():
        decayed = not torch.equal(p, before[name])
        assert decayed == (decay_all or p.dim() >= 2), name  # biases and the LayerNorm's gain: only when all decay


def halving(step: int, *, total_steps: int, every: int = 10) -> float:
    """A fork's schedule (conf/sched/halving.yaml's _target_): the lr halves every `every` optimizer steps."""
    return 0.5 ** (step // every)


def test_a_forks_schedule_is_a_yaml_and_a_function_its_keys_typed_by_the_signature(tmp_path):
    """sched= is a room like model=, data=, task=: a fork adds conf/sched/<name>.yaml naming its own function, no
    engine edit; its keys are its keyword arguments after total_steps (typed, a wrong one refused in one line)."""
    import shutil

    from hydra import compose, initialize_config_dir

    from helpers import ROOT
    from trainkit import config, optim

    conf = shutil.copytree(ROOT / "conf", tmp_path / "conf")
    (conf / "sched" / "halving.yaml").write_text("_target_: test_schedules.halving\n_partial_: true\nevery: 3\n")
    with initialize_config_dir(str(conf), version_base="1.3"):
        cfg = compose("train", ["sched=halving"])
        bad = compose("train", ["sched=halving", "sched.every=often"])
    config.check(cfg)
    assert [optim.multiplier(cfg.sched, 10)(s) for s in (0, 2, 3, 7)] == [1.0, 1.0, 0.5, 0.25]
    with pytest.raises(ConfigError, match="sched.every"):
        config.check(bad)


def scaled(step: int, *, total_steps: int, factor: float) -> float:
    """A fork's schedule with a setting that has no default: its yaml (or the command line) must set it."""
    return factor


def mlp_of_width(in_shape: list[int], num_classes: int, width: int, depth: int = 2) -> torch.nn.Module:
    """A fork's model whose width has no default."""
    from trainkit.models.mlp import mlp

    return mlp(in_shape, num_classes, width, depth)


# sched=constant's own key removed: the fork's schedule has none of its keys (~: Hydra's delete)
SCALED = ["sched=constant", "~sched.warmup_steps", "sched._target_=test_schedules.scaled"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (SCALED, "sched.factor is not set: sched._target_=test_schedules.scaled takes it without a default"),
        (
            ["model._target_=test_schedules.mlp_of_width", "~model.width", "~model.dropout"],
            "model.width is not set: model._target_=test_schedules.mlp_of_width takes it without a default",
        ),
    ],
    ids=["sched", "model"],
)
def test_a_rooms_setting_without_a_default_left_unset_is_one_line_exit_2(
    tmp_path, capsys, monkeypatch, overrides, message
):
    """Before: a TypeError at the first step (sched), MissingMandatoryValue as the model is built (model), exit 1."""
    from test_config_errors import cli_in_process

    assert cli_in_process(overrides, tmp_path / "run", monkeypatch) == 2
    out, err = capsys.readouterr()
    assert err.strip().splitlines() == [f"error: {message}; set it in its yaml or on the command line"], out + err
    assert not (tmp_path / "run").exists()


def falling(step: int, *, total_steps: int, at: int = 3, value: float = -0.5) -> float:
    """A fork's schedule gone wrong: 1 until step `at`, then `value` (below 0, NaN, inf)."""
    return 1.0 if step < at else value


@pytest.mark.parametrize("value", [-0.5, math.nan, math.inf])
def test_a_schedule_value_below_0_or_not_finite_is_refused_naming_sched_and_the_step(value):
    """Before: lr < 0 trained uphill and exited 0; NaN stopped as "non-finite loss or gradient" (the data blamed)."""
    from helpers import compose_cfg
    from trainkit import optim

    cfg = compose_cfg(
        "sched=constant", "~sched.warmup_steps", "sched._target_=test_schedules.falling", f"+sched.value={value}"
    )
    lr_at = optim.multiplier(cfg.sched, 10)
    with pytest.raises(ConfigError) as refused:
        optim.survey(cfg.sched, lr_at, 10)
    assert str(refused.value) == (
        f"sched: test_schedules.falling returns {value} at step=3 (optimizer step 4's lr, as the rows count); "
        "a schedule's value, the multiplier of optim.lr, must be a finite number >= 0"
    )
    assert optim.survey(cfg.sched, optim.multiplier(cfg.sched, 3), 3) is None  # a run of steps 0..2 trains fine


def test_a_negative_schedule_stops_the_run_before_it_starts_one_line_exit_2(tmp_path, capsys, monkeypatch):
    from test_config_errors import cli_in_process

    overrides = [
        "sched=constant",
        "~sched.warmup_steps",
        "sched._target_=test_schedules.falling",
        "trainer.max_steps=5",
    ]
    assert cli_in_process(overrides, tmp_path / "run", monkeypatch) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        "error: sched: test_schedules.falling returns -0.5 at step=3 (optimizer step 4's lr, as the rows count); "
        "a schedule's value, the multiplier of optim.lr, must be a finite number >= 0"
    ]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "overrides, total, rises",
    [
        (["sched=cosine", "sched.warmup_steps=20"], 5, True),  # the default warmup: peaks at 5/21 of optim.lr
        (["sched=cosine", "sched.warmup_steps=20"], 21, True),  # the peak at the last step: no decay
        (["sched=cosine", "sched.warmup_steps=20"], 22, False),
        (["sched=constant", "sched.warmup_steps=3"], 3, True),
        (["sched=constant", "sched.warmup_steps=3"], 4, True),  # the last step's rise: 3 of 4 steps warm up
        (["sched=constant", "sched.warmup_steps=3"], 5, False),  # flat at the end: its peak
        (["sched=onecycle"], 3, False),
        (["sched=constant"], 1, False),
    ],
)
def test_a_run_that_ends_while_its_schedule_still_rises_is_said(overrides, total, rises):
    """Before: trainer.max_steps=5 with the default warmup of 20 trained at most 5/21 of optim.lr, silently."""
    from helpers import compose_cfg
    from trainkit import optim

    sched = compose_cfg(*overrides).sched
    line = optim.survey(sched, optim.multiplier(sched, total), total)
    assert (line is not None) == rises, line
    if rises and total == 5:  # the default warmup in a 5-step run
        assert line == (
            "sched: the multiplier rises until the run's last step (step 5: 0.19 -> 0.238 x optim.lr): the run ends "
            "at or before trainkit.schedules.warmup.warmup_cosine's peak, with no decay after it (a warmup as long as "
            "the run or longer?)"
        )


def test_the_run_says_it_once(tmp_path):
    from helpers import run_in_process

    out = run_in_process(
        tmp_path, "model.width=8", "trainer.max_steps=2", "trainer.eval_every=100", "trainer.test=false"
    )
    assert (
        out.count("sched: the multiplier rises until the run's last step (step 2: 0.0476 -> 0.0952 x optim.lr)") == 1
    ), out
