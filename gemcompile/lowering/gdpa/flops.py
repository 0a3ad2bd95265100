"""Useful FLOPs of GDPA (gemcompile::gdpa): only the (i, j) pairs that take part in the sum count.

A pair (i, j) of batch b is valid when i < q_len[b], j < kv_len[b], j <= i if causal, and, with a
window w > 0, i - j <= w (causal) or |i - j| <= w (not causal). forward = 4 * H * D * pairs (q.k and
a.v, 2 FLOPs per MAC; the pointwise activation is not counted), backward = 2.5 x forward, the same
conventions as jagged attention (common/flops.py). The lengths are clamped into [0, L]; a
missing lengths tensor means the padded length.

With HSTU's target mask (num_targets) or contextual prefix (contextual_len > 0) the pairs are those of
op.py's clamped-id rule; they are counted exactly, row by row, in closed form (:func:`_hstu_keys_per_row`:
every visible set is the union of at most two key intervals and the diagonal), without building masks.

With a kv_mask (B, Lk) (never with targets or a prefix) a row's keys are still one interval [lo, hi), and
the count is the number of valid keys in it, from the mask's prefix sums (:func:`_masked_keys_per_row`).
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["gdpa_pairs", "padded_gdpa_pairs"]


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


def _masked_keys_per_row(Lq: int, kv: torch.Tensor, kv_mask: torch.Tensor, causal: bool,
                         window: int) -> torch.Tensor:
    """(B, Lq) int64: valid keys (j < kv_len and kv_mask[b, j]) in each row's interval [lo, hi)."""
    B, Lk = kv_mask.shape
    ok = kv_mask.to(torch.bool) & (torch.arange(Lk)[None, :] < kv[:, None])
    prefix = torch.zeros(B, Lk + 1, dtype=torch.int64)
    prefix[:, 1:] = ok.to(torch.int64).cumsum(1)  # prefix[b, x] = valid keys j < x
    i = torch.arange(int(Lq), dtype=torch.int64)[None, :].expand(B, -1)
    hi = torch.minimum(i + 1, torch.tensor(Lk)) if causal else torch.full_like(i, Lk)
    lo = torch.zeros_like(i)
    if window > 0:
        lo = (i - int(window)).clamp(0, Lk)
        if not causal:
            hi = torch.minimum(hi, i + int(window) + 1)
    count = prefix.gather(1, hi) - prefix.gather(1, lo)
    return count.clamp_min(0)


def _pairs(qn: torch.Tensor, kv: torch.Tensor, Lq: int, causal: bool, window: int, kv_mask=None) -> int:
    if kv.numel() == 0 or Lq == 0:
        return 0
    if kv_mask is None:
        per_row = _keys_per_row(Lq, kv, causal, window)
    else:
        per_row = _masked_keys_per_row(Lq, kv, kv_mask, causal, window)
    rows_ok = torch.arange(int(Lq), dtype=torch.int64)[None, :] < qn[:, None]
    return int((per_row * rows_ok).sum())


def _hstu_keys_per_row(
    Lq: int, kv: torch.Tensor, targets: Optional[torch.Tensor], c: int, window: int
) -> torch.Tensor:
    """(B, Lq) int64: how many keys j < n each query row i sees under the clamped-id rule (causal).

    f(x) = min(max(x - off, 0), m) (the min only with targets), off = max(c - 1, 0), is non-decreasing, so
    P(X) = #{j < n : f(j) < X} gives intervals: the keys with f(i) - window <= f(j) < f(i) are
    [P(f(i) - window), P(f(i))) (or [0, P(f(i))) without a window); a contextual row (c > 0, f(i) == 0)
    also sees [0, P(m)); and the diagonal j = i when i < n (and not already counted)."""
    n = kv[:, None]  # (B, 1)
    off = max(int(c) - 1, 0)
    m = n - int(c) + 1 if c > 0 else n
    if targets is not None:
        m = m - targets[:, None]
    i = torch.arange(int(Lq), dtype=torch.int64)[None, :]

    def f(x):
        y = (x - off).clamp_min(0)
        return torch.minimum(y, m) if targets is not None else y

    def P(X):
        below = torch.where(X > 0, torch.minimum((X + off).clamp_min(0), n), torch.zeros_like(X))
        if targets is not None:
            below = torch.where(m < X, n.expand_as(below), below)
        return below

    fi = f(i) + torch.zeros_like(n)  # (B, Lq)
    count = P(fi) - (P(fi - int(window)) if window > 0 else 0)
    diagonal = i < n
    if c > 0:
        history = P(m).expand_as(fi)  # the contextual rows' extra keys [0, P(m))
        contextual = fi == 0
        count = count + torch.where(contextual, history, torch.zeros_like(count))
        diagonal = diagonal & ~(contextual & (i < history))
    return count.clamp_min(0) + diagonal.to(torch.int64)


def gdpa_pairs(
    q_lengths: Optional[torch.Tensor],
    kv_lengths: Optional[torch.Tensor],
    B: int,
    Lq: int,
    Lk: int,
    causal: bool,
    window: int,
    num_targets: Optional[torch.Tensor] = None,
    contextual_len: int = 0,
    kv_mask: Optional[torch.Tensor] = None,
) -> int:
    """Sum over the batch of valid (i, j) pairs; lengths clamped to [0, L], None means the padded length.
    With num_targets or contextual_len > 0 (causal), HSTU's clamped-id rule of op.py. kv_mask (B, Lk)
    bool: only its True keys count (not combined with targets or a prefix)."""
    if kv_lengths is None:
        kv = torch.full((int(B),), int(Lk), dtype=torch.int64)
    else:
        kv = kv_lengths.detach().to("cpu", torch.int64).clamp(0, int(Lk))
    if q_lengths is None:
        qn = torch.full((int(B),), int(Lq), dtype=torch.int64)
    else:
        qn = q_lengths.detach().to("cpu", torch.int64).clamp(0, int(Lq))
    c = int(contextual_len)
    if kv_mask is not None:
        if num_targets is not None or c != 0:
            raise ValueError("kv_mask is not served together with num_targets or contextual_len > 0")
        mask = kv_mask.detach().to("cpu").expand(int(B), int(Lk))
        return _pairs(qn, kv, int(Lq), causal, int(window), mask)
    if num_targets is None and c == 0:
        return _pairs(qn, kv, int(Lq), causal, int(window))
    if kv.numel() == 0 or Lq == 0:
        return 0
    targets = None if num_targets is None else num_targets.detach().to("cpu", torch.int64)
    per_row = _hstu_keys_per_row(int(Lq), kv, targets, c, int(window))
    rows_ok = torch.arange(int(Lq), dtype=torch.int64)[None, :] < qn[:, None]
    return int((per_row * rows_ok).sum())


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
