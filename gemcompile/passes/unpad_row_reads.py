"""The unpad pass's row reads: a reader that picks a few rows of a region's exit reads them packed.

A region (unpad.py) leaves its packed rows by a scatter, ``x = zeros(B, N, ...).index_put((b, n), P)``,
wherever something outside reads x. Recommender models often read only a few rows of a sequence's
output: the last valid token (SASRec, HSTU's current embedding), the k most recent (GEM-ref's sequence
summary), the first position (a BERT pooler). The scatter then writes B x N rows for a read of B x k. This
file rewrites those readers, on the graph the region rewrite left, to read the packed rows directly:

    x.gather(1, idx)          (idx: (B', K, *F') positions along N, any values torch.gather takes)
    x[:, c]  /  x.select(1, c)              (a constant position)
    x[torch.arange(B), idx]                 (one position per sequence, idx: (B,), negative from the end)

become ``packed_row_gather(P, rows)`` with ``rows = pos[b, position]`` read from a (B, N) map of packed
row numbers, ``pos = full((B, N), -1).index_put((b, n), arange(T))``: the exit's own index, so a position
holds its packed row exactly where the scatter wrote that row, and -1 (read as 0) where the scatter left
zeros. Every value read therefore equals the scattered tensor's value at that position: the rewrite is
exact whatever the exit's proof was, positions out of range fail as they did (gather and indexing of the
(B, N) map check them as those of x), and with token buckets the map takes the exit's extra batch row and
the slice that drops it, so slack rows are never read. The map is B x N integers, a small fraction of
x's B x N x F. A scatter left without readers is removed.
"""

from __future__ import annotations

import operator

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true as known

import gemcompile.lowering.packed_row_gather  # noqa: F401  registers gemcompile::packed_row_gather
from gemcompile.passes.graph import Emitter, erase_dead, example_value, size_argument, target_name
from gemcompile.passes.token_wise import node_argument, same_size, shape_of
from gemcompile.passes.unpad_attention import RegionIndex, scattered_rows

aten = torch.ops.aten


def _is_full_slice(s) -> bool:
    return isinstance(s, slice) and s == slice(None, None, None)


def _is_batch_arange(node, batch) -> bool:
    """``torch.arange(B)`` (or arange(0, B)), with at most a device / dtype given."""
    if not isinstance(node, fx.Node) or target_name(node) != "arange" or node.op != "call_function":
        return False
    bounds = list(node.args)
    if set(node.kwargs) - {"device", "dtype"} or len(bounds) not in (1, 2):
        return False
    if len(bounds) == 2 and bounds[0] != 0:
        return False
    return same_size(example_value(bounds[-1]), batch)  # (a size node under dynamic shapes)


def _within(position: int, seq) -> bool:
    """-seq <= position < seq, known without a guard (seq may be symbolic)."""
    return known(-seq <= position) and known(position < seq)


def _read_form(user: fx.Node, x: fx.Node, seq) -> tuple[str, object] | None:
    """("gather", idx), ("position", c) or ("per_batch", idx) when ``user`` reads rows of x (B, N, *F) in
    one of the module doc's forms; None otherwise."""
    shape = shape_of(x)
    name = target_name(user)
    if name == "gather" and user.op in ("call_function", "call_method"):
        source = node_argument(user, 0, "input")
        dim, idx = node_argument(user, 1, "dim"), node_argument(user, 2, "index")
        sparse = node_argument(user, 3, "sparse_grad", False)
        if source is x and dim in (1, 1 - len(shape)) and sparse is False and isinstance(idx, fx.Node) \
                and len(shape_of(idx) or ()) == len(shape) and idx.meta.get("example_value") is not None \
                and idx.meta["example_value"].dtype == torch.int64:
            return "gather", idx
        return None
    if name == "select" and node_argument(user, 0, "input") is x and \
            node_argument(user, 1, "dim") in (1, 1 - len(shape)):
        c = node_argument(user, 2, "index")
        return ("position", c) if isinstance(c, int) and _within(c, seq) else None
    if user.target is operator.getitem and user.args[0] is x and isinstance(user.args[1], tuple) \
            and len(user.args[1]) == 2:
        first, second = user.args[1]
        if _is_full_slice(first) and isinstance(second, int) and not isinstance(second, bool):
            return ("position", second) if _within(second, seq) else None
        if _is_batch_arange(first, shape[0]) and isinstance(second, fx.Node):
            value = second.meta.get("example_value")
            if value is not None and value.dtype in (torch.int64, torch.int32) and value.dim() == 1 \
                    and same_size(value.shape[0], shape[0]):
                return "per_batch", second
    return None


