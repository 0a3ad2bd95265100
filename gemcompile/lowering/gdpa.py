"""``gemcompile::gdpa``: generalized dot-product attention (GDPA), a pointwise activation instead of softmax.

Public op (the signature is fixed)::

    torch.ops.gemcompile.gdpa(Tensor q, Tensor k, Tensor v, Tensor? q_lengths, Tensor? kv_lengths,
        Tensor? bias, str activation, float scale, float out_scale, bool divide_by_kv_length,
        bool causal, int window, Tensor? num_targets=None, int contextual_len=0,
        int? relative_offset=None) -> Tensor

The last three arguments (HSTU's target mask and contextual prefix, a relative bias table) have defaults:
callers that pass the first twelve keep the plain causal/window semantics and a dense bias.

Inputs
------
* q (Bq, H, Lq, D) with Bq in {1, B} (Bq = 1: learned queries shared by the batch, e.g. PMA); k, v
  (B, H, Lk, D); any strides (permuted or expanded views are read in place). One float dtype and one
  device for q, k, v; head dims 16 <= D <= 128 (the Triton kernels' limits, as for jagged attention).
* q_lengths / kv_lengths: int32 or int64 (B,), or None (every one of the Lq query rows / Lk keys is
  valid). Values are checked to lie in [0, L] on CPU; on CUDA they are clamped into [0, L] inside the
  kernels and checked only under :func:`gemcompile.lowering.checks.strict_length_checks`.
* bias: None or 4-D broadcastable to (B, H, Lq, Lk) (each dim equal or 1), any float dtype, added to the
  scaled scores; may require grad (its gradient is summed over its broadcast dims).
* relative_offset: None, or an int: then bias is a relative-position table (T,) or (T, Hz), Hz in {1, H},
  read as bias[b, h, i, j] = table[j - i + relative_offset, h] (every position inside the table, else
  ValueError); its gradient has the table's shape (gdpa_relative_bias.py).
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

Semantics
---------
For batch b, the pair (i, j) is valid when i < q_len_b and j < kv_len_b and (not causal or j <= i,
top-left aligned) and (window == 0 or (i - j <= window if causal else |i - j| <= window)).

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

where kv_len_b is the clamped length (Lk when kv_lengths is None). Rows without a valid pair and padded
query rows (i >= q_len_b) are exactly 0; with divide_by_kv_length and kv_len_b == 0 the output is 0
(no NaN or inf). Garbage (NaN/inf) at padded positions of q, k, v, bias or grad_out never leaks. The
bias must be finite on valid pairs: it is not a mask (act(-inf) is activation-specific, e.g. NaN for
silu). Output: contiguous (B, H, Lq, D) in q's dtype; accumulation in fp32 (fp64 for float64 inputs).

Gradients (q, k, v, bias): with a = act(s), m the valid mask, dA_ij = c_b m_ij (dO_i . v_j),
dS = dA * act'(s): dV = c_b (m a)^T dO, dQ = scale dS K (summed over the batch when q is shared),
dK = scale dS^T Q, dbias = dS summed over the bias's broadcast dims. Deterministic, no atomics. act' of
relu and relu_squared is 0 at 0, as torch's autograd. No double backward.

How it is wired (as ``gemcompile::jagged_attention``, see jagged_attention.py)
-----------------------------------------------------------------------------
* ``gemcompile::gdpa_fwd(...) -> out``: a ``torch.library.custom_op`` (opaque to Dynamo/Inductor) with a
  fake impl and ``register_autograd``; the backward needs only the inputs (no softmax statistics).
* ``gemcompile::gdpa_bwd(grad_out, q, k, v, ..., bias_requires_grad, num_targets=None, contextual_len=0)
  -> (dq, dk, dv, dbias)``: a custom_op with a fake impl (dbias is an empty tensor when not needed).
* ``gemcompile::gdpa``: the public op, ``CompositeImplicitAutograd``, which calls ``gdpa_fwd``. A plain
  eager call on CUDA (no tracing, no dispatch mode) skips the custom ops and runs the same kernels
  through one autograd.Function (:class:`EagerGDPA`): less host time per step.

Dispatch: CUDA runs the Triton kernels of gdpa_triton.py (float64 falls back to the reference); every
other device runs the plain-PyTorch reference of gdpa_reference.py. Neither path syncs with the host.

FLOPs: ``torch.utils.flop_counter`` formulas on gdpa_fwd / gdpa_bwd count the valid pairs from the real
lengths (causal, window, targets and contextual prefix included; the padded causal/window count when
the lengths or num_targets are fake): forward 4*H*D*pairs, backward 2.5x forward (gdpa_flops.py).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from . import checks
from .gdpa_flops import BACKWARD_FLOPS_RATIO, forward_flops, gdpa_pairs, padded_gdpa_pairs
from .gdpa_reference import GDPA_ACTIVATIONS, reference_gdpa_backward, reference_gdpa_forward
from .gdpa_relative_bias import check_relative_table
from .jagged_attention_eager import takes_eager_path

__all__ = ["gdpa", "GDPA_ACTIVATIONS", "EagerGDPA", "check_gdpa_args"]

_LIB = torch.library.Library("gemcompile", "FRAGMENT")


# ---------------------------------------------------------------------------------------------------
# Input checks (metadata only: they also run on fake tensors while tracing)


def _check_number(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")


def _check_bias(bias, target: tuple, device) -> None:
    if not isinstance(bias, torch.Tensor):
        raise TypeError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
    if not bias.is_floating_point():
        raise TypeError(f"bias must be a floating-point tensor, got {bias.dtype}")
    if bias.device != device:
        raise ValueError(f"bias is on {bias.device} but q is on {device}")
    if bias.dim() != 4 or any(s not in (1, t) for s, t in zip(bias.shape, target)):
        raise ValueError(
            f"bias must be 4-D and broadcastable to (B, H, Lq, Lk) = {target} (each dim equal or 1), "
            f"got shape {tuple(bias.shape)}"
        )


def check_gdpa_args(
    q,
    k,
    v,
    q_lengths,
    kv_lengths,
    bias,
    activation,
    scale,
    out_scale,
    divide_by_kv_length,
    causal,
    window,
    num_targets=None,
    contextual_len=0,
    relative_offset=None,
) -> None:
    """Metadata checks of ``gemcompile::gdpa``; TypeError/ValueError naming the argument."""
    if all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
        D = q.shape[-1]
        if k.shape[-1] == D and v.shape[-1] == D and not (checks.MIN_HEAD_DIM <= D <= checks.MAX_HEAD_DIM):
            raise ValueError(
                f"head dim {D} is not supported by the gdpa kernels (valid: {checks.MIN_HEAD_DIM} <= D <= "
                f"{checks.MAX_HEAD_DIM})"
            )
    checks._check_qkv(q, k, v, 4, "(batch, heads, length, head_dim)")
    B, H, Lk, _ = k.shape
    if v.shape != k.shape:
        raise ValueError(
            f"k and v must have one shape (B, H, Lk, D), got k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.shape[0] not in (1, B):
        raise ValueError(f"q's batch size must be 1 (shared queries) or k's batch size {B}, got {q.shape[0]}")
    if q.shape[1] != H:
        raise ValueError(f"q and k must have the same number of heads, got q {q.shape[1]}, k {H}")
    Lq = q.shape[2]
    if q_lengths is not None:
        checks._check_index_vector("q_lengths", q_lengths, B, "B", q.device)
    if kv_lengths is not None:
        checks._check_index_vector("kv_lengths", kv_lengths, B, "B", q.device)
    if relative_offset is not None:
        check_relative_table(bias, relative_offset, H, Lq, Lk, q.device)
    elif bias is not None:
        _check_bias(bias, (B, H, Lq, Lk), q.device)
    if not isinstance(activation, str) or activation not in GDPA_ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(GDPA_ACTIVATIONS)}; got {activation!r}")
    checks._check_flags(causal, scale)
    _check_number("out_scale", out_scale)
    if not isinstance(divide_by_kv_length, bool):
        raise TypeError(f"divide_by_kv_length must be a bool, got {type(divide_by_kv_length).__name__}")
    if isinstance(window, bool) or not isinstance(window, (int, torch.SymInt)):
        raise TypeError(f"window must be an int, got {type(window).__name__}")
    if isinstance(window, int) and window < 0:
        raise ValueError(f"window must be >= 0 (0: no window), got {window}")
    _check_hstu_args(q, k, kv_lengths, causal, num_targets, contextual_len)


def _check_hstu_args(q, k, kv_lengths, causal, num_targets, contextual_len) -> None:
    """num_targets / contextual_len: types, and what they require (causal, kv_lengths, Lq == Lk, Bq == B)."""
    if isinstance(contextual_len, bool) or not isinstance(contextual_len, (int, torch.SymInt)):
        raise TypeError(f"contextual_len must be an int, got {type(contextual_len).__name__}")
    if isinstance(contextual_len, int) and contextual_len < 0:
        raise ValueError(f"contextual_len must be >= 0 (0: no contextual prefix), got {contextual_len}")
    B = k.shape[0]
    if num_targets is not None:
        checks._check_index_vector("num_targets", num_targets, B, "B", q.device)
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


def _check_values(q, k, q_lengths, kv_lengths, num_targets=None) -> None:
    checks.check_length_values("q_lengths", q_lengths, q.shape[2])
    checks.check_length_values("kv_lengths", kv_lengths, k.shape[2])
    if num_targets is None or kv_lengths is None or not checks._should_check_values(num_targets):
        return
    n = kv_lengths.clamp(0, k.shape[2])
    bad = (num_targets < 0) | (num_targets > n)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"num_targets[{i}] = {int(num_targets[i])} is outside [0, {int(n[i])}] (the kv length of "
            f"sequence {i})"
        )


def _use_triton(q: Tensor) -> bool:
    return q.device.type == "cuda" and q.dtype != torch.float64


def _triton():
    # imported lazily: CPU-only installs never need triton
    from . import gdpa_triton

    return gdpa_triton


def _kernels(q: Tensor):
    if _use_triton(q):
        t = _triton()
        return t.gdpa_forward_triton, t.gdpa_backward_triton
    return reference_gdpa_forward, reference_gdpa_backward


# ---------------------------------------------------------------------------------------------------
# Forward


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
) -> Tensor:
    """out (B, H, Lq, D) contiguous in q's dtype."""
    args = (activation, scale, out_scale, divide_by_kv_length, causal, window, num_targets, contextual_len,
            relative_offset)
    check_gdpa_args(q, k, v, q_lengths, kv_lengths, bias, *args)
    _check_values(q, k, q_lengths, kv_lengths, num_targets)
    return reference_gdpa_forward(q, k, v, q_lengths, kv_lengths, bias, *args)


