"""Find pointwise-activation attention in a Dynamo graph and take it apart.

The anchor is the activation: ``act(scores)`` with scores = ``q @ k^T`` scaled and biased, and the
activated scores going to ``@ v`` through a mask, a normalizer and casts:

    act(q @ k^T * scale [+ bias]) [* mask | masked_fill(~mask, 0) | where(mask, ., 0)]
                                  [* c | / c | / lengths[b]] @ v

with act one of silu, gelu (exact or tanh), relu, relu squared, sigmoid. The mask must be applied after
the activation (sigmoid(0) != 0, so a mask inside the activation would not drop a pair). Masks stay
graph nodes here; gdpa_mask.py proves what they are. Every node of the chain must feed only the next.

Identity (linear attention, ``(q @ k^T * scale [+ bias]) * mask @ v``) has no activation to anchor on:
its anchor is the raw scores that a mask op takes (``identity_scores``), and it needs that mask: without
one the chain is two plain matmuls, nothing to gain.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx

from gemcompile.passes.attention_match import (
    _CASTS,
    _MATMUL,
    _SCALE_OPS,
    _constant_float,
    _leads_to_matmul,
    _name,
    _scores_einsum,
    _single_user,
    _values_einsum,
    is_call,
)
from gemcompile.passes.mask_provenance import Unproven


@dataclass
class GdpaSite:
    """One pointwise attention, taken apart (q/k/v become (B|1, H, L, D) once the perms apply)."""

    anchor: fx.Node
    output: fx.Node
    q: fx.Node
    k: fx.Node
    v: fx.Node
    activation: str
    scale: float = 1.0
    out_scale: float = 1.0
    divisor: fx.Node | None = None  # the per-sample normalizer (a lengths tensor), if any
    q_perm: tuple[int, ...] | None = None
    k_perm: tuple[int, ...] | None = None
    k_is_transposed: bool = False
    v_perm: tuple[int, ...] | None = None
    out_perm: tuple[int, ...] | None = None
    bias: list[tuple[fx.Node, float]] = field(default_factory=list)
    masks: list[tuple[fx.Node, str]] = field(default_factory=list)  # (node, "keep" | "drop")
    matched: list[fx.Node] = field(default_factory=list)


_MUL = ("mul", "__mul__", "__rmul__")
_DIV = ("truediv", "div", "__truediv__")


def activation_of(node: fx.Node) -> tuple[str, fx.Node] | None:
    """(activation name, the node holding act(scores)) when node is an activation; None otherwise."""
    if is_call(node, "silu"):
        return "silu", node
    if is_call(node, "sigmoid"):
        return "sigmoid", node
    if is_call(node, "gelu"):
        approximate = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
        if approximate not in ("none", "tanh"):
            return None
        return ("gelu" if approximate == "none" else "gelu_tanh"), node
    if is_call(node, "relu"):
        if len(node.users) == 1:
            (user,) = node.users
            if (is_call(user, "pow", "__pow__") and user.args[0] is node and user.args[1] == 2) or (
                is_call(user, "square") and user.args[0] is node
            ):
                return "relu_squared", user
        return "relu", node
    return None


def _is_raw_scores(node: Any) -> bool:
    """node is q @ k^T through constant scales, bias additions and casts only (no activation, no mask)."""
    while isinstance(node, fx.Node):
        if is_call(node, *_MATMUL, "einsum"):
            value = node.meta.get("example_value")
            return getattr(value, "ndim", 0) == 4  # (B, H, Lq, Lk) scores
        if is_call(node, *_CASTS):
            node = node.args[0]
        elif is_call(node, *_SCALE_OPS):
            a, b = node.args[:2]
            if isinstance(a, fx.Node) == isinstance(b, fx.Node):
                return False
            node = a if isinstance(a, fx.Node) else b
        elif is_call(node, "add", "__add__", "__radd__", "sub", "__sub__"):
            a, b = node.args[:2]
            if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)) or _leads_to_matmul(a) == _leads_to_matmul(b):
                return False
            node = a if _leads_to_matmul(a) else b
        else:
            return False
    return False


def identity_scores(node: fx.Node) -> fx.Node | None:
    """The raw scores when node is the first mask op of an identity attention (its anchor); else None."""
    if is_call(node, "masked_fill"):
        data = node.args[0]
    elif is_call(node, "where") and len(node.args) == 3:
        _cond, x, y = node.args
        data = x if isinstance(x, fx.Node) and not isinstance(y, fx.Node) else (
            y if isinstance(y, fx.Node) and not isinstance(x, fx.Node) else None)
    elif is_call(node, *_MUL) and all(isinstance(a, fx.Node) for a in node.args[:2]):
        a, b = node.args[:2]
        data = a if _is_raw_scores(a) and not _is_raw_scores(b) else (b if _is_raw_scores(b) and not _is_raw_scores(a)
                                                                      else None)
    else:
        return None
    if not isinstance(data, fx.Node) or len(data.users) != 1 or not _is_raw_scores(data):
        return None
    # and the masked scores go on to `@ v` (else a softmax or an activation follows: not identity attention,
    # and not worth a refusal in explain)
    chain = node
    while len(chain.users) == 1:
        (user,) = chain.users
        if is_call(user, *_MATMUL, "einsum"):
            return data if user.args[0] is chain or is_call(user, "einsum") else None
        if not is_call(user, *_CASTS, *_MUL, *_DIV, "masked_fill", "where"):
            return None
        chain = user
    return None


def _fill_is_zero(fill: Any) -> None:
    if _constant_float(fill) != 0.0:
        raise Unproven(f"masked pairs are filled with {fill!r}, not 0 (after the activation a mask must zero them)")


def match_gdpa(anchor: fx.Node, identity: bool = False) -> GdpaSite:
    """Take apart the attention around ``anchor``: an activation node, or with identity=True the raw
    scores that identity_scores found."""
    if identity:
        activation, act_out = "identity", anchor
    else:
        found = activation_of(anchor)
        if found is None:
            raise Unproven(f"{anchor.name} is not a supported activation")
        activation, act_out = found
    matched: list[fx.Node] = []
    info: dict[str, Any] = {}
    out_scale, divisor = 1.0, None
    masks: list[tuple[fx.Node, str]] = []

    # forward: act(scores) -> mask / normalizer / casts -> (. @ v)
    node = anchor
    while True:
        _single_user(node, matched)
        (user,) = node.users
        if user is act_out and act_out is not anchor:
            node = user
            continue
        if is_call(user, *_CASTS):
            node = user
            continue
        if is_call(user, *_MUL, *_DIV) and (user.args[0] is node or is_call(user, *_MUL)):
            other = user.args[1] if user.args[0] is node else user.args[0]
            divides = is_call(user, *_DIV)
            c = _constant_float(other)
            if c is not None:
                if c == 0:
                    raise Unproven("the activated scores are multiplied or divided by 0")
                out_scale *= (1.0 / c) if divides else c
            elif not isinstance(other, fx.Node):
                raise Unproven(f"the activated scores are scaled by the symbolic value {other!r}")
            elif divides:
                if divisor is not None:
                    raise Unproven("the activated scores are divided by two tensors")
                divisor = other
            else:
                masks.append((other, "keep"))
            node = user
            continue
        if is_call(user, "masked_fill") and user.args[0] is node:
            fill = user.args[2] if len(user.args) > 2 else user.kwargs.get("value")
            _fill_is_zero(fill)
            masks.append((user.args[1], "drop"))
            node = user
            continue
        if is_call(user, "where"):
            cond, x, y = user.args
            if x is node and not isinstance(y, fx.Node):
                _fill_is_zero(y)
                masks.append((cond, "keep"))
            elif y is node and not isinstance(x, fx.Node):
                _fill_is_zero(x)
                masks.append((cond, "drop"))
            else:
                raise Unproven("torch.where on the activated scores with a tensor on both sides")
            node = user
            continue
        break
    if identity and not masks:
        raise Unproven("identity attention without a mask: two plain matmuls, nothing to rewrite")
    if is_call(user, *_MATMUL) and user.args[0] is node:
        info["v"] = user.args[1]
    elif is_call(user, "einsum"):
        _values_einsum(user, node, info)
    else:
        raise Unproven(f"the activated scores go to `{_name(user)}`, not to a matmul with the values")
    output = user

    # backward: act input -> scale / bias / casts -> q @ k^T
    ops: list[tuple[str, Any]] = []  # in backward order
    node = anchor if identity else anchor.args[0]
    while True:
        _single_user(node, matched)
        if is_call(node, *_MATMUL):
            info.update(q=node.args[0], k=node.args[1], k_is_transposed=True)
            break
        if is_call(node, "einsum"):
            _scores_einsum(node, info)
            break
        if is_call(node, *_CASTS):
            node = node.args[0]
            continue
        if is_call(node, *_SCALE_OPS):
            a, b = node.args[:2]
            divides = _SCALE_OPS[_name(node)] is operator.truediv
            chain = a if isinstance(a, fx.Node) else b
            c = _constant_float(b) if isinstance(a, fx.Node) else _constant_float(a)
            if c is None or (divides and not isinstance(a, fx.Node)):
                raise Unproven("the scores are scaled by a tensor or a symbolic value, not a constant")
            if c == 0:
                raise Unproven("the scores are scaled by 0")
            ops.append(("scale", 1.0 / c if divides else c))
            node = chain
            continue
        if is_call(node, "add", "__add__", "__radd__", "sub", "__sub__"):
            a, b = node.args[:2]
            if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
                raise Unproven("a constant added to the scores")
            if _leads_to_matmul(a) == _leads_to_matmul(b):
                raise Unproven("an addition on the scores where the score side is ambiguous")
            subtract = is_call(node, "sub", "__sub__")
            if subtract and not _leads_to_matmul(a):
                raise Unproven("the scores are subtracted from something")
            chain, term = (a, b) if _leads_to_matmul(a) else (b, a)
            ops.append(("bias", (term, -1.0 if subtract else 1.0)))
            node = chain
            continue
        raise Unproven(f"`{_name(node)}` ({node.name}) between the scores and the activation is not a scale, "
                       "bias or cast")
    for key in ("q", "k", "v"):
        if not isinstance(info.get(key), fx.Node):
            raise Unproven(f"no tensor for {key}")
    # replay forward: a scale multiplies the bias terms added before it
    scale, bias = 1.0, []
    for kind, arg in reversed(ops):
        if kind == "scale":
            scale *= arg
            bias = [(t, w * arg) for t, w in bias]
        else:
            bias.append(arg)
    return GdpaSite(anchor=anchor, output=output, q=info["q"], k=info["k"], v=info["v"], activation=activation,
                    scale=scale, out_scale=out_scale, divisor=divisor, q_perm=info.get("q_perm"),
                    k_perm=info.get("k_perm"), k_is_transposed=info.get("k_is_transposed", False),
                    v_perm=info.get("v_perm"), out_perm=info.get("out_perm"), bias=bias, masks=masks,
                    matched=matched + [output])
