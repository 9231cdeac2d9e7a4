"""trainer.profile (trainkit/profile.py): one trace per rank over exactly the profiled optimizer steps,
the table printed once, training unchanged; a window past the run's end refused; a resume profiles
what is left of the window."""

import gzip
import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from test_config_errors import cli_in_process

from helpers import run_in_process, weights
from trainkit.dist import Dist
from trainkit.profile import Profiler

# 2 ranks x 2 micro-batches: a profiler stepped per micro-batch would cover 1.5 optimizer steps, not 3.
RUN = ["trainer.max_steps=8", "trainer.log_every=4", "accumulation.steps=2", "data.batch_size=16", "optim=sgd"]


def trace_events(path: Path) -> list[dict]:
    with gzip.open(path) as file:  # what ui.perfetto.dev and chrome://tracing read
        return json.load(file)["traceEvents"]


def test_a_profiled_2_rank_run_traces_its_steps_on_every_rank_and_trains_alike(tmp_path):
    out = run_in_process(tmp_path / "profiled", *RUN, "trainer.profile.steps=[3,5]", "trainer.profile.top=5", nproc=2)
    run_in_process(tmp_path / "plain", *RUN, nproc=2)
    for rank in (0, 1):
        events = trace_events(tmp_path / "profiled" / "profile" / f"rank{rank}.json.gz")
        names = [e.get("name", "") for e in events]
        assert "aten::addmm" in names  # the forwards' linear layers
        # Exactly optimizer steps 3..5: the profiler's steps 2, 3, 4 (its step 0 is the run's first), three SGD steps.
        assert sorted(n for n in names if n.startswith("ProfilerStep#")) == [
            "ProfilerStep#2",
            "ProfilerStep#3",
            "ProfilerStep#4",
        ]
        assert sum(n.startswith("Optimizer.step#SGD") for n in names) == 3
    assert out.count("Self CPU time total") == 1 and out.count("profile: steps 3..5, top 5") == 1  # rank 0, once
    assert "profile/rank1.json.gz" in out
    profiled, plain = weights(tmp_path / "profiled"), weights(tmp_path / "plain")
    assert all(torch.equal(profiled[k], plain[k]) for k in plain)  # the profiler observes, it changes nothing
    assert not (tmp_path / "plain" / "profile").exists()


def test_a_window_past_the_end_is_one_line_exit_2(tmp_path, capsys, monkeypatch):
    status = cli_in_process(["trainer.max_steps=100", "trainer.profile.steps=[900,910]"], tmp_path / "run", monkeypatch)
    err = capsys.readouterr().err.strip()
    assert status == 2
    assert err == (
        "error: trainer.profile.steps=[900, 910] is past the end of this run's 100 optimizer steps "
        "(trainer.max_steps / trainer.epochs)"
    )
    assert not (tmp_path / "run").exists()


def profile_cfg(steps, warmup: int = 1):
    return OmegaConf.create(
        {
            "steps": steps,
            "warmup": warmup,
            "top": 3,
            "record_shapes": False,
            "profile_memory": False,
            "with_stack": False,
        }
    )


def test_a_resumed_run_profiles_what_is_left_of_the_window_and_off_builds_nothing(tmp_path, capsys):
    d = Dist(0, 0, 1, torch.device("cpu"))
    profiler = Profiler(profile_cfg([3, 7]), 10, d, tmp_path)
    with profiler.over(4):  # resumed after step 4: steps 5..7 are left
        for step in range(5, 11):
            with torch.profiler.record_function(f"train step {step}"):
                torch.ones(4, 4) @ torch.ones(4, 4)
            profiler.step()
    out = capsys.readouterr().out
    assert "resumed at step 4: steps 3..4 are not profiled, 5.." in out
    names = {e.get("name") for e in trace_events(tmp_path / "profile" / "rank0.json.gz")}
    assert {f"train step {s}" for s in range(4, 11)} & names == {"train step 5", "train step 6", "train step 7"}
    assert "step" not in vars(profiler)  # past the window: step() is the class's no-op again

    off = Profiler(profile_cfg(None), 10, d, tmp_path / "off")
    with off.over(0):
        off.step()
        assert off.prof is None  # no torch.profiler object
    assert off.prof is None and "step" not in vars(off) and not (tmp_path / "off").exists()


@pytest.mark.filterwarnings("ignore:CUDA is not available")  # torch.profiler's, on this CPU machine
def test_on_cuda_the_memory_history_covers_the_window_and_an_out_of_memory_dumps_it(tmp_path, monkeypatch, capsys):
    """The CUDA path on a CPU machine: torch.cuda.memory's recorder, snapshot and out-of-memory observer
    replaced by a log of the calls (the trace itself records CPU events only here)."""
    calls: list[str] = []
    observers: list = []
    memory = torch.cuda.memory
    monkeypatch.setattr(memory, "_record_memory_history", lambda enabled="all", **_: calls.append(f"record {enabled}"))
    monkeypatch.setattr(memory, "_dump_snapshot", lambda path: calls.append(f"dump {Path(path).name}"))
    monkeypatch.setattr(torch._C, "_cuda_attach_out_of_memory_observer", observers.append, raising=False)
    d = Dist(0, 0, 1, torch.device("cuda"))
    profiler = Profiler(profile_cfg([2, 3]), 5, d, tmp_path)
    with profiler.over(0):
        for step in range(1, 6):
            calls.append(f"step {step}")
            profiler.step()
    assert calls == [
        "step 1",
        "record all",
        "step 2",
        "step 3",
        "dump memory_rank0.pickle",
        "record None",
        "step 4",
        "step 5",
    ]
    out = capsys.readouterr().out
    assert not observers and out.count("Self CPU time total") == 2  # only with profile_memory; CPU and CUDA tables
    assert "memory_rank<r>.pickle (https://pytorch.org/memory_viz)" in out

    calls.clear()
    cfg = profile_cfg([2, 3])
    cfg.profile_memory = True  # the history from the start, and the observer torch calls before it raises
    profiler = Profiler(cfg, 5, d, tmp_path / "memory")
    with profiler.over(0):
        calls.append("step 1")
        observers[0](0, 1 << 30, 0, 0)  # out of memory in step 1 (data.batch_size=auto would halve and retry)
        profiler.step()
    assert calls[:3] == ["record all", "step 1", "dump memory_oom_rank0.pickle"] and calls[-1] == "record None"
