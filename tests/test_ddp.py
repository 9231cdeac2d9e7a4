"""DDP on 2 gloo ranks: gradient syncs counted by the comm hook, why no_sync must wrap forward
too, and exact accumulation on a linear regression whose answer is known in closed form."""

from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir
from omegaconf import open_dict
from torch import nn

from helpers import ROOT, regression_splits, run_distributed
from train import train
from trainkit.accumulate import sync_context, syncs_now
from trainkit.dist import Dist
from trainkit.parallel import wrap


def _grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def _same_on_all_ranks(tensor) -> bool:
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, tensor)
    return all(torch.equal(gathered[0], t) for t in gathered)


def _accounting(rank, world_size):
    d = Dist(rank, rank, world_size, torch.device("cpu"))
    out = {}
    for strategy in ("no_sync", "sync_each_batch"):
        torch.manual_seed(0)
        model, comm = wrap(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)), "ddp", d)
        same_inside, same_after = [], []
        K, windows = 4, 3
        for _ in range(windows):
            for k in range(K):
                x = torch.randn(5, 4) + rank  # different data on each rank
                with sync_context(model, syncs_now(strategy, k, K)):
                    model(x).sum().backward()
                (same_after if k == K - 1 else same_inside).append(_same_on_all_ranks(_grads(model)))
            model.zero_grad()
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        out[strategy] = dict(
            syncs=comm.syncs, bytes=comm.bytes, param_bytes=params, same_inside=same_inside, same_after=same_after
        )

    # A model in several buckets (parallel.bucket_cap_mb): one sync reduces every bucket.
    torch.manual_seed(0)
    model, comm = wrap(nn.Sequential(*[nn.Linear(64, 64) for _ in range(3)]), "ddp", d, bucket_cap_mb=0.01)
    for _ in range(3):
        for k in range(4):
            with sync_context(model, syncs_now("no_sync", k, 4)):
                model(torch.randn(5, 64) + rank).sum().backward()
        model.zero_grad()
    out["buckets"] = dict(
        syncs=comm.syncs,
        bytes=comm.bytes,
        param_bytes=3 * (64 * 64 + 64) * 4,
        buckets=model._get_ddp_logging_data()["rebuilt_bucket_sizes"].count(",") + 1,
    )

    # Compression (parallel.comm_hook): the gradients travel in 16 bits, half the bytes.
    for hook in ("none", "fp16", "bf16"):
        torch.manual_seed(0)
        model, comm = wrap(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)), "ddp", d, comm_hook=hook)
        for k in range(4):
            with sync_context(model, syncs_now("no_sync", k, 4)):
                model(torch.randn(5, 4, generator=torch.Generator().manual_seed(10 * k + rank))).sum().backward()
        out[hook] = dict(
            syncs=comm.syncs, bytes=comm.bytes, grads=_grads(model), same=_same_on_all_ranks(_grads(model))
        )

    # parallel.static_graph (syncing every micro-batch: torch's no_sync + static graph is broken):
    # the same gradients, the same syncs.
    for static in (False, True):
        torch.manual_seed(0)
        model, comm = wrap(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)), "ddp", d, static_graph=static)
        for step in range(3):
            for k in range(2):
                with sync_context(model, syncs_now("sync_each_batch", k, 2)):
                    model(
                        torch.randn(5, 4, generator=torch.Generator().manual_seed(10 * step + k + rank))
                    ).sum().backward()
            grads = _grads(model)
            model.zero_grad()
        out[f"static_{static}"] = dict(syncs=comm.syncs, grads=grads, static=model.static_graph)

    # The classic pitfall: forward outside no_sync(), only backward inside. It still syncs.
    torch.manual_seed(0)
    model, comm = wrap(nn.Linear(4, 1), "ddp", d)
    loss = model(torch.randn(5, 4) + rank).sum()
    with model.no_sync():
        loss.backward()
    out["backward_only"] = dict(syncs=comm.syncs, same=_same_on_all_ranks(_grads(model)))
    return out


