"""Triton kernels of GDPA (generalized dot-product attention: a pointwise activation, no softmax) and their
launchers. Semantics: see op.py; plain-PyTorch twin: reference.py.

Layout: q (Bq, H, Lq, D) with Bq in {1, B} (batch stride 0 serves shared queries), k, v (B, H, Lk, D),
read through their strides (permuted and expanded views are never copied); lengths (B,) or None (every row
valid), clamped into [0, L] inside the kernels. Packed queries (Q_MODE == MODE_OFFSETS, op.py's
token_offsets): q, out, grad_out and dq are (T, H, D) rows read with batch stride 0 from row
token_offsets[b] (clamped into [0, T]; QLengths then holds the offsets), positions n = row - start drive
every mask and the bias exactly as padded rows do, and a program never writes past its sequence's rows
(the launchers zero the packed outputs first: rows outside every sequence stay 0). Q_MODE is a constexpr:
the padded kernels compile as before. All element offsets of a
sequence's base are computed in int64. The device helpers (sequence lookup, program coordinates,
masked tile loads/stores), the launch helper that bypasses the autotuner after the first tune and the
shared-memory prune are the attention toolkit of common/attention_triton.py; the per-pair helpers
(pair mask, activations, output scale) are in pairs_triton.py, shared with the bias-gradient kernel.

Which key tiles a query tile [m0, m0 + BLOCK_M) visits: j < kv_len; j <= i when causal (stop at the
diagonal); with a window w > 0, j >= i - w (start at m0 - w, rounded down to a tile) and, when not
causal, j <= i + w. Fully masked tiles are never visited. The visited range runs in three parts: tiles
that need the pair mask at its start (window edge), unmasked tiles in the middle (every pair of the tile
valid: no mask, no masked loads) and masked tiles at its end (kv_len, diagonal, window edge). The
backward's key tiles visit query tiles by the mirrored rules.

HSTU's target mask and contextual prefix (HAS_TARGETS: num_targets (B,) read per sequence, used as given;
HAS_CONTEXT: contextual_len > 0, a runtime int; both causal) mask pairs on clamped ids (op.py). Let u
be the number of history keys (u = kv_len - t when kv_len - t >= contextual_len, else 0, clamped into
[0, kv_len]): a key j < u is seen by every row i > j and by the contextual rows i < contextual_len; a
target key j >= u only by itself. Hence: keys never exceed the causal bound (j <= the tile's last row)
except for query tiles holding contextual rows, which also visit [0, u); unmasked tiles lie below u (and
the diagonal); the dK/dV kernel visits, for a key tile starting below u, the query tiles of the
contextual rows before its causal start (masked) too. The clamped ids make the window's far bound (the
start of the key range, the end of the query range) non-trivial: with targets or a prefix it is not
used to skip tiles (the unmasked window bounds stay valid: the clamped distance never exceeds i - j).

A key mask (HAS_KV_MASK: kv_mask (B, Lk) bool, read in place as uint8 through its strides; never with
targets or a prefix): the launcher derives per batch, with torch ops on the device, kv_lo (the first valid
key, Lk if none) and kv_hi (the last valid key + 1, 0 if none; valid = the mask and j < kv_len). Query
tiles visit key tiles only from kv_lo rounded down to a tile up to kv_hi (left and right padding skip
whole tiles), unmasked tiles stay whole tiles below kv_hi, and every visited tile ANDs the loaded mask
vector into its validity and its K/V loads (masked-out keys read as 0: no garbage leaks). dK/dV programs
whose key tile holds no valid key write zeros and exit; the others zero the rows of masked-out keys. The
forward and dQ programs are ordered by kv_hi - kv_lo. HAS_KV_MASK False compiles to the code without it.

Forward (``_gdpa_fwd_kernel``): one program per (query tile, batch*head), 1-D grid of static size.
acc = sum_j act(s_ij) v_j in fp32, out = c_b * acc with c_b = out_scale (/ kv_len_b).

Backward, deterministic, no atomics, no delta kernel (no softmax): ``_gdpa_bwd_dkdv_kernel`` runs one
program per key tile and loops over query tiles (dV = c (m a)^T dO, dK = scale c dS'^T Q, where
dS' = m (dO V^T) act'(s)); ``_gdpa_bwd_dq_kernel`` runs one program per query tile and loops over key
tiles (dQ = scale c dS' K). The per-batch c is applied once, at the end of each program. When the bias
needs a gradient: a bias with full (Lq, Lk) dims (HSTU's relative bias, shared by batch and heads) gets
it from bias_grad_triton.py, which reduces over the (b, h) pairs in-kernel; any other bias (one
broadcast along rows or columns) from the dQ kernel, which then writes dS = c dS' once per visited valid
pair into a zeroed (B, H, Lq, Lk) fp32 buffer that the launcher sums over the broadcast dims with torch.
A relative-position table (``relative_offset``, relative_table.py) is read by the same code through
a view with strides (0, head, -row, +row) based at its row ``offset``: no kernel has a separate path for
it; its gradient is the bias-gradient kernel's parts summed along their diagonals (diagonal_sums_triton.py).

Programs are mapped to batches longest first (a device-side stable argsort by counting,
common/length_order_triton.py, of the lengths that bound their loop:
kv lengths for the forward and dQ, q lengths for dK/dV; the other side's lengths when one is None);
with ``causal`` the query tiles of a sequence run from the last (heaviest) to the first.

Precision: scores, activations and accumulators are fp32 (act and act' evaluated in fp32; gelu uses
tl.math.erf, gelu_tanh is x * sigmoid(2u); for bf16/fp16 inputs on the GPU sigmoid is 0.5 + 0.5 tanh(x/2)
with the SFU's tanh.approx, see pairs_triton.py); a and dS are cast to the input dtype for the a.V, dS.K and
dS^T.Q dots, as flash attention does. fp32 inputs follow torch's matmul precision (3xTF32 at
"highest", TF32 otherwise). Autotuning is keyed on length buckets, the head dim and the flags; under
TRITON_INTERPRET=1 each kernel has one small config. Only APIs present in triton 3.6 and 3.9 are used.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.attention_triton import (
    MODE_FULL,
    MODE_LENGTHS,
    MODE_OFFSETS,
    Side,
    batch_order,
    bhld_strides,
    block_d,
    dot_precision,
    kernel_configs,
    length_bucket,
    load_rows,
    loop_split,
    make_prune,
    mask_key_bounds,
    per_step_jit,
    program_coordinates,
    store_rows,
)
from ..common.length_order import key_span
from ..common.length_order_triton import longest_first_order
from ..common.reference import reduce_bias_grad
from ..common.slack_rows_triton import fill_slack_rows
from ..common.tuned_launch import INTERPRET, autotune, launch
from .diagonal_sums_triton import relative_table_grad_triton
from .pairs_triton import (act, act_grad, key_keep, masked_key_range, output_scale, pair_mask, query_start,
                           sample_bounds)
from .relative_table import table_heads, toeplitz_view
from .spec import GDPA_ACTIVATIONS, GdpaSpec

__all__ = ["gdpa_forward_triton", "gdpa_backward_triton", "activation_code"]


# (BLOCK_M, BLOCK_N, num_warps, num_stages) -> head dims served ("small": D <= 64, "large": D > 64).
# Short, Hopper-friendly lists. Each config was compiled for sm_90a (bf16 and fp32, with and without
# bias/causal/window, gelu_tanh: the heaviest activation) and left out for the head dims where ptxas
# reported register spills.
_FWD_SHAPES = {
    (128, 64, 8, 3): ("small", "large"), (64, 64, 4, 3): ("small", "large"), (128, 128, 8, 3): ("small",),
}
# dK/dV: BLOCK_N keys per program, BLOCK_M query rows per inner step.
_DKDV_SHAPES = {
    (32, 128, 8, 3): ("small", "large"), (32, 64, 4, 3): ("small", "large"), (64, 64, 4, 3): ("small",),
    (64, 128, 8, 3): ("small",),
}
# dQ: BLOCK_M query rows per program, BLOCK_N keys per inner step.
_DQ_SHAPES = {
    (128, 32, 8, 3): ("small", "large"), (128, 64, 8, 3): ("small",), (64, 64, 4, 3): ("small",),
    (64, 32, 4, 3): ("large",), (64, 64, 8, 3): ("large",),
}

_FWD_CONFIGS = kernel_configs(_FWD_SHAPES, (32, 16))
_DKDV_CONFIGS = kernel_configs(_DKDV_SHAPES, (16, 32))
_DQ_CONFIGS = kernel_configs(_DQ_SHAPES, (32, 16))
# bucketed lengths, never the raw lengths; the autotuner adds the dtypes of the tensor arguments itself.
# DIVIDE (a per-program scalar) does not change the cost: not part of the key.
# HAS_TARGETS / HAS_CONTEXT are flags only (never the contextual length nor the number of targets).
_AUTOTUNE_KEY = ["LQ_BUCKET", "LK_BUCKET", "HEAD_D", "Q_MODE", "KV_MODE", "HAS_BIAS", "CAUSAL", "HAS_WINDOW",
                 "HAS_TARGETS", "HAS_CONTEXT", "HAS_KV_MASK", "ACT", "FAST_ACT", "DOT_PRECISION"]


def activation_code(name: str) -> int:
    """The kernels' ACT constexpr of an activation name."""
    return GDPA_ACTIVATIONS.index(name)


