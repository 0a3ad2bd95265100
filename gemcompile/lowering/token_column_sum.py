"""gemcompile::token_column_sum: the sum over tokens (dim 0) of a (T, N) tensor, run by torch's own reduction.

    torch.ops.gemcompile.token_column_sum(Tensor x, ScalarType? dtype=None) -> Tensor
        (N,) in ``dtype`` (x's dtype when None): sum_t x[t, :], as ``x.sum(0, dtype=dtype)`` (float32
        accumulation for half inputs, as torch.sum and Inductor).

Why: a Linear's bias gradient over packed tokens is such a sum, with T unbacked (a new token count every
step). Inductor compiles a reduction over an unbacked row count without knowing its size, and picks a
slow split for it. On the H200 (bf16, GEM-ref medium's shapes), Inductor's sum over an unbacked T took
0.315 ms at (262144, 512) and 0.672 ms at (262144, 2048) where eager ``x.sum(0)`` took 0.136 and 0.314
(and a Triton kernel of ours that split the rows at launch, 0.216 and 0.677: dropped). This op keeps the
sum opaque to Inductor, so that the compiled graph calls torch's reduction, which sizes its launch from
the real T at every call. No atomics: deterministic.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .common.opkit import direct_cuda

__all__ = ["token_column_sum"]


def _check(x: Tensor, dtype: Optional[torch.dtype] = None) -> None:
    if x.dim() != 2:
        raise ValueError(f"token_column_sum: expected a 2-D (T, N) tensor, got shape {tuple(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise ValueError(f"token_column_sum: expected a float16 / bfloat16 / float32 / float64 tensor, got "
                         f"{x.dtype}")
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(f"token_column_sum: dtype must be a floating dtype, got {dtype}")


@torch.library.custom_op("gemcompile::token_column_sum", mutates_args=())
def token_column_sum(x: Tensor, dtype: Optional[torch.dtype] = None) -> Tensor:
    """sum over dim 0 of a (T, N) tensor, in ``dtype`` or x's (module doc)."""
    _check(x, dtype)
    return x.sum(0, dtype=dtype)


direct_cuda(token_column_sum)  # CUDA calls skip register_kernel's wrapper (opkit.direct_cuda)


@token_column_sum.register_fake
def _token_column_sum_fake(x: Tensor, dtype: Optional[torch.dtype] = None) -> Tensor:
    _check(x, dtype)
    return x.new_empty((x.shape[1],), dtype=dtype or x.dtype)


def _setup_context(ctx, inputs, output) -> None:
    ctx.rows, ctx.x_dtype = inputs[0].shape[0], inputs[0].dtype


def _backward(ctx, grad: Tensor):
    return grad.to(ctx.x_dtype).unsqueeze(0).expand(ctx.rows, grad.shape[0]), None


token_column_sum.register_autograd(_backward, setup_context=_setup_context)
