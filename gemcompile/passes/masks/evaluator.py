"""Prove what an attention mask is, by evaluating the graph that builds it over index symbols.

Modelers build masks in many spellings (``arange(L)[None] < lengths[:, None]``, ``~(... >= ...)``,
``masked_fill`` of zeros, ``(1 - m.float()) * -1e9``, ``torch.where``, ``tril(ones)``...). Rather than
enumerate spellings, this module interprets the mask's subgraph abstractly: each tensor becomes a
function of its element index.

- an integer tensor is a sympy expression in index symbols (``arange`` gives the index itself; a
  per-sample integer tensor the graph does not build from known ops, e.g. a ``lengths`` input, is an
  opaque function of the batch index);
- a boolean tensor is a propositional formula over canonical integer comparisons;
- a float tensor is piecewise constant: a few (value, condition) pieces that partition the index space.

Index symbols are right-aligned (``r0`` is the last dim, ``r1`` the one before...), so broadcasting
needs no renaming. Comparisons are canonicalized for integers (``a <= b`` is ``a - b - 1 < 0``; a
negation ``not (e < 0)`` is ``-e - 1 < 0``) and each complementary pair shares one proposition, so two
masks are equal when their formulas are propositionally equivalent (sound: never equal by mistake).
Anything the evaluator does not model raises ``Unproven`` with a reason; the caller leaves the attention
alone and ``explain`` shows the reason.
"""

from __future__ import annotations

import functools
import math
import operator
from typing import Any

import sympy
import torch
import torch.fx as fx
from sympy.logic.boolalg import Boolean
from torch.fx.experimental.symbolic_shapes import statically_known_true

from gemcompile.passes.graph import BUFFER_VALUE, Emitter, Unproven, example_value, input_hint, target_name
from gemcompile.passes.masks.arange import arange_value
from gemcompile.passes.masks.bitwise import bitwise
from gemcompile.passes.masks.broadcast_dims import constant_dims
from gemcompile.passes.masks.constants import emit_triangle_check, find_triangle, triangle_value
from gemcompile.passes.masks.einsum_permutation import einsum_permutation
from gemcompile.passes.masks.int_select import compare_split, select
from gemcompile.passes.masks.mutation import check_not_updated
from gemcompile.passes.masks.split_reshape import merge_reshape, repeat_interleaved, split_reshape
from gemcompile.passes.masks.zero_one import selected_zero_one, zero_one_pieces
from gemcompile.passes.masks.values import (  # noqa: F401  (index_symbol and the values are read from here too)
    Abstract, Atoms, BoolTensor, DataLeaf, IntTensor, PiecewiseTensor, constant_scalar, piecewise, simplify_pred,
    triangle, index_symbol, check_constant_fits, check_fits_int, check_no_wrap, compare_rounded, comparison_dtype,
    float_op, stored_as, trunc_is_floor,
)

NEG_FILL_LIMIT = -1.0e4
"""Fill values at or below this act as -inf in a softmax (exp underflows to exactly 0 in every float
dtype for scores of ordinary magnitude); -inf, -1e9 and finfo.min all qualify."""


# -- the evaluator -----------------------------------------------------------------------------------

_COMPARE = {operator.lt: "lt", operator.le: "le", operator.gt: "gt", operator.ge: "ge", operator.eq: "eq",
            operator.ne: "ne", torch.lt: "lt", torch.le: "le", torch.gt: "gt", torch.ge: "ge", torch.eq: "eq",
            torch.ne: "ne", "lt": "lt", "le": "le", "gt": "gt", "ge": "ge", "eq": "eq", "ne": "ne",
            "__lt__": "lt", "__le__": "le", "__gt__": "gt", "__ge__": "ge", "__eq__": "eq", "__ne__": "ne"}
_AND = {operator.and_, torch.logical_and, torch.bitwise_and, "logical_and", "bitwise_and", "__and__"}
_OR = {operator.or_, torch.logical_or, torch.bitwise_or, "logical_or", "bitwise_or", "__or__"}
_XOR = {operator.xor, torch.logical_xor, torch.bitwise_xor, "logical_xor", "bitwise_xor", "__xor__"}
_NOT = {operator.invert, torch.logical_not, torch.bitwise_not, "logical_not", "bitwise_not", "__invert__"}
_ARITH = {operator.add: operator.add, operator.sub: operator.sub, operator.mul: operator.mul,
          operator.truediv: operator.truediv, operator.floordiv: operator.floordiv,
          torch.add: operator.add, torch.sub: operator.sub, torch.mul: operator.mul,
          torch.div: operator.truediv, torch.floor_divide: operator.floordiv, "add": operator.add,
          "sub": operator.sub, "mul": operator.mul, "div": operator.truediv, "floor_divide": operator.floordiv,
          "__add__": operator.add, "__sub__": operator.sub, "__mul__": operator.mul,
          "__truediv__": operator.truediv, "__floordiv__": operator.floordiv}
_REVERSED_ARITH = {"__radd__": operator.add, "__rsub__": operator.sub, "__rmul__": operator.mul,
                   "__rtruediv__": operator.truediv, "__rfloordiv__": operator.floordiv, "rsub": operator.sub}
_IDENTITY_METHODS = {"contiguous", "clone", "detach", "to", "type", "type_as", "cuda", "cpu", "requires_grad_",
                     "alias", "_to_copy", "convert_element_type", "as_tensor", "from_numpy", "asarray"}
