"""Useful FLOPs of GDPA (gemcompile::gdpa): only the (i, j) pairs that take part in the sum count.

A pair (i, j) of batch b is valid when i < q_len[b], j < kv_len[b], j <= i if causal, and, with a
window w > 0, i - j <= w (causal) or |i - j| <= w (not causal). forward = 4 * H * D * pairs (q.k and
a.v, 2 FLOPs per MAC; the pointwise activation is not counted), backward = 2.5 x forward, the same
conventions as jagged attention (jagged_attention_flops.py). The lengths are clamped into [0, L]; a
missing lengths tensor means the padded length.
"""

from __future__ import annotations

from typing import Optional

import torch

from .jagged_attention_flops import BACKWARD_FLOPS_RATIO, forward_flops

__all__ = ["gdpa_pairs", "padded_gdpa_pairs", "forward_flops", "BACKWARD_FLOPS_RATIO"]


def _keys_per_row(Lq: int, kv: torch.Tensor, causal: bool, window: int) -> torch.Tensor:
    """(B, Lq) int64: how many valid keys each query row i sees, given (B,) kv lengths."""
    i = torch.arange(int(Lq), dtype=torch.int64)[None, :]
    c = kv[:, None]
    hi = torch.minimum(c, i + 1) if causal else c.expand(-1, int(Lq))  # exclusive end of the key range
    lo = torch.zeros_like(i)
    if window > 0:
        lo = (i - int(window)).clamp_min(0)
        if not causal:
            hi = torch.minimum(hi, i + int(window) + 1)
    return (hi - lo).clamp_min(0)


def _pairs(qn: torch.Tensor, kv: torch.Tensor, Lq: int, causal: bool, window: int) -> int:
    if kv.numel() == 0 or Lq == 0:
        return 0
    per_row = _keys_per_row(Lq, kv, causal, window)
    rows_ok = torch.arange(int(Lq), dtype=torch.int64)[None, :] < qn[:, None]
    return int((per_row * rows_ok).sum())


def gdpa_pairs(
    q_lengths: Optional[torch.Tensor],
    kv_lengths: Optional[torch.Tensor],
    B: int,
    Lq: int,
    Lk: int,
    causal: bool,
    window: int,
) -> int:
    """Sum over the batch of valid (i, j) pairs; lengths clamped to [0, L], None means the padded length."""
    if kv_lengths is None:
        kv = torch.full((int(B),), int(Lk), dtype=torch.int64)
    else:
        kv = kv_lengths.detach().to("cpu", torch.int64).clamp(0, int(Lk))
    if q_lengths is None:
        qn = torch.full((int(B),), int(Lq), dtype=torch.int64)
    else:
        qn = q_lengths.detach().to("cpu", torch.int64).clamp(0, int(Lq))
    return _pairs(qn, kv, int(Lq), causal, int(window))


def padded_gdpa_pairs(B: int, Lq: int, Lk: int, causal: bool, window: int) -> int:
    """The pair count when every sequence has its padded length (used when lengths are not known).

    Plain Python (no tensors): it runs under FakeTensorMode, where a new tensor would have no values."""
    Lq, Lk, window = int(Lq), int(Lk), int(window)
    per_batch = 0
    for i in range(Lq):
        hi = min(Lk, i + 1) if causal else Lk
        lo = 0
        if window > 0:
            lo = max(i - window, 0)
            if not causal:
                hi = min(hi, i + window + 1)
        per_batch += max(hi - lo, 0)
    return int(B) * per_batch
