"""model=timm: timm's zoo by name. Its classes and channels come from the data, an unknown name is one
line, parallel=fsdp shards per residual block with no extra keys, 2 DDP / FSDP ranks train as one
process at the same global batch (SyncBN for the ResNet's BatchNorm), activation checkpointing is the
same step bit for bit. (trainer.compile on a timm ResNet trained as eager to 3.6e-7 when tried; test_compile.py
tests compile itself: a timm copy of it cost the suite 32 s of inductor's cold start.)"""

import pytest
import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from torch.distributed.fsdp import FSDPModule

from helpers import compose_cfg, max_diff, run_distributed, run_in_process, weights
from trainkit import config, optim
from trainkit.dist import Dist
from trainkit.errors import ConfigError
from trainkit.models.timm import timm_model
from trainkit.parallel import fsdp_units, wrap

# The smallest timm ResNet (4 BasicBlocks, BatchNorm) at 16x16 and a ViT-Tiny at 32x32 (patch 16: 4
# tokens, 12 Blocks; the trained one 2, each an FSDP unit), 2 SGD steps of a global batch 16 on data=fake.
SMALL = ["model=timm", "data=fake", "data.splits.train_size=64", "data.splits.val_size=16", "logger=none"]
RESNET = [*SMALL, "model.name=resnet10t", "data.shape=[3,16,16]"]
VIT = [*SMALL, "model.name=vit_tiny_patch16_224", "data.shape=[3,32,32]"]
VIT_2 = [*VIT, "+model.kwargs.depth=2"]  # timm's depth: a fifth of the 12 Blocks' time under FSDP
STEPS = ["optim=sgd", "optim.lr=0.1", "trainer.max_steps=2", "trainer.eval_every=2", "checkpoint.every=0"]
STEPS += ["checkpoint.monitor=null"]  # no best checkpoint, no model_best.pt: a fifth of a run's CPU, writing
ONE, TWO = ["data.batch_size=16"], ["data.batch_size=8"]
# SGD's update is lr x gradient: 2 ranks and one process differ by the gradient's reduction-order
# rounding (the all-reduce's sum of two halves against one sum; SyncBN's merged statistics against one
# batch's): measured 1.2e-7 (ResNet), 3.7e-9 (the 2-Block ViT); 1e-5 is 80x that, and BatchNorm on each
# rank's half alone (sync_bn off) moves them by 9.0e-2 (asserted below: over 1e-3).
TOLERANCE = dict(rtol=0, atol=1e-5)


def assert_close(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], **TOLERANCE, msg=key)


def test_classes_and_channels_come_from_the_data():
    cfg = compose_cfg("model=timm", "model.name=resnet10t", "data=fake", "data.num_classes=7", "data.shape=[1,16,16]")
    model = instantiate(cfg.model)
    assert model(torch.randn(2, 1, 16, 16)).shape == (2, 7)
    cfg = compose_cfg(*VIT, "data.num_classes=5")  # the ViT takes its image size from the data too
    model = instantiate(cfg.model)
    assert model.patch_embed.img_size == (32, 32) and model(torch.randn(2, 3, 32, 32)).shape == (2, 5)
    # Set by hand against the data: named before anything is built (else a shape error at the first forward).
    for override, line in [
        ("model.img_size=64", "model.img_size=64 must equal the size of data.shape=[3,32,32]"),
        ("model.in_chans=1", "model.in_chans=1 must equal the channels of data.shape=[3,32,32]"),
        ("model.num_classes=5", "model.num_classes=5 must be at least data.num_classes=10"),
    ]:
        with pytest.raises(ConfigError, match=f"^{line}$".replace("[", r"\[")):
            config.check(compose_cfg(*VIT, override))


def test_an_unknown_name_is_one_line_with_close_matches():
    with pytest.raises(ConfigError) as error:
        timm_model("resnet181", 10, 3)
    assert str(error.value) == (
        "model.name=resnet181 is not a timm model; close: resnet18, resnet18d, resnet101, resnet101_clip, "
        "resnet101_clip_gap (all: timm.list_models('PATTERN'))"
    )
    with pytest.raises(ConfigError) as error:  # a misspelling: close by the name's start too
        timm_model("vit_tinny", 10, 3)
    assert str(error.value).startswith("model.name=vit_tinny is not a timm model; close: vit_tiny_patch16_224,")


@pytest.mark.parametrize(
    "name,why,fit",
    [
        ("convnext_atto", "Kernel size: (2 x 2). Kernel size can't be greater than actual input size", 32),
        ("vit_tiny_patch16_224", "Kernel size: (16 x 16). Kernel size can't be greater than actual input size", 16),
    ],
)
def test_a_model_that_cannot_take_the_data_is_one_line_before_the_run_dir(tmp_path, capsys, name, why, fit):
    """Issue 32: on digits' 8x8 the summary said "FLOPs: not measured (...)", then the first forward's 71-89
    line traceback, exit 1, and a run dir was left."""
    with pytest.raises(ConfigError) as error:
        timm_model(name, 10, 1, img_size=8)
    said = str(error.value)
    assert said.startswith(f"model.name={name} does not take data.shape=[1,8,8] (Calculated padded input size")
    assert why in said and f"the smallest square input it takes is {fit}x{fit} (of 16, 32, ..., 1024)" in said
    timm_model(name, 10, 1, img_size=fit)  # which fits
    run_dir = tmp_path / "run"
    run_dir.mkdir()  # as Hydra makes it before the task: a refused run removes it
    with pytest.raises(SystemExit) as refused:
        run_in_process(run_dir, "model=timm", f"model.name={name}", "trainer.max_steps=1")  # data=digits
    assert refused.value.code == 2 and not run_dir.exists()
    assert capsys.readouterr().err.strip().splitlines() == [f"error: {said}"]