_CONSTANT_MAKERS = {"ones", "zeros", "full", "ones_like", "zeros_like", "full_like", "new_ones", "new_zeros",
                    "new_full"}
_NUMPY = {"wrapped_ones": "ones", "wrapped_zeros": "zeros", "wrapped_tril": "tril", "wrapped_triu": "triu",
          "wrapped_arange": "arange"}  # np.* as Dynamo traces them (ReChorus: torch.from_numpy(np.arange(N)))
_TO_FLOAT = {"float", "half", "bfloat16", "double"}
_TO_INT = {"long", "int", "short"}
_FLOAT_DTYPES = {torch.float16, torch.bfloat16, torch.float32, torch.float64}
_INT_DTYPES = {torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8}


def _shape(node: fx.Node) -> tuple:
    value = example_value(node)
    if not isinstance(value, torch.Tensor):
        raise Unproven(f"no shape known for {node.name}")
    return tuple(value.shape)


def _is_one(size) -> bool:
    return statically_known_true(size == 1)


class MaskEvaluator:
    """Evaluates FX nodes (Dynamo-level torch ops) into abstract tensors; one instance per attention site."""

    def __init__(self):
        self.atoms = Atoms()
        self.leaves: dict[str, fx.Node] = {}  # opaque per-sample integer tensors, by function name
        self.data: dict[str, DataLeaf] = {}  # opaque data tensors (masks read from data), by function name
        self.zero_one: dict[str, fx.Node] = {}  # integer data read as 0/1 (checked at run time by the rewrite)
        self.checks: list = []  # device-side checks the rewrite must emit: each a callable(emitter)
        self.fills: set[float] = set()  # the values an additive mask drops scores with
        self.why: dict[str, str] = {}  # why a lengths leaf is opaque, for refusals
        self._memo: dict[fx.Node, Abstract] = {}
        self.fallback: set[str] = set()  # names of nodes that are leaves because their op is not modeled

    # -- helpers ---------------------------------------------------------------------------------
    def _scalar(self, x) -> sympy.Expr | float | bool:
        if isinstance(x, bool):
            return x
        if isinstance(x, int):
            return sympy.Integer(x)
        if isinstance(x, float):
            return x
        if isinstance(x, torch.SymInt):
            return sympy.sympify(x.node.expr)
        raise Unproven(f"unsupported constant {x!r}")

    def _with_unit_dims_zeroed(self, node: fx.Node, value: Abstract) -> Abstract:
        """A size-1 dim's index is always 0: substitute it so broadcasting stays exact."""
        shape = _shape(node)
        subs = {index_symbol(len(shape) - 1 - d): 0 for d, s in enumerate(shape) if _is_one(s)}
        return self._subs(value, subs) if subs else value

    def _subs(self, value: Abstract, subs: dict) -> Abstract:
        if not subs:
            return value
        if isinstance(value, IntTensor):
            return IntTensor(value.ndim, value.expr.subs(subs, simultaneous=True))
        if isinstance(value, BoolTensor):
            return BoolTensor(value.ndim, self._subs_pred(value.pred, subs))
        return piecewise(value.ndim, [(v, self._subs_pred(c, subs)) for v, c in value.pieces])

    def lengths_at(self, pred: Boolean, b: sympy.Symbol) -> Boolean:
        """``pred`` with the lengths read at index 0 read at ``b``: the same formula for a batch of one."""
        return self._subs_pred(pred, {sympy.Function(n)(0): sympy.Function(n)(b) for n in self.leaves})

    def _subs_pred(self, pred: Boolean, subs: dict) -> Boolean:
        """Substitute index symbols inside the comparisons a formula's propositions stand for."""
        replace = {}
        for atom in pred.free_symbols:
            kind, e = self.atoms.expr_of[atom]
            new_e = e.subs(subs, simultaneous=True)
            replace[atom] = self.atoms.lt0(new_e) if kind == "lt" else self.atoms.eq0(new_e)
        return simplify_pred(pred.xreplace(replace)) if replace else pred

    def relabel(self, value: Abstract, mapping: dict[int, int | None], ndim: int) -> Abstract:
        """Move right-aligned dim k to dim mapping[k] (None: the dim is gone, its index is 0)."""
        tmp = {index_symbol(k): sympy.Symbol(f"_t{k}", integer=True) for k in mapping}
        back = {sympy.Symbol(f"_t{k}", integer=True): (0 if j is None else index_symbol(j))
                for k, j in mapping.items()}
        moved = self._subs(self._subs(value, tmp), back)
        return type(moved)(ndim, *[getattr(moved, f) for f in ("expr", "pred", "pieces") if hasattr(moved, f)])

    def _leaf(self, node: fx.Node, why: str = "") -> IntTensor | BoolTensor:
        """An integer or boolean tensor the evaluator does not derive: an opaque function of its indices.
        A 1-D integer tensor is per-sample lengths (``len_*``); anything else is data (``dat_*``), whose
        value at a position is unknown but fixed: the rewrite reads the same tensor at run time."""
        value = example_value(node)
        if value.dim() == 1 and value.dtype != torch.bool:
            fname = f"len_{node.name}"
            self.leaves[fname], self.why[fname] = node, why
            return IntTensor(1, sympy.Function(fname)(index_symbol(0)))
        if value.dim() == 0:
            raise Unproven(f"{node.name} is an integer tensor of shape () that the mask prover does not model"
                           + (f" ({why})" if why else ""))
        fname, ndim = f"dat_{node.name}", value.dim()
        self.data[fname] = DataLeaf(node, why)
        copies = constant_dims(node)  # e.g. the heads of mask.view(B, 1, 1, L).expand(-1, H, -1, -1): index 0
        expr = sympy.Function(fname)(*[0 if ndim - 1 - d in copies else index_symbol(ndim - 1 - d)
                                       for d in range(ndim)])
        if value.dtype == torch.bool:
            return BoolTensor(ndim, sympy.Not(self.atoms.eq0(expr)))
        return IntTensor(ndim, expr)

    def data_function(self, expr: sympy.Expr) -> DataLeaf | None:
        """The data leaf ``expr`` applies, if it is one (``dat_x(...)``)."""
        name = getattr(getattr(expr, "func", None), "__name__", "")
        return self.data.get(name) if isinstance(expr, sympy.Function) else None

    # -- evaluation --------------------------------------------------------------------------------
    def evaluate(self, x: Any) -> Abstract | sympy.Expr | float | bool:
        if not isinstance(x, fx.Node):
            return self._scalar(x)
        if x not in self._memo:
            check_not_updated(x)  # not an opaque leaf either: its value depends on where it is read
            try:
                value = stored_as(self._evaluate_node(x), getattr(example_value(x), "dtype", torch.float64))
            except Unproven as error:
                value = self._opaque(x, error)
            if isinstance(value, (IntTensor, BoolTensor, PiecewiseTensor)):
                value = self._with_unit_dims_zeroed(x, value)
            self._memo[x] = value
        return self._memo[x]

    def _opaque(self, node: fx.Node, error: Unproven) -> Abstract:
        """An integer or boolean tensor the evaluator cannot derive is still an exact function of its indices: a
        leaf (masks read from data); a float one too when it selects from 0/1 masks (a cat: masks/zero_one.py).
        Other float tensors and 0-d values re-raise ``error``."""
        if (selected := selected_zero_one(self, node)) is not None:
            return selected
        value = example_value(node)
        if not isinstance(value, torch.Tensor) or value.dim() == 0 or not (
                value.dtype in _INT_DTYPES or value.dtype == torch.bool):
            raise error
        self.fallback.add(node.name)
        return self._leaf(node, why=str(error))

    def _from_fallback(self, expr) -> bool:
        """Whether expr reads a tensor that became a leaf only because its op is not modeled."""
        return any(f.func.__name__[4:] in self.fallback for f in sympy.sympify(expr).atoms(sympy.Function))

    def tensor(self, x: Any) -> Abstract:
        v = self.evaluate(x)
        if not isinstance(v, (IntTensor, BoolTensor, PiecewiseTensor)):
            raise Unproven(f"expected a tensor, got the constant {v!r}")
        return v

    def _evaluate_node(self, node: fx.Node):
        value = example_value(node)
        if isinstance(value, (torch.SymInt, int)) and not isinstance(value, bool):
            return sympy.sympify(value.node.expr) if isinstance(value, torch.SymInt) else sympy.Integer(value)
        if not isinstance(value, torch.Tensor):
            raise Unproven(f"{node.name} is not a tensor")
        if node.op in ("placeholder", "get_attr"):
            buffer = node.meta.get(BUFFER_VALUE)
            triangle = find_triangle(buffer) if buffer is not None else None
            if triangle is not None:  # a registered causal buffer: its formula, checked at every call
                self.checks.append(functools.partial(emit_triangle_check, node=node, triangle=triangle, value=buffer))
                return triangle_value(self.atoms, triangle, buffer.dim(), value.dtype)
            if value.dtype in _INT_DTYPES or value.dtype == torch.bool:
                return self._leaf(node, why=f"the input {node.name!r}")
            if value.requires_grad:  # s - (~valid) * self.mask_scale: learned, not a mask built outside
                raise Unproven(f"the mask reads {node.name!r}, a float tensor that requires grad (learned: a scale, "
                               "or a bias from before a graph break), not a fixed fill the kernels can drop keys for")
            raise Unproven(f"the mask reads the float input {node.name!r} ({value.dtype}): float data in a mask "
                           "is not proven (masks from lengths, ids, or a bool or integer mask input are); "
                           + input_hint(node))
        if node.op not in ("call_function", "call_method"):
            raise Unproven(f"{node.op} {node.target} in the mask")
        target = node.target
        name = _NUMPY.get(target_name(target), target_name(target))  # ReChorus' torch.from_numpy(np.tril(...))
        args, kwargs = node.args, node.kwargs
        ndim = value.dim()

        if target is torch.arange or name == "arange" and node.op == "call_function":
            return arange_value(self.evaluate, node)
        if name == "iota":  # what arange is after Inductor's decompositions (joint and post-grad graphs)
            start, step = node.kwargs.get("start", 0), node.kwargs.get("step", 1)
            return IntTensor(1, self._scalar(start) + self._scalar(step) * index_symbol(0))
        if name == "scalar_tensor":
            return self._constant_value(value, self.evaluate(node.args[0]))
        if name == "eye":  # the diagonal: row index == column index
            diagonal = self.atoms.compare("eq", index_symbol(1), index_symbol(0))
            if value.dtype == torch.bool:
                return BoolTensor(2, diagonal)
            return piecewise(2, [(1.0, diagonal), (0.0, sympy.Not(diagonal))])
        if name in _CONSTANT_MAKERS:  # by name: torch.full and aten.full alike
            return self._constant(node, value)
        if name in ("tensor", "as_tensor") and isinstance(args[0], (int, float, bool)):  # torch.tensor(1.0)
            return self._constant_value(value, args[0])
        if name == "repeat_interleave" and ndim > 1:  # a mask tiled over the heads into the batch
            return repeat_interleaved(self, node, self.tensor(args[0]))
        if name in ("repeat", "tile"):
            return self._repeat(node, self.tensor(args[0]))
        if target is operator.getitem:
            return self._getitem(node)
        if name in ("unsqueeze",):
            return self._unsqueeze(self.tensor(args[0]), args[1] if len(args) > 1 else kwargs.get("dim", kwargs.get("axis")), ndim)
        if name in ("view", "reshape", "expand", "expand_as", "broadcast_to", "view_as", "reshape_as", "flatten",
                    "unflatten", "squeeze"):  # (squeeze drops size-1 dims only: CANINE's molecule mask)
            return self._reshape(node, self.tensor(args[0]))
        if name in ("transpose", "swapaxes", "permute", "mT", "t") or (target is getattr and args[1] in ("T", "mT")):
            return self._permute(node, self.tensor(args[0]))  # getattr: ModernBERT's rows.T
        permutation = einsum_permutation(node) if name == "einsum" else None
        if permutation is not None:  # XLNet's einsum("ijbn->bnij", mask)
            operand, order = permutation
            return self._reorder(self.tensor(operand), order)
        if name in _COMPARE and len(args) == 2:
            return self._compare(_COMPARE[name], args[0], args[1], ndim)
        if target in _COMPARE:
            return self._compare(_COMPARE[target], args[0], args[1], ndim)
        kind = next((k for k, ops in (("and", _AND), ("or", _OR), ("xor", _XOR), ("not", _NOT))
                     if target in ops or name in ops), None)
        if kind is not None:
            return self._logic(node, kind, ndim)
        if name in ("tril", "triu"):
            return self._tril(node, name)
        if target is torch.where or name == "where":
            return self._where(node, ndim)
        if name in ("masked_fill", "masked_fill_"):
            return self._masked_fill(node, ndim)
        if name in _IDENTITY_METHODS or name in _TO_FLOAT or name in _TO_INT or name == "bool":
            return self._cast(node, value)
        if kwargs.get("alpha", 1) != 1 or (kwargs.get("rounding_mode") and value.dtype not in _INT_DTYPES):
            raise Unproven(f"`{name}` with alpha= or a float rounding_mode= in the mask")
        if name in ("div", "divide") and value.dtype in _INT_DTYPES and kwargs.get("rounding_mode"):  # floor, trunc
            if kwargs["rounding_mode"] == "trunc" and not trunc_is_floor(*(self.evaluate(a) for a in args[:2])):
                raise Unproven("integer division rounding toward zero of a value that may be negative")
            return self._arith(operator.floordiv, args[0], args[1], ndim, value)  # i // b spelled torch.div
        if name in ("bmm", "matmul", "__matmul__") and len(_shape(args[0])) > 1 and _shape(args[0])[-1] == 1 \
                and len(_shape(args[1])) > 1:
            return self._arith(operator.mul, args[0], args[1], ndim, value)  # CARCA's outer product of masks
        if target in _ARITH or name in _ARITH or name in _REVERSED_ARITH:
            op = _ARITH.get(target) or _ARITH.get(name) or _REVERSED_ARITH[name]
            a, b = (args[1], args[0]) if name in _REVERSED_ARITH else (args[0], args[1])
            return self._arith(op, a, b, ndim, value)
        if name in ("clamp", "clip", "clamp_min", "clamp_max", "minimum", "maximum") and value.dtype in _INT_DTYPES:
            return self._clamp(node, name, ndim)  # clamped position ids: HSTU's target and context masks
        if target in (abs, torch.abs) or name in ("abs", "__abs__"):  # |i - j|: sliding windows
            src, _ = self.tensor(args[0]), check_no_wrap(value.dtype)  # abs(int8 -128) is -128
            if not isinstance(src, IntTensor):
                raise Unproven("abs of a mask (only abs of integer index expressions is modeled)")
            return IntTensor(ndim, sympy.Abs(src.expr))
        if target in (operator.neg, torch.neg) or name in ("neg", "__neg__"):
            return self._arith(operator.mul, args[0], -1, ndim, value)
        raise Unproven(f"`{name}` ({node.name}) in the mask is not an op the mask prover models")

    def _logic(self, node: fx.Node, kind: str, ndim: int) -> Abstract:
        """and / or / xor / not: logic on bool results, bitwise on integer ones (~ of uint8 is 255 - x)."""
        integer = bitwise(self, node, kind)
        if integer is not None:
            return integer
        if kind == "not":
            return BoolTensor(ndim, simplify_pred(sympy.Not(self._pred(node.args[0]))))
        a, b = self._pred(node.args[0]), self._pred(node.args[1])
        return BoolTensor(ndim, simplify_pred({"and": sympy.And, "or": sympy.Or, "xor": sympy.Xor}[kind](a, b)))

    def _pred(self, x) -> Boolean:
        v = self.evaluate(x)
        if isinstance(v, bool):
            return sympy.true if v else sympy.false
        if isinstance(v, BoolTensor):
            return v.pred
        if isinstance(v, PiecewiseTensor):
            return v.as_bool()
        raise Unproven("an integer tensor is used as a boolean mask")

    def _constant(self, node: fx.Node, value: torch.Tensor) -> Abstract:
        name = _NUMPY.get(target_name(node.target), target_name(node.target))
        if name in ("ones", "ones_like", "new_ones"):
            fill = 1
        elif name in ("zeros", "zeros_like", "new_zeros"):
            fill = 0
        else:
            positional = node.args[1:] if name in ("full", "full_like") else node.args[-1:]  # new_full: last
            if "fill_value" not in node.kwargs and not positional:
                raise Unproven(f"`{name}` ({node.name}) without a fill value")
            fill = self.evaluate(node.kwargs.get("fill_value", positional[0] if positional else None))
        return self._constant_value(value, fill)

    def _constant_value(self, value: torch.Tensor, fill) -> Abstract:
        if isinstance(fill, sympy.Expr) and not fill.is_number:  # a size compiled as dynamic
            if value.dtype in _INT_DTYPES:
                return IntTensor(value.dim(), fill)
            raise Unproven(f"a {value.dtype} tensor filled with the symbolic size {fill}")
        if value.dtype == torch.bool:
            return BoolTensor(value.dim(), sympy.true if fill else sympy.false)
        if value.dtype in _INT_DTYPES:
            return IntTensor(value.dim(), sympy.Integer(int(fill)))
        return piecewise(value.dim(), [(float(fill), sympy.true)])

    def _getitem(self, node: fx.Node) -> Abstract:
        base, index = node.args
        src = self.tensor(base)
        index = index if isinstance(index, tuple) else (index,)
        if index and all(isinstance(i, fx.Node) for i in index):
            return self._gather(node, src, index)
        if any(i is Ellipsis for i in index):
            e = index.index(Ellipsis)
            fill = src.ndim - sum(1 for i in index if i is not None and i is not Ellipsis)
            index = index[:e] + (slice(None),) * fill + index[e + 1:]
        consumed = sum(1 for i in index if i is not None)
        index = index + (slice(None),) * (src.ndim - consumed)
        out_ndim = example_value(node).dim()
        mapping: dict[int, int | None] = {}
        subs, shifts = {}, {}
        src_dim, out_dim = 0, 0  # left-aligned positions
        for i in index:
            if i is None:
                out_dim += 1
            elif isinstance(i, slice):
                start = 0 if i.start is None else i.start
                if i.step not in (None, 1) or not isinstance(start, int) or start < 0:
                    raise Unproven("a sliced mask (only slices x[a:b] with a constant a >= 0 are modeled)")
                if start:  # value[p] = src[p + start]
                    shifts[index_symbol(src.ndim - 1 - src_dim)] = start
                mapping[src.ndim - 1 - src_dim] = out_ndim - 1 - out_dim
                src_dim += 1
                out_dim += 1
            elif isinstance(i, int):
                if i < 0:
                    raise Unproven("negative index into a mask")
                subs[index_symbol(src.ndim - 1 - src_dim)] = i
                src_dim += 1
            else:
                raise Unproven("tensor indexing in the mask")
        subs.update({x: x + c for x, c in shifts.items()})
        return self.relabel(self._subs(src, subs), mapping, out_ndim)

    def _gather(self, node: fx.Node, src: Abstract, index: tuple[fx.Node, ...]) -> Abstract:
        """mask[bi, ki] with an integer index tensor per dim (transformers' padding_mask[batch_idx, kv_idx]):
        the value at a position is src at the indices' values there (they broadcast, right-aligned)."""
        if len(index) != src.ndim:
            raise Unproven("tensor indexing of some of a mask's dims (only one index tensor per dim is modeled)")
        subs = {}
        for d, i in enumerate(index):
            value = self.tensor(i)
            if not isinstance(value, IntTensor) or example_value(i).dtype == torch.bool:
                raise Unproven(f"the mask is indexed by {i.name}, which is not an integer index tensor")
            if any(self.data_function(f) is not None for f in value.expr.atoms(sympy.Function)):
                # a table looked up by data (TransAct's action_type_lookup[ids + 1]): data at these positions
                raise Unproven(f"a tensor looked up by {i.name}, read from data")
            if value.expr.is_nonnegative is not True:  # pad[b, kv - 1] at kv = 0 reads the last key
                raise Unproven(f"the mask is indexed by {i.name}, which may be negative (counted from the end)")
            subs[index_symbol(src.ndim - 1 - d)] = value.expr
        out_ndim = example_value(node).dim()
        tmp = {k: sympy.Symbol(f"_g{k}", integer=True) for k in subs}
        moved = self._subs(src, tmp)
        moved = self._subs(moved, {tmp[k]: e for k, e in subs.items()})
        return type(moved)(out_ndim, *[getattr(moved, f) for f in ("expr", "pred", "pieces") if hasattr(moved, f)])

    def _unsqueeze(self, src: Abstract, dim: int, out_ndim: int) -> Abstract:
        dim = dim if dim >= 0 else dim + out_ndim
        mapping = {}
        for left in range(src.ndim):
            out_left = left if left < dim else left + 1
            mapping[src.ndim - 1 - left] = out_ndim - 1 - out_left
        return self.relabel(src, mapping, out_ndim)

    def _reshape(self, node: fx.Node, src: Abstract) -> Abstract:
        """Only reshapes that add, drop or expand size-1 dims: the non-unit dims keep their order."""
        if any(isinstance(a, torch.dtype) for a in (*node.args[1:], *node.kwargs.values())):
            raise Unproven(f"`view` ({node.name}) as another dtype reads the mask's bits as other values")
        in_shape = _shape(node.args[0])
        out_shape = _shape(node)
        in_dims = [d for d, s in enumerate(in_shape) if not _is_one(s)]
        out_dims = [d for d, s in enumerate(out_shape) if not _is_one(s)]
        name = target_name(node.target)
        if name in ("expand", "expand_as", "broadcast_to"):
            # expand keeps dims right-aligned; new size>1 dims come from size-1 dims whose index is 0
            return type(src)(len(out_shape), *[getattr(src, f) for f in ("expr", "pred", "pieces")
                                               if hasattr(src, f)])
        if len(in_dims) != len(out_dims):  # a split (d2l's rows shaped back) or a merge (heads tiled into the batch)
            split = split_reshape(self, src, in_shape, out_shape, in_dims, out_dims) or \
                merge_reshape(self, src, in_shape, out_shape, in_dims, out_dims)
            if split is None:
                raise Unproven(f"{name} merges or splits mask dims ({tuple(in_shape)} -> {tuple(out_shape)})")
            return split
        for a, b in zip(in_dims, out_dims):
            if not statically_known_true(in_shape[a] == out_shape[b]):
                raise Unproven(f"{name} reshapes mask dims ({tuple(in_shape)} -> {tuple(out_shape)})")
        mapping = {len(in_shape) - 1 - a: len(out_shape) - 1 - b for a, b in zip(in_dims, out_dims)}
        return self.relabel(src, mapping, len(out_shape))

    def _repeat(self, node: fx.Node, src: Abstract) -> Abstract:
        """repeat/tile that only copies size-1 dims (and adds leading dims) is an expand: value[..] = src[0..]."""
        in_shape, out_shape = _shape(node.args[0]), _shape(node)
        for k in range(1, len(in_shape) + 1):  # right-aligned: repeat's extra dims are leading
            if not _is_one(in_shape[-k]) and not statically_known_true(out_shape[-k] == in_shape[-k]):
                raise Unproven(f"`{target_name(node.target)}` ({node.name}) tiles a mask dim of size "
                               f"{in_shape[-k]} (only size-1 dims are modeled)")
        return type(src)(len(out_shape), *[getattr(src, f) for f in ("expr", "pred", "pieces") if hasattr(src, f)])

    def _permute(self, node: fx.Node, src: Abstract) -> Abstract:
        n = src.ndim
        name = target_name(node.target)
        if name in ("transpose", "swapaxes"):
            a, b = (d % n for d in node.args[1:3])
            order = list(range(n))
            order[a], order[b] = order[b], order[a]
        elif name == "permute":
            dims = node.args[1:] if not isinstance(node.args[1], (tuple, list)) else node.args[1]
            order = [d % n for d in dims]
        elif node.args[1:] == ("T",):  # x.T reverses every dim
            order = list(range(n))[::-1]
        else:  # mT / t: swap the last two
            order = [*range(n - 2), n - 1, n - 2]
        return self._reorder(src, order)

    def _reorder(self, src: Abstract, order: list[int]) -> Abstract:
        """src with its dims permuted: output dim p (left) holds input dim order[p]."""
        n = src.ndim
        return self.relabel(src, {n - 1 - order[p]: n - 1 - p for p in range(n)}, n)

    def _compare(self, op: str, a, b, ndim: int) -> BoolTensor:
        check_constant_fits(a, b)  # uint8 != -256 compares with -256 cast to uint8: 0
        va, vb = self.evaluate(a), self.evaluate(b)
        if isinstance(va, (BoolTensor, PiecewiseTensor)) or isinstance(vb, (BoolTensor, PiecewiseTensor)):
            return BoolTensor(ndim, self._compare_values(op, va, vb, comparison_dtype(a, b)))
        if (dtype := comparison_dtype(a, b)) in (torch.float16, torch.bfloat16):  # bf16 arange(257) < n: n = 256
            raise Unproven(f"integer positions compared in {dtype}, which rounds them")
        ea = va.expr if isinstance(va, IntTensor) else va
        eb = vb.expr if isinstance(vb, IntTensor) else vb
        ea, eb = (sympy.Integer(int(e)) if isinstance(e, bool) else e for e in (ea, eb))  # j < True is j < 1
        if isinstance(ea, float) or isinstance(eb, float):
            if isinstance(ea, float) and ea.is_integer():
                ea = sympy.Integer(int(ea))
            elif isinstance(eb, float) and eb.is_integer():
                eb = sympy.Integer(int(eb))
            else:
                raise Unproven("an integer index compared with a fractional float")
        return BoolTensor(ndim, simplify_pred(self.compare_exprs(op, ea, eb)))

    def compare_exprs(self, op: str, ea, eb) -> Boolean:
        """ea op eb, with the cases of an |u|, min, max or integer where inside split (masks/int_select.py)."""
        return compare_split(self.atoms, op, ea, eb)

    def _clamp(self, node: fx.Node, name: str, ndim: int) -> IntTensor:
        """Integer clamp / minimum / maximum (bounds may be per-sample tensors) as sympy Min and Max."""
        args, kwargs = node.args, node.kwargs
        if name in ("minimum", "maximum"):
            lo_or_hi = [self._int_expr(args[1])]
            x = self._int_expr(args[0])
            return IntTensor(ndim, (sympy.Min if name == "minimum" else sympy.Max)(x, *lo_or_hi))
        x = self._int_expr(args[0])
        if name == "clamp_min":
            lo, hi = args[1] if len(args) > 1 else kwargs.get("min"), None
        elif name == "clamp_max":
            lo, hi = None, args[1] if len(args) > 1 else kwargs.get("max")
        else:
            lo = kwargs.get("min", args[1] if len(args) > 1 else None)
            hi = kwargs.get("max", args[2] if len(args) > 2 else None)
        if lo is not None:
            x = sympy.Max(x, self._int_expr(lo))
        if hi is not None:
            x = sympy.Min(x, self._int_expr(hi))
        return IntTensor(ndim, x)

    def _int_expr(self, x) -> sympy.Expr:
        return self._as_int_expr(self.evaluate(x))

    def _as_int_expr(self, v) -> sympy.Expr:
        if isinstance(v, IntTensor):
            return v.expr
        if isinstance(v, sympy.Expr) and v.is_integer:
            return v
        pieces = self._as_pieces(v, 0) if isinstance(v, (BoolTensor, PiecewiseTensor)) else ()
        if pieces and all(float(value).is_integer() for value, _ in pieces):  # a 0/1 mask as an integer
            expr = sympy.Integer(int(pieces[-1][0]))
            for value, cond in pieces[:-1]:
                expr = select(self.atoms, cond, sympy.Integer(int(value)), expr)
            return expr
        raise Unproven("integer index expressions combined with a non-integer value")

    def _compare_values(self, op: str, va, vb, dtype: torch.dtype) -> Boolean:
        """A comparison where one side is a mask (bool or piecewise) and the other a constant."""
        if not isinstance(va, (BoolTensor, PiecewiseTensor)):
            va, vb, op = vb, va, {"lt": "gt", "gt": "lt", "le": "ge", "ge": "le"}.get(op, op)
        if isinstance(vb, (IntTensor, BoolTensor, PiecewiseTensor)):
            raise Unproven("two masks compared element-wise")
        pieces = va.pieces if isinstance(va, PiecewiseTensor) else ((1.0, va.pred), (0.0, sympy.Not(va.pred)))
        cmp = {"lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge, "eq": operator.eq,
               "ne": operator.ne}[op]
        return simplify_pred(sympy.Or(*[cond for v, cond in pieces if compare_rounded(cmp, v, float(vb), dtype)]))

    def _tril(self, node: fx.Node, name: str) -> Abstract:
        k = node.kwargs.get("diagonal", node.kwargs.get("k", node.args[1] if len(node.args) > 1 else 0))  # np: k
        k = self.evaluate(k) if isinstance(k, fx.Node) else k  # a diagonal from a dynamic size: symbolic
        return triangle(self.atoms, self.tensor(node.args[0]), name, k)

    def _as_pieces(self, v, ndim: int) -> tuple[tuple[float, Boolean], ...]:
        if isinstance(v, PiecewiseTensor):
            return v.pieces
        if isinstance(v, BoolTensor):
            return ((1.0, v.pred), (0.0, sympy.Not(v.pred)))
        if isinstance(v, (int, float, bool)) or (isinstance(v, sympy.Expr) and v.is_number):
            return ((float(v), sympy.true),)
        raise Unproven("an integer-valued tensor mixed into a float mask")

    def _where(self, node: fx.Node, ndim: int) -> Abstract:
        if node.op == "call_method":  # x.where(c, y) is where(c, x, y): graph.positional_arguments writes it so
            raise Unproven("x.where(...) in a spelling the passes did not rewrite as torch.where")
        cond = self._pred(node.args[0])
        x, y = self.evaluate(node.args[1]), self.evaluate(node.args[2])
        if example_value(node).dtype == torch.bool:
            px = self._pred(node.args[1]) if isinstance(node.args[1], fx.Node) else sympy.true if x else sympy.false
            py = self._pred(node.args[2]) if isinstance(node.args[2], fx.Node) else sympy.true if y else sympy.false
            return BoolTensor(ndim, simplify_pred(sympy.Or(sympy.And(cond, px), sympy.And(sympy.Not(cond), py))))
        dtype = example_value(node).dtype
        if dtype in _INT_DTYPES and (isinstance(x, IntTensor) or isinstance(y, IntTensor)):
            check_no_wrap(dtype)  # a uint8 where stores -1 as 255: the prover's integers do not wrap
            ex, ey = self._int_expr(node.args[1]), self._int_expr(node.args[2])
            info = torch.iinfo(dtype)
            if any(e.is_number and not info.min <= int(e) <= info.max for e in (ex, ey)):
                raise Unproven(f"an integer where in {dtype} holding a constant outside its range")
            return IntTensor(ndim, select(self.atoms, cond, ex, ey))
        pieces = [(v, sympy.And(cond, c)) for v, c in self._as_pieces(x, ndim)]
        pieces += [(v, sympy.And(sympy.Not(cond), c)) for v, c in self._as_pieces(y, ndim)]
        return piecewise(ndim, pieces)

    def _masked_fill(self, node: fx.Node, ndim: int) -> Abstract:
        base, mask, fill = node.args[0], node.args[1], node.args[2] if len(node.args) > 2 else node.kwargs["value"]
        if target_name(node.target) == "masked_fill_" and len(base.users) > 1:
            raise Unproven("an in-place masked_fill_ on a tensor that is used elsewhere")
        m = self._pred(mask)
        f = constant_scalar(self.evaluate(fill))
        if example_value(node).dtype == torch.bool:
            return BoolTensor(ndim, simplify_pred(sympy.Or(sympy.And(m, sympy.true if f else sympy.false),
                                                       sympy.And(sympy.Not(m), self._pred(base)))))
        pieces = [(float(f), m)] + [(v, sympy.And(sympy.Not(m), c)) for v, c in self._as_pieces(self.evaluate(base),
                                                                                            ndim)]
        return piecewise(ndim, pieces)

    def _cast(self, node: fx.Node, value: torch.Tensor) -> Abstract:
        src = self.tensor(node.args[0])
        dtype = value.dtype
        if dtype == torch.bool:
            if isinstance(src, BoolTensor):
                return src
            if isinstance(src, PiecewiseTensor):
                return BoolTensor(src.ndim, src.as_bool())
            return BoolTensor(src.ndim, sympy.Not(self.atoms.eq0(src.expr)))
        if dtype in _FLOAT_DTYPES:
            zero_one = zero_one_pieces(self, src)
            if zero_one is not None:  # an integer mask read from data used as a float: 0/1 (masks/zero_one.py)
                return zero_one
            if isinstance(src, IntTensor):
                raise Unproven("an integer index converted to float")
            return piecewise(src.ndim, self._as_pieces(src, src.ndim))
        if dtype in _INT_DTYPES:
            if isinstance(src, IntTensor):
                return check_no_wrap(dtype, getattr(example_value(node.args[0]), "dtype", None)) or src
            pieces = self._as_pieces(src, src.ndim)
            if example_value(node.args[0]).is_floating_point():
                check_fits_int(src, dtype)
            if all(float(v).is_integer() for v, _ in pieces):
                return piecewise(src.ndim, pieces)
        raise Unproven(f"a cast to {dtype} in the mask")

    def _arith(self, op, a, b, ndim: int, value: torch.Tensor) -> Abstract:
        va, vb = self.evaluate(a), self.evaluate(b)
        if value.dtype in _INT_DTYPES and (all(isinstance(v, (IntTensor, sympy.Expr)) for v in (va, vb)) or
                                           any(isinstance(v, IntTensor) for v in (va, vb))):
            # (ids * keep.long(): an integer, not a 0/1 mask; keep's pieces become a Select)
            check_no_wrap(value.dtype)  # int8 16 + 120 is -120: the prover's integers do not wrap
            ea, eb = self._as_int_expr(va), self._as_int_expr(vb)
            if ndim == 1 and (self._from_fallback(ea) or self._from_fallback(eb) or _shifted_reads(ea - eb)):
                # lengths = offsets[1:] - offsets[:-1]: one per-sample integer, not two unknowns
                raise Unproven("integer arithmetic on a tensor the prover reads as data")
            if op is operator.floordiv:
                return IntTensor(ndim, sympy.floor(ea / eb))
            if op is operator.truediv:
                raise Unproven("true division of integer indices")
            return IntTensor(ndim, op(ea, eb))
        if value.dtype == torch.bool:  # bool + bool is or, bool * bool is and (True + True is True)
            logic = {operator.add: sympy.Or, operator.mul: sympy.And}.get(op)
            if logic is None:
                raise Unproven("arithmetic on bool masks other than + and *")
            return BoolTensor(ndim, simplify_pred(logic(self._pred(a), self._pred(b))))
        # an integer mask from data added to a float one (StableLM's causal + attention_mask == 0): 0/1
        va, vb = (v if (read := zero_one_pieces(self, v)) is None else read for v in (va, vb))
        pa, pb = self._as_pieces(va, ndim), self._as_pieces(vb, ndim)
        pieces = []
        for x, cx in pa:
            for y, cy in pb:
                with_nan = float_op(op, x, y, value.dtype)  # NaN on a division by zero
                pieces.append((with_nan, sympy.And(cx, cy)))
        if any(math.isnan(v) for v, _ in pieces):
            raise Unproven("the mask arithmetic produces NaN (inf - inf or 0 * inf)")
        return piecewise(ndim, pieces)


