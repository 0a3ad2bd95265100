"""Attention outputs whose padded query rows the model zeroes (``o * valid[:, None, :, None]``, ``where``,
``masked_fill``) still run packed end to end (passes/unpad_zeroed_rows.py).

The attention passes fold such a zeroing into the op's q_lengths, so the op writes those rows as 0; the
unpad pass drops the zeroing that is left (it changes nothing) and the stack packs from one gather to one
scatter, both attentions on packed tokens, as the same stack without the zeroing does. Near-misses keep the
zeroing and stay exact: rows zeroed by other lengths than the op's, a zeroing that also scales, a product
that promotes the dtype.
"""

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from gemcompile import explain
from gemcompile.passes.unpad_zeroed_rows import drop_zeroed_query_rows
from tests.compiled_vs_eager import assert_compiled_matches_eager

from tests.integration.test_unpad_packed_self_attention import LENGTHS, B, D, N, PermuteHeadsLayer

ZEROINGS = {
    "mul_bool": lambda o, rows: o * rows,
    "mul_cast": lambda o, rows: o * rows.to(o.dtype),
    "mul_float": lambda o, rows: rows.float() * o,
    "where": lambda o, rows: torch.where(rows, o, 0.0),
    "masked_fill": lambda o, rows: o.masked_fill(~rows, 0.0),
}
NEAR_MISSES = {
    # (zeroing, expected (zeroings dropped, GEMMs packed, packed attentions) of the one-layer stack)
    # the zeroing by shorter rows is folded into the op's q_lengths and dropped like any other, but the op's
    # query rows are not the region's: it stays padded (q, k, v scattered to it, its output gathered back)
    "other_lengths": (lambda o, rows, shorter: o * shorter, (1, 5, {})),
    # a zeroing that also scales is no zeroing: kept; q stays padded, k and v go in packed (the PMA layout)
    "scaled": (lambda o, rows, shorter: o * (rows.to(o.dtype) * 0.5), (0, 4, {"jagged_attention": 1})),
    # float64 out of a float32 attention: the product is no identity on the op's output (its dtype), so it
    # stays; the op's q_lengths (folded from it) rule out the packed-keys layout: the attention stays padded
    "promoted": (lambda o, rows, shorter: (o * rows.double()).float(), (0, 4, {})),
}


class Layer(PermuteHeadsLayer):
    """The BERT-style layer of test_unpad_packed_self_attention.py with the padded query rows of its attention
    output zeroed by ``zero``."""

    def __init__(self, zero):
        super().__init__()
        self.zero = zero

    def forward(self, x, valid, shorter):
        o = self.zero(self.attend(x, valid), valid[:, None, :, None], shorter[:, None, :, None])
        o = o.permute(0, 2, 1, 3).contiguous()
        x = self.norm(x + self.o(o.view(o.size()[:-2] + (D,))))
        return x + F.gelu(self.ff(x))


class Stack(nn.Module):
    def __init__(self, zero, layers=2):
        super().__init__()
        self.layers = nn.ModuleList(Layer(zero) for _ in range(layers))

    def forward(self, x, lengths):
        valid = torch.arange(N)[None, :] < lengths[:, None]
        shorter = torch.arange(N)[None, :] < (lengths[:, None] - 1)
        for layer in self.layers:
            x = layer(x, valid, shorter)
        return x * valid[..., None]


def _unpad(report):
    return [r.metrics for r in report.rewrites if r.pass_name == "unpad"]


def _inputs():
    torch.manual_seed(0)
    return torch.randn(B, N, D, requires_grad=True), LENGTHS


@pytest.mark.parametrize("spelling", sorted(ZEROINGS))
def test_zeroed_attention_rows_run_packed(spelling):
    model = Stack(lambda o, rows, shorter: ZEROINGS[spelling](o, rows))
    x, lengths = _inputs()
    (metrics,) = _unpad(explain(model, x, lengths))
    assert metrics["packed_attention"] == {"jagged_attention": 2}
    assert (metrics["gathers"], metrics["scatters"]) == (1, 1)
    assert metrics["gemms"] == 10 and metrics["zeroings_dropped"] == 2
    assert_compiled_matches_eager(model, x, lengths)


@pytest.mark.parametrize("miss", sorted(NEAR_MISSES))
def test_near_misses(miss):
    zero, (dropped, gemms, attention) = NEAR_MISSES[miss]
    model = Stack(zero, layers=1)
    x, lengths = _inputs()
    (metrics,) = _unpad(explain(model, x, lengths))
    assert (metrics["zeroings_dropped"], metrics["gemms"], metrics["packed_attention"]) == \
        (dropped, gemms, attention)
    assert_compiled_matches_eager(model, x, lengths)


def test_an_op_without_query_lengths_keeps_its_zeroing():
    """The drop needs the op to write the rows as 0 (its q_lengths): a zeroing of an op that computes every
    row stays."""
    graph = fx.Graph()
    out = graph.placeholder("out")
    rows = graph.placeholder("rows")
    product = graph.call_function(torch.mul, (out, rows))
    graph.output(product)
    assert drop_zeroed_query_rows(graph) == []
    assert product in graph.nodes
