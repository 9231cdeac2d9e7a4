"""Distributed inference sees every sample exactly once, in dataset order, on any number of ranks:
contiguous shards, the unequal-length gather, and src/predict.py on 1, 2 and 3 ranks."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch.utils.data import TensorDataset

from helpers import rows as rows_of
from helpers import run_distributed, run_in_process, run_train
from trainkit.config import ConfigError
from trainkit.data.digits import digits
from trainkit.dist import Dist
from trainkit.inference import gather, predict
from trainkit.loading import ContiguousSampler, eval_loader, shard_bounds


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("num_samples", [1, 3, 6, 82, 99, 512])
def test_contiguous_shards_cover_every_sample_once_in_order(num_samples, world_size):
    shards = [list(ContiguousSampler(num_samples, world_size, rank)) for rank in range(world_size)]
    # Concatenated in rank order they are exactly range(N): disjoint, complete, no padding, and
    # rank order is dataset order (what gather relies on).
    assert [i for shard in shards for i in shard] == list(range(num_samples))
    for rank, shard in enumerate(shards):
        start, end = shard_bounds(num_samples, world_size, rank)
        assert shard == list(range(start, end)) and len(ContiguousSampler(num_samples, world_size, rank)) == end - start
    sizes = [len(shard) for shard in shards]
    assert max(sizes) - min(sizes) <= 1
    if num_samples < world_size:  # the last ranks are empty, nobody gets a padded repeat
        assert sizes == [1] * num_samples + [0] * (world_size - num_samples)


# (N, trailing shape, dtype): N=2 and N=0 leave ranks of a 3-rank world empty.
GATHER_CASES = [(2, (), torch.long), (7, (3,), torch.float32), (10, (4, 2), torch.float64), (0, (5,), torch.float32)]


def _dataset_of(num_samples, trailing, dtype):
    return torch.arange(num_samples * torch.Size(trailing).numel()).to(dtype).view(num_samples, *trailing)


def _toy():
    """A linear model and 7 samples (3 ranks: shards of 3, 2, 2; its first 2 samples: 1, 1, 0)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    return model, TensorDataset(torch.randn(7, 4), torch.randint(0, 3, (7,)))


def _gather_and_predict(rank, world_size):
    d = Dist(rank, rank, world_size, torch.device("cpu"))
    gathered = []
    for num_samples, trailing, dtype in GATHER_CASES:
        start, end = shard_bounds(num_samples, world_size, rank)
        gathered.append(gather(_dataset_of(num_samples, trailing, dtype)[start:end], d))
    # An empty rank may hand in any empty tensor of the right ndim (predict does: it has no logits).
    start, end = shard_bounds(2, world_size, rank)
    ragged = torch.ones(end - start, 6) if end > start else torch.empty(0, 0)
    model, data = _toy()
    return {
        "gathered": gathered,
        "ragged": gather(ragged, d),
        "predict": predict(model, eval_loader(data, d, 4, 0), d),
        "predict_tiny": predict(model, eval_loader(TensorDataset(*data[:2]), d, 4, 0), d),
    }


def test_gather_and_predict_on_3_ranks_equal_one_process_in_dataset_order():
    ranks = run_distributed(_gather_and_predict, 3)
    single = Dist(0, 0, 1, torch.device("cpu"))
    model, data = _toy()
    expected = predict(model, eval_loader(data, single, 4, 0), single)
    expected_tiny = predict(model, eval_loader(TensorDataset(*data[:2]), single, 4, 0), single)
    for result in ranks:  # every rank gets the whole result
        for case, got in zip(GATHER_CASES, result["gathered"], strict=True):
            want = _dataset_of(*case)
            assert got.dtype == want.dtype and torch.equal(got, want), case
        assert torch.equal(result["ragged"], torch.ones(2, 6))
        for got, want in ((result["predict"], expected), (result["predict_tiny"], expected_tiny)):
            assert torch.equal(got["targets"], want["targets"])
            torch.testing.assert_close(got["logits"], want["logits"])  # a row out of order is far off
    assert torch.equal(expected["targets"], data.tensors[1])  # dataset order


# --- src/predict.py end to end, from a 2-rank DDP training run of the BatchNorm cnn -------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("train")
    run_in_process(run_dir, "parallel=ddp", "model=cnn", "trainer.max_steps=30", nproc=2)
    return run_dir


