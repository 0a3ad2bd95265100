"""``&``, ``|``, ``^`` and ``~`` on integer masks: bitwise, not logical. ``~`` of a uint8 0/1 mask is 255/254,
both nonzero, so ``(~m).bool()`` keeps every position; ``(2 * m) & m2`` is 0 everywhere. On bool tensors (and
torch.logical_*, whose result is bool) the evaluator reads them as logic; on integers it computes them here,
on the values of a piecewise mask or, for ``~`` of a signed index expression, as ``-e - 1``."""

from __future__ import annotations

import operator

import sympy
import torch
import torch.fx as fx

from gemcompile.passes.graph import Unproven, example_value
from gemcompile.passes.masks.values import BoolTensor, IntTensor, PiecewiseTensor, piecewise

_OPS = {"and": operator.and_, "or": operator.or_, "xor": operator.xor}


def _int_pieces(value):
    if isinstance(value, PiecewiseTensor):
        return [(int(v), c) for v, c in value.pieces]
    if isinstance(value, BoolTensor):  # a bool operand promotes to 0/1
        return [(1, value.pred), (0, sympy.Not(value.pred))]
    if isinstance(value, bool) or (isinstance(value, (int, sympy.Integer))):
        return [(int(value), sympy.true)]
    raise Unproven("a bitwise operation on an integer index expression (only on 0/1-style masks is it modeled)")


def bitwise(evaluator, node: fx.Node, kind: str):
    """The value of ``node`` (kind "and", "or", "xor" or "not") when its result is an integer tensor; None
    when it is bool (logic: the caller's business)."""
    dtype = example_value(node).dtype
    if dtype == torch.bool:
        return None
    if dtype.is_floating_point:
        raise Unproven(f"a bitwise operation giving {dtype}")
    ndim = example_value(node).dim()
    if kind == "not":
        src = evaluator.evaluate(node.args[0])
        if isinstance(src, IntTensor):
            if dtype == torch.uint8:
                raise Unproven("~ of a uint8 index expression")
            return IntTensor(ndim, -src.expr - 1)  # two's complement
        return piecewise(ndim, [(~v, c) for v, c in _int_pieces(src)])  # stored_as wraps uint8
    a, b = (evaluator.evaluate(x) for x in node.args[:2])
    op = _OPS[kind]
    pieces = [(op(x, y), sympy.And(cx, cy)) for x, cx in _int_pieces(a) for y, cy in _int_pieces(b)]
    return piecewise(ndim, pieces)