def _shifted_reads(expr) -> bool:
    """Whether one leaf is read at two positions (offsets[1:] - offsets[:-1])."""
    seen: dict[str, tuple] = {}
    for f in sympy.sympify(expr).atoms(sympy.Function):
        if seen.setdefault(f.func.__name__, f.args) != f.args:
            return True
    return False


# -- a mask term of the scores as the condition that keeps a score -----------------------------------

def keep_predicate(evaluator: MaskEvaluator, mask: Abstract, kind: str) -> Boolean:
    """The condition under which a score is kept, for a boolean mask ("bool": True keeps) or an additive
    float mask ("additive": 0 keeps, a large negative value drops)."""
    if kind == "bool":
        if isinstance(mask, PiecewiseTensor):
            return mask.as_bool()
        if isinstance(mask, BoolTensor):
            return mask.pred
        raise Unproven("an integer tensor used as a boolean mask")
    if not isinstance(mask, PiecewiseTensor):
        raise Unproven("a non-float tensor used as an additive mask")
    keep, drop = [], []
    for v, c in mask.pieces:
        if v == 0:
            keep.append(c)
        elif v <= NEG_FILL_LIMIT:
            drop.append(c)
            evaluator.fills.add(float(v))
        else:
            raise Unproven(f"the additive mask holds {v!r}: neither 0 nor a large negative number (<= -1e4)")
    return simplify_pred(sympy.Or(*keep))
