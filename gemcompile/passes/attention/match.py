"""Find attention in a Dynamo graph and take it apart: q, k, v, scale, additive bias, masks, output.

Anchors, not enumerated spellings. An attention is
- a ``scaled_dot_product_attention`` node (``match_sdpa``);
- a ``multi_head_attention_forward`` node, what ``nn.MultiheadAttention`` is in a Dynamo graph
  (attention/mha.py; the jagged family rewrites it with its projections);
- a softmax over the last dim whose input comes from ``q @ k^T`` and whose output goes to ``@ v``
  (``match_softmax``): between the two matmuls the chain may scale (by a constant), add terms (a float
  mask or a bias), fill masked positions (``masked_fill``, ``torch.where``), cast, or apply dropout that
  is off;
- a pointwise activation (silu, gelu exact or tanh, relu, relu squared, sigmoid) of the scores
  (``match_pointwise``), the activated scores going to ``@ v`` through a mask, a normalizer and casts:

      act(q @ k^T * scale [+ bias]) [* mask | masked_fill(~mask, 0) | where(mask, ., 0)]
                                    [* c | / c | / lengths[b]] @ v

  The mask must come after the activation (sigmoid(0) != 0: a mask inside would not drop a pair).
  Identity (linear) attention, ``(q @ k^T * scale [+ bias]) * mask @ v``, has no activation to anchor on:
  its anchor is the raw scores that the first mask op takes (``identity_scores``), and it needs a mask
  (without one the chain is two plain matmuls, nothing to gain).

Masks are kept as graph nodes here; masks/ proves what they are. Every node of the chain must feed only
the next one: attention weights used elsewhere (returned, logged) cannot be skipped, so such sites are
left alone.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from gemcompile.passes.attention.activation_fills import fill_dropped
from gemcompile.passes.attention.scores import (
    ADD, CASTS, DIV, MATMUL, MUL, PRODUCTS, RESHAPES, SCALE_OPS, SCORE_MAPS, SUB, check_plain_arithmetic,
    constant_float,
    filled_with,
    heads_view,
    is_call,
    leads_to_matmul,
    replay,
    single_user,
    values,
    tensor_factor,
    walk_to_scores,
)
from gemcompile.passes.attention.weights import check_post_masks, key_mask_op, nan_zeroing, row_op
from gemcompile.passes.graph import Unproven, example_value, fed_by, target_name
from gemcompile.passes.masks.evaluator import NEG_FILL_LIMIT, MaskEvaluator, PiecewiseTensor


@dataclass(frozen=True)
class MaskTerm:
    """A mask applied to the scores: ``node`` keeps a score where it is True ("keep"), where it is False
    ("drop") or by adding 0 / a large negative value ("additive"). ``dims`` maps the mask's right-aligned
    dims onto the scores' (B, H, Lq, Lk) frame when they do not line up."""

    node: fx.Node
    kind: str  # "keep" | "drop" | "additive"
    dims: dict[int, int] | None = None
    fill: float | None = None
    """The value a keep/drop term fills dropped scores with (masked_fill, where); None: -inf (a bool mask
    given to SDPA or nn.MultiheadAttention). Additive terms' values come from the mask evaluator."""
    negated: bool = False
    """An additive term subtracted from the scores (``s - 1e30 * mask``): its values are negated."""
    fill_added: bool = False
    """Whether that fill is added to the scores (``s + where(keep, bias, F)``) rather than written over
    them: a row with no valid key then gets eager's s + F, as for an additive mask."""


@dataclass(frozen=True)
class GatedBias:
    """A bias that applies on one side of a condition only, the other side being a mask's fill:
    ``where(cond, value, F)`` added to the scores is this bias (``where(cond, value, 0)``, built by
    ``summed_bias``) plus the keep mask ``cond`` filled with F. The gate keeps eager's gradient: none
    reaches ``value`` where the fill stands, a sequence with no valid key included."""

    value: fx.Node
    cond: fx.Node
    kept: bool
    """True: the bias stands where cond is True (``where(cond, value, F)``); False: where it is False."""


