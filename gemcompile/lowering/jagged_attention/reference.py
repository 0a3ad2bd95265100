"""Plain-PyTorch reference of jagged softmax attention: what runs on CPU (and any non-CUDA device).

Semantics (shared with the Triton kernels, see op.py): for batch b, head h and query row
i < q_len[b], ``out[b,h,i] = softmax_j(scale * q_i . k_j + bias[b,h,i,j]) @ v`` over keys j < kv_len[b]
(and j <= i when causal, top-left aligned) and with kv_mask[b, j] (when a kv_mask is given; positions
stay absolute). Where uniform_keys[b] is True every score of sequence b (bias included) is replaced by 0
before masking, so each row is uniform over its valid keys; the backward still applies the usual formulas
to those probabilities with the real q and k. Rows with no valid key and rows i >= q_len are exactly 0. Lengths above the padded
length mean "all positions" (the eager ``arange(L) < length`` mask); kv_lengths None means Lk.

The forward returns ``(out, lse)``; ``lse`` is the natural-log sum-exp of each row's scores, and +inf on
rows without a valid key so that ``exp(s - lse) = 0`` there. The backward is the flash-attention
backward written densely: it recomputes the scores but takes the softmax normaliser from ``lse``.

Positions outside the valid region are never read (they are zeroed first), so garbage or NaN in
padding cannot leak into outputs or gradients.

With ``dropout_p`` > 0 the probabilities that multiply V are ``P * keep * keep_scale(p)``, keep drawn from
``dropout_seed`` as the kernels draw it (common/dropout.py); lse and the softmax are those of P itself.

Math runs in float32 for half inputs and in float64 for float64 inputs.
"""

from __future__ import annotations

import torch

from ..common.dropout import keep_mask, keep_scale
from ..common.reference import compute_dtype, key_mask, reduce_bias_grad, row_mask, zero_invalid_rows

__all__ = ["key_mask", "reference_backward", "reference_forward", "valid_mask"]


def valid_mask(q_lengths, kv_lengths, B: int, Lq: int, Lk: int, causal: bool, device,
               kv_mask=None) -> torch.Tensor:
    """(B, 1, Lq, Lk) bool mask of the (i, j) score entries that take part in the softmax."""
    q_ok = row_mask(q_lengths, B, Lq, device)
    kv_ok = key_mask(kv_lengths, kv_mask, B, Lk, device)
    valid = q_ok[:, None, :, None] & kv_ok[:, None, None, :]
    if causal:
        rows = torch.arange(Lq, device=device)
        cols = torch.arange(Lk, device=device)
        valid = valid & (cols[None, :] <= rows[:, None])
    return valid


def _probabilities(q, k, lse, q_lengths, kv_lengths, bias, causal, scale, kv_mask, uniform_keys):
    """Returns (probabilities or scores, valid, zeroed q, zeroed k) in the compute dtype."""
    B, _, Lk, _ = k.shape
    Lq = q.shape[2]
    cdt = compute_dtype(q.dtype)
    qf = zero_invalid_rows(q.to(cdt), row_mask(q_lengths, B, Lq, q.device))
    kf = zero_invalid_rows(k.to(cdt), key_mask(kv_lengths, kv_mask, B, Lk, k.device))
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    if bias is not None:
        s = s + bias.to(cdt)
    if uniform_keys is not None:
        s = torch.where(uniform_keys.to(s.device)[:, None, None, None], torch.zeros_like(s), s)
    valid = valid_mask(q_lengths, kv_lengths, B, Lq, Lk, causal, q.device, kv_mask)
    s = s.masked_fill(~valid, float("-inf"))
    if lse is None:
        return s, valid, qf, kf
    p = torch.exp(s - lse.to(cdt)[..., None]).masked_fill(~valid, 0.0)
    return p, valid, qf, kf


def _dropout_scale(p, dropout_p: float, dropout_seed) -> torch.Tensor | float:
    """keep * keep_scale(p) (1 / (1 - p) for the p drawn) as a (B, H, Lq, Lk) factor of p's dtype, or 1.0
    without dropout."""
    if not dropout_p:
        return 1.0
    B, H, Lq, Lk = p.shape
    keep = keep_mask(dropout_seed, dropout_p, B, H, Lq, Lk, p.device)
    return torch.where(keep, p.new_tensor(keep_scale(dropout_p)), p.new_zeros(()))


