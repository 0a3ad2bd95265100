"""``gemcompile::jagged_attention``: softmax attention over jagged (variable-length) sequences.

Public op (what the jagged_attention pass emits; the signature is fixed)::

    torch.ops.gemcompile.jagged_attention(Tensor q, Tensor k, Tensor v, Tensor? q_lengths,
        Tensor kv_lengths, Tensor? bias, bool causal, float scale) -> Tensor

q (Bq, H, Lq, D) with Bq in {1, B}; k, v (B, H, Lk, D); any strides (permuted or expanded views are read
in place); bias None or 4-D broadcastable to (B, H, Lq, Lk), additive after scaling. Output: contiguous
(B, H, Lq, D) in q's dtype. For row i < q_len[b]: softmax over keys j < kv_len[b] (and j <= i when
causal, top-left aligned). Rows i >= q_len and rows without a valid key are exactly 0 with zero
gradients (eager SDPA gives NaN on an all-masked row; we give 0, as its math backend does).

How autograd and the log-sum-exp are wired
------------------------------------------
The backward must reuse the forward's log-sum-exp, but a ``custom_op``'s ``setup_context`` only sees
the op's own outputs. So there are three ops:

* ``gemcompile::jagged_attention_fwd(...) -> (out, lse)``: a ``torch.library.custom_op`` (opaque to
  Dynamo/Inductor, so graphs and ``explain`` show one stable node) with a fake impl and
  ``register_autograd``; ``lse`` is saved for the backward and marked non-differentiable.
* ``gemcompile::jagged_attention_bwd(grad_out, q, k, v, out, lse, ..., bias_requires_grad)
  -> (dq, dk, dv, dbias)``: a custom_op with a fake impl (dbias is an empty tensor when not needed).
* ``gemcompile::jagged_attention``: the public op, ``CompositeImplicitAutograd``, a thin wrapper that
  returns ``jagged_attention_fwd(...)[0]``. Dynamo keeps it as one node in the pre-grad graph (where
  the pass puts it); AOTAutograd decomposes it into the fwd op in the forward graph and the bwd op in
  the backward graph. Its fake behaviour is the fwd op's fake impl. Works with ``fullgraph=True``.
  A plain eager call on CUDA (no tracing, no dispatch mode) skips the two custom ops and runs the same
  kernels through one autograd.Function (jagged_attention_eager.py): less host time per step.

``custom_op`` rather than ``triton_op``: the launchers autotune and argsort on the device; keeping the
op opaque keeps Inductor out of them and keeps the node name stable across torch 2.11-2.13.

Dispatch: CUDA runs the Triton kernels of jagged_attention_triton.py (float64 falls back to the
reference); every other device runs the plain-PyTorch reference of jagged_attention_reference.py.
Neither path syncs with the host (no ``.item()``); grids depend only on static shapes. Length values
are always checked on CPU; on CUDA they are clamped into [0, L] inside the kernels and checked only
under :func:`gemcompile.lowering.checks.strict_length_checks`.

FLOPs: the fwd and bwd ops have ``torch.utils.flop_counter`` formulas that count useful
pairs from the actual lengths (padded count when the lengths are fake): forward 4*H*D*pairs,
backward 2.5x forward.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from . import checks
from .jagged_attention_eager import EagerJaggedAttention, takes_eager_path
from .jagged_attention_flops import BACKWARD_FLOPS_RATIO, attention_pairs, forward_flops, padded_pairs
from .jagged_attention_reference import reference_backward, reference_forward

__all__ = ["jagged_attention"]

_LIB = torch.library.Library("gemcompile", "FRAGMENT")


def _triton():
    # imported lazily: CPU-only installs never need triton
    from . import jagged_attention_triton

    return jagged_attention_triton


def _use_triton(q: Tensor) -> bool:
    return q.device.type == "cuda" and q.dtype != torch.float64


def _check_values(q, k, q_lengths, kv_lengths) -> None:
    checks.check_length_values("q_lengths", q_lengths, q.shape[2])
    checks.check_length_values("kv_lengths", kv_lengths, k.shape[2])


def _lse_dtype(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


# ---------------------------------------------------------------------------------------------------
# Padded layout: forward


@torch.library.custom_op("gemcompile::jagged_attention_fwd", mutates_args=())
def jagged_attention_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_lengths: Optional[Tensor],
    kv_lengths: Tensor,
    bias: Optional[Tensor],
    causal: bool,
    scale: float,
) -> tuple[Tensor, Tensor]:
    """(out (B, H, Lq, D), lse (B, H, Lq) fp32; +inf on rows without a valid key)."""
    checks.check_jagged_attention_args(q, k, v, q_lengths, kv_lengths, bias, causal, scale)
    _check_values(q, k, q_lengths, kv_lengths)
    return reference_forward(q, k, v, q_lengths, kv_lengths, bias, causal, scale)


@jagged_attention_fwd.register_kernel("cuda")
def _jagged_attention_fwd_cuda(q, k, v, q_lengths, kv_lengths, bias, causal, scale):
    checks.check_jagged_attention_args(q, k, v, q_lengths, kv_lengths, bias, causal, scale)
    _check_values(q, k, q_lengths, kv_lengths)
    if not _use_triton(q):
        return reference_forward(q, k, v, q_lengths, kv_lengths, bias, causal, scale)
    return _triton().jagged_attention_forward_triton(q, k, v, q_lengths, kv_lengths, bias, causal, scale)


@jagged_attention_fwd.register_fake
def _jagged_attention_fwd_fake(q, k, v, q_lengths, kv_lengths, bias, causal, scale):
    checks.check_jagged_attention_args(q, k, v, q_lengths, kv_lengths, bias, causal, scale)
    B, H, _, D = k.shape
    Lq = q.shape[2]
    out = q.new_empty((B, H, Lq, D))
    lse = q.new_empty((B, H, Lq), dtype=_lse_dtype(q))
    return out, lse


# ---------------------------------------------------------------------------------------------------
# Padded layout: backward


@torch.library.custom_op("gemcompile::jagged_attention_bwd", mutates_args=())
def jagged_attention_bwd(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    q_lengths: Optional[Tensor],
    kv_lengths: Tensor,
    bias: Optional[Tensor],
    causal: bool,
    scale: float,
    bias_requires_grad: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq like q, dk, dv, dbias like bias; dbias is an empty tensor unless bias_requires_grad)."""
    return reference_backward(
        grad_out, q, k, v, out, lse, q_lengths, kv_lengths, bias, causal, scale, bias_requires_grad
    )


