"""Per-rank memory of parameters, gradients and AdamW state: DDP against FSDP2 (no_sync and
sync_each_batch accumulation), W ranks, one accumulated optimizer step.

Runs trainkit's own wrap() / sync_context() on W spawned ranks (gloo on CPU; NCCL when there is
one GPU per rank) and counts the bytes of the tensors each rank holds, at two moments:

- mid-window, after the K-1 non-final micro-steps: with no_sync, FSDP2 holds every unit's
  *unsharded* accumulated gradient there (nothing has been reduce-scattered yet); with
  sync_each_batch only the sharded gradient; DDP always the full .grad;
- after the optimizer step (before zero_grad): parameters, gradients, AdamW's exp_avg/exp_avg_sq.

"parameters" counts the sharded parameters plus any all-gathered (unsharded) parameter storage
still allocated. FSDP's unsharded gradients and parameters are only reachable through FSDP2's
internal FSDPParam objects (`_get_fsdp_state()._fsdp_param_groups[..].fsdp_params`): this script
reads them, train.py never does. Not counted on CPU: activations and communication buffers
(DDP's reducer buckets hold the .grad tensors themselves: trainkit's DDP runs with
gradient_as_bucket_view=True). On CUDA, the last column is torch.cuda.max_memory_allocated over
the whole step, which counts all of those.

    OMP_NUM_THREADS=1 python scripts/bench_memory.py [--model resnet18|mlp] [--world-size 2] [--steps 2]

`--activation-checkpointing` measures model.activation_checkpointing instead, in one process: the
peak memory of one training forward + backward with and without it (gpt with activations that
dominate its parameters; resnet18, CIFAR stem, 32x32, batch 64), and the time of a whole step
(forward, backward, AdamW). Peak: on CUDA torch.cuda.max_memory_allocated; on CPU, where torch has
no allocator statistics (and tracemalloc does not see its allocations), the running sum of the
allocations and frees torch's profiler records (profile_memory=True). Both: above what was
allocated before the forward (the parameters), so activations, gradients and temporaries.

    python scripts/bench_memory.py --activation-checkpointing
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
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from trainkit.accumulate import sync_context, syncs_now  # noqa: E402
from trainkit.dist import Dist  # noqa: E402
from trainkit.models.gpt import gpt  # noqa: E402
from trainkit.models.mlp import mlp
from trainkit.models.resnet import resnet18
from trainkit.parallel import wrap  # noqa: E402

RUNS = [
    ("DDP", "ddp", "no_sync"),
    ("FSDP no_sync", "fsdp", "no_sync"),
    ("FSDP sync_each_batch", "fsdp", "sync_each_batch"),
]


def nbytes(tensors) -> int:
    """Bytes of the local tensors (a DTensor's local shard), each storage once."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if isinstance(t, DTensor) else t
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def fsdp_params(model):
    """FSDP2's internal per-parameter objects (private API, for measuring only)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            for group in module._get_fsdp_state()._fsdp_param_groups:
                yield from group.fsdp_params


def measure(model, optimizer) -> dict[str, int]:
    params = list(model.parameters())
    grads = [p.grad for p in params]
    unsharded_params = []
    if isinstance(model, FSDPModule):
        for fp in fsdp_params(model):
            if hasattr(fp, "_unsharded_param"):
                unsharded_params.append(fp._unsharded_param)
                grads += [fp._unsharded_param.grad, fp.unsharded_accumulated_grad]
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return {"params": nbytes(params) + nbytes(unsharded_params), "grads": nbytes(grads), "optim": nbytes(state)}


def one_run(d: Dist, name: str, mode: str, strategy: str, args) -> dict:
    torch.manual_seed(0)
    if args.model == "resnet18":
        model, shape = resnet18(3, 10), (3, 32, 32)
    else:
        model, shape = mlp((args.width,), 10, width=args.width, depth=4), (args.width,)
    model, _ = wrap(model, mode, d)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if d.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    g = torch.Generator().manual_seed(d.rank)
    K = args.steps
    mid = None
    for k in range(K):
        x = torch.randn(args.batch, *shape, generator=g).to(d.device)
        y = torch.randint(0, 10, (args.batch,), generator=g).to(d.device)
        with sync_context(model, syncs_now(strategy, k, K)):
            F.cross_entropy(model(x), y).backward()
        if k == K - 2:  # mid-window: after the K-1 non-final micro-steps
            mid = measure(model, optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    after = measure(model, optimizer)
    peak = torch.cuda.max_memory_allocated(d.device) if d.device.type == "cuda" else None
    optimizer.zero_grad(set_to_none=True)
    return {
        "name": name,
        "params": after["params"],
        "grads_mid": mid["grads"] if mid else None,
        "grads_after": after["grads"],
        "optim": after["optim"],
        "peak": peak,
    }


def worker(rank: int, world_size: int, port: int, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    cuda = torch.cuda.device_count() >= world_size
    device = torch.device(f"cuda:{rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world_size)
    d = Dist(rank, rank, world_size, device)
    results = [one_run(d, *run, args) for run in RUNS]
    gathered = [None] * world_size
    dist.all_gather_object(gathered, results)
    if rank == 0:
        report(gathered, args, device)
    dist.destroy_process_group()


def mib(b) -> str:
    return "-" if b is None else f"{b / 2**20:8.2f}"


def report(per_rank: list[list[dict]], args, device) -> None:
    world = len(per_rank)
    print(
        f"{args.model}, W={world} ranks on {device.type}, K={args.steps} micro-batches of {args.batch}, AdamW; "
        "MiB per rank (the largest over ranks)"
    )
    keys = ["params", "grads_mid", "grads_after", "optim", "peak"]
    rows = []
    for i, run in enumerate(per_rank[0]):
        row = {"name": run["name"]}
        for key in keys:
            values = [r[i][key] for r in per_rank]
            row[key] = None if values[0] is None else max(values)
        row["total_mid"] = row["params"] + (row["grads_mid"] or 0) + row["optim"]
        rows.append(row)
    cols = ["params", "grads_mid", "grads_after", "optim", "total_mid"] + (["peak"] if rows[0]["peak"] else [])
    titles = {
        "params": "parameters",
        "grads_mid": "grads mid-window",
        "grads_after": "grads after sync",
        "optim": "AdamW state",
        "total_mid": "sum mid-window",
        "peak": "CUDA peak",
    }
    print(f"| {'run':<22} | " + " | ".join(f"{titles[c]:>16}" for c in cols) + " |")
    print(f"|{'-' * 24}|" + "|".join("-" * 18 for _ in cols) + "|")
    base = rows[0]
    for row in rows:
        cells = []
        for c in cols:
            ratio = "" if row is base or not base[c] else f" ({row[c] / base[c]:.2f}x)"
            cells.append(f"{mib(row[c]).strip() + ratio:>16}")
        print(f"| {row['name']:<22} | " + " | ".join(cells) + " |")


# --- activation checkpointing -------------------------------------------------------------------


def checkpointing_model(name: str, checkpointing: bool):
    """The model, a batch and the loss: gpt sized so that activations dominate (8 Blocks of width
    128 on 8 x 256 tokens: ~30x its parameters' bytes), resnet18 as on CIFAR-10."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if name == "gpt":
        model = gpt(16, 256, n_layer=8, n_head=4, n_embd=128, activation_checkpointing=checkpointing)
        x, y = torch.randint(0, 16, (8, 256), generator=g), torch.randint(0, 16, (8, 256), generator=g)
    else:
        model = resnet18(3, 10, small_input=True, activation_checkpointing=checkpointing)
        x, y = torch.randn(64, 3, 32, 32, generator=g), torch.randint(0, 10, (64,), generator=g)
    return model, x, y


def forward_backward(model, x, y) -> None:
    out = model(x)
    F.cross_entropy(out.flatten(0, -2), y.flatten()).backward()


def peak_bytes(model, x, y, device) -> int:
    """Peak allocation of one forward + backward above the allocation before it."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated(device)
        forward_backward(model, x, y)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated(device) - before
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        forward_backward(model, x, y)
    # Every allocation and free (also those inside an op), in time order; kineto_results is the
    # profiler's raw record (what its memory timeline reads), FunctionEvents only keep net sums per op.
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    now = peak = 0
    for _, nbytes in events:
        now += nbytes
        peak = max(peak, now)
    return peak


def checkpointing_table(args) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rows = []
    for name in ("gpt", "resnet18"):
        for checkpointing in (False, True):
            model, x, y = checkpointing_model(name, checkpointing)
            model, x, y = model.to(device), x.to(device), y.to(device)
            params = sum(p.numel() * p.element_size() for p in model.parameters())
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
            peak = peak_bytes(model, x, y, device)  # also the warm-up; no .grad yet, no AdamW state
            optimizer.step()  # AdamW's state exists before the timed steps
            optimizer.zero_grad(set_to_none=True)
            times = []
            for _ in range(args.timed_steps):
                sync()
                start = time.perf_counter()
                forward_backward(model, x, y)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                sync()
                times.append(time.perf_counter() - start)
            rows.append((name, checkpointing, params, peak, min(times)))  # min: the least disturbed run
    what = "torch.cuda.max_memory_allocated" if device.type == "cuda" else "torch.profiler's CPU allocations"
    print(
        f"activation checkpointing on {device.type} ({torch.get_num_threads()} threads): peak of one forward + "
        f"backward above the parameters ({what}); step time: forward + backward + AdamW, "
        f"the fastest of {args.timed_steps}"
    )
    print("| model    | checkpointing | parameters MiB | peak MiB | peak saved | step s | step time |")
    print("|----------|---------------|----------------|----------|------------|--------|-----------|")
    for name, checkpointing, params, peak, seconds in rows:
        base = next(r for r in rows if r[0] == name and not r[1])
        saved = f"{1 - peak / base[3]:.0%}" if checkpointing else "-"
        cost = f"{seconds / base[4]:.2f}x" if checkpointing else "1.00x"
        print(
            f"| {name:<8} | {'on' if checkpointing else 'off':<13} | {params / 2**20:14.1f} | {peak / 2**20:8.1f} "
            f"| {saved:>10} | {seconds:6.2f} | {cost:>9} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["resnet18", "mlp"], default="resnet18")
    parser.add_argument("--width", type=int, default=2048, help="mlp: input size and width (4 hidden layers)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2, help="K micro-batches per optimizer step (>= 2)")
    parser.add_argument("--batch", type=int, default=8, help="micro-batch per rank")
    parser.add_argument(
        "--activation-checkpointing", action="store_true", help="measure model.activation_checkpointing instead"
    )
    parser.add_argument("--timed-steps", type=int, default=2, help="--activation-checkpointing: steps timed")
    args = parser.parse_args()
    if args.activation_checkpointing:
        checkpointing_table(args)
        return
    if args.steps < 2:
        parser.error("--steps must be >= 2 (the mid-window measurement is after K-1 micro-steps)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(
        worker, args=(args.world_size, port, args), nprocs=args.world_size, join=True, start_method="spawn"
    )


if __name__ == "__main__":
    main()