def test_one_sync_per_optimizer_step_with_no_sync_and_k_with_sync_each_batch():
    for result in run_distributed(_accounting, 2):
        no_sync, each = result["no_sync"], result["sync_each_batch"]
        assert no_sync["syncs"] == 3 and each["syncs"] == 12  # 3 optimizer steps of K=4
        assert no_sync["bytes"] == 3 * no_sync["param_bytes"]
        assert each["bytes"] == 12 * each["param_bytes"]
        assert not any(no_sync["same_inside"])  # local accumulation: ranks differ in the window
        assert all(no_sync["same_after"])  # the sync step makes them identical
        assert all(each["same_inside"]) and all(each["same_after"])
        full = result["none"]
        for hook, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
            compressed = result[hook]
            assert compressed["syncs"] == 1 and compressed["same"]
            assert compressed["bytes"] == full["bytes"] // 2 == full["grads"].numel() * 2
            # Each rank's sum rounded to 16 bits once: within that dtype's resolution of the exact mean.
            tolerance = 4 * torch.finfo(dtype).eps * full["grads"].abs().max()
            assert 0 < (compressed["grads"] - full["grads"]).abs().max() <= tolerance, hook
        buckets = result["buckets"]  # DDP rebuilds its buckets after the first step: 3 from then on
        assert buckets["buckets"] == 3 and buckets["syncs"] == 3 and buckets["bytes"] == 3 * buckets["param_bytes"]
        static, dynamic = result["static_True"], result["static_False"]
        assert static["static"] and not dynamic["static"] and static["syncs"] == dynamic["syncs"] == 6
        assert torch.equal(static["grads"], dynamic["grads"])
        # no_sync() around backward alone does not stop the all-reduce: DDP armed it in forward.
        assert result["backward_only"] == {"syncs": 1, "same": True}


def _regression(rank, world_size, batch_size, steps, run_dir):
    """train.py's train() itself on least squares (helpers.LeastSquares, a float64 linear model
    from zero, plain SGD): the same loop, sampler and normalisation as every other run."""
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(
            "train",
            overrides=[
                "task._target_=helpers.LeastSquares",
                "data.splits._target_=helpers.regression_splits",
                "data.splits.val_fraction=0",
                "optim=sgd",
                "optim.lr=0.1",
                "optim.momentum=0",
                "sched=constant",
                "trainer.clip_grad_norm=null",
                "trainer.epochs=2",
                f"data.batch_size={batch_size}",
                f"accumulation.steps={steps}",
                "checkpoint.every=0",
            ],
        )
    with open_dict(cfg):
        cfg.model = {"_target_": "helpers.zero_linear", "features": 3}
    d = Dist(rank, rank, world_size, torch.device("cpu"))
    train(cfg, d, "ddp" if world_size > 1 else "single", Path(run_dir))
    if rank == 0:
        weights = torch.load(Path(run_dir) / "model.pt", weights_only=True)
        return torch.cat([weights["weight"].flatten(), weights["bias"]])
    return None


def _closed_form(X, y, global_batch, lr, epochs):
    """Gradient descent on 0.5 * mean squared error over each global window, in numpy."""
    Xn, yn = X.numpy(), y.numpy()
    w, b = np.zeros(X.shape[1]), 0.0
    for epoch in range(epochs):
        g = torch.Generator().manual_seed(epoch)  # DistributedSampler: seed + epoch
        order = torch.randperm(len(yn), generator=g).numpy()
        for start in range(0, len(yn), global_batch):
            idx = order[start : start + global_batch]
            residual = Xn[idx] @ w + b - yn[idx]
            w, b = w - lr * Xn[idx].T @ residual / len(idx), b - lr * residual.mean()
    return np.concatenate([w, [b]])


def test_linear_regression_two_ranks_k4_b1_equals_one_process_b8_and_closed_form(tmp_path):
    X, y = regression_splits()[0].tensors  # 21 = 2 full windows of 8 and a short one of 5
    expected = _closed_form(X, y, global_batch=8, lr=0.1, epochs=2)
    single = _regression(0, 1, 8, 1, str(tmp_path / "single"))
    two_ranks = run_distributed(_regression, 2, 1, 4, str(tmp_path / "ddp"))[0]
    np.testing.assert_allclose(single.numpy(), expected, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(two_ranks.numpy(), expected, rtol=1e-12, atol=1e-12)


def test_sync_bn_is_skipped_with_one_process(capsys):
    model, _ = wrap(
        nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4)), "single", Dist(0, 0, 1, torch.device("cpu")), sync_bn=True
    )
    assert type(model[1]) is nn.BatchNorm2d
    assert "parallel.sync_bn=true: one process, so BatchNorm stays as it is" in capsys.readouterr().out