@jagged_attention_bwd.register_kernel("cuda")
def _jagged_attention_bwd_cuda(
    grad_out, q, k, v, out, lse, q_lengths, kv_lengths, bias, causal, scale, bias_requires_grad
):
    if not _use_triton(q):
        return reference_backward(
            grad_out, q, k, v, out, lse, q_lengths, kv_lengths, bias, causal, scale, bias_requires_grad
        )
    return _triton().jagged_attention_backward_triton(
        grad_out, q, k, v, out, lse, q_lengths, kv_lengths, bias, causal, scale, bias_requires_grad
    )


@jagged_attention_bwd.register_fake
def _jagged_attention_bwd_fake(
    grad_out, q, k, v, out, lse, q_lengths, kv_lengths, bias, causal, scale, bias_requires_grad
):
    dq = q.new_empty(q.shape)
    dk = k.new_empty(k.shape)
    dv = v.new_empty(v.shape)
    dbias = bias.new_empty(bias.shape) if (bias is not None and bias_requires_grad) else q.new_empty(0)
    return dq, dk, dv, dbias


def _fwd_setup_context(ctx, inputs, output):
    q, k, v, q_lengths, kv_lengths, bias, causal, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, q_lengths, kv_lengths, bias)
    ctx.causal = causal
    ctx.scale = scale
    ctx.bias_requires_grad = bias is not None and bool(ctx.needs_input_grad[5])
    ctx.mark_non_differentiable(lse)


