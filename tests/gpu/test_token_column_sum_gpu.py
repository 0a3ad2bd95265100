"""gemcompile::token_column_sum and TokenColumnSumPass on CUDA: the op against float64 sums at GEM-ref
medium's token counts (bf16 and float32), and a masked FFN compiled with gem_compile whose bias
gradients over packed tokens go through the op, with gradients equal to eager's (and to the pass off).

Run on the GPU machine:  python -m pytest -q tests/gpu/test_token_column_sum_gpu.py
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from gemcompile import GemConfig, gem_compile

ops = torch.ops.gemcompile


@pytest.mark.parametrize("T", [0, 1, 4095, 131072, 262145])
@pytest.mark.parametrize("N,dtype", [(512, torch.bfloat16), (2048, torch.bfloat16), (1000, torch.float32)])
def test_kernel_matches_float64(T, N, dtype):
    x = torch.randn(T, N, device="cuda", generator=torch.Generator(device="cuda").manual_seed(T)).to(dtype)
    got = ops.token_column_sum(x)
    want = x.double().sum(0)
    assert got.shape == (N,) and got.dtype == dtype
    # float32 accumulation rounded once: within the dtype's rounding of the exact sum
    tol = {"rtol": 2 ** -7, "atol": 1e-3} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-3}
    torch.testing.assert_close(got.double(), want, **tol)
    assert torch.equal(ops.token_column_sum(x), got)  # deterministic: no atomics


class MaskedFfn(nn.Module):
    """tests/gpu/test_unpad_gpu.py's model: the unpad pass packs it (its Linears run on packed tokens)."""

    def __init__(self, d_in=64, d=256):
        super().__init__()
        self.inp = nn.Linear(d_in, d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x, lengths):
        valid = (torch.arange(x.shape[1], device=x.device)[None, :] < lengths[:, None])[..., None]
        h = self.inp(x) * valid
        return (h + self.down(F.gelu(self.up(h))) * valid).sum(1)


def _grads(fn, model, x, t):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = fn(x, t)
    out.float().square().mean().backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("enabled", [True, False])
def test_bias_gradients_over_packed_tokens(enabled):
    torch.manual_seed(0)
    model = MaskedFfn().cuda()
    counters.clear()
    compiled = gem_compile(model, config=GemConfig(token_column_sums={"enabled": enabled}))
    for lengths in ([300] * 8, [0, 300, 1, 150, 299, 7, 0, 64], [0] * 8):
        x = torch.randn(8, 300, 64, device="cuda")
        t = torch.tensor(lengths, device="cuda")
        got = _grads(compiled, model, x, t)
        want = _grads(model, model, x, t)
        for g, w in zip(got, want, strict=True):
            error = (g.double() - w.double()).norm() / w.double().norm().clamp(min=1e-12)
            assert error < 2e-2, error
    seen = dict(counters["gemcompile"])
    assert seen.get("unpad", 0) >= 1, seen
    assert (seen.get("token_column_sums", 0) >= 1) is enabled, seen  # the backward's bias sums
