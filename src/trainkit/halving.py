"""Evaluation and prediction batches that halve when a rank runs out of memory (data.batch_size=auto).

Each rank reads its contiguous shard (loading.eval_loader: every sample exactly once, rank order is
dataset order). With `halve`, the ranks go through their shards in step: the i-th batch of every rank
starts at the same offset of its shard. After each batch's forward they agree through one all-reduce
of a flag (rule 17) whether any rank ran out of memory; if one did, every rank drops that batch's
result and reads the same samples again at half the batch size, which the next pass starts at. A
forward holds no state to undo, and evaluation metrics are sums and counts: the results are those
of the full batch (to float rounding: a per-sample loss may differ in its last bits at another batch
size).

The agreement costs one all-reduce of a flag per batch (a host sync). Under FSDP, whose units
all-gather in their forward, the ranks also agree before each unit (as autobatch's points do while
searching, here in every evaluation): an out of memory between two all-gathers is retried too. Every
rank runs as many steps as the rank with the largest shard: a rank that is done runs empty batches
under FSDP (its forwards must join the all-gathers) and otherwise takes only the agreements.
"""

import contextlib
from collections.abc import Callable, Iterable, Iterator

import torch
from torch.distributed.fsdp import FSDPModule
from torch.utils.data import Dataset

from trainkit.batch import emptied
from trainkit.dist import Dist
from trainkit.errors import RunError, out_of_memory
from trainkit.loading import collate_fn, eval_loader, length, shard_bounds
from trainkit.parallel import EqualBatches


class _PeerOutOfMemory(Exception):
    """Raised at an agreement point inside a forward when another rank ran out of memory."""


class EvalBatches:
    """This rank's shard of `dataset` in batches of `batch_size` (an int, or a callable read at each
    pass: train.py's follows the training micro-batch) and, with `halve`, smaller after an out of
    memory. Use:

        for batch in batches.over(model):
            with batches.catching():
                result = ...  # the forward
            if batches.fits():  # all ranks together; else the same samples come again, half as many
                keep(result)
        batches.check()  # a RunError when even a batch of 1 did not fit (every rank raises it)
    """

    def __init__(
        self,
        dataset: Dataset,
        d: Dist,
        batch_size: int | Callable[[], int],
        num_workers: int,
        halve: bool = False,
        equal_forwards: bool = False,
        what: str = "evaluation",
    ):
        self.dataset, self.d, self.num_workers, self.what = dataset, d, num_workers, what
        self.limit = batch_size if callable(batch_size) else (lambda: batch_size)
        self.halve, self.equal_forwards = halve, equal_forwards  # equal_forwards: FSDP (every rank's forward joins)
        self.fitting: int | None = None  # the batch size found to fit, when it halved
        self.armed = self.oom = False
        self.failure: RunError | None = None

    @property
    def batch_size(self) -> int:
        return min(self.limit(), self.fitting or self.limit())

    def over(self, model: torch.nn.Module | None = None) -> Iterator:
        """The batches of one pass; `model`: the module whose FSDP units need agreement points."""
        self.failure = None
        if not self.halve:
            loader: Iterable = eval_loader(self.dataset, self.d, self.batch_size, self.num_workers)
            yield from EqualBatches(loader, self.d.world_size) if self.equal_forwards else loader
            return
        units = [m for m in model.modules() if isinstance(m, FSDPModule)] if model is not None else []
        points = [unit.register_forward_pre_hook(self._point, prepend=True) for unit in units]  # before its all-gather
        try:
            yield from self._in_step(units[0] if units else None)
        finally:
            for handle in points:
                handle.remove()

    def _in_step(self, fsdp_root) -> Iterator:
        n, world, rank = length(self.dataset), self.d.world_size, self.d.rank
        start, end = shard_bounds(n, world, rank)
        first, last = shard_bounds(n, world, 0)
        longest = last - first  # rank 0's shard is a largest one
        b = self.batch_size
        tried, done, batches = [b], 0, None
        while done < longest:
            self.oom = False
            if done < end - start:
                if batches is None:  # from the first sample not done, at this batch size
                    batches = iter(eval_loader(self.dataset, self.d, b, self.num_workers, skip=done))
                yield next(batches)
            elif self.equal_forwards:  # done, but every FSDP forward needs every rank: an empty batch
                yield emptied(collate_fn(self.dataset)([self.dataset[0]]))
            else:  # done: only the agreement the others take after their forward
                self.fits()
            if not self.oom:
                done += b
                continue
            if fsdp_root is not None:
                fsdp_root.reset_iter_state()  # FSDP2's recovery from an aborted forward
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            if b == 1:
                self.failure = RunError(
                    f"out of memory in {self.what} at a batch of 1 (data.batch_size=auto): one sample does not fit; "
                    "try a smaller model or trainer.precision=bf16"
                )
                break
            b, batches = b // 2, None
            tried.append(b)
            self.fitting = b
        if len(tried) > 1:
            self.d.print0(f"{self.what} batch {' -> '.join(map(str, tried))} (out of memory)")

    def _point(self, *_) -> None:
        """Before an FSDP unit's forward (its all-gather): raises on every rank when one ran out of memory."""
        if self.armed:
            self.oom = self.d.any(False)
            if self.oom:
                self.armed = False
                raise _PeerOutOfMemory

    @contextlib.contextmanager
    def catching(self):
        """A batch's forward: running out of memory ends this rank's attempt at the batch."""
        if not self.halve:
            yield
            return
        self.armed = True
        try:
            yield
        except _PeerOutOfMemory:
            pass
        except Exception as error:
            if not out_of_memory(error):
                raise
            self.armed = False
            self.oom = self.d.any(True)  # the point the others wait at (a unit's, or the batch's end), in their place
        finally:
            self.armed = False

    def fits(self) -> bool:
        """After the batch, on every rank: did it fit on all? (Decided at a point already when it did not.)"""
        if self.halve and not self.oom:
            self.oom = self.d.any(False)
        return not self.oom

    def check(self) -> None:
        if self.failure is not None:
            raise self.failure

    def state_dict(self) -> dict:
        return {"eval_batch": self.fitting} if self.fitting else {}

    def load_state_dict(self, state: dict | None) -> None:
        if self.halve and state and state.get("eval_batch"):
            self.fitting = state["eval_batch"]


