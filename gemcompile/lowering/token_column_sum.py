"""gemcompile::token_column_sum: the sum over tokens (dim 0) of a (T, N) tensor, run by torch's own reduction.

    torch.ops.gemcompile.token_column_sum(Tensor x) -> Tensor
        (N,) in x's dtype: sum_t x[t, :], accumulated in float32 for half inputs (as torch.sum and Inductor).

Why: a Linear's bias gradient over packed tokens is such a sum, with T unbacked (a new token count every
step). Inductor compiles a reduction over an unbacked row count without knowing its size, and picks a
slow split for it. On the H200 (bf16, GEM-ref medium's shapes), Inductor's sum over an unbacked T took
0.315 ms at (262144, 512) and 0.672 ms at (262144, 2048) where eager ``x.sum(0)`` took 0.136 and 0.314
(and a Triton kernel of ours that split the rows at launch, 0.216 and 0.677: dropped). This op keeps the
sum opaque to Inductor, so that the compiled graph calls torch's reduction, which sizes its launch from
the real T at every call. No atomics: deterministic.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .common.opkit import direct_cuda

__all__ = ["token_column_sum"]


def _check(x: Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"token_column_sum: expected a 2-D (T, N) tensor, got shape {tuple(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise ValueError(f"token_column_sum: expected a float16 / bfloat16 / float32 / float64 tensor, got "
                         f"{x.dtype}")


@torch.library.custom_op("gemcompile::token_column_sum", mutates_args=())
def token_column_sum(x: Tensor) -> Tensor:
    """sum over dim 0 of a (T, N) tensor in x's dtype (module doc)."""
    _check(x)
    return x.sum(0)


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
