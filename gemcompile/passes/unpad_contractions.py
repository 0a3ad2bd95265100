"""Readers that sum over the tokens against a factor zero at the padding: pad-blind for the unpad pass.

    torch.bmm(w.unsqueeze(1), h)          w = valid / valid.sum(-1, keepdim=True)   (weighted mean pooling)
    torch.einsum("bld,bl->bd", h, valid)                                            (two-tower user towers)
    torch.matmul(scores.unsqueeze(1), h)  scores = s.masked_fill(~valid, 0)         (DIN's attention pooling)

Each output element is a sum over the tokens n of h[b, n, ...] * w[b, ..., n]; where the row mask does not
hold, w is 0, so h's padded rows do not change it (as in ``(h * valid).sum(1)``; h finite). ``zero_at``
proves a factor zero there: the row mask itself, a zeroing by it (masked_fill / where), and the
products, quotients, zero-preserving maps, dtype casts and dim shuffles (unsqueeze, squeeze, transpose,
expand, same-shape views) of such a factor. A product with such a factor ignores the padded rows too
(unpad_pad_blind: sentence-transformers' weighted mean, ``h * (mask * positions)``).

A reader computed on the padded rows (the exit's zeros there) may also take a factor that is 0 or NaN at the
padding (``empty_nan``): the softmax of scores filled with -inf outside the row mask (NARM's and DIN's
``softmax(s.masked_fill(~valid, -inf), 1)``) is exactly 0 at the padding, or NaN over a whole row with no
valid token, and 0 * h and NaN * h do not depend on a finite h. A finite fill (-1e9) does not qualify: a
sample with no valid token spreads its weights over the padded rows.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import fx

from gemcompile.passes.graph import example_value, target_name
from gemcompile.passes.token_wise import ZERO_PRESERVING_UNARY, node_argument, same_size, shape_of

PadAnalysis = Any
"""unpad_pad_blind.PadAnalysis (which imports this module): its is_mask and zeroing_of."""

Rows = tuple[int, int]
"""The positions of the batch and the token dim in a value."""

CONTRACTIONS = frozenset({"bmm", "matmul", "einsum"})


def contraction_blind(analysis: PadAnalysis, user: fx.Node, node: fx.Node, rows: Rows) -> bool:
    """Whether the bmm / matmul / einsum ``user`` reads ``node`` (rows at ``rows``) only through a sum over the
    tokens against a factor zero at the padding, and whether that result ignores them as a whole."""
    operands = _operands(user)
    if operands is None or operands.count(node) != 1:
        return False
    shapes = [shape_of(a) for a in operands]
    if any(s is None for s in shapes):
        return False
    mine = operands.index(node)
    other, other_shape = operands[1 - mine], shapes[1 - mine]
    if target_name(user) == "einsum":
        factor_rows = _einsum_factor_rows(user.args[0], mine, rows)
    else:  # (..., M, K) @ (..., K, N) of one rank: the tokens must be the contracted K
        rank = len(shapes[mine])
        if len(other_shape) != rank or rank < 3 or rows[0] != 0:
            return False
        token_dim, other_token_dim = (rank - 1, rank - 2) if mine == 0 else (rank - 2, rank - 1)
        factor_rows = (0, other_token_dim) if rows[1] == token_dim else None
    if factor_rows is None or not all(same_size(other_shape[f], shapes[mine][r]) for f, r in zip(factor_rows, rows)):
        return False
    return zero_at(analysis, other, factor_rows, empty_nan=True)


def _operands(user: fx.Node) -> list | None:
    name = target_name(user)
    if user.kwargs or name not in CONTRACTIONS:
        return None
    if name == "einsum":
        if not user.args or not isinstance(user.args[0], str):
            return None
        rest = user.args[1:]
        operands = list(rest[0]) if len(rest) == 1 and isinstance(rest[0], (list, tuple)) else list(rest)
    else:
        operands = list(user.args)
    return operands if len(operands) == 2 and all(isinstance(a, fx.Node) for a in operands) else None


def _einsum_factor_rows(equation: str, mine: int, rows: Rows) -> Rows | None:
    """The positions of the batch and token letters in the other operand, when the equation sums the token
    letter out and both operands carry each of the two letters once; None otherwise."""
    equation = equation.replace(" ", "")
    match = re.fullmatch(r"([a-zA-Z]+),([a-zA-Z]+)->([a-zA-Z]*)", equation)
    if match is None:  # (an ellipsis or an implicit output: not modelled)
        return None
    subscripts, output = [match.group(1), match.group(2)], match.group(3)
    own, other = subscripts[mine], subscripts[1 - mine]
    if max(rows) >= len(own):
        return None
    batch, token = own[rows[0]], own[rows[1]]
    if token in output or any(s.count(c) != 1 for s in (own, other) for c in (batch, token)):
        return None
    return other.index(batch), other.index(token)


def zero_at(analysis: PadAnalysis, node, rows: Rows, depth: int = 8, empty_nan: bool = False) -> bool:
    """Whether ``node`` is 0 wherever the analysis' row mask does not hold, its batch and token dims at
    ``rows`` (module doc); with ``empty_nan``, 0 or NaN there."""
    if not isinstance(node, fx.Node) or depth == 0:
        return False
    shape = shape_of(node)
    if shape is None or max(rows) >= len(shape):
        return False
    if rows == (0, 1) and analysis.is_mask(node) or analysis.zeroing_of(node, rows) is not None:
        return True  # (a zeroing of scores transposed to (B, 1, N): DeepCTR-Torch's DIN, rows (0, 2))
    name = target_name(node)
    tensors = [a for a in node.args if isinstance(a, fx.Node)]
    if empty_nan and name in ("softmax", "_softmax") and tensors and node.args[0] is tensors[0]:
        filled = _scaled_by_a_positive_number(tensors[0])  # (a temperature after the fill keeps -inf)
        fill = analysis.fills.get(filled)
        return fill is not None and fill.value == float("-inf") and analysis.fill_of(filled, rows) is not None
    if name == "mul":
        return any(_zero_broadcast(analysis, a, shape, rows, depth, empty_nan) for a in tensors)
    if name in ("truediv", "div"):
        return bool(node.args) and _zero_broadcast(analysis, node.args[0], shape, rows, depth, empty_nan)
    if name in ZERO_PRESERVING_UNARY and not (empty_nan and not _floating(node)):  # (NaN cast to an integer)
        return len(tensors) == 1 and node.args[0] is tensors[0] and \
            _zero_broadcast(analysis, tensors[0], shape, rows, depth, empty_nan)
    source = node.args[0] if node.args else None
    if name == "unsqueeze":
        dim = node_argument(node, 1, "dim")
        if not isinstance(dim, int) or dim % len(shape) in rows:
            return False
        dim %= len(shape)
        return zero_at(analysis, source, tuple(r - (r > dim) for r in rows), depth - 1, empty_nan)
    if name == "squeeze":
        dim = node_argument(node, 1, "dim")
        source_shape = shape_of(source)
        if not isinstance(dim, int) or source_shape is None:
            return False
        dim %= len(source_shape)
        return same_size(source_shape[dim], 1) and \
            zero_at(analysis, source, tuple(r + (r >= dim) for r in rows), depth - 1, empty_nan)
    if name == "getitem" and len(node.args) == 2 and shape_of(source) is not None:
        dims = _new_axes(node.args[1], len(shape_of(source)))  # w[:, None, :]
        if dims is None or any(dims[r] is None for r in rows):
            return False
        return zero_at(analysis, source, tuple(dims[r] for r in rows), depth - 1, empty_nan)
    if name == "transpose" and len(node.args) == 3 and all(isinstance(d, int) for d in node.args[1:]):
        a, b = (d % len(shape) for d in node.args[1:])
        swap = {a: b, b: a}
        return zero_at(analysis, source, tuple(swap.get(r, r) for r in rows), depth - 1, empty_nan)
    if name in ("expand", "expand_as", "contiguous") and shape_of(source) is not None and \
            len(shape_of(source)) == len(shape):  # (a (B, N, 1) mask expanded over the features)
        return zero_at(analysis, source, rows, depth - 1, empty_nan)
    if name in ("view", "reshape") and shape_of(source) is not None and len(shape_of(source)) == len(shape) and \
            all(same_size(x, y) for x, y in zip(shape_of(source), shape)):
        return zero_at(analysis, source, rows, depth - 1, empty_nan)
    return False


def _scaled_by_a_positive_number(node: fx.Node) -> fx.Node:
    """x under ``x / c`` and ``x * c`` by positive finite numbers (RecBole's SequenceAttLayer divides the filled
    scores by sqrt(E) before its softmax): -inf stays -inf, finite values stay finite."""
    while target_name(node) in ("truediv", "div", "mul") and len(node.args) == 2 and not node.kwargs and \
            isinstance(node.args[0], fx.Node) and type(node.args[1]) in (int, float) and \
            0 < node.args[1] < float("inf"):
        node = node.args[0]
    return node


def _floating(node: fx.Node) -> bool:
    value = example_value(node)
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def _new_axes(index, rank: int) -> list[int | None] | None:
    """For ``x[index]`` of full slices, ``None`` and one ``...``: the source dim of each output dim (None for a
    new axis); None for any other index."""
    index = index if isinstance(index, tuple) else (index,)
    full = slice(None)
    if index.count(Ellipsis) > 1 or not all(i is None or i is Ellipsis or i == full for i in index):
        return None
    kept = sum(1 for i in index if i == full)
    if kept > rank:
        return None
    dims, source = [], 0
    for i in index:
        if i is None:
            dims.append(None)
        elif i is Ellipsis:
            skipped = rank - kept
            dims.extend(range(source, source + skipped))
            source += skipped
        else:
            dims.append(source)
            source += 1
    dims.extend(range(source, rank))  # the trailing dims the index leaves out
    return dims


def _zero_broadcast(analysis: PadAnalysis, operand, shape: tuple, rows: Rows, depth: int,
                    empty_nan: bool = False) -> bool:
    """An elementwise operand zero at the padding, its dims right-aligned with the output's (not broadcast
    along the batch or the tokens)."""
    operand_shape = shape_of(operand)
    if operand_shape is None:
        return False
    shift = len(shape) - len(operand_shape)
    mapped = tuple(r - shift for r in rows)
    if min(mapped) < 0 or not all(same_size(operand_shape[m], shape[r]) for m, r in zip(mapped, rows)):
        return False
    return zero_at(analysis, operand, mapped, depth - 1, empty_nan)
