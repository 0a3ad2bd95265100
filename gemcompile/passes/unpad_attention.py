"""The unpad pass's packed attention: a region keeps its tokens packed through a gemcompile attention op.

Without this, every attention op is a region boundary: q, k and v leave the region through a scatter
``zeros(B, N, H, D).index_put((b, n), packed)``, are viewed as (B, H, N, D), and the attention output
enters again through a gather. The padded copies are the largest tensors saved for the backward (issue 26)
and the scatters and gathers cost a pass over B x N rows each (issue 24). Where the attention op has a
packed layout (``token_offsets`` and N: the ops' docstrings in lowering/), :func:`pack_attentions`
rewrites, on the graph the region rewrite left,

    q = transpose(zeros(B, N, H, D).index_put((b, n), q_packed), 1, 2)   [-> rms_norm / layer_norm /
    ...                                                                    unary ops over the head dim]
    o = attention(q, k, v, lengths, ...)
    o_packed = transpose(o, 1, 2)[b, n]

into ``o_packed = attention(q_packed, k_packed, v_packed, lengths, ..., token_offsets, N)`` with the ops
between the scatter and the attention run on the (T, H, D) rows (they act on the head dim of one row, so
they commute with packing). ``token_offsets = [0, cumsum(clamp(lengths + c, 0, N))]`` is emitted once per
lengths per graph.

Not every operand need be token rows. GEM-ref's GDPA cross-attention (gdpa) has the sequence's queries
over dense summary keys: q is packed, k and v stay (B, H, S, D), the output is packed as above. Its PMA
pooling (jagged_attention) has learned dense queries over the sequence's keys: k and v are packed and the
output (B, H, P, D) stays dense, its readers unchanged. A BERT- or SASRec-style layer (jagged_attention over
the region's own tokens) has q, k, v and the output packed. :data:`PACKED_LAYOUTS` says, per op and layout,
which operands are token rows, whether the output is, and which lengths must be the region's; an op's
layouts are tried in order.

Why it is exact. The scatter and the gather use the region's own index (node identity), so every packed
row is a token n < lengths[b] + c. Keys are valid by lengths that are the region's (the attention pass's
clamp of the same lengths node and offset, compared by identity), so the packed keys are exactly the keys
the padded op reads; queries' lengths are None or the region's (both give the valid rows their values). The
packed op computes the valid rows as the padded one does (op.py), positions n included. The padded op's
other query rows are read by nobody: every reader of a token-row output is the gather (through the
transpose back and an optional flatten to (B, N, H * D)), which reads the valid rows only; a dense output
has no padded rows. Anything else (another reader, a kv_mask, lengths other than the region's, an argument
built another way) keeps the old boundary, silently: it is what the pass did before. Token buckets do not:
their slack rows come after the last offset, where every packed op writes zero outputs and gradients
(lowering/common/packed.py), and the exit's scatter drops them as before.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from gemcompile.passes.graph import (Emitter, Unproven, copy_source_meta, erase_dead, example_value,
                                     schema_arguments, target_name)
from gemcompile.passes.token_wise import NORMS, ZERO_PRESERVING_UNARY, same_size, shape_of
from gemcompile.passes.unpad_masks import RowMask


@dataclass(frozen=True)
class PackedLayout:
    """How one attention op takes packed token rows (argument names of its schema)."""

    rows: tuple[str, ...]
    """Operands that are (B, H, N, D) token rows; packed, they are (T, H, D)."""
    output_rows: bool
    """The output is (B, H, N, D) token rows, read back by the region's gather (packed: (T, H, D)); else it
    is dense and its readers are kept."""
    lengths: tuple[str, ...]
    """Lengths arguments that must be the region's (the token-row keys are valid by them); kept."""
    same_lengths: tuple[str, ...]
    """Optional lengths arguments that must be None or the region's lengths."""
    drop_same_lengths: bool
    """Whether the packed call passes None for them (the op refuses them with offsets)."""
    absent: tuple[str, ...]
    """Arguments that must hold their default (None, 0)."""
    offsets: str
    """Where the packed op takes the (B+1,) token offsets."""
    max_len: str
    """Where it takes the padded length N."""


