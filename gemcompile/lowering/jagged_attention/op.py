"""``gemcompile::jagged_attention``: softmax attention over jagged (variable-length) sequences.

Public op (what the jagged_attention pass emits; the signature is fixed)::

    torch.ops.gemcompile.jagged_attention(Tensor q, Tensor k, Tensor v, Tensor? q_lengths,
        Tensor? kv_lengths, Tensor? bias, bool causal, float scale, Tensor? kv_mask=None,
        Tensor? uniform_keys=None, Tensor? q_order=None, Tensor? kv_order=None,
        Tensor? kv_bounds=None, Tensor? token_offsets=None, SymInt packed_len=0, float dropout_p=0.0,
        Tensor? dropout_seed=None) -> Tensor

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

token_offsets, packed_len (optional; packed.py): packed keys and values, k and v (T, H, D) with token n of
sequence b at row token_offsets[b] + n, token_offsets (B + 1,) int32/int64 cumulative token counts (each at
most packed_len); packed_len is the padded length N of those sequences (0 and unused without offsets).
q stays dense (Bq, H, Lq, D), or is packed too, (T, H, D), over the same sequences (self-attention,
causal or not; out (T, H, D)). The result equals the padded op on the (B, H, N, D) tensors restricted to
the valid rows (positions n = row - token_offsets[b]: kv_mask (B, N), bias and causal read them); kv_lengths
(and q_lengths for packed q) may be None or the token counts. Packed operands are read in place through any
strides; their gradients come back packed; rows outside every sequence come out 0. Offsets are checked on
CPU (and under strict_length_checks) as lengths are.

dropout_p, dropout_seed (optional): dropout on the attention probabilities, as eager
``dropout(softmax(s), p) @ v`` applies it: each kept pair's probability is divided by 1 - p, the others
are 0 (p drawn to 16 bits, within 2**-17 of the argument: common/dropout.py). The keep mask is drawn
inside the kernels from dropout_seed (an int64 tensor of one element on q's device) with the stream of
common/dropout.py, and drawn again identically in the backward; the references draw the same numbers, so
CPU and CUDA agree for one seed. lse stays the softmax's own.

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
from ..common.dropout import check_dropout, new_seed
from ..common.length_order import check_plan, check_plan_values
from ..common.opkit import (LIB, contiguous_vectors, cuda_kernel, ignoring_plan, input_grads, is_fake,
                           save_for_backward, takes_eager_path, use_triton)
from ..common.reference import compute_dtype
from ..length_order import derive_plan
from .flops import attention_pairs, padded_pairs
from .packed import (check_packed_values, packed_reference_backward, packed_reference_forward, packed_lengths,
                     padded_views)

__all__ = ["EagerJaggedAttention", "check_jagged_attention_args", "jagged_attention"]

_INPUTS = 17  # q, k, v, q_lengths, kv_lengths, bias, causal, scale, kv_mask, uniform_keys, q_order, kv_order,
# kv_bounds, token_offsets, packed_len, dropout_p, dropout_seed
_SAVED = 8  # q, k, v, out, lse, q_lengths, kv_lengths, bias (then kv_mask, uniform_keys, q_order, kv_order,
# kv_bounds, token_offsets, dropout_seed: the bwd op's last tensors; packed_len and dropout_p travel in ctx.args)


def check_jagged_attention_args(q, k, v, q_lengths, kv_lengths, bias, causal, scale, kv_mask=None,
                                uniform_keys=None, q_order=None, kv_order=None, kv_bounds=None, token_offsets=None,
                                packed_len=0, dropout_p=0.0, dropout_seed=None) -> None:
    """Metadata checks of ``gemcompile::jagged_attention``; TypeError/ValueError naming the argument."""
    q, k, v = padded_views(q, k, v, token_offsets, packed_len)  # packed operands: checked as (B, H, N, D)
    B, H, Lq, Lk = checks.check_attention_layout(q, k, v, q_lengths, kv_lengths, "jagged attention kernel")
    if bias is not None:
        checks.check_bias(bias, (B, H, Lq, Lk), q.device)
    checks.check_flags(causal, scale)
    checks.check_kv_mask(kv_mask, B, Lk, q.device)
    checks.check_uniform_keys(uniform_keys, B, q.device)
    check_plan(B, q.device, kv_mask, q_order, kv_order, kv_bounds)
    check_dropout(dropout_p, dropout_seed, Lq, Lk, q.device)


def _check_values(q, k, q_lengths, kv_lengths, kv_mask=None, q_order=None, kv_order=None,
                  kv_bounds=None, token_offsets=None, packed_len=0) -> None:
    check_packed_values(q, k, q_lengths, kv_lengths, token_offsets, packed_len)
    if token_offsets is not None:
        q, k, _ = padded_views(q, k, k, token_offsets, packed_len)
    checks.check_length_values("q_lengths", q_lengths, q.shape[2])
    checks.check_length_values("kv_lengths", kv_lengths, k.shape[2])
    plan = (q_order, kv_order, kv_bounds)
    if any(t is not None and checks.should_check_values(t) for t in plan):
        check_plan_values(q_lengths, kv_lengths, kv_mask, *plan)


def _kernels(q: Tensor):
    """(forward, backward): the Triton launchers on CUDA (imported lazily: CPU-only installs never need
    triton), else the reference; both take the derived tensors as keywords (q_order, kv_order, kv_bounds)."""
    if use_triton(q):
        from . import packed_triton as kernels

        return (contiguous_vectors(kernels.jagged_attention_forward_triton),
                contiguous_vectors(kernels.jagged_attention_backward_triton))
    return ignoring_plan(packed_reference_forward), ignoring_plan(packed_reference_backward)


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
    token_offsets: Optional[Tensor] = None,
    packed_len: int = 0,
    dropout_p: float = 0.0,
    dropout_seed: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """(out (B, H, Lq, D), lse (B, H, Lq) fp32; +inf on rows without a valid key); packed q: (T, H, D), (T, H)."""
    return _jagged_attention_fwd_cuda(q, k, v, q_lengths, kv_lengths, bias, causal, scale, kv_mask, uniform_keys,
                                      q_order, kv_order, kv_bounds, token_offsets, packed_len, dropout_p,
                                      dropout_seed)


def _jagged_attention_fwd_cuda(q, k, v, q_lengths, kv_lengths, bias, causal, scale, kv_mask=None,
                               uniform_keys=None, q_order=None, kv_order=None, kv_bounds=None, token_offsets=None,
                               packed_len=0, dropout_p=0.0, dropout_seed=None):
    """The fwd op on any device: checks, then the kernels (the reference on CPU; tests may route CPU tensors
    to the Triton interpreter)."""
    check_jagged_attention_args(q, k, v, q_lengths, kv_lengths, bias, causal, scale, kv_mask, uniform_keys,
                                q_order, kv_order, kv_bounds, token_offsets, packed_len, dropout_p, dropout_seed)
    _check_values(q, k, q_lengths, kv_lengths, kv_mask, q_order, kv_order, kv_bounds, token_offsets, packed_len)
    forward, _ = _kernels(q)
    return forward(q, k, v, q_lengths, kv_lengths, bias, causal, scale, kv_mask, uniform_keys, dropout_p,
                   dropout_seed, q_order=q_order, kv_order=kv_order, kv_bounds=kv_bounds,
                   **_packed(token_offsets, packed_len))


def _packed(token_offsets, packed_len) -> dict:
    """The packed keywords of the launchers (none without offsets: the padded call is unchanged)."""
    return {} if token_offsets is None else {"token_offsets": token_offsets, "packed_len": packed_len}


cuda_kernel(jagged_attention_fwd)(_jagged_attention_fwd_cuda)


@jagged_attention_fwd.register_fake
def _jagged_attention_fwd_fake(q, k, v, q_lengths, kv_lengths, bias, causal, scale, kv_mask=None,
                               uniform_keys=None, q_order=None, kv_order=None, kv_bounds=None, token_offsets=None,
                               packed_len=0, dropout_p=0.0, dropout_seed=None):
    check_jagged_attention_args(q, k, v, q_lengths, kv_lengths, bias, causal, scale, kv_mask, uniform_keys,
                                q_order, kv_order, kv_bounds, token_offsets, packed_len, dropout_p, dropout_seed)
    if token_offsets is not None and q.dim() == 3:  # packed self-attention
        return q.new_empty(q.shape), q.new_empty(q.shape[:2], dtype=compute_dtype(q.dtype))
    B = k.shape[0] if token_offsets is None else token_offsets.shape[0] - 1
    H, Lq, D = q.shape[1:]
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
    token_offsets: Optional[Tensor] = None,
    packed_len: int = 0,
    dropout_p: float = 0.0,
    dropout_seed: Optional[Tensor] = None,
    grad_lse: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq like q, dk, dv, dbias like bias; dbias is an empty tensor unless bias_requires_grad). grad_lse: the
    gradient of lse when it was used (jagged_attention_lse), else None."""
    return _jagged_attention_bwd_cuda(grad_out, q, k, v, out, lse, q_lengths, kv_lengths, bias, causal, scale,
                                      bias_requires_grad, kv_mask, uniform_keys, q_order, kv_order, kv_bounds,
                                      token_offsets, packed_len, dropout_p, dropout_seed, grad_lse)


