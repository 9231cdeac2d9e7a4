"""Inference throughput on 1 vs 2 ranks, measured side by side in one run.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_inference.py [--model resnet18] [--samples 1024]

Each rank is a spawned gloo process with one thread (as under torchrun on CPU) and runs what
src/predict.py runs: trainkit.inference.predict on its contiguous shard (loading.eval_loader),
including the gather of all logits back into dataset order. Data: random fake-like 3x32x32
images. The timer runs on rank 0 from a barrier to the end of the gather, so it covers the
slowest rank; best of --repeats. The two runs must give the same predictions (checked).
"""

import argparse
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from trainkit.dist import Dist  # noqa: E402
from trainkit.inference import predict  # noqa: E402
from trainkit.loading import eval_loader  # noqa: E402
from trainkit.models.cnn import cnn  # noqa: E402
from trainkit.models.resnet import resnet18  # noqa: E402


def build_model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)  # the same weights in every process
    return resnet18(3, 10) if name == "resnet18" else cnn(3, 10, width=64)


def fake_data(samples: int) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.rand(samples, 3, 32, 32, generator=g), torch.randint(0, 10, (samples,), generator=g))


def worker(rank: int, world_size: int, port: int, args, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # one core per rank: W ranks use W cores
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    d = Dist(rank, rank, world_size, torch.device("cpu"))
    data, model = fake_data(args.samples), build_model(args.model)
    warmup = TensorDataset(*data[: args.batch_size * world_size])
    predict(model, eval_loader(warmup, d, args.batch_size, 0), d)  # allocator and kernel warm-up
    times = []
    for _ in range(args.repeats):  # best of N: the machine may be busy with something else
        dist.barrier()
        start = time.perf_counter()
        out = predict(model, eval_loader(data, d, args.batch_size, 0), d)
        times.append(time.perf_counter() - start)  # ends after the gather: the slowest rank counts
    elapsed = min(times)
    if rank == 0:
        results.put((elapsed, out["logits"].argmax(dim=1).tolist()))
    dist.destroy_process_group()


def measure(world_size: int, args) -> tuple[float, list]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(
        worker, args=(world_size, port, args, results), nprocs=world_size, join=True, start_method="spawn"
    )
    return results.get()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["resnet18", "cnn"], default="resnet18")
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(
        f"{args.model} on {args.samples} fake 3x32x32 images, batch {args.batch_size} per rank, "
        f"gloo, 1 thread per rank, best of {args.repeats} | {os.cpu_count()} CPUs, load average "
        f"{os.getloadavg()[0]:.1f}"
    )
    throughput, predictions = {}, {}
    for world_size in (1, 2):
        elapsed, predictions[world_size] = measure(world_size, args)
        throughput[world_size] = args.samples / elapsed
        print(f"W={world_size}: {elapsed:6.2f} s  {throughput[world_size]:8.1f} samples/s")
    print(
        f"speed-up W=2 / W=1: {throughput[2] / throughput[1]:.2f}x | same predictions: "
        f"{predictions[1] == predictions[2]}"
    )


if __name__ == "__main__":
    main()
