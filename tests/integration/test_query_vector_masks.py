"""Query padding read from data: a mask that is a broadcast of a per-query (b, i) and a per-key (b, j)
vector (``valid[:, :, None] & valid[:, None, :]``, the pairwise spelling of a token mask) is rewritten to
jagged attention with a kv_mask and zeroed query rows (AttentionMask.query_vector). Compiled == eager for
outputs and every gradient wherever eager defines the rows (a safe softmax zeroes rows without a key;
SDPA's math gives NaN there, the kernels 0); near-misses stay refused with their reason."""

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from gemcompile import explain
from tests.compiled_vs_eager import assert_same_weighted_grads
from tests.rewritten import rewritten

B, L, H, D = 4, 12, 2, 16


def pairwise_safe_softmax(q, k, v, ids):
    """A token mask from item ids, in the pairwise form, -inf fill, rows without a key made 0 by nan_to_num."""
    valid = ids > 0
    keep = (valid[:, :, None] & valid[:, None, :])[:, None]
    s = (q @ k.transpose(-2, -1)) * D ** -0.5
    p = torch.softmax(s.masked_fill(~keep, float("-inf")), dim=-1).nan_to_num(0.0)
    return p @ v


def pairwise_causal_where_isnan(q, k, v, ids):
    """The same with causal and the where(isnan) spelling of a safe softmax."""
    valid = ids != 0
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    keep = valid.unsqueeze(1).unsqueeze(-1) & valid.unsqueeze(1).unsqueeze(2) & causal
    s = q @ k.transpose(-2, -1) / D ** 0.5
    p = torch.softmax(s.masked_fill(~keep, float("-inf")), dim=-1)
    p = torch.where(torch.isnan(p), torch.zeros_like(p), p)
    return p @ v


def pairwise_sdpa(q, k, v, ids):
    """SDPA with the pairwise bool mask: rows of padded queries see no key (NaN in eager's math, 0 here)."""
    valid = ids > 0
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(valid[:, None, :, None] & valid[:, None, None, :]))


def _ids(g, holes: bool):
    lengths = torch.randint(0, L + 1, (B,), generator=g)
    lengths[0], lengths[1] = L, 0
    ids = torch.randint(1, 50, (B, L), generator=g) * (torch.arange(L)[None, :] < lengths[:, None])
    if holes:
        ids = ids * (torch.rand(B, L, generator=g) > 0.25)
    return ids


@pytest.mark.parametrize("fn", [pairwise_safe_softmax, pairwise_causal_where_isnan, pairwise_sdpa],
                         ids=lambda f: f.__name__)
@pytest.mark.parametrize("holes", [False, True])
def test_pairwise_token_mask_is_rewritten_and_exact(fn, holes):
    g = torch.Generator().manual_seed(7 + holes)
    q, k, v = (torch.randn(B, H, L, D, generator=g, requires_grad=True) for _ in range(3))
    ids = _ids(g, holes)
    report = explain(fn, q, k, v, ids)
    assert report.counts["jagged_attention"] == 1, [r.reason for r in report.refusals]
    assert "queries where" in report.rewrites[0].detail and "keys where" in report.rewrites[0].detail
    counters.clear()
    out = rewritten(fn)(q, k, v, ids)
    assert counters["gemcompile"]["jagged_attention"] == 1
    ref = fn(q, k, v, ids)
    rows = (ids > 0)[:, None, :, None]
    if fn is pairwise_sdpa:  # eager's math backend gives NaN on rows without a key; the rewrite gives 0
        assert torch.all(out.masked_select(~rows.expand_as(out)) == 0)
        ref = torch.where(rows, ref, 0.0)
        out_cmp = torch.where(rows, out, 0.0)
    else:
        out_cmp = out
    torch.testing.assert_close(out_cmp, ref, atol=2e-5, rtol=1e-4)
    w = torch.randn(ref.shape, generator=g)
    grads = torch.autograd.grad((out_cmp * w).sum(), (q, k, v))
    grads_ref = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, atol=5e-5, rtol=1e-4)


