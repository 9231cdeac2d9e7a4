"""Losses that couple the global batch (trainkit/coupled.py, task=contrastive): the gradient of one window of
W=2 ranks x K=2 micro-batches x b is the gradient one process computes on the batch of 4b, while naive
accumulation (each micro-batch its own negatives) is clearly off; the second pass draws the first pass's dropout
masks; BatchNorm's running statistics move once per micro-batch; +experiment=digits_simclr trains the same
weights and kNN accuracy on 1 process and on 2 ranks x K=2.

Tolerances: float32 gradients of magnitude ~1e-2..1 summed in another order (micro-batches, ranks, DDP's
all-reduce) differ by ~1e-7 relative; 1e-5 absolute leaves a hundredfold margin, and the naive loop's gap is
thousands of times larger (asserted)."""

import contextlib
import math

import pytest
import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from helpers import compose_cfg, max_diff, rows, run_distributed, run_in_process, weights
from trainkit import config
from trainkit.coupled import CoupledWindows, note
from trainkit.data.digits_views import DigitsViews
from trainkit.dist import Dist
from trainkit.errors import ConfigError
from trainkit.models.simclr import SimCLR
from trainkit.tasks.contrastive import Contrastive, knn_predict, nt_xent

B, K, W = 4, 2, 2  # micro-batch, micro-batches per rank, ranks: a global batch of 16 samples
TOLERANCE = 1e-5


class NoAuto:
    """AutoBatch with data.batch_size=auto off (what CoupledWindows uses of it)."""

    enabled, K = False, K

    def micro_steps(self, micro):
        return enumerate(micro)

    def catching(self):
        return contextlib.nullcontext()


class Meter:
    def __init__(self):
        self.losses = []

    def add_micro_step(self, loss_sum):
        self.losses.append(loss_sum.detach())


def task() -> Contrastive:
    return Contrastive(bank=torch.utils.data.TensorDataset(torch.zeros(1)))


def views(samples: int = W * K * B) -> torch.Tensor:
    return torch.randn(samples, 2, 1, 8, 8, generator=torch.Generator().manual_seed(1))


def model(**kwargs) -> nn.Module:
    torch.manual_seed(0)
    return SimCLR((1, 8, 8), width=32, depth=1, dim=16, **kwargs)


def batches(x: torch.Tensor, first: int, count: int) -> list[dict]:
    """`count` micro-batches of B samples from sample first * B on."""
    labels = torch.zeros(len(x), dtype=torch.long)
    return [
        {"views": x[i * B : (i + 1) * B], "label": labels[i * B : (i + 1) * B]} for i in range(first, first + count)
    ]


def gradients(net: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in net.named_parameters()}


def coupled_step(net: nn.Module, micro: list, d: Dist, wrapped: nn.Module | None = None) -> Meter:
    """One coupled window's gradient in `net`'s .grad (scale: W / samples, as train.py's)."""
    meter = Meter()
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    windows = CoupledWindows(wrapped or net, task(), d, contextlib.nullcontext, scaler, NoAuto(), meter)
    windows.run(micro, d.world_size / (W * K * B), "no_sync")
    return meter


def reference(net: nn.Module, micro: list) -> torch.Tensor:
    """One process, the whole batch's loss with graph (each micro-batch's forward in turn: the same dropout draws
    and BatchNorm statistics as the window's), backward: the exact gradient in `net`'s .grad."""
    t = task()
    outputs = [net(t.unpack(batch)[0]) for batch in micro]
    loss = t.loss_sum(torch.cat(outputs), torch.zeros(0)) / (W * K * B)
    loss.backward()
    return loss.detach()


def _ranks(rank: int, world_size: int, channels: int | None = None) -> dict:
    d = Dist(rank, rank, world_size, torch.device("cpu"))
    net = model(channels=channels)
    micro = batches(views(), rank * K, K)
    meter = coupled_step(net, micro, d, DDP(net))
    coupled = gradients(net)
    # the usual loop: each micro-batch's loss over its own B samples (B - 1 negatives each)
    naive = model(channels=channels)
    ddp = DDP(naive)
    t = task()
    for k, batch in enumerate(micro):
        with ddp.no_sync() if k < K - 1 else contextlib.nullcontext():
            (t.loss_sum(ddp(t.unpack(batch)[0]), batch["label"]) * world_size / (W * K * B)).backward()
    return {"coupled": coupled, "naive": gradients(naive), "loss": sum(meter.losses)}


