"""Compare the jobs of a sweep (or look at one run): a table and plots from their metrics.jsonl.

    .venv/bin/python scripts/report.py multirun/2025-06-01/12-00-00    # a sweep dir: one row per job
    .venv/bin/python scripts/report.py outputs/2025-06-01/12-00-00     # a run dir: a one-row report

Writes report.md (one row per job) and report.png (loss against step and against samples seen,
the monitored evaluation (best/<key> in its rows: val/acc, val/r2, ...) against step, throughput per job)
into that dir. Reads only what the runs wrote, so it
also works while a sweep is running: a job with no metrics yet, or a half-written last line,
is reported as far as it got. Exit status 2 when the dir holds no runs.

An Optuna study's sweep dir (hparams_search=..., its study.db, or study.log for a journal storage):
report.md also gets a table of the study's trials (parameters, objective, state: a pruned trial with
its step, a failed trial with its error) and its best trial; report.png the optimisation history (each
trial's objective, the best so far, pruned trials marked) and each trial's reported curve (the values
its evaluations reported to a pruner, against the step). Job N is trial N.
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
LEGEND_JOBS = 12  # report.png names the jobs in a legend up to this many
STUDY_FILES = (
    "study.db",
    "study.log",
)  # an Optuna study's storage: sqlite, journal (conf/hydra/sweeper/optuna_study.yaml)


@dataclass
class Job:
    name: str
    path: Path
    overrides: list[str] | None  # None: no .hydra/overrides.yaml yet
    rows: list[dict]
    status: str
    wall_s: float | None
    error: str | None  # a failed job's one-line error (its error.txt)


@dataclass
class Study:
    name: str
    objective: str  # the key the jobs returned the best value of, e.g. val/acc
    direction: str  # maximize | minimize
    trials: list  # optuna FrozenTrials, by number
    others: list[str]  # further studies in the same file


def read_study(root: Path) -> Study | None:
    """The newest study in <root>/study.db (or study.log), or None (no file: not a study's sweep)."""
    found = [root / name for name in STUDY_FILES if (root / name).is_file()]
    if not found:
        return None
    import optuna  # here only: a second to import

    from trainkit.search import studies  # scripts/ runs with src/ on the path (pyproject's editable install)

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    path = found[0].resolve()
    storage = studies.storage(str(path) if path.suffix == ".log" else f"sqlite:///{path}")
    names = [summary.study_name for summary in optuna.get_all_study_summaries(storage)]
    if not names:
        return None
    study = optuna.load_study(study_name=names[-1], storage=storage)
    objective = study.user_attrs.get("objective", "objective")
    return Study(names[-1], objective, study.direction.name.lower(), list(study.trials), names[:-1])


def best_trial(study: Study):
    done = [t for t in study.trials if t.state.name == "COMPLETE"]
    pick = max if study.direction == "maximize" else min
    return pick(done, key=lambda t: t.value) if done else None


def study_markdown(study: Study) -> list[str]:
    params = sorted({name for trial in study.trials for name in trial.params})
    best = best_trial(study)
    lines = ["", f"## Study {study.name}: {len(study.trials)} trials, {study.direction} the best {study.objective}", ""]
    if study.others:
        lines += [f"(the same file also holds the studies {', '.join(study.others)})", ""]
    if best is not None:
        said = " ".join(f"{k}={v}" for k, v in best.params.items())
        where = f"Best trial {best.number} (job dir {best.number}/)"
        lines += [f"{where}: {study.objective} {best.value:.6g} with `{said}`", ""]
    else:
        lines += ["No trial has completed yet.", ""]
    header = ["trial", "state", study.objective, *params, "error"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for trial in study.trials:
        state = {"RUNNING": "running (or interrupted)"}.get(trial.state.name, trial.state.name.lower())
        if trial.state.name == "PRUNED" and "pruned_at" in trial.user_attrs:
            state = f"pruned at step {trial.user_attrs['pruned_at']}"
        value = f"{trial.value:.6g}" if trial.value is not None else "—"
        cells = [str(trial.number), state, value, *(_param(trial.params.get(p)) for p in params)]
        cells.append(trial.user_attrs.get("error", "").replace("|", "\\|"))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _param(value) -> str:
    if value is None:
        return "—"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


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


def metric(jobs: list[Job]) -> str:
    """The evaluation key the table and plot follow: the jobs' monitored one (their rows' best/<key>), else the
    first val/ metric besides the loss, else val/loss. Its direction is the run's own (best/<key>): never guessed."""
    keys = [k for job in jobs for row in job.rows for k in row]
    monitored = [k.removeprefix("best/") for k in keys if k.startswith("best/") and k != "best/step"]
    evaluated = [k for k in keys if k.startswith("val/") and k != "val/loss"]
    return (monitored or evaluated or ["val/loss"])[0]


def summary(job: Job, key: str) -> dict[str, float | None]:
    finals = [v for v in values(job, key) if not math.isnan(v)]
    losses = values(job, "loss")
    test = "test/" + key.split("/", 1)[1]
    return {
        "steps": job.rows[-1]["step"] if job.rows else None,
        "final loss": losses[-1] if losses else None,
        f"best {key}": (values(job, f"best/{key}") or [None])[-1],
        f"final {key}": values(job, key)[-1] if finals else None,
        test: (values(job, test) or [None])[-1],
        "samples/s": mean(values(job, "samples_per_s")),
        "syncs/step": mean(values(job, "comm/grad_syncs")),
        "time": job.wall_s,
    }


def formats(key: str) -> dict[str, str | None]:
    test = "test/" + key.split("/", 1)[1]
    numbers = {f"best {key}": "{:.4f}", f"final {key}": "{:.4f}", test: "{:.4f}"}
    return (
        {"steps": "{:.0f}", "final loss": "{:.4f}"}
        | numbers
        | {"samples/s": "{:.0f}", "syncs/step": "{:.2f}"}
        | {
            "time": None  # see duration
        }
    )


def duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, s = divmod(round(seconds), 60)
    return f"{minutes}m{s:02d}s" if minutes < 60 else f"{minutes // 60}h{minutes % 60:02d}m"


def cell(value: float | None, spec: str | None) -> str:
    if value is None:
        return "—"
    return duration(value) if spec is None else spec.format(value)


def markdown(root: Path, jobs: list[Job], common: list[str], study: Study | None = None) -> str:
    key = metric(jobs)
    columns = formats(key)
    header = ["job", "overrides", "status", *columns]
    lines = [
        f"# Report: {root}",
        "",
        f"{len(jobs)} job(s)" + (f"; every job has: `{' '.join(common)}`" if common else "") + ".",
        "",
        "- final loss: the last logged training loss (a mean over its log interval).",
        f"- best / final {key}: the run's best (checkpoint.monitor, its task's direction) and its last evaluation.",
        f"- test/{key.split('/', 1)[1]}: the test pass at the end of the run (trainer.test), once on the test split.",
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
        numbers = summary(job, key)
        cells = [job.name, label(job, common).replace("|", "\\|"), job.status]
        lines.append("| " + " | ".join(cells + [cell(numbers[k], f) for k, f in columns.items()]) + " |")
    if failed := [job for job in jobs if job.status == "failed"]:
        lines += ["", "Failed jobs:", ""] + [f"- {job.name}: {job.error}" for job in failed]
    if study is not None:
        lines += study_markdown(study)
    return "\n".join(lines) + "\n"


def plot(jobs: list[Job], common: list[str], path: Path, study: Study | None = None) -> None:
    fig, axes = plt.subplots(3 if study else 2, 2, figsize=(12, 12 if study else 8), squeeze=False)
    (by_step, by_samples), (acc, speed) = axes[0], axes[1]
    if study is not None:
        history(study, fig, axes[2])
    key = metric(jobs)
    for i, job in enumerate(jobs):
        style = {"color": f"C{i}", "marker": ".", "label": f"{job.name}: {label(job, common)}"}
        train = [r for r in job.rows if "loss" in r]  # "samples": seen so far (cumulative), all ranks
        by_step.plot([r["step"] for r in train], [r["loss"] for r in train], **style)
        by_samples.plot([r["samples"] for r in train], [r["loss"] for r in train], **style)
        evals = [r for r in job.rows if key in r]
        acc.plot([r["step"] for r in evals], [r[key] for r in evals], **style)
    throughput = [summary(j, key)["samples/s"] or 0.0 for j in jobs]
    speed.bar([j.name for j in jobs], throughput, color=[f"C{i}" for i in range(len(jobs))])
    for ax, title, xlabel, ylabel in [
        (by_step, "training loss", "optimizer step", "loss"),
        (by_samples, "training loss", "samples seen", "loss"),
        (acc, f"evaluation: {key}", "optimizer step", key),
        (speed, "throughput (mean of rows)", "job", "samples/s"),
    ]:
        ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
        ax.grid(alpha=0.3)
    for ax in (by_step, acc):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if len(jobs) <= LEGEND_JOBS:  # more would crowd the figure out (a study's trials: its table names them)
        by_step.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def history(study: Study, fig, row) -> None:
    """The optimisation history: each completed trial's objective, the best so far, pruned and failed
    trials marked; beside it each trial's reported curve (its evaluations as a pruner saw them)."""
    ax, curves = row
    done = [t for t in study.trials if t.state.name == "COMPLETE"]
    ax.plot([t.number for t in done], [t.value for t in done], "o", color="C0", label=f"trial's best {study.objective}")
    best, running = [], None
    pick = max if study.direction == "maximize" else min
    for trial in done:
        running = trial.value if running is None else pick(running, trial.value)
        best.append(running)
    ax.step([t.number for t in done], best, where="post", color="C1", label="best so far")
    if pruned := [t for t in study.trials if t.state.name == "PRUNED" and t.value is not None]:
        ax.plot([t.number for t in pruned], [t.value for t in pruned], "x", color="C2", label="pruned (its last value)")
    for trial in study.trials:
        if steps := sorted(trial.intermediate_values):
            style = {"color": "C2", "alpha": 0.6} if trial.state.name == "PRUNED" else {"color": "C0", "alpha": 0.4}
            curves.plot(steps, [trial.intermediate_values[s] for s in steps], ".-", **style)
    curves.plot([], [], ".-", color="C2", label="pruned trial")
    curves.plot([], [], ".-", color="C0", label="other trial")
    curves.set(title="each trial's reported values", xlabel="optimizer step", ylabel=study.objective)
    curves.grid(alpha=0.3)
    curves.legend(fontsize="small")
    if failed := [t.number for t in study.trials if t.state.name == "FAIL"]:
        for number in failed:
            ax.axvline(number, color="C3", alpha=0.3)
        ax.plot([], [], color="C3", alpha=0.3, label="failed trial")
    title = f"study {study.name}: optimisation history ({study.direction})"
    ax.set(title=title, xlabel="trial", ylabel=study.objective)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")


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
    study = read_study(root)
    (root / "report.md").write_text(markdown(root, jobs, common, study))
    plot(jobs, common, root / "report.png", study)
    print(f"wrote {root / 'report.md'} and {root / 'report.png'} ({len(jobs)} job(s))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
