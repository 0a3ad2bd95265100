"""Token rows flattened to (B*N, ...) for an MLP, written back as the (B, N, ...) rows they are.

CTR libraries run their per-token MLPs on flattened rows. FuxiCTR's DIN attention:

    attention_input = torch.cat([target, history, target - history, target * history], dim=-1)   # (B, N, 4E)
    attention_weight = self.attention_layer(attention_input.view(-1, 4 * E))                       # (B*N, 1)
    attention_weight = attention_weight.view(-1, seq_len) * mask.float()                            # (B, N)

The token-wise table (token_wise.py) describes ops over (B, N, ...) rows, so the unpad pass saw the flattening
view as an unknown reader of the tokens' padded rows and left the MLP padded. A linear, a norm over the last
dims, an activation or a product with per-feature weights computes row r of a (B*N, ...) tensor from row r of
its inputs alone, exactly as it computes row (b, n) of the (B, N, ...) tensor: so ``unflatten_token_rows``
runs such ops on the (B, N, ...) source instead, and the views back to (B, N, ...) (or any other reader, through
``flatten(0, 1)``) read the result. The values are the same elements in the same order; the unpad pass then
packs the chain like any other.

An elementwise operand that is itself a (B, N, ...) tensor reshaped to (B*N, ...) (the mask flattened as
``valid.view(-1, 1)``, a residual ``x.view(-1, E)``) is read through its (B, N, ...) form.

Only ops whose output row depends on the same input row are moved (the table below); a batch norm over the
flattened rows (FuxiCTR's MLP_Block with batch_norm, its Dice activation) mixes rows and ends the chain there,
as it must: its statistics read the padded rows. Such a stop with GEMMs around it is reported (explain says
why those GEMMs run padded). Flattened values updated in place are left as written.
"""

from __future__ import annotations

import math

import torch
from torch import fx

from gemcompile.passes.graph import Emitter, size_argument, target_name
from gemcompile.passes.masks.mutation import in_place_update
from gemcompile.passes.token_wise import ELEMENTWISE, NORMS, REDUCTIONS, SOFTMAX, dtype_of, has_rows, node_argument, \
    same_size, shape_of
from gemcompile.passes.unpad_row_chains import RowLayout, move_chains

_RESHAPES = frozenset({"view", "reshape", "flatten"})


def _flattened(node: fx.Node, row_dims: list[tuple]) -> fx.Node | None:
    """x when ``node`` is a view / reshape / flatten of a (B, N, ...) float tensor x (B, N of ``row_dims``) that
    merges exactly its first two dims: (B*N, ...) with the rest unchanged."""
    if node.op not in ("call_function", "call_method") or target_name(node) not in _RESHAPES or not node.args:
        return None
    x, out = node.args[0], shape_of(node)
    shape = shape_of(x)
    dtype = dtype_of(x)
    if not isinstance(x, fx.Node) or shape is None or out is None or dtype is None or not dtype.is_floating_point:
        return None
    if len(out) != len(shape) - 1 or not all(same_size(a, b) for a, b in zip(out[1:], shape[2:])):
        return None
    if not any(has_rows(shape, b, n) and same_size(out[0], b * n) for b, n in row_dims):
        return None
    return x


def _flat_operand(node, row_dims: list[tuple]) -> tuple | None:
    """(x, (B, N, *rest)) when ``node`` reshapes a (B, N, ...) tensor x of any dtype to (B*N, *rest) with the
    same elements per row (``valid.view(-1, 1)`` of a (B, N) mask, ``x.view(-1, E)``): its row form is x
    reshaped to (B, N, *rest)."""
    if not isinstance(node, fx.Node) or node.op not in ("call_function", "call_method") or \
            target_name(node) not in _RESHAPES or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    x, out = node.args[0], shape_of(node)
    shape = shape_of(x)
    if shape is None or out is None or not out or in_place_update(node) is not None:
        return None  # (updated in place: x read at the op could differ from the reshape, a copy taken earlier)
    for b, n in row_dims:
        if has_rows(shape, b, n) and same_size(out[0], b * n) and \
                same_size(math.prod(out[1:]), math.prod(shape[2:])):
            return x, (shape[0], shape[1], *out[1:])
    return None


