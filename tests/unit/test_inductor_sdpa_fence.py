"""Inductor's attention patterns (torch/_inductor/fx_passes/fuse_attention.py) do not read the numbers in them
(pytorch/pytorch#196468): attention-shaped chains that differ from a pattern in a number became SDPA computing
something else, a softmax over the queries (RecBole's LightSANs: 2.5 off, gradients too), a padding mask
compared with 1 taken for == 0, a query-row mask view taken for the key one, a fill of -1 (inference). Under
gem_compile those patterns decline (passes/inductor_sdpa_fence.py): compiled == eager. torch.compile without
gemcompile in the same process keeps them (the fence is not process-wide)."""

from __future__ import annotations

import math

import pytest
import torch
from torch._dynamo.utils import counters

from gemcompile import gem_compile

B, H, L, K, D = 2, 2, 8, 4, 16

SOFTMAX_DIMS = {
    "functional_minus_2": lambda s: torch.softmax(s, dim=-2),
    "module": lambda s: torch.nn.Softmax(dim=-2)(s),
    "method_positional": lambda s: s.softmax(2),
    "special": lambda s: torch.special.softmax(s, 2),
    "over_heads": lambda s: torch.softmax(s, dim=1),
}


@pytest.mark.parametrize("spelling", list(SOFTMAX_DIMS))
def test_a_softmax_over_another_dim_before_a_matmul_equals_eager(spelling):
    normalize = SOFTMAX_DIMS[spelling]

    def attention(q, k, v):
        return normalize(q @ k.transpose(-1, -2) / math.sqrt(D)) @ v

    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, L, D, generator=g, requires_grad=True)
    k, v = (torch.randn(B, H, K, D, generator=g, requires_grad=True) for _ in range(2))
    torch._dynamo.reset()
    out, ref = gem_compile(attention)(q, k, v), attention(q, k, v)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    weights = torch.randn(ref.shape, generator=g)
    for got, want in zip(torch.autograd.grad((out * weights).sum(), (q, k, v)),
                         torch.autograd.grad((ref * weights).sum(), (q, k, v))):
        torch.testing.assert_close(got, want, atol=5e-5, rtol=1e-4)


def _distilbert_like(drop_value, fill, view=None):
    def attention(query, key, value, attn_mask):
        q, k, v = (t.permute([0, 2, 1, 3]) for t in (query, key, value))
        scores = (q @ k.transpose(-2, -1)).div(math.sqrt(D))
        mask = (attn_mask == drop_value).view(view or (q.size(0), 1, 1, k.size(-2))).expand_as(scores)
        return torch.softmax(scores.masked_fill(mask, torch.full((), fill)), dim=-1) @ v
    return attention


def _gpt2_like(fill):
    def attention(query, key, value, attn_mask):
        q, k, v = (t.permute([0, 2, 1, 3]) for t in (query, key, value))
        w = torch.matmul(q, k.permute(0, 1, 3, 2)).div(torch.full([], D ** 0.5))
        causal = torch.ones(L, L, dtype=torch.bool).tril()[None, None]
        return torch.where(causal, w, torch.full((), fill)).softmax(dim=-1).matmul(v)
    return attention


NUMBERS = {  # (attention, whether the mask holds 1 at padding)
    "padding_compared_with_1": (_distilbert_like(1, float("-inf")), True),
    "zero_fill": (_distilbert_like(0, 0.0), False),
    "query_row_view": (_distilbert_like(0, torch.finfo(torch.float32).min, view=(B, 1, L, 1)), False),
    "fill_of_minus_one": (_gpt2_like(-1.0), True),
}


@pytest.mark.parametrize("spelling", list(NUMBERS))
def test_an_attention_shaped_chain_with_other_numbers_equals_eager_in_inference(spelling):
    attention, holds_padding = NUMBERS[spelling]
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, L, H, D, generator=g) for _ in range(3))
    pad = (torch.arange(L)[None] >= torch.tensor([6, 5])[:, None]).long()
    mask = pad if holds_padding else 1 - pad
    torch._dynamo.reset()
    with torch.no_grad():
        out, ref = gem_compile(attention)(q, k, v, mask), attention(q, k, v, mask)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def test_torch_compile_without_gemcompile_keeps_inductors_patterns():
    """The fence declines only inside gemcompile's compiles: a plain torch.compile of an SDPA-shaped chain,
    after a gem_compile in the same process, is still fused by Inductor."""
    def attention(q, k, v):
        return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(D), dim=-1) @ v

    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(B, H, L, D, generator=g) for _ in range(3))
    torch._dynamo.reset()
    counters.clear()
    no_caches = {"enable_autograd_cache": False} if hasattr(functorch_config, "enable_autograd_cache") else {}
    # a cached compile runs no pattern: the counters below need both compiles to happen
    with torch.no_grad(), inductor_config.patch(fx_graph_cache=False), functorch_config.patch(**no_caches):
        torch.testing.assert_close(gem_compile(attention)(q, k, v), attention(q, k, v), atol=2e-5, rtol=1e-4)
        assert counters["inductor"]["fuse_attention"] == 0
        assert counters["gemcompile"]["inductor_sdpa_pattern_declined"] > 0
        torch._dynamo.reset()
        torch.testing.assert_close(torch.compile(attention)(q, k, v), attention(q, k, v), atol=2e-5, rtol=1e-4)
    assert counters["inductor"]["fuse_attention"] > 0
