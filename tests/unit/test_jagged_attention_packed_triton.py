"""The Triton launchers of jagged attention with packed keys/values (packed_triton.py), run by the Triton
interpreter on CPU (TRITON_INTERPRET=1, set by conftest): on the valid rows they equal the padded launchers
on the padded tensors and the float64 reference, outputs and every gradient; rows outside every sequence
are 0. float16/float32 only (the interpreter's tl.dot on bfloat16 is wrong)."""

import os

import pytest
import torch

if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("interpreter tests: run on a machine without CUDA (conftest sets TRITON_INTERPRET=1)",
                allow_module_level=True)
pytest.importorskip("triton")

from gemcompile.lowering.common.jagged import lengths_to_offsets  # noqa: E402
from gemcompile.lowering.jagged_attention import triton as padded  # noqa: E402
from gemcompile.lowering.jagged_attention.packed_triton import (  # noqa: E402
    jagged_attention_backward_triton,
    jagged_attention_forward_triton,
)
from gemcompile.lowering.jagged_attention.reference import reference_backward, reference_forward  # noqa: E402
from tests.grids import pairwise  # noqa: E402

B, H, N, D, Q = 4, 2, 37, 16, 5  # N spans several tiles and a partial one
LENGTHS = [N, 0, 17, 1]
TOL = {torch.float32: 5e-5, torch.float16: 8e-3}  # relative-norm error against float64
SCALE = 0.3


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def pad(x, lengths, offsets, n=N):
    out = x.new_zeros(len(lengths), n, *x.shape[1:])
    for b in range(len(lengths)):
        out[b, : lengths[b]] = x[offsets[b]: offsets[b + 1]]
    return out.transpose(1, 2)


