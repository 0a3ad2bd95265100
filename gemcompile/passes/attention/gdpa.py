"""The GDPA family: padded pointwise-activation attention -> gemcompile::gdpa.

Serves each activation that sits between ``q @ k^T`` and ``@ v`` (attention/match.py; for identity
attention, the first mask op on the raw scores) whose mask is proven (masks/) to be key padding, query
padding, causal, a local window, HSTU's target/contextual visibility, or none, with the normalizer a
constant or the key lengths per sample. Query rows are skipped when the mask says so or when the model
zeroes them in the attention's output downstream (what GEM-ref's PFFN cross-attention does; the proof the
jagged and block families share, attention/family.py ``fold_query_rows``, masks/rows.py); otherwise every
query row is computed, as in eager.

Semantics (exact up to rounding at every position the model uses): pairs the mask drops contribute
nothing; rows without a valid pair, and skipped query rows, come out as 0.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from gemcompile.passes.attention.family import (
    AttentionFamily,
    check_lengths_device,
    check_qkv,
    fold_query_rows,
    key_mask_operand,
    lengths_operand,
    size_of,
    summed_bias,
)
from gemcompile.passes.attention.finite_fill import no_valid_key
from gemcompile.passes.attention.kernels import GDPA_NO_WINDOW, HEAD_DIMS
from gemcompile.passes.attention.match import AttentionSite
from gemcompile.passes.graph import Emitter, Unproven, example_value, target_name
from gemcompile.passes.masks.model import AttentionMask

_LENGTH_VIEWS = ("view", "reshape", "unsqueeze", "to", "float", "double", "half", "bfloat16", "type_as",
                 "getitem", "expand", "expand_as", "contiguous")


class Gdpa(AttentionFamily):
    """Provable padded pointwise attention -> gemcompile::gdpa."""

    name = "gdpa"
    config_section = "gdpa"
    masks_served = ("a combination of key padding, query padding, causal and a local window over lengths, nor "
                    "HSTU's target/contextual mask")

    def accept(self, site: AttentionSite, mask: AttentionMask) -> None:
        if mask.block is not None:
            raise Unproven(f"the mask is not {self.masks_served}: it is {mask.formula}")

    @staticmethod
    def _normalizer(site: AttentionSite, mask: AttentionMask) -> tuple[str, bool]:
        """(how explain names the tensor the activated scores are divided by, '' without one; whether it is
        the key lengths). A divisor
        constant along the keys (its key dim 1: per sample, head or query row) divides the output of the
        sum over keys exactly as it divides each term, so the model's own divisor is applied to the op's
        output (emit)."""
        if site.divisor is None:
            return "", False
        node = site.divisor
        while node.op in ("call_function", "call_method") and (
            (node.target is operator.getitem) or target_name(node) in _LENGTH_VIEWS
        ):
            node = node.args[0]
        value = example_value(site.divisor)
        shape = value.shape if isinstance(value, torch.Tensor) else ()  # a size (the padded length, dynamic)
        if len(shape) > 4 or (len(shape) and shape[-1] != 1):
            raise Unproven(f"the activated scores are divided by {site.divisor.name}, which varies along the "
                           "keys")
        if mask.kv_lengths is not None and node is mask.kv_lengths and mask.kv_offset == 0:
            return "the key lengths", True
        return site.divisor.name, False

    @staticmethod
    def _divisor(emit: Emitter, site: AttentionSite, kv_len, kv_mask, by_key_lengths: bool):
        """What the op's output is divided by: the model's divisor, with 1 where it is 0 and eager's mask,
        written over the divided scores, gives 0 (``site.divided_then_replaced``: a sample with no valid
        key). A divisor that is not the key lengths and holds a 0 where the sample has keys (eager: x / 0
        term by term, not sum / 0) stops the run with a device-side check."""
        divisor = site.divisor
        if not isinstance(example_value(divisor), torch.Tensor):  # a size: the padded length, dynamic
            return divisor
        if by_key_lengths and not site.divided_then_replaced:
            return divisor  # eager's 0 / 0 = NaN on a sample with no key, kept
        zero = emit.call(operator.eq, (divisor, 0))
        if not by_key_lengths:
            bad = zero
            empty = no_valid_key(emit, kv_len, kv_mask)
            if site.divided_then_replaced and empty is not None:  # a 0 is eager's 0 there
                ndim = example_value(divisor).dim()
                empty = emit.call(torch.reshape, (empty, (-1,) + (1,) * (ndim - 1))) if ndim else empty
                bad = emit.call(torch.logical_and, (zero, emit.call(torch.logical_not, (empty,))))
            ok = emit.call(torch.logical_not, (emit.call(torch.any, (bad,)),))
            message = f"gemcompile: the attention's normalizer {divisor.name} holds a 0"
            emit.call(torch._assert_async, (ok, message))
        if not site.divided_then_replaced:
            return divisor  # eager's NaN (0 / 0, or x / 0 times 0) on such a sample, kept
        return emit.call(torch.where, (zero, emit.call(torch.ones_like, (divisor,)), divisor))

    @staticmethod
    def _downstream_rows(site: AttentionSite, mask: AttentionMask) -> tuple[AttentionMask, str]:
        """The mask with the query rows the model zeroes after the attention skipped, when that is proven
        (attention/family.py, masks/rows.py; else the mask as is: every row is computed, exactly as in eager),
        and its description."""
        if mask.rows_dropped_after:  # the mask equals the model's on rows i < kv_lengths only
            why = ("the mask has no key-padding term, so eager attends on rows past the length too; rewritten "
                   "only when the model drops those rows after the attention")
            folded, note = fold_query_rows(site, mask, within=(mask.kv_lengths, 0), why=why)
            return folded, f"{mask.describe()}; {note}"
        if mask.q_lengths is not None:
            return mask, mask.describe()
        folded, note = fold_query_rows(site, mask)
        return folded, mask.describe() + (f"; {note}" if note else "")

    def emit(self, emit: Emitter, site: AttentionSite, mask: AttentionMask, q: fx.Node, k: fx.Node,
             v: fx.Node) -> tuple[fx.Node, str]:
        qv, kv = example_value(q), example_value(k)
        check_qkv(qv, kv, example_value(v), HEAD_DIMS)
        normalizer, by_key_lengths = self._normalizer(site, mask)
        mask, detail = self._downstream_rows(site, mask)
        check_lengths_device(q, mask.kv_lengths, mask.q_lengths, mask.num_targets)
        kv_len = lengths_operand(emit, mask.kv_lengths, mask.kv_offset, k)
        q_len = lengths_operand(emit, mask.q_lengths, mask.q_offset, q)
        bias = summed_bias(emit, site.bias)
        window = GDPA_NO_WINDOW if mask.window is None else mask.window
        # The normalizer is applied to the output by the model's own divisor tensor: the op's
        # divide_by_kv_length divides by the clamped length, eager by the raw one (a history longer than the
        # padded length is common in recommendation data), and the key lengths' 0 / 0 stays eager's NaN.
        args = (q, k, v, q_len, kv_len, bias, site.activation, float(site.scale), float(site.out_scale),
                False, mask.causal, int(window))
        if mask.hstu:
            if qv.shape[0] != kv.shape[0] or qv.shape[2] != kv.shape[2]:
                raise Unproven("HSTU's target/contextual mask needs self-attention (q and k of one shape)")
            args += (_targets_operand(emit, mask, kv_len, k), int(mask.contextual_len))
        kv_mask = key_mask_operand(emit, mask, k)
        if kv_mask is not None and mask.hstu:
            raise Unproven("HSTU's target/contextual mask with key padding read from data (the kernel takes "
                           "lengths there)")
        out = emit.call(torch.ops.gemcompile.gdpa.default, args, {} if kv_mask is None else {"kv_mask": kv_mask})
        if normalizer:
            divisor = self._divisor(emit, site, kv_len, kv_mask, by_key_lengths)
            out = emit.call(operator.truediv, (out, divisor))
        return out, (f"{site.activation}; mask proven: {detail}"
                     + (f"; normalized by {normalizer}" if normalizer else ""))


def _targets_operand(emit: Emitter, mask: AttentionMask, kv_len: fx.Node | None, k: fx.Node) -> fx.Node | None:
    """num_targets as the op takes them (None without targets: a contextual prefix alone). The mask's
    target rows start at n - num_targets with n the lengths as given; the op counts from its lengths clamped
    to the padded L, so a history longer than L (lengths kept raw) shifts the count by n - min(n, L). Then
    clamped to [0, the op's length]: the mask keeps the same keys for any value (more targets than a
    sequence holds make each of its rows a target, as num_targets = length does; fewer than 0 none, as 0
    does). Computed in int64 (int8/int16/uint8 counts widened exactly)."""
    if mask.num_targets is None:
        return None
    targets = emit.method("to", (mask.num_targets, torch.int64))
    if kv_len is None:
        return emit.call(torch.clamp, (targets, 0, size_of(emit, k, 2)))
    beyond = emit.call(operator.sub, (emit.method("to", (mask.kv_lengths, torch.int64)), kv_len))
    targets = emit.call(operator.sub, (targets, beyond))
    return emit.call(torch.minimum, (emit.call(torch.clamp, (targets, 0)), kv_len))
