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


def attention_pairs(q_lengths, kv_lengths, Lq: int, Lk: int, causal: bool) -> int:
    """Sum over the batch of valid (i, j) pairs; lengths are clamped to [0, L]; q_lengths None means Lq."""
    kv = kv_lengths.detach().to("cpu", torch.int64).clamp(0, int(Lk))
    if q_lengths is None:
        qn = torch.full_like(kv, int(Lq))
    else:
        qn = q_lengths.detach().to("cpu", torch.int64).clamp(0, int(Lq))
    if causal:
        return int(_causal_pairs(qn, kv).sum())
    return int((qn * kv).sum())

