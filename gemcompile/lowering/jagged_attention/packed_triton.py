"""Launchers of jagged attention with packed keys/values (``token_offsets``; packed.py has the layouts).

The kernels of triton.py already address a side through MODE_OFFSETS (common/attention_triton.sequence):
program b reads start = token_offsets[b] and its base is ``ptr + start * stride_row + h * stride_h`` with
batch stride 0, and packed rows are stored only below the sequence's length (the next sequence's rows are
never touched). So the packed layout is a choice of Side and strides here, the kernels are unchanged and
the padded path compiles to the same code. A (T, H * D) Linear output viewed as (T, H, D) is read in place.

Packed outputs and gradients are allocated empty: the kernels write every row of every sequence (a key tile
a kv_mask skips stores zeros), and ``fill_slack_rows`` gives the rows outside every sequence (before
token_offsets[0], and a bucketed token index's sentinel rows from token_offsets[B]) 0 (lse +inf). Zeroed
allocations memset every row each call (GEM-ref medium: ~1 ms a step of bf16 fills).
"""

from __future__ import annotations

import torch

from ..common.attention_triton import MODE_FULL, MODE_LENGTHS, MODE_OFFSETS, Side, bhld_strides, mask_key_bounds
from ..common.packed import packed_lengths
from ..common.slack_rows_triton import fill_slack_rows
from . import triton as padded

__all__ = ["jagged_attention_backward_triton", "jagged_attention_forward_triton"]


def _rows_strides(t: torch.Tensor) -> tuple:
    """(b, h, row, d) strides of a packed (T, H, D) tensor: batch stride 0 (rows are found by offsets)."""
    return 0, t.stride(1), t.stride(0), t.stride(2)


def _lse_strides(lse: torch.Tensor, q_packed: bool) -> tuple:
    return (0, lse.stride(1), lse.stride(0)) if q_packed else lse.stride()


def _sides(q, k, q_lengths, token_offsets, packed_len: int, q_order, kv_order, dummy):
    """(q side, kv side): the keys by offsets, in ``kv_order`` when given (the kv lengths' order, which the
    op checks against the offsets; None with a kv_mask, whose order is its key span's); q the same sequences
    when packed (one Side: both loops share the order), else dense by its lengths."""
    kv_side = Side(MODE_OFFSETS, token_offsets, None, packed_len, k.shape[0], dummy, kv_order)
    if q.dim() == 3:
        return kv_side, kv_side
    Lq = q.shape[2]
    mode = MODE_FULL if q_lengths is None else MODE_LENGTHS
    return Side(mode, None, q_lengths, Lq, Lq, dummy, q_order), kv_side


def _key_mask_bounds(kv_mask, kv_lengths, token_offsets, kv_bounds):
    """The key bounds of kv_mask limited by the packed lengths (the given ones when the graph has them)."""
    if kv_mask is None or kv_bounds is not None:
        return kv_bounds
    lengths = kv_lengths if kv_lengths is not None else packed_lengths(token_offsets)
    return mask_key_bounds(kv_mask, lengths)


