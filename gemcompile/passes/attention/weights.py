"""The attention weights between the softmax and ``@ v``: what a model may do to them that the kernels
reproduce exactly.

- ``nan_zeroing``: a safe softmax's zeroing of NaN rows (``nan_to_num``, ``where(isnan(p), 0, p)``): the
  rows with no valid key, which the kernels give 0 anyway;
- ``row_op``: the weights' query rows scaled or zeroed (TF SASRec's query masking ``weights *=
  query_mask``): ``(p * r) @ v = r * (p @ v)`` for r constant along the keys, so the families apply the
  same op to the output rows (family.py);
- ``key_mask_op`` and ``same_mask``: the scores' own mask applied again to the weights
  (``softmax(s.masked_fill(m, F)).masked_fill(m, 0)``, or the weights times the keep mask, CARCA's ``w *
  attn_mask``): a no-op on rows with a valid key (their dropped weights are 0 already, exactly so under the
  fill's checks), and rows with none become 0, the kernels' own rule, whatever the fill.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true as known

from gemcompile.passes.attention.scores import CASTS, MUL, NEGATIONS, constant_float, is_call
from gemcompile.passes.graph import Unproven, example_value



def row_op(user: fx.Node, p: fx.Node) -> tuple[str, fx.Node] | None:
    """("mul", r), ("masked_fill", cond) or ("where", cond) when ``user`` scales or zeroes whole query rows of
    the (B, H, Lq, Lk) weights ``p`` (or (N, Lq, Lk): batch and heads merged, as SASRec's TensorFlow original
    and its ports write ``w * query_mask``): a tensor whose last dim is 1 (constant along the keys), 0 as the
    fill."""
    def per_row(x) -> bool:
        value = example_value(x) if isinstance(x, fx.Node) else None
        return isinstance(value, torch.Tensor) and 0 < value.dim() <= weights.dim() and value.shape[-1] == 1

    weights = example_value(p)
    if weights.dim() not in (3, 4) or not user.args:
        return None
    if is_call(user, *MUL) and len(user.args) == 2:
        other = _along_keys_source(user.args[1] if user.args[0] is p else user.args[0])
        # a float, integer or bool factor (``p * valid[..., None]``): the weights keep their dtype
        if other is not p and per_row(other) and not example_value(other).is_complex():
            return "mul", other
    if is_call(user, "masked_fill") and user.args[0] is p and len(user.args) > 1:
        fill = user.args[2] if len(user.args) > 2 else user.kwargs.get("value")
        if per_row(_along_keys_source(user.args[1])) and constant_float(fill) == 0.0:
            return "masked_fill", _along_keys_source(user.args[1])
    if is_call(user, "where") and len(user.args) == 3 and user.args[1] is p:
        if per_row(_along_keys_source(user.args[0])) and constant_float(user.args[2]) == 0.0:
            return "where", _along_keys_source(user.args[0])
    return None


def _along_keys_source(x):
    """x's (..., Lq, 1) source when x only copies it along the keys (the TF original's query mask, as gSASRec
    writes it: ``query_masks.unsqueeze(-1).repeat(1, 1, Lk)``, or ``expand(-1, -1, Lk)``); x otherwise."""
    if not isinstance(x, fx.Node) or not is_call(x, "repeat", "expand", "tile") or not x.args or \
            not isinstance(x.args[0], fx.Node) or x.kwargs:
        return x
    source, out = example_value(x.args[0]), example_value(x)
    sizes = x.args[1] if len(x.args) == 2 and isinstance(x.args[1], (tuple, list)) else x.args[1:]
    if not isinstance(source, torch.Tensor) or not isinstance(out, torch.Tensor) or source.dim() != out.dim() or \
            len(sizes) != out.dim() or source.shape[-1] != 1:
        return x
    copies_only_the_last = all(s == 1 for s in sizes[:-1]) if not is_call(x, "expand") else \
        all(s == -1 or known(s == d) for s, d in zip(sizes[:-1], source.shape[:-1]))
    return x.args[0] if copies_only_the_last else x


def key_mask_op(user: fx.Node, p: fx.Node) -> tuple[bool, fx.Node] | None:
    """(keeps, cond) when ``user`` zeroes the weights ``p`` by a mask that varies along the keys:
    ``p.masked_fill(cond, 0)`` (False: cond drops), ``torch.where(cond, p, 0)`` or ``p * cond`` (True: cond
    keeps), the weights' shape kept (a mask that broadcasts them to more dims is something else)."""
    out, weights = example_value(user), example_value(p)
    if not (isinstance(out, torch.Tensor) and isinstance(weights, torch.Tensor) and out.dim() == weights.dim()
            and all(known(a == b) for a, b in zip(out.shape, weights.shape))):
        return None  # (known: a plain == of p @ v's (..., L, Dh) with (..., L, L) guarded L != Dh, a recompile)
    return _zeroing_mask(user, p)


