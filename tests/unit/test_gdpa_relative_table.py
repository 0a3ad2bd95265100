"""gemcompile::gdpa with ``relative_offset``: the bias read from a relative-position table (T,) or (T, Hz)
(lowering/gdpa/relative_table.py). The op against GDPA over the gathered dense bias (values and gradients,
the table's included), opcheck, gradcheck, the eager Function, and the errors on bad tables."""

import pytest
import torch

from gemcompile.lowering.gdpa.op import EagerGDPA, gdpa
from gemcompile.lowering.gdpa.relative_table import dense_relative_bias, toeplitz_view
from gemcompile.lowering.gdpa.spec import GdpaSpec

ops = torch.ops.gemcompile
B, H, L, D = 4, 2, 9, 16


def _case(seed=0, Lq=L, Lk=L, table_shape=(2 * L - 1,)):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Lq, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, H, Lk, D, generator=g, dtype=torch.float64) for _ in range(2))
    table = torch.randn(table_shape, generator=g, dtype=torch.float64)
    ql = torch.tensor([Lq, 0, 1, Lq // 2])  # full, empty, one row, half
    kl = torch.tensor([Lk, Lk // 3, 0, Lk])
    return q, k, v, ql, kl, table


def _grads(fn, inputs, g):
    inputs = [x.detach().requires_grad_(True) for x in inputs]
    out = fn(*inputs)
    return out, torch.autograd.grad(out, inputs, g)


CASES = {  # (Lq, Lk, table shape, offset, causal)
    "hstu_shared": (L, L, (2 * L - 1,), L - 1, True),
    "per_head": (L, L, (2 * L - 1, H), L - 1, True),
    "one_head_column": (L, L, (2 * L - 1, 1), L - 1, False),
    "long_table_rows_unread": (L, L, (2 * L + 6, H), L + 3, False),
    "rows_ne_cols": (5, 11, (20, H), 6, False),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("activation", ["silu", "relu_squared"])
def test_table_matches_the_gathered_dense_bias(case, activation):
    Lq, Lk, shape, offset, causal = CASES[case]
    q, k, v, ql, kl, table = _case(len(case), Lq, Lk, shape)
    args = (activation, 0.3, 1.0, True, causal, 0)
    g = torch.randn(B, H, Lq, D, dtype=torch.float64)
    out, grads = _grads(lambda q, k, v, t: gdpa(q, k, v, ql, kl, t, *args, relative_offset=offset),
                        (q, k, v, table), g)
    ref, ref_grads = _grads(lambda q, k, v, t: gdpa(q, k, v, ql, kl, dense_relative_bias(t, offset, Lq, Lk), *args),
                            (q, k, v, table), g)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for name, a, b in zip(("dq", "dk", "dv", "dtable"), grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=name)
    assert grads[3].shape == table.shape
    if case == "long_table_rows_unread":  # rows no pair reads: exactly 0
        lo, hi = offset - (Lq - 1), offset + Lk - 1
        assert (grads[3][:lo] == 0).all() and (grads[3][hi + 1:] == 0).all()


def test_opcheck_gradcheck_and_eager_function():
    q, k, v, ql, kl, table = _case(3, table_shape=(2 * L - 1, H))
    args = ("gelu_tanh", 0.3, 1.0, False, True, 0)
    qr, kr, vr, tr = (x.clone().requires_grad_(True) for x in (q, k, v, table))
    g = torch.randn(B, H, L, D, dtype=torch.float64)
    for op, op_args in (
        (ops.gdpa_fwd.default, (qr, kr, vr, ql, kl, tr, *args, None, 0, L - 1)),
        (ops.gdpa_bwd.default, (g, q, k, v, ql, kl, table, *args, True, None, 0, L - 1)),
        (ops.gdpa.default, (qr, kr, vr, ql, kl, tr, *args, None, 0, L - 1)),
    ):
        result = torch.library.opcheck(op, op_args)
        assert all(r == "SUCCESS" for r in result.values()), result
    small = [x[:2, :1, :5].detach().requires_grad_(True) for x in (q, k, v)] + [
        torch.randn(9, dtype=torch.float64, requires_grad=True)]
    assert torch.autograd.gradcheck(
        lambda q, k, v, t: gdpa(q, k, v, None, None, t, "silu", 0.4, 1.0, False, True, 0, relative_offset=4),
        small, fast_mode=True)
    out_fn, grads_fn = _grads(lambda q, k, v, t: EagerGDPA.apply(q, k, v, ql, kl, t,
                                                                 *GdpaSpec.from_schema(*args, None, 0, L - 1)),
                              (q, k, v, table), g)
    out_op, grads_op = _grads(lambda q, k, v, t: ops.gdpa_fwd(q, k, v, ql, kl, t, *args, None, 0, L - 1),
                              (q, k, v, table), g)
    torch.testing.assert_close(out_fn, out_op, rtol=0, atol=0)
    for a, b in zip(grads_fn, grads_op):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_hstu_targets_with_a_table():
    q, k, v, _, kl, table = _case(5)
    nt = torch.tensor([2, 1, 0, 3])
    kl = torch.tensor([L, 4, 0, L])
    args = ("silu", 0.3, 1.0 / L, False, True, 0)
    g = torch.randn(B, H, L, D, dtype=torch.float64)
    out, grads = _grads(lambda q, k, v, t: gdpa(q, k, v, kl, kl, t, *args, nt, 2, relative_offset=L - 1),
                        (q, k, v, table), g)
    ref, ref_grads = _grads(lambda q, k, v, t: gdpa(q, k, v, kl, kl, dense_relative_bias(t, L - 1, L, L), *args, nt, 2),
                            (q, k, v, table), g)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("table,offset,match", [
    (torch.randn(2 * L - 1, 2, 2), L - 1, r"shape \(T,\) or \(T, Hz\)"),  # 3-D
    (torch.randn(2 * L - 1, 3), L - 1, r"Hz with Hz 1 or the 2 heads|Hz\) with Hz"),  # 3 heads, H = 2
    (torch.randn(2 * L - 1), L - 2, r"span \[-1, 15\], outside a table of 17 rows"),  # wraps around
    (torch.randn(2 * L - 1), L, r"span \[1, 17\], outside"),  # past the end
    (torch.randint(0, 3, (2 * L - 1,)), L - 1, "floating point"),
    (torch.randn(2 * L - 1), 8.0, "relative_offset must be an int"),
    (torch.randn(2 * L - 1), True, "relative_offset must be an int"),
])
def test_bad_tables_raise_clear_errors(table, offset, match):
    q, k, v, ql, kl, _ = _case()
    with pytest.raises((ValueError, TypeError), match=match):
        gdpa(q.float(), k.float(), v.float(), ql, kl, table, "silu", 0.3, relative_offset=offset)


def test_toeplitz_view_reads_the_table_at_j_minus_i():
    """The strided view the kernels use, emulated with torch.as_strided on the positive-stride mirror."""
    table = torch.arange(2 * L - 1, dtype=torch.float32)[:, None] * 10 + torch.arange(H)[None, :]
    base, (sb, sh, sm, sn) = toeplitz_view(table, L - 1, B, H)
    assert sb == 0 and sm == -sn and sn == table.stride(0) and sh == table.stride(1)
    flat = base.reshape(-1)  # base starts at row L - 1
    for i, j, h in ((0, 0, 1), (3, 7, 0), (8, 0, 1), (0, 8, 0)):
        offset_elems = i * sm + j * sn + h * sh  # may be negative: before the base
        got = table.reshape(-1)[(L - 1) * table.stride(0) + offset_elems]
        assert got == table[j - i + L - 1, h]
    assert flat[0] == table[L - 1, 0]
