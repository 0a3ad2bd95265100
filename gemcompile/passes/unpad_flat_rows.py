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

Only ops whose output row depends on the same input row are moved (the table below); a batch norm over the
flattened rows (FuxiCTR's MLP_Block with batch_norm, its Dice activation) mixes rows and ends the chain there,
as it must: its statistics read the padded rows. Flattened values updated in place are left as written.
"""

from __future__ import annotations

from torch import fx

from gemcompile.passes.graph import Emitter, copy_source_meta, erase_dead, target_name
from gemcompile.passes.masks.mutation import forget_mutations, in_place_update
from gemcompile.passes.token_wise import ELEMENTWISE, NORMS, SOFTMAX, dtype_of, has_rows, node_argument, same_size, \
    shape_of

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
        # every other tensor broadcasts over the rows (fewer dims than the output: right-aligned, off dim 0)
        if not all(a in rows or shape_of(a) is not None and len(shape_of(a)) < rank for a in tensors):
            return None
        return args, kwargs
    first = node.args[0] if node.args else None
    if first not in rows or any(a in rows for a in tensors[1:]):
        return None
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


def unflatten_token_rows(graph: fx.Graph, row_dims: list[tuple]) -> int:
    """Run the row-by-row ops of every flattened (B*N, ...) chain on its (B, N, ...) rows (module doc), for
    the (B, N) of ``row_dims``; the number of ops moved."""
    moved = 0
    for node in list(graph.nodes):
        if getattr(node, "_erased", False):
            continue  # (erased with an earlier chain)
        source = _flattened(node, row_dims)
        if source is None or in_place_update(node) is not None:
            continue
        count = _unflatten_chain(graph, node, source, row_dims)
        if count:
            forget_mutations(graph)  # (the alias index of the graph's in-place updates: rebuilt for the next chain)
        moved += count
    return moved


def _unflatten_chain(graph: fx.Graph, view: fx.Node, source: fx.Node, row_dims: list[tuple]) -> int:
    rows: dict[fx.Node, fx.Node] = {view: source}  # flattened value -> its (B, N, ...) form
    emit = Emitter(graph)
    order = {n: i for i, n in enumerate(graph.nodes)}
    pending = sorted(view.users, key=order.get)
    try:
        while pending:  # graph order: every flattened operand of a node has its row form before the node
            user = pending.pop(0)
            moved = None if user in rows else _moved(user, rows)
            if moved is None:
                continue
            with graph.inserting_before(user):
                rows[user] = emit.node(user.op, user.target, *moved)
            copy_source_meta(user, rows[user])
            pending = sorted({*pending, *user.users}, key=order.get)
    except Exception:  # noqa: BLE001  (a copy that does not trace: the chain stays as written)
        emit.rollback()
        return 0
    ops = [n for n in rows if n is not view]
    if not ops:
        return 0
    replaced = []  # the views back to (B, N, ...) rows, read through the row form instead
    for flat in ops:  # readers outside the chain read the rows back through a view (the source's own view stays)
        row_form = rows[flat]
        for user in [u for u in flat.users if u not in rows]:
            with graph.inserting_before(user):
                if _rows_reader(user, row_dims):
                    back = graph.call_method("reshape", (row_form, *user.args[1:]))
                    back.meta.update(user.meta)
                    user.replace_all_uses_with(back)
                    replaced.append(user)
                    continue
                back = graph.call_method("flatten", (row_form, 0, 1))
                back.meta.update(flat.meta)
            user.replace_input_with(flat, back)
    erase_dead([*replaced, *reversed(ops), view])
    return len(ops)

