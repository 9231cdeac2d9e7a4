"""The optimizer of a run: `cfg.optim` (a partial of a torch optimizer) over the model's parameter groups, which
are decided BY NAME on the unwrapped model, before wrapping (`plan`), and carried to the wrapped model by name
(`build`): DDP keeps the parameters (its names gain `module.`), FSDP2's fully_shard replaces every Parameter by
its DTensor shard, so a group made of the parameter objects seen before sharding would silently be lost.

What decides a parameter's group, later rules over earlier ones:
- `optim.decay_norms_and_biases=false`: parameters with fewer than 2 dimensions (biases, LayerNorm and BatchNorm
  gains) without weight decay, the rule of nanoGPT and most transformer recipes. Measured on
  +experiment=pydoc_gpt (a nanoGPT loop on its split, 2000 steps): decaying every parameter ends 0.021 nats per
  character higher.
- `optim.layer_decay=<d>`: lr x d^(L - layer) for models that declare their layer order (a `layer_of(name)`
  method: 0 for the input side, L for the head: GPT, timm's models through timm's group_matcher).
- `optim.groups`: a list of {params: a glob over parameter names, lr_scale, weight_decay, frozen, name}; a parameter
  matched by two is refused, the unmatched ones keep the defaults. `frozen: true`: requires_grad=False before
  wrapping, so the parameter is in no optimizer group, no clipping norm and no gradient sync (DDP builds its
  buckets of the parameters that require a gradient; FSDP2 reduce-scatters only gradients that exist), and the
  BatchNorm layers whose parameters are all frozen keep their running statistics (eval mode) unless
  `optim.frozen_batchnorm=train`.
- optim=muon (trainkit/muon.py): each parameter's side, Muon or AdamW, by its rule (hidden nn.Linear matrices
  to Muon), and optim.groups' `optimizer: muon | adamw`; printed at start (steps.build).
Each group's lr is optim.lr x its lr_scale, moved by the schedule (LambdaLR scales each group's initial lr; a
resume recomputes them from this run's config: checkpoint._apply_hyperparameters). Rows show `lr` (optim.lr x the
schedule: the parameters nothing scales) and each named group's own as `lr/<name>` (`lr_row`): a group's `name`, else
its glob without wildcards (`encoder.*`: lr/encoder); with layer_decay `layer<k>` (lr/layer3, lr/encoder/layer3).
"""

import fnmatch
import functools
import inspect
import logging
import math
import re
import types
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig, OmegaConf

from trainkit import muon
from trainkit.errors import ConfigError

GROUP_KEYS = ("params", "lr_scale", "weight_decay", "frozen", "name", "optimizer")
FROZEN_BATCHNORM = ("eval", "train")  # optim.frozen_batchnorm
# optim's keys that are trainkit's, not the optimizer's arguments
TRAINKIT_KEYS = ("decay_norms_and_biases", "groups", "layer_decay", "frozen_batchnorm", "compile")
FUSED = ("auto", True, False)  # optim.fused


def matches(name: str, pattern: str) -> bool:
    """A glob over parameter names (`encoder.*`); a pattern without wildcards also matches a prefix of modules
    (`encoder` is `encoder.*`)."""
    return fnmatch.fnmatchcase(name, pattern) or (
        not any(c in pattern for c in "*?[") and name.startswith(pattern + ".")
    )


@dataclass(frozen=True)
class Plan:
    """Each parameter's group, by name: {name: (lr_scale, weight_decay or None for the optimizer's)}, the frozen
    names, and each parameter's label: what its lr is named by in the rows ("" for optim.lr's own)."""

    settings: dict[str, tuple[float, float | None]]
    frozen: frozenset[str]
    frozen_batchnorm: str = "eval"
    labels: dict[str, str] = field(default_factory=dict)
    routes: dict[str, str] = field(default_factory=dict)  # optim=muon: {name: muon | adamw}; else empty
    routing: str | None = None  # optim=muon: the start line saying which parameters go where

    def freeze(self, model: torch.nn.Module) -> None:
        """requires_grad=False for the frozen parameters (by name; before wrapping, and again after it on the
        unwrapped model: SyncBN conversion and FSDP2 make new Parameter objects)."""
        for name, p in model.named_parameters():
            if name in self.frozen:
                p.requires_grad_(False)

    def hold_batchnorm(self, model: torch.nn.Module) -> list[str]:
        """The BatchNorm layers whose parameters are all frozen stay in eval mode (their running statistics the
        parent's) whatever model.train() says; optim.frozen_batchnorm=train: they train as before. Returns their
        names. Called on the unwrapped model after wrapping (SyncBN conversion makes new modules)."""
        if self.frozen_batchnorm == "train" or not self.frozen:
            return []
        held = []
        for name, module in model.named_modules():
            own = [f"{name}.{n}" if name else n for n, _ in module.named_parameters(recurse=False)]
            if isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and own and set(own) <= self.frozen:
                module.train = types.MethodType(_stays_in_eval, module)  # type: ignore[method-assign]
                module.eval()
                held.append(name)
        return held


