"""Triton kernels of jagged softmax attention (forward and deterministic backward) and their launchers.

One kernel serves both layouts. Every sequence is addressed by (start row, length): in the padded
layout (B, H, L, D) the start row is 0 and the length comes from a lengths tensor (clamped into
[0, L]); in the packed layout (T, H, D) the start row and length come from an offsets tensor (B+1,).
Any strides are read as given (permuted and expanded views are never copied); batch stride 0 serves
q shared by the batch (Bq = 1). All element offsets of a sequence's base are computed in int64.

Forward (``_fwd_kernel``): one program per (query tile, batch*head), flattened into a 1-D grid whose
size depends only on static shapes. Programs are mapped to batches through a device-side argsort of
the kv lengths (longest first), so the longest programs start first and the tail is short; with
``causal`` the tiles of a sequence run from the last (heaviest) to the first. A tile that starts past
its sequence's length only writes zeros (padded layout) and exits; the key loop stops at the
sequence's kv length (and at the diagonal when causal). The key loop runs in two parts: key tiles that
need no masking (inside kv_len and fully below the diagonal) and the tiles that do. Online softmax in
fp32 with exp2 (log2 e is folded into the scale); a row with no valid key gets out = 0 and lse = +inf.

Backward, deterministic, no atomics: ``_bwd_delta_kernel`` computes delta = rowsum(dO * O);
``_bwd_dkdv_kernel`` runs one program per key tile and loops over query tiles accumulating dK and dV;
``_bwd_dq_kernel`` runs one program per query tile and loops over key tiles accumulating dQ. When the
bias needs a gradient, ``_bwd_dq_kernel`` writes dS once per element into a (B, H, Lq, Lk) fp32 buffer
that the launcher sums over the bias's broadcast dims with torch (memory: B*H*Lq*Lk*4 bytes, only
when the bias requires grad). P is rebuilt from the saved lse, never from a second forward pass.

Precision: scores, softmax statistics and accumulators are fp32; P and dS are cast to the input dtype
for the P.V, dS.K and dS^T.Q dots, as flash attention does. fp32 inputs use 3xTF32 dots when torch's
float32 matmul precision is "highest" (the default) and TF32 otherwise.

Autotuning is keyed on bucketed lengths (next power of two of the padded/max lengths, never the raw
lengths), the head dim and the layout/mask flags. Under TRITON_INTERPRET=1 each kernel has one small
config so that CPU tests stay fast. Only APIs present in triton 3.6 are used.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from gemcompile.runtime.jagged import bucket_length

__all__ = [
    "jagged_attention_forward_triton",
    "jagged_attention_backward_triton",
    "length_bucket",
]

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
_LOG2E = 1.4426950408889634

# How a side (queries or keys) finds its sequences.
MODE_FULL = 0  # every sequence has the padded length
MODE_LENGTHS = 1  # padded layout, lengths (B,) tensor, start row 0
MODE_OFFSETS = 2  # packed layout, offsets (B+1,) tensor

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def length_bucket(n: int) -> int:
    """Autotune key of a maximum length: the project's length bucket (next power of two), at least 16."""
    return bucket_length(max(int(n), 16))


# (BLOCK_M, BLOCK_N, num_warps, num_stages) -> head dims served ("small": D <= 64, "large": D > 64).
# Short, Hopper-friendly lists: configs that spill registers at a head dim (checked with ptxas for sm_90)
# are left out for it, so tuning stays cheap (a handful of compiles per kernel variant).
_FWD_SHAPES = {
    (128, 64, 4, 3): ("small",), (128, 64, 8, 3): ("small", "large"), (128, 128, 8, 3): ("small", "large"),
    (64, 64, 4, 3): ("small", "large"),
}
# dK/dV: BLOCK_N keys per program, BLOCK_M query rows per inner step.
_DKDV_SHAPES = {
    (32, 128, 8, 3): ("small", "large"), (32, 64, 4, 3): ("small", "large"), (64, 64, 4, 3): ("small",),
    (64, 128, 8, 3): ("small",), (64, 64, 8, 2): ("large",),
}
# dQ: BLOCK_M query rows per program, BLOCK_N keys per inner step.
_DQ_SHAPES = {
    (128, 32, 8, 3): ("small", "large"), (128, 64, 8, 3): ("small", "large"),
    (64, 64, 4, 3): ("small", "large"), (128, 32, 4, 4): ("small",), (64, 32, 4, 3): ("large",),
}


def _configs(shapes, interpret_shape):
    if _INTERPRET:
        m, n = interpret_shape
        return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=4, num_stages=1)]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in shapes]


_FWD_CONFIGS = _configs(_FWD_SHAPES, (32, 16))
_DKDV_CONFIGS = _configs(_DKDV_SHAPES, (16, 32))
_DQ_CONFIGS = _configs(_DQ_SHAPES, (32, 16))
# bucketed lengths, never the raw lengths; the autotuner adds the dtypes of the tensor arguments itself
_AUTOTUNE_KEY = ["LQ_BUCKET", "LK_BUCKET", "HEAD_D", "Q_MODE", "KV_MODE", "HAS_BIAS", "CAUSAL",
                 "DOT_PRECISION"]


SHARED_MEMORY_BUDGET = 227 * 1024
"""Bytes of shared memory a block may use on Hopper. The tile estimate below matched what Triton asked
for on an H200 (256 KiB for fp32, D=128, 128x64 tiles, 3 stages: refused)."""

