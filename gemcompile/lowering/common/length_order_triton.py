"""Batch order, longest sequence first, by one small Triton launch (the attention kernels' program order).

``order[rank[b]] = b`` with rank[b] = #{b' : key[b'] > key[b], or key[b'] == key[b] and b' < b}: a stable
descending argsort by counting, O(B^2) compares, which for the batch sizes of a training step (tens to a
few thousands) is one launch. ``torch.argsort`` takes two (an arange and a bitonic sort): 4.5 us per call
on the H200 at B 32, called once in the forward and once in the backward of every attention op
(benchmarks/results/gdpa-hstu-cudagraph-20261130-183648.json). Compiled graphs compute it once per lengths
tensor per step (``gemcompile::length_order``, common/length_order.py) and hand it to every attention op.

A kv_mask's key bounds [lo, hi, holes] (common/length_order.py defines them) likewise take one launch,
``_key_bounds_kernel`` (a program per sample loops over its keys), which also writes the key span that the
order sorts by: ``gemcompile::key_bounds`` is two launches on CUDA. In torch ops it was eleven small ones: a
jagged forward call that derived its own bounds and order that way took 780 us of host time against 138 us
with them given (benchmarks/results/op_host_time-20261202-001343.json, B32 L512 H8 D64), in a SASRec-style
step whose GPU work took 1.7 ms.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .length_order import COUNTS
from .tuned_launch import INTERPRET

__all__ = ["key_bounds_and_span", "longest_first_order"]


@triton.jit
def _rank_kernel(Key, Order, B, BLOCK: tl.constexpr, BLOCK_J: tl.constexpr):
    # BLOCK rows against BLOCK_J columns at a time: a (BLOCK, BLOCK) compare tile of int64 keys spilled at
    # BLOCK 128 on sm_90a (380 bytes a thread with triton 3.9, about 3 KB with 3.6); (128, 32) does not
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ki = tl.load(Key + i, mask=i < B, other=0)
    rank = tl.zeros([BLOCK], tl.int32)
    for j0 in range(0, B, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
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
    _rank_kernel[(triton.cdiv(B, block),)](key.contiguous(), order, B, BLOCK=block, BLOCK_J=min(block, 32),
                                           num_warps=4)
    return order


@triton.jit
def _key_bounds_kernel(Mask, Lengths, Bounds, Span, L, stride_mb, stride_mn, HAS_LENGTHS: tl.constexpr,
                       BLOCK: tl.constexpr):
    b = tl.program_id(0)
    n = L
    if HAS_LENGTHS:  # keys j < kv_lengths[b] only (any length: clamped into [0, L])
        n = tl.minimum(tl.maximum(tl.load(Lengths + b).to(tl.int32), 0), L)
    row = Mask + b.to(tl.int64) * stride_mb
    lo = tl.full([BLOCK], L, tl.int32)
    hi = tl.zeros([BLOCK], tl.int32)
    count = tl.zeros([BLOCK], tl.int32)
    for j0 in range(0, n, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        inside = j < n
        valid = (tl.load(row + j.to(tl.int64) * stride_mn, mask=inside, other=0) != 0) & inside
        lo = tl.minimum(lo, tl.where(valid, j, L))
        hi = tl.maximum(hi, tl.where(valid, j + 1, 0))
        count += valid.to(tl.int32)
    first = tl.min(lo, 0)
    end = tl.max(hi, 0)
    tl.store(Bounds + 3 * b, first)
    tl.store(Bounds + 3 * b + 1, end)
    tl.store(Bounds + 3 * b + 2, (tl.sum(count, 0) < end - first).to(tl.int32))
    tl.store(Span + b, tl.maximum(end - first, 0))


def key_bounds_and_span(kv_mask: torch.Tensor, kv_lengths: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(int32 (B, 3) key bounds [lo, hi, holes], int32 (B,) key span max(hi - lo, 0)) of a bool (B, L) kv_mask
    (any strides) and optional (B,) kv_lengths, in one launch; equal to common/length_order.key_bounds."""
    if kv_mask.dim() != 2 or kv_mask.dtype != torch.bool:
        raise ValueError(f"key_bounds: kv_mask must be a 2-D bool tensor, got {kv_mask.dtype} "
                         f"{tuple(kv_mask.shape)}")
    COUNTS["bounds"] += 1
    B, L = kv_mask.shape
    bounds = torch.empty((B, 3), dtype=torch.int32, device=kv_mask.device)
    span = torch.empty((B,), dtype=torch.int32, device=kv_mask.device)
    if B == 0:
        return bounds, span
    block = 16 if INTERPRET else min(1024, max(16, triton.next_power_of_2(L)))
    lengths = kv_lengths.contiguous() if kv_lengths is not None else span  # (span: a dummy pointer, never read)
    _key_bounds_kernel[(B,)](kv_mask.view(torch.uint8), lengths, bounds, span, L, kv_mask.stride(0),
                             kv_mask.stride(1), HAS_LENGTHS=kv_lengths is not None, BLOCK=block, num_warps=4)
    return bounds, span
