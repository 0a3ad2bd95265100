"""d2l's masked_softmax (dive-into-deep-learning, copied by many recommender ports): the (B * H, Lq, Lk) scores
flattened to rows, each row masked by its own length (the lengths repeat_interleave'd over the query rows, the
fill written in place through a boolean index), then shaped back before the softmax. The fold of
passes/attention/row_flattened.py and the split reshape of masks/evaluator.py make it key padding by the lengths:
rewritten, with eager's outputs and gradients. Near misses (the lengths tiled instead of repeated, per-query
lengths, a fill that is not of the rows' shape) are left as written, with eager's outputs."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from gemcompile import explain
from tests.rewritten import rewritten

B, H, L, D = 4, 2, 9, 16


def sequence_mask(X, valid_len, value=0.0):
    """d2l.sequence_mask, as written there."""
    maxlen = X.size(1)
    mask = torch.arange((maxlen), dtype=torch.float32, device=X.device)[None, :] < valid_len[:, None]
    X[~mask] = value
    return X


class D2lAttention(nn.Module):
    """d2l's MultiHeadAttention over DotProductAttention, with masked_softmax spelled as ``spelling`` says."""

    def __init__(self, spelling: str):
        super().__init__()
        self.spelling = spelling
        self.W_q, self.W_k, self.W_v, self.W_o = (nn.Linear(H * D, H * D, bias=False) for _ in range(4))

    def _split(self, X):  # d2l's transpose_qkv: (B, L, H*D) -> (B*H, L, D)
        X = X.reshape(X.shape[0], X.shape[1], H, -1).permute(0, 2, 1, 3)
        return X.reshape(-1, X.shape[2], X.shape[3])

    def masked_softmax(self, X, valid_lens):
        shape = X.shape
        if self.spelling == "d2l":
            valid_lens = torch.repeat_interleave(valid_lens, shape[1])
            X = sequence_mask(X.reshape(-1, shape[-1]), valid_lens, value=-1e6)
        elif self.spelling == "masked_fill":  # the same rows, out of place
            rows = torch.repeat_interleave(valid_lens, shape[1])
            keep = torch.arange(shape[-1])[None, :] < rows[:, None]
            X = X.reshape(-1, shape[-1]).masked_fill(~keep, -1e6)
        elif self.spelling == "tiled":  # near miss: lengths tiled (repeat), not repeated per row
            X = sequence_mask(X.reshape(-1, shape[-1]), valid_lens.repeat(shape[1]), value=-1e6)
        elif self.spelling == "per_query":  # near miss: one length per (sample, query row), flattened
            per_query = valid_lens[:, None] - torch.arange(shape[1])[None, :].clamp(max=2)
            X = sequence_mask(X.reshape(-1, shape[-1]), per_query.reshape(-1), value=-1e6)
        return nn.functional.softmax(X.reshape(shape), dim=-1)

    def forward(self, x, valid_lens):
        q, k, v = self._split(self.W_q(x)), self._split(self.W_k(x)), self._split(self.W_v(x))
        lens = torch.repeat_interleave(valid_lens, repeats=H, dim=0)
        scores = torch.bmm(q, k.transpose(1, 2)) / math.sqrt(D)
        out = torch.bmm(self.masked_softmax(scores, lens), v)
        out = out.reshape(-1, H, out.shape[1], out.shape[2]).permute(0, 2, 1, 3)
        return self.W_o(out.reshape(out.shape[0], out.shape[1], -1))


REWRITTEN, KEPT = ["d2l", "masked_fill"], ["tiled", "per_query"]


@pytest.mark.parametrize("spelling", REWRITTEN + KEPT)
def test_rows_flattened_mask(spelling):
    torch.manual_seed(0)
    model = D2lAttention(spelling)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, L, H * D, generator=g, requires_grad=True)
    lengths = torch.tensor([L, 1, 4, 6])  # a full row; no empty one (d2l's -1e6 fill gives it uniform weights)
    report = explain(model, x, lengths)
    assert report.counts["jagged_attention"] == (1 if spelling in REWRITTEN else 0), report.refusals
    if spelling in KEPT:
        assert report.refusals, "a near miss is left alone with a reason"
    out, ref = rewritten(model)(x, lengths), model(x, lengths)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    w = torch.randn(ref.shape, generator=g)
    leaves = [x, *model.parameters()]
    for a, b in zip(torch.autograd.grad((out * w).sum(), leaves), torch.autograd.grad((ref * w).sum(), leaves)):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)


def test_a_sequence_with_no_valid_key_matches_eager():
    """d2l fills with -1e6, a finite value: a row with no valid key gets uniform weights in eager, and so here."""
    torch.manual_seed(0)
    model = D2lAttention("d2l")
    x = torch.randn(B, L, H * D)
    lengths = torch.tensor([L, 0, 4, 6])
    torch.testing.assert_close(rewritten(model)(x, lengths), model(x, lengths), atol=2e-5, rtol=1e-4)


def test_dynamic_shapes_fold_and_prove_the_same():
    """Under dynamic shapes the scores' shape is read (``shape = X.shape``) and the repeats are a size node:
    still rewritten, once for every padded length, with eager's outputs."""
    from torch._dynamo.utils import counters

    from gemcompile import gem_compile

    torch.manual_seed(0)
    model = D2lAttention("d2l")
    compiled = gem_compile(model, dynamic=True)
    counters.clear()
    for n in (9, 12, 7):
        x = torch.randn(B, n, H * D)
        lengths = torch.tensor([n, 1, 4, 6])
        torch.testing.assert_close(compiled(x, lengths), model(x, lengths), atol=2e-5, rtol=1e-4)
    assert counters["gemcompile"]["jagged_attention"] == 1 and not counters["gemcompile"]["jagged_attention_refused"]
