"""A reshape that splits or merges mask dims, for the mask evaluator: d2l's ``masked_softmax`` masks the (B * H, Lq, Lk)
scores as (B * H * Lq, Lk) rows, each by its own length (the lengths ``repeat_interleave``'d over the query
rows), and shapes them back (passes/attention/row_flattened.py folds the fill into the scores' shape, so the
mask reaches the evaluator through that split). The old index of a split dim is sum(new index * stride) over
its group; a length read through ``repeat_interleave(x, R)`` along a split whose inner part has R rows is x read
at the outer index, so the mask is key padding by x again.

A merge is the inverse: FuxiCTR's DMIN tiles a per-sample mask over the heads into the batch,
``m.unsqueeze(1).repeat(1, H, 1, 1).flatten(end_dim=1)``, and reads it back with ``view_as(scores)``. Merged,
the old indices are ``r // H`` and ``r % H``; split again, ``(b * H + h) // H`` is b and ``% H`` is h because
0 <= h < H (``_within_bounds``), so the mask is sample b's for every head."""

from __future__ import annotations

from typing import Any

import sympy
import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true as known

from gemcompile.passes.graph import Unproven, example_value, target_name
from gemcompile.passes.masks.values import Abstract, IntTensor, index_symbol


def _groups(in_shape, out_shape, in_dims, out_dims) -> list[tuple[int, list[int]]] | None:
    """Each non-unit input dim with the consecutive output dims whose sizes multiply to it; None unless every
    output dim is in a group and some group splits (a merge is not modeled)."""
    groups, j = [], 0
    for a in in_dims:
        group, size = [], 1
        while j < len(out_dims) and not known(size == in_shape[a]):
            group.append(out_dims[j])
            size = size * out_shape[out_dims[j]]
            j += 1
        if not group or not known(size == in_shape[a]):
            return None
        groups.append((a, group))
    return groups if j == len(out_dims) and len(out_dims) > len(in_dims) else None


def split_reshape(ev: Any, src: Abstract, in_shape, out_shape, in_dims, out_dims) -> Abstract | None:
    """``src`` reshaped from ``in_shape`` to ``out_shape`` when the reshape only splits dims, else None. ``ev``
    is the MaskEvaluator (not imported: it imports this module)."""
    groups = _groups(in_shape, out_shape, in_dims, out_dims)
    if groups is None:
        return None
    n_in, n_out = len(in_shape), len(out_shape)
    tmp = {index_symbol(n_in - 1 - a): sympy.Symbol(f"_t{n_in - 1 - a}", integer=True) for a, _ in groups}
    value = ev._subs(src, tmp)
    back, repeated = {}, {}
    for a, group in groups:
        old, stride, expr = tmp[index_symbol(n_in - 1 - a)], sympy.Integer(1), sympy.Integer(0)
        for b in reversed(group):  # sizes as sympy expressions: symbolic under dynamic shapes
            expr = expr + index_symbol(n_out - 1 - b) * stride
            stride = stride * ev._scalar(out_shape[b])
        back[old] = expr
        if len(group) == 2:
            repeated.update(_repeated_lengths(ev, old, out_shape[group[1]], index_symbol(n_out - 1 - group[0])))
    value = _within_bounds(ev, ev._subs(ev._subs(value, repeated), back), out_shape)
    return type(value)(n_out, *[getattr(value, f) for f in ("expr", "pred", "pieces") if hasattr(value, f)])


def merge_reshape(ev: Any, src: Abstract, in_shape, out_shape, in_dims, out_dims) -> Abstract | None:
    """``src`` reshaped from ``in_shape`` to ``out_shape`` when the reshape only merges dims (each output dim
    consecutive input dims, row-major), else None."""
    groups = _groups(out_shape, in_shape, out_dims, in_dims)  # the same grouping, read the other way
    if groups is None:
        return None
    n_in, n_out = len(in_shape), len(out_shape)
    old = {a: sympy.Symbol(f"_t{n_in - 1 - a}", integer=True) for _, group in groups for a in group}
    value = ev._subs(src, {index_symbol(n_in - 1 - a): t for a, t in old.items()})
    back = {}
    for b, group in groups:
        merged, stride = index_symbol(n_out - 1 - b), sympy.Integer(1)
        for position, a in enumerate(reversed(group)):  # innermost first
            index = sympy.floor(merged / stride) if stride != 1 else merged
            back[old[a]] = index if position == len(group) - 1 else sympy.Mod(index, ev._scalar(in_shape[a]))
            stride = stride * ev._scalar(in_shape[a])
    value = ev._subs(value, back)
    return type(value)(n_out, *[getattr(value, f) for f in ("expr", "pred", "pieces") if hasattr(value, f)])


