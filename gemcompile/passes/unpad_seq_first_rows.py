"""Token rows laid out sequence-first, (N, B, ...), written back as the (B, N, ...) rows they are.

PyTorch's encoder layers default to ``batch_first=False``: a model with batch-first embeddings feeds
``nn.TransformerEncoder`` ``x.transpose(0, 1)`` (or ``x.permute(1, 0, 2)``) and transposes its output back.
The jagged_attention pass reads the attention itself batch-first, but the residual adds, norms and the FFN
between the attentions run on (N, B, E) values that the token-wise table (token_wise.py) does not describe:
unpad saw the transpose as an unknown reader of the padded rows and left every one of those GEMMs padded.

A linear, a norm over the features, an elementwise op or a softmax over the features computes row (n, b) of
an (N, B, ...) tensor from row (n, b) of its operands alone, exactly as it computes row (b, n) of the
(B, N, ...) tensor: ``batch_first_token_rows`` runs such ops on the (B, N, ...) source instead, its other
operands transposed the same way (a full (N, B, ...) tensor by ``transpose(0, 1)``, a per-sample (B, ...) one by
``unsqueeze(1)``, per-feature ones as they are); the transposes back to (B, N, ...) read the result, other
readers a transpose of it. The values are the same elements; the unpad pass then packs the chain like any
other. An op over the tokens or the batch (a reduction, a softmax over dim 0) ends the chain, as it must.
"""

from __future__ import annotations

import operator

from torch import fx

from gemcompile.passes.graph import Emitter, permutation, target_name
from gemcompile.passes.masks.mutation import in_place_update
from gemcompile.passes.token_wise import ELEMENTWISE, NORMS, SOFTMAX, dtype_of, has_rows, node_argument, \
    same_size, shape_of
from gemcompile.passes.unpad_row_chains import RowLayout, move_chains


def _order(node: fx.Node) -> list[int] | None:
    """The permutation a transpose / permute node applies to an input of 3 or more dims (graph.permutation)."""
    order = permutation(node)
    return order if order is not None and len(order) >= 3 else None


def _sequence_first(emit: Emitter, node: fx.Node, row_dims: list[tuple]) -> fx.Node | None:
    """The (B, N, ...) rows when ``node`` lays a float tensor out as (N, B, ...): x itself for ``x.transpose(0,
    1)`` of (B, N, ...) rows; ``o.transpose(1, 2)`` for an attention output o (B, H, N, d) permuted to (N, B, H,
    d), as MultiheadAttention does (``permute(2, 0, 1, 3)``)."""
    order = _order(node)
    if order is None or order[1] != 0 or order[0] == 0 or in_place_update(node) is not None:
        return None
    x, out = node.args[0], shape_of(node)
    dtype = dtype_of(x)
    if dtype is None or not dtype.is_floating_point or not any(has_rows((out[1], out[0]), b, n) for b, n in row_dims):
        return None
    rows = [0, order[0], *order[2:]]
    if rows == list(range(len(rows))):
        return x
    with emit.graph.inserting_after(x):
        return emit.method("permute", (x, *rows))


def _operand_spec(a, rows: dict, rank: int) -> str | None:
    """How an operand of an elementwise op on (N, B, ...) values of ``rank`` dims is read on (B, N, ...) rows:
    'rows' (a moved value), 'same' (a number, or a tensor broadcast along both leading dims), 'unsqueeze' (a
    per-sample (B, ...) tensor, right-aligned onto dim 1), 'transpose' (a full (N, B, ...) tensor); None for a
    tensor of more dims."""
    if not isinstance(a, fx.Node):
        return "same"
    if a in rows:
        return "rows"
    shape = shape_of(a)
    if shape is None or len(shape) > rank:
        return None
    if len(shape) <= rank - 2 or len(shape) == rank - 1 and same_size(shape[0], 1):
        return "same"
    return "unsqueeze" if len(shape) == rank - 1 else "transpose"


def _elementwise(emit: Emitter, node: fx.Node, rows: dict, out: tuple) -> fx.Node | None:
    if target_name(node) == "dropout" and node_argument(node, 3, "inplace", False):
        return None
    rank = len(out)
    if any(isinstance(v, fx.Node) for v in node.kwargs.values()):
        return None
    specs = [_operand_spec(a, rows, rank) for a in node.args]
    if None in specs:
        return None
    if not all(len(shape_of(a)) == rank and all(same_size(p, q) for p, q in zip(shape_of(a), out))
               for a, spec in zip(node.args, specs) if spec == "rows"):
        return None  # (a moved value broadcast to a larger tensor: not one row per row)
    args = []
    for a, spec in zip(node.args, specs):
        if spec == "rows":
            a = rows[a]
        elif spec == "unsqueeze":
            a = emit.method("unsqueeze", (a, 1))
        elif spec == "transpose":
            a = emit.method("transpose", (a, 0, 1))
        args.append(a)
    return emit.node(node.op, node.target, tuple(args), dict(node.kwargs))


