"""The query rows a model zeroes after an attention, proven: the one proof every kernel family folds into
its query lengths.

``downstream_row_mask`` proves that an attention output only matters at rows n < lengths[b] + c: EVERY use
of it (every path through the graph, fan-out included) reaches an op that sets the row to zero through a
row mask proven (masks/prover.py) equal to ``n < lengths[b] + c``:

* ``x * m``, m a 0/1 row mask (bool, or float holding only 0 and 1), broadcast over the other dims;
* ``torch.where(m, x, 0)``, ``torch.where(~m, 0, x)``, ``x.masked_fill(~m, 0)``;
* fbgemm's ``dense_to_jagged(x, [offsets])`` over (B, N, ...) rows, which keeps rows n < offsets[b + 1] -
  offsets[b] only (HSTU's output packed back to jagged tokens, as generative-recommenders writes it);

possibly after ops that map row (b, n) to row (b, n) only and keep a finite row finite (so the kernel's 0
rows stay finite up to the zeroing: 0 * inf and 0 * NaN are NaN): views and reshapes that keep the batch
and row dims, transposes and permutes, casts, a Linear (or a matmul by a 2-D weight) over the feature dim,
gelu / relu / silu / tanh / sigmoid / negation, dropout (not in place), arithmetic with a finite Python
number (division only of the row). Ops that read only the shape (``zeros_like``, ``size``) read no row.
Any other use is a read of the padded rows before they are zeroed and refuses the proof: a residual add or
any op with a second tensor, a reduction or softmax over rows, an output of the graph, an in-place op, a
mask that is only partly the lengths mask (``valid & other``), a mask over other dims, left padding (not a
prefix), masks from different lengths on different paths.

Why this is exact: rows n >= lengths[b] + c of the output reach the model's result only through the
zeroing, which gives 0 whatever finite value the kernel writes there (the kernels write exact zeros), and
the zeroing passes back exactly zero gradient to those rows (x * 0 and where's backward), so the rows the
kernel skips would have contributed nothing to dq, dk, dv in eager either.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from gemcompile.passes.graph import Unproven, example_value, target_name
from gemcompile.passes.masks.evaluator import MaskEvaluator, index_symbol
from gemcompile.passes.masks.prover import equivalent, render
from gemcompile.passes.masks.terms import length_atoms
from gemcompile.passes.records import source_location

_VIEWS = frozenset({"view", "reshape", "flatten", "contiguous", "clone", "to", "float", "half", "bfloat16",
                    "double", "type_as"})
_PERMUTES = frozenset({"transpose", "permute", "swapaxes"})
_POINTWISE = frozenset({"gelu", "relu", "silu", "tanh", "sigmoid", "neg", "__neg__"})
"""Unary ops with a finite value and a finite derivative at every finite input (0 included)."""
_SCALAR_OPS = frozenset({"mul", "__mul__", "__rmul__", "add", "__add__", "__radd__", "sub", "__sub__",
                         "__rsub__", "truediv", "__truediv__", "div"})
_MULTIPLY = frozenset({"mul", "__mul__", "__rmul__"})
_SHAPE_ONLY = frozenset({"zeros_like", "new_zeros", "size", "sym_size", "dim"})
_ZEROS = frozenset({"zeros_like", "new_zeros", "zeros"})


@dataclass(frozen=True)
class RowFold:
    """Rows n >= lengths[b] + offset of the attention output are zeroed by the model before any use."""

    lengths: fx.Node
    offset: int
    zeroed_by: tuple[fx.Node, ...]
    """The ops that zero the rows (a multiply, where or masked_fill per path), for explain."""

    def rows(self) -> str:
        shift = f" + {self.offset}" if self.offset > 0 else f" - {-self.offset}" if self.offset < 0 else ""
        return f"n < {self.lengths.name}[b]{shift}"

    def describe(self) -> str:
        """What explain shows, e.g. ``query rows: n < len[b], from the output row mask at gem.py:519 in
        forward``."""
        places = []
        for node in self.zeroed_by:
            where = source_location(node)
            text = str(where) if where is not None else node.name
            if text not in places:
                places.append(text)
        packed = any(target_name(node) == "dense_to_jagged" for node in self.zeroed_by)
        how = "the output row mask" if not packed else "the packing into jagged tokens (dense_to_jagged)"
        return f"query rows: {self.rows()}, from {how} at {', '.join(places)}"


def downstream_row_mask(output: fx.Node, batch_dim: int, row_dim: int) -> RowFold:
    """The row mask every use of ``output`` (batch at ``batch_dim``, query rows at ``row_dim``) goes through
    before anything reads its rows (module docstring); Unproven, with the first use that reads them or the
    mask that is not ``n < lengths[b] + c``, otherwise."""
    found: list[tuple[fx.Node, int, fx.Node]] = []
    _walk(output, batch_dim, row_dim, found, set())
    if not found:
        raise Unproven(f"{output.name} is not used")
    lengths = {node for node, _, _ in found}
    if len(lengths) > 1:
        names = ", ".join(sorted(n.name for n in lengths))
        raise Unproven(f"the uses of {output.name} are masked by different lengths ({names})")
    (node,) = lengths
    # every path zeroes rows past its own bound; rows below the largest bound are kept on some path
    return RowFold(node, max(offset for _, offset, _ in found), tuple(z for _, _, z in found))


def _walk(node: fx.Node, batch: int, rows: int, found: list, seen: set) -> None:
    if (node, batch, rows) in seen:
        return
    seen.add((node, batch, rows))
    for user in node.users:
        if user.op not in ("call_function", "call_method"):
            what = "an output of the graph" if user.op == "output" else f"used by {user.op} {user.target}"
            raise Unproven(f"{node.name} is {what} before any query-row mask")
        name = target_name(user)
        if name in _SHAPE_ONLY and user.args and user.args[0] is node and _uses(user, node) == 1:
            continue  # reads the shape only
        zeroed = zeroing_rows(user, node, batch, rows) or _packed(user, node, batch, rows)
        if zeroed is not None:
            found.append((*zeroed, user))
            continue
        dims = _row_wise(user, node, name, batch, rows)
        if dims is None:
            raise Unproven(f"the attention output goes to `{name}` ({user.name}) before any query-row mask")
        _walk(user, *dims, found, seen)


def _uses(user: fx.Node, node: fx.Node) -> int:
    """How many times ``node`` is an argument of ``user``."""
    return sum(arg is node for arg in _flat((user.args, user.kwargs)))


def _flat(x):
    if isinstance(x, (list, tuple)):
        for a in x:
            yield from _flat(a)
    elif isinstance(x, dict):
        for a in x.values():
            yield from _flat(a)
    elif isinstance(x, slice):
        yield from _flat((x.start, x.stop, x.step))
    else:
        yield x


def _permuted_dim(node: fx.Node, dim: int) -> int:
    """Where dim goes under a transpose/permute node."""
    ndim = example_value(node.args[0]).dim()
    if target_name(node) == "permute":
        perm = node.args[1] if isinstance(node.args[1], (list, tuple)) else node.args[1:]
        return [p % ndim for p in perm].index(dim)
    a, b = (x % ndim for x in node.args[1:3])
    return b if dim == a else a if dim == b else dim


def _finite_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _row_wise(user: fx.Node, node: fx.Node, name: str, batch: int, rows: int) -> tuple[int, int] | None:
    """(batch dim, row dim) of ``user`` when it maps row (b, n) of ``node`` to its row (b, n) only and keeps
    finite rows finite; None otherwise."""
    if name in _SCALAR_OPS:
        return _scalar_arithmetic(user, node, name, batch, rows)
    if not user.args or user.args[0] is not node or _uses(user, node) != 1:
        return None
    value, before = example_value(user), example_value(node)
    if not isinstance(value, torch.Tensor) or not isinstance(before, torch.Tensor):
        return None
    if name in _PERMUTES:
        return _permuted_dim(user, batch), _permuted_dim(user, rows)
    if name in _VIEWS:
        keep = max(rows, batch) + 1
        if value.dim() < keep or tuple(value.shape[:keep]) != tuple(before.shape[:keep]):
            return None  # the view moves the batch or query-row dims
        return batch, rows
    if name in ("linear", "matmul", "__matmul__"):
        last = value.dim() - 1
        if value.dim() != before.dim() or rows == last or batch == last:
            return None
        if name != "linear" and example_value(user.args[1]).dim() != 2:
            return None  # a matmul by a 2-D weight only (a batched matmul mixes rows)
        return batch, rows
    if name in _POINTWISE:
        if any(isinstance(a, fx.Node) for a in _flat((user.args[1:], user.kwargs))):
            return None
        return batch, rows
    if name == "dropout":  # F.dropout(x, p, training, inplace): 0 stays 0, a finite row stays finite
        inplace = user.args[3] if len(user.args) > 3 else user.kwargs.get("inplace", False)
        other = [a for a in _flat((user.args[1:], user.kwargs)) if isinstance(a, fx.Node)]
        return None if inplace or other else (batch, rows)
    return None


def _scalar_arithmetic(user: fx.Node, node: fx.Node, name: str, batch: int,
                       rows: int) -> tuple[int, int] | None:
    """x op c or c op x with c a finite Python number (x / c only: c / x is infinite at a zero row)."""
    if name not in _SCALAR_OPS or user.kwargs or len(user.args) != 2 or _uses(user, node) != 1:
        return None
    other = user.args[1] if user.args[0] is node else user.args[0]
    if not _finite_number(other):
        return None
    divides = name in ("truediv", "__truediv__", "div")
    if divides and (user.args[0] is not node or other == 0):
        return None
    return batch, rows


# -- the zeroing ops ---------------------------------------------------------------------------------

def zeroing_rows(user: fx.Node, node: fx.Node, batch: int, rows: int) -> tuple[fx.Node, int] | None:
    """(lengths, offset) when ``user`` zeroes the rows n >= lengths[b] + offset of ``node`` (and keeps the
    others as they are); None when it is no zeroing op; Unproven when it zeroes by a mask that is not that."""
    name = target_name(user)
    if _uses(user, node) != 1:
        return None
    value = example_value(user)
    if not isinstance(value, torch.Tensor) or value.dim() != example_value(node).dim():
        return None
    one = statically_known_true(value.shape[batch] == 1)  # a batch of one: lengths read at 0 are per sample
    if name in _MULTIPLY and len(user.args) == 2 and not user.kwargs:
        other = user.args[1] if user.args[0] is node else user.args[0]
        if not isinstance(other, fx.Node):
            return None  # a number: arithmetic, not a mask
        return _row_mask(other, False, value.dim(), batch, rows, product=True, one=one)
    if name == "where":
        names = ("condition", "input", "other")[len(user.args):]
        args = list(user.args) + [user.kwargs.get(k) for k in names]
        if user.op == "call_method":  # x.where(cond, y)
            args = [args[1], args[0], args[2]] if len(args) >= 3 else args
        if len(args) < 3:
            return None
        cond, kept, other = args[:3]
        if kept is node and _is_zero(other):
            return _row_mask(cond, False, value.dim(), batch, rows, one=one)
        if other is node and _is_zero(kept):
            return _row_mask(cond, True, value.dim(), batch, rows, one=one)
        return None
    if name == "masked_fill" and user.args[0] is node:
        mask = user.args[1] if len(user.args) > 1 else user.kwargs.get("mask")
        fill = user.args[2] if len(user.args) > 2 else user.kwargs.get("value")
        if isinstance(mask, fx.Node) and _is_zero(fill):
            return _row_mask(mask, True, value.dim(), batch, rows, one=one)
    return None


def _packed(user: fx.Node, node: fx.Node, batch: int, rows: int) -> tuple[fx.Node, int] | None:
    """(lengths, 0) when ``user`` is fbgemm's ``dense_to_jagged(node, [offsets], ...)`` over (B, N, ...)
    rows: it reads only rows n < offsets[b + 1] - offsets[b] (generative-recommenders packs HSTU's output
    so), and its backward gives the other rows zero gradient, as a zeroing does. The lengths are the
    graph's own ``offsets[1:] - offsets[:-1]`` node (the one a mask built from the offsets reads); None when
    ``user`` is another op."""
    qualified = getattr(user.target, "_qualified_op_name", None) or (  # an op packet, or one overload of it
        f"{getattr(user.target, 'namespace', '')}::{target_name(user)}")
    if qualified != "fbgemm::dense_to_jagged":
        return None
    if not user.args or user.args[0] is not node or _uses(user, node) != 1 or (batch, rows) != (0, 1):
        raise Unproven(f"{user.name} (fbgemm dense_to_jagged) does not read {node.name} as (B, N, ...) rows")
    offsets = user.args[1] if len(user.args) > 1 else user.kwargs.get("x_offsets")
    if not isinstance(offsets, (list, tuple)) or len(offsets) != 1 or not isinstance(offsets[0], fx.Node):
        raise Unproven(f"{user.name} (fbgemm dense_to_jagged) packs by more than one offsets tensor")
    lengths = _offsets_lengths(offsets[0])
    if lengths is None:
        raise Unproven(f"{user.name} packs by {offsets[0].name}, but the graph computes no lengths "
                       f"{offsets[0].name}[1:] - {offsets[0].name}[:-1] for the kernel")
    return lengths, 0


def _offsets_lengths(offsets: fx.Node) -> fx.Node | None:
    """The node computing ``offsets[1:] - offsets[:-1]`` (a (B,) lengths tensor), if the graph has one."""

    def slice_of(x, want: tuple) -> bool:
        return (isinstance(x, fx.Node) and x.target is operator.getitem and x.args[0] is offsets
                and isinstance(x.args[1], slice) and (x.args[1].start, x.args[1].stop, x.args[1].step) == want)

    for user in offsets.users:
        for sub in user.users if slice_of(user, (1, None, None)) else ():
            if target_name(sub) in ("sub", "__sub__") and len(sub.args) == 2 and sub.args[0] is user \
                    and slice_of(sub.args[1], (None, -1, None)):
                return sub
    return None


def _is_zero(x) -> bool:
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return x == 0
    if not isinstance(x, fx.Node) or x.op not in ("call_function", "call_method"):
        return False
    name = target_name(x)
    if name in _ZEROS:
        return True
    if name in ("full", "full_like", "new_full") and len(x.args) >= 2:
        return _is_zero(x.args[-1]) and not isinstance(x.args[-1], fx.Node)
    return False


def _row_mask(mask: fx.Node, negated: bool, ndim: int, batch: int, rows: int,
              product: bool = False, one: bool = False) -> tuple[fx.Node, int]:
    """(lengths, offset) when ``mask`` (its complement if ``negated``), broadcast to ``ndim`` dims, keeps
    exactly the positions whose index at ``rows`` is < lengths[index at ``batch``] + offset; ``one``: the
    output has a batch of one, so lengths read at index 0 are read at the batch index."""
    evaluator = MaskEvaluator()
    value = evaluator.tensor(mask)
    pieces = getattr(value, "pieces", None)
    if pieces is not None:
        if not product or any(v not in (0.0, 1.0) for v, _ in pieces):
            raise Unproven(f"the attention output is multiplied by {mask.name}, which holds values other "
                           "than 0 and 1 (weights, not a row mask)")
        keep = value.as_bool()
    elif hasattr(value, "pred"):
        keep = value.pred
    else:
        raise Unproven(f"the attention output is multiplied by the integer tensor {mask.name}")
    if negated:
        keep = sympy.Not(keep)
    if value.ndim > ndim:
        raise Unproven(f"the row mask {mask.name} has more dims than the attention output")
    b, i = index_symbol(ndim - 1 - batch), index_symbol(ndim - 1 - rows)
    if one:
        keep = evaluator.lengths_at(keep, b)
    comparisons = [evaluator.atoms.expr_of[a] for a in keep.free_symbols]
    for _, e in comparisons:
        for f in e.atoms(sympy.Function):
            if f.func.__name__ in evaluator.leaves and f.args != (b,):
                raise Unproven(f"the row mask {mask.name} reads its lengths at another index than the batch "
                               "dim")
    for node, offset, prop in length_atoms(evaluator, comparisons, i):
        if equivalent(evaluator, keep, prop):
            if example_value(node).dtype not in (torch.int32, torch.int64):
                raise Unproven(f"{node.name} is not an integer lengths tensor")
            if evaluator.checks:
                raise Unproven(f"the row mask {mask.name} is proven only for data values checked at run time")
            return node, offset
    names = {index_symbol(k): f"d{ndim - 1 - k}" for k in range(ndim)} | {b: "b", i: "n"}
    raise Unproven(f"the attention output is kept where {render(evaluator, keep, names)}, not where "
                   "`n < lengths[b] + c`")
