"""Runs that build on runs: model.init.* (a finished run's weights into a new run), optim.groups (frozen parts,
lr scales by name, carried to DDP and FSDP by name), exact on any allocation, resumable without the parent."""

import os
import shutil
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

import helpers
from helpers import assert_equal, run_in_process, weights
from helpers import rows as metrics_rows
from trainkit import config, optim
from trainkit.errors import ConfigError
from trainkit.parent import Parent, load_into, model_node, remap
from trainkit.progress import groups_lr

# A small mlp (Linear layers 1, 4, 7) trained briefly: the parent of the runs below.
PARENT = ["model.width=16", "trainer.max_steps=3", "trainer.eval_every=3", "trainer.test=false"]
# Its chained run: the first layer frozen, the second at lr x 0.1, the last one's bias frozen (a unit of FSDP's
# with mixed requires_grad), SGD (equivalences compare SGD steps).
GROUPS = 'optim.groups=[{params: "1.*", frozen: true}, {params: "4", lr_scale: 0.1}, {params: 7.bias, frozen: true}]'
FROZEN = ("1.weight", "1.bias", "7.bias")
CHAINED = [
    "model.width=16",
    "optim=sgd",
    "optim._target_=helpers.RecordingSGD",  # torch's SGD, recording each step's group lrs
    "sched=cosine",
    "sched.warmup_steps=2",
    GROUPS,
    "trainer.max_steps=6",
    "trainer.log_every=1",
    "trainer.eval_every=100",
    "trainer.test=false",
    "checkpoint.every=3",
]
TRAINABLE = (16 * 16 + 16) + 10 * 16  # layer 4, 7.weight: what a step reduces


