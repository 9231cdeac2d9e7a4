"""data=shards as a run sees it (issue 60): the same weights on 1 process and 2 ranks x K=2; a mixture resumed three
times, on 1 -> 2 -> 3 -> 1 ranks, ends where the uninterrupted run ends (bit for bit where the world size stays);
shards read from an S3 server on localhost through a small cache, and that server going down mid-run: one line, a
checkpoint, and a resume once it is back that ends on the uninterrupted run's weights. The order and the mixture's
counts themselves: tests/test_shards.py; the engine's agreement on a failed read: tests/test_data_order.py."""

import contextlib
import io
from pathlib import Path

import pytest
import torch
from s3_server import SECRET
from test_shards import script

from helpers import cli_in_process, max_diff, rows, run_in_process, weights
from trainkit.data.shard_store import upload


@pytest.fixture(scope="module")
def sets(tmp_path_factory) -> Path:
    """Two shard sets of digits, in other write orders (a, b): 1079 train samples each, in shards of 60 and 45."""
    base = tmp_path_factory.mktemp("shard_runs")
    for name, args in (("a", ["max_count=60"]), ("b", ["max_count=45", "seed=1"])):
        with contextlib.redirect_stdout(io.StringIO()):
            assert script().main(["data=digits", *args, f"out={base / name}"], progress=False) == 0
    return base


BASE = ("data=shards", "model=mlp", "optim=sgd", "optim.lr=0.05", "sched=constant", "logger=none")
BASE += ("trainer.eval_every=1000", "checkpoint.every=0", "data.window=2")


def test_two_ranks_with_two_micro_batches_train_what_one_process_trains(sets, tmp_path):
    """Global batch 32 from 1 process x 32 and from 2 ranks x K=2 x 8: the same samples per step (the order is the
    shard set's, independent of W, K, b), so the same weights to SGD's rounding, 12 steps."""
    run = (*BASE, f"data.path={sets / 'a'}", "trainer.max_steps=12")
    run_in_process(tmp_path / "one", *run, "data.batch_size=32")
    run_in_process(tmp_path / "two", *run, "data.batch_size=8", "accumulation.steps=2", "parallel=ddp", nproc=2)
    assert max_diff(weights(tmp_path / "one"), weights(tmp_path / "two")) < 1e-6


def _mixture(sets: Path) -> tuple[str, ...]:
    """A 0.7 / 0.3 mixture of the two sets in epochs of 100 samples, global batch 24 from micro-batches of 4."""
    sources = f"data.sources={{a: {{path: {sets / 'a'}, weight: 0.7}}, b: {{path: {sets / 'b'}, weight: 0.3}}}}"
    batches = ("accumulation.global_batch_size=24", "data.batch_size=4", "trainer.log_every=1")
    return (*BASE, sources, "data.epoch_samples=100", *batches)


def _data_rows(run_dir: Path) -> list[tuple]:
    return [(r["step"], r["samples"], r["data/a"], r["data/b"]) for r in rows(run_dir) if "data/a" in r]


def test_a_mixture_resumed_three_times_on_1_2_3_1_ranks_ends_where_the_uninterrupted_run_ends(sets, tmp_path):
    """A 0.7/0.3 mixture in epochs of 100 samples, global batch 24: 8 steps cross the epochs (5 windows each, the
    last of 4 samples). Run whole, and in four parts of 2 steps on 1, 2, 3 and 1 ranks (K = 6, 3, 2, 6): every row
    counts the same samples of each source (exact), the weights agree to SGD's rounding (reduction order changes
    with W); four parts on 1 process give the same weights bit for bit. The anchors' bug (the second resume
    restarting the stream) would draw other samples from the third part on."""
    mixture = _mixture(sets)
    run_in_process(tmp_path / "whole", *mixture, "trainer.max_steps=8")
    for part, nproc in enumerate((1, 2, 3, 1), start=1):
        ranks = ("parallel=ddp",) if nproc > 1 else ()
        resume = ("checkpoint.resume=auto",) if part > 1 else ()
        run_in_process(tmp_path / "parts", *mixture, *ranks, *resume, f"trainer.max_steps={2 * part}", nproc=nproc)
        run_in_process(tmp_path / "alone", *mixture, *resume, f"trainer.max_steps={2 * part}")
    whole = _data_rows(tmp_path / "whole")  # (step, samples, data/a, data/b): windows of 24, 24, 24, 24, 4 an epoch
    assert [r[:2] for r in whole] == [(1, 24), (2, 48), (3, 72), (4, 96), (5, 100), (6, 124), (7, 148), (8, 172)]
    assert all(a + b == n and abs(a - 0.7 * n) < 1 for _, n, a, b in whole)
    assert _data_rows(tmp_path / "parts") == whole and _data_rows(tmp_path / "alone") == whole
    assert max_diff(weights(tmp_path / "parts"), weights(tmp_path / "whole")) < 1e-6
    assert all(
        torch.equal(a, b) for a, b in zip(*(weights(tmp_path / d).values() for d in ("alone", "whole")), strict=True)
    )


