"""provenance.json (trainkit/provenance.py) of a tree with uncommitted changes, and of none: the end-to-end
chain of 2 runs and the run without git are in tests/test_distil.py."""

import hashlib
import json
import os
import shutil
import subprocess

import pytest

from helpers import run_in_process
from trainkit import provenance


def git(repo, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


@pytest.fixture
def repo(tmp_path):
    """A repository of one commit: src/tracked.py and a .gitignore of *.log."""
    repo = tmp_path / "repo"
    (repo / "src").mkdir(parents=True)
    git(repo, "init", "-q")
    (repo / "src" / "tracked.py").write_text("a = 1\n")
    (repo / ".gitignore").write_text("*.log\n")
    git(repo, "add", ".")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "first")
    return repo


def applied(repo, diff, tmp_path):
    """A fresh clone of the repository's commit with the diff put on it by `git apply`."""
    copy, patch = tmp_path / "copy", tmp_path / "patch.diff"
    git(tmp_path, "clone", "-q", str(repo), str(copy))
    patch.write_bytes(diff)
    git(copy, "apply", str(patch))
    return copy


def test_an_untracked_file_without_a_final_newline_is_recreated_exactly_by_git_apply(repo, tmp_path):
    (repo / "src" / "last.py").write_bytes(b"x = 1\ny = 2")
    _, diff = provenance.git_state(repo)
    assert (applied(repo, diff, tmp_path) / "src" / "last.py").read_bytes() == b"x = 1\ny = 2"


