"""Contrastive learning, SimCLR-style (+experiment=digits_simclr): two random views of every sample, NT-Xent
over the global batch (task=contrastive: its loss couples the batch, trainkit/coupled.py makes it exact at
any allocation), evaluated by k-nearest-neighbour accuracy of the encoder's embeddings (val/knn_acc).

Here: the task and its kNN evaluation; the views: trainkit/data/digits_views.py, the model:
trainkit/models/simclr.py."""

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import MISSING
from torch import nn
from torch.utils.data import Dataset

from trainkit.batch import to_device
from trainkit.dist import Dist
from trainkit.errors import ConfigError
from trainkit.inference import gather
from trainkit.loading import eval_loader
from trainkit.parallel import EqualBatches


@dataclass
class Schema:
    """conf/task/contrastive.yaml's keys and their types."""

    _target_: str = MISSING
    temperature: float = 0.5
    knn_k: int = 10
    bank_batch_size: int = 256
    bank: Any = None  # a _target_ node: the labelled split kNN classifies against


class Contrastive:
    """NT-Xent (Chen et al. 2020): a batch of N samples gives 2N views; each view's positive is its sample's
    other view, its negatives the other 2N - 2 views of the *global* batch. loss_sum is the sum over samples
    of the mean of its two views' losses, so the loop's mean over samples is SimCLR's mean over views.

    Batches: {"views": (n, 2, *shape), "label": (n,)} to train (the labels are not used), (image, label) pairs
    to evaluate. The model gets the views as (2n, *shape), a sample's two views side by side; in train mode it
    returns projections, in eval mode the encoder's embeddings (model=simclr).

    Evaluation: every val/test image is classified by its `knn_k` nearest (cosine) embeddings of the labelled
    `bank` (the train split without augmentation), a vote weighted by similarity; the bank's embeddings are
    computed on every rank's contiguous shard and gathered (prepare_eval), so val/knn_acc is exact at any world
    size."""

    couples_batch = True  # loss_sum gets the outputs of the whole global window (trainkit/coupled.py)
    items_name = None  # items are samples
    eval_width = 2  # correct, samples
    metrics = {"knn_acc": "max"}
    monitor = "val/knn_acc"

    def __init__(self, bank: Dataset | None, temperature: float = 0.5, knn_k: int = 10, bank_batch_size: int = 256):
        if bank is None:
            raise ConfigError(
                "task.bank=null: task=contrastive evaluates by kNN against a labelled split, e.g. "
                "+experiment=digits_simclr's (digits' train split)"
            )
        if not temperature > 0:
            raise ConfigError(f"task.temperature={temperature} must be > 0")
        if not (isinstance(knn_k, int) and knn_k >= 1):
            raise ConfigError(f"task.knn_k={knn_k} must be an integer >= 1")
        self.bank, self.temperature, self.knn_k, self.bank_batch_size = bank, temperature, knn_k, bank_batch_size
        self.bank_embeddings = self.bank_labels = torch.empty(0)

    def unpack(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(batch, dict):  # training: both views of each sample, side by side
            return batch["views"].flatten(0, 1), batch["label"]
        return batch[0], batch[1]

    def loss_sum(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nt_xent(output, self.temperature).sum() / 2

    def items(self, target: torch.Tensor) -> torch.Tensor:
        return torch.tensor(len(target), device=target.device)

    @torch.inference_mode()
    def prepare_eval(self, model: nn.Module, d: Dist, autocast) -> None:
        """The bank's embeddings and labels, in dataset order, on every rank (the model in eval mode)."""
        loader = eval_loader(self.bank, d, self.bank_batch_size, 0)
        embedded, labels = [], []
        for x, y in EqualBatches(loader, d.world_size):  # FSDP: every rank as many forwards
            with autocast():
                embedded.append(model(to_device(x, d.device)).float())
            labels.append(y.to(d.device))
        self.bank_embeddings = F.normalize(gather(torch.cat(embedded), d), dim=1)
        self.bank_labels = gather(torch.cat(labels), d)

    def eval_sums(self, inputs: torch.Tensor, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        predicted = knn_predict(output.float(), self.bank_embeddings, self.bank_labels, self.knn_k)
        correct = (predicted == target).sum().double()
        return torch.stack([correct, correct.new_full((), len(target))])

    def eval_metrics(self, sums: list[float]) -> dict[str, float]:
        correct, samples = sums
        return {"knn_acc": correct / samples}

    def embeddings(self, output: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
        """predict.py's embeddings.pt: the encoder's embedding of every sample (eval mode) and its label."""
        return {"embedding": output, "label": target}


def nt_xent(output: torch.Tensor, temperature: float) -> torch.Tensor:
    """Each view's NT-Xent loss: rows 2i and 2i+1 of `output` are sample i's two views (float32)."""
    z = F.normalize(output.float(), dim=1)
    similarity = (z @ z.T / temperature).masked_fill(torch.eye(len(z), dtype=torch.bool, device=z.device), -math.inf)
    rows = torch.arange(len(z), device=z.device)
    return torch.logsumexp(similarity, dim=1) - similarity[rows, rows ^ 1]


def knn_predict(queries: torch.Tensor, bank: torch.Tensor, labels: torch.Tensor, k: int) -> torch.Tensor:
    """Each query's class by its k most cosine-similar rows of `bank` (normalised), a vote weighted by similarity."""
    similarity, nearest = (F.normalize(queries, dim=1) @ bank.T).topk(min(k, len(bank)), dim=1)
    votes = torch.zeros(len(queries), int(labels.max()) + 1, device=queries.device)
    return votes.scatter_add_(1, labels[nearest], similarity).argmax(dim=1)
