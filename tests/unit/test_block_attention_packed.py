"""block_attention in the packed layout (token_offsets, max_len): q, k, v (T, H, D) strided views of one
(T, 3 * H * D) projection, against the float64 padded reference restricted to the valid rows (outputs,
lse and dq, dk, dv), through the Triton kernels under the interpreter (TRITON_INTERPRET=1, set by conftest)
and through the op's reference path on CPU; opcheck of the new signature; the errors it raises.

Lengths include 0 and L (and 1, odd). bfloat16 is left to the GPU tests (the interpreter's tl.dot on it is
wrong)."""

import os

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import gemcompile.lowering  # noqa: F401  (registers the ops)
from gemcompile.lowering.block_attention.reference import reference_backward, reference_forward

ops = torch.ops.gemcompile
TOL = {torch.float32: (2e-5, 5e-5), torch.float16: (3e-3, 8e-3), torch.float64: (1e-12, 1e-12)}


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def packed_case(B, H, L, D, dtype, rotary="none", seed=0, lengths=None, device="cpu"):
    """(packed q, k, v as views of one projection, lengths, offsets, cos, sin, where = (batch, position) of
    each packed row)."""
    g = torch.Generator().manual_seed(seed)
    if lengths is None:
        special = [L, 0, 1, (L // 3) | 1]
        lengths = torch.tensor([special[i] if i < 4 else int(torch.randint(0, L + 1, (1,), generator=g))
                                for i in range(B)])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    T = int(offsets[-1])
    projection = torch.randn(T, 3 * H * D, generator=g).to(device, dtype)
    q, k, v = (x.view(T, H, D) for x in projection.split(H * D, dim=1))  # strided views, read in place
    cos = sin = None
    if rotary != "none":
        theta = torch.rand(L, D, generator=g) * 6.3
        cos, sin = theta.cos().to(device, dtype), theta.sin().to(device, dtype)
    batch = torch.repeat_interleave(torch.arange(B), lengths)
    where = (batch.to(device), (torch.arange(T) - offsets[batch]).to(device))
    return q, k, v, lengths.to(device), offsets.to(device), cos, sin, where


def pad(x, where, B, L):
    """(T, H, D) -> (B, H, L, D) float64, zeros at padded rows."""
    out = x.new_zeros((B, L, *x.shape[1:]), dtype=torch.float64)
    out[where] = x.double()
    return out.transpose(1, 2)


def unpad(x, where):
    return x.transpose(1, 2)[where]


def padded_reference(q, k, v, lengths, cos, sin, where, L, block, window, causal, rotary, grad_out, scale=0.3):
    """The padded op in float64 on the padded tensors, restricted to the valid rows: (out, lse (T, H), dq,
    dk, dv). Padded rows of the upstream gradient are 0, as an exit scatter's backward gives them."""
    B = lengths.shape[0]
    qp, kp, vp, gp = (pad(x, where, B, L) for x in (q, k, v, grad_out))
    t64 = [None if t is None else t.double() for t in (cos, sin)]
    out, lse = reference_forward(qp, kp, vp, lengths, block, window, causal, *t64, rotary, scale)
    grads = reference_backward(gp, qp, kp, vp, out, lse, lengths, block, window, causal, *t64, rotary, scale)
    return (unpad(out, where), lse.transpose(1, 2)[where], *(unpad(g, where) for g in grads))


def compare(got, want, dtype, tol=None, lse_tol=4e-3):
    fwd_tol, bwd_tol = tol or TOL[dtype]
    out, lse, *grads = got
    ref_out, ref_lse, *ref_grads = want
    assert out.shape == ref_out.shape and out.dtype == dtype
    assert rel(out, ref_out) < fwd_tol, rel(out, ref_out)
    empty = torch.isposinf(ref_lse)
    assert torch.equal(torch.isposinf(lse), empty)
    torch.testing.assert_close(lse[~empty].double(), ref_lse[~empty], rtol=0, atol=lse_tol)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert g.shape == r.shape and g.dtype == dtype and not g.isnan().any(), name
        assert rel(g, r) < bwd_tol, (name, rel(g, r))


CASES = [  # block, window, causal, rotary, dtype, L (interpreter tiles: closed 32 rows, general 32x16)
    (16, -1, False, "none", torch.float32, 48),  # closed kernels, two blocks per tile
    (32, -1, True, "half", torch.float16, 45),  # closed, partial last tile
    (16, -1, True, "half", torch.float32, 40),
    (32, -1, False, "none", torch.float16, 64),
    (64, -1, True, "none", torch.float32, 70),  # general kernels (block larger than the tile)
    (0, 5, False, "half", torch.float16, 37),  # general kernels, window only
    (16, -1, True, "interleaved", torch.float32, 40, 16),  # rotary at D = 16: torch rotates the packed rows
    (0, 4, False, "half", torch.float16, 30, 16),
]
IDS = [f"block{c[0]}-w{c[1]}-{'causal' if c[2] else 'full'}-{c[3]}-{str(c[4])[6:]}" for c in CASES]


def check_packed_kernels(case, H=2):
    """The Triton launchers on packed rows (B 5) against the padded reference."""
    from gemcompile.lowering.block_attention.triton import (
        block_attention_backward_triton,
        block_attention_forward_triton,
    )

    block, window, causal, rotary, dtype, L, *head = case
    B, D = 5, (head or [32])[0]
    q, k, v, lengths, offsets, cos, sin, where = packed_case(B, H, L, D, dtype, rotary, seed=L + block)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    args = (lengths, block, window, causal, cos, sin, rotary, 0.3)
    packed = {"token_offsets": offsets.int(), "max_len": L}
    out, lse = block_attention_forward_triton(q, k, v, *args, **packed)
    grads = block_attention_backward_triton(grad_out, q, k, v, out, lse, *args, **packed)
    want = padded_reference(q, k, v, lengths, cos, sin, where, L, block, window, causal, rotary, grad_out)
    compare((out, lse, *grads), want, dtype)


@pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="interpreter test: runs on a machine without CUDA")
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_packed_kernels_match_padded(case):
    pytest.importorskip("triton")
    check_packed_kernels(case)


@pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="interpreter test: runs on a machine without CUDA")
@pytest.mark.parametrize("case", [CASES[1], CASES[2]], ids=[IDS[1], IDS[2]])
def test_packed_kernels_tiles_per_program(monkeypatch, case):
    """The closed kernels' TILES option on packed rows against the padded reference (a sequence's tiles
    past its length hold the next sequence's rows: the row masks keep them out)."""
    triton = pytest.importorskip("triton")
    from gemcompile.lowering.block_attention import triton as kernels

    for kernel in (kernels._closed_fwd_kernel, kernels._closed_bwd_kernel):
        monkeypatch.setattr(kernel, "configs", [triton.Config({"BLOCK": 32, "HEADS": 2, "TILES": 3},
                                                              num_warps=4, num_stages=1)])
    block, rotary, D = case[0], case[3], (case[6:] or [32])[0]
    assert kernels.closed_tile_serves(block, D, rotary)
    check_packed_kernels(case, H=3)


