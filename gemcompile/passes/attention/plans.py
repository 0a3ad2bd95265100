"""One batch order and one set of key bounds per lengths (or key mask) tensor per step, shared by every
attention op of the graph and saved for the backward (issue 24).

The attention kernels order their programs longest sequence first and, with a key mask, visit only each
sample's key bounds; each op call used to derive both from its lengths and mask again, forward and
backward (``_rank_kernel`` 44 times per GEM-ref step on the H200, for a few distinct lengths). After the
families have rewritten the graph, :func:`share_derived_tensors` gives every attention op
(``gemcompile::jagged_attention``, ``gdpa``, ``block_attention``) its derived tensors as inputs:

* ``kv_order`` = ``gemcompile::length_order(kv_lengths)``; with a kv_mask the order and ``kv_bounds`` of one
  ``gemcompile::key_bounds(kv_mask, kv_lengths)`` (block attention takes only the bounds);
* ``q_order`` = ``gemcompile::length_order(q_lengths)``.

One node per distinct input: lengths operands that are the same pure expression of the same graph values
(each site clamps the model's lengths itself: ``clamp(lengths, 0, L)``) share one node, inserted before the
first op that reads it. Graphs holding an in-place op compare nodes by identity only (an expression may read
a value that changed in between); AOTAutograd's CSE, after functionalization, merges what is left. Being an
opaque custom op, the derived node is never recomputed by the partitioner: its output is saved for the
backward ops, which then derive nothing. The values are exactly what the kernels would derive themselves,
so no output changes (the ops refuse wrong ones on CPU: CI checks this wiring on every rewritten graph).
"""

from __future__ import annotations

import logging
import operator
from typing import Any

import torch
import torch.fx as fx

from gemcompile.passes.graph import Emitter, example_value, schema_arguments, target_name

__all__ = ["share_derived_tensors"]

log = logging.getLogger(__name__)

# The pure, deterministic ops that lengths and key-mask expressions are made of (what the passes emit and
# what models write): nodes of these with equal inputs hold equal values.
_PURE = frozenset({
    "clamp", "clamp_min", "clamp_max", "add", "sub", "mul", "floordiv", "mod", "neg", "ne", "eq", "lt", "le",
    "gt", "ge", "and_", "or_", "xor", "invert", "logical_and", "logical_or", "logical_not", "bitwise_and",
    "bitwise_or", "bitwise_not", "__and__", "__or__", "__invert__", "getitem", "expand", "expand_as", "to",
    "bool", "int", "long", "view", "reshape", "unsqueeze", "squeeze", "flip", "arange", "full", "ones",
    "zeros", "sym_size", "size", "where", "sum", "any", "all", "cumsum", "type", "contiguous",
})


def _attention_ops() -> dict:
    ops = torch.ops.gemcompile
    return {ops.jagged_attention.default: "kv", ops.jagged_attention_lse.default: "kv", ops.gdpa.default: "kv",
            ops.block_attention.default: "block"}


def _mutates(node: fx.Node) -> bool:
    if node.op not in ("call_function", "call_method"):
        return False
    if node.op == "call_function" and node.target in (operator.setitem, operator.iadd, operator.isub,
                                                      operator.imul, operator.iand, operator.ior):
        return True
    if isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable:
        return True
    if node.op == "call_function" and node.target in (operator.and_, operator.or_, operator.not_, operator.is_):
        return False  # operator's names, not in-place methods
    name = target_name(node)
    return name.endswith("_") and not name.endswith("__")


def _set_arguments(node: fx.Node, values: dict[str, fx.Node]) -> None:
    """Set schema arguments of ``node``: in place where given by position, else as keywords."""
    names = [a.name for a in node.target._schema.arguments]
    args, kwargs = list(node.args), dict(node.kwargs)
    for name, value in values.items():
        i = names.index(name)
        if i < len(args):
            args[i] = value
        else:
            kwargs[name] = value
    node.args, node.kwargs = tuple(args), kwargs