def _within_bounds(ev: Any, value: Abstract, shape) -> Abstract:
    """``floor(x / c)`` is 0 and ``Mod(x, c)`` is x for an index x of a dim of at most c elements."""
    sizes = {index_symbol(len(shape) - 1 - d): int(s) for d, s in enumerate(shape) if isinstance(s, int)}

    def simpler(expr):
        for f in sympy.sympify(expr).atoms(sympy.floor, sympy.Mod):
            x, c = (f.args[0].as_coeff_Mul()[1], 1 / f.args[0].as_coeff_Mul()[0]) if f.func is sympy.floor \
                else f.args
            if x in sizes and getattr(c, "is_Integer", False) and sizes[x] <= c:
                expr = expr.xreplace({f: 0 if f.func is sympy.floor else x})
        return expr

    if isinstance(value, IntTensor):
        return IntTensor(value.ndim, simpler(value.expr))
    replace = {}
    for atom in (value.pred if hasattr(value, "pred") else sympy.Or(*[c for _, c in value.pieces])).free_symbols:
        kind, e = ev.atoms.expr_of[atom]
        if (new := simpler(e)) != e:
            replace[atom] = ev.atoms.lt0(new) if kind == "lt" else ev.atoms.eq0(new)
    if not replace:
        return value
    if hasattr(value, "pred"):
        return type(value)(value.ndim, value.pred.xreplace(replace))
    return type(value)(value.ndim, tuple((v, c.xreplace(replace)) for v, c in value.pieces))


def _repeated_lengths(ev: Any, old: sympy.Symbol, inner, outer: sympy.Symbol) -> dict:
    """{len_r(old): x's value at ``outer``} for each lengths leaf r = repeat_interleave(x, R) along dim 0 of a
    1-D x with R equal to the split's inner size: rows outer * R .. outer * R + R - 1 all read x[outer]."""
    found = {}
    for fname, node in list(ev.leaves.items()):
        if target_name(node) != "repeat_interleave" or len(node.args) < 2 or not isinstance(node.args[0], fx.Node):
            continue
        x, repeats = node.args[0], example_value(node.args[1])  # a size node under dynamic shapes
        dim = node.kwargs.get("dim", node.args[2] if len(node.args) > 2 else None)
        x_value = example_value(x)
        if dim not in (None, 0) or not isinstance(x_value, torch.Tensor) or x_value.dim() != 1:
            continue
        if not isinstance(repeats, (int, torch.SymInt)) or not known(repeats == inner):
            continue
        source = ev.tensor(x)
        if isinstance(source, IntTensor):
            found[sympy.Function(fname)(old)] = source.expr.subs(index_symbol(0), outer)
    return found


def repeat_interleaved(ev: Any, node: fx.Node, src: Abstract) -> Abstract:
    """``src.repeat_interleave(R, dim)`` with a constant R: the new index x reads the old one at x // R
    (``m.repeat_interleave(H, 0)`` tiles a per-sample mask over the heads into the batch)."""
    repeats = node.args[1] if len(node.args) > 1 else node.kwargs.get("repeats")
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
    if not isinstance(repeats, (int, torch.SymInt)) or not isinstance(dim, int):
        raise Unproven("repeat_interleave with per-element repeats or no dim in the mask")
    n = src.ndim
    x = index_symbol(n - 1 - (dim % n))
    moved = ev._subs(src, {x: sympy.Symbol("_t", integer=True)})
    return ev._subs(moved, {sympy.Symbol("_t", integer=True): sympy.floor(x / ev._scalar(repeats))})
