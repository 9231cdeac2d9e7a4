"""model=hf against what a user would pick instead: trainkit's loop (src/train.py's train()) on a transformers model,
side by side in one process with transformers' own `Trainer` and with a plain PyTorch loop on the same model
(issue 59, part 8; docs/performance.md).

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_hf.py [--steps 240] [--every 5] [--clock cpu] [overrides ...]
    e.g. ... model.config.hidden_size=64 model.config.num_hidden_layers=2 --steps 2000 --every 10 (the fixed costs)
    ... trainer.device=cuda trainer.precision=bf16 (on a GPU: wall time)

The default job: a Llama-style model from a config (width 256, 4 layers of 4 heads, MLP 688: 3.2 M parameters) on
data=pydoc_text's fixed 128-character blocks (data.random_offsets=false: a block is a sample, the same wherever it is
read), batch 4, AdamW (optim's lr 3e-3 and weight decay 0.01, not on the norms: decay_norms_and_biases=false, which
is Trainer's rule), sched=constant, clipping at 1.0, fp32, K=1. All three start from the same weights (the model
built from the run's seed) and train on the same batches in the same order (trainkit's sampler, TrainBatches, same
seed) with the same optimizer, schedule, clipping and precision. The script checks it: each loop's optimizer groups
(parameter names and every hyperparameter, fused or not) must be trainkit's, and it prints how far each loop's final
weights are from trainkit's (0 on one CPU thread: the three compute the same numbers in the same order; one AdamW
step on another batch moves them by ~lr).

- **trainkit**: train() itself, model=hf (trainkit.models.hf.HFModel: the forward hands the task the logits; the loss
  is task=lm's sum over the batch's loss-bearing tokens times 1 / their count), its meter and rows.
- **plain**: the loop a person writes around a transformers model: the split's tensors in memory, one gather per
  epoch in the same order, slices; `model(input_ids=x).logits`, `F.cross_entropy` (its mean over the tokens that
  bear a loss), backward, `clip_grad_norm_(model.parameters(), ...)`, step, schedule, zero_grad. No metrics.
- **Trainer**: `transformers.Trainer` with `TrainingArguments` at their defaults but what must match or must not run:
  the optimizer named for trainkit's (`adamw_torch`; `adamw_torch_fused`, Trainer's own default on torch >= 2.8, with
  optim.fused=true), lr, weight decay, max_grad_norm, precision (bf16 / fp16), seed, no evaluation, no saving,
  report_to none, no progress bar, a log every as many steps as trainkit's rows. Its data: the split as a map-style
  Dataset of {input_ids, labels, shift_labels} (the blocks' targets are shifted already, as a padding-free collator
  hands them; remove_unused_columns=False keeps shift_labels, not a named argument of the forward), its DataLoader
  with the default collator, Trainer's sampler replaced by trainkit's order (`_get_train_sampler`) and its scheduler
  by trainkit's (`create_scheduler`: LambdaLR on the same multiplier). Its loss is the model's own (`labels=`,
  ForCausalLMLoss: the sum over the tokens / Trainer's num_items_in_batch), the same value as the others'.

How the figures are taken: bench_train.py's interleaving. train() drives; after every --every of its steps (at its
optimizer's zero_grad) the plain loop and the Trainer each run their next --every steps. Trainer owns its loop, so it
runs in a thread (bench_train.Guest) released for one optimizer step at a time, handing control back from its
`on_step_end` callback (Trainer zero_grads the model, not the optimizer); the driver waits meanwhile, so one loop runs
at a time and the process's CPU time (--clock cpu, the default on a CPU; wall time on a GPU) is that loop's. A Trainer
step as timed runs from its release to its next on_step_end: its batch (DataLoader, collation, the items count),
forward, loss, backward, clip, step, schedule, model.zero_grad, its FLOP estimate, and its previous step's
`_maybe_log_save_evaluate`. The two followers take turns going first (interleaved's rotate): a loop run right after
the Trainer's thread ran its first steps slower (on the 0.1 M model, ~2.5 ms more on the first step after each
segment, the next few a little: trainkit / plain read 0.96 with the Trainer always just before trainkit, 1.02 with it
just before the plain loop; the same thread's loops reuse each other's freed memory, another thread's do not); taking
turns, each loop follows each other one as often. The first quarter is untimed warm-up (Trainer's construction and
start happen there); each ratio is the other loop's time over trainkit's summed over the timed segments (trainkit's
steps/s over the other's), with its range over 8 consecutive parts of the run.

One process, K=1 (accumulation.steps=1: the three accumulate differently), blocks in memory (TensorDataset-like).
"""

import argparse
import contextlib
import io
import itertools
import math
import sys
import tempfile
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F
from hydra.utils import instantiate

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_train  # noqa: E402

from trainkit import config, dist, optim, steps  # noqa: E402
from trainkit.data.addition import IGNORE  # noqa: E402
from trainkit.loading import TrainBatches  # noqa: E402
from trainkit.precision import autocast_for  # noqa: E402