@dataclass(frozen=True)
class MergedBias:
    """A bias added to scores of batch and heads merged, (B * H, Lq, Lk) (or broadcast to it): summed_bias
    views it as (B, H, Lq, Lk)."""

    value: fx.Node
    heads: int


@dataclass
class AttentionSite:
    """One attention, taken apart. q/k/v are (B|1, H, L, D) views once the ``*_perm`` permutations apply."""

    anchor: fx.Node
    output: fx.Node
    q: fx.Node
    k: fx.Node
    v: fx.Node
    scale: float = 1.0
    activation: str | None = None
    """None: softmax; else the pointwise activation of the scores ("identity" for linear attention)."""
    out_scale: float = 1.0
    """A constant the activated scores are multiplied by (pointwise attention)."""
    divisor: fx.Node | None = None
    """The per-sample normalizer the activated scores are divided by (a lengths tensor), if any."""
    divided_then_replaced: bool = False
    """A mask written over the activated scores after the division (where / masked_fill): a sample whose
    normalizer is 0 has every score replaced by 0 in eager, so its output is 0, not 0 / 0."""
    q_factor: tuple[fx.Node, bool] | None = None
    """A tensor the scores are multiplied (False) or divided (True) by, constant along the keys and applied
    before any bias or mask (a learned temperature): the families fold it into q."""
    q_perm: tuple[int, ...] | None = None
    k_perm: tuple[int, ...] | None = None
    k_is_transposed: bool = False
    v_perm: tuple[int, ...] | None = None
    out_perm: tuple[int, ...] | None = None
    bias: list[tuple[fx.Node | GatedBias | MergedBias, float]] = field(default_factory=list)
    masks: list[MaskTerm] = field(default_factory=list)
    causal_flag: bool = False
    matched: list[fx.Node] = field(default_factory=list)
    zero_blind_rows: bool = False
    """The weights were masked again after the softmax by the scores' own mask: rows with no valid key are 0
    in eager, whatever the fill (weights.py)."""
    kv_repeats: int = 1
    """SDPA's enable_gqa: each k and v head serves this many query heads (repeat_interleave'd, as SDPA
    does)."""
    row_ops: list[tuple[str, fx.Node]] = field(default_factory=list)
    """What the weights' query rows were multiplied by before ``@ v`` (TF SASRec's query masking: ``p *=
    query_mask``; ``p.masked_fill(~rows, 0)``; ``where(rows, p, 0)``), each constant along the keys: the same
    op on the output rows gives the same result, ("mul", factor), ("masked_fill", cond) or ("where", cond)."""
    heads: int | None = None
    """H when q and k (``qk_merged``) or v and the output (``pv_merged``) hold batch and heads merged in
    dim 0, (B * H, L, D), as bmm takes them (fairseq, DeBERTa; H = 1 for single-head (B, L, D) attention):
    the families view them as (B, H, L, D)."""
    qk_merged: bool = False
    pv_merged: bool = False
    kind: str = "softmax"
    """"softmax", "sdpa", "mha" or "pointwise"."""
    dropout_p: float = 0.0
    """Dropout on the attention weights in training (F.dropout / nn.Dropout after the softmax, SDPA's
    dropout_p, MultiheadAttention's dropout): the families that serve it draw it inside their kernel."""


def _site(anchor: fx.Node, output: fx.Node, info: dict, matched: list[fx.Node], **fields) -> AttentionSite:
    for key in ("q", "k", "v"):
        if not isinstance(info.get(key), fx.Node):
            raise Unproven(f"no tensor for {key}")
    layout = {key: info[key] for key in ("q_perm", "k_perm", "k_is_transposed", "v_perm", "out_perm", "heads",
                                         "qk_merged", "pv_merged") if key in info}
    return AttentionSite(anchor=anchor, output=output, q=info["q"], k=info["k"], v=info["v"], matched=matched,
                         **layout, **fields)


# -- softmax ---------------------------------------------------------------------------------------

