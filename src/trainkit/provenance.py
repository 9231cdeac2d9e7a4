"""provenance.json: where a run came from, one file in its run dir, written by rank 0 (atomically: a temp file
renamed) before training, beside .hydra/config.yaml. It holds the git commit of the source tree trainkit runs
from and whether the tree was dirty (the diff of its tracked files in provenance.diff next to it, with the untracked
files under src/ and conf/, a fork's new options, listed by hash and their content in the diff too), the versions
of Python, torch and every dependency pyproject.toml names, the command line and its overrides, the world size,
and for a run that builds on runs (model.init.from, task.teacher.from) each parent's run dir and the parent's
own record, nested: a chain is traceable to its first run. A resume keeps the record of the start and appends
its own (step, command, world size, commit) under "resumes". No git, or a tree that is no repository: the
record says why, and the run goes on. W&B's config gets the record (`brief`: the parents by their dirs)."""

import hashlib
import importlib.metadata
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

try:
    import tomllib  # Python 3.11+
except ModuleNotFoundError:  # 3.10: the installed package's metadata names the dependencies instead
    tomllib = None  # type: ignore[assignment]

FILE = "provenance.json"
DIFF = "provenance.diff"
# the keys that name a run this one builds on; run_dir: the training run predict.py and eval.py read
PARENT_KEYS = ("model.init.from", "task.teacher.from", "run_dir")
ROOT = Path(__file__).resolve().parents[2]  # the source tree: src/trainkit/provenance.py -> its repository
UNTRACKED_IN = ("src", "conf")  # where an untracked file is the run's code (a fork's new option), not a stray note


def git_state(root: Path | None = None, diff_name: str = DIFF) -> tuple[dict, str]:
    """{"commit", "dirty", ...} of the tree at `root`, and the diff of its tracked files ("" when clean: else the
    record names it as `diff_name`); without git, or outside a repository: {"commit": None, "why": ...}."""

    root = ROOT if root is None else root
    # git by its path: subprocess searches PATH for a bare name inside warnings.catch_warnings(), which resets
    # Python's once-per-place memory of warnings, so a user's warning would show again in every sweep job.
    executable = shutil.which("git")
    if executable is None:
        return {"commit": None, "why": "git is not installed"}, ""

    def git(*args: str) -> str:
        done = subprocess.run(
            [executable, "-C", str(root), *args], capture_output=True, text=True, timeout=20, check=True
        )
        return done.stdout

    try:
        commit = git("rev-parse", "HEAD").strip()
        status = git("status", "--porcelain", "--untracked-files=no")
        diff = git("diff", "HEAD") if status else ""
        # a fork's new files (docs/forking.md: src/trainkit/models/mine.py, conf/model/mine.yaml) are the run's code
        # too, untracked until committed; git's own ignores (.gitignore: __pycache__, outputs/) stay out
        listed = git("ls-files", "--others", "--exclude-standard", "-z", "--", *UNTRACKED_IN)
    except FileNotFoundError:
        return {"commit": None, "why": "git is not installed"}, ""
    except subprocess.CalledProcessError as error:
        why = (error.stderr.strip().splitlines() or ["git failed"])[0]
        return {"commit": None, "why": f"{root}: {why}"}, ""
    except subprocess.TimeoutExpired:
        return {"commit": None, "why": "git did not answer in 20 s"}, ""
    untracked = {path: (root / path).read_bytes() for path in sorted(filter(None, listed.split("\0")))}
    diff += "".join(_new_file(path, content) for path, content in untracked.items())
    state: dict = {"commit": commit, "dirty": bool(status or untracked)}
    if untracked:
        state["untracked"] = {path: hashlib.sha256(content).hexdigest() for path, content in untracked.items()}
    if diff:
        state |= {"diff": diff_name, "diff_sha256": hashlib.sha256(diff.encode()).hexdigest()}
    return state, diff