def _stays_in_eval(self: torch.nn.Module, mode: bool = True) -> torch.nn.Module:
    """A frozen BatchNorm's train(): eval, whatever the mode (nn.Module.train calls each child's train)."""
    return torch.nn.Module.train(self, False)


def plan(optim: DictConfig, model: torch.nn.Module) -> Plan:
    """The groups of `model`'s (unwrapped) parameters, by name."""
    named = list(model.named_parameters())
    decay_all = optim.get("decay_norms_and_biases", True)
    settings: dict[str, tuple[float, float | None]] = {
        name: (1.0, None if decay_all or p.dim() >= 2 else 0.0) for name, p in named
    }
    if (decay := optim.get("layer_decay")) is not None:
        layer_of = getattr(model, "layer_of", None)
        if layer_of is None:
            raise ConfigError(
                f"optim.layer_decay={decay}: {type(model).__name__} declares no layer order (a layer_of(name) "
                "method: GPT, model=timm); use optim.groups' lr_scale instead"
            )
        layers = {name: layer_of(name) for name, _ in named}
        last = max(layers.values())
        settings = {name: (decay ** (last - layers[name]), wd) for name, (_, wd) in settings.items()}
        labels = {name: f"layer{layers[name]}" for name, _ in named}
    else:
        labels = {name: "" for name, _ in named}
    frozen: set[str] = set()
    owner: dict[str, int] = {}
    sides: dict[str, str] = {}  # optim.groups' optimizer: muon | adamw
    for i, group in enumerate(optim.get("groups") or []):
        hits = [name for name, _ in named if matches(name, group.params)]
        if not hits:
            raise ConfigError(
                f"optim.groups[{i}].params={group.params} matches no parameter (they are: "
                f"{', '.join(name for name, _ in named[:4])}{' ...' if len(named) > 4 else ''})"
            )
        for name in hits:
            if name in owner:
                raise ConfigError(
                    f"optim.groups[{i}].params={group.params} and optim.groups[{owner[name]}] both match {name}"
                )
            owner[name] = i
            scale, wd = settings[name]
            settings[name] = (scale * group.get("lr_scale", 1.0), group.get("weight_decay", wd))
            labels[name] = "/".join(filter(None, (group_name(group), labels[name])))
            if group.get("frozen", False):
                frozen.add(name)
            if (side := group.get("optimizer")) is not None:  # optim=muon's side (check: only there)
                if side == "muon" and (dims := model.get_parameter(name).dim()) != 2 and name not in frozen:
                    raise ConfigError(
                        f"optim.groups[{i}].optimizer=muon: {name} has {dims} dimensions; Muon "
                        "orthogonalizes 2-D matrices only (optimizer: adamw for it)"
                    )
                sides[name] = side
    routes, routing = {}, None
    if routes_parameters(optim):
        routes = muon.route(model, [name for name, _ in named]) | sides
        trained = {name: to for name, to in routes.items() if name not in frozen}
        routing = muon.routing_line(trained, {name: p.numel() for name, p in named})
    return Plan(settings, frozenset(frozen), optim.get("frozen_batchnorm", "eval"), labels, routes, routing)


def routes_parameters(optim: DictConfig) -> bool:
    """Whether cfg.optim is the Muon + AdamW hybrid (or a subclass), whose groups each name their side."""
    try:
        target = get_class(str(optim.get("_target_", "")))
    except Exception:  # an unknown _target_ is instantiate's error to report
        return False
    return isinstance(target, type) and issubclass(target, muon.MuonAdamW)


def group_name(group) -> str:
    """A group's name in the rows (lr/<name>): its `name`, else its glob without wildcards (`encoder.*`: encoder)."""
    return str(group.get("name") or re.sub(r"[*?\[\]]", "", group.params).strip(".") or group.params)


