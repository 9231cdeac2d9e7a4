"""trainer.compile=true: torch.compile on the model (each FSDP unit under FSDP), the same training
as eager within float rounding, with no_sync accumulation under DDP and under FSDP2."""

import json
from pathlib import Path

import pytest
import torch

from helpers import _torchrun_worker, max_diff, run_distributed, run_in_process, weights

# SGD: docs/testing.md. No test pass, and 16 val images (8 a rank: one batch of the micro-batch's size): each
# shape evaluated (a split's last partial batch) is one more graph to compile, seconds each on a cold cache.
STEPS = [
    "trainer.max_steps=6",
    "trainer.log_every=1",
    "trainer.eval_every=6",
    "trainer.test=false",
    "optim=sgd",
    "data.splits.val_fraction=0.009",
]
# The global batch 32 of the eager run (one process at b=32), in micro-batches of 8 on 2 ranks x K=2.
TWO_RANKS_K2 = ["data.batch_size=8", "accumulation.steps=2"]
# inductor fuses elementwise ops and reorders reductions: the same maths, other float roundings.
# Measured after 6 SGD steps: 7.5e-9 in one process, under DDP and under FSDP; 1e-5 is 1000x that.
TOLERANCE = dict(rtol=1e-5, atol=1e-5)


def syncs(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r["comm/grad_syncs"] for r in map(json.loads, lines) if "loss" in r]


def compiled_rank(rank: int, world_size: int, run_dir: str, overrides: tuple[str, ...]) -> int:
    """A rank of train.py's run in torchrun's environment (forked: the compiler's state stays out of the test
    process, which later tests fork); returns how many graphs dynamo compiled in it."""
    from torch._dynamo.utils import counters

    counters.clear()
    _torchrun_worker(rank, world_size, "train", run_dir, overrides)
    return counters["stats"]["unique_graphs"]


def compiler_loaded() -> None:
    """What a process pays before its first graph, paid here once before the ranks fork instead of in each: inductor's
    modules and its cache's keys (hashes of torch's and triton's sources), 3-5 s a rank on a loaded machine (the two
    ranks of a mode 18-22 s, 7.5-8.5 s after this). Nothing is compiled in this process."""
    import torch._inductor.compile_fx  # noqa: F401  (torch.compile's backend, imported at a first compile)
    from torch._inductor.codecache import CacheBase, torch_key

    torch_key()
    CacheBase.get_system()


@pytest.fixture(scope="module")
def eager(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("eager")
    run_in_process(run_dir, *STEPS)
    return run_dir


@pytest.mark.slow
# parallel=single compiles as ddp does (model.compile in place, then DDP wraps it: parallel.wrap), so ddp's
# run covers single's path; fsdp compiles each unit's forward.
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_compiled_training_equals_eager_within_rounding(eager, tmp_path, mode):
    overrides = (*STEPS, "trainer.compile=true", f"parallel={mode}", *TWO_RANKS_K2)
    compiler_loaded()
    graphs = run_distributed(compiled_rank, 2, str(tmp_path), overrides, group=False)
    assert min(graphs) > 0, graphs  # compiled, not silently eager
    got, expected = weights(tmp_path), weights(eager)
    assert got.keys() == expected.keys()  # compiled in place: no _orig_mod. prefix
    print(f"max |compiled {mode} - eager| {max_diff(got, expected):.2e}")
    for name in expected:
        assert torch.allclose(got[name], expected[name], **TOLERANCE), name
    assert syncs(tmp_path) == [1.0] * 6  # no_sync holds around the compiled forward and backward


def test_trainer_compile_takes_torchs_modes_and_refuses_cuda_graphs_under_fsdp(monkeypatch):
    """true is torch's default mode, a mode by name goes to torch.compile as it is; an unknown value and CUDA
    graphs under FSDP are one-line config errors (no compilation is run: torch.compile's own test is above)."""
    from trainkit.dist import Dist
    from trainkit.errors import ConfigError
    from trainkit.parallel import compile_mode, wrap

    modes = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kwargs: modes.append(kwargs["mode"]))
    cpu = Dist(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    for value in (True, "default", "reduce-overhead", "max-autotune-no-cudagraphs"):
        wrap(torch.nn.Linear(2, 2), "single", cpu, compile=value)
    wrap(torch.nn.Linear(2, 2), "single", cpu, compile=False)
    assert modes == ["default", "default", "reduce-overhead", "max-autotune-no-cudagraphs"]
    with pytest.raises(ConfigError, match=r"trainer.compile=fast is not one of: false, true, default, reduce-overhead"):
        compile_mode("fast", "single")
    with pytest.raises(ConfigError, match="trainer.compile=reduce-overhead captures CUDA graphs"):
        compile_mode("reduce-overhead", "fsdp")
    assert compile_mode("max-autotune-no-cudagraphs", "fsdp") == "max-autotune-no-cudagraphs"