def left_padded_pairwise(q, k, v, lengths):
    """Left padding from lengths (j >= L - lengths[b]) in the pairwise form, and the output rows zeroed: no
    query-length term says which rows are kept, so they are a query vector too."""
    valid = torch.arange(L)[None, :] >= L - lengths[:, None]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=(valid[:, :, None] & valid[:, None, :])[:, None])
    return out * valid[:, None, :, None]


def test_left_padding_from_lengths_in_the_pairwise_form_is_rewritten_and_exact():
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(B, H, L, D, generator=g, requires_grad=True) for _ in range(3))
    lengths = torch.tensor([L, 0, 5, 1])
    report = explain(left_padded_pairwise, q, k, v, lengths)
    assert report.counts["jagged_attention"] == 1, [r.reason for r in report.refusals]
    out = rewritten(left_padded_pairwise)(q, k, v, lengths)
    rows = (torch.arange(L)[None, :] >= L - lengths[:, None])[:, None, :, None]
    ref = torch.where(rows, left_padded_pairwise(q, k, v, lengths), 0.0)  # eager's math: NaN * 0 elsewhere
    assert torch.all(out.masked_select(~rows.expand_as(out)) == 0)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    assert_same_weighted_grads(out, ref, [q, k, v])


def test_changing_masks_do_not_recompile():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(B, H, L, D, generator=g) for _ in range(3))
    compiled = rewritten(pairwise_safe_softmax)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(5):
            ids = _ids(g, holes=True)
            torch.testing.assert_close(compiled(q, k, v, ids), pairwise_safe_softmax(q, k, v, ids), atol=2e-5,
                                       rtol=1e-4)


def filled_pairwise(q, k, v, ids):
    valid = ids > 0
    keep = (valid[:, :, None] & valid[:, None, :])[:, None]
    s = (q @ k.transpose(-2, -1)).masked_fill(~keep, -1e9)
    return s.softmax(-1) @ v


def test_a_fill_written_over_the_pairwise_mask_gives_dropped_rows_the_mean_of_v():
    """masked_fill(~pairwise, -1e9) (DeBERTa's spelling): every score of a dropped query row is the fill, so
    eager's row is the uniform average of every value and no gradient reaches q or k; the rewrite gives such
    rows the mean of v: equal to eager on every row and every gradient."""
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(B, H, L, D, generator=g, requires_grad=True) for _ in range(3))
    ids = _ids(g, holes=True)
    assert explain(filled_pairwise, q, k, v, ids).counts["jagged_attention"] == 1
    out, ref = rewritten(filled_pairwise)(q, k, v, ids), filled_pairwise(q, k, v, ids)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    assert_same_weighted_grads(out, ref, [q, k, v])


def test_near_misses_stay_refused():
    def finite_fill(q, k, v, ids):  # added: padded query rows' q and k get gradients in eager: refused
        valid = ids > 0
        keep = (valid[:, :, None] & valid[:, None, :])[:, None]
        s = (q @ k.transpose(-2, -1)) + (~keep).float() * -1e9
        return s.softmax(-1) @ v

    def query_or_key(q, k, v, ids):  # not a conjunction of vectors
        valid = ids > 0
        keep = (valid[:, :, None] | valid[:, None, :])[:, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)

    def per_head_query(q, k, v, ids):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=(ids > 0)[:, :, :, None] & (ids > 0)[:, :, None, :])

    q, k, v = (torch.randn(B, H, L, D) for _ in range(3))
    ids = _ids(torch.Generator().manual_seed(1), holes=False)
    for fn, arg, reason in ((finite_fill, ids, "query padding read from data"), (query_or_key, ids, "the mask is"),
                            (per_head_query, torch.randint(0, 3, (B, H, L)), "differs between heads")):
        report = explain(fn, q, k, v, arg)
        assert sum(report.counts.values()) == 0, fn.__name__
        assert report.refusals and reason in report.refusals[0].reason, (fn.__name__, report.refusals)