PACKED_LAYOUTS: dict[str, tuple[PackedLayout, ...]] = {
    "block_attention": (PackedLayout(rows=("q", "k", "v"), output_rows=True, lengths=("lengths",),
                                     same_lengths=("q_lengths",), drop_same_lengths=True,
                                     absent=("kv_mask", "kv_bounds"), offsets="token_offsets", max_len="max_len"),),
    # packed queries over dense keys (GEM-ref's GDPA cross-attention); q_lengths (and its q_order) may stay:
    # the op takes the offsets' token counts
    "gdpa": (PackedLayout(rows=("q",), output_rows=True, lengths=(), same_lengths=("q_lengths",),
                          drop_same_lengths=False, absent=("num_targets", "contextual_len"),
                          offsets="token_offsets", max_len="packed_len"),),
    "jagged_attention": (
        # self-attention over the region's tokens (a BERT / SASRec layer): q, k, v and the output packed
        PackedLayout(rows=("q", "k", "v"), output_rows=True, lengths=("kv_lengths",), same_lengths=("q_lengths",),
                     drop_same_lengths=False, absent=("kv_mask", "kv_bounds", "uniform_keys"),
                     offsets="token_offsets", max_len="packed_len"),
        # packed keys and values, dense queries and output (GEM-ref's PMA pooling)
        PackedLayout(rows=("k", "v"), output_rows=False, lengths=("kv_lengths",), same_lengths=(),
                     drop_same_lengths=False, absent=("q_lengths", "kv_mask", "kv_bounds", "uniform_keys"),
                     offsets="token_offsets", max_len="packed_len"),
    ),
}
"""Attention ops with packed layouts, tried in order (the first whose plan holds is taken)."""


@dataclass
class RegionIndex:
    """The region's row index nodes (unpad.py's _token_indices) and the lengths they pack by."""

    mask: RowMask
    batch_index: fx.Node
    seq_index: fx.Node
    gather_batch: fx.Node
    offsets: Callable[[], fx.Node]
    """Emits (or returns) the token offsets of these lengths."""
    seq: Any
    """The padded length as an argument of emitted nodes: an int, or a size node under dynamic shapes."""


def _is_head_transpose(node: fx.Node) -> bool:
    """(B, N, H, D) <-> (B, H, N, D): transpose(1, 2) or permute(0, 2, 1, 3)."""
    name = target_name(node)
    if len(shape_of(node) or ()) != 4:
        return False
    if name == "transpose" and len(node.args) == 3 and not node.kwargs:
        return {d % 4 if isinstance(d, int) else d for d in node.args[1:]} == {1, 2}
    if name == "permute":
        dims = node.args[1] if len(node.args) == 2 else node.args[1:]
        return isinstance(dims, (list, tuple)) and [d % 4 for d in dims] == [0, 2, 1, 3]
    return False


def _row_op(node: fx.Node) -> bool:
    """An op of (B, H, N, D) rows that acts on the head dim of one row: a norm over the last dim (its weights
    of at most one dim), or a unary op without other tensor arguments."""
    name = target_name(node)
    first = node.args[0] if node.args else None
    if node.op not in ("call_function", "call_method") or not isinstance(first, fx.Node):
        return False
    others = [a for a in (*node.args[1:], *node.kwargs.values()) if isinstance(a, fx.Node)]
    if name in NORMS:
        shape = node.args[1] if len(node.args) > 1 else node.kwargs.get("normalized_shape")
        n = 1 if isinstance(shape, int) else len(shape) if isinstance(shape, (list, tuple)) else None
        return n == 1 and all(len(shape_of(a) or (0, 0)) <= 1 for a in others)
    return name in ZERO_PRESERVING_UNARY and not others and name != "dropout"


def scattered_rows(node: fx.Node, index: RegionIndex) -> fx.Node | None:
    """P when ``node`` is ``new_zeros(P, (B, N, ...)).index_put((batch_index, seq_index), P)``, or with
    token buckets ``new_zeros(P, (B + 1, N, ...)).index_put(...)[:B]`` (row B takes the slack rows)."""
    if (node.target is torch.ops.aten.slice.Tensor and len(node.args) == 4
            and isinstance(node.args[0], fx.Node)
            and node.args[1] == 0 and node.args[2] == 0 and same_size(node.args[3], index.mask.batch)):
        node = node.args[0]
    if node.target is not torch.ops.aten.index_put.default or len(node.args) != 3:
        return None
    zeros, indices, values = node.args
    if not (isinstance(zeros, fx.Node) and zeros.target is torch.ops.aten.new_zeros.default
            and isinstance(indices, (list, tuple)) and len(indices) == 2
            and indices[0] is index.batch_index and indices[1] is index.seq_index):
        return None
    return values if isinstance(values, fx.Node) else None