@pytest.mark.parametrize("block,window,causal,rotary,dtype", [
    (16, -1, True, "half", torch.float64),
    (32, -1, False, "none", torch.float32),
    (0, 3, True, "interleaved", torch.float64),
    (8, -1, False, "half", torch.float64),
])
def test_packed_op_matches_padded_on_reference_path(block, window, causal, rotary, dtype):
    """The public op on CPU (the reference path) with autograd: packed output and gradients equal the
    padded op's valid rows."""
    B, H, L, D = 6, 2, 24, 16
    q, k, v, lengths, offsets, cos, sin, where = packed_case(B, H, L, D, dtype, rotary, seed=block + 7)
    q, k, v = (x.detach().requires_grad_(True) for x in (q, k, v))
    out = ops.block_attention(q, k, v, lengths, block, window, causal, cos, sin, rotary, 0.3, None, None,
                              None, offsets, L)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    _, lse = ops.block_attention_fwd(q, k, v, lengths, block, window, causal, cos, sin, rotary, 0.3, None,
                                     None, None, offsets, L)
    want = padded_reference(q, k, v, lengths, cos, sin, where, L, block, window, causal, rotary, grad_out)
    compare((out, lse, *grads), want, dtype)


def test_packed_flops_equal_padded():
    """FLOP formulas count the same useful pairs in both layouts."""
    B, H, L, D = 4, 2, 20, 16
    q, k, v, lengths, offsets, _, _, where = packed_case(B, H, L, D, torch.float32, seed=3)
    qp, kp, vp = (pad(x, where, B, L).float() for x in (q, k, v))
    counts = []
    for args in ((qp, kp, vp, lengths, 8, -1, True, None, None, "none", 0.3),
                 (q, k, v, lengths, 8, -1, True, None, None, "none", 0.3, None, None, None, offsets, L)):
        x = [a.detach().requires_grad_(True) if i < 3 else a for i, a in enumerate(args)]
        with FlopCounterMode(display=False) as counter:
            ops.block_attention(*x).sum().backward()
        counts.append(counter.get_total_flops())
    assert counts[0] == counts[1] > 0


