"""The Triton launchers of GDPA with packed queries (token_offsets, packed_len), run by the Triton interpreter
on CPU (TRITON_INTERPRET=1, set by conftest): on the valid rows they equal the float64 reference on padded
queries and the padded launchers, outputs and every gradient (the bias-gradient kernel and the relative
table included); rows outside every sequence are 0. float16/float32 only (the interpreter's tl.dot on
bfloat16 is wrong)."""

import os

import pytest
import torch

if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("interpreter tests: run on a machine without CUDA (conftest sets TRITON_INTERPRET=1)",
                allow_module_level=True)
pytest.importorskip("triton")

from gemcompile.lowering.common.jagged import lengths_to_offsets  # noqa: E402
from gemcompile.lowering.gdpa.reference import reference_gdpa_backward, reference_gdpa_forward  # noqa: E402
from gemcompile.lowering.gdpa.spec import GdpaSpec  # noqa: E402
from gemcompile.lowering.gdpa.triton import gdpa_backward_triton, gdpa_forward_triton  # noqa: E402

B, H, N, D, S = 4, 2, 37, 16, 20  # N spans several query tiles and a partial one
LENGTHS = [N, 0, 17, 1]
TOL = {torch.float32: 5e-5, torch.float16: 8e-3}  # relative-norm error against float64


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def pad(x, lengths, offsets):
    out = x.new_zeros(B, N, *x.shape[1:])
    for b in range(B):
        out[b, : lengths[b]] = x[offsets[b]: offsets[b + 1]]
    return out.transpose(1, 2)


CASES = {  # name -> (GdpaSpec fields, extras)
    "gem_cross": (dict(activation="gelu", scale=1.0, out_scale=1.0 / N), {}),
    "causal_window": (dict(activation="silu", scale=0.3, causal=True, window=6), {}),
    "kv_lengths_divide": (dict(activation="relu", scale=0.3, divide_by_kv_length=True), {"kv_lengths": True}),
    "kv_mask": (dict(activation="gelu_tanh", scale=0.3), {"kv_mask": True}),
    "full_bias_grad": (dict(activation="silu", scale=0.3), {"bias": (1, H, N, S)}),
    "row_bias_grad": (dict(activation="sigmoid", scale=0.3, causal=True), {"bias": (B, 1, 1, S)}),
    "relative_table": (dict(activation="silu", scale=0.3, causal=True, relative_offset=N - 1),
                       {"bias": (N + S - 1, H)}),
}


def _inputs(dtype, extras, seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(LENGTHS)
    offsets = lengths_to_offsets(lengths)
    T = int(offsets[-1]) + 3  # 3 rows outside every sequence
    q = torch.randn(T, 2 * H * D, generator=g).to(dtype)[:, H * D:].view(T, H, D)  # a Linear output's view
    k = torch.randn(B, H, S, D, generator=g).to(dtype)
    v = torch.randn(B, H, S, D, generator=g).to(dtype)
    kv_lengths = torch.tensor([S, 3, 0, 11]) if extras.get("kv_lengths") else None
    kv_mask = None
    if extras.get("kv_mask"):
        kv_mask = torch.rand(B, S, generator=g) > 0.4
        kv_mask[3] = False
    bias = (0.3 * torch.randn(extras["bias"], generator=g)).to(dtype) if "bias" in extras else None
    return lengths, offsets, T, q, k, v, kv_lengths, kv_mask, bias, g


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("name", list(CASES))
def test_packed_queries(dtype, name, nan_empty):  # empty allocations hold NaN: every row must be written
    fields, extras = CASES[name]
    lengths, offsets, T, q, k, v, kv_lengths, kv_mask, bias, g = _inputs(dtype, extras, seed=len(name))
    spec = GdpaSpec(**fields)
    out = gdpa_forward_triton(q, k, v, None, kv_lengths, bias, spec, None, kv_mask, token_offsets=offsets,
                              packed_len=N)
    qp = pad(q, lengths, offsets)
    d64 = [None if t is None else t.double() for t in (qp, k, v, bias)]
    ref = reference_gdpa_forward(*d64[:3], lengths, kv_lengths, d64[3], spec, None, kv_mask)
    assert out.shape == (T, H, D) and out.dtype == dtype and (out[-3:] == 0).all()
    assert rel(pad(out, lengths, offsets), ref) < TOL[dtype], rel(pad(out, lengths, offsets), ref)
    padded_out = gdpa_forward_triton(qp, k, v, lengths, kv_lengths, bias, spec, None, kv_mask)
    torch.testing.assert_close(pad(out, lengths, offsets), padded_out, rtol=1e-3, atol=1e-3)

    grad = torch.randn(out.shape, generator=g).to(dtype)
    bias_grad = bias is not None
    dq, dk, dv, dbias = gdpa_backward_triton(grad, q, k, v, None, kv_lengths, bias, spec, None, bias_grad, kv_mask,
                                             token_offsets=offsets, packed_len=N)
    want = reference_gdpa_backward(pad(grad, lengths, offsets).double(), *d64[:3], lengths, kv_lengths, d64[3],
                                   spec, None, bias_grad, kv_mask)
    assert dq.shape == (T, H, D) and (dq[-3:] == 0).all()
    for what, got, ref_grad in (("dq", pad(dq, lengths, offsets), want[0]), ("dk", dk, want[1]),
                                ("dv", dv, want[2])) + ((("dbias", dbias, want[3]),) if bias_grad else ()):
        assert not got.isnan().any(), what
        assert rel(got, ref_grad) < TOL[dtype], (what, rel(got, ref_grad))


def test_no_valid_query(nan_empty):
    offsets = torch.zeros(B + 1, dtype=torch.int64)
    q = torch.randn(2, H, D)
    k = torch.randn(B, H, S, D)
    spec = GdpaSpec(activation="gelu")
    out = gdpa_forward_triton(q, k, k, None, None, None, spec, token_offsets=offsets, packed_len=N)
    dq, dk, dv, _ = gdpa_backward_triton(torch.ones_like(out), q, k, k, None, None, None, spec,
                                         token_offsets=offsets, packed_len=N)
    assert (out == 0).all() and (dq == 0).all() and (dk == 0).all() and (dv == 0).all()


def test_rows_before_the_first_sequence_are_zero(nan_empty):
    """Offsets may start past row 0 (packed.py): those rows belong to no sequence, so their output and dq are 0
    (the launchers fill only the rows outside [token_offsets[0], token_offsets[B]), the kernels the rest)."""
    fields, extras = CASES["gem_cross"]
    lengths, offsets, T, q, k, v, _, _, _, g = _inputs(torch.float32, extras, seed=5)
    shifted = offsets + 2  # two rows ahead of the first sequence, one left after the last
    spec = GdpaSpec(**fields)
    out = gdpa_forward_triton(q, k, v, None, None, None, spec, token_offsets=shifted, packed_len=N)
    assert (out[:2] == 0).all() and (out[-1:] == 0).all()
    ref = reference_gdpa_forward(pad(q[2:], lengths, offsets).double(), k.double(), v.double(), lengths, None,
                                 None, spec)
    assert rel(pad(out[2:], lengths, offsets), ref) < TOL[torch.float32]
    dq, dk, dv, _ = gdpa_backward_triton(torch.randn(out.shape, generator=g), q, k, v, None, None, None, spec,
                                         token_offsets=shifted, packed_len=N)
    assert (dq[:2] == 0).all() and (dq[-1:] == 0).all() and not dq.isnan().any()
