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

`--hf-load` measures model=hf's pretrained load instead (issue 59): a Llama-style model written with
save_pretrained (safetensors, fp32, untied head) is loaded on W gloo CPU ranks, each variant in fresh processes:
trainkit's parallel=fsdp path (built on the meta device inside trainkit.materialize.deferred(True), sharded by
trainkit.parallel.wrap, then each rank reads its rows of the files), the whole load (deferred(False)), the whole
load then sharded (what FSDP costs without the meta device), and transformers' own from_pretrained. Measured over
the build and one read of every parameter (from_pretrained maps the file and reads nothing before), per rank: the
peak resident memory above the start (/proc/self/status VmHWM, reset through /proc/self/clear_refs: getrusage's
ru_maxrss is the same high-water mark), and its two parts' peaks, sampled every ms: anonymous memory (RssAnon, the
process's own allocations) and mapped file pages (RssFile: the safetensors file's pages a rank has touched, the
page cache's, shared by the ranks, held while the reader has the file open); the bytes of its parameters (its shards
under FSDP), the wall time, and a checksum of the loaded parameters against the files'. --file-size writes several
files (save_pretrained's max_shard_size).

    OMP_NUM_THREADS=1 python scripts/bench_memory.py --hf-load [--layers 8 --hidden 1024 --file-size 100MB]
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


# --- model=hf: the peak memory of a pretrained load ---------------------------------------------

# variant -> (trainkit's deferral, parallel=fsdp's wrap after the build); None: transformers' from_pretrained
HF_VARIANTS = {
    "fsdp: meta, shard, load rows": (True, True),
    "whole (no sharding)": (False, False),
    "whole, then fsdp": (False, True),
    "transformers from_pretrained": None,
}


def write_llama(_, directory: str, args) -> None:
    """A Llama-style causal LM, fp32, untied head, saved with save_pretrained (safetensors) into `directory`, with
    its bytes and the sum of its tensors (what the loaded parameters must add up to) in directory/sum.json. Run in
    a process of its own: the ranks fork from a process that never held the model (glibc's malloc raises its mmap
    threshold after freeing large blocks: a rank forked after that keeps freed tensors in its heap)."""
    import json

    from safetensors import safe_open
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 64),
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(directory, **({"max_shard_size": args.file_size} if args.file_size else {}))
    total = 0.0
    for f in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as opened:
            names = opened.keys()
            total += sum(param_sum([opened.get_tensor(name)]) for name in names)
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    Path(directory, "sum.json").write_text(json.dumps({"bytes": size, "sum": total}))


def status_kib() -> dict[str, int]:
    """/proc/self/status's memory lines, KiB."""
    with open("/proc/self/status") as f:
        return {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f) if v.strip().endswith("kB")}


class Peak:
    """This process's resident memory over a block, above what it held at the start, bytes: `rss`, the kernel's
    high-water mark (VmHWM, reset on entry through /proc/self/clear_refs; getrusage's ru_maxrss reads the same
    mark, which cannot be reset), and the peaks of its two parts, sampled every ms by a thread (torch's copies
    release the GIL; a tensor alive for under a ms may be missed): `anon` (RssAnon: the process's own memory) and
    `file` (RssFile: pages of mapped files, the safetensors file's among them: page cache, shared by the processes
    mapping it). `anon_end`: RssAnon at the end."""

    def __enter__(self) -> "Peak":
        import threading

        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS now
        self.start = status_kib()
        self.peaks = {"RssAnon": self.start["RssAnon"], "RssFile": self.start["RssFile"]}
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.sample, daemon=True)
        self.thread.start()
        self.seconds = time.perf_counter()
        return self

    def sample(self) -> None:
        while not self.done.wait(0.001):
            now = status_kib()
            for key in self.peaks:
                self.peaks[key] = max(self.peaks[key], now[key])

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self.seconds
        self.done.set()
        self.thread.join()
        end = status_kib()
        for key in self.peaks:
            self.peaks[key] = max(self.peaks[key], end[key])
        self.rss = (end["VmHWM"] - self.start["VmRSS"]) * 1024
        self.anon = (self.peaks["RssAnon"] - self.start["RssAnon"]) * 1024
        self.file = (self.peaks["RssFile"] - self.start["RssFile"]) * 1024
        self.anon_end = (end["RssAnon"] - self.start["RssAnon"]) * 1024


def hf_build(variant: str, weights: str, d: Dist):
    """The model of one variant, loaded from `weights`."""
    from transformers import AutoModelForCausalLM

    from trainkit.materialize import deferred
    from trainkit.models.hf import hf_model

    if HF_VARIANTS[variant] is None:
        return AutoModelForCausalLM.from_pretrained(weights, dtype=torch.float32)
    defer, shard = HF_VARIANTS[variant]
    with deferred(defer):
        model = hf_model(pretrained=weights)
    if shard:
        model, _ = wrap(model, "fsdp", d)
    return model