def lr_row(optimizer: torch.optim.Optimizer, lrs: list[float]) -> dict[str, float]:
    """The row's learning rates, `lrs` being each param group's at the step: `lr`, optim.lr x the schedule (the lr
    of the parameters that no group or layer decay scales), and with named groups `lr/<name>`, each one's own."""
    row: dict[str, float] = {}
    base = None
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        if group.get("name"):
            row.setdefault(f"lr/{group['name']}", lr)
        if base is None and group.get("lr_scale", 1.0) > 0:
            base = lr / group.get("lr_scale", 1.0)  # x 1 for an unscaled group: its own lr, exactly
    return {"lr": lrs[0] if base is None else base} | row


def build(
    optim: DictConfig, model: torch.nn.Module, groups: Plan | None = None, device: torch.device | None = None
) -> torch.optim.Optimizer:
    """cfg.optim's optimizer over `model`'s parameters (the UNWRAPPED module after wrapping: under FSDP its
    DTensor shards) on `device`, grouped by name by `groups` (None: planned on `model` itself); frozen ones left
    out."""
    plan_ = plan(optim, model) if groups is None else groups
    kwargs = OmegaConf.to_container(optim, resolve=True)
    assert isinstance(kwargs, dict)
    compiled = kwargs.get("compile", False)
    for key in TRAINKIT_KEYS:
        kwargs.pop(key, None)
    if compiled and kwargs.get("fused") == "auto":  # the compiled step is a fused kernel of its own (check: not true)
        kwargs.pop("fused")
    if kwargs.get("fused") == "auto":  # optim.fused (adamw, sgd); an optimizer without the argument keeps its own
        takes = "fused" in inspect.signature(get_class(kwargs["_target_"])).parameters
        kwargs["fused"] = fused_kernel(device or torch.device("cpu")) if takes else None
        if kwargs["fused"] is None:
            kwargs.pop("fused")
    lr = kwargs["lr"]
    by_setting: dict[tuple[str, str, float, float | None], list[torch.nn.Parameter]] = {}  # in parameter order
    for name, p in model.named_parameters():
        if name not in plan_.frozen:
            setting = (plan_.routes.get(name, ""), plan_.labels.get(name, ""), *plan_.settings[name])
            by_setting.setdefault(setting, []).append(p)
    if not by_setting:
        raise ConfigError("optim.groups: every parameter is frozen: nothing to train")
    param_groups = []
    for (side, label, scale, wd), params in by_setting.items():
        # optim.compile: the lr a tensor, which the schedule fills in place: a changing number would recompile
        group_lr = torch.tensor(lr * scale, dtype=torch.float64) if compiled else lr * scale
        group: dict = {"params": params, "lr": group_lr} | ({"optimizer": side} if side else {})
        if wd is not None:
            group["weight_decay"] = wd
        if label:  # the rows' lr/<label> (lr_row); torch keeps a group's extra keys, a resume puts back this run's
            group |= {"name": label, "lr_scale": scale}
        param_groups.append(group)
    optimizer = instantiate(kwargs)(param_groups)
    if compiled:  # bound like the method it replaces (LambdaLR wraps optimizer.step's __func__)
        optimizer.step = types.MethodType(torch.compile(type(optimizer).step), optimizer)
        logging.getLogger("torch._dynamo.variables.ctx_manager").addFilter(_profiler_note)
    return optimizer


def _profiler_note(record: logging.LogRecord) -> bool:
    """Drops dynamo's note, on every rank, that the record_function torch wraps around Optimizer.step is left out
    of the compiled graph (the profiler's label of the step: nothing to fix)."""
    return not record.getMessage().startswith("Profiler record function")


def fused_kernel(device: torch.device) -> bool | None:
    """optim.fused=auto: on CUDA torch's fused kernel, one launch for every parameter's update (its default there
    is foreach, a launch per op over lists), which also takes fp16's GradScaler inf check without a host sync;
    elsewhere None, torch's own choice (on the CPU a loop per parameter). true / false go to torch as they are."""
    return True if device.type == "cuda" else None


