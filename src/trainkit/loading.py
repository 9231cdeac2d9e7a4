"""Loading batches: the train split sharded by DistributedSampler, evaluation by contiguous shards that
never pad or repeat a sample; and what a data set may use (InMemory, held_out). The data sets themselves
are in trainkit/data/ (the room of conf/data)."""

import contextlib
import functools
import itertools
import math
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import cast

import torch
import torch.distributed as tdist
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, TensorDataset

from trainkit.accumulate import EpochLayout
from trainkit.batch import collate, emptied, leaves, to_device
from trainkit.dist import Dist, place
from trainkit.errors import ConfigError, DataUnavailable
from trainkit.rng import sample_seed, seed_all


def draws_random(dataset: Dataset) -> bool:
    """Whether loading a sample of `dataset` may draw from python's, numpy's or torch's global RNG
    (a random augmentation): its `draws_random` attribute ("torch": from torch's generator alone), and True
    for a data set without one (a user's data set may draw). SeededBatches seeds the generators before each
    sample only where it may."""
    return bool(getattr(dataset, "draws_random", True))


class InMemory(TensorDataset):
    """A TensorDataset that loads a batch with one indexing per tensor (DataLoader calls
    `__getitems__`) instead of one per sample: for the default job that was a fifth of a step."""

    draws_random = False  # tensors as they are: nothing to seed, and TrainLoader's fast path

    def __getitems__(self, indices: list[int]) -> list:
        return list(zip(*(tensor[indices] for tensor in self.tensors), strict=True))


def held_out(samples: int, val_fraction: float, test_fraction: float) -> tuple[int, int]:
    """(val, test) sizes of data.splits' fractions, refused in one line where they leave no training sample."""
    for key, value in (("val_fraction", val_fraction), ("test_fraction", test_fraction)):
        if not 0 <= value < 1:
            raise ConfigError(f"data.splits.{key}={value} must be >= 0 and < 1")
    n_val, n_test = round(samples * val_fraction), round(samples * test_fraction)
    if n_val + n_test >= samples:
        raise ConfigError(
            f"data.splits.val_fraction={val_fraction} + test_fraction={test_fraction} leave no training samples"
        )
    return n_val, n_test


def collate_fn(dataset: Dataset):
    """The data set's own `collate_fn` (e.g. padding sequences to the batch's longest), else
    torch's default (and dataclass samples field by field: trainkit.batch.collate)."""
    return getattr(dataset, "collate_fn", collate)


def length(dataset: Dataset) -> int:
    """len() of a map-style data set (torch's Dataset type declares no __len__)."""
    return len(dataset)  # type: ignore[arg-type]


