"""GDPA's kernels reading a relative-position table in place (a view with a negative row stride) and the
diagonal-sum kernel that turns the bias-gradient parts into the table's gradient, under the Triton
interpreter (TRITON_INTERPRET=1, set by conftest), against float64 references."""

import os

import pytest
import torch

if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip(
        "interpreter tests: run on a machine without CUDA (conftest sets TRITON_INTERPRET=1)",
        allow_module_level=True,
    )
triton = pytest.importorskip("triton")

from gemcompile.lowering.gdpa.diagonal_sums_triton import relative_table_grad_triton
from gemcompile.lowering.gdpa.reference import reference_gdpa_backward, reference_gdpa_forward
from gemcompile.lowering.gdpa.triton import gdpa_backward_triton, gdpa_forward_triton
from gemcompile.lowering.gdpa.spec import GdpaSpec

TOL = {torch.float32: (2e-5, 5e-5), torch.float16: (3e-3, 8e-3)}


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def diagonal_sums_reference(part):
    _, Z, Lq, Lk = part.shape
    out = torch.zeros(Z, Lq + Lk - 1, dtype=torch.float64)
    p = part.double().sum(0)
    for i in range(Lq):
        for j in range(Lk):
            out[:, j - i + Lq - 1] += p[:, i, j]
    return out


@pytest.mark.parametrize("S,Z,Lq,Lk", [
    (1, 1, 5, 7), (3, 2, 37, 20), (6, 1, 20, 45), (9, 3, 40, 40), (2, 1, 1, 1), (1, 1, 33, 1), (5, 1, 1, 33),
])
def test_diagonal_sums_against_loops(S, Z, Lq, Lk):
    # S = 6, 9: parts beyond a multiple of the kernel's 4-part unroll. A table of exactly the Lq + Lk - 1
    # diagonals, offset Lq - 1: its rows are the diagonal sums themselves
    part = torch.randn(S, Z, Lq, Lk, generator=torch.Generator().manual_seed(Lq * Lk))
    got = relative_table_grad_triton(part, torch.empty(Lq + Lk - 1, Z), Lq - 1)
    assert got.shape == (Lq + Lk - 1, Z) and got.dtype == torch.float32
    torch.testing.assert_close(got.double().t(), diagonal_sums_reference(part), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("table_shape,offset,dtype,Lq", [
    ((39,), 19, torch.float32, 20), ((50, 2), 25, torch.float16, 20), ((39, 1), 19, torch.float32, 20),
    ((99,), 79, torch.float32, 80),  # 5 row blocks: more than one load of the partials
])
def test_table_rows_from_parts(table_shape, offset, dtype, Lq):
    S, Lk = 3, 20
    Z = 1 if len(table_shape) == 1 else table_shape[1]
    part = torch.randn(S, Z, Lq, Lk, generator=torch.Generator().manual_seed(offset))
    got = relative_table_grad_triton(part, torch.empty(table_shape, dtype=dtype), offset)
    assert got.shape == table_shape and got.dtype == dtype
    want = torch.zeros(table_shape[0], Z, dtype=torch.float64)
    lo = offset - (Lq - 1)
    want[lo:lo + Lq + Lk - 1] = diagonal_sums_reference(part).t()
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.double().reshape(-1, Z), want, rtol=tol, atol=tol)
    assert (got.reshape(-1, Z)[:lo] == 0).all() and (got.reshape(-1, Z)[lo + Lq + Lk - 1:] == 0).all()


def test_diagonal_sums_refuses_non_fp32_and_handles_empty():
    with pytest.raises(ValueError, match="fp32"):
        relative_table_grad_triton(torch.randn(1, 1, 4, 4, dtype=torch.float64), torch.empty(7), 3)
    assert relative_table_grad_triton(torch.randn(0, 1, 4, 4), torch.empty(7), 3).equal(torch.zeros(7))


