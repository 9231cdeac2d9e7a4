"""Rank 0's console: a tqdm progress bar on a terminal (step, loss, lr, samples/s), and the periodic
log lines either way. A batch job's log (stdout not a terminal) gets the lines only, no bar
redraws; TQDM_DISABLE=1 turns the bar off on a terminal too. Other ranks print nothing."""

import sys

from tqdm import tqdm


def headline(task) -> tuple[str, ...]:
    """The metrics a task's lines show: its `headline` (e.g. loss, acc, bpc, not each operand pair's acc), else
    every metric it declares (`metrics`); () for a task that declares none: then every metric it reports."""
    return tuple(getattr(task, "headline", None) or getattr(task, "metrics", None) or ())


def metrics_text(metrics: dict[str, float], split: str, names: tuple[str, ...] = (), sep: str = " | ") -> str:
    """`val loss 0.0940 | val acc 0.9666` of `<split>/<name>` keys: `names` in order, then each named evaluation
    set's (data.eval_sets: `val/extra loss 0.1012 | ...`); without `names` every `<split>/` key."""
    keys = [f"{split}/{name}" for name in names] if names else [k for k in metrics if k.startswith(f"{split}/")]
    texts = [f"{split} {key.removeprefix(split + '/')} {metrics[key]:.4f}" for key in keys if key in metrics]
    for named in named_splits(metrics, split, names):
        texts += [f"{named} {name} {metrics[f'{named}/{name}']:.4f}" for name in names if f"{named}/{name}" in metrics]
    return sep.join(texts)


def named_splits(metrics: dict[str, float], split: str, names: tuple[str, ...]) -> list[str]:
    """The named sets' `<split>/<set>` among `<split>/<set>/<metric>` keys, in order: a metric of `names` after a
    set, where `<set>/<metric>` is none of `names` (distil's val/loss/ce is its own metric, no set named loss)."""
    found: dict[str, None] = {}
    for key in metrics:
        head, _, rest = key.partition("/")
        name, _, metric = rest.partition("/")
        if head == split and metric in names and f"{name}/{metric}" not in names:
            found[f"{split}/{name}"] = None
    return list(found)


class Progress:
    def __init__(self, is_main: bool, total_steps: int, step: int, shown: tuple[str, ...] = ()):
        """shown: the metrics an evaluation's line shows (headline(task)); (): every one."""
        self.is_main, self.shown = is_main, shown
        on_terminal = is_main and sys.stdout.isatty()
        self.bar = (
            tqdm(total=total_steps, initial=step, unit="step", dynamic_ncols=True, file=sys.stdout)
            if on_terminal
            else None
        )

    def step(self, step: int) -> None:
        """Optimizer steps up to `step` done (no host sync: the bar counts, the numbers come with log rows)."""
        if self.bar is not None:
            self.bar.update(step - self.bar.n)

    def row(self, loss: float, lr: float, samples_per_s: float) -> None:
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", samples_s=f"{samples_per_s:,.0f}")

    def train_line(self, step: int, total_steps: int, epoch: int, row: dict) -> None:
        """A log row's line (and the bar's numbers); a task's loss terms (`loss/<term>`: loss_terms) after the loss."""
        self.row(row["loss"], row["lr"], row["samples_per_s"])
        terms = "".join(f" | {key} {value:.4f}" for key, value in row.items() if key.startswith("loss/"))
        self.print(
            f"step {step:>5}/{total_steps} | epoch {epoch} | loss {row['loss']:.4f}{terms} | "
            f"lr {row['lr']:.2e}{groups_lr(row)} | "
            f"grad norm {row['grad_norm']:.3f} | {row['samples_per_s']:,.0f} samples/s"
            + (f" | {row['tokens_per_s']:,.0f} tokens/s" if "tokens_per_s" in row else "")
        )

    def val_line(self, step: int, total_steps: int, val: dict) -> None:
        """An evaluation's line: the task's metrics (val loss, val acc, ...), the best so far."""
        best = next((k for k in val if k.startswith("best/") and k != "best/step"), None)
        self.print(
            f"step {step:>5}/{total_steps} | {metrics_text(val, 'val', self.shown)}"
            + (f" | best {best.removeprefix('best/')} {val[best]:.4f} (step {val['best/step']})" if best else "")
        )

    def print(self, line: str) -> None:
        """A log line from rank 0, above the bar."""
        if self.bar is not None:
            self.bar.write(line)
        elif self.is_main:
            print(line, flush=True)

    def __enter__(self):
        return self

    def __exit__(self, *_):
        if self.bar is not None:
            self.bar.close()


def done_line(step: int, val: dict, selection, test: dict, wrote: list, shown: tuple[str, ...] = ()) -> str:
    """The run's last line: its steps, the last evaluation's metrics (`shown`: headline(task)), the best
    monitored value (trainkit.selection) and its step, the test pass's metrics, the files written."""
    summary = metrics_text(val, "val", shown, ", ") if val else "no validation split"
    if selection.best is not None:
        summary += f", best {selection.monitor} {selection.best:.4f} at step {selection.best_step}"
    summary += f", {metrics_text(test, 'test', shown, ', ')}" if test else ""
    return f"done: {step} steps, {summary}; wrote {', '.join(map(str, wrote))}"


def groups_lr(row: dict, shown: int = 3) -> str:
    """The named groups' lrs beside `lr` (optim.groups, layer decay: lr/<name>), e.g. " (encoder 5.00e-03)"."""
    named = [f"{key.removeprefix('lr/')} {value:.2e}" for key, value in row.items() if key.startswith("lr/")]
    if not named:
        return ""
    return f" ({', '.join(named[:shown])}{', ...' if len(named) > shown else ''})"