def looks_like_attention(softmax: fx.Node) -> bool:
    """Only softmaxes that sit on a matmul are candidates: a softmax over logits is none of our business.
    So is a softmax whose weights multiply values (weights @ v) over scores computed from a product through
    ops no score chain holds (STOSA's negated Wasserstein distance): matching it fails, and explain names
    the op the kernels do not compute instead of saying nothing."""
    if not softmax.args or not isinstance(softmax.args[0], fx.Node):
        return False
    if leads_to_matmul(softmax.args[0], through=(*SCORE_MAPS, *RESHAPES)):
        return True
    return _weights_meet_values(softmax) and fed_by(softmax.args[0], _is_product, limit=128)


def _weights_meet_values(weights: fx.Node, depth: int = 4) -> bool:
    """Whether the weights, through casts, dropout and views, are the left operand of a product."""
    for user in weights.users:
        operands = user.args[1:] if is_call(user, "einsum") else user.args  # einsum's first is its equation
        if _is_product(user) and operands and operands[0] is weights:
            return True
        if depth and (is_call(user, *CASTS, *RESHAPES, "dropout") or heads_view(user) is not None):
            if _weights_meet_values(user, depth - 1):
                return True
    return False


def dropout_probability(node: fx.Node) -> float:
    """p of F.dropout(x, p, training) / torch.dropout(x, p, train): 0.0 when it is off (p = 0 or not
    training); Unproven when p or the flag is computed in the graph."""
    p = node.kwargs.get("p", node.args[1] if len(node.args) > 1 else 0.5)
    training = node.kwargs.get("training", node.kwargs.get("train", node.args[2] if len(node.args) > 2 else True))
    if training is False or p == 0:
        return 0.0
    if training is not True or constant_float(p) is None:
        raise Unproven("dropout on the attention weights with p or the training flag computed in the graph")
    return float(p)


def match_softmax(softmax: fx.Node) -> AttentionSite:
    """softmax(scores) @ v with scores = q @ k^T scaled, biased and masked."""
    dim = softmax.kwargs.get("dim", softmax.kwargs.get("axis", softmax.args[1] if len(softmax.args) > 1 else None))
    ndim = example_value(softmax).dim()
    if not (isinstance(dim, int) and dim % ndim == ndim - 1):
        raise Unproven(f"softmax over dim {dim}, not over the keys (the last dim)")
    matched: list[fx.Node] = []
    views: list[int] = []  # heads of the weights' views to (B * H, Lq, Lk) before a bmm
    row_ops: list[tuple[str, fx.Node]] = []
    post_masks: list[tuple[bool, fx.Node]] = []
    dropout_p = 0.0  # dropout multiplies each weight: it commutes with the row ops and masks around it
    # forward: softmax -> casts / dropout / a heads view -> (weights @ v)
    node = softmax
    while True:
        zeroed = nan_zeroing(node)
        if zeroed is not None:  # a safe softmax: rows with no valid key are 0, as the kernel gives them
            matched.append(node)
            matched.extend(u for u in node.users if u is not zeroed)  # isnan, zeros_like
            node = zeroed
            continue
        single_user(node, matched)
        (user,) = (u for u in node.users if u not in matched)  # (a dead read went into matched)
        scaled_rows, post_mask = row_op(user, node), key_mask_op(user, node)
        if scaled_rows is not None or post_mask is not None:
            (row_ops if scaled_rows is not None else post_masks).append(scaled_rows or post_mask)
            node = user
            continue
        if is_call(user, "dropout"):
            p = dropout_probability(user)
            if p and dropout_p:
                raise Unproven("two dropouts on the attention weights")
            dropout_p = p or dropout_p
        heads = heads_view(user)
        if not is_call(user, *CASTS, "dropout") and heads is None:
            break
        if heads is not None:
            views.append(heads)
        node = user
    info: dict[str, Any] = {}
    values(user, node, info, "the softmax output goes")
    ops = walk_to_scores(softmax.args[0], matched, info, _softmax_step, positive=True,
                         what="the softmax is not a scale, bias, mask or cast", added=_added_terms)
    ops = _merged_heads(info, ops, views, qk=example_value(info["q"]).dim() == 3,
                        pv=example_value(info["v"]).dim() == 3)
    scale, bias, masks = replay(ops)
    if row_ops and (views or info.get("heads", 1) != 1):
        raise Unproven("the attention weights' rows are scaled with batch and heads merged")
    check_post_masks(post_masks, masks)
    return _site(softmax, user, info, matched + [user], scale=scale, bias=bias, masks=masks,
                 q_factor=tensor_factor(ops), row_ops=row_ops, zero_blind_rows=bool(post_masks),
                 dropout_p=dropout_p)



