"""A finite mask fill (-1e9, -1e4, finfo.min) kept exact when its dropped scores become skipped keys.

Eager adds the fill F to each dropped score; the kernels skip dropped keys. The two agree exactly except

1. **large scores**: a dropped key adds exp(s + F - m) to its row, which is exactly 0 in fp32 only while
   s + F - m < -104. The rewrite adds a device-side check (``torch._assert_async``, no host sync) that
   2 * (scale * max|q_i| * max|k_j| + max|bias|) <= -F - 120 (Cauchy-Schwarz bounds every score), so a model
   whose scores reach the fill's magnitude stops with a message instead of a silently different answer.
   Fills at or below -1e30 (finfo.min of fp32 and bf16) need no check.
2. **rows that see no valid key**: eager gives them softmax(s + F) over the keys the fill spans.
   - no causal/window/block/HSTU term and no query padding: such a row is a sequence with no valid key, and
     the rewrite gives that sequence every key. Written over the scores (masked_fill, where), F makes the
     row uniform whatever its value. Added, eager computes s + F in the dtype of its addition (a hand-written
     softmax's; SDPA adds in fp32), which puts s on a grid of F's spacing there (finite_fill.spacing: 2**-10
     at fp32 -1e4, 8 at fp16 -1e4, 64 at bf16 -1e4). Up to EXACT_SPACING the row is softmax(s), the exact one
     (eager's differs by its own rounding).
     Coarser, the row is uniform where the grid rounds s away, and the kernel is told so (``uniform_keys``:
     scores taken as 0, gradients as eager's autograd gives them), with a device-side check that the scores
     are small enough to round away (|s| < spacing / 2, bounded per sample from that sample's own q and k;
     always true for finfo.min); where they are not, eager's row depends on the rounding and the run stops
     with a message. A fill added by several terms instead gets a device-side check that no sequence is
     empty: eager's row then attends only to the keys the fewest terms drop.
     Written over the scores (masked_fill, where), the fill passes no gradient to them: q and k of such a
     sequence are detached, as eager's autograd gives;
   - causal: a row i sees no valid key when keys 0..i are all padding (left padding, leading holes of a
     data mask, an empty sequence): those rows are a prefix of each sequence. With one fill F for every
     dropped pair, eager's such row is softmax(s + F) over all the keys (the causal ones dropped with the
     same F), so the rewrite computes these rows in a second, non-causal call of the kernel over every key
     (``BlindRows``: query lengths = the prefix, uniform or exact as above) and adds it to the first, whose
     rows there are 0. A fill added by several terms instead gets the device-side check that key 0 is valid;
   - a window, blocks, HSTU or query padding with a finite fill: refused (rows that see no key are common
     there), with the reason; -inf or a bool mask is rewritten.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from gemcompile.lowering.common.reference import compute_dtype
from gemcompile.passes.attention.family import size_of
from gemcompile.passes.attention.mha import mha_arguments
from gemcompile.passes.attention.scores import ADD, SUB, is_call
from gemcompile.passes.graph import Emitter, Unproven, example_value
from gemcompile.passes.masks.model import AttentionMask

SAFE_FILL = -1.0e30
"""A fill this negative cannot reach the scores' range: no magnitude check (finfo.min of fp32 and bf16)."""

EXACT_SPACING = 2.0 ** -4
"""Up to this spacing of an added fill F in the dtype of the addition (fp32: |F| < 2**20, HF Funnel's 1e6
included), a row with no valid key is served as softmax(s), the exact row: eager's own rounding of s + F
moves each of its scores by at most spacing / 2 (3% in exp at the limit; such rows are rarely used). Above it
(fp32 -1e7, fp16 or bf16 -1e4) eager's row is softmax of s on a coarse grid; the rewrite serves it as uniform
where that grid rounds s away (checked on the device per sample) and stops with a message where it does not."""

_UNDERFLOW_MARGIN = 120.0
"""exp(x) is exactly 0 in fp32 for x < -104; 120 leaves room for the rounding of the scores."""


