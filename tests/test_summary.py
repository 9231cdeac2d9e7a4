"""The model summary (trainkit/summary.py): parameter counts, FLOPs per sample and per token, the
rows' mem/peak_gb and mfu, summary.json; the FLOP count leaves the model and the RNG as they were."""

import json
import random

import numpy as np
import torch

from helpers import rows, run_in_process
from trainkit import summary
from trainkit.dist import Dist
from trainkit.models import cnn, gpt
from trainkit.models import mlp as mlps


def test_counts_are_per_top_level_module_and_a_tied_weight_counts_once():
    mlp = mlps.mlp([1, 8, 8], 10, width=16, depth=2)
    counts = summary.parameters(mlp)
    assert counts["total"] == counts["trainable"] == sum(p.numel() for p in mlp.parameters())
    assert counts["per_module"] == {
        name: sum(p.numel() for p in m.parameters()) for name, m in mlp.named_children() if list(m.parameters())
    }
    model = gpt.gpt(vocab_size=14, block_size=16, n_layer=1, n_head=2, n_embd=8)
    counts = summary.parameters(model)  # lm_head.weight is wte.weight: counted in wte, lm_head has nothing of its own
    distinct = {id(p): p.numel() for m in model.modules() for p in m.parameters(recurse=False)}
    assert counts["total"] == sum(distinct.values()) == sum(counts["per_module"].values())
    assert counts["per_module"]["lm_head"] == 0 and counts["per_module"]["wte"] == 14 * 8


def test_the_mlps_flops_per_sample_are_its_matmuls_and_counting_changes_nothing():
    mlp = cnn.cnn(1, 10, width=4, dropout=0.5)  # BatchNorm (running statistics) and dropout (the RNG)
    x = torch.randn(3, 1, 8, 8)
    state = {k: v.clone() for k, v in mlp.state_dict().items()}
    rng = torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate()
    summary.forward_flops(mlp, x, x.device)
    assert all(torch.equal(state[k], v) for k, v in mlp.state_dict().items())  # running stats untouched (eval)
    assert torch.equal(torch.get_rng_state(), rng[0]) and (np.random.get_state()[1] == rng[1]).all()
    assert random.getstate() == rng[2] and all(m.training for m in mlp.modules())  # train mode back
    inputs, width, classes = 64, 16, 10
    mlp = mlps.mlp([1, 8, 8], classes, width=width, depth=1)
    assert summary.forward_flops(mlp, torch.randn(1, 1, 8, 8), torch.device("cpu")) == 2 * (
        inputs * width + width * classes
    )


def test_flopcountermode_agrees_with_the_gpt_formula():
    # FlopCounterMode counts matmuls (2·m·n·k) and, with trainkit's mapping for the CPU kernel, the attention's
    # 4·T·d per token and layer. nanoGPT's 6N + 12·L·H·Q·T also counts every bias and LayerNorm parameter as
    # 6 FLOPs (13·d per block; 13/(12·d) = 1.7 % over at d=64) and ignores softmax and LayerNorm compute: 2.5 %
    # holds it. Without the attention (the CPU kernel counted 0, as in torch 2.14.1's own table): 18 % over.
    model = gpt.gpt(vocab_size=14, block_size=64, n_layer=2, n_head=4, n_embd=64)
    length = 64
    measured = 3 * summary.forward_flops(model, torch.zeros(1, length, dtype=torch.long), torch.device("cpu")) / length
    formula = model.flops_per_token(length)
    assert abs(formula / measured - 1) < 0.025, (formula, measured)


def test_mfu_is_flops_per_sample_times_samples_per_s_over_every_devices_peak():
    assert summary.peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989.4e12
    assert summary.peak_flops("NVIDIA H100 PCIe", "fp32") == 51.2e12
    assert summary.peak_flops("Tesla V100-SXM2-16GB", "bf16") is None  # no bf16 tensor cores
    assert summary.peak_flops("Some Future GPU", "bf16") is None
    d = Dist(0, 0, 2, torch.device("cpu"))  # 2 ranks: samples/s counts both, the peak is 2 devices'
    row = summary.Efficiency(d, train_flops_per_sample=1e6, peak_flops=1e9).row(samples_per_s=500)
    assert row["mfu"] == 1e6 * 500 / (2 * 1e9) and row["mem/peak_gb"] > 0
    assert "mfu" not in summary.Efficiency(d, 1e6, None).row(500)  # CPU or a device not in the table


def test_a_2_rank_run_prints_the_summary_once_and_logs_it_and_the_memory_peak(tmp_path):
    width = 16
    out = run_in_process(tmp_path, "trainer.max_steps=4", "trainer.log_every=2", f"model.width={width}", nproc=2)
    assert out.count("model: ") == 1 and out.count("FLOPs per sample") == 1  # rank 0 alone
    facts = json.loads((tmp_path / "summary.json").read_text())
    # Per sample (not per micro- or global batch): 3 x the forward's 2 FLOPs per weight (2 hidden layers, the head).
    assert facts["flops_per_sample"] == 3 * 2 * (64 * width + width * width + width * 10)
    assert facts["params"] == 64 * width + width + width * width + width + width * 10 + 10
    train_rows = [r for r in rows(tmp_path) if "loss" in r]
    assert len(train_rows) == 2
    for row in train_rows:
        # Peak RSS of a process with torch imported: hundreds of MB. KiB read as bytes: ~0.001 GB, as MiB: ~1000 GB.
        assert 0.05 < row["mem/peak_gb"] < 24, row
        assert "mfu" not in row  # CPU


def test_the_loggers_get_the_summary(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from helpers import compose_cfg
    from trainkit.loggers import Loggers, WandbLogger

    monkeypatch.setenv("WANDB_MODE", "offline")
    in_wandb = {}
    for name in ("tensorboard", "wandb"):
        (tmp_path / name).mkdir()  # Hydra's run dir
        with Loggers(tmp_path / name, compose_cfg(f"logger={name}"), None, None) as logger:
            logger.summary({"params": 26122, "flops_per_sample": 155136.0})
            if isinstance(backend := logger.backends[-1], WandbLogger):  # the run's summary as the run holds it (its
                in_wandb = dict(backend.run.summary)  # file is written later, by wandb's own service process: not read)
        assert json.loads((tmp_path / name / "summary.json").read_text())["params"] == 26122
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    assert "params: 26122" in events.Tensors("summary/text_summary")[0].tensor_proto.string_val[0].decode()
    assert in_wandb["model/flops_per_sample"] == 155136.0 and in_wandb["model/params"] == 26122
