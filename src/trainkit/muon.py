"""optim=muon: torch's Muon (torch.optim.Muon's math: momentum, Newton-Schulz orthogonalization, decoupled weight
decay, the lr adjusted to the matrix's shape) for the hidden 2-D weight matrices and torch's AdamW for every other
parameter, as ONE optimizer (MuonAdamW): the engine schedules, clips, scales, checkpoints and resumes it like any.

Which parameter goes where is decided by name on the unwrapped model (`route`, called by trainkit.optim.plan, so
it carries to DDP and to FSDP2's shards like the parameter groups): Muon iff the parameter is 2-D, belongs to an
nn.Linear and is not the model's output head; AdamW for the rest (nn.Embedding, biases, norms, conv kernels, the
head). The head: the parameters of the model's top layer where it declares a layer order (`layer_of(name)`: GPT,
timm, model=hf), else the last nn.Linear registered. optim.groups' `optimizer: muon | adamw` overrides the rule
for the parameters it matches (a non-2-D one sent to Muon is refused).

Under FSDP2 a matrix is a DTensor sharded on dim 0, and Newton-Schulz needs the whole of it: the momentum update
(elementwise, on the shard) is gathered (full_tensor), orthogonalized whole on every rank, and each rank keeps its
own rows (distribute_tensor without communication). The extra memory per rank at the peak: the largest Muon
matrix A x B in full, 8AB + 4 min(A, B)^2 bytes (the fp32 gather, two bf16 iterates, two bf16 Gram matrices).
Under DDP gradients are averaged before the step: the one-process update.

One lr serves both sides: adjust_lr_fn=match_rms_adamw (Moonlight, arXiv 2502.16982) scales Muon's update to
AdamW's RMS (lr x 0.2 x sqrt(max(A, B))); the AdamW side's lr is optim.lr x adamw_lr_scale (default 1). The lr
schedule is sched= (LambdaLR scales every group's lr, both sides'); momentum_warmup (0: off, torch's) ramps
Muon's momentum linearly from momentum_start to momentum over that many of the optimizer's own steps (counted in
each matrix's state, `step`, so a resume continues it)."""

import re
from collections.abc import Iterable

import torch
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

ROUTES = ("muon", "adamw")


def route(model: torch.nn.Module, names: list[str]) -> dict[str, str]:
    """{name: muon | adamw} for `names` (model.named_parameters()'s) by the default rule; optim.plan applies
    optim.groups' `optimizer` keys over it."""
    params = dict(model.named_parameters())
    linear, other = set(), set()
    last_linear: list[int] = []
    for module in model.modules():
        owned = {id(p) for p in module.parameters(recurse=False)}
        if isinstance(module, torch.nn.Linear):
            linear |= owned
            last_linear = [id(module.weight)]
        else:
            other |= owned  # another owner too (an Embedding tied to the head): not a hidden matrix
    layer_of = getattr(model, "layer_of", None)
    if layer_of is not None:
        top = max(layer_of(name) for name in names)
        head = {name for name in names if layer_of(name) == top}
    else:
        head = {name for name in names if id(params[name]) in last_linear}
    return {
        name: "muon" if params[name].dim() == 2 and id(params[name]) in linear - other and name not in head else "adamw"
        for name in names
    }


def routing_line(routes: dict[str, str], sizes: dict[str, int]) -> str:
    """The start line: how many tensors and parameters each side has, with their names as globs."""

    def side(which: str) -> str:
        names = [n for n, to in routes.items() if to == which]
        globs = list(dict.fromkeys(re.sub(r"\.\d+\.", ".*.", n) for n in names))
        shown = ", ".join(globs[:4]) + (f", ... ({len(globs) - 4} more)" if len(globs) > 4 else "")
        return f"{which} {len(names)} tensors ({sum(sizes[n] for n in names):,} params){': ' if names else ''}{shown}"

    return f"optim=muon: {side('muon')} | {side('adamw')}"