@pytest.fixture(scope="module")
def parent(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("parent")
    run_in_process(run_dir, *PARENT)
    return run_dir


def chained(run_dir: Path, parent: Path, *overrides: str, nproc: int = 1) -> str:
    return run_in_process(run_dir, *CHAINED, f"+model.init.from={parent}", *overrides, nproc=nproc)


def rows(run_dir: Path) -> list[dict]:
    return [row for row in metrics_rows(run_dir, timings=False) if "loss" in row]


def test_parent_opens_a_run_dir_or_a_file_and_builds_its_model(parent, tmp_path):
    p = Parent.open(parent)
    assert p.run_dir == parent and p.weights_path == parent / "model.pt" and p.config is not None
    model = p.build_model()
    assert_equal(model.state_dict(), weights(parent), "model")
    copy = p.copy_into(tmp_path / "copy")
    again = Parent.open(copy, "last")  # the copy is a run dir of its own
    assert_equal(again.state_dict(), p.state_dict(), "copy")
    assert again.config == p.config
    assert Parent.open(parent / "model_best.pt").config is None
    assert set(remap({"encoder.0.w": 1, "head.0.w": 2, "x": 3}, {"head.": None, "encoder.": "enc."})) == {
        "enc.0.w",
        "x",
    }


def refusal(run_dir: Path, capsys, *overrides: str) -> str:
    """The one line a refused chained run prints (exit status 2)."""
    with pytest.raises(SystemExit) as exit:
        run_in_process(run_dir, *CHAINED, *overrides)
    err = capsys.readouterr().err.strip()
    assert exit.value.code == 2 and len(err.splitlines()) == 1, err
    return err


def test_an_init_with_a_missing_key_a_wrong_shape_or_no_model_best_is_one_line_exit_2(parent, tmp_path, capsys):
    state = weights(parent)
    del state["7.bias"]
    torch.save(state, tmp_path / "short.pt")
    err = refusal(tmp_path / "a", capsys, f"+model.init.from={tmp_path / 'short.pt'}")
    assert err == (
        f"error: model.init.from={tmp_path / 'short.pt'} does not fit the model: missing 7.bias "
        "(model.init.map drops or renames prefixes, model.init.strict=false loads the keys that fit)"
    )
    err = refusal(tmp_path / "b", capsys, f"+model.init.from={parent}", "model.width=8")
    assert err.endswith(
        "other shape than the model's: 1.weight [16, 64] vs [8, 64]; 1.bias [16] vs [8]; "
        "4.weight [16, 16] vs [8, 8] ... (model.init.exclude keeps the model's own; Sequential has no adapt_init)"
    )
    bare = tmp_path / "bare"
    shutil.copytree(parent, bare, ignore=shutil.ignore_patterns("model_best.pt"))
    err = refusal(tmp_path / "c", capsys, f"+model.init.from={bare}", "+model.init.weights=best")
    assert err == (
        f"error: model.init.from={bare} has no model_best.pt (model.init.weights=best): the run kept no best "
        "checkpoint (checkpoint.monitor=null, or no evaluation)"
    )


def test_a_parent_key_the_model_lacks_is_refused_and_the_longest_prefix_decides(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    state = {**model.state_dict(), "9.weight": torch.zeros(1)}  # a key the model has no place for
    torch.save(state, tmp_path / "extra.pt")
    init = OmegaConf.create({"from": str(tmp_path / "extra.pt")})
    with pytest.raises(ConfigError, match=r"does not fit the model: unused 9.weight \(model.init.map"):
        load_into(model, init)
    lines: list[str] = []
    load_into(model, OmegaConf.create({"from": str(tmp_path / "extra.pt"), "map": {"9.": None}}), lines.append)
    assert lines == [f"model.init: 2 of 2 tensors from {tmp_path / 'extra.pt'}"]
    keys = {"enc.head.w": 1, "enc.0.w": 2}
    for mapping in ({"enc.": "encoder.", "enc.head.": None}, {"enc.head.": None, "enc.": "encoder."}):  # any order
        assert remap(keys, mapping) == {"encoder.0.w": 2}, mapping  # enc.head. is longer: dropped, not renamed
    assert remap(keys, {"enc.": "e.", "enc.head.": "h."}) == {"h.w": 1, "e.0.w": 2}


def test_init_excludes_by_glob_and_a_model_may_adapt_a_parents_tensor_to_its_shape(tmp_path):
    """model.init.exclude: "everything but the head" (a new label set's head keeps its fresh initialisation);
    a model's `adapt_init(name, tensor)`: a parent's tensor of another shape made its own (GPT's longer context)."""
    torch.manual_seed(0)
    parent = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 10))
    torch.save(parent.state_dict(), tmp_path / "p.pt")
    child = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 4))  # a new label set: 4 classes
    fresh = child[1].weight.detach().clone()
    lines: list[str] = []
    load_into(child, OmegaConf.create({"from": str(tmp_path / "p.pt"), "exclude": ["1.*"]}), lines.append)
    assert torch.equal(child[0].weight, parent[0].weight) and torch.equal(child[1].weight, fresh)
    assert lines[1] == "model.init: left at their initialisation (model.init.exclude): 1.weight, 1.bias"
    with pytest.raises(ConfigError, match=r"model.init.exclude=\[2.\*\] matches no key of the model"):
        load_into(child, OmegaConf.create({"from": str(tmp_path / "p.pt"), "exclude": ["1.*", "2.*"]}))
    with pytest.raises(ConfigError, match=r"other shape than the model's: 1.weight \[10, 3\] vs \[4, 3\]"):
        load_into(child, OmegaConf.create({"from": str(tmp_path / "p.pt")}))  # no exclude, no adapt_init

    from trainkit.models.gpt import GPT

    short, long = (GPT(vocab_size=7, block_size=n, n_layer=1, n_head=2, n_embd=8, dropout=0.0) for n in (4, 6))
    torch.save(short.state_dict(), tmp_path / "gpt.pt")
    own = long.wpe.weight.detach().clone()
    load_into(long, OmegaConf.create({"from": str(tmp_path / "gpt.pt")}), lines.append)  # strict: every key
    assert torch.equal(long.wpe.weight[:4], short.wpe.weight) and torch.equal(long.wpe.weight[4:], own[4:])
    assert "model.init: adapted by GPT.adapt_init: wpe.weight [4, 8] -> [6, 8]" in lines
    torch.save(long.state_dict(), tmp_path / "long.pt")  # a shorter context from a longer one: refused, one line
    with pytest.raises(ConfigError, match=r"GPT.adapt_init: wpe.weight \[6, 8\] does not fit \[4, 8\]"):
        load_into(short, OmegaConf.create({"from": str(tmp_path / "long.pt")}))