class EvalSets:
    """A split's EvalBatches (None: the run has none, e.g. no test split) and each named evaluation set's
    (data.eval_sets, built by trainkit.heldout.batches), measured together by evaluate.evaluate_sets as
    `<prefix>/*` and `<prefix>/<name>/*`. Where train.py and a checkpoint treat it as the split's EvalBatches:
    its batch size, a check of every set's, the batch sizes they found (data.batch_size=auto)."""

    def __init__(self, main: EvalBatches | None, named: dict[str, EvalBatches]):
        self.main, self.named = main, named

    def prefixed(self, prefix: str) -> list[tuple[str, EvalBatches]]:
        """[(prefix, the split's), (prefix/<name>, each named set's), ...]: each evaluated under its prefix."""
        main = [(prefix, self.main)] if self.main is not None else []
        return main + [(f"{prefix}/{name}", batches) for name, batches in self.named.items()]

    @property
    def batch_size(self) -> int:
        assert self.main is not None  # val's: every run has a val split (a test pass follows val's, not this)
        return self.main.batch_size

    def check(self) -> None:
        for _, batches in self.prefixed(""):
            batches.check()

    def state_dict(self) -> dict:
        state = self.main.state_dict() if self.main is not None else {}
        found = {name: batches.fitting for name, batches in self.named.items() if batches.fitting}
        return state | ({"eval_sets": found} if found else {})

    def load_state_dict(self, state: dict | None) -> None:
        """A checkpoint's; a set it does not name (added on this resume) starts at val's batch."""
        if self.main is not None:
            self.main.load_state_dict(state)
        found = (state or {}).get("eval_sets", {})
        for name, batches in self.named.items():
            batches.load_state_dict({"eval_batch": found.get(name)})


class _Plain:
    """Any iterable of batches as EvalBatches without halving."""

    failure = None

    def __init__(self, loader: Iterable):
        self.loader = loader

    def over(self, model=None) -> Iterator:
        return iter(self.loader)

    def catching(self):
        return contextlib.nullcontext()

    def fits(self) -> bool:
        return True

    def check(self) -> None:
        pass


def batches_of(loader: Iterable) -> EvalBatches | _Plain:
    """EvalBatches as they are; a plain loader (a DataLoader, a list of batches) without halving."""
    return loader if isinstance(loader, EvalBatches) else _Plain(loader)
