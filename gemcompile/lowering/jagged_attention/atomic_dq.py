"""dQ of the jagged backward from the dK/dV kernel, by atomic adds (FlashAttention-2's scheme).

The deterministic backward runs two kernels over the same (key tile, query tile) pairs: dK/dV (S, dV, dP,
dK: four GEMMs a pair) and dQ (S, dP, dQ: three), so S and dP are computed twice. With atomic dQ the dK/dV
kernel also forms dS K for each pair and adds it into an fp32 accumulator with relaxed atomics: five
GEMMs a pair and one kernel fewer. The price is the order of the adds, which varies run to run, so dQ
is not bit-reproducible: under ``torch.use_deterministic_algorithms(True)`` the deterministic kernels run.

The accumulator has dq's shape and layout; the delta kernel zeroes its valid rows (the only rows the adds
reach) and :func:`dq_from_accumulator` writes dq = scale * accumulator on valid rows and 0 on padded ones.
``GEMCOMPILE_ATOMIC_DQ`` = 1 / 0 forces the choice (tests and benchmarks run both).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..common.attention_triton import Side, block_d, load_rows, sequence, store_rows
from ..common.tuned_launch import INTERPRET

ATOMIC_DQ_BY_DEFAULT = False
"""Whether CUDA backward passes take the atomic path when neither the environment nor determinism decides."""


def atomic_dq_enabled(device: torch.device) -> bool:
    """The atomic dQ path: never under deterministic algorithms; else ``GEMCOMPILE_ATOMIC_DQ`` if set, else
    the default on CUDA (the interpreter follows the environment only)."""
    if torch.are_deterministic_algorithms_enabled():
        return False
    forced = os.environ.get("GEMCOMPILE_ATOMIC_DQ")
    if forced is not None:
        return forced == "1"
    return ATOMIC_DQ_BY_DEFAULT and device.type == "cuda" and not INTERPRET


def dq_accumulator(dq: torch.Tensor) -> torch.Tensor:
    """The fp32 buffer the adds go to: dq itself when it is fp32 already, else a new one of its shape (both
    callers allocate dq contiguous, so the accumulator shares dq's strides)."""
    if dq.dtype == torch.float32:
        return dq
    return torch.empty(dq.shape, dtype=torch.float32, device=dq.device)


@triton.jit
def _dq_from_accumulator_kernel(
    Acc, DQ, QOffsets, QLengths, stride_b, stride_h, stride_m, stride_d, H, max_q_len, total_q_rows, scale,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, Q_MODE: tl.constexpr, BLOCK_M: tl.constexpr,
):
    pid = tl.program_id(0)
    num_m = tl.cdiv(max_q_len, BLOCK_M)
    bh = pid // num_m
    b = bh // H
    h = bh % H
    offs_m = (pid % num_m) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_start, q_len = sequence(QOffsets, QLengths, b, max_q_len, total_q_rows, Q_MODE)
    row = b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h + q_start.to(tl.int64) * stride_m
    row_ok = offs_m < q_len
    acc = load_rows(Acc + row, offs_m, offs_d, stride_m, stride_d, row_ok, HEAD_D, BLOCK_D, True)
    if Q_MODE == 2:  # MODE_OFFSETS, packed rows: a sequence owns only its own rows
        store_mask = row_ok
    else:  # padded layout: rows past the length get zeros
        store_mask = offs_m < max_q_len
    store_rows(DQ + row, offs_m, offs_d, stride_m, stride_d, tl.where(row_ok[:, None], acc * scale, 0.0),
               store_mask, HEAD_D)


def dq_from_accumulator(acc: torch.Tensor, dq: torch.Tensor, q_side: Side, B: int, H: int, D: int, scale: float,
                        strides) -> None:
    """dq = scale * acc on each sequence's rows, 0 on padded rows (in place when acc is dq)."""
    block_m = 32 if INTERPRET else 64
    _dq_from_accumulator_kernel[(triton.cdiv(q_side.max_len, block_m) * B * H,)](
        acc, dq, q_side.offsets, q_side.lengths, *strides, H, q_side.max_len, q_side.total_rows, float(scale),
        HEAD_D=D, BLOCK_D=block_d(D), Q_MODE=q_side.mode, BLOCK_M=block_m, num_warps=4)