def _jagged_attention_bwd_cuda(grad_out, q, k, v, out, lse, q_lengths, kv_lengths, bias, causal, scale,
                               bias_requires_grad, kv_mask=None, uniform_keys=None, q_order=None, kv_order=None,
                               kv_bounds=None, token_offsets=None, packed_len=0, dropout_p=0.0, dropout_seed=None,
                               grad_lse=None):
    """jagged_attention_bwd on any device (the Triton launcher on CUDA, the reference for float64 and on CPU).
    Named one by one: a caller may leave the trailing optional ones out."""
    _, backward = _kernels(q)
    return backward(grad_out, q, k, v, out, lse, q_lengths, kv_lengths, bias, causal, scale, bias_requires_grad,
                    kv_mask, uniform_keys, dropout_p, dropout_seed, grad_lse, q_order=q_order, kv_order=kv_order,
                    kv_bounds=kv_bounds, **_packed(token_offsets, packed_len))


cuda_kernel(jagged_attention_bwd)(_jagged_attention_bwd_cuda)


@jagged_attention_bwd.register_fake
def _jagged_attention_bwd_fake(
    grad_out, q, k, v, out, lse, q_lengths, kv_lengths, bias, causal, scale, bias_requires_grad, kv_mask=None,
    uniform_keys=None, q_order=None, kv_order=None, kv_bounds=None, token_offsets=None, packed_len=0,
    dropout_p=0.0, dropout_seed=None, grad_lse=None,
):
    dbias = bias.new_empty(bias.shape) if (bias is not None and bias_requires_grad) else q.new_empty(0)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dbias


