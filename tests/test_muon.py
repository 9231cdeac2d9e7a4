"""optim=muon (trainkit/muon.py): the routing of parameters by name, the hybrid being torch's own Muon and AdamW,
a bit-equal resume through state_dict, and on 2 gloo ranks DDP = 1 process and FSDP2 = 1 process (the sharded
matrices orthogonalized whole), with a DCP round trip of the hybrid's sharded state."""

import copy
import io

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from helpers import compose_cfg, run_distributed, run_in_process, weights
from trainkit import config, optim
from trainkit.dist import Dist
from trainkit.errors import ConfigError
from trainkit.models.gpt import GPT
from trainkit.parallel import unwrap, wrap

STEPS = 4
LR = 0.02


@pytest.fixture(scope="module")
def muon_cfg():
    return compose_cfg("optim=muon", f"optim.lr={LR}", "optim.weight_decay=0.1")


def with_optim(cfg, **settings):
    cfg = copy.deepcopy(cfg)
    for key, value in settings.items():
        OmegaConf.update(cfg, key, value, merge=False)
    return cfg


class Tiny(nn.Module):
    """An embedding, two hidden Linear layers of odd widths (FSDP2's shards of 7 and 5 rows are uneven) and a
    head: a model without a layer order (its head is its last nn.Linear)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(10, 6)
        self.fc1, self.fc2, self.head = nn.Linear(6, 7), nn.Linear(7, 5), nn.Linear(5, 10)

    def forward(self, x):
        return self.head(F.relu(self.fc2(F.relu(self.fc1(self.emb(x))))))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, 10, (8,), generator=g), torch.randint(0, 10, (8,), generator=g)


def train_steps(model, optimizer, steps, rank_batches):
    for step in steps:
        x, y = rank_batches(step)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def tiny_gpt():
    torch.manual_seed(0)
    return GPT(vocab_size=20, block_size=8, n_layer=2, n_head=2, n_embd=16)


def gpt_loss(model, step):
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, 20, (4, 9), generator=g)
    return F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())


# --- routing ------------------------------------------------------------------------------------


def test_routing_by_name_overrides_refusals_and_the_start_line(muon_cfg):
    gpt = tiny_gpt()
    plan = optim.plan(muon_cfg.optim, gpt)
    to_muon = sorted(n for n, to in plan.routes.items() if to == "muon")
    assert to_muon == sorted(f"blocks.{i}.{m}.weight" for i in range(2) for m in ("qkv", "proj", "mlp.0", "mlp.2"))
    assert plan.routes["wte.weight"] == "adamw"  # the embedding, tied to the head
    assert all(plan.routes[n] == "adamw" for n, p in gpt.named_parameters() if p.dim() != 2)
    assert plan.routing == (
        "optim=muon: muon 8 tensors (6,144 params): blocks.*.qkv.weight, blocks.*.proj.weight, blocks.*.mlp.*.weight"
        " | adamw 20 tensors (896 params): wte.weight, wpe.weight, blocks.*.ln_1.weight, blocks.*.ln_1.bias, ..."
        " (7 more)"
    )
    # Without a layer order the head is the last nn.Linear registered
    tiny = optim.plan(muon_cfg.optim, Tiny())
    assert {n for n, to in tiny.routes.items() if to == "muon"} == {"fc1.weight", "fc2.weight"}
    # optim.groups' optimizer moves parameters either way; a frozen one is in no group
    moved = with_optim(
        muon_cfg,
        **{"optim.groups": [{"params": "blocks.0", "optimizer": "adamw"}, {"params": "ln_f.weight", "frozen": True}]},
    )
    routes = optim.plan(moved.optim, gpt).routes
    assert {n for n, to in routes.items() if to == "muon"} == {n for n in to_muon if n.startswith("blocks.1.")}
    routes = optim.plan(
        with_optim(muon_cfg, **{"optim.groups": [{"params": "head.weight", "optimizer": "muon"}]}).optim, Tiny()
    ).routes
    assert routes["head.weight"] == "muon"
    built = optim.build(moved.optim, gpt, optim.plan(moved.optim, gpt))
    assert sum(g["optimizer"] == "muon" for g in built.param_groups) == 1
    # Refused in one line naming the key: a 1-D parameter sent to Muon; the key without optim=muon; a bad value
    bad = with_optim(muon_cfg, **{"optim.groups": [{"params": "ln_f.weight", "optimizer": "muon"}]})
    with pytest.raises(ConfigError, match=r"^optim.groups\[0\].optimizer=muon: ln_f.weight has 1 dimensions; "):
        optim.plan(bad.optim, gpt)
    adamw = compose_cfg("optim.groups=[{params: fc1, optimizer: muon}]")
    with pytest.raises(ConfigError, match=r"^optim.groups\[0\].optimizer=muon: only optim=muon routes parameters$"):
        config.check(adamw)
    with pytest.raises(ConfigError, match=r"^optim.groups\[0\].optimizer=sgd: one of muon, adamw$"):
        optim.check(with_optim(muon_cfg, **{"optim.groups": [{"params": "fc1", "optimizer": "sgd"}]}).optim)


def test_the_hybrid_is_torch_muon_plus_torch_adamw(muon_cfg):
    """Built by optim.build (layer decay: a group per layer and side; norms and biases without decay; the momentum
    warmup off) and stepped under LambdaLR: bit for bit torch.optim.Muon and torch.optim.AdamW on the same groups."""
    cfg = with_optim(muon_cfg, **{"optim.layer_decay": 0.8, "optim.decay_norms_and_biases": False})
    ours, theirs = tiny_gpt(), tiny_gpt()
    hybrid = optim.build(cfg.optim, ours)
    assert {g["optimizer"] for g in hybrid.param_groups} == {"muon", "adamw"} and len(hybrid.param_groups) > 4
    index = {id(p): i for i, p in enumerate(ours.parameters())}
    params = list(theirs.parameters())
    split = {"muon": [], "adamw": []}
    for g in hybrid.param_groups:
        keys = ("lr", "weight_decay") if g["optimizer"] == "muon" else ("lr", "weight_decay", "betas", "eps")
        split[g["optimizer"]].append({"params": [params[index[id(p)]] for p in g["params"]]} | {k: g[k] for k in keys})
    muon = torch.optim.Muon(split["muon"], momentum=0.95, nesterov=True, adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW(split["adamw"])
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1 / (s + 1)) for o in (hybrid, muon, adamw)]
    for step in range(STEPS):
        gpt_loss(ours, step).backward()
        gpt_loss(theirs, step).backward()
        for o in (hybrid, muon, adamw):
            o.step()
            o.zero_grad()
        for s in schedules:
            s.step()
    assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), theirs.parameters(), strict=True))
    assert not torch.equal(ours.blocks[0].qkv.weight, tiny_gpt().blocks[0].qkv.weight)  # it trained
    assert hybrid.state[ours.blocks[0].qkv.weight].keys() == {"momentum_buffer"}  # torch's state, no more


def test_resume_from_a_state_dict_is_bit_equal_and_continues_the_momentum_warmup(muon_cfg):
    """What checkpoint.snapshot/restore do for one process (and DDP): optimizer.state_dict() through torch.save,
    load_state_dict into a fresh optimizer (which replaces its group dicts and state: the inner AdamW relinked)."""
    cfg = with_optim(muon_cfg, **{"optim.momentum_warmup": 4})

    def fresh():
        model = tiny_gpt()
        return model, optim.build(cfg.optim, model)

    def run(model, opt, steps):
        for step in steps:
            gpt_loss(model, step).backward()
            opt.step()
            opt.zero_grad()

    straight, straight_opt = fresh()
    run(straight, straight_opt, range(6))
    first, first_opt = fresh()
    run(first, first_opt, range(3))
    saved = io.BytesIO()
    torch.save({"model": first.state_dict(), "optimizer": first_opt.state_dict()}, saved)
    saved.seek(0)
    state = torch.load(saved, weights_only=True)
    resumed, resumed_opt = fresh()
    resumed.load_state_dict(state["model"])
    resumed_opt.load_state_dict(state["optimizer"])
    run(resumed, resumed_opt, range(3, 6))
    assert all(torch.equal(a, b) for a, b in zip(straight.parameters(), resumed.parameters(), strict=True))
    assert resumed_opt.state[resumed.blocks[0].qkv.weight]["step"].item() == 6  # the warmup's count went on
    no_warmup = tiny_gpt()
    no_warmup_opt = optim.build(muon_cfg.optim, no_warmup)
    run(no_warmup, no_warmup_opt, range(6))
    assert not torch.equal(no_warmup.blocks[0].qkv.weight, straight.blocks[0].qkv.weight)  # the warmup acts


def test_a_run_prints_its_routing_and_resumes_from_a_mid_run_checkpoint_bit_equal(tmp_path):
    """train.py's own path (steps.build's start line; checkpoint.snapshot/restore; LambdaLR, clipping): a run
    resumed from step 3 of 6, in a new dir, ends with the uninterrupted run's weights bit for bit."""
    run = ("optim=muon", "model=mlp", "model.width=16", "optim.momentum_warmup=4", "trainer.max_steps=6")
    run += ("checkpoint.every=3", "checkpoint.keep=2", "trainer.eval_every=100", "trainer.test=false")
    out = run_in_process(tmp_path / "straight", *run)
    line = next(line for line in out.splitlines() if line.startswith("optim=muon:"))
    assert line == (  # digits' 64 pixels, two hidden layers of 16, 10 classes
        "optim=muon: muon 2 tensors (1,280 params): 1.weight, 4.weight | adamw 4 tensors (202 params): 1.bias, "
        "4.bias, 7.weight, 7.bias"
    )
    middle = tmp_path / "straight" / "checkpoints" / "step_00000003.pt"
    out = run_in_process(tmp_path / "resumed", *run, f"checkpoint.resume={middle}")
    assert "at step 3" in out
    straight, resumed = (weights(tmp_path / name) for name in ("straight", "resumed"))
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)


