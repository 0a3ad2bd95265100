"""Which Dynamo-graph ops are token-wise, and how each is written on packed tokens.

An op is token-wise over a padded batch when its output has the batch and sequence dims (B, N) first
and output row (b, n) depends only on row (b, n) of its row operands (operands of shape (B, N, ...)).
Such an op commutes with packing: ``op(x)[valid] == op(x[valid])``, so it can run on the (T, ...)
packed rows. Every rule below is a property of the op alone, never of where its inputs came from: the
unpad pass's correctness rests on this table and on the two pad analyses in unpad.py.

The table, by op name (call_function's target name or call_method's method name):

- elementwise ops (broadcasting operands are aligned to the packed layout: an operand with the N dim
  is gathered by position, one with only the B dim by sample, one with neither is left as is);
- linear, layer_norm / rms_norm over trailing dims, embedding lookups of (B, N, ...) ids (``F.embedding`` and
  gemcompile::sparse_embedding in its nn.Embedding mode, the lookup of a sparsely trained table);
- softmax / reductions / cat / unflatten / flatten / transpose / getitem over trailing dims only;
- view / reshape that keep the (B, N) dims (a head split ``x.view(B, N, H, D)`` or its merge): they keep
  the row-major order of the elements, so row (b, n) of the output is row (b, n) of the input; on packed
  rows they become ``view(-1, *trailing)`` (the trailing sizes static).

``packed_args`` rewrites the dim arguments: dim d >= 2 becomes d - 1 (B and N fold into T), a negative
dim is unchanged; an op that names dim 0 or 1 is not token-wise.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from gemcompile.passes.graph import example_value, target_name

# f(0) = 0 for every one of these, so a tensor that is zero at the padding stays zero there.
ZERO_PRESERVING_UNARY = frozenset({
    "neg", "gelu", "relu", "silu", "tanh", "sin", "abs", "sqrt", "dropout", "float", "half", "bfloat16",
    "double", "long", "int", "to", "type_as", "contiguous", "floor", "ceil", "square", "erf", "mish",
    "leaky_relu", "elu", "hardswish", "log1p", "expm1", "clone", "round", "trunc",
})
ELEMENTWISE = ZERO_PRESERVING_UNARY | frozenset({
    "add", "sub", "mul", "truediv", "div", "pow", "sigmoid", "exp", "log", "cos", "rsqrt", "reciprocal",
    "clamp", "clamp_min", "clamp_max", "where", "softplus", "maximum", "minimum", "masked_fill", "eq",
    "ne", "lt", "le", "gt", "ge", "and_", "or_", "xor", "invert", "logical_not", "logical_and",
    "logical_or", "hardsigmoid", "sign", "radd", "rsub", "rmul", "rtruediv",
})
NORMS = frozenset({"layer_norm", "rms_norm"})
TAKES_SEQUENCE_ARGS = frozenset({"cat", "unflatten", "getitem", "layer_norm", "rms_norm", "sum", "mean", "amax",
                                 "amin", "to", "view", "reshape"})
"""Ops whose list/tuple arguments the rules below understand (sizes, dims, an index); any other op with
one is not classified."""
REDUCTIONS = frozenset({"sum", "mean", "amax", "amin", "logsumexp"})
SOFTMAX = frozenset({"softmax", "log_softmax"})


def shape_of(x: Any) -> tuple | None:
    value = example_value(x) if isinstance(x, fx.Node) else None
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def dtype_of(x: Any) -> torch.dtype | None:
    value = example_value(x) if isinstance(x, fx.Node) else None
    return value.dtype if isinstance(value, torch.Tensor) else None


def same_size(a, b) -> bool:
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return statically_known_true(a == b)


def has_rows(shape: tuple | None, batch, seq) -> bool:
    """The shape starts with (B, N)."""
    return shape is not None and len(shape) >= 2 and same_size(shape[0], batch) and same_size(shape[1], seq)


def packed_dim(dim: Any, rank: int) -> int | None:
    """A dim of a (B, N, ...) tensor of the given rank, in the packed (T, ...) tensor; None: 0 or 1."""
    if not isinstance(dim, int) or isinstance(dim, bool):
        return None
    if dim < 0:
        return dim if dim + rank >= 2 else None
    return dim - 1 if dim >= 2 else None


@dataclass(frozen=True)
class TokenWise:
    """How one node is token-wise: its row operands and how to build its packed copy."""

    node: fx.Node
    kind: str
    """'elementwise' (operands broadcast) or 'structural' (one row operand, other args are parameters)."""
    rows: tuple[fx.Node, ...]
    """The operands of shape (B, N, ...) (each is packed or gathered)."""
    translate: Callable[[tuple, dict], tuple[tuple, dict] | None]
    """(args, kwargs) -> the packed node's (args, kwargs) with dims moved (tensors untouched)."""