def _merged_heads(info: dict, ops: list, views: list[int], qk: bool, pv: bool) -> list:
    """The ops in the split (B, H, Lq, Lk) frame when q @ k^T or weights @ v ran on batch and heads merged
    (B * H, ...): H from the heads views of the scores or weights (1 without any: single-head attention);
    a term applied in the merged frame is a bias viewed per head (MergedBias) or a mask broadcast alike in
    both frames (one read per batch and head is refused). ``ops`` unchanged when nothing ran merged."""
    frames = info.pop("op_frames")
    seen = {*views, *([info["heads"]] if "heads" in info else [])}
    if len(seen) > 1:
        raise Unproven(f"the scores are viewed with {sorted(seen)} heads")
    if not (qk or pv or 3 in frames):
        return ops
    heads = seen.pop() if seen else 1
    info.update(heads=heads, qk_merged=qk, pv_merged=pv)
    out = []
    for (kind, arg), frame in zip(ops, frames, strict=True):
        if frame == 3 and kind == "bias":
            term, c = arg
            arg = (MergedBias(term, heads), c)
        elif frame == 3 and kind == "mask":
            shape = example_value(arg.node).shape
            if len(shape) == 3 and shape[0] != 1 and heads != 1:
                raise Unproven(f"the mask {arg.node.name} is applied per batch and head merged ({shape[0]} "
                               "rows): view the scores as (B, H, Lq, Lk) to mask them")
            if len(shape) == 3:  # (B, Lq, Lk) of single-head attention: b, i, j of the split frame
                arg = dataclasses.replace(arg, dims={0: 0, 1: 1, 2: 3})
        out.append((kind, arg))
    return out


def _softmax_step(node: fx.Node, ops: list) -> fx.Node | None:
    """The bias and mask ops a softmax's score chain may hold (walk_to_scores' step)."""
    if is_call(node, *ADD, *SUB):
        check_plain_arithmetic(node)
    if is_call(node, *ADD):
        shift = _constant_shift(*node.args[:2])
        if shift is not None:
            return shift
        chain, term = _which_is_scores(*node.args[:2])
        ops.extend(_added_terms(term))
        return chain
    if is_call(node, *SUB):
        a, b = node.args[:2]
        if not leads_to_matmul(a):
            raise Unproven("the scores are subtracted from something")
        if not isinstance(b, fx.Node):
            if constant_float(b) != 0.0:
                raise Unproven("the scores minus a constant")
            return a
        if _constant_along_keys(b):  # s - max(s) (ReChorus): the same softmax, and the same gradient
            return a
        if _subtracted_mask(b):  # XLNet: s - 1e30 * mask
            ops.append(("mask", MaskTerm(b, "additive", negated=True)))
            return a
        if _is_additive_mask(b):
            raise Unproven("a mask subtracted from the scores")
        ops.append(("bias", (b, -1.0)))
        return a
    if is_call(node, "masked_fill"):
        base, mask, fill = node.args[0], node.args[1], node.args[2] if len(node.args) > 2 else node.kwargs["value"]
        ops.append(("mask", MaskTerm(mask, "drop", fill=_check_fill(fill))))
        return base
    if is_call(node, "where"):
        cond, x, y = node.args
        if isinstance(x, fx.Node) and leads_to_matmul(x) and filled_with(y) is not None:
            ops.append(("mask", MaskTerm(cond, "keep", fill=_check_fill(filled_with(y)))))
            return x
        if isinstance(y, fx.Node) and leads_to_matmul(y) and filled_with(x) is not None:
            ops.append(("mask", MaskTerm(cond, "drop", fill=_check_fill(filled_with(x)))))
            return y
        raise Unproven("torch.where on the scores with a tensor on both sides")
    return None