# --- two ranks: DDP and FSDP2 against one process ------------------------------------------------


def _one_process(cfg, steps):
    model = Tiny()
    opt = optim.build(cfg.optim, model)
    train_steps(model, opt, steps, lambda s: tuple(torch.cat(t) for t in zip(batch(s, 0), batch(s, 1), strict=True)))
    return {n: p.detach() for n, p in model.named_parameters()}


def _two_ranks(rank, world_size, cfg, directory):
    d = Dist(rank, rank, world_size, torch.device("cpu"))
    out = {}
    for mode in ("ddp", "fsdp"):
        net = Tiny()
        groups = optim.plan(cfg.optim, net)
        model, _ = wrap(net, mode, d)
        opt = optim.build(cfg.optim, unwrap(model), groups, d.device)
        same_grads = None
        if mode == "fsdp":  # one process on the very gradients FSDP2 reduce-scattered: equal bit for bit
            same_grads = Tiny()
            same_opt = optim.build(cfg.optim, same_grads)
            exact = []
        for step in range(STEPS):
            x, y = batch(step, rank)
            F.cross_entropy(model(x), y).backward()
            if same_grads is not None:
                for p, q in zip(unwrap(model).parameters(), same_grads.parameters(), strict=True):
                    q.grad = p.grad.full_tensor()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if same_grads is not None:
                same_opt.step()
                same_opt.zero_grad(set_to_none=True)
                full = [p.full_tensor() for p in unwrap(model).parameters()]
                exact.append(all(torch.equal(a, b) for a, b in zip(full, same_grads.parameters(), strict=True)))
        full = {
            n: p.full_tensor() if isinstance(p, DTensor) else p.detach() for n, p in unwrap(model).named_parameters()
        }
        out[mode] = full
    out["exact"] = exact
    buf = opt.state[unwrap(model).fc1.weight]["momentum_buffer"]
    out["buffer_rows"] = buf.to_local().shape[0]  # the momentum buffer stays sharded: 4 and 3 of 7 rows
    # DCP round trip (checkpoint.snapshot/restore's FSDP path): one more step after it equals one more without
    model_state, optim_state = get_state_dict(model, opt)
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=directory)
    net = Tiny()
    groups = optim.plan(cfg.optim, net)
    fresh, _ = wrap(net, "fsdp", d)
    fresh_opt = optim.build(cfg.optim, unwrap(fresh), groups, d.device)
    model_state, optim_state = get_state_dict(fresh, fresh_opt)  # _init_optim_state: a step at lr 0
    dcp.load({"model": model_state, "optimizer": optim_state}, checkpoint_id=directory)
    set_state_dict(fresh, fresh_opt, model_state_dict=model_state, optim_state_dict=optim_state)
    for m, o in ((model, opt), (fresh, fresh_opt)):
        x, y = batch(STEPS, rank)
        F.cross_entropy(m(x), y).backward()
        o.step()
    out["dcp"] = all(
        torch.equal(p.to_local(), q.to_local()) for p, q in zip(model.parameters(), fresh.parameters(), strict=True)
    ) and all(
        torch.equal(opt.state[p][k].to_local(), fresh_opt.state[q][k].to_local())
        for p, q in zip(model.parameters(), fresh.parameters(), strict=True)
        for k in opt.state[p]
        if isinstance(opt.state[p][k], DTensor)
    )
    return out


