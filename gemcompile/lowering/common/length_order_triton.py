"""Batch order, longest sequence first, by one small Triton launch (the attention kernels' program order).

``order[rank[b]] = b`` with rank[b] = #{b' : key[b'] > key[b], or key[b'] == key[b] and b' < b}: a stable
descending argsort by counting, O(B^2) compares, which for the batch sizes of a training step (tens to a
few thousands) is one launch. ``torch.argsort`` takes two (an arange and a bitonic sort): 4.5 us per call
on the H200 at B 32, called once in the forward and once in the backward of every attention op
(benchmarks/results/gdpa-hstu-cudagraph-20261130-183648.json). Compiled graphs compute it once per lengths
tensor per step (``gemcompile::length_order``, common/length_order.py) and hand it to every attention op.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .length_order import COUNTS
from .tuned_launch import INTERPRET

__all__ = ["longest_first_order"]


@triton.jit
def _rank_kernel(Key, Order, B, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ki = tl.load(Key + i, mask=i < B, other=0)
    rank = tl.zeros([BLOCK], tl.int32)
    for j0 in range(0, B, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        kj = tl.load(Key + j, mask=j < B, other=0)
        before = ((kj[None, :] > ki[:, None]) | ((kj[None, :] == ki[:, None]) & (j[None, :] < i[:, None])))
        rank += tl.sum((before & (j < B)[None, :]).to(tl.int32), 1)
    tl.store(Order + rank, i.to(tl.int64), mask=i < B)


def longest_first_order(key: torch.Tensor) -> torch.Tensor:
    """int64 (B,) batch indices by ``key`` descending, ties by index (a stable argsort, descending)."""
    if key.dim() != 1 or key.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"longest_first_order: key must be a 1-D int32/int64 tensor, got {key.dtype} "
                         f"{tuple(key.shape)}")
    COUNTS["order"] += 1
    B = key.shape[0]
    order = torch.empty(B, dtype=torch.int64, device=key.device)
    if B == 0:
        return order
    block = 16 if INTERPRET else min(128, max(16, triton.next_power_of_2(B)))
    _rank_kernel[(triton.cdiv(B, block),)](key.contiguous(), order, B, BLOCK=block, num_warps=4)
    return order
