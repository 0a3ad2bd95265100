"""The attention weights between the softmax and ``@ v``: what a model may do to them that the kernels
reproduce exactly.

- ``nan_zeroing``: a safe softmax's zeroing of NaN rows (``nan_to_num``, ``where(isnan(p), 0, p)``): the
  rows with no valid key, which the kernels give 0 anyway;
- ``row_op``: the weights' query rows scaled or zeroed (TF SASRec's query masking ``weights *=
  query_mask``): ``(p * r) @ v = r * (p @ v)`` for r constant along the keys, so the families apply the
  same op to the output rows (family.py).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from gemcompile.passes.attention.scores import MUL, constant_float, is_call
from gemcompile.passes.graph import example_value


def row_op(user: fx.Node, p: fx.Node) -> tuple[str, fx.Node] | None:
    """("mul", r), ("masked_fill", cond) or ("where", cond) when ``user`` scales or zeroes whole query rows of
    the (B, H, Lq, Lk) weights ``p``: a tensor whose last dim is 1 (constant along the keys), 0 as the
    fill."""
    def per_row(x) -> bool:
        value = example_value(x) if isinstance(x, fx.Node) else None
        return isinstance(value, torch.Tensor) and 0 < value.dim() <= 4 and value.shape[-1] == 1

    if example_value(p).dim() != 4 or not user.args:
        return None
    if is_call(user, *MUL) and len(user.args) == 2:
        other = user.args[1] if user.args[0] is p else user.args[0]
        if other is not p and per_row(other) and example_value(other).is_floating_point():
            return "mul", other
    if is_call(user, "masked_fill") and user.args[0] is p and len(user.args) > 1:
        fill = user.args[2] if len(user.args) > 2 else user.kwargs.get("value")
        if per_row(user.args[1]) and constant_float(fill) == 0.0:
            return "masked_fill", user.args[1]
    if is_call(user, "where") and len(user.args) == 3 and user.args[1] is p:
        if per_row(user.args[0]) and constant_float(user.args[2]) == 0.0:
            return "where", user.args[0]
    return None


def nan_zeroing(p: fx.Node) -> fx.Node | None:
    """The node that zeroes p's NaN rows when that is all p's users do (``nan_to_num(p)``,
    ``where(isnan(p), 0, p)``, ``p.masked_fill(isnan(p), 0)``), else None."""
    users = list(p.users)
    if len(users) == 1 and is_call(users[0], "nan_to_num"):
        user = users[0]
        nan = user.kwargs.get("nan", user.args[1] if len(user.args) > 1 else 0.0)
        return user if nan in (0, 0.0, None) else None
    zeros = [u for u in users if is_call(u, "zeros_like")]
    users = [u for u in users if u not in zeros]
    if len(users) != 2 or len(zeros) > 1:
        return None
    isnan = next((u for u in users if is_call(u, "isnan")), None)
    other = next((u for u in users if u is not isnan), None)
    if isnan is None or other is None or len(isnan.users) != 1 or next(iter(isnan.users)) is not other:
        return None
    if is_call(other, "where") and other.args[0] is isnan and other.args[2] is p:
        fill = other.args[1]
    elif is_call(other, "masked_fill") and other.args[0] is p and other.args[1] is isnan:
        fill = other.args[2] if len(other.args) > 2 else other.kwargs.get("value")
    else:
        return None
    if zeros:
        return other if fill is zeros[0] and len(zeros[0].users) == 1 else None
    return other if constant_float(fill) == 0.0 else None