@pytest.mark.parametrize("channels", [None, 4], ids=["mlp", "conv-groupnorm"])
def test_two_ranks_x_k2_give_the_one_process_gradient_and_naive_accumulation_does_not(channels):
    ranks = run_distributed(_ranks, W, channels)
    net = model(channels=channels)
    loss = reference(net, batches(views(), 0, W * K))
    exact = gradients(net)
    gap = max_diff(ranks[0]["naive"], exact)
    print(f"max |coupled - one process| {max_diff(ranks[0]['coupled'], exact):.2e}, naive accumulation's {gap:.2e}")
    assert max_diff(ranks[0]["coupled"], exact) < TOLERANCE
    assert max_diff(ranks[1]["coupled"], ranks[0]["coupled"]) == 0  # DDP's average: the same on both
    assert gap > 1000 * TOLERANCE  # what the usual loop computes for this loss is another gradient
    # the meter holds the global batch's loss once: on rank 0 (its sum over ranks is the row's loss)
    assert ranks[0]["loss"] / (W * K * B) == pytest.approx(loss.item(), rel=1e-6) and ranks[1]["loss"] == 0


def test_the_second_pass_draws_the_first_pass_s_dropout_masks():
    one = Dist(0, 0, 1, torch.device("cpu"))
    micro = batches(views(), 0, W * K)  # 1 process, 4 micro-batches
    torch.manual_seed(5)
    net = model(dropout=0.5)
    state = torch.get_rng_state()
    coupled_step(net, micro, one)
    torch.set_rng_state(state)
    exact = model(dropout=0.5)
    torch.set_rng_state(state)
    reference(exact, micro)
    assert max_diff(gradients(net), gradients(exact)) < TOLERANCE


class BatchNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 8))

    def forward(self, x):
        return self.layers(x)


def test_batchnorm_statistics_move_once_per_micro_batch_as_in_the_usual_loop():
    one = Dist(0, 0, 1, torch.device("cpu"))
    micro = batches(views(), 0, W * K)
    net, exact = BatchNormNet(), BatchNormNet()
    coupled_step(net, micro, one)
    reference(exact, micro)  # each micro-batch's forward once, with graph
    norm, norm_exact = net.layers[2], exact.layers[2]
    assert int(norm.num_batches_tracked) == W * K
    assert torch.allclose(norm.running_mean, norm_exact.running_mean, atol=1e-7)
    assert torch.allclose(norm.running_var, norm_exact.running_var, atol=1e-7)
    assert max_diff(gradients(net), gradients(exact)) < TOLERANCE  # per-micro-batch statistics in both passes


def test_batchnorm_with_a_coupled_loss_is_said_to_be_inexact_once():
    assert note(BatchNormNet(), K=2, world_size=1) is not None and "micro-batch by" in note(BatchNormNet(), 2, 1)
    assert "micro-batch of each rank" in note(BatchNormNet(), 1, 2)
    assert note(BatchNormNet(), K=1, world_size=1) is None  # one process, one micro-batch: the whole batch
    assert note(model(), K=4, world_size=2) is None  # LayerNorm: exact at any allocation


def test_nt_xent_is_each_view_s_cross_entropy_against_its_other_view_among_every_other_row():
    output = torch.randn(6, 5, generator=torch.Generator().manual_seed(0))  # samples 0, 1, 2: rows 2i, 2i + 1
    z = F.normalize(output, dim=1)
    logits = (z @ z.T / 0.5).fill_diagonal_(-math.inf)  # a view is never its own negative
    expected = F.cross_entropy(logits, torch.tensor([1, 0, 3, 2, 5, 4]), reduction="none")
    assert torch.allclose(nt_xent(output, 0.5), expected, atol=1e-6)


def _at(*degrees: float) -> torch.Tensor:
    return torch.tensor([[math.cos(math.radians(a)), math.sin(math.radians(a))] for a in degrees])


def test_knn_votes_by_similarity_among_the_k_nearest():
    query = _at(0)
    # One label-0 neighbour at 5 degrees outweighs two label-1 ones at 70 (0.996 > 2 x 0.342; a plain count says 1);
    # the label-2 row at 180 degrees is not among the 3 nearest.
    assert knn_predict(query, _at(5, 70, -70, 180), torch.tensor([0, 1, 1, 2]), k=3).tolist() == [0]
    # Two label-1 neighbours at 30 degrees outweigh the nearest, label 0 (2 x 0.866 > 1): k=1 says 0.
    bank, labels = _at(0, 30, -30), torch.tensor([0, 1, 1])
    assert knn_predict(query, bank, labels, k=3).tolist() == [1]
    assert knn_predict(query, bank, labels, k=1).tolist() == [0]
    assert knn_predict(query * 7, bank, labels, k=5).tolist() == [1]  # a query of any length; k beyond the bank


