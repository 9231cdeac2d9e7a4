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


def rng_state() -> dict:
    """This rank's python, numpy, torch and CUDA generator states, as weights_only-safe values."""
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
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy = state["numpy"]
    np.random.set_state(
        {**numpy, "state": {"key": numpy["state"]["key"].numpy().astype(np.uint32), "pos": numpy["state"]["pos"]}}
    )
    torch.set_rng_state(state["torch"])
    if state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])
