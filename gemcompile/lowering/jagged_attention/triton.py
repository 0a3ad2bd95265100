"""Triton kernels of jagged softmax attention (forward and deterministic backward) and their launchers.

Padded layout (B, H, L, D): every sequence is addressed by (start row 0, length), the length from a
lengths tensor (clamped into [0, L]); the device helpers, the batch order and the launch helper are the
attention toolkit of common/attention_triton.py. Any strides are read as given (permuted and expanded
views are never copied); batch stride 0 serves q shared by the batch (Bq = 1). All element offsets of a sequence's base are computed in int64.

Forward (``_fwd_kernel``): one program per (query tile, batch*head), flattened into a 1-D grid whose
size depends only on static shapes. Programs are mapped to batches through a device-side argsort of
the kv lengths (longest first), so the longest programs start first and the tail is short; with
``causal`` the tiles of a sequence run from the last (heaviest) to the first. A tile that starts past
its sequence's length only writes zeros (padded layout) and exits; the key loop stops at the
sequence's kv length (and at the diagonal when causal). The key loop runs in two parts: key tiles that
need no masking (inside kv_len and fully below the diagonal) and the tiles that do. Online softmax in
fp32 with exp2 (log2 e is folded into the scale); a row with no valid key gets out = 0 and lse = +inf.

kv_mask (constexpr HAS_KV_MASK; without a mask the kernels compile to the length-only code): the
launcher derives per batch, on the device, kv_lo/kv_hi (first valid key, last valid key + 1) and a holes
flag (fewer valid keys than kv_hi - kv_lo), one (B, 3) int32 tensor (common/attention_triton.mask_key_bounds;
given to the op when the graph derived it once per step), and orders batches by kv_hi - kv_lo. The fwd and
dQ key loops run from kv_lo's tile to kv_hi only. A sequence without holes
(left/right padding, any contiguous run) has exactly the keys kv_lo <= j < kv_hi: its loop is split like
the length path (masked first tile, unmasked inner tiles that load neither the mask nor any row mask,
masked last tile, bounds only), so it costs what lengths cost. A sequence with holes runs every tile
masked and ANDs the mask vector in (masked keys load as 0: garbage never reaches P.V or dS). The flag is
one scalar per program, so the split is a runtime choice of loop bounds, not a branch per tile. dK/dV
programs whose key tile lies outside [kv_lo, kv_hi) write zeros and exit; the others zero the rows of
masked keys at the end (a row of dK/dV depends only on its own key). kv_lengths None: MODE_FULL keys.

uniform_keys (constexpr HAS_UNIFORM; without it the code is unchanged): one flag per program, loaded once;
for a flagged sequence s = where(uniform, 0, s) after the bias, in the forward and in the P recomputation
of both backward kernels (the dS, dQ, dK formulas are unchanged and use the real q and k).

Backward, deterministic, no atomics: ``_bwd_dq_kernel`` runs first, one program per query tile: it computes
delta = rowsum(dO * O) of its rows (stored for the next kernel; ``DELTA_IN_DQ``) and loops over key tiles
accumulating dQ; ``_bwd_dkdv_kernel`` then runs one program per key tile and loops over query tiles
accumulating dK and dV. When the bias needs a gradient, ``_bwd_dq_kernel`` writes dS once per element
into a (B, H, Lq, Lk) fp32 buffer that the launcher sums over the bias's broadcast dims with torch (memory:
B*H*Lq*Lk*4 bytes, only when the bias requires grad). P is rebuilt from the saved lse, never from a second forward pass.

TMA (constexpr USE_TMA, common/ragged_tma.py): on Hopper the streamed tiles (forward: q, k, v; dK/dV: q and
dO; dQ: k and v) come through ragged TMA descriptors that bound each load by the sequence (rows past it read
as 0, as the pointer loads do); each kernel has TMA configs beside its pointer configs and the launch picks
the variant. Pointer loads stay for k and v under a kv_mask (masked keys' rows would be read), for sides TMA
cannot address, and for launches below ragged_tma.TMA_MIN_WORK (the descriptors' host time). GEMCOMPILE_TMA=0
turns TMA off.

Warp specialization (constexpr WS, set by a config; common/warp_specialize.py): the forward and dK/dV have
configs whose loop Triton splits into a TMA producer and two consumer warp groups. Such a program reads its
tiles through descriptors it makes over its sequence's rows (shape = the length: rows past it read as 0),
runs one loop with every tile masked and never returns early (what the pass accepts). The configs ride on
the TMA variant and serve only launches without a bias, key mask, uniform keys or dropout. They are off: on
an H200 they gave wrong outputs and were slower (common/warp_specialize.py says where); GEMCOMPILE_WARP_SPECIALIZE=1
offers them on the CPU (interpreter tests) only. dQ has none (the pass fails on it).

Precision: scores, softmax statistics and accumulators are fp32; P and dS are cast to the input dtype
for the P.V, dS.K and dS^T.Q dots, as flash attention does. fp32 inputs use 3xTF32 dots when torch's
float32 matmul precision is "highest" (the default) and TF32 otherwise.

Autotuning is keyed on bucketed lengths (next power of two of the padded/max lengths, never the raw
lengths), the head dim and the layout/mask flags. Under TRITON_INTERPRET=1 each kernel has one small
config so that CPU tests stay fast. Only APIs present in triton 3.6 are used.
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl

from ..common.attention_triton import (
    KV_BOUNDS_WIDTH,
    LN2,
    LOG2E,
    MODE_FULL,
    MODE_LENGTHS,
    Side,
    batch_order,
    bhld_strides,
    block_d,
    bwd_delta_kernel,
    dot_precision,
    dropout_args,
    dropout_dv_dp,
    dropout_factor,
    dropout_stream,
    in_registers,
    kernel_configs,
    length_bucket,
    load_rows,
    loop_split,
    make_prune,
    mask_key_bounds,
    per_step_jit,
    program_coordinates,
    q_in_registers,
    same_sequences,
    sequence,
    store_rows,
)
from ..common.length_order import key_span
from ..common.length_order_triton import longest_first_order
from ..common.ragged_tma import (
    TMA_ENABLED,
    load_tile_or_rows,
    ragged_rows,
    rows_readable,
    tma_available,
    tma_pre_hook,
    tma_worth,
)
from ..common.reference import reduce_bias_grad
from ..common.tuned_launch import INTERPRET, autotune, launch
from ..common.warp_specialize import WARP_SPECIALIZE, ensure_scratch_allocator, warp_specialize_available
from gemcompile.env import env_flag

__all__ = ["jagged_attention_backward_triton", "jagged_attention_forward_triton"]

_LOG2E = 1.4426950408889634

DELTA_IN_DQ = env_flag("GEMCOMPILE_DELTA_IN_DQ", True)
"""The dQ kernel computes delta = rowsum(dO * O) for its rows and runs before dK/dV (one launch and one read
of dO fewer than a delta kernel of its own); GEMCOMPILE_DELTA_IN_DQ=0 restores that kernel (A/B timings)."""


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
    # D 128: two stages of 64 query rows (97 KB of shared memory: two CTAs per SM; 255 registers and a 24 B
    # spill with triton 3.9); found by a sweep on the H100, picked at B256 L4096 H4 in the A/B runs of
    # 2026-12-06 (benchmarks/README.md, "dK/dV in two stages of 64 query rows")
    (64, 64, 4, 2): ("large",),
}
# dQ: BLOCK_M query rows per program, BLOCK_N keys per inner step.
_DQ_SHAPES = {
    (128, 32, 8, 3): ("small", "large"), (128, 64, 8, 3): ("small", "large"),
    (64, 64, 4, 3): ("small", "large"), (128, 32, 4, 4): ("small",), (64, 32, 4, 3): ("large",),
}


# The forward with TMA loads (common/ragged_tma.py; sm_90a, D 128: 149 registers at 128x64x3 against 172 with
# pointer loads). A 128-register cap (two CTAs per SM) serializes its wgmma (ptxas C7512): not listed.
_FWD_TMA_SHAPES = {
    (128, 64, 8, 3): ("small", "large"), (128, 128, 8, 2): ("large",), (128, 128, 8, 3): ("small",),
    (128, 64, 4, 3): ("small",), (64, 64, 4, 3): ("small", "large"),
}
_FWD_TMA_BLOCKS = (("QDesc", "BLOCK_M"), ("KDesc", "BLOCK_N"), ("VDesc", "BLOCK_N"))
# dK/dV streams q and dO through TMA, dQ streams k and v (the tiles loaded once per program keep pointers)
_DKDV_TMA_SHAPES = {**_DKDV_SHAPES, (64, 64, 8, 3): ("large",)}  # (64x128x2 spills 48 B at D 128)
_DQ_TMA_SHAPES = _DQ_SHAPES


# The warp-specialized forward (common/warp_specialize.py; WS=True in the config): num_warps=4 compiles to 12
# warps (a TMA producer and two consumer groups). Off (wrong outputs and slower on an H200, see
# common/warp_specialize.py); its configs ride on the TMA variant (the prune keeps them only where the launch takes TMA
# loads and has no bias, key mask, uniform keys or dropout).
_FWD_WS_SHAPES = {(128, 64, 4, 3): ("small", "large"), (128, 128, 4, 2): ("small", "large")}
_FWD_WS_CONFIGS = kernel_configs(_FWD_WS_SHAPES, (32, 16), pre_hook=tma_pre_hook(_FWD_TMA_BLOCKS),
                                 kwargs={"WS": True})
_FWD_CONFIGS = (kernel_configs(_FWD_SHAPES, (32, 16))
                + kernel_configs(_FWD_TMA_SHAPES, (32, 16), pre_hook=tma_pre_hook(_FWD_TMA_BLOCKS))
                + (_FWD_WS_CONFIGS if WARP_SPECIALIZE and warp_specialize_available() else []))
_DKDV_TMA_HOOK = tma_pre_hook((("QDesc", "BLOCK_M"), ("DODesc", "BLOCK_M")))
# warp-specialized dK/dV (q, dO and the key tile through descriptors made in the kernel): 12 warps; at D 128
# only 32-query steps compile without spilling (64x128 spills 24 B; triton 3.6, sm_90a)
_DKDV_WS_SHAPES = {(32, 128, 4, 3): ("small", "large"), (64, 128, 4, 2): ("small",)}
_DKDV_WS_CONFIGS = kernel_configs(_DKDV_WS_SHAPES, (16, 32), pre_hook=_DKDV_TMA_HOOK, kwargs={"WS": True})
_DKDV_CONFIGS = (kernel_configs(_DKDV_SHAPES, (16, 32))
                 + kernel_configs(_DKDV_TMA_SHAPES, (16, 32), pre_hook=_DKDV_TMA_HOOK)
                 + (_DKDV_WS_CONFIGS if WARP_SPECIALIZE and warp_specialize_available() else []))
_DQ_CONFIGS = (kernel_configs(_DQ_SHAPES, (32, 16))
               + kernel_configs(_DQ_TMA_SHAPES, (32, 16), pre_hook=tma_pre_hook(
                   (("KDesc", "BLOCK_N"), ("VDesc", "BLOCK_N")))))
# bucketed lengths, never the raw lengths; the autotuner adds the dtypes of the tensor arguments itself
_AUTOTUNE_KEY = ["LQ_BUCKET", "LK_BUCKET", "HEAD_D", "Q_MODE", "KV_MODE", "HAS_BIAS", "CAUSAL",
                 "DOT_PRECISION", "HAS_KV_MASK", "HAS_UNIFORM", "DROPOUT", "USE_TMA"]


@triton.jit
def _key_mask(m_base, cols, stride_mn, col_ok, holes):
    """kv_mask[b, cols] as a bool vector, read only where col_ok and only for a sequence with holes; True
    elsewhere (AND it with the bounds). m_base points at row b."""
    read = tl.where(holes, col_ok, False)  # (col_ok & holes: the interpreter mistypes a scalar bool &)
    return tl.load(m_base + cols.to(tl.int64) * stride_mn, mask=read, other=1) != 0


@triton.jit
def _key_bounds(KVBounds, b, kv_len):
    """With a kv_mask: (key_lo, key_hi, holes) of batch b (row b of the (B, 3) int32 key bounds). Without
    holes the valid keys are exactly key_lo <= j < key_hi; with holes they are a subset and the mask vector
    must be applied too."""
    row = KVBounds + KV_BOUNDS_WIDTH * b
    key_lo = tl.load(row)
    key_hi = tl.minimum(kv_len, tl.load(row + 1))
    holes = tl.load(row + 2) != 0
    return key_lo, key_hi, holes


@triton.jit
def _key_split(key_lo, hi, full_end, holes, BLOCK_N: tl.constexpr):
    """Loop split of a kv_mask key loop over [lo, hi) -> (lo, head_end, first_full, tail): the masked tile
    holding an unaligned key_lo [lo, head_end), unmasked tiles [first_full, full_end), masked tiles
    [tail, hi). Without holes only the first and last tiles are masked (as with lengths); with holes the
    masked tail loop takes every tile. The head is at most one tile and its loop is not pipelined: a
    third pipelined loop (or one masked loop that skips the unmasked tiles: non-affine addresses) made
    the forward spill registers on sm_90 at 128x128 tiles, D=128."""
    lo = (key_lo // BLOCK_N) * BLOCK_N
    first_full = tl.cdiv(key_lo, BLOCK_N) * BLOCK_N
    first_full = tl.where(holes, hi, first_full)  # holes: nothing unmasked
    head_end = tl.where(holes, lo, tl.minimum(first_full, hi))
    tail = tl.where(holes, lo, tl.maximum(first_full, full_end))  # (causal: full_end can be < first_full)
    return lo, head_end, first_full, tail


@triton.jit
def _key_ranges(KVBounds, b, kv_len, m0, q_len, CAUSAL: tl.constexpr, HAS_KV_MASK: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A query tile's key loops (forward, dQ) -> (kv_len: key_hi with a kv_mask, key_lo, holes, and the ranges
    [lo, head_end) masked (a kv_mask's first tile; empty without one), [first_full, full_end) unmasked,
    [tail, hi) masked), causal keys clipped to the tile's last row."""
    key_lo = 0
    holes = False
    if HAS_KV_MASK:
        key_lo, kv_len, holes = _key_bounds(KVBounds, b, kv_len)
    hi = kv_len
    full_end = (hi // BLOCK_N) * BLOCK_N
    if CAUSAL:
        hi = tl.minimum(hi, tl.minimum(m0 + BLOCK_M, q_len))
        full_end = tl.minimum(full_end, ((m0 + 1) // BLOCK_N) * BLOCK_N)
    lo = 0
    head_end = 0
    first_full = 0
    tail = full_end
    if HAS_KV_MASK:
        lo, head_end, first_full, tail = _key_split(key_lo, hi, full_end, holes, BLOCK_N)
    return kv_len, key_lo, holes, lo, head_end, first_full, full_end, tail, hi


# ---------------------------------------------------------------------------------------------------
# Forward


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, k_base, v_base, bias_base, m_base, offs_m, offs_n, offs_d, q_len, kv_len,
               stride_kn, stride_kd, stride_vn, stride_vd, stride_zm, stride_zn, stride_mn, qk_scale, lo, hi,
               key_lo, holes,
               HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, HAS_BIAS: tl.constexpr, CAUSAL: tl.constexpr,
               MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr,
               HAS_KV_MASK: tl.constexpr, uniform, HAS_UNIFORM: tl.constexpr, seed, drop_below, dropout_scale,
               row_counters, DROPOUT: tl.constexpr, k_desc, v_desc, kv_row0, kv_col, USE_TMA: tl.constexpr,
               STAGES: tl.constexpr = None, WS: tl.constexpr = False):
    """kv_len: the key length (with a kv_mask: key_hi). Unmasked tiles lie inside the valid keys and load
    nothing else; masked tiles check the bounds, and the mask vector only when the sequence has holes. USE_TMA
    (never with a kv_mask): k and v tiles come through their ragged descriptors, zero past kv_len. WS: a
    warp-specialized loop whose k_desc / v_desc are descriptors made in the kernel over the sequence's rows."""
    row_ok = offs_m < q_len
    for start_n in tl.range(lo, hi, BLOCK_N, num_stages=STAGES, warp_specialize=WS):
        cols = start_n + offs_n
        col_ok = cols < kv_len
        if MASKED and HAS_KV_MASK:
            # masked keys read as 0 (garbage in k or v there must not reach p @ v)
            col_ok = col_ok & (cols >= key_lo)
            col_ok = col_ok & _key_mask(m_base, cols, stride_mn, col_ok, holes)
        if WS:
            k = k_desc.load([start_n, 0])
        else:
            k = load_tile_or_rows(k_desc, kv_row0, kv_col, kv_len, start_n, k_base, cols, offs_d, stride_kn,
                                  stride_kd, col_ok, HEAD_D, BLOCK_D, MASKED, USE_TMA)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if HAS_BIAS:
            z_ptrs = bias_base + (offs_m.to(tl.int64)[:, None] * stride_zm
                                  + cols.to(tl.int64)[None, :] * stride_zn)
            if MASKED:
                z = tl.load(z_ptrs, mask=row_ok[:, None] & col_ok[None, :], other=0.0)
            else:
                z = tl.load(z_ptrs, mask=row_ok[:, None], other=0.0)
            s += z.to(tl.float32) * LOG2E
        if HAS_UNIFORM:
            s = tl.where(uniform, 0.0, s)
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
        if DROPOUT:  # the softmax statistics are P's own; only P @ V sees the dropped pairs
            p = p * dropout_factor(seed, offs_m, start_n, row_counters, drop_below, dropout_scale, BLOCK_N)
        if WS:
            v = v_desc.load([start_n, 0])
        else:
            v = load_tile_or_rows(v_desc, kv_row0, kv_col, kv_len, start_n, v_base, cols, offs_d, stride_vn,
                                  stride_vd, col_ok, HEAD_D, BLOCK_D, MASKED, USE_TMA)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@autotune(configs=_FWD_CONFIGS, key=_AUTOTUNE_KEY,
          prune_configs_by=make_prune(_FWD_SHAPES, "fwd", _FWD_TMA_SHAPES, _FWD_WS_SHAPES))
@per_step_jit
def _fwd_kernel(
    Q, K, V, Bias, Out, Lse,
    QOffsets, QLengths, KVOffsets, KVLengths, Order, KVMask, KVBounds, Uniform, Seed, QDesc, KDesc, VDesc,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_zb, stride_zh, stride_zm, stride_zn,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_lb, stride_lh, stride_lm,
    stride_mb, stride_mn,
    q_row_b, q_row_h, q_col_h, kv_row_b, kv_row_h, kv_col_h,
    H, max_q_len, max_kv_len, total_q_rows, total_kv_rows, qk_scale, drop_below, dropout_scale,
    LQ_BUCKET, LK_BUCKET,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, Q_MODE: tl.constexpr, KV_MODE: tl.constexpr,
    HAS_BIAS: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_KV_MASK: tl.constexpr, HAS_UNIFORM: tl.constexpr,
    DROPOUT: tl.constexpr, USE_TMA: tl.constexpr, WS: tl.constexpr = False, A_REGS: tl.constexpr = False,
):
    tile, b, h = program_coordinates(Order, H, tl.cdiv(max_q_len, BLOCK_M), CAUSAL)
    q_start, q_len = sequence(QOffsets, QLengths, b, max_q_len, total_q_rows, Q_MODE)
    kv_start, kv_len = sequence(KVOffsets, KVLengths, b, max_kv_len, total_kv_rows, KV_MODE)
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
        store_mask = offs_m < q_len
    else:
        store_mask = offs_m < max_q_len
    if WS:
        # one warp-specialized loop over every key tile, each masked; an empty query tile loops zero times
        # (the pass refuses an early return). k and v come through descriptors made here over the sequence's
        # rows (a shape of at least one row; rows past the length read as 0), as the TMA loads' contract.
        tl.static_assert(not (HAS_BIAS or HAS_KV_MASK or HAS_UNIFORM or DROPOUT),
                         "the warp-specialized forward reads no bias, key mask, uniform keys or dropout")
        row_ok = offs_m < q_len
        q_desc = tl.make_tensor_descriptor(
            Q + b64 * stride_qb + h64 * stride_qh + q_start.to(tl.int64) * stride_qm,
            shape=[tl.maximum(q_len, 1), HEAD_D], strides=[stride_qm, 1], block_shape=[BLOCK_M, HEAD_D])
        k_desc = tl.make_tensor_descriptor(
            K + b64 * stride_kb + h64 * stride_kh + kv_start.to(tl.int64) * stride_kn,
            shape=[tl.maximum(kv_len, 1), HEAD_D], strides=[stride_kn, 1], block_shape=[BLOCK_N, HEAD_D])
        v_desc = tl.make_tensor_descriptor(
            V + b64 * stride_vb + h64 * stride_vh + kv_start.to(tl.int64) * stride_vn,
            shape=[tl.maximum(kv_len, 1), HEAD_D], strides=[stride_vn, 1], block_shape=[BLOCK_N, HEAD_D])
        q = q_desc.load([m0, 0])
        hi = kv_len
        if CAUSAL:
            hi = tl.minimum(hi, tl.minimum(m0 + BLOCK_M, q_len))
        hi = tl.where(m0 < q_len, hi, 0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        acc, l_i, m_i = _fwd_inner(
            acc, l_i, m_i, q, K, V, Bias, KVMask, offs_m, offs_n, offs_d, q_len, kv_len, stride_kn, stride_kd,
            stride_vn, stride_vd, stride_zm, stride_zn, stride_mn, qk_scale, 0, hi, 0, False, HEAD_D, BLOCK_D,
            False, CAUSAL, True, DOT_PRECISION, BLOCK_N, False, False, False, 0, drop_below, dropout_scale, 0,
            False, k_desc, v_desc, 0, 0, False, None, True)
    else:
        if m0 >= q_len:
            if Q_MODE != 2:
                store_rows(o_base, offs_m, offs_d, stride_om, stride_od,
                           tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32), store_mask, HEAD_D)
                tl.store(l_base + offs_m * stride_lm, tl.full([BLOCK_M], float("inf"), tl.float32),
                         mask=store_mask)
            return

        row_ok = offs_m < q_len
        q_base = Q + b64 * stride_qb + h64 * stride_qh + q_start.to(tl.int64) * stride_qm
        k_base = K + b64 * stride_kb + h64 * stride_kh + kv_start.to(tl.int64) * stride_kn
        v_base = V + b64 * stride_vb + h64 * stride_vh + kv_start.to(tl.int64) * stride_vn
        z_base = Bias + b64 * stride_zb + h64 * stride_zh
        m_base = KVMask + b64 * stride_mb
        uniform = False
        if HAS_UNIFORM:  # one flag per program: this sequence's scores (bias included) are all taken as 0
            uniform = tl.load(Uniform + b) != 0
        seed, row_counters = dropout_stream(Seed, b64, h64, H, max_kv_len, DROPOUT)
        # TMA: a sequence's rows start at its start row plus the (batch, head)'s row offset (common/ragged_tma.py)
        kv_row0 = kv_start + b * kv_row_b + h * kv_row_h
        kv_col = h * kv_col_h
        q_row0 = q_start + b * q_row_b + h * q_row_h
        q = load_tile_or_rows(QDesc, q_row0, h * q_col_h, q_len, m0, q_base, offs_m, offs_d, stride_qm, stride_qd,
                              row_ok, HEAD_D, BLOCK_D, True, USE_TMA)
        q = in_registers(q, row_ok, A_REGS)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        kv_len, key_lo, holes, lo, head_end, first_full, full_end, tail, hi = _key_ranges(
            KVBounds, b, kv_len, m0, q_len, CAUSAL, HAS_KV_MASK, BLOCK_M, BLOCK_N)
        if HAS_KV_MASK:
            acc, l_i, m_i = _fwd_inner(
                acc, l_i, m_i, q, k_base, v_base, z_base, m_base, offs_m, offs_n, offs_d, q_len, kv_len,
                stride_kn, stride_kd, stride_vn, stride_vd, stride_zm, stride_zn, stride_mn, qk_scale, lo,
                head_end, key_lo, holes, HEAD_D, BLOCK_D, HAS_BIAS, CAUSAL, True, DOT_PRECISION, BLOCK_N,
                HAS_KV_MASK, uniform, HAS_UNIFORM, seed, drop_below, dropout_scale, row_counters, DROPOUT, KDesc,
                VDesc, kv_row0, kv_col, USE_TMA, 1)
        acc, l_i, m_i = _fwd_inner(
            acc, l_i, m_i, q, k_base, v_base, z_base, m_base, offs_m, offs_n, offs_d, q_len, kv_len, stride_kn,
            stride_kd, stride_vn, stride_vd, stride_zm, stride_zn, stride_mn, qk_scale, first_full, full_end,
            key_lo, holes, HEAD_D, BLOCK_D, HAS_BIAS, CAUSAL, False, DOT_PRECISION, BLOCK_N, HAS_KV_MASK, uniform,
            HAS_UNIFORM, seed, drop_below, dropout_scale, row_counters, DROPOUT, KDesc, VDesc, kv_row0, kv_col,
            USE_TMA)
        acc, l_i, m_i = _fwd_inner(
            acc, l_i, m_i, q, k_base, v_base, z_base, m_base, offs_m, offs_n, offs_d, q_len, kv_len, stride_kn,
            stride_kd, stride_vn, stride_vd, stride_zm, stride_zn, stride_mn, qk_scale, tail, hi, key_lo, holes,
            HEAD_D, BLOCK_D, HAS_BIAS, CAUSAL, True, DOT_PRECISION, BLOCK_N, HAS_KV_MASK, uniform, HAS_UNIFORM,
            seed, drop_below, dropout_scale, row_counters, DROPOUT, KDesc, VDesc, kv_row0, kv_col, USE_TMA)
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    out = tl.where(row_ok[:, None], out, 0.0)
    lse = tl.where(empty | (~row_ok), float("inf"), (m_i + tl.log2(l_safe)) * LN2)
    store_rows(o_base, offs_m, offs_d, stride_om, stride_od, out, store_mask, HEAD_D)
    tl.store(l_base + offs_m * stride_lm, lse, mask=store_mask)


# ---------------------------------------------------------------------------------------------------
# Backward


@triton.jit
def _dkdv_inner(dk, dv, k, v, q_base, do_base, l_base, d_base, z_base, offs_n, offs_d, q_len, kv_len,
                stride_qm, stride_qd, stride_gm, stride_gd, stride_lm, stride_zm, stride_zn, qk_scale, lo, hi,
                HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, HAS_BIAS: tl.constexpr, CAUSAL: tl.constexpr,
                MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, uniform,
                HAS_UNIFORM: tl.constexpr, seed, drop_below, dropout_scale, row_counters, DROPOUT: tl.constexpr,
                q_desc, do_desc, q_row0, q_col, do_row0, do_col, USE_TMA: tl.constexpr,
                n0=0, BLOCK_N: tl.constexpr = 16, WS: tl.constexpr = False):
    """USE_TMA: q and dO tiles come through their ragged descriptors, zero past q_len. WS: a warp-specialized
    loop whose q_desc / do_desc are descriptors made in the kernel over the sequence's rows."""
    col_ok = offs_n < kv_len
    for start_m in tl.range(lo, hi, BLOCK_M, warp_specialize=WS):
        rows = start_m + tl.arange(0, BLOCK_M)
        row_ok = rows < q_len
        if WS:
            q = q_desc.load([start_m, 0])
            do = do_desc.load([start_m, 0])
        else:
            q = load_tile_or_rows(q_desc, q_row0, q_col, q_len, start_m, q_base, rows, offs_d, stride_qm,
                                  stride_qd, row_ok, HEAD_D, BLOCK_D, MASKED, USE_TMA)
            do = load_tile_or_rows(do_desc, do_row0, do_col, q_len, start_m, do_base, rows, offs_d, stride_gm,
                                   stride_gd, row_ok, HEAD_D, BLOCK_D, MASKED, USE_TMA)
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
        if HAS_UNIFORM:
            s_t = tl.where(uniform, 0.0, s_t)
        p_t = tl.exp2(s_t - lse[None, :] * LOG2E)
        if MASKED:
            valid = col_ok[:, None] & row_ok[None, :]
            if CAUSAL:
                valid = valid & (rows[None, :] >= offs_n[:, None])
            p_t = tl.where(valid, p_t, 0.0)
        if DROPOUT:
            dv, dp_t = dropout_dv_dp(dv, p_t, v, do, seed, rows, n0, row_counters, drop_below, dropout_scale,
                                     BLOCK_N, DOT_PRECISION)
        else:
            dv += tl.dot(p_t.to(do.dtype), do, input_precision=DOT_PRECISION)
            dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        dk += tl.dot(ds_t.to(q.dtype), q, input_precision=DOT_PRECISION)
    return dk, dv


@autotune(configs=_DKDV_CONFIGS, key=_AUTOTUNE_KEY,
          prune_configs_by=make_prune(_DKDV_SHAPES, "dkdv", _DKDV_TMA_SHAPES, _DKDV_WS_SHAPES))
@per_step_jit
def _bwd_dkdv_kernel(
    Q, K, V, Bias, DO, Lse, Delta, DK, DV,
    QOffsets, QLengths, KVOffsets, KVLengths, Order, KVMask, KVBounds, Uniform, Seed, QDesc, DODesc,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_zb, stride_zh, stride_zm, stride_zn,
    stride_gb, stride_gh, stride_gm, stride_gd,
    stride_lb, stride_lh, stride_lm,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_mb, stride_mn,
    q_row_b, q_row_h, q_col_h, do_row_b, do_row_h, do_col_h,
    H, max_q_len, max_kv_len, total_q_rows, total_kv_rows, qk_scale, scale, drop_below, dropout_scale,
    LQ_BUCKET, LK_BUCKET,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, Q_MODE: tl.constexpr, KV_MODE: tl.constexpr,
    HAS_BIAS: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_KV_MASK: tl.constexpr, HAS_UNIFORM: tl.constexpr,
    DROPOUT: tl.constexpr, USE_TMA: tl.constexpr, WS: tl.constexpr = False,
):
    # dK and dV share one layout (both contiguous like k), hence one set of strides
    tile, b, h = program_coordinates(Order, H, tl.cdiv(max_kv_len, BLOCK_N), False)
    q_start, q_len = sequence(QOffsets, QLengths, b, max_q_len, total_q_rows, Q_MODE)
    kv_start, kv_len = sequence(KVOffsets, KVLengths, b, max_kv_len, total_kv_rows, KV_MODE)
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    n0 = tile * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    dk_base = DK + b64 * stride_dkb + h64 * stride_dkh + kv_start.to(tl.int64) * stride_dkn
    dv_base = DV + b64 * stride_dkb + h64 * stride_dkh + kv_start.to(tl.int64) * stride_dkn
    if KV_MODE == 2:
        store_mask = offs_n < kv_len
    else:
        store_mask = offs_n < max_kv_len
    if WS:
        # one warp-specialized loop over the query tiles, each masked; a key tile past the sequence loops zero
        # times (no early return) and stores zeros. q and dO come through descriptors made here over the
        # sequence's rows (at least one row; rows past the length read as 0).
        tl.static_assert(not (HAS_BIAS or HAS_KV_MASK or HAS_UNIFORM or DROPOUT),
                         "the warp-specialized dK/dV reads no bias, key mask, uniform keys or dropout")
        # the key tile through descriptors too: pointer loads before the loop make the pass fail (triton 3.6,
        # WSLowerToken.cpp:73 assertion, compiled for sm_90a)
        start64 = q_start.to(tl.int64)
        k_desc = tl.make_tensor_descriptor(
            K + b64 * stride_kb + h64 * stride_kh + kv_start.to(tl.int64) * stride_kn,
            shape=[tl.maximum(kv_len, 1), HEAD_D], strides=[stride_kn, 1], block_shape=[BLOCK_N, HEAD_D])
        v_desc = tl.make_tensor_descriptor(
            V + b64 * stride_vb + h64 * stride_vh + kv_start.to(tl.int64) * stride_vn,
            shape=[tl.maximum(kv_len, 1), HEAD_D], strides=[stride_vn, 1], block_shape=[BLOCK_N, HEAD_D])
        k = k_desc.load([n0, 0])
        v = v_desc.load([n0, 0])
        q_desc = tl.make_tensor_descriptor(
            Q + b64 * stride_qb + h64 * stride_qh + start64 * stride_qm,
            shape=[tl.maximum(q_len, 1), HEAD_D], strides=[stride_qm, 1], block_shape=[BLOCK_M, HEAD_D])
        do_desc = tl.make_tensor_descriptor(
            DO + b64 * stride_gb + h64 * stride_gh + start64 * stride_gm,
            shape=[tl.maximum(q_len, 1), HEAD_D], strides=[stride_gm, 1], block_shape=[BLOCK_M, HEAD_D])
        m_lo = 0
        if CAUSAL:
            m_lo = (n0 // BLOCK_M) * BLOCK_M  # rows i >= j >= n0
        hi = tl.where(n0 < kv_len, q_len, m_lo)
        dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        dk, dv = _dkdv_inner(
            dk, dv, k, v, Q, DO, Lse + b64 * stride_lb + h64 * stride_lh + start64 * stride_lm,
            Delta + b64 * stride_lb + h64 * stride_lh + start64 * stride_lm, Bias, offs_n, offs_d, q_len,
            kv_len, stride_qm, stride_qd, stride_gm, stride_gd, stride_lm, stride_zm, stride_zn, qk_scale, m_lo,
            hi, HEAD_D, BLOCK_D, False, CAUSAL, True, DOT_PRECISION, BLOCK_M, False, False, 0, drop_below,
            dropout_scale, 0, False, q_desc, do_desc, 0, 0, 0, 0, False, n0, BLOCK_N, True)
    else:
        skip = n0 >= kv_len
        if HAS_KV_MASK:  # a key tile wholly outside [kv_lo, kv_hi) has no valid key
            skip = skip | (n0 >= tl.load(KVBounds + KV_BOUNDS_WIDTH * b + 1)) | (
                n0 + BLOCK_N <= tl.load(KVBounds + KV_BOUNDS_WIDTH * b))
        if skip:  # packed keys: no row past the length is stored, but a tile the kv_mask skips is zeroed
            zeros = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
            store_rows(dk_base, offs_n, offs_d, stride_dkn, stride_dkd, zeros, store_mask, HEAD_D)
            store_rows(dv_base, offs_n, offs_d, stride_dkn, stride_dkd, zeros, store_mask, HEAD_D)
            return

        col_ok = offs_n < kv_len
        if HAS_KV_MASK:
            # rows of dK/dV depend only on their own key: compute masked keys (read as 0) and zero them last;
            # without holes the bounds are exact and the mask is not read
            key_lo, key_hi, holes = _key_bounds(KVBounds, b, kv_len)
            col_ok = (offs_n >= key_lo) & (offs_n < key_hi)
            col_ok = col_ok & _key_mask(KVMask + b64 * stride_mb, offs_n, stride_mn, col_ok, holes)
        start64 = q_start.to(tl.int64)
        q_base = Q + b64 * stride_qb + h64 * stride_qh + start64 * stride_qm
        do_base = DO + b64 * stride_gb + h64 * stride_gh + start64 * stride_gm
        l_base = Lse + b64 * stride_lb + h64 * stride_lh + start64 * stride_lm
        d_base = Delta + b64 * stride_lb + h64 * stride_lh + start64 * stride_lm
        z_base = Bias + b64 * stride_zb + h64 * stride_zh
        k = load_rows(K + b64 * stride_kb + h64 * stride_kh + kv_start.to(tl.int64) * stride_kn, offs_n, offs_d,
                      stride_kn, stride_kd, col_ok, HEAD_D, BLOCK_D, True)
        v = load_rows(V + b64 * stride_vb + h64 * stride_vh + kv_start.to(tl.int64) * stride_vn, offs_n, offs_d,
                      stride_vn, stride_vd, col_ok, HEAD_D, BLOCK_D, True)
        dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        uniform = False
        if HAS_UNIFORM:  # one flag per program: this sequence's scores (bias included) are all taken as 0
            uniform = tl.load(Uniform + b) != 0
        seed, row_counters = dropout_stream(Seed, b64, h64, H, max_kv_len, DROPOUT)
        q_row0 = q_start + b * q_row_b + h * q_row_h  # the TMA slices of q and dO (common/ragged_tma.py)
        do_row0 = q_start + b * do_row_b + h * do_row_h
        # query tiles crossing the diagonal (causal) masked, then full tiles unmasked, then the partial last
        # tile masked; the last key tile of the sequence (n0 + BLOCK_N > kv_len) masks every query tile. The
        # ranges are computed (loop_split), never chosen by a branch: see loop_split (wgmma on sm_90a).
        m_lo = 0
        diag_end = 0
        if CAUSAL:
            m_lo = (n0 // BLOCK_M) * BLOCK_M  # rows i >= j >= n0
            diag_end = m_lo + tl.cdiv(tl.maximum(n0 + BLOCK_N - 1 - m_lo, 0), BLOCK_M) * BLOCK_M
        lo, mid_lo, mid_hi, hi = loop_split(m_lo, diag_end, (q_len // BLOCK_M) * BLOCK_M, q_len,
                                            n0 + BLOCK_N > kv_len)
        dk, dv = _dkdv_inner(
            dk, dv, k, v, q_base, do_base, l_base, d_base, z_base, offs_n, offs_d, q_len, kv_len, stride_qm,
            stride_qd, stride_gm, stride_gd, stride_lm, stride_zm, stride_zn, qk_scale, lo, mid_lo, HEAD_D,
            BLOCK_D, HAS_BIAS, CAUSAL, True, DOT_PRECISION, BLOCK_M, uniform, HAS_UNIFORM,
            seed, drop_below, dropout_scale, row_counters, DROPOUT, QDesc, DODesc, q_row0, h * q_col_h, do_row0,
            h * do_col_h, USE_TMA, n0, BLOCK_N)
        dk, dv = _dkdv_inner(
            dk, dv, k, v, q_base, do_base, l_base, d_base, z_base, offs_n, offs_d, q_len, kv_len, stride_qm,
            stride_qd, stride_gm, stride_gd, stride_lm, stride_zm, stride_zn, qk_scale, mid_lo, mid_hi, HEAD_D,
            BLOCK_D, HAS_BIAS, CAUSAL, False, DOT_PRECISION, BLOCK_M, uniform, HAS_UNIFORM,
            seed, drop_below, dropout_scale, row_counters, DROPOUT, QDesc, DODesc, q_row0, h * q_col_h, do_row0,
            h * do_col_h, USE_TMA, n0, BLOCK_N)
        dk, dv = _dkdv_inner(
            dk, dv, k, v, q_base, do_base, l_base, d_base, z_base, offs_n, offs_d, q_len, kv_len, stride_qm,
            stride_qd, stride_gm, stride_gd, stride_lm, stride_zm, stride_zn, qk_scale, mid_hi, hi, HEAD_D,
            BLOCK_D, HAS_BIAS, CAUSAL, True, DOT_PRECISION, BLOCK_M, uniform, HAS_UNIFORM,
            seed, drop_below, dropout_scale, row_counters, DROPOUT, QDesc, DODesc, q_row0, h * q_col_h, do_row0,
            h * do_col_h, USE_TMA, n0, BLOCK_N)
    if HAS_KV_MASK:
        dk = tl.where(col_ok[:, None], dk, 0.0)
        dv = tl.where(col_ok[:, None], dv, 0.0)
    store_rows(dk_base, offs_n, offs_d, stride_dkn, stride_dkd, dk * scale, store_mask, HEAD_D)
    store_rows(dv_base, offs_n, offs_d, stride_dkn, stride_dkd, dv, store_mask, HEAD_D)


@triton.jit
def _dq_inner(dq, q, do, lse2, delta, k_base, v_base, z_base, ds_base, m_base, offs_m, offs_n, offs_d, q_len,
              kv_len, stride_kn, stride_kd, stride_vn, stride_vd, stride_zm, stride_zn, stride_sm, stride_mn,
              qk_scale, lo, hi, key_lo, holes, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr,
              HAS_BIAS: tl.constexpr, BIAS_GRAD: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr,
              DOT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, HAS_KV_MASK: tl.constexpr, uniform,
              HAS_UNIFORM: tl.constexpr, seed, drop_below, dropout_scale, row_counters, DROPOUT: tl.constexpr,
              k_desc, v_desc, kv_row0, kv_col, USE_TMA: tl.constexpr, STAGES: tl.constexpr = None):
    """Tiles, masking and TMA loads as in _fwd_inner."""
    row_ok = offs_m < q_len
    for start_n in tl.range(lo, hi, BLOCK_N, num_stages=STAGES):
        cols = start_n + offs_n
        col_ok = cols < kv_len
        if MASKED and HAS_KV_MASK:
            # masked keys read as 0: garbage there must not reach dS (through dP) or dS @ K
            col_ok = col_ok & (cols >= key_lo)
            col_ok = col_ok & _key_mask(m_base, cols, stride_mn, col_ok, holes)
        k = load_tile_or_rows(k_desc, kv_row0, kv_col, kv_len, start_n, k_base, cols, offs_d, stride_kn,
                              stride_kd, col_ok, HEAD_D, BLOCK_D, MASKED, USE_TMA)
        v = load_tile_or_rows(v_desc, kv_row0, kv_col, kv_len, start_n, v_base, cols, offs_d, stride_vn,
                              stride_vd, col_ok, HEAD_D, BLOCK_D, MASKED, USE_TMA)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if HAS_BIAS:
            z_ptrs = z_base + (offs_m.to(tl.int64)[:, None] * stride_zm
                               + cols.to(tl.int64)[None, :] * stride_zn)
            if MASKED:
                z = tl.load(z_ptrs, mask=row_ok[:, None] & col_ok[None, :], other=0.0)
            else:
                z = tl.load(z_ptrs, mask=row_ok[:, None], other=0.0)
            s += z.to(tl.float32) * LOG2E
        if HAS_UNIFORM:
            s = tl.where(uniform, 0.0, s)
        p = tl.exp2(s - lse2[:, None])
        if MASKED:
            valid = col_ok[None, :]
            if CAUSAL:
                valid = valid & (cols[None, :] <= offs_m[:, None])
            p = tl.where(valid, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        if DROPOUT:
            dp = dp * dropout_factor(seed, offs_m, start_n, row_counters, drop_below, dropout_scale, BLOCK_N)
        ds = p * (dp - delta[:, None])
        if BIAS_GRAD:
            s_ptrs = ds_base + offs_m.to(tl.int64)[:, None] * stride_sm + cols.to(tl.int64)[None, :]
            tl.store(s_ptrs, ds, mask=row_ok[:, None] & col_ok[None, :])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)
    return dq


@autotune(configs=_DQ_CONFIGS, key=_AUTOTUNE_KEY + ["BIAS_GRAD"],
          prune_configs_by=make_prune(_DQ_SHAPES, "dq", _DQ_TMA_SHAPES))
@per_step_jit
def _bwd_dq_kernel(
    Q, K, V, Bias, DO, Out, Lse, GradLse, Delta, DQ, DS,
    QOffsets, QLengths, KVOffsets, KVLengths, Order, KVMask, KVBounds, Uniform, Seed, KDesc, VDesc,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_zb, stride_zh, stride_zm, stride_zn,
    stride_gb, stride_gh, stride_gm, stride_gd,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_lb, stride_lh, stride_lm,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    stride_sb, stride_sh, stride_sm,
    stride_mb, stride_mn,
    kv_row_b, kv_row_h, kv_col_h,
    H, max_q_len, max_kv_len, total_q_rows, total_kv_rows, qk_scale, scale, drop_below, dropout_scale,
    LQ_BUCKET, LK_BUCKET,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, Q_MODE: tl.constexpr, KV_MODE: tl.constexpr,
    HAS_BIAS: tl.constexpr, BIAS_GRAD: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_KV_MASK: tl.constexpr, HAS_UNIFORM: tl.constexpr,
    DROPOUT: tl.constexpr, USE_TMA: tl.constexpr, DELTA_HERE: tl.constexpr = False,
    HAS_GRAD_LSE: tl.constexpr = False,
):
    tile, b, h = program_coordinates(Order, H, tl.cdiv(max_q_len, BLOCK_M), CAUSAL)
    q_start, q_len = sequence(QOffsets, QLengths, b, max_q_len, total_q_rows, Q_MODE)
    kv_start, kv_len = sequence(KVOffsets, KVLengths, b, max_kv_len, total_kv_rows, KV_MODE)
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    m0 = tile * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    start64 = q_start.to(tl.int64)
    kv_row0 = kv_start + b * kv_row_b + h * kv_row_h  # the TMA slices of k and v (common/ragged_tma.py)
    kv_col = h * kv_col_h
    dq_base = DQ + b64 * stride_dqb + h64 * stride_dqh + start64 * stride_dqm
    if Q_MODE == 2:
        store_mask = offs_m < q_len
    else:
        store_mask = offs_m < max_q_len
    if m0 >= q_len:
        if Q_MODE != 2:
            store_rows(dq_base, offs_m, offs_d, stride_dqm, stride_dqd,
                       tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32), store_mask, HEAD_D)
        return

    row_ok = offs_m < q_len
    q = load_rows(Q + b64 * stride_qb + h64 * stride_qh + start64 * stride_qm, offs_m, offs_d,
                  stride_qm, stride_qd, row_ok, HEAD_D, BLOCK_D, True)
    do = load_rows(DO + b64 * stride_gb + h64 * stride_gh + start64 * stride_gm, offs_m, offs_d,
                   stride_gm, stride_gd, row_ok, HEAD_D, BLOCK_D, True)
    l_rows = b64 * stride_lb + h64 * stride_lh + (start64 + offs_m) * stride_lm
    lse2 = tl.load(Lse + l_rows, mask=row_ok, other=float("inf")) * LOG2E
    if DELTA_HERE:
        # delta = rowsum(dO * O) (- dlse) of this program's rows, stored for the dK/dV kernel launched after
        # this one: dO is loaded anyway, so a separate delta kernel's second read of dO and its launch go
        o = load_rows(Out + b64 * stride_ob + h64 * stride_oh + start64 * stride_om, offs_m, offs_d,
                      stride_om, stride_od, row_ok, HEAD_D, BLOCK_D, True)
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
        if HAS_GRAD_LSE:
            delta -= tl.load(GradLse + l_rows, mask=row_ok, other=0.0)
        tl.store(Delta + l_rows, delta, mask=row_ok)
    else:
        delta = tl.load(Delta + l_rows, mask=row_ok, other=0.0)
    k_base = K + b64 * stride_kb + h64 * stride_kh + kv_start.to(tl.int64) * stride_kn
    v_base = V + b64 * stride_vb + h64 * stride_vh + kv_start.to(tl.int64) * stride_vn
    z_base = Bias + b64 * stride_zb + h64 * stride_zh
    ds_base = DS + b64 * stride_sb + h64 * stride_sh
    m_base = KVMask + b64 * stride_mb
    uniform = False
    if HAS_UNIFORM:  # one flag per program: this sequence's scores (bias included) are all taken as 0
        uniform = tl.load(Uniform + b) != 0
    seed, row_counters = dropout_stream(Seed, b64, h64, H, max_kv_len, DROPOUT)

    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    kv_len, key_lo, holes, lo, head_end, first_full, full_end, tail, hi = _key_ranges(
        KVBounds, b, kv_len, m0, q_len, CAUSAL, HAS_KV_MASK, BLOCK_M, BLOCK_N)
    if HAS_KV_MASK:
        dq = _dq_inner(
            dq, q, do, lse2, delta, k_base, v_base, z_base, ds_base, m_base, offs_m, offs_n, offs_d, q_len,
            kv_len, stride_kn, stride_kd, stride_vn, stride_vd, stride_zm, stride_zn, stride_sm, stride_mn,
            qk_scale, lo, head_end, key_lo, holes, HEAD_D, BLOCK_D, HAS_BIAS, BIAS_GRAD, CAUSAL, True,
            DOT_PRECISION, BLOCK_N, HAS_KV_MASK, uniform, HAS_UNIFORM, seed, drop_below, dropout_scale, row_counters,
            DROPOUT, KDesc, VDesc, kv_row0, kv_col, USE_TMA, 1)
    dq = _dq_inner(
        dq, q, do, lse2, delta, k_base, v_base, z_base, ds_base, m_base, offs_m, offs_n, offs_d, q_len,
        kv_len, stride_kn, stride_kd, stride_vn, stride_vd, stride_zm, stride_zn, stride_sm, stride_mn,
        qk_scale, first_full, full_end, key_lo, holes, HEAD_D, BLOCK_D, HAS_BIAS, BIAS_GRAD, CAUSAL, False,
        DOT_PRECISION, BLOCK_N, HAS_KV_MASK, uniform, HAS_UNIFORM, seed, drop_below, dropout_scale, row_counters,
        DROPOUT, KDesc, VDesc, kv_row0, kv_col, USE_TMA)
    dq = _dq_inner(
        dq, q, do, lse2, delta, k_base, v_base, z_base, ds_base, m_base, offs_m, offs_n, offs_d, q_len,
        kv_len, stride_kn, stride_kd, stride_vn, stride_vd, stride_zm, stride_zn, stride_sm, stride_mn,
        qk_scale, tail, hi, key_lo, holes, HEAD_D, BLOCK_D, HAS_BIAS, BIAS_GRAD, CAUSAL, True, DOT_PRECISION,
        BLOCK_N, HAS_KV_MASK, uniform, HAS_UNIFORM, seed, drop_below, dropout_scale, row_counters, DROPOUT,
        KDesc, VDesc, kv_row0, kv_col, USE_TMA)
    dq = tl.where(row_ok[:, None], dq * scale, 0.0)
    store_rows(dq_base, offs_m, offs_d, stride_dqm, stride_dqd, dq, store_mask, HEAD_D)


# ---------------------------------------------------------------------------------------------------
# Launchers


class _KeyMask:
    """What the kernels get for a kv_mask: the mask as uint8 (a view, no copy), its (b, n) strides, the
    per-batch key bounds (B, 3) [lo, hi, holes] (device side, common/attention_triton.mask_key_bounds) and
    the batch order longest span first; each the one given (``bounds``, ``order``: derived once per step by the
    graph) or computed here. Without a mask: dummies that are never read, and the kv lengths' order."""

    def __init__(self, kv_mask, kv_side: Side, B: int, device, bounds=None, order=None):
        self.has = kv_mask is not None
        if self.has:
            lengths = kv_side.lengths if kv_side.mode == MODE_LENGTHS else None
            self.mask, self.strides = kv_mask.view(torch.uint8), kv_mask.stride()
            self.bounds = mask_key_bounds(kv_mask, lengths, bounds)
            self.order = order if order is not None else longest_first_order(key_span(self.bounds))
        else:
            self.mask = self.bounds = kv_side.lengths
            self.strides = (0, 0)
            self.order = batch_order(kv_side, B, device)

    def args(self):
        return self.mask, self.bounds


def _uniform_arg(uniform_keys, keys: _KeyMask):
    """uniform_keys as contiguous uint8 (the kernels read element b; B bytes at most are copied); without
    it a dummy pointer that is never read."""
    return keys.mask if uniform_keys is None else uniform_keys.contiguous().view(torch.uint8)


def _forward(q, k, v, bias, q_side: Side, kv_side: Side, B: int, H: int, D: int, causal: bool, scale: float,
             q_strides, k_strides, v_strides, out, out_strides, lse, lse_strides, kv_mask=None,
             uniform_keys=None, kv_order=None, kv_bounds=None, dropout_p=0.0, dropout_seed=None):
    Lq, Lk = q_side.max_len, kv_side.max_len
    if bias is not None:
        z_strides = bias.expand(B, H, Lq, Lk).stride()
    else:
        bias, z_strides = q, (0, 0, 0, 0)
    keys = _KeyMask(kv_mask, kv_side, B, q.device, kv_bounds, kv_order)
    uniform = _uniform_arg(uniform_keys, keys)
    seed, *dropout = dropout_args(dropout_p, dropout_seed, keys.mask)

    tma = _tma_rows(_fwd_kernel, (((q, q_strides),), ((k, k_strides), (v, v_strides))), H, D,
                    B * H * Lq * Lk * D, keys_read=not keys.has)
    if tma.used and any(c.kwargs.get("WS") for c in _fwd_kernel.configs):
        ensure_scratch_allocator()  # descriptors made in the kernel (common/warp_specialize.py)

    def grid(meta):
        return (triton.cdiv(Lq, meta["BLOCK_M"]) * B * H,)

    launch(_fwd_kernel, grid, (
        q, k, v, bias, out, lse,
        q_side.offsets, q_side.lengths, kv_side.offsets, kv_side.lengths, keys.order, *keys.args(), uniform, seed,
        *tma.descs,
        *q_strides, *k_strides, *v_strides, *z_strides, *out_strides, *lse_strides, *keys.strides,
        *tma.rows,
        H, Lq, Lk, q_side.total_rows, kv_side.total_rows, float(scale) * _LOG2E, *dropout,
        length_bucket(Lq), length_bucket(Lk),
    ), dict(HEAD_D=D, BLOCK_D=block_d(D), Q_MODE=q_side.mode, KV_MODE=kv_side.mode,
           HAS_BIAS=bias is not q, CAUSAL=bool(causal), DOT_PRECISION=dot_precision(q.dtype),
           HAS_KV_MASK=keys.has, HAS_UNIFORM=uniform_keys is not None, DROPOUT=bool(dropout_p),
           USE_TMA=tma.used, A_REGS=q_in_registers(D)),
        (length_bucket(Lq), length_bucket(Lk)))


class _TmaArgs:
    """A launch's TMA arguments: one descriptor per side (None on the pointer path), the row-offset integers
    (row_b, row_h, col_h) per group of sides, and whether the kernel takes the TMA loads."""

    def __init__(self, descs: tuple, rows: tuple, used: bool):
        self.descs, self.rows, self.used = descs, rows, used


def _tma_rows(kernel, groups, H: int, D: int, work: int, keys_read: bool = True, ws_reads=()) -> _TmaArgs:
    """The TMA arguments of a kernel's loads of ``groups``: tuples of sides ((tensor, its (b, h, l, d)
    strides) pairs, common/ragged_tma.py) whose rows the kernel offsets by one set of integers. Pointer
    loads (descriptors None, integers 0) when TMA is off or absent, the launch is too small to pay the
    descriptors' host time (``work``: B * H * Lq * Lk * D, ragged_tma.tma_worth), a kv_mask's keys would be
    read (``keys_read`` False: TMA would read masked keys' rows, which may hold garbage, where the pointer
    loads read 0), a side TMA cannot read, sides of a group are laid out differently, or the kernel's config
    list has no TMA config (tests pin their own). ``ws_reads``: more sides that the kernel's warp-specialized
    configs read through descriptors of their own (they ride on the TMA variant): where one of those cannot
    be read so and such configs are listed, the launch takes the pointer loads."""
    sides = [side for group in groups for side in group]
    pointer = _TmaArgs((None,) * len(sides), (0,) * (3 * len(groups)), False)
    if (not TMA_ENABLED or not keys_read or not tma_worth(work) or not tma_available(sides[0][0].device)
            or not any(c.pre_hook is not None for c in kernel.configs)):
        return pointer
    if ws_reads and any(c.kwargs.get("WS") for c in kernel.configs) and not all(
            rows_readable(t, H, D, strides) for t, strides in ws_reads):
        return pointer
    descs, rows = [], []
    for group in groups:
        found = [ragged_rows(t, H, D, strides) for t, strides in group]
        if None in found or any(r.args() != found[0].args() for r in found):
            return pointer
        descs += [r.desc for r in found]
        rows += found[0].args()
    return _TmaArgs(tuple(descs), tuple(rows), True)


def _backward(grad_out, q, k, v, out, lse, bias, bias_grad: bool, q_side: Side, kv_side: Side, B: int,
              H: int, D: int, causal: bool, scale: float, q_strides, k_strides, v_strides, g_strides,
              o_strides, lse_strides, delta, dq, dq_strides, dk, dv, dk_strides, ds, ds_strides,
              kv_mask=None, uniform_keys=None, kv_order=None, kv_bounds=None, dropout_p=0.0, dropout_seed=None,
              grad_lse=None):
    Lq, Lk = q_side.max_len, kv_side.max_len
    has_bias = bias is not None
    if has_bias:
        z_strides = bias.expand(B, H, Lq, Lk).stride()
    else:
        bias, z_strides = q, (0, 0, 0, 0)
    if ds is None:
        ds, ds_strides = lse, (0, 0, 0)
    common = dict(HEAD_D=D, BLOCK_D=block_d(D), Q_MODE=q_side.mode)

    # delta = rowsum(dO * O) - dlse (lse's own gradient: dS = P * (dP - delta + dlse)): computed by the dQ
    # kernel, launched first, or (DELTA_IN_DQ off) by a kernel of its own
    grad_lse_arg = delta  # never read without HAS_GRAD_LSE
    if not DELTA_IN_DQ:
        delta_block = 64 if not INTERPRET else 32
        bwd_delta_kernel[(triton.cdiv(Lq, delta_block) * B * H,)](
            out, grad_out, delta, q_side.offsets, q_side.lengths, *o_strides, *g_strides, *lse_strides,
            H, Lq, q_side.total_rows, BLOCK_M=delta_block, num_warps=4, **common)
        if grad_lse is not None:
            delta.sub_(grad_lse)
    elif grad_lse is not None:
        grad_lse_arg = torch.empty_like(delta).copy_(grad_lse)  # laid out like delta (lse's strides)

    keys = _KeyMask(kv_mask, kv_side, B, q.device, kv_bounds, kv_order)
    uniform = _uniform_arg(uniform_keys, keys)
    seed, *dropout = dropout_args(dropout_p, dropout_seed, keys.mask)
    flags = dict(common, KV_MODE=kv_side.mode, HAS_BIAS=has_bias, CAUSAL=bool(causal),
                 DOT_PRECISION=dot_precision(q.dtype), HAS_KV_MASK=keys.has,
                 HAS_UNIFORM=uniform_keys is not None, DROPOUT=bool(dropout_p))
    scalars = (H, Lq, Lk, q_side.total_rows, kv_side.total_rows, float(scale) * _LOG2E, float(scale), *dropout,
               length_bucket(Lq), length_bucket(Lk))
    # dQ programs loop over keys: order batches by kv length (key span with a mask); dK/dV programs loop
    # over query rows: by query length (the same order when both sides share their lengths)
    kv_order = keys.order
    if q_side.mode == MODE_FULL or (q_side.order is None and same_sequences(q_side, kv_side)):
        q_order = kv_order
    else:
        q_order = batch_order(q_side, B, q.device)
    work = B * H * Lq * Lk * D
    kv = _tma_rows(_bwd_dq_kernel, (((k, k_strides), (v, v_strides)),), H, D, work, keys_read=not keys.has)
    launch(_bwd_dq_kernel, lambda meta: (triton.cdiv(Lq, meta["BLOCK_M"]) * B * H,), (
        q, k, v, bias, grad_out, out, lse, grad_lse_arg, delta, dq, ds,
        q_side.offsets, q_side.lengths, kv_side.offsets, kv_side.lengths, kv_order, *keys.args(), uniform,
        seed, *kv.descs, *q_strides, *k_strides, *v_strides, *z_strides, *g_strides, *o_strides,
        *lse_strides, *dq_strides, *ds_strides, *keys.strides, *kv.rows, *scalars),
        dict(flags, BIAS_GRAD=bool(bias_grad), USE_TMA=kv.used, DELTA_HERE=DELTA_IN_DQ,
             HAS_GRAD_LSE=DELTA_IN_DQ and grad_lse is not None), scalars[-2:])
    q_do = _tma_rows(_bwd_dkdv_kernel, (((q, q_strides),), ((grad_out, g_strides),)), H, D, work,
                     ws_reads=((k, k_strides), (v, v_strides)))
    if q_do.used and any(c.kwargs.get("WS") for c in _bwd_dkdv_kernel.configs):
        ensure_scratch_allocator()  # descriptors made in the kernel (common/warp_specialize.py)
    launch(_bwd_dkdv_kernel, lambda meta: (triton.cdiv(Lk, meta["BLOCK_N"]) * B * H,), (
        q, k, v, bias, grad_out, lse, delta, dk, dv,
        q_side.offsets, q_side.lengths, kv_side.offsets, kv_side.lengths, q_order, *keys.args(), uniform,
        seed, *q_do.descs, *q_strides, *k_strides, *v_strides, *z_strides, *g_strides,
        *lse_strides, *dk_strides, *keys.strides, *q_do.rows, *scalars),
        dict(flags, USE_TMA=q_do.used), scalars[-2:])


def _padded_sides(q, k, q_lengths, kv_lengths, dummy, q_order=None, kv_order=None, kv_mask=None):
    """kv_lengths None: every key position is valid (MODE_FULL); ``dummy`` fills unused pointers. The given
    orders go with their sides (kv_order is the kv lengths' only without a kv_mask)."""
    Lq, Lk = q.shape[2], k.shape[2]
    if kv_lengths is not None:
        dummy = kv_lengths
    q_side = Side(MODE_FULL if q_lengths is None else MODE_LENGTHS, None, q_lengths, Lq, Lq, dummy, q_order)
    kv_side = Side(MODE_FULL if kv_lengths is None else MODE_LENGTHS, None, kv_lengths, Lk, Lk, dummy,
                   kv_order if kv_mask is None else None)
    return q_side, kv_side


def jagged_attention_forward_triton(q, k, v, q_lengths, kv_lengths, bias, causal: bool, scale: float,
                                    kv_mask=None, uniform_keys=None, dropout_p=0.0, dropout_seed=None, *,
                                    q_order=None, kv_order=None, kv_bounds=None):
    """Padded: q (Bq, H, Lq, D), Bq in {1, B}; k, v (B, H, Lk, D) -> (out (B, H, Lq, D), lse (B, H, Lq)).
    q_order, kv_order, kv_bounds: the derived tensors of common/length_order.py when the caller has them
    (computed here otherwise)."""
    B, H, Lk, D = k.shape
    Lq = q.shape[2]
    out = torch.empty((B, H, Lq, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, Lq), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse
    if Lk == 0:
        return out.zero_(), lse.fill_(float("inf"))
    q_side, kv_side = _padded_sides(q, k, q_lengths, kv_lengths, lse, q_order, kv_order, kv_mask)
    _forward(q, k, v, bias, q_side, kv_side, B, H, D, causal, scale,
             bhld_strides(q, q.shape[0] != B), k.stride(), v.stride(), out, out.stride(), lse, lse.stride(),
             kv_mask, uniform_keys, kv_order, kv_bounds, dropout_p, dropout_seed)
    return out, lse


def jagged_attention_backward_triton(grad_out, q, k, v, out, lse, q_lengths, kv_lengths, bias, causal: bool,
                                     scale: float, bias_requires_grad: bool, kv_mask=None, uniform_keys=None,
                                     dropout_p=0.0, dropout_seed=None, grad_lse=None, *, q_order=None,
                                     kv_order=None, kv_bounds=None):
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
        delta = torch.empty((B, H, Lq), dtype=torch.float32, device=q.device)
        q_side, kv_side = _padded_sides(q, k, q_lengths, kv_lengths, delta, q_order, kv_order, kv_mask)
        _backward(grad_out, q, k, v, out, lse, bias, bias_grad, q_side, kv_side, B, H, D, causal, scale,
                  bhld_strides(q, shared_q), k.stride(), v.stride(), grad_out.stride(), out.stride(),
                  lse.stride(), delta, dq_buffer, dq_buffer.stride(), dk, dv, dk.stride(),
                  ds, None if ds is None else ds.stride()[:3], kv_mask, uniform_keys, kv_order, kv_bounds,
                  dropout_p, dropout_seed, grad_lse)
    else:
        dk.zero_()
        dv.zero_()
        dq_buffer.zero_()
    dq = dq_buffer.sum(dim=0, keepdim=True).to(q.dtype) if shared_q else dq_buffer
    dbias = reduce_bias_grad(ds, bias) if bias_grad else q.new_empty(0)
    return dq, dk, dv, dbias