def _constant_along_keys(x: fx.Node) -> bool:
    """A float tensor with one value per row of the scores (0-d, or a last dim of 1): subtracting it leaves
    the softmax unchanged, and its gradient too (a softmax's input gradient sums to 0 over each row)."""
    value = example_value(x)
    return (isinstance(value, torch.Tensor) and value.is_floating_point()
            and (value.dim() == 0 or value.shape[-1] == 1))


def _constant_shift(a: Any, b: Any) -> fx.Node | None:
    """The scores' side of ``s + 0`` (XLNet's ``ef = 0`` without segments), else None. Only 0: another
    constant shifts the scores against a finite fill, which the fill's checks do not bound."""
    for x, c in ((a, b), (b, a)):
        if isinstance(x, fx.Node) and not isinstance(c, fx.Node) and constant_float(c) == 0.0:
            return x
    return None


def _subtracted_mask(term: fx.Node) -> bool:
    """Whether ``s - term`` masks: term is 0 where a score is kept and >= 1e4 where it is dropped."""
    try:
        value = MaskEvaluator().tensor(term)
    except Unproven:
        return False
    pieces = value.pieces if isinstance(value, PiecewiseTensor) else None
    return bool(pieces) and all(v == 0 or -v <= NEG_FILL_LIMIT for v, _ in pieces) and \
        any(v != 0 for v, _ in pieces)


def _which_is_scores(a: Any, b: Any) -> tuple[fx.Node, fx.Node]:
    a_scores, b_scores = leads_to_matmul(a), leads_to_matmul(b)
    if not (a_scores or b_scores):  # a score map on one side: the walk goes on to name it
        a_scores, b_scores = (leads_to_matmul(x, through=SCORE_MAPS) for x in (a, b))
    if not (a_scores or b_scores):
        stop = next((op for x in (a, b) if (op := _off_chain_op(x)) is not None), None)
        if stop is not None:
            raise Unproven(f"`{target_name(stop)}` ({stop.name}) between the product and the softmax is not a "
                           "scale, bias, mask or cast of q @ k^T: the kernels compute a scaled q @ k^T plus a "
                           "bias or mask, not a distance or another function of products")
    if a_scores == b_scores or not isinstance(a, fx.Node) or not isinstance(b, fx.Node):
        names = [x.name if isinstance(x, fx.Node) else repr(x) for x in (a, b)]
        raise Unproven(f"an addition on the scores ({names[0]} + {names[1]}) where the score side is ambiguous "
                       "or the other side constant")
    return (a, b) if a_scores else (b, a)


def _is_product(node: fx.Node) -> bool:
    return is_call(node, *PRODUCTS)


def _off_chain_op(node: Any, depth: int = 12) -> fx.Node | None:
    """The first op on the way from ``node`` up to a product that no score chain holds (what stops
    leads_to_matmul), or None when no product is upstream."""
    while isinstance(node, fx.Node) and depth > 0 and fed_by(node, _is_product, limit=128):
        if _is_product(node):
            return None
        if not is_call(node, *CASTS, *SCALE_OPS, *ADD, *SUB, "masked_fill", "where") and heads_view(node) is None:
            return node
        node = next((a for a in node.all_input_nodes if fed_by(a, _is_product, limit=128)), None)
        depth -= 1
    return None


def _check_fill(fill: Any) -> float:
    value = constant_float(fill)
    if value is None:
        raise Unproven("the masked positions are filled with a tensor, not a constant")
    if not value <= NEG_FILL_LIMIT:  # NaN too: eager's filled rows are NaN, no kernel skips them
        raise Unproven(f"masked scores are filled with {value!r}, not -inf or a large negative number (<= -1e4)")
    return float(value)


def _is_additive_mask(term: fx.Node) -> bool:
    """An added term is a mask when it only takes 0 and large negative values, or when it is built like one
    (a large negative fill constant) even if the prover cannot read it: then the refusal names what
    blocked the proof rather than calling the mask a bias."""
    return _added_terms(term, depth=0)[0][0] == "mask"