def _fwd_backward(ctx, grad_out, grad_lse):
    # grad_lse is ignored: lse is an internal, non-differentiable output
    q, k, v, out, lse, q_lengths, kv_lengths, bias = ctx.saved_tensors
    dq, dk, dv, dbias = torch.ops.gemcompile.jagged_attention_bwd(
        grad_out,
        q,
        k,
        v,
        out,
        lse,
        q_lengths,
        kv_lengths,
        bias,
        ctx.causal,
        ctx.scale,
        ctx.bias_requires_grad,
    )
    return dq, dk, dv, None, None, (dbias if ctx.bias_requires_grad else None), None, None


jagged_attention_fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup_context)


# ---------------------------------------------------------------------------------------------------
# Padded layout: the public op


_LIB.define(
    "jagged_attention(Tensor q, Tensor k, Tensor v, Tensor? q_lengths, Tensor kv_lengths, Tensor? bias, "
    "bool causal, float scale) -> Tensor"
)


def _jagged_attention_composite(q, k, v, q_lengths, kv_lengths, bias, causal, scale):
    if takes_eager_path(q):  # plain eager CUDA call: the same kernels, less host time
        checks.check_jagged_attention_args(q, k, v, q_lengths, kv_lengths, bias, causal, scale)
        return EagerJaggedAttention.apply(q, k, v, q_lengths, kv_lengths, bias, causal, scale)
    return torch.ops.gemcompile.jagged_attention_fwd(q, k, v, q_lengths, kv_lengths, bias, causal, scale)[0]


_LIB.impl("jagged_attention", _jagged_attention_composite, "CompositeImplicitAutograd")


def jagged_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_lengths: Optional[Tensor],
    kv_lengths: Tensor,
    bias: Optional[Tensor] = None,
    causal: bool = False,
    scale: Optional[float] = None,
) -> Tensor:
    """Python convenience wrapper of ``torch.ops.gemcompile.jagged_attention`` (scale defaults to D**-0.5)."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    checks.check_jagged_attention_args(q, k, v, q_lengths, kv_lengths, bias, causal, scale)
    return torch.ops.gemcompile.jagged_attention(q, k, v, q_lengths, kv_lengths, bias, causal, float(scale))


# ---------------------------------------------------------------------------------------------------
# FLOP formulas (raw tensors: the lengths are read when they are real; padded count when fake)


def _is_fake(t: Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return t.device.type == "meta" or is_fake(t)


def _padded_forward_flops(q, k, q_lengths, kv_lengths, causal) -> int:
    B, H, Lk, D = k.shape
    Lq = q.shape[2]
    if _is_fake(kv_lengths) or (q_lengths is not None and _is_fake(q_lengths)):
        pairs = padded_pairs(B, Lq, Lk, causal)
    else:
        pairs = attention_pairs(q_lengths, kv_lengths, Lq, Lk, causal)
    return forward_flops(H, D, pairs)


@register_flop_formula(torch.ops.gemcompile.jagged_attention_fwd, get_raw=True)
def _fwd_flops(
    q, k, v, q_lengths=None, kv_lengths=None, bias=None, causal=False, scale=1.0, *, out_val=None, **kwargs
) -> int:
    return _padded_forward_flops(q, k, q_lengths, kv_lengths, causal)


@register_flop_formula(torch.ops.gemcompile.jagged_attention_bwd, get_raw=True)
def _bwd_flops(
    grad_out,
    q,
    k,
    v,
    out,
    lse,
    q_lengths=None,
    kv_lengths=None,
    bias=None,
    causal=False,
    scale=1.0,
    bias_requires_grad=False,
    *,
    out_val=None,
    **kwargs,
) -> int:
    return int(BACKWARD_FLOPS_RATIO * _padded_forward_flops(q, k, q_lengths, kv_lengths, causal))