def test_opcheck_packed():
    B, H, L, D = 3, 2, 10, 8
    q, k, v, lengths, offsets, cos, sin, _ = packed_case(B, H, L, D, torch.float64, "half", seed=4,
                                                         lengths=torch.tensor([10, 0, 7]))
    q, k, v = (x.detach().requires_grad_(True) for x in (q, k, v))
    args = (q, k, v, lengths, 4, -1, True, cos, sin, "half", 0.3, None, None, None, offsets, L)
    for op in (ops.block_attention_fwd.default, ops.block_attention.default):
        result = torch.library.opcheck(op, args)
        assert all(r == "SUCCESS" for r in result.values()), result
    with torch.no_grad():
        out, lse = ops.block_attention_fwd(*args)
    result = torch.library.opcheck(ops.block_attention_bwd.default,
                                   (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse,
                                    *args[3:]))
    assert all(r == "SUCCESS" for r in result.values()), result


def _packed_args(**over):
    B, H, L, D = 2, 2, 8, 16
    q, k, v, lengths, offsets, _, _, _ = packed_case(B, H, L, D, torch.float32, seed=5,
                                                     lengths=torch.tensor([8, 3]))
    args = {"q": q, "k": k, "v": v, "lengths": lengths, "block": 4, "window": -1, "causal": False,
            "cos": None, "sin": None, "rotary": "none", "scale": 0.3, "kv_mask": None, "kv_bounds": None,
            "q_lengths": None, "token_offsets": offsets, "max_len": L}
    args.update(over)
    return tuple(args.values())


@pytest.mark.parametrize("over,match", [
    ({"token_offsets": torch.tensor([0, 8])}, "token_offsets must be 1-D of size B \\+ 1"),
    ({"token_offsets": torch.tensor([0, 8, 10])}, "token_offsets must be \\[0, cumsum"),
    ({"token_offsets": torch.tensor([0.0, 8.0, 11.0])}, "token_offsets must be an int32 or int64"),
    ({"kv_mask": torch.ones(2, 8, dtype=torch.bool)}, "kv_mask is not supported with token_offsets"),
    ({"q_lengths": torch.tensor([8, 3])}, "q_lengths must be None with token_offsets"),
    ({"max_len": 0}, "max_len \\(the padded length L\\) must be an int >= 1"),
    ({"lengths": torch.tensor([9, 2])}, "lengths\\[0\\] = 9 is outside"),
])
def test_packed_errors(over, match):
    with pytest.raises((ValueError, TypeError), match=match):
        ops.block_attention(*_packed_args(**over))


def test_max_len_without_offsets_is_refused():
    q = torch.randn(2, 2, 8, 16)
    with pytest.raises(ValueError, match="give it only with token_offsets"):
        ops.block_attention(q, q, q, torch.tensor([8, 3]), 4, -1, False, None, None, "none", 0.3, None, None,
                            None, None, 8)


def with_slack(q, k, v, extra, dtype, seed=11):
    """q, k, v with `extra` rows after the last sequence (a bucketed token index's slack rows): finite
    values that belong to no sequence."""
    g = torch.Generator().manual_seed(seed)
    T, H, D = q.shape
    tail = torch.randn(extra, 3 * H * D, generator=g).to(q.device, dtype)
    return tuple(torch.cat([x, t.view(extra, H, D)]) for x, t in zip((q, k, v), tail.split(H * D, dim=1)))