def _added_terms(term: fx.Node, depth: int = 4) -> list[tuple[str, Any]]:
    """What an added tensor contributes, as walk_to_scores' ops: a mask, a bias, or, for a sum that is not a
    mask as a whole (T5's ``position_bias + extended_mask``, ALiBi's slopes plus padding), each part
    classified on its own; s + (b + m) is s + b with the keys m drops dropped."""
    try:
        value = MaskEvaluator().tensor(term)
    except Unproven:
        value = None
    if value is not None:
        pieces = value.pieces if isinstance(value, PiecewiseTensor) else [(1.0, None)]
        if all(v == 0 or v <= NEG_FILL_LIMIT for v, _ in pieces):
            return [("mask", MaskTerm(term, "additive"))]
    gated = _gated_bias(term)
    if gated is not None:
        return gated
    if value is not None:
        return [("bias", (term, 1.0))]
    summed = is_call(term, *ADD) and not term.kwargs and all(isinstance(a, fx.Node) for a in term.args[:2])
    if depth and summed:
        parts = [op for part in term.args[:2] for op in _added_terms(part, depth - 1)]
        if any(kind == "mask" for kind, _ in parts):
            return parts
    return [("mask", MaskTerm(term, "additive")) if _built_like_a_mask(term) else ("bias", (term, 1.0))]


def _gated_bias(term: fx.Node) -> list[tuple[str, Any]] | None:
    """``where(cond, bias, F)`` (or ``where(cond, F, bias)``, ``masked_fill(bias, cond, F)``) with a fill
    F <= -1e4, as transformers' SDPA integration folds T5's position_bias (Falcon its ALiBi) into a bool
    mask: the keep mask cond with F added on the keys it
    drops, and the bias gated to the keys it keeps (GatedBias); None for any other term."""
    while is_call(term, "contiguous", "clone"):
        term = term.args[0]
    if is_call(term, "masked_fill") and len(term.args) == 3 and not term.kwargs:  # Falcon's ALiBi mask
        (bias, cond, fill), kept = term.args, False  # = where(cond, F, bias)
    elif is_call(term, "where") and len(term.args) == 3 and not term.kwargs:
        cond, x, y = term.args
        kept = isinstance(x, fx.Node) and not isinstance(y, fx.Node)
        bias, fill = (x, y) if kept else (y, x)
    else:
        return None
    value = constant_float(fill)
    if not isinstance(cond, fx.Node) or not isinstance(bias, fx.Node) or value is None or value > NEG_FILL_LIMIT:
        return None
    if example_value(cond).dtype != torch.bool:
        return None
    mask = MaskTerm(cond, "keep" if kept else "drop", fill=float(value), fill_added=True)
    return [("mask", mask), ("bias", (GatedBias(bias, cond, kept), 1.0))]


def _built_like_a_mask(term: fx.Node, limit: int = 32) -> bool:
    """Whether a constant <= -1e4 (a fill) feeds the term (within ``limit`` producers): a bias built with
    comparisons (T5's buckets) has none and stays a bias."""
    def mask_like(n: fx.Node) -> bool:
        return any(isinstance(a, (int, float)) and not isinstance(a, bool) and a <= NEG_FILL_LIMIT
                   for a in (*n.args, *n.kwargs.values()))

    return fed_by(term, mask_like, limit)


# -- SDPA and nn.MultiheadAttention ----------------------------------------------------------------

