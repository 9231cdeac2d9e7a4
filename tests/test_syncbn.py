"""SyncBatchNorm on 2 gloo ranks equals nn.BatchNorm on the concatenated batch: outputs, input
and parameter gradients, running statistics. Plus gradcheck, eval without communication,
world size 1, and convert_sync_batchnorm."""

import copy
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from helpers import run_distributed, run_in_process
from trainkit.syncbn import SyncBatchNorm, _SyncBatchNormFn, batchnorm_caveat, convert_sync_batchnorm

STEPS = 3  # training steps per case: running stats and momentum=None need several

# name -> (BatchNorm class, per-sample shape (C, *), per-rank batch sizes, BatchNorm kwargs)
CASES: dict[str, tuple[type[nn.Module], tuple[int, ...], tuple[int, int], dict]] = {
    "1d_NC": (nn.BatchNorm1d, (4,), (4, 4), {}),
    "1d_NCL": (nn.BatchNorm1d, (3, 7), (4, 4), {}),
    "2d_unequal": (nn.BatchNorm2d, (3, 5, 4), (5, 3), {"momentum": 0.3, "eps": 1e-3}),
    "3d": (nn.BatchNorm3d, (2, 3, 4, 3), (3, 2), {}),
    "momentum_none": (nn.BatchNorm2d, (3, 4, 4), (4, 2), {"momentum": None}),
    "no_affine": (nn.BatchNorm1d, (3, 6), (2, 5), {"affine": False}),
    "no_bias": (nn.BatchNorm1d, (3, 6), (3, 3), {"bias": False}),
    "no_running_stats": (nn.BatchNorm2d, (2, 3, 3), (4, 4), {"track_running_stats": False}),
    "empty_rank": (nn.BatchNorm2d, (2, 3, 3), (6, 0), {}),
}


def _group() -> dist.ProcessGroup:
    # A group with a short timeout: a collective mismatch fails the test instead of hanging it.
    return dist.new_group(timeout=timedelta(seconds=30))


def _case_data(name: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global input batch and loss weights of one step, identical in every process."""
    _, shape, sizes, _ = CASES[name]
    g = torch.Generator().manual_seed(1000 * step + len(name))
    x = torch.randn(sum(sizes), *shape, generator=g, dtype=torch.float64) * 2 + 0.5
    return x, torch.randn(sum(sizes), *shape, generator=g, dtype=torch.float64)


def _init_affine(bn: nn.Module) -> None:
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        if bn.weight is not None:
            bn.weight.copy_(torch.rand(bn.num_features, generator=g, dtype=torch.float64) + 0.5)
        if bn.bias is not None:
            bn.bias.copy_(torch.randn(bn.num_features, generator=g, dtype=torch.float64))


def _run_case(bn: nn.Module, name: str, rank: int | None) -> dict:
    """STEPS training steps with backward (grads accumulate), then one eval forward.
    rank=None: the whole global batch (reference); else this rank's slice."""
    sizes = CASES[name][2]
    lo, hi = (0, sum(sizes)) if rank is None else (sum(sizes[:rank]), sum(sizes[: rank + 1]))
    outs, grads = [], []
    bn.train()
    for step in range(STEPS):
        x, w = _case_data(name, step)
        x = x[lo:hi].clone().requires_grad_()
        out = bn(x)
        (out * w[lo:hi]).sum().backward()
        outs.append(out.detach())
        grads.append(x.grad)
    bn.eval()
    with torch.no_grad():
        eval_out = bn(_case_data(name, STEPS)[0][lo:hi])
    return {
        "out": outs,
        "grad_x": grads,
        "eval_out": eval_out,
        "grad_w": None if bn.weight is None else bn.weight.grad,
        "grad_b": None if bn.bias is None else bn.bias.grad,
        "state": {k: v.clone() for k, v in bn.state_dict().items()},
    }


def _reference(name: str) -> dict:
    cls, shape, _, kwargs = CASES[name]
    bn = cls(shape[0], dtype=torch.float64, **kwargs)
    _init_affine(bn)
    return _run_case(bn, name, None)


def _equivalence_worker(rank: int, world_size: int) -> dict:
    group = _group()
    results = {}
    for name, (_, shape, _, kwargs) in CASES.items():
        bn = SyncBatchNorm(shape[0], process_group=group, dtype=torch.float64, **kwargs)
        _init_affine(bn)
        results[name] = _run_case(bn, name, rank)
    x, w = _large_mean_batch()
    lo, hi = (0, 5) if rank == 0 else (5, 8)  # unequal: 5 and 3 samples
    results["large_mean"] = _large_mean_step(SyncBatchNorm(3, process_group=group), x[lo:hi], w[lo:hi])
    results["ddp"] = _ddp_accumulation(rank, world_size, group)
    return results


def _small_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 3 * 3, 2)
    ).double()