def _move(emit: Emitter, node: fx.Node, rows: dict) -> fx.Node | None:
    """``node`` on the (B, N, ...) rows, or None when it does not compute each (n, b) row from that row."""
    name = target_name(node)
    if node.op not in ("call_function", "call_method") or in_place_update(node) is not None:
        return None
    if name in _SPLITS:  # (a tuple: its parts are checked where they are read)
        out = shape_of(node.args[0]) if node.args and isinstance(node.args[0], fx.Node) else None
    else:
        out, dtype = shape_of(node), dtype_of(node)
        if dtype is None or not dtype.is_floating_point:
            return None
    if out is None or len(out) < 3:
        return None
    if name in ELEMENTWISE:
        return _elementwise(emit, node, rows, out)
    if name == "getitem" and len(node.args) == 2 and not node.kwargs:
        return _getitem(emit, node, rows)
    first = node.args[0] if node.args else None
    tensors = [a for a in (*node.args[1:], *node.kwargs.values()) if isinstance(a, fx.Node)]
    if not isinstance(first, fx.Node) or first not in rows or any(a in rows for a in tensors):
        return None
    args = (rows[first], *node.args[1:])
    if name == "linear":
        return emit.node(node.op, node.target, args, dict(node.kwargs))
    if name in NORMS:
        normalized = node_argument(node, 1, "normalized_shape")
        n = 1 if isinstance(normalized, int) else len(normalized) if isinstance(normalized, (tuple, list)) else None
        return emit.node(node.op, node.target, args, dict(node.kwargs)) if n is not None and n <= len(out) - 2 \
            else None
    if name in SOFTMAX or name in _SPLITS or name in ("unflatten", "flatten"):
        dim = node_argument(node, 1 if name not in _SPLITS else 2, "start_dim" if name == "flatten" else "dim",
                            0 if name == "flatten" else None)
        rank = len(shape_of(first))
        return emit.node(node.op, node.target, args, dict(node.kwargs)) \
            if isinstance(dim, int) and -rank <= dim < rank and dim % rank >= 2 else None
    if name in ("view", "reshape") and not node.kwargs and _keeps_leading(first, out):
        sizes = list(node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (tuple, list)) else node.args[1:])
        return emit.method("reshape", (rows[first], (sizes[1], sizes[0], *sizes[2:])))
    return None


_SPLITS = frozenset({"chunk", "split", "tensor_split"})
"""Splits along a feature dim: a tuple of (N, B, ...) values (read by ``getitem``)."""


def _keeps_leading(x: fx.Node, out: tuple) -> bool:
    shape = shape_of(x)
    return shape is not None and len(out) >= 3 and same_size(shape[0], out[0]) and same_size(shape[1], out[1])


def _getitem(emit: Emitter, node: fx.Node, rows: dict) -> fx.Node | None:
    """A part of a moved split (``chunk(3, -1)[0]``), or an index of the features alone (``x[..., :E]``)."""
    source, index = node.args
    if not isinstance(source, fx.Node) or source not in rows:
        return None
    if target_name(source) in _SPLITS:
        return emit.call(operator.getitem, (rows[source], index)) if isinstance(index, int) else None
    shape = shape_of(source)
    index = index if isinstance(index, tuple) else (index,)
    full = slice(None)
    trailing = index[1:] if index and index[0] is Ellipsis else index[2:] if index[:2] == (full, full) else None
    if shape is None or trailing is None or len(trailing) > len(shape) - 2 or \
            not all(isinstance(i, (slice, int)) and not isinstance(i, bool) for i in trailing):
        return None  # (an index of the tokens or the batch, a new axis, a tensor index: not moved)
    return emit.call(operator.getitem, (rows[source], index))


def _read_back(graph: fx.Graph, user: fx.Node, row_form: fx.Node) -> fx.Node | None:
    """A transpose or permute of an (N, B, ...) value: the row form itself for ``transpose(0, 1)``, else the
    permute of the row form that gives the same tensor (dims 0 and 1 exchanged in its order)."""
    order = _order(user)
    if order is None:
        return None
    if order == [1, 0, *range(2, len(order))]:
        return row_form
    swapped = [1 if d == 0 else 0 if d == 1 else d for d in order]
    read = graph.call_method("permute", (row_form, *swapped))
    read.meta.update(user.meta)
    return read


def batch_first_token_rows(graph: fx.Graph, row_dims: list[tuple]) -> int:
    """Run the row-by-row ops of every (N, B, ...) chain on its (B, N, ...) rows (module doc), for the (B, N) of
    ``row_dims``: the number of ops moved."""
    emit = Emitter(graph)  # (the permutes of attention outputs that start a chain)
    layout = RowLayout(
        name="token rows laid out sequence-first, (N, B, ...)",
        start=lambda node: _sequence_first(emit, node, row_dims),
        move=_move,
        reads_back=_read_back,
        back=lambda graph_, row_form: graph_.call_method("transpose", (row_form, 0, 1)),
        mixes=lambda node: False,  # (what ends a chain here is attention or pooling, which other analyses read)
        keeps=lambda node: False)  # (any chain: an elementwise one between two transposes joins two regions)
    moved = move_chains(graph, layout)[0]
    emit.rollback()  # (the starts no chain was moved from: unused)
    return moved
