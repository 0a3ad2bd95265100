"""``gemcompile::jagged_attention``: softmax attention over jagged (variable-length) sequences.

Public op (what the jagged_attention pass emits; the signature is fixed)::

    torch.ops.gemcompile.jagged_attention(Tensor q, Tensor k, Tensor v, Tensor? q_lengths,
        Tensor? kv_lengths, Tensor? bias, bool causal, float scale, Tensor? kv_mask=None,
        Tensor? uniform_keys=None, Tensor? q_order=None, Tensor? kv_order=None,
        Tensor? kv_bounds=None) -> Tensor

q (Bq, H, Lq, D) with Bq in {1, B}; k, v (B, H, Lk, D); any strides (permuted or expanded views are read
in place); bias None or 4-D broadcastable to (B, H, Lq, Lk), additive after scaling; kv_lengths None
means Lk; kv_mask None or torch.bool (B, Lk), any strides (a (1, Lk) mask expanded to (B, Lk) is read
in place). Output: contiguous (B, H, Lq, D) in q's dtype. For row i < q_len[b]: softmax over keys
j < kv_len[b] with kv_mask[b, j] (and j <= i when causal, top-left aligned; positions are absolute: holes
or left padding in the mask do not shift them). Rows i >= q_len and rows without a valid key are exactly
0 with zero gradients (eager SDPA gives NaN on an all-masked row; we give 0, as its math backend does);
keys that are not valid get exactly zero dK and dV.

uniform_keys None or torch.bool (B,) on q's device: for a sequence b with uniform_keys[b], every score
(bias included) is taken as 0, so each row's probabilities P are uniform over its valid keys; the
backward still applies the usual formulas to those P with the real q and k (dS = P * (dP - delta),
dQ = scale * dS @ K, dK = scale * dS^T @ Q, dV = P^T @ dO, dbias = dS). Why: eager softmax(s + F) with a
huge finite fill F rounds s + F to F (a uniform forward) while autograd still passes gradients through
s + F with derivative 1; the pass uses this for sequences whose keys are all padding under a finite fill.

q_order, kv_order, kv_bounds (optional; what the kernels derive from the lengths and kv_mask, defined in
common/length_order.py): the longest-first order of q_lengths, of kv_lengths (of the key span with a
kv_mask), and the (B, 3) key bounds of kv_mask. The attention rewrite passes them from one
``gemcompile::length_order`` / ``gemcompile::key_bounds`` per distinct lengths or mask, so a step derives
each once for all its attention calls, forward and backward; left out, the kernels derive their own. They
change no value; wrong ones are refused on CPU and under ``strict_length_checks`` (checks with a host sync).

Wiring (common/opkit.py explains why there are three ops): ``gemcompile::jagged_attention_fwd(...) ->
(out, lse)`` and ``gemcompile::jagged_attention_bwd(grad_out, q, k, v, out, lse, ..., bias_requires_grad)
-> (dq, dk, dv, dbias)`` are custom ops with fake impls and ``register_autograd``; the public op is
``CompositeImplicitAutograd`` over the fwd op. A plain eager call on CUDA runs the same kernels through one
autograd.Function (:class:`EagerJaggedAttention`): less host time per step.

Dispatch: CUDA runs the Triton kernels of triton.py (float64 falls back to the reference); every other
device runs the plain-PyTorch reference of reference.py. Neither path syncs with the host (no
``.item()``); grids depend only on static shapes. Length values are always checked on CPU; on CUDA they
are clamped into [0, L] inside the kernels and checked only under
:func:`gemcompile.lowering.common.checks.strict_length_checks`.

FLOPs: the fwd and bwd ops have ``torch.utils.flop_counter`` formulas that count useful pairs from the
actual lengths and kv_mask (padded count when any of them is fake): forward 4*H*D*pairs, backward 2.5x
forward.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from ..common import checks
from ..common.flops import BACKWARD_FLOPS_RATIO, forward_flops
from ..common.length_order import check_plan, check_plan_values
from ..common.opkit import (LIB, cuda_kernel, ignoring_plan, input_grads, is_fake, save_for_backward,
                           takes_eager_path, use_triton)
from ..common.reference import compute_dtype
from ..length_order import derive_plan
from .flops import attention_pairs, padded_pairs
from .reference import reference_backward, reference_forward

__all__ = ["EagerJaggedAttention", "check_jagged_attention_args", "jagged_attention"]

_INPUTS = 13  # q, k, v, q_lengths, kv_lengths, bias, causal, scale, kv_mask, uniform_keys, q_order, kv_order,
# kv_bounds
_SAVED = 8  # q, k, v, out, lse, q_lengths, kv_lengths, bias (then kv_mask, uniform_keys, q_order, kv_order,
# kv_bounds: the bwd op's last)


def check_jagged_attention_args(q, k, v, q_lengths, kv_lengths, bias, causal, scale, kv_mask=None,
                                uniform_keys=None, q_order=None, kv_order=None, kv_bounds=None) -> None:
    """Metadata checks of ``gemcompile::jagged_attention``; TypeError/ValueError naming the argument."""
    B, H, Lq, Lk = checks.check_attention_layout(q, k, v, q_lengths, kv_lengths, "jagged attention kernel")
    if bias is not None:
        checks.check_bias(bias, (B, H, Lq, Lk), q.device)
    checks.check_flags(causal, scale)
    checks.check_kv_mask(kv_mask, B, Lk, q.device)
    checks.check_uniform_keys(uniform_keys, B, q.device)
    check_plan(B, q.device, kv_mask, q_order, kv_order, kv_bounds)


def _check_values(q, k, q_lengths, kv_lengths, kv_mask=None, q_order=None, kv_order=None,
                  kv_bounds=None) -> None:
    checks.check_length_values("q_lengths", q_lengths, q.shape[2])
    checks.check_length_values("kv_lengths", kv_lengths, k.shape[2])
    plan = (q_order, kv_order, kv_bounds)
    if any(t is not None and checks.should_check_values(t) for t in plan):
        check_plan_values(q_lengths, kv_lengths, kv_mask, *plan)


def _kernels(q: Tensor):
    """(forward, backward): the Triton launchers on CUDA (imported lazily: CPU-only installs never need
    triton), else the reference; both take the derived tensors as keywords (q_order, kv_order, kv_bounds)."""
    if use_triton(q):
        from . import triton as kernels

        return kernels.jagged_attention_forward_triton, kernels.jagged_attention_backward_triton
    return ignoring_plan(reference_forward), ignoring_plan(reference_backward)


# ---------------------------------------------------------------------------------------------------
# The custom ops


@torch.library.custom_op("gemcompile::jagged_attention_fwd", mutates_args=())
def jagged_attention_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_lengths: Optional[Tensor],
    kv_lengths: Optional[Tensor],
    bias: Optional[Tensor],
    causal: bool,
    scale: float,
    kv_mask: Optional[Tensor] = None,
    uniform_keys: Optional[Tensor] = None,
    q_order: Optional[Tensor] = None,
    kv_order: Optional[Tensor] = None,
    kv_bounds: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """(out (B, H, Lq, D), lse (B, H, Lq) fp32; +inf on rows without a valid key)."""
    check_jagged_attention_args(q, k, v, q_lengths, kv_lengths, bias, causal, scale, kv_mask, uniform_keys,
                                q_order, kv_order, kv_bounds)
    _check_values(q, k, q_lengths, kv_lengths, kv_mask, q_order, kv_order, kv_bounds)
    forward, _ = _kernels(q)  # the reference (tests may route CPU tensors to the Triton interpreter)
    return forward(q, k, v, q_lengths, kv_lengths, bias, causal, scale, kv_mask, uniform_keys,
                   q_order=q_order, kv_order=kv_order, kv_bounds=kv_bounds)


@cuda_kernel(jagged_attention_fwd)
def _jagged_attention_fwd_cuda(q, k, v, q_lengths, kv_lengths, bias, causal, scale, kv_mask=None,
                               uniform_keys=None, q_order=None, kv_order=None, kv_bounds=None):
    check_jagged_attention_args(q, k, v, q_lengths, kv_lengths, bias, causal, scale, kv_mask, uniform_keys,
                                q_order, kv_order, kv_bounds)
    _check_values(q, k, q_lengths, kv_lengths, kv_mask, q_order, kv_order, kv_bounds)
    forward, _ = _kernels(q)
    return forward(q, k, v, q_lengths, kv_lengths, bias, causal, scale, kv_mask, uniform_keys,
                   q_order=q_order, kv_order=kv_order, kv_bounds=kv_bounds)


@jagged_attention_fwd.register_fake
def _jagged_attention_fwd_fake(q, k, v, q_lengths, kv_lengths, bias, causal, scale, kv_mask=None,
                               uniform_keys=None, q_order=None, kv_order=None, kv_bounds=None):
    check_jagged_attention_args(q, k, v, q_lengths, kv_lengths, bias, causal, scale, kv_mask, uniform_keys,
                                q_order, kv_order, kv_bounds)
    B, H, _, D = k.shape
    Lq = q.shape[2]
    return q.new_empty((B, H, Lq, D)), q.new_empty((B, H, Lq), dtype=compute_dtype(q.dtype))


@torch.library.custom_op("gemcompile::jagged_attention_bwd", mutates_args=())
def jagged_attention_bwd(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    q_lengths: Optional[Tensor],
    kv_lengths: Optional[Tensor],
    bias: Optional[Tensor],
    causal: bool,
    scale: float,
    bias_requires_grad: bool,
    kv_mask: Optional[Tensor] = None,
    uniform_keys: Optional[Tensor] = None,
    q_order: Optional[Tensor] = None,
    kv_order: Optional[Tensor] = None,
    kv_bounds: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq like q, dk, dv, dbias like bias; dbias is an empty tensor unless bias_requires_grad)."""
    _, backward = _kernels(q)
    return backward(grad_out, q, k, v, out, lse, q_lengths, kv_lengths, bias, causal, scale, bias_requires_grad,
                    kv_mask, uniform_keys, q_order=q_order, kv_order=kv_order, kv_bounds=kv_bounds)


