"""``x[index] = value`` on part of a tensor, spelled out of place as ``where(selected, value, x)``.

Models adjust a mask they built by assigning to part of it: TransAct (Pinterest) keeps every sequence's first
action, ``mask[:, 0] = zeros(B)``; FuxiCTR's TransAct lets an empty sequence attend to its last key,
``mask[mask.all(-1), -1] = False``. in_place.py rewrites updates of fresh tensors out of place so the mask
prover can read them; this module gives it the out-of-place form of such an assignment, in ops the prover
models (arange, comparisons, unsqueeze, logical and, masked_fill, where):

    selected = (arange(N) == 0)[None, :]                 # the elements the index reaches, per indexed dim
    x' = x.masked_fill(selected, value)                  # a scalar value
    x' = torch.where(selected, value_in_x's_frame, x)    # a tensor value that broadcasts along the indexed dims

Served index parts, one per dim: an int (negative ones count from the end), a slice with step 1, the
full slice, Ellipsis, and one boolean tensor over the leading dims it indexes (the value then a scalar: a
boolean index flattens what it selects). A tensor value must hold one element along every dim an int or a
partial slice indexes (so that it broadcasts over x's own shape); anything else returns None and the
assignment stays as written (the prover then names it).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true as known

from gemcompile.passes.graph import Emitter, example_value

__all__ = ["emit_index_assign", "index_assign_parts"]


def _value_of(arg):
    return example_value(arg) if isinstance(arg, fx.Node) else arg


def _expand_ellipsis(index: tuple, ndim: int) -> tuple | None:
    """The index with one part per dim of x (a boolean tensor part counts for its dims), or None."""
    consumed = 0
    for part in index:
        value = _value_of(part)
        if part is None:
            return None  # a new axis: the value's frame would need it too
        if isinstance(value, torch.Tensor):
            if value.dtype != torch.bool:
                return None  # an integer index tensor: a gather, not a region
            consumed += max(value.dim(), 1)
        elif part is not Ellipsis:
            consumed += 1
    ellipses = [i for i, part in enumerate(index) if part is Ellipsis]
    if len(ellipses) > 1 or consumed > ndim:
        return None
    if ellipses:
        e = ellipses[0]
        return index[:e] + (slice(None),) * (ndim - consumed) + index[e + 1:]
    return index + (slice(None),) * (ndim - consumed)


def _full(part, size) -> bool:
    if not isinstance(part, slice) or part.step not in (None, 1) or part.start not in (None, 0):
        return False
    stop = _value_of(part.stop)
    return stop is None or (isinstance(stop, (int, torch.SymInt)) and known(stop >= size))


def index_assign_parts(node: fx.Node) -> tuple[tuple, object] | None:
    """(index with one part per dim, value) for a served ``x[index] = value`` (module doc), else None."""
    if len(node.args) != 3 or node.kwargs:
        return None
    x, index, value = _value_of(node.args[0]), node.args[1], node.args[2]
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        return None
    index = _expand_ellipsis(index if isinstance(index, tuple) else (index,), x.dim())
    if index is None:
        return None
    dim, masks, partial = 0, 0, []
    for part in index:
        part_value = _value_of(part)
        if isinstance(part_value, torch.Tensor):  # a boolean mask over the dims it covers
            span = max(part_value.dim(), 1)
            if dim != 0 or part_value.dim() == 0 or not all(
                    known(a == b) for a, b in zip(part_value.shape, x.shape[dim:dim + span])):
                return None  # only over the leading dims, matching x's sizes
            masks += 1
            dim += span
            continue
        if isinstance(part_value, (int, torch.SymInt)) and not isinstance(part_value, bool):
            if not _sign_known(part_value):
                return None
            partial.append(dim)
        elif isinstance(part, slice):
            if part.step not in (None, 1):
                return None
            bounds = [_value_of(b) for b in (part.start, part.stop)]
            if any(b is not None and not (isinstance(b, (int, torch.SymInt)) and _sign_known(b)) for b in bounds):
                return None
            if not _full(part, x.shape[dim]):
                partial.append(dim)
        else:
            return None
        dim += 1
    if masks > 1 or (not partial and not masks):
        return None  # two boolean masks pair up their True elements; no indexed dim: a whole assignment
    if not _value_fits(value, x, index, masks):
        return None
    return index, value


def _sign_known(v) -> bool:
    """Whether an index or bound is known negative (counted from the end) or known non-negative: a dynamic
    size's sign decides what ``x[:, -c:]`` reaches, and the graph holds one meaning."""
    return isinstance(v, int) or known(v < 0) or known(v >= 0)


