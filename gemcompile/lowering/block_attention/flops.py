"""Useful FLOPs of block attention: the (i, j) pairs with i, j < len[b] that the block/window/causal mask
allows. Padded query rows that see keys (rows of the last partial block) are computed by the kernels
but are not useful work, so they do not count.

forward = 4 * H * D * pairs, backward = 2.5 x forward (common/flops.py, ARCHITECTURE.md). The
count is closed-form per sequence (no L x L mask): a sequence of n tokens splits into n // block full
blocks and one partial block of n % block tokens (block 0: one block of n); within a block of b tokens,
a window w allows b + 2 * sum_{d=1..m} (b - d) pairs, m = min(w, b - 1) (causal: one side only).

With a kv_mask (keys j with kv_mask[b, j] False take no part; query rows are still i < len) the count
goes per key instead, O(B * L): key j < len is seen by the rows of one contiguous range (its block,
its window, i >= j if causal, i < len), so pairs = sum over the valid keys of that range's size.
"""

from __future__ import annotations

import torch

__all__ = ["block_attention_pairs", "padded_block_attention_pairs"]


def _pairs_in_span(n: torch.Tensor, window: int, causal: bool) -> torch.Tensor:
    """Allowed pairs among n consecutive valid positions (elementwise on an int64 tensor)."""
    if window < 0:
        return n * (n + 1) // 2 if causal else n * n
    m = torch.clamp(torch.minimum(n - 1, torch.full_like(n, window)), min=0)
    one_side = m * n - m * (m + 1) // 2
    return n + one_side if causal else n + 2 * one_side


def _pairs(n: torch.Tensor, block: int, window: int, causal: bool) -> int:
    if block > 0:
        full, rest = n // block, n % block
        per_block = _pairs_in_span(torch.full_like(n, block), window, causal)
        return int((full * per_block + _pairs_in_span(rest, window, causal)).sum())
    return int(_pairs_in_span(n, window, causal).sum())


def _masked_pairs(n: torch.Tensor, kv_mask: torch.Tensor, L: int, block: int, window: int,
                  causal: bool) -> int:
    """Per key j of each sample: the rows [lo, hi) that see it, summed over keys j < n with kv_mask."""
    j = torch.arange(L, dtype=torch.int64)[None, :]
    lo = torch.zeros_like(j)
    hi = n[:, None].expand(-1, L)
    if block > 0:
        lo = (j // block) * block
        hi = torch.minimum(hi, lo + block)
    if window >= 0:
        lo = torch.maximum(lo, j - window)
        hi = torch.minimum(hi, j + window + 1)
    if causal:
        lo = torch.maximum(lo, j)
    keys = kv_mask.detach().to("cpu", torch.bool) & (j < n[:, None])
    return int(((hi - lo).clamp(min=0) * keys).sum())


def block_attention_pairs(lengths: torch.Tensor, L: int, block: int, window: int, causal: bool,
                          kv_mask: torch.Tensor | None = None) -> int:
    """Sum over the batch of useful pairs; lengths are clamped into [0, L] as the kernels do. kv_mask
    (B, L) bool drops the keys it marks False (query rows stay i < len)."""
    n = lengths.detach().to("cpu", torch.int64).clamp(0, int(L))
    if kv_mask is not None:
        return _masked_pairs(n, kv_mask, int(L), int(block), int(window), bool(causal))
    return _pairs(n, int(block), int(window), bool(causal))


def padded_block_attention_pairs(B: int, L: int, block: int, window: int, causal: bool) -> int:
    """The count when every sequence has the padded length (lengths unknown, e.g. fake tensors)."""
    return _pairs(torch.full((int(B),), int(L), dtype=torch.int64), int(block), int(window), bool(causal))