def test_init_exclude_of_one_side_of_a_tied_weight_or_of_every_key_is_refused_naming_exclude(tmp_path):
    """GPT's lm_head.weight is wte.weight (one tensor): excluding one side alone would load it through the other
    (issue 58, 6: the start line said "left at its initialisation"). Both sides: both fresh."""
    from trainkit.models.gpt import GPT

    parent, child = (GPT(vocab_size=7, block_size=4, n_layer=1, n_head=2, n_embd=8) for _ in range(2))
    torch.save(parent.state_dict(), tmp_path / "gpt.pt")
    fresh = child.wte.weight.detach().clone()
    init = lambda *globs: OmegaConf.create({"from": str(tmp_path / "gpt.pt"), "exclude": list(globs)})  # noqa: E731
    with pytest.raises(ConfigError) as refused:
        load_into(child, init("lm_head.weight"))
    assert str(refused.value) == (
        "model.init.exclude: lm_head.weight is tied to wte.weight (one tensor of GPT): exclude both or neither"
    )
    with pytest.raises(ConfigError, match=r"^model.init.exclude=\[\*\] excludes every key of the model: nothing"):
        load_into(child, init("*"))
    assert torch.equal(child.wte.weight, fresh)  # a refusal loads nothing
    lines: list[str] = []
    load_into(child, init("lm_head.weight", "wte.weight"), lines.append)
    assert torch.equal(child.lm_head.weight, fresh) and torch.equal(child.wpe.weight, parent.wpe.weight)
    assert lines[1] == "model.init: left at their initialisation (model.init.exclude): wte.weight, lm_head.weight"
    untied = {k: v for k, v in parent.state_dict().items() if k != "lm_head.weight"}  # saved once, as some tools do
    torch.save(untied, tmp_path / "once.pt")
    load_into(child, OmegaConf.create({"from": str(tmp_path / "once.pt")}), lines.append)  # strict: it loads, via wte
    assert torch.equal(child.lm_head.weight, parent.wte.weight) and lines[-1].startswith("model.init: 17 of 17")


def test_a_group_keeps_decay_norms_and_biases_false_and_a_partly_frozen_batchnorm_trains():
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 1), torch.nn.BatchNorm2d(2), torch.nn.Linear(3, 1))
    cfg = helpers.compose_cfg(
        "optim=sgd",
        "optim.weight_decay=0.1",
        "optim.decay_norms_and_biases=false",
        'optim.groups=[{params: "0", lr_scale: 0.5}, {params: "1.weight", frozen: true}]',
    ).optim
    plan = optim.plan(cfg, net)
    assert plan.settings["0.weight"] == (0.5, None) and plan.settings["0.bias"] == (0.5, 0.0)  # no decay in a group
    assert plan.settings["1.bias"] == (1.0, 0.0) and plan.settings["2.weight"] == (1.0, None)
    decay = {id(p): g["weight_decay"] for g in optim.build(cfg, net, plan).param_groups for p in g["params"]}
    assert decay[id(net[0].bias)] == decay[id(net[1].bias)] == 0.0 and decay[id(net[0].weight)] == 0.1
    plan.freeze(net)
    assert plan.hold_batchnorm(net) == []  # its bias trains: the layer is not frozen, it normalises by the batch
    net.train()
    before = net[1].running_mean.clone()
    net[1](torch.randn(4, 2, 3, 3))
    assert net[1].training and not torch.equal(net[1].running_mean, before)  # and its statistics move


def _fsdp_init(rank: int, world_size: int, parent_file: str, init: dict) -> dict:
    """What train.py does on each rank: build (seeded alike), model.init, wrap with FSDP2; the full weights after."""
    from trainkit.checkpoint import full_state_dict
    from trainkit.dist import Dist
    from trainkit.parallel import wrap

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))  # as torchrun's ranks
    torch.manual_seed(0)
    d = Dist(rank, rank, world_size, torch.device("cpu"))
    net = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))
    load_into(net, OmegaConf.create({"from": parent_file, **init}), lambda line: None)
    model, _ = wrap(net, "fsdp", d, False)
    shards = {k: v.to_local().clone() for k, v in model.state_dict().items()}  # what this rank holds
    return {"shards": shards, "full": full_state_dict(model)}  # gathered to rank 0