def _ddp_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    return [
        (torch.randn(8, 3, 5, 5, generator=g, dtype=torch.float64), torch.randint(0, 2, (8,), generator=g))
        for _ in range(2)
    ]


def _ddp_accumulation(rank: int | None, world_size: int, group: dist.ProcessGroup | None) -> dict:
    """Two accumulated micro-batches (the first under no_sync), unequal 5/3 rank split; the loss
    of each rank is scaled so that DDP's average is the mean over all 16 samples."""
    model = _small_net()
    if rank is not None:
        model, _ = convert_sync_batchnorm(model, group)
        model = nn.parallel.DistributedDataParallel(model)
    lo, hi = (0, 8) if rank is None else ((0, 5) if rank == 0 else (5, 8))
    for i, (x, y) in enumerate(_ddp_batches()):
        loss = F.cross_entropy(model(x[lo:hi]), y[lo:hi], reduction="sum") * world_size / 16
        if rank is not None and i == 0:
            with model.no_sync():  # SyncBN still syncs its statistics here
                loss.backward()
        else:
            loss.backward()
    module = model.module if rank is not None else model
    return {
        "grads": {k: p.grad.clone() for k, p in module.named_parameters()},
        "state": {k: v.clone() for k, v in module.state_dict().items()},
    }


def _large_mean_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """float32 inputs with mean 1e4 and std 1, where sum/sum-of-squares variance breaks down."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(8, 3, 5, 4, generator=g, dtype=torch.float64) + 1e4).float()
    return x, torch.randn(8, 3, 5, 4, generator=g)


def _large_mean_step(bn: nn.Module, x: torch.Tensor, w: torch.Tensor) -> dict:
    x = x.clone().requires_grad_()
    out = bn(x)
    (out * w).sum().backward()
    return {"out": out.detach(), "grad_x": x.grad, "running_var": bn.running_var.clone()}


@pytest.fixture(scope="module")
def two_rank_results() -> list[dict]:
    return run_distributed(_equivalence_worker, 2)  # one spawn for all cases (~3 s each)


@pytest.mark.parametrize("name", CASES)
def test_matches_batchnorm_on_the_concatenated_batch(two_rank_results, name):
    ref, r0, r1 = _reference(name), two_rank_results[0][name], two_rank_results[1][name]
    tol = dict(rtol=1e-10, atol=1e-10)  # float64, observed <= 1.5e-14: a formula slip is far above
    for step in range(STEPS):
        torch.testing.assert_close(
            torch.cat([r0["out"][step], r1["out"][step]]), ref["out"][step], **tol, msg=f"output, step {step}"
        )
        torch.testing.assert_close(
            torch.cat([r0["grad_x"][step], r1["grad_x"][step]]),
            ref["grad_x"][step],
            **tol,
            msg=f"input grad, step {step}",
        )
    torch.testing.assert_close(torch.cat([r0["eval_out"], r1["eval_out"]]), ref["eval_out"], **tol)
    for key in ("grad_w", "grad_b"):  # local gradients; DDP sums (and averages) them over ranks
        if ref[key] is None:
            assert r0[key] is None and r1[key] is None
        else:
            torch.testing.assert_close(r0[key] + r1[key], ref[key], **tol, msg=key)
    assert ref["state"].keys() == r0["state"].keys() == r1["state"].keys()
    for key, value in ref["state"].items():  # running_mean/var, num_batches_tracked
        torch.testing.assert_close(r0["state"][key], value, **tol, msg=key)
        torch.testing.assert_close(r1["state"][key], value, **tol, msg=key)


def test_large_mean_float32_is_stable(two_rank_results):
    x, w = _large_mean_batch()
    exact = _large_mean_step(nn.BatchNorm2d(3, dtype=torch.float64), x.double(), w.double())
    ours = {
        k: torch.cat([two_rank_results[0]["large_mean"][k], two_rank_results[1]["large_mean"][k]])
        for k in ("out", "grad_x")
    }
    # Observed: 3e-7 (out, grad_x) and 5e-8 relative (running_var); torch's own float32
    # BatchNorm2d on the concatenated batch is off by 9e-4 in the output.
    torch.testing.assert_close(ours["out"].double(), exact["out"], rtol=0, atol=1e-5)
    torch.testing.assert_close(ours["grad_x"].double(), exact["grad_x"], rtol=0, atol=1e-5)
    running_var = two_rank_results[0]["large_mean"]["running_var"].double()
    torch.testing.assert_close(running_var, exact["running_var"], rtol=1e-6, atol=0)

    # The naive float32 formula E[x^2] - E[x]^2 on the same batch is off by O(1): 8 for a
    # variance of 1, even negative.
    n = x.numel() // 3
    naive = (x.pow(2).sum((0, 2, 3)) / n - (x.sum((0, 2, 3)) / n) ** 2) * n / (n - 1)
    exact_var = (exact["running_var"] - 0.9) / 0.1  # undo the momentum-0.1 update from 1
    ours_var = (running_var - 0.9) / 0.1
    assert (naive - exact_var).abs().max() > 1000 * (ours_var - exact_var).abs().max()


def test_ddp_accumulation_matches_single_process(two_rank_results):
    ref = _ddp_accumulation(None, 1, None)
    for rank in range(2):
        for kind in ("grads", "state"):
            assert ref[kind].keys() == two_rank_results[rank]["ddp"][kind].keys()
            for key, value in ref[kind].items():
                torch.testing.assert_close(
                    two_rank_results[rank]["ddp"][kind][key],
                    value,
                    rtol=1e-10,
                    atol=1e-12,
                    msg=f"rank {rank} {kind} {key}",
                )


def _gradcheck_eval_worker(rank: int, world_size: int) -> dict:
    group = _group()
    g = torch.Generator().manual_seed(rank)  # different local inputs, the same shapes
    x = torch.randn(3, 2, 4, generator=g, dtype=torch.float64, requires_grad=True)
    w = (torch.rand(2, generator=g, dtype=torch.float64) + 0.5).requires_grad_()
    b = torch.randn(2, generator=g, dtype=torch.float64, requires_grad=True)
    x_fixed = x.detach().clone().requires_grad_()

    def active(x, w=None, b=None):
        return _SyncBatchNormFn.apply(x, w, b, None, None, 1e-5, 0.1, group)

    def passive(x, w=None, b=None):
        # The partner of the checking rank: its input stays x_fixed (0 * x: the perturbations of
        # gradcheck do not reach it) and it feeds zero output gradients. Both ranks running
        # gradcheck on their own input would perturb both inputs at once and mix in the other
        # rank's unit output gradients. The node stays on the path to x, so backward runs here
        # too and the collectives pair up.
        return active(x_fixed + 0 * x, w, b) * 0 + x

    ok = {}
    for checker in range(world_size):  # each rank takes a turn as the checked one
        fn = active if rank == checker else passive
        # Equal shapes on both ranks: gradcheck's sequence of forward/backward calls is the same.
        ok[f"rank{checker}"] = torch.autograd.gradcheck(fn, (x, w, b))
        ok[f"rank{checker}_no_affine"] = torch.autograd.gradcheck(fn, (x,))

    # Eval: rank 0 alone runs forwards. Any collective there would wait for rank 1, which sits
    # in a barrier of another group, and fail on the 30 s timeout.
    bn = SyncBatchNorm(2, process_group=group, dtype=torch.float64).eval()
    with torch.no_grad():
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
    eval_equal = True
    if rank == 0:
        for _ in range(3):
            eval_equal &= torch.equal(
                bn(x.detach()),
                F.batch_norm(x.detach(), bn.running_mean, bn.running_var, bn.weight, bn.bias, False, 0.0, bn.eps),
            )
    dist.barrier()
    return {**ok, "eval_equal": eval_equal}


def test_gradcheck_and_eval_without_communication():
    for result in run_distributed(_gradcheck_eval_worker, 2):
        assert len(result) == 5 and all(result.values()), result


def _compare_with_batchnorm() -> None:
    """SyncBN equals nn.BatchNorm2d bit for bit, training and eval."""
    ref = nn.BatchNorm2d(3, momentum=None)
    _init_affine(ref)
    ours = SyncBatchNorm(3, momentum=None)
    ours.load_state_dict(ref.state_dict())
    for step in range(3):
        x = torch.randn(4, 3, 5, 5, generator=torch.Generator().manual_seed(step))
        xr, xo = x.clone().requires_grad_(), x.clone().requires_grad_()
        ref(xr).pow(2).sum().backward()
        ours(xo).pow(2).sum().backward()
        assert torch.equal(xr.grad, xo.grad)
    for key, value in ref.state_dict().items():
        assert torch.equal(ours.state_dict()[key], value), key
    assert torch.equal(ours.weight.grad, ref.weight.grad) and torch.equal(ours.bias.grad, ref.bias.grad)
    ref.eval()
    ours.eval()
    assert torch.equal(ours(x), ref(x))


def test_no_process_group_is_plain_batchnorm():
    assert not dist.is_initialized()
    _compare_with_batchnorm()


def test_world_size_one_is_plain_batchnorm():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        _compare_with_batchnorm()
    finally:
        dist.destroy_process_group()


class MyBatchNorm(nn.Module):  # a custom norm that is no _BatchNorm: reported, left alone
    def forward(self, x):
        return x


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)
        self.bn = nn.BatchNorm2d(4, eps=1e-3, momentum=0.01)
        self.inner = nn.Sequential(nn.BatchNorm3d(2, affine=False), MyBatchNorm())


def test_convert_sync_batchnorm_keeps_parameters_buffers_and_settings():
    model = nn.Sequential(
        Block(),
        nn.BatchNorm1d(5, momentum=None, track_running_stats=False),
        nn.Sequential(nn.BatchNorm1d(6, bias=False).eval()),
    )
    with torch.no_grad():  # non-default state, so that "copied" is checked against something
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                _init_affine(m)
                if m.running_mean is not None:
                    m.running_mean.uniform_(-1, 1)
                    m.running_var.uniform_(0.5, 2)
                    m.num_batches_tracked.fill_(5)
    before = copy.deepcopy(model)
    old = dict(model.named_modules())
    params = dict(model.named_parameters())

    converted, skipped = convert_sync_batchnorm(model)

    assert converted is model and skipped == ["0.inner.1"]
    assert isinstance(converted[0].inner[1], MyBatchNorm)
    names = ["0.bn", "0.inner.0", "1", "2.0"]
    new = dict(converted.named_modules())
    for name in names:
        assert type(new[name]) is SyncBatchNorm, name
        for attr in ("num_features", "eps", "momentum", "affine", "track_running_stats", "training"):
            assert getattr(new[name], attr) == getattr(old[name], attr), (name, attr)
    assert new["2.0"].bias is None and not new["2.0"].training
    assert dict(converted.named_parameters()) == params  # the same Parameter objects
    assert converted.state_dict().keys() == before.state_dict().keys()
    for key, value in before.state_dict().items():
        assert torch.equal(converted.state_dict()[key], value), key

    # Converting again changes nothing; a BatchNorm root comes back as a new SyncBatchNorm.
    again, _ = convert_sync_batchnorm(converted)
    assert all(again.get_submodule(n) is new[n] for n in names)
    root, skipped = convert_sync_batchnorm(nn.BatchNorm2d(3))
    assert type(root) is SyncBatchNorm and skipped == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_convert_uses_torch_syncbn_on_cuda():
    model, skipped = convert_sync_batchnorm(nn.Sequential(nn.BatchNorm2d(3), MyBatchNorm()).cuda())
    assert type(model[0]) is nn.SyncBatchNorm and skipped == ["1"]


def test_a_run_whose_batchnorm_sees_part_of_the_global_batch_says_so_once(tmp_path):
    """W x K x b trains what one process trains, except BatchNorm's statistics: per rank without parallel.sync_bn,
    per micro-batch with K > 1. The run says which, once; where they are the global batch's, nothing."""
    net = nn.Sequential(nn.Conv2d(1, 2, 1), nn.BatchNorm2d(2), nn.Flatten(), nn.Linear(2, 1), nn.BatchNorm1d(1))
    ranks = batchnorm_caveat(net, world_size=2, steps=1)
    assert ranks is not None and "each of the 2 ranks' micro-batch" in ranks and "parallel.sync_bn=true" in ranks
    assert "(1, 4)" in ranks
    micro = batchnorm_caveat(convert_sync_batchnorm(net)[0], world_size=2, steps=2)  # synced: the K stay apart
    assert micro is not None and "each of the 2 micro-batches" in micro and "sync_bn" not in micro
    assert batchnorm_caveat(convert_sync_batchnorm(net)[0], world_size=2, steps=1) is None
    assert batchnorm_caveat(net, world_size=1, steps=1) is None
    assert batchnorm_caveat(nn.Linear(2, 1), world_size=2, steps=2) is None  # no BatchNorm
    assert batchnorm_caveat(net.eval(), world_size=2, steps=2) is None  # held in eval (frozen): no batch statistics
    out = run_in_process(
        tmp_path,
        "model=cnn",
        "model.width=4",
        "trainer.max_steps=1",
        "accumulation.steps=2",
        "trainer.test=false",
        "checkpoint.every=0",
    )
    assert out.count("note: BatchNorm") == 1 and "each of the 2 micro-batches" in out, out
