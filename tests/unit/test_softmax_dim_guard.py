"""A softmax over a dim other than the last, followed by ``@ v`` (RecBole's LightSANs normalizes its low-rank
attention over the queries): Inductor's attention patterns do not read the softmax's dim
(pytorch/pytorch#196468) and turned it into SDPA, a softmax over the keys (outputs 2.5 off under gem_compile,
as under plain torch.compile). gem_compile spells it over the last dim between transposes
(passes/softmax_dim_guard.py): compiled == eager, values and gradients; a softmax over the last dim is left
as written."""

from __future__ import annotations

import math

import pytest
import torch
from torch._dynamo.utils import counters

from gemcompile import gem_compile

B, H, L, K, D = 2, 2, 8, 4, 16

SPELLINGS = {
    "functional_minus_2": lambda s: torch.softmax(s, dim=-2),
    "module": lambda s: torch.nn.Softmax(dim=-2)(s),
    "method_positional": lambda s: s.softmax(2),
    "functional_dtype": lambda s: torch.nn.functional.softmax(s, dim=-2, dtype=torch.float32),
    "over_heads": lambda s: torch.softmax(s, dim=1),
    "last_dim": lambda s: torch.softmax(s, dim=-1),
}


@pytest.mark.parametrize("spelling", list(SPELLINGS))
def test_a_softmax_over_another_dim_before_a_matmul_equals_eager(spelling):
    normalize = SPELLINGS[spelling]

    def attention(q, k, v):
        return normalize(q @ k.transpose(-1, -2) / math.sqrt(D)) @ v

    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, L, D, generator=g, requires_grad=True)
    k, v = (torch.randn(B, H, K, D, generator=g, requires_grad=True) for _ in range(2))
    torch._dynamo.reset()
    counters.clear()
    out, ref = gem_compile(attention)(q, k, v), attention(q, k, v)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    weights = torch.randn(ref.shape, generator=g)
    for got, want in zip(torch.autograd.grad((out * weights).sum(), (q, k, v)),
                         torch.autograd.grad((ref * weights).sum(), (q, k, v))):
        torch.testing.assert_close(got, want, atol=5e-5, rtol=1e-4)
    assert counters["gemcompile"]["softmax_dim_guard"] == (0 if spelling == "last_dim" else 1)
