"""Masks built under torch.vmap, rewritten as the broadcast ops they equal.

Hugging Face's masking utilities (transformers >= 4.53: GPT-2, Llama, Qwen2, Mistral... in eager and SDPA
mode) build the 4-D attention mask by vmapping a mask function of scalar indices over batch, head, query
and key: ``vmap(vmap(vmap(vmap(fn))))(batch_arange, head_arange, cache_position, kv_arange)`` where ``fn``
reads ``padding_mask[b, kv]`` and compares ``kv <= q``. Dynamo records this as functorch's pre-dispatch ops
(``_add_batch_dim(x, in_dim, level)``, the mask function's ops on 0-d values, ``_remove_batch_dim(x,
level, size, out_dim)``, and the nesting calls), which the mask prover does not model.

This rewrite does what vmap's batching rules do, with plain broadcasting: each batched value becomes a
physical tensor with one leading dim per vmap level of the graph (size 1 where the value is not batched at
that level) followed by its logical dims. Elementwise ops broadcast those directly (logical dims padded to
one rank first), ``aten.index`` with batched index tensors is advanced indexing over broadcast indices, and
``_remove_batch_dim`` moves the level's dim into the logical dims. The mask that comes out is the same
tensor, built by ops the prover reads (``padding_mask[b_idx, kv_idx]`` over broadcast index tensors, as
transformers 5 writes it). A region holding any other op on a batched value is left as written (the
prover then refuses it, naming the op).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from gemcompile.passes.graph import Emitter, example_value, target_name

_ADD, _REMOVE = "_add_batch_dim", "_remove_batch_dim"
_NESTING = ("_vmap_increment_nesting", "_vmap_decrement_nesting", "lazy_load_decompositions")
_ELEMENTWISE = {
    "le", "lt", "ge", "gt", "eq", "ne", "__le__", "__lt__", "__ge__", "__gt__", "__eq__", "__ne__", "__and__",
    "__or__", "__xor__", "__rand__", "__ror__", "__invert__", "and_", "or_", "xor",
    "invert", "logical_and", "logical_or", "logical_not", "logical_xor", "bitwise_and", "bitwise_or",
    "bitwise_not", "add", "__add__", "__radd__", "sub", "__sub__", "__rsub__", "mul", "__mul__", "__rmul__",
    "floordiv", "__floordiv__", "remainder", "__mod__", "mod", "abs", "neg", "where", "to", "bool", "int",
    "long", "float", "type_as", "clone", "contiguous",
}
"""Ops applied element by element (their batching rule is broadcasting), by name."""
_FACTORIES = ("new_ones", "new_zeros", "new_full", "new_empty", "new_tensor")
"""Methods whose result reads only the shape and dtype given, not the batched tensor's values."""


def _is(node: fx.Node, *names: str) -> bool:
    return node.op in ("call_function", "call_method") and target_name(node) in names


def _tensor_indexing(node: fx.Node) -> bool:
    """``pm[b, kv]`` with a tensor for every index (without transformers' getitem-to-index rewrite)."""
    index = node.args[1] if node.target is operator.getitem and len(node.args) == 2 else None
    if isinstance(index, fx.Node):  # n[b]: one integer index tensor (a bool one would select, not index)
        value = example_value(index)
        return isinstance(value, torch.Tensor) and not value.is_floating_point() and value.dtype != torch.bool
    return isinstance(index, tuple) and bool(index) and all(isinstance(i, fx.Node) for i in index)


class _Unsupported(Exception):
    """A batched value meets an op this rewrite does not model: leave the region as written."""


