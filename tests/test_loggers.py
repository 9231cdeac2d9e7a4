"""trainkit/loggers.py: a backend is one class and one yaml; logger=mlflow's run read back through MLflow's own
API, continued by a resume (also from a checkpoint that names the run id the old way, wandb_run_id)."""

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
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # what the logger sets: MLflow 3's file store
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
    torch.save(state, path)
    run_in_process(tmp_path, *overrides, "checkpoint.every=2")

    client = MlflowClient((tmp_path / "mlruns").as_uri())
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
