"""Slack rows of a packed output: the rows outside [token_offsets[0], token_offsets[B]), filled with a constant.

A bucketed token index (UnpadConfig.token_buckets) gives the packed tensors more rows than tokens; those
rows belong to no sequence, and the packed attention ops give them output 0, lse +inf and zero gradients
(packed.py). So do rows before token_offsets[0] (offsets that start past 0 are valid: packed.py). The
kernels write every row in [token_offsets[0], token_offsets[B]), so only the rows outside need a fill:
allocating the outputs with zeros instead memset all T rows (on the H200, GEM-ref small at B 1024 under
CUDA graphs: 88 bf16 fills a step, 3.8 ms of its 117 ms of kernel time). The kernel reads the two offsets
on the device (no host sync): a fixed grid of programs strides over the rows before the first and from the
last to the end, and does nothing when there are none (offsets from 0, no buckets).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .tuned_launch import INTERPRET

__all__ = ["fill_slack_rows"]

_BLOCK = 4096
# Enough programs that a program's loop runs once or twice over a bucket's slack: with 264 programs of 1024
# elements the loop was latency-bound (GEM-ref medium under CUDA graphs on the H200: 24 us a call,
# e2e-medium-fill0.5-20261204-031049.json). Without slack every program reads two ints and exits.
_MAX_PROGRAMS = 1024


@triton.jit(do_not_specialize=["numel"])
def _fill_slack_rows_kernel(X, Offsets, B, numel, row_numel, value, BLOCK: tl.constexpr):
    # the elements before the first sequence's and from the last one's end; offsets clamped into [0, T] so
    # that a bad (negative, too large) offset cannot write outside x (packed.py: unchecked offsets on CUDA
    # give unspecified values, never an access outside the tensors)
    head = tl.minimum(tl.maximum(tl.load(Offsets).to(tl.int64), 0) * row_numel, numel)
    tail = tl.minimum(tl.maximum(tl.load(Offsets + B).to(tl.int64), 0) * row_numel, numel)
    step = tl.num_programs(0).to(tl.int64) * BLOCK
    start0 = tl.program_id(0).to(tl.int64) * BLOCK
    fill = tl.full((BLOCK,), value, X.dtype.element_ty)
    for start in range(start0, head, step):
        idx = start + tl.arange(0, BLOCK)
        tl.store(X + idx, fill, mask=idx < head)
    for start in range(tail + start0, numel, step):
        idx = start + tl.arange(0, BLOCK)
        tl.store(X + idx, fill, mask=idx < numel)


def fill_slack_rows(token_offsets: Tensor, *filled: tuple[Tensor, float]) -> None:
    """For each (x, value): x[:token_offsets[0]] = x[token_offsets[-1]:] = value, in place. x is a contiguous
    packed tensor (T, ...) on token_offsets' device (CUDA, or the CPU under the Triton interpreter); both
    offsets are taken inside [0, T] (the ops' value checks refuse offsets outside it)."""
    B = token_offsets.shape[0] - 1
    for x, value in filled:
        if not x.is_contiguous():
            raise ValueError(f"fill_slack_rows: a packed output must be contiguous, got strides {x.stride()}")
        if x.numel() == 0:
            continue
        row_numel = x.numel() // x.shape[0]
        programs = min(_MAX_PROGRAMS if not INTERPRET else 4, triton.cdiv(x.numel(), _BLOCK))
        _fill_slack_rows_kernel[(programs,)](x, token_offsets, B, x.numel(), row_numel, float(value),
                                             BLOCK=_BLOCK)


def fill_slack_rows_reference(token_offsets: Tensor, x: Tensor, value: float) -> Tensor:
    """x with its rows before token_offsets[0] and from token_offsets[-1] on set to value (a copy; host sync)."""
    T = x.shape[0]
    out = x.clone()
    out[: min(max(int(token_offsets[0]), 0), T)] = value
    out[min(max(int(token_offsets[-1]), 0), T):] = value
    return out