def _fwd_setup_context(ctx, inputs, output):
    # kv_mask, uniform_keys, q_order, kv_order, kv_bounds, token_offsets, then packed_len, dropout_p, dropout_seed
    q, k, v, q_lengths, kv_lengths, bias, causal, scale, *optional = inputs
    tensors, (packed_len, dropout_p, dropout_seed) = optional[:6], optional[6:]
    out, lse = output
    save_for_backward(ctx, (q, k, v, out, lse, q_lengths, kv_lengths, bias, *tensors, dropout_seed),
                      (causal, scale, packed_len, dropout_p), bias=bias, bias_index=5, lse=lse)


def _fwd_backward(ctx, grad_out, grad_lse):
    # grad_lse is ignored: lse is an internal, non-differentiable output (jagged_attention_lse's is not)
    saved = ctx.saved_tensors
    causal, scale, packed_len, dropout_p = ctx.args
    dq, dk, dv, dbias = torch.ops.gemcompile.jagged_attention_bwd(
        grad_out, *saved[:_SAVED], causal, scale, ctx.bias_requires_grad, *saved[_SAVED:-1], packed_len,
        dropout_p, saved[-1], grad_lse if ctx.lse_differentiable else None
    )
    return input_grads(_INPUTS, dq, dk, dv, dbias if ctx.bias_requires_grad else None)


def _fwd_setup_context_internal_lse(ctx, inputs, output):
    _fwd_setup_context(ctx, inputs, output)
    ctx.lse_differentiable = False


jagged_attention_fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup_context_internal_lse)


