"""Score chains as relative-position models (XLNet, Transformer-XL) write them: tensors in (L, B, H, D)
read by einsum, a content term plus a positional term that is itself a product of q (shifted into place by
reshapes, so the kernel takes it as a bias), 0 added to the sum (XLNet's ``ef = 0`` without segments),
and the mask subtracted (``s - 1e30 * einsum("ijbn->bnij", m)``
with m = 1 on dropped keys). Each: rewritten, and compiled == eager on outputs and every gradient, an empty
sequence included; the near-misses keep the eager graph."""

import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import counters

from gemcompile import explain
from tests.compiled_vs_eager import assert_same_weighted_grads
from tests.rewritten import rewritten

L, B, H, D = 9, 4, 2, 16


def shift_relative(x: torch.Tensor, keys: int) -> torch.Tensor:
    """(B, H, Lq, R) scores against R relative positions -> (B, H, Lq, keys) against key positions: the
    reshape trick that moves row i left by i (Transformer-XL's)."""
    b, h, i, r = x.shape
    x = x.reshape(b, h, r, i)[:, :, 1:, :].reshape(b, h, i, r - 1)
    return torch.index_select(x, 3, torch.arange(keys, device=x.device))


class RelativeAttention(nn.Module):
    def __init__(self, subtracted: float = 1e30, shift: float = 0.0):
        super().__init__()
        self.qkv = nn.Linear(H * D, 3 * H * D)
        self.r = nn.Parameter(torch.randn(2 * L, H, D) * 0.1)
        self.content_bias = nn.Parameter(torch.randn(H, D) * 0.1)
        self.position_bias = nn.Parameter(torch.randn(H, D) * 0.1)
        self.subtracted, self.shift = subtracted, shift

    def forward(self, x, attention_mask):  # x (L, B, H * D); attention_mask (B, L), 1 = token
        q, k, v = (t.reshape(L, B, H, D) for t in self.qkv(x).chunk(3, -1))
        ac = torch.einsum("ibnd,jbnd->bnij", q + self.content_bias, k)
        bd = torch.einsum("ibnd,jnd->bnij", q + self.position_bias, self.r)
        bd = shift_relative(bd, keys=L)
        scores = (ac + bd + self.shift) * D ** -0.5
        dropped = (1.0 - attention_mask.T.float())[None, :, :, None]  # (1, L, B, 1): XLNet's (i, j, b, n)
        scores = scores - self.subtracted * torch.einsum("ijbn->bnij", dropped)
        p = torch.softmax(scores, dim=3)
        return torch.einsum("bnij,jbnd->ibnd", p, v).reshape(L, B, H * D)


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(L, B, H * D, generator=g, requires_grad=True)
    lengths = torch.tensor([L, 4, 0, 7])
    return x, (torch.arange(L)[None, :] < lengths[:, None]).long()


@pytest.mark.parametrize("subtracted", [1e30, 65500.0])
def test_relative_scores_with_a_subtracted_mask_are_rewritten_and_equal_eager(subtracted):
    torch.manual_seed(0)
    model = RelativeAttention(subtracted)
    x, mask = _inputs(1)
    assert explain(model, x, mask).counts["jagged_attention"] == 1
    counters.clear()
    out, ref = rewritten(model)(x, mask), model(x, mask)
    assert counters["gemcompile"]["jagged_attention"] == 1
    # -65500 (XLNet's fp16 fill) is added in eager at a grid of 0.004-0.008: the empty sequence's scores
    # carry eager's own rounding there (finite_fill.py), the kernel's are exact
    tol = dict(atol=2e-5, rtol=1e-4) if subtracted > 1e8 else dict(atol=5e-3, rtol=5e-3)
    torch.testing.assert_close(out, ref, **tol)
    assert_same_weighted_grads(out, ref, [x, *model.parameters()], **tol)


def test_a_nonzero_constant_added_to_the_scores_is_refused():
    """s + 3 is a shift the softmax does not see, but it moves the scores against a finite fill, which the
    fill's checks do not bound: only + 0 is read."""
    torch.manual_seed(0)
    model = RelativeAttention(65500.0, shift=3.0)
    x, mask = _inputs(3)
    report = explain(model, x, mask)
    assert report.counts["jagged_attention"] == 0
    assert any("constant" in r.reason for r in report.refusals), [r.reason for r in report.refusals]


def test_a_subtracted_term_that_is_not_a_mask_stays_eager():
    """s - 5 * m: 5 is no fill (a mask drops by >= 1e4), so the term is a bias, and the refusal says so."""
    torch.manual_seed(0)
    model = RelativeAttention(subtracted=5.0)
    x, mask = _inputs(2)
    report = explain(model, x, mask)
    assert report.counts["jagged_attention"] == 0
    assert any("added as a bias" in r.reason for r in report.refusals), [r.reason for r in report.refusals]
    torch.testing.assert_close(rewritten(model)(x, mask), model(x, mask))
