"""The step's kernels: optim.fused (torch's fused optimizer kernel on CUDA) and trainer.tf32 (TF32 matrix products on
CUDA), each leaving what is computed as it was, to the optimizer's own rounding; both tested on the CPU."""

import pytest
import torch

from helpers import compose_cfg
from trainkit import optim
from trainkit.config import ConfigError, check
from trainkit.precision import use_tf32

CUDA = torch.device("cuda", 0)  # only its type is read: nothing here touches a GPU


def _steps(fused: bool, lr: float, steps: int = 5) -> list[torch.Tensor]:
    """AdamW (weight decay on) over a fixed model and fixed gradients: each step's update depends on the kernel
    alone, not on weights that earlier rounding moved (which AdamW would turn into lr-sized jumps where a
    gradient is near zero)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4))
    optimizer = optim.build(compose_cfg(f"optim.lr={lr}", f"optim.fused={str(fused).lower()}").optim, model)
    assert optimizer.defaults["fused"] is fused
    grads = [[torch.randn_like(p) * 10.0 ** -(i % 6) for p in model.parameters()] for i in range(steps)]
    for step_grads in grads:
        for p, g in zip(model.parameters(), step_grads, strict=True):
            p.grad = g.clone()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def test_fused_adamw_takes_the_steps_the_plain_one_takes_to_its_rounding():
    lr = 3e-3
    fused, plain = _steps(True, lr), _steps(False, lr)
    # Per step each update is about lr (m / sqrt(v) with bias correction): kernels that round its few float32
    # operations differently part by a few of its ulps (lr x 1e-6), and the new weight's own rounding by one of
    # the weight's (eps x |w|): 5 steps stay within 5 x both. (Seen here: 3e-8, one ulp of a weight of 0.25.)
    eps = torch.finfo(torch.float32).eps
    for a, b in zip(fused, plain, strict=True):
        assert torch.allclose(a, b, rtol=0, atol=5 * (eps * b.abs().max().item() + lr * 1e-6)), (a - b).abs().max()
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
