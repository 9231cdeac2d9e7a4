"""Optimizer steps with a non-finite loss or gradient: decided on all ranks together (a rank
that skips alone hangs the others), and a skipped window leaves no trace."""

import torch

from trainkit.dist import Dist
from trainkit.errors import RunError


class StepGuard:
    """What to do with the optimizer step just computed: "step", "skip" (a non-finite loss or
    gradient with trainer.on_nonfinite=skip) or "overflow" (fp16: GradScaler's own skip, which
    lowers the loss scale). With on_nonfinite=raise a non-finite window raises RunError.

    Deciding before the step costs one all-reduce and a host sync per step, so it is done only
    where the step depends on it: on_nonfinite=skip, and fp16 (GradScaler.step syncs anyway).
    The default, on_nonfinite=raise without fp16, steps on and is checked (`check`) before each
    log row and each checkpoint: a non-finite loss or gradient propagates into the meter's sums,
    so one all-reduce there tells, and no checkpoint, row or model.pt ever holds it.

    A window's forwards update the model's buffers (BatchNorm running statistics) before the
    loss is known: with `skip` they are copied before each window and put back when it is
    dropped, so parameters, buffers, optimizer and scheduler are as before it."""

    def __init__(
        self, model: torch.nn.Module, on_nonfinite: str, scaler: torch.amp.GradScaler, d: Dist, keep: bool = False
    ):
        """keep: copy the buffers before each window also without skip (data.batch_size=auto retries windows)."""
        self.on_nonfinite, self.scaler, self.d = on_nonfinite, scaler, d
        self.deferred = on_nonfinite == "raise" and not scaler.is_enabled()
        self.checked = 0  # deferred: the steps up to here are known to be finite
        self.buffers = list(model.buffers()) if on_nonfinite == "skip" or keep else []
        self.saved = [b.clone() for b in self.buffers]

    def start_window(self) -> None:
        if not self.buffers:  # on_nonfinite=raise (the default): nothing to keep
            return
        for saved, buffer in zip(self.saved, self.buffers, strict=True):
            saved.copy_(buffer)

    def put_back_buffers(self) -> None:
        """The buffers as before the window (BatchNorm's running statistics)."""
        for saved, buffer in zip(self.saved, self.buffers, strict=True):
            buffer.copy_(saved)

    def decide(self, meter, grad_norm: torch.Tensor, step: int) -> str:
        """meter: the TrainMeter whose `window_loss` is this rank's loss sum of the window (read only
        where needed: its stack and sum cost ~7 us, 1 % of the default job's step); grad_norm: the
        global norm (the same on every rank). Deferred: "step", at no cost. Else one all-reduce; the host waits."""
        if self.deferred:
            return "step"
        window_loss = meter.window_loss
        bad_loss, bad_grad = self.d.any_each(torch.stack([~torch.isfinite(window_loss), ~torch.isfinite(grad_norm)]))
        if bad_grad and not bad_loss and self.scaler.is_enabled():
            return "overflow"  # fp16: the scaled gradient overflowed; GradScaler skips and backs off
        if not (bad_loss or bad_grad):
            return "step"
        if self.on_nonfinite == "raise":
            self._raise(step, step)
        return "skip"

    def check(self, meter, step: int) -> None:
        """Deferred: raise on every rank if a step since the last check had a non-finite loss or
        gradient (call before a log row takes the meter's sums, and before a checkpoint)."""
        if not self.deferred or step == self.checked:
            return
        if not meter.finite():  # a step after the last check and after the meter's last row
            self._raise(max(self.checked, step - meter.steps) + 1, step)
        self.checked = step

    def _raise(self, first: int, last: int):
        where = f"at step {last}" if first == last else f"in steps {first}-{last}"
        raise RunError(f"non-finite loss or gradient {where} (trainer.on_nonfinite=raise; skip drops such windows)")

    def undo(self, outcome: str) -> None:
        """The step was not taken: put back what the window changed."""
        if outcome == "overflow":
            self.scaler.update()  # unscale_ recorded the overflow: the scale backs off, as GradScaler.step would
            return
        self.put_back_buffers()
        if self.scaler.is_enabled():  # close the step GradScaler's unscale_ opened, the scale unchanged
            self.scaler.update(self.scaler.get_scale())