def case(dtype, seed, extra_rows=3):
    """lengths, offsets, packed k, v (views into one wider tensor: strides of a Linear output), T."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(LENGTHS)
    offsets = lengths_to_offsets(lengths)
    T = int(offsets[-1]) + extra_rows
    kv = torch.randn(T, 3 * H * D, generator=g).to(dtype)
    return lengths, offsets, kv[:, : H * D].view(T, H, D), kv[:, 2 * H * D:].view(T, H, D), T, g


def check(got, want64, dtype, what):
    assert not got.isnan().any(), what
    assert rel(got, want64) < TOL[dtype], (what, rel(got, want64))


@pytest.mark.parametrize("dtype,causal,extra", pairwise(
    {"fp32": torch.float32, "fp16": torch.float16}, {"full": False, "causal": True},
    {x: x for x in ("plain", "kv_mask", "bias_grad", "shared_q")}))
def test_packed_keys(dtype, causal, extra, nan_empty):  # empty allocations hold NaN: every row must be written
    lengths, offsets, k, v, T, g = case(dtype, seed=len(extra) + 2 * causal)
    q = torch.randn(1 if extra == "shared_q" else B, H, Q, D, generator=g).to(dtype)
    kv_mask = None
    if extra == "kv_mask":  # holes, left padding, an all-False row
        kv_mask = torch.rand(B, N, generator=g) > 0.4
        kv_mask[2, :5] = False
        kv_mask[3] = False
    bias = (0.5 * torch.randn(1, H, Q, N, generator=g)).to(dtype) if extra == "bias_grad" else None
    out, lse = jagged_attention_forward_triton(q, k, v, None, lengths, bias, causal, SCALE, kv_mask,
                                               token_offsets=offsets, packed_len=N)
    kp, vp = pad(k, lengths, offsets), pad(v, lengths, offsets)
    d64 = [None if t is None else t.double() for t in (q, kp, vp, bias)]
    ref_out, ref_lse = reference_forward(*d64[:3], None, lengths, d64[3], causal, SCALE, kv_mask)
    assert out.shape == (B, H, Q, D) and lse.shape == (B, H, Q)
    check(out, ref_out, dtype, "out")
    pad_out, _ = padded.jagged_attention_forward_triton(q, kp, vp, None, lengths, bias, causal, SCALE, kv_mask)
    torch.testing.assert_close(out, pad_out, rtol=1e-3, atol=1e-3)

    grad = torch.randn(out.shape, generator=g).to(dtype)
    dq, dk, dv, dbias = jagged_attention_backward_triton(grad, q, k, v, out, lse, None, lengths, bias, causal, SCALE,
                                                         bias is not None, kv_mask, token_offsets=offsets,
                                                         packed_len=N)
    ref = reference_backward(grad.double(), *d64[:3], ref_out, ref_lse, None, lengths, d64[3], causal, SCALE,
                             bias is not None, kv_mask)
    assert dq.shape == q.shape and dk.shape == dv.shape == (T, H, D)
    assert (dk[-3:] == 0).all() and (dv[-3:] == 0).all()  # rows outside every sequence
    check(dq, ref[0], dtype, "dq")
    check(pad(dk, lengths, offsets), ref[1], dtype, "dk")
    check(pad(dv, lengths, offsets), ref[2], dtype, "dv")
    if bias is not None:
        assert dbias.shape == bias.shape
        check(dbias, ref[3], dtype, "dbias")
    if kv_mask is not None:  # keys the mask drops get exactly zero gradients
        dropped = pad(dk, lengths, offsets).transpose(1, 2)[~kv_mask]
        assert (dropped == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_packed_self_attention(dtype, causal, nan_empty):
    lengths, offsets, k, v, T, g = case(dtype, seed=11 + causal)
    q = torch.randn(T, 2 * H * D, generator=g).to(dtype)[:, H * D:].view(T, H, D)  # strided rows
    out, lse = jagged_attention_forward_triton(q, k, v, None, None, None, causal, SCALE, token_offsets=offsets,
                                               packed_len=N)
    assert out.shape == (T, H, D) and lse.shape == (T, H) and (out[-3:] == 0).all()
    qp, kp, vp = (pad(t, lengths, offsets).double() for t in (q, k, v))
    ref_out, ref_lse = reference_forward(qp, kp, vp, lengths, lengths, None, causal, SCALE)
    check(pad(out, lengths, offsets), ref_out, dtype, "out")
    grad = torch.randn(out.shape, generator=g).to(dtype)
    dq, dk, dv, _ = jagged_attention_backward_triton(grad, q, k, v, out, lse, None, None, None, causal, SCALE, False,
                                                     token_offsets=offsets, packed_len=N)
    ref = reference_backward(pad(grad, lengths, offsets).double(), qp, kp, vp, ref_out, ref_lse, lengths, lengths,
                             None, causal, SCALE, False)
    for name, got, want in (("dq", dq, ref[0]), ("dk", dk, ref[1]), ("dv", dv, ref[2])):
        assert got.shape == (T, H, D) and (got[-3:] == 0).all(), name
        check(pad(got, lengths, offsets), want, dtype, name)


@pytest.mark.parametrize("kv_mask", [False, True], ids=["lengths", "kv_mask"])
def test_rows_outside_every_sequence_are_zero(kv_mask, nan_empty):
    """Offsets that start past row 0 and end before the last row: those rows belong to no sequence, so the
    output, dq, dk and dv are 0 there (lse +inf), and the rows of every sequence equal the offsets-from-0 run."""
    lengths, offsets, k, v, T, g = case(torch.float32, seed=3)
    q = torch.randn(T, H, D, generator=g)
    mask = None
    if kv_mask:  # a sequence whose keys are all dropped: its key tiles are skipped
        mask = torch.rand(B, N, generator=g) > 0.3
        mask[3] = False
    lead = 2
    shifted = offsets + lead  # rows 0, 1 before the first sequence; one slack row left at the end
    qs, ks, vs = (torch.cat([t.new_full((lead, H, D), 7.0), t[:-lead]]) for t in (q, k, v))
    out, lse = jagged_attention_forward_triton(qs, ks, vs, None, None, None, False, SCALE, mask,
                                               token_offsets=shifted, packed_len=N)
    want_out, want_lse = jagged_attention_forward_triton(q, k, v, None, None, None, False, SCALE, mask,
                                                         token_offsets=offsets, packed_len=N)
    end = int(offsets[-1])
    assert (out[:lead] == 0).all() and (out[lead + end:] == 0).all() and torch.isinf(lse[:lead]).all()
    torch.testing.assert_close(out[lead:lead + end], want_out[:end])
    grad = torch.randn(out.shape, generator=g)
    got = jagged_attention_backward_triton(grad, qs, ks, vs, out, lse, None, None, None, False, SCALE, False, mask,
                                           token_offsets=shifted, packed_len=N)
    want = jagged_attention_backward_triton(torch.cat([grad[lead:], grad[:lead]]), q, k, v, want_out, want_lse,
                                            None, None, None, False, SCALE, False, mask, token_offsets=offsets,
                                            packed_len=N)
    for name, a, b in zip(("dq", "dk", "dv"), got[:3], want[:3]):
        assert (a[:lead] == 0).all() and (a[lead + end:] == 0).all(), name
        torch.testing.assert_close(a[lead:lead + end], b[:end], msg=name)
    if kv_mask:  # the all-dropped sequence's keys: exactly zero gradients (a skipped tile stores zeros)
        rows = slice(lead + int(offsets[3]), lead + int(offsets[4]))
        assert (got[1][rows] == 0).all() and (got[2][rows] == 0).all()


def test_empty_batch_and_zero_packed_len():
    offsets = torch.zeros(3, dtype=torch.int64)
    k = torch.randn(0, H, D)
    q = torch.randn(2, H, Q, D)
    out, lse = jagged_attention_forward_triton(q, k, k, None, None, None, False, SCALE, token_offsets=offsets,
                                               packed_len=0)
    assert (out == 0).all() and torch.isinf(lse).all()
    dq, dk, dv, _ = jagged_attention_backward_triton(torch.ones_like(out), q, k, k, out, lse, None, None, None, False,
                                                     SCALE, False, token_offsets=offsets, packed_len=0)
    assert (dq == 0).all() and dk.shape == (0, H, D) and dv.shape == (0, H, D)
