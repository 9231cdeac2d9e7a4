"""Cost of trainkit's SyncBatchNorm against plain BatchNorm2d, side by side in one run.

Spawns W gloo ranks on CPU (one thread each) and times forward + backward of a small conv net
(conv-BN-ReLU blocks) on a per-rank batch, once with nn.BatchNorm2d and once with the same
weights converted by convert_sync_batchnorm. No DDP and no optimizer: the difference is the
SyncBN layers alone (their statistics, and one collective per BN layer in forward and one in
backward). Timed in alternating rounds so that load on the machine hits both alike.

    OMP_NUM_THREADS=1 python scripts/bench_syncbn.py [--iters 40] [--batch 32]
"""

import argparse
import copy
import os
import socket
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from trainkit.syncbn import convert_sync_batchnorm  # noqa: E402


def make_net(width: int = 32) -> nn.Module:
    def block(c_in: int, c_out: int, stride: int = 1) -> list[nn.Module]:
        return [nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU()]

    return nn.Sequential(
        *block(3, width // 2),
        *block(width // 2, width, 2),
        *block(width, width),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(width, 10),
    )


def step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(x), y).backward()


def count_collectives(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Counter:
    """Collectives issued by one forward + backward, by name (patches torch.distributed)."""
    calls: Counter = Counter()
    originals = {name: getattr(dist, name) for name in ("all_gather", "all_reduce")}

    def counting(name):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return originals[name](*args, **kwargs)

        return wrapper

    for name in originals:
        setattr(dist, name, counting(name))
    try:
        step(model, x, y)
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return calls


def worker(rank: int, world_size: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    plain = make_net()
    synced, skipped = convert_sync_batchnorm(copy.deepcopy(plain))
    assert not skipped
    models = {"BatchNorm2d": plain, "trainkit SyncBatchNorm": synced}
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (args.batch,), generator=g)

    calls = {name: count_collectives(model, x, y) for name, model in models.items()}
    for model in models.values():
        for _ in range(args.warmup):
            step(model, x, y)

    per_round: dict[str, list[float]] = {name: [] for name in models}
    iters_per_round = max(1, args.iters // args.rounds)
    for _ in range(args.rounds):
        for name, model in models.items():
            dist.barrier()
            start = time.perf_counter()
            for _ in range(iters_per_round):
                step(model, x, y)
            elapsed = torch.tensor((time.perf_counter() - start) / iters_per_round * 1e3)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step lasts as long as the slowest rank
            per_round[name].append(elapsed.item())

    # What the 2 x n_bn small collectives alone cost (gloo latency, not bandwidth, at this size).
    packed = torch.zeros(65, dtype=torch.float64)
    gathered = [torch.empty_like(packed) for _ in range(world_size)]
    dist.barrier()
    start = time.perf_counter()
    for _ in range(100):
        dist.all_gather(gathered, packed)
        dist.all_reduce(packed[:64])
    pair_ms = (time.perf_counter() - start) / 100 * 1e3

    if rank == 0:
        n_bn = sum(isinstance(m, nn.BatchNorm2d) for m in plain.modules())
        print(
            f"{world_size} gloo ranks x 1 thread, batch {args.batch}/rank of 3x32x32, {n_bn} conv-BN-ReLU "
            f"blocks; forward+backward, median of {args.rounds} rounds x {iters_per_round} iters"
        )
        print(f"{'model':<24} {'ms/iter':>8} {'(min)':>7} {'ratio':>6}  collectives per iteration")
        base = statistics.median(per_round["BatchNorm2d"])
        for name in models:
            ms = statistics.median(per_round[name])
            comm = ", ".join(f"{k} {v}" for k, v in sorted(calls[name].items())) or "none"
            print(f"{name:<24} {ms:8.2f} {min(per_round[name]):7.2f} {ms / base:6.2f}  {comm}")
        print(f"expected for SyncBN: all_gather {n_bn} (1 per BN forward), all_reduce {n_bn} (1 per BN backward)")
        print(
            f"one all_gather + one all_reduce of ~65 numbers: {pair_ms:.2f} ms, "
            f"so ~{n_bn * pair_ms:.1f} ms/iter of the difference is collective latency"
        )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32, help="per rank")
    parser.add_argument("--iters", type=int, default=40, help="timed iterations per model")
    parser.add_argument("--rounds", type=int, default=8, help="alternating timing rounds")
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the spawned ranks
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(worker, args=(args.world_size, port, args), nprocs=args.world_size, start_method="spawn")


if __name__ == "__main__":
    main()
