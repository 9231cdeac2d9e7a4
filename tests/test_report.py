"""scripts/report.py: a real 3-job sweep end to end, and sweeps caught mid-run (hand-written dirs)."""

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from matplotlib.image import imread

from helpers import ROOT, final_test_row, run_train
from helpers import rows as rows_of

spec = importlib.util.spec_from_file_location("report", ROOT / "scripts" / "report.py")
report = importlib.util.module_from_spec(spec)
spec.loader.exec_module(report)

PNG = b"\x89PNG\r\n\x1a\n"


def run_report(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "report.py"), str(path)], capture_output=True, text=True, timeout=120
    )


def table(markdown: str) -> dict[str, dict[str, str]]:
    """{job: {column: cell}} from report.md's table."""
    lines = [line for line in markdown.splitlines() if line.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    return {row[0]: dict(zip(header, row, strict=True)) for row in cells}


def assert_png(path: Path):
    assert path.read_bytes().startswith(PNG)
    image = imread(path)
    assert image.shape[0] > 100 and image.shape[1] > 100
    assert image[..., :3].std() > 0.05  # lines and bars, not a blank canvas


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sweep")
    proc = run_train(
        tmp / "unused",
        "-m",
        f"hydra.sweep.dir={tmp / 'sweep'}",
        "trainer.max_steps=4",
        "trainer.log_every=2",
        "trainer.eval_every=2",
        "accumulation.steps=1,2,4,0",  # 0: job 3 fails, the others run
        check=False,
    )
    assert proc.returncode == 1 and [line for line in proc.stderr.splitlines() if line.startswith("error")] == [
        "error: job 3 (trainer.max_steps=4 trainer.log_every=2 trainer.eval_every=2 accumulation.steps=0): "
        "accumulation.steps=0 must be null or a positive integer"
    ], proc.stderr
    return tmp / "sweep"


@pytest.mark.slow
def test_a_4_job_sweep_gives_one_dir_per_job_and_a_report_that_matches_its_metrics(sweep):
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0", "1", "2", "3"]
    for job in ("0", "1", "2"):
        assert (sweep / job / "metrics.jsonl").is_file() and (sweep / job / "model.pt").is_file()

    proc = run_report(sweep)
    assert proc.returncode == 0, proc.stderr
    assert str(sweep / "report.md") in proc.stdout
    markdown = (sweep / "report.md").read_text()
    assert markdown.startswith("# Report:")
    assert "every job has: `trainer.max_steps=4 trainer.log_every=2 trainer.eval_every=2`" in markdown
    rows = table(markdown)
    assert list(rows) == ["0", "1", "2", "3"]
    assert (rows["3"]["overrides"], rows["3"]["status"], rows["3"]["steps"]) == ("accumulation.steps=0", "failed", "—")
    assert "- 3: accumulation.steps=0 must be null or a positive integer" in markdown
    for job, steps in zip(("0", "1", "2"), (1, 2, 4), strict=True):
        metrics = rows_of(sweep / job)  # training and validation rows; the test row: final_test_row
        row = rows[job]
        assert row["overrides"] == f"accumulation.steps={steps}"  # only what differs between the jobs
        assert row["status"] == "finished"
        assert row["steps"] == "4" == str(metrics[-1]["step"])
        assert row["final loss"] == f"{metrics[-1]['loss']:.4f}"
        assert row["best val/acc"] == f"{max(r['val/acc'] for r in metrics):.4f}"
        assert row["final val/acc"] == f"{metrics[-1]['val/acc']:.4f}"
        assert row["test/acc"] == f"{final_test_row(sweep / job)['test/acc']:.4f}"
        speeds = [r["samples_per_s"] for r in metrics]
        assert row["samples/s"] == f"{sum(speeds) / len(speeds):.0f}"
        assert row["syncs/step"] == "0.00"  # one process: no gradient all-reduce (DDP no_sync: 1.00)
        assert row["time"].endswith("s")
    assert_png(sweep / "report.png")


def write_job(path: Path, overrides: list[str], rows: list[dict], tail: str = "", finished: bool = False):
    (path / ".hydra").mkdir(parents=True)
    (path / ".hydra" / "config.yaml").write_text("seed: 0\n")
    (path / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)
    if finished:
        (path / "model.pt").write_bytes(b"")


def train_row(step: int, loss: float, **extra) -> dict:
    return {
        "step": step,
        "epoch": step / 10,
        "loss": loss,
        "samples": 32 * step,
        "comm/grad_syncs": 1.0,
        "samples_per_s": 100.0 * step,
        **extra,
    }


def test_a_running_sweep_is_reported_as_far_as_each_job_got(tmp_path, capsys):
    sweep = tmp_path / "multirun"
    first = train_row(2, 2.0, **{"val/acc": 0.5, "best/val/acc": 0.5, "best/step": 2})
    write_job(sweep / "0", ["optim.lr=0.1"], [first, train_row(4, 1.5)], finished=True)
    # Still running: no evaluation yet, a NaN loss, the last line half written.
    write_job(sweep / "1", ["optim.lr=1.0"], [train_row(2, 2.5), train_row(4, float("nan"))], tail='{"step": 6, "lo')
    (sweep / "2").mkdir()  # started, nothing written yet
    (sweep / "10").mkdir()  # sorted as a number: after 2
    write_job(sweep / "3", ["optim.lr=3.0"], [])  # an empty metrics.jsonl
    write_job(sweep / "4", ["optim.lr=4.0"], [train_row(2, 2.0)])  # stopped: its last row is old
    os.utime(sweep / "4" / "metrics.jsonl", (time.time() - 2 * report.RUNNING_S,) * 2)
    write_job(sweep / "5", ["optim.lr=5.0"], [train_row(2, 2.0)])  # failed at step 3
    (sweep / "5" / "error.txt").write_text("non-finite loss or gradient at step 3\n")
    assert report.main([str(sweep)]) == 0
    assert "report.md" in capsys.readouterr().out
    markdown = (sweep / "report.md").read_text()
    rows = table(markdown)
    assert list(rows) == ["0", "1", "2", "3", "4", "5", "10"]
    assert (rows["4"]["status"], rows["4"]["steps"]) == ("stopped", "2")
    assert (rows["5"]["status"], rows["5"]["steps"]) == ("failed", "2")
    assert "- 5: non-finite loss or gradient at step 3" in markdown
    assert rows["0"] | {"time": ""} == {
        "job": "0",
        "overrides": "optim.lr=0.1",
        "status": "finished",
        "steps": "4",
        "final loss": "1.5000",
        "best val/acc": "0.5000",
        "final val/acc": "0.5000",
        "test/acc": "—",
        "samples/s": "300",
        "syncs/step": "1.00",
        "time": "",
    }
    assert (rows["1"]["status"], rows["1"]["steps"], rows["1"]["final loss"]) == ("running", "4", "nan")
    assert rows["1"]["best val/acc"] == "—"
    assert (rows["2"]["overrides"], rows["2"]["steps"], rows["2"]["time"]) == ("(no .hydra yet)", "—", "—")
    assert (rows["3"]["overrides"], rows["3"]["steps"]) == ("optim.lr=3.0", "—")
    assert_png(sweep / "report.png")


def test_a_run_dir_gives_a_one_row_report_with_all_its_overrides(tmp_path):
    write_job(tmp_path, ["optim.lr=0.1", "model=cnn"], [train_row(2, 2.0), train_row(3, 1.25)], finished=True)
    assert report.main([str(tmp_path)]) == 0
    rows = table((tmp_path / "report.md").read_text())
    assert len(rows) == 1
    (row,) = rows.values()
    assert (row["overrides"], row["steps"], row["final loss"]) == ("optim.lr=0.1 model=cnn", "3", "1.2500")


def test_a_dir_without_runs_exits_2_with_one_line(tmp_path):
    proc = run_report(tmp_path)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "no runs in" in proc.stderr
    assert not (tmp_path / "report.md").exists()