@gdpa_fwd.register_kernel("cuda")
def _gdpa_fwd_cuda(q, k, v, q_lengths, kv_lengths, bias, activation, scale, out_scale, divide_by_kv_length,
                   causal, window, num_targets=None, contextual_len=0, relative_offset=None):
    args = (activation, scale, out_scale, divide_by_kv_length, causal, window, num_targets, contextual_len,
            relative_offset)
    check_gdpa_args(q, k, v, q_lengths, kv_lengths, bias, *args)
    _check_values(q, k, q_lengths, kv_lengths, num_targets)
    forward, _ = _kernels(q)
    return forward(q, k, v, q_lengths, kv_lengths, bias, *args)


@gdpa_fwd.register_fake
def _gdpa_fwd_fake(q, k, v, q_lengths, kv_lengths, bias, *args):
    check_gdpa_args(q, k, v, q_lengths, kv_lengths, bias, *args)
    B, H, _, D = k.shape
    return q.new_empty((B, H, q.shape[2], D))


# ---------------------------------------------------------------------------------------------------
# Backward


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
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq like q, dk, dv, dbias like bias; dbias is an empty tensor unless bias_requires_grad)."""
    return reference_gdpa_backward(grad_out, q, k, v, q_lengths, kv_lengths, bias, activation, scale, out_scale,
                                   divide_by_kv_length, causal, window, bias_requires_grad, num_targets,
                                   contextual_len, relative_offset)


@gdpa_bwd.register_kernel("cuda")
def _gdpa_bwd_cuda(grad_out, q, *rest):
    """Same arguments as gdpa_bwd, forwarded to the Triton launcher (the reference for float64)."""
    _, backward = _kernels(q)
    return backward(grad_out, q, *rest)


@gdpa_bwd.register_fake
def _gdpa_bwd_fake(grad_out, q, k, v, q_lengths, kv_lengths, bias, activation, scale, out_scale,
                   divide_by_kv_length, causal, window, bias_requires_grad, num_targets=None,
                   contextual_len=0, relative_offset=None):
    dq = q.new_empty(q.shape)
    dk = k.new_empty(k.shape)
    dv = v.new_empty(v.shape)
    dbias = bias.new_empty(bias.shape) if (bias is not None and bias_requires_grad) else q.new_empty(0)
    return dq, dk, dv, dbias


def _fwd_setup_context(ctx, inputs, output):
    (q, k, v, q_lengths, kv_lengths, bias, activation, scale, out_scale, divide, causal, window, num_targets,
     contextual_len, relative_offset) = inputs
    ctx.save_for_backward(q, k, v, q_lengths, kv_lengths, bias, num_targets)
    ctx.args = (activation, scale, out_scale, divide, causal, window)
    ctx.contextual_len = contextual_len
    ctx.relative_offset = relative_offset
    ctx.bias_requires_grad = bias is not None and bool(ctx.needs_input_grad[5])


def _fwd_backward(ctx, grad_out):
    q, k, v, q_lengths, kv_lengths, bias, num_targets = ctx.saved_tensors
    dq, dk, dv, dbias = torch.ops.gemcompile.gdpa_bwd(
        grad_out, q, k, v, q_lengths, kv_lengths, bias, *ctx.args, ctx.bias_requires_grad, num_targets,
        ctx.contextual_len, ctx.relative_offset
    )
    return (dq, dk, dv, None, None, (dbias if ctx.bias_requires_grad else None)) + (None,) * 9


gdpa_fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup_context)


# ---------------------------------------------------------------------------------------------------
# Eager fast path (see jagged_attention_eager.py for why)


class EagerGDPA(torch.autograd.Function):
    """out = gdpa(q, k, v, q_lengths, kv_lengths, bias, activation, scale, out_scale, divide_by_kv_length,
    causal, window, num_targets=None, contextual_len=0, relative_offset=None) in one autograd.Function,
    calling the same kernels as the custom ops; arguments are checked by the caller. Taken for plain eager
    CUDA calls; runs the reference elsewhere."""

    @staticmethod
    def forward(
        ctx,
        q,
        k,
        v,
        q_lengths,
        kv_lengths,
        bias,
        activation,
        scale,
        out_scale,
        divide,
        causal,
        window,
        num_targets=None,
        contextual_len=0,
        relative_offset=None,
    ):
        _check_values(q, k, q_lengths, kv_lengths, num_targets)
        forward, _ = _kernels(q)
        args = (activation, scale, out_scale, divide, causal, window)
        out = forward(q, k, v, q_lengths, kv_lengths, bias, *args, num_targets, contextual_len,
                      relative_offset)
        ctx.save_for_backward(q, k, v, q_lengths, kv_lengths, bias, num_targets)
        ctx.args = args
        ctx.contextual_len = contextual_len
        ctx.relative_offset = relative_offset
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, q_lengths, kv_lengths, bias, num_targets = ctx.saved_tensors
        bias_grad = bias is not None and ctx.needs_input_grad[5]
        _, backward = _kernels(q)
        dq, dk, dv, dbias = backward(
            grad_out, q, k, v, q_lengths, kv_lengths, bias, *ctx.args, bias_grad, num_targets,
            ctx.contextual_len, ctx.relative_offset,
        )
        return (dq, dk, dv, None, None, (dbias if bias_grad else None)) + (None,) * 9


# ---------------------------------------------------------------------------------------------------
# The public op


_LIB.define(
    "gdpa(Tensor q, Tensor k, Tensor v, Tensor? q_lengths, Tensor? kv_lengths, Tensor? bias, str activation, "
    "float scale, float out_scale, bool divide_by_kv_length, bool causal, int window, "
    "Tensor? num_targets=None, int contextual_len=0, int? relative_offset=None) -> Tensor"
)


def _gdpa_composite(q, k, v, q_lengths, kv_lengths, bias, *args):
    if takes_eager_path(q):  # plain eager CUDA call: the same kernels, less host time
        check_gdpa_args(q, k, v, q_lengths, kv_lengths, bias, *args)
        return EagerGDPA.apply(q, k, v, q_lengths, kv_lengths, bias, *args)
    return torch.ops.gemcompile.gdpa_fwd(q, k, v, q_lengths, kv_lengths, bias, *args)


_LIB.impl("gdpa", _gdpa_composite, "CompositeImplicitAutograd")


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
) -> Tensor:
    """Python convenience wrapper of ``torch.ops.gemcompile.gdpa`` (scale defaults to D**-0.5).
    relative_offset: ``bias`` is a relative-position table (T,) or (T, Hz) read as
    bias[b, h, i, j] = table[j - i + relative_offset, h] (gdpa_relative_bias.py)."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    # checked here too so that a wrongly typed argument gets our message, not the dispatcher's
    flags = (activation, scale, out_scale, divide_by_kv_length, causal, window, num_targets, contextual_len,
             relative_offset)
    check_gdpa_args(q, k, v, q_lengths, kv_lengths, bias, *flags)
    return torch.ops.gemcompile.gdpa(q, k, v, q_lengths, kv_lengths, bias, activation, float(scale),
                                     float(out_scale), divide_by_kv_length, causal, window, num_targets,
                                     contextual_len, relative_offset)