# (Lq, Lk, table shape, offset, causal, shared q)
CASES = {
    "hstu_shared_table": (40, 40, (79,), 39, True, False),
    "per_head_table": (40, 40, (79, 2), 39, True, False),
    "long_table_window": (33, 33, (80, 2), 40, False, False),
    "cross_rows_ne_cols": (21, 40, (70, 1), 25, False, False),
    "shared_queries": (9, 40, (60,), 12, False, True),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", list(CASES))
def test_kernels_read_the_table_in_place(case, dtype):
    Lq, Lk, shape, offset, causal, shared_q = CASES[case]
    B, H, D = 4, 2, 32
    g = torch.Generator().manual_seed(len(case))
    q = torch.randn(1 if shared_q else B, H, Lq, D, generator=g).to(dtype)
    k, v = (torch.randn(B, H, Lk, D, generator=g).to(dtype) for _ in range(2))
    table = (0.5 * torch.randn(shape, generator=g)).to(dtype)
    ql = None if shared_q else torch.tensor([Lq, 0, 1, Lq // 2 + 1])  # full, empty, one row, part
    kl = torch.tensor([Lk // 3 + 1, Lk, 0, Lk])
    window = 6 if case == "long_table_window" else 0
    args = ("silu", 0.25, 1.0, True, causal, window)
    out = gdpa_forward_triton(q, k, v, ql, kl, table, *GdpaSpec.from_schema(*args, None, 0, offset))
    d64 = [x.double() for x in (q, k, v, table)]
    ref = reference_gdpa_forward(*d64[:3], ql, kl, d64[3], *GdpaSpec.from_schema(*args, None, 0, offset))
    fwd_tol, bwd_tol = TOL[dtype]
    assert rel(out, ref) < fwd_tol, rel(out, ref)
    grad_out = torch.randn(out.shape, generator=g).to(dtype)
    got = gdpa_backward_triton(grad_out, q, k, v, ql, kl, table,
                               *GdpaSpec.from_bwd_schema(*args, True, None, 0, offset))
    want = reference_gdpa_backward(grad_out.double(), *d64[:3], ql, kl, d64[3],
                                   *GdpaSpec.from_bwd_schema(*args, True, None, 0, offset))
    for name, a, b, like in zip(("dq", "dk", "dv", "dtable"), got, want, (q, k, v, table)):
        assert a.shape == like.shape and a.dtype == like.dtype, name
        assert rel(a, b) < bwd_tol, (name, rel(a, b))
    lo, hi = offset - (Lq - 1), offset + Lk - 1  # rows no pair reads get exactly 0
    assert (got[3][:lo] == 0).all() and (got[3][hi + 1:] == 0).all()


def test_targets_and_no_bias_grad():
    B, H, L, D = 3, 2, 24, 16
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(B, H, L, D, generator=g) for _ in range(3))
    table = torch.randn(2 * L - 1, H, generator=g)
    n = torch.tensor([L, 10, 0])
    nt = torch.tensor([3, 2, 0])
    args = ("silu", 0.25, 1.0 / L, False, True, 0)
    out = gdpa_forward_triton(q, k, v, n, n, table, *GdpaSpec.from_schema(*args, nt, 2, L - 1))
    ref = reference_gdpa_forward(q.double(), k.double(), v.double(), n, n, table.double(),
                                 *GdpaSpec.from_schema(*args, nt, 2, L - 1))
    assert rel(out, ref) < 2e-5
    go = torch.randn(out.shape, generator=g)
    got = gdpa_backward_triton(go, q, k, v, n, n, table,
                               *GdpaSpec.from_bwd_schema(*args, False, nt, 2, L - 1))
    want = reference_gdpa_backward(go.double(), q.double(), k.double(), v.double(), n, n, table.double(),
                                   *GdpaSpec.from_bwd_schema(*args, False, nt, 2, L - 1))
    for a, b in zip(got[:3], want[:3]):
        assert rel(a, b) < 5e-5
    assert got[3].numel() == 0