def test_model_init_reaches_every_ranks_shard_under_fsdp(tmp_path):
    torch.manual_seed(1)  # not the ranks' seed: a rank left at its own initialisation differs
    parent = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2)).state_dict()
    torch.save(parent, tmp_path / "parent.pt")
    ranks = helpers.run_distributed(_fsdp_init, 2, str(tmp_path / "parent.pt"), {})
    for rank, got in enumerate(ranks):
        for name, tensor in parent.items():  # Shard(0): rank r holds rows [r x ceil(n/2), ...)
            rows = -(-len(tensor) // 2)
            torch.testing.assert_close(got["shards"][name], tensor[rank * rows : (rank + 1) * rows], rtol=0, atol=0)
    assert_equal(ranks[0]["full"], dict(parent), "gathered")


def test_groups_are_refused_when_a_parameter_is_matched_twice_or_none_is():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    twice = helpers.compose_cfg("optim=sgd", 'optim.groups=[{params: "0.*"}, {params: "*.weight"}]').optim
    with pytest.raises(optim.ConfigError, match=r"optim.groups\[1\].params=\*.weight and optim.groups\[0\] both match"):
        optim.plan(twice, model)
    with pytest.raises(optim.ConfigError, match="matches no parameter"):
        optim.plan(helpers.compose_cfg("optim=sgd", 'optim.groups=[{params: "head.*"}]').optim, model)
    with pytest.raises(optim.ConfigError, match="declares no layer order"):
        optim.plan(helpers.compose_cfg("optim=sgd", "optim.layer_decay=0.5").optim, model)
    nested = helpers.compose_cfg("optim=sgd", 'optim.groups=[{params: "0.*", name: enc/head}]').optim
    with pytest.raises(optim.ConfigError, match=r"optim.groups\[0\].name=enc/head must be a word"):  # lr/enc/head
        optim.check(nested)


def test_a_fully_frozen_batchnorm_keeps_its_statistics_unless_told_to_train():
    for mode, held in (("eval", ["1"]), ("train", [])):
        net = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 1), torch.nn.BatchNorm2d(2), torch.nn.Linear(3, 1))
        frozen = 'optim.groups=[{params: "[01].*", frozen: true}]'
        plan = optim.plan(helpers.compose_cfg("optim=sgd", f"optim.frozen_batchnorm={mode}", frozen).optim, net)
        assert plan.hold_batchnorm(net) == held
        net.train()
        assert net[1].training is (mode == "train") and net[2].training
        before = net[1].running_mean.clone()
        net[1](torch.randn(4, 2, 3, 3))
        assert torch.equal(net[1].running_mean, before) is (mode == "eval")


@pytest.fixture(scope="module")
def single(parent, tmp_path_factory) -> Path:
    """The chained run in one process at global batch 32 (1 x 32 x K=1)."""
    run_dir = tmp_path_factory.mktemp("single")
    chained(run_dir, parent)
    LRS["single"] = helpers.RecordingSGD.lrs
    return run_dir


LRS: dict[str, list[list[float]]] = {}  # what each group stepped with, each step of the single run


def test_frozen_parameters_are_the_parents_bit_for_bit_and_groups_follow_the_schedule(parent, single):
    got, start = weights(single), weights(parent)
    for name in got:
        assert torch.equal(got[name], start[name]) is (name in FROZEN), name  # the others trained
    # The checkpoint's groups: layer 4 (x 0.1) and 7.weight. The rows: `lr` (optim.lr x the schedule: 7.weight's,
    # which no group scales) and each group's own, lr/<group> (not the lr of whichever holds the first parameter)
    saved = torch.load(single / "checkpoints" / "step_00000006.pt", weights_only=True)["optimizer"]["param_groups"]
    assert [len(g["params"]) for g in saved] == [2, 1] and [g["initial_lr"] for g in saved] == [0.1 * 0.1, 0.1]
    lrs = [(row["lr"], row["lr/4"]) for row in rows(single)]
    assert lrs[:2] == [pytest.approx((0.1 / 3, 0.01 / 3)), pytest.approx((0.2 / 3, 0.02 / 3))]  # warmup (s+1)/(w+1)
    assert not any(key.startswith("lr/") and key != "lr/4" for key in rows(single)[0])  # the frozen ones: none
    assert all(row["comm/grad_bytes"] == 0 for row in rows(single))
    assert (single / "parent" / "model.pt").is_file() and (single / "parent" / ".hydra" / "config.yaml").is_file()


