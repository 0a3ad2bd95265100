"""Constant masks given as inputs: a causal ``triu(ones)`` kept as a module buffer, or a float causal mask
passed in (``nn.Transformer.generate_square_subsequent_mask(L)``), read as what it is.

Either is an input of the Dynamo graph, so the evaluator would see data. When its compile-time value
(graph.mark_buffer_values) is a triangle, ``x[i, j] = (j - i <= k)`` (tril) or ``(j - i >= k)`` (triu),
as bool, 0/1, or 0 and one fill value (float), the evaluator reads it as that formula, and the rewrite adds
a device-side check that the buffer still holds it at every call (a buffer changed in place stops the run
with a message instead of computing a mask the model no longer has).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx

from gemcompile.passes.graph import Emitter
from gemcompile.passes.masks.values import Abstract, Atoms, BoolTensor, index_symbol, piecewise


@dataclass(frozen=True)
class Triangle:
    """value[i, j] = inside if (j - i <= k when lower else j - i >= k) else outside."""

    lower: bool
    k: int
    inside: float | bool
    outside: float | bool

    def describe(self) -> str:
        return f"{self.inside} where j - i {'<=' if self.lower else '>='} {self.k}, else {self.outside}"


def find_triangle(value: torch.Tensor) -> Triangle | None:
    """The Triangle ``value`` (2-D, or with leading size-1 dims: GPT-2's and nanoGPT's ``tril(ones(n, n)).view(1,
    1, n, n)``) is, if it is one (two distinct values; one value: no mask to read)."""
    while value.dim() > 2 and value.shape[0] == 1:
        value = value[0]
    if value.dim() != 2 or value.numel() == 0 or value.is_complex():
        return None
    x = value.detach().cpu()
    distinct = torch.unique(x)
    if distinct.numel() != 2:
        return None
    n, m = x.shape
    d = torch.arange(m)[None, :] - torch.arange(n)[:, None]
    for inside in (distinct[0].item(), distinct[1].item()):
        outside = distinct[1].item() if inside == distinct[0].item() else distinct[0].item()
        hit = x == inside
        row0 = hit[0]
        # lower: row 0 keeps j <= k, so k = (count of hits in row 0) - 1; upper: k = first hit in row 0
        lower_k = int(row0.sum()) - 1
        upper_k = int(row0.float().argmax()) if row0.any() else m
        if torch.equal(hit, d <= lower_k):
            return Triangle(True, lower_k, inside, outside)
        if torch.equal(hit, d >= upper_k):
            return Triangle(False, upper_k, inside, outside)
    return None


def triangle_value(atoms: Atoms, triangle: Triangle, ndim: int, dtype: torch.dtype) -> Abstract:
    """The triangle as an abstract tensor of ``ndim`` dims (right-aligned indices: leading size-1 dims of a
    (1, 1, n, n) buffer are read at index 0)."""
    inside = atoms.compare("le" if triangle.lower else "ge", index_symbol(0) - index_symbol(1), triangle.k)
    if dtype == torch.bool:
        return BoolTensor(ndim, inside if triangle.inside else sympy.Not(inside))
    return piecewise(ndim, [(float(triangle.inside), inside), (float(triangle.outside), sympy.Not(inside))])


def emit_triangle_check(emit: Emitter, node: fx.Node, triangle: Triangle, value: torch.Tensor) -> None:
    """A device-side assert that the buffer still holds ``triangle`` (no host sync); leading size-1 dims
    broadcast."""
    n, m = value.shape[-2:]
    device = node.meta.get("example_value", value).device
    rows = emit.call(torch.reshape, (emit.call(torch.arange, (n,), {"device": device}), (-1, 1)))
    cols = emit.call(torch.reshape, (emit.call(torch.arange, (m,), {"device": device}), (1, -1)))
    offset = emit.call(operator.sub, (cols, rows))
    inside = emit.call(operator.le if triangle.lower else operator.ge, (offset, triangle.k))
    if value.dtype == torch.bool:
        expected = inside if triangle.inside else emit.call(torch.logical_not, (inside,))
    else:
        expected = emit.call(torch.where, (inside, float(triangle.inside), float(triangle.outside)))
        expected = emit.call(torch.Tensor.to, (expected, value.dtype))
    same = emit.call(torch.all, (emit.call(operator.eq, (node, expected)),))
    emit.call(torch._assert_async, (same, f"gemcompile: the mask {node.name} no longer holds the triangle "
                                          f"({triangle.describe()}) it held when the model was compiled; the "
                                          "attention rewrite relied on it (pass masks that change as bool or "
                                          "integer key masks, or recompile)"))
