"""passes/graph.py hoist_before: a value the model computes after a node is moved before it, with what it
reads, unless it depends on that node or an in-place op lies between them."""

import operator

import pytest
import torch
import torch.fx as fx

from gemcompile.passes.graph import Unproven, hoist_before


def _graph(between_in_place: bool = False):
    """x -> attention (anchor) -> out; lengths -> count, computed after the anchor (its own input chain)."""
    g = fx.Graph()
    x, lengths = g.placeholder("x"), g.placeholder("lengths")
    anchor = g.call_function(torch.relu, (x,))
    if between_in_place:
        g.call_method("add_", (lengths, 1))
    doubled = g.call_function(operator.mul, (lengths, 2))
    count = g.call_function(torch.clamp, (doubled,), {"max": 7})
    from_anchor = g.call_function(torch.sum, (anchor,))
    g.output((anchor, count, from_anchor))
    return g, anchor, doubled, count, from_anchor


def test_a_late_value_and_its_producers_move_before_the_anchor_in_order():
    g, anchor, doubled, count, _ = _graph()
    hoist_before(count, anchor)
    order = list(g.nodes)
    assert order.index(doubled) < order.index(count) < order.index(anchor)
    g.lint()  # every node is defined before its uses
    x, lengths = torch.randn(3), torch.tensor([1, 5])
    out = fx.GraphModule(torch.nn.Module(), g)(x, lengths)
    torch.testing.assert_close(out[1], torch.tensor([2, 7]))


def test_a_value_already_before_the_anchor_stays():
    g, anchor, _, count, _ = _graph()
    before = list(g.nodes)
    hoist_before(next(n for n in g.nodes if n.name == "x"), anchor)
    assert list(g.nodes) == before


def test_a_value_that_reads_the_anchor_is_refused():
    g, anchor, _, _, from_anchor = _graph()
    with pytest.raises(Unproven, match="depends on the attention's output"):
        hoist_before(from_anchor, anchor)


def test_an_in_place_op_between_refuses_the_move():
    g, anchor, _, count, _ = _graph(between_in_place=True)
    with pytest.raises(Unproven, match="past an in-place op"):
        hoist_before(count, anchor)


def test_a_value_that_reads_a_fixed_node_is_refused_and_nothing_moves():
    """unpad keeps its region's members where they are: a token vector read computed from one stays after."""
    g, anchor, doubled, count, _ = _graph()
    before = list(g.nodes)
    with pytest.raises(Unproven, match=f"depends on {doubled.name}, which stays after"):
        hoist_before(count, anchor, fixed={doubled})
    assert list(g.nodes) == before
