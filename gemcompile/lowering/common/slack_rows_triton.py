"""Slack rows of a packed output: the rows at and past ``token_offsets[B]``, filled with a constant.

A bucketed token index (UnpadConfig.token_buckets) gives the packed tensors more rows than tokens; those
rows belong to no sequence, and the packed attention ops give them output 0, lse +inf and zero gradients
(packed.py). The kernels write every row before ``token_offsets[B]``, so only the slack needs a fill:
allocating the outputs with zeros instead memset all T rows (on the H200, GEM-ref small at B 1024 under
CUDA graphs: 88 bf16 fills a step, 3.8 ms of its 117 ms of kernel time). The kernel reads
``token_offsets[B]`` on the device (no host sync): a fixed grid of programs strides over the rows from
there to the end, and does nothing when there is no slack (no buckets).
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
# e2e-medium-fill0.5-20261204-031049.json). Without slack every program reads one int and exits.
_MAX_PROGRAMS = 1024


@triton.jit(do_not_specialize=["numel"])
def _fill_slack_rows_kernel(X, Offsets, B, numel, row_numel, value, BLOCK: tl.constexpr):
    # the first slack element; clamped at 0 so that a bad (negative) offset cannot write before x (packed.py:
    # unchecked offsets on CUDA give unspecified values, never an access outside the tensors)
    first = tl.maximum(tl.load(Offsets + B).to(tl.int64), 0) * row_numel
    step = tl.num_programs(0).to(tl.int64) * BLOCK
    fill = tl.full((BLOCK,), value, X.dtype.element_ty)
    for start in range(first + tl.program_id(0).to(tl.int64) * BLOCK, numel, step):
        idx = start + tl.arange(0, BLOCK)
        tl.store(X + idx, fill, mask=idx < numel)


def fill_slack_rows(token_offsets: Tensor, *filled: tuple[Tensor, float]) -> None:
    """For each (x, value): x[token_offsets[-1]:] = value, in place. x is a contiguous packed tensor
    (T, ...) on token_offsets' device (CUDA, or the CPU under the Triton interpreter); token_offsets[-1]
    is taken inside [0, T] (outside it: no row, or all of them; the ops' value checks refuse such offsets)."""
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
    """x with its rows from token_offsets[-1] on set to value (a copy; host sync)."""
    out = x.clone()
    out[int(token_offsets[-1]):] = value
    return out