def test_pretrained_weights_out_of_reach_are_one_line(tmp_path, monkeypatch, capsys):
    from huggingface_hub import constants

    # Never a download in the suite, network or not, and an empty cache: the hub's settings, which it reads from
    # HF_HUB_OFFLINE and HF_HOME when imported (this process may have imported it already), set where it reads them.
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    with pytest.raises(SystemExit) as refused:
        run_in_process(tmp_path / "run", *RESNET, "model.pretrained=true", "trainer.max_steps=1")
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert refused.value.code == 2 and "model.pretrained=true: no weights for resnet10t" in line and "HF_HOME" in line


def test_units_are_the_residual_blocks():
    resnet = timm_model("resnet10t", 10, 3)
    assert fsdp_units(resnet) == [block for stage in (resnet.layer1, resnet.layer2, resnet.layer3, resnet.layer4)
                                  for block in stage]  # fmt: skip
    vit = timm_model("vit_tiny_patch16_224", 10, 3, img_size=32)
    assert fsdp_units(vit) == list(vit.blocks)


def _sharded_classes(rank, world_size):
    torch.manual_seed(0)
    d = Dist(rank, rank, world_size, torch.device("cpu"))
    model, _ = wrap(timm_model("vit_tiny_patch16_224", 10, 3, img_size=32), "fsdp", d)
    # fully_shard swaps a module's class for FSDP<its class>
    return sorted(type(m).__name__.removeprefix("FSDP") for m in model.modules() if isinstance(m, FSDPModule))


def test_fsdp_shards_each_vit_block_with_no_extra_keys():
    for classes in run_distributed(_sharded_classes, 2):
        assert classes == ["Block"] * 12 + ["VisionTransformer"]  # 12 Blocks, and the root


@pytest.fixture(scope="module")
def resnet_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("resnet")
    run_in_process(root / "single", *RESNET, *STEPS, *ONE)
    for name, extra in [("ddp", ["parallel=ddp"]), ("fsdp", ["parallel=fsdp"]), ("no_sync_bn", ["parallel=ddp"])]:
        sync_bn = "parallel.sync_bn=false" if name == "no_sync_bn" else "parallel.sync_bn=true"
        run_in_process(root / name, *RESNET, *STEPS, *TWO, *extra, sync_bn, nproc=2)
    return {name: weights(root / name) for name in ("single", "ddp", "fsdp", "no_sync_bn")}


def test_a_resnet_on_two_ranks_trains_as_one_process(resnet_runs):
    single, ddp, fsdp = resnet_runs["single"], resnet_runs["ddp"], resnet_runs["fsdp"]
    print(f"max |DDP - single| {max_diff(ddp, single):.2e}, |FSDP - DDP| {max_diff(fsdp, ddp):.2e}")
    assert_close(ddp, single)
    assert_close(fsdp, ddp)
    # Without SyncBN each rank normalises by its own half batch: another model, far outside the tolerance.
    apart = max_diff(resnet_runs["no_sync_bn"], single)
    print(f"max |DDP without sync_bn - single| {apart:.2e}")
    assert apart > 1e-3


def test_a_vit_under_fsdp_trains_as_one_process(tmp_path):
    run_in_process(tmp_path / "single", *VIT_2, *STEPS, *ONE)
    run_in_process(tmp_path / "fsdp", *VIT_2, *STEPS, *TWO, "parallel=fsdp", nproc=2)
    single, fsdp = weights(tmp_path / "single"), weights(tmp_path / "fsdp")
    print(f"max |FSDP - single| {max_diff(fsdp, single):.2e}")
    assert_close(fsdp, single)
    # Each Block checkpointed inside its FSDP unit (FSDP2's hooks around the segment): the same run, bit for bit.
    checkpointing = "model.activation_checkpointing=true"
    run_in_process(tmp_path / "ac", *VIT_2, *STEPS, *TWO, "parallel=fsdp", checkpointing, nproc=2)
    checkpointed = weights(tmp_path / "ac")
    assert all(torch.equal(checkpointed[key], fsdp[key]) for key in fsdp)


@pytest.mark.parametrize("name", ["resnet10t", "vit_tiny_patch16_224"])
def test_activation_checkpointing_is_the_same_step_bit_for_bit(name):
    results, recomputed = [], []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = timm_model(name, 10, 3, img_size=32, activation_checkpointing=checkpointing)
        calls: list[int] = []  # the forwards of each block's first layer: rerun in a checkpointed backward
        for block in fsdp_units(model):
            next(block.children()).register_forward_pre_hook(lambda *_, c=calls: c.append(1))
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 10, (4,), generator=g)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        results.append((loss.detach(), grads, model.state_dict()))
        recomputed.append(len(calls))
    (loss_a, grads_a, state_a), (loss_b, grads_b, state_b) = results
    assert torch.equal(loss_a, loss_b)
    assert all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)
    assert all(torch.equal(state_a[n], state_b[n]) for n in state_a)  # BatchNorm's running statistics too
    blocks = len(fsdp_units(model))
    assert recomputed == [blocks, 2 * blocks]  # each block once in forward, once more in backward


def test_layer_decay_follows_timms_group_matcher():
    resnet = compose_cfg("model=timm", "model.name=resnet18", "optim.layer_decay=0.5")
    config.typed(resnet)
    settings = optim.plan(resnet.optim, instantiate(resnet.model)).settings  # stem 0, 8 blocks, the head 9
    assert settings["conv1.weight"][0] == 0.5**9 and settings["layer4.1.conv2.weight"][0] == 0.5
    assert settings["fc.weight"][0] == 1
