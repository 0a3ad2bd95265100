"""``gemcompile::gdpa``: generalized dot-product attention (GDPA), a pointwise activation instead of softmax.

Public op (the signature is fixed)::

    torch.ops.gemcompile.gdpa(Tensor q, Tensor k, Tensor v, Tensor? q_lengths, Tensor? kv_lengths,
        Tensor? bias, str activation, float scale, float out_scale, bool divide_by_kv_length,
        bool causal, int window, Tensor? num_targets=None, int contextual_len=0,
        int? relative_offset=None, Tensor? kv_mask=None, Tensor? q_order=None, Tensor? kv_order=None,
        Tensor? kv_bounds=None, Tensor? token_offsets=None, SymInt packed_len=0) -> Tensor

The last nine arguments (HSTU's target mask and contextual prefix, a relative bias table, a key mask, the
derived tensors) have defaults: callers that pass the first twelve keep the plain causal/window semantics
and a dense bias.

q_order, kv_order, kv_bounds (optional; defined in common/length_order.py): the longest-first order of
q_lengths, of kv_lengths (of the key span with a kv_mask), and the (B, 3) key bounds of kv_mask. The
attention rewrite passes them from one ``gemcompile::length_order`` / ``gemcompile::key_bounds`` per
distinct lengths or mask, so a step derives each once for all its attention calls, forward and backward;
left out, the kernels derive their own. They change no value; wrong ones are refused on CPU and under
``strict_length_checks``. They travel beside the spec, like num_targets and kv_mask.

token_offsets, packed_len (optional; packed.py): packed queries. q (T, H, D) holds the valid query rows of
every sequence back to back (token n of sequence b at row token_offsets[b] + n; any strides, e.g. a
(T, H * D) Linear output viewed as (T, H, D) is read in place), token_offsets (B + 1,) int32/int64 the
cumulative token counts (each at most packed_len), packed_len the padded query length N. The output and dq
are (T, H, D) (rows outside every sequence: 0); k, v and the rest stay padded. The result equals the
padded op on (B, H, N, D) queries restricted to the valid rows: query positions are n = row -
token_offsets[b] for causal, window, bias and relative tables. Not with num_targets / contextual_len > 0
(ValueError). Offsets values are checked on CPU (and under strict_length_checks) as lengths are.

Inputs
------
* q (Bq, H, Lq, D) with Bq in {1, B} (Bq = 1: learned queries shared by the batch, e.g. PMA); k, v
  (B, H, Lk, D); any strides (permuted or expanded views are read in place). One float dtype and one
  device for q, k, v; head dims 16 <= D <= 128 (the Triton kernels' limits, as for jagged attention).
* q_lengths / kv_lengths: int32 or int64 (B,), or None (every one of the Lq query rows / Lk keys is
  valid). Values are checked to lie in [0, L] on CPU; on CUDA they are clamped into [0, L] inside the
  kernels and checked only under :func:`gemcompile.lowering.common.checks.strict_length_checks`.
* bias: None or 4-D broadcastable to (B, H, Lq, Lk) (each dim equal or 1), any float dtype, added to the
  scaled scores; may require grad (its gradient is summed over its broadcast dims).
* relative_offset: None, or an int: then bias is a relative-position table (T,) or (T, Hz), Hz in {1, H},
  read as bias[b, h, i, j] = table[j - i + relative_offset, h] (every position inside the table, else
  ValueError); its gradient has the table's shape (relative_table.py).
* activation: one of :data:`GDPA_ACTIVATIONS`: "identity", "relu", "relu_squared" (relu(x)**2), "silu",
  "sigmoid", "gelu" (exact, erf), "gelu_tanh" (tanh approximation, as F.gelu(approximate="tanh")).
* window >= 0; 0 means no window.
* num_targets: None or int32/int64 (B,) on q's device: the last num_targets[b] of sequence b's kv_len_b
  positions are targets (HSTU). Values are used as given; on CPU they are checked to lie in
  [0, kv_len_b] (ValueError otherwise); on CUDA they are checked only under strict_length_checks (no
  host sync).
* contextual_len: int >= 0 (TypeError/ValueError otherwise): the first contextual_len positions are a
  contextual prefix (HSTU), seen by every later position and seeing every non-target position.
* num_targets or contextual_len > 0 require causal=True, kv_lengths not None, Lq == Lk and Bq == B (no
  shared queries); ValueError naming the argument otherwise.
* kv_mask: None or a torch.bool (B, Lk) tensor on q's device (B = k's batch, also with shared queries),
  any strides (a (1, Lk) mask expanded to (B, Lk) is read in place): key j of batch b is valid only where
  kv_mask[b, j] is True (and j < kv_len_b). Not served with num_targets or contextual_len > 0
  (ValueError). Wrong dtype, shape or device: ValueError naming kv_mask.

Semantics
---------
For batch b, the pair (i, j) is valid when i < q_len_b and j < kv_len_b and kv_mask[b, j] (when given)
and (not causal or j <= i, top-left aligned) and (window == 0 or (i - j <= window if causal else
|i - j| <= window)). Positions are absolute: a mask with holes or left padding shifts nothing.

With num_targets or contextual_len > 0 (causal), the visibility uses clamped position ids. With
n = kv_len_b, t = num_targets[b] (only when given), c = contextual_len::

    ii, jj, m = i, j, n
    if c > 0:  ii = max(i - c + 1, 0); jj = max(j - c + 1, 0); m = n - c + 1
    if num_targets is not None:  m = m - t;  ii = min(ii, m);  jj = min(jj, m)
    d = ii - jj
    visible = (i == j) or (d > 0)              # causal
    if window > 0: visible = visible and (d <= window)
    if c > 0:      visible = visible or (ii == 0 and jj < m)
    valid(i, j) = visible and i < q_len_b and j < n

so a target sees the non-target history (within the window of its clamped id) and itself, never another
target; when m >= 1 (n - t >= c) the contextual rows i < c see every non-target key and every row sees
the contextual keys (within the window). Without num_targets and with c == 0 this is exactly the
causal/window rule above (d = i - j).

With s_ij = scale * q_i . k_j + bias_ij::

    out[b, h, i] = c_b * sum over valid j of act(s_ij) * v_j,
    c_b = out_scale * (1 / kv_len_b if divide_by_kv_length else 1)

where kv_len_b is the clamped length (Lk when kv_lengths is None; kv_mask does not change it). Rows
without a valid pair and padded query rows (i >= q_len_b) are exactly 0; with divide_by_kv_length and
kv_len_b == 0 the output is 0 (no NaN or inf). Garbage (NaN/inf) at padded positions of q, k, v, bias or
grad_out (masked-out keys included) never leaks; keys with kv_mask False get exactly zero dk, dv. The
bias must be finite on valid pairs: it is not a mask (act(-inf) is activation-specific, e.g. NaN for
silu). Output: contiguous (B, H, Lq, D) in q's dtype; accumulation in fp32 (fp64 for float64 inputs).

Gradients (q, k, v, bias): with a = act(s), m the valid mask, dA_ij = c_b m_ij (dO_i . v_j),
dS = dA * act'(s): dV = c_b (m a)^T dO, dQ = scale dS K (summed over the batch when q is shared),
dK = scale dS^T Q, dbias = dS summed over the bias's broadcast dims. Deterministic, no atomics. act' of
relu and relu_squared is 0 at 0, as torch's autograd. No double backward.

How it is wired (as every attention op, see common/opkit.py)
-----------------------------------------------------------
* ``gemcompile::gdpa_fwd(...) -> out``: a ``torch.library.custom_op`` (opaque to Dynamo/Inductor) with a
  fake impl and ``register_autograd``; the backward needs only the inputs (no softmax statistics).
* ``gemcompile::gdpa_bwd(grad_out, q, k, v, ..., bias_requires_grad, num_targets=None, contextual_len=0,
  relative_offset=None, kv_mask=None, q_order=None, kv_order=None, kv_bounds=None, token_offsets=None,
  packed_len=0) -> (dq, dk, dv, dbias)``: a custom_op with a fake impl (dbias is an empty tensor when not
  needed). ``gdpa_fwd`` ends with the same arguments after ``kv_mask``.
* ``gemcompile::gdpa``: the public op, ``CompositeImplicitAutograd``, which calls ``gdpa_fwd``. A plain
  eager call on CUDA (no tracing, no dispatch mode) skips the custom ops and runs the same kernels
  through one autograd.Function (:class:`EagerGDPA`): less host time per step.
* Past the schema, the flags travel as one frozen :class:`~gemcompile.lowering.gdpa.spec.GdpaSpec`
  (spec.py) through the checks, the reference, the Triton launchers, the FLOP formula and the eager path.

Dispatch: CUDA runs the Triton kernels of triton.py (float64 falls back to the reference); every other
device runs the plain-PyTorch reference of reference.py. Neither path syncs with the host.

FLOPs: ``torch.utils.flop_counter`` formulas on gdpa_fwd / gdpa_bwd count the valid pairs from the real
lengths and kv_mask (causal, window, targets and contextual prefix included; the padded causal/window
count when the lengths, num_targets or kv_mask are fake): forward 4*H*D*pairs, backward 2.5x forward
(flops.py).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from ..common import checks
from ..common.flops import BACKWARD_FLOPS_RATIO, forward_flops
from ..common.length_order import check_plan, check_plan_values
from ..common.opkit import (LIB, contiguous_vectors, cuda_kernel, ignoring_plan, input_grads, is_fake,
                           save_for_backward, takes_eager_path, use_triton)
from ..common.packed import packed_lengths
from ..length_order import derive_plan
from .flops import gdpa_pairs, padded_gdpa_pairs
from .packed import check_packed_values, packed_reference_backward, packed_reference_forward, padded_query
from .relative_table import check_relative_table
from .spec import GDPA_ACTIVATIONS, GdpaSpec

__all__ = ["EagerGDPA", "check_gdpa_args", "gdpa"]

_SCHEMA_INPUTS = 21  # gdpa_fwd's arguments, q to packed_len
_EAGER_INPUTS = 14  # EagerGDPA's: q, k, v, q_lengths, kv_lengths, bias, spec, num_targets, kv_mask, q_order,
# kv_order, kv_bounds, token_offsets, packed_len
_FLAGS = 10  # gdpa_fwd's arguments after bias up to kv_mask (GdpaSpec.from_schema's); then the 3 derived and
# the 2 of packed queries
_PLAN = ("q_order", "kv_order", "kv_bounds", "token_offsets", "packed_len")


def _split_plan(flags: tuple, count: int = _FLAGS) -> tuple[tuple, dict]:
    """(the schema's flags after bias up to kv_mask, {q_order, kv_order, kv_bounds, token_offsets,
    packed_len} that follow them; keywords of the checks and kernels)."""
    return flags[:count], dict(zip(_PLAN, flags[count:]))


# ---------------------------------------------------------------------------------------------------
# Input checks (metadata only: they also run on fake tensors while tracing)


def check_gdpa_args(q, k, v, q_lengths, kv_lengths, bias, spec: GdpaSpec, num_targets=None,
                    kv_mask=None, q_order=None, kv_order=None, kv_bounds=None, token_offsets=None,
                    packed_len=0) -> None:
    """Metadata checks of ``gemcompile::gdpa``; TypeError/ValueError naming the argument."""
    q = padded_query(q, k, token_offsets, packed_len, num_targets, spec.contextual_len)  # packed: as (B, H, N, D)
    B, H, Lq, Lk = checks.check_attention_layout(q, k, v, q_lengths, kv_lengths, "gdpa kernels")
    if spec.relative_offset is not None:
        check_relative_table(bias, spec.relative_offset, H, Lq, Lk, q.device)
    elif bias is not None:
        checks.check_bias(bias, (B, H, Lq, Lk), q.device)
    if not isinstance(spec.activation, str) or spec.activation not in GDPA_ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(GDPA_ACTIVATIONS)}; got {spec.activation!r}")
    checks.check_flags(spec.causal, spec.scale)
    checks.check_number("out_scale", spec.out_scale)
    if not isinstance(spec.divide_by_kv_length, bool):
        raise TypeError(f"divide_by_kv_length must be a bool, got {type(spec.divide_by_kv_length).__name__}")
    window = spec.window
    if isinstance(window, bool) or not isinstance(window, (int, torch.SymInt)):
        raise TypeError(f"window must be an int, got {type(window).__name__}")
    if isinstance(window, int) and window < 0:
        raise ValueError(f"window must be >= 0 (0: no window), got {window}")
    _check_hstu_args(q, k, kv_lengths, spec.causal, num_targets, spec.contextual_len)
    if kv_mask is not None:
        _check_kv_mask(kv_mask, B, Lk, q.device, num_targets, spec.contextual_len)
    check_plan(B, q.device, kv_mask, q_order, kv_order, kv_bounds)


def _check_kv_mask(kv_mask, B, Lk, device, num_targets, contextual_len) -> None:
    """kv_mask: common/checks.py's check, and not with HSTU's targets or prefix."""
    checks.check_kv_mask(kv_mask, B, Lk, device)
    if num_targets is not None or (isinstance(contextual_len, int) and contextual_len != 0):
        raise ValueError("kv_mask is not served together with num_targets or contextual_len > 0")


def _check_hstu_args(q, k, kv_lengths, causal, num_targets, contextual_len) -> None:
    """num_targets / contextual_len: types, and what they require (causal, kv_lengths, Lq == Lk, Bq == B)."""
    if isinstance(contextual_len, bool) or not isinstance(contextual_len, (int, torch.SymInt)):
        raise TypeError(f"contextual_len must be an int, got {type(contextual_len).__name__}")
    if isinstance(contextual_len, int) and contextual_len < 0:
        raise ValueError(f"contextual_len must be >= 0 (0: no contextual prefix), got {contextual_len}")
    B = k.shape[0]
    if num_targets is not None:
        checks.check_index_vector("num_targets", num_targets, B, "B", q.device)
    used = []
    if num_targets is not None:
        used.append("num_targets")
    if contextual_len != 0:
        used.append("contextual_len > 0")
    if not used:
        return
    name = " and ".join(used) + (" require" if len(used) > 1 else " requires")
    if not causal:
        raise ValueError(f"{name} causal=True")
    if kv_lengths is None:
        raise ValueError(f"{name} kv_lengths (the sequence lengths), got None")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"{name} self-attention with Lq == Lk, got Lq {q.shape[2]}, Lk {k.shape[2]}")
    if q.shape[0] != B:
        raise ValueError(
            f"{name} q's batch size to be k's batch size {B} (no shared queries), got {q.shape[0]}"
        )


def _check_values(q, k, q_lengths, kv_lengths, num_targets=None, kv_mask=None, q_order=None, kv_order=None,
                  kv_bounds=None, token_offsets=None, packed_len=0) -> None:
    check_packed_values(q, q_lengths, token_offsets, packed_len)
    q = padded_query(q, k, token_offsets, packed_len)
    checks.check_length_values("q_lengths", q_lengths, q.shape[2])
    checks.check_length_values("kv_lengths", kv_lengths, k.shape[2])
    plan = (q_order, kv_order, kv_bounds)
    if any(t is not None and checks.should_check_values(t) for t in plan):
        check_plan_values(q_lengths, kv_lengths, kv_mask, *plan)
    if num_targets is None or kv_lengths is None or not checks.should_check_values(num_targets):
        return
    n = kv_lengths.clamp(0, k.shape[2])
    bad = (num_targets < 0) | (num_targets > n)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"num_targets[{i}] = {int(num_targets[i])} is outside [0, {int(n[i])}] (the kv length of "
            f"sequence {i})"
        )


def _kernels(q: Tensor):
    """(forward, backward): the Triton launchers on CUDA (imported lazily: CPU-only installs never need
    triton), else the reference. Both take (..., bias, spec, num_targets[, bias_requires_grad], kv_mask) and
    the derived tensors as keywords (q_order, kv_order, kv_bounds)."""
    if use_triton(q):
        from . import triton as kernels

        return contiguous_vectors(kernels.gdpa_forward_triton), contiguous_vectors(kernels.gdpa_backward_triton)
    return ignoring_plan(packed_reference_forward), ignoring_plan(packed_reference_backward)


def _forward(q, k, v, q_lengths, kv_lengths, bias, spec: GdpaSpec, num_targets, kv_mask=None, **plan):
    """The checked forward of every path (the ops' CPU and CUDA kernels, the eager Function)."""
    _check_values(q, k, q_lengths, kv_lengths, num_targets, kv_mask, **plan)
    forward, _ = _kernels(q)
    return forward(q, k, v, q_lengths, kv_lengths, bias, spec, num_targets, kv_mask, **plan)


# ---------------------------------------------------------------------------------------------------
# The custom ops: the schema's positional flags become one GdpaSpec here


@torch.library.custom_op("gemcompile::gdpa_fwd", mutates_args=())
def gdpa_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_lengths: Optional[Tensor],
    kv_lengths: Optional[Tensor],
    bias: Optional[Tensor],
    activation: str,
    scale: float,
    out_scale: float,
    divide_by_kv_length: bool,
    causal: bool,
    window: int,
    num_targets: Optional[Tensor] = None,
    contextual_len: int = 0,
    relative_offset: Optional[int] = None,
    kv_mask: Optional[Tensor] = None,
    q_order: Optional[Tensor] = None,
    kv_order: Optional[Tensor] = None,
    kv_bounds: Optional[Tensor] = None,
    token_offsets: Optional[Tensor] = None,
    packed_len: int = 0,
) -> Tensor:
    """out (B, H, Lq, D) contiguous in q's dtype; packed q: (T, H, D)."""
    spec, num_targets, kv_mask = GdpaSpec.from_schema(activation, scale, out_scale, divide_by_kv_length,
                                                      causal, window, num_targets, contextual_len,
                                                      relative_offset, kv_mask)
    plan = dict(q_order=q_order, kv_order=kv_order, kv_bounds=kv_bounds, token_offsets=token_offsets,
                packed_len=packed_len)
    check_gdpa_args(q, k, v, q_lengths, kv_lengths, bias, spec, num_targets, kv_mask, **plan)
    _check_values(q, k, q_lengths, kv_lengths, num_targets, kv_mask, **plan)
    forward, _ = _kernels(q)  # the reference (tests may route CPU tensors to the Triton interpreter)
    return forward(q, k, v, q_lengths, kv_lengths, bias, spec, num_targets, kv_mask, **plan)