@cuda_kernel(jagged_attention_bwd)
def _jagged_attention_bwd_cuda(grad_out, q, k, v, out, lse, q_lengths, kv_lengths, bias, causal, scale,
                               bias_requires_grad, kv_mask=None, uniform_keys=None, q_order=None, kv_order=None,
                               kv_bounds=None):
    """jagged_attention_bwd's arguments, forwarded to the Triton launcher (the reference for float64). Named
    one by one: a caller may leave the trailing optional ones out."""
    _, backward = _kernels(q)
    return backward(grad_out, q, k, v, out, lse, q_lengths, kv_lengths, bias, causal, scale, bias_requires_grad,
                    kv_mask, uniform_keys, q_order=q_order, kv_order=kv_order, kv_bounds=kv_bounds)


@jagged_attention_bwd.register_fake
def _jagged_attention_bwd_fake(
    grad_out, q, k, v, out, lse, q_lengths, kv_lengths, bias, causal, scale, bias_requires_grad, kv_mask=None,
    uniform_keys=None, q_order=None, kv_order=None, kv_bounds=None,
):
    dbias = bias.new_empty(bias.shape) if (bias is not None and bias_requires_grad) else q.new_empty(0)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dbias


def _fwd_setup_context(ctx, inputs, output):
    q, k, v, q_lengths, kv_lengths, bias, causal, scale, *optional = inputs  # kv_mask ... kv_bounds
    out, lse = output
    save_for_backward(ctx, (q, k, v, out, lse, q_lengths, kv_lengths, bias, *optional),
                      (causal, scale), bias=bias, bias_index=5, lse=lse)