class _Shared:
    """The derived nodes of one graph, by the structural key of their inputs."""

    def __init__(self, graph: fx.Graph):
        self.graph = graph
        self.emit = Emitter(graph)
        self.structural = not any(_mutates(n) for n in graph.nodes)
        self.nodes: dict[Any, Any] = {}
        self.keys: dict[fx.Node, Any] = {}

    def key(self, a) -> Any:
        if isinstance(a, (list, tuple)):
            return (type(a).__name__, *(self.key(x) for x in a))
        if isinstance(a, dict):
            return ("dict", *((k, self.key(v)) for k, v in sorted(a.items())))
        if not isinstance(a, fx.Node):
            return ("const", type(a).__name__, repr(a))
        if a in self.keys:
            return self.keys[a]
        key: Any = a
        if self.structural and a.op in ("call_function", "call_method") and target_name(a) in _PURE:
            key = (a.op, a.target, self.key(a.args), self.key(dict(a.kwargs)))
        self.keys[a] = key
        return key

    @staticmethod
    def _index_vector(node) -> bool:
        value = example_value(node)
        return (isinstance(node, fx.Node) and isinstance(value, torch.Tensor) and value.dim() == 1
                and value.dtype in (torch.int32, torch.int64))

    def order(self, lengths, before: fx.Node):
        """The length_order node of ``lengths`` (None when it is none or no 1-D int tensor)."""
        if lengths is None or not self._index_vector(lengths):
            return None
        key = ("order", self.key(lengths))
        if key not in self.nodes:
            with self.graph.inserting_before(before):
                self.nodes[key] = self.emit.call(torch.ops.gemcompile.length_order.default, (lengths,))
        return self.nodes[key]

    def bounds(self, kv_mask, lengths, before: fx.Node):
        """(bounds, order) nodes of key_bounds(kv_mask, lengths)."""
        value = example_value(kv_mask)
        if not isinstance(value, torch.Tensor) or value.dim() != 2 or value.dtype != torch.bool:
            return None, None
        if lengths is not None and not self._index_vector(lengths):
            return None, None
        key = ("bounds", self.key(kv_mask), self.key(lengths))
        if key not in self.nodes:
            with self.graph.inserting_before(before):
                both = self.emit.call(torch.ops.gemcompile.key_bounds.default, (kv_mask, lengths))
                self.nodes[key] = (self.emit.call(operator.getitem, (both, 0)),
                                   self.emit.call(operator.getitem, (both, 1)))
        return self.nodes[key]


def _unless_full(lengths, kv_mask):
    """None for lengths that keep every key (``torch.full((B,), L)``, what the block family passes with a key
    mask from data): the bounds of (mask, None) are the same, and so is the node the other ops share."""
    L = example_value(kv_mask).shape[1]
    if (isinstance(lengths, fx.Node) and lengths.op == "call_function" and lengths.target is torch.full
            and len(lengths.args) == 2 and isinstance(lengths.args[1], int) and lengths.args[1] >= L):
        return None
    return lengths


def share_derived_tensors(graph: fx.Graph) -> int:
    """Give every attention op of ``graph`` its derived tensors (module docstring); returns how many derived
    nodes were emitted. Arguments already given are kept."""
    kinds = _attention_ops()
    shared = _Shared(graph)
    changed: list[tuple[fx.Node, tuple, dict]] = []
    try:
        _share(graph, kinds, shared, changed)
    except Exception:  # an optimization only: on any failure the ops derive their own, as before
        log.warning("gemcompile: the attention ops' derived tensors are not shared (each call derives its own)",
                    exc_info=True)
        for node, args, kwargs in changed:
            node.args, node.kwargs = args, kwargs
        shared.emit.rollback()
        return 0
    return len(shared.emit.created)


def _share(graph: fx.Graph, kinds: dict, shared: _Shared, changed: list) -> None:
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in kinds:
            continue
        call = schema_arguments(node)
        mask = call["kv_mask"]
        new: dict[str, fx.Node] = {}
        if kinds[node.target] == "block":
            if mask is not None and call["kv_bounds"] is None:
                bounds, _ = shared.bounds(mask, _unless_full(call["lengths"], mask), node)
                if bounds is not None:
                    new["kv_bounds"] = bounds
        else:
            if mask is not None:
                bounds, order = shared.bounds(mask, call["kv_lengths"], node)
                if bounds is not None and call["kv_bounds"] is None and call["kv_order"] is None:
                    new |= {"kv_bounds": bounds, "kv_order": order}
            elif call["kv_order"] is None:
                order = shared.order(call["kv_lengths"], node)
                if order is not None:
                    new["kv_order"] = order
            if call["q_order"] is None:
                order = shared.order(call["q_lengths"], node)
                if order is not None:
                    new["q_order"] = order
        if new:
            changed.append((node, node.args, dict(node.kwargs)))
            _set_arguments(node, new)
