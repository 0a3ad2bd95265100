"""nn.MultiheadAttention as an attention site: the configurations the jagged family serves (``check_mha``)
and its masks in the scores' frame (``match_mha``), a 3-D per-head attn_mask included when it repeats a
per-sample mask over the heads (``split_per_head_mask``)."""

from __future__ import annotations

import math
import operator
from typing import Any

import torch
import torch.fx as fx

from gemcompile.passes.attention.match import AttentionSite, MaskTerm
from gemcompile.passes.attention.scores import is_call
from gemcompile.passes.graph import Unproven, example_value, target_name


_MHA_ARGS = ("query", "key", "value", "embed_dim_to_check", "num_heads", "in_proj_weight", "in_proj_bias",
             "bias_k", "bias_v", "add_zero_attn", "dropout_p", "out_proj_weight", "out_proj_bias", "training",
             "key_padding_mask", "need_weights", "attn_mask", "use_separate_proj_weight", "q_proj_weight",
             "k_proj_weight", "v_proj_weight", "static_k", "static_v", "average_attn_weights", "is_causal")


def mha_arguments(node: fx.Node) -> dict[str, Any]:
    """multi_head_attention_forward's arguments by name."""
    return {**dict(zip(_MHA_ARGS, node.args)), **node.kwargs}


def check_mha(node: fx.Node) -> dict[str, Any]:
    """The arguments of an nn.MultiheadAttention configuration the rewrite serves; Unproven otherwise."""
    a = mha_arguments(node)
    if a.get("bias_k") is not None or a.get("bias_v") is not None or a.get("add_zero_attn"):
        raise Unproven("MultiheadAttention with add_bias_kv or add_zero_attn")
    if a.get("static_k") is not None or a.get("static_v") is not None:
        raise Unproven("MultiheadAttention with static k/v")
    if a.get("training", True) is not True:
        a["dropout_p"] = 0.0  # eval: MultiheadAttention applies no dropout
    if not isinstance(a.get("dropout_p", 0.0), (int, float)):
        raise Unproven("MultiheadAttention with a dropout computed in the graph")
    mask = a.get("attn_mask")
    if mask is not None and (not isinstance(mask, fx.Node) or example_value(mask).dim() not in (2, 3)):
        raise Unproven("MultiheadAttention with a constant attn_mask")
    if mask is not None and example_value(mask).dim() == 3:
        a["attn_mask_split"] = split_per_head_mask(mask, a["num_heads"])
    if a.get("is_causal") and mask is None:
        raise Unproven("MultiheadAttention with is_causal and no attn_mask (torch itself rejects it)")
    if a.get("key_padding_mask") is None and mask is None:
        raise Unproven("MultiheadAttention without key_padding_mask or attn_mask: nothing to skip")
    weights_users = [u for u in node.users if u.target is operator.getitem and u.args[1] == 1]
    if any(u.users for u in weights_users):
        raise Unproven("MultiheadAttention's attention weights are used (need_weights): they cannot be skipped")
    separate = ("q_proj_weight", "k_proj_weight", "v_proj_weight")
    if a.get("use_separate_proj_weight") and any(not isinstance(a.get(w), fx.Node) for w in separate):
        raise Unproven("MultiheadAttention with use_separate_proj_weight but without q/k/v projection weights")
    if not a.get("use_separate_proj_weight") and not isinstance(a.get("in_proj_weight"), fx.Node):
        raise Unproven("MultiheadAttention without an in-projection weight")
    return a