def check_fill_served(mask: AttentionMask) -> None:
    """Unproven when a finite fill comes with a mask whose rows often see no valid key."""
    if mask.fill is None:
        return
    # query padding read from data with a fill written over the scores is served: such a row is uniform over
    # every key in eager, and the jagged family gives it the mean of v (uniform_dropped_rows)
    data_rows = mask.query_vector is not None and not mask.fill_replaces
    what = ("a sliding window" if mask.window is not None else "blocks" if mask.block is not None
            else "HSTU's target mask" if mask.hstu else "query padding" if mask.q_lengths is not None
            else "query padding read from data (or left padding)" if data_rows else None)
    if what is not None:
        raise Unproven(f"a finite fill ({mask.fill:g}) with {what}: rows that see no valid key average the padding "
                       "in eager and are 0 in the kernel (fill with -inf or use a bool mask)")


@dataclass(frozen=True)
class BlindRows:
    """A causal mask's rows that see no valid key, computed in a second kernel call over every key and
    added to the first call's output (which is 0 on them): the first ``rows[b]`` queries of sample b."""

    rows: fx.Node
    """(B,) int: how many leading queries of each sample see no valid key (the sample's queries when none)."""
    q: fx.Node
    k: fx.Node
    bias: fx.Node | None
    """q, k and the bias for that call (detached where eager's fill passes them no gradient)."""
    uniform_keys: fx.Node | None
    """The call's uniform_keys: every sample when eager's s + F rounds to F, else None (softmax of s)."""


def uniform_dropped_rows(emit: Emitter, mask: AttentionMask, q: fx.Node, k: fx.Node, v: fx.Node, scale: float,
                         dropout: dict) -> fx.Node | None:
    """What the rows a query vector drops hold in eager under a fill written over the scores: every score of
    such a row is F, so it is uniform over every key, the mean of v ((B, H, 1, D)), and no gradient reaches
    q or k; None for any other mask (those rows are 0, the kernels' rule). With dropout (the op's keywords)
    eager drops those uniform weights too: a second kernel call over every key with every score taken as 0
    (uniform_keys) and the same draws, q and k detached ((B, H, L, D))."""
    if mask.query_vector is None or mask.fill is None or not mask.fill_replaces:
        return None
    if not dropout:
        return emit.call(torch.mean, (v, 2), {"keepdim": True})
    value = example_value(k)
    every = emit.call(torch.ones, ((size_of(emit, k, 0),),), {"dtype": torch.bool, "device": value.device})
    q, k = (emit.call(torch.Tensor.detach, (x,)) for x in (q, k))
    return emit.call(torch.ops.gemcompile.jagged_attention.default, (q, k, v, None, None, None, False, scale),
                     {"uniform_keys": every, **dropout})


def keep_fill_exact(emit: Emitter, mask: AttentionMask, scale: float, q: fx.Node, k: fx.Node,
                    kv_len: fx.Node | None, kv_mask: fx.Node | None, bias: fx.Node | None,
                    blind_rows_zero: bool = False):
    """(q, k, kv_len, kv_mask, uniform_keys, blind, bias) for the kernel such that the finite fill's rows
    match eager (module doc); uniform_keys is None or the (B,) bool of sequences whose scores the fill rounds
    away; blind is None or the BlindRows of a causal mask; bias is detached in the sequences whose every score
    the fill replaces (eager passes it no gradient there). ``blind_rows_zero``: the model masks the weights
    again after the softmax (AttentionSite.zero_blind_rows), so rows with no valid key are 0 in eager.
    The caller has checked that the fill is served (``check_fill_served``)."""
    fill = mask.fill
    bound = _score_bound(emit, scale, q, k, bias) if fill > SAFE_FILL else None  # no score reaches -1e30
    scores = (scale, q, k, bias) if bound is not None else None
    if bound is not None:
        ok = emit.call(operator.le, (emit.call(operator.mul, (bound, 2.0)), -fill - _UNDERFLOW_MARGIN))
        emit.call(torch._assert_async, (ok, f"gemcompile: attention scores can reach the mask's fill ({fill:g}), "
                                            "so eager does not drop the masked keys and the kernel would; fill "
                                            "with -inf or a bool mask, or scale the scores"))
    if blind_rows_zero:  # the model zeroes the dropped weights again after the softmax: such rows are 0
        return q, k, kv_len, kv_mask, None, None, bias
    if kv_len is None and kv_mask is None:
        return q, k, kv_len, kv_mask, None, None, bias  # no key padding: every row sees a key (causal: key 0)
    if mask.causal and mask.fill_stacked:  # eager's blind rows attend to the keys fewest terms drop
        first = emit.call(torch.all, (_first_key_valid(emit, kv_len, kv_mask),))
        message = (f"gemcompile: a sequence whose first key is padding under a causal mask that adds its "
                   f"fill ({fill:g}) in several terms: eager attends to the keys the fewest terms drop in its"
                   " first rows, the kernel cannot (fill with -inf, use a bool mask or add one mask)")
        emit.call(torch._assert_async, (first, message))
        return q, k, kv_len, kv_mask, None, None, bias
    if mask.causal:
        return q, k, kv_len, kv_mask, None, _blind_rows(emit, mask, q, k, kv_len, kv_mask, scores, bias), bias
    empty = no_valid_key(emit, kv_len, kv_mask)
    if mask.fill_stacked:  # eager's row attends to the keys fewest terms drop: no kernel computes that
        none_empty = emit.call(torch.logical_not, (emit.call(torch.any, (empty,)),))
        message = (f"gemcompile: a sequence with no valid key under a mask that adds its fill ({fill:g}) "
                   "in several terms: eager attends to the keys the fewest terms drop, the kernel cannot "
                   "(fill with -inf, use a bool mask or add one mask)")
        emit.call(torch._assert_async, (none_empty, message))
        return q, k, kv_len, kv_mask, None, None, bias
    keys = size_of(emit, k, 2)  # a size node under dynamic shapes (a raw SymInt argument warns in FX)
    if kv_len is not None:
        kv_len = emit.call(torch.where, (empty, keys, kv_len))
    if kv_mask is not None:
        kv_mask = emit.call(torch.logical_or, (kv_mask, emit.call(torch.unsqueeze, (empty, 1))))
    if mask.fill_replaces:  # every score of the sequence is F itself: uniform, whatever F is
        q, k = (_detached_where(emit, empty, x) for x in (q, k))
        if bias is not None and example_value(bias).requires_grad:  # (expanded to the batch: B H L L)
            bias = _detached_where(emit, empty, bias)
        return q, k, kv_len, kv_mask, empty, None, bias
    if spacing(fill, mask.fill_dtype) <= EXACT_SPACING:
        return q, k, kv_len, kv_mask, None, None, bias
    _check_rounded_away(emit, fill, mask.fill_dtype, scores, empty)
    return q, k, kv_len, kv_mask, empty, None, bias