def test_ddp_and_fsdp2_two_ranks_equal_one_process(muon_cfg, tmp_path):
    """FSDP2 on the gradients it reduce-scattered equals one process on those gradients bit for bit (each rank
    orthogonalizes the whole gathered matrix), and DDP bit for bit; against one process on the whole batch they
    differ only by the gradients' float32 rounding (the ranks' mean) carried through Newton-Schulz's bfloat16:
    within `tolerance` (docs/config.md derives it). Orthogonalizing each shard alone differed by 0.018 (planted)."""
    cfg = with_optim(muon_cfg, **{"optim.momentum_warmup": 2})
    ranks = run_distributed(_two_ranks, 2, cfg, str(tmp_path / "dcp"))
    reference = _one_process(cfg, range(STEPS))
    tolerance = STEPS * LR * 0.2 * 7**0.5 * 2**-5  # steps x adjusted lr x 8 bf16 ulps of a unit entry of O
    for rank, result in enumerate(ranks):
        for mode in ("ddp", "fsdp"):
            diff = max((result[mode][n] - reference[n]).abs().max().item() for n in reference)
            print(f"rank {rank} {mode}: max |2 ranks - 1 process| = {diff:.3g} (tolerance {tolerance:.3g})")
            assert diff <= tolerance, (mode, diff)
        # with 2 ranks the reduce-scatter's and the all-reduce's sums are the same a + b: the same run, bit for bit
        assert all(torch.equal(result["ddp"][n], result["fsdp"][n]) for n in reference), rank
        assert all(result["exact"]), rank
        assert result["buffer_rows"] == (4 if rank == 0 else 3)
        assert result["dcp"], rank
