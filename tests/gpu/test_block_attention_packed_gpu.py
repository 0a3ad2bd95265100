"""gemcompile::block_attention's packed layout (token_offsets, max_len) on CUDA: the Triton kernels against
the float64 padded reference restricted to the valid rows (tests/unit/test_block_attention_packed.py does the
same under the interpreter), bfloat16 included, and the public op with autograd.

Run on the GPU machine:  python -m pytest -q tests/gpu/test_block_attention_packed_gpu.py
"""

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import gemcompile.lowering  # noqa: F401
from gemcompile.lowering.block_attention.triton import (
    block_attention_backward_triton,
    block_attention_forward_triton,
)
from tests.unit.test_block_attention_packed import TOL as CPU_TOL
from tests.unit.test_block_attention_packed import compare, packed_case, padded_reference

TOL = {**CPU_TOL, torch.bfloat16: (1.5e-2, 3e-2)}
CASES = [  # block, window, causal, rotary, dtype, L, D
    (64, -1, False, "half", torch.bfloat16, 300, 64),  # closed kernels
    (128, -1, True, "none", torch.bfloat16, 517, 128),  # general kernels (block larger than the tile)
    (32, -1, True, "half", torch.float16, 200, 64),
    (0, 31, False, "none", torch.float32, 150, 64),  # window only
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"block{c[0]}-w{c[1]}-{c[3]}-{str(c[4])[6:]}-L{c[5]}")
def test_packed_kernels_match_padded_reference(case):
    block, window, causal, rotary, dtype, L, D = case
    q, k, v, lengths, offsets, cos, sin, where = packed_case(9, 2, L, D, dtype, rotary, seed=L, device="cuda")
    grad_out = torch.randn(q.shape, device="cuda").to(dtype)
    args = (lengths, block, window, causal, cos, sin, rotary, 0.3)
    out, lse = block_attention_forward_triton(q, k, v, *args, token_offsets=offsets, max_len=L)
    grads = block_attention_backward_triton(grad_out, q, k, v, out, lse, *args, token_offsets=offsets,
                                            max_len=L)
    want = padded_reference(q, k, v, lengths, cos, sin, where, L, block, window, causal, rotary, grad_out)
    compare((out, lse, *grads), want, dtype, TOL[dtype], lse_tol=3e-2 if dtype == torch.bfloat16 else 4e-3)


def test_public_op_with_autograd_on_cuda():
    L = 96
    q, k, v, lengths, offsets, cos, sin, where = packed_case(6, 2, L, 64, torch.float16, "half", seed=1,
                                                             device="cuda")
    q, k, v = (x.detach().requires_grad_(True) for x in (q, k, v))
    out = torch.ops.gemcompile.block_attention(q, k, v, lengths, 32, -1, True, cos, sin, "half", 0.3, None,
                                               None, None, offsets, L)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    _, lse = torch.ops.gemcompile.block_attention_fwd(q, k, v, lengths, 32, -1, True, cos, sin, "half", 0.3,
                                                      None, None, None, offsets, L)
    want = padded_reference(q, k, v, lengths, cos, sin, where, L, 32, -1, True, "half", grad_out)
    compare((out, lse, *grads), want, torch.float16)


@pytest.mark.parametrize("extra", [1, 300])
def test_slack_rows_on_cuda(extra):
    """Rows past token_offsets[B] (token buckets), bfloat16: output 0, lse +inf, gradients 0 (the outputs
    are allocated empty and only the slack rows filled, slack_rows_triton.py); the other rows as without
    them."""
    from tests.unit.test_block_attention_packed import with_slack

    B, H, L, D, dtype = 7, 4, 256, 64, torch.bfloat16
    q, k, v, lengths, offsets, cos, sin, _ = packed_case(B, H, L, D, dtype, "half", seed=extra, device="cuda")
    T = q.shape[0]
    qs, ks, vs = (x.cuda() for x in with_slack(q.cpu(), k.cpu(), v.cpu(), extra, dtype))
    torch.cuda.empty_cache()
    grad_out = torch.randn(qs.shape, device="cuda", dtype=dtype)
    args = (lengths, 64, -1, True, cos, sin, "half", 0.3)
    packed = {"token_offsets": offsets, "max_len": L}
    junk = torch.full((4 * qs.numel(),), float("nan"), device="cuda", dtype=torch.float32)
    del junk  # its block goes back to the allocator: empty outputs now start as NaN, not fresh zeros
    out, lse = block_attention_forward_triton(qs, ks, vs, *args, **packed)
    grads = block_attention_backward_triton(grad_out, qs, ks, vs, out, lse, *args, **packed)
    out0, lse0 = block_attention_forward_triton(q, k, v, *args, **packed)
    grads0 = block_attention_backward_triton(grad_out[:T], q, k, v, out0, lse0, *args, **packed)
    assert torch.isposinf(lse[T:]).all() and (out[T:] == 0).all() and all((g[T:] == 0).all() for g in grads)
    for got, want in zip((out, lse, *grads), (out0, lse0, *grads0)):  # autotuning may pick other tiles
        torch.testing.assert_close(got[:T].float(), want.float(), rtol=2e-2, atol=2e-2)