def check_slack(got, exact, T, dtype):
    """Rows < T equal the call without slack rows; rows >= T: output 0, lse +inf, gradients 0."""
    out, lse, *grads = got
    compare((out[:T], lse[:T], *(g[:T] for g in grads)), [x.double() for x in exact], dtype,
            tol=(1e-6, 1e-6) if dtype != torch.float16 else (1e-3, 1e-3), lse_tol=1e-6)
    assert torch.equal(out[T:], torch.zeros_like(out[T:]))
    assert torch.isposinf(lse[T:]).all()
    for g in grads:
        assert torch.equal(g[T:], torch.zeros_like(g[T:]))


SLACK_CASES = [CASES[0], CASES[4], CASES[6]]  # closed kernels, general kernels, torch-side rotary


@pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="interpreter test: runs on a machine without CUDA")
@pytest.mark.parametrize("extra", [1, 37])
@pytest.mark.parametrize("case", SLACK_CASES, ids=[IDS[CASES.index(c)] for c in SLACK_CASES])
def test_packed_kernels_slack_rows(case, extra, nan_empty):
    """Rows past token_offsets[B] (token buckets): the kernels give them zeros (lse +inf) and zero
    gradients, and the valid rows equal the call without them (outputs allocated empty hold NaN here)."""
    pytest.importorskip("triton")
    from gemcompile.lowering.block_attention.triton import (
        block_attention_backward_triton,
        block_attention_forward_triton,
    )

    block, window, causal, rotary, dtype, L, *head = case
    B, H, D = 5, 2, (head or [32])[0]
    q, k, v, lengths, offsets, cos, sin, _ = packed_case(B, H, L, D, dtype, rotary, seed=L + block + 1)
    T = q.shape[0]
    qs, ks, vs = with_slack(q, k, v, extra, dtype)
    grad_out = torch.randn(qs.shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    args = (lengths, block, window, causal, cos, sin, rotary, 0.3)
    packed = {"token_offsets": offsets.int(), "max_len": L}
    out, lse = block_attention_forward_triton(qs, ks, vs, *args, **packed)
    grads = block_attention_backward_triton(grad_out, qs, ks, vs, out, lse, *args, **packed)
    out0, lse0 = block_attention_forward_triton(q, k, v, *args, **packed)
    grads0 = block_attention_backward_triton(grad_out[:T], q, k, v, out0, lse0, *args, **packed)
    check_slack((out, lse, *grads), (out0, lse0, *grads0), T, dtype)


@pytest.mark.parametrize("extra", [1, 9])
@pytest.mark.parametrize("rotary", ["none", "half"])
def test_packed_op_slack_rows_on_reference_path(rotary, extra):
    """The public op on CPU with autograd and rows past token_offsets[B]: zeros there (output, lse,
    gradients), the valid rows as the padded float64 reference."""
    B, H, L, D = 5, 2, 24, 16
    dtype = torch.float64
    q, k, v, lengths, offsets, cos, sin, where = packed_case(B, H, L, D, dtype, rotary, seed=extra)
    T = q.shape[0]
    qs, ks, vs = (x.detach().requires_grad_(True) for x in with_slack(q, k, v, extra, dtype))
    call = (lengths, 8, -1, True, cos, sin, rotary, 0.3, None, None, None, offsets, L)
    out = ops.block_attention(qs, ks, vs, *call)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(4), dtype=dtype)
    grads = torch.autograd.grad(out, (qs, ks, vs), grad_out)
    _, lse = ops.block_attention_fwd(qs.detach(), ks.detach(), vs.detach(), *call)
    want = padded_reference(q, k, v, lengths, cos, sin, where, L, 8, -1, True, rotary, grad_out[:T])
    check_slack((out.detach(), lse, *grads), want, T, dtype)


def test_packed_offsets_past_the_rows_are_refused():
    """Offsets that end past q's rows (fewer rows than tokens) are an error, not a read past the end."""
    q, k, v, lengths, offsets, *_ = packed_case(2, 2, 8, 16, torch.float32, seed=5,
                                                lengths=torch.tensor([8, 3]))
    with pytest.raises(ValueError, match="ending at most at T = 10"):
        ops.block_attention(q[:10], k[:10], v[:10], lengths, 4, -1, False, None, None, "none", 0.3, None,
                            None, None, offsets, 8)