def _zeroing_mask(user: fx.Node, p: fx.Node) -> tuple[bool, fx.Node] | None:
    def along_keys(x) -> bool:
        value = example_value(x) if isinstance(x, fx.Node) else None
        return isinstance(value, torch.Tensor) and value.dtype == torch.bool and value.shape[-1] != 1

    if is_call(user, "masked_fill") and user.args[0] is p and len(user.args) > 1:
        fill = user.args[2] if len(user.args) > 2 else user.kwargs.get("value")
        if along_keys(user.args[1]) and constant_float(fill) == 0.0:
            return False, user.args[1]
    if is_call(user, "where") and len(user.args) == 3 and user.args[1] is p:
        if along_keys(user.args[0]) and constant_float(user.args[2]) == 0.0:
            return True, user.args[0]
    if is_call(user, *MUL) and len(user.args) == 2 and p in user.args[:2]:  # CARCA's ``w * attn_mask``
        other = user.args[1] if user.args[0] is p else user.args[0]
        while isinstance(other, fx.Node) and is_call(other, *CASTS) and not along_keys(other) and other.args:
            other = other.args[0]  # ``w * m.float()``: m's 0/1 as a float
        if other is not p and along_keys(other):
            return True, other
    return None


def same_mask(a: tuple[bool, fx.Node], b: tuple[bool, fx.Node]) -> bool:
    """Whether two (keeps, cond) masks are one: the same expression once the negations are peeled."""
    def peeled(keeps: bool, node):
        while isinstance(node, fx.Node) and is_call(node, *NEGATIONS) and node.args:
            keeps, node = not keeps, node.args[0]
        return keeps, node

    (ka, na), (kb, nb) = peeled(*a), peeled(*b)
    return ka == kb and same_expression(na, nb)


def check_post_masks(post: list[tuple[bool, fx.Node]], masks: list) -> None:
    """Unproven unless each mask applied to the weights after the softmax is the scores' one mask (``masks``:
    the site's MaskTerms)."""
    if not post:
        return
    # dims: only single-head scores of batch and heads merged, (B, Lq, Lk) masked as the weights are
    own = masks[0] if len(masks) == 1 and masks[0].dims in (None, {0: 0, 1: 1, 2: 3}) else None
    own = own and ((own.kind == "keep", own.node) if own.kind in ("drop", "keep") else _added_where(own.node))
    if own is None or not all(same_mask(p, own) for p in post):
        raise Unproven("the attention weights are masked after the softmax by a mask that is not the scores' "
                       "own (one bool mask applied before the softmax, the same one after it)")


def _added_where(term: fx.Node) -> tuple[bool, fx.Node] | None:
    """(keeps, cond) of an additive mask written ``where(cond, 0, F)`` (True) or ``where(cond, F, 0)``
    (False), CARCA's ``baddbmm(where(m, 0.0, -2 ** 32 + 1), q, kT)``; None for any other term (the fill was
    checked with the scores' mask)."""
    if not is_call(term, "where") or len(term.args) != 3 or not isinstance(term.args[0], fx.Node):
        return None
    cond, x, y = term.args
    if constant_float(x) == 0.0 and not isinstance(y, fx.Node):
        return True, cond
    if constant_float(y) == 0.0 and not isinstance(x, fx.Node):
        return False, cond
    return None


def same_expression(a, b, depth: int = 8) -> bool:
    """a and b compute the same value: one node, or the same op on the same expressions (two ``~m`` or
    ``m == 0`` written twice are two nodes of one value)."""
    if a is b:
        return True
    if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
        return not isinstance(a, fx.Node) and not isinstance(b, fx.Node) and a == b
    if depth == 0 or a.op not in ("call_function", "call_method") or (a.op, a.target) != (b.op, b.target):
        return False
    if len(a.args) != len(b.args) or a.kwargs.keys() != b.kwargs.keys():
        return False
    pairs = [*zip(a.args, b.args), *((a.kwargs[k], b.kwargs[k]) for k in a.kwargs)]
    return all(_same_arg(x, y, depth - 1) for x, y in pairs)


def _same_arg(x, y, depth: int) -> bool:
    if isinstance(x, (tuple, list)) and isinstance(y, (tuple, list)):
        return len(x) == len(y) and all(_same_arg(i, j, depth) for i, j in zip(x, y))
    return same_expression(x, y, depth)


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
