"""The eager fast path of ``gemcompile::jagged_attention``: one ``torch.autograd.Function`` that calls the
same kernels as the custom ops, without their dispatcher round trips.

Why: an eager forward+backward through the custom ops (``register_autograd`` wrapper, Python kernels at
the Autograd and CUDA dispatch keys, the output aliasing check, a zero-filled gradient for the
non-differentiable lse) cost more host time than the GPU time of the whole step on short shapes
(benchmarks/results/jagged_attention-overhead-*.json). Graph capture (Dynamo, AOTAutograd, make_fx,
FlopCounterMode, opcheck) never takes this path: it runs only for plain tensors with no dispatch mode
active, so compiled graphs, FLOP counts and fake tensors still see the custom ops.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

from . import checks
from .jagged_attention_reference import reference_backward, reference_forward

__all__ = ["EagerJaggedAttention", "takes_eager_path"]


def takes_eager_path(q: Tensor) -> bool:
    """Plain CUDA tensors outside any tracing or dispatch mode (the only case with no graph to build)."""
    return (
        q.device.type == "cuda"
        and type(q) is Tensor
        and _get_current_dispatch_mode() is None
        and not torch.compiler.is_compiling()
    )


def _kernels(q: Tensor):
    if q.device.type == "cuda" and q.dtype != torch.float64:
        from . import jagged_attention_triton

        return (
            jagged_attention_triton.jagged_attention_forward_triton,
            jagged_attention_triton.jagged_attention_backward_triton,
        )
    return reference_forward, reference_backward


class EagerJaggedAttention(torch.autograd.Function):
    """out = jagged_attention(q, k, v, q_lengths, kv_lengths, bias, causal, scale); arguments checked by
    the caller. The lse stays inside the Function, so no gradient is ever materialized for it."""

    @staticmethod
    def forward(ctx, q, k, v, q_lengths, kv_lengths, bias, causal: bool, scale: float):
        checks.check_length_values("q_lengths", q_lengths, q.shape[2])
        checks.check_length_values("kv_lengths", kv_lengths, k.shape[2])
        forward, _ = _kernels(q)
        out, lse = forward(q, k, v, q_lengths, kv_lengths, bias, causal, scale)
        ctx.save_for_backward(q, k, v, out, lse, q_lengths, kv_lengths, bias)
        ctx.causal, ctx.scale = causal, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, q_lengths, kv_lengths, bias = ctx.saved_tensors
        bias_grad = bias is not None and ctx.needs_input_grad[5]
        _, backward = _kernels(q)
        dq, dk, dv, dbias = backward(
            grad_out, q, k, v, out, lse, q_lengths, kv_lengths, bias, ctx.causal, ctx.scale, bias_grad
        )
        return dq, dk, dv, None, None, (dbias if bias_grad else None), None, None