@pytest.fixture(scope="module")
def predicted(trained, tmp_path_factory) -> dict:
    """predict.py on 1, 2 and 3 ranks: world size -> (its run dir, its stdout: every rank's)."""
    out = {}
    for world_size in (1, 2, 3):
        run_dir = tmp_path_factory.mktemp(f"predict{world_size}")
        stdout = run_in_process(run_dir, f"run_dir={trained}", "predict.probs=true", nproc=world_size, script="predict")
        out[world_size] = run_dir, stdout
    return out


@pytest.mark.slow
def test_predict_on_1_2_3_ranks_writes_identical_files_in_dataset_order(predicted):
    files = {
        w: ((d / "predictions.csv").read_bytes(), (d / "metrics.json").read_text()) for w, (d, _) in predicted.items()
    }
    assert files[1] == files[2] == files[3]

    lines = files[1][0].decode().splitlines()
    assert lines[0] == "index,target,prediction," + ",".join(f"prob_{c}" for c in range(10))
    rows = [line.split(",") for line in lines[1:]]
    _, val, _ = digits()
    assert [int(r[0]) for r in rows] == list(range(len(val)))  # every sample once, in order
    assert [int(r[1]) for r in rows] == val.tensors[1].tolist()  # the targets of those samples
    probs = torch.tensor([[float(p) for p in r[3:]] for r in rows])
    torch.testing.assert_close(probs.sum(dim=1), torch.ones(len(rows)), rtol=0, atol=1e-4)
    assert [int(r[2]) for r in rows] == probs.argmax(dim=1).tolist()

    metrics = json.loads(files[1][1])
    assert metrics["samples"] == len(val)
    assert metrics["acc"] == sum(r[1] == r[2] for r in rows) / len(rows)
    for _, stdout in predicted.values():  # rank 0 alone reports
        assert stdout.count("predict | run dir") == 1 and stdout.count("done: loss ") == 1


@pytest.mark.slow
def test_val_metrics_of_a_2_rank_training_run_equal_predict(trained, predicted):
    val = rows_of(trained)[-1]  # the last evaluation (the test row after it: test_test_split.py)
    metrics = json.loads((predicted[1][0] / "metrics.json").read_text())
    assert val["val/acc"] == metrics["acc"]
    assert val["val/loss"] == pytest.approx(metrics["loss"], rel=0, abs=1e-6)


# --- errors: one line, exit status 2, no traceback --------------------------------------------


def _broken_run(trained: Path, tmp: Path, kind: str) -> Path:
    run_dir = tmp / kind
    (run_dir / ".hydra").mkdir(parents=True)
    run_cfg = OmegaConf.load(trained / ".hydra" / "config.yaml")
    if kind == "mismatched":  # the trained weights, but a config asking for a narrower cnn
        run_cfg.model.width = 16
        shutil.copy(trained / "model.pt", run_dir / "model.pt")
    OmegaConf.save(run_cfg, run_dir / ".hydra" / "config.yaml")
    return run_dir


CASES = [
    ("missing", "does not exist"),
    ("no_model", "has no model.pt: not a finished training run"),
    ("mismatched", "(the run's model config) does not fit the model: other shape 0.weight"),
    ("split", "split=tests is not one of: train, val, test"),
    ("sampling", "prompt=hi, temperature=0.5: sampling settings need a text run (data=pydoc_text); run_dir="),
]


def _bad_overrides(trained: Path, tmp_path: Path, case: str) -> list[str]:
    return {
        "missing": [f"run_dir={tmp_path / 'nope'}"],
        "no_model": [f"run_dir={_broken_run(trained, tmp_path, 'no_model')}"],
        "mismatched": [f"run_dir={_broken_run(trained, tmp_path, 'mismatched')}"],
        "split": [f"run_dir={trained}", "split=tests"],
        "sampling": [f"run_dir={trained}", "prompt=hi", "temperature=0.5", "top_k=null"],  # top_k: the default
    }[case]


@pytest.mark.slow
@pytest.mark.parametrize("case,message", CASES)
def test_bad_run_dir_is_refused_naming_the_problem(trained, tmp_path, case, message):
    with pytest.raises(ConfigError) as error:
        run_in_process(tmp_path / "out", *_bad_overrides(trained, tmp_path, case), script="predict")
    assert message in str(error.value)


@pytest.mark.slow
@pytest.mark.parametrize("case,message", [CASES[0], CASES[2]])  # before and after the process group
def test_bad_run_dir_is_one_line_with_exit_2(trained, tmp_path, case, message):
    proc = run_train(tmp_path / "out", *_bad_overrides(trained, tmp_path, case), script="src/predict.py", check=False)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr


