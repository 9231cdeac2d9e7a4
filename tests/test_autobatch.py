"""data.batch_size=auto: an out-of-memory error on one rank halves the micro-batch on every rank
together, and the run is the one that used the found micro-batch from the start. The out-of-memory
errors are real exceptions from the model (helpers.Faulty "oom"), on one rank only."""

from pathlib import Path

import pytest
import torch

from helpers import compose_cfg, run_in_process, weights
from helpers import rows as metrics_rows
from trainkit import config
from trainkit.config import ConfigError

# cnn: BatchNorm, whose running statistics the dropped attempt must not keep.
RUN = [
    "model=cnn",
    "model.width=8",
    "accumulation.global_batch_size=32",
    "trainer.max_steps=6",
    "trainer.log_every=2",
    "trainer.eval_every=100",
    "checkpoint.every=3",
    "parallel.timeout_s=60",
]


def oom(above: int, rank: int = 1, fault: str = "oom") -> list[str]:
    """Every training forward (oom_backward: backward) of more than `above` samples on `rank` raises
    torch.OutOfMemoryError."""
    return [
        "model._target_=helpers.faulty_model",
        "+model.name=cnn",
        f"+model.fault={fault}",
        f"+model.rank={rank}",
        f"+model.oom_above={above}",
    ]


def rows(run_dir: Path) -> list[dict]:
    return metrics_rows(run_dir, timings=False)


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for key in wa:
        assert torch.allclose(wa[key].double(), wb[key].double(), rtol=0, atol=1e-6), key


LINE = "micro-batch 16 -> 8 (out of memory), K 1 -> 2"


@pytest.fixture(scope="module")
def searched(tmp_path_factory) -> tuple[Path, str]:
    """2 ranks, global batch 32: auto starts at 16, rank 1 runs out of memory above 8."""
    run_dir = tmp_path_factory.mktemp("auto")
    return run_dir, run_in_process(run_dir, *RUN, *oom(8), "data.batch_size=auto", nproc=2)


@pytest.fixture(scope="module")
def fixed(tmp_path_factory) -> Path:
    """The same run at a micro-batch of 8 from the start."""
    run_dir = tmp_path_factory.mktemp("fixed")
    run_in_process(run_dir, *RUN, *oom(1000), "data.batch_size=8", nproc=2)
    return run_dir


def test_an_oom_on_one_rank_halves_the_micro_batch_on_all_and_equals_the_fixed_run(searched, fixed):
    auto, out = searched
    assert out.count(LINE) == 1 and out.count("out of memory") == 1, out
    assert_same_weights(auto, fixed)
    assert rows(auto) == rows(fixed)
    assert [r["micro_batch"] for r in rows(auto) if "loss" in r] == [8, 8, 8]


def test_a_real_allocation_failure_on_one_rank_is_found_too(fixed, tmp_path):
    # Rank 1's forward allocates 64 MiB a sample under an address-space limit (setrlimit) that leaves
    # room for 8: the CPU allocator's own "can't allocate memory" at 16.
    out = run_in_process(tmp_path, *RUN, *oom(8, fault="rlimit"), "data.batch_size=auto", nproc=2)
    assert out.count(LINE) == 1, out
    assert_same_weights(tmp_path, fixed)
    assert rows(tmp_path) == rows(fixed)


def test_two_halvings_the_second_in_a_non_syncing_micro_step_equal_the_fixed_run(tmp_path):
    # 16 (K=1) runs out of memory on rank 1, then 8 (K=2) in its first micro-step, before the syncing
    # forward in which DDP broadcasts the BatchNorm buffers: rank 0 must not start that forward alone.
    auto, fixed = tmp_path / "auto", tmp_path / "fixed"
    out = run_in_process(auto, *RUN, *oom(4), "data.batch_size=auto", "parallel.timeout_s=20", nproc=2)
    run_in_process(fixed, *RUN, *oom(1000), "data.batch_size=4", nproc=2)
    assert out.count("micro-batch 16 -> 8 -> 4 (out of memory), K 1 -> 2 -> 4") == 1, out
    assert_same_weights(auto, fixed)
    assert rows(auto) == rows(fixed)


def test_a_checkpoint_after_the_search_resumes_at_the_found_micro_batch(searched, tmp_path):
    auto, _ = searched
    checkpoint = auto / "checkpoints" / "step_00000003.pt"
    assert torch.load(checkpoint, weights_only=True)["autobatch"] == {"micro_batch": 8}
    resumed = tmp_path / "resumed"
    out = run_in_process(resumed, *RUN, *oom(8), "data.batch_size=auto", f"checkpoint.resume={checkpoint}", nproc=2)
    assert "out of memory" not in out, out  # no new search: the first window already ran at 8
    assert "2 ranks x 8 micro-batch x 2 accumulation" in out
    assert_same_weights(auto, resumed)


def test_a_micro_batch_of_1_that_does_not_fit_is_one_clear_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        run_in_process(tmp_path, *RUN, *oom(0, rank=0), "data.batch_size=auto", "accumulation.global_batch_size=4")
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert exit_.value.code == 3
    assert errors == [
        "error: out of memory at micro-batch 1 (data.batch_size=auto): one sample does not fit; try a smaller "
        "model, trainer.precision=bf16 or activation checkpointing"
    ]