def test_odd_untracked_files_are_recreated_byte_for_byte_and_a_large_one_is_recorded_by_hash_and_size(repo, tmp_path):
    """Issue 58, 7: a dangling symlink or one to a dir crashed every run at start; a form feed or U+2028 (split
    there by str.splitlines) made a corrupt diff; a 37 MB CSV went into every run's diff."""
    odd = "a = 1\n\x0c\nb = '\u2028'\r\n".encode()  # a form feed, a line separator, a CRLF line
    files = {"src/odd.py": odd, "src/blob.bin": bytes(range(256)), "conf/empty.yaml": b""}
    for path, content in files.items():
        (repo / path).parent.mkdir(exist_ok=True)
        (repo / path).write_bytes(content)
    (repo / "src" / "dangling").symlink_to("nowhere")
    (repo / "conf" / "sources").symlink_to("../src", target_is_directory=True)
    big = provenance.DIFF_MAX_BYTES + 1
    (repo / "src" / "big.csv").write_bytes(b"1," * (big // 2) + b"\n")
    state, diff = provenance.git_state(repo)
    assert state["symlinks"] == {"src/dangling": "nowhere", "conf/sources": "../src"}
    assert state["untracked_large"] == {"src/big.csv": big}
    sha = {path: hashlib.sha256(content).hexdigest() for path, content in files.items()}
    sha |= {"src/big.csv": hashlib.sha256((repo / "src" / "big.csv").read_bytes()).hexdigest()}
    assert state["untracked"] == sha | {"src/dangling": hashlib.sha256(b"nowhere").hexdigest()} | {
        "conf/sources": hashlib.sha256(b"../src").hexdigest()
    }
    assert state["diff_sha256"] == hashlib.sha256(diff).hexdigest() and b"big.csv" not in diff
    copy = applied(repo, diff, tmp_path)
    assert all((copy / path).read_bytes() == content for path, content in files.items())
    assert os.readlink(copy / "src" / "dangling") == "nowhere" and os.readlink(copy / "conf" / "sources") == "../src"
    assert not (copy / "src" / "big.csv").exists()


def test_a_git_ignored_file_is_not_listed_as_untracked(repo):
    (repo / "src" / "train.log").write_text("step 1\n")  # *.log: ignored
    (repo / "src" / "new.py").write_text("b = 2\n")
    state, diff = provenance.git_state(repo)
    assert list(state["untracked"]) == ["src/new.py"] and b"train.log" not in diff


def test_a_dirty_tree_records_its_commit_and_the_diff_of_its_tracked_files(repo, tmp_path, monkeypatch):
    commit = git(repo, "rev-parse", "HEAD").strip()
    assert provenance.git_state(repo) == ({"commit": commit, "dirty": False}, b"")
    (repo / "src" / "tracked.py").write_text("a = 2\n")
    (repo / "untracked.py").write_text("ignored\n")  # not tracked, outside src/ and conf/: not in the diff
    state, diff = provenance.git_state(repo)
    assert state["dirty"] and state["diff"] == "provenance.diff" and b"+a = 2" in diff and b"untracked" not in diff
    monkeypatch.setattr(provenance, "ROOT", repo)  # a run from that tree writes the diff beside its record
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    record = provenance.write(run_dir, provenance.OmegaConf.create({}), world_size=3)
    assert json.loads((run_dir / "provenance.json").read_text()) == record and record["world_size"] == 3
    assert (run_dir / "provenance.diff").read_bytes() == diff and record["git"]["commit"] == commit


def test_outside_a_repository_the_record_says_so(tmp_path):
    state, diff = provenance.git_state(tmp_path)
    assert state["commit"] is None and "not a git repository" in state["why"] and diff == b""


def test_untracked_files_under_src_and_conf_make_the_tree_dirty_and_are_listed_with_their_content(repo, tmp_path):
    """A fork's new model (docs/forking.md's "Making it yours": src/trainkit/models/mine.py, conf/model/mine.yaml) is
    code the run uses that git does not track yet: the record lists it (its hash) and the diff holds it."""
    (repo / "src" / "trainkit" / "models").mkdir(parents=True)
    (repo / "src" / "trainkit" / "models" / "mine.py").write_text("def mine():\n    return 2\n")
    (repo / "conf" / "model").mkdir(parents=True)
    (repo / "conf" / "model" / "mine.yaml").write_text("_target_: trainkit.models.mine.mine\n")
    (repo / "notes.txt").write_text("not the run's code\n")  # outside src/ and conf/: not the run's
    state, diff = provenance.git_state(repo)
    assert state["dirty"] and set(state["untracked"]) == {"src/trainkit/models/mine.py", "conf/model/mine.yaml"}
    assert (
        state["untracked"]["conf/model/mine.yaml"]
        == hashlib.sha256(b"_target_: trainkit.models.mine.mine\n").hexdigest()
    )
    assert b"+++ b/src/trainkit/models/mine.py" in diff and b"+    return 2" in diff and b"notes" not in diff
    assert state["diff_sha256"] == hashlib.sha256(diff).hexdigest()
    assert git(repo, "status", "--porcelain") == "?? conf/\n?? notes.txt\n?? src/trainkit/\n"  # its index as it was
    copy = applied(repo, diff, tmp_path)
    assert (copy / "src" / "trainkit" / "models" / "mine.py").read_text() == "def mine():\n    return 2\n"


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """A run of 2 steps, a run resumed in a new dir from its checkpoint, a copy of the first resumed in its own dir,
    and predict.py and eval.py of the second."""
    root = tmp_path_factory.mktemp("chain")
    short = ("trainer.eval_every=100", "trainer.log_every=1", "model.width=16")
    run_in_process(root / "first", *short, "trainer.max_steps=2", "checkpoint.every=2")
    source = root / "first" / "checkpoints" / "step_00000002.pt"
    run_in_process(root / "second", *short, "trainer.max_steps=3", f"checkpoint.resume={source}")
    shutil.copytree(root / "first", root / "again")  # resumed in its own dir (checkpoint.resume=auto)
    run_in_process(root / "again", *short, "trainer.max_steps=3", "checkpoint.every=2")
    run_in_process(root / "predict", f"run_dir={root / 'second'}", script="predict")
    run_in_process(root / "eval", f"run_dir={root / 'second'}", script="eval")
    return root, source


def test_a_resume_from_another_run_s_checkpoint_records_its_source_and_step(chain):
    root, source = chain
    record = provenance.read(root / "second")
    assert record["resumed_from"]["checkpoint"] == str(source) and record["resumed_from"]["step"] == 2
    assert record["resumed_from"]["run_dir"] == str(root / "first")
    assert record["resumed_from"]["provenance"] == provenance.read(root / "first")  # the chain, traceable


def test_a_resume_in_its_own_dir_records_its_checkpoint_and_step_beside_its_start(chain):
    root, _ = chain
    record = provenance.read(root / "again")
    start = provenance.read(root / "first")
    assert {k: record[k] for k in start} == start and "resumed_from" not in record  # the start, kept as it was
    (resume,) = record["resumes"]
    assert resume["step"] == 2 and resume["checkpoint"] == str(root / "again" / "checkpoints" / "step_00000002.pt")
    assert resume["world_size"] == 1 and resume["git"]["commit"] == start["git"]["commit"]


@pytest.mark.parametrize("script", ["predict", "eval"])
def test_predict_and_eval_write_their_provenance_with_the_run_they_read(chain, script):
    root, _ = chain
    record = provenance.read(root / script)
    assert record is not None and record["world_size"] == 1 and "commit" in record["git"]
    assert record["parents"]["run_dir"]["run_dir"] == str(root / "second")
    assert record["parents"]["run_dir"]["provenance"] == provenance.read(root / "second")
