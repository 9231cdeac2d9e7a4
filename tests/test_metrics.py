"""W&B from rank 0: offline without credentials (never a prompt), the full nested config."""

import pytest

from helpers import rows, run_in_process, run_train
from trainkit.loggers import swept_keys, wandb_mode


@pytest.mark.parametrize(
    "env,netrc,expected",
    [
        ({}, None, "offline"),
        ({"WANDB_MODE": "disabled"}, None, "disabled"),
        ({"WANDB_API_KEY": "x" * 40}, None, "online"),
        ({}, "machine api.wandb.ai\n  login user\n  password secret\n", "online"),
        ({}, "machine example.com\n  login user\n  password secret\n", "offline"),
    ],
)
def test_wandb_mode(monkeypatch, tmp_path, env, netrc, expected):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    if netrc:
        (tmp_path / ".netrc").write_text(netrc)
        (tmp_path / ".netrc").chmod(0o600)
    assert wandb_mode() == expected


def _string_field(text: str) -> bytes:
    """A protobuf string as W&B's run record holds it: its varint length, then its bytes (so
    "trainer.max_steps=2" is not found inside the command line "trainer.max_steps=2,3")."""
    data, n, head = text.encode(), len(text.encode()), b""
    while n >= 0x80:
        head, n = head + bytes([n & 0x7F | 0x80]), n >> 7
    return head + bytes([n]) + data


@pytest.mark.slow
def test_a_sweep_gets_one_wandb_run_per_job_grouped_by_the_sweep_with_the_nested_config(tmp_path):
    sweep = tmp_path / "sweep"
    # Fixed overrides that sort before the swept key make the job's name longer than W&B's 64
    # characters for a job type: the job type is the swept key's value alone.
    fixed = ["accumulation.strategy=no_sync", "checkpoint.keep=2", "data.num_workers=0", "logger=wandb"]
    fixed += ["trainer.log_every=1"]
    run_train(tmp_path / "unused", "-m", f"hydra.sweep.dir={sweep}", *fixed, "trainer.max_steps=2,3")
    for job, steps in enumerate((2, 3)):
        runs = list((sweep / str(job) / "wandb").glob("offline-run-*"))
        assert len(runs) == 1  # its own run, finished before the next job's began
        data = next(runs[0].glob("*.wandb")).read_bytes()
        keys = (b"accumulation", b"global_batch_size", b"trainer", b"clip_grad_norm", b"val/acc", b"grad_norm")
        for key in (*keys, b"provenance", b"versions", b"hydra-core"):  # W&B's config has provenance.json's record
            assert key in data, key
        assert _string_field(str(sweep)) in data  # group: the sweep
        # name: the job's overrides (hydra.job.override_dirname); job type: what the sweep varies
        assert _string_field(",".join([*fixed, f"trainer.max_steps={steps}"])) in data
        assert _string_field(f"trainer.max_steps={steps}") in data
        assert _string_field(f"trainer.max_steps={5 - steps}") not in data


def test_swept_keys_are_the_sweep_overrides_and_the_sweepers_params(tmp_path):
    path = tmp_path / "multirun.yaml"
    path.write_text(
        "hydra:\n  overrides:\n    task: [optim.lr=0.1, 'trainer.max_steps=2,3', 'seed=range(3)', '+x=choice(1,2)']\n"
        "  sweeper:\n    params:\n      accumulation.steps: 1,2,4\n      model.width: '64'\n"
    )
    assert swept_keys(path) == {"trainer.max_steps", "seed", "x", "accumulation.steps"}
    assert swept_keys(tmp_path / "absent.yaml") == set()


@pytest.mark.slow
def test_tensorboard_holds_the_rows_and_the_config_and_a_resume_appends(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    overrides = ["logger=tensorboard", "trainer.max_steps=4", "trainer.log_every=1", "trainer.eval_every=2"]
    run_in_process(tmp_path, *overrides, "checkpoint.every=2")
    # As if the run died after logging step 4, before its checkpoint: the resume logs steps 3 and 4 again.
    (tmp_path / "checkpoints" / "step_00000004.pt").unlink()
    (tmp_path / "model.pt").unlink()
    run_in_process(tmp_path, *overrides, "checkpoint.every=2")
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 2  # one file per attempt, in the run dir
    events = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    logged = rows(tmp_path, test=True)
    assert [r["step"] for r in logged] == [1, 2, 3, 4, 4]  # the test row at the end, at the last step
    keys = (
        "loss",
        "lr",
        "grad_norm",
        "samples",
        "comm/grad_syncs",
        "epoch",
        "val/loss",
        "val/acc",
        "test/loss",
        "test/acc",
    )
    for key in keys:
        want = [(r["step"], pytest.approx(r[key], rel=1e-6)) for r in logged if key in r]
        assert [(s.step, s.value) for s in events.Scalars(key)] == want, key  # each step once: no stale rows
    configs = [e.tensor_proto.string_val[0].decode() for e in events.Tensors("config/text_summary")]
    assert len(configs) == 2 and all("max_steps: 4" in c and "name: tensorboard" in c for c in configs)


def test_a_wandb_run_is_continued_in_its_own_run_dir_and_store_only_and_a_branch_names_its_parent(
    tmp_path, monkeypatch, capsys
):
    """The checkpoint's W&B run (logger_run_id; its store: entity/project) continues in the run dir that wrote it,
    with the same entity; a checkpoint of another run dir (checkpoint.resume=<its path> in a new run dir) starts a
    new run whose config names the checkpoint's (branched_from)."""
    from helpers import compose_cfg
    from trainkit.loggers import make_logger

    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = compose_cfg("logger=wandb", "logger.entity=me")

    def checkpoint_of(run_dir: str, store: str = "me/trainkit") -> dict:
        path = str(tmp_path / run_dir / "checkpoints" / "step_00000004.pt")
        return {"path": path, "progress": {"step": 4}, "logger_run_id": "a1b2c3d4"} | {
            "logger_store": {"backend": "wandb", "store": store}
        }

    parent = {"run_id": "a1b2c3d4", "backend": "wandb", "store": "me/trainkit", "step": 4}
    moved = "logger: the checkpoint's run a1b2c3d4 is a wandb run in /trainkit: a new wandb run in me/trainkit"
    cases = [  # (run dir, the checkpoint it resumes, continued, what is said, what its config names)
        ("own", checkpoint_of("own"), True, [], None),
        ("user", checkpoint_of("user", "/trainkit"), False, [moved], None),  # of the user's default entity
        ("branch", checkpoint_of("own"), False, [], parent | {"checkpoint": checkpoint_of("own")["path"]}),
    ]
    for run_dir, resume, continued, said, branched_from in cases:
        (tmp_path / run_dir).mkdir()
        with make_logger(tmp_path / run_dir, cfg, True, resume) as logger:
            assert logger.run is not None and logger.run["store"] == "me/trainkit", run_dir  # the entity in it
            assert (logger.run["id"] == "a1b2c3d4") is continued, run_dir
            assert dict(logger.backends[-1].run.config).get("branched_from") == branched_from, run_dir
        assert capsys.readouterr().out.strip().splitlines() == said, run_dir
