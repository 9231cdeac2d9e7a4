"""The step's kernels: optim.fused (torch's fused optimizer kernel on CUDA), optim.compile (the optimizer step
compiled), trainer.tf32 (TF32 matrix products on CUDA) and trainer.deterministic (deterministic kernels), each
leaving what is computed as it was, to the optimizer's own rounding; all tested on the CPU."""

import os

import pytest
import torch
from torch._dynamo.utils import counters

from helpers import compose_cfg, rows, run_distributed, run_in_process, weights
from trainkit import errors, optim
from trainkit.config import ConfigError, check
from trainkit.determinism import CUBLAS_WORKSPACE, use_deterministic
from trainkit.precision import use_tf32

CUDA = torch.device("cuda", 0)  # only its type is read: nothing here touches a GPU


def _steps(fused: bool | str, lr: float, steps: int = 5, *overrides: str, graphs: list | None = None) -> list:
    """AdamW (weight decay on) over a fixed model and fixed gradients, its lr moved by a schedule (LambdaLR, as
    runs do): each step's update depends on the kernel alone, not on weights that earlier rounding moved (which
    AdamW would turn into lr-sized jumps where a gradient is near zero). `graphs`: the count of graphs compiled
    after each step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4))
    optimizer = optim.build(compose_cfg(f"optim.lr={lr}", f"optim.fused={str(fused).lower()}", *overrides).optim, model)
    assert optimizer.defaults.get("fused") is (None if fused == "auto" else fused)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (1 + step))
    grads = [[torch.randn_like(p) * 10.0 ** -(i % 6) for p in model.parameters()] for i in range(steps)]
    for step_grads in grads:
        for p, g in zip(model.parameters(), step_grads, strict=True):
            p.grad = g.clone()
        optimizer.step()
        schedule.step()
        if graphs is not None:
            graphs.append(counters["stats"]["unique_graphs"])
    return [p.detach().clone() for p in model.parameters()]


def _within_adamws_rounding(a: list, b: list, lr: float, steps: int = 5, float32_step: bool = False) -> None:
    """Per step each update is about lr (m / sqrt(v) with bias correction): kernels that round its few float32
    operations differently part by a few of its ulps (lr x 1e-6), and the new weight's own rounding by one of the
    weight's (eps x |w|): `steps` steps stay within `steps` x both. float32_step: one side computes the bias
    corrections from a float32 step count (the compiled step, as torch's capturable path does) where the other
    uses Python's doubles: 1 - beta2^t then carries float32's rounding of beta2 (0.999) amplified by
    1 / (1 - beta2^t), up to eps / (1 - beta2) = 1.2e-4 of the update at t = 1, less later."""
    eps = torch.finfo(torch.float32).eps
    per_step = eps / (1 - 0.999) if float32_step else 1e-6  # AdamW's default betas (0.9, 0.999)
    for x, y in zip(a, b, strict=True):
        assert torch.allclose(x, y, rtol=0, atol=steps * (eps * y.abs().max().item() + lr * per_step)), (
            (x - y).abs().max()
        )


def test_fused_adamw_takes_the_steps_the_plain_one_takes_to_its_rounding():
    lr = 3e-3
    fused, plain = _steps(True, lr), _steps(False, lr)
    _within_adamws_rounding(fused, plain, lr)  # (seen here: 3e-8, one ulp of a weight of 0.25)
    assert any(not torch.equal(a, b) for a, b in zip(_steps(False, 2 * lr), plain, strict=True))  # lr is seen


def test_fused_auto_is_torchs_fused_kernel_on_cuda_and_its_own_choice_elsewhere():
    assert optim.fused_kernel(CUDA) is True
    assert optim.fused_kernel(torch.device("cpu")) is None
    model = torch.nn.Linear(3, 2)
    assert optim.build(compose_cfg().optim, model, device=torch.device("cpu")).defaults["fused"] is None
    assert optim.build(compose_cfg("optim=sgd").optim, model).defaults["fused"] is None
    with pytest.raises(ConfigError, match="^optim.fused=fast is not one of: auto, true, false$"):
        check(compose_cfg("optim.fused=fast"))


def test_tf32_is_set_for_cuda_only_and_both_ways():
    matmul, conv = torch.backends.cuda.matmul, torch.backends.cudnn.conv
    before = matmul.fp32_precision, conv.fp32_precision
    try:
        use_tf32(True, torch.device("cpu"))  # the CPU: nothing changes
        assert (matmul.fp32_precision, conv.fp32_precision) == before
        use_tf32(True, CUDA)
        assert (matmul.fp32_precision, conv.fp32_precision) == ("tf32", "tf32")
        use_tf32(False, CUDA)
        assert (matmul.fp32_precision, conv.fp32_precision) == ("ieee", "ieee")
    finally:
        matmul.fp32_precision, conv.fp32_precision = before
    assert compose_cfg().trainer.tf32 is True  # the default, as docs/config.md says


def _compiled_and_eager(rank: int, world_size: int, lr: float) -> dict:
    """In a forked process (the compiler's state and threads stay out of the test process, which later tests fork):
    AdamW's and Muon's (optim=muon: Linear(16, 32)'s weight on Muon's side) compiled and eager steps, and the graphs
    compiled after each compiled AdamW step."""
    graphs: list = []
    compiled = _steps("auto", lr, 5, "optim.compile=true", graphs=graphs)
    muon = _steps("auto", lr, 5, "optim=muon", "optim.compile=true"), _steps("auto", lr, 5, "optim=muon")
    return {"adamw": (compiled, _steps(False, lr)), "graphs": graphs, "muon": muon}


def test_the_compiled_step_takes_the_eager_steps_and_compiles_once_as_the_lr_moves():
    lr = 3e-3
    [ran] = run_distributed(_compiled_and_eager, 1, lr, group=False)
    (compiled, eager), graphs = ran["adamw"], ran["graphs"]
    _within_adamws_rounding(compiled, eager, lr, float32_step=True)  # (seen here: 1.4e-5 x lr)
    # optim=muon: Muon's side runs eager inside the compiled step (torch reads its lr as a number), bit-equal;
    # AdamW's side (the norm, the head) to its rounding
    (muon_compiled, muon_eager) = ran["muon"]
    assert torch.equal(muon_compiled[0], muon_eager[0])
    _within_adamws_rounding(muon_compiled[1:], muon_eager[1:], lr, float32_step=True)
    # The lr is a tensor the schedule fills in place: the first step compiles, the four lrs after it reuse it (a
    # float lr is a constant of the graph: each new value would compile again, up to dynamo's limit, then run eager)
    assert graphs[0] >= 1 and graphs == graphs[:1] * 5, graphs
    with pytest.raises(ConfigError, match="^optim.compile=true with optim.fused=true: the compiled step fuses"):
        check(compose_cfg("optim.compile=true", "optim.fused=true"))


def test_a_compiled_step_run_logs_the_steps_lr_and_resumes_bitwise(tmp_path):
    """The engine's side: LambdaLR over the compiled step, the rows' lr (read before the schedule fills the tensor
    in place), a checkpoint holding tensor lrs, a resume; against the eager run of the same config. SGD: the
    weights' differences stay the kernels' rounding (AdamW would turn rounding in a near-zero gradient into an
    lr-sized jump: its own step is compared above, on fixed gradients). The compiled runs in a forked rank."""
    run = ["optim=sgd", "trainer.max_steps=4", "trainer.log_every=1", "trainer.eval_every=100", "checkpoint.every=2"]
    run += ["sched=cosine", "sched.warmup_steps=2"]
    run_in_process(tmp_path / "eager", *run)
    run_in_process(tmp_path / "compiled", *run, "optim.compile=true", torchrun=True)
    eager, compiled = rows(tmp_path / "eager", timings=False), rows(tmp_path / "compiled", timings=False)
    assert [r["lr"] for r in compiled] == [r["lr"] for r in eager]  # float64 lrs: exactly the schedule's
    assert eager[1]["lr"] > eager[0]["lr"]  # the warmup moves it
    final, expected = weights(tmp_path / "compiled"), weights(tmp_path / "eager")
    eps = torch.finfo(torch.float32).eps
    for key, value in expected.items():  # a few ulps of the weights per step (seen here: equal)
        assert torch.allclose(final[key], value, rtol=0, atol=4 * 4 * eps * value.abs().max().item()), key
    resumed = tmp_path / "resumed"
    resume = f"checkpoint.resume={tmp_path / 'compiled' / 'checkpoints' / 'step_00000002.pt'}"
    run_in_process(resumed, *run, "optim.compile=true", resume, torchrun=True)
    for key, value in final.items():
        assert torch.equal(weights(resumed)[key], value), key
    assert rows(resumed, timings=False)[-1] == compiled[-1]


def test_the_deterministic_switch_sets_torchs_settings_and_false_puts_back_its_defaults(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    cudnn = torch.backends.cudnn
    try:
        use_deterministic(True)
        assert (
            torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()
        )
        assert (cudnn.deterministic, cudnn.benchmark) == (True, False)
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == CUBLAS_WORKSPACE == ":4096:8"
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # a user's own choice is kept
        use_deterministic(True)
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    finally:
        use_deterministic(False)
    assert not torch.are_deterministic_algorithms_enabled() and (cudnn.deterministic, cudnn.benchmark) == (False, False)
    assert compose_cfg().trainer.deterministic is False  # the default, as docs/config.md says


def test_an_operation_without_a_deterministic_kernel_is_one_line_naming_the_key(tmp_path, capfd):
    """A model whose forward uses Tensor.put_ (no deterministic kernel, on the CPU too): refused under
    trainer.deterministic=true as one line (exit 3), trained without it; and on the CPU the switch changes no
    number: the default job's weights are bit-equal with it on (torch.empty's NaN fill shows no read of them)."""
    from helpers import cli_in_process

    short = ["trainer.max_steps=3", "trainer.eval_every=100", "trainer.test=false"]
    refused = cli_in_process(
        capfd, tmp_path / "put", *short, "model._target_=helpers.put_mlp", "trainer.deterministic=true"
    )
    assert refused.returncode == 3, refused.stderr
    line = "error: trainer.deterministic=true: put_ has no deterministic kernel on this device (torch refuses it): "
    assert (
        refused.stderr.strip().splitlines()[-1]
        == line + "replace the operation, or run with trainer.deterministic=false"
    )
    assert cli_in_process(capfd, tmp_path / "put_free", *short, "model._target_=helpers.put_mlp").returncode == 0
    assert not torch.are_deterministic_algorithms_enabled()  # the next run (a sweep's job) starts from torch's defaults
    run_in_process(tmp_path / "plain", *short)
    run_in_process(tmp_path / "deterministic", *short, "trainer.deterministic=true")
    plain = weights(tmp_path / "plain")
    try:
        assert all(torch.equal(weights(tmp_path / "deterministic")[k], v) for k, v in plain.items())
    finally:
        use_deterministic(False)
    assert isinstance(errors.user_error(RuntimeError("boom")), type(None))  # other errors are not this one