@cuda_kernel(gdpa_fwd)
def _gdpa_fwd_cuda(q, k, v, q_lengths, kv_lengths, bias, *flags):
    flags, plan = _split_plan(flags)
    spec, num_targets, kv_mask = GdpaSpec.from_schema(*flags)
    check_gdpa_args(q, k, v, q_lengths, kv_lengths, bias, spec, num_targets, kv_mask, **plan)
    return _forward(q, k, v, q_lengths, kv_lengths, bias, spec, num_targets, kv_mask, **plan)


@gdpa_fwd.register_fake
def _gdpa_fwd_fake(q, k, v, q_lengths, kv_lengths, bias, *flags):
    flags, plan = _split_plan(flags)
    check_gdpa_args(q, k, v, q_lengths, kv_lengths, bias, *GdpaSpec.from_schema(*flags), **plan)
    if plan.get("token_offsets") is not None:  # packed q: packed out
        return q.new_empty(q.shape)
    B, H, _, D = k.shape
    return q.new_empty((B, H, q.shape[2], D))


@torch.library.custom_op("gemcompile::gdpa_bwd", mutates_args=())
def gdpa_bwd(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_lengths: Optional[Tensor],
    kv_lengths: Optional[Tensor],
    bias: Optional[Tensor],
    activation: str,
    scale: float,
    out_scale: float,
    divide_by_kv_length: bool,
    causal: bool,
    window: int,
    bias_requires_grad: bool,
    num_targets: Optional[Tensor] = None,
    contextual_len: int = 0,
    relative_offset: Optional[int] = None,
    kv_mask: Optional[Tensor] = None,
    q_order: Optional[Tensor] = None,
    kv_order: Optional[Tensor] = None,
    kv_bounds: Optional[Tensor] = None,
    token_offsets: Optional[Tensor] = None,
    packed_len: int = 0,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq like q, dk, dv, dbias like bias; dbias is an empty tensor unless bias_requires_grad)."""
    flags = GdpaSpec.from_bwd_schema(activation, scale, out_scale, divide_by_kv_length, causal, window,
                                     bias_requires_grad, num_targets, contextual_len, relative_offset,
                                     kv_mask)
    _, backward = _kernels(q)
    return backward(grad_out, q, k, v, q_lengths, kv_lengths, bias, *flags, q_order=q_order, kv_order=kv_order,
                    kv_bounds=kv_bounds, token_offsets=token_offsets, packed_len=packed_len)


@cuda_kernel(gdpa_bwd)
def _gdpa_bwd_cuda(grad_out, q, k, v, q_lengths, kv_lengths, bias, *flags):
    _, backward = _kernels(q)
    flags, plan = _split_plan(flags, _FLAGS + 1)
    return backward(grad_out, q, k, v, q_lengths, kv_lengths, bias, *GdpaSpec.from_bwd_schema(*flags), **plan)


@gdpa_bwd.register_fake
def _gdpa_bwd_fake(grad_out, q, k, v, q_lengths, kv_lengths, bias, activation, scale, out_scale,
                   divide_by_kv_length, causal, window, bias_requires_grad, num_targets=None,
                   contextual_len=0, relative_offset=None, kv_mask=None, q_order=None, kv_order=None,
                   kv_bounds=None, token_offsets=None, packed_len=0):
    dbias = bias.new_empty(bias.shape) if (bias is not None and bias_requires_grad) else q.new_empty(0)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dbias


def _fwd_setup_context(ctx, inputs, output):
    q, k, v, q_lengths, kv_lengths, bias, *flags = inputs
    flags, plan = _split_plan(tuple(flags))
    spec, num_targets, kv_mask = GdpaSpec.from_schema(*flags)
    packed_len = plan.pop("packed_len", 0)  # an int: beside the spec, not saved as a tensor
    save_for_backward(ctx, (q, k, v, q_lengths, kv_lengths, bias, num_targets, kv_mask, *plan.values()), spec,
                      bias=bias, bias_index=5)
    ctx.packed_len = packed_len


def _fwd_backward(ctx, grad_out):
    q, k, v, q_lengths, kv_lengths, bias, num_targets, kv_mask, *plan = ctx.saved_tensors
    flags = ctx.args.bwd_schema_args(ctx.bias_requires_grad, num_targets, kv_mask)
    dq, dk, dv, dbias = torch.ops.gemcompile.gdpa_bwd(grad_out, q, k, v, q_lengths, kv_lengths, bias, *flags,
                                                      *plan, ctx.packed_len)
    return input_grads(_SCHEMA_INPUTS, dq, dk, dv, dbias if ctx.bias_requires_grad else None)


gdpa_fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup_context)


# ---------------------------------------------------------------------------------------------------
# Eager fast path (common/opkit.py says why)


class EagerGDPA(torch.autograd.Function):
    """out = gdpa(q, k, v, q_lengths, kv_lengths, bias, spec, num_targets, kv_mask) in one
    autograd.Function, calling the same kernels as the custom ops; arguments are checked by the caller.
    Taken for plain eager CUDA calls; runs the reference elsewhere."""

    @staticmethod
    def forward(ctx, q, k, v, q_lengths, kv_lengths, bias, spec: GdpaSpec, num_targets, kv_mask=None,
                q_order=None, kv_order=None, kv_bounds=None, token_offsets=None, packed_len=0):
        # derived once here (unless given) and saved: the backward reuses them
        plan = (*derive_plan(q_lengths, kv_lengths, kv_mask, q_order, kv_order, kv_bounds), token_offsets)
        out = _forward(q, k, v, q_lengths, kv_lengths, bias, spec, num_targets, kv_mask, **dict(zip(_PLAN, plan)),
                       packed_len=packed_len)
        save_for_backward(ctx, (q, k, v, q_lengths, kv_lengths, bias, num_targets, kv_mask, *plan), spec,
                          bias=bias, bias_index=5)
        ctx.packed_len = packed_len
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, q_lengths, kv_lengths, bias, num_targets, kv_mask, *plan = ctx.saved_tensors
        _, backward = _kernels(q)
        dq, dk, dv, dbias = backward(grad_out, q, k, v, q_lengths, kv_lengths, bias, ctx.args, num_targets,
                                     ctx.bias_requires_grad, kv_mask, **dict(zip(_PLAN, plan)),
                                     packed_len=ctx.packed_len)
        return input_grads(_EAGER_INPUTS, dq, dk, dv, dbias if ctx.bias_requires_grad else None)


# ---------------------------------------------------------------------------------------------------
# The public op


LIB.define(
    "gdpa(Tensor q, Tensor k, Tensor v, Tensor? q_lengths, Tensor? kv_lengths, Tensor? bias, str activation, "
    "float scale, float out_scale, bool divide_by_kv_length, bool causal, int window, "
    "Tensor? num_targets=None, int contextual_len=0, int? relative_offset=None, Tensor? kv_mask=None, "
    "Tensor? q_order=None, Tensor? kv_order=None, Tensor? kv_bounds=None, Tensor? token_offsets=None, "
    "SymInt packed_len=0) -> Tensor"
)


def _gdpa_composite(q, k, v, q_lengths, kv_lengths, bias, *flags):
    if takes_eager_path(q):  # plain eager CUDA call: the same kernels, less host time
        spec_flags, plan = _split_plan(flags)
        spec, num_targets, kv_mask = GdpaSpec.from_schema(*spec_flags)
        check_gdpa_args(q, k, v, q_lengths, kv_lengths, bias, spec, num_targets, kv_mask, **plan)
        return EagerGDPA.apply(q, k, v, q_lengths, kv_lengths, bias, spec, num_targets, kv_mask, *plan.values())
    return torch.ops.gemcompile.gdpa_fwd(q, k, v, q_lengths, kv_lengths, bias, *flags)


LIB.impl("gdpa", _gdpa_composite, "CompositeImplicitAutograd")


def gdpa(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_lengths: Optional[Tensor] = None,
    kv_lengths: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    activation: str = "silu",
    scale: Optional[float] = None,
    out_scale: float = 1.0,
    divide_by_kv_length: bool = False,
    causal: bool = False,
    window: int = 0,
    num_targets: Optional[Tensor] = None,
    contextual_len: int = 0,
    relative_offset: Optional[int] = None,
    kv_mask: Optional[Tensor] = None,
    q_order: Optional[Tensor] = None,
    kv_order: Optional[Tensor] = None,
    kv_bounds: Optional[Tensor] = None,
    token_offsets: Optional[Tensor] = None,
    packed_len: int = 0,
) -> Tensor:
    """Python convenience wrapper of ``torch.ops.gemcompile.gdpa`` (scale defaults to D**-0.5).
    relative_offset: ``bias`` is a relative-position table (T,) or (T, Hz) read as
    bias[b, h, i, j] = table[j - i + relative_offset, h] (relative_table.py). kv_mask: bool (B, Lk), the
    valid keys (besides kv_lengths). token_offsets, packed_len: packed q (T, H, D) -> packed out (module
    docstring)."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    spec = GdpaSpec(activation, scale, out_scale, divide_by_kv_length, causal, window, contextual_len,
                    relative_offset)
    # checked here too so that a wrongly typed argument gets our message, not the dispatcher's
    check_gdpa_args(q, k, v, q_lengths, kv_lengths, bias, spec, num_targets, kv_mask, q_order, kv_order,
                    kv_bounds, token_offsets, packed_len)
    spec = dataclasses.replace(spec, scale=float(scale), out_scale=float(out_scale))
    flags = spec.schema_args(num_targets, kv_mask)
    return torch.ops.gemcompile.gdpa(q, k, v, q_lengths, kv_lengths, bias, *flags, q_order, kv_order, kv_bounds,
                                     token_offsets, packed_len)


