"""Scores scaled by a tensor constant along the keys (a learned temperature, Swin V2's per-head logit scale)
are rewritten with the factor folded into q ((q c) . k = (q . k) c, gradients of c included); a factor
that varies along the keys, or a bias or mask applied before the factor, is refused with the reason."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from gemcompile import explain
from tests.compiled_vs_eager import assert_same_weighted_grads
from tests.integration.test_in_place_scores import B, D, E, H, L, InPlaceScores
from tests.rewritten import rewritten

class ScaledScores(InPlaceScores):
    def __init__(self, spelling: str):
        super().__init__(spelling)
        self.temperature = nn.Parameter(torch.tensor(2.0))
        self.logit_scale = nn.Parameter(torch.log(10 * torch.ones(H, 1, 1)))

    def forward(self, x, lengths):
        q, k, v = self.qkv(x).view(B, L, 3, H, D).permute(2, 0, 3, 1, 4)
        pad = (torch.arange(L)[None, :] >= lengths[:, None])[:, None, None, :]
        if self.spelling == "temperature":
            s = (q @ k.transpose(-1, -2)) / self.temperature
        elif self.spelling == "swin_v2":  # cosine scores times a clamped, exponentiated per-head scale
            s = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)
            s = s * torch.clamp(self.logit_scale, max=math.log(100.0)).exp()
        elif self.spelling == "silu_temperature":  # pointwise attention (GDPA)
            a = F.silu(q @ k.transpose(-1, -2) / self.temperature) * ~pad
            return (a @ v).transpose(1, 2).reshape(B, L, E)
        elif self.spelling == "bias_before":
            s = (q @ k.transpose(-1, -2) + torch.ones(L, L)) / self.temperature
        elif self.spelling == "per_key":
            s = (q @ k.transpose(-1, -2)) * torch.linspace(0.5, 1.5, L)
        s = s.masked_fill(pad, float("-inf"))
        return (torch.softmax(s, dim=-1) @ v).transpose(1, 2).reshape(B, L, E)


REWRITTEN = {"temperature": "jagged_attention", "swin_v2": "jagged_attention", "silu_temperature": "gdpa"}
REFUSED = {"bias_before": "before they are scaled by the tensor", "per_key": "varies along the keys"}


@pytest.mark.parametrize("spelling", list(REWRITTEN))
def test_a_tensor_factor_is_folded_into_q(spelling):
    torch.manual_seed(0)
    model = ScaledScores(spelling)
    x = torch.randn(B, L, E, generator=torch.Generator().manual_seed(1), requires_grad=True)
    lengths = torch.tensor([L, 5, 1, 8])
    assert explain(model, x, lengths).counts[REWRITTEN[spelling]] == 1
    out, ref = rewritten(model)(x, lengths), model(x, lengths)
    rows = (torch.arange(L)[None, :] < lengths[:, None])[..., None]
    out, ref = torch.where(rows, out, 0), torch.where(rows, ref, 0)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    assert_same_weighted_grads(out, ref, [x, *model.parameters()], atol=1e-4)


@pytest.mark.parametrize("spelling", list(REFUSED))
def test_factors_that_do_not_fold_into_q_are_refused_with_the_reason(spelling):
    x, lengths = torch.randn(B, L, E), torch.tensor([L, 5, 1, 8])
    report = explain(ScaledScores(spelling), x, lengths)
    assert sum(report.counts.values()) == 0
    assert any(REFUSED[spelling] in r.reason for r in report.refusals), report.refusals
