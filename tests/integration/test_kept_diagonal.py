"""Masks that keep the diagonal besides the key padding (``valid[b, j] or i == j``: FuxiCTR's BST, XLNet's
content stream): rewritten into gemcompile::jagged_attention_lse plus the merge of each padded row's own key
(attention/kept_diagonal.py); compiled == eager on every row (padded rows and empty sequences included, where
eager attends to the row itself), outputs and every gradient. Near misses keep eager with the reason. BST
itself is in the real-model zoo (tests/integration/test_real_model_masks.py)."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from gemcompile import explain
from tests.compiled_vs_eager import assert_same_weighted_grads
from tests.rewritten import rewritten

B, L, H, D = 3, 7, 2, 16
E = H * D


class KeptDiagonal(nn.Module):
    """Self-attention over ``valid[b, j] or i == j`` (and causal), SDPA or a hand-written fill."""

    def __init__(self, spelling: str = "sdpa", causal: bool = False, bias: bool = False):
        super().__init__()
        self.qkv, self.spelling, self.causal = nn.Linear(E, 3 * E), spelling, causal
        self.bias = nn.Parameter(torch.randn(1, H, L, L) * 0.5) if bias else None

    def forward(self, x, lengths):
        q, k, v = (t.view(B, L, H, D).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        valid = torch.arange(L)[None, :] < lengths[:, None]
        eye = torch.arange(L)[:, None] == torch.arange(L)[None, :]
        keep = valid[:, None, None, :] | eye
        if self.causal:
            keep = keep & torch.ones(L, L, dtype=torch.bool).tril()
        scores = q @ k.transpose(-1, -2) / D ** 0.5 + (0 if self.bias is None else self.bias)
        if self.spelling == "sdpa":
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=torch.where(keep, self.bias if self.bias is not None
                                                                               else 0.0, float("-inf")))
        elif self.spelling == "finite_fill":
            o = scores.masked_fill(~keep, -1e9).softmax(-1) @ v
        else:  # additive, as HF's extended masks: (1 - keep) * finfo.min
            o = (scores + (1.0 - keep.float()) * torch.finfo(torch.float32).min).softmax(-1) @ v
        return o.transpose(1, 2).reshape(B, L, E)


CASES = {
    "sdpa_bool": dict(spelling="sdpa"),
    "finite_fill": dict(spelling="finite_fill"),
    "additive_finfo_min": dict(spelling="additive"),
    "causal": dict(spelling="finite_fill", causal=True),
    "with_bias": dict(spelling="finite_fill", bias=True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_kept_diagonal_is_rewritten_and_equals_eager_on_every_row(name):
    torch.manual_seed(0)
    model = KeptDiagonal(**CASES[name])
    x = torch.randn(B, L, E, requires_grad=True)
    lengths = torch.tensor([L, 0, 3])  # full, empty (every row attends to itself only), partial
    report = explain(model, x, lengths)
    assert report.counts["jagged_attention"] == 1, [r.reason for r in report.refusals]
    assert "or i == j" in report.rewrites[0].detail and "diagonal merged" in report.rewrites[0].detail
    out, ref = rewritten(model)(x, lengths), model(x, lengths)
    assert torch.isfinite(ref).all()
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    assert_same_weighted_grads(out, ref, [x, *model.parameters()])


def _with_query_padding(q, k, v, lengths):
    valid = torch.arange(L)[None, :] < lengths[:, None]
    eye = torch.eye(L, dtype=torch.bool)
    keep = (valid[:, None, None, :] & valid[:, None, :, None]) | eye
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)


def _with_dropout(q, k, v, lengths):
    keep = (torch.arange(L)[None, :] < lengths[:, None])[:, None, None, :] | torch.eye(L, dtype=torch.bool)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=0.1)


def test_kept_diagonal_with_dropout_equals_eager_under_the_same_draws(monkeypatch):
    """XLNet in train(): the kernel drops the kept keys' weights, the merged key i is dropped with pair
    (i, i)'s draw; eager's dropout(softmax) over both, patched to the kernel's draws, is matched exactly."""
    from tests.integration.test_attention_dropout_pass import under_the_same_draws

    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(B, H, L, D, generator=g, requires_grad=True) for _ in range(3))
    lengths = torch.tensor([L, 0, 3])
    report = explain(_with_dropout, q, k, v, lengths)
    assert report.counts["jagged_attention"] == 1, [r.reason for r in report.refusals]
    assert "dropout p=0.1" in report.rewrites[0].detail and "diagonal merged" in report.rewrites[0].detail
    out, ref = under_the_same_draws(_with_dropout, (q, k, v, lengths), 1, monkeypatch)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    assert_same_weighted_grads(out, ref, [q, k, v])


def _diagonal_only(q, k, v, lengths):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.eye(L, dtype=torch.bool))


@pytest.mark.parametrize("fn, reason", [
    (_with_query_padding, "query padding"),
    (_diagonal_only, "no key-padding mask"),
])
def test_near_misses_keep_eager_with_the_reason(fn, reason):
    q, k, v = (torch.randn(B, H, L, D) for _ in range(3))
    report = explain(fn, q, k, v, torch.tensor([L, 0, 3]))
    assert report.counts["jagged_attention"] == 0
    assert any(reason in r.reason for r in report.refusals), [r.reason for r in report.refusals]


def test_float64_is_merged_in_float64():
    """The merge runs in the kernel's compute dtype: a float64 model equals eager to float64 rounding."""
    torch.manual_seed(0)
    model = KeptDiagonal("finite_fill", bias=True).double()
    x = torch.randn(B, L, E, dtype=torch.float64, requires_grad=True)
    lengths = torch.tensor([L, 0, 3])
    out, ref = rewritten(model)(x, lengths), model(x, lengths)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
    assert_same_weighted_grads(out, ref, [x, *model.parameters()], atol=1e-11, rtol=1e-11)