def node_argument(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    """Argument ``index`` of a call, or its keyword ``name`` (``default`` when neither is given)."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _set_arg(args: tuple, kwargs: dict, index: int, name: str, value: Any) -> tuple[tuple, dict]:
    if len(args) > index:
        args = args[:index] + (value,) + args[index + 1:]
    else:
        kwargs = {**kwargs, name: value}
    return args, kwargs


def _same(args, kwargs):
    return args, kwargs


def _dims_translator(index: int, name: str, rank: int, required: bool) -> Callable:
    """Translate the dim argument(s) at (index, name): an int or a tuple of ints, all trailing."""

    def translate(args, kwargs):
        dims = args[index] if len(args) > index else kwargs.get(name)
        if dims is None:
            return None if required else (args, kwargs)
        many = isinstance(dims, (tuple, list))
        moved = [packed_dim(d, rank) for d in (dims if many else [dims])]
        if any(m is None for m in moved):
            return None
        return _set_arg(args, kwargs, index, name, type(dims)(moved) if many else moved[0])

    return translate


def _getitem_translator(index: Any, rank: int) -> Callable | None:
    """x[idx] on trailing dims: (..., rest) or (:, :, rest) with rest of None / ints / int slices."""
    if not isinstance(index, tuple):
        return None

    def simple(i):
        return i is None or (isinstance(i, int) and not isinstance(i, bool)) or (
            isinstance(i, slice) and all(v is None or isinstance(v, int) for v in (i.start, i.stop, i.step)))

    if index and index[0] is Ellipsis:
        rest = index[1:]
        if not all(simple(i) for i in rest) or sum(i is not None for i in rest) > rank - 2:
            return None
        return _same
    full = slice(None)
    if len(index) >= 2 and index[0] == full and index[1] == full:
        rest = index[2:]
        if rest and rest[0] is Ellipsis:  # x[:, :, ..., i] is x[:, :, i] on the trailing dims
            rest = rest[1:]
        if not all(simple(i) for i in rest):  # (an Ellipsis anywhere else is not simple)
            return None
        packed_index = (full, *index[2:])
        return lambda args, kwargs: ((args[0], packed_index), kwargs)
    return None


def _view_rule(node: fx.Node, first: fx.Node, out_shape: tuple) -> TokenWise | None:
    """view / reshape of (B, N, ...) rows to (B, N, ...) rows (classify checked both): the packed copy is
    ``view(packed, (-1, *trailing))``; a reinterpreting ``view(dtype)`` keeps its argument."""
    if node.kwargs:
        return None
    if len(node.args) == 2 and isinstance(node.args[1], torch.dtype):
        return TokenWise(node, "structural", (first,), _same) if target_name(node) == "view" else None
    trailing = out_shape[2:]
    if not all(isinstance(s, int) for s in trailing):  # a symbolic trailing size: no static packed shape
        return None
    sizes = (-1, *trailing)
    return TokenWise(node, "structural", (first,), lambda args, kwargs: ((args[0], sizes), kwargs))


def _two_dims_rule(node: fx.Node, first: fx.Node, rank: int, one: tuple, two: tuple) -> TokenWise | None:
    """flatten / transpose: an op with two dim arguments (positions 1 and 2, names and defaults in
    ``one`` / ``two``), structural when both dims are trailing; each is shifted to the packed rank."""
    dims = [node_argument(node, position, name, default)
            for position, (name, default) in ((1, one), (2, two))]
    if any(packed_dim(d, rank) is None for d in dims):
        return None

    def translate(args, kwargs):
        for position, (name, _), d in zip((1, 2), (one, two), dims):
            args, kwargs = _set_arg(args, kwargs, position, name, packed_dim(d, rank))
        return args, kwargs

    return TokenWise(node, "structural", (first,), translate)


def classify(node: fx.Node, batch, seq) -> TokenWise | None:
    """The node's token-wise rule over rows (batch, seq), or None when it is not token-wise."""
    if node.op not in ("call_function", "call_method"):
        return None
    out = example_value(node)
    if not isinstance(out, torch.Tensor) or not has_rows(tuple(out.shape), batch, seq):
        return None
    name = target_name(node)
    tensors = [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, fx.Node)]
    if any(isinstance(a, (list, tuple)) for a in node.args[1:]) and name not in TAKES_SEQUENCE_ARGS:
        return None
    if name in ELEMENTWISE:
        if name == "dropout" and node_argument(node, 3, "inplace", False):
            return None
        rank = len(out.shape)
        # a row operand has the output's rank (right-aligned broadcasting puts its dims 0, 1 on B, N)
        rows = tuple(a for a in tensors if len(shape_of(a) or ()) == rank and has_rows(shape_of(a), batch, seq))
        for a in tensors:
            s = shape_of(a)
            if s is None or len(s) > rank:
                return None
        return TokenWise(node, "elementwise", rows, _same) if rows else None
    first = node.args[0] if node.args else None
    if not isinstance(first, fx.Node):
        if name == "cat" and node.args and isinstance(node.args[0], (list, tuple)):
            parts = node.args[0]
            if not parts or not all(isinstance(p, fx.Node) and has_rows(shape_of(p), batch, seq) for p in parts):
                return None
            translate = _dims_translator(1, "dim", len(out.shape), required=False)
            if translate(node.args, node.kwargs) is None or node_argument(node, 1, "dim", 0) in (0, 1):
                return None
            return TokenWise(node, "structural", tuple(parts), translate)
        return None
    in_shape = shape_of(first)
    if name == "sparse_embedding" and node_argument(node, 4, "mode") == 0:  # MODE_LOOKUP: F.embedding's rule
        name = "embedding"
    if not has_rows(in_shape, batch, seq) and name != "embedding":
        return None
    rank = len(in_shape)
    others = [a for a in tensors if a is not first]
    if any(has_rows(shape_of(a), batch, seq) for a in others):
        return None  # a second row operand in a structural op (e.g. x @ y of two sequences)
    if name == "linear":  # over a feature dim: on (B, N) it would contract the tokens
        return TokenWise(node, "structural", (first,), _same) if rank >= 3 else None
    if name == "matmul":  # x @ W by a weight of at most 2 dims (UniSRec's MoE gate x @ self.w_gate): per token
        weight = node.args[1] if len(node.args) == 2 and not node.kwargs else None
        return TokenWise(node, "structural", (first,), _same) \
            if rank >= 3 and weight in others and 1 <= len(shape_of(weight) or ()) <= 2 else None
    if name in NORMS:
        shape = node_argument(node, 1, "normalized_shape")
        n = 1 if isinstance(shape, int) else len(shape) if isinstance(shape, (tuple, list)) else None
        return TokenWise(node, "structural", (first,), _same) if n is not None and n <= rank - 2 else None
    if name == "embedding":
        ids = shape_of(first)
        if not has_rows(ids, batch, seq):
            return None
        if target_name(node.target) == "embedding" and (node_argument(node, 3, "max_norm") is not None
                                                        or node_argument(node, 5, "scale_grad_by_freq", False)):
            return None  # renormalizes the weight rows of every id looked up / counts every id: pad rows too
        return TokenWise(node, "structural", (first,), _same)
    if name in SOFTMAX:
        translate = _dims_translator(1, "dim", rank, required=True)
        return TokenWise(node, "structural", (first,), translate) if translate(node.args, node.kwargs) else None
    if name in REDUCTIONS:
        translate = _dims_translator(1, "dim", rank, required=True)
        if len(out.shape) < 2 or translate(node.args, node.kwargs) is None:
            return None
        return TokenWise(node, "structural", (first,), translate)
    if name == "unflatten":
        translate = _dims_translator(1, "dim", rank, required=True)
        return TokenWise(node, "structural", (first,), translate) if translate(node.args, node.kwargs) else None
    if name == "flatten":
        return _two_dims_rule(node, first, rank, ("start_dim", 0), ("end_dim", -1))
    if name == "transpose":
        return _two_dims_rule(node, first, rank, ("dim0", None), ("dim1", None))
    if name in ("view", "reshape"):
        return _view_rule(node, first, tuple(out.shape))
    if name == "getitem" and node.target is operator.getitem:
        translate = _getitem_translator(node.args[1], rank)
        return TokenWise(node, "structural", (first,), translate) if translate else None
    return None


