"""trainkit/loggers.py: a backend is one class and one yaml; logger=mlflow's run read back through MLflow's own
API, continued by a resume in its run dir (also from a checkpoint that names the run id the old way, wandb_run_id),
a new run that names its parent in a run dir branched from another run's checkpoint."""

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from helpers import rows, run_in_process
from trainkit import loggers


def test_the_checkpoint_key_is_neutral_and_the_old_one_still_reads():
    assert loggers.saved_run_id({"logger_run_id": "a", "wandb_run_id": "b"}) == "a"
    assert loggers.saved_run_id({"wandb_run_id": "b"}) == "b"  # a checkpoint written before the rename
    assert loggers.saved_run_id({}) is None


def _history(client, run_id: str, key: str) -> dict[int, float]:
    """{step: value} of one metric; where a step was logged twice (a resume's replayed rows), the later value."""
    logged = sorted(client.get_metric_history(run_id, key), key=lambda m: m.timestamp)
    return {m.step: m.value for m in logged}


@pytest.mark.slow
def test_mlflow_holds_the_rows_by_step_and_a_resume_continues_its_run(tmp_path, monkeypatch):
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)  # not the project's outputs/mlflow.db
    from mlflow.tracking import MlflowClient

    overrides = ["logger=mlflow", "trainer.max_steps=4", "trainer.log_every=1", "trainer.eval_every=2"]
    run_in_process(tmp_path, *overrides, "checkpoint.every=2")
    # As if the run died after logging step 4, before its checkpoint; its step-2 checkpoint written before the
    # key's rename (wandb_run_id): the resume logs steps 3 and 4 again, into the same MLflow run.
    (tmp_path / "checkpoints" / "step_00000004.pt").unlink()
    (tmp_path / "model.pt").unlink()
    path = tmp_path / "checkpoints" / "step_00000002.pt"
    state = torch.load(path, weights_only=True)
    state["wandb_run_id"] = state.pop("logger_run_id")
    assert state.pop("logger_store") == {"backend": "mlflow", "store": store}  # nor the store, kept since
    torch.save(state, path)
    run_in_process(tmp_path, *overrides, "checkpoint.every=2")

    client = MlflowClient(store)
    (run,) = client.search_runs([client.get_experiment_by_name("trainkit").experiment_id])  # one run, continued
    assert run.info.run_id == state["wandb_run_id"] and run.info.status == "FINISHED"
    logged = rows(tmp_path, test=True)
    keys = {key for row in logged for key in row} - {"step"}
    assert {"loss", "lr", "val/acc", "test/acc"} <= keys and keys == set(run.data.metrics)
    for key in keys:
        want = {row["step"]: pytest.approx(row[key], rel=1e-12) for row in logged if key in row}
        assert _history(client, run.info.run_id, key) == want, key
    assert run.data.params["trainer.max_steps"] == "4" and run.data.tags["model/params"] == "26122"
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {"config.yaml", "summary.json"}


def test_the_file_logger_s_rows_are_on_disk_after_each_log_call(tmp_path):
    """A run killed mid-way (SIGKILL, a lost node) keeps every row logged before: each log() reaches the file."""
    logger = loggers.FileLogger(tmp_path, OmegaConf.create({}), resume_step=None)
    for step in (1, 2):
        logger.log({"step": step, "loss": 0.5})
        assert rows(tmp_path) == [{"step": s, "loss": 0.5} for s in range(1, step + 1)]  # read by another handle
    logger.close(failed=False)


# --- logger=mlflow: one store for the project (a sqlite database), a resume continues only its own store's run ----


def _mlflow_jobs(rank: int, world_size: int, run_dirs: list[str], store: str) -> str:
    """Two sweep jobs at once (forked processes): each opens the store (the first creates it) and logs 20 rows."""
    import os

    os.environ["MLFLOW_TRACKING_URI"] = store
    from helpers import compose_cfg

    cfg = compose_cfg("logger=mlflow")
    with loggers.Loggers(Path(run_dirs[rank]), cfg, None, None) as logger:
        for step in range(1, 21):
            logger.log({"step": step, "loss": float(rank + step)})
        assert logger.run is not None
        return logger.run["id"]