def _new_file(path: str, content: bytes) -> str:
    """An untracked file as git's diff of a new file (`git apply` recreates it); a binary one by its hash alone."""
    try:
        text = content.decode()
    except UnicodeDecodeError:
        return f"diff --git a/{path} b/{path}\nnew file mode 100644\nBinary files /dev/null and b/{path} differ\n"
    lines = text.splitlines(keepends=True)
    body = "".join(f"+{line}" for line in lines) + (
        "" if text.endswith("\n") or not text else "\n\\ No newline at end of file\n"
    )
    header = f"diff --git a/{path} b/{path}\nnew file mode 100644\n--- /dev/null\n+++ b/{path}\n"
    return header + (f"@@ -0,0 +1,{len(lines)} @@\n{body}" if lines else "")


def versions(root: Path | None = None) -> dict[str, str | None]:
    """Python's, torch's and each dependency's of pyproject.toml (None: not installed)."""
    root = ROOT if root is None else root
    specs: list[str] = []
    try:
        if tomllib is not None:
            specs = tomllib.loads((root / "pyproject.toml").read_text())["project"].get("dependencies", [])
        else:
            specs = importlib.metadata.requires("trainkit") or []
    except (OSError, KeyError, ValueError, importlib.metadata.PackageNotFoundError):
        pass  # a tree without its pyproject.toml (a renamed fork not installed): torch's alone
    names = ["torch", *(re.split(r"[\s<>=!~;\[]", spec, maxsplit=1)[0] for spec in specs)]
    found: dict[str, str | None] = {"python": platform.python_version()}
    for name in dict.fromkeys(names):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def parents(cfg: DictConfig) -> dict[str, dict]:
    """{key: {"from", "run_dir", "provenance"}} for each key of PARENT_KEYS the config sets: the parent's dir (a
    .pt file's dir) and its own record (None where it has none)."""
    found = {}
    for key in PARENT_KEYS:
        value = OmegaConf.select(cfg, key, default=None, throw_on_missing=False)
        if value is None:
            continue
        source = Path(str(value)).resolve()
        run_dir = source if source.is_dir() else source.parent
        found[key] = {"from": str(value), "run_dir": str(run_dir), "provenance": read(run_dir)}
    return found


def read(run_dir: Path) -> dict | None:
    """A run dir's record, None where it has none (a run made before provenance.json, or no run)."""
    try:
        return json.loads((Path(run_dir) / FILE).read_text())
    except (OSError, ValueError):
        return None


def _start(world_size: int, diff_name: str) -> tuple[dict, str]:
    """This process's part of a record: when, what command, what code, how many ranks."""
    git, diff = git_state(diff_name=diff_name)
    overrides = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else None
    entry = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "overrides": overrides,
        "world_size": world_size,
        "host": platform.node(),
        "git": git,
    }
    return entry, diff


def write(
    run_dir: Path, cfg: DictConfig, world_size: int, resumed_step: int | None = None, checkpoint: str | None = None
) -> dict:
    """Rank 0, before training (predict.py, eval.py: before writing): a fresh run's record, or the resumed run's
    record with this start appended (its step and checkpoint). A run resumed in a new dir from another run's
    checkpoint records where it came from (`resumed_from`: the checkpoint, its step, its run dir and that dir's
    record)."""
    earlier = read(run_dir) if resumed_step is not None else None
    entry, diff = _start(world_size, DIFF if earlier is None else f"provenance.step_{resumed_step}.diff")
    if earlier is not None:
        resume = {"step": resumed_step, "checkpoint": checkpoint, **entry}
        record = earlier | {"resumes": [*earlier.get("resumes", []), resume]}
    else:
        record = entry | {"versions": versions(), "parents": parents(cfg)}
    if earlier is None and resumed_step is not None:
        source = Path(str(checkpoint)).resolve().parent  # checkpoints/step_N.pt (FSDP: checkpoints/step_N/)
        source = source.parent if source.name == "checkpoints" else source
        found = {"checkpoint": checkpoint, "step": resumed_step, "run_dir": str(source), "provenance": read(source)}
        record["resumed_from"] = found
    if diff:
        _atomic(Path(run_dir) / entry["git"]["diff"], diff)
    _atomic(Path(run_dir) / FILE, json.dumps(record, indent=1) + "\n")
    return record


def brief(run_dir: Path) -> dict | None:
    """The record for W&B's config: the parents by their dirs (their own records stay in the file)."""
    record = read(run_dir)
    if record is None:
        return None
    return record | {"parents": {key: parent["run_dir"] for key, parent in record.get("parents", {}).items()}}


def _atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
