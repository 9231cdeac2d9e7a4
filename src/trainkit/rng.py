"""Seeding and the RNG states a checkpoint keeps per rank (weights_only-safe values)."""

import random

import numpy as np
import torch


def seed_all(seed: int, cuda: bool = True) -> None:
    """Seed python, numpy and torch (CPU, and CUDA unless cuda=False): nothing draws from an
    unseeded generator. (torch.manual_seed also seeds every CUDA device: ~100x the CPU's cost.)"""
    random.seed(seed)
    np.random.seed(seed)
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