@pytest.fixture(scope="module")
def mlflow_store(tmp_path_factory):
    """A sqlite store that two jobs created and wrote at once: (its URL, the two jobs' run dirs and run ids)."""
    from helpers import run_distributed

    root = tmp_path_factory.mktemp("mlflow")
    store = f"sqlite:///{root / 'outputs' / 'mlflow.db'}"
    run_dirs = [str(root / f"job{rank}") for rank in (0, 1)]
    for run_dir in run_dirs:
        Path(run_dir).mkdir()
    return store, run_dirs, run_distributed(_mlflow_jobs, 2, run_dirs, store, group=False)


def test_mlflow_s_store_is_one_sqlite_database_two_jobs_write_at_once_and_mlflow_reads_without_switches(
    mlflow_store, monkeypatch
):
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)  # what a user's own process has: no switch
    from mlflow.tracking import MlflowClient

    store, run_dirs, run_ids = mlflow_store
    client = MlflowClient(store)
    experiment = client.get_experiment_by_name("trainkit")
    assert {run.info.run_id for run in client.search_runs([experiment.experiment_id])} == set(run_ids)
    for rank, run_id in enumerate(run_ids):
        assert _history(client, run_id, "loss") == {step: float(rank + step) for step in range(1, 21)}
        assert not (Path(run_dirs[rank]) / "mlruns").exists()  # nothing in the run dir but metrics.jsonl
    assert experiment.artifact_location.startswith(Path(store.removeprefix("sqlite:///")).parent.as_uri())
    assert loggers.mlflow_store(Path("/x")).startswith("sqlite:////")  # the default: an absolute path


def test_a_resume_continues_its_mlflow_run_in_the_same_store_and_starts_a_new_one_elsewhere(
    mlflow_store, monkeypatch, tmp_path, capsys
):
    from helpers import compose_cfg

    store, _, (run_id, _) = mlflow_store
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    cfg = compose_cfg("logger=mlflow")
    own = {"path": str(tmp_path / "checkpoints" / "step_00000020.pt"), "progress": {"step": 20}}  # this run dir's
    same = own | {"logger_run_id": run_id, "logger_store": {"backend": "mlflow", "store": store}}
    elsewhere = same | {"logger_store": {"backend": "mlflow", "store": "sqlite:////elsewhere/mlflow.db"}}
    wandb = same | {"logger_run_id": "1a2b3c4d", "logger_store": {"backend": "wandb", "store": "me/trainkit"}}
    unknown = own | {"logger_run_id": "0" * 32}  # a checkpoint from before the store was kept
    for resume, continued in ((same, True), (elsewhere, False), (wandb, False), (unknown, False)):
        with loggers.make_logger(tmp_path, cfg, True, resume) as logger:
            assert logger.run is not None and (logger.run["id"] == resume["logger_run_id"]) is continued
            assert logger.run["store"] == store
        said = capsys.readouterr().out.strip().splitlines()
        if continued:
            assert said == []
        else:
            assert len(said) == 1 and said[0].startswith(f"logger: the checkpoint's run {resume['logger_run_id']} ")
            assert said[0].endswith(f"a new mlflow run in {store}")


# --- a run branched from another run's checkpoint (a new run dir): a new logger run that names its parent ---------


BRANCHED = ["logger=mlflow", "trainer.max_steps=8", "trainer.log_every=2", "checkpoint.every=4", "trainer.test=false"]


