"""Plain-PyTorch reference of block attention: what runs on CPU (and on CUDA for what the kernels skip).

Semantics (shared with the Triton kernels, see op.py): every query row i of the padded length L (padded
rows too) attends key j iff j < len[b], and (block > 0) i // block == j // block, and (window >= 0)
|i - j| <= window, and (causal) j <= i, and (kv_mask given) kv_mask[b, j]. A row with no allowed key is
exactly 0 with zero gradients, and so are rows i >= q_lengths[b] when q_lengths is given. With rotary, q
and k are rotated first: x * cos + rot(x) * sin, rot = rotate_half ("half") or rotate-every-two
("interleaved"); v is not rotated.

Block attention is jagged attention (q_lengths as given, None: every row is a query; kv_lengths = lengths)
with an additive 0/-inf bias of the (L, L) block/window/causal pattern, on rotated q and k. So the
reference rotates, builds that pattern once (not per batch; a kv_mask adds its (B, 1, 1, L) -inf columns,
and its masked keys and values are zeroed so that garbage there cannot leak) and calls the
jagged-attention reference; its backward applies the transposed rotation to dq and dk. Dense: memory
O(B*H*L*L). Math in float32 for half inputs, float64 for float64.

Packed layout (token_offsets given, op.py): q, k, v (T, H, D) are scattered into zeros (B, H, L, D)
(common/packed.py), the padded reference runs with q_lengths = lengths (rows past a length do not exist
in the packed layout), and the valid rows are gathered back; lse comes back as (T, H). Rows past the last
offset (the slack rows of a bucketed token index) belong to no sequence: output and gradients 0, lse +inf.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..common.packed import pack_padded, pad_packed
from ..common.reference import compute_dtype, zero_invalid_rows
from ..jagged_attention.reference import reference_backward as jagged_reference_backward
from ..jagged_attention.reference import reference_forward as jagged_reference_forward

__all__ = [
    "ROTARY_MODES",
    "allowed_pattern",
    "apply_rotary",
    "apply_rotary_transpose",
    "reference_backward",
    "reference_forward",
    "rotary_tables",
    "rotate",
]

ROTARY_MODES = ("none", "half", "interleaved")


def rotary_tables(table: Tensor, B: int) -> Tensor:
    """cos or sin of shape (L, D), (Bc, L, D) or (Bc, 1, L, D), Bc in {1, B} -> a (Bc, L, D) view.

    Views only (no copy): a shared table keeps Bc = 1, which the kernels read with batch stride 0."""
    if table.dim() == 2:
        return table.unsqueeze(0)
    if table.dim() == 4:
        return table.squeeze(1)
    return table


def rotate(x: Tensor, rotary: str) -> Tensor:
    """rot(x): "half" = cat(-x2, x1) of the two halves; "interleaved" = (-x1, x0, -x3, x2, ...)."""
    if rotary == "half":
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    if rotary == "interleaved":
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.stack((-odd, even), dim=-1).flatten(-2)
    raise ValueError(f"rotary must be 'half' or 'interleaved' here, got {rotary!r}")


def _tables_4d(table: Tensor, B: int, dtype: torch.dtype) -> Tensor:
    return rotary_tables(table, B).to(dtype).unsqueeze(1)  # (Bc, 1, L, D): broadcasts over heads


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor, rotary: str) -> Tensor:
    """x (B, H, L, D) -> x * cos + rot(x) * sin, computed in x's dtype."""
    B = x.shape[0]
    return x * _tables_4d(cos, B, x.dtype) + rotate(x, rotary) * _tables_4d(sin, B, x.dtype)


def apply_rotary_transpose(g: Tensor, cos: Tensor, sin: Tensor, rotary: str) -> Tensor:
    """The gradient of apply_rotary w.r.t. x: g * cos + rot^T(g * sin), and rot^T = -rot."""
    B = g.shape[0]
    return g * _tables_4d(cos, B, g.dtype) - rotate(g * _tables_4d(sin, B, g.dtype), rotary)


