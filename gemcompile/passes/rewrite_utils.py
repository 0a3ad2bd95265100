"""Small tools for passes that insert nodes into a Dynamo graph and remove what they replaced."""

from __future__ import annotations

import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_map

from gemcompile.passes.mask_provenance import example_value


class FakeRunner:
    """Inserts call_function nodes with ``meta["example_value"]`` computed on fake tensors, so later
    passes (ours and Inductor's pre-grad passes) see shapes on new nodes as on Dynamo's."""

    def __init__(self, graph: fx.Graph):
        self.graph = graph
        self.created: list[fx.Node] = []

    def rollback(self, mark: int) -> None:
        """Erase the nodes created since ``len(self.created) == mark`` (a rewrite that was abandoned)."""
        for node in reversed(self.created[mark:]):
            if not node.users:
                node.graph.erase_node(node)
        del self.created[mark:]

    def call(self, graph: fx.Graph, target, args: tuple, kwargs: dict | None = None) -> fx.Node:
        kwargs = kwargs or {}
        node = graph.call_function(target, args, kwargs)
        self.created.append(node)
        to_value = lambda a: example_value(a) if isinstance(a, fx.Node) else a  # noqa: E731
        fake_args, fake_kwargs = tree_map(to_value, args), tree_map(to_value, kwargs)
        # the mode the example values live in (the tracing context may hold another one)
        mode = next((a.fake_mode for a in (*fake_args, *fake_kwargs.values()) if isinstance(a, FakeTensor)), None)
        if mode is not None:
            with mode:
                node.meta["example_value"] = target(*fake_args, **fake_kwargs)
        return node


def _may_erase(node: fx.Node) -> bool:
    """Pure ops only: Dynamo graphs may hold in-place methods whose result is unused but whose effect is
    not (``x.add_(1)``), so a graph-wide dead-code pass is unsafe before functionalization."""
    if node.op not in ("call_function", "call_method") or node.users:
        return False
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    if name.endswith("_") and not name.endswith("__"):
        return False
    return not node.is_impure()


def erase_dead(nodes: list[fx.Node]) -> None:
    """Erase the given nodes and then their inputs, as long as each is pure and has no users left."""
    work = list(nodes)
    seen: set[fx.Node] = set()
    while work:
        node = work.pop()
        if node in seen or getattr(node, "_erased", False):
            continue
        if not _may_erase(node):
            continue
        seen.add(node)
        inputs = [a for a in node.all_input_nodes]
        node.graph.erase_node(node)
        work.extend(inputs)
