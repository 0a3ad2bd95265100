"""A one-operand einsum that only permutes dims, as XLNet writes its mask's layout: ``einsum("ijbn->bnij", m)``
is ``m.permute(2, 3, 0, 1)``, which the mask evaluator reads as a reorder of the mask's dims."""

from __future__ import annotations

import torch.fx as fx


def einsum_permutation(node: fx.Node) -> tuple[fx.Node, list[int]] | None:
    """(operand, order) when ``node`` is a one-operand einsum that only permutes dims
    (``einsum("ijbn->bnij", x)``): output dim p holds input dim order[p]; else None."""
    equation, *operands = node.args
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = list(operands[0])
    if not isinstance(equation, str) or len(operands) != 1 or not isinstance(operands[0], fx.Node):
        return None
    if "->" not in equation or "." in equation:
        return None
    src, out = equation.replace(" ", "").split("->")
    if len(set(src)) != len(src) or sorted(src) != sorted(out):
        return None
    return operands[0], [src.index(c) for c in out]