def param_sum(tensors) -> float:
    """The sum of `tensors` in float64, 2 MB at a time (no whole float64 copy); reads every page once."""
    total = 0.0
    for t in tensors:
        for chunk in t.detach().reshape(-1).split(1 << 18):
            total += chunk.double().sum().item()
    return total


def hf_rank(rank: int, world_size: int, port: int, variant: str, weights: str, out: str) -> None:
    """One rank of one variant (a fresh process: its high-water mark is reset at the start of the measurement);
    measures the build and one read of every parameter (transformers' from_pretrained maps the files and reads
    nothing until then); writes its numbers to `out`."""
    import json

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    d = Dist(rank, rank, world_size, torch.device("cpu"))
    with Peak() as peak:
        model = hf_build(variant, weights, d)
        params = list(model.parameters())
        local = [p.to_local() if isinstance(p, DTensor) else p for p in params]
        total = torch.tensor(param_sum(local), dtype=torch.float64)
    if any(isinstance(p, DTensor) for p in params):  # this rank's rows: the whole is the sum over the ranks
        dist.all_reduce(total)
    result = {
        "rss": peak.rss,
        "anon": peak.anon,
        "file": peak.file,
        "anon_end": peak.anon_end,
        "shards": nbytes(params),
        "seconds": peak.seconds,
        "sum": total.item(),
    }
    Path(out, f"{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def hf_load_table(args) -> None:
    import json
    import tempfile

    import safetensors  # noqa: F401  what the ranks' loads import, imported once here: not in the measurement
    import torch.distributed.checkpoint  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401
    from transformers.utils import logging

    import trainkit.models.hf  # noqa: F401

    logging.disable_progress_bar()  # save_pretrained's and from_pretrained's

    with tempfile.TemporaryDirectory(prefix="bench_memory_hf.") as tmp:
        weights = Path(tmp) / "llama"
        mp.start_processes(write_llama, args=(str(weights), args), nprocs=1, join=True, start_method="fork")
        written = json.loads((weights / "sum.json").read_text())
        model_bytes, expected = written["bytes"], written["sum"]
        rows = []
        for variant in HF_VARIANTS:
            out = Path(tmp) / f"out{len(rows)}"
            out.mkdir()
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            # fork: the ranks start with this process's imports (spawned, each imports torch and transformers
            # again, ~10 s here) and measure above their own start
            mp.start_processes(
                hf_rank,
                args=(args.world_size, port, variant, str(weights), str(out)),
                nprocs=args.world_size,
                join=True,
                start_method="fork",
            )
            ranks = [json.loads((out / f"{r}.json").read_text()) for r in range(args.world_size)]
            row = {key: max(r[key] for r in ranks) for key in ranks[0] if key != "sum"}
            row["loaded"] = all(abs(r["sum"] - expected) <= 1e-6 * max(1.0, abs(expected)) for r in ranks)
            rows.append((variant, row))
    print(
        f"model=hf pretrained load: Llama, {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, fp32, "
        f"untied head; W={args.world_size} gloo ranks on the CPU ({os.cpu_count()} cores), each variant in fresh "
        "processes; MB per rank (10^6 bytes, the largest over ranks), above the rank's memory before the build"
    )
    cols = [
        ("peak RSS MB", "rss"),
        ("peak anon MB", "anon"),
        ("peak file MB", "file"),
        ("anon after MB", "anon_end"),
        ("shards MB", "shards"),
    ]
    titles = [title for title, _ in cols] + ["peak RSS / model", "peak anon / model", "seconds"]
    print(f"| {'variant':<28} | model MB | " + " | ".join(titles) + " | loaded |")
    print(f"|{'-' * 30}|----------|" + "|".join("-" * (len(t) + 2) for t in titles) + "|--------|")
    for variant, r in rows:
        cells = [f"{r[key] / 1e6:{len(title)}.1f}" for title, key in cols]
        cells += [f"{r['rss'] / model_bytes:16.2f}", f"{r['anon'] / model_bytes:17.2f}", f"{r['seconds']:7.1f}"]
        loaded = "yes" if r["loaded"] else "NO"
        print(f"| {variant:<28} | {model_bytes / 1e6:8.1f} | " + " | ".join(cells) + f" | {loaded:>6} |")


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
    parser.add_argument("--hf-load", action="store_true", help="measure model=hf's pretrained load instead")
    parser.add_argument("--layers", type=int, default=8, help="--hf-load: the Llama's decoder layers")
    parser.add_argument("--hidden", type=int, default=1024, help="--hf-load: its width (MLP: twice)")
    parser.add_argument("--vocab", type=int, default=32000, help="--hf-load: its vocabulary")
    parser.add_argument("--file-size", help="--hf-load: save_pretrained's max_shard_size (e.g. 100MB: several files)")
    args = parser.parse_args()
    if args.hf_load:
        hf_load_table(args)
        return
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
