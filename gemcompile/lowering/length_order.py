"""gemcompile::length_order and gemcompile::key_bounds: what the attention ops derive from a batch's lengths
or key mask, as graph values computed once per step.

    torch.ops.gemcompile.length_order(Tensor key) -> Tensor
        int64 (B,): batch indices by key descending, ties by index (a stable descending argsort).
    torch.ops.gemcompile.key_bounds(Tensor kv_mask, Tensor? kv_lengths) -> (Tensor bounds, Tensor order)
        bounds int32 (B, 3) [lo, hi, holes] of the valid keys (kv_mask[b, j] and j < kv_lengths[b]);
        order: the length_order of the key span max(hi - lo, 0).

The attention ops (jagged_attention, gdpa, block_attention) take them as optional inputs (``q_order``,
``kv_order``, ``kv_bounds``); without them each call derives its own, as before. The attention rewrite
(passes/attention/plans.py) emits one of these per distinct lengths / mask and hands it to every attention
op that reads it: Dynamo/AOTAutograd dedup shares the node and AOTAutograd saves its output for the
backward (an opaque custom op is never recomputed there), so a step computes each order once
(common/length_order.py says why a graph value and not a memo keyed on the tensor).

Dispatch: CUDA runs one Triton launch for the bounds (with the key span) and one for the argsort
(common/length_order_triton.py); every other device runs torch ops (torch.sort). No host sync on either.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .common.length_order import (
    KV_BOUNDS_WIDTH,
    key_bounds,
    key_span,
    stable_longest_first,
)
from .common.opkit import direct_cuda

__all__ = ["bounds_and_span", "derive_plan", "longest_first"]


def _check_key(key: Tensor) -> None:
    if key.dim() != 1 or key.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"length_order: key must be a 1-D int32/int64 tensor, got {key.dtype} {tuple(key.shape)}")


def _check_mask(kv_mask: Tensor, kv_lengths: Optional[Tensor]) -> None:
    if kv_mask.dim() != 2 or kv_mask.dtype != torch.bool:
        raise ValueError(f"key_bounds: kv_mask must be a 2-D bool tensor, got {kv_mask.dtype} "
                         f"{tuple(kv_mask.shape)}")
    if kv_lengths is not None:
        _check_key(kv_lengths)
        if kv_lengths.shape[0] != kv_mask.shape[0] or kv_lengths.device != kv_mask.device:
            raise ValueError(f"key_bounds: kv_lengths {tuple(kv_lengths.shape)} on {kv_lengths.device} do not "
                             f"match kv_mask {tuple(kv_mask.shape)} on {kv_mask.device}")


def longest_first(key: Tensor) -> Tensor:
    """The order of ``key`` on its device: the Triton argsort on CUDA, torch.sort elsewhere."""
    if key.device.type == "cuda":
        from .common.length_order_triton import longest_first_order

        return longest_first_order(key)
    return stable_longest_first(key)


@torch.library.custom_op("gemcompile::length_order", mutates_args=())
def length_order(key: Tensor) -> Tensor:
    """int64 (B,) batch indices, longest first (stable)."""
    _check_key(key)
    return longest_first(key)


direct_cuda(length_order)  # CUDA calls skip register_kernel's wrapper (opkit.direct_cuda)


@length_order.register_fake
def _length_order_fake(key: Tensor) -> Tensor:
    _check_key(key)
    return key.new_empty(key.shape, dtype=torch.int64)


def bounds_and_span(kv_mask: Tensor, kv_lengths: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """(key bounds (B, 3), key span (B,)) of a kv_mask on its device: one Triton launch on CUDA (it writes
    both), torch ops elsewhere."""
    if kv_mask.device.type == "cuda":
        from .common.length_order_triton import key_bounds_and_span

        return key_bounds_and_span(kv_mask, kv_lengths)
    bounds = key_bounds(kv_mask, kv_lengths)
    return bounds, key_span(bounds)


@torch.library.custom_op("gemcompile::key_bounds", mutates_args=())
def key_bounds_op(kv_mask: Tensor, kv_lengths: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """(bounds int32 (B, 3) [lo, hi, holes], the longest-span-first order int64 (B,))."""
    _check_mask(kv_mask, kv_lengths)
    bounds, span = bounds_and_span(kv_mask, kv_lengths)
    return bounds, longest_first(span)


direct_cuda(key_bounds_op)  # CUDA calls skip register_kernel's wrapper (opkit.direct_cuda)


@key_bounds_op.register_fake
def _key_bounds_fake(kv_mask: Tensor, kv_lengths: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    _check_mask(kv_mask, kv_lengths)
    B = kv_mask.shape[0]
    return kv_mask.new_empty((B, KV_BOUNDS_WIDTH), dtype=torch.int32), kv_mask.new_empty((B,), dtype=torch.int64)


def derive_plan(q_lengths: Optional[Tensor], kv_lengths: Optional[Tensor], kv_mask: Optional[Tensor],
                q_order: Optional[Tensor] = None, kv_order: Optional[Tensor] = None,
                kv_bounds: Optional[Tensor] = None) -> tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """(q_order, kv_order, kv_bounds) with what is missing derived here: what the rewrite emits in a graph, for
    the eager fast paths (derived once in the forward, saved for the backward). q_order is the kv order when
    both sides share one lengths tensor and there is no mask."""
    if kv_mask is not None:
        if kv_bounds is None:
            kv_bounds = bounds_and_span(kv_mask, kv_lengths)[0]
        if kv_order is None:
            kv_order = longest_first(key_span(kv_bounds))
    elif kv_lengths is not None and kv_order is None:
        kv_order = longest_first(kv_lengths)
    if q_lengths is not None and q_order is None:
        q_order = kv_order if (q_lengths is kv_lengths and kv_mask is None) else longest_first(q_lengths)
    return q_order, kv_order, kv_bounds