LLAMA = "model_type:llama,hidden_size:256,intermediate_size:688,num_hidden_layers:4,num_attention_heads:4"
LLAMA += ",max_position_embeddings:128"  # the model from a config, unless model.pretrained=<dir> names one
DEFAULTS = [
    "model=hf",
    "data=pydoc_text",
    "data.block_size=128",
    "data.random_offsets=false",
    "data.batch_size=4",
    "optim.decay_norms_and_biases=false",  # Trainer's rule: no decay on norms and biases (here: the 1-D weights)
    "sched=constant",
    "trainer.test=false",
]


def hf_net(cfg, device: torch.device) -> torch.nn.Module:
    """The transformers model of cfg.model with trainkit's initial weights (drawn from the run's seed)."""
    torch.manual_seed(cfg.seed)
    return instantiate(cfg.model).net.to(device)


def trainkit_order(cfg, samples: int) -> TrainBatches:
    """trainkit's sampler of one process: each epoch's permutation of (seed + epoch), as train() draws it."""
    return TrainBatches(samples, 1, 0, cfg.data.batch_size, cfg.seed)


def plain_steps(cfg, d: dist.Dist, total: int):
    """The plain loop (see the module's docstring); yields each step's samples after its zero_grad."""
    train_set, *_ = instantiate(cfg.data.splits)
    inputs, targets = (t.to(d.device) for t in train_set.tensors)
    model = hf_net(cfg, d.device)
    optimizer = optim.build(cfg.optim, model, device=d.device)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, optim.multiplier(cfg.sched, total))
    autocast = autocast_for(cfg.trainer.precision, d.device)
    max_norm, b = cfg.trainer.clip_grad_norm or math.inf, cfg.data.batch_size
    order = trainkit_order(cfg, len(targets))
    TRAINED["plain"] = (model, optimizer)
    model.train()
    for epoch in itertools.count():
        order.set_epoch(epoch)
        index = order.order_tensor().to(d.device)
        x_epoch, y_epoch = inputs[index], targets[index]
        for i in range(0, len(index), b):
            x, y = x_epoch[i : i + b], y_epoch[i : i + b]
            with autocast():
                logits = model(input_ids=x).logits
                loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            yield len(y)


class Examples(torch.utils.data.Dataset):
    """The split's (inputs, targets) blocks as the dicts a transformers model's forward takes."""

    def __init__(self, pairs):
        self.pairs = pairs

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        x, y = self.pairs[index]
        return {"input_ids": x, "labels": y, "shift_labels": y}


def trainer_steps(cfg, d: dist.Dist, total: int) -> bench_train.Guest:
    """transformers' Trainer (see the module's docstring), one optimizer step per advance."""
    import transformers
    from transformers import Trainer, TrainerCallback, TrainingArguments

    transformers.logging.set_verbosity_error()  # its warnings about a model without a tokenizer, every run

    class OneStep(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            bench_train.Guest.guests[guest.thread].stepped()

    class SameBatches(Trainer):
        def _get_train_sampler(self, train_dataset=None):
            return trainkit_order(cfg, len(self.train_dataset)).shard  # its DistributedSampler: the order

        def create_scheduler(self, num_training_steps, optimizer=None):
            lr_at = optim.multiplier(cfg.sched, total)
            self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer or self.optimizer, lr_at)
            return self.lr_scheduler

    def run() -> None:
        train_set, *_ = instantiate(cfg.data.splits)
        fused = optim.build(cfg.optim, torch.nn.Linear(1, 1), device=d.device).defaults.get("fused")
        precision = cfg.trainer.precision
        with tempfile.TemporaryDirectory() as out:
            args = TrainingArguments(
                output_dir=out,
                max_steps=total,
                per_device_train_batch_size=cfg.data.batch_size,
                learning_rate=cfg.optim.lr,
                weight_decay=cfg.optim.weight_decay,
                optim="adamw_torch_fused" if fused else "adamw_torch",
                max_grad_norm=cfg.trainer.clip_grad_norm or 0.0,
                bf16=precision == "bf16",
                fp16=precision == "fp16",
                use_cpu=d.device.type == "cpu",
                seed=cfg.seed,
                eval_strategy="no",
                save_strategy="no",
                logging_steps=cfg.trainer.log_every,
                report_to="none",
                disable_tqdm=True,
                dataloader_num_workers=cfg.data.num_workers,
                dataloader_pin_memory=d.device.type == "cuda",
                remove_unused_columns=False,  # else it drops shift_labels, not a named argument of the forward
            )
            trainer = SameBatches(
                model=hf_net(cfg, d.device), args=args, train_dataset=Examples(train_set), callbacks=[OneStep()]
            )
            trainer.train()
            TRAINED["Trainer"] = (trainer.model, trainer.optimizer.optimizer)  # inside accelerate's wrapper
            if trainer.state.global_step != total:
                raise AssertionError(f"Trainer ran {trainer.state.global_step} steps, not {total}")

    guest = bench_train.Guest(run)
    return guest


