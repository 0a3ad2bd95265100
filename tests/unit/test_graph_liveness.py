"""passes/graph_liveness.py: the peak live bytes of hand-built fx graphs with known answers.

Every tensor is float32 (4 bytes an element), built on the meta device: a node's bytes are its numel x 4."""

import operator

import pytest
import torch
import torch.fx as fx

from gemcompile.passes.graph_liveness import peak_liveness

aten = torch.ops.aten
KB = 1024  # a (16, 16) float32 tensor


def _t(*shape):
    return torch.empty(*shape, device="meta")


class _Builder:
    """An fx graph whose nodes carry meta["val"], computed on meta tensors as they are added."""

    def __init__(self):
        self.graph = fx.Graph()

    def input(self, name, val):
        node = self.graph.placeholder(name)
        node.meta["val"] = val
        return node

    def op(self, target, *args, **kwargs):
        """A call of ``target``, named as ``op`` does in AOTAutograd's graphs (``relu``, ``relu_1``)."""
        base = target.__name__.split(".")[0] if target is not operator.getitem else "getitem"
        node = self.graph.create_node("call_function", target, args, kwargs, name=base)
        vals = fx.node.map_arg(args, lambda n: n.meta["val"])
        node.meta["val"] = target(*vals, **kwargs)
        return node

    def output(self, *nodes):
        self.graph.output(tuple(nodes))
        return self.graph


def _relu_neg_sin():
    """x -> a = relu -> b = neg -> c = sin, each (16, 16): the builder, a and c."""
    g = _Builder()
    a = g.op(aten.relu.default, g.input("x", _t(16, 16)))
    c = g.op(aten.sin.default, g.op(aten.neg.default, a))
    return g, a, c


def _chain():
    """relu -> neg -> sin: a is freed after b, so at most two are alive: 2 KiB at b."""
    g, _, c = _relu_neg_sin()
    return g.output(c), 2 * KB, "neg"


def _diamond():
    """a feeds b and c, d = b + c: at c (sin), a, b and c alive: 3 KiB (a is freed after c; at d, b, c and
    d: 3 KiB again, not a new peak)."""
    g = _Builder()
    x = g.input("x", _t(16, 16))
    a = g.op(aten.relu.default, x)
    b = g.op(aten.neg.default, a)
    c = g.op(aten.sin.default, a)
    d = g.op(aten.add.Tensor, b, c)
    return g.output(d), 3 * KB, "sin"


def _views():
    """a, a view of a and a transpose of that view: one buffer (1 KiB), kept alive by its last view's
    reader; e = exp(t) allocates 1 KiB more: 2 KiB, never 4."""
    g = _Builder()
    x = g.input("x", _t(16, 16))
    a = g.op(aten.relu.default, x)
    v = g.op(aten.view.default, a, [256])
    v2 = g.op(aten.view.default, v, [16, 16])
    t = g.op(aten.t.default, v2)
    e = g.op(aten.exp.default, t)
    return g.output(e), 2 * KB, "exp"


def _multi_output():
    """var_mean allocates both its outputs ((16, 1) each: 64 B) at once, alive with the (16, 16) relu it
    reads: 1 KiB + 128 B."""
    g = _Builder()
    x = g.input("x", _t(16, 16))
    a = g.op(aten.relu.default, x)
    vm = g.op(aten.var_mean.correction, a, [1], correction=0, keepdim=True)
    var = g.op(operator.getitem, vm, 0)
    mean = g.op(operator.getitem, vm, 1)
    s = g.op(aten.add.Tensor, var, mean)
    return g.output(s), KB + 128, "var_mean"


def _output_kept():
    """The chain with a an output, kept to the end: at c, a, b and c are alive (3 KiB; the chain: 2 KiB)."""
    g, a, c = _relu_neg_sin()
    return g.output(a, c), 3 * KB, "sin"


@pytest.mark.parametrize("build", [_chain, _diamond, _views, _multi_output, _output_kept])
def test_peak_of_a_hand_built_graph(build):
    graph, want, at = build()
    peak = peak_liveness(graph)
    assert (peak.nbytes, peak.node) == (want, at)
    assert peak.op.startswith(f"aten.{at}") and peak.saved_bytes == peak.tangent_bytes == 0
    assert peak.produced_bytes == want == sum(v.nbytes for v in peak.top)


def test_split_is_views_and_getitem_names_the_output():
    g = _Builder()
    x = g.input("x", _t(16, 16))
    a = g.op(aten.relu.default, x)
    parts = g.op(aten.split.Tensor, a, 8)
    first = g.op(operator.getitem, parts, 0)
    e = g.op(aten.exp.default, first)  # reads a view: a stays alive, e adds 512 B
    peak = peak_liveness(g.output(e))
    assert peak.nbytes == KB + 512 and peak.node == "exp"
    assert [(v.name, v.nbytes) for v in peak.top] == [("relu", KB), ("exp", 512)]

    g = _Builder()
    x = g.input("x", _t(16, 16))
    vm = g.op(aten.var_mean.correction, x, [1], correction=0, keepdim=True)
    mean = g.op(operator.getitem, vm, 1)
    peak = peak_liveness(g.output(mean))
    names = {v.name: v.op for v in peak.top}
    assert names == {"var_mean[0]": "aten.var_mean.correction[0]", "getitem": "aten.var_mean.correction[1]"}


def test_counted_inputs_split_saved_tangents_and_produced():
    """A backward-like graph: a saved value (1 KiB) and a tangent (1 KiB) counted from the start, the
    saved one freed after its last reader; an uncounted input (a parameter) adds nothing."""
    g = _Builder()
    saved = g.input("saved", _t(16, 16))
    weight = g.input("weight", _t(16, 16))
    tangent = g.input("tangents_1", _t(16, 16))
    a = g.op(aten.mul.Tensor, saved, tangent)  # saved, tangent, a: 3 KiB
    b = g.op(aten.mm.default, a, weight)  # saved dead; tangent dead; a, b: 2 KiB
    graph = g.output(b)
    peak = peak_liveness(graph, counted_inputs={"saved", "tangents_1"})
    assert (peak.nbytes, peak.node) == (3 * KB, "mul")
    assert (peak.saved_bytes, peak.tangent_bytes, peak.produced_bytes) == (KB, KB, KB)
    assert {v.kind for v in peak.top} == {"saved", "tangent", "produced"}
    assert peak_liveness(graph).nbytes == 2 * KB  # inputs not counted: a and b at mm
