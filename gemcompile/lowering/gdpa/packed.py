"""GDPA with packed queries (``token_offsets``): the argument checks and the reference.

q (T, H, D) and the output (T, H, D) hold the valid query rows back to back (common/packed.py defines the
layout); k, v stay (B, H, Lk, D). GEM-ref's cross-attention: long queries from the sequence over a few
summary keys. ``packed_len`` N is the sequences' padded length: query positions n = row -
token_offsets[b] lie in [0, N) and every position rule reads them (causal, window, a dense bias (B|1, H|1,
N|1, Lk|1), a relative table, the bias gradient), so the result equals the padded op on (B, H, N, D)
queries restricted to the valid rows. q_lengths may be None or the offsets' token counts (checked on CPU).
kv_lengths, kv_mask, divide_by_kv_length and every activation work as in the padded op. Refused
(ValueError): HSTU's num_targets and contextual_len (their self-attention on clamped ids reads q and k as
one sequence layout) and shared queries (a packed q belongs to its sequences).
"""

from __future__ import annotations

from ..common.packed import (
    check_packed_len,
    check_packed_operand,
    check_token_offsets,
    check_token_offsets_values,
    offsets_batch,
    pack_padded,
    packed_lengths,
    pad_packed,
    padded_stand_in,
)
from .reference import reference_gdpa_backward, reference_gdpa_forward

__all__ = ["check_packed_values", "packed_reference_backward", "packed_reference_forward", "padded_query"]


def padded_query(q, k, token_offsets, packed_len, num_targets=None, contextual_len=0):
    """q as the padded checks should see it: q itself without ``token_offsets``, else a (B, H, packed_len, D)
    stand-in (no memory); ValueError naming the argument on an inconsistent packed layout."""
    check_packed_len(packed_len)
    if token_offsets is None:
        if not (isinstance(packed_len, int) and packed_len == 0):
            raise ValueError("packed_len is given without token_offsets (it is the padded length of packed q)")
        return q
    check_packed_operand("q", q)
    B = offsets_batch(token_offsets)
    if getattr(k, "dim", lambda: 0)() == 4 and k.shape[0] != B:
        raise ValueError(f"token_offsets must have B + 1 = {k.shape[0] + 1} entries (B: k's batch), got "
                         f"{token_offsets.shape[0]}")
    check_token_offsets(token_offsets, B, q.device, packed_len)
    if num_targets is not None or not (isinstance(contextual_len, int) and contextual_len == 0):
        raise ValueError("token_offsets (packed q) is not served with num_targets or contextual_len > 0")
    return padded_stand_in(q, B, packed_len)


def check_packed_values(q, q_lengths, token_offsets, packed_len) -> None:
    """The offsets' values and q_lengths against them (CPU; CUDA under strict checks)."""
    if token_offsets is not None:
        check_token_offsets_values(token_offsets, q.shape[0], int(packed_len), (("q_lengths", q_lengths),))


def packed_reference_forward(q, k, v, q_lengths, kv_lengths, bias, spec, num_targets=None, kv_mask=None, *,
                             token_offsets=None, packed_len=0):
    """reference_gdpa_forward on padded queries; packed q gives the packed output (T, H, D)."""
    if token_offsets is None:
        return reference_gdpa_forward(q, k, v, q_lengths, kv_lengths, bias, spec, num_targets, kv_mask)
    N = int(packed_len)
    out = reference_gdpa_forward(pad_packed(q, token_offsets, N), k, v, packed_lengths(token_offsets), kv_lengths,
                                 bias, spec, num_targets, kv_mask)
    return pack_padded(out, token_offsets, q.shape[0])


def packed_reference_backward(grad_out, q, k, v, q_lengths, kv_lengths, bias, spec, num_targets=None,
                              bias_requires_grad=False, kv_mask=None, *, token_offsets=None, packed_len=0):
    """reference_gdpa_backward on padded queries; dq comes back packed."""
    if token_offsets is None:
        return reference_gdpa_backward(grad_out, q, k, v, q_lengths, kv_lengths, bias, spec, num_targets,
                                       bias_requires_grad, kv_mask)
    N = int(packed_len)
    dq, dk, dv, dbias = reference_gdpa_backward(pad_packed(grad_out, token_offsets, N),
                                                pad_packed(q, token_offsets, N), k, v, packed_lengths(token_offsets),
                                                kv_lengths, bias, spec, num_targets, bias_requires_grad, kv_mask)
    return pack_padded(dq, token_offsets, q.shape[0]), dk, dv, dbias