def test_each_groups_lr_is_the_schedule_times_its_scale_at_every_step_also_after_a_resume(parent, single, tmp_path):
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    name = "step_00000003.pt"
    shutil.copy(single / "checkpoints" / name, resumed / "checkpoints" / name)
    moved = tmp_path / "gone"
    shutil.move(parent, moved)  # the parent's dir is gone: a resume reads the checkpoint, never the parent
    try:
        out = chained(resumed, tmp_path / "elsewhere")  # no such dir: never read, and no other run for it
        # eval.py and predict.py of a chained run read its own dir alone
        evaluated = run_in_process(tmp_path / "eval", f"run_dir={single}", "split=test", script="eval")
        predicted = run_in_process(tmp_path / "predict", f"run_dir={single}", script="predict")
    finally:
        shutil.move(moved, parent)
    assert "model.init" not in out and "resumed from" in out
    assert "done: test loss" in evaluated and "on 359 val samples" in predicted, evaluated + predicted
    final = torch.load(single / "checkpoints" / "step_00000006.pt", weights_only=True)
    got = torch.load(resumed / "checkpoints" / "step_00000006.pt", weights_only=True)
    for key in ("model", "optimizer", "scheduler", "ranks", "progress"):
        assert_equal(got[key], final[key], key)  # bitwise
    assert rows(resumed) == rows(single)[3:]
    multiplier = optim.multiplier(helpers.compose_cfg(*CHAINED).sched, 6)
    want = [[0.1 * 0.1 * multiplier(step), 0.1 * multiplier(step)] for step in range(6)]  # layer 4 at x 0.1, 7
    assert [lr for step in LRS["single"] for lr in step] == pytest.approx([lr for step in want for lr in step])
    assert helpers.RecordingSGD.lrs == LRS["single"][3:]  # the resumed run's, bit for bit


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_ranks_k2_train_a_partly_frozen_model_as_one_process_and_sync_only_the_trainable(
    parent, single, mode, tmp_path
):
    run_in_process(
        tmp_path,
        *CHAINED,
        f"+model.init.from={parent}",
        f"parallel={mode}",
        "data.batch_size=8",
        "accumulation.steps=2",
        nproc=2,
    )
    got, want, start = weights(tmp_path), weights(single), weights(parent)
    for name in got:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)
        assert torch.equal(got[name], start[name]) is (name in FROZEN), name
    assert [row["comm/grad_bytes"] for row in rows(tmp_path)] == [TRAINABLE * 4] * 6  # one sync of the trainable


def test_layer_decay_follows_gpts_declared_layer_order():
    gpt = helpers.compose_cfg("+experiment=addition_gpt", "model.n_layer=2", "optim.layer_decay=0.5")
    config.typed(gpt)
    model = instantiate(model_node(gpt))
    settings = optim.plan(gpt.optim, model).settings
    assert [settings[n][0] for n in ("wte.weight", "blocks.0.qkv.weight", "blocks.1.mlp.0.bias", "ln_f.weight")] == [
        0.125,
        0.25,
        0.5,
        1.0,
    ]
    # The rows: optim.lr as `lr`, each layer's own as lr/layer<k>; the console names the first three
    optimizer = optim.build(gpt.optim, model)
    row = optim.lr_row(optimizer, [group["lr"] for group in optimizer.param_groups])
    lr = gpt.optim.lr
    assert row == pytest.approx(
        {"lr": lr, "lr/layer0": lr / 8, "lr/layer1": lr / 4, "lr/layer2": lr / 2, "lr/layer3": lr}
    )
    assert groups_lr(row) == f" (layer0 {lr / 8:.2e}, layer1 {lr / 4:.2e}, layer2 {lr / 2:.2e}, ...)"


class Layered(torch.nn.Sequential):
    """Linear layers that declare their order (`layer_of`: 0 at the input) as GPT does: optim.layer_decay's model."""

    def layer_of(self, name: str) -> int:
        return int(name.split(".")[0])


def test_each_rows_lr_is_its_own_groups_and_a_group_under_layer_decay_keeps_the_layer_in_its_name():
    cfg = helpers.compose_cfg(
        "optim=sgd", "optim.layer_decay=0.5", 'optim.groups=[{params: "[12].*", name: head, lr_scale: 0.1}]'
    )
    model = Layered(*(torch.nn.Linear(2, 2) for _ in range(3)))
    optimizer = optim.build(cfg.optim, model)
    lr = cfg.optim.lr
    assert [group["lr"] for group in optimizer.param_groups] == pytest.approx([lr / 4, lr / 2 * 0.1, lr * 0.1])
    row = optim.lr_row(optimizer, [7.0, 5.0, 3.0])  # the schedule's lrs at a step: each row shows its own group's
    assert row == {"lr": 28.0, "lr/layer0": 7.0, "lr/head/layer1": 5.0, "lr/head/layer2": 3.0}
