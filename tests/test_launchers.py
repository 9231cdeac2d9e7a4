"""Beyond one process per torchrun: submitit's launcher (the SLURM path, run locally; its preemption signal and
requeue) and multi-node torchrun (two agents meeting through a c10d rendezvous), end to end on digits."""

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from test_preemption import assert_resumed_exactly, stopped_at

from helpers import ROOT, _env, _free_port, rows, run_in_process, run_train

TINY = ("model.width=16", "model.depth=1", "data.batch_size=8", "trainer.max_steps=2")


def submitit_logs(sweep: Path, task: int, stream: str = "out") -> str:
    """What the tasks numbered `task` of every job printed (<sweep>/.submitit/<job id>/<job id>_<task>_log.out;
    stream="err": their stderr)."""
    return "".join(p.read_text() for p in sorted(sweep.glob(f".submitit/*/*_{task}_log.{stream}")))


def run_submitit(tmp: Path, *overrides: str) -> subprocess.CompletedProcess:
    # timeout_min: a stuck task is ended by submitit's controller, which outlives a killed launcher.
    return run_train(
        tmp / "unused",
        "-m",
        "hydra/launcher=submitit_local",
        "hydra.launcher.tasks_per_node=2",
        "hydra.launcher.timeout_min=10",
        "parallel.timeout_s=60",
        *overrides,
        timeout=900,
        check=False,
    )


@pytest.mark.slow
def test_a_submitit_sweep_runs_each_job_as_its_own_ddp_group_and_a_preempted_job_is_requeued_and_resumes(tmp_path):
    # parallel=auto picks ddp under submitit; the two jobs run at once, each on a port of its own.
    # The default ${run_stamp:} dir: each task composes its job's config anew, from the launching
    # process's resolved values, so the jobs land in the sweep dir that holds .submitit/.
    # +experiment=accumulation_sweep takes the world size from submitit (${world_size:}): the job
    # named K trains K micro-batches of 32 / (K x 2); K=3 does not divide: that job alone fails, in
    # one line, and the sweep's exit status says so.
    # Job 0 is preempted: each of its tasks gets submitit's signal (SIGUSR2, as SLURM's --signal and submitit's
    # local controller send it) at its 200th forward, in step 50 of 500: the stop comes at the ranks' next check,
    # at most a quarter second of training later (stop.PERIOD), well before step 500. trainkit checkpoints that
    # step, then calls submitit's handler: rank 0 requeues the job (locally: exit 144, the controller starts the
    # tasks again), which resumes in its job dir and ends as the uninterrupted run (tests/test_preemption.py).
    run = ("trainer.max_steps=500", "trainer.log_every=25", "trainer.eval_every=250", "checkpoint.every=0")
    job = ("+experiment=accumulation_sweep", "model.width=16", "model.depth=1", *run)
    model = ["model._target_=test_preemption.signalling_mlp", "+model.rank=null", "+model.at_forward=200"]
    model += [f"+model.signum={int(signal.SIGUSR2)}", f"+model.marker={tmp_path / 'signalled'}"]
    proc = run_submitit(tmp_path, f"hydra.sweep.dir={tmp_path}/${{run_stamp:}}", *job, "accumulation.steps=4,3", *model)
    [sweep] = [p.parent for p in tmp_path.glob("*/*/multirun.yaml")]
    assert sorted(p.name for p in sweep.parent.iterdir()) == [sweep.name]  # one stamp dir
    assert sorted(p.name for p in sweep.iterdir()) == [".submitit", "0", "1", "multirun.yaml"]  # a dir a job
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    overrides = " ".join(["accumulation.steps=3", "parallel.timeout_s=60", *job, *model])  # the swept key first
    assert [line for line in proc.stderr.splitlines() if line.startswith("error")] == [
        f"error: job 1 ({overrides}): data.batch_size: micro_batch: the global batch 32 is not a multiple of "
        "K x world size = 3 x 2"
    ]
    assert (sweep / "1" / "error.txt").is_file() and not (sweep / "1" / "model.pt").exists()
    train_rows = [r for r in rows(sweep / "0") if "loss" in r]
    assert train_rows[-1]["step"] == 500 and (sweep / "0" / "model.pt").is_file()
    assert all(r["comm/grad_syncs"] == 1.0 for r in train_rows)  # no_sync over K=4: one sync per step
    # Ranks and world size came from submitit's environment: rank 0 reports 2 ranks, rank 1 is quiet.
    assert "global batch 32 = 2 ranks x 4 micro-batch x 4 accumulation" in submitit_logs(sweep, 0)
    assert submitit_logs(sweep, 0).count("ddp x2") == 2  # once a round: preempted, requeued
    assert "trainkit |" not in submitit_logs(sweep, 1)

    logs = submitit_logs(sweep, 0) + submitit_logs(sweep, 0, "err")
    step = stopped_at(logs, "SIGUSR2")
    assert "Requeued job" in logs and f"resumed from {sweep / '0' / 'checkpoints' / f'step_{step:08d}.pt'}" in logs
    assert sorted(p.name for p in (sweep / "0" / "checkpoints").iterdir()) == [
        "best.pt",
        f"step_{step:08d}.pt",
        "step_00000500.pt",
    ]
    uninterrupted = tmp_path / "uninterrupted"
    run_in_process(uninterrupted, *job, "accumulation.steps=4", "parallel.timeout_s=60", nproc=2)
    assert_resumed_exactly(sweep / "0", uninterrupted, step)


@pytest.mark.slow
def test_two_torchrun_agents_train_as_two_nodes_into_one_run_dir(tmp_path):
    # The default ${run_stamp:} dir, agreed through the agents' shared store: each node composes it
    # apart (a run dir given in full needs no agreement; it is the same string on both).
    base = f"{tmp_path}/${{run_stamp:}}"
    port, rdzv_id = _free_port(), uuid.uuid4().hex
    cmd = [
        *(sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1"),
        *("--rdzv-backend=c10d", f"--rdzv-endpoint=localhost:{port}", f"--rdzv-id={rdzv_id}"),
        *(str(ROOT / "src/train.py"), f"hydra.run.dir={base}", "parallel=ddp", "parallel.timeout_s=60", *TINY),
    ]
    agents = [
        subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for _ in range(2)
    ]
    try:
        outputs = [agent.communicate(timeout=600)[0] for agent in agents]
    finally:
        for agent in agents:  # a hung agent and its worker: end the whole session
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()
    assert [a.returncode for a in agents] == [0, 0], "\n".join(outputs)
    run_dirs = [p.parent for p in tmp_path.rglob("metrics.jsonl")]
    assert len(run_dirs) == 1, run_dirs  # both nodes in one dir
    assert list(tmp_path.glob("*/*")) == run_dirs  # (rank 1 writes no metrics; nor does its Hydra make another)
    assert rows(run_dirs[0])[-1]["step"] == 2
    assert (run_dirs[0] / "model.pt").is_file()
    assert "ddp x2" in "".join(outputs)