@pytest.fixture(scope="module")
def branched_runs(tmp_path_factory):
    """Run A (8 steps), then run B in a new dir from A's step-4 checkpoint with another lr, both into the default
    store (MLFLOW_TRACKING_URI unset), the command started in `project`: (project, A's dir, B's dir)."""
    root = tmp_path_factory.mktemp("branched")
    project, a, b = root / "project", root / "a", root / "b"
    project.mkdir()
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("MLFLOW_TRACKING_URI", raising=False)
        patch.chdir(project)  # Hydra's original cwd (HydraConfig is not set in process: the cwd)
        run_in_process(a, *BRANCHED)
        run_in_process(b, *BRANCHED, f"checkpoint.resume={a / 'checkpoints' / 'step_00000004.pt'}", "optim.lr=0.01")
    return project, a, b


def test_the_default_mlflow_store_is_outputs_mlflow_db_where_the_command_started_not_in_the_run_dir(branched_runs):
    project, a, b = branched_runs
    from mlflow.tracking import MlflowClient

    assert (project / "outputs" / "mlflow.db").is_file()
    store = f"sqlite:///{project / 'outputs' / 'mlflow.db'}"
    client = MlflowClient(store)
    assert len(client.search_runs([client.get_experiment_by_name("trainkit").experiment_id])) == 2  # A's and B's
    for run_dir in (a, b):
        saved = torch.load(run_dir / "checkpoints" / "step_00000008.pt", weights_only=True)
        assert saved["logger_store"] == {"backend": "mlflow", "store": store}
        assert not list(run_dir.rglob("mlflow.db*")) and not (run_dir / "outputs").exists()


def test_a_run_branched_from_another_run_s_checkpoint_is_a_new_mlflow_run_that_names_its_parent(branched_runs):
    project, a, b = branched_runs
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{project / 'outputs' / 'mlflow.db'}")
    ids = {d: torch.load(d / "checkpoints" / "step_00000008.pt", weights_only=True)["logger_run_id"] for d in (a, b)}
    parent, child = client.get_run(ids[a]), client.get_run(ids[b])
    assert ids[a] != ids[b] and parent.info.status == child.info.status == "FINISHED"
    for run, run_dir in ((parent, a), (child, b)):  # each run's rows once at their step, as its metrics.jsonl
        logged = [m.step for m in client.get_metric_history(run.info.run_id, "loss")]
        assert sorted(logged) == [row["step"] for row in rows(run_dir)], run_dir
    assert sorted(m.step for m in client.get_metric_history(ids[b], "loss")) == [6, 8]  # B's rows alone
    assert parent.data.params["optim.lr"] != "0.01" and child.data.params["optim.lr"] == "0.01"
    assert child.data.tags["branched_from.run_id"] == ids[a] and child.data.tags["branched_from.step"] == "4"


@pytest.mark.parametrize("uri", ["./mlruns", "file:///tmp/mlruns"])
def test_mlflow_tracking_uri_naming_a_file_store_is_one_line_exit_2_and_no_run_dir(uri, tmp_path, capsys, monkeypatch):
    """MLflow 3 refuses its file store (maintenance mode) with a traceback, after the run dir was written."""
    from test_config_errors import cli_in_process

    from helpers import compose_cfg

    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.chdir(tmp_path)  # ./mlruns: where it would be
    assert cli_in_process(["logger=mlflow"], tmp_path / "run", monkeypatch) == 2
    out, err = capsys.readouterr()
    assert err.strip().splitlines() == [
        f"error: MLFLOW_TRACKING_URI={uri} is MLflow's file store, which MLflow no longer keeps up (it refuses it "
        "without MLFLOW_ALLOW_FILE_STORE=true): set it to a database (sqlite:///<path>/mlflow.db) or unset it "
        "(logger=mlflow's store: outputs/mlflow.db)"
    ]
    assert "Traceback" not in out + err and not (tmp_path / "run").exists() and not (tmp_path / "mlruns").exists()
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow's own switch, the user's choice: accepted
    loggers.check(compose_cfg("logger=mlflow"))
