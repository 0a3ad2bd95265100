"""Plain-PyTorch reference of GDPA (generalized dot-product attention): what runs on CPU, on any
non-CUDA device and for float64 on CUDA. The semantics (HSTU's target mask and contextual prefix
included) are spelled out in op.py.

For batch b and a valid pair (i, j) (see :func:`valid_pair_mask`)::

    s_ij = scale * q_i . k_j + bias_ij,   a_ij = act(s_ij)
    out_i = c_b * sum_j a_ij v_j,         c_b = out_scale (/ kv_len_b when divide_by_kv_length)

Invalid pairs contribute nothing; rows without a valid pair and padded query rows are exactly 0. A key
with kv_mask[b, j] False is invalid like a padded one (positions stay absolute).

The backward is written out (no autograd inside the op, so it also runs below the autograd dispatch
key): with m the valid mask, dA_ij = c_b m_ij (dO_i . v_j), dS = dA * act'(s), dV = c_b (m a)^T dO,
dQ = scale dS K (summed over the batch for shared queries), dK = scale dS^T Q, dbias = dS reduced to the
bias's shape.

Positions outside the valid region are never used (rows are zeroed with ``torch.where`` first and the
scores of invalid pairs are replaced by 0 before the activation), so garbage or NaN in padding cannot
leak into outputs or gradients. Math runs in float32 for half inputs and in float64 for float64 inputs.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
from torch import Tensor

from ..common.reference import compute_dtype, key_mask, reduce_bias_grad, reduce_to_shape, row_mask, zero_invalid_rows
from .relative_table import dense_relative_bias, relative_table_grad
from .spec import GDPA_ACTIVATIONS, GdpaSpec

__all__ = [
    "activation_fn",
    "activation_grad_fn",
    "valid_pair_mask",
    "reference_gdpa_forward",
    "reference_gdpa_backward",
]

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_GELU_TANH_C = 0.044715


def _check_activation(name) -> None:
    if not isinstance(name, str) or name not in GDPA_ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(GDPA_ACTIVATIONS)}; got {name!r}")


def _relu_squared(x: Tensor) -> Tensor:
    r = torch.relu(x)
    return r * r


def _gelu_tanh(x: Tensor) -> Tensor:
    # 0.5 x (1 + tanh(u)) = x * sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3)
    u = _SQRT_2_OVER_PI * (x + _GELU_TANH_C * x * x * x)
    return x * torch.sigmoid(2.0 * u)


_ACT = {
    "identity": lambda x: x,
    "relu": torch.relu,
    "relu_squared": _relu_squared,
    "silu": lambda x: x * torch.sigmoid(x),
    "sigmoid": torch.sigmoid,
    "gelu": lambda x: 0.5 * x * (1.0 + torch.erf(x * _INV_SQRT_2)),
    "gelu_tanh": _gelu_tanh,
}


def _silu_grad(x: Tensor) -> Tensor:
    sg = torch.sigmoid(x)
    return sg * (1.0 + x * (1.0 - sg))


def _sigmoid_grad(x: Tensor) -> Tensor:
    sg = torch.sigmoid(x)
    return sg * (1.0 - sg)


def _gelu_grad(x: Tensor) -> Tensor:
    return 0.5 * (1.0 + torch.erf(x * _INV_SQRT_2)) + x * torch.exp(-0.5 * x * x) * _INV_SQRT_2PI


def _gelu_tanh_grad(x: Tensor) -> Tensor:
    u = _SQRT_2_OVER_PI * (x + _GELU_TANH_C * x * x * x)
    du = _SQRT_2_OVER_PI * (1.0 + 3.0 * _GELU_TANH_C * x * x)
    sg = torch.sigmoid(2.0 * u)
    return sg + 2.0 * x * sg * (1.0 - sg) * du


_ACT_GRAD = {
    "identity": torch.ones_like,
    "relu": lambda x: (x > 0).to(x.dtype),
    "relu_squared": lambda x: 2.0 * torch.relu(x),
    "silu": _silu_grad,
    "sigmoid": _sigmoid_grad,
    "gelu": _gelu_grad,
    "gelu_tanh": _gelu_tanh_grad,
}


def activation_fn(name: str) -> Callable[[Tensor], Tensor]:
    """The activation ``name`` as a torch function (ValueError on an unknown name)."""
    _check_activation(name)
    return _ACT[name]


def activation_grad_fn(name: str) -> Callable[[Tensor], Tensor]:
    """The derivative of activation ``name`` (relu and relu_squared: 0 at 0, as torch's autograd)."""
    _check_activation(name)
    return _ACT_GRAD[name]


def valid_pair_mask(
    q_lengths: Optional[Tensor],
    kv_lengths: Optional[Tensor],
    B: int,
    Lq: int,
    Lk: int,
    causal: bool,
    window: int,
    device,
    num_targets: Optional[Tensor] = None,
    contextual_len: int = 0,
    kv_mask: Optional[Tensor] = None,
) -> Tensor:
    """(B, 1, Lq, Lk) bool: i < q_len and j < kv_len (lengths None mean the padded length) and kv_mask[b, j]
    (when given), and

    * without num_targets and contextual_len == 0: j <= i if causal; with window > 0 also i - j <= window
      (causal) or |i - j| <= window (not causal);
    * with num_targets or contextual_len > 0 (causal only; HSTU's target mask and contextual prefix), with
      n = kv_len_b, t = num_targets[b], c = contextual_len::

          ii, jj, m = i, j, n
          if c > 0:  ii = max(i - c + 1, 0); jj = max(j - c + 1, 0); m = n - c + 1
          if num_targets is not None:  m = m - t;  ii = min(ii, m);  jj = min(jj, m)
          d = ii - jj
          visible = (i == j) or (d > 0)
          if window > 0: visible = visible and (d <= window)
          if c > 0:      visible = visible or (ii == 0 and jj < m)
    """
    c = int(contextual_len)
    q_ok = row_mask(q_lengths, B, Lq, device)
    kv_ok = key_mask(kv_lengths, kv_mask, B, Lk, device)
    valid = q_ok[:, None, :, None] & kv_ok[:, None, None, :]
    rows = torch.arange(Lq, device=device)[:, None]
    cols = torch.arange(Lk, device=device)[None, :]
    if num_targets is None and c == 0:
        if causal:
            valid = valid & (cols <= rows)
        if window > 0:
            dist = (rows - cols) if causal else (rows - cols).abs()
            valid = valid & (dist <= window)
        return valid
    if not causal:
        raise ValueError("num_targets and contextual_len > 0 require causal=True")
    if c < 0:
        raise ValueError(f"contextual_len must be >= 0, got {c}")
    if kv_lengths is None:
        n = torch.full((B,), int(Lk), dtype=torch.int64, device=device)
    else:
        n = kv_lengths.to(device, torch.int64).clamp(0, int(Lk))
    i, j = rows[None], cols[None]  # (1, Lq, 1), (1, 1, Lk)
    ii, jj, m = i, j, n[:, None, None]  # m: (B, 1, 1)
    if c > 0:
        ii, jj, m = (i - c + 1).clamp_min(0), (j - c + 1).clamp_min(0), m - c + 1
    if num_targets is not None:
        m = m - num_targets.to(device, torch.int64)[:, None, None]
        ii, jj = torch.minimum(ii, m), torch.minimum(jj, m)
    d = ii - jj
    visible = (i == j) | (d > 0)
    if window > 0:
        visible = visible & (d <= window)
    if c > 0:
        visible = visible | ((ii == 0) & (jj < m))
    return valid & visible[:, None]


def _output_scale(kv_lengths, B: int, Lk: int, out_scale: float, divide: bool, dtype, device) -> Tensor:
    """(B, 1, 1, 1) c_b = out_scale (/ kv_len_b, clamped into [0, Lk]; 0 pairs when kv_len_b = 0)."""
    c = torch.full((B,), float(out_scale), dtype=dtype, device=device)
    if divide:
        if kv_lengths is None:
            n = torch.full((B,), float(max(Lk, 1)), dtype=dtype, device=device)
        else:
            n = kv_lengths.to(device).clamp(0, Lk).clamp_min(1).to(dtype)
        c = c / n
    return c.reshape(B, 1, 1, 1)


def _terms(q, k, v, q_lengths, kv_lengths, bias, num_targets, spec: GdpaSpec, kv_mask=None):
    """What the forward and the backward share, in the compute dtype: s (0 at invalid pairs), the valid
    mask (B, 1, Lq, Lk), a = act(s) at valid pairs, zeroed q, k, v and the per-batch output scale c."""
    B, _, Lk, _ = k.shape
    Lq = q.shape[2]
    cdt = compute_dtype(q.dtype)
    qf = zero_invalid_rows(q.to(cdt), row_mask(q_lengths, B, Lq, q.device))
    key_ok = key_mask(kv_lengths, kv_mask, B, Lk, k.device)
    kf = zero_invalid_rows(k.to(cdt), key_ok)
    vf = zero_invalid_rows(v.to(cdt), key_ok)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * spec.scale
    valid = valid_pair_mask(q_lengths, kv_lengths, B, Lq, Lk, spec.causal, spec.window, q.device, num_targets,
                            spec.contextual_len, kv_mask)
    if bias is not None:
        s = s + torch.where(valid, bias.to(cdt), s.new_zeros(()))
    s = torch.where(valid, s, s.new_zeros(()))
    a = torch.where(valid, activation_fn(spec.activation)(s), s.new_zeros(()))
    c = _output_scale(kv_lengths, B, Lk, spec.out_scale, spec.divide_by_kv_length, cdt, q.device)
    return s, valid, a, qf, kf, vf, c


def _dense_bias(bias, q, k, spec: GdpaSpec):
    """The bias as a dense (.., Lq, Lk) tensor: a relative table (relative_offset set) is materialized."""
    if spec.relative_offset is None:
        return bias
    return dense_relative_bias(bias, spec.relative_offset, q.shape[2], k.shape[2])


def reference_gdpa_forward(q: Tensor, k: Tensor, v: Tensor, q_lengths: Optional[Tensor],
                           kv_lengths: Optional[Tensor], bias: Optional[Tensor], spec: GdpaSpec,
                           num_targets: Optional[Tensor] = None, kv_mask: Optional[Tensor] = None) -> Tensor:
    """q (Bq, H, Lq, D), k/v (B, H, Lk, D) -> out (B, H, Lq, D) contiguous in q's dtype. With
    spec.relative_offset, bias is a relative table: bias[b, h, i, j] = table[j - i + relative_offset, h]."""
    bias = _dense_bias(bias, q, k, spec)
    _, _, a, _, _, vf, c = _terms(q, k, v, q_lengths, kv_lengths, bias, num_targets, spec, kv_mask)
    return (torch.matmul(a, vf) * c).to(q.dtype).contiguous()


def reference_gdpa_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, q_lengths: Optional[Tensor],
                            kv_lengths: Optional[Tensor], bias: Optional[Tensor], spec: GdpaSpec,
                            num_targets: Optional[Tensor] = None, bias_requires_grad: bool = False,
                            kv_mask: Optional[Tensor] = None):
    """(dq like q, dk, dv, dbias like bias); dbias is an empty tensor unless bias_requires_grad. With
    spec.relative_offset, bias is a relative table and dbias is its gradient (the dense gradient's
    diagonal sums)."""
    table, bias = bias, _dense_bias(bias, q, k, spec)
    B, H, _, D = k.shape
    Lq = q.shape[2]
    s, valid, a, qf, kf, vf, c = _terms(q, k, v, q_lengths, kv_lengths, bias, num_targets, spec, kv_mask)
    do = zero_invalid_rows(grad_out.to(s.dtype), row_mask(q_lengths, B, Lq, q.device))
    dv = torch.matmul(a.transpose(-1, -2), do) * c
    da = torch.where(valid, torch.matmul(do, vf.transpose(-1, -2)) * c, s.new_zeros(()))
    ds = da * activation_grad_fn(spec.activation)(s)
    dq = torch.matmul(ds, kf) * spec.scale
    if q.shape[0] == 1 and B != 1:
        dq = dq.sum(dim=0, keepdim=True)
    dk = torch.matmul(ds.transpose(-1, -2), qf.expand(B, H, Lq, D)) * spec.scale
    if bias is not None and bias_requires_grad and spec.relative_offset is not None:
        dbias = relative_table_grad(reduce_to_shape(ds, bias.shape), table, spec.relative_offset).contiguous()
    elif bias is not None and bias_requires_grad:
        dbias = reduce_bias_grad(ds, bias)
    else:
        dbias = q.new_empty(0)
    return dq.to(q.dtype).contiguous(), dk.to(k.dtype).contiguous(), dv.to(v.dtype).contiguous(), dbias