def _fwd_backward(ctx, grad_out, grad_lse):
    # grad_lse is ignored: lse is an internal, non-differentiable output
    saved = ctx.saved_tensors
    dq, dk, dv, dbias = torch.ops.gemcompile.jagged_attention_bwd(
        grad_out, *saved[:_SAVED], *ctx.args, ctx.bias_requires_grad, *saved[_SAVED:]
    )
    return input_grads(_INPUTS, dq, dk, dv, dbias if ctx.bias_requires_grad else None)


jagged_attention_fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup_context)


# ---------------------------------------------------------------------------------------------------
# The eager fast path (common/opkit.py says why)


class EagerJaggedAttention(torch.autograd.Function):
    """out = jagged_attention(q, k, v, q_lengths, kv_lengths, bias, causal, scale, kv_mask, uniform_keys)
    through the same kernels as the custom ops; arguments checked by the caller. The lse stays inside the
    Function, so no gradient is ever materialized for it."""

    @staticmethod
    def forward(ctx, q, k, v, q_lengths, kv_lengths, bias, causal: bool, scale: float, kv_mask=None,
                uniform_keys=None, q_order=None, kv_order=None, kv_bounds=None):
        _check_values(q, k, q_lengths, kv_lengths, kv_mask, q_order, kv_order, kv_bounds)
        forward, _ = _kernels(q)
        # derived once here (unless given) and saved: the backward reuses them
        plan = derive_plan(q_lengths, kv_lengths, kv_mask, q_order, kv_order, kv_bounds)
        out, lse = forward(q, k, v, q_lengths, kv_lengths, bias, causal, scale, kv_mask, uniform_keys,
                           **dict(zip(("q_order", "kv_order", "kv_bounds"), plan)))
        save_for_backward(ctx, (q, k, v, out, lse, q_lengths, kv_lengths, bias, kv_mask, uniform_keys, *plan),
                          (causal, scale), bias=bias, bias_index=5)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        saved = ctx.saved_tensors
        _, backward = _kernels(saved[0])
        kv_mask, uniform_keys, q_order, kv_order, kv_bounds = saved[_SAVED:]
        dq, dk, dv, dbias = backward(grad_out, *saved[:_SAVED], *ctx.args, ctx.bias_requires_grad, kv_mask,
                                     uniform_keys, q_order=q_order, kv_order=kv_order, kv_bounds=kv_bounds)
        return input_grads(_INPUTS, dq, dk, dv, dbias if ctx.bias_requires_grad else None)