def _moved_dim(dim, rank: int) -> int | None:
    """A dim of a flattened (B*N, ...) value of the given rank, on the (B, N, ...) value; None for dim 0."""
    if not isinstance(dim, int) or isinstance(dim, bool):
        return None
    if dim < 0:
        return dim if dim + rank >= 1 else None
    return dim + 1 if dim >= 1 else None


def _moved(node: fx.Node, rows: dict[fx.Node, fx.Node]) -> tuple[tuple, dict] | None:
    """The (args, kwargs) of ``node`` run on (B, N, ...) rows: its flattened operands replaced by their row
    form and its dim moved; None when the op is not row by row over its flattened operands (module doc)."""
    name = target_name(node)
    out = shape_of(node)
    dtype = dtype_of(node)
    if node.op not in ("call_function", "call_method") or out is None or dtype is None or \
            not dtype.is_floating_point or in_place_update(node) is not None:
        return None
    rank = len(out)
    args, kwargs = tuple(rows.get(a, a) if isinstance(a, fx.Node) else a for a in node.args), dict(node.kwargs)
    if any(isinstance(value, fx.Node) and value in rows for value in kwargs.values()):
        return None  # (a flattened operand given by keyword: not modelled)
    tensors = [a for a in node.args if isinstance(a, fx.Node)]
    if name in ELEMENTWISE:
        if name == "dropout" and node_argument(node, 3, "inplace", False):
            return None
        # a flattened operand has the output's rank (its rows on the output's dim 0, not broadcast against
        # another's: x.view(-1, 1, E) - x.view(-1, E) pairs every row with every row); every other tensor
        # broadcasts over the rows (fewer dims than the output: right-aligned, off dim 0)
        if not all(len(shape_of(a) or ()) == rank if a in rows else shape_of(a) is not None and
                   len(shape_of(a)) < rank for a in tensors):
            return None
        return args, kwargs
    first = node.args[0] if node.args else None
    if not isinstance(first, fx.Node) or first not in rows or any(a in rows for a in tensors[1:]):
        return None  # (a cat's list of tensors: not moved, and no TypeError that would drop the whole chain)
    if name == "linear":
        return args, kwargs
    if name in NORMS:
        normalized = node_argument(node, 1, "normalized_shape")
        n = 1 if isinstance(normalized, int) else len(normalized) if isinstance(normalized, (tuple, list)) else None
        return (args, kwargs) if n is not None and n < rank else None
    if name in SOFTMAX:
        dim = _moved_dim(node_argument(node, 1, "dim"), rank)
        if dim is None:
            return None
        if len(args) > 1:
            return (args[0], dim, *args[2:]), kwargs
        return args, {**kwargs, "dim": dim}
    return None


def _rows_reader(user: fx.Node, row_dims: list[tuple]) -> bool:
    """``user`` views a flattened value back as (B, N, ...) rows (``w.view(-1, seq_len)``, ``view(B, N, E)``)."""
    return target_name(user) in ("view", "reshape") and not user.kwargs and \
        any(has_rows(shape_of(user), b, n) for b, n in row_dims)


def _flat_operands(nodes, rows: dict, row_dims: list[tuple]) -> dict:
    """The operands among ``nodes`` that are (B, N, ...) tensors reshaped to (B*N, ...) outside the chain:
    node -> (source, row shape)."""
    return {a: spec for a in nodes
            if isinstance(a, fx.Node) and a not in rows and (spec := _flat_operand(a, row_dims))}


