"""Bad input ends with a clear error naming the key, a non-zero exit code and no traceback."""

import pytest

from helpers import run_train


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides,message",
    [
        (["accumulation.steps=0"], "accumulation.steps=0 must be a positive integer"),
        (["data.batch_size=-4"], "data.batch_size=-4 must be a positive integer"),
        (
            ["accumulation.global_batch_size=100"],
            "accumulation.global_batch_size=100 is not a multiple of data.batch_size x world size = 32 x 1 = 32",
        ),
        (["trainer.precision=fp8"], "trainer.precision=fp8 is not one of: fp32, bf16, fp16"),
        (
            ["accumulation.strategy=sometimes"],
            "accumulation.strategy=sometimes is not one of: no_sync, sync_each_batch",
        ),
        (["data=mnist", "data.root=/nonexistent"], "data.root=/nonexistent holds no MNIST data"),
        (["parallel=ddp"], "parallel=ddp needs torchrun"),
        (["data.drop_last=true", "data.batch_size=1500"], "data.drop_last=true drops every sample"),
        (["trainer.max_steps=2.5"], "trainer.max_steps=2.5 must be null or a positive integer"),
        (["parallel.timeout_s=null"], "parallel.timeout_s=None must be a positive number"),
        (
            ["accumulation.global_batch_size=64.0"],
            "accumulation.global_batch_size=64.0 must be null or a positive integer",
        ),
        (["optim.lr=abc"], "optim.lr=abc must be a number >= 0"),
        (["optim.lr=-1"], "optim.lr=-1 must be a number >= 0"),
        (["sched.warmup_steps=abc"], "sched.warmup_steps=abc must be an integer >= 0"),
        (["parallel.comm_hook=int8"], "parallel.comm_hook=int8 is not one of: none, fp16, bf16"),
        (
            ["data.splits.val_fraction=1.0"],
            "data.splits.val_fraction=1.0 must be >= 0 and < 1 (1 leaves no training samples)",
        ),
    ],
)
def test_bad_setting_is_one_line_with_exit_2(tmp_path, overrides, message):
    proc = run_train(tmp_path, *overrides, check=False)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {message}")
    assert "Traceback" not in proc.stdout + proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    "group,options",
    [("model", ["cnn", "gpt", "mlp", "resnet18"]), ("data", ["addition", "cifar10", "digits", "fake", "mnist"])],
)
def test_unknown_choice_names_the_group_and_its_options(tmp_path, group, options):
    proc = run_train(tmp_path, f"{group}=nope", check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert f"Could not find '{group}/nope'" in proc.stderr
    listed = proc.stderr.split(f"Available options in '{group}':", 1)[1].split()
    assert listed[: len(options)] == options


@pytest.mark.slow
def test_explicit_single_under_torchrun_is_refused(tmp_path):
    proc = run_train(tmp_path, "parallel=single", nproc=2, check=False)
    assert proc.returncode != 0
    assert proc.stderr.count("error: parallel=single with world size 2 would train 2 independent replicas") == 1