# ---------------------------------------------------------------------------------------------------
# FLOP formulas (raw tensors: the lengths are read when they are real; padded count when fake)


def _forward_flops(q, k, q_lengths, kv_lengths, spec: GdpaSpec, num_targets, kv_mask=None, token_offsets=None,
                   packed_len=0) -> int:
    if token_offsets is not None:  # packed q: its lengths are the offsets' token counts (fake: padded count)
        q_lengths = token_offsets if is_fake(token_offsets) else packed_lengths(token_offsets)
        q = padded_query(q, k, token_offsets, packed_len)
    B, H, Lk, D = k.shape
    Lq = q.shape[2]
    window = int(spec.window)
    if any(t is not None and is_fake(t) for t in (q_lengths, kv_lengths, num_targets, kv_mask)):
        pairs = padded_gdpa_pairs(B, Lq, Lk, spec.causal, window)
    else:
        pairs = gdpa_pairs(q_lengths, kv_lengths, B, Lq, Lk, spec.causal, window, num_targets,
                           int(spec.contextual_len), kv_mask)
    return forward_flops(H, D, pairs)


@register_flop_formula(torch.ops.gemcompile.gdpa_fwd, get_raw=True)
def _fwd_flops(q, k, v, q_lengths=None, kv_lengths=None, bias=None, activation="silu", scale=1.0, out_scale=1.0,
               divide_by_kv_length=False, causal=False, window=0, num_targets=None, contextual_len=0,
               relative_offset=None, kv_mask=None, q_order=None, kv_order=None, kv_bounds=None, token_offsets=None,
               packed_len=0, *, out_val=None, **kwargs) -> int:
    spec, num_targets, kv_mask = GdpaSpec.from_schema(activation, scale, out_scale, divide_by_kv_length,
                                                      causal, window, num_targets, contextual_len,
                                                      relative_offset, kv_mask)
    return _forward_flops(q, k, q_lengths, kv_lengths, spec, num_targets, kv_mask, token_offsets, packed_len)


@register_flop_formula(torch.ops.gemcompile.gdpa_bwd, get_raw=True)
def _bwd_flops(grad_out, q, k, v, q_lengths=None, kv_lengths=None, bias=None, activation="silu", scale=1.0,
               out_scale=1.0, divide_by_kv_length=False, causal=False, window=0, bias_requires_grad=False,
               num_targets=None, contextual_len=0, relative_offset=None, kv_mask=None, q_order=None,
               kv_order=None, kv_bounds=None, token_offsets=None, packed_len=0, *, out_val=None, **kwargs) -> int:
    spec, num_targets, _, kv_mask = GdpaSpec.from_bwd_schema(activation, scale, out_scale,
                                                             divide_by_kv_length, causal, window,
                                                             bias_requires_grad, num_targets, contextual_len,
                                                             relative_offset, kv_mask)
    return int(BACKWARD_FLOPS_RATIO * _forward_flops(q, k, q_lengths, kv_lengths, spec, num_targets, kv_mask,
                                                     token_offsets, packed_len))