class _PairTarget:
    """A task whose loss reads a structured target, (label, input) (task=distil's): its fields are no samples."""

    eval_width = 2

    def predictions(self, output, target):
        return {"target": target[0], "prediction": output.argmax(dim=1)}

    def eval_sums(self, inputs, output, target):
        correct = (output.argmax(dim=1) == target[0]).sum().double()
        return torch.stack([correct, torch.tensor(float(len(target[0])), dtype=torch.float64)])

    def eval_metrics(self, sums):
        return {"acc": sums[0] / sums[1]}


def test_predict_counts_the_samples_of_a_structured_target_not_its_fields():
    from predict import task_results  # issue 45, 6: "acc ... on 2 val samples" and "samples": 2 for 359

    torch.manual_seed(0)
    out = {"logits": torch.randn(359, 3), "targets": (torch.randint(0, 3, (359,)), torch.randn(359, 4))}
    metrics, rows = task_results(_PairTarget(), out, probs=False, device=torch.device("cpu"))
    assert metrics["samples"] == 359 and len(rows) == 1 + 359


def test_predict_writes_a_contrastive_run_s_embeddings_index_aligned_on_1_and_2_ranks(tmp_path):
    """task=contrastive has no predictions but declares `embeddings`: embeddings.pt, every val sample once in
    dataset order (359: a multiple of neither 2 ranks nor the batch of 64), the same on 1 and 2 ranks."""
    from helpers import make_parent

    run_dir = make_parent(tmp_path / "simclr", "+experiment=digits_simclr")  # its initial weights: no training
    written = []
    for nproc in (1, 2):
        out = tmp_path / f"predict{nproc}"
        run_in_process(out, f"run_dir={run_dir}", "batch_size=64", script="predict", nproc=nproc)
        written.append(torch.load(out / "embeddings.pt", weights_only=True))
        assert not (out / "predictions.csv").exists()
        metrics = json.loads((out / "metrics.json").read_text())
        assert metrics["samples"] == 359 and 0 <= metrics["knn_acc"] <= 1
    one, two = written
    labels = torch.tensor([int(y) for _, y in digits(0.2, 0.2)[1]])
    assert one["split"] == "val" and one["index"].tolist() == list(range(359)) and one["label"].equal(labels)
    assert one["embedding"].shape[0] == 359 and torch.allclose(one["embedding"], two["embedding"], atol=1e-6)
    assert two["index"].equal(one["index"]) and two["label"].equal(labels)


def test_predict_and_eval_on_a_world_size_that_does_not_divide_the_run_s_global_batch(tmp_path):
    """+experiment=digits_simclr's data.batch_size is ${micro_batch:256,K,${world_size:}}: on 3 ranks it resolved at
    3 and failed (issue 54, 3). Resolved at the run's own world size instead (its provenance.json; none: 1), said."""
    from helpers import make_parent

    run_dir = make_parent(tmp_path / "simclr", "+experiment=digits_simclr")
    out = run_in_process(tmp_path / "predict3", f"run_dir={run_dir}", script="predict", nproc=3)
    assert out.count("data.batch_size resolves at the run's own world size 1: batch 256 per rank") == 1
    embedded = torch.load(tmp_path / "predict3" / "embeddings.pt", weights_only=True)
    assert embedded["index"].tolist() == list(range(359)) and embedded["embedding"].shape[0] == 359
    run_in_process(tmp_path / "eval3", f"run_dir={run_dir}", script="eval", nproc=3)
    assert 0 <= json.loads((tmp_path / "eval3" / "metrics.json").read_text())["test/knn_acc"] <= 1


def test_the_run_s_batch_resolves_at_the_world_size_of_its_newest_start(tmp_path, capsys):
    """A run started on 1 rank and resumed on 2, then 4: its ${micro_batch:16,1,${world_size:}} last resolved at 4
    (4 per rank); predict.py and eval.py resolve it there too, not at the first start's 1 (16 per rank)."""
    from trainkit.rundir import run_batch_size

    record = {"world_size": 1, "resumes": [{"step": 2, "world_size": 2}, {"step": 5, "world_size": 4}]}
    (tmp_path / "provenance.json").write_text(json.dumps(record))
    run_cfg = OmegaConf.create({"data": {"batch_size": "${micro_batch:16,1,${world_size:}}"}})
    job = Dist(rank=0, local_rank=0, world_size=3, device=torch.device("cpu"))
    assert run_batch_size(OmegaConf.create({"run_dir": str(tmp_path)}), run_cfg, job) == 4
    assert capsys.readouterr().out == (
        "data.batch_size resolves at the run's own world size 4: batch 4 per rank (not at this job's 3; "
        "batch_size= sets another)\n"
    )
