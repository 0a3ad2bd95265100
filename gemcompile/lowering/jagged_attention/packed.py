"""Jagged attention with packed keys and values (``token_offsets``): the argument checks and the reference.

Layouts (common/packed.py defines the packed layout):

* keys packed: k, v (T, H, D); q (Bq, H, Lq, D) dense, Bq in {1, B} (PMA: learned queries over the packed
  sequence), B = token_offsets.shape[0] - 1. Output (B, H, Lq, D), lse (B, H, Lq).
* self-attention packed: q, k, v (T, H, D) over the same sequences (causal or not). Output (T, H, D),
  lse (T, H).

A packed query side without packed keys is refused. The packed side's lengths are the offsets' token counts;
``kv_lengths`` (and ``q_lengths`` when q is packed) may be None or those lengths (checked on CPU). Positions
are n = row - token_offsets[b] in [0, packed_len): kv_mask (B, packed_len), the bias's key (and, packed q,
query) dims and the causal rule read positions, exactly as the padded op on (B, H, packed_len, D) tensors.
"""

from __future__ import annotations

from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..common.packed import (
    check_packed_operand,
    check_packed_len,
    check_token_offsets,
    check_token_offsets_values,
    offsets_batch,
    pack_padded,
    packed_lengths,
    pad_packed,
    padded_stand_in,
)
from .reference import reference_backward, reference_forward

__all__ = ["check_packed_values", "packed_reference_backward", "packed_reference_forward", "padded_views"]


def padded_views(q, k, v, token_offsets, packed_len):
    """(q, k, v) as the padded checks should see them: the tensors themselves without ``token_offsets``,
    else (B, H, packed_len, D) stand-ins for the packed ones (no memory); ValueError naming the argument on
    an inconsistent packed layout."""
    check_packed_len(packed_len)
    if token_offsets is None:
        if not (isinstance(packed_len, int) and packed_len == 0):
            raise ValueError("packed_len is given without token_offsets (it is the padded length of packed k, v)")
        return q, k, v
    check_packed_operand("k", k)
    check_packed_operand("v", v)
    # T may be a data-dependent size (the unpad pass's): refuse only what is known to differ
    if any(statically_known_true(a != b) for a, b in zip(v.shape, k.shape)):
        raise ValueError(f"packed k and v must have one shape (T, H, D), got k {tuple(k.shape)}, v {tuple(v.shape)}")
    B = offsets_batch(token_offsets)
    check_token_offsets(token_offsets, B, getattr(q, "device", k.device), packed_len)
    if getattr(q, "dim", lambda: 0)() == 4 and q.shape[0] not in (1, B):
        raise ValueError(f"token_offsets has B + 1 = {B + 1} entries but q's batch is {q.shape[0]} (1 or B)")
    if getattr(q, "dim", lambda: 4)() == 3:
        if statically_known_true(q.shape[0] != k.shape[0]):
            raise ValueError(f"packed q must hold the tokens of packed k (self-attention): q has {q.shape[0]} rows, "
                             f"k {k.shape[0]}")
        q = padded_stand_in(q, B, packed_len)
    return q, padded_stand_in(k, B, packed_len), padded_stand_in(v, B, packed_len)


def check_packed_values(q, k, q_lengths, kv_lengths, token_offsets, packed_len) -> None:
    """The offsets' values, and the packed side's lengths against them (CPU; CUDA under strict checks)."""
    if token_offsets is None:
        return
    lengths = [("kv_lengths", kv_lengths)] + ([("q_lengths", q_lengths)] if q.dim() == 3 else [])
    check_token_offsets_values(token_offsets, k.shape[0], int(packed_len), tuple(lengths))


def packed_reference_forward(q, k, v, q_lengths, kv_lengths, bias, causal, scale, kv_mask=None, uniform_keys=None,
                             dropout_p=0.0, dropout_seed=None, *, token_offsets=None, packed_len=0):
    """reference_forward on the padded tensors; packed q gives packed out (T, H, D) and lse (T, H)."""
    if token_offsets is None:
        return reference_forward(q, k, v, q_lengths, kv_lengths, bias, causal, scale, kv_mask, uniform_keys,
                                 dropout_p, dropout_seed)
    N, counts = int(packed_len), packed_lengths(token_offsets)
    q_packed = q.dim() == 3
    if q_packed:
        q, q_lengths = pad_packed(q, token_offsets, N), counts
    out, lse = reference_forward(q, pad_packed(k, token_offsets, N), pad_packed(v, token_offsets, N), q_lengths,
                                 counts, bias, causal, scale, kv_mask, uniform_keys, dropout_p, dropout_seed)
    if q_packed:
        T = k.shape[0]
        out, lse = pack_padded(out, token_offsets, T), pack_padded(lse, token_offsets, T)
    return out, lse


def packed_reference_backward(grad_out, q, k, v, out, lse, q_lengths, kv_lengths, bias, causal, scale,
                              bias_requires_grad, kv_mask=None, uniform_keys=None, dropout_p=0.0,
                              dropout_seed=None, grad_lse=None, *, token_offsets=None, packed_len=0):
    """reference_backward on the padded tensors; gradients of packed operands come back packed."""
    if token_offsets is None:
        return reference_backward(grad_out, q, k, v, out, lse, q_lengths, kv_lengths, bias, causal, scale,
                                  bias_requires_grad, kv_mask, uniform_keys, dropout_p, dropout_seed, grad_lse)
    N, counts, T = int(packed_len), packed_lengths(token_offsets), k.shape[0]
    q_packed = q.dim() == 3
    if q_packed:
        q, grad_out, out, lse = (pad_packed(t, token_offsets, N) for t in (q, grad_out, out, lse))
        grad_lse = None if grad_lse is None else pad_packed(grad_lse, token_offsets, N)
        q_lengths = counts
    dq, dk, dv, dbias = reference_backward(grad_out, q, pad_packed(k, token_offsets, N),
                                           pad_packed(v, token_offsets, N), out, lse, q_lengths, counts, bias,
                                           causal, scale, bias_requires_grad, kv_mask, uniform_keys, dropout_p,
                                           dropout_seed, grad_lse)
    if q_packed:
        dq = pack_padded(dq, token_offsets, T)
    return dq, pack_padded(dk, token_offsets, T), pack_padded(dv, token_offsets, T), dbias