def _move(emit: Emitter, node: fx.Node, rows: dict, row_dims: list[tuple]) -> fx.Node | None:
    if target_name(node) in ("cat", "concat") and node.args and isinstance(node.args[0], (list, tuple)):
        return _cat(emit, node, rows, row_dims)
    operands = _flat_operands(node.args, rows, row_dims)
    moved = _moved(node, {**rows, **{a: a for a in operands}})
    if moved is None:
        return None
    forms = {a: _row_form(emit, *spec) for a, spec in operands.items()}
    args = tuple(forms.get(a, a) if isinstance(a, fx.Node) else a for a in moved[0])
    return emit.node(node.op, node.target, args, moved[1])


def _cat(emit: Emitter, node: fx.Node, rows: dict, row_dims: list[tuple]) -> fx.Node | None:
    """``cat`` of flattened rows along a feature dim (``cat([h, x.view(-1, E)], -1)``): the cat of their rows."""
    parts, out = node.args[0], shape_of(node)
    dim = _moved_dim(node_argument(node, 1, "dim", 0), len(out or ()))
    operands = _flat_operands(parts, rows, row_dims)
    if dim is None or not any(a in rows for a in parts) or \
            any(not isinstance(a, fx.Node) or a not in rows and a not in operands or
                len(shape_of(a) or ()) != len(out) for a in parts):
        return None
    forms = {**rows, **{a: _row_form(emit, *spec) for a, spec in operands.items()}}
    return emit.call(torch.cat, ([forms[a] for a in parts], dim))


def _reshaped_back(graph: fx.Graph, user: fx.Node, row_form: fx.Node, row_dims: list[tuple]) -> fx.Node | None:
    """A view back to (B, N, ...) rows: the same view of the row form."""
    if not _rows_reader(user, row_dims):
        return None
    back = graph.call_method("reshape", (row_form, *user.args[1:]))
    back.meta.update(user.meta)
    return back


def unflatten_token_rows(graph: fx.Graph, row_dims: list[tuple]) -> tuple[int, list[tuple[fx.Node, str]]]:
    """Run the row-by-row ops of every flattened (B*N, ...) chain on its (B, N, ...) rows (module doc), for
    the (B, N) of ``row_dims``: the number of ops moved, and (node, reason) for each op across the flattened
    rows that leaves GEMMs on them padded."""
    def flat(node):
        shape = shape_of(node)
        return shape is not None and len(shape) >= 1 and any(same_size(shape[0], b * n) for b, n in row_dims)

    layout = RowLayout(
        name="token rows flattened to (B*N, ...)",
        start=lambda node: _flattened(node, row_dims),
        move=lambda emit, node, rows: _move(emit, node, rows, row_dims),
        reads_back=lambda graph_, user, row_form: _reshaped_back(graph_, user, row_form, row_dims),
        back=lambda graph_, row_form: graph_.call_method("flatten", (row_form, 0, 1)),
        mixes=_mixes_rows,
        keeps=lambda node: flat(node) or any(has_rows(shape_of(node), b, n) for b, n in row_dims))
    return move_chains(graph, layout)


_ACROSS_ROWS = frozenset({"cumsum", "cumprod", "var", "std", "prod"})


def _mixes_rows(node: fx.Node) -> bool:
    """Whether ``node`` computes across the rows of its flattened (B*N, ...) first operand: a batch norm, or a
    reduction, softmax or scan over dim 0 (or over every dim)."""
    name = target_name(node)
    if name == "batch_norm":
        return True
    if name not in REDUCTIONS | SOFTMAX | _ACROSS_ROWS:
        return False
    dim = node_argument(node, 1, "dim")
    if dim is None:
        return name not in SOFTMAX  # (a softmax without dim: not modelled, said nowhere)
    dims = dim if isinstance(dim, (tuple, list)) else (dim,)
    return any(isinstance(d, int) and d in (0, -len(shape_of(node.args[0]) or ())) for d in dims)


def _row_form(emit: Emitter, x: fx.Node, shape: tuple) -> fx.Node:
    """x (B, N, ...) as (B, N, *rest): x itself when it has that shape."""
    if len(shape) == len(shape_of(x)) and all(same_size(p, q) for p, q in zip(shape, shape_of(x))):
        return x
    return emit.method("reshape", (x, *(size_argument(emit, d) for d in shape)))
