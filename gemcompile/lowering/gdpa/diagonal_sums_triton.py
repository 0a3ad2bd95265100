"""Diagonal sums of fp32 parts into a relative table's gradient (relative_table.py).

``dtable[offset + d, z] = sum over s, i of part[s, z, i, i + d]`` for the diagonals d = j - i of an
(Lq, Lk) gradient held as ``S`` partial sums; table rows no diagonal reaches get 0.

Two launches:

1. ``_diagonal_sums_kernel``: one program per (BLOCK_I rows, BLOCK_T diagonals, z) reads the skewed tile
   part[s, z, i, i + t - (Lq - 1)] (contiguous along t) for every part s and sums it over its rows into a
   row-block partial. Programs whose rows miss their diagonals' band store zeros and load nothing. A
   program makes one pass over its rows, loading UNROLL parts per step as independent loads: the first
   version looped over 128 rows x S parts with one load in flight per step, and took 26 us on HSTU's
   1024 x 1024 bias with 5 parts (20 MB) on the H200 (gdpa-hstu-cudagraph-20261130-183648).
2. ``_table_rows_kernel``: sums the row-block partials of each diagonal and writes every table row (in the
   table's dtype): the sum, the cast and the zero rows in one launch. It loads BLOCK_C partials at a time
   (one at a time, 64 of them: 5 us on the H200 for 0.5 MB, gdpa-hstu-cudagraph-20261130-184623).

Deterministic: no atomics, a fixed order of additions.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.tuned_launch import INTERPRET

__all__ = ["relative_table_grad_triton"]

_UNROLL = 4  # parts loaded per step, independently


@triton.jit
def _diagonal_sums_kernel(Part, Partial, splits, Lq, Lk, n_diag,
                          stride_ps, stride_pz, stride_pm, stride_qc, stride_qz,
                          BLOCK_I: tl.constexpr, BLOCK_T: tl.constexpr, UNROLL: tl.constexpr):
    t_block = tl.program_id(0)
    row_block = tl.program_id(1)
    z = tl.program_id(2)
    t = t_block * BLOCK_T + tl.arange(0, BLOCK_T)
    i = row_block * BLOCK_I + tl.arange(0, BLOCK_I)
    j = i[:, None] + t[None, :] - (Lq - 1)
    acc = tl.zeros([BLOCK_I, BLOCK_T], tl.float32)
    # rows i reach diagonals t when some j = i + t - (Lq - 1) lies in [0, Lk)
    t0 = t_block * BLOCK_T
    i0 = row_block * BLOCK_I
    if (i0 + BLOCK_I - 1 + t0 + BLOCK_T - 1 >= Lq - 1) & (i0 + t0 - (Lq - 1) < Lk):
        ok = (i < Lq)[:, None] & (j >= 0) & (j < Lk) & (t < n_diag)[None, :]
        ptrs = Part + z.to(tl.int64) * stride_pz + i.to(tl.int64)[:, None] * stride_pm + j.to(tl.int64)
        for s0 in range(0, splits, UNROLL):
            for u in tl.static_range(UNROLL):
                # a step past the last part re-reads it (in bounds) and adds 0
                s = tl.minimum(s0 + u, splits - 1)
                x = tl.load(ptrs + s.to(tl.int64) * stride_ps, mask=ok, other=0.0)
                acc += tl.where(s0 + u < splits, x, 0.0)
    tl.store(Partial + row_block * stride_qc + z.to(tl.int64) * stride_qz + t, tl.sum(acc, 0),
             mask=t < n_diag)


@triton.jit
def _table_rows_kernel(Partial, Table, row_blocks, n_diag, first, table_rows,
                       stride_qc, stride_qz, stride_tr, stride_tz, BLOCK_R: tl.constexpr,
                       BLOCK_C: tl.constexpr):
    pid = tl.program_id(0)
    z = tl.program_id(1)
    r = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    t = r - first  # the diagonal of table row r (rows outside [first, first + n_diag) get 0)
    ok = (t >= 0) & (t < n_diag)
    acc = tl.zeros([BLOCK_C, BLOCK_R], tl.float32)
    for c0 in range(0, row_blocks, BLOCK_C):  # BLOCK_C row-block partials per (independent) load
        c = c0 + tl.arange(0, BLOCK_C)
        acc += tl.load(Partial + c[:, None] * stride_qc + z * stride_qz + t[None, :],
                       mask=(c < row_blocks)[:, None] & ok[None, :], other=0.0)
    tl.store(Table + r.to(tl.int64) * stride_tr + z * stride_tz, tl.sum(acc, 0), mask=r < table_rows)


def _partials(part: torch.Tensor, block_i: int, block_t: int) -> torch.Tensor:
    S, Z, Lq, Lk = part.shape
    n_diag = Lq + Lk - 1
    row_blocks = triton.cdiv(Lq, block_i)
    partial = part.new_empty((row_blocks, Z, n_diag))
    _diagonal_sums_kernel[(triton.cdiv(n_diag, block_t), row_blocks, Z)](
        part, partial, S, Lq, Lk, n_diag, part.stride(0), part.stride(1), part.stride(2),
        partial.stride(0), partial.stride(1), BLOCK_I=block_i, BLOCK_T=block_t, UNROLL=_UNROLL, num_warps=4)
    return partial


def _check(part: torch.Tensor) -> None:
    if part.dtype != torch.float32 or part.dim() != 4 or part.stride(3) != 1:
        raise ValueError(f"diagonal sums: part must be (S, Z, Lq, Lk) fp32 with contiguous rows, got "
                         f"{tuple(part.shape)} {part.dtype} strides {part.stride()}")


def _blocks() -> tuple[int, int]:
    return (16, 16) if INTERPRET else (16, 128)


def relative_table_grad_triton(part: torch.Tensor, table: torch.Tensor, offset: int) -> torch.Tensor:
    """The gradient of a table (T,) or (T, Z) read at j - i + offset, like ``table``, from the bias
    gradient's parts (S, Z, Lq, Lk) fp32: diagonal j - i = d lands on row offset + d."""
    _check(part)
    S, Z, Lq, Lk = part.shape
    T = table.shape[0]
    grad = torch.empty((T, Z), dtype=table.dtype, device=table.device)
    if S == 0 or Z == 0 or Lq == 0 or Lk == 0:
        return grad.zero_().reshape(table.shape)
    partial = _partials(part, *_blocks())
    block_r, block_c = (16, 4) if INTERPRET else (64, 32)
    _table_rows_kernel[(triton.cdiv(T, block_r), Z)](
        partial, grad, partial.shape[0], Lq + Lk - 1, offset - (Lq - 1), T,
        partial.stride(0), partial.stride(1), grad.stride(0), grad.stride(1), BLOCK_R=block_r,
        BLOCK_C=block_c, num_warps=4)
    return grad.reshape(table.shape)