# ---------------------------------------------------------------------------------------------------
# The public op


LIB.define(
    "jagged_attention(Tensor q, Tensor k, Tensor v, Tensor? q_lengths, Tensor? kv_lengths, Tensor? bias, "
    "bool causal, float scale, Tensor? kv_mask=None, Tensor? uniform_keys=None, Tensor? q_order=None, "
    "Tensor? kv_order=None, Tensor? kv_bounds=None) -> Tensor"
)


def _jagged_attention_composite(q, k, v, q_lengths, kv_lengths, bias, causal, scale, kv_mask=None,
                                uniform_keys=None, q_order=None, kv_order=None, kv_bounds=None):
    optional = (kv_mask, uniform_keys, q_order, kv_order, kv_bounds)
    if takes_eager_path(q):  # plain eager CUDA call: the same kernels, less host time
        check_jagged_attention_args(q, k, v, q_lengths, kv_lengths, bias, causal, scale, *optional)
        return EagerJaggedAttention.apply(q, k, v, q_lengths, kv_lengths, bias, causal, scale, *optional)
    return torch.ops.gemcompile.jagged_attention_fwd(
        q, k, v, q_lengths, kv_lengths, bias, causal, scale, *optional
    )[0]


LIB.impl("jagged_attention", _jagged_attention_composite, "CompositeImplicitAutograd")


def jagged_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_lengths: Optional[Tensor],
    kv_lengths: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    causal: bool = False,
    scale: Optional[float] = None,
    kv_mask: Optional[Tensor] = None,
    uniform_keys: Optional[Tensor] = None,
    q_order: Optional[Tensor] = None,
    kv_order: Optional[Tensor] = None,
    kv_bounds: Optional[Tensor] = None,
) -> Tensor:
    """Python convenience wrapper of ``torch.ops.gemcompile.jagged_attention`` (scale defaults to D**-0.5)."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    optional = (kv_mask, uniform_keys, q_order, kv_order, kv_bounds)
    check_jagged_attention_args(q, k, v, q_lengths, kv_lengths, bias, causal, scale, *optional)
    return torch.ops.gemcompile.jagged_attention(
        q, k, v, q_lengths, kv_lengths, bias, causal, float(scale), *optional
    )


# ---------------------------------------------------------------------------------------------------
# FLOP formulas (raw tensors: lengths and kv_mask are read when they are real; padded count when fake)


def _forward_flops(q, k, q_lengths, kv_lengths, causal, kv_mask=None) -> int:
    B, H, Lk, D = k.shape
    Lq = q.shape[2]
    if any(t is not None and is_fake(t) for t in (q_lengths, kv_lengths, kv_mask)):
        pairs = padded_pairs(B, Lq, Lk, causal)
    else:
        if kv_lengths is None:
            kv_lengths = torch.full((B,), Lk, dtype=torch.int64)
        pairs = attention_pairs(q_lengths, kv_lengths, Lq, Lk, causal, kv_mask)
    return forward_flops(H, D, pairs)


@register_flop_formula(torch.ops.gemcompile.jagged_attention_fwd, get_raw=True)
def _fwd_flops(q, k, v, q_lengths=None, kv_lengths=None, bias=None, causal=False, scale=1.0, kv_mask=None,
               uniform_keys=None, q_order=None, kv_order=None, kv_bounds=None, *, out_val=None, **kwargs) -> int:
    return _forward_flops(q, k, q_lengths, kv_lengths, causal, kv_mask)


@register_flop_formula(torch.ops.gemcompile.jagged_attention_bwd, get_raw=True)
def _bwd_flops(grad_out, q, k, v, out, lse, q_lengths=None, kv_lengths=None, bias=None, causal=False,
               scale=1.0, bias_requires_grad=False, kv_mask=None, uniform_keys=None, q_order=None, kv_order=None,
               kv_bounds=None, *, out_val=None, **kwargs) -> int:
    return int(BACKWARD_FLOPS_RATIO * _forward_flops(q, k, q_lengths, kv_lengths, causal, kv_mask))