def allowed_pattern(L: int, block: int, window: int, causal: bool, device) -> Tensor:
    """(L, L) bool: query i may attend key j by position alone (the length condition comes on top)."""
    i = torch.arange(L, device=device)[:, None]
    j = torch.arange(L, device=device)[None, :]
    ok = torch.ones(L, L, dtype=torch.bool, device=device)
    if block > 0:
        ok = ok & (i // block == j // block)
    if window >= 0:
        ok = ok & ((i - j).abs() <= window)
    if causal:
        ok = ok & (j <= i)
    return ok


def _pattern_bias(L: int, block: int, window: int, causal: bool, dtype, device) -> Tensor:
    ok = allowed_pattern(L, block, window, causal, device)
    return torch.zeros(1, 1, L, L, dtype=dtype, device=device).masked_fill(~ok, float("-inf"))


def _bias(L: int, block: int, window: int, causal: bool, kv_mask, dtype, device) -> Tensor:
    """(1 | B, 1, L, L) additive 0/-inf bias: the position pattern, AND the key mask when given."""
    bias = _pattern_bias(L, block, window, causal, dtype, device)
    if kv_mask is None:
        return bias
    keys = torch.zeros(kv_mask.shape, dtype=dtype, device=device).masked_fill(~kv_mask, float("-inf"))
    return bias + keys[:, None, None, :]


def _rotated(q, k, v, cos, sin, rotary, kv_mask):
    """q, k rotated and v, all in the compute dtype; keys and values the kv_mask drops read as 0."""
    cdt = compute_dtype(q.dtype)
    q, k, v = q.to(cdt), k.to(cdt), v.to(cdt)
    if rotary != "none":
        q, k = apply_rotary(q, cos, sin, rotary), apply_rotary(k, cos, sin, rotary)
    if kv_mask is not None:
        k, v = zero_invalid_rows(k, kv_mask), zero_invalid_rows(v, kv_mask)
    return q, k, v


def _packed_forward(q, k, v, lengths, block, window, causal, cos, sin, rotary, scale, token_offsets,
                    max_len, dropout_p=0.0, dropout_seed=None):
    L, T = int(max_len), q.shape[0]
    qp, kp, vp = (pad_packed(x, token_offsets, L) for x in (q, k, v))
    out, lse = reference_forward(qp, kp, vp, lengths, block, window, causal, cos, sin, rotary, scale,
                                 q_lengths=lengths, dropout_p=dropout_p, dropout_seed=dropout_seed)
    # (B, H, L) -> (T, H); a row outside every sequence has no allowed key: +inf, as in the kernels
    lse_rows = pack_padded(lse.unsqueeze(-1), token_offsets, T, fill=float("inf")).squeeze(-1)
    return pack_padded(out, token_offsets, T), lse_rows.contiguous()


def _packed_backward(grad_out, q, k, v, out, lse, lengths, block, window, causal, cos, sin, rotary, scale,
                     token_offsets, max_len, dropout_p=0.0, dropout_seed=None):
    L, T = int(max_len), q.shape[0]
    padded = [pad_packed(x, token_offsets, L) for x in (grad_out, q, k, v, out)]
    lse_p = pad_packed(lse.unsqueeze(-1), token_offsets, L).squeeze(-1)  # (T, H) -> (B, H, L)
    past = torch.arange(L, device=lse.device)[None, :] >= lengths.to(lse.device).long()[:, None]
    lse_p = lse_p.masked_fill(past[:, None, :], float("inf"))  # +inf past lengths
    grads = reference_backward(*padded, lse_p, lengths, block, window, causal, cos, sin, rotary, scale,
                               q_lengths=lengths, dropout_p=dropout_p, dropout_seed=dropout_seed)
    return tuple(pack_padded(g, token_offsets, T) for g in grads)  # zeros on rows outside every sequence


def reference_forward(q, k, v, lengths, block: int, window: int, causal: bool, cos, sin, rotary: str,
                      scale: float, kv_mask=None, q_lengths=None, token_offsets=None, max_len: int = 0,
                      dropout_p: float = 0.0, dropout_seed=None):
    """q, k, v (B, H, L, D) -> (out (B, H, L, D) in q's dtype, lse (B, H, L); +inf on rows without keys).
    Packed (token_offsets given): q, k, v (T, H, D) -> (out (T, H, D), lse (T, H)). Dropout on the weights
    as jagged attention draws it (common/dropout.py), by positions in the sequence."""
    if token_offsets is not None:
        return _packed_forward(q, k, v, lengths, block, window, causal, cos, sin, rotary, scale,
                               token_offsets, max_len, dropout_p, dropout_seed)
    L = q.shape[2]
    cdt = compute_dtype(q.dtype)
    qr, kr, vr = _rotated(q, k, v, cos, sin, rotary, kv_mask)
    bias = _bias(L, block, window, causal, kv_mask, cdt, q.device)
    out, lse = jagged_reference_forward(qr, kr, vr, q_lengths, lengths, bias, False, scale,
                                        dropout_p=dropout_p, dropout_seed=dropout_seed)
    return out.to(q.dtype).contiguous(), lse


def reference_backward(grad_out, q, k, v, out, lse, lengths, block: int, window: int, causal: bool, cos,
                       sin, rotary: str, scale: float, kv_mask=None, q_lengths=None, token_offsets=None,
                       max_len: int = 0, dropout_p: float = 0.0, dropout_seed=None):
    """(dq, dk, dv), contiguous, in the inputs' dtypes; dq and dk are w.r.t. the un-rotated q and k."""
    if token_offsets is not None:
        return _packed_backward(grad_out, q, k, v, out, lse, lengths, block, window, causal, cos, sin,
                                rotary, scale, token_offsets, max_len, dropout_p, dropout_seed)
    L = q.shape[2]
    cdt = compute_dtype(q.dtype)
    qr, kr, vr = _rotated(q, k, v, cos, sin, rotary, kv_mask)
    bias = _bias(L, block, window, causal, kv_mask, cdt, q.device)
    dq, dk, dv, _ = jagged_reference_backward(
        grad_out.to(cdt), qr, kr, vr, out.to(cdt), lse, q_lengths, lengths, bias, False, scale, False,
        dropout_p=dropout_p, dropout_seed=dropout_seed
    )
    if rotary != "none":
        dq, dk = apply_rotary_transpose(dq, cos, sin, rotary), apply_rotary_transpose(dk, cos, sin, rotary)
    return dq.to(q.dtype).contiguous(), dk.to(k.dtype).contiguous(), dv.to(v.dtype).contiguous()
