"""passes/records.py: where a graph input came from in the call (input_path)."""

import torch

from gemcompile import explain
from gemcompile.passes.records import input_path


def _placeholders(fn, *args, **kwargs):
    report = explain(fn, *args, **kwargs)
    return {n.name: n for n in report.graph_before.graph.nodes if n.op == "placeholder"}


def test_input_path_follows_list_items_and_keywords():
    def fn(x, lengths):
        return x * lengths[1][:, None]

    nodes = _placeholders(fn, torch.randn(4, 3), lengths=[torch.ones(4), torch.ones(4)])
    paths = {input_path(n) for n in nodes.values()}
    assert ("x",) in paths and ("lengths", 1) in paths
    assert ("lengths", 0) not in paths  # unused: Dynamo makes no placeholder of it


def test_input_path_is_none_for_other_nodes():
    def fn(x):
        return x + 1

    report = explain(fn, torch.randn(2))
    nodes = [n for n in report.graph_before.graph.nodes if n.op != "placeholder"]
    assert nodes and all(input_path(n) is None for n in nodes)


def test_a_node_a_pass_inserted_is_located_at_the_nearest_source_it_reads():
    """Refusals anchored at a node a pass inserted (no stack trace of its own) name where the model computed
    what it reads, not '?'."""
    from torch import fx

    from gemcompile.passes.records import source_location

    graph = fx.Graph()
    x = graph.placeholder("x")
    linear = graph.call_function(torch.relu, (x,))
    linear.meta["stack_trace"] = '  File "/src/model.py", line 12, in forward\n    h = torch.relu(x)\n'
    inserted = graph.call_method("view", (linear, -1))
    graph.output(inserted)
    location = source_location(inserted)
    assert location is not None and (location.file, location.line) == ("/src/model.py", 12)
    assert source_location(x) is None  # nothing to fall back to