class _PositionMaps:
    """The (B, N) packed-row map of each exit shape, emitted once right after the region's index."""

    def __init__(self, graph: fx.Graph, emit: Emitter, index: RegionIndex):
        self.graph, self.emit, self.index = graph, emit, index
        self.maps: dict[tuple, fx.Node] = {}

    def get(self, exit_node: fx.Node) -> fx.Node:
        index_put = exit_node.args[0] if exit_node.target is aten.slice.Tensor else exit_node
        rows, seq = index_put.args[0].args[1][:2]  # new_zeros(P, (B [+ 1], N, ...))
        sliced = exit_node is not index_put
        key = (rows, seq, sliced)
        if key not in self.maps:
            emit, b, n = self.emit, self.index.batch_index, self.index.seq_index
            with self.graph.inserting_before(n.next):  # in creation order, before any reader
                ones = emit.call(aten.ones_like.default, (b,))
                rank = emit.call(aten.sub.Tensor, (emit.call(aten.cumsum.default, (ones, 0)), 1))
                empty = emit.call(aten.new_full.default, (b, [rows, seq], -1))
                pos = emit.call(aten.index_put.default, (empty, [b, n], rank))
                if sliced:
                    pos = emit.call(aten.slice.Tensor, (pos, 0, 0, self.index.mask.batch))
            self.maps[key] = pos
        return self.maps[key]


def pack_row_reads(graph: fx.Graph, emit: Emitter, index: RegionIndex) -> tuple[dict[str, int], int]:
    """Rewrite every row read of the region's exits (module doc). Returns (reads rewritten by form,
    scatters removed)."""
    forms: dict[str, int] = {}
    found = [n for n in graph.nodes if scattered_rows(n, index) is not None]
    # with token buckets both the index_put and the slice after it match: the slice is the exit
    exits = [n for n in found if not any(u in found for u in n.users)]
    maps = _PositionMaps(graph, emit, index)
    for x in exits:
        packed = scattered_rows(x, index)
        shape = shape_of(x)
        if shape is None or len(shape) < 2 or len(shape_of(packed) or ()) != len(shape) - 1:
            continue
        for user in list(x.users):
            form = _read_form(user, x, index.mask.seq)
            if form is None:
                continue
            pos = maps.get(x)
            with graph.inserting_before(user):
                out = _emit_read(emit, form, pos, packed, shape)
            user.replace_all_uses_with(out)
            graph.erase_node(user)
            forms[form[0]] = forms.get(form[0], 0) + 1
    erase_dead([x for x in exits if not x.users])
    removed = sum(1 for x in exits if getattr(x, "_erased", False))
    return forms, removed


def _emit_read(emit: Emitter, form: tuple[str, object], pos: fx.Node, packed: fx.Node, shape) -> fx.Node:
    kind, arg = form
    shape = [size_argument(emit, d) for d in shape]  # (size nodes under dynamic shapes)
    if kind == "gather":  # rows[b, k, f] = pos[b, idx[b, k, f]]
        idx_shape = [size_argument(emit, d) for d in shape_of(arg)]
        flat = emit.call(aten.reshape.default, (arg, [idx_shape[0], -1]))
        rows = emit.call(aten.gather.default, (pos, 1, flat))
        rows = emit.call(aten.reshape.default, (rows, [-1, *idx_shape[2:]]))
        out = emit.call(torch.ops.gemcompile.packed_row_gather.default, (packed, rows))
        return emit.call(aten.reshape.default, (out, idx_shape))
    if kind == "position":  # rows[b] = pos[b, c]
        rows = emit.call(aten.select.int, (pos, 1, arg))
    else:  # per_batch: rows[b] = pos[b, idx[b]], a negative idx counted from the end as indexing does
        idx = emit.call(aten.to.dtype, (arg, torch.int64))
        wrapped = emit.call(aten.where.self, (emit.call(aten.lt.Scalar, (idx, 0)),
                                              emit.call(aten.add.Tensor, (idx, shape[1])), idx))
        column = emit.call(aten.unsqueeze.default, (wrapped, 1))
        rows = emit.call(aten.squeeze.dim, (emit.call(aten.gather.default, (pos, 1, column)), 1))
    features = list(shape[2:])
    rows = emit.call(aten.reshape.default, (rows, [shape[0]] + [1] * len(features)))
    rows = emit.call(aten.expand.default, (rows, [shape[0], *features]))
    return emit.call(torch.ops.gemcompile.packed_row_gather.default, (packed, rows))
