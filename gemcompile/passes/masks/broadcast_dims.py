"""The dims along which a tensor in a mask's graph holds copies: what an ``expand`` over heads leaves behind.

A mask read from data becomes an opaque leaf of the evaluator, a function of every index of the node it
is read at (masks/evaluator.py ``_leaf``). When that node sits after ``mask.view(B, 1, 1, L).expand(-1, H,
-1, -1)`` (FuxiCTR's target attention), its head dim has size H, and a leaf indexed by h would read as "a
mask that differs between heads", though every head holds the same copy. ``constant_dims`` finds such dims
by walking back through the shape and elementwise ops: the leaf reads index 0 there instead. A tensor on
that walk that anything updates in place (through a view too) holds no such copies any more.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from gemcompile.passes.graph import example_value, permutation, target_name
from gemcompile.passes.masks.mutation import in_place_update

_EXPANDS = ("expand", "expand_as", "broadcast_to")
_PERMUTES = ("transpose", "swapaxes", "permute")
_ELEMENTWISE = {
    "eq", "ne", "lt", "le", "gt", "ge", "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__",
    "logical_and", "logical_or", "logical_not", "logical_xor", "bitwise_and", "bitwise_or", "bitwise_not",
    "__and__", "__or__", "__xor__", "__invert__", "add", "sub", "mul", "__add__", "__sub__", "__mul__",
    "__radd__", "__rsub__", "__rmul__", "rsub", "neg", "__neg__", "abs", "sign", "float", "half", "bfloat16",
    "double", "long", "int", "bool", "to", "type", "type_as", "contiguous", "clone", "detach", "where",
}
_OPERATORS = {operator.eq: "eq", operator.ne: "ne", operator.lt: "lt", operator.le: "le", operator.gt: "gt",
              operator.ge: "ge", operator.and_: "__and__", operator.or_: "__or__", operator.xor: "__xor__",
              operator.invert: "__invert__", operator.add: "add", operator.sub: "sub", operator.mul: "mul",
              operator.neg: "neg"}


def constant_dims(node, depth: int = 16) -> frozenset[int]:
    """Dims of ``node``'s tensor (counted from the right: 0 is the last) along which its value is provably
    constant: size-1 dims, and dims an expand or a repeat created, through the ops of ``_ELEMENTWISE`` and the
    shape ops that keep each dim's meaning (unsqueeze, permutes, reshapes adding or dropping size-1 dims)."""
    value = example_value(node) if isinstance(node, fx.Node) else None
    if not isinstance(value, torch.Tensor):
        return frozenset()
    ndim = value.dim()
    unit = frozenset(ndim - 1 - d for d, s in enumerate(value.shape) if _is_one(s))
    if depth <= 0 or node.op not in ("call_function", "call_method"):
        return unit
    if in_place_update(node) is not None:  # MEANTIME's repeated key mask made causal by .tril_(): no copies
        return unit
    name = _OPERATORS.get(node.target) or target_name(node.target)
    args = node.args
    if name in _EXPANDS:
        source = _tensor(args[0])
        if source is None:
            return unit
        src_ndim = source.dim()  # expand is right-aligned: dims past the source's are new copies
        inner = constant_dims(args[0], depth - 1)
        return unit | frozenset(r for r in range(ndim) if r >= src_ndim or r in inner)
    if name in ("repeat", "tile"):  # copies: constant where the source was (a repeated unit dim) or a new dim
        source = _tensor(args[0])
        if source is None:
            return unit
        inner = constant_dims(args[0], depth - 1)
        return unit | frozenset(r for r in range(ndim) if r >= source.dim() or r in inner)
    if name in ("cat", "concat", "concatenate"):  # NOVA's torch.cat([m] * H, 0): constant off the joined dim
        return unit | _through_cat(node, ndim, depth)
    if name in _ELEMENTWISE:
        tensors = [a for a in (*args, *node.kwargs.values()) if _tensor(a) is not None]
        if name == "where" and tensors:
            tensors = [a for a in args if _tensor(a) is not None]
        if not tensors:
            return unit
        found = frozenset(range(ndim))
        for t in tensors:  # constant where every operand is (broadcast: an operand's missing dims are)
            t_ndim = _tensor(t).dim()
            found &= frozenset(r for r in range(ndim) if r >= t_ndim or r in constant_dims(t, depth - 1))
        return unit | found
    if name == "unsqueeze":
        dim = args[1] if len(args) > 1 else node.kwargs.get("dim", node.kwargs.get("axis"))
        dim = dim if dim >= 0 else dim + ndim
        inner = constant_dims(args[0], depth - 1)
        mapped = {(r if r < ndim - 1 - dim else r + 1) for r in inner}
        return unit | frozenset(mapped)
    if name in _PERMUTES:
        order = permutation(node)
        if order is None:
            return unit
        inner = constant_dims(args[0], depth - 1)
        return unit | frozenset(ndim - 1 - p for p in range(ndim) if ndim - 1 - order[p] in inner)
    if name in ("view", "reshape", "view_as", "reshape_as"):
        return unit | _through_reshape(node, depth)
    return unit


def _through_cat(node: fx.Node, ndim: int, depth: int) -> frozenset[int]:
    """Dims other than the one a cat joins along which every part is constant."""
    parts = node.args[0] if node.args else node.kwargs.get("tensors")
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", node.kwargs.get("axis", 0))
    if not isinstance(parts, (list, tuple)) or not isinstance(dim, int) or not parts:
        return frozenset()
    if any(_tensor(p) is None or _tensor(p).dim() != ndim for p in parts):
        return frozenset()
    found = frozenset(r for r in range(ndim) if r != ndim - 1 - dim % ndim)
    for part in parts:
        found &= constant_dims(part, depth - 1)
    return found


def _through_reshape(node: fx.Node, depth: int) -> frozenset[int]:
    """The non-unit dims of a reshape that only adds or drops size-1 dims keep their order (and constancy)."""
    source = _tensor(node.args[0])
    value = example_value(node)
    in_dims = [d for d, s in enumerate(source.shape) if not _is_one(s)]
    out_dims = [d for d, s in enumerate(value.shape) if not _is_one(s)]
    if len(in_dims) != len(out_dims) or any(not _same(source.shape[a], value.shape[b])
                                            for a, b in zip(in_dims, out_dims)):
        return frozenset()
    inner = constant_dims(node.args[0], depth - 1)
    n_in, n_out = source.dim(), value.dim()
    return frozenset(n_out - 1 - b for a, b in zip(in_dims, out_dims) if n_in - 1 - a in inner)


def _tensor(x) -> torch.Tensor | None:
    value = example_value(x) if isinstance(x, fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _is_one(size) -> bool:
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return statically_known_true(size == 1)


def _same(a, b) -> bool:
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return statically_known_true(a == b)