class MuonAdamW(torch.optim.Optimizer):
    """torch.optim.Muon for the param groups whose "optimizer" is "muon", torch.optim.AdamW (an inner instance
    sharing this one's group dicts and state) for the "adamw" ones; a group without the key is split by dimension
    (2-D: muon). Muon's arguments are torch.optim.Muon's (adjust_lr_fn defaults to match_rms_adamw here); betas,
    adamw_eps and fused are the AdamW side's, weight_decay both sides'."""

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = (3.4445, -4.775, 2.0315),
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = "match_rms_adamw",
        momentum_warmup: int = 0,
        momentum_start: float = 0.85,
        adamw_lr_scale: float = 1.0,
        betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        fused: bool | None = None,
    ) -> None:
        groups = list(params)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        split = []
        for group in groups:
            if "optimizer" in group:
                split.append(group)
                continue
            ps = list(group["params"])  # by dimension, like torch's example
            for to, members in (("muon", [p for p in ps if p.dim() == 2]), ("adamw", [p for p in ps if p.dim() != 2])):
                if members:
                    split.append(dict(group, params=members, optimizer=to))
        muon = {"momentum": momentum, "nesterov": nesterov, "ns_coefficients": tuple(ns_coefficients), "eps": eps}
        muon |= {"ns_steps": ns_steps, "adjust_lr_fn": adjust_lr_fn}
        muon |= {"momentum_warmup": momentum_warmup, "momentum_start": momentum_start}
        for group in split:
            if group["optimizer"] not in ROUTES:
                raise ValueError(f"param group optimizer={group['optimizer']} is not one of {ROUTES}")
            if group["optimizer"] == "muon":
                for key, value in muon.items():
                    group.setdefault(key, value)
            elif adamw_lr_scale != 1.0:  # lr_scale: trainkit.optim.lr_row reads optim.lr back from it
                group["lr"] = group.get("lr", lr) * adamw_lr_scale
                group["lr_scale"] = group.get("lr_scale", 1.0) * adamw_lr_scale
        super().__init__(split, {"lr": lr, "weight_decay": weight_decay})
        for group in self.param_groups:
            bad = next((p for p in group["params"] if p.dim() != 2), None)
            if group["optimizer"] == "muon" and bad is not None:
                raise ValueError(f"Muon takes 2-D parameters only, got one of shape {tuple(bad.shape)}")
        adamw = [g for g in self.param_groups if g["optimizer"] == "adamw"]
        self._adamw = None
        if adamw:
            beta1, beta2 = betas
            self._adamw = torch.optim.AdamW(
                adamw, lr=lr, betas=(beta1, beta2), eps=adamw_eps, weight_decay=weight_decay, fused=fused
            )
        self._relink()

    def _relink(self) -> None:
        """The inner AdamW works on this optimizer's group dicts and state: load_state_dict replaces both."""
        if self._adamw is not None:
            self._adamw.param_groups = [g for g in self.param_groups if g["optimizer"] == "adamw"]
            self._adamw.state = self.state

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._relink()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["optimizer"] == "muon":
                self._muon_group(group)
        if self._adamw is not None:
            self._adamw.step()
        return loss

    # optim.compile=true compiles AdamW's side (elementwise: fused); Muon's stays eager, as torch's own step reads
    # its lr and momentum as numbers (compiled, a number read from a changing tensor went stale: 0.6 lr off in 6
    # steps), and Newton-Schulz is matrix products, which compiling does not fuse.
    @torch.compiler.disable
    def _muon_group(self, group: dict) -> None:
        """torch.optim._muon._single_tensor_muon, with the orthogonalization of a sharded matrix done whole."""
        lr, wd = group["lr"], group["weight_decay"]
        lr = lr.item() if isinstance(lr, torch.Tensor) else lr
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
            momentum = group["momentum"]
            if group["momentum_warmup"] > 0:
                step = state.setdefault("step", torch.tensor(0.0))
                step += 1  # this step's number, from 1; the first one at momentum_start
                frac = min((step.item() - 1) / group["momentum_warmup"], 1.0)
                momentum = group["momentum_start"] + frac * (group["momentum"] - group["momentum_start"])
            buf = state["momentum_buffer"]
            buf.lerp_(p.grad, 1 - momentum)
            update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
            update = orthogonalize(update, group["ns_coefficients"], group["ns_steps"], group["eps"])
            p.mul_(1 - lr * wd)
            p.add_(update, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], p.shape))  # p.shape: the whole matrix's


def orthogonalize(update: torch.Tensor, coefficients, steps: int, eps: float) -> torch.Tensor:
    """torch's Newton-Schulz (in bf16, as torch.optim.Muon) of the whole matrix: a DTensor is gathered on every
    rank, orthogonalized, and each rank keeps its own shard of the result (the same split, no communication)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(update, DTensor):
        return _zeropower_via_newtonschulz(update, coefficients, steps, eps)
    whole = _zeropower_via_newtonschulz(update.full_tensor(), coefficients, steps, eps)
    return distribute_tensor(whole, update.device_mesh, update.placements, src_data_rank=None)