def shard_bounds(num_samples: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, end) of rank's contiguous shard; shard sizes differ by at most one."""
    base, extra = divmod(num_samples, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


class ContiguousSampler(Sampler[int]):
    """Rank r reads the contiguous block [start_r, end_r): every sample exactly once over all
    ranks, no padding duplicates (DistributedSampler pads and strides, which double-counts
    samples in metrics), and per-rank results concatenate back into dataset order."""

    def __init__(self, num_samples: int, world_size: int, rank: int, skip: int = 0):
        self.start, self.end = shard_bounds(num_samples, world_size, rank)
        self.start = min(self.start + skip, self.end)  # skip: the block's first samples (done already)

    def __iter__(self):
        return iter(range(self.start, self.end))

    def __len__(self) -> int:
        return self.end - self.start


class TrainBatches(Sampler[tuple[int, list[int]]]):
    """This rank's micro-batches of one epoch: DistributedSampler's shard of the epoch's
    permutation without its padding repeats, cut into micro-batches of `(epoch, indices)`.

    DistributedSampler pads the epoch to a multiple of the world size by repeating samples at
    the end of some ranks' shards. They are cut off here, so they never reach a forward: neither
    the loss nor BatchNorm statistics see them, and W ranks train exactly what one process does.
    Such a rank's last micro-batch is one sample short, or missing (the loop then runs an empty
    batch: every rank must run the same micro-steps). `start` skips micro-batches (a mid-epoch
    resume) without loading them. The epoch goes with the indices: SeededBatches seeds the RNGs
    from (seed, epoch, sample index) before loading each sample of a data set that draws.
    """

    def __init__(
        self,
        num_samples: int,
        world_size: int,
        rank: int,
        batch_size: int,
        seed: int,
        shuffle: bool = True,
        global_order: Callable[[int], torch.Tensor] | None = None,
    ):
        """shuffle=False (data.shuffle): the epoch in the data set's order, global window s = samples s·B..(s+1)·B-1.
        global_order(epoch): the epoch's order where the data set defines it (`epoch_order`: a shard set's locality),
        in place of the permutation of (seed + epoch); rank r still takes its positions r, r+W, ..."""
        indices = range(num_samples)  # DistributedSampler only takes the len() of its "dataset"
        self.shard: DistributedSampler = DistributedSampler(
            indices,  # type: ignore[arg-type]
            num_replicas=world_size,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=False,
        )
        real = len(range(rank, num_samples, world_size))  # this rank's shard less the padding
        self.real, self.batches = real, math.ceil(real / batch_size)
        self.batch_size, self.epoch, self.start = batch_size, 0, 0
        self.global_order = global_order if shuffle else None  # data.shuffle=false: the data set's order

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.shard.set_epoch(epoch)

    def order(self) -> list[int]:
        """This rank's samples of the epoch, in order, without the padding."""
        if self.global_order is not None:
            return self.order_tensor().tolist()
        return list(itertools.islice(self.shard, self.real))

    def order_tensor(self) -> torch.Tensor:
        """order() as a tensor, computed as DistributedSampler does without its Python lists (~0.1 ms an
        epoch): the permutation of (seed + epoch), this rank's every W-th position from `rank` on (the
        padding repeats are appended past position N-1, so they are never among them)."""
        shard = self.shard
        if not shard.shuffle:
            return torch.arange(shard.rank, len(shard.dataset), shard.num_replicas)  # type: ignore[arg-type]
        if self.global_order is not None:
            order = self.global_order(self.epoch)
            if order.shape != (len(shard.dataset),):  # type: ignore[arg-type]
                raise RuntimeError(f"epoch_order gave {tuple(order.shape)} positions for {len(shard.dataset)} samples")  # type: ignore[arg-type]
            return order[shard.rank :: shard.num_replicas]
        generator = torch.Generator().manual_seed(shard.seed + shard.epoch)
        return torch.randperm(len(shard.dataset), generator=generator)[shard.rank :: shard.num_replicas]  # type: ignore[arg-type]

    def __iter__(self):
        indices = self.order()
        for j in range(self.start, self.batches):
            yield self.epoch, indices[j * self.batch_size : (j + 1) * self.batch_size]

    def __len__(self) -> int:
        return max(0, self.batches - self.start)


class SeededBatches(Dataset):
    """`dataset`, loaded a micro-batch at a time (TrainBatches' `(epoch, indices)`); for a data set
    that draws (`draws_random`), python's, numpy's and torch's CPU generators are seeded from
    (seed, epoch, sample index) before each sample.

    What a random augmentation draws for a sample is then a function of that sample alone (rule 15):
    not of the rank, the micro-batch or the loader worker that loads it (workers are persistent and
    their RNG streams are in no checkpoint), so W ranks x K micro-batches train on the samples one
    process does, and a resume, on any world size, draws what the uninterrupted run drew. Such a
    data set is loaded a sample at a time (a `__getitems__` would draw for the batch at once). In the
    main process (num_workers=0) the seeding re-seeds training's stream too: train.py re-seeds it
    per optimizer step after the batches are fetched (rng.seed_step), so dropout does not depend on
    where they were loaded. Nothing is saved and put back: that cost more than the rest of a small
    model's step (numpy's state alone ~60 us). The seeding costs ~8 us a sample (a CIFAR crop, flip
    and normalise ~120 us): a data set that draws nothing says so (`draws_random = False`) and pays nothing."""

    def __init__(self, dataset: Dataset, seed: int):
        self.dataset, self.seed, self.draws = dataset, seed, draws_random(dataset)
        # draws_random = "torch": a data set whose draws come from torch's generator alone (torchvision's
        # transforms) has only that one seeded: re-seeding numpy's and python's cost ~25 us a sample
        # more, 6 % of loading a 64x64 JPEG (scripts/bench_data.py --images).
        self.torch_only = getattr(dataset, "draws_random", True) == "torch"
        # draws_random = "seed": the data set draws from the sample's seed itself, `dataset.seeded(index, seed)`
        # (data=tokens' block offsets): no generator is seeded, which cost 50 % of loading such a block.
        self.from_seed = getattr(dataset, "draws_random", True) == "seed"

    def __len__(self) -> int:
        return length(self.dataset)

    def __getitem__(self, index):
        return self.dataset[index]

    def __getitems__(self, batch: tuple[int, list[int]]) -> list:
        epoch, indices = batch
        if not self.draws:  # nothing random: the data set's own batch loading, if it has one
            load_batch = getattr(self.dataset, "__getitems__", None)
            return load_batch(indices) if load_batch is not None else [self.dataset[i] for i in indices]
        samples = []
        for i in indices:
            # On the CPU: CUDA's streams (dropout on a GPU) go on untouched.
            if self.from_seed:
                samples.append(self.dataset.seeded(i, sample_seed(self.seed, epoch, i)))  # type: ignore[attr-defined]
                continue
            if self.torch_only:
                torch.default_generator.manual_seed(sample_seed(self.seed, epoch, i))
            else:
                seed_all(sample_seed(self.seed, epoch, i), cuda=False)
            samples.append(self.dataset[i])
        return samples


DEVICE_SHARE = 0.5  # data.on_device=auto: the train split goes to the device where it takes at most this share of
# the memory free there (the rest: the model, its optimizer state, activations)


def tensor_form(dataset: Dataset) -> list[torch.Tensor] | None:
    """The host tensors a train split lives in, their rows its samples, where it declares them: an InMemory or plain
    TensorDataset's own, a data set's `device_tensors()` (addition's padded rows, FakeData's images made once, a
    corpus's token stream); None for any other data set (an image folder, a user's without the method)."""
    if isinstance(dataset, InMemory) or type(dataset) is TensorDataset:  # a subclass may draw: it says how
        return list(dataset.tensors)
    make = getattr(dataset, "device_tensors", None)
    return list(make()) if make is not None else None


def free_memory(device: torch.device) -> int | None:
    """Bytes free on `device`: the GPU's (cudaMemGetInfo), the host's available memory for the CPU (there "the
    device" is host memory); None where unknown (the meta device of the tests)."""
    with contextlib.suppress(ValueError, OSError, AttributeError, RuntimeError):  # RuntimeError: no CUDA after all
        if device.type == "cuda":
            return torch.cuda.mem_get_info(device)[0]
        if device.type == "cpu":  # MemAvailable counts the page cache the kernel gives back; free pages do not
            with contextlib.suppress(OSError, StopIteration):
                meminfo = Path("/proc/meminfo").read_text().splitlines()
                return int(next(line for line in meminfo if line.startswith("MemAvailable:")).split()[1]) * 1024
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return None


def _gb(size: int) -> str:
    return f"{size / 1e9:.2f} GB" if size >= 1e8 else f"{size / 1e6:.1f} MB"


def residency(dataset: Dataset, device: torch.device, on_device, num_workers: int) -> tuple[bool, str]:
    """data.on_device: whether the train split goes to the device once and its micro-batches are taken there by index
    (Resident), and why: the startup line's words. `auto` takes it where the data set has a tensor form, draws
    nothing on the host (or builds its draws itself: `device_batches`), asks for no loader worker, and fits in
    DEVICE_SHARE of the device's free memory; `true` takes it wherever the data set has a tensor form (a ConfigError,
    one line, where it has none or draws on the host); `false` never."""
    name = getattr(dataset, "startup_name", None) or type(dataset).__name__  # debug's subset: named so
    if on_device is False:
        return False, "data.on_device=false"
    why = None
    if not (isinstance(dataset, InMemory) or type(dataset) is TensorDataset or hasattr(dataset, "device_tensors")):
        why = f"{name} declares no tensor form (device_tensors)"
    elif draws_random(dataset) and type(dataset) is not TensorDataset and not hasattr(dataset, "device_batches"):
        drawn = getattr(dataset, "draws_random", True)
        why = f"{name} draws random augmentation on the host (draws_random={drawn})"
    if why is not None:
        if on_device is True:
            raise ConfigError(f"data.on_device=true: the train split cannot be on the device: {why}")
        return False, f"data.on_device=auto: {why}"
    if on_device == "auto" and num_workers:
        return False, f"data.on_device=auto: data.num_workers={num_workers} asks for loader workers"
    size = getattr(dataset, "device_bytes", None)
    size = size() if size is not None else sum(t.nbytes for t in tensor_form(dataset) or [])
    free = free_memory(device)
    room = f"{_gb(size)} of {_gb(free)} free" if free is not None else _gb(size)
    share, shared = device_share(device)
    if on_device == "auto" and free is not None and size > share * free:
        return False, f"data.on_device=auto: the split's {room} is over {share:.0%} of it{shared}"
    return True, f"data.on_device={'auto' if on_device == 'auto' else 'true'}: {room}"


def device_share(device: torch.device) -> tuple[float, str]:
    """The share of the free memory a rank's split may take (DEVICE_SHARE), and what the line says of it: on the CPU
    the node's local ranks share the host's memory and each makes its own copy (a corpus's token stream as int64),
    so DEVICE_SHARE is theirs together; a GPU is its rank's own."""
    ranks = place().local_world_size if device.type == "cpu" else 1
    return DEVICE_SHARE / ranks, f" ({DEVICE_SHARE:.0%} among {ranks} local ranks, each its own copy)" * (ranks > 1)


class Resident:
    """A train split on the device: its tensor form (tensor_form) moved there once, each epoch's micro-batches taken
    there by index from this rank's order (TrainBatches.order_tensor): no loader, no per-batch copy. A data set's
    `device_batches(tensors, order, batch_size, epoch, seed, rows)` builds them itself (a collate's padding, blocks
    drawn from per-sample seeds); without one, each tensor is gathered by the order once an epoch (one more copy of the
    shard) and the micro-batches are views of that (~1 us a batch). Either way each is the loader path's micro-batch
    bit for bit: the same samples in the same order, the same values and shapes (tests/test_on_device.py)."""

    def __init__(self, dataset: Dataset, device: torch.device):
        self.tensors = [t.to(device) for t in tensor_form(dataset) or []]
        self.build = getattr(dataset, "device_batches", None)
        self.device = device

    def epoch(self, order: torch.Tensor, batch_size: int, epoch: int, seed: int) -> Iterable:
        """The micro-batches of this rank's `order` (on the host: a data set may read host-side sizes by it)."""
        if self.build is not None:
            return self.build(self.tensors, order, batch_size, epoch, seed)
        on_device = order.to(self.device, non_blocking=True)  # once an epoch
        return zip(*(t[on_device].split(batch_size) for t in self.tensors), strict=True)


def ahead(batches: Iterable, device: torch.device) -> Iterator:
    """The loader's batches on `device`, each copied while the one before it computes: batch j+1's copy is issued
    (non_blocking, from pinned memory, on a side stream on CUDA) before batch j is handed over; the compute stream
    waits on batch j's copy alone. The same batches in the same order (on the CPU a copy is the tensor itself)."""
    if device.type != "cuda":
        for batch in batches:
            yield to_device(batch, device)
        return
    copying, computing = torch.cuda.Stream(device), torch.cuda.current_stream(device)
    pending = None
    for batch in batches:
        with torch.cuda.stream(copying):
            moved = to_device(batch, device)  # non_blocking: pinned batches copy asynchronously
            done = copying.record_event()
        if pending is not None:
            yield _ready(*pending, computing)
        pending = moved, done
    if pending is not None:
        yield _ready(*pending, computing)


def _ready(batch, copied: torch.cuda.Event, computing: torch.cuda.Stream):
    computing.wait_event(copied)  # the compute stream waits on this batch's copy, not the next one's
    for tensor in leaves(batch):
        tensor.record_stream(computing)  # allocated on the copy stream, freed only after compute used it
    return batch


class TrainLoader:
    """The train loader: this rank's micro-batches (TrainBatches) and then, up to `micro_batches`
    per epoch, empty ones (the rank whose last micro-batch held only padding still runs it).

    A split on the device (`resident`: residency's decision, data.on_device) skips the DataLoader (its machinery
    costs ~0.1 ms a batch, a tenth of the default job's step): Resident takes each epoch's micro-batches there by
    index. Any other data set goes through a DataLoader over SeededBatches (per-sample seeds where the data set
    draws), its workers persistent across epochs, and (`prefetch`: on a device that is not the CPU) each batch
    copied to the device while the one before it computes (`ahead`)."""

    def __init__(
        self,
        dataset: Dataset,
        d: Dist,
        batch_size: int,
        num_workers: int,
        seed: int,
        micro_batches: int,
        pin_memory: bool = True,
        prefetch_factor: int | None = None,
        shuffle: bool = True,
        resident: "Resident | bool | None" = None,
        global_order: Callable[[int], torch.Tensor] | None = None,
    ):
        self.sampler = TrainBatches(length(dataset), d.world_size, d.rank, batch_size, seed, shuffle, global_order)
        self.collate = collate_fn(dataset)
        self.loader = DataLoader(
            SeededBatches(dataset, seed),
            batch_sampler=self.sampler,
            collate_fn=self.collate,
            num_workers=num_workers,
            generator=torch.Generator(),  # not the global RNG (it seeds the workers)
            pin_memory=pin_memory and d.device.type == "cuda",  # pinned memory speeds up copies to a GPU only
            prefetch_factor=prefetch_factor if num_workers else None,  # batches ahead per worker (null: torch's 2)
            persistent_workers=num_workers > 0,  # the workers live across epochs
        )
        self.dataset, self.seed, self.micro_batches, self.batch_size = dataset, seed, micro_batches, batch_size
        self.device = d.device  # where the tensors go at the first epoch (building a loader touches no device)
        if resident is None:  # a loader of its own (tests, benchmarks): data.on_device=auto's decision
            resident = residency(dataset, d.device, "auto", num_workers)[0]
        self.resident: Resident | bool = resident  # True: built at the first epoch (building touches no device)
        self.in_memory = bool(resident)
        self.prefetch = d.device.type != "cpu"  # the loader's batches copied ahead (on the CPU: nothing to copy)

    def epoch(self, epoch: int, start: int = 0):
        """An iterator over the micro-batches of `epoch` from micro-batch `start` on. What it
        yields depends on (seed, epoch, start) alone, so a resumed run needs no loader state."""
        self.sampler.set_epoch(epoch)  # a new permutation every epoch, the same on every rank
        self.sampler.start = start
        batches: Iterable = ()
        if self.in_memory and start < self.sampler.batches:  # taken on the device by index
            if not isinstance(self.resident, Resident):
                self.resident = Resident(self.dataset, self.device)  # once: then already there
            order = self.sampler.order_tensor()[start * self.batch_size :]
            batches = self.resident.epoch(order, self.batch_size, epoch, self.seed)
        elif not self.in_memory:
            self.loader.generator.manual_seed(self.seed + epoch)  # what the iterator draws (worker seeds)
            batches = ahead(self.loader, self.device) if self.prefetch else self.loader
        return itertools.chain(batches, self._empty(max(self.sampler.batches, start)))

    def _empty(self, ran: int):
        if ran < self.micro_batches:
            empty = emptied(self.collate([self.dataset[0]]))  # the right structure, shapes and dtypes
            if self.in_memory or self.prefetch:  # the micro-batches are on the device already: so is this one
                empty = to_device(empty, self.device)
            yield from itertools.repeat(empty, self.micro_batches - ran)


def eval_loader(dataset: Dataset, d: Dist, batch_size: int, num_workers: int, skip: int = 0) -> DataLoader:
    sampler = ContiguousSampler(length(dataset), d.world_size, d.rank, skip)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        collate_fn=collate_fn(dataset),
        num_workers=num_workers,
        generator=torch.Generator(),  # its iterator draws a seed: not from the training RNG
        pin_memory=d.device.type == "cuda",
    )


