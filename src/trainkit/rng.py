"""Seeding and the RNG states a checkpoint keeps per rank (weights_only-safe values)."""

import random

import numpy as np
import torch


def seed_all(seed: int, cuda: bool = True) -> None:
    """Seed python, numpy and torch (CPU, and CUDA unless cuda=False): nothing draws from an
    unseeded generator. (torch.manual_seed also seeds every CUDA device: ~100x the CPU's cost.)
    Any seed >= 0 works (seed + rank may pass numpy's 2**32 - 1: numpy takes it modulo 2**32)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    if cuda:
        torch.manual_seed(seed)
    else:
        torch.default_generator.manual_seed(seed)


def rng_state(device: torch.device) -> dict:
    """This rank's python, numpy, torch and (on a CUDA device) its device's generator states, as
    weights_only-safe values. Only this rank's own GPU: every GPU the process sees would fail to
    restore where fewer are visible (a SLURM task bound to its GPU) with "invalid device ordinal"."""
    np_state = np.random.get_state(legacy=False)
    return {
        "python": random.getstate(),
        "numpy": {
            **np_state,
            "state": {
                "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
                "pos": np_state["state"]["pos"],
            },
        },
        "torch": torch.get_rng_state(),
        "cuda": [torch.cuda.get_rng_state(device)] if device.type == "cuda" else [],
    }


def set_rng_state(state: dict, device: torch.device) -> None:
    """Put back rng_state()'s states; the CUDA one onto `device`, and only when both runs used CUDA
    (a CPU run of a GPU checkpoint draws nothing on a GPU)."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy = state["numpy"]
    np.random.set_state(
        {**numpy, "state": {"key": numpy["state"]["key"].numpy().astype(np.uint32), "pos": numpy["state"]["pos"]}}
    )
    torch.set_rng_state(state["torch"])
    if state["cuda"] and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"][0], device)


_U64 = (1 << 64) - 1


def _mix(*values: int) -> int:
    """splitmix64's finaliser over the values, one after another (about 0.6 us a value; numpy's
    SeedSequence takes 15 us): distinct tuples give unrelated 63-bit seeds (valid for every generator)."""
    x = 0
    for value in values:
        x = (x ^ (value & _U64)) * 0x9E3779B97F4A7C15 & _U64
        x = (x ^ (x >> 31)) * 0xBF58476D1CE4E5B9 & _U64
        x ^= x >> 29
    return x >> 1


def step_seed(seed: int, step: int, rank: int) -> int:
    """A seed for (seed, step, rank): the training stream of one rank's optimizer step, `_mix(seed, step, rank)`,
    read from a table of STEPS of them computed at once (_mix in Python costs ~1.2 us a step, the table ~0.02)."""
    global _table
    block, i = divmod(step, STEPS)
    key, seeds = _table
    if key != (seed, rank, block):
        seeds = _mixed(seed, np.arange(block * STEPS, (block + 1) * STEPS, dtype=np.uint64), rank)
        _table = (seed, rank, block), seeds
    return seeds[i]


STEPS = 1024
_table: tuple[tuple[int, int, int], list[int]] = ((-1, -1, -1), [])  # the last block's (seed, rank, block), seeds


def _mixed(seed: int, steps: np.ndarray, rank: int) -> list[int]:
    """_mix(seed, step, rank) for each of `steps` (uint64, which wraps as `& _U64` does), as Python ints."""
    with np.errstate(over="ignore"):
        x = np.zeros_like(steps)
        for value in (np.full_like(steps, seed & _U64), steps, np.full_like(steps, rank & _U64)):
            x = (x ^ value) * np.uint64(0x9E3779B97F4A7C15)
            x = (x ^ (x >> np.uint64(31))) * np.uint64(0xBF58476D1CE4E5B9)
            x ^= x >> np.uint64(29)
        return (x >> np.uint64(1)).tolist()


_SAMPLE = 0x73616D706C65  # "sample": sample seeds and step seeds of the same numbers are unrelated


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A seed for (seed, epoch, sample index): what loading sample `index` in `epoch` may draw (a
    random augmentation), whichever rank, micro-batch or loader worker loads it."""
    return _mix(_SAMPLE, seed, epoch, index)


def seed_step(seed: int, step: int, rank: int, device: torch.device) -> None:
    """Re-seed the training stream (torch's CPU generator, and this device's on CUDA: what dropout
    draws from) for optimizer step `step`. Its draws then depend on (seed, step, rank) alone: not on
    whether the batches were loaded in this process (a loader seeds the global generators per sample)
    or in a worker, nor on what they drew; a resume needs no RNG state for them. ~1.3 us a step, most of it
    the CPU generator's own seeding (torch.manual_seed would also seed every CUDA device: ~250 us even without one)."""
    key, seeds = _table  # step_seed(seed, step, rank), less a call where its block's table is at hand
    value = seeds[step % STEPS] if key == (seed, rank, step // STEPS) else step_seed(seed, step, rank)
    torch.default_generator.manual_seed(value)
    if device.type == "cuda":
        torch.cuda.default_generators[device.index].manual_seed(value)  # resolve_device: always indexed


_GENERATE = 0x67656E6572617465  # "generate"


def generation_seed(seed: int, index: int) -> int:
    """A seed for (seed, sample index): what predict.py draws for text sample `index`, on whichever rank."""
    return _mix(_GENERATE, seed, index)