# per kernel: (tiles streamed per pipeline stage, tiles resident) in units of (rows x BLOCK_D) for each
# of BLOCK_M and BLOCK_N: fwd streams K and V (2 x BLOCK_N) and holds Q (BLOCK_M); dK/dV streams Q and
# dO (2 x BLOCK_M) and holds K and V (2 x BLOCK_N); dQ streams K and V and holds Q and dO.
_SMEM_TILES = {"fwd": ((0, 2), (1, 0)), "dkdv": ((2, 0), (0, 2)), "dq": ((0, 2), (2, 0))}


def _shared_memory(kind: str, block_m: int, block_n: int, stages: int, block_d: int, element_size: int) -> int:
    (sm, sn), (rm, rn) = _SMEM_TILES[kind]
    if element_size == 4:  # fp32 dots run as 3xTF32: Triton keeps the transposed operands too (measured:
        sm, sn = 2 * sm, 2 * sn  # the dQ kernel at 64x64, 2 stages, D=128 asked for 256 KiB)
    rows = stages * (sm * block_m + sn * block_n) + rm * block_m + rn * block_n
    return rows * block_d * element_size


def _fit_shared_memory(config, kind: str, args: dict):
    """Fewer pipeline stages until the tiles fit (fp32 inputs at D=128 need fewer stages than bf16)."""
    q = args.get("Q")
    element_size = q.element_size() if hasattr(q, "element_size") else 2
    block_d = triton.next_power_of_2(int(args.get("HEAD_D", 64)))
    stages = config.num_stages
    m, n = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"]
    while stages > 1 and _shared_memory(kind, m, n, stages, block_d, element_size) > SHARED_MEMORY_BUDGET:
        stages -= 1
    if stages == config.num_stages:
        return config
    return triton.Config(dict(config.kwargs), num_warps=config.num_warps, num_stages=stages)


def _make_prune(shapes, kind):
    def prune(configs, named_args, **kwargs):
        """Keep the configs meant for this head dim whose tiles are not far larger than the lengths."""
        args = {**named_args, **kwargs}
        head = "small" if args.get("HEAD_D", 64) <= 64 else "large"
        lq, lk = args.get("LQ_BUCKET", 1 << 30), args.get("LK_BUCKET", 1 << 30)
        kept = []
        for c in configs:
            key = (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages)
            if head not in shapes.get(key, ("small", "large")):
                continue
            if c.kwargs["BLOCK_M"] > max(lq, 64) or c.kwargs["BLOCK_N"] > max(lk, 64):
                continue
            kept.append(_fit_shared_memory(c, kind, args))
        return kept or [_fit_shared_memory(configs[0], kind, args)]

    return {"early_config_prune": prune}




# ---------------------------------------------------------------------------------------------------
# Device helpers


@triton.jit
def _sequence(Offsets, Lengths, b, max_len, total_rows, MODE: tl.constexpr):
    """(start row, length) of sequence b, clamped so that no access leaves the tensor."""
    zero = b * 0
    if MODE == 2:
        start = tl.load(Offsets + b).to(tl.int32)
        end = tl.load(Offsets + b + 1).to(tl.int32)
        start = tl.minimum(tl.maximum(start, 0), total_rows)
        end = tl.minimum(tl.maximum(end, start), total_rows)
        length = tl.minimum(end - start, max_len)
    elif MODE == 1:
        start = zero
        length = tl.minimum(tl.maximum(tl.load(Lengths + b).to(tl.int32), 0), max_len)
    else:
        start = zero
        length = zero + max_len
    return start, length


@triton.jit
def _program_coordinates(Order, H, num_tiles, REVERSE: tl.constexpr):
    """1-D program id -> (tile, batch, head); batches come in the order of Order (longest first)."""
    pid = tl.program_id(0)
    bh = pid // num_tiles
    tile = pid % num_tiles
    if REVERSE:
        tile = num_tiles - 1 - tile
    b = tl.load(Order + bh // H).to(tl.int32)
    h = bh % H
    return tile, b, h


@triton.jit
def _load_rows(base, rows, offs_d, stride_r, stride_d, mask_rows, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr,
               MASK_ROWS: tl.constexpr):
    """Load a [len(rows), BLOCK_D] tile; padded head-dim columns and masked rows read as 0."""
    ptrs = base + rows.to(tl.int64)[:, None] * stride_r + offs_d[None, :] * stride_d
    if MASK_ROWS:
        if BLOCK_D == HEAD_D:
            x = tl.load(ptrs, mask=mask_rows[:, None], other=0.0)
        else:
            x = tl.load(ptrs, mask=mask_rows[:, None] & (offs_d < HEAD_D)[None, :], other=0.0)
    else:
        if BLOCK_D == HEAD_D:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=(offs_d < HEAD_D)[None, :], other=0.0)
    return x


@triton.jit
def _store_rows(base, rows, offs_d, stride_r, stride_d, value, mask_rows, HEAD_D: tl.constexpr):
    ptrs = base + rows.to(tl.int64)[:, None] * stride_r + offs_d[None, :] * stride_d
    tl.store(ptrs, value.to(base.dtype.element_ty), mask=mask_rows[:, None] & (offs_d < HEAD_D)[None, :])