def jagged_attention_forward_triton(q, k, v, q_lengths, kv_lengths, bias, causal: bool, scale: float,
                                    kv_mask=None, uniform_keys=None, dropout_p=0.0, dropout_seed=None, *,
                                    q_order=None, kv_order=None, kv_bounds=None, token_offsets=None, packed_len=0):
    """triton.py's forward; with token_offsets, packed k, v (T, H, D) (and q: self-attention) -> (out, lse):
    (B, H, Lq, D) and (B, H, Lq) for dense q, (T, H, D) and (T, H) for packed q."""
    if token_offsets is None:
        return padded.jagged_attention_forward_triton(q, k, v, q_lengths, kv_lengths, bias, causal, scale, kv_mask,
                                                      uniform_keys, dropout_p, dropout_seed, q_order=q_order,
                                                      kv_order=kv_order, kv_bounds=kv_bounds)
    B, N = token_offsets.shape[0] - 1, int(packed_len)
    T, H, D = k.shape
    q_packed = q.dim() == 3
    Lq = N if q_packed else q.shape[2]
    out_shape = (T, H, D) if q_packed else (B, H, Lq, D)
    if B * H * Lq * N * T == 0 or D == 0:  # no pair: zeros, lse +inf
        return (torch.zeros(out_shape, dtype=q.dtype, device=q.device),
                torch.full(out_shape[:-1], float("inf"), dtype=torch.float32, device=q.device))
    out = torch.empty(out_shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(out_shape[:-1], dtype=torch.float32, device=q.device)
    if q_packed:
        q_strides = _rows_strides(q)
        fill_slack_rows(token_offsets, (out, 0.0), (lse, float("inf")))
    else:  # dense queries: every row written, as in the padded launcher
        q_strides = bhld_strides(q, q.shape[0] != B)
    q_side, kv_side = _sides(q, k, q_lengths, token_offsets, N, q_order,
                             kv_order if kv_mask is None else None, lse)
    o_strides = _rows_strides(out) if q_packed else out.stride()
    padded._forward(q, k, v, bias, q_side, kv_side, B, H, D, causal, scale, q_strides, _rows_strides(k),
                    _rows_strides(v), out, o_strides, lse, _lse_strides(lse, q_packed), kv_mask, uniform_keys,
                    kv_order if kv_mask is not None else None,
                    _key_mask_bounds(kv_mask, kv_lengths, token_offsets, kv_bounds), dropout_p, dropout_seed)
    return out, lse


def jagged_attention_backward_triton(grad_out, q, k, v, out, lse, q_lengths, kv_lengths, bias, causal: bool,
                                     scale: float, bias_requires_grad: bool, kv_mask=None, uniform_keys=None,
                                     dropout_p=0.0, dropout_seed=None, grad_lse=None, *, q_order=None,
                                     kv_order=None, kv_bounds=None, token_offsets=None, packed_len=0):
    """triton.py's backward; with token_offsets the gradients of packed operands come back packed."""
    if token_offsets is None:
        return padded.jagged_attention_backward_triton(grad_out, q, k, v, out, lse, q_lengths, kv_lengths, bias,
                                                       causal, scale, bias_requires_grad, kv_mask, uniform_keys,
                                                       dropout_p, dropout_seed, grad_lse, q_order=q_order,
                                                       kv_order=kv_order, kv_bounds=kv_bounds)
    B, N = token_offsets.shape[0] - 1, int(packed_len)
    T, H, D = k.shape
    q_packed = q.dim() == 3
    shared_q = not q_packed and q.shape[0] != B
    Lq = N if q_packed else q.shape[2]
    bias_grad = bias is not None and bias_requires_grad
    work = B * H * Lq * N * T > 0 and D > 0
    new = torch.empty if work else torch.zeros  # no pair: zero gradients
    dk = new((T, H, D), dtype=k.dtype, device=k.device)
    dv = new((T, H, D), dtype=v.dtype, device=v.device)
    dq_buffer = new((B, H, Lq, D) if not q_packed else q.shape, device=q.device,
                    dtype=torch.float32 if shared_q else q.dtype)
    ds = torch.zeros((B, H, Lq, N), dtype=torch.float32, device=q.device) if bias_grad else None
    if work:
        fill_slack_rows(token_offsets, (dk, 0.0), (dv, 0.0), *(((dq_buffer, 0.0),) if q_packed else ()))
        delta = torch.empty(lse.shape, dtype=torch.float32, device=q.device)
        q_side, kv_side = _sides(q, k, q_lengths, token_offsets, N, q_order,
                                 kv_order if kv_mask is None else None, delta)
        if q_packed:
            q_strides, g_strides, o_strides = _rows_strides(q), _rows_strides(grad_out), _rows_strides(out)
            dq_strides = _rows_strides(dq_buffer)
        else:
            q_strides, g_strides, o_strides = bhld_strides(q, shared_q), grad_out.stride(), out.stride()
            dq_strides = dq_buffer.stride()
        padded._backward(grad_out, q, k, v, out, lse, bias, bias_grad, q_side, kv_side, B, H, D, causal, scale,
                         q_strides, _rows_strides(k), _rows_strides(v), g_strides, o_strides,
                         _lse_strides(lse, q_packed), delta, dq_buffer, dq_strides, dk, dv, _rows_strides(dk), ds,
                         None if ds is None else ds.stride()[:3], kv_mask, uniform_keys,
                         kv_order if kv_mask is not None else None,
                         _key_mask_bounds(kv_mask, kv_lengths, token_offsets, kv_bounds), dropout_p, dropout_seed,
                         grad_lse)
    dq = dq_buffer.sum(dim=0, keepdim=True).to(q.dtype) if shared_q else dq_buffer
    dbias = padded.reduce_bias_grad(ds, bias) if bias_grad else q.new_empty(0)
    return dq, dk, dv, dbias
