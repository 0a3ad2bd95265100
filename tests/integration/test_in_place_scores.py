"""Score chains written with in-place updates (``s /= c``, ``s += mask``, ``s.masked_fill_(pad, -inf)``,
``s[~valid] = -1e6`` with a full-shape boolean index, as d2l's masked_softmax writes it) are
read as their out-of-place forms (passes/attention/in_place.py) and rewritten like them; updates that
another reader could see (a value read before the update, a view, a promoting dtype) stay as written, and
every model gives eager's outputs and gradients. Also T5's and LLaMA's ``softmax(s.float()).type_as(s)``, whose
``type_as`` reads only the scores' dtype."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import counters

from gemcompile import explain
from tests.rewritten import rewritten

B, L, H, D = 4, 11, 2, 16
E = H * D


class InPlaceScores(nn.Module):
    def __init__(self, spelling: str):
        super().__init__()
        self.spelling = spelling
        self.qkv = nn.Linear(E, 3 * E)

    def forward(self, x, ids):
        q, k, v = self.qkv(x).view(B, L, 3, H, D).permute(2, 0, 3, 1, 4)
        pad = (ids == 0)[:, None, None, :]
        s = torch.matmul(q, k.transpose(-1, -2))
        extra = None
        if self.spelling == "itruediv_masked_fill_":
            s /= math.sqrt(D)
            s.masked_fill_(pad, float("-inf"))
        elif self.spelling == "div__iadd":
            s.div_(math.sqrt(D))
            s += torch.zeros(B, 1, 1, L).masked_fill(pad, torch.finfo(s.dtype).min)
        elif self.spelling == "mul__masked_fill_":
            s.mul_(D**-0.5).masked_fill_(pad, -1e9)
        elif self.spelling == "read_before":  # the unscaled scores are also returned: the update is seen
            extra = s.sum((-2, -1))
            s.masked_fill_(pad, float("-inf"))
        elif self.spelling == "view":  # an update through a view: left as written
            s.transpose(-1, -2).masked_fill_(pad.transpose(-1, -2), float("-inf"))
        elif self.spelling == "promoting":  # bf16 scores += an fp32 mask stays bf16 in place
            s = torch.matmul(q.bfloat16(), k.bfloat16().transpose(-1, -2))
            s += torch.zeros(B, 1, 1, L).masked_fill(pad, float("-inf"))
            s = s.float()
        elif self.spelling == "bool_index_fill":  # d2l: a full-shape boolean index of a copy of the scores
            s = (s / math.sqrt(D)).clone()
            s[pad.expand(B, H, L, L)] = -1e6
        elif self.spelling == "bool_index_rows":  # a boolean index over the leading dims: whole query rows,
            s = (s / math.sqrt(D)).masked_fill(pad, -1e6)  # a where() over them (index_assign.py)
            s[(ids == 0)[:, None, :].expand(B, H, L)] = -1e6
        elif self.spelling == "rows_flattened":  # the scores as (B*H*L, L) rows and back (passes/attention/
            # row_flattened.py), the mask built in the scores' shape and flattened with them
            shape = s.shape
            flat = (s / math.sqrt(D)).reshape(-1, shape[-1])
            valid = (ids != 0)[:, None, None, :].expand(B, H, L, L).reshape(-1, shape[-1])
            s = flat.masked_fill(~valid, -1e6).reshape(shape)
        elif self.spelling == "rows_to_merged_heads":  # rows shaped back to (B*H, L, L): not the scores' shape
            flat = (s / math.sqrt(D)).reshape(-1, L)
            valid = (ids != 0)[:, None, None, :].expand(B, H, L, L).reshape(-1, L)
            s = flat.masked_fill(~valid, -1e6).reshape(B * H, L, L)
        if self.spelling == "float_softmax_type_as":
            s = s * D**-0.5 + torch.zeros(B, 1, 1, L).masked_fill(pad, torch.finfo(s.dtype).min)
            p = torch.softmax(s.float(), dim=-1).type_as(s)
        else:
            p = torch.softmax(s, dim=-1)
        if self.spelling == "rows_to_merged_heads":
            p = p.view(B, H, L, L)
        out = (p @ v).transpose(1, 2).reshape(B, L, E)
        return out if extra is None else (out, extra)


REWRITTEN = ["itruediv_masked_fill_", "div__iadd", "mul__masked_fill_", "float_softmax_type_as", "bool_index_fill",
             "rows_flattened", "bool_index_rows"]
KEPT = ["read_before", "view", "promoting", "rows_to_merged_heads"]
REFUSED_WITH = {"rows_to_merged_heads": "`reshape`"}
"""Kept spellings explain names: a reshape of the scores that is not a heads view says so (it said nothing)."""


def _inputs():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, L, E, generator=g, requires_grad=True)
    lengths = torch.tensor([L, 4, 7, 1])
    ids = torch.randint(1, 9, (B, L), generator=g) * (torch.arange(L)[None, :] < lengths[:, None])
    return x, ids


@pytest.mark.parametrize("spelling", REWRITTEN + KEPT)
def test_in_place_score_updates_match_eager(spelling):
    torch.manual_seed(0)
    model = InPlaceScores(spelling)
    x, ids = _inputs()
    report = explain(model, x, ids)
    assert report.counts["jagged_attention"] == (1 if spelling in REWRITTEN else 0), report.refusals
    if spelling in REFUSED_WITH:
        assert any(REFUSED_WITH[spelling] in str(r) for r in report.refusals), report.refusals
    counters.clear()
    out, ref = rewritten(model)(x, ids), model(x, ids)
    out, ref = (out if isinstance(out, tuple) else (out,)), (ref if isinstance(ref, tuple) else (ref,))
    leaves = [x, *model.parameters()]
    weights = [torch.randn(r.shape, generator=torch.Generator().manual_seed(2)) for r in ref]
    grads = torch.autograd.grad(sum((o * w).sum() for o, w in zip(out, weights)), leaves)
    grads_ref = torch.autograd.grad(sum((r * w).sum() for r, w in zip(ref, weights)), leaves)
    tol = dict(atol=5e-5, rtol=1e-4)
    for o, r in zip(out, ref):
        torch.testing.assert_close(o, r, **tol)
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref, **tol)


def test_a_slice_of_the_mask_read_after_its_assignment_sees_the_assigned_values():
    """x[..., :n] = v is functionalized only when every reader of an earlier slice of x reads it before the
    assignment: here a slice taken before is read after, and must see the assigned values, as eager does."""
    from gemcompile import gem_compile

    def f(s, valid):
        m = torch.zeros(s.shape[0], 1, 1, s.shape[-1]).clone()
        before = m[:, :, :, : s.shape[-1]]
        m[:, :, :, : s.shape[-1]] = before.masked_fill(~valid[:, None, None, :], -1e9)
        return torch.softmax(s + m, dim=-1) + before  # `before` is a view: it holds the fill now

    s = torch.randn(3, 2, 5, 5)
    valid = torch.arange(5)[None, :] < torch.tensor([5, 2, 1])[:, None]
    torch.testing.assert_close(gem_compile(f)(s, valid), f(s, valid))