def _check_rounded_away(emit: Emitter, fill: float, dtype: torch.dtype, scores, blind: fx.Node) -> None:
    """A device-side check that eager's s + fill rounds to the fill wherever ``blind`` ((B,) bool or counts)
    says a sample has rows that see no valid key: a bound on that sample's own scores (every position, as
    such a row reads every key) below half the fill's ulp; no check when no score can reach (scores None)."""
    if scores is None:
        return
    bound = _score_bound(emit, *scores, per_sample=True)  # (B,) or (1,) for queries shared by the batch
    rounded_away = emit.call(operator.lt, (bound, spacing(fill, dtype) / 2))
    seeing = emit.call(operator.eq, (blind, 0))  # no blind row in the sample: nothing to check there
    ok = emit.call(torch.all, (emit.call(torch.logical_or, (rounded_away, seeing)),))
    emit.call(torch._assert_async, (ok, f"gemcompile: a sequence with no valid key under a fill of {fill:g}, with "
                                        "scores large enough that eager's s + fill does not round to the fill: "
                                        "its eager value depends on that rounding; fill with -inf or finfo.min"))


def _blind_rows(emit: Emitter, mask: AttentionMask, q: fx.Node, k: fx.Node, kv_len, kv_mask,
                scores, bias: fx.Node | None) -> BlindRows:
    """The BlindRows of a causal mask with one finite fill (module doc)."""
    keys = size_of(emit, k, 2)
    valid = _valid_keys(emit, kv_len, kv_mask, keys, example_value(k).device)
    leading = emit.call(torch.sum, (emit.call(operator.eq, (emit.call(torch.cumsum, (valid, -1)), 0)), -1))
    empty = emit.call(operator.eq, (leading, keys))
    rows = emit.call(torch.where, (empty, size_of(emit, q, 2), leading))  # every query of an empty one
    everyone = emit.call(torch.ones_like, (rows,), {"dtype": torch.bool})
    if mask.fill_replaces:  # every score of such a row is F itself: uniform, no gradient to q and k
        detached = [None if x is None else emit.call(torch.Tensor.detach, (x,)) for x in (q, k, bias)]
        return BlindRows(rows, detached[0], detached[1], detached[2], everyone)
    if spacing(mask.fill, mask.fill_dtype) <= EXACT_SPACING:
        return BlindRows(rows, q, k, bias, None)
    _check_rounded_away(emit, mask.fill, mask.fill_dtype, scores, rows)
    return BlindRows(rows, q, k, bias, everyone)