# ---------------------------------------------------------------------------------------------------
# FLOP formulas (raw tensors: the lengths are read when they are real; padded count when fake)


def _is_fake(t: Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return t.device.type == "meta" or is_fake(t)


def _gdpa_forward_flops(
    q, k, q_lengths, kv_lengths, causal, window, num_targets=None, contextual_len=0
) -> int:
    B, H, Lk, D = k.shape
    Lq = q.shape[2]
    window = int(window)
    if any(t is not None and _is_fake(t) for t in (q_lengths, kv_lengths, num_targets)):
        pairs = padded_gdpa_pairs(B, Lq, Lk, causal, window)
    else:
        pairs = gdpa_pairs(q_lengths, kv_lengths, B, Lq, Lk, causal, window, num_targets, int(contextual_len))
    return forward_flops(H, D, pairs)


@register_flop_formula(torch.ops.gemcompile.gdpa_fwd, get_raw=True)
def _fwd_flops(
    q,
    k,
    v,
    q_lengths=None,
    kv_lengths=None,
    bias=None,
    activation="silu",
    scale=1.0,
    out_scale=1.0,
    divide_by_kv_length=False,
    causal=False,
    window=0,
    num_targets=None,
    contextual_len=0,
    relative_offset=None,
    *,
    out_val=None,
    **kwargs,
) -> int:
    return _gdpa_forward_flops(q, k, q_lengths, kv_lengths, causal, window, num_targets, contextual_len)


@register_flop_formula(torch.ops.gemcompile.gdpa_bwd, get_raw=True)
def _bwd_flops(
    grad_out,
    q,
    k,
    v,
    q_lengths=None,
    kv_lengths=None,
    bias=None,
    activation="silu",
    scale=1.0,
    out_scale=1.0,
    divide_by_kv_length=False,
    causal=False,
    window=0,
    bias_requires_grad=False,
    num_targets=None,
    contextual_len=0,
    relative_offset=None,
    *,
    out_val=None,
    **kwargs,
) -> int:
    fwd = _gdpa_forward_flops(q, k, q_lengths, kv_lengths, causal, window, num_targets, contextual_len)
    return int(BACKWARD_FLOPS_RATIO * fwd)
