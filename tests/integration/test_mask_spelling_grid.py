"""A grid of mask spellings through the attention passes: every key source (lengths right / left padded,
``ids > 0``, ``~(ids == 0)``, an HF long mask, none) crossed with every causal spelling (none, ``tril``,
``~triu(.., 1)``, ``>=``, ``eye | >``, a window), each with one attention form and fill (SDPA bool or
additive, ``masked_fill``, additive, ``where``; -inf, -1e9, finfo.min, -1e4) chosen by rotation. Each: the
attention is rewritten and compiled == eager for outputs and every gradient on the rows eager defines (a row
with no valid key under -inf is NaN in eager). A local run of the full product (612 programs) found no
mismatch; this is its regression net."""

import itertools
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

from gemcompile.backend import allow_warnings_in_graphs
from tests.rewritten import rewritten

B, L, H, D = 3, 10, 2, 8
E = H * D
KEYS = ["lengths_right", "lengths_left", "ids", "ids_eq", "attn_long", "none"]
CAUSAL = ["none", "tril", "triu_inv", "ge", "eye_gt", "window"]
FORMS = [("sdpa_bool", float("-inf")), ("sdpa_add", float("-inf")), ("manual_masked_fill", -1e9),
         ("manual_add", torch.finfo(torch.float32).min), ("manual_where", -1e4), ("sdpa_add", -1e9),
         ("manual_masked_fill", float("-inf")), ("manual_where", torch.finfo(torch.float32).min)]
GRID = [(k, c, *FORMS[n % len(FORMS)]) for n, (k, c) in enumerate(itertools.product(KEYS, CAUSAL))]


class Spelled(nn.Module):
    def __init__(self, keys: str, causal: str, form: str, fill: float):
        super().__init__()
        self.qkv = nn.Linear(E, 3 * E)
        self.keys, self.causal, self.form, self.fill = keys, causal, form, fill

    def key_mask(self, data, n):
        pos = torch.arange(n)
        return {"lengths_right": lambda: pos[None, :] < data[:, None],
                "lengths_left": lambda: pos[None, :] >= n - data[:, None],
                "ids": lambda: data > 0, "ids_eq": lambda: ~(data == 0), "attn_long": lambda: data.bool(),
                "none": lambda: None}[self.keys]()

    def causal_mask(self, n):
        pos = torch.arange(n)
        return {"none": lambda: None,
                "tril": lambda: torch.tril(torch.ones(n, n, dtype=torch.bool)),
                "triu_inv": lambda: ~torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1),
                "ge": lambda: pos[:, None] >= pos[None, :],
                "eye_gt": lambda: torch.eye(n, dtype=torch.bool) | ((pos[:, None] - pos[None, :]) > 0),
                "window": lambda: (pos[:, None] - pos[None, :]).abs() <= 3}[self.causal]()

    def forward(self, x, data):
        n = x.shape[1]
        keys, causal = self.key_mask(data, n), self.causal_mask(n)
        keep = None if keys is None else keys[:, None, None, :]
        if causal is not None:
            keep = causal[None, None] if keep is None else keep & causal[None, None]
        q, k, v = (t.view(x.shape[0], n, H, D).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        if keep is None:
            o = F.scaled_dot_product_attention(q, k, v)
        elif self.form == "sdpa_bool":
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        elif self.form == "sdpa_add":
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=torch.zeros(keep.shape, dtype=q.dtype).masked_fill(~keep, self.fill))
        else:
            s = q @ k.transpose(-1, -2) / math.sqrt(D)
            if self.form == "manual_masked_fill":
                s = s.masked_fill(~keep, self.fill)
            elif self.form == "manual_add":
                s = s + (1.0 - keep.float()) * self.fill
            else:
                s = torch.where(keep, s, torch.full_like(s, self.fill))
            o = torch.softmax(s, -1) @ v
        return o.transpose(1, 2).reshape(x.shape[0], n, E)


def _data(keys: str, g: torch.Generator):
    lengths = torch.randint(0, L + 1, (B,), generator=g)
    lengths[0] = L
    if keys in ("lengths_right", "lengths_left", "none"):
        return lengths
    valid = torch.arange(L)[None] < lengths[:, None]
    if keys in ("ids", "ids_eq"):  # holes inside the sequences too
        return torch.randint(1, 9, (B, L), generator=g) * valid * (torch.rand(B, L, generator=g) > 0.2)
    return valid.long()


@pytest.mark.parametrize("keys, causal, form, fill", GRID, ids=[f"{k}-{c}-{f}-{v:g}" for k, c, f, v in GRID])
def test_spelling_is_rewritten_and_equals_eager(keys, causal, form, fill):
    allow_warnings_in_graphs()
    torch.manual_seed(0)
    model = Spelled(keys, causal, form, fill)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, L, E, generator=g, requires_grad=True)
    data = _data(keys, g)
    counters.clear()
    torch._dynamo.reset()
    out = rewritten(model)(x, data)
    assert sum(counters["gemcompile"].values()) >= 1  # the attention was rewritten
    ref = model(x, data)
    defined = torch.isfinite(ref)
    assert torch.isfinite(out[defined]).all()
    torch.testing.assert_close(torch.where(defined, out, 0), torch.where(defined, ref, 0), atol=1e-5, rtol=1e-4)
    weights = torch.randn(ref.shape, generator=g)
    leaves = [x, *model.parameters()]
    grads = torch.autograd.grad((torch.where(defined, out, 0) * weights).sum(), leaves)
    grads_ref = torch.autograd.grad((torch.where(defined, ref, 0) * weights).sum(), leaves)
    for got, want in zip(grads, grads_ref):
        torch.testing.assert_close(torch.nan_to_num(got), torch.nan_to_num(want), atol=1e-4, rtol=1e-3)
