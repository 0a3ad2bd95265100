"""What the attention kernels derive from a batch's lengths or key mask (torch only, no Triton): the batch
order longest first and the per-sample key bounds, their checks, and a counter of how often they are
computed.

One lengths (or key-mask) tensor feeds many attention calls in a step (every layer's attention, forward and
backward), and each call used to derive its order and bounds again (issue 24: ``_rank_kernel`` 44 times per
GEM-ref step on the H200). The derived tensors are now graph values: the attention rewrite emits
``gemcompile::length_order`` / ``gemcompile::key_bounds`` (lowering/length_order.py) once per distinct lengths
or mask and passes them to every attention op that reads them (``q_order``, ``kv_order``, ``kv_bounds``), so
the graph's dedup shares them and AOTAutograd saves them for the backward. Graph values rather than a memo
keyed on tensor identity: Inductor reuses buffers in place (a new value in the same tensor object, with no
version bump), so an identity memo could return bounds of a different mask; a graph value cannot go stale,
and CUDA-graph capture needs no special case.

Definitions (what the ops compute and the launchers take):

* order of a key (B,) int: int64 (B,) batch indices by key descending, ties by index (a stable descending
  argsort). ``q_order`` is the order of the q lengths, ``kv_order`` that of the kv lengths, or with a kv_mask
  that of the key span ``max(hi - lo, 0)``.
* key bounds of (kv_mask (B, L) bool, kv_lengths (B,) or None): int32 (B, 3), row b = [lo, hi, holes]: lo
  the first valid key (L if none), hi the last valid key + 1 (0 if none), holes 1 where fewer than hi - lo
  keys are valid; key j is valid iff kv_mask[b, j] and j < kv_lengths[b] (every j < L without lengths). The
  kernels read row b at ``KVBounds + 3 * b`` (``KV_BOUNDS_WIDTH`` in attention_triton.py).

``COUNTS`` counts computations ("order": one stable argsort of a key, on any device and path; "bounds":
one key-bounds computation); tests reset it and check that a step derives each once per distinct input.
"""

from __future__ import annotations

import collections

import torch
from torch import Tensor

__all__ = [
    "COUNTS",
    "KV_BOUNDS_WIDTH",
    "check_plan",
    "check_plan_values",
    "key_bounds",
    "key_span",
    "reset_counts",
    "stable_longest_first",
]

KV_BOUNDS_WIDTH = 3
"""int32 entries per sample in a key-bounds tensor: lo, hi, holes."""

COUNTS: collections.Counter = collections.Counter()
"""How many orders ("order") and key bounds ("bounds") were computed since the last :func:`reset_counts`."""


def reset_counts() -> None:
    COUNTS.clear()


def stable_longest_first(key: Tensor, *, counted: bool = True) -> Tensor:
    """The order of ``key`` with torch ops (any device): a stable descending argsort, int64 (B,)."""
    if counted:
        COUNTS["order"] += 1
    return torch.sort(key, descending=True, stable=True).indices


def key_bounds(kv_mask: Tensor, kv_lengths: Tensor | None, *, counted: bool = True) -> Tensor:
    """int32 (B, 3) [lo, hi, holes] per sample (module docstring), on the device, no host sync. A kv_mask with
    batch stride 0 (one mask expanded over the batch) is read as is."""
    if counted:
        COUNTS["bounds"] += 1
    L = kv_mask.shape[1]
    pos = torch.arange(L, device=kv_mask.device, dtype=torch.int32)
    valid = kv_mask
    if kv_lengths is not None:
        valid = valid & (pos[None, :] < kv_lengths[:, None])
    lo = torch.where(valid, pos, L).amin(dim=1)
    hi = torch.where(valid, pos + 1, 0).amax(dim=1)
    holes = valid.sum(dim=1, dtype=torch.int32) < hi - lo
    return torch.stack((lo, hi, holes.to(torch.int32)), 1).to(torch.int32)


def key_span(bounds: Tensor) -> Tensor:
    """int32 (B,) max(hi - lo, 0): the keys a masked key loop visits, what ``kv_order`` sorts by."""
    return (bounds[:, 1] - bounds[:, 0]).clamp_min(0)


def check_plan(B: int, device, kv_mask, q_order=None, kv_order=None, kv_bounds=None) -> None:
    """Metadata checks of the derived tensors an attention op may be given (they run on fake tensors too)."""
    for name, t, dtype, shape in (("q_order", q_order, torch.int64, (B,)),
                                  ("kv_order", kv_order, torch.int64, (B,)),
                                  ("kv_bounds", kv_bounds, torch.int32, (B, KV_BOUNDS_WIDTH))):
        if t is None:
            continue
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
        if t.dtype != dtype or tuple(t.shape) != shape:
            raise ValueError(f"{name} must be {dtype} of shape {shape}, got {t.dtype} {tuple(t.shape)}")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but q is on {device}")
        if name == "kv_bounds" and not t.is_contiguous():
            raise ValueError("kv_bounds must be contiguous (the kernels read row b at 3 * b)")
    if kv_bounds is not None and kv_mask is None:
        raise ValueError("kv_bounds is given without a kv_mask (it is derived from the mask)")


def check_plan_values(q_lengths, kv_lengths, kv_mask, q_order=None, kv_order=None, kv_bounds=None) -> None:
    """Given derived tensors equal what they are derived from (ValueError otherwise). Syncs with the host: the
    ops call it on CPU (where CI runs every rewritten graph) and under ``strict_length_checks``."""
    bounds = kv_bounds
    if kv_mask is not None and (kv_bounds is not None or kv_order is not None):
        bounds = key_bounds(kv_mask, kv_lengths, counted=False)
        if kv_bounds is not None and not torch.equal(kv_bounds, bounds):
            raise ValueError("kv_bounds are not the key bounds of kv_mask and kv_lengths")
    expected = {"q_order": q_lengths,
                "kv_order": key_span(bounds) if kv_mask is not None and kv_order is not None else kv_lengths}
    for name, order in (("q_order", q_order), ("kv_order", kv_order)):
        if order is None:
            continue
        key = expected[name]
        if key is None:
            raise ValueError(f"{name} is given but there is nothing to order by (no lengths)")
        if not torch.equal(order, stable_longest_first(key, counted=False)):
            raise ValueError(f"{name} is not the longest-first order of its "
                             f"{'key span' if name == 'kv_order' and kv_mask is not None else 'lengths'}")