@pytest.mark.parametrize(
    "overrides,message",
    [
        ([], "data.batch_size=auto needs accumulation.global_batch_size"),
        (["accumulation.global_batch_size=32", "accumulation.steps=2"], "accumulation.steps=2 must be null"),
        (["accumulation.global_batch_size=33"], "accumulation.global_batch_size=33 is not a multiple of the world"),
    ],
)
def test_auto_needs_a_global_batch_that_the_world_size_divides_and_no_k(monkeypatch, overrides, message):
    monkeypatch.setenv("WORLD_SIZE", "2")  # config.check reads the world size from the launcher's environment
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        config.check(compose_cfg("data.batch_size=auto", *overrides))


SHORT = ["trainer.max_steps=3"]


@pytest.mark.parametrize(
    "parallel", [["parallel=fsdp"], ["parallel=ddp", "parallel.sync_bn=true"]], ids=["fsdp", "syncbn"]
)
def test_an_oom_inside_layers_with_collectives_after_a_no_sync_micro_step_equals_the_fixed_run(parallel, tmp_path):
    # FSDP all-gathers in every unit's forward, SyncBN all-reduces in every layer's: each waits for the
    # ranks' agreement while searching. 16 runs out of memory on rank 1, then 8 (K=2) in the window's
    # syncing micro-step (rank 1's 3rd forward), after a no_sync one accumulated gradients (FSDP: in its
    # unsharded parameters, which the retry must drop): 4.
    auto, fixed = tmp_path / "auto", tmp_path / "fixed"
    out = run_in_process(auto, *RUN, *SHORT, *oom(8), "+model.at_forward=3", "data.batch_size=auto", *parallel, nproc=2)
    run_in_process(fixed, *RUN, *SHORT, *oom(1000), "data.batch_size=4", *parallel, nproc=2)
    assert out.count("micro-batch 16 -> 8 -> 4 (out of memory), K 1 -> 2 -> 4") == 1, out
    assert_same_weights(auto, fixed)
    assert rows(auto) == rows(fixed)


def test_with_sync_each_batch_an_oom_in_the_forward_after_a_synced_micro_step_is_retried(tmp_path):
    # Every micro-step syncs: rank 1's 3rd forward (the second micro-step at 8) comes after a finished
    # gradient sync, not inside one. The attempt's syncs stay counted in the rows (they happened).
    sync_each = [*SHORT, "accumulation.strategy=sync_each_batch", "parallel=ddp"]
    auto, fixed = tmp_path / "auto", tmp_path / "fixed"
    out = run_in_process(auto, *RUN, *sync_each, *oom(8), "+model.at_forward=3", "data.batch_size=auto", nproc=2)
    run_in_process(fixed, *RUN, *sync_each, *oom(1000), "data.batch_size=4", nproc=2)
    assert out.count("micro-batch 16 -> 8 -> 4 (out of memory), K 1 -> 2 -> 4") == 1, out
    assert_same_weights(auto, fixed)


def test_fsdp_retries_an_oom_in_the_syncing_backward(tmp_path):
    # In the first layer's backward: the last of a backward, after every unit's points; next would come
    # FSDP's end-of-backward reduce-scatter of that unit's gradients (its inputs need none).
    auto, fixed = tmp_path / "auto", tmp_path / "fixed"
    fsdp = ["parallel=fsdp", "parallel.timeout_s=20"]
    out = run_in_process(auto, *RUN, *SHORT, *oom(8, fault="oom_backward"), "data.batch_size=auto", *fsdp, nproc=2)
    run_in_process(fixed, *RUN, *SHORT, *oom(1000, fault="oom_backward"), "data.batch_size=8", *fsdp, nproc=2)
    assert out.count(LINE) == 1, out
    assert_same_weights(auto, fixed)
    assert rows(auto) == rows(fixed)


def test_with_layer_collectives_an_oom_after_the_search_is_one_error_not_a_hang(tmp_path, capfd):
    # The per-layer points end once two windows fitted (they cost a host sync per layer); rank 1's 5th
    # forward then runs out of memory while rank 0 is inside an all-gather.
    overrides = [
        *RUN,
        *oom(1000),
        "+model.at_forward=5",
        "data.batch_size=auto",
        "parallel=fsdp",
        "parallel.timeout_s=20",
    ]
    with pytest.raises(Exception, match="exit code"):
        run_in_process(tmp_path, *overrides, nproc=2)
    errors = [line for line in capfd.readouterr().err.splitlines() if line.startswith("error:")]
    assert errors[0].startswith("error: rank 1: out of memory at micro-batch 16 after the search"), errors


def test_a_batch_size_is_a_positive_integer_or_auto():
    with pytest.raises(ConfigError, match="data.batch_size=big must be a positive integer or auto"):
        config.check(compose_cfg("data.batch_size=big"))


def test_an_oom_in_the_syncing_backward_ends_the_run_with_one_error_not_a_hang(tmp_path, capfd):
    # Rank 1 runs out of memory in the window's last backward, after the ranks agreed and while rank 0
    # is already inside DDP's gradient all-reduce: no retry is possible, and nobody may wait forever.
    overrides = [*RUN, *oom(8, fault="oom_backward"), "data.batch_size=auto", "parallel.timeout_s=20"]
    with pytest.raises(Exception, match="exit code"):
        run_in_process(tmp_path, *overrides, nproc=2)
    # Rank 1 alone knows why and says so; rank 0 may still report its failed collective, unless the
    # launcher (here as torchrun's: the first rank to fail ends the others) stops it first.
    errors = [line for line in capfd.readouterr().err.splitlines() if line.startswith("error:")]
    assert [e for e in errors if e.startswith("error: rank 1: out of memory in the gradient-syncing backward")], errors
    assert all(
        e.startswith(("error: rank 1: out of memory", "error: a collective failed, a peer rank died or hangs"))
        for e in errors
    ), errors
    assert len(errors) <= 2
