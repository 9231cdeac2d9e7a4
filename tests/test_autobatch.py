"""data.batch_size=auto: an out-of-memory error on one rank halves the micro-batch on every rank
together, and the run is the one that used the found micro-batch from the start. The out-of-memory
errors are real exceptions from the model (helpers.Faulty "oom"), on one rank only."""

import contextlib
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from helpers import compose_cfg, run_distributed, run_in_process, weights
from helpers import rows as metrics_rows
from trainkit import config
from trainkit.autobatch import AutoBatch
from trainkit.config import ConfigError
from trainkit.dist import Dist
from trainkit.evaluate import evaluate
from trainkit.halving import EvalBatches
from trainkit.syncbn import SyncBatchNorm
from trainkit.tasks.classification import Classification

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


def oom(above: int, rank: int = 1, fault: str = "oom", name: str = "cnn") -> list[str]:
    """Every training forward (oom_backward: backward) of more than `above` samples on `rank` raises
    torch.OutOfMemoryError."""
    return [
        "model._target_=helpers.faulty_model",
        f"+model.name={name}",
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
    # The line's K is the K used: 2 ranks x micro-batch 8 x K 2, the global batch of 32 a step.
    assert [(r["micro_batch"], r["samples"]) for r in rows(auto) if "loss" in r] == [
        (8, 2 * 32),
        (8, 4 * 32),
        (8, 6 * 32),
    ]
    assert_same_weights(auto, fixed)
    assert rows(auto) == rows(fixed)


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


# Evaluation and predict.py under data.batch_size=auto: an out-of-memory error halves their batch too.
EVAL_OOM = [*RUN, *SHORT, "trainer.eval_every=3", "parallel.timeout_s=20"]  # a rank left in a collective: 20 s


def eval_oom(above: int, rank: int = 1) -> list[str]:
    """Every evaluation forward of more than `above` samples on `rank` raises torch.OutOfMemoryError."""
    return oom(above, rank, fault="oom_eval")


def assert_same_rows(a: list[dict], b: list[dict]) -> None:
    """Equal rows; the evaluation loss to float32 (per-sample losses of other batch sizes), accuracy exactly."""
    assert len(a) == len(b)
    for ra, rb in zip(a, b, strict=True):
        assert ra.keys() == rb.keys()
        for key in ra:
            assert ra[key] == (pytest.approx(rb[key], rel=1e-6) if key == "val/loss" else rb[key]), key


@pytest.fixture(scope="module")
def eval_runs(tmp_path_factory):
    """eval_runs(parallel): 2 ranks at micro-batch 16 whose rank 1 runs out of memory in evaluation
    above 4 (FSDP: between the all-gathers of its units), and a reference run without it; once each."""
    runs: dict[str, tuple[Path, Path, str]] = {}

    def run(parallel: str) -> tuple[Path, Path, str]:
        if parallel not in runs:
            auto, fixed = tmp_path_factory.mktemp(f"eval_{parallel}"), tmp_path_factory.mktemp(f"fixed_{parallel}")
            mode = f"parallel={parallel}"
            out = run_in_process(auto, *EVAL_OOM, *eval_oom(4), "data.batch_size=auto", mode, nproc=2)
            run_in_process(fixed, *EVAL_OOM, *eval_oom(1000), "data.batch_size=16", mode, nproc=2)
            runs[parallel] = auto, fixed, out
        return runs[parallel]

    return run


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_an_oom_in_evaluation_halves_its_batch_on_all_ranks_and_keeps_the_checkpoint_and_metrics(eval_runs, parallel):
    auto, fixed, out = eval_runs(parallel)
    assert out.count("evaluation batch 16 -> 8 -> 4 (out of memory)") == 1, out
    assert "micro-batch 16 ->" not in out  # training kept its micro-batch
    assert (auto / "model.pt").is_file()
    assert sorted(p.name.removesuffix(".pt") for p in (auto / "checkpoints").iterdir()) == ["best", "step_00000003"]
    if parallel == "ddp":  # the found evaluation batch is checkpointed too: a resume starts at it
        state = torch.load(auto / "checkpoints" / "step_00000003.pt", weights_only=True)
        assert state["autobatch"] == {"micro_batch": 16, "eval_batch": 4}
    assert_same_weights(auto, fixed)
    assert_same_rows(rows(auto), rows(fixed))  # the same val/loss and val/acc: every sample once


def test_a_resume_evaluates_at_the_evaluation_batch_found_before(eval_runs, tmp_path):
    # The final checkpoint: nothing left to train, the evaluation runs again, at 4 from the start.
    auto, _, _ = eval_runs("ddp")
    checkpoint = auto / "checkpoints" / "step_00000003.pt"
    overrides = [*EVAL_OOM, *eval_oom(4), "data.batch_size=auto", f"checkpoint.resume={checkpoint}"]
    out = run_in_process(tmp_path, *overrides, "parallel=ddp", nproc=2)
    assert "out of memory" not in out, out
    final = rows(auto)[-1]
    assert f"val acc {final['val/acc']:.4f}" in out  # the same batches: the same numbers
    assert_same_weights(auto, tmp_path)


def test_predict_of_an_auto_run_halves_its_batch_on_an_oom_and_predicts_every_sample_once(eval_runs, tmp_path):
    # The run's own model (it runs out of memory above 4 on rank 1) at the run's micro-batch 16, against
    # batch 4 given explicitly (which does not halve).
    auto, _, _ = eval_runs("ddp")
    out = run_in_process(tmp_path / "auto", f"run_dir={auto}", script="predict", nproc=2)
    run_in_process(tmp_path / "fixed", f"run_dir={auto}", "batch_size=4", script="predict", nproc=2)
    assert out.count("prediction batch 16 -> 8 -> 4 (out of memory)") == 1, out
    predicted = (tmp_path / "auto" / "predictions.csv").read_text()
    assert predicted == (tmp_path / "fixed" / "predictions.csv").read_text()
    assert len(predicted.splitlines()) == 1 + 359  # a header and every validation sample once


def test_an_evaluation_that_does_not_fit_at_batch_1_ends_the_run_with_its_step_saved(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        run_in_process(tmp_path, *EVAL_OOM, *eval_oom(0, rank=0), "data.batch_size=auto")
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert exit_.value.code == 3
    assert errors == [
        "error: out of memory in evaluation at a batch of 1 (data.batch_size=auto): one sample does not fit; "
        "try a smaller model or trainer.precision=bf16"
    ]
    assert (tmp_path / "checkpoints" / "step_00000003.pt").is_file()  # the step's checkpoint, its row
    assert [r["step"] for r in rows(tmp_path)] == [2, 3] and "val/loss" not in rows(tmp_path)[-1]
    assert not (tmp_path / "model.pt").exists()


def test_an_oom_with_a_fixed_batch_size_is_one_line_exit_3(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        run_in_process(tmp_path, *RUN, *oom(8, rank=0), "data.batch_size=16")
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert exit_.value.code == 3
    assert errors == [
        "error: out of memory: helpers.Faulty: out of memory at a micro-batch of 16 (a smaller data.batch_size, "
        "data.batch_size=auto with accumulation.global_batch_size, or trainer.precision=bf16)"
    ]


# Without BatchNorm a micro-batch changes only the reduction order: windows that ran at 16 before an
# out of memory equal the run at 8 throughout.
MLP_RUN = [o for o in RUN if not o.startswith("model")] + ["model=mlp", "model.width=16"]


def test_an_oom_in_a_later_window_retries_that_window_not_the_epochs_first(tmp_path):
    # Rank 1's 3rd forward runs out of memory once: windows 0 and 1 ran at 16, window 2 (the 3rd step) again at 8.
    auto, fixed = tmp_path / "auto", tmp_path / "fixed"
    faulty = oom(1000, name="mlp")
    out = run_in_process(auto, *MLP_RUN, *SHORT, *faulty, "+model.at_forward=3", "data.batch_size=auto", nproc=2)
    run_in_process(fixed, *MLP_RUN, *SHORT, *faulty, "data.batch_size=8", nproc=2)
    assert out.count(LINE) == 1, out
    assert [r["micro_batch"] for r in rows(auto) if "loss" in r] == [16, 8]
    assert_same_weights(auto, fixed)  # the retried window read its own samples


@pytest.mark.parametrize(
    "run,name,parallel",
    [(MLP_RUN, "mlp", ["parallel=fsdp"]), (RUN, "cnn", ["parallel=ddp", "parallel.sync_bn=true"])],
    ids=["fsdp", "syncbn"],
)
def test_with_layer_collectives_an_oom_in_the_second_window_is_still_searched(run, name, parallel, tmp_path):
    # The per-layer points stay until two windows fit: rank 1's 2nd forward (window 1, after window 0
    # fitted at 16) runs out of memory and is retried at 8. (A search that ended after the first window
    # would make it the one error of an out of memory after the search.)
    overrides = [*run, *SHORT, *oom(1000, name=name), "+model.at_forward=2", "data.batch_size=auto", *parallel]
    try:
        out = run_in_process(tmp_path, *overrides, "parallel.timeout_s=10", nproc=2)
    except Exception as error:
        pytest.fail(f"the out of memory in window 1 was not retried: {str(error)[-400:]}")
    assert out.count(LINE) == 1, out
    assert [r["micro_batch"] for r in rows(tmp_path) if "loss" in r] == [8, 8]


class _OutOfMemoryOn(nn.Module):
    """Identity, except on `rank`: torch.OutOfMemoryError, as a device too small for the batch."""

    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def forward(self, x):
        if dist.get_rank() == self.rank:
            raise torch.OutOfMemoryError("test: out of memory")
        return x


def _one_rank_runs_out_of_memory(rank: int, world_size: int, where: str):
    # A short collective timeout: a rank left alone in a collective fails in seconds, not at a test timeout.
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=5))
    d = Dist(rank, rank, world_size, torch.device("cpu"))
    cfg = OmegaConf.create(
        {"data": {"batch_size": "auto"}, "accumulation": {"global_batch_size": 32, "strategy": "no_sync"}}
    )
    auto = AutoBatch(cfg, d)
    if where == "ddp":  # the point at the end of the forward before DDP's gradient sync
        model: nn.Module = DDP(nn.Sequential(_OutOfMemoryOn(rank=1), nn.Linear(3, 2)))
    else:  # a SyncBN layer's point, before its forward's all-gather of statistics
        model = nn.Sequential(_OutOfMemoryOn(rank=1), SyncBatchNorm(3), nn.Flatten(), nn.Linear(3 * 4, 2))
    auto.attach(model)
    try:
        for _, batch in auto.micro_steps([torch.ones(16, 3, 2, 2) if where == "syncbn" else torch.ones(16, 3)]):
            with auto.catching():
                model(batch)
        return auto.retry(), auto.batch_size, auto.K
    except Exception as error:  # e.g. rank 0 alone in SyncBN's all-gather: the timeout
        return repr(error)[:300]


def _imported_before_ddp(rank: int, world_size: int) -> bool:
    return "torch._dynamo" in sys.modules


def test_forked_ranks_start_with_the_import_ddp_s_constructor_would_make_between_its_collectives():
    # Issue 45: the test below failed once under load: each forked rank imported torch._dynamo inside DDP's
    # constructor (3-5 s there), and one waited for the other past its 5 s group timeout (tests/helpers.py).
    assert run_distributed(_imported_before_ddp, 2, group=False) == [True, True]


@pytest.mark.parametrize("where", ["ddp", "syncbn"])
def test_an_oom_on_one_rank_makes_every_rank_retry_at_half_the_micro_batch_and_twice_k(where):
    # Rule 17: through the all-reduced flag at the agreement point, rank 0 (which fitted) retries too.
    results = run_distributed(_one_rank_runs_out_of_memory, 2, where, group=False, timeout=60)
    assert results == [(True, 8, 2), (True, 8, 2)]  # (retry, micro-batch, K) of ranks 0 and 1


class _EvalOutOfMemory(nn.Module):
    """A linear layer whose evaluation forwards of more than `above` samples run out of memory on
    rank 1; it counts its forwards."""

    def __init__(self, above: int):
        super().__init__()
        self.linear, self.above, self.forwards = nn.Linear(6, 3), above, 0

    def forward(self, x):
        self.forwards += 1
        if dist.is_initialized() and dist.get_rank() == 1 and len(x) > self.above:
            raise torch.OutOfMemoryError("test: out of memory")
        return self.linear(x)


def _evaluate_in_halving_batches(rank: int, world_size: int, equal_forwards: bool):
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(17, 6), torch.randint(0, 3, (17,)))  # shards of 9 and 8
    model = _EvalOutOfMemory(above=2)
    d = Dist(rank, rank, world_size, torch.device("cpu"))
    batches = EvalBatches(data, d, 4, 0, halve=True, equal_forwards=equal_forwards)
    metrics = evaluate(model, batches, d, contextlib.nullcontext, Classification())
    return metrics, model.forwards, batches.batch_size


@pytest.mark.parametrize("equal_forwards", [False, True], ids=["plain", "fsdp-like"])
def test_evaluation_batches_halve_together_and_count_every_sample_once(equal_forwards):
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(17, 6), torch.randint(0, 3, (17,)))
    model = _EvalOutOfMemory(above=1000)
    single = Dist(0, 0, 1, torch.device("cpu"))
    expected = evaluate(model, [data[:]], single, contextlib.nullcontext, Classification())
    (m0, forwards0, b0), (m1, forwards1, b1) = run_distributed(_evaluate_in_halving_batches, 2, equal_forwards)
    assert m0 == m1 and m0 == pytest.approx(expected, rel=1e-6)
    assert b0 == b1 == 2  # both ranks keep the batch found for the next evaluation
    # Rank 1 (8 samples): its first batch of 4 fails, then 4 batches of 2; rank 0 (9 samples): 1 of 4
    # whose result it drops, then 5 of 2. With equal forwards rank 1 runs an empty 5th one.
    assert (forwards0, forwards1) == (6, 6 if equal_forwards else 5)