def _same_shape(shape, want) -> bool:
    return shape is not None and len(shape) == len(want) and all(same_size(a, b) for a, b in zip(shape, want))


def _packed_rows(arg, index: RegionIndex, heads: int, dim: int) -> tuple[fx.Node, list[fx.Node]] | None:
    """(packed value P with (T, H, D) or (T, H * D) rows, the row ops between the head split and the
    attention, outermost last) when ``arg`` is the head split of a scatter of the region's rows."""
    if not isinstance(arg, fx.Node):
        return None
    ops: list[fx.Node] = []
    node = arg
    while _row_op(node):
        ops.append(node)
        node = node.args[0]
    if not _is_head_transpose(node):
        return None
    split = node.args[0]
    if not isinstance(split, fx.Node) or not _same_shape(shape_of(split), (index.mask.batch, index.mask.seq,
                                                                          heads, dim)):
        return None
    packed = scattered_rows(split, index)
    if packed is None and target_name(split) in ("unflatten", "view", "reshape") and \
            isinstance(split.args[0], fx.Node):  # (B, N, H * D) scattered, then split
        packed = scattered_rows(split.args[0], index)
    if packed is None or tuple(shape_of(packed)[1:]) not in ((heads, dim), (heads * dim,)):
        return None
    return packed, ops[::-1]


def _output_gathers(node: fx.Node, index: RegionIndex) -> list[tuple[fx.Node, bool]] | None:
    """Every reader of the attention output is transpose back [-> flatten to (B, N, H * D)] -> the region's
    gather: [(gather, flattened)]; None otherwise."""
    found = []
    B, H, N, D = shape_of(node)
    for t in node.users:
        if not _is_head_transpose(t):
            return None
        for user in t.users:
            flat = target_name(user) in ("flatten", "reshape", "view") and \
                _same_shape(shape_of(user), (B, N, H * D))
            readers = list(user.users) if flat else [user]
            for g in readers:
                if not (g.target is torch.ops.aten.index.Tensor and g.args[0] is (user if flat else t) and
                        list(g.args[1]) == [index.gather_batch, index.seq_index]):
                    return None
                found.append((g, flat))
    return found or None


def lengths_arg_mask(arg, seq) -> tuple[fx.Node, int] | None:
    """(lengths, offset) when ``arg`` is lengths, or clamp(lengths [+ offset], 0, seq) as the passes emit."""
    if not isinstance(arg, fx.Node):
        return None
    if target_name(arg) == "clamp" and len(arg.args) == 3 and arg.args[1] == 0 and \
            same_size(example_value(arg.args[2]), seq):  # (a size node under dynamic shapes)
        inner = arg.args[0]
        if isinstance(inner, fx.Node) and target_name(inner) == "add" and isinstance(inner.args[1], int):
            return inner.args[0], inner.args[1]
        return (inner, 0) if isinstance(inner, fx.Node) else None
    return arg, 0


def _same_lengths(arg, mask: RowMask, seq) -> bool:
    found = lengths_arg_mask(arg, seq)
    return found is not None and found[0] is mask.lengths and found[1] == mask.offset


def _is_default(value) -> bool:
    return value is None or (type(value) is int and value == 0)


def _region_rows(shape, mask: RowMask) -> bool:
    """(B, H, N, D) over the region's batch and padded length."""
    return shape is not None and len(shape) == 4 and same_size(shape[0], mask.batch) and \
        same_size(shape[2], mask.seq)


