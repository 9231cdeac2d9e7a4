"""The benchmark scripts run end to end at their smallest sizes and count what they claim to count; no timing
assertions (the numbers of a quick run mean nothing). Each runs as its command line runs it, as __main__ with its
arguments, but in a forked process of this one (torch already imported: 0.3 s to start, a fresh interpreter ~5 s);
the commands a script starts itself (train.py's runs) are real commands."""

import contextlib
import importlib
import io
import json
import os
import runpy
import subprocess
import sys
from unittest import mock

import pytest
import torch

from helpers import ROOT, run_distributed, together
from trainkit.checkpoint import step_name
from trainkit.dist import Dist

CPU = Dist(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))


def script_rank(rank: int, world_size: int, argv: tuple[str, ...], torchrun: bool) -> str:
    """A rank of run_distributed: `python <argv>` in this forked process (torchrun: one rank of `torchrun
    --nproc_per_node=<world_size> <argv>`, in the environment torchrun gives it); returns what it printed to
    stdout. Worker processes the script asks torch.multiprocessing to spawn are forked too."""
    os.environ["OMP_NUM_THREADS"] = "1"  # for the commands it starts, too
    if torchrun:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
        os.environ.update(LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0")
    start = torch.multiprocessing.start_processes

    def forked(*args, **kwargs):
        return start(*args, **{**kwargs, "start_method": "fork"})

    out = io.StringIO()
    spawned = mock.patch.object(torch.multiprocessing, "start_processes", forked)
    with mock.patch.object(sys, "argv", list(argv)), contextlib.redirect_stdout(out), spawned:
        try:
            runpy.run_path(str(ROOT / argv[0]), run_name="__main__")
        except SystemExit as exited:  # argparse's --help exits 0
            if exited.code:
                raise AssertionError(f"{' '.join(argv)} exited with {exited.code!r}:\n{out.getvalue()}") from None
    return out.getvalue()


def run_script(*argv: str, nproc: int = 1) -> str:
    """What `python <argv>` (nproc=1) or `torchrun --nproc_per_node=<nproc> <argv>` prints to stdout (the ranks'
    output in rank order), one thread per process; a script that fails fails the test."""
    importlib.import_module("train")  # what every benchmark imports, once here, not in every forked process
    return "".join(run_distributed(script_rank, nproc, argv, nproc > 1, group=False))


@pytest.mark.slow
def test_bench_accumulation_counts_the_syncs_of_every_variant(tmp_path):
    out = tmp_path / "bench.json"
    models = ["mlp"]  # gpt and resnet18 run the same code, only slower
    stdout = run_script("scripts/bench_accumulation.py", "--quick", "--models", *models, "--out", str(out))
    result = json.loads(out.read_text())
    K = result["settings"]["K"]
    assert K > 1
    # Per optimizer step: plain DDP syncs every micro-batch; no_sync() around backward only still
    # syncs every micro-batch (DDP armed its reducer in forward); around forward and backward once.
    # trainkit's own loop: accumulation=sync_each_batch syncs K times, no_sync once.
    expected = {"baseline": K, "no_sync_backward_only": K, "no_sync": 1, "trainkit_sync_each_batch": K, "trainkit": 1}
    for model in models:
        summary = result["summary"][model]
        assert set(summary) == set(expected)
        for variant, syncs in expected.items():
            assert summary[variant]["syncs_per_step"] == syncs, (model, variant, summary[variant])
            assert summary[variant]["median"] > 0
        assert f"| {model} |" in stdout
        assert f"no_sync / sync every micro-batch, {model} (samples/s): hand-written DDP loop" in stdout
        assert summary["trainkit"]["speedup_over_own"]["median"] > 0
    rows = result["rows"]
    assert {(r["model"], r["variant"]) for r in rows} == {(m, v) for m in models for v in expected} | {
        ("mlp", "one_process")
    }
    assert all(r["s_per_micro_batch"] > 0 for r in rows)
    assert all(r["syncs_per_step"] == 0 for r in rows if r["variant"] == "one_process")
    assert all(e["scaling_efficiency"] > 0 for e in result["summary"]["mlp"].values())
    assert "scaling efficiency, mlp" in stdout


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["python", "torchrun"])
def test_bench_train_runs_the_three_loops_interleaved_single_and_ddp(launcher):
    """A quick run of each: the three loops train interleaved and both ratios are printed (their values mean
    nothing here); under torchrun the ranks' DDP loops and trainkit's interleave the same way (no hang). One
    process adds --breakdown: the Python calls per step of the tensor loop and trainkit, then the hooks' CPU time."""
    # --steps: its least, 8 segments of --every
    script = ["scripts/bench_train.py", "--steps", "8", "--every", "1", "data.batch_size=8", "trainer.test=false"]
    ranks = 2 if launcher == "torchrun" else 1
    if launcher == "torchrun":
        script.append("accumulation.steps=2")
    else:
        script.insert(1, "--breakdown")
    stdout = run_script(*script, nproc=ranks)
    assert f"{ranks} rank(s), K={ranks}" in stdout
    for baseline in ("tensor-slicing loop", "DataLoader loop"):
        assert stdout.count(f"ratio trainkit / {baseline}:") == 1, stdout
    if launcher == "python":
        for line in ("| function calls per step (cProfile) |", "| all |", "| rng: seed_step", "| all hooks |"):
            assert stdout.count(line) == 1, stdout
        assert "| bare_step (train.py:" in stdout  # trainkit's own step: a call per step the tensor loop lacks