def _valid_keys(emit: Emitter, kv_len, kv_mask, keys, device) -> fx.Node:
    """(B, Lk) bool: the keys the kernel sees as valid (inside their length and their data mask)."""
    valid = kv_mask
    if kv_len is not None:  # keys past the length are padding too
        positions = emit.call(torch.arange, (keys,), {"device": device})
        inside = emit.call(operator.lt, (emit.call(torch.unsqueeze, (positions, 0)),
                                         emit.call(torch.unsqueeze, (kv_len, 1))))
        valid = inside if valid is None else emit.call(torch.logical_and, (valid, inside))
    return valid


def _detached_where(emit: Emitter, empty: fx.Node, x: fx.Node) -> fx.Node:
    """x with no gradient in the sequences ``empty`` flags ((B,) bool; x (B, H, L, D))."""
    flags = emit.call(torch.reshape, (empty, (-1, 1, 1, 1)))
    return emit.call(torch.where, (flags, emit.call(torch.Tensor.detach, (x,)), x))


def spacing(x: float, dtype: torch.dtype) -> float:
    """The spacing of ``dtype``'s numbers at x: s + x rounds to x in that dtype when |s| < spacing / 2."""
    return 2.0 ** math.floor(math.log2(abs(x))) * torch.finfo(dtype).eps


def no_valid_key(emit: Emitter, kv_len, kv_mask) -> fx.Node:
    """(B,) bool: the sequences where the kernel would see no valid key."""
    if kv_mask is None:
        return None if kv_len is None else emit.call(operator.eq, (kv_len, 0))
    value = example_value(kv_mask)
    valid = _valid_keys(emit, kv_len, kv_mask, value.shape[1], value.device)
    return emit.call(torch.logical_not, (emit.call(torch.any, (valid, -1)),))


def _first_key_valid(emit: Emitter, kv_len, kv_mask) -> fx.Node:
    ok = None
    if kv_len is not None:
        ok = emit.call(operator.ge, (kv_len, 1))
    if kv_mask is not None:
        first = emit.call(operator.getitem, (kv_mask, (slice(None), 0)))
        ok = first if ok is None else emit.call(torch.logical_and, (ok, first))
    return ok


def _score_bound(emit: Emitter, scale: float, q: fx.Node, k: fx.Node, bias,
                 per_sample: bool = False) -> fx.Node:
    """A 0-d bound (fp32; fp64 for fp64 inputs) on every |score|: scale * max|q_i| * max|k_j| (+ max|bias|), by Cauchy-Schwarz;
    ``per_sample``: one per sample, (B,) (q and k are (B|1, H, L, D))."""
    def max_norm(x: fx.Node) -> fx.Node:
        dtype = compute_dtype(example_value(x).dtype)  # float32 for half inputs; float64 stays (no narrowing)
        norms = emit.call(torch.linalg.vector_norm, (x,), {"dim": -1, "dtype": dtype})
        return emit.call(torch.amax, (norms, (1, 2))) if per_sample else emit.call(torch.amax, (norms,))

    bound = emit.call(operator.mul, (emit.call(operator.mul, (max_norm(q), max_norm(k))), abs(scale)))
    if bias is not None:
        biggest = emit.call(torch.amax, (emit.call(torch.abs, (bias,)),))
        bound = emit.call(operator.add, (bound, emit.call(torch.Tensor.float, (biggest,))))
    return bound


def fill_dtype(site) -> torch.dtype:
    """The dtype eager adds an additive fill to the scores in: the coarsest of a hand-written softmax's score
    additions; SDPA's (and nn.MultiheadAttention's without weights) internal fp32; the query's dtype where
    nn.MultiheadAttention computes the weights (need_weights, its default: baddbmm(mask, q, k^T))."""
    if site.kind == "softmax":
        adds = [example_value(n).dtype for n in site.matched
                if is_call(n, *ADD, *SUB, "baddbmm")
                and isinstance(example_value(n), torch.Tensor) and example_value(n).is_floating_point()]
        dtypes = adds or [example_value(site.anchor.args[0]).dtype]
        return max(dtypes, key=lambda d: torch.finfo(d).eps)
    if site.kind == "mha":
        if mha_arguments(site.anchor).get("need_weights", True):
            return example_value(site.q).dtype
    return torch.float32
