"""The eager fast path of ``gemcompile::block_attention``: one ``torch.autograd.Function`` over the same
kernels as the custom ops, without their dispatcher round trips (why: jagged_attention_eager.py).

Taken only for plain CUDA tensors outside any tracing or dispatch mode (``takes_eager_path``, shared
with jagged attention), so compiled graphs, FLOP counts and fake tensors still see the custom ops.
"""

from __future__ import annotations

import torch

from . import checks
from .block_attention_reference import reference_backward, reference_forward
from .jagged_attention_eager import takes_eager_path

__all__ = ["EagerBlockAttention", "takes_eager_path"]


def _kernels(q: torch.Tensor, block: int, window: int):
    from .block_attention import _use_triton

    if _use_triton(q, block, window):
        from . import block_attention_triton as kernels

        return kernels.block_attention_forward_triton, kernels.block_attention_backward_triton
    return reference_forward, reference_backward


class EagerBlockAttention(torch.autograd.Function):
    """out = block_attention(q, k, v, lengths, block, window, causal, cos, sin, rotary, scale); arguments
    checked by the caller. The lse stays inside the Function: no gradient is materialized for it."""

    @staticmethod
    def forward(ctx, q, k, v, lengths, block, window, causal, cos, sin, rotary, scale):
        checks.check_length_values("lengths", lengths, q.shape[2])
        forward, _ = _kernels(q, block, window)
        out, lse = forward(q, k, v, lengths, block, window, causal, cos, sin, rotary, scale)
        ctx.save_for_backward(q, k, v, out, lse, lengths, cos, sin)
        ctx.args = (block, window, causal, rotary, scale)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, lengths, cos, sin = ctx.saved_tensors
        block, window, causal, rotary, scale = ctx.args
        _, backward = _kernels(q, block, window)
        dq, dk, dv = backward(grad_out, q, k, v, out, lse, lengths, block, window, causal, cos, sin, rotary,
                              scale)
        return dq, dk, dv, None, None, None, None, None, None, None, None
