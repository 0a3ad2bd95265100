"""gemcompile::token_column_sum: the sum over tokens (dim 0) of a (T, N) tensor, one bandwidth-bound kernel.

    torch.ops.gemcompile.token_column_sum(Tensor x) -> Tensor
        (N,) in x's dtype: sum_t x[t, :], accumulated in float32 and rounded once (as Inductor's sum).

Why: a Linear's bias gradient over packed tokens is such a sum, with T unbacked (a new token count every
step). Inductor compiles a reduction over an unbacked row count without knowing its size, and those sums
read at about 2.2 TB/s in GEM-ref medium on the H200 (e2e-medium-fill0.5-20261204-054114.json:
``triton_unk_fused_sum_view_30``, 23 launches and 2.8 ms a step), half the H200's bandwidth.

The kernel: programs over (column blocks, row splits); each sums BLOCK_T x BLOCK_N tiles of its rows in
float32 (a pipelined loop of plain loads) and writes one partial row; the partial rows (a few hundred at
most) are summed by torch in float32 and rounded once. No atomics, so the result is deterministic. The
split count is a function of T and the SM count, taken at launch (a CUDA graph captures it per token
count). Other devices, float64 and empty inputs run ``x.sum(0)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common.opkit import direct_cuda
from .common.tuned_launch import INTERPRET, autotune, launch

__all__ = ["token_column_sum", "token_column_sum_triton"]

_PROGRAMS_PER_SM = 4
"""Programs in flight per SM the split aims at: enough loads in flight to run at bandwidth."""


def _configs():
    if INTERPRET:
        return [triton.Config({"BLOCK_T": 16, "BLOCK_N": 32}, num_warps=4, num_stages=1)]
    return [triton.Config({"BLOCK_T": t, "BLOCK_N": n}, num_warps=w, num_stages=s)
            for t, n, w, s in ((64, 128, 4, 3), (32, 256, 4, 3), (64, 256, 8, 3), (128, 64, 4, 4))]


@autotune(configs=_configs(), key=["N_BUCKET", "T_BUCKET"])
@triton.jit(do_not_specialize=["T", "rows_per_split"])
def _column_partials_kernel(X, Partial, T, N, stride_t, stride_n, rows_per_split, T_BUCKET, N_BUCKET,
                            BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    split = tl.program_id(1)
    start = split.to(tl.int64) * rows_per_split
    end = tl.minimum(start + rows_per_split, T)
    acc = tl.zeros((BLOCK_T, BLOCK_N), tl.float32)
    for t0 in tl.range(start, end, BLOCK_T):
        rows = t0 + tl.arange(0, BLOCK_T)
        x = tl.load(X + rows[:, None] * stride_t + cols[None, :] * stride_n,
                    mask=(rows < end)[:, None] & col_ok[None, :], other=0.0)
        acc += x.to(tl.float32)
    tl.store(Partial + split.to(tl.int64) * N + cols, tl.sum(acc, 0), mask=col_ok)


def _splits(T: int, col_blocks: int, device: torch.device) -> int:
    """Row splits: about _PROGRAMS_PER_SM programs per SM over all column blocks, each split at least 256
    rows (fewer, longer loops for small T)."""
    sms = 4 if INTERPRET else torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(triton.cdiv(T, 256), triton.cdiv(_PROGRAMS_PER_SM * sms, col_blocks)))


def token_column_sum_triton(x: Tensor) -> Tensor:
    """x.sum(0) for a 2-D x through the Triton kernel (CUDA, or the CPU under the interpreter)."""
    T, N = x.shape
    col_blocks = triton.cdiv(N, 64)  # the smallest BLOCK_N: splits are counted for it
    splits = _splits(T, col_blocks, x.device)
    rows_per_split = triton.cdiv(T, splits)
    partial = torch.empty((splits, N), device=x.device, dtype=torch.float32)

    def grid(meta):
        return (triton.cdiv(N, meta["BLOCK_N"]), splits)

    args = (x, partial, T, N, x.stride(0), x.stride(1), rows_per_split, triton.next_power_of_2(T),
            triton.next_power_of_2(N))
    launch(_column_partials_kernel, grid, args, {}, (triton.next_power_of_2(T), triton.next_power_of_2(N)))
    return partial.sum(0).to(x.dtype)


def _check(x: Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"token_column_sum: expected a 2-D (T, N) tensor, got shape {tuple(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise ValueError(f"token_column_sum: expected a float16 / bfloat16 / float32 / float64 tensor, got "
                         f"{x.dtype}")


@torch.library.custom_op("gemcompile::token_column_sum", mutates_args=())
def token_column_sum(x: Tensor) -> Tensor:
    """sum over dim 0 of a (T, N) tensor in x's dtype, float32 accumulation (module doc)."""
    _check(x)
    if x.device.type == "cuda" and x.dtype != torch.float64 and x.numel() > 0:
        return token_column_sum_triton(x)
    return x.sum(0, dtype=torch.float32 if x.dtype != torch.float64 else None).to(x.dtype)


direct_cuda(token_column_sum)  # CUDA calls skip register_kernel's wrapper (opkit.direct_cuda)


@token_column_sum.register_fake
def _token_column_sum_fake(x: Tensor) -> Tensor:
    _check(x)
    return x.new_empty((x.shape[1],))


def _setup_context(ctx, inputs, output) -> None:
    ctx.rows = inputs[0].shape[0]


def _backward(ctx, grad: Tensor):
    return grad.unsqueeze(0).expand(ctx.rows, grad.shape[0])


token_column_sum.register_autograd(_backward, setup_context=_setup_context)