def unavailable_line(error: DataUnavailable) -> str:
    """A DataUnavailable's one line, also where a loader worker raised it (the DataLoader re-raises it with the
    worker's traceback as its text, our line last)."""
    text = str(error).strip()
    if "Traceback" not in text:
        return text
    last = text.splitlines()[-1]
    return last.split(": ", 1)[1] if last.startswith(("DataUnavailable", "trainkit.errors.")) else last


class TrainWindows:
    """The train split as optimizer-step windows: the epoch's layout (accumulate.EpochLayout) and this rank's
    loader at the current micro-batch b and K, `fetch(window)` giving the window's micro-batches. data.batch_size
    =auto halves b (and doubles K) when a window runs out of memory: `refit(window)` rebuilds both and fetches
    the same window again, the same samples in smaller micro-batches."""

    def __init__(self, dataset: Dataset, d: Dist, data, seed: int, size: Callable[[], tuple[int, int]]):
        self.dataset, self.d, self.seed, self.size = dataset, d, seed, size  # size(): (b, K), read at each fit
        # data.get: a data set's yaml composed without conf/shared/data.yaml (a test's) may leave them out
        self.knobs = (data.num_workers, data.get("pin_memory", True), data.get("prefetch_factor"))
        self.shuffle, self.epoch_number = data.get("shuffle", True), 0
        # reads_remotely: read failures are agreed on before each step (fetch); a gloo group where the default is not
        self.remote, self.agree = bool(getattr(dataset, "reads_remotely", False)), None
        if self.remote and d.distributed and tdist.get_backend() != "gloo":  # every rank builds this at one point
            self.agree = cast(tdist.ProcessGroup, tdist.new_group(backend="gloo"))
        # data.on_device: the split on the device once (Resident), or a DataLoader; `path` says which and why
        resident, why = residency(dataset, d.device, data.get("on_device", "auto"), data.num_workers)
        self.resident: Resident | bool = resident  # built at the first epoch; kept when `refit` rebuilds the loader
        workers = f"{data.num_workers} worker{'s' * (data.num_workers != 1)}" if data.num_workers else "no worker"
        copied = ", each batch copied ahead" if d.device.type != "cpu" else ""
        self.path = (
            f"on the device, batches taken by index ({why})" if resident else f"DataLoader, {workers}{copied} ({why})"
        )
        self.fit()

    def fit(self) -> None:
        b, K = self.size()
        self.layout = layout = EpochLayout(len(self.dataset), self.d.world_size, b, K)  # type: ignore[arg-type]
        workers, pin, prefetch = self.knobs
        previous: TrainLoader | None = getattr(self, "loader", None)
        if previous is not None and isinstance(previous.resident, Resident):
            self.resident = previous.resident  # a refit (auto's halved micro-batch) moves nothing again
        shuffle, resident = self.shuffle, self.resident
        # A data set's own global order (`epoch_order`: a shard set's locality, a mixture's shares per global batch)
        make_order = getattr(self.dataset, "epoch_order", None)
        order = functools.partial(make_order, self.seed, global_batch=layout.global_batch) if make_order else None
        self.loader = TrainLoader(
            self.dataset, self.d, b, workers, self.seed, layout.micro_batches, pin, prefetch, shuffle, resident, order
        )
        # Per window of the epoch, read every step: its micro-batches and (all ranks') real samples.
        self.micro_steps = [layout.micro_steps(w) for w in range(layout.windows(drop_last=False))]
        self.samples = [layout.window_samples(w) for w in range(layout.windows(drop_last=False))]
        # Its micro-batches are on the device already: taken there by index, or copied ahead of the step
        self.on_device = self.loader.in_memory or self.loader.prefetch

    def epoch(self, epoch: int, first_window: int = 0) -> None:
        """Start `epoch` at `first_window` (a resume's): set_epoch, a new permutation per epoch."""
        self.epoch_number = epoch
        self.batches = self.loader.epoch(epoch, start=first_window * self.layout.steps)

    def fetch(self, window: int) -> list:
        if not self.remote:
            return list(itertools.islice(self.batches, self.micro_steps[window]))  # islice: no comprehension call
        # A data set that reads remotely: a rank whose read failed after its retries (DataUnavailable) must not
        # leave the others in the step's collectives. Every rank learns of it before the step (one all-reduce of a
        # host flag, on gloo: no device wait), and all raise it: train.py then writes the last step's checkpoint.
        try:
            micro, failed = list(itertools.islice(self.batches, self.micro_steps[window])), ""
        except DataUnavailable as error:
            micro, failed = [], unavailable_line(error)
        flag = torch.tensor([bool(failed)], dtype=torch.int32)
        if self.d.distributed:
            tdist.all_reduce(flag, op=tdist.ReduceOp.MAX, group=self.agree)
        if flag.item():
            lines = [line for line in self.d.gather_object(failed) if line] if self.d.distributed else [failed]
            raise DataUnavailable(lines[0])  # the first failing rank's line, the same on every rank
        return micro

    def row(self, windows: int) -> dict:
        """What the rows say of the data after `windows` windows of the current epoch: the micro-batch, and a data
        set's own entries (`row(epoch, windows, global_batch)`: a mixture's samples per source)."""
        row = {"micro_batch": self.layout.batch_size}
        own = getattr(self.dataset, "row", None)
        return row | own(self.epoch_number, windows, self.layout.global_batch) if own is not None else row

    def refit(self, window: int) -> None:
        self.fit()
        self.epoch(self.epoch_number, window)