class _Lowering:
    """One graph's vmap ops lowered to broadcast ops (module doc); ``phys[node] = (physical node, logical
    ndim, batched levels)`` for each batched value."""

    def __init__(self, graph: fx.Graph, levels: list[int]):
        self.graph, self.emit = graph, Emitter(graph, untraceable=None)
        self.slot = {level: i for i, level in enumerate(levels)}  # level -> leading physical dim
        self.depth = len(levels)
        self.phys: dict[fx.Node, tuple[fx.Node, int, frozenset[int]]] = {}
        self.results: list[tuple[fx.Node, fx.Node]] = []  # (outermost _remove_batch_dim, its plain tensor)

    def _batched(self, x) -> bool:
        return isinstance(x, fx.Node) and x in self.phys

    def _physical(self, x, rank: int):
        """x as a physical tensor whose logical dims are padded (size-1 dims in front) to ``rank``."""
        if not isinstance(x, fx.Node):
            return x  # a Python scalar broadcasts as is
        if x in self.phys:
            node, ndim, _ = self.phys[x]
        else:
            value = example_value(x)
            if not isinstance(value, torch.Tensor):
                return x
            node, ndim = x, value.dim()
            for _ in range(self.depth):
                node = self.emit.method("unsqueeze", (node, 0))
        for _ in range(rank - ndim):
            node = self.emit.method("unsqueeze", (node, self.depth))
        return node

    def _movedim(self, p: fx.Node, ndim: int, src: int, dst: int) -> fx.Node:
        order = [d for d in range(ndim) if d != src]
        order.insert(dst, src)
        return p if order == list(range(ndim)) else self.emit.method("permute", (p, *order))

    def _drop(self, p: fx.Node, dims: int, at: int = 0) -> fx.Node:
        """p without its size-1 dims at..at+dims-1 (read at index 0: an op the prover models)."""
        return self.emit.call(operator.getitem, (p, (slice(None),) * at + (0,) * dims))

    def _elementwise(self, node: fx.Node) -> None:
        tensors = [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, fx.Node)]
        ranks = [self.phys[a][1] if a in self.phys else getattr(example_value(a), "ndim", 0) for a in tensors]
        rank = max(ranks, default=0)
        levels = frozenset().union(*(self.phys[a][2] for a in tensors if a in self.phys))
        args = tuple(self._physical(a, rank) for a in node.args)
        kwargs = {k: self._physical(v, rank) for k, v in node.kwargs.items()}
        self.phys[node] = (self.emit.node(node.op, node.target, args, kwargs), rank, levels)

    def _index(self, node: fx.Node) -> None:
        """aten.index(t, [i, j, ...]) on an unbatched t: advanced indexing over the indices broadcast."""
        source, indices = node.args[0], node.args[1]
        indices = (indices,) if isinstance(indices, fx.Node) else indices
        if self._batched(source) or any(i is None for i in indices) or len(node.args) != 2:
            raise _Unsupported(f"{node.name}: index of a batched tensor or with a None index")
        rank = max(self.phys[i][1] if i in self.phys else example_value(i).dim() for i in indices)
        levels = frozenset().union(*(self.phys[i][2] for i in indices if i in self.phys))
        physical = [self._physical(i, rank) for i in indices]
        out = self.emit.call(operator.getitem, (source, tuple(physical)))  # = aten.index over tensors
        self.phys[node] = (out, rank + example_value(source).dim() - len(indices), levels)

    def _add(self, node: fx.Node) -> None:
        x, in_dim, level = node.args
        rank = self.phys[x][1] if x in self.phys else example_value(x).dim()
        levels = self.phys[x][2] if x in self.phys else frozenset()
        slot = self.slot[level]
        p = self._drop(self._physical(x, rank), 1, at=slot)
        p = self._movedim(p, self.depth - 1 + rank, self.depth - 1 + in_dim % rank, slot)
        self.phys[node] = (p, rank - 1, levels | {level})

    def _remove(self, node: fx.Node) -> None:
        x, level, size, out_dim = node.args
        p, rank, levels = self.phys[x]
        slot = self.slot[level]
        if level not in levels:  # not batched at this level: vmap's output repeats it along the new dim
            p = self.emit.method("expand", (p, *[size if d == slot else -1 for d in range(self.depth + rank)]))
        p = self._movedim(p, self.depth + rank, slot, self.depth - 1 + out_dim % (rank + 1))
        p = self.emit.method("unsqueeze", (p, slot))
        levels = levels - {level}
        if levels or level != min(self.slot):
            self.phys[node] = (p, rank + 1, levels)
            return
        p = self._drop(p, self.depth)  # out of the outermost vmap: a plain tensor again
        self.results.append((node, p))

    def run(self, nodes: list[fx.Node]) -> None:
        for node in nodes:
            if node.op not in ("call_function", "call_method"):
                if any(self._batched(a) for a in node.all_input_nodes):
                    raise _Unsupported(f"{node.name} reads a batched value")
                continue
            with self.graph.inserting_before(node):
                if _is(node, _ADD):
                    self._add(node)
                elif _is(node, _REMOVE):
                    self._remove(node)
                elif not any(self._batched(a) for a in node.all_input_nodes):
                    continue
                elif _is(node, *_FACTORIES):  # reads the batched tensor's dtype and device only: unbatched
                    out = self.emit.node(node.op, node.target, (self.phys[node.args[0]][0], *node.args[1:]),
                                         dict(node.kwargs))
                    self.phys[node] = (self._physical(out, 0), example_value(out).dim(), frozenset())
                elif _is(node, "index") and node.op == "call_function" or _tensor_indexing(node):
                    self._index(node)
                elif _is(node, *_ELEMENTWISE):  # operator.and_ etc. too: their names are listed
                    self._elementwise(node)
                else:
                    raise _Unsupported(f"`{target_name(node)}` ({node.name}) on a batched value")


def lower_vmapped_masks(graph: fx.Graph) -> int:
    """Rewrite the graph's vmap regions (module doc); returns how many plain tensors left vmap (0: none,
    or the regions left as written)."""
    adds = [n for n in graph.nodes if _is(n, _ADD)]
    if not adds or any(not isinstance(n.args[2], int) or not isinstance(n.args[1], int) for n in adds):
        return 0
    nodes = list(graph.nodes)
    lowering = _Lowering(graph, sorted({n.args[2] for n in adds}))
    try:
        lowering.run(nodes)
    except Exception:  # noqa: BLE001 (_Unsupported, or an op the fake mode cannot run on the physical shapes)
        lowering.emit.rollback()
        return 0
    gone = {*lowering.phys, *(node for node, _ in lowering.results),
            *(n for n in nodes if _is(n, _ADD, _REMOVE, *_NESTING))}
    outermost = {node for node, _ in lowering.results}
    if any(u not in gone for n in gone - outermost for u in n.users):
        lowering.emit.rollback()  # a batched value read outside vmap: not a region this rewrite understands
        return 0
    for node, plain in lowering.results:
        node.replace_all_uses_with(plain)
    for node in reversed(nodes):
        if node in gone:
            graph.erase_node(node)
    return len(lowering.results)