def zero_preserving(tw: TokenWise, zero: Callable[[Any], bool], is_mask: Callable[[Any], bool]) -> bool:
    """Whether the output is zero at every padded row, given which inputs are (``zero``) and which operands
    are the region's own length mask (``is_mask``: the product with it is zero at the padding)."""
    name = target_name(tw.node)
    args = [*tw.node.args, *tw.node.kwargs.values()]
    tensors = [a for a in args if isinstance(a, fx.Node)]
    if name == "mul":
        return any(zero(a) or is_mask(a) for a in tensors)
    if name in ("truediv", "div"):
        return bool(tw.node.args) and zero(tw.node.args[0])
    if name in ("add", "sub"):
        scalars_zero = all(a == 0 for a in tw.node.args if isinstance(a, (int, float)) and not isinstance(a, bool))
        return scalars_zero and "alpha" not in tw.node.kwargs and all(zero(a) for a in tensors)
    if name in ZERO_PRESERVING_UNARY or name in ("unflatten", "flatten", "transpose", "getitem", "sum",
                                                 "amax", "amin", "mean", "rms_norm", "view", "reshape"):
        return bool(tw.rows) and all(zero(r) for r in tw.rows)
    if name == "linear":
        bias = node_argument(tw.node, 2, "bias")
        return bias is None and zero(tw.node.args[0])
    if name == "matmul":
        return zero(tw.node.args[0])
    if name == "cat":
        return all(zero(r) for r in tw.rows)
    return False
