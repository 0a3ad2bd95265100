"""Dropout on a region's packed rows (unpad.py).

F.dropout does not trace over a data-dependent row count: it tests its input for zero elements. On packed
rows it becomes what Inductor's decomposition of dropout computes, ``x * (u > p) / (1 - p)``, u uniform in
[0, 1): from ``rand_like(x)``, or where that does not trace either (torch 2.11: its uniform_ decomposition
guards on the row count) drawn for the padded (B, N, ...) rows and gathered at the packed ones. The draws
differ from eager's, as any compiled dropout's do; each element is still kept with probability 1 - p.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from gemcompile.passes.graph import (Emitter, Unproven, copy_source_meta, dropout_arguments, example_value, size_argument,
                                     target_name)


def packed_dropout(emit, args: tuple, kwargs: dict, uniform: Callable[[Any], Any]) -> Any:
    """Dropout (``F.dropout(x, p, training)``, ``torch.dropout(x, p, train)``) of packed rows x: the
    identity when not training or p == 0, else ``x * (u > p) / (1 - p)`` with ``u = uniform(x)`` uniform
    in [0, 1) of x's shape, what Inductor's decomposition of dropout computes. F.dropout itself does not
    trace there: it tests x for zero elements, which a data-dependent row count cannot answer."""
    x, p, training = dropout_arguments(args, kwargs)
    if not isinstance(p, (int, float)) or not isinstance(training, bool):
        raise Unproven(f"a dropout with a computed probability or mode ({p!r}, {training!r})")
    if not training or p == 0:
        return x
    if p >= 1:
        return emit.call(operator.mul, (x, 0.0))
    keep = emit.call(operator.gt, (uniform(x), float(p)))
    return emit.call(operator.mul, (emit.call(operator.mul, (x, keep)), 1.0 / (1.0 - float(p))))


def packed_op(emit: Emitter, node: fx.Node, args: tuple, kwargs: dict, uniform) -> fx.Node:
    """``node``'s op on packed operands (dropout: packed_dropout, the identity where not training)."""
    if target_name(node) == "dropout":
        out = packed_dropout(emit, args, kwargs, uniform)
        if out is not dropout_arguments(args, kwargs)[0]:
            copy_source_meta(node, out)
        return out
    out = emit.node(node.op, node.target, args, kwargs)
    copy_source_meta(node, out)
    return out


def uniform_like_packed(emit: Emitter, batch, seq, batch_index: fx.Node, seq_index: fx.Node, x: fx.Node) -> fx.Node:
    """Uniform [0, 1) numbers of the packed x's shape, for dropout: ``rand_like(x)``, or where that does not
    trace over a data-dependent row count (torch 2.11's uniform_ decomposition guards on it) drawn for the
    padded (B, N, ...) rows and gathered at the packed ones."""
    mark = emit.mark()
    try:
        return emit.call(torch.rand_like, (x,))
    except Unproven:
        emit.rollback(mark)
    value = example_value(x)
    shape = [batch, seq, *(size_argument(emit, d) for d in value.shape[1:])]
    padded = emit.call(torch.rand, (shape,), {"dtype": value.dtype, "device": value.device})
    return emit.call(torch.ops.aten.index.Tensor, (padded, [batch_index, seq_index]))