def test_interleaved_segments_cover_the_same_steps_of_each_loop():
    """bench_train.interleaved: after the untimed quarter, every segment of --every trainkit steps is followed by
    --every steps of each plain loop, so each loop's timed steps are the same ones (the same samples)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_train

    steps, every, calls = 60, 5, {"trainkit": 0, "tensor": 0}
    plain = bench_train.PLAIN["tensor"]

    def counted(cfg, d, total):
        for samples in plain(cfg, d, total):
            calls["tensor"] += 1
            yield samples

    cfg = bench_train.composed(steps, ["data.batch_size=8", "trainer.test=false"])
    with mock.patch.dict(bench_train.PLAIN, {"tensor": counted}):
        seconds = bench_train.interleaved(cfg, CPU, steps, every, ["tensor"])
    warm = steps // 4 // every * every
    assert len(seconds["trainkit"]) == len(seconds["tensor"]) == (steps - warm) // every
    assert calls["tensor"] == steps  # its warm quarter untimed, then as many steps as trainkit's, segment by segment
    assert all(t > 0 for t in seconds["trainkit"] + seconds["tensor"])
    whole, parts = bench_train.segment_ratio({"trainkit": [1.0] * 8, "tensor": [2.0] * 4 + [1.0] * 4}, "tensor")
    assert whole == 1.5 and parts == [2.0] * 4 + [1.0] * 4


def test_interleaved_rotate_lets_each_plain_loop_go_first_in_turn():
    """rotate=True (bench_hf.py): the plain loops' order turns by one each segment, so that with two of them each of
    the three loops follows each other one as often (a loop run after another thread's ran slower); each still runs
    every step once."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_train

    steps, every, ran = 40, 5, []
    plain = bench_train.PLAIN["tensor"]

    def named(name):
        def loop(cfg, d, total):
            for samples in plain(cfg, d, total):
                ran.append(name)
                yield samples

        return loop

    cfg = bench_train.composed(steps, ["data.batch_size=8", "trainer.test=false"])
    with mock.patch.dict(bench_train.PLAIN, {"a": named("a"), "b": named("b")}):
        bench_train.interleaved(cfg, CPU, steps, every, ["a", "b"], rotate=True)
    warm = steps // 4 // every * every
    firsts = ran[2 * warm :: 2 * every]  # the loop that went first in each timed segment (after both warm-ups)
    assert firsts == ["b", "a"] * (len(firsts) // 2) and len(firsts) == (steps - warm) // every
    assert ran.count("a") == ran.count("b") == steps


def test_bench_train_paths_row_each_data_path_with_its_data_wait():
    """--paths: trainkit with its split on the device (the driver), trainkit through its DataLoader (a second train()
    stepped in a thread, one step per advance), the tensor-slicing and the DataLoader loop: a row each, its step's
    time and time/data_wait (a share of the step), measured over the same timed segments."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_train

    steps, every = 40, 5
    cfg = bench_train.composed(steps, ["data.batch_size=8", "trainer.test=false"])
    table = bench_train.data_paths(cfg, CPU, steps, every)
    rows = [line.split(" | ") for line in table.splitlines()[2:]]
    assert [row[0] for row in rows] == [
        "| trainkit, data on the device (data.on_device=true)",
        "| trainkit, DataLoader (data.on_device=false)",
        "| tensor-slicing loop",
        "| DataLoader loop",
    ], table
    assert all(float(row[1].replace(",", "")) > 0 and 0 < float(row[2]) < 1 for row in rows), table
    assert bench_train.WAITED is None and all(guest.finished for guest in bench_train.Guest.guests.values())


def test_bench_memory_help_is_its_whole_docstring_not_a_cut_first_line():
    import ast

    doc = ast.get_docstring(ast.parse((ROOT / "scripts/bench_memory.py").read_text()), clean=False)
    shown = run_script("scripts/bench_memory.py", "--help")
    assert all(line.strip() in shown for line in doc.strip().splitlines())


@pytest.mark.slow
def test_bench_launch_times_self_launched_workers_to_their_first_step():
    """One variant runs every line of the script (the variants differ in their command and environment only): fork,
    the self-launched workers of `python src/train.py parallel.nproc_per_node=2`, with an environment of its own."""
    stdout = run_script("scripts/bench_launch.py", "trainer.max_steps=1", "--repeats", "1", "--variants", "fork")
    rows = [line.split("|")[1].strip() for line in stdout.splitlines() if line.startswith("| ")]
    assert rows == ["command (trainer.max_steps=1)", "fork"], stdout


@pytest.mark.slow
def test_bench_finetune_prints_the_probes_ratios_and_reduces_only_the_classifier(tmp_path):
    out = tmp_path / "bench.json"
    small = ["model.channels=4", "model.width=16", "data.batch_size=8"]  # a classifier of 16 x 10 + 10
    stdout = run_script(
        "scripts/bench_finetune.py", "--rounds", "1", "--steps", "2", "--every", "1", "--out", str(out), *small
    )
    figures = json.loads(out.read_text())["figures"]
    assert figures["probe"]["grad_bytes"] == (16 * 10 + 10) * 4 == figures["probe"]["trainable"] * 4
    assert figures["full"]["grad_bytes"] == figures["full"]["trainable"] * 4 > figures["probe"]["grad_bytes"]
    assert stdout.count("ratio probe / full: step time ") == 1, stdout


def test_compare_runs_prints_the_largest_difference_at_each_step_both_runs_kept(tmp_path):
    """scripts/compare_runs.py: max |difference| over every tensor, per common checkpoint step and for model.pt; a
    step only the reference kept is a dash; DDP's "module." prefix is not a difference."""
    import torch

    def run(name: str, steps: dict, end: dict, prefix: str = "") -> str:
        (tmp_path / name / "checkpoints").mkdir(parents=True)
        for step, state in steps.items():
            model = {prefix + key: value for key, value in state.items()}
            torch.save({"model": model, "optimizer": {}}, tmp_path / name / "checkpoints" / step_name(step))
        torch.save(end, tmp_path / name / "model.pt")
        return str(tmp_path / name)

    zero = {"w": torch.zeros(3), "b": torch.zeros(2)}
    one = run("one", {10: zero, 20: zero}, zero)
    two = run(
        "two",
        {10: {"w": torch.tensor([0.0, -0.25, 0.0]), "b": torch.zeros(2)}},
        {**zero, "b": torch.ones(2)},
        "module.",
    )
    lines = run_script("scripts/compare_runs.py", one, two).splitlines()
    assert [line.split() for line in lines[1:]] == [["10", "2.50e-01"], ["20", "-"], ["end", "1.00e+00"]]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is there: scripts/gpu_check.sh would run its checks")
def test_gpu_check_without_a_gpu_exits_2_with_one_line_in_both_sizes_and_its_help_says_both(tmp_path):
    """scripts/gpu_check.sh (issue 52): on a machine without CUDA, the full check and --quick stop at once with one
    line and exit 2, leaving no log dir; --help gives both sizes and their time budgets."""
    env = dict(os.environ, PY=sys.executable, OUT=str(tmp_path / "out"), OMP_NUM_THREADS="1")

    def gpu_check(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", "scripts/gpu_check.sh", *args], cwd=ROOT, env=env, capture_output=True, text=True
        )

    for proc in together(gpu_check, lambda: gpu_check("--quick")):  # side by side: each starts a python with torch
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert proc.stderr.splitlines() == ["error: no CUDA device visible (torch.cuda.device_count() = 0)"]
        assert proc.stdout == "" and not (tmp_path / "out").exists()
    proc = gpu_check("--help")
    assert proc.returncode == 0 and "--quick    at most 4 minutes on one GPU" in proc.stdout
    assert "the full check: about 7 minutes" in proc.stdout and "exit status" in proc.stdout
    wrong = gpu_check("--fast")
    assert wrong.returncode == 2 and "unknown argument --fast" in wrong.stderr


def test_bench_hf_times_trainkit_trainer_and_a_plain_loop_that_train_alike(monkeypatch, tmp_path):
    """scripts/bench_hf.py at its smallest (a 1-layer Llama of width 32, 8 steps of 2 blocks): trainkit's loop,
    transformers' Trainer (released one step at a time, handing back from its on_step_end) and the plain loop run
    interleaved, both ratios are printed, and the three end on trainkit's weights: the same initial weights, batches
    in the same order, optimizer groups, clipping and loss, or the figures would compare other work (one AdamW step
    on another batch moves the weights by ~lr = 3e-3; here they are equal bit for bit)."""
    pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the model is made from a config: nothing to fetch
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    small = ["model.config.hidden_size=32", "model.config.intermediate_size=64", "model.config.num_hidden_layers=1"]
    stdout = run_script("scripts/bench_hf.py", "--steps", "8", "--every", "1", *small, "data.batch_size=2")
    for name in ("Trainer", "plain"):
        assert stdout.count(f"ratio trainkit / {name}:") == 1, stdout
        difference = float(stdout.split(f"from trainkit's after 8 steps, {name}: ")[1].split()[0])
        assert difference < 1e-6, stdout


def test_bench_shards_reads_every_sample_every_way_and_holds_the_url_cache_to_its_limit(tmp_path):
    """scripts/bench_shards.py --quick at 0 workers: trainkit's loader over the token and image shards, webdataset's
    over the same files and the memory-mapped corpus each read the epoch's every sample (the script counts them), the
    rows and the table are printed; the shards read from an S3 server on localhost: each downloaded once, none again,
    the cache never past its limit plus the two shards a reader and its prefetch thread may be downloading."""
    out = tmp_path / "bench.json"
    stdout = run_script("scripts/bench_shards.py", "--quick", "--workers", "0", "--out", str(out))
    tokens, images, cache = json.loads(out.read_text())
    assert [(r["section"], r.get("workers")) for r in (tokens, images, cache)] == [
        ("tokens", 0),
        ("images", 0),
        ("cache", None),
    ]
    assert tokens["shards"] > 4 and images["samples"] == 128
    assert all(r[k] > 0 for r in (tokens, images) for k in ("trainkit", "webdataset", "ratio")) and tokens["memmap"] > 0
    assert (cache["unread"], cache["refetched"]) == (0, 0) and cache["downloads"] >= cache["shards"] > 2 * cache[
        "window"
    ]
    assert 0 < cache["max_cache"] <= cache["cache_limit"] + 2 * cache["shard_bytes"]
    assert "| tokens | 0 |" in stdout and "| images | 0 |" in stdout and "cache (s3:// on localhost" in stdout


def test_bench_checkpoint_times_both_modes_of_a_checkpoint_of_model_and_adamw_state():
    out = run_script("scripts/bench_checkpoint.py", "--models", "pydoc_gpt", "--saves", "1", "--steps", "1")
    [row] = [line.split() for line in out.splitlines() if line.startswith("pydoc_gpt")]
    params, mb = float(row[1].rstrip("M")), float(row[2])
    assert mb == pytest.approx(3 * params * 4, rel=0.02)  # the parameters and AdamW's two moments, fp32
    assert all(float(row[i]) > 0 for i in (3, 4)) and row[5].endswith("x")  # each mode's stall, their ratio