# jagged_attention_fwd's (out, lse) with lse differentiable: what a caller merges more keys into (the jagged
# family's kept diagonal, passes/attention/kept_diagonal.py). lse is +inf on rows without a valid key; its
# gradient enters the backward as dS = P * (dP - delta + dlse). The fwd op's schema and implementation.
jagged_attention_lse = torch.library.custom_op(
    "gemcompile::jagged_attention_lse", _jagged_attention_fwd_cuda, mutates_args=(),
    schema="(" + str(torch.ops.gemcompile.jagged_attention_fwd.default._schema).split("(", 1)[1])
cuda_kernel(jagged_attention_lse)(_jagged_attention_fwd_cuda)
jagged_attention_lse.register_fake(_jagged_attention_fwd_fake)


def _lse_setup_context(ctx, inputs, output):
    q, k, v, q_lengths, kv_lengths, bias, causal, scale, *optional = inputs
    tensors, (packed_len, dropout_p, dropout_seed) = optional[:6], optional[6:]
    out, lse = output
    save_for_backward(ctx, (q, k, v, out, lse, q_lengths, kv_lengths, bias, *tensors, dropout_seed),
                      (causal, scale, packed_len, dropout_p), bias=bias, bias_index=5)
    ctx.lse_differentiable = True


jagged_attention_lse.register_autograd(_fwd_backward, setup_context=_lse_setup_context)


# ---------------------------------------------------------------------------------------------------
# The eager fast path (common/opkit.py says why)


class EagerJaggedAttention(torch.autograd.Function):
    """out = jagged_attention(q, k, v, q_lengths, kv_lengths, bias, causal, scale, kv_mask, uniform_keys, ...,
    token_offsets, packed_len) through the same kernels as the custom ops; arguments checked by the caller.
    The lse stays inside the Function, so no gradient is ever materialized for it."""

    @staticmethod
    def forward(ctx, q, k, v, q_lengths, kv_lengths, bias, causal: bool, scale: float, kv_mask=None,
                uniform_keys=None, q_order=None, kv_order=None, kv_bounds=None, token_offsets=None, packed_len=0,
                dropout_p=0.0, dropout_seed=None):
        _check_values(q, k, q_lengths, kv_lengths, kv_mask, q_order, kv_order, kv_bounds, token_offsets,
                      packed_len)
        forward, _ = _kernels(q)
        # derived once here (unless given) and saved: the backward reuses them
        plan = derive_plan(q_lengths, kv_lengths, kv_mask, q_order, kv_order, kv_bounds)
        out, lse = forward(q, k, v, q_lengths, kv_lengths, bias, causal, scale, kv_mask, uniform_keys, dropout_p,
                           dropout_seed, **dict(zip(("q_order", "kv_order", "kv_bounds"), plan)),
                           **_packed(token_offsets, packed_len))
        save_for_backward(ctx, (q, k, v, out, lse, q_lengths, kv_lengths, bias, kv_mask, uniform_keys, *plan,
                                token_offsets, dropout_seed), (causal, scale, packed_len, dropout_p), bias=bias,
                          bias_index=5)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        saved = ctx.saved_tensors
        _, backward = _kernels(saved[0])
        kv_mask, uniform_keys, q_order, kv_order, kv_bounds, token_offsets, dropout_seed = saved[_SAVED:]
        causal, scale, packed_len, dropout_p = ctx.args
        dq, dk, dv, dbias = backward(grad_out, *saved[:_SAVED], causal, scale, ctx.bias_requires_grad, kv_mask,
                                     uniform_keys, dropout_p, dropout_seed, q_order=q_order, kv_order=kv_order,
                                     kv_bounds=kv_bounds, **_packed(token_offsets, packed_len))
        return input_grads(_INPUTS, dq, dk, dv, dbias if ctx.bias_requires_grad else None)


# ---------------------------------------------------------------------------------------------------
# The public op


LIB.define(
    "jagged_attention(Tensor q, Tensor k, Tensor v, Tensor? q_lengths, Tensor? kv_lengths, Tensor? bias, "
    "bool causal, float scale, Tensor? kv_mask=None, Tensor? uniform_keys=None, Tensor? q_order=None, "
    "Tensor? kv_order=None, Tensor? kv_bounds=None, Tensor? token_offsets=None, SymInt packed_len=0, "
    "float dropout_p=0.0, Tensor? dropout_seed=None) -> Tensor"
)


