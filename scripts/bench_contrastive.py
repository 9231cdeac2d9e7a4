"""The cost of an exact coupled loss (trainkit/coupled.py), side by side in one run, and the kNN baselines of
+experiment=digits_simclr.

    python scripts/bench_contrastive.py [--batch 64] [--K 4] [--width 1024] [--steps 20] [--seeds 3] [--knn-only]

1. Step time at the same micro-batch b, K micro-batches a window: gradient caching (a graph-free forward, the
   loss over the whole window, a forward with graph and backward per micro-batch) against the usual loop
   (forward and backward per micro-batch, each micro-batch its own negatives: cheaper, and another loss).
2. Activation memory: the bytes autograd holds at its peak (saved tensors, counted by saved_tensors_hooks: exact
   on any device; on CUDA also torch.cuda.max_memory_allocated) for the cached loop at b against one process
   with the whole batch K·b: the big batch's negatives at one micro-batch's activation memory.
3. kNN accuracy (val and test, the task's k, cosine) of digits' raw pixels and of the untrained encoder
   (conf/model/simclr.yaml): what a trained one must beat.
"""

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from trainkit.coupled import CoupledWindows  # noqa: E402
from trainkit.data.digits import digits  # noqa: E402
from trainkit.data.digits_views import digits_bank  # noqa: E402
from trainkit.dist import Dist  # noqa: E402
from trainkit.models.simclr import SimCLR  # noqa: E402
from trainkit.rng import seed_all  # noqa: E402
from trainkit.tasks.contrastive import Contrastive, knn_predict  # noqa: E402

ONE = Dist(0, 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu"))


class NoAuto:
    enabled, K = False, 1

    def micro_steps(self, micro):
        return enumerate(micro)

    def catching(self):
        return contextlib.nullcontext()


class NoMeter:
    def add_micro_step(self, loss_sum):
        pass


class SavedBytes:
    """The bytes of the activations autograd saves for backward (not the weights it saves), live now and at the peak."""

    def __init__(self, net: torch.nn.Module):
        self.live = self.peak = 0
        self.weights = {p.untyped_storage().data_ptr() for p in net.parameters()}  # saved, but not activations

    def pack(self, tensor):
        weight = tensor.untyped_storage().data_ptr() in self.weights
        size = 0 if weight else tensor.numel() * tensor.element_size()
        self.live += size
        self.peak = max(self.peak, self.live)
        return tensor, size

    def unpack(self, packed):
        tensor, size = packed
        self.live -= size  # a saved tensor is read once in backward: counted free from then
        return tensor


def micro_batches(task, K: int, b: int):
    x = torch.randn(K * b, 2, 1, 8, 8, device=ONE.device)
    labels = torch.zeros(K * b, dtype=torch.long, device=ONE.device)
    return [{"views": x[k * b : (k + 1) * b], "label": labels[k * b : (k + 1) * b]} for k in range(K)]


def cached(net, task, micro, saved):
    scaler = torch.amp.GradScaler(ONE.device.type, enabled=False)
    windows = CoupledWindows(net, task, ONE, contextlib.nullcontext, scaler, NoAuto(), NoMeter())
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        windows.run(micro, 1.0 / sum(len(m["label"]) for m in micro), "no_sync")


def naive(net, task, micro, saved):
    n = sum(len(m["label"]) for m in micro)
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        for batch in micro:
            x, y = task.unpack(batch)
            (task.loss_sum(net(x), y) / n).backward()


def whole(net, task, micro, saved):
    x = torch.cat([m["views"] for m in micro]).flatten(0, 1)
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        (task.loss_sum(net(x), None) / (len(x) // 2)).backward()


def measure(step, args, task):
    torch.manual_seed(0)
    net = SimCLR((1, 8, 8), width=args.width, depth=args.depth).to(ONE.device)
    micro = micro_batches(task, args.K, args.batch)
    saved = SavedBytes(net)
    step(net, task, micro, saved)  # warm-up, and the saved bytes' peak
    times = []
    for _ in range(args.steps):
        net.zero_grad(set_to_none=True)
        if ONE.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        step(net, task, micro, SavedBytes(net))
        if ONE.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    cuda_peak = torch.cuda.max_memory_allocated() / 2**20 if ONE.device.type == "cuda" else float("nan")
    return sorted(times)[len(times) // 2], saved.peak / 2**20, cuda_peak


def knn_baselines(seeds: int) -> None:
    """What the trained encoder's val/knn_acc is compared with, computed as the task computes it (the same k,
    cosine similarity, similarity-weighted vote, train split as the bank): raw pixels, and the encoder of
    conf/model/simclr.yaml untrained (initialised with seeds 0 .. seeds - 1). Raw pixels at k=1 too: digits'
    pixels are their own best kNN features at k=1, a ceiling a 359-image split barely leaves room above."""
    k = OmegaConf.load(ROOT / "conf/task/contrastive.yaml").knn_k
    encoder = OmegaConf.load(ROOT / "conf/model/simclr.yaml")
    encoder.in_shape = [1, 8, 8]  # ${data.shape}
    train, val, test = digits()
    bank_x, bank_y = train.tensors  # type: ignore[attr-defined]
    assert len(digits_bank()) == len(bank_y)

    def accuracy(features, neighbours: int) -> str:
        bank = torch.nn.functional.normalize(features(bank_x), dim=1)
        return " / ".join(
            f"{(knn_predict(features(x), bank, bank_y, neighbours) == y).double().mean():.4f}"
            for x, y in (val.tensors, test.tensors)  # type: ignore[attr-defined]
        )

    print(f"kNN accuracy val / test (k={k}, cosine, weighted vote, bank: the train split):")
    print(f"  raw pixels {accuracy(lambda x: x.flatten(1), k)} (k=1: {accuracy(lambda x: x.flatten(1), 1)})")
    for seed in range(seeds):
        seed_all(seed)
        untrained = instantiate(encoder).eval()
        with torch.no_grad():
            print(f"  untrained encoder, seed {seed}: {accuracy(untrained, k)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64, help="micro-batch b (samples; 2b views)")
    parser.add_argument("--K", type=int, default=4, help="micro-batches a window")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seeds", type=int, default=3, help="untrained encoders for the kNN baseline")
    parser.add_argument("--knn-only", action="store_true", help="only the kNN baselines")
    args = parser.parse_args()
    if args.knn_only:
        return knn_baselines(args.seeds)
    task = Contrastive(bank=torch.utils.data.TensorDataset(torch.zeros(1)))
    print(
        f"{ONE.device}: SimCLR width {args.width} depth {args.depth}, b={args.batch}, K={args.K} "
        f"(global batch {args.K * args.batch}), median of {args.steps} windows"
    )
    rows = {name: measure(step, args, task) for name, step in (("cached", cached), ("naive", naive), ("whole", whole))}
    for name, (seconds, saved, cuda) in rows.items():
        print(
            f"  {name:7s} {seconds * 1e3:8.1f} ms a window | activations saved at peak {saved:8.2f} MiB"
            + (f" | cuda peak {cuda:8.1f} MiB" if ONE.device.type == "cuda" else "")
        )
    (c, cs, _), (n, _, _), (_, ws, _) = rows["cached"], rows["naive"], rows["whole"]
    print(f"  cached / naive time {c / n:.2f}x; cached / whole-batch activation memory {cs / ws:.2f}x")
    knn_baselines(args.seeds)


if __name__ == "__main__":
    main()
