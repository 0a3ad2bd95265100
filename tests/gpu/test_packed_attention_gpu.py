"""Packed operands (token_offsets, packed_len) of gemcompile::jagged_attention (packed keys/values, packed
self-attention) and gemcompile::gdpa (packed queries) on CUDA (the compiled Triton kernels): outputs and
gradients on the valid rows against the float64 reference on the padded tensors.

Run on the GPU machine:  python -m pytest -q tests/gpu/test_packed_attention_gpu.py
"""

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from kernel_checks import TOL, rel  # noqa: E402

import gemcompile.lowering  # noqa: E402,F401
from gemcompile.lowering.common.jagged import lengths_to_offsets  # noqa: E402

ops = torch.ops.gemcompile
DEV = "cuda"


def _layout(B, N, seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, N + 1, (B,), generator=g)
    lengths[0], lengths[1] = 0, N
    return lengths.to(DEV), lengths_to_offsets(lengths).to(DEV)


def _pad(x, lengths, offsets, N):
    """(T, H, D) -> (B, H, N, D) with torch indexing (the tests' own scatter)."""
    B = lengths.shape[0]
    rows = torch.arange(N, device=DEV)[None, :] < lengths[:, None]
    out = x.new_zeros(B, N, *x.shape[1:])
    out[rows] = x[: int(offsets[-1])]
    return out.transpose(1, 2)


def _leaf(x):
    return x.detach().clone().requires_grad_(True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("packed_q", [False, True], ids=["pma", "self_causal"])
def test_jagged_attention_packed(dtype, D, packed_q):
    B, H, N, Q = 6, 4, 1000, 16
    lengths, offsets = _layout(B, N, seed=D)
    T = int(offsets[-1])
    kv = torch.randn(T, 3 * H * D, device=DEV, dtype=dtype)
    k, v = kv[:, : H * D].view(T, H, D), kv[:, 2 * H * D:].view(T, H, D)  # a Linear output's views
    q = torch.randn(T, H, D, device=DEV, dtype=dtype) if packed_q else torch.randn(1, H, Q, D, device=DEV,
                                                                                   dtype=dtype).expand(B, H, Q, D)
    causal = packed_q
    args = [_leaf(t) for t in (q, k, v)]
    out = ops.jagged_attention(*args, None, lengths, None, causal, D ** -0.5, token_offsets=offsets, packed_len=N)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref = [_leaf((_pad(t, lengths, offsets, N) if (t.dim() == 3) else t).double()) for t in (q, k, v)]
    want = ops.jagged_attention(*ref, lengths if packed_q else None, lengths, None, causal, D ** -0.5)
    want.backward((_pad(grad, lengths, offsets, N) if packed_q else grad).double())
    fwd_tol, bwd_tol = TOL[dtype]
    got_out = _pad(out, lengths, offsets, N) if packed_q else out
    assert rel(got_out, want) < fwd_tol
    for got, r in zip(args, ref):
        g = _pad(got.grad, lengths, offsets, N) if got.dim() == 3 else got.grad
        assert rel(g, r.grad) < bwd_tol


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("D", [64, 128])
def test_gdpa_packed_queries(dtype, D):
    """GEM-ref's cross-attention: packed sequence queries over a few summary keys, gelu, out_scale 1/N."""
    B, H, N, S = 6, 4, 1000, 24
    lengths, offsets = _layout(B, N, seed=D + 1)
    T = int(offsets[-1])
    q = torch.randn(T, 2 * H * D, device=DEV, dtype=dtype)[:, H * D:].view(T, H, D)
    k = torch.randn(B, H, S, D, device=DEV, dtype=dtype)
    v = torch.randn(B, H, S, D, device=DEV, dtype=dtype)
    flags = ("gelu", D ** -0.5, 1.0 / N, False, False, 0)
    args = [_leaf(t) for t in (q, k, v)]
    out = ops.gdpa(*args, None, None, None, *flags, token_offsets=offsets, packed_len=N)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref = [_leaf(t.double()) for t in (_pad(q, lengths, offsets, N), k, v)]
    want = ops.gdpa(*ref, lengths, None, None, *flags)
    want.backward(_pad(grad, lengths, offsets, N).double())
    fwd_tol, bwd_tol = TOL[dtype]
    assert rel(_pad(out, lengths, offsets, N), want) < fwd_tol
    assert rel(_pad(args[0].grad, lengths, offsets, N), ref[0].grad) < bwd_tol
    assert rel(args[1].grad, ref[1].grad) < bwd_tol and rel(args[2].grad, ref[2].grad) < bwd_tol


@pytest.mark.parametrize("kv_mask", [False, True], ids=["lengths", "kv_mask"])
def test_jagged_attention_packed_rows_outside_every_sequence(kv_mask, nan_empty):
    """Outputs and gradients allocated empty (NaN here): rows before token_offsets[0] and after
    token_offsets[B] are 0 (lse +inf), key tiles a kv_mask skips get zero dK, dV, and the sequences' rows
    equal a run with offsets from 0 (packed self-attention, causal)."""
    from gemcompile.lowering.jagged_attention.packed_triton import (jagged_attention_backward_triton,
                                                                    jagged_attention_forward_triton)
    B, H, N, D, lead, slack = 6, 4, 700, 64, 5, 37
    lengths, offsets = _layout(B, N, seed=7)
    end = int(offsets[-1])
    g = torch.Generator(device=DEV).manual_seed(0)
    q, k, v = (torch.randn(end, H, D, device=DEV, dtype=torch.bfloat16, generator=g) for _ in range(3))
    mask = None
    if kv_mask:
        mask = torch.rand(B, N, device=DEV, generator=g) > 0.3
        mask[2] = False  # every key dropped: its tiles are skipped

    def shifted(t):
        return torch.cat([t.new_full((lead, *t.shape[1:]), 3.0), t, t.new_full((slack, *t.shape[1:]), 3.0)])
    qs, ks, vs = shifted(q), shifted(k), shifted(v)
    off_s = offsets + lead
    out, lse = jagged_attention_forward_triton(qs, ks, vs, None, None, None, True, D ** -0.5, mask,
                                               token_offsets=off_s, packed_len=N)
    want_out, want_lse = jagged_attention_forward_triton(q, k, v, None, None, None, True, D ** -0.5, mask,
                                                         token_offsets=offsets, packed_len=N)
    outside = torch.ones(out.shape[0], dtype=torch.bool, device=DEV)
    outside[lead:lead + end] = False
    assert (out[outside] == 0).all() and torch.isinf(lse[outside]).all()
    torch.testing.assert_close(out[lead:lead + end], want_out, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(lse[lead:lead + end], want_lse, rtol=1e-3, atol=1e-3)
    grad = torch.randn(out.shape, device=DEV, dtype=torch.bfloat16, generator=g)
    got = jagged_attention_backward_triton(grad, qs, ks, vs, out, lse, None, None, None, True, D ** -0.5, False,
                                           mask, token_offsets=off_s, packed_len=N)
    want = jagged_attention_backward_triton(grad[lead:lead + end].contiguous(), q, k, v, want_out, want_lse, None,
                                            None, None, True, D ** -0.5, False, mask, token_offsets=offsets,
                                            packed_len=N)
    for name, a, b in zip(("dq", "dk", "dv"), got[:3], want[:3]):
        assert (a[outside] == 0).all(), name
        torch.testing.assert_close(a[lead:lead + end], b, rtol=1e-2, atol=1e-2, msg=name)
    if kv_mask:
        rows = slice(lead + int(offsets[2]), lead + int(offsets[3]))
        assert (got[1][rows] == 0).all() and (got[2][rows] == 0).all()