def split_per_head_mask(mask: fx.Node, heads: int) -> tuple[fx.Node, dict[int, int] | None]:
    """MultiheadAttention's 3-D attn_mask (B * H, L, S) reads row b * H + h for sample b, head h: the mask
    it was built from, with its dims in the scores' (MaskTerm.dims; None: the 4-D mask itself), when it is a
    (B, H, L, S) mask flattened or viewed into the heads' rows, a (B, L, S) one repeat_interleave'd over
    them, or one (1, L, S) or (L, S) mask expanded or repeated over every row; Unproven otherwise (a mask repeated with .repeat(H, 1, 1) gives sample b another sample's rows).
    A bool mask reaches the functional as MultiheadAttention canonicalized it, zeros_like(m).masked_fill_(m,
    -inf): m is split (its True drops the score, as the -inf did)."""
    if is_call(mask, "masked_fill", "masked_fill_") and len(mask.args) > 2 and mask.args[2] == float("-inf"):
        zeros, bool_mask = mask.args[:2]
        if is_call(zeros, "zeros_like") and zeros.args[0] is bool_mask:
            mask = bool_mask
    source = mask.args[0] if mask.args and isinstance(mask.args[0], fx.Node) else None
    value = example_value(source) if source is not None else None
    if isinstance(value, torch.Tensor) and value.dim() == 4 and value.shape[1] == heads:
        start = mask.kwargs.get("start_dim", mask.args[1] if len(mask.args) > 1 else 0)
        end = mask.kwargs.get("end_dim", mask.args[2] if len(mask.args) > 2 else -1)
        if is_call(mask, "flatten") and start == 0 and end in (1, -3):
            return source, None
        if is_call(mask, "view", "reshape"):  # only the first two dims merged: the last two are kept
            out = example_value(mask).shape
            if out[1:] == value.shape[2:]:
                return source, None
    if is_call(mask, "expand", "repeat") and isinstance(value, torch.Tensor) and value.dim() in (2, 3) and (
            value.dim() == 2 or value.shape[0] == 1):  # one (L, S) mask for every sample and head
        return source, {0: 0, 1: 1, 2: 3} if value.dim() == 3 else {0: 0, 1: 1}
    if is_call(mask, "repeat_interleave") and isinstance(value, torch.Tensor) and value.dim() == 3:
        repeats = mask.kwargs.get("repeats", mask.args[1] if len(mask.args) > 1 else None)
        dim = mask.kwargs.get("dim", mask.args[2] if len(mask.args) > 2 else None)
        if repeats == heads and dim == 0:
            return source, {0: 0, 1: 1, 2: 3}  # right-aligned dims: (B, L, S) -> b, i, j of the scores
    tiled = _tiling_before(mask)
    if tiled is not None:  # ~tiled, 1 - tiled.float(), ~(~tiled), zeros.masked_fill(~tiled, -inf)
        raise Unproven(f"MultiheadAttention's per-head (3-D) attn_mask is `{target_name(mask)}` ({mask.name}) of "
                       f"the mask tiled over the heads ({tiled.name}): only the tiling itself is read per sample "
                       "(apply the op before tiling)")
    raise Unproven("MultiheadAttention with a per-head (3-D) attn_mask that is not a per-sample mask "
                   "repeated over the heads (flatten of (B, H, L, S), or repeat_interleave(H, dim=0)) or one "
                   "mask for all (expand or repeat of a (1, L, S) or (L, S) mask)")


def _tiling_before(mask: fx.Node, depth: int = 4) -> fx.Node | None:
    """The tiling over the heads (flatten / view / reshape / repeat_interleave) that ``mask`` is computed from
    by ops of its own shape (an invert, a cast, a fill: FuxiCTR DMIN's ``get_mask`` negates after tiling),
    for explain's advice; None when there is none within ``depth`` ops."""
    shape = example_value(mask).shape
    node = mask
    for _ in range(depth):
        inputs = [a for a in node.all_input_nodes if getattr(example_value(a), "shape", None) == shape]
        if not inputs:
            return None
        node = inputs[-1]  # (a fill's mask operand comes after the tensor it fills)
        if is_call(node, "flatten", "view", "reshape", "repeat_interleave"):
            return node
    return None


def match_mha(node: fx.Node) -> AttentionSite:
    """nn.MultiheadAttention as a site: q, k, v are its (L, B, E) inputs, before the in-projection. Its
    key_padding_mask (B, S) and attn_mask (L, S) mark dropped scores True (bool) or add to them (float):
    dims (b, j) and (i, j) of the scores. With is_causal, torch takes attn_mask as a hint that it is the
    causal mask and may run either one; without a key_padding_mask and weights it runs plain causal, which
    is what the site is then (a mask that is not causal is eager's own inconsistency, not ours to pick)."""
    a = check_mha(node)
    terms = []
    padding, attn = a.get("key_padding_mask"), a.get("attn_mask")
    causal = bool(a.get("is_causal")) and padding is None and not a.get("need_weights", True)
    attn_dims = None
    if "attn_mask_split" in a:  # (B * H, L, S): the per-sample mask it repeats over the heads
        attn, attn_dims = a["attn_mask_split"]
    for mask, dims in ((padding, {1: 3, 0: 0}), (None if causal else attn, attn_dims)):
        if mask is not None:
            kind = "drop" if example_value(mask).dtype == torch.bool else "additive"
            terms.append(MaskTerm(mask, kind, dims=dims))
    head_dim = a["embed_dim_to_check"] // a["num_heads"]
    return AttentionSite(anchor=node, output=node, q=a["query"], k=a["key"], v=a["value"],
                         scale=1.0 / math.sqrt(head_dim), masks=terms, causal_flag=causal, matched=[node],
                         kind="mha", dropout_p=float(a.get("dropout_p", 0.0)))