def check(optim: DictConfig) -> None:
    """Values refused before anything runs (the names are checked against the model in `plan`)."""
    if (fused := optim.get("fused", "auto")) not in FUSED:
        raise ConfigError(f"optim.fused={fused} is not one of: auto, true, false")
    if (compiled := optim.get("compile", False)) not in (True, False):
        raise ConfigError(f"optim.compile={compiled} must be true or false")
    if compiled and fused is True:
        raise ConfigError(
            "optim.compile=true with optim.fused=true: the compiled step fuses the update itself (use optim.fused=auto)"
        )
    if (decay := optim.get("layer_decay")) is not None and not (
        isinstance(decay, (int, float)) and not isinstance(decay, bool) and 0 < decay <= 1
    ):
        raise ConfigError(f"optim.layer_decay={decay} must be null or a number in (0, 1]")
    if (mode := optim.get("frozen_batchnorm", "eval")) not in FROZEN_BATCHNORM:
        raise ConfigError(f"optim.frozen_batchnorm={mode} is not one of: {', '.join(FROZEN_BATCHNORM)}")
    groups = optim.get("groups") or []
    if not OmegaConf.is_list(groups) and not isinstance(groups, list):
        raise ConfigError("optim.groups must be a list of {params, lr_scale, weight_decay, frozen, name, optimizer}")
    for i, group in enumerate(groups):
        if not OmegaConf.is_dict(group):
            raise ConfigError(f"optim.groups[{i}] must be a mapping: {{params, lr_scale, weight_decay, frozen}}")
        if unknown := set(group) - set(GROUP_KEYS):
            raise ConfigError(f"optim.groups[{i}]: unknown key {sorted(unknown)[0]} (keys: {', '.join(GROUP_KEYS)})")
        if not isinstance(group.get("params"), str):
            raise ConfigError(f"optim.groups[{i}].params must be a glob over parameter names (e.g. encoder.*)")
        if not isinstance(group.get("name", ""), str) or "/" in group.get("name", ""):
            raise ConfigError(f"optim.groups[{i}].name={group.name} must be a word (the rows' lr/<name>)")
        if (side := group.get("optimizer")) is not None and (side not in muon.ROUTES or not routes_parameters(optim)):
            raise ConfigError(
                f"optim.groups[{i}].optimizer={side}: "
                + ("one of muon, adamw" if routes_parameters(optim) else "only optim=muon routes parameters")
            )
        if not isinstance(group.get("frozen", False), bool):
            raise ConfigError(f"optim.groups[{i}].frozen={group.frozen} must be true or false")
        wd = group.get("weight_decay")
        if wd is not None and (not isinstance(wd, (int, float)) or isinstance(wd, bool) or wd < 0):
            raise ConfigError(f"optim.groups[{i}].weight_decay={wd} must be null or a number >= 0")
        scale = group.get("lr_scale", 1.0)
        if not isinstance(scale, (int, float)) or isinstance(scale, bool) or scale < 0:
            raise ConfigError(f"optim.groups[{i}].lr_scale={scale} must be a number >= 0")


def multiplier(sched: DictConfig, total_steps: int) -> Callable[[int], float]:
    """The configured schedule (cfg.sched: a function of the schedules room, trainkit/schedules/) with its settings
    and total_steps bound, as a plain functools.partial: Hydra's own partial checks its target policy on every call
    (~0.1 ms, as long as a small model's step). torch's LambdaLR calls it once per optimizer step."""
    schedule = instantiate(sched, total_steps=total_steps)
    if isinstance(schedule, functools.partial):
        return functools.partial(schedule.func, *schedule.args, **schedule.keywords)
    return schedule


def survey(sched: DictConfig, lr_at: Callable[[int], float], total_steps: int) -> str | None:
    """The bound schedule at each step the run trains (0 to total_steps - 1), before training: Python calls on the
    host, as cheap as LambdaLR's own, none of them in the step. A value below 0 or not finite is refused naming the
    step (an lr < 0 trains uphill and ends well; a NaN one ends as a non-finite loss, which points at the data).
    Returns a start line where the multiplier rises until the last step: a warmup as long as the run or longer (the
    default's 20 steps in a 5-step run train at most 5/21 of optim.lr), no decay after the peak. Read from the
    values, not the settings: the engine knows no schedule's keys."""
    values = list(map(lr_at, range(total_steps)))  # ~1-2 us a step: a 1M-step run starts a second or two later
    if (step := next((s for s, value in enumerate(values) if not 0 <= value < math.inf), None)) is not None:
        raise ConfigError(  # (NaN compares false)
            f"sched: {sched._target_} returns {values[step]} at step={step} (optimizer step {step + 1}'s lr, as the "
            "rows count); a schedule's value, the multiplier of optim.lr, must be a finite number >= 0"
        )
    last = total_steps - 1
    if last >= 1 and values[last] > values[last - 1]:
        return (
            f"sched: the multiplier rises until the run's last step (step {total_steps}: {values[last - 1]:.3g} -> "
            f"{values[last]:.3g} x optim.lr): the run ends at or before {sched._target_}'s peak, with no decay "
            "after it (a warmup as long as the run or longer?)"
        )
    return None
