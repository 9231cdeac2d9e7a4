"""Compare the jobs of a sweep (or look at one run): a table and plots from their metrics.jsonl.

    .venv/bin/python scripts/report.py multirun/2025-06-01/12-00-00    # a sweep dir: one row per job
    .venv/bin/python scripts/report.py outputs/2025-06-01/12-00-00     # a run dir: a one-row report

Writes report.md (one row per job) and report.png (loss against step and against samples seen,
val/acc against step, throughput per job) into that dir. Reads only what the runs wrote, so it
also works while a sweep is running: a job with no metrics yet, or a half-written last line,
is reported as far as it got. Exit status 2 when the dir holds no runs.
"""

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import yaml  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

RUNNING_S = 300  # no model.pt and a metrics row written this recently: "running", else "stopped"
ERROR_FILE = "error.txt"  # a failed run's one-line error (trainkit.config.record_failure)


@dataclass
class Job:
    name: str
    path: Path
    overrides: list[str] | None  # None: no .hydra/overrides.yaml yet
    rows: list[dict]
    status: str
    wall_s: float | None
    error: str | None  # a failed job's one-line error (its error.txt)


def read_rows(path: Path) -> list[dict]:
    """metrics.jsonl's complete rows; none when the file is absent or empty. A line that does not
    parse (the last one, half written while the run logs) is skipped."""
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    rows = []
    for line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and "step" in row:
            rows.append(row)
    return rows


def is_run(path: Path) -> bool:
    return any((path / name).exists() for name in ("metrics.jsonl", ".hydra", "model.pt", ERROR_FILE))


def job_dirs(root: Path) -> list[Path]:
    """[root] for a run dir; for a sweep dir its job dirs (0/, 1/, ...: numbered, or holding a run)."""
    if is_run(root):
        return [root]
    if not root.is_dir():
        return []
    jobs = [p for p in root.iterdir() if p.is_dir() and (p.name.isdigit() or is_run(p))]
    return sorted(jobs, key=lambda p: (int(p.name) if p.name.isdigit() else math.inf, p.name))


def load_job(path: Path, name: str, now: float) -> Job:
    metrics, config, overrides = path / "metrics.jsonl", path / ".hydra" / "config.yaml", path / ".hydra/overrides.yaml"
    last_write = metrics.stat().st_mtime if metrics.exists() else path.stat().st_mtime
    error = (path / ERROR_FILE).read_text().strip() if (path / ERROR_FILE).exists() else None
    if (path / "model.pt").exists():
        status = "finished"
    elif error is not None:
        status = "failed"
    else:
        status = "running" if now - last_write < RUNNING_S else "stopped"
    return Job(
        name,
        path,
        [str(o) for o in yaml.safe_load(overrides.read_text()) or []] if overrides.exists() else None,
        read_rows(metrics),
        status,
        last_write - config.stat().st_mtime if metrics.exists() and config.exists() else None,
        error,
    )


def shared(jobs: list[Job]) -> list[str]:
    """The overrides every job shares (a sweep's fixed settings); [] for a single job."""
    known = [set(j.overrides) for j in jobs if j.overrides is not None]
    if len(jobs) < 2 or not known:
        return []
    common = set.intersection(*known)
    first = next(j.overrides for j in jobs if j.overrides is not None)
    return [o for o in first if o in common]


def label(job: Job, common: list[str]) -> str:
    if job.overrides is None:
        return "(no .hydra yet)"
    if not job.overrides:
        return "(defaults)"
    return " ".join(o for o in job.overrides if o not in common) or "(the shared ones only)"


def values(job: Job, key: str) -> list[float]:
    return [float(r[key]) for r in job.rows if key in r]


def mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def summary(job: Job) -> dict[str, float | None]:
    accs = [a for a in values(job, "val/acc") if not math.isnan(a)]
    losses = values(job, "loss")
    return {
        "steps": job.rows[-1]["step"] if job.rows else None,
        "final loss": losses[-1] if losses else None,
        "best val/acc": max(accs) if accs else None,
        "final val/acc": values(job, "val/acc")[-1] if accs else None,
        "test/acc": (values(job, "test/acc") or [None])[-1],
        "samples/s": mean(values(job, "samples_per_s")),
        "syncs/step": mean(values(job, "comm/grad_syncs")),
        "time": job.wall_s,
    }


