"""model.activation_checkpointing: a checkpointed training step is the same step, bit for bit (loss,
gradients, BatchNorm buffers, the RNG state it leaves), it reruns each segment's forward once in
backward and never in eval or under no_grad, and it composes with DDP no_sync and FSDP2 units.

Bit-exact (torch.equal) on CPU: the recomputation runs the same kernels on the same inputs with the
same RNG state (non-reentrant checkpoint replays it: the same dropout masks), so nothing differs
that could round differently."""

import collections
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from hydra.utils import instantiate
from torch import nn
from torch.distributed.tensor import DTensor

from helpers import ROOT, run_distributed, run_in_process, small_resnet
from helpers import rows as rows_of
from trainkit import config  # noqa: F401  (registers the schema)
from trainkit.accumulate import sync_context, syncs_now
from trainkit.dist import Dist
from trainkit.models.cnn import cnn
from trainkit.models.gpt import GPT, gpt
from trainkit.models.resnet import resnet18
from trainkit.parallel import wrap
from trainkit.recompute import Staged


def build(name: str, checkpointing: bool) -> nn.Module:
    torch.manual_seed(0)
    if name == "gpt":  # dropout everywhere: attention, residual, MLP, embeddings
        return gpt(vocab_size=14, block_size=16, n_layer=3, dropout=0.2, activation_checkpointing=checkpointing)
    if name == "cnn":
        return cnn(3, 10, width=8, dropout=0.3, activation_checkpointing=checkpointing)
    if name == "small_resnet":  # resnet18's structure and checkpointed segments, 1/250 of its parameters
        return small_resnet(3, 10, activation_checkpointing=checkpointing)
    return resnet18(3, 10, small_input=True, activation_checkpointing=checkpointing)