# ---------------------------------------------------------------------------------------------------
# Forward


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, k_base, v_base, bias_base, offs_m, offs_n, offs_d, q_len, kv_len,
               stride_kn, stride_kd, stride_vn, stride_vd, stride_zm, stride_zn, qk_scale, lo, hi,
               HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, HAS_BIAS: tl.constexpr, CAUSAL: tl.constexpr,
               MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr):
    row_ok = offs_m < q_len
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        col_ok = cols < kv_len
        k = _load_rows(k_base, cols, offs_d, stride_kn, stride_kd, col_ok, HEAD_D, BLOCK_D, MASKED)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if HAS_BIAS:
            z_ptrs = bias_base + (offs_m.to(tl.int64)[:, None] * stride_zm
                                  + cols.to(tl.int64)[None, :] * stride_zn)
            if MASKED:
                z = tl.load(z_ptrs, mask=row_ok[:, None] & col_ok[None, :], other=0.0)
            else:
                z = tl.load(z_ptrs, mask=row_ok[:, None], other=0.0)
            s += z.to(tl.float32) * LOG2E
        if MASKED:
            valid = col_ok[None, :]
            if CAUSAL:
                valid = valid & (cols[None, :] <= offs_m[:, None])
            s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a row whose scores are all -inf so far (e.g. a -inf bias) must not produce inf - inf = NaN
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_rows(v_base, cols, offs_d, stride_vn, stride_vd, col_ok, HEAD_D, BLOCK_D, MASKED)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.autotune(configs=_FWD_CONFIGS, key=_AUTOTUNE_KEY, prune_configs_by=_make_prune(_FWD_SHAPES, "fwd"))
@triton.jit
def _fwd_kernel(
    Q, K, V, Bias, Out, Lse,
    QOffsets, QLengths, KVOffsets, KVLengths, Order,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_zb, stride_zh, stride_zm, stride_zn,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_lb, stride_lh, stride_lm,
    H, max_q_len, max_kv_len, total_q_rows, total_kv_rows, qk_scale,
    LQ_BUCKET, LK_BUCKET,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, Q_MODE: tl.constexpr, KV_MODE: tl.constexpr,
    HAS_BIAS: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    tile, b, h = _program_coordinates(Order, H, tl.cdiv(max_q_len, BLOCK_M), CAUSAL)
    q_start, q_len = _sequence(QOffsets, QLengths, b, max_q_len, total_q_rows, Q_MODE)
    kv_start, kv_len = _sequence(KVOffsets, KVLengths, b, max_kv_len, total_kv_rows, KV_MODE)
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    m0 = tile * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    o_base = Out + b64 * stride_ob + h64 * stride_oh + q_start.to(tl.int64) * stride_om
    l_base = Lse + b64 * stride_lb + h64 * stride_lh + q_start.to(tl.int64) * stride_lm
    # packed rows past the sequence belong to the next one: never write them
    if Q_MODE == 2:
        store_rows = offs_m < q_len
    else:
        store_rows = offs_m < max_q_len
    if m0 >= q_len:
        if Q_MODE != 2:
            _store_rows(o_base, offs_m, offs_d, stride_om, stride_od,
                        tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32), store_rows, HEAD_D)
            tl.store(l_base + offs_m * stride_lm, tl.full([BLOCK_M], float("inf"), tl.float32),
                     mask=store_rows)
        return

    row_ok = offs_m < q_len
    q_base = Q + b64 * stride_qb + h64 * stride_qh + q_start.to(tl.int64) * stride_qm
    k_base = K + b64 * stride_kb + h64 * stride_kh + kv_start.to(tl.int64) * stride_kn
    v_base = V + b64 * stride_vb + h64 * stride_vh + kv_start.to(tl.int64) * stride_vn
    z_base = Bias + b64 * stride_zb + h64 * stride_zh
    q = _load_rows(q_base, offs_m, offs_d, stride_qm, stride_qd, row_ok, HEAD_D, BLOCK_D, True)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = kv_len
    full_end = (kv_len // BLOCK_N) * BLOCK_N
    if CAUSAL:
        hi = tl.minimum(hi, tl.minimum(m0 + BLOCK_M, q_len))
        full_end = tl.minimum(full_end, ((m0 + 1) // BLOCK_N) * BLOCK_N)
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, k_base, v_base, z_base, offs_m, offs_n, offs_d, q_len, kv_len, stride_kn, stride_kd,
        stride_vn, stride_vd, stride_zm, stride_zn, qk_scale, 0, full_end, HEAD_D, BLOCK_D, HAS_BIAS, CAUSAL,
        False, DOT_PRECISION, BLOCK_N)
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, k_base, v_base, z_base, offs_m, offs_n, offs_d, q_len, kv_len, stride_kn, stride_kd,
        stride_vn, stride_vd, stride_zm, stride_zn, qk_scale, full_end, hi, HEAD_D, BLOCK_D, HAS_BIAS, CAUSAL,
        True, DOT_PRECISION, BLOCK_N)
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    out = tl.where(row_ok[:, None], out, 0.0)
    lse = tl.where(empty | (~row_ok), float("inf"), (m_i + tl.log2(l_safe)) * LN2)
    _store_rows(o_base, offs_m, offs_d, stride_om, stride_od, out, store_rows, HEAD_D)
    tl.store(l_base + offs_m * stride_lm, lse, mask=store_rows)


# ---------------------------------------------------------------------------------------------------
# Backward


@triton.jit
def _bwd_delta_kernel(
    Out, DO, Delta, QOffsets, QLengths,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_gb, stride_gh, stride_gm, stride_gd,
    stride_lb, stride_lh, stride_lm,
    H, max_q_len, total_q_rows,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, Q_MODE: tl.constexpr, BLOCK_M: tl.constexpr,
):
    pid = tl.program_id(0)
    num_m = tl.cdiv(max_q_len, BLOCK_M)
    bh = pid // num_m
    b = bh // H
    h = bh % H
    m0 = (pid % num_m) * BLOCK_M
    q_start, q_len = _sequence(QOffsets, QLengths, b, max_q_len, total_q_rows, Q_MODE)
    if m0 >= q_len:
        return
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    start64 = q_start.to(tl.int64)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < q_len
    o = _load_rows(Out + b64 * stride_ob + h64 * stride_oh + start64 * stride_om, offs_m, offs_d,
                   stride_om, stride_od, row_ok, HEAD_D, BLOCK_D, True)
    do = _load_rows(DO + b64 * stride_gb + h64 * stride_gh + start64 * stride_gm, offs_m, offs_d,
                    stride_gm, stride_gd, row_ok, HEAD_D, BLOCK_D, True)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(Delta + b64 * stride_lb + h64 * stride_lh + (start64 + offs_m) * stride_lm, delta, mask=row_ok)


@triton.jit
def _dkdv_inner(dk, dv, k, v, q_base, do_base, l_base, d_base, z_base, offs_n, offs_d, q_len, kv_len,
                stride_qm, stride_qd, stride_gm, stride_gd, stride_lm, stride_zm, stride_zn, qk_scale, lo, hi,
                HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, HAS_BIAS: tl.constexpr, CAUSAL: tl.constexpr,
                MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr):
    col_ok = offs_n < kv_len
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + tl.arange(0, BLOCK_M)
        row_ok = rows < q_len
        q = _load_rows(q_base, rows, offs_d, stride_qm, stride_qd, row_ok, HEAD_D, BLOCK_D, MASKED)
        do = _load_rows(do_base, rows, offs_d, stride_gm, stride_gd, row_ok, HEAD_D, BLOCK_D, MASKED)
        if MASKED:
            lse = tl.load(l_base + rows * stride_lm, mask=row_ok, other=float("inf"))
            delta = tl.load(d_base + rows * stride_lm, mask=row_ok, other=0.0)
        else:
            lse = tl.load(l_base + rows * stride_lm)
            delta = tl.load(d_base + rows * stride_lm)
        s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale
        if HAS_BIAS:
            z_ptrs = z_base + (rows.to(tl.int64)[None, :] * stride_zm
                               + offs_n.to(tl.int64)[:, None] * stride_zn)
            if MASKED:
                z = tl.load(z_ptrs, mask=col_ok[:, None] & row_ok[None, :], other=0.0)
            else:
                z = tl.load(z_ptrs)
            s_t += z.to(tl.float32) * LOG2E
        p_t = tl.exp2(s_t - lse[None, :] * LOG2E)
        if MASKED:
            valid = col_ok[:, None] & row_ok[None, :]
            if CAUSAL:
                valid = valid & (rows[None, :] >= offs_n[:, None])
            p_t = tl.where(valid, p_t, 0.0)
        dv += tl.dot(p_t.to(do.dtype), do, input_precision=DOT_PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        dk += tl.dot(ds_t.to(q.dtype), q, input_precision=DOT_PRECISION)
    return dk, dv


@triton.autotune(configs=_DKDV_CONFIGS, key=_AUTOTUNE_KEY, prune_configs_by=_make_prune(_DKDV_SHAPES, "dkdv"))
@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, Bias, DO, Lse, Delta, DK, DV,
    QOffsets, QLengths, KVOffsets, KVLengths, Order,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_zb, stride_zh, stride_zm, stride_zn,
    stride_gb, stride_gh, stride_gm, stride_gd,
    stride_lb, stride_lh, stride_lm,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    H, max_q_len, max_kv_len, total_q_rows, total_kv_rows, qk_scale, scale,
    LQ_BUCKET, LK_BUCKET,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, Q_MODE: tl.constexpr, KV_MODE: tl.constexpr,
    HAS_BIAS: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # dK and dV share one layout (both contiguous like k), hence one set of strides
    tile, b, h = _program_coordinates(Order, H, tl.cdiv(max_kv_len, BLOCK_N), False)
    q_start, q_len = _sequence(QOffsets, QLengths, b, max_q_len, total_q_rows, Q_MODE)
    kv_start, kv_len = _sequence(KVOffsets, KVLengths, b, max_kv_len, total_kv_rows, KV_MODE)
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    n0 = tile * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    dk_base = DK + b64 * stride_dkb + h64 * stride_dkh + kv_start.to(tl.int64) * stride_dkn
    dv_base = DV + b64 * stride_dkb + h64 * stride_dkh + kv_start.to(tl.int64) * stride_dkn
    if KV_MODE == 2:
        store_rows = offs_n < kv_len
    else:
        store_rows = offs_n < max_kv_len
    if n0 >= kv_len:
        if KV_MODE != 2:
            zeros = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
            _store_rows(dk_base, offs_n, offs_d, stride_dkn, stride_dkd, zeros, store_rows, HEAD_D)
            _store_rows(dv_base, offs_n, offs_d, stride_dkn, stride_dkd, zeros, store_rows, HEAD_D)
        return

    col_ok = offs_n < kv_len
    start64 = q_start.to(tl.int64)
    q_base = Q + b64 * stride_qb + h64 * stride_qh + start64 * stride_qm
    do_base = DO + b64 * stride_gb + h64 * stride_gh + start64 * stride_gm
    l_base = Lse + b64 * stride_lb + h64 * stride_lh + start64 * stride_lm
    d_base = Delta + b64 * stride_lb + h64 * stride_lh + start64 * stride_lm
    z_base = Bias + b64 * stride_zb + h64 * stride_zh
    k = _load_rows(K + b64 * stride_kb + h64 * stride_kh + kv_start.to(tl.int64) * stride_kn, offs_n, offs_d,
                   stride_kn, stride_kd, col_ok, HEAD_D, BLOCK_D, True)
    v = _load_rows(V + b64 * stride_vb + h64 * stride_vh + kv_start.to(tl.int64) * stride_vn, offs_n, offs_d,
                   stride_vn, stride_vd, col_ok, HEAD_D, BLOCK_D, True)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    m_lo = 0
    if CAUSAL:
        m_lo = (n0 // BLOCK_M) * BLOCK_M  # rows i >= j >= n0
    if n0 + BLOCK_N > kv_len:
        # the last key tile of the sequence: every query tile needs the key mask
        dk, dv = _dkdv_inner(
            dk, dv, k, v, q_base, do_base, l_base, d_base, z_base, offs_n, offs_d, q_len, kv_len, stride_qm,
            stride_qd, stride_gm, stride_gd, stride_lm, stride_zm, stride_zn, qk_scale, m_lo, q_len, HEAD_D,
            BLOCK_D, HAS_BIAS, CAUSAL, True, DOT_PRECISION, BLOCK_M)
    else:
        # query tiles crossing the diagonal (causal), then full tiles unmasked, then the partial last tile
        diag_end = m_lo
        if CAUSAL:
            diag_end = m_lo + tl.cdiv(tl.maximum(n0 + BLOCK_N - 1 - m_lo, 0), BLOCK_M) * BLOCK_M
        mid_end = tl.maximum(diag_end, (q_len // BLOCK_M) * BLOCK_M)
        dk, dv = _dkdv_inner(
            dk, dv, k, v, q_base, do_base, l_base, d_base, z_base, offs_n, offs_d, q_len, kv_len, stride_qm,
            stride_qd, stride_gm, stride_gd, stride_lm, stride_zm, stride_zn, qk_scale, m_lo,
            tl.minimum(diag_end, q_len), HEAD_D, BLOCK_D, HAS_BIAS, CAUSAL, True, DOT_PRECISION, BLOCK_M)
        dk, dv = _dkdv_inner(
            dk, dv, k, v, q_base, do_base, l_base, d_base, z_base, offs_n, offs_d, q_len, kv_len, stride_qm,
            stride_qd, stride_gm, stride_gd, stride_lm, stride_zm, stride_zn, qk_scale, diag_end, mid_end,
            HEAD_D, BLOCK_D, HAS_BIAS, CAUSAL, False, DOT_PRECISION, BLOCK_M)
        dk, dv = _dkdv_inner(
            dk, dv, k, v, q_base, do_base, l_base, d_base, z_base, offs_n, offs_d, q_len, kv_len, stride_qm,
            stride_qd, stride_gm, stride_gd, stride_lm, stride_zm, stride_zn, qk_scale, mid_end, q_len,
            HEAD_D, BLOCK_D, HAS_BIAS, CAUSAL, True, DOT_PRECISION, BLOCK_M)
    _store_rows(dk_base, offs_n, offs_d, stride_dkn, stride_dkd, dk * scale, store_rows, HEAD_D)
    _store_rows(dv_base, offs_n, offs_d, stride_dkn, stride_dkd, dv, store_rows, HEAD_D)


@triton.jit
def _dq_inner(dq, q, do, lse2, delta, k_base, v_base, z_base, ds_base, offs_m, offs_n, offs_d, q_len, kv_len,
              stride_kn, stride_kd, stride_vn, stride_vd, stride_zm, stride_zn, stride_sm, qk_scale, lo, hi,
              HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_GRAD: tl.constexpr,
              CAUSAL: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr):
    row_ok = offs_m < q_len
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        col_ok = cols < kv_len
        k = _load_rows(k_base, cols, offs_d, stride_kn, stride_kd, col_ok, HEAD_D, BLOCK_D, MASKED)
        v = _load_rows(v_base, cols, offs_d, stride_vn, stride_vd, col_ok, HEAD_D, BLOCK_D, MASKED)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if HAS_BIAS:
            z_ptrs = z_base + (offs_m.to(tl.int64)[:, None] * stride_zm
                               + cols.to(tl.int64)[None, :] * stride_zn)
            if MASKED:
                z = tl.load(z_ptrs, mask=row_ok[:, None] & col_ok[None, :], other=0.0)
            else:
                z = tl.load(z_ptrs, mask=row_ok[:, None], other=0.0)
            s += z.to(tl.float32) * LOG2E
        p = tl.exp2(s - lse2[:, None])
        if MASKED:
            valid = col_ok[None, :]
            if CAUSAL:
                valid = valid & (cols[None, :] <= offs_m[:, None])
            p = tl.where(valid, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        if BIAS_GRAD:
            s_ptrs = ds_base + offs_m.to(tl.int64)[:, None] * stride_sm + cols.to(tl.int64)[None, :]
            tl.store(s_ptrs, ds, mask=row_ok[:, None] & col_ok[None, :])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)
    return dq


@triton.autotune(configs=_DQ_CONFIGS, key=_AUTOTUNE_KEY + ["BIAS_GRAD"],
                 prune_configs_by=_make_prune(_DQ_SHAPES, "dq"))
@triton.jit
def _bwd_dq_kernel(
    Q, K, V, Bias, DO, Lse, Delta, DQ, DS,
    QOffsets, QLengths, KVOffsets, KVLengths, Order,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_zb, stride_zh, stride_zm, stride_zn,
    stride_gb, stride_gh, stride_gm, stride_gd,
    stride_lb, stride_lh, stride_lm,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    stride_sb, stride_sh, stride_sm,
    H, max_q_len, max_kv_len, total_q_rows, total_kv_rows, qk_scale, scale,
    LQ_BUCKET, LK_BUCKET,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, Q_MODE: tl.constexpr, KV_MODE: tl.constexpr,
    HAS_BIAS: tl.constexpr, BIAS_GRAD: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    tile, b, h = _program_coordinates(Order, H, tl.cdiv(max_q_len, BLOCK_M), CAUSAL)
    q_start, q_len = _sequence(QOffsets, QLengths, b, max_q_len, total_q_rows, Q_MODE)
    kv_start, kv_len = _sequence(KVOffsets, KVLengths, b, max_kv_len, total_kv_rows, KV_MODE)
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    m0 = tile * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    start64 = q_start.to(tl.int64)
    dq_base = DQ + b64 * stride_dqb + h64 * stride_dqh + start64 * stride_dqm
    if Q_MODE == 2:
        store_rows = offs_m < q_len
    else:
        store_rows = offs_m < max_q_len
    if m0 >= q_len:
        if Q_MODE != 2:
            _store_rows(dq_base, offs_m, offs_d, stride_dqm, stride_dqd,
                        tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32), store_rows, HEAD_D)
        return

    row_ok = offs_m < q_len
    q = _load_rows(Q + b64 * stride_qb + h64 * stride_qh + start64 * stride_qm, offs_m, offs_d,
                   stride_qm, stride_qd, row_ok, HEAD_D, BLOCK_D, True)
    do = _load_rows(DO + b64 * stride_gb + h64 * stride_gh + start64 * stride_gm, offs_m, offs_d,
                    stride_gm, stride_gd, row_ok, HEAD_D, BLOCK_D, True)
    l_rows = b64 * stride_lb + h64 * stride_lh + (start64 + offs_m) * stride_lm
    lse2 = tl.load(Lse + l_rows, mask=row_ok, other=float("inf")) * LOG2E
    delta = tl.load(Delta + l_rows, mask=row_ok, other=0.0)
    k_base = K + b64 * stride_kb + h64 * stride_kh + kv_start.to(tl.int64) * stride_kn
    v_base = V + b64 * stride_vb + h64 * stride_vh + kv_start.to(tl.int64) * stride_vn
    z_base = Bias + b64 * stride_zb + h64 * stride_zh
    ds_base = DS + b64 * stride_sb + h64 * stride_sh

    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = kv_len
    full_end = (kv_len // BLOCK_N) * BLOCK_N
    if CAUSAL:
        hi = tl.minimum(hi, tl.minimum(m0 + BLOCK_M, q_len))
        full_end = tl.minimum(full_end, ((m0 + 1) // BLOCK_N) * BLOCK_N)
    dq = _dq_inner(
        dq, q, do, lse2, delta, k_base, v_base, z_base, ds_base, offs_m, offs_n, offs_d, q_len, kv_len,
        stride_kn, stride_kd, stride_vn, stride_vd, stride_zm, stride_zn, stride_sm, qk_scale, 0, full_end,
        HEAD_D, BLOCK_D, HAS_BIAS, BIAS_GRAD, CAUSAL, False, DOT_PRECISION, BLOCK_N)
    dq = _dq_inner(
        dq, q, do, lse2, delta, k_base, v_base, z_base, ds_base, offs_m, offs_n, offs_d, q_len, kv_len,
        stride_kn, stride_kd, stride_vn, stride_vd, stride_zm, stride_zn, stride_sm, qk_scale, full_end, hi,
        HEAD_D, BLOCK_D, HAS_BIAS, BIAS_GRAD, CAUSAL, True, DOT_PRECISION, BLOCK_N)
    dq = tl.where(row_ok[:, None], dq * scale, 0.0)
    _store_rows(dq_base, offs_m, offs_d, stride_dqm, stride_dqd, dq, store_rows, HEAD_D)


# ---------------------------------------------------------------------------------------------------
# Launchers


_BEST_CONFIG: dict = {}
"""(kernel, tuning key) -> (the kernel's config list, the config the autotuner chose from it)."""


def _launch(kernel, grid, args: tuple, consts: dict, buckets: tuple[int, int]) -> None:
    """Launch an autotuned kernel. The first launch of a tuning key goes through the autotuner; later ones
    go straight to the tuned kernel with the config it chose: the autotuner rebuilds dicts of all ~45
    arguments on every launch (about 0.1 ms of host time per launch on the H200 machine's CPU).

    The key holds what the autotuner keys on: the values of the ``_AUTOTUNE_KEY`` arguments (the length
    ``buckets`` and the flags, passed in ``consts`` with the other constexprs) and the dtypes of the
    tensor arguments."""
    key = (kernel, *buckets, *consts.values(), *(a.dtype for a in args if isinstance(a, torch.Tensor)))
    tuned = _BEST_CONFIG.get(key)
    if tuned is None or tuned[0] is not kernel.configs:  # (tests pin configs by replacing the list)
        kernel[grid](*args, **consts)
        _BEST_CONFIG[key] = (kernel.configs, kernel.best_config)
    else:
        kernel.fn.run(*args, grid=grid, warmup=False, **consts, **tuned[1].all_kwargs())


class _Side:
    """How a kernel finds the sequences of one side (queries or keys/values)."""

    def __init__(self, mode: int, offsets, lengths, max_len: int, total_rows: int, dummy: torch.Tensor):
        self.mode = mode
        self.offsets = offsets if offsets is not None else dummy
        self.lengths = lengths if lengths is not None else dummy
        self.max_len = int(max_len)
        self.total_rows = int(total_rows)

    def sort_key(self) -> torch.Tensor | None:
        if self.mode == MODE_OFFSETS:
            return self.offsets[1:] - self.offsets[:-1]
        if self.mode == MODE_LENGTHS:
            return self.lengths
        return None


def _order(primary: _Side, B: int, device) -> torch.Tensor:
    """Batch indices, longest sequence first (a device-side stable argsort in one launch, no host sync)."""
    key = primary.sort_key()
    if key is None:
        return torch.arange(B, device=device)
    from .length_order_triton import longest_first_order  # (imports this module's _INTERPRET)

    return longest_first_order(key)


def _same_sequences(a: _Side, b: _Side) -> bool:
    return a.mode == b.mode and a.lengths is b.lengths and a.offsets is b.offsets


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs follow torch's matmul policy: near-fp32 accuracy unless the user allowed TF32. 3xTF32
    # keeps tensor cores (plain "ieee" FMA dots spill registers heavily on sm_90); half inputs ignore it.
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return "tf32x3"
    return "tf32"


def _block_d(D: int) -> int:
    return max(16, triton.next_power_of_2(D))


def _bhld_strides(t: torch.Tensor, batch_broadcast: bool):
    """Strides (b, h, l, d) of a padded (B, H, L, D) tensor; batch stride 0 when shared by the batch."""
    sb, sh, sl, sd = t.stride()
    return (0 if batch_broadcast else sb), sh, sl, sd


def _forward(q, k, v, bias, q_side: _Side, kv_side: _Side, B: int, H: int, D: int, causal: bool, scale: float,
             q_strides, k_strides, v_strides, out, out_strides, lse, lse_strides):
    Lq, Lk = q_side.max_len, kv_side.max_len
    if bias is not None:
        z_strides = bias.expand(B, H, Lq, Lk).stride()
    else:
        bias, z_strides = q, (0, 0, 0, 0)
    order = _order(kv_side, B, q.device)

    def grid(meta):
        return (triton.cdiv(Lq, meta["BLOCK_M"]) * B * H,)

    _launch(_fwd_kernel, grid, (
        q, k, v, bias, out, lse,
        q_side.offsets, q_side.lengths, kv_side.offsets, kv_side.lengths, order,
        *q_strides, *k_strides, *v_strides, *z_strides, *out_strides, *lse_strides,
        H, Lq, Lk, q_side.total_rows, kv_side.total_rows, float(scale) * _LOG2E,
        length_bucket(Lq), length_bucket(Lk),
    ), dict(HEAD_D=D, BLOCK_D=_block_d(D), Q_MODE=q_side.mode, KV_MODE=kv_side.mode,
            HAS_BIAS=bias is not q, CAUSAL=bool(causal), DOT_PRECISION=_dot_precision(q.dtype)),
        (length_bucket(Lq), length_bucket(Lk)))


def _backward(grad_out, q, k, v, out, lse, bias, bias_grad: bool, q_side: _Side, kv_side: _Side, B: int,
              H: int, D: int, causal: bool, scale: float, q_strides, k_strides, v_strides, g_strides,
              o_strides, lse_strides, delta, dq, dq_strides, dk, dv, dk_strides, ds, ds_strides):
    Lq, Lk = q_side.max_len, kv_side.max_len
    has_bias = bias is not None
    if has_bias:
        z_strides = bias.expand(B, H, Lq, Lk).stride()
    else:
        bias, z_strides = q, (0, 0, 0, 0)
    if ds is None:
        ds, ds_strides = lse, (0, 0, 0)
    block_d = _block_d(D)
    common = dict(HEAD_D=D, BLOCK_D=block_d, Q_MODE=q_side.mode)

    delta_block = 64 if not _INTERPRET else 32
    _bwd_delta_kernel[(triton.cdiv(Lq, delta_block) * B * H,)](
        out, grad_out, delta, q_side.offsets, q_side.lengths, *o_strides, *g_strides, *lse_strides,
        H, Lq, q_side.total_rows, BLOCK_M=delta_block, num_warps=4, **common)

    flags = dict(common, KV_MODE=kv_side.mode, HAS_BIAS=has_bias, CAUSAL=bool(causal),
                 DOT_PRECISION=_dot_precision(q.dtype))
    scalars = (H, Lq, Lk, q_side.total_rows, kv_side.total_rows, float(scale) * _LOG2E, float(scale),
               length_bucket(Lq), length_bucket(Lk))
    # dQ programs loop over keys: order batches by kv length; dK/dV programs loop over query rows: by
    # query length (the same order when both sides share their lengths)
    kv_order = _order(kv_side, B, q.device)
    shared = q_side.mode == MODE_FULL or _same_sequences(q_side, kv_side)
    q_order = kv_order if shared else _order(q_side, B, q.device)
    _launch(_bwd_dkdv_kernel, lambda meta: (triton.cdiv(Lk, meta["BLOCK_N"]) * B * H,), (
        q, k, v, bias, grad_out, lse, delta, dk, dv,
        q_side.offsets, q_side.lengths, kv_side.offsets, kv_side.lengths, q_order,
        *q_strides, *k_strides, *v_strides, *z_strides, *g_strides, *lse_strides, *dk_strides,
        *scalars), flags, scalars[-2:])
    _launch(_bwd_dq_kernel, lambda meta: (triton.cdiv(Lq, meta["BLOCK_M"]) * B * H,), (
        q, k, v, bias, grad_out, lse, delta, dq, ds,
        q_side.offsets, q_side.lengths, kv_side.offsets, kv_side.lengths, kv_order,
        *q_strides, *k_strides, *v_strides, *z_strides, *g_strides, *lse_strides, *dq_strides, *ds_strides,
        *scalars), dict(flags, BIAS_GRAD=bool(bias_grad)), scalars[-2:])


def _padded_sides(q, k, q_lengths, kv_lengths):
    Lq, Lk = q.shape[2], k.shape[2]
    q_side = _Side(MODE_FULL if q_lengths is None else MODE_LENGTHS, None, q_lengths, Lq, Lq, kv_lengths)
    kv_side = _Side(MODE_LENGTHS, None, kv_lengths, Lk, Lk, kv_lengths)
    return q_side, kv_side


def jagged_attention_forward_triton(q, k, v, q_lengths, kv_lengths, bias, causal: bool, scale: float):
    """Padded: q (Bq, H, Lq, D), Bq in {1, B}; k, v (B, H, Lk, D) -> (out (B, H, Lq, D), lse (B, H, Lq))."""
    B, H, Lk, D = k.shape
    Lq = q.shape[2]
    out = torch.empty((B, H, Lq, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, Lq), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse
    if Lk == 0:
        return out.zero_(), lse.fill_(float("inf"))
    q_side, kv_side = _padded_sides(q, k, q_lengths, kv_lengths)
    _forward(q, k, v, bias, q_side, kv_side, B, H, D, causal, scale,
             _bhld_strides(q, q.shape[0] != B), k.stride(), v.stride(), out, out.stride(), lse, lse.stride())
    return out, lse


def _reduce_bias_grad(ds: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    dims = [d for d in range(4) if bias.shape[d] == 1 and ds.shape[d] != 1]
    if dims:
        ds = ds.sum(dim=dims, keepdim=True)  # deterministic reduction, in fp32
    return ds.reshape(bias.shape).to(bias.dtype).contiguous()


def jagged_attention_backward_triton(grad_out, q, k, v, out, lse, q_lengths, kv_lengths, bias, causal: bool,
                                     scale: float, bias_requires_grad: bool):
    """Padded layout -> (dq like q, dk, dv, dbias like bias or an empty tensor). Deterministic."""
    B, H, Lk, D = k.shape
    Lq = q.shape[2]
    shared_q = q.shape[0] != B
    bias_grad = bias is not None and bias_requires_grad
    dk = torch.empty((B, H, Lk, D), dtype=k.dtype, device=k.device)
    dv = torch.empty((B, H, Lk, D), dtype=v.dtype, device=v.device)
    dq_buffer = torch.empty((B, H, Lq, D), dtype=torch.float32 if shared_q else q.dtype, device=q.device)
    ds = torch.zeros((B, H, Lq, Lk), dtype=torch.float32, device=q.device) if bias_grad else None
    if B * H > 0 and Lq > 0 and Lk > 0:
        q_side, kv_side = _padded_sides(q, k, q_lengths, kv_lengths)
        delta = torch.empty((B, H, Lq), dtype=torch.float32, device=q.device)
        _backward(grad_out, q, k, v, out, lse, bias, bias_grad, q_side, kv_side, B, H, D, causal, scale,
                  _bhld_strides(q, shared_q), k.stride(), v.stride(), grad_out.stride(), out.stride(),
                  lse.stride(), delta, dq_buffer, dq_buffer.stride(), dk, dv, dk.stride(),
                  ds, None if ds is None else ds.stride()[:3])
    else:
        dk.zero_()
        dv.zero_()
        dq_buffer.zero_()
    dq = dq_buffer.sum(dim=0, keepdim=True).to(q.dtype) if shared_q else dq_buffer
    dbias = _reduce_bias_grad(ds, bias) if bias_grad else q.new_empty(0)
    return dq, dk, dv, dbias
