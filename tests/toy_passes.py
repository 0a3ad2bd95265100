"""Small passes that exercise the pass machinery (registry, managers, uuid, explain) in tests."""

import operator

import torch
import torch.fx as fx

from gemcompile.passes.base import GemPass
from gemcompile.passes.records import describe_nodes


class MulByTwoToAdd(GemPass):
    """pre-grad: `x * 2` -> `x + x` (the same value, so compiled output must equal eager)."""

    name = "mul_by_two_to_add"
    stage = "pre_grad"
    config_section = "jagged_attention"  # borrows a section so that its knobs reach the uuid

    def run(self, graph: fx.Graph) -> None:
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target is not operator.mul or len(node.args) != 2:
                continue
            if node.args[1] != 2:
                self.refused(node, f"multiplies by {node.args[1]!r}, not by 2")
                continue
            before = describe_nodes([node])
            with graph.inserting_before(node):
                new = graph.call_function(operator.add, (node.args[0], node.args[0]))
            new.meta.update(node.meta)
            node.replace_all_uses_with(new)
            graph.erase_node(node)
            self.rewrote(new, before, [new])


class CountMatmulsJoint(GemPass):
    """joint: counts aten.mm nodes of the joint graph (no change) so tests can see the stage ran."""

    name = "count_mm_joint"
    stage = "joint"
    seen: list[int] = []

    def run(self, graph: fx.Graph) -> None:
        CountMatmulsJoint.seen.append(sum(1 for n in graph.nodes if n.target is torch.ops.aten.mm.default))


class CountNodesPostGrad(GemPass):
    """post-grad: records the size of each forward/backward graph it sees."""

    name = "count_nodes_post_grad"
    stage = "post_grad"
    config_section = "jagged_attention"  # so that a knob change reaches a slot's uuid
    seen: list[int] = []

    def run(self, graph: fx.Graph) -> None:
        CountNodesPostGrad.seen.append(len(graph.nodes))


TOY_PIPELINE = (MulByTwoToAdd, CountMatmulsJoint, CountNodesPostGrad)
