"""provenance.json: where a run came from, one file in its run dir, written by rank 0 (atomically: a temp file
renamed) before training, beside .hydra/config.yaml. It holds the git commit of the source tree trainkit runs
from and whether the tree was dirty (git's own diff of its tracked files in provenance.diff next to it, byte-exact,
with the untracked files under src/ and conf/, a fork's new options, listed by hash and in the diff as new files:
a symlink as a symlink, a file above DIFF_MAX_BYTES by hash and size alone), the versions
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
import stat
import subprocess
import sys
import tempfile
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
DIFF_MAX_BYTES = 1 << 20  # an untracked file above it (data under src/, not code) is recorded by hash and size alone


def git_state(root: Path | None = None, diff_name: str = DIFF) -> tuple[dict, bytes]:
    """{"commit", "dirty", ...} of the tree at `root`, and git's own diff of its tracked files and of its untracked
    files under src/ and conf/ (b"" when clean: else the record names it as `diff_name`); without git, or outside a
    repository: {"commit": None, "why": ...}."""

    root = ROOT if root is None else root
    # git by its path: subprocess searches PATH for a bare name inside warnings.catch_warnings(), which resets
    # Python's once-per-place memory of warnings, so a user's warning would show again in every sweep job.
    executable = shutil.which("git")
    if executable is None:
        return {"commit": None, "why": "git is not installed"}, b""

    def git(*args: str, index: Path | None = None) -> bytes:
        # a copy of the index for _diff; literal pathspecs: a file named *.py is that file alone
        env = None if index is None else os.environ | {"GIT_INDEX_FILE": str(index), "GIT_LITERAL_PATHSPECS": "1"}
        command = [executable, "-C", str(root), *args]
        return subprocess.run(command, capture_output=True, timeout=20, check=True, env=env).stdout

    try:
        commit = git("rev-parse", "HEAD").decode().strip()
        status = git("status", "--porcelain", "--untracked-files=no")
        # a fork's new files (docs/forking.md: src/trainkit/models/mine.py, conf/model/mine.yaml) are the run's code
        # too, untracked until committed; git's own ignores (.gitignore: __pycache__, outputs/) stay out
        listed = git("ls-files", "--others", "--exclude-standard", "-z", "--", *UNTRACKED_IN)
        untracked, in_diff = _untracked(root, sorted(os.fsdecode(path) for path in listed.split(b"\0") if path))
        diff = _diff(git, root, in_diff) if status or in_diff else b""
    except FileNotFoundError:
        return {"commit": None, "why": "git is not installed"}, b""
    except subprocess.CalledProcessError as error:
        why = (error.stderr.decode(errors="replace").strip().splitlines() or ["git failed"])[0]
        return {"commit": None, "why": f"{root}: {why}"}, b""
    except subprocess.TimeoutExpired:
        return {"commit": None, "why": "git did not answer in 20 s"}, b""
    state: dict = {"commit": commit, "dirty": bool(status or untracked["untracked"])}
    state |= {key: found for key, found in untracked.items() if found}
    if diff:
        state |= {"diff": diff_name, "diff_sha256": hashlib.sha256(diff).hexdigest()}
    return state, diff


def _untracked(root: Path, paths: list[str]) -> tuple[dict[str, dict], list[str]]:
    """The untracked files by path — "untracked": their sha256 (a symlink's: of its target); "symlinks": their
    targets (dangling or a dir alike: git records the link, not what it points to); "untracked_large": the size of
    the files above DIFF_MAX_BYTES, recorded by hash and size alone — and the paths that go into the diff."""
    found: dict[str, dict] = {"untracked": {}, "symlinks": {}, "untracked_large": {}}
    in_diff = []
    for path in paths:
        file = root / path
        try:
            info = file.lstat()
            if stat.S_ISLNK(info.st_mode):
                found["symlinks"][path] = target = os.readlink(file)
                found["untracked"][path] = hashlib.sha256(os.fsencode(target)).hexdigest()
            elif stat.S_ISREG(info.st_mode):
                found["untracked"][path] = _sha256(file)
            else:
                continue  # a fifo or a socket: no content git could record
        except OSError:
            continue  # gone since git listed it
        if stat.S_ISREG(info.st_mode) and info.st_size > DIFF_MAX_BYTES:
            found["untracked_large"][path] = info.st_size
        else:
            in_diff.append(path)
    return found, in_diff


def _sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as stream:  # by chunks: a data file under src/ need not be held in memory
        for chunk in iter(lambda: stream.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


# --binary: every byte, for `git apply`; the rest pins the format against a user's git config (colour, an external
# diff, textconv filters, rename detection, other prefixes)
DIFF_COMMAND = (
    *("diff", "HEAD", "--binary", "--no-color", "--no-ext-diff", "--no-textconv", "--no-renames"),
    *("--src-prefix=a/", "--dst-prefix=b/"),
)


def _diff(git, root: Path, new_files: list[str]) -> bytes:
    """git's diff against HEAD, byte-exact (--binary: `git apply` recreates every byte, a symlink as a symlink), with
    the untracked `new_files` as new files: marked intent-to-add in a copy of the index, so the repository's own
    index stays as it was."""
    if not new_files:
        return git(*DIFF_COMMAND)
    with tempfile.TemporaryDirectory() as tmp:
        index = Path(tmp) / "index"
        own = root / os.fsdecode(git("rev-parse", "--git-path", "index").strip())  # a worktree's own, relative or not
        if own.exists():  # the tracked files: an index without them would diff them as deleted
            shutil.copyfile(own, index)
        git("add", "--intent-to-add", "--", *new_files, index=index)
        return git(*DIFF_COMMAND, index=index)


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


def _start(world_size: int, diff_name: str) -> tuple[dict, bytes]:
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


def _atomic(path: Path, content: str | bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(content if isinstance(content, bytes) else content.encode())
    os.replace(tmp, path)
