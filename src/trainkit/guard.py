"""Optimizer steps with a non-finite loss or gradient: decided on all ranks together (a rank
that skips alone hangs the others), and a skipped window leaves no trace."""

import torch

from trainkit.config import RunError
from trainkit.dist import Dist


class StepGuard:
    """What to do with the optimizer step just computed: "step", "skip" (a non-finite loss or
    gradient with trainer.on_nonfinite=skip) or "overflow" (fp16: GradScaler's own skip, which
    lowers the loss scale). With on_nonfinite=raise a non-finite window raises RunError.

    A window's forwards update the model's buffers (BatchNorm running statistics) before the
    loss is known: with `skip` they are copied before each window and put back when it is
    dropped, so parameters, buffers, optimizer and scheduler are as before it."""

    def __init__(self, model: torch.nn.Module, on_nonfinite: str, scaler: torch.amp.GradScaler, d: Dist):
        self.on_nonfinite, self.scaler, self.d = on_nonfinite, scaler, d
        self.buffers = list(model.buffers()) if on_nonfinite == "skip" else []
        self.saved = [b.clone() for b in self.buffers]

    def start_window(self) -> None:
        for saved, buffer in zip(self.saved, self.buffers, strict=True):
            saved.copy_(buffer)

    def decide(self, window_loss: torch.Tensor, grad_norm: torch.Tensor, step: int) -> str:
        """window_loss: this rank's loss sum of the window; grad_norm: the global norm (the
        same on every rank). One all-reduce; the host waits for its result."""
        bad_loss, bad_grad = self.d.any_each(torch.stack([~torch.isfinite(window_loss), ~torch.isfinite(grad_norm)]))
        if bad_grad and not bad_loss and self.scaler.is_enabled():
            return "overflow"  # fp16: the scaled gradient overflowed; GradScaler skips and backs off
        if not (bad_loss or bad_grad):
            return "step"
        if self.on_nonfinite == "raise":
            raise RunError(
                f"non-finite loss or gradient at step {step} (trainer.on_nonfinite=raise; skip drops such windows)"
            )
        return "skip"

    def undo(self, outcome: str) -> None:
        """The step was not taken: put back what the window changed."""
        if outcome == "overflow":
            self.scaler.update()  # unscale_ recorded the overflow: the scale backs off, as GradScaler.step would
            return
        for saved, buffer in zip(self.saved, self.buffers, strict=True):
            buffer.copy_(saved)
        if self.scaler.is_enabled():  # close the step GradScaler's unscale_ opened, the scale unchanged
            self.scaler.update(self.scaler.get_scale())