def _value_fits(value, x: torch.Tensor, index: tuple, masks: int) -> bool:
    v = _value_of(value)
    if isinstance(v, (int, float, bool)) or (isinstance(v, torch.Tensor) and v.dim() == 0):
        return True
    if masks or not isinstance(v, torch.Tensor):
        return False
    kept = [d for d, part in enumerate(index) if not _is_int(part)]  # the region's dims, in x's order
    if v.dim() > len(kept):
        return False
    aligned = [1] * (len(kept) - v.dim()) + list(v.shape)
    for d, size in zip(kept, aligned):
        if not (known(size == 1) or (_full(index[d], x.shape[d]) and known(size == x.shape[d]))):
            return False
    return True


def _is_int(part) -> bool:
    value = _value_of(part)
    return isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool)


def _size(emit: Emitter, x: fx.Node, d: int):
    size = example_value(x).shape[d]
    return size if isinstance(size, int) else emit.method("size", (x, d))


def _positions(emit: Emitter, x: fx.Node, d: int, part) -> fx.Node:
    """The positions of dim ``d`` that ``part`` (an int or a slice) reaches, as a bool vector over the dim."""
    size = _size(emit, x, d)
    device = example_value(x).device
    at = emit.call(torch.arange, (size,), {"device": device})

    def bound(b):  # a negative bound counts from the end: size + b (in the graph when either is dynamic)
        value = _value_of(b)
        if not (known(value < 0) if isinstance(value, torch.SymInt) else isinstance(b, int) and b < 0):
            return b
        return b + size if isinstance(size, int) and isinstance(b, int) else emit.call(operator.add, (size, b))

    if not isinstance(part, slice):
        return emit.call(operator.eq, (at, bound(part)))
    cond = None
    if part.start not in (None, 0):
        cond = emit.call(operator.ge, (at, bound(part.start)))
    if part.stop is not None:
        below = emit.call(operator.lt, (at, bound(part.stop)))
        cond = below if cond is None else emit.call(operator.and_, (cond, below))
    return cond


def emit_index_assign(emit: Emitter, x: fx.Node, index: tuple, value) -> fx.Node:
    """x with ``x[index] = value`` applied, out of place (``index`` from index_assign_parts)."""
    x_value = example_value(x)
    ndim, selected, dim = x_value.dim(), None, 0
    for part in index:
        if isinstance(part, fx.Node) and isinstance(example_value(part), torch.Tensor):  # a boolean mask
            cond, span = part, example_value(part).dim()
        elif isinstance(part, slice) and _full(part, x_value.shape[dim]):
            dim += 1
            continue
        else:
            cond, span = _positions(emit, x, dim, part), 1
        for _ in range(ndim - dim - span):  # to x's rank: size-1 dims after it (and broadcast before it)
            cond = emit.call(torch.unsqueeze, (cond, -1))
        selected = cond if selected is None else emit.call(operator.and_, (selected, cond))
        dim += span
    v = _value_of(value)
    if not isinstance(v, torch.Tensor) or v.dim() == 0:
        if isinstance(v, float) and x_value.is_floating_point() and abs(v) > torch.finfo(x_value.dtype).max:
            # eager's setitem casts it (-1e9 into float16 is -inf), masked_fill would refuse the number
            value = emit.call(torch.scalar_tensor, (v,), {"dtype": torch.float64, "device": x_value.device})
            value = emit.method("to", (value, x_value.dtype))
        return emit.method("masked_fill", (x, selected, value))
    if v.dtype != x_value.dtype:
        value = emit.method("to", (value, x_value.dtype))
    kept = [d for d, part in enumerate(index) if not _is_int(part)]
    for _ in range(len(kept) - v.dim()):
        value = emit.call(torch.unsqueeze, (value, 0))
    for d in range(ndim):  # an int part drops its dim from the value's frame: put it back as size 1
        if _is_int(index[d]):
            value = emit.call(torch.unsqueeze, (value, d))
    return emit.call(torch.where, (selected, value, x))