TRAINED: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]] = {}  # each loop's, for the checks after the run
bench_train.PLAIN |= {"plain": plain_steps, "Trainer": trainer_steps}


def groups(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> set:
    """An optimizer's groups as (parameter names, hyperparameters): what must be equal for the same optimizer."""
    names = {id(p): n.removeprefix("net.") for n, p in model.named_parameters()}
    return {
        (frozenset(names[id(p)] for p in g["params"]), tuple((k, g.get(k)) for k in sorted(optimizer.defaults)))
        for g in optimizer.param_groups
    }


def largest_difference(a: torch.nn.Module, b: torch.nn.Module) -> float:
    """The largest |difference| between two models' parameters, matched by name (HFModel's less its `net.`)."""
    theirs = {n.removeprefix("net."): p.detach() for n, p in b.named_parameters()}
    return max((p.detach() - theirs[n.removeprefix("net.")]).abs().max().item() for n, p in a.named_parameters())


def compare(cfg, d: dist.Dist, total: int, every: int) -> tuple[dict[str, list[float]], dict[str, float]]:
    """The three loops interleaved (bench_train.interleaved); then the checks that they trained alike: the same
    optimizer groups, and each loop's largest weight difference from trainkit's at the end."""
    TRAINED.clear()
    build = steps.build

    def kept(*args, **kwargs):  # trainkit's model and optimizer, for the checks after its run
        parts = build(*args, **kwargs)
        TRAINED["trainkit"] = (parts.model, parts.optimizer)
        return parts

    with mock.patch.object(steps, "build", kept), contextlib.redirect_stdout(io.StringIO()):
        seconds = bench_train.interleaved(cfg, d, total, every, ["plain", "Trainer"], rotate=True)
    if "Trainer" not in TRAINED:
        raise RuntimeError("the Trainer's thread stopped before its end (its traceback above)")
    model, optimizer = TRAINED["trainkit"]
    ours = groups(optimizer, model)
    for name in ("plain", "Trainer"):
        net, other = TRAINED[name]
        if (theirs := groups(other, net)) != ours:
            raise AssertionError(f"{name}'s optimizer groups are not trainkit's: {theirs - ours} for {ours - theirs}")
    return seconds, {name: largest_difference(model, TRAINED[name][0]) for name in ("plain", "Trainer")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=240, help="each loop's steps (a quarter untimed)")
    parser.add_argument("--every", type=int, default=5, help="steps per segment, each loop in turn")
    parser.add_argument("--threads", type=int, default=1, help="torch's intra-op threads (default 1)")
    parser.add_argument(
        "--clock", choices=["auto", *bench_train.CLOCKS], default="auto", help="CPU time or wall; auto: cpu on a CPU"
    )
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.every < 1 or args.steps < 8 * args.every:
        parser.error(f"--every must be >= 1 and --steps at least 8 segments (8 x --every = {8 * args.every})")
    args.steps -= args.steps % args.every
    pretrained = any(o.startswith("model.pretrained=") for o in args.overrides)
    fresh = [] if pretrained else [f"+model.config={{{LLAMA}}}"]
    cfg = bench_train.composed(args.steps, [*DEFAULTS, *fresh, *args.overrides])
    config.check(cfg)  # as train.py checks it (and types it: model=hf's and the data's nodes, their resolvers)
    if config.accumulation_steps(cfg, 1) != 1:
        parser.error("accumulation.steps=1 only: the three loops accumulate differently")
    torch.set_num_threads(args.threads)
    d = dist.init("auto", cfg.trainer.device)
    if d.distributed:
        parser.error("one process only")
    args.clock = args.clock if args.clock != "auto" else "cpu" if d.device.type == "cpu" else "wall"
    bench_train.clock = bench_train.CLOCKS[args.clock]
    net = hf_net(cfg, torch.device("meta"))
    size = sum(p.numel() for p in net.parameters())
    print(
        f"model=hf {net.config.model_type} ({size / 1e6:.1f} M parameters) on {cfg.data.name}, batch "
        f"{cfg.data.batch_size} x {cfg.data.block_size}, {cfg.trainer.precision}, {d.device}, "
        f"{torch.get_num_threads()} thread(s); {args.steps} steps, segments of {args.every} interleaved, the last "
        f"{args.steps - args.steps // 4 // args.every * args.every} timed by {args.clock} time"
    )
    seconds, differences = compare(cfg, d, args.steps, args.every)
    for name, us in bench_train.step_us(seconds, args.every).items():
        print(f"{name:<9} {us / 1e3:>9,.1f} ms per step of {args.clock} time")
    for name in ("Trainer", "plain"):
        print(f"ratio trainkit / {name}: {bench_train.ratio_text(seconds, name)}")
    for name, difference in differences.items():
        print(f"largest weight difference from trainkit's after {args.steps} steps, {name}: {difference:.1e}")


if __name__ == "__main__":
    main()
