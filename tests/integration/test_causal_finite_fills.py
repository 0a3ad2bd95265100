"""Causal attention with key padding and a finite fill (RecBole's where(tril(ids != 0), 0, -1e4), Hugging
Face decoders' (1 - mask) * finfo.min, masked_fill / where with -1e9): on left-padded or holed data the
first rows of a sequence see no valid key, and eager gives them softmax(s + F) over every key (uniform when
s + F rounds to F). The rewrite computes those rows in a second call over every key (finite_fill.py,
BlindRows): compiled == eager on every row and every gradient, an empty sequence included, through the CPU
reference and through the Triton launchers. A fill added by two terms keeps its device-side check."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from gemcompile import explain
from tests.grids import pairwise
from tests.compiled_vs_eager import assert_same_weighted_grads
from tests.rewritten import rewritten

B, H, L, D = 4, 2, 9, 16
FILLS = {"finfo": torch.finfo(torch.float32).min, "-1e9": -1e9, "-1e4": -1e4}
SPELLINGS = ["added_where", "hf_additive", "masked_fill", "where", "sdpa_float"]


def _attention(spelling: str, fill: float):
    def attention(q, k, v, ids):
        n = ids.shape[1]
        keep = torch.tril((ids != 0)[:, None, None, :].expand(-1, 1, n, -1))
        s = q @ k.transpose(-1, -2) / math.sqrt(D)
        if spelling == "added_where":
            p = torch.softmax(s + torch.where(keep, 0.0, fill), dim=-1)
        elif spelling == "hf_additive":
            p = torch.softmax(s + (1.0 - keep.float()) * fill, dim=-1)
        elif spelling == "masked_fill":
            p = torch.softmax(s.masked_fill(~keep, fill), dim=-1)
        elif spelling == "where":
            p = torch.softmax(torch.where(keep, s, fill), dim=-1)
        else:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.where(keep, 0.0, fill))
        return p @ v

    return attention


def _inputs(seed: int, layout: str, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, L, D, generator=g).to(device).requires_grad_() for _ in range(3))
    lengths = torch.tensor([L, 4, 0, 7])
    ids = torch.randint(1, 50, (B, L), generator=g)
    if layout == "left":
        ids = ids * (torch.arange(L)[None, :] >= L - lengths[:, None])
    else:  # holes, leading ones included
        ids = ids * (torch.rand(B, L, generator=g) > 0.4)
        ids[0, :3] = 0
        ids[2] = 0
    return q, k, v, ids.to(device)


def _check(spelling, fill_name, layout, seed=1, device="cpu"):
    fill = FILLS[fill_name]
    attention = _attention(spelling, fill)
    q, k, v, ids = _inputs(seed, layout, device)
    assert explain(attention, q, k, v, ids).counts["jagged_attention"] == 1
    out = rewritten(attention)(q, k, v, ids)
    # SDPA's fused CPU kernel rebuilds a blind row's P from a logsumexp that cannot hold log(L) next to
    # -1e9 or finfo.min (its backward is then not its forward's): the reference is SDPA's math definition
    with sdpa_kernel(SDPBackend.MATH):
        ref = attention(q, k, v, ids)
    added = spelling in ("added_where", "hf_additive", "sdpa_float")
    # an added -1e4 is rounded by eager at a grid of 1e-3 (its own rounding); the kernel keeps s exact
    tol = dict(atol=2e-3, rtol=2e-3) if added and fill_name == "-1e4" else dict(atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(out, ref, **tol)
    assert_same_weighted_grads(out, ref, [q, k, v], **tol)


@pytest.mark.parametrize("spelling,fill_name,layout", pairwise(SPELLINGS, list(FILLS), ["left", "holes"]))
def test_rows_that_see_no_valid_key_equal_eager(spelling, fill_name, layout):
    _check(spelling, fill_name, layout)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the Triton interpreter on a machine without CUDA")
@pytest.mark.parametrize("spelling, fill_name", [("hf_additive", "finfo"), ("added_where", "-1e4"),
                                                 ("masked_fill", "-1e9")])
def test_rows_that_see_no_valid_key_through_the_triton_launchers(spelling, fill_name, monkeypatch):
    pytest.importorskip("triton")
    from gemcompile.lowering.jagged_attention import op as jagged_op

    monkeypatch.setattr(jagged_op, "use_triton", lambda q: q.dtype != torch.float64)
    _check(spelling, fill_name, "left", seed=5)


def test_a_causal_fill_added_by_two_terms_stops_on_a_left_padded_batch():
    """s + where(tril, 0, F) + where(keep, 0, F): a key both terms drop gets 2F, so eager's blind rows attend
    to the keys one term drops, which no kernel call computes: a device-side check, exact otherwise."""
    def attention(q, k, v, ids):
        n = ids.shape[1]
        causal = torch.tril(torch.ones(n, n, dtype=torch.bool))
        s = q @ k.transpose(-1, -2) / math.sqrt(D)
        s = s + torch.where(causal, 0.0, -1e9) + torch.where((ids != 0)[:, None, None, :], 0.0, -1e9)
        return torch.softmax(s, dim=-1) @ v

    q, k, v, ids = _inputs(1, "left")
    compiled = rewritten(attention)
    with pytest.raises(RuntimeError, match="several terms"):
        compiled(q, k, v, ids)
    right = torch.randint(1, 50, (B, L)) * (torch.arange(L)[None, :] < torch.tensor([L, 4, 2, 7])[:, None])
    torch.testing.assert_close(compiled(q, k, v, right), attention(q, k, v, right), atol=2e-5, rtol=1e-4)
