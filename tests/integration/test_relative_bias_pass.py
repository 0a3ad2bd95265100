"""gemcompile::relative_bias and the relative_bias pass: Toeplitz gathers ``table[j - i + c]`` written the
ways modelers write them are rewritten, with eager's values and table gradients; clamped, bucketed or
out-of-range positions and data lookups are left alone (the arange-built ones with a reason)."""

import pytest
import torch
from torch._dynamo.utils import counters

from gemcompile import GemConfig, explain, gem_compile
from gemcompile.lowering.relative_bias.op import relative_bias, relative_bias_backward, relative_bias_reference

L = 9


# -- the op ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("table_rows,rows,cols,offset,rest", [
    (2 * L - 1, L, L, L - 1, ()),  # HSTU: every relative position, (L, L)
    (20, 5, 9, 6, (3,)),  # per-head tables (T, H), rows != cols
    (12, 6, 3, 5, (2, 2)),
    (7, 1, 1, 3, ()),  # one pair
    (30, 4, 4, 10, ()),  # a table longer than the positions read: untouched slots get 0
])
def test_op_values_and_gradient_against_the_gather(table_rows, rows, cols, offset, rest):
    table = torch.randn(table_rows, *rest, dtype=torch.float64, requires_grad=True)
    out = relative_bias(table, rows, cols, offset)
    ref = relative_bias_reference(table, rows, cols, offset)
    assert torch.equal(out, ref) and out.shape == (rows, cols, *rest)
    grad = torch.randn_like(out)
    (got,) = torch.autograd.grad(out, table, grad)
    (want,) = torch.autograd.grad(ref, table, grad)  # the gather's own backward (index_put, accumulate)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_op_opcheck_empty_and_bad_input():
    torch.library.opcheck(torch.ops.gemcompile.relative_bias.default, (torch.randn(9, requires_grad=True), 4, 5, 3))
    empty = relative_bias_backward(torch.randn(0, 5), 7, 0, 5, 3)
    assert torch.equal(empty, torch.zeros(7))
    with pytest.raises(ValueError, match="outside a table of 8 rows"):
        relative_bias(torch.randn(8), 5, 5, 2)  # position -2: a wrap-around the op refuses


def test_bf16_gradient_sums_in_fp32():
    table = torch.randn(2 * 64 - 1, dtype=torch.bfloat16, requires_grad=True)
    out = relative_bias(table, 64, 64, 63)
    grad = torch.randn_like(out)
    (got,) = torch.autograd.grad(out, table, grad)
    want = relative_bias_backward(grad.double(), 127, 64, 64, 63)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=1e-2)


# -- the pass -------------------------------------------------------------------------------------------

def hstu_rab(table, x):
    i = torch.arange(x.shape[-1])
    return x + table[i[None, :] - i[:, None] + x.shape[-1] - 1]


def t5_style_per_head(table, x):
    """(2L - 1, H) table -> (H, L, L) bias; keys minus queries with the offset written first."""
    q_pos = torch.arange(L)[:, None]
    k_pos = torch.arange(L)[None, :]
    rel = (L - 1) + k_pos - q_pos
    return x + table[rel].permute(2, 0, 1)


def aten_index_spelling(table, x):
    i = torch.arange(L)
    return x + torch.ops.aten.index.Tensor(table, [i.unsqueeze(0) - i.unsqueeze(1) + (L - 1)])


def near_miss_clamped(table, x):
    i = torch.arange(L)
    return x + table[(i[:, None] - i[None, :]).clamp(0, L - 1)]


def near_miss_transposed(table, x):
    """i - j + c: a Toeplitz index too, but mirrored (the op reads j - i): left alone, never misread."""
    i = torch.arange(L)
    return x + table[i[:, None] - i[None, :] + L - 1]


def near_miss_wraps(table, x):
    """j - i alone: negative positions wrap around to the table's end in eager."""
    i = torch.arange(L)
    return x + table[i[None, :] - i[:, None]]


def data_lookup(table, x):
    ids = (x.detach().abs() * 3).long().clamp(max=2 * L - 2)[0]  # (L, L) from data: an embedding-style gather
    return x + table[ids]


TABLES = {hstu_rab: (2 * L - 1,), t5_style_per_head: (2 * L - 1, 2), aten_index_spelling: (2 * L - 1,),
          near_miss_clamped: (L,), near_miss_transposed: (2 * L - 1,), near_miss_wraps: (L,),
          data_lookup: (2 * L - 1,)}
X_SHAPES = {t5_style_per_head: (2, L, L)}


def _inputs(fn, seed=0):
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(*TABLES[fn], generator=g, requires_grad=True)
    x = torch.randn(*X_SHAPES.get(fn, (3, L, L)), generator=g, requires_grad=True)
    return table, x


@pytest.mark.parametrize("fn,rewritten,reason", [
    (hstu_rab, True, None), (t5_style_per_head, True, None), (aten_index_spelling, True, None),
    (near_miss_clamped, False, "not a relative position"), (near_miss_transposed, False, "not j - i + constant"),
    (near_miss_wraps, False, "wrap around"), (data_lookup, False, None),
], ids=lambda v: getattr(v, "__name__", str(v)))
def test_pass_matches_eager_and_rewrites_only_proven_gathers(fn, rewritten, reason):
    table, x = _inputs(fn)
    report = explain(fn, table, x)
    rewrites = [r for r in report.rewrites if r.pass_name == "relative_bias"]
    refusals = [r for r in report.refusals if r.pass_name == "relative_bias"]
    assert len(rewrites) == int(rewritten)
    if reason is None:
        assert refusals == []  # data lookups are not candidates: no noise in explain
    else:
        assert len(refusals) == 1 and reason in refusals[0].reason, refusals
    counters.clear()
    compiled = gem_compile(fn, fullgraph=True)
    out = compiled(table, x)
    ref = fn(table, x)
    torch.testing.assert_close(out, ref)
    grad = torch.randn_like(ref)
    got = torch.autograd.grad(out, (table, x), grad)
    want = torch.autograd.grad(ref, (table, x), grad)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert counters["gemcompile"]["relative_bias"] == int(rewritten)


def test_disabled_pass_rewrites_nothing():
    table, x = _inputs(hstu_rab)
    report = explain(hstu_rab, table, x, config=GemConfig(relative_bias={"enabled": False}))
    assert not [r for r in report.rewrites if r.pass_name == "relative_bias"]


def test_an_absolute_position_embedding_lookup_is_not_a_candidate():
    """``weight[position_ids]`` with position_ids an arange over the batch (Whisper's and CodeGen's position
    embeddings) reads one position: no relative bias, and no refusal in explain's report."""
    class Positions(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.pos = torch.nn.Embedding(64, 16)

        def forward(self, x):
            position_ids = torch.arange(x.shape[1]).unsqueeze(0).repeat(x.shape[0], 1)
            return x + self.pos.weight[position_ids]

    report = explain(Positions(), torch.randn(4, 8, 16))
    assert report.counts["relative_bias"] == 0
    assert not [r for r in report.refusals if r.pass_name == "relative_bias"]
