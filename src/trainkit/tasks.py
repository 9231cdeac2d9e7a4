"""What is learned: a task turns a batch's model output and targets into the summed loss of its
loss-bearing items (the loop normalises it over the global window) and the evaluation sums.
train.py and evaluate.py are the same for every task: forking for another task means writing
one class here (or in your project) and its conf/task/<name>.yaml."""

import torch
import torch.nn.functional as F


class Classification:
    """Items are samples: per-sample cross-entropy; accuracy is argmax == target."""

    def loss_sum(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The summed loss of the batch's items (0 for an empty batch)."""
        return F.cross_entropy(output, target, reduction="sum")

    def eval_sums(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """[loss sum, correct, items] of one evaluation batch, float64 (all-reduced by evaluate)."""
        loss = F.cross_entropy(output.float(), target, reduction="sum")  # float32 also under autocast
        correct = (output.argmax(dim=1) == target).sum()
        return torch.stack([loss.double(), correct.double(), torch.tensor(len(target), dtype=torch.float64)])