FORMATS: dict[str, str | None] = {
    "steps": "{:.0f}",
    "final loss": "{:.4f}",
    "best val/acc": "{:.4f}",
    "final val/acc": "{:.4f}",
    "test/acc": "{:.4f}",
    "samples/s": "{:.0f}",
    "syncs/step": "{:.2f}",
    "time": None,  # see duration
}


def duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, s = divmod(round(seconds), 60)
    return f"{minutes}m{s:02d}s" if minutes < 60 else f"{minutes // 60}h{minutes % 60:02d}m"


def cell(value: float | None, spec: str | None) -> str:
    if value is None:
        return "—"
    return duration(value) if spec is None else spec.format(value)


def markdown(root: Path, jobs: list[Job], common: list[str]) -> str:
    header = ["job", "overrides", "status", *FORMATS]
    lines = [
        f"# Report: {root}",
        "",
        f"{len(jobs)} job(s)" + (f"; every job has: `{' '.join(common)}`" if common else "") + ".",
        "",
        "- final loss: the last logged training loss (a mean over its log interval).",
        "- best / final val/acc: the highest and the last evaluation.",
        "- test/acc: the test pass at the end of the run (trainer.test), once on the test split.",
        "- samples/s: the mean of the rows' samples_per_s (each over its log interval, training time only).",
        "- syncs/step: the mean of comm/grad_syncs (gradient all-reduces per optimizer step; 0 in a single process).",
        "- time: from .hydra/config.yaml (written as training starts, or resumes) to the last metrics row.",
        f"- status: finished (model.pt written), failed ({ERROR_FILE}: its error is listed below the table), "
        f"running (a row in the last {RUNNING_S}s), else stopped.",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    for job in jobs:
        numbers = summary(job)
        cells = [job.name, label(job, common).replace("|", "\\|"), job.status]
        lines.append("| " + " | ".join(cells + [cell(numbers[k], f) for k, f in FORMATS.items()]) + " |")
    if failed := [job for job in jobs if job.status == "failed"]:
        lines += ["", "Failed jobs:", ""] + [f"- {job.name}: {job.error}" for job in failed]
    return "\n".join(lines) + "\n"


def plot(jobs: list[Job], common: list[str], path: Path) -> None:
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    (by_step, by_samples), (acc, speed) = axes
    for i, job in enumerate(jobs):
        style = {"color": f"C{i}", "marker": ".", "label": f"{job.name}: {label(job, common)}"}
        train = [r for r in job.rows if "loss" in r]  # "samples": seen so far (cumulative), all ranks
        by_step.plot([r["step"] for r in train], [r["loss"] for r in train], **style)
        by_samples.plot([r["samples"] for r in train], [r["loss"] for r in train], **style)
        evals = [r for r in job.rows if "val/acc" in r]
        acc.plot([r["step"] for r in evals], [r["val/acc"] for r in evals], **style)
    throughput = [summary(j)["samples/s"] or 0.0 for j in jobs]
    speed.bar([j.name for j in jobs], throughput, color=[f"C{i}" for i in range(len(jobs))])
    for ax, title, xlabel, ylabel in [
        (by_step, "training loss", "optimizer step", "loss"),
        (by_samples, "training loss", "samples seen", "loss"),
        (acc, "validation accuracy", "optimizer step", "val/acc"),
        (speed, "throughput (mean of rows)", "job", "samples/s"),
    ]:
        ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
        ax.grid(alpha=0.3)
    for ax in (by_step, acc):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    by_step.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path, help="a sweep dir (multirun/<stamp>) or a run dir")
    root = parser.parse_args(argv).dir
    dirs = job_dirs(root)
    if not dirs:
        print(
            f"report.py: no runs in {root} (expected a run dir with metrics.jsonl, or a sweep dir of jobs)",
            file=sys.stderr,
        )
        return 2
    now = time.time()
    jobs = [load_job(d, d.name or str(d), now) for d in dirs]
    common = shared(jobs)
    (root / "report.md").write_text(markdown(root, jobs, common))
    plot(jobs, common, root / "report.png")
    print(f"wrote {root / 'report.md'} and {root / 'report.png'} ({len(jobs)} job(s))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
