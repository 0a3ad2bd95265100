"""The query-padding mask a model applies after an attention, proven.

``downstream_row_mask`` proves that an attention output only matters at rows i < q_len[b]: every use goes
through row-wise ops (views that keep the batch and query dims, casts, a Linear over the last dim) to a
multiplication by such a row mask, so padded query rows may come out as anything (the kernel writes 0)
without changing the model.
"""

from __future__ import annotations

import sympy
import torch
import torch.fx as fx

from gemcompile.passes.graph import Unproven, example_value, target_name
from gemcompile.passes.masks.evaluator import MaskEvaluator, index_symbol
from gemcompile.passes.masks.prover import equivalent, render
from gemcompile.passes.masks.terms import length_atoms

_VIEWS = ("view", "reshape", "flatten", "contiguous", "to", "float", "half", "bfloat16", "type_as")
_PERMUTES = ("transpose", "permute", "swapaxes")


def _permuted_dim(node: fx.Node, dim: int) -> int:
    """Where dim goes under a transpose/permute node."""
    ndim = example_value(node.args[0]).dim()
    if target_name(node) == "permute":
        perm = node.args[1] if isinstance(node.args[1], (list, tuple)) else node.args[1:]
        return [p % ndim for p in perm].index(dim)
    a, b = (x % ndim for x in node.args[1:3])
    return b if dim == a else a if dim == b else dim


def downstream_row_mask(output: fx.Node, batch_dim: int, row_dim: int) -> tuple[fx.Node, int]:
    """(lengths node, offset) when every use of ``output`` (dims: batch_dim, query rows at row_dim) ends in a
    multiplication by `row < lengths[b] + offset` through row-wise ops; Unproven otherwise."""
    node, rows, batch = output, row_dim, batch_dim
    while True:
        if len(node.users) != 1:
            raise Unproven(f"{node.name} has {len(node.users)} uses before any query-row mask")
        (user,) = node.users
        name = target_name(user) if user.op in ("call_function", "call_method") else ""
        value = example_value(user)
        if name in _PERMUTES:
            rows, batch = _permuted_dim(user, rows), _permuted_dim(user, batch)
        elif name in _VIEWS:
            before = example_value(node).shape
            keep = max(rows, batch) + 1
            if value.dim() < keep or tuple(value.shape[:keep]) != tuple(before[:keep]):
                raise Unproven(f"`{name}` ({user.name}) reshapes the batch or query-row dims")
        elif name == "linear":
            if user.args[0] is not node or rows == value.dim() - 1 or batch == value.dim() - 1:
                raise Unproven(f"{user.name} is not a Linear over the feature dim")
        elif name in ("mul", "__mul__", "__rmul__"):
            other = user.args[1] if user.args[0] is node else user.args[0]
            if not isinstance(other, fx.Node):
                raise Unproven(f"{user.name} multiplies by a constant, not by a row mask")
            return _row_mask(other, value.dim(), batch, rows)
        else:
            raise Unproven(f"the attention output goes to `{name or user.op}` ({user.name}) before any "
                           "query-row mask")
        node = user


def _row_mask(mask: fx.Node, ndim: int, batch: int, rows: int) -> tuple[fx.Node, int]:
    evaluator = MaskEvaluator()
    value = evaluator.tensor(mask)
    pieces = getattr(value, "pieces", None)
    if pieces is not None:
        if any(v not in (0.0, 1.0) for v, _ in pieces):
            raise Unproven("the output is multiplied by weights, not by a 0/1 row mask")
        keep = value.as_bool()
    elif hasattr(value, "pred"):
        keep = value.pred
    else:
        raise Unproven("the output is multiplied by an integer tensor")
    offset = ndim - value.ndim  # right-aligned broadcasting
    b, i = index_symbol(ndim - 1 - batch), index_symbol(ndim - 1 - rows)
    if batch - offset < 0 or rows - offset < 0:
        raise Unproven("the row mask does not span the batch and query-row dims")
    comparisons = [evaluator.atoms.expr_of[a] for a in keep.free_symbols]
    for _, e in comparisons:
        for f in e.atoms(sympy.Function):
            if f.func.__name__ in evaluator.leaves and f.args != (b,):
                raise Unproven("the row mask's lengths are not indexed by the batch dim")
    for node, off, prop in length_atoms(evaluator, comparisons, i):
        if equivalent(evaluator, keep, prop):
            if example_value(node).dtype not in (torch.int32, torch.int64):
                raise Unproven(f"{node.name} is not an integer lengths tensor")
            return node, off
    raise Unproven(f"the output is multiplied by {render(evaluator, keep)}, not by `row < lengths[b]`")