SDPA_PARAMETERS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def match_sdpa(sdpa: fx.Node) -> AttentionSite:
    bound = dict(zip(SDPA_PARAMETERS, sdpa.args)) | dict(sdpa.kwargs)  # ALBERT passes query=, key=, value=
    q, k, v = (bound.get(name) for name in SDPA_PARAMETERS[:3])
    if not all(isinstance(x, fx.Node) for x in (q, k, v)):
        raise Unproven("scaled_dot_product_attention without query, key and value tensors in the graph")
    mask = bound.get("attn_mask")
    dropout_p = bound.get("dropout_p", 0.0)
    is_causal = bound.get("is_causal", False)
    scale = bound.get("scale")
    kv_repeats = _gqa_repeats(q, k) if bound.get("enable_gqa", False) else 1
    if constant_float(dropout_p) is None:
        raise Unproven("a dropout_p computed in the graph")
    if mask is None and is_causal:
        raise Unproven("is_causal=True with no attention mask: no padding to skip, and SDPA's own causal "
                       "kernels run it")
    if mask is None:
        raise Unproven("no attention mask: nothing to skip")
    if not isinstance(mask, fx.Node):
        raise Unproven("a constant attention mask")
    if scale is None:
        head_dim = example_value(q).shape[-1]
        if not isinstance(head_dim, int):
            raise Unproven("a symbolic head dim (the default scale would be symbolic)")
        scale = 1.0 / math.sqrt(head_dim)
    elif constant_float(scale) is None:
        raise Unproven("a non-constant scale")
    if example_value(mask).dtype == torch.bool:
        masks, bias = [MaskTerm(mask, "keep")], []
    else:  # added to the scaled scores: a mask, a bias, or both summed (T5's position_bias + padding mask)
        terms = _added_terms(mask)
        masks = [arg for kind, arg in terms if kind == "mask"]
        bias = [arg for kind, arg in terms if kind == "bias"]
        if not masks:  # no part reads as a mask: prove it as one, so the refusal says what it is instead
            masks, bias = [MaskTerm(mask, "additive")], []
    return AttentionSite(anchor=sdpa, output=sdpa, q=q, k=k, v=v, scale=float(scale), masks=masks, bias=bias,
                         causal_flag=bool(is_causal), matched=[sdpa], kind="sdpa", kv_repeats=kv_repeats,
                         dropout_p=float(dropout_p))


def _gqa_repeats(q: fx.Node, k: fx.Node) -> int:
    """Query heads per k/v head under enable_gqa (1 when the counts are equal)."""
    hq, hk = example_value(q).shape[-3], example_value(k).shape[-3]
    if not (isinstance(hq, int) and isinstance(hk, int)) or hk == 0 or hq % hk:
        raise Unproven(f"enable_gqa with {hq} query heads and {hk} key/value heads (not a multiple)")
    return hq // hk


# -- pointwise activations (GDPA) ------------------------------------------------------------------

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


def feeds_from_scores(node: fx.Node) -> bool:
    """Whether an activation takes (B, H, Lq, Lk) scores: an activation in an MLP is none of our business."""
    arg = node.args[0] if node.args else node.kwargs.get("input")
    if not isinstance(arg, fx.Node) or not leads_to_matmul(arg):
        return False
    value = example_value(arg)
    return isinstance(value, torch.Tensor) and value.dim() == 4


def _is_raw_scores(node: Any) -> bool:
    """node is q @ k^T through constant scales, bias additions and casts only (no activation, no mask)."""
    while isinstance(node, fx.Node):
        if node.kwargs.get("alpha", 1) != 1 or node.kwargs.get("rounding_mode") is not None:
            return False
        if is_call(node, *MATMUL, "einsum"):
            value = node.meta.get("example_value")
            return getattr(value, "ndim", 0) == 4  # (B, H, Lq, Lk) scores
        if is_call(node, *CASTS):
            node = node.args[0]
        elif is_call(node, *SCALE_OPS):
            a, b = node.args[:2]
            if isinstance(a, fx.Node) == isinstance(b, fx.Node):
                return False
            node = a if isinstance(a, fx.Node) else b
        elif is_call(node, *ADD, *SUB):
            a, b = node.args[:2]
            if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)) or leads_to_matmul(a) == leads_to_matmul(b):
                return False
            node = a if leads_to_matmul(a) else b
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
    elif is_call(node, *MUL) and all(isinstance(a, fx.Node) for a in node.args[:2]):
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
        if is_call(user, *MATMUL, "einsum"):
            return data if user.args[0] is chain or is_call(user, "einsum") else None
        if not is_call(user, *CASTS, *MUL, *DIV, "masked_fill", "where"):
            return None
        chain = user
    return None