# ---------------------------------------------------------------------------------------------------
# Device helpers: activations (ACT = index in GDPA_ACTIVATIONS) and loop bounds


@triton.jit
def _key_range(m0, q_len, kv_len, window, u, ctx, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
               HAS_TARGETS: tl.constexpr, HAS_CONTEXT: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """Key tiles of query tile [m0, m0 + BLOCK_M) (m0 < q_len): (lo, mid_lo, mid_hi, hi); tiles in
    [mid_lo, mid_hi) need no mask. lo and mid_lo are multiples of BLOCK_N (or mid_lo = hi). u: see
    pairs_triton.py (kv_len without targets and contextual prefix)."""
    last_row = tl.minimum(m0 + BLOCK_M, q_len) - 1  # the last valid row of the tile
    hi = kv_len
    mid_hi = (u // BLOCK_N) * BLOCK_N  # target keys (j >= u) always need the mask
    lo = m0 * 0
    mid_lo = lo
    if CAUSAL:
        hi = tl.minimum(hi, last_row + 1)
        mid_hi = tl.minimum(mid_hi, ((m0 + 1) // BLOCK_N) * BLOCK_N)  # cols <= the first row m0
    if HAS_CONTEXT:  # a tile with contextual rows (i < ctx) sees every history key, also j > i
        hi = tl.where(m0 < ctx, tl.maximum(hi, u), hi)
    if HAS_WINDOW:
        lo = (tl.maximum(m0 - window, 0) // BLOCK_N) * BLOCK_N
        # clamped ids: a target or a row after the prefix may see keys j < i - window (no start bound)
        if HAS_TARGETS:
            lo = m0 * 0
        if HAS_CONTEXT:
            lo = m0 * 0
        # unmasked: the last row of the tile (m0 + BLOCK_M - 1) is within the window of the first col
        mid_lo = tl.cdiv(tl.maximum(m0 + BLOCK_M - 1 - window, 0), BLOCK_N) * BLOCK_N
        if not CAUSAL:
            hi = tl.minimum(hi, last_row + window + 1)
            mid_hi = tl.minimum(mid_hi, ((m0 + window + 1) // BLOCK_N) * BLOCK_N)  # cols <= m0 + window
    hi = tl.maximum(hi, lo)
    mid_lo = tl.minimum(tl.maximum(mid_lo, lo), hi)
    mid_hi = tl.minimum(tl.maximum(mid_hi, mid_lo), hi)
    return lo, mid_lo, mid_hi, hi


@triton.jit
def _query_range(n0, q_len, kv_len, window, u, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                 HAS_TARGETS: tl.constexpr, HAS_CONTEXT: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    """Query tiles of key tile [n0, n0 + BLOCK_N) (n0 < kv_len): (lo, mid_lo, mid_hi, hi) as above, in
    multiples of BLOCK_M. No unmasked tiles when the key tile is the last, partial one or holds target
    keys (j >= u). The contextual rows i < ctx before lo are not in this range (see the dK/dV kernel)."""
    last_col = tl.minimum(n0 + BLOCK_N, kv_len) - 1
    hi = q_len
    mid_hi = (q_len // BLOCK_M) * BLOCK_M
    lo = n0 * 0
    mid_lo = lo
    if CAUSAL:
        lo = (n0 // BLOCK_M) * BLOCK_M  # rows i >= j >= n0
        mid_lo = tl.cdiv(n0 + BLOCK_N - 1, BLOCK_M) * BLOCK_M  # rows >= the last col of the tile
    if HAS_WINDOW:
        hi_window = tl.minimum(hi, last_col + window + 1)  # rows i <= j + window
        # clamped ids: a target or a row after the prefix may see keys j < i - window (no end bound)
        if HAS_TARGETS:
            hi_window = hi
        if HAS_CONTEXT:
            hi_window = hi
        hi = hi_window
        mid_hi = tl.minimum(mid_hi, ((n0 + window + 1) // BLOCK_M) * BLOCK_M)  # rows <= n0 + window
        if not CAUSAL:
            lo = (tl.maximum(n0 - window, 0) // BLOCK_M) * BLOCK_M
            mid_lo = tl.cdiv(tl.maximum(n0 + BLOCK_N - 1 - window, 0), BLOCK_M) * BLOCK_M
    # the last key tile or target keys (u <= kv_len): every query tile needs the mask (a select, not a
    # branch: see loop_split)
    return loop_split(lo, mid_lo, mid_hi, hi, n0 + BLOCK_N > u)


# ---------------------------------------------------------------------------------------------------
# Forward


@triton.jit
def _fwd_inner(acc, q, k_base, v_base, bias_base, kvm_base, offs_m, offs_n, offs_d, q_len, kv_len, window,
               n_targets, ctx, stride_kn, stride_kd, stride_vn, stride_vd, stride_zm, stride_zn, stride_mn,
               scale, lo, hi, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, HAS_BIAS: tl.constexpr,
               CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_TARGETS: tl.constexpr,
               HAS_CONTEXT: tl.constexpr, HAS_KV_MASK: tl.constexpr, ACT: tl.constexpr, FAST_ACT: tl.constexpr,
               MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr):
    row_ok = offs_m < q_len
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        col_ok = cols < kv_len
        if HAS_KV_MASK:  # masked-out keys load as 0 (no garbage) and are dropped from every tile
            keep = key_keep(kvm_base, cols, col_ok, stride_mn)
            col_ok = col_ok & keep
            k = load_rows(k_base, cols, offs_d, stride_kn, stride_kd, col_ok, HEAD_D, BLOCK_D, True)
        else:
            k = load_rows(k_base, cols, offs_d, stride_kn, stride_kd, col_ok, HEAD_D, BLOCK_D, MASKED)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        if MASKED:
            valid = pair_mask(offs_m[:, None], cols[None, :], q_len, kv_len, window, n_targets, ctx, CAUSAL,
                              HAS_WINDOW, HAS_TARGETS, HAS_CONTEXT)
            if HAS_KV_MASK:
                valid = valid & keep[None, :]
        if HAS_BIAS:
            z_ptrs = bias_base + (offs_m.to(tl.int64)[:, None] * stride_zm
                                  + cols.to(tl.int64)[None, :] * stride_zn)
            if MASKED:
                z = tl.load(z_ptrs, mask=valid, other=0.0)
            else:
                z = tl.load(z_ptrs, mask=row_ok[:, None], other=0.0)
            s += z.to(tl.float32)
        a = act(s, ACT, FAST_ACT)
        if MASKED:
            a = tl.where(valid, a, 0.0)
        elif HAS_KV_MASK:
            a = tl.where(keep[None, :], a, 0.0)
        if HAS_KV_MASK:
            v = load_rows(v_base, cols, offs_d, stride_vn, stride_vd, col_ok, HEAD_D, BLOCK_D, True)
        else:
            v = load_rows(v_base, cols, offs_d, stride_vn, stride_vd, col_ok, HEAD_D, BLOCK_D, MASKED)
        acc += tl.dot(a.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc


@autotune(configs=_FWD_CONFIGS, key=_AUTOTUNE_KEY, prune_configs_by=make_prune(_FWD_SHAPES, "fwd"))
@per_step_jit
def _gdpa_fwd_kernel(
    Q, K, V, Bias, Out,
    QLengths, KVLengths, NumTargets, Order, KVMask, KVBounds,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_zb, stride_zh, stride_zm, stride_zn,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_mb, stride_mn,
    H, max_q_len, max_kv_len, scale, out_scale, window, contextual_len,
    LQ_BUCKET, LK_BUCKET, total_q_rows,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, Q_MODE: tl.constexpr, KV_MODE: tl.constexpr,
    HAS_BIAS: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_TARGETS: tl.constexpr,
    HAS_CONTEXT: tl.constexpr, HAS_KV_MASK: tl.constexpr, ACT: tl.constexpr, FAST_ACT: tl.constexpr,
    DIVIDE: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    tile, b, h = program_coordinates(Order, H, tl.cdiv(max_q_len, BLOCK_M), CAUSAL)
    q_len, kv_len, n_targets, u = sample_bounds(QLengths, KVLengths, NumTargets, b, max_q_len, max_kv_len,
                                                contextual_len, Q_MODE, KV_MODE, HAS_TARGETS, HAS_CONTEXT,
                                                total_q_rows)
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    m0 = tile * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    o_base = Out + b64 * stride_ob + h64 * stride_oh
    q_base = Q + b64 * stride_qb + h64 * stride_qh
    store_mask = offs_m < max_q_len
    if Q_MODE == 2:  # packed queries: rows from token_offsets[b]; never write the next sequence's rows
        row0 = query_start(QLengths, b, total_q_rows)
        o_base += row0 * stride_om
        q_base += row0 * stride_qm
        store_mask = offs_m < q_len
    if m0 >= q_len:
        if Q_MODE != 2:
            store_rows(o_base, offs_m, offs_d, stride_om, stride_od,
                       tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32), store_mask, HEAD_D)
        return

    row_ok = offs_m < q_len
    q = load_rows(q_base, offs_m, offs_d, stride_qm, stride_qd, row_ok, HEAD_D, BLOCK_D, True)
    k_base = K + b64 * stride_kb + h64 * stride_kh
    v_base = V + b64 * stride_vb + h64 * stride_vh
    z_base = Bias + b64 * stride_zb + h64 * stride_zh
    m_base = KVMask + b64 * stride_mb
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo, mid_lo, mid_hi, hi = _key_range(m0, q_len, kv_len, window, u, contextual_len, CAUSAL, HAS_WINDOW,
                                        HAS_TARGETS, HAS_CONTEXT, BLOCK_M, BLOCK_N)
    if HAS_KV_MASK:
        lo, mid_lo, mid_hi, hi = masked_key_range(KVBounds, b, lo, mid_lo, mid_hi, hi, BLOCK_N)
    if HAS_WINDOW:  # the window's left edge: masked tiles before the unmasked ones
        acc = _fwd_inner(acc, q, k_base, v_base, z_base, m_base, offs_m, offs_n, offs_d, q_len, kv_len, window,
                         n_targets, contextual_len, stride_kn, stride_kd, stride_vn, stride_vd, stride_zm,
                         stride_zn, stride_mn, scale, lo, mid_lo, HEAD_D, BLOCK_D, HAS_BIAS, CAUSAL, HAS_WINDOW,
                         HAS_TARGETS, HAS_CONTEXT, HAS_KV_MASK, ACT, FAST_ACT, True, DOT_PRECISION, BLOCK_N)
    acc = _fwd_inner(acc, q, k_base, v_base, z_base, m_base, offs_m, offs_n, offs_d, q_len, kv_len, window,
                     n_targets, contextual_len, stride_kn, stride_kd, stride_vn, stride_vd, stride_zm, stride_zn,
                     stride_mn, scale, mid_lo, mid_hi, HEAD_D, BLOCK_D, HAS_BIAS, CAUSAL, HAS_WINDOW,
                     HAS_TARGETS, HAS_CONTEXT, HAS_KV_MASK, ACT, FAST_ACT, False, DOT_PRECISION, BLOCK_N)
    acc = _fwd_inner(acc, q, k_base, v_base, z_base, m_base, offs_m, offs_n, offs_d, q_len, kv_len, window,
                     n_targets, contextual_len, stride_kn, stride_kd, stride_vn, stride_vd, stride_zm, stride_zn,
                     stride_mn, scale, mid_hi, hi, HEAD_D, BLOCK_D, HAS_BIAS, CAUSAL, HAS_WINDOW, HAS_TARGETS,
                     HAS_CONTEXT, HAS_KV_MASK, ACT, FAST_ACT, True, DOT_PRECISION, BLOCK_N)
    c = output_scale(out_scale, kv_len, DIVIDE)
    out = tl.where(row_ok[:, None], acc * c, 0.0)
    store_rows(o_base, offs_m, offs_d, stride_om, stride_od, out, store_mask, HEAD_D)


# ---------------------------------------------------------------------------------------------------
# Backward


@triton.jit
def _dkdv_inner(dk, dv, k, v, q_base, do_base, z_base, offs_n, offs_d, q_len, kv_len, window, n_targets, ctx,
                stride_qm, stride_qd, stride_gm, stride_gd, stride_zm, stride_zn, scale, lo, hi,
                HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, HAS_BIAS: tl.constexpr, CAUSAL: tl.constexpr,
                HAS_WINDOW: tl.constexpr, HAS_TARGETS: tl.constexpr, HAS_CONTEXT: tl.constexpr,
                ACT: tl.constexpr, FAST_ACT: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
                BLOCK_M: tl.constexpr):
    """Transposed tiles: rows are keys (BLOCK_N), columns are queries (BLOCK_M)."""
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + tl.arange(0, BLOCK_M)
        row_ok = rows < q_len
        q = load_rows(q_base, rows, offs_d, stride_qm, stride_qd, row_ok, HEAD_D, BLOCK_D, MASKED)
        do = load_rows(do_base, rows, offs_d, stride_gm, stride_gd, row_ok, HEAD_D, BLOCK_D, MASKED)
        s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * scale
        if MASKED:
            valid_t = pair_mask(rows[None, :], offs_n[:, None], q_len, kv_len, window, n_targets, ctx,
                                CAUSAL, HAS_WINDOW, HAS_TARGETS, HAS_CONTEXT)
        if HAS_BIAS:
            z_ptrs = z_base + (rows.to(tl.int64)[None, :] * stride_zm
                               + offs_n.to(tl.int64)[:, None] * stride_zn)
            if MASKED:
                z = tl.load(z_ptrs, mask=valid_t, other=0.0)
            else:
                z = tl.load(z_ptrs)
            s_t += z.to(tl.float32)
        a_t = act(s_t, ACT, FAST_ACT)
        da_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        ds_t = da_t * act_grad(s_t, ACT, FAST_ACT)
        if MASKED:
            a_t = tl.where(valid_t, a_t, 0.0)
            ds_t = tl.where(valid_t, ds_t, 0.0)
        dv += tl.dot(a_t.to(do.dtype), do, input_precision=DOT_PRECISION)
        dk += tl.dot(ds_t.to(q.dtype), q, input_precision=DOT_PRECISION)
    return dk, dv


@autotune(configs=_DKDV_CONFIGS, key=_AUTOTUNE_KEY,
          prune_configs_by=make_prune(_DKDV_SHAPES, "dkdv"))
@per_step_jit
def _gdpa_bwd_dkdv_kernel(
    Q, K, V, Bias, DO, DK, DV,
    QLengths, KVLengths, NumTargets, Order, KVMask,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_zb, stride_zh, stride_zm, stride_zn,
    stride_gb, stride_gh, stride_gm, stride_gd,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_mb, stride_mn,
    H, max_q_len, max_kv_len, scale, out_scale, window, contextual_len,
    LQ_BUCKET, LK_BUCKET, total_q_rows,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, Q_MODE: tl.constexpr, KV_MODE: tl.constexpr,
    HAS_BIAS: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_TARGETS: tl.constexpr,
    HAS_CONTEXT: tl.constexpr, HAS_KV_MASK: tl.constexpr, ACT: tl.constexpr, FAST_ACT: tl.constexpr,
    DIVIDE: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # dK and dV share one layout (both contiguous like k), hence one set of strides
    tile, b, h = program_coordinates(Order, H, tl.cdiv(max_kv_len, BLOCK_N), False)
    q_len, kv_len, n_targets, u = sample_bounds(QLengths, KVLengths, NumTargets, b, max_q_len, max_kv_len,
                                                contextual_len, Q_MODE, KV_MODE, HAS_TARGETS, HAS_CONTEXT,
                                                total_q_rows)
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    n0 = tile * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    dk_base = DK + b64 * stride_dkb + h64 * stride_dkh
    dv_base = DV + b64 * stride_dkb + h64 * stride_dkh
    store_mask = offs_n < max_kv_len
    col_ok = offs_n < kv_len
    skip = n0 >= kv_len
    if HAS_KV_MASK:  # a key tile without a valid key (in padding or a hole of the mask): zeros
        keep = key_keep(KVMask + b64 * stride_mb, offs_n, col_ok, stride_mn)
        col_ok = col_ok & keep
        skip = skip | (tl.max(keep.to(tl.int32), 0) == 0)
    if skip:
        zeros = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        store_rows(dk_base, offs_n, offs_d, stride_dkn, stride_dkd, zeros, store_mask, HEAD_D)
        store_rows(dv_base, offs_n, offs_d, stride_dkn, stride_dkd, zeros, store_mask, HEAD_D)
        return

    q_base = Q + b64 * stride_qb + h64 * stride_qh
    do_base = DO + b64 * stride_gb + h64 * stride_gh
    if Q_MODE == 2:  # packed queries and grad_out: rows from token_offsets[b]
        row0 = query_start(QLengths, b, total_q_rows)
        q_base += row0 * stride_qm
        do_base += row0 * stride_gm
    z_base = Bias + b64 * stride_zb + h64 * stride_zh
    k = load_rows(K + b64 * stride_kb + h64 * stride_kh, offs_n, offs_d, stride_kn, stride_kd, col_ok,
                  HEAD_D, BLOCK_D, True)
    v = load_rows(V + b64 * stride_vb + h64 * stride_vh, offs_n, offs_d, stride_vn, stride_vd, col_ok,
                  HEAD_D, BLOCK_D, True)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    lo, mid_lo, mid_hi, hi = _query_range(n0, q_len, kv_len, window, u, CAUSAL, HAS_WINDOW, HAS_TARGETS,
                                          HAS_CONTEXT, BLOCK_M, BLOCK_N)
    if HAS_CONTEXT:
        # the contextual rows i < ctx see every history key (j < u), also keys j > i: the query tiles
        # holding them that lie before the causal start lo (masked; none when the tile has no history key)
        ctx_hi = tl.minimum(tl.cdiv(tl.minimum(q_len, contextual_len), BLOCK_M) * BLOCK_M, lo)
        ctx_hi = tl.where(n0 < u, ctx_hi, 0)
        dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, z_base, offs_n, offs_d, q_len, kv_len, window,
                             n_targets, contextual_len, stride_qm, stride_qd, stride_gm, stride_gd, stride_zm,
                             stride_zn, scale, lo * 0, ctx_hi, HEAD_D, BLOCK_D, HAS_BIAS, CAUSAL, HAS_WINDOW,
                             HAS_TARGETS, HAS_CONTEXT, ACT, FAST_ACT, True, DOT_PRECISION, BLOCK_M)
    # masked query tiles before the unmasked ones (the diagonal, the window's edge; empty otherwise)
    dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, z_base, offs_n, offs_d, q_len, kv_len, window,
                         n_targets, contextual_len, stride_qm, stride_qd, stride_gm, stride_gd, stride_zm,
                         stride_zn, scale, lo, mid_lo, HEAD_D, BLOCK_D, HAS_BIAS, CAUSAL, HAS_WINDOW,
                         HAS_TARGETS, HAS_CONTEXT, ACT, FAST_ACT, True, DOT_PRECISION, BLOCK_M)
    dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, z_base, offs_n, offs_d, q_len, kv_len, window,
                         n_targets, contextual_len, stride_qm, stride_qd, stride_gm, stride_gd, stride_zm,
                         stride_zn, scale, mid_lo, mid_hi, HEAD_D, BLOCK_D, HAS_BIAS, CAUSAL, HAS_WINDOW,
                         HAS_TARGETS, HAS_CONTEXT, ACT, FAST_ACT, False, DOT_PRECISION, BLOCK_M)
    dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, z_base, offs_n, offs_d, q_len, kv_len, window,
                         n_targets, contextual_len, stride_qm, stride_qd, stride_gm, stride_gd, stride_zm,
                         stride_zn, scale, mid_hi, hi, HEAD_D, BLOCK_D, HAS_BIAS, CAUSAL, HAS_WINDOW,
                         HAS_TARGETS, HAS_CONTEXT, ACT, FAST_ACT, True, DOT_PRECISION, BLOCK_M)
    c = output_scale(out_scale, kv_len, DIVIDE)
    if HAS_KV_MASK:  # a row of dK/dV is one key's: masked-out keys (scored as k = 0 above) get exactly 0
        dk = tl.where(keep[:, None], dk, 0.0)
        dv = tl.where(keep[:, None], dv, 0.0)
    store_rows(dk_base, offs_n, offs_d, stride_dkn, stride_dkd, dk * (c * scale), store_mask, HEAD_D)
    store_rows(dv_base, offs_n, offs_d, stride_dkn, stride_dkd, dv * c, store_mask, HEAD_D)


@triton.jit
def _dq_inner(dq, q, do, k_base, v_base, z_base, ds_base, kvm_base, offs_m, offs_n, offs_d, q_len, kv_len,
              window, n_targets, ctx, stride_kn, stride_kd, stride_vn, stride_vd, stride_zm, stride_zn,
              stride_sm, stride_mn, scale, c, lo, hi, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr,
              HAS_BIAS: tl.constexpr, BIAS_GRAD: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
              HAS_TARGETS: tl.constexpr, HAS_CONTEXT: tl.constexpr, HAS_KV_MASK: tl.constexpr,
              ACT: tl.constexpr, FAST_ACT: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
              BLOCK_N: tl.constexpr):
    row_ok = offs_m < q_len
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        col_ok = cols < kv_len
        if HAS_KV_MASK:  # masked-out keys load as 0 (no garbage) and are dropped from every tile
            keep = key_keep(kvm_base, cols, col_ok, stride_mn)
            col_ok = col_ok & keep
            k = load_rows(k_base, cols, offs_d, stride_kn, stride_kd, col_ok, HEAD_D, BLOCK_D, True)
            v = load_rows(v_base, cols, offs_d, stride_vn, stride_vd, col_ok, HEAD_D, BLOCK_D, True)
        else:
            k = load_rows(k_base, cols, offs_d, stride_kn, stride_kd, col_ok, HEAD_D, BLOCK_D, MASKED)
            v = load_rows(v_base, cols, offs_d, stride_vn, stride_vd, col_ok, HEAD_D, BLOCK_D, MASKED)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        if MASKED:
            valid = pair_mask(offs_m[:, None], cols[None, :], q_len, kv_len, window, n_targets, ctx, CAUSAL,
                              HAS_WINDOW, HAS_TARGETS, HAS_CONTEXT)
            if HAS_KV_MASK:
                valid = valid & keep[None, :]
        if HAS_BIAS:
            z_ptrs = z_base + (offs_m.to(tl.int64)[:, None] * stride_zm
                               + cols.to(tl.int64)[None, :] * stride_zn)
            if MASKED:
                z = tl.load(z_ptrs, mask=valid, other=0.0)
            else:
                z = tl.load(z_ptrs, mask=row_ok[:, None], other=0.0)
            s += z.to(tl.float32)
        da = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = da * act_grad(s, ACT, FAST_ACT)
        if MASKED:
            ds = tl.where(valid, ds, 0.0)
        elif HAS_KV_MASK:
            ds = tl.where(keep[None, :], ds, 0.0)
        if BIAS_GRAD:
            s_ptrs = ds_base + offs_m.to(tl.int64)[:, None] * stride_sm + cols.to(tl.int64)[None, :]
            tl.store(s_ptrs, ds * c, mask=row_ok[:, None] & col_ok[None, :])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)
    return dq


@autotune(configs=_DQ_CONFIGS, key=_AUTOTUNE_KEY + ["BIAS_GRAD"],
          prune_configs_by=make_prune(_DQ_SHAPES, "dq"))
@per_step_jit
def _gdpa_bwd_dq_kernel(
    Q, K, V, Bias, DO, DQ, DS,
    QLengths, KVLengths, NumTargets, Order, KVMask, KVBounds,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_zb, stride_zh, stride_zm, stride_zn,
    stride_gb, stride_gh, stride_gm, stride_gd,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    stride_sb, stride_sh, stride_sm,
    stride_mb, stride_mn,
    H, max_q_len, max_kv_len, scale, out_scale, window, contextual_len,
    LQ_BUCKET, LK_BUCKET, total_q_rows,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, Q_MODE: tl.constexpr, KV_MODE: tl.constexpr,
    HAS_BIAS: tl.constexpr, BIAS_GRAD: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_TARGETS: tl.constexpr, HAS_CONTEXT: tl.constexpr, HAS_KV_MASK: tl.constexpr, ACT: tl.constexpr,
    FAST_ACT: tl.constexpr, DIVIDE: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    tile, b, h = program_coordinates(Order, H, tl.cdiv(max_q_len, BLOCK_M), CAUSAL)
    q_len, kv_len, n_targets, u = sample_bounds(QLengths, KVLengths, NumTargets, b, max_q_len, max_kv_len,
                                                contextual_len, Q_MODE, KV_MODE, HAS_TARGETS, HAS_CONTEXT,
                                                total_q_rows)
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    m0 = tile * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    dq_base = DQ + b64 * stride_dqb + h64 * stride_dqh
    q_base = Q + b64 * stride_qb + h64 * stride_qh
    do_base = DO + b64 * stride_gb + h64 * stride_gh
    store_mask = offs_m < max_q_len
    if Q_MODE == 2:  # packed queries: rows from token_offsets[b]; never write the next sequence's rows
        row0 = query_start(QLengths, b, total_q_rows)
        dq_base += row0 * stride_dqm
        q_base += row0 * stride_qm
        do_base += row0 * stride_gm
        store_mask = offs_m < q_len
    if m0 >= q_len:
        if Q_MODE != 2:
            store_rows(dq_base, offs_m, offs_d, stride_dqm, stride_dqd,
                       tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32), store_mask, HEAD_D)
        return

    row_ok = offs_m < q_len
    q = load_rows(q_base, offs_m, offs_d, stride_qm, stride_qd, row_ok, HEAD_D, BLOCK_D, True)
    do = load_rows(do_base, offs_m, offs_d, stride_gm, stride_gd, row_ok, HEAD_D, BLOCK_D, True)
    k_base = K + b64 * stride_kb + h64 * stride_kh
    v_base = V + b64 * stride_vb + h64 * stride_vh
    z_base = Bias + b64 * stride_zb + h64 * stride_zh
    ds_base = DS + b64 * stride_sb + h64 * stride_sh
    m_base = KVMask + b64 * stride_mb
    c = output_scale(out_scale, kv_len, DIVIDE)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo, mid_lo, mid_hi, hi = _key_range(m0, q_len, kv_len, window, u, contextual_len, CAUSAL, HAS_WINDOW,
                                        HAS_TARGETS, HAS_CONTEXT, BLOCK_M, BLOCK_N)
    if HAS_KV_MASK:
        lo, mid_lo, mid_hi, hi = masked_key_range(KVBounds, b, lo, mid_lo, mid_hi, hi, BLOCK_N)
    if HAS_WINDOW:  # the window's left edge: masked tiles before the unmasked ones
        dq = _dq_inner(dq, q, do, k_base, v_base, z_base, ds_base, m_base, offs_m, offs_n, offs_d, q_len,
                       kv_len, window, n_targets, contextual_len, stride_kn, stride_kd, stride_vn, stride_vd,
                       stride_zm, stride_zn, stride_sm, stride_mn, scale, c, lo, mid_lo, HEAD_D, BLOCK_D,
                       HAS_BIAS, BIAS_GRAD, CAUSAL, HAS_WINDOW, HAS_TARGETS, HAS_CONTEXT, HAS_KV_MASK, ACT,
                       FAST_ACT, True, DOT_PRECISION, BLOCK_N)
    dq = _dq_inner(dq, q, do, k_base, v_base, z_base, ds_base, m_base, offs_m, offs_n, offs_d, q_len, kv_len,
                   window, n_targets, contextual_len, stride_kn, stride_kd, stride_vn, stride_vd, stride_zm,
                   stride_zn, stride_sm, stride_mn, scale, c, mid_lo, mid_hi, HEAD_D, BLOCK_D, HAS_BIAS,
                   BIAS_GRAD, CAUSAL, HAS_WINDOW, HAS_TARGETS, HAS_CONTEXT, HAS_KV_MASK, ACT, FAST_ACT, False,
                   DOT_PRECISION, BLOCK_N)
    dq = _dq_inner(dq, q, do, k_base, v_base, z_base, ds_base, m_base, offs_m, offs_n, offs_d, q_len, kv_len,
                   window, n_targets, contextual_len, stride_kn, stride_kd, stride_vn, stride_vd, stride_zm,
                   stride_zn, stride_sm, stride_mn, scale, c, mid_hi, hi, HEAD_D, BLOCK_D, HAS_BIAS, BIAS_GRAD,
                   CAUSAL, HAS_WINDOW, HAS_TARGETS, HAS_CONTEXT, HAS_KV_MASK, ACT, FAST_ACT, True,
                   DOT_PRECISION, BLOCK_N)
    dq = tl.where(row_ok[:, None], dq * (c * scale), 0.0)
    store_rows(dq_base, offs_m, offs_d, stride_dqm, stride_dqd, dq, store_mask, HEAD_D)


# ---------------------------------------------------------------------------------------------------
# Launchers


def _sides(q, k, q_lengths, kv_lengths, q_order=None, kv_order=None, kv_mask=None, token_offsets=None,
           packed_len=0):
    """The two sides, each with its given order (kv_order is the kv lengths' only without a kv_mask). Packed
    queries: MODE_OFFSETS, with the offsets also in ``lengths`` (the kernels read them through QLengths)."""
    Lq, Lk = (q.shape[2] if token_offsets is None else int(packed_len)), k.shape[2]
    dummy = kv_lengths if kv_lengths is not None else q_lengths
    if dummy is None:
        dummy = torch.zeros(1, dtype=torch.int32, device=q.device)
    if token_offsets is not None:
        q_side = Side(MODE_OFFSETS, token_offsets, token_offsets, Lq, q.shape[0], dummy, q_order)
    else:
        q_side = Side(MODE_FULL if q_lengths is None else MODE_LENGTHS, None, q_lengths, Lq, Lq, dummy, q_order)
    kv_side = Side(MODE_FULL if kv_lengths is None else MODE_LENGTHS, None, kv_lengths, Lk, Lk, dummy,
                   kv_order if kv_mask is None else None)
    return q_side, kv_side


def _order_by(first: Side, second: Side, B: int, device) -> torch.Tensor:
    """Batches longest first by the lengths of ``first`` (``second``'s when first has none)."""
    return batch_order(first if first.sort_key() is not None else second, B, device)


def _key_loop_order(q_side: Side, kv_side: Side, kv_span, B: int, device, kv_order=None) -> torch.Tensor:
    """The batch order of the programs that loop over keys (forward, dQ): by kv lengths (q lengths when
    none), or with a kv_mask by its span kv_hi - kv_lo (what they iterate; ``kv_order`` when given)."""
    if kv_span is None:
        return _order_by(kv_side, q_side, B, device)
    return kv_order if kv_order is not None else longest_first_order(kv_span)


def _query_loop_order(q_side: Side, kv_side: Side, kv_order, kv_span, q_lengths, kv_lengths, B: int, device):
    """The batch order of the programs that loop over queries (dK/dV; the bias-gradient kernel's prefix
    search needs it): by q lengths, else kv_order (also when kv_order is by the same lengths)."""
    if q_side.sort_key() is None or (kv_span is None and q_lengths is kv_lengths):
        return kv_order
    return _order_by(q_side, kv_side, B, device)


def _kv_mask_args(kv_mask, kv_lengths, dummy: torch.Tensor, given_bounds=None):
    """(the mask the kernels read (uint8 view, its strides: read in place), its (b, n) strides, KVBounds
    (B, 3) int32 [kv_lo, kv_hi, holes] (common/length_order.py; ``given_bounds`` when the graph derived
    them), the span (B,) int32 max(kv_hi - kv_lo, 0) or None). Device-side torch ops, no host sync."""
    if kv_mask is None:
        return dummy, (0, 0), dummy, None
    bounds = mask_key_bounds(kv_mask, kv_lengths, given_bounds)
    return kv_mask.view(torch.uint8), kv_mask.stride(), bounds, key_span(bounds)


def _bias_args(bias, q, B, H, Lq, Lk, relative_offset=None):
    """(the tensor the kernels read the bias through, its (b, h, m, n) strides); a relative table is read
    in place through a view with a negative row stride (relative_table.py)."""
    if bias is None:
        return q, (0, 0, 0, 0)
    if relative_offset is not None:
        return toeplitz_view(bias, relative_offset, B, H)
    return bias, bias.expand(B, H, Lq, Lk).stride()


# The SFU's tanh in sigmoid-based activations (silu, sigmoid, gelu_tanh; see pairs_triton.py) for bf16/fp16
# inputs on the GPU: their activation is cast to 16 bits before its dot, so the 2^-11 error is below that cast's.
# fp32 inputs keep tl.sigmoid (their float64 checks are tighter), and so does the CPU interpreter (no inline
# assembly there). False: tl.sigmoid everywhere (benchmarks/gdpa.py --diagnose times both).
SFU_ACTIVATIONS = True


def sfu_activation(dtype: torch.dtype) -> bool:
    """Whether the kernels evaluate sigmoid-based activations with the SFU's tanh for inputs of ``dtype``."""
    return SFU_ACTIVATIONS and not INTERPRET and dtype in (torch.bfloat16, torch.float16)


def _total_q_rows(q_side: Side) -> int:
    """The kernels' total_q_rows: T for packed queries; 0 (never read) otherwise, so that the padded kernels
    keep one integer specialization whatever Lq is."""
    return q_side.total_rows if q_side.mode == MODE_OFFSETS else 0


def _query_strides(t, B: int, packed: bool):
    """(b, h, m, d) strides of q, out, grad_out or dq: packed (T, H, D) rows with batch stride 0, or padded
    (batch stride 0 for queries shared by the batch)."""
    if packed:
        return 0, t.stride(1), t.stride(0), t.stride(2)
    return bhld_strides(t, t.shape[0] != B)


def _flags(q, D, q_side, kv_side, has_bias, spec: GdpaSpec, has_targets, has_kv_mask=False):
    return dict(HEAD_D=D, BLOCK_D=block_d(D), Q_MODE=q_side.mode, KV_MODE=kv_side.mode, HAS_BIAS=has_bias,
                CAUSAL=bool(spec.causal), HAS_WINDOW=int(spec.window) > 0, HAS_TARGETS=bool(has_targets),
                HAS_CONTEXT=int(spec.contextual_len) > 0, HAS_KV_MASK=bool(has_kv_mask),
                ACT=activation_code(spec.activation),
                FAST_ACT=sfu_activation(q.dtype), DIVIDE=bool(spec.divide_by_kv_length),
                DOT_PRECISION=dot_precision(q.dtype))


def _loop_bounds(spec: GdpaSpec, num_targets, kv_mask=None) -> tuple[int, int]:
    """(window, contextual_len) as ints, checked: the loop bounds of targets / a contextual prefix
    assume causal; a kv_mask's span is not combined with them."""
    window, contextual_len = int(spec.window), int(spec.contextual_len)
    if window < 0:
        raise ValueError(f"window must be >= 0 (0: no window), got {window}")
    if contextual_len < 0:
        raise ValueError(f"contextual_len must be >= 0, got {contextual_len}")
    if (num_targets is not None or contextual_len > 0) and not spec.causal:
        raise ValueError("num_targets and contextual_len > 0 require causal=True")
    if kv_mask is not None and (num_targets is not None or contextual_len > 0):
        raise ValueError("kv_mask is not served together with num_targets or contextual_len > 0")
    return window, contextual_len


def gdpa_forward_triton(q, k, v, q_lengths, kv_lengths, bias, spec: GdpaSpec, num_targets=None, kv_mask=None,
                        *, q_order=None, kv_order=None, kv_bounds=None, token_offsets=None, packed_len=0):
    """q (Bq, H, Lq, D), Bq in {1, B}; k, v (B, H, Lk, D) -> out (B, H, Lq, D) contiguous in q's dtype.
    num_targets (B,) int or None, spec.contextual_len >= 0: HSTU's target mask and contextual prefix
    (causal). spec.relative_offset: bias is a relative table (T,) or (T, Hz),
    bias[b, h, i, j] = table[j - i + offset, h]. kv_mask: None or bool (B, Lk), any strides. q_order,
    kv_order, kv_bounds: the derived tensors of common/length_order.py when the caller has them (computed
    here otherwise). token_offsets, packed_len: packed q (T, H, D) -> packed out (T, H, D), zeros on rows
    outside every sequence (op.py)."""
    window, contextual_len = _loop_bounds(spec, num_targets, kv_mask)
    B, H, Lk, D = k.shape
    packed = token_offsets is not None
    Lq = int(packed_len) if packed else q.shape[2]
    out = torch.empty(q.shape if packed else (B, H, Lq, D), dtype=q.dtype, device=q.device)
    if out.numel() == 0 or B * H * Lq == 0 or Lk == 0:  # no pair: zeros
        return out.zero_()
    if packed:  # rows outside every sequence (a bucketed index's slack) belong to no program: 0
        fill_slack_rows(token_offsets, (out, 0.0))
    q_side, kv_side = _sides(q, k, q_lengths, kv_lengths, q_order, kv_order, kv_mask, token_offsets, Lq)
    bias_t, z_strides = _bias_args(bias, q, B, H, Lq, Lk, spec.relative_offset)
    mask_t, m_strides, bounds, span = _kv_mask_args(kv_mask, kv_lengths, kv_side.lengths, kv_bounds)
    order = _key_loop_order(q_side, kv_side, span, B, q.device, kv_order)
    buckets = (length_bucket(Lq), length_bucket(Lk))

    def grid(meta):
        return (triton.cdiv(Lq, meta["BLOCK_M"]) * B * H,)

    targets = num_targets if num_targets is not None else kv_side.lengths  # (a dummy pointer when None)
    launch(_gdpa_fwd_kernel, grid, (
        q, k, v, bias_t, out, q_side.lengths, kv_side.lengths, targets, order, mask_t, bounds,
        *_query_strides(q, B, packed), *k.stride(), *v.stride(), *z_strides, *_query_strides(out, B, packed),
        *m_strides, H, Lq, Lk, float(spec.scale), float(spec.out_scale), window, contextual_len, *buckets,
        _total_q_rows(q_side),
    ), _flags(q, D, q_side, kv_side, bias is not None, spec, num_targets is not None, kv_mask is not None),
        buckets)
    return out


def gdpa_backward_triton(grad_out, q, k, v, q_lengths, kv_lengths, bias, spec: GdpaSpec, num_targets=None,
                         bias_requires_grad: bool = False, kv_mask=None, *, bias_grad_splits: int | None = None,
                         q_order=None, kv_order=None, kv_bounds=None, token_offsets=None, packed_len=0):
    """-> (dq like q, dk, dv, dbias like bias or an empty tensor). Deterministic (no atomics). A bias with
    full (Lq, Lk) dims gets its gradient from bias_grad_triton.py (reduced over the shared batch and
    head dims in-kernel, in ``bias_grad_splits`` parts: None = enough to fill the GPU); any other bias
    from the dQ kernel's per-pair buffer, summed by torch. A relative table (``relative_offset``) gets the
    in-kernel parts' diagonal sums (diagonal_sums_triton.py). token_offsets, packed_len: packed q and grad_out
    (T, H, D) -> packed dq, zeros on rows outside every sequence."""
    from .bias_grad_triton import bias_grad_parts, bias_grad_triton, full_bias_grad_supported

    window, contextual_len = _loop_bounds(spec, num_targets, kv_mask)
    relative_offset = spec.relative_offset
    B, H, Lk, D = k.shape
    packed = token_offsets is not None
    Lq = int(packed_len) if packed else q.shape[2]
    shared_q = not packed and q.shape[0] != B
    bias_grad = bias is not None and bias_requires_grad
    relative = relative_offset is not None
    in_kernel_bias_grad = bias_grad and (relative or full_bias_grad_supported(bias, Lq, Lk))
    dbias = None
    dk = torch.empty((B, H, Lk, D), dtype=k.dtype, device=k.device)
    dv = torch.empty((B, H, Lk, D), dtype=v.dtype, device=v.device)
    if packed:  # zero gradients on rows outside every sequence (filled below; the kernel writes the others)
        dq_buffer = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    else:
        dq_buffer = torch.empty((B, H, Lq, D), dtype=torch.float32 if shared_q else q.dtype, device=q.device)
    ds = (torch.zeros((B, H, Lq, Lk), dtype=torch.float32, device=q.device)
          if bias_grad and not in_kernel_bias_grad else None)
    if B * H > 0 and Lq > 0 and Lk > 0 and q.numel() > 0:
        q_side, kv_side = _sides(q, k, q_lengths, kv_lengths, q_order, kv_order, kv_mask, token_offsets, Lq)
        if packed:
            fill_slack_rows(token_offsets, (dq_buffer, 0.0))
        bias_t, z_strides = _bias_args(bias, q, B, H, Lq, Lk, relative_offset)
        if ds is None:
            ds_t, ds_strides = dq_buffer, (0, 0, 0)
        else:
            ds_t, ds_strides = ds, ds.stride()[:3]
        flags = _flags(q, D, q_side, kv_side, bias is not None, spec, num_targets is not None,
                       kv_mask is not None)
        buckets = (length_bucket(Lq), length_bucket(Lk))
        scalars = (H, Lq, Lk, float(spec.scale), float(spec.out_scale), window, contextual_len, *buckets,
                   _total_q_rows(q_side))
        targets = num_targets if num_targets is not None else kv_side.lengths  # (a dummy pointer when None)
        q_strides = _query_strides(q, B, packed)
        g_strides = _query_strides(grad_out, B, packed) if packed else grad_out.stride()
        mask_t, m_strides, bounds, span = _kv_mask_args(kv_mask, kv_lengths, kv_side.lengths, kv_bounds)
        # dK/dV programs loop over query rows: order by q lengths; dQ programs loop over keys: by kv lengths
        kv_order = _key_loop_order(q_side, kv_side, span, B, q.device, kv_order)
        q_order = _query_loop_order(q_side, kv_side, kv_order, span, q_lengths, kv_lengths, B, q.device)
        launch(_gdpa_bwd_dkdv_kernel, lambda meta: (triton.cdiv(Lk, meta["BLOCK_N"]) * B * H,), (
            q, k, v, bias_t, grad_out, dk, dv, q_side.lengths, kv_side.lengths, targets, q_order, mask_t,
            *q_strides, *k.stride(), *v.stride(), *z_strides, *g_strides, *dk.stride(), *m_strides,
            *scalars), flags, buckets)
        launch(_gdpa_bwd_dq_kernel, lambda meta: (triton.cdiv(Lq, meta["BLOCK_M"]) * B * H,), (
            q, k, v, bias_t, grad_out, dq_buffer, ds_t, q_side.lengths, kv_side.lengths, targets, kv_order,
            mask_t, bounds, *q_strides, *k.stride(), *v.stride(), *z_strides, *g_strides,
            *_query_strides(dq_buffer, B, packed), *ds_strides, *m_strides,
            *scalars), dict(flags, BIAS_GRAD=ds is not None),
            buckets)
        key_mask = (mask_t, m_strides)
        if in_kernel_bias_grad and relative:
            part = bias_grad_parts(q, k, v, bias_t, 1, table_heads(bias), grad_out, q_side, kv_side, targets,
                                   q_order, q_strides, z_strides, flags, scalars[:7], bias_grad_splits,
                                   key_mask=key_mask, g_strides=g_strides)
            dbias = relative_table_grad_triton(part, bias, relative_offset)
        elif in_kernel_bias_grad:
            dbias = bias_grad_triton(q, k, v, bias, grad_out, q_side, kv_side, targets, q_order, q_strides,
                                     z_strides, flags, scalars[:7], bias_grad_splits, key_mask=key_mask,
                                     g_strides=g_strides)
    else:
        dk.zero_()
        dv.zero_()
        dq_buffer.zero_()
    dq = dq_buffer.sum(dim=0, keepdim=True).to(q.dtype) if shared_q else dq_buffer
    if dbias is None:
        if ds is not None:
            dbias = reduce_bias_grad(ds, bias)
        elif bias_grad:  # nothing ran (an empty batch, head or length): no pair, no gradient
            dbias = torch.zeros_like(bias)
        else:
            dbias = q.new_empty(0)
    return dq, dk, dv, dbias
