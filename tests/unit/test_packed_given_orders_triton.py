"""Packed attention launchers take the graph's longest-first orders (derived once per step from the lengths,
common/length_order.py) for their packed sides too: with the orders given, no order is computed in the call
(no argsort launch), and every output and gradient is bit-identical to the call that computes them.
Jagged attention (packed self-attention, packed keys under dense queries) and GDPA (packed queries), under
the Triton interpreter (float32)."""

import os

import pytest
import torch

if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("interpreter tests: run on a machine without CUDA (conftest sets TRITON_INTERPRET=1)",
                allow_module_level=True)
pytest.importorskip("triton")

from gemcompile.lowering.common import attention_triton  # noqa: E402
from gemcompile.lowering.common.jagged import lengths_to_offsets  # noqa: E402
from gemcompile.lowering.common.length_order import stable_longest_first  # noqa: E402
from gemcompile.lowering.gdpa import triton as gdpa_triton  # noqa: E402
from gemcompile.lowering.gdpa.spec import GdpaSpec  # noqa: E402
from gemcompile.lowering.jagged_attention import packed_triton  # noqa: E402
from gemcompile.lowering.jagged_attention import triton as jagged_triton  # noqa: E402

B, H, N, D, Q, S = 4, 2, 37, 16, 5, 20
LENGTHS = [17, 0, N, 1]  # not already longest first


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(LENGTHS)
    offsets = lengths_to_offsets(lengths)
    T = int(offsets[-1]) + 3
    rows = [torch.randn(T, H, D, generator=g) for _ in range(4)]
    return lengths, offsets, T, rows, g


@pytest.fixture
def no_order_computed(monkeypatch):
    """Fails any launch of the argsort kernel (the launchers' fallback when no order is given)."""
    def refuse(key):
        raise AssertionError("an order was computed although the call was given one")
    for module in (attention_triton, gdpa_triton, jagged_triton):
        monkeypatch.setattr(module, "longest_first_order", refuse)


def _same(a, b):
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def _jagged(q, k, v, grad, lengths, offsets, causal, **orders):
    out, lse = packed_triton.jagged_attention_forward_triton(q, k, v, None, lengths, None, causal, 0.3,
                                                             token_offsets=offsets, packed_len=N, **orders)
    grads = packed_triton.jagged_attention_backward_triton(grad, q, k, v, out, lse, None, lengths, None, causal,
                                                           0.3, False, token_offsets=offsets, packed_len=N,
                                                           **orders)
    return out, lse, *grads[:3]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("packed_q", [True, False], ids=["self", "dense_q"])
def test_jagged_packed_sides_take_the_given_order(causal, packed_q, request):
    lengths, offsets, T, (q, k, v, grad), g = _inputs(seed=3 + causal)
    if not packed_q:
        q, grad = torch.randn(B, H, Q, D, generator=g), torch.randn(B, H, Q, D, generator=g)
    computed = _jagged(q, k, v, grad, lengths, offsets, causal)
    request.getfixturevalue("no_order_computed")
    given = _jagged(q, k, v, grad, lengths, offsets, causal, kv_order=stable_longest_first(lengths))
    _same(given, computed)


def _gdpa(q, k, v, grad, lengths, offsets, spec, **orders):
    out = gdpa_triton.gdpa_forward_triton(q, k, v, lengths, None, None, spec, token_offsets=offsets, packed_len=N,
                                          **orders)
    grads = gdpa_triton.gdpa_backward_triton(grad, q, k, v, lengths, None, None, spec, token_offsets=offsets,
                                             packed_len=N, **orders)
    return out, *grads[:3]


@pytest.mark.parametrize("fields", [dict(activation="gelu", scale=1.0, out_scale=1.0 / N),
                                    dict(activation="silu", scale=0.3, causal=True, window=6)],
                         ids=["gem_cross", "causal_window"])
def test_gdpa_packed_queries_take_the_given_order(fields, request):
    lengths, offsets, T, (q, _, _, grad), g = _inputs(seed=7)
    k, v = torch.randn(B, H, S, D, generator=g), torch.randn(B, H, S, D, generator=g)
    spec = GdpaSpec(**fields)
    computed = _gdpa(q, k, v, grad, lengths, offsets, spec)
    request.getfixturevalue("no_order_computed")
    given = _gdpa(q, k, v, grad, lengths, offsets, spec, q_order=stable_longest_first(lengths))
    _same(given, computed)