def _jagged_attention_composite(q, k, v, q_lengths, kv_lengths, bias, causal, scale, kv_mask=None,
                                uniform_keys=None, q_order=None, kv_order=None, kv_bounds=None, token_offsets=None,
                                packed_len=0, dropout_p=0.0, dropout_seed=None):
    optional = (kv_mask, uniform_keys, q_order, kv_order, kv_bounds, token_offsets, packed_len, dropout_p,
                dropout_seed)
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
    token_offsets: Optional[Tensor] = None,
    packed_len: int = 0,
    dropout_p: float = 0.0,
    dropout_seed: Optional[Tensor] = None,
) -> Tensor:
    """Python convenience wrapper of ``torch.ops.gemcompile.jagged_attention`` (scale defaults to D**-0.5).
    token_offsets, packed_len: packed k, v (T, H, D) (and q: self-attention), see the module docstring.
    dropout_p > 0 without a dropout_seed draws one (common/dropout.new_seed)."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if dropout_p and dropout_seed is None:
        dropout_seed = new_seed(q.device)
    optional = (kv_mask, uniform_keys, q_order, kv_order, kv_bounds, token_offsets, packed_len, float(dropout_p),
                dropout_seed)
    check_jagged_attention_args(q, k, v, q_lengths, kv_lengths, bias, causal, scale, *optional)
    return torch.ops.gemcompile.jagged_attention(
        q, k, v, q_lengths, kv_lengths, bias, causal, float(scale), *optional
    )


# ---------------------------------------------------------------------------------------------------
# FLOP formulas (raw tensors: lengths and kv_mask are read when they are real; padded count when fake)


def _forward_flops(q, k, q_lengths, kv_lengths, causal, kv_mask=None, token_offsets=None, packed_len=0) -> int:
    if token_offsets is not None:  # the packed side's lengths are the offsets' token counts
        kv_lengths = token_offsets if is_fake(token_offsets) else packed_lengths(token_offsets)
        q_lengths = kv_lengths if q.dim() == 3 else q_lengths
        q, k, _ = padded_views(q, k, k, token_offsets, packed_len)
    B, H, Lk, D = k.shape
    Lq = q.shape[2]
    if any(t is not None and is_fake(t) for t in (q_lengths, kv_lengths, kv_mask)):  # (fake offsets too)
        pairs = padded_pairs(B, Lq, Lk, causal)
    else:
        if kv_lengths is None:
            kv_lengths = torch.full((B,), Lk, dtype=torch.int64)
        pairs = attention_pairs(q_lengths, kv_lengths, Lq, Lk, causal, kv_mask)
    return forward_flops(H, D, pairs)


@register_flop_formula([torch.ops.gemcompile.jagged_attention_fwd, torch.ops.gemcompile.jagged_attention_lse],
                       get_raw=True)
def _fwd_flops(q, k, v, q_lengths=None, kv_lengths=None, bias=None, causal=False, scale=1.0, kv_mask=None,
               uniform_keys=None, q_order=None, kv_order=None, kv_bounds=None, token_offsets=None, packed_len=0,
               dropout_p=0.0, dropout_seed=None, *, out_val=None, **kwargs) -> int:
    return _forward_flops(q, k, q_lengths, kv_lengths, causal, kv_mask, token_offsets, packed_len)


@register_flop_formula(torch.ops.gemcompile.jagged_attention_bwd, get_raw=True)
def _bwd_flops(grad_out, q, k, v, out, lse, q_lengths=None, kv_lengths=None, bias=None, causal=False,
               scale=1.0, bias_requires_grad=False, kv_mask=None, uniform_keys=None, q_order=None, kv_order=None,
               kv_bounds=None, token_offsets=None, packed_len=0, dropout_p=0.0, dropout_seed=None, grad_lse=None, *,
               out_val=None, **kwargs) -> int:
    return int(BACKWARD_FLOPS_RATIO * _forward_flops(q, k, q_lengths, kv_lengths, causal, kv_mask, token_offsets,
                                                     packed_len))
