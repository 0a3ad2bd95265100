"""The abstract tensors of the mask evaluator (masks/evaluator.py) and the propositions they are made of.

Index symbols are right-aligned (``r0`` is the last dim): an integer tensor is a sympy expression in them,
a boolean tensor a propositional formula over canonical integer comparisons (``Atoms``: ``e < 0`` and
``e == 0``, each complementary pair sharing one proposition), a float tensor a few (value, condition)
pieces that partition the index space. A tensor read as data (``DataLeaf``) is an opaque function of its
indices inside those expressions.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import sympy
import torch
import torch.fx as fx
from sympy.logic.boolalg import Boolean, BooleanFalse, BooleanTrue

from gemcompile.passes.graph import Unproven, example_value


def index_symbol(k: int) -> sympy.Symbol:
    """The index along the k-th dim from the right."""
    return sympy.Symbol(f"r{k}", integer=True, nonnegative=True)


@dataclass(frozen=True)
class DataLeaf:
    """A tensor of the mask the evaluator reads as data: ``node`` (int or bool), and why it is opaque."""

    node: fx.Node
    why: str = ""


@dataclass(frozen=True)
class IntTensor:
    """value[idx] = expr(idx), an integer."""

    ndim: int
    expr: sympy.Expr


@dataclass(frozen=True)
class BoolTensor:
    """value[idx] = pred(idx)."""

    ndim: int
    pred: Boolean


@dataclass(frozen=True)
class PiecewiseTensor:
    """value[idx] = v for the one (v, cond) piece whose cond holds at idx."""

    ndim: int
    pieces: tuple[tuple[float, Boolean], ...]

    def as_bool(self) -> Boolean:
        return simplify_pred(sympy.Or(*[c for v, c in self.pieces if v != 0]))


Abstract = IntTensor | BoolTensor | PiecewiseTensor


def simplify_pred(pred: Boolean) -> Boolean:
    if isinstance(pred, (BooleanTrue, BooleanFalse)):
        return pred
    return sympy.simplify_logic(pred, force=True) if len(pred.free_symbols) <= 8 else pred


def piecewise(ndim: int, pieces) -> PiecewiseTensor:
    """Merge pieces with equal values, drop impossible ones."""
    merged: dict[float, Boolean] = {}
    for v, c in pieces:
        if c is sympy.false:
            continue
        key = float(v)
        merged[key] = sympy.Or(merged[key], c) if key in merged else c
    simplified = ((v, simplify_pred(c)) for v, c in merged.items())  # (x & ~x: a fill that covers a piece)
    return PiecewiseTensor(ndim, tuple((v, c) for v, c in simplified if c is not sympy.false))


# -- canonical comparisons --------------------------------------------------------------------------

@dataclass
class Atoms:
    """The propositions of one evaluation: each canonical integer comparison -> its sympy symbol."""

    by_key: dict[tuple[str, sympy.Expr], sympy.Symbol] = field(default_factory=dict)
    expr_of: dict[sympy.Symbol, tuple[str, sympy.Expr]] = field(default_factory=dict)

    def _symbol(self, kind: str, e: sympy.Expr) -> sympy.Symbol:
        key = (kind, e)
        if key not in self.by_key:
            s = sympy.Symbol(f"A{len(self.by_key)}")
            self.by_key[key] = s
            self.expr_of[s] = key
        return self.by_key[key]

    def lt0(self, e: sympy.Expr) -> Boolean:
        """The proposition `e < 0` for integer e; `e < 0` and `-e - 1 < 0` share one symbol."""
        e = sympy.expand(e)
        if e.is_number:
            return sympy.true if e < 0 else sympy.false
        other = sympy.expand(-e - 1)
        if sympy.default_sort_key(other) < sympy.default_sort_key(e):
            return sympy.Not(self._symbol("lt", other))
        return self._symbol("lt", e)

    def eq0(self, e: sympy.Expr) -> Boolean:
        factors = [f for f in sympy.factor_terms(e).as_ordered_factors() if not f.is_number]
        if len(factors) > 1:  # an integer product is 0 iff a factor is: DeBERTa's m[b, i] * m[b, j]
            return sympy.Or(*[self.eq0(f) for f in factors])
        e = sympy.expand(e)
        if e.is_number:
            return sympy.true if e == 0 else sympy.false
        neg = sympy.expand(-e)
        if sympy.default_sort_key(neg) < sympy.default_sort_key(e):
            e = neg
        return self._symbol("eq", e)

    def compare(self, op: str, a: sympy.Expr, b: sympy.Expr) -> Boolean:
        d = a - b
        return {
            "lt": lambda: self.lt0(d),
            "le": lambda: self.lt0(d - 1),
            "gt": lambda: self.lt0(-d),
            "ge": lambda: self.lt0(-d - 1),
            "eq": lambda: self.eq0(d),
            "ne": lambda: sympy.Not(self.eq0(d)),
        }[op]()


def triangle(atoms: Atoms, src, name: str, k) -> BoolTensor | PiecewiseTensor:
    """``src.tril(k)`` (keeps col <= row + k) or ``src.triu(k)`` (col >= row + k) of a bool or float mask."""
    row, col = index_symbol(1), index_symbol(0)
    keep = atoms.compare("le" if name == "tril" else "ge", col, row + k)
    if isinstance(src, BoolTensor):
        return BoolTensor(src.ndim, simplify_pred(sympy.And(src.pred, keep)))
    if isinstance(src, PiecewiseTensor):
        kept = [(v, sympy.And(c, keep)) for v, c in src.pieces]
        return piecewise(src.ndim, kept + [(0.0, sympy.Not(keep))])
    if isinstance(src, IntTensor) and src.expr.is_number:  # ReChorus' tril(ones(..., dtype=int)): two values
        return piecewise(src.ndim, [(float(src.expr), keep), (0.0, sympy.Not(keep))])
    raise Unproven(f"{name} of an integer tensor that is not a constant")


def trunc_is_floor(a, b) -> bool:
    """Whether a / b rounds the same toward zero and down: a >= 0 and b > 0 (WeNet's chunk index i // c)."""
    ea, eb = (v.expr if isinstance(v, IntTensor) else v for v in (a, b))
    return getattr(ea, "is_nonnegative", False) is True and getattr(eb, "is_positive", False) is True


_NARROW_INTS = (torch.int8, torch.uint8, torch.int16)


def check_no_wrap(dtype: torch.dtype, source: torch.dtype | None = None) -> None:
    """Unproven where integers may wrap around, which the prover's unbounded integers do not model:
    arithmetic computed in int8, uint8 or int16 (``source`` None), or a cast into one of them from a type with
    values outside it (``lengths.to(torch.int8)`` of 200 is -56). int32 and int64 are taken not to wrap
    (the kernels read lengths as int32)."""
    if dtype not in _NARROW_INTS:
        return None
    if source is None:
        raise Unproven(f"integer arithmetic in {dtype} may wrap around")
    if source.is_floating_point or source == torch.bool:
        return None
    wide, narrow = torch.iinfo(source), torch.iinfo(dtype)
    if wide.min < narrow.min or wide.max > narrow.max:
        raise Unproven(f"a cast from {source} to {dtype} may wrap around")
    return None


def check_constant_fits(a, b) -> None:
    """Unproven when an integer tensor is compared with a Python int outside its dtype's range: torch casts
    the number to the tensor's dtype first (uint8 ``!= -256`` is ``!= 0``, ``< 300`` is ``< 44``), which the
    prover's unbounded comparison does not model."""
    for tensor, number in ((a, b), (b, a)):
        value = example_value(tensor) if isinstance(tensor, fx.Node) else None
        scalar = example_value(number) if isinstance(number, fx.Node) else None
        if isinstance(value, torch.Tensor) and value.dim() > 0 and isinstance(scalar, torch.Tensor) \
                and scalar.dim() == 0 and _wider_int(scalar.dtype, value.dtype):
            # a 0-d tensor takes the dimensioned one's dtype too (uint8 < tensor(260) compares with 4)
            raise Unproven(f"{tensor.name} ({value.dtype}) is compared with a 0-d {scalar.dtype} tensor: torch "
                           "casts it to that dtype first, wrapping values outside its range")
        if not isinstance(value, torch.Tensor) or isinstance(number, (fx.Node, bool)):
            continue
        if isinstance(number, int) and not value.is_floating_point() and value.dtype != torch.bool:  # a float
            # number promotes the comparison to float instead
            info = torch.iinfo(value.dtype)
            if not info.min <= number <= info.max:
                raise Unproven(f"{tensor.name} ({value.dtype}) is compared with {number!r}, outside its range: "
                               "torch casts the number to that dtype first, wrapping it")



def _wider_int(wide: torch.dtype, narrow: torch.dtype) -> bool:
    """Whether integer dtype ``wide`` holds values integer dtype ``narrow`` does not."""
    if wide.is_floating_point or narrow.is_floating_point or torch.bool in (wide, narrow):
        return False
    w, n = torch.iinfo(wide), torch.iinfo(narrow)
    return w.min < n.min or w.max > n.max


def stored_as(value, dtype: torch.dtype):
    """``value`` with a piecewise tensor's values as torch stores them in ``dtype``: the prover computes in exact
    arithmetic, torch rounds every op's result to its dtype (fp32 ``1 + 1e8`` is 1e8, fp16 ``-1e9`` is -inf,
    int32 ``2**32`` and uint8 ``256`` wrap to 0)."""
    if not isinstance(value, PiecewiseTensor) or dtype == torch.bool:
        return value
    if dtype.is_floating_point:
        stored = [(torch.tensor(v, dtype=torch.float64).to(dtype).item(), c) for v, c in value.pieces]
    else:
        info = torch.iinfo(dtype)
        span = info.max - info.min + 1
        if any(not float(v).is_integer() for v, _ in value.pieces):
            raise Unproven(f"a {dtype} mask holding non-integer values")
        stored = [(float((int(v) - info.min) % span + info.min), c) for v, c in value.pieces]  # two's complement
    return piecewise(value.ndim, stored) if stored != list(value.pieces) else value


def check_fits_int(value, dtype: torch.dtype) -> None:
    """Unproven when a float mask cast to an integer dtype holds a value outside it (C++ leaves that undefined)."""
    if isinstance(value, PiecewiseTensor) and not dtype.is_floating_point and dtype != torch.bool:
        info = torch.iinfo(dtype)
        for v, _ in value.pieces:
            if not info.min <= v <= info.max:
                raise Unproven(f"a float mask value {v!r} cast to {dtype}, outside its range")


def float_op(op, x: float, y: float, dtype: torch.dtype) -> float:
    """``op(x, y)`` as torch computes it for a result of ``dtype``: a float result in its compute type (float32
    for float16 / bfloat16 / float32, float64 for float64), then rounded to ``dtype``. A Python scalar enters a
    product or quotient in the compute type on CPU and CUDA alike (float16 ``0 * -1e9`` is 0, not 0 * -inf);
    a sum's kernels differ (bfloat16 ``x - 3.3`` rounds 3.3 to bfloat16 first on CPU, not on CUDA): Unproven
    where the two give different values. An integer result is exact (``stored_as`` wraps it); a division by
    zero is NaN (the mask refuses it)."""
    if y == 0 and op in (operator.truediv, operator.floordiv, operator.mod):
        return math.nan
    if not dtype.is_floating_point:
        return op(x, y)
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    results = set()
    for operands in {compute} if op in (operator.mul, operator.truediv) else {dtype, compute}:
        a, b = (torch.tensor(v, dtype=torch.float64).to(operands).to(compute) for v in (x, y))
        r = op(a, b).to(dtype).item()
        results.add("nan" if math.isnan(r) else r)
    if len(results) > 1:
        raise Unproven(f"a mask computed in {dtype} whose value depends on where torch rounds a scalar")
    (r,) = results
    return math.nan if r == "nan" else r


def compare_rounded(cmp, x: float, c: float, dtype: torch.dtype) -> bool:
    """``x cmp c`` for a tensor value x compared with a Python number c in ``dtype`` (torch casts both to the
    comparison's dtype first: float32 ``0.1f > 0.1`` is False, int64 2**24 + 1 is 2**24 against a float);
    Unproven where rounding c to ``dtype`` or to its compute type give different answers."""
    if not dtype.is_floating_point:
        return cmp(x, c)
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    x = torch.tensor(x, dtype=torch.float64).to(dtype).item()  # an int64 mask compared in float32 is rounded too
    answers = {cmp(x, torch.tensor(c, dtype=torch.float64).to(d).item()) for d in (dtype, compute)}
    if len(answers) > 1:
        raise Unproven(f"a mask compared with {c!r}, which {dtype} does not hold exactly, at a value it rounds to")
    return answers.pop()


def comparison_dtype(a, b) -> torch.dtype:
    """The dtype torch compares operands ``a`` and ``b`` (nodes or Python numbers) in (float64 if unknown)."""
    values = [example_value(x) if isinstance(x, fx.Node) else x for x in (a, b)]
    if not all(isinstance(v, (torch.Tensor, int, float, bool)) for v in values):
        return torch.float64
    return torch.result_type(*values)


def constant_scalar(value):
    """A scalar argument as a number (masked_fill's value): a Python scalar, or a 0-dim tensor of one constant
    (``masked_fill(mask, torch.tensor(-inf))``, RecBole's DIN)."""
    if isinstance(value, PiecewiseTensor):
        if value.ndim == 0 and len(value.pieces) == 1 and value.pieces[0][1] == sympy.true:
            return value.pieces[0][0]
        raise Unproven("a masked_fill whose value is a tensor other than one constant")
    if isinstance(value, IntTensor) and value.ndim == 0 and value.expr.is_number:
        return int(value.expr)
    if isinstance(value, (BoolTensor, IntTensor)):
        raise Unproven("a masked_fill whose value is a tensor other than one constant")
    return value
