"""Fp32GemmOutPass on CUDA: an MLP of float32 parameters under bf16 autocast, compiled, has its weight
gradients written by float32 GEMMs, and its gradients match eager's.

Run on the GPU machine:  python -m pytest -q tests/gpu/test_fp32_gemm_out_gpu.py
"""

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from gemcompile import GemConfig, gem_compile
from gemcompile.passes.fp32_gemm_out import mm_dtype_supported


def _grads(fn, model, x):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = fn(x)
    out.float().square().mean().backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("enabled", [True, False])
def test_weight_gradients_of_an_autocast_mlp(enabled):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256, bias=False), nn.ReLU(),
                          nn.Linear(256, 64)).cuda()
    x = torch.randn(384, 256, device="cuda")
    counters["gemcompile"].clear()
    compiled = gem_compile(model, config=GemConfig(fp32_gemm_out={"enabled": enabled}))
    got = _grads(compiled, model, x)
    want = _grads(model, model, x)
    rewrites = counters["gemcompile"]["fp32_gemm_out"]
    assert rewrites == (1 if enabled and mm_dtype_supported() else 0)  # one record for the backward graph
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, w, atol=2e-3, rtol=2e-2)