def test_shards_in_an_object_store_through_a_small_cache_and_the_store_going_down(sets, tmp_path, s3_server, capfd):
    """The shard set uploaded to an S3 server on localhost, read through a cache of 5 of its 18 train shards (two
    windows and one): 40 steps end on the weights of the same run from the local dir, bit for bit, the cache never
    past its limit by more than the shard in flight. Then the server goes down after 6 more shard downloads:
    retries, one line naming the shard's URL, the last step's checkpoint; once it is back, the same command resumes
    and ends on those weights too (a start while it is down: one line, data.retries' tries). The credentials (from
    the environment) are in no file of the run dir."""
    url = s3_server.bucket("shards") + "/digits"
    upload(sets / "a", url)
    limit = 5 * max(p.stat().st_size for p in (sets / "a").glob("train-*.tar"))  # 2 windows (read, prefetched) + 1
    run = (*BASE, "trainer.max_steps=40", "data.batch_size=32", "checkpoint.every=0")
    remote = (*run, f"data.path={url}", f"data.cache_dir={tmp_path / 'cache'}", f"data.cache_limit={limit}")
    remote += ("data.retries=2", "data.backoff=0.05")
    run_in_process(tmp_path / "local", *run, f"data.path={sets / 'a'}")
    run_in_process(tmp_path / "remote", *remote)
    assert torch.equal(*(torch.cat([w.flatten() for w in weights(tmp_path / d).values()]) for d in ("local", "remote")))
    cached = [p.stat().st_size for p in (tmp_path / "cache").rglob("*") if p.is_file()]
    assert 0 < sum(cached) <= limit + max(cached)

    s3_server.stop_after(6)
    down = cli_in_process(capfd, tmp_path / "down", *remote, f"data.cache_dir={tmp_path / 'cold'}")
    assert not s3_server.up and down.returncode == 3, down.stderr
    (line,) = [line for line in down.stderr.splitlines() if line]
    (written,) = (tmp_path / "down" / "checkpoints").iterdir()
    step = int(written.name.removeprefix("step_").removesuffix(".pt"))
    assert line.startswith(f"error: {url}/train-") and "unavailable after 2 tries" in line and 0 < step < 40
    assert line.endswith(f"checkpoint of step {step} written: the same command resumes once it is back")
    fresh = cli_in_process(capfd, tmp_path / "fresh", *remote, "data.retries=1")  # a start while it is down
    assert fresh.returncode == 2 and not (tmp_path / "fresh").exists()
    assert fresh.stderr.strip() == f"error: {url}/manifest.json: unavailable after 1 try: EndpointConnectionError: " + (
        f'Could not connect to the endpoint URL: "{s3_server.endpoint}/shards/digits/manifest.json"'
    )
    s3_server.start()
    back = cli_in_process(capfd, tmp_path / "down", *remote, f"data.cache_dir={tmp_path / 'cold'}")
    assert back.returncode == 0, back.stderr
    assert max_diff(weights(tmp_path / "down"), weights(tmp_path / "local")) == 0.0
    for path in (p for d in ("remote", "down") for p in (tmp_path / d).rglob("*") if p.is_file()):
        assert SECRET.encode() not in path.read_bytes() and b"trainkit-test-key" not in path.read_bytes(), path
