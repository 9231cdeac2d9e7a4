"""Rank 0's console: a tqdm progress bar on a terminal (step, loss, lr, samples/s), and the periodic
log lines either way. A batch job's log (stdout not a terminal) gets the lines only, no bar
redraws; TQDM_DISABLE=1 turns the bar off on a terminal too. Other ranks print nothing."""

import sys

from tqdm import tqdm


class Progress:
    def __init__(self, is_main: bool, total_steps: int, step: int):
        self.is_main = is_main
        on_terminal = is_main and sys.stdout.isatty()
        self.bar = (
            tqdm(total=total_steps, initial=step, unit="step", dynamic_ncols=True, file=sys.stdout)
            if on_terminal
            else None
        )

    def step(self) -> None:
        """One optimizer step done (no host sync: the bar counts, the numbers come with log rows)."""
        if self.bar is not None:
            self.bar.update()

    def row(self, loss: float, lr: float, samples_per_s: float) -> None:
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", samples_s=f"{samples_per_s:,.0f}")

    def train_line(self, step: int, total_steps: int, epoch: int, row: dict) -> None:
        """A log row's line (and the bar's numbers)."""
        self.row(row["loss"], row["lr"], row["samples_per_s"])
        self.print(
            f"step {step:>5}/{total_steps} | epoch {epoch} | loss {row['loss']:.4f} | lr {row['lr']:.2e} | "
            f"grad norm {row['grad_norm']:.3f} | {row['samples_per_s']:,.0f} samples/s"
            + (f" | {row['tokens_per_s']:,.0f} tokens/s" if "tokens_per_s" in row else "")
        )

    def val_line(self, step: int, total_steps: int, val: dict) -> None:
        """An evaluation's line: val loss and acc, bits/char for text, the best so far."""
        best = next((k for k in val if k.startswith("best/") and k != "best/step"), None)
        self.print(
            f"step {step:>5}/{total_steps} | val loss {val['val/loss']:.4f} | val acc {val['val/acc']:.4f}"
            + (f" | {val['val/bpc']:.3f} bits/char" if "val/bpc" in val else "")
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


def done_line(step: int, val: dict, selection, test: dict, wrote: list) -> str:
    """The run's last line: its steps, the last val/acc, the best monitored value (trainkit.selection)
    and its step, the test accuracy, the files written."""
    summary = f"val acc {val['val/acc']:.4f}" if val else "no validation split"
    if selection.best is not None:
        summary += f", best {selection.monitor} {selection.best:.4f} at step {selection.best_step}"
    summary += f", test acc {test['test/acc']:.4f}" if test else ""
    return f"done: {step} steps, {summary}; wrote {', '.join(map(str, wrote))}"