def _fill_is_zero(fill: Any) -> None:
    if constant_float(fill) != 0.0:
        raise Unproven(f"masked pairs are filled with {fill!r}, not 0 (after the activation a mask must zero them)")


def match_pointwise(anchor: fx.Node, identity: bool = False) -> AttentionSite:
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
    forward = _activated_to_values(anchor, act_out, matched)
    if identity and not forward["masks"]:
        raise Unproven("identity attention without a mask: two plain matmuls, nothing to rewrite")
    info: dict[str, Any] = {}
    values(forward["user"], forward["node"], info, "the activated scores go")
    ops = walk_to_scores(anchor if identity else anchor.args[0], matched, info,
                         functools.partial(_pointwise_step, activation=activation), positive=False,
                         what="the activation is not a scale, bias or cast")
    scale, bias, filled = replay(ops)
    return _site(anchor, forward["user"], info, matched + [forward["user"]], scale=scale, bias=bias,
                 activation=activation, out_scale=forward["out_scale"], divisor=forward["divisor"],
                 divided_then_replaced=forward["replaced_after"],
                 masks=forward["masks"] + filled, kind="pointwise", q_factor=tensor_factor(ops))


def _activated_to_values(anchor: fx.Node, act_out: fx.Node, matched: list[fx.Node]) -> dict[str, Any]:
    """Forward from the activation: masks, constant scales and the per-sample normalizer, up to the node
    that uses the activated scores against v."""
    out_scale, divisor, masks, replaced_after = 1.0, None, [], False
    node = anchor
    while True:
        single_user(node, matched)
        (user,) = (u for u in node.users if u not in matched)  # (a dead read went into matched)
        if (user is act_out and act_out is not anchor) or is_call(user, *CASTS):
            node = user
            continue
        if is_call(user, *MUL, *DIV) and (user.args[0] is node or is_call(user, *MUL)):
            other = user.args[1] if user.args[0] is node else user.args[0]
            divides = is_call(user, *DIV)
            c = constant_float(other)
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
                masks.append(MaskTerm(other, "keep"))
        elif is_call(user, "masked_fill") and user.args[0] is node:
            _fill_is_zero(user.args[2] if len(user.args) > 2 else user.kwargs.get("value"))
            masks.append(MaskTerm(user.args[1], "drop"))
            replaced_after |= divisor is not None
        elif is_call(user, "where"):
            cond, x, y = user.args
            if x is node and not isinstance(y, fx.Node):
                _fill_is_zero(y)
                masks.append(MaskTerm(cond, "keep"))
            elif y is node and not isinstance(x, fx.Node):
                _fill_is_zero(x)
                masks.append(MaskTerm(cond, "drop"))
            else:
                raise Unproven("torch.where on the activated scores with a tensor on both sides")
            replaced_after |= divisor is not None
        else:
            return {"node": node, "user": user, "out_scale": out_scale, "divisor": divisor, "masks": masks,
                    "replaced_after": replaced_after}
        node = user


def _pointwise_step(node: fx.Node, ops: list, activation: str = "identity") -> fx.Node | None:
    """The bias ops and drop fills (activation_fills.py) an activation's score chain may hold (a step)."""
    if is_call(node, "masked_fill") and len(node.args) == 3 and isinstance(node.args[1], fx.Node):
        fill_dropped(node.args[2], ops, activation)
        ops.append(("mask", MaskTerm(node.args[1], "drop")))
        return node.args[0]
    if not is_call(node, *ADD, *SUB):
        return None
    a, b = node.args[:2]
    if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
        raise Unproven("a constant added to the scores")
    if leads_to_matmul(a) == leads_to_matmul(b):
        raise Unproven("an addition on the scores where the score side is ambiguous")
    subtract = is_call(node, *SUB)
    if subtract and not leads_to_matmul(a):
        raise Unproven("the scores are subtracted from something")
    chain, term = (a, b) if leads_to_matmul(a) else (b, a)
    ops.append(("bias", (term, -1.0 if subtract else 1.0)))
    return chain