def batch(name: str, seed: int = 1, size: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if name == "gpt":
        return torch.randint(0, 14, (size, 16), generator=g), torch.randint(0, 14, (size, 16), generator=g)
    return torch.randn(size, 3, 8, 8, generator=g), torch.randint(0, 10, (size,), generator=g)


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return F.cross_entropy(out.flatten(0, -2), y.flatten())


def segment_heads(name: str, model: Any) -> list[nn.Module]:
    """The first module each checkpointed segment calls: its forward runs again in backward."""
    if name == "gpt":
        return list(model.blocks)
    if name == "cnn":
        return [layer for layer in model if isinstance(layer, nn.Conv2d)]
    return [getattr(model, f"layer{i}")[0] for i in range(1, 5)]


def head(name: str, model: Any) -> nn.Module:
    """A module outside every segment: its forward runs once."""
    return model.lm_head if name == "gpt" else model[-1] if name == "cnn" else model.fc


MODELS = ["gpt", "cnn", "resnet18"]


@pytest.mark.parametrize("name", MODELS)
def test_a_checkpointed_step_is_the_same_step_bit_for_bit(name):
    results = []
    for checkpointing in (False, True):
        model = build(name, checkpointing)
        x, y = batch(name)
        torch.manual_seed(2)  # dropout's masks
        loss = loss_of(model, x, y)
        loss.backward()
        grads: dict[str, Any] = {n: p.grad for n, p in model.named_parameters()}
        results.append((loss.detach(), grads, model.state_dict(), torch.get_rng_state()))
    (loss_a, grads_a, state_a, rng_a), (loss_b, grads_b, state_b, rng_b) = results
    assert torch.equal(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys() and all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)
    # the same names (a checkpoint loads either way), the same BatchNorm running statistics and
    # num_batches_tracked: the recomputation does not update them a second time
    assert state_a.keys() == state_b.keys() and all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    assert torch.equal(rng_a, rng_b)  # the next step draws the same masks too
    if name == "gpt":  # dropout is live: another RNG state gives another loss
        model = build(name, True)
        torch.manual_seed(3)
        assert not torch.equal(loss_of(model, *batch(name)), loss_a)


@pytest.mark.parametrize("name", MODELS)
def test_training_reruns_each_segment_in_backward_eval_and_no_grad_never(name):
    model = build(name, checkpointing=True)
    heads, calls = segment_heads(name, model) + [head(name, model)], collections.Counter[int]()
    for i, module in enumerate(heads):
        module.register_forward_pre_hook(lambda *_, i=i: calls.update([i]))
    x, y = batch(name)

    def forwards(train: bool, grad: bool, backward: bool) -> list[int]:
        calls.clear()
        model.train(train)
        with torch.set_grad_enabled(grad):
            loss = loss_of(model, x, y)
        if backward:
            loss.backward()
        return [calls[i] for i in range(len(heads))]

    once, segments = [1] * len(heads), len(heads) - 1
    assert forwards(train=True, grad=True, backward=False) == once  # the forward itself
    assert forwards(train=True, grad=True, backward=True) == [2] * segments + [1]  # + the recomputation
    assert forwards(train=False, grad=True, backward=True) == once  # eval: nothing is checkpointed
    assert forwards(train=True, grad=False, backward=False) == once  # no graph, nothing to save


def test_the_config_key_reaches_each_built_in_model_and_mlp_refuses_it():
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        for overrides, checkpointed in [
            (["model=gpt", "data=addition"], lambda m: isinstance(m, GPT) and m.activation_checkpointing),
            (["model=cnn"], lambda m: isinstance(m, Staged) and len(m.stages) == 3),
            (
                ["model=resnet18", "data=fake"],
                lambda m: isinstance(m.layer4, Staged),
            ),
        ]:
            assert not checkpointed(instantiate(compose("train", overrides=overrides).model))
            cfg = compose("train", overrides=[*overrides, "model.activation_checkpointing=true"])
            assert checkpointed(instantiate(cfg.model)), overrides
        with pytest.raises(ConfigCompositionException, match="activation_checkpointing"):  # mlp: no segments
            compose("train", overrides=["model=mlp", "model.activation_checkpointing=true"])


# --- DDP no_sync and FSDP2 -------------------------------------------------------------------

# (model, mode, FSDP units, sync_bn). FSDP: GPT's Block and resnet18's BasicBlock as units put
# FSDP2's hooks inside the checkpointed segment (the backward recomputation runs them again);
# resnet18's default units are layer1..layer4, the segments themselves (hooks outside). The resnet
# is helpers.small_resnet: resnet18's blocks and segments, without the 11 M parameters to shard.
RUNS = [
    ("gpt", "ddp", None, False),
    ("cnn", "ddp", None, True),  # SyncBN: its recomputation all-gathers again, on every rank alike
    ("gpt", "fsdp", ["Block"], False),
    ("small_resnet", "fsdp", ["BasicBlock"], False),
    ("small_resnet", "fsdp", None, False),
]


def _local(t):
    return None if t is None else (t.to_local() if isinstance(t, DTensor) else t).clone()


def _accumulated_window(rank, world_size):
    """Each run with and without checkpointing: K=2 micro-batches under no_sync, then an AdamW
    step and one more micro-batch; this rank's gradients (shards), buffers and parameters."""
    d = Dist(rank, rank, world_size, torch.device("cpu"))
    out = []
    for name, mode, units, sync_bn in RUNS:
        got = []
        for checkpointing in (False, True):
            model, _ = wrap(build(name, checkpointing), mode, d, sync_bn, shard_units=units)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            torch.manual_seed(10 + rank)  # dropout masks differ between ranks, as in train.py
            grads = []
            for k in range(3):  # micro-steps 0, 1: one window (no_sync); 2: the next window
                with sync_context(model, syncs_now("no_sync", k % 2, 2)):
                    loss_of(model, *batch(name, seed=100 * rank + k)).backward()
                if k == 1:
                    grads = [_local(p.grad) for p in model.parameters()]
                    optimizer.step()
                    optimizer.zero_grad()
            grads += [_local(p.grad) for p in model.parameters()]
            got.append(grads + [_local(t) for t in model.buffers()] + [_local(p) for p in model.parameters()])
        out.append(all(a is b is None or torch.equal(a, b) for a, b in zip(*got, strict=True)))
    return out


def test_ddp_no_sync_and_fsdp2_units_give_the_same_gradients():
    for rank_result in run_distributed(_accumulated_window, 2):
        assert rank_result == [True] * len(RUNS), list(zip(RUNS, rank_result, strict=True))


# --- end to end ------------------------------------------------------------------------------

E2E = [
    "model=gpt",
    "data=addition",
    "data.num_train=200",
    "data.num_val=90",
    "data.batch_size=8",
    "model.dropout=0.1",
    "trainer.max_steps=2",
    "trainer.log_every=1",
    "checkpoint.every=0",
    "parallel=fsdp",
    "parallel.shard_units=[Block]",
]


@pytest.mark.slow
def test_fsdp_training_with_checkpointing_is_training_without(tmp_path):
    for checkpointing in ("false", "true"):
        run_in_process(tmp_path / checkpointing, *E2E, f"model.activation_checkpointing={checkpointing}", nproc=2)
    rows = {c: rows_of(tmp_path / c, test=True) for c in ("false", "true")}
    keys = ("step", "loss", "grad_norm", "val/loss", "test/loss")
    assert len(rows["true"]) == 3  # two training rows and the test row
    assert [{k: r.get(k) for k in keys} for r in rows["true"]] == [{k: r.get(k) for k in keys} for r in rows["false"]]
    a, b = (torch.load(tmp_path / c / "model.pt", weights_only=True) for c in ("false", "true"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
