"""gemcompile::token_mm on CUDA, bf16 at GEM-ref medium's token counts: against an fp64 matmul (within
bf16's rounding, the reduction split within one more), for token counts just past a bucket size, at one,
and under the split size."""

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

ops = torch.ops.gemcompile


def _rel_err(got, want):
    return ((got.double() - want).norm() / want.norm()).item()


@pytest.mark.parametrize("n", [0, 300, 4096, 65537, 250673, 277156])
@pytest.mark.parametrize("split_dim", [0, 1])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_matches_fp64(n, split_dim, with_bias):
    g = torch.Generator(device="cuda").manual_seed(n + split_dim)
    k, n_out = 512, 1024
    if split_dim == 0:
        a = torch.randn(n, k, device="cuda", generator=g).bfloat16()
        b = torch.randn(n_out, k, device="cuda", generator=g).bfloat16().t()
    else:
        a = torch.randn(n, k, device="cuda", generator=g).bfloat16().t()
        b = torch.randn(n, n_out, device="cuda", generator=g).bfloat16()
    bias = torch.randn(n_out, device="cuda", generator=g).bfloat16() if with_bias else None
    got = ops.token_mm(a, b, bias, split_dim, 16, 256)
    want = a.double() @ b.double() + (0 if bias is None else bias.double())
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    if n == 0 and split_dim == 1:
        assert torch.equal(got.double(), want)
        return
    if n:
        plain = (torch.mm(a, b) if bias is None else torch.addmm(bias, a, b))
        # no worse than one cuBLAS GEMM in bf16 (twice its error at most: the split adds one rounding)
        assert _rel_err(got, want) <= 2 * _rel_err(plain, want) + 1e-4