def reference_forward(q, k, v, q_lengths, kv_lengths, bias, causal: bool, scale: float, kv_mask=None,
                      uniform_keys=None, dropout_p: float = 0.0, dropout_seed=None):
    """Padded layout: q (Bq, H, Lq, D), k/v (B, H, Lk, D) -> (out (B, H, Lq, D), lse (B, H, Lq))."""
    B, H, Lk, D = k.shape
    Lq = q.shape[2]
    cdt = compute_dtype(q.dtype)
    s, _, _, _ = _probabilities(q, k, None, q_lengths, kv_lengths, bias, causal, scale, kv_mask,
                                uniform_keys)
    lse = torch.logsumexp(s, dim=-1) if Lk > 0 else s.new_full((B, H, Lq), float("-inf"))
    lse = torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse)
    # normalized by the row's own sum, not exp(s - lse): with large scores s - lse loses the low bits of s
    # (fp32), and the backward's delta = dO . out inherits that error (10x-50x worse dq/dk on scores ~1e3)
    m = s.amax(dim=-1, keepdim=True) if Lk > 0 else s.new_zeros((B, H, Lq, 1))
    e = torch.exp(s - torch.where(torch.isfinite(m), m, 0.0))
    total = e.sum(dim=-1, keepdim=True)
    p = e / torch.where(total == 0, 1.0, total)
    vf = zero_invalid_rows(v.to(cdt), key_mask(kv_lengths, kv_mask, B, Lk, v.device))
    out = torch.matmul(p * _dropout_scale(p, dropout_p, dropout_seed), vf)
    return out.to(q.dtype).contiguous(), lse.to(compute_dtype(q.dtype)).contiguous()


def reference_backward(
    grad_out,
    q,
    k,
    v,
    out,
    lse,
    q_lengths,
    kv_lengths,
    bias,
    causal: bool,
    scale: float,
    bias_requires_grad: bool,
    kv_mask=None,
    uniform_keys=None,
    dropout_p: float = 0.0,
    dropout_seed=None,
    grad_lse=None,
):
    """Gradients (dq, dk, dv, dbias) from the saved lse; dbias is empty unless bias_requires_grad. grad_lse
    (B, H, Lq) or None: the gradient of lse itself, dS = P * (dP - delta + grad_lse)."""
    B, H, Lk, D = k.shape
    Lq = q.shape[2]
    cdt = compute_dtype(q.dtype)
    p, _, qf, kf = _probabilities(q, k, lse, q_lengths, kv_lengths, bias, causal, scale, kv_mask,
                                  uniform_keys)
    q_ok = row_mask(q_lengths, B, Lq, q.device)
    do = zero_invalid_rows(grad_out.to(cdt), q_ok)
    o = zero_invalid_rows(out.to(cdt), q_ok)
    vf = zero_invalid_rows(v.to(cdt), key_mask(kv_lengths, kv_mask, B, Lk, v.device))
    delta = (do * o).sum(dim=-1, keepdim=True)
    if grad_lse is not None:
        delta = delta - grad_lse.to(cdt)[..., None]
    dropped = _dropout_scale(p, dropout_p, dropout_seed)
    dv = torch.matmul((p * dropped).transpose(-1, -2), do)
    dp = torch.matmul(do, vf.transpose(-1, -2)) * dropped
    ds = p * (dp - delta)
    dq = torch.matmul(ds, kf) * scale
    if q.shape[0] == 1 and B != 1:
        dq = dq.sum(dim=0, keepdim=True)
    dk = torch.matmul(ds.transpose(-1, -2), qf.expand(B, H, Lq, D)) * scale
    if bias is not None and bias_requires_grad:
        dbias = reduce_bias_grad(ds, bias)
    else:
        dbias = q.new_empty(0)
    return (dq.to(q.dtype).contiguous(), dk.to(k.dtype).contiguous(), dv.to(v.dtype).contiguous(), dbias)
