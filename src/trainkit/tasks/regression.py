"""task=regression: the squared error per sample; val/rmse and val/r2 exact at any world size."""

import math

import torch


class Regression:
    """One real-valued target per sample: the squared error per sample; val/loss is the mean squared
    error, val/rmse its root, val/r2 the coefficient of determination 1 - SSE / SST of the split, with SST
    from the all-reduced sums of y and y^2 (no per-rank means: exact at any world size). The model's
    output of shape (N, 1) is read as (N,)."""

    items_name = None  # items are samples
    eval_width = 4  # len(eval_sums(...))
    metrics = {"loss": "min", "rmse": "min", "r2": "max"}
    monitor = "val/r2"

    def loss_sum(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (output.reshape(target.shape) - target).pow(2).sum()

    def items(self, target: torch.Tensor) -> torch.Tensor:
        return torch.tensor(len(target), device=target.device)

    def eval_sums(self, inputs: torch.Tensor, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """[squared errors, samples, sum of y, sum of y^2], float64 (evaluate all-reduces them)."""
        y = target.double()
        error = (output.double().reshape(y.shape) - y).pow(2).sum()
        return torch.stack([error, y.new_tensor(float(len(y))), y.sum(), y.pow(2).sum()])

    def eval_metrics(self, sums: list[float]) -> dict[str, float]:
        error, samples, total, squares = sums
        spread = squares - total * total / samples  # SST: the squared deviations from the split's mean
        mse = error / samples
        return {"loss": mse, "rmse": math.sqrt(mse), "r2": 1 - error / spread if spread > 0 else math.nan}

    def predictions(self, output: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
        """predict.py's columns beside `index`, one row per sample."""
        return {"target": target, "prediction": output.reshape(target.shape)}
