"""Useful pairs of jagged attention: only the (i, j) score entries that take part in the softmax count
(FLOPs from pairs: common/flops.py; registered with torch.utils.flop_counter in op.py; the benchmark uses
the same helpers)."""

from __future__ import annotations

import torch

__all__ = ["attention_pairs", "padded_pairs"]


def _causal_pairs(a: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Rows i < a each see min(i + 1, c) keys (top-left aligned causal mask)."""
    m = torch.minimum(a, c)
    return m * (m + 1) // 2 + (a - m) * c


def padded_pairs(B: int, Lq: int, Lk: int, causal: bool) -> int:
    """The pair count when every sequence has its padded length (used when lengths are not known)."""
    if causal:
        return int(B) * int(_causal_pairs(torch.tensor(int(Lq)), torch.tensor(int(Lk))))
    return int(B) * int(Lq) * int(Lk)


def attention_pairs(q_lengths, kv_lengths, Lq: int, Lk: int, causal: bool, kv_mask=None) -> int:
    """Sum over the batch of valid (i, j) pairs; lengths are clamped to [0, L]; q_lengths None means Lq;
    a kv_mask (B, Lk) removes keys (positions stay absolute)."""
    kv = kv_lengths.detach().to("cpu", torch.int64).clamp(0, int(Lk))
    if q_lengths is None:
        qn = torch.full_like(kv, int(Lq))
    else:
        qn = q_lengths.detach().to("cpu", torch.int64).clamp(0, int(Lq))
    if kv_mask is not None:
        return _masked_pairs(qn, kv, kv_mask.detach().to("cpu"), int(Lk), causal)
    if causal:
        return int(_causal_pairs(qn, kv).sum())
    return int((qn * kv).sum())


def _masked_pairs(qn, kv, kv_mask, Lk: int, causal: bool) -> int:
    """Key j of batch b counts for every row i < q_len (causal: for the rows j <= i < q_len)."""
    pos = torch.arange(Lk)
    valid = kv_mask & (pos[None, :] < kv[:, None])
    if causal:
        rows = (qn[:, None] - pos[None, :]).clamp_min(0)
    else:
        rows = qn[:, None].expand(-1, Lk)
    return int((rows * valid).sum())
