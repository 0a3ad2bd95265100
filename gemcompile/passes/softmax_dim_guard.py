"""A softmax over a dim other than the last, spelled over the last dim between two transposes.

Inductor's attention patterns (torch/_inductor/fx_passes/fuse_attention.py) match a softmax without reading
its dim (pytorch/pytorch#196468, open, "correctness (silent)"): ``softmax(q @ k^T / c, dim=-2) @ v`` (RecBole's
LightSANs normalizes its low-rank attention over the queries) becomes ``scaled_dot_product_attention``, a
softmax over the keys, under plain torch.compile too. ``softmax(x.transpose(d, -1), -1).transpose(d, -1)`` has
the same values and gradient, and no pattern takes it (they lead the softmax's output straight to the matmul).
gem_compile applies it to every graph it compiles, after its own passes (which refuse such a softmax, naming
the dim).
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch._dynamo.utils import counters

from gemcompile.passes.graph import Emitter, example_value, target_name


def _dim(node: fx.Node) -> tuple[int, int | None] | None:
    """(position of the dim argument, its value normalized) for a softmax call, else None."""
    if node.op not in ("call_function", "call_method") or target_name(node) != "softmax" or not node.args:
        return None
    value = example_value(node)
    if not isinstance(value, torch.Tensor) or value.dim() < 2:
        return None
    if "dim" in node.kwargs:
        dim, at = node.kwargs["dim"], "dim"
    elif len(node.args) > 1:
        dim, at = node.args[1], 1
    else:
        return None  # the legacy implicit dim (deprecated): left as written
    if not isinstance(dim, int):
        return None
    return at, dim % value.dim()


def guard_softmax_dims(gm: fx.GraphModule) -> int:
    """Rewrite each softmax over a dim other than the last (module doc); the number rewritten."""
    graph, count = gm.graph, 0
    for node in list(graph.nodes):
        found = _dim(node)
        if found is None or found[1] == example_value(node).dim() - 1:
            continue
        at, dim = found
        emit = Emitter(graph)
        with graph.inserting_before(node):
            moved = emit.call(torch.transpose, (node.args[0], dim, -1))
            args, kwargs = (moved, *node.args[1:]), dict(node.kwargs)
            if at == "dim":
                kwargs["dim"] = -1
            else:
                args = (moved, -1, *node.args[2:])
            softmax = emit.node(node.op, node.target, args, kwargs)
            back = emit.call(torch.transpose, (softmax, dim, -1))
        node.replace_all_uses_with(back)
        graph.erase_node(node)
        count += 1
    if count:
        counters["gemcompile"]["softmax_dim_guard"] += count
        gm.recompile()
    return count