def _plan(node: fx.Node, layout: PackedLayout, index: RegionIndex):
    """(arguments of the packed call, row ops per row operand, output gathers or None for a dense output),
    or None to keep the node."""
    mask = index.mask
    call = schema_arguments(node)
    if layout.output_rows and not _region_rows(shape_of(node), mask):
        return None
    if not all(_same_lengths(call[a], mask, mask.seq) for a in layout.lengths):
        return None
    if not all(_is_default(call[a]) for a in layout.absent):
        return None
    if any(call[a] is not None and not _same_lengths(call[a], mask, mask.seq) for a in layout.same_lengths):
        return None
    rows = {}
    for name in layout.rows:
        shape = shape_of(call[name]) if isinstance(call[name], fx.Node) else None
        found = _packed_rows(call[name], index, shape[1], shape[3]) if _region_rows(shape, mask) else None
        if found is None:
            return None
        rows[name] = found
    if not layout.output_rows:
        return call, rows, None
    gathers = _output_gathers(node, index)
    if gathers is None:
        return None
    return call, rows, gathers


def pack_attentions(graph: fx.Graph, emit: Emitter, index: RegionIndex) -> tuple[list[str], int, int]:
    """Rewrite every attention op of the table whose rows are the region's (module doc) to its packed layout.
    Returns (the names of the ops packed, scatters removed, gathers removed)."""
    names: list[str] = []
    gathers_removed = 0
    scatters = [n for n in graph.nodes if scattered_rows(n, index) is not None]
    for node in list(graph.nodes):
        name = target_name(node)
        if name not in PACKED_LAYOUTS or not isinstance(node.target, torch._ops.OpOverload) or \
                node.target.namespace != "gemcompile":
            continue
        plans = ((layout, _plan(node, layout, index)) for layout in PACKED_LAYOUTS[name])
        layout, plan = next(((lay, p) for lay, p in plans if p is not None), (None, None))
        if plan is None:
            continue
        call, rows, gathers = plan
        mark = emit.mark()
        try:
            with graph.inserting_before(node):
                out = _emit_packed(emit, node, layout, call, rows, index)
        except Unproven:
            emit.rollback(mark)  # nothing rewired yet: the old boundary stays
            continue
        if gathers is None:  # a dense output: its readers read the packed op's, as they read the padded one's
            node.replace_all_uses_with(out)
            erase_dead([node])  # the padded op, the head splits and scatters before it
            names.append(name)
            continue
        readers = []
        for gather, flat in gathers:
            with graph.inserting_before(gather):
                value = emit.method("flatten", (out, 1)) if flat else out
            gather.replace_all_uses_with(value)
            readers.append(gather.args[0])
            graph.erase_node(gather)
            gathers_removed += 1
        erase_dead(readers)  # the transposes back, the padded op, the ops and views before it
        names.append(name)
    erase_dead([n for n in scatters if not getattr(n, "_erased", False) and not n.users])
    scatters_removed = sum(1 for n in scatters if getattr(n, "_erased", False))
    return names, scatters_removed, gathers_removed


def _emit_packed(emit: Emitter, node: fx.Node, layout: PackedLayout, call: dict, rows: dict,
                 index: RegionIndex) -> fx.Node:
    """The packed op call: row operands as (T, H, D) with their row ops, the offsets and N."""
    for arg, (packed, ops) in rows.items():
        value, shape = packed, shape_of(call[arg])
        if len(shape_of(packed)) == 2:  # (T, H * D) scattered before the head split
            value = emit.method("unflatten", (packed, -1, (shape[1], shape[3])))
        for op in ops:  # the same op on (T, H, D): it reads the head dim of one row
            value = emit.node(op.op, op.target, (value, *op.args[1:]), dict(op.kwargs))
            copy_source_meta(op, value)
        call[arg] = value
    for a in layout.same_lengths if layout.drop_same_lengths else ():
        call[a] = None
    call[layout.offsets] = index.offsets()
    call[layout.max_len] = index.seq
    out = emit.call(node.target, tuple(call.values()))
    copy_source_meta(node, out)
    return out


def emit_token_offsets(emit: Emitter, lengths: fx.Node, offset: int, seq: int) -> fx.Node:
    """[0, cumsum(clamp(lengths + offset, 0, seq))]: the (B+1,) token offsets of a lengths row mask."""
    if offset:
        lengths = emit.call(operator.add, (lengths, offset))
    clamped = emit.call(torch.ops.aten.clamp.default, (lengths, 0, seq))
    total = emit.call(torch.ops.aten.cumsum.default, (clamped, 0))
    zero = emit.call(torch.ops.aten.new_zeros.default, (total, [1]))
    return emit.call(torch.ops.aten.cat.default, ([zero, total],))  # (constant_pad_nd's fake ints B: a guard)