def test_digits_views_are_the_seed_s_and_each_transform_is_drawn():
    images, labels = torch.rand(3, 1, 8, 8), torch.arange(3)
    still = {"shift": 0, "rotation": 0, "scale": 0, "contrast": 0, "noise": 0}
    assert torch.equal(DigitsViews(images, labels, **still)[1]["views"], images[1].expand(2, 1, 8, 8))  # no-op: exact
    torch.manual_seed(3)
    first = DigitsViews(images, labels)[1]["views"]
    torch.manual_seed(3)
    assert torch.equal(DigitsViews(images, labels)[1]["views"], first)  # SeededBatches' seed decides the views
    for name in ("shift", "rotation", "scale"):  # each geometric transform alone moves the pixels, differently per view
        views = DigitsViews(images, labels, **{**still, name: {"shift": 1, "rotation": 15, "scale": 0.15}[name]})[1]
        assert (views["views"] - images[1]).abs().amax(dim=(1, 2, 3)).min() > 1e-3, name
        assert not torch.equal(views["views"][0], views["views"][1]), name


def test_the_views_strengths_are_data_settings_typed_and_passed_on():
    still = [f"data.splits.{name}=0" for name in ("shift", "rotation", "scale", "contrast", "noise")]
    cfg = compose_cfg("+experiment=digits_simclr", *still)
    config.check(cfg)
    train = instantiate(cfg.data.splits)[0]
    assert torch.equal(train[5]["views"], train.images[5].expand(2, 1, 8, 8))  # every strength 0 reached DigitsViews
    with pytest.raises(ConfigError, match="data.splits.rotation"):
        config.check(compose_cfg("+experiment=digits_simclr", "data.splits.rotation=wide"))


SIMCLR = [
    "+experiment=digits_simclr",
    "trainer.max_steps=4",
    "trainer.eval_every=2",
    "checkpoint.every=0",
    "trainer.clip_grad_norm=null",
]


@pytest.mark.slow
def test_digits_simclr_on_2_ranks_x_k2_trains_what_one_process_trains(tmp_path):
    """4 SGD steps at lr 0.1, unclipped (clipping to a norm would hide a gradient's scale). Summed in another order
    the weights part by ~1e-8 a step (3e-8 after 4); besides, a ReLU input or a max-pool tie within rounding of
    its switch routes one sample's gradient term differently (such a step: ~1e-6; at lr 0.5 they grow ~50x a
    step, 1.4e-4 by step 6). Half the gradient (a missing W in the scale) is 3.7e-5 off, no gather far more."""
    run_in_process(tmp_path / "one", *SIMCLR, "optim=sgd")
    run_in_process(tmp_path / "two", *SIMCLR, "optim=sgd", "accumulation.steps=2", nproc=2)
    print(f"max |2 ranks x K=2 - 1 process| {max_diff(weights(tmp_path / 'one'), weights(tmp_path / 'two')):.1e}")
    assert max_diff(weights(tmp_path / "one"), weights(tmp_path / "two")) < TOLERANCE
    one, two = ([r for r in rows(tmp_path / d) if "val/knn_acc" in r] for d in ("one", "two"))
    assert [r["val/knn_acc"] for r in one] == [r["val/knn_acc"] for r in two]
    losses = [[r["loss"] for r in rows(tmp_path / d) if "loss" in r] for d in ("one", "two")]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)


@pytest.mark.slow
def test_an_out_of_memory_in_the_coupled_passes_halves_the_micro_batch_and_trains_the_fixed_run(tmp_path):
    """data.batch_size=auto with the coupled loss: the model runs out of memory above 16 samples (32 views) in
    either pass; the window runs again at half the micro-batch, twice K, until it fits (64 -> 32 -> 16, K=4), and
    the run is the one at micro-batch 16 throughout: the same weights bit for bit."""
    small = ["accumulation.global_batch_size=64", "optim=sgd", "optim.lr=0.5"]
    faulty = ["model._target_=helpers.faulty_model", "+model.name=trainkit.models.simclr.SimCLR", "+model.fault=oom"]
    out = run_in_process(tmp_path / "auto", *SIMCLR, *small, "data.batch_size=auto", *faulty, "+model.oom_above=32")
    run_in_process(tmp_path / "fixed", *SIMCLR, *small, "data.batch_size=16", "accumulation.steps=4")
    assert out.count("micro-batch 64 -> 32 -> 16 (out of memory), K 1 -> 2 -> 4") == 1, out
    auto_rows = rows(tmp_path / "auto")
    assert {r["micro_batch"] for r in auto_rows if "micro_batch" in r} == {16}
    fixed = weights(tmp_path / "fixed")
    auto = {key.removeprefix("inner."): value for key, value in weights(tmp_path / "auto").items()}  # Faulty's
    assert auto.keys() == fixed.keys() and all(torch.equal(value, fixed[key]) for key, value in auto.items())
