"""Find attention in a Dynamo graph and take it apart: q, k, v, scale, additive bias, masks, output.

Anchors, not enumerated spellings: an attention is a ``scaled_dot_product_attention`` node, a
``multi_head_attention_forward`` node (what ``nn.MultiheadAttention`` is in a Dynamo graph), or a
softmax over the last dim whose input comes from ``q @ k^T`` and whose output goes to ``@ v``.
Between the two matmuls the chain may scale (by a constant), add terms (a float mask or a bias), fill
masked positions (``masked_fill``, ``torch.where``), cast, or apply dropout that is off. Masks are
kept as graph nodes here; ``mask_provenance`` proves what they are.

Every node of the chain must feed only the next one: attention weights used elsewhere (returned,
logged) cannot be skipped, so such sites are left alone.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from gemcompile.passes.mask_provenance import NEG_FILL_LIMIT, Unproven, example_value


@dataclass(frozen=True)
class MaskTerm:
    """A mask applied to the scores: ``node`` keeps a score where it is True ("keep"), where it is False
    ("drop_where_true" inverted) or by adding 0 / a large negative value ("additive"). ``dims`` maps the
    mask's right-aligned dims onto the scores' (B, H, Lq, Lk) frame when they do not line up."""

    node: fx.Node
    kind: str  # "keep" | "drop" | "additive"
    dims: dict[int, int] | None = None


@dataclass
class AttentionSite:
    """One attention, taken apart. q/k/v are (B|1, H, L, D) views once ``*_perm`` permutations apply."""

    anchor: fx.Node
    output: fx.Node
    q: fx.Node
    k: fx.Node
    v: fx.Node
    scale: float
    q_perm: tuple[int, ...] | None = None
    k_perm: tuple[int, ...] | None = None
    k_is_transposed: bool = False
    v_perm: tuple[int, ...] | None = None
    out_perm: tuple[int, ...] | None = None
    bias: list[tuple[fx.Node, float]] = field(default_factory=list)
    masks: list[MaskTerm] = field(default_factory=list)
    causal_flag: bool = False
    matched: list[fx.Node] = field(default_factory=list)
    kind: str = "softmax"


def _name(node: fx.Node) -> str:
    t = node.target
    return t if isinstance(t, str) else getattr(t, "__name__", str(t))


def is_call(node: Any, *names: str) -> bool:
    return isinstance(node, fx.Node) and node.op in ("call_function", "call_method") and _name(node) in names


_MATMUL = ("matmul", "__matmul__")
_CASTS = ("to", "float", "half", "bfloat16", "double", "type_as", "type", "contiguous")
_SCALE_OPS = {"mul": operator.mul, "__mul__": operator.mul, "__rmul__": operator.mul,
              "truediv": operator.truediv, "div": operator.truediv, "__truediv__": operator.truediv}


def _constant_float(x: Any) -> float | None:
    if isinstance(x, bool):
        return None
    if isinstance(x, (int, float)):
        return float(x)
    return None


def _single_user(node: fx.Node, site_nodes: list[fx.Node]) -> None:
    if len(node.users) != 1:
        raise Unproven(f"{node.name} (part of the attention) is also used elsewhere: "
                       "attention weights that are returned or reused cannot be skipped")
    site_nodes.append(node)


def _dims_last(node: fx.Node, dim: Any) -> bool:
    ndim = example_value(node).dim()
    return isinstance(dim, int) and dim % ndim == ndim - 1


def _dropout_is_off(node: fx.Node) -> bool:
    p = node.kwargs.get("p", node.args[1] if len(node.args) > 1 else 0.5)
    training = node.kwargs.get("training", node.args[2] if len(node.args) > 2 else True)
    return p == 0 or training is False


# -- einsum ----------------------------------------------------------------------------------------

def _parse_einsum(node: fx.Node) -> tuple[list[str], str, list[fx.Node]]:
    equation, *operands = node.args
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = list(operands[0])
    if not isinstance(equation, str) or "->" not in equation or "." in equation:
        raise Unproven("an einsum without an explicit output")
    lhs, out = equation.replace(" ", "").split("->")
    return lhs.split(","), out, operands


def _perm(src: str, dst: str) -> tuple[int, ...] | None:
    perm = tuple(src.index(c) for c in dst)
    return None if perm == tuple(range(len(dst))) else perm


def _scores_einsum(node: fx.Node, site: dict) -> None:
    (a, b), out, (q, k) = _parse_einsum(node)
    if len(out) != 4 or len(a) != 4 or len(b) != 4:
        raise Unproven("a score einsum that is not 4-D")
    batch, head, qi, kj = out
    (d,) = [c for c in a if c not in out] or [None]
    if d is None or d not in b or set(a) != {batch, head, qi, d} or set(b) != {batch, head, kj, d}:
        raise Unproven(f"the score einsum {a},{b}->{out} is not q.k^T over the head dim")
    site.update(q=q, k=k, q_perm=_perm(a, batch + head + qi + d), k_perm=_perm(b, batch + head + kj + d),
                roles=(batch, head, qi, kj))


def _values_einsum(node: fx.Node, probs: fx.Node, site: dict) -> None:
    (a, b), out, (p, v) = _parse_einsum(node)
    if p is not probs or len(a) != 4 or len(b) != 4 or len(out) != 4:
        raise Unproven("the attention weights are not the first operand of a 4-D einsum")
    batch, head, qi, kj = a  # the weights are in the (B, H, Lq, Lk) frame of the scores
    (d,) = [c for c in b if c not in a] or [None]
    if d is None or set(b) != {batch, head, kj, d} or set(out) != {batch, head, qi, d}:
        raise Unproven(f"the value einsum {a},{b}->{out} does not contract the key dim")
    site.update(v=v, v_perm=_perm(b, batch + head + kj + d), out_perm=_perm(batch + head + qi + d, out))


# -- the three anchors -------------------------------------------------------------------------------

def match_softmax(softmax: fx.Node) -> AttentionSite:
    """softmax(scores) @ v with scores = q @ k^T scaled, biased and masked."""
    dim = softmax.kwargs.get("dim", softmax.args[1] if len(softmax.args) > 1 else None)
    if not _dims_last(softmax, dim):
        raise Unproven(f"softmax over dim {dim}, not over the keys (the last dim)")
    matched: list[fx.Node] = []
    # forward: softmax -> casts / dropout that is off -> (weights @ v)
    node = softmax
    while True:
        _single_user(node, matched)
        (user,) = node.users
        if is_call(user, *_CASTS):
            node = user
            continue
        if is_call(user, "dropout"):
            if not _dropout_is_off(user):
                raise Unproven("dropout on the attention weights (the kernel has none); use dropout_p=0 or eval()")
            node = user
            continue
        break
    info: dict[str, Any] = {}
    if is_call(user, *_MATMUL) and user.args[0] is node:
        info.update(v=user.args[1])
    elif is_call(user, "einsum"):
        _values_einsum(user, node, info)
    else:
        raise Unproven(f"the softmax output goes to `{_name(user)}`, not to a matmul with the values")
    output = user

    # backward: softmax input -> ... -> q @ k^T
    ops: list[tuple[str, Any]] = []  # in backward order
    node = softmax.args[0]
    while True:
        _single_user(node, matched)
        if is_call(node, *_MATMUL):
            q, kt = node.args
            info.update(q=q, k=kt)
            info["k_is_transposed"] = True
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
            if divides and not isinstance(a, fx.Node):
                raise Unproven("a constant divided by the scores")
            c = _constant_float(b) if isinstance(a, fx.Node) else _constant_float(a)
            chain = a if isinstance(a, fx.Node) else b
            if c is None:
                raise Unproven("the scores are scaled by a tensor or a symbolic value, not a constant")
            if c <= 0:
                raise Unproven("the scores are scaled by a non-positive constant")
            ops.append(("scale", 1.0 / c if divides else c))
            node = chain
            continue
        if is_call(node, "add", "__add__", "__radd__"):
            a, b = node.args[:2]
            chain, term = _which_is_scores(a, b)
            ops.append(("add", term))
            node = chain
            continue
        if is_call(node, "sub", "__sub__"):
            a, b = node.args[:2]
            if not _leads_to_matmul(a):
                raise Unproven("the scores are subtracted from something")
            ops.append(("sub", b))
            node = a
            continue
        if is_call(node, "masked_fill"):
            base, mask, fill = node.args[0], node.args[1], node.args[2] if len(node.args) > 2 else node.kwargs["value"]
            _check_fill(fill)
            ops.append(("mask", MaskTerm(mask, "drop")))
            node = base
            continue
        if is_call(node, "where"):
            cond, x, y = node.args
            if isinstance(x, fx.Node) and _leads_to_matmul(x) and not isinstance(y, fx.Node):
                _check_fill(y)
                ops.append(("mask", MaskTerm(cond, "keep")))
                node = x
            elif isinstance(y, fx.Node) and _leads_to_matmul(y) and not isinstance(x, fx.Node):
                _check_fill(x)
                ops.append(("mask", MaskTerm(cond, "drop")))
                node = y
            else:
                raise Unproven("torch.where on the scores with a tensor on both sides")
            continue
        raise Unproven(f"`{_name(node)}` ({node.name}) between the scores and the softmax is not a scale, "
                       "bias, mask or cast")

    # replay the chain forward: scale multiplies what was added before it
    scale = 1.0
    bias: list[tuple[fx.Node, float]] = []
    masks: list[MaskTerm] = []
    for kind, arg in reversed(ops):
        if kind == "scale":
            scale *= arg
            bias = [(b, c * arg) for b, c in bias]
        elif kind == "mask":
            masks.append(arg)
        else:
            sign = 1.0 if kind == "add" else -1.0
            masks_or_bias = _mask_or_bias(arg)
            if masks_or_bias == "mask":
                if sign < 0:
                    raise Unproven("a mask subtracted from the scores")
                masks.append(MaskTerm(arg, "additive"))
            else:
                bias.append((arg, sign))
    for key in ("q", "k", "v"):
        if not isinstance(info.get(key), fx.Node):
            raise Unproven(f"no tensor for {key}")
    site = AttentionSite(anchor=softmax, output=output, q=info["q"], k=info["k"], v=info["v"], scale=scale,
                         q_perm=info.get("q_perm"), k_perm=info.get("k_perm"),
                         k_is_transposed=info.get("k_is_transposed", False), v_perm=info.get("v_perm"),
                         out_perm=info.get("out_perm"), bias=bias, masks=masks, matched=matched + [output])
    return site


def match_sdpa(sdpa: fx.Node) -> AttentionSite:
    args = list(sdpa.args) + [None] * (7 - len(sdpa.args))
    q, k, v = args[:3]
    mask = sdpa.kwargs.get("attn_mask", args[3])
    dropout_p = sdpa.kwargs.get("dropout_p", args[4] if args[4] is not None else 0.0)
    is_causal = sdpa.kwargs.get("is_causal", args[5] if args[5] is not None else False)
    scale = sdpa.kwargs.get("scale", args[6])
    if sdpa.kwargs.get("enable_gqa", False):
        raise Unproven("grouped-query attention (enable_gqa) is not supported by the kernel")
    if dropout_p not in (0, 0.0):
        raise Unproven(f"dropout_p={dropout_p} (the kernel has no dropout)")
    if mask is None:
        raise Unproven("no attention mask: nothing to skip")
    if not isinstance(mask, fx.Node):
        raise Unproven("a constant attention mask")
    if scale is None:
        head_dim = example_value(q).shape[-1]
        if not isinstance(head_dim, int):
            raise Unproven("a symbolic head dim (the default scale would be symbolic)")
        scale = 1.0 / math.sqrt(head_dim)
    elif _constant_float(scale) is None:
        raise Unproven("a non-constant scale")
    kind = "keep" if example_value(mask).dtype == torch.bool else "additive"
    return AttentionSite(anchor=sdpa, output=sdpa, q=q, k=k, v=v, scale=float(scale),
                         masks=[MaskTerm(mask, kind)], causal_flag=bool(is_causal), matched=[sdpa], kind="sdpa")


_MHA_ARGS = ("query", "key", "value", "embed_dim_to_check", "num_heads", "in_proj_weight", "in_proj_bias",
             "bias_k", "bias_v", "add_zero_attn", "dropout_p", "out_proj_weight", "out_proj_bias", "training",
             "key_padding_mask", "need_weights", "attn_mask", "use_separate_proj_weight", "q_proj_weight",
             "k_proj_weight", "v_proj_weight", "static_k", "static_v", "average_attn_weights", "is_causal")


def mha_arguments(node: fx.Node) -> dict[str, Any]:
    bound = dict(zip(_MHA_ARGS, node.args))
    bound.update(node.kwargs)
    return bound


def check_mha(node: fx.Node) -> dict[str, Any]:
    """The nn.MultiheadAttention configurations the rewrite serves; raises Unproven otherwise."""
    a = mha_arguments(node)
    if a.get("bias_k") is not None or a.get("bias_v") is not None or a.get("add_zero_attn"):
        raise Unproven("MultiheadAttention with add_bias_kv or add_zero_attn")
    if a.get("use_separate_proj_weight") or a.get("static_k") is not None or a.get("static_v") is not None:
        raise Unproven("MultiheadAttention with kdim/vdim or static k/v")
    if a.get("dropout_p", 0.0) not in (0, 0.0) and a.get("training", True):
        raise Unproven("MultiheadAttention dropout in training (the kernel has no dropout)")
    if a.get("attn_mask") is not None:
        raise Unproven("MultiheadAttention with attn_mask (only key_padding_mask is rewritten)")
    if a.get("is_causal"):
        raise Unproven("MultiheadAttention with is_causal")
    if a.get("key_padding_mask") is None:
        raise Unproven("MultiheadAttention without key_padding_mask: nothing to skip")
    weights_users = [u for u in node.users if u.target is operator.getitem and u.args[1] == 1]
    if any(u.users for u in weights_users):
        raise Unproven("MultiheadAttention's attention weights are used (need_weights): they cannot be skipped")
    if a.get("in_proj_bias") is None or a.get("in_proj_weight") is None:
        raise Unproven("MultiheadAttention without a packed in-projection")
    return a


# -- helpers ---------------------------------------------------------------------------------------

def _leads_to_matmul(node: Any, depth: int = 12) -> bool:
    """Whether the scores' q @ k^T is upstream of node through the ops a score chain may hold."""
    while isinstance(node, fx.Node) and depth > 0:
        if is_call(node, *_MATMUL, "einsum"):
            return True
        if not is_call(node, *_CASTS, *_SCALE_OPS, "add", "__add__", "__radd__", "sub", "__sub__",
                       "masked_fill", "where"):
            return False
        candidates = [a for a in node.args if isinstance(a, fx.Node)]
        if is_call(node, "where"):
            candidates = candidates[1:]
        if is_call(node, "masked_fill"):
            candidates = candidates[:1]
        if len(candidates) == 1:
            node, depth = candidates[0], depth - 1
            continue
        return any(_leads_to_matmul(c, depth - 1) for c in candidates)
    return False


def _which_is_scores(a: Any, b: Any) -> tuple[fx.Node, fx.Node]:
    a_scores, b_scores = _leads_to_matmul(a), _leads_to_matmul(b)
    if a_scores == b_scores or not isinstance(a, fx.Node) or not isinstance(b, fx.Node):
        raise Unproven("an addition on the scores where the score side is ambiguous or the other side constant")
    return (a, b) if a_scores else (b, a)


def _check_fill(fill: Any) -> None:
    value = _constant_float(fill)
    if value is None:
        raise Unproven("the masked positions are filled with a tensor, not a constant")
    if value > NEG_FILL_LIMIT:
        raise Unproven(f"masked scores are filled with {value!r}, not -inf or a large negative number (<= -1e4)")


def _mask_or_bias(term: fx.Node) -> str:
    """An added term is a mask when it only takes 0 and large negative values and comes from lengths."""
    from gemcompile.passes.mask_provenance import MaskEvaluator, PiecewiseTensor

    try:
        value = MaskEvaluator().tensor(term)
    except Unproven:
        return "bias"
    if isinstance(value, PiecewiseTensor) and all(v == 0 or v <= NEG_FILL_LIMIT for v, _ in value.pieces):
        return "mask"
    return "bias"
