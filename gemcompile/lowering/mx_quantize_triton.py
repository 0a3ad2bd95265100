"""Triton quantize kernels for block-scaled FP8 (E4M3 elements, power-of-two scales), bit-exact with the
reference of mx_numerics.py on every input (the one documented exception is below).

Kernels and what they write
---------------------------
* :func:`mx_quantize_triton` -- MXFP8, blocks of 32 along the last dim, E8M0 codes: the same output as
  ``mx_numerics.mx_quantize(x, dim=-1, rule)``.
* :func:`quantize_1x128` -- 1x128 blocks along the last dim (activations, gradients). One read of x (R, C)
  writes the row-blocked copy ``x8`` (R, C) with scales ``s`` (R, C/128) and/or the column-blocked,
  transposed copy ``xt8`` (C, R) (blocks of 128 along R, the reduction dim of ``xt8``) with scales
  ``st`` (C, R/128).
* :func:`quantize_128x128` -- 128x128 blocks (weights): ``w8`` (R, C) and/or ``wt8`` (C, R); one scale per
  tile, the same for both copies (2-D blocks are transpose invariant, so a weight is quantized once and
  serves forward and dgrad).

Scales
------
The 1x128 / 128x128 kernels write fp32 *descale* factors 2^e (what cuBLAS multiplies by), built from the
exponent bits, so they are exact powers of two (2^-127 is the fp32 subnormal 0x00400000); a block holding
NaN or +-Inf gets a NaN scale (the reference's E8M0 0xFF). Layouts are the ones torch's blockwise scaled
GEMM wants (aten/src/ATen/native/cuda/ScaledBlas.cpp, ``is_blockwise_1x128_scaling`` /
``is_blockwise_128x128_scaling`` for ``torch._scaled_mm`` and ``_scaled_block1x128_block128x128`` & co. for
``F.scaled_mm`` / ``_scaled_mm_v2``; the same in torch/_meta_registrations.py ``_check_scaled_mm_sizes_v2``):

* 1x128 operand X (rows, K): scales (rows, K/128) "outer-dim-major", strides (1, rows). Both APIs.
* 128x128 operand X (rows, K): stored row-major as (rows/128, L4) with L4 = round_up(K/128, 4), i.e. 16-byte
  aligned rows. F.scaled_mm (v2) wants the view ``storage.t()`` of shape (L4, rows/128), strides (1, L4),
  padding included (filled with 1.0, as torchao does); torch._scaled_mm (v1) wants (rows/128, K/128) with
  strides (K/128, 1) exactly, which is the same memory only when K/128 % 4 == 0. The kernels return the
  unpadded view ``storage[:, :K/128]``; ``scale_storage(s)`` gives the padded one.

One pass. The copies that need a whole tile's reduction (the transposed 1x128 copy, the 128x128 tiles)
come from :func:`_tile_kernel` (``dual_impl() == "tile"``, opt-in): a persistent kernel that holds
one 128x128 tile in registers (16 warps), reduces rows within warps and columns once across warps,
writes the row-major copy directly and the transposed copy as 4-byte words (four rows of a column packed
in one thread, transposed through shared memory as 32-bit words), while the compiler prefetches the next
tiles with cp.async. A tile holding NaN / Inf is skipped and written afterwards by a careful, rarely run
path. The row-only 1x128 copy, inputs with R % 4 != 0, and GEMCOMPILE_DUAL_QUANT_IMPL=old (the default) take
:func:`_block_kernel`, which walks a tile in CHUNK-row slices (the transposed copy re-reads the slices
from L1/L2 after the column amax; on the H200 that walk made the dual 1x128 copy ~5x slower than the
row copy: a cross-warp column reduction with barriers per slice, and byte-wise shared-memory transposes).
Either way HBM sees x once, and both write the same bytes.

Shapes that are not multiples of the block: the kernels mask the tails, which is exactly the reference
applied to the tensor zero-padded to the next block multiple (zeros do not change a block's amax) and
sliced back; the scale grids use ceil(dim / block). The MX kernel needs the last dim to be a multiple of
32 (as the reference); the fp8_mm op pads K with zeros (exact for a GEMM).

How the bits are made
---------------------
Scale exponent, from the block amax's fp32 bits (integer arithmetic, so no rounding and no flushing):
floor: e = floor(log2 amax) - 8; rceil: e = ceil(log2(fl32(amax / 448))), which is floor(log2 amax) - 8,
plus 1 when amax's mantissa exceeds 1.75 (fl32(amax / 448) is a power of two only for mantissa 1.75), with
one fp32-subnormal special case at the bottom of the range; clamped to [-127, 127].
Elements: on GPUs with FP8 conversion (sm_89+), x * 2^-e in fp32 (exact: a power-of-two multiply, and
PTX mul.rn.f32 without .ftz keeps subnormals; Triton emits no .ftz here, checked in the sm_90 PTX),
clamped to +-448 and converted by the hardware's round-to-nearest-even ``cvt.rn.satfinite.e4m3x2.f32``;
a zero result takes x's sign. The integer path (the interpreter's, selectable with use_hw=False or
GEMCOMPILE_FP8_INT_CONVERT=1) rounds the significand to E4M3 with integer shifts, no float instruction at
all. NaN elements become 0x7F | sign, +-Inf saturate to +-448 (the reference clamps before the cast).

Known difference from mx_numerics (reference bug, reported): with the rceil rule and an fp32 block whose
amax < 448 * 2^-150 (about 2.6e-43, fp32 subnormal inputs only), the reference's fp32 division amax / 448
underflows to 0 and frexp(0) yields exponent 0, so it writes code 127 (scale 1) instead of the clamped
minimum 0 (scale 2^-127). The elements are 0 either way, so dequantized values agree; the kernels write
code 0, which is what the spec's clamp gives.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from .jagged_attention_triton import _launch  # autotune once per key, then launch the tuned kernel directly

__all__ = [
    "alloc_outputs",
    "codes_to_descale",
    "dual_impl",
    "mx_quantize_triton",
    "quantize_1x128",
    "quantize_128x128",
    "scale_storage",
    "use_hw_convert",
]

_RULES = ("floor", "rceil")
_IN_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


# ---------------------------------------------------------------------------------------------------
# Device helpers


@triton.jit
def _load_bits(ptr, offs, mask, IN_KIND: tl.constexpr, MASKED: tl.constexpr = True):
    """fp32 bit pattern (int32) of each element. fp32 and bf16 arrive as int32 / int16 views so that no
    float instruction (and no flush-to-zero) touches a subnormal; fp16 widens exactly to a normal fp32."""
    if MASKED:
        raw = tl.load(ptr + offs, mask=mask, other=0)
    else:
        raw = tl.load(ptr + offs)
    if IN_KIND == 0:
        u = raw
    elif IN_KIND == 1:
        u = (raw.to(tl.int32) & 0xFFFF) << 16
    else:
        u = raw.to(tl.float32).to(tl.int32, bitcast=True)
    return u


@triton.jit
def _store(ptrs, values, mask, MASKED: tl.constexpr):
    if MASKED:
        tl.store(ptrs, values, mask=mask)
    else:
        tl.store(ptrs, values)


@triton.jit
def _scale_exponent(amax, RCEIL: tl.constexpr):
    """Unbiased scale exponent from the block amax's fp32 bits (finite, >= 0), clamped to E8M0's range."""
    aef = amax >> 23
    e = aef - 135  # floor(log2 amax) - 8 for a normal amax; subnormal and zero amax clamp to -127 below
    if RCEIL:
        aman = amax & 0x7FFFFF
        e = e + (aman > 0x600000).to(tl.int32)
        # amax = (1.75 + 2^-23) * 2^-119: amax / 448 lands just above 2^-127 in the fp32 subnormal range,
        # where the grid is 2^-149, and rounds down onto 2^-127
        e = tl.where((aef == 8) & (aman == 0x600001), -127, e)
    return tl.minimum(tl.maximum(e, -127), 127)


@triton.jit
def _descale_bits(e, finite):
    """fp32 bits of 2^e (2^-127 is subnormal), NaN for a non-finite block."""
    bits = tl.where(e >= -126, (e + 127) << 23, 0x400000)
    return tl.where(finite, bits, 0x7FC00000)


@triton.jit
def _e4m3_exact(a, e):
    """E4M3 magnitude bits of a * 2^-e (a: finite fp32 magnitude bits), round to nearest even, saturated."""
    ef = a >> 23
    man = a & 0x7FFFFF
    normal = ef > 0
    sig = tl.where(normal, man | 0x800000, man)
    p = tl.where(normal, ef - 150, -149)  # |x| = sig * 2^p
    sub_log2 = (man.to(tl.float32).to(tl.int32, bitcast=True) >> 23) - 127  # floor(log2 man), exact
    top = tl.where(normal, 23, sub_log2)
    t = top + p - e  # floor(log2 |v|), v = x * 2^-e
    qe = tl.maximum(t, -6) - 3  # exponent of v's E4M3 quantum (subnormals share 2^-9)
    sh = qe - p + e  # right shift taking sig to a count of quanta (>= -3)
    shr = tl.minimum(tl.maximum(sh, 0), 30)  # sig < 2^24: a 30-bit shift already rounds to 0
    shl = tl.maximum(-sh, 0)
    q = sig >> shr
    rem = sig - (q << shr)
    half = (1 << shr) >> 1
    up = (rem > half) | ((rem == half) & (shr > 0) & ((q & 1) == 1))
    q = (q + up.to(tl.int32)) << shl
    bits = (qe + 9) * 8 + q  # exponent field (qe + 9) - 1 plus the implicit bit: q in [8, 16] carries
    bits = tl.minimum(bits, 126)  # 0x7E = 448
    return tl.where(sig == 0, 0, bits)


@triton.jit
def _quantize(u, e, USE_HW: tl.constexpr):
    """E4M3 bytes (int32 0..255) of x * 2^-e; u = x's fp32 bits, e broadcastable to u."""
    a = u & 0x7FFFFFFF
    sign = (u >> 31) & 1
    if USE_HW:
        # x * 2^-e is exact (mul.rn.f32 keeps subnormals; a product below 2^-126 is far below E4M3's
        # 2^-10 rounding threshold, so its own rounding cannot matter), then the hardware's RNE cvt
        inv = ((127 - e) << 23).to(tl.float32, bitcast=True)  # 2^-e, a normal fp32 for e in [-127, 127]
        v = u.to(tl.float32, bitcast=True) * inv
        v = tl.minimum(tl.maximum(v, -448.0), 448.0)
        b = v.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True).to(tl.int32)
        b = tl.where((b & 0x7F) == 0, sign << 7, b)  # zeros keep x's sign, whatever the cvt did with tiny inputs
    else:
        b = _e4m3_exact(tl.minimum(a, 0x7F800000), e) | (sign << 7)
        b = tl.where(a == 0x7F800000, 0x7E | (sign << 7), b)  # +-Inf saturate (the reference clamps them)
    return tl.where(a > 0x7F800000, 0x7F | (sign << 7), b)


# ---------------------------------------------------------------------------------------------------
# Kernels


_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# memory-bound kernels: tune only the tile height / warps; one config under the interpreter
_MX_CONFIGS = (
    [triton.Config({"BLOCK_R": 32}, num_warps=4)]
    if _INTERPRET
    else [triton.Config({"BLOCK_R": r}, num_warps=w) for r, w in ((16, 4), (32, 8))]  # 86-94 registers
)
# (CHUNK, warps) without register spills on sm_90 (checked with cuobjdump -res-usage: 63-172 registers)
_BLOCK_CONFIGS = (
    [triton.Config({"CHUNK": 32}, num_warps=4)]
    if _INTERPRET
    else [triton.Config({"CHUNK": c}, num_warps=w) for c, w in ((16, 4), (16, 8), (32, 8))]
)
# the one-pass tile kernel (both copies): warps per 128x128 tile, program order
_TILE_CONFIGS = (
    [triton.Config({"COL_MAJOR": False, "PER_SM": 1, "STAGES": 1}, num_warps=4)]
    if _INTERPRET
    else [triton.Config({"COL_MAJOR": cm, "PER_SM": 1, "STAGES": st}, num_warps=w)
          for cm, w, st in ((False, 16, 3), (False, 16, 4), (True, 16, 3), (False, 8, 3))]
)


@triton.autotune(configs=_MX_CONFIGS, key=["C_BUCKET", "IN_KIND", "BLOCK_C"])
@triton.jit
def _mx_kernel(
    x_ptr, y_ptr, code_ptr, R, C, sxr, sxc, C_BUCKET,
    IN_KIND: tl.constexpr, RCEIL: tl.constexpr, USE_HW: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    G: tl.constexpr = BLOCK_C // 32
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows < R)[:, None] & (cols < C)[None, :]
    u = _load_bits(x_ptr, rows[:, None].to(tl.int64) * sxr + cols[None, :].to(tl.int64) * sxc, mask, IN_KIND)
    u3 = tl.reshape(u, (BLOCK_R, G, 32))
    a3 = u3 & 0x7FFFFFFF
    nonfinite = a3 >= 0x7F800000
    amax = tl.max(tl.where(nonfinite, 0, a3), axis=2)
    finite = tl.max(nonfinite.to(tl.int32), axis=2) == 0
    e = _scale_exponent(amax, RCEIL)
    b = tl.reshape(_quantize(u3, e[:, :, None], USE_HW), (BLOCK_R, BLOCK_C))
    tl.store(y_ptr + rows[:, None].to(tl.int64) * C + cols[None, :], b.to(tl.uint8), mask=mask)
    groups = pid_c * G + tl.arange(0, G)
    n_groups = C // 32
    codes = tl.where(finite, e + 127, 255)
    gmask = (rows < R)[:, None] & (groups < n_groups)[None, :]
    tl.store(code_ptr + rows[:, None].to(tl.int64) * n_groups + groups[None, :], codes.to(tl.uint8), mask=gmask)


@triton.autotune(configs=_BLOCK_CONFIGS, key=["C_BUCKET", "IN_KIND", "TILE", "WRITE_ROW", "WRITE_COL", "EVEN"])
@triton.jit
def _block_kernel(
    x_ptr, y_ptr, s_ptr, yt_ptr, st_ptr, R, C, R_OUT, C_OUT, sxr, sxc, s_s0, s_s1, st_s0, st_s1, C_BUCKET,
    IN_KIND: tl.constexpr, RCEIL: tl.constexpr, USE_HW: tl.constexpr, TILE: tl.constexpr,
    WRITE_ROW: tl.constexpr, WRITE_COL: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    CHUNK: tl.constexpr, EVEN: tl.constexpr,
):
    """One (BLOCK_R, BLOCK_C = 128) tile of x (R, C). TILE: one 128x128 block (BLOCK_R = 128). Otherwise
    1x128 blocks along C for the row copy y (R, C) and 128x1 blocks along R for the transposed copy
    yt (C, R) (BLOCK_R = 128 when WRITE_COL). Scales: s[r or r-block, c-block], st[c or c-block, r-block]
    through the given strides. EVEN: the tile is inside x (no masks). R_OUT >= R, C_OUT >= C: the
    outputs are those of x zero-padded to (R_OUT, C_OUT), written without a padded copy of x (loads stop
    at R, C; stores at R_OUT, C_OUT).

    The tile is walked in CHUNK-row slices so that few registers are live: pass 1 reduces (and writes
    the row copy, whose 1x128 blocks lie inside a slice); pass 2 re-reads the slices (from L1/L2) to
    write the copies that need the whole tile's reduction (the transposed copy, the 128x128 tile)."""
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    r0 = pid_r * BLOCK_R
    c0 = pid_c * BLOCK_C
    lr = tl.arange(0, CHUNK)
    lc = tl.arange(0, BLOCK_C)
    cols = c0 + lc
    # 64-bit tile bases, 32-bit offsets inside the tile (128x128 int64 offset tiles cost registers)
    x_tile = x_ptr + r0.to(tl.int64) * sxr + c0.to(tl.int64) * sxc
    y_tile = y_ptr + r0.to(tl.int64) * C_OUT + c0
    yt_tile = yt_ptr + c0.to(tl.int64) * R_OUT + r0
    col_amax = tl.zeros((BLOCK_C,), dtype=tl.int32)
    col_max = tl.zeros((BLOCK_C,), dtype=tl.int32)
    for i in range(BLOCK_R // CHUNK):
        rl = i * CHUNK + lr
        mask = ((r0 + rl) < R)[:, None] & (cols < C)[None, :]
        out_mask = ((r0 + rl) < R_OUT)[:, None] & (cols < C_OUT)[None, :]
        u = _load_bits(x_tile, rl[:, None] * sxr + lc[None, :] * sxc, mask, IN_KIND, not EVEN)
        a = u & 0x7FFFFFFF
        am = tl.where(a >= 0x7F800000, 0, a)  # amax over finite values; max(a) >= Inf flags a non-finite
        if TILE or WRITE_COL:
            col_amax = tl.maximum(col_amax, tl.max(am, axis=0))
            col_max = tl.maximum(col_max, tl.max(a, axis=0))
        if WRITE_ROW and not TILE:
            e_r = _scale_exponent(tl.max(am, axis=1), RCEIL)
            b = _quantize(u, e_r[:, None], USE_HW).to(tl.uint8)
            _store(y_tile + rl[:, None] * C_OUT + lc[None, :], b, out_mask, not EVEN)
            rows = r0 + rl
            tl.store(s_ptr + rows.to(tl.int64) * s_s0 + pid_c * s_s1, _descale_bits(e_r, tl.max(a, axis=1) < 0x7F800000),
                     mask=rows < R_OUT)
    if TILE or WRITE_COL:
        if TILE:
            e_c = _scale_exponent(tl.max(col_amax), RCEIL)  # one exponent for the tile (a scalar)
            sbits = _descale_bits(e_c, tl.max(col_max) < 0x7F800000)
            if WRITE_ROW:
                tl.store(s_ptr + pid_r * s_s0 + pid_c * s_s1, sbits)
            if WRITE_COL:
                tl.store(st_ptr + pid_c * st_s0 + pid_r * st_s1, sbits)
            e_q = e_c
        else:
            e_c = _scale_exponent(col_amax, RCEIL)
            sbits = _descale_bits(e_c, col_max < 0x7F800000)
            tl.store(st_ptr + cols.to(tl.int64) * st_s0 + pid_r * st_s1, sbits, mask=cols < C_OUT)
            e_q = e_c[None, :]
        for j in range(BLOCK_R // CHUNK):  # fresh names: a name of pass 1 would become loop-carried here
            rl2 = j * CHUNK + lr
            mask2 = ((r0 + rl2) < R)[:, None] & (cols < C)[None, :]
            u2 = _load_bits(x_tile, rl2[:, None] * sxr + lc[None, :] * sxc, mask2, IN_KIND, not EVEN)
            b2 = _quantize(u2, e_q, USE_HW).to(tl.uint8)
            if TILE and WRITE_ROW:
                out_mask2 = ((r0 + rl2) < R_OUT)[:, None] & (cols < C_OUT)[None, :]
                _store(y_tile + rl2[:, None] * C_OUT + lc[None, :], b2, out_mask2, not EVEN)
            if WRITE_COL:
                tmask = (cols < C_OUT)[:, None] & ((r0 + rl2) < R_OUT)[None, :]
                _store(yt_tile + lc[:, None] * R_OUT + rl2[None, :], tl.trans(b2), tmask, not EVEN)


@triton.jit
def _scale_exponent_finite(amax, RCEIL: tl.constexpr):
    """_scale_exponent for a finite amax (bits < 0x7F800000), in fewer instructions: the exponent is at
    most 254 - 135 + 1 = 120, so the upper clamp never acts; rceil's "+1 when the mantissa exceeds 1.75"
    is the carry of amax + 0x1FFFFF into the exponent field; its one exception (mantissa 1.75 + 2^-23 at
    binade 8, see _scale_exponent) is the single value amax = 0x04600001."""
    if RCEIL:
        e = tl.maximum(((amax + 0x1FFFFF) >> 23) - 135, -127)
        e = tl.where(amax == 0x04600001, -127, e)
    else:
        e = tl.maximum((amax >> 23) - 135, -127)
    return e


@triton.jit
def _descale_bits_finite(e):
    """_descale_bits(e, True) for e in [-127, 120]: (e + 127) << 23 is 0 only for e = -127, whose descale
    2^-127 has the bits 0x400000."""
    return tl.maximum((e + 127) << 23, 0x400000)


@triton.jit
def _quantize_finite_hw(a, sgn, e):
    """_quantize(u, e, USE_HW=True) for a finite x, from its magnitude bits a and its sign sgn (at bit 7):
    the same bytes, since the RNE conversion is symmetric (converting |v| and or-ing the sign equals
    converting v, and a zero result gets x's sign either way); |v| >= 0 needs the upper clamp only."""
    inv = ((127 - e) << 23).to(tl.float32, bitcast=True)
    v = tl.minimum(a.to(tl.float32, bitcast=True) * inv, 448.0)
    return v.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True).to(tl.int32) | sgn


@triton.jit
def _q_finite(u, a, sgn, e, USE_HW: tl.constexpr):
    if USE_HW:
        return _quantize_finite_hw(a, sgn, e)
    else:
        return _quantize(u, e, False)


@triton.jit
def _m2(row_ok, col_ok, MASK_R: tl.constexpr, MASK_C: tl.constexpr):
    """The 2-D mask from the parts that can be False (unmasked tiles do not use it)."""
    if MASK_R and MASK_C:
        return row_ok[:, None] & col_ok[None, :]
    elif MASK_C:
        return col_ok[None, :]
    else:
        return row_ok[:, None]


@triton.jit
def _tile_load(x_tile, li, lc, k: tl.constexpr, r0, cols, R, C, sxr, sxc, IN_KIND: tl.constexpr,
               MASK_R: tl.constexpr, MASK_C: tl.constexpr, RELOAD: tl.constexpr = False):
    """fp32 bits of rows r0 + 4 i + k (i = li) of the tile: (32, 128). RELOAD: a volatile load, which the
    compiler neither merges with another load of the same group nor keeps alive in its place."""
    rl = 4 * li + k
    mask = _m2((r0 + rl) < R, cols < C, MASK_R, MASK_C)
    if RELOAD:
        raw = tl.load(x_tile + (rl[:, None] * sxr + lc[None, :] * sxc), mask=mask, other=0, volatile=True)
        if IN_KIND == 0:
            u = raw
        elif IN_KIND == 1:
            u = (raw.to(tl.int32) & 0xFFFF) << 16
        else:
            u = raw.to(tl.float32).to(tl.int32, bitcast=True)
        return u
    else:
        return _load_bits(x_tile, rl[:, None] * sxr + lc[None, :] * sxc, mask, IN_KIND, MASK_R or MASK_C)


@triton.jit
def _tile_load_main(x_ptr, r0, c0, li, lc, k: tl.constexpr, R, C, sxr, sxc, IN_KIND: tl.constexpr,
                    MASK_R: tl.constexpr, MASK_C: tl.constexpr, PAIRS: tl.constexpr):
    """_tile_load for the main loop. PAIRS (bf16 with contiguous rows, an even row stride and 4-byte
    alignment): the row group is read as (32, 64) int32 words, each two bf16, and split with one shift or
    one mask per element (the int16 path spends three instructions per element on it)."""
    rl = 4 * li + k
    if PAIRS:
        sw = sxr // 2
        lw = tl.arange(0, 64)
        xw = x_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + (r0.to(tl.int64) * sw + c0 // 2)
        offs = rl[:, None] * sw + lw[None, :]
        if MASK_R or MASK_C:
            w = tl.load(xw + offs, mask=_m2((r0 + rl) < R, (c0 // 2 + lw) < C // 2, MASK_R, MASK_C), other=0)
        else:
            w = tl.load(xw + offs)
        # element 2 j is the low half of word j (little endian), element 2 j + 1 the high half
        return tl.reshape(tl.join(w << 16, w & -65536), (32, 128))
    else:
        x_tile = x_ptr + r0.to(tl.int64) * sxr + c0.to(tl.int64) * sxc
        return _tile_load(x_tile, li, lc, k, r0, c0 + lc, R, C, sxr, sxc, IN_KIND, MASK_R, MASK_C)


@triton.jit
def _tile_store_rows(y_tile, b, k: tl.constexpr, li, lc, r0, cols, R, C, sy,
                     MASK_R: tl.constexpr, MASK_C: tl.constexpr):
    """Row-major bytes b (32, 128) of rows r0 + 4 i + k (y row stride sy)."""
    rl = 4 * li + k
    mask = _m2((r0 + rl) < R, cols < C, MASK_R, MASK_C)
    _store(y_tile + rl[:, None] * sy + lc[None, :], b.to(tl.uint8), mask, MASK_R or MASK_C)


@triton.jit
def _tile_store_row_scales(s_col, s_s0, e, finite, k: tl.constexpr, li, r0, R):
    rows = r0 + 4 * li + k
    tl.store(s_col + rows.to(tl.int64) * s_s0, _descale_bits(e, finite), mask=rows < R)


@triton.jit
def _tile_store_row_scales4(s_col, s_s0, d0, d1, d2, d3, r0, R, MASK_R: tl.constexpr):
    """Descale bits d_k (32,) of rows r0 + 4 i + k, interleaved into one store of the tile's 128 rows
    (one layout conversion instead of four)."""
    d = tl.reshape(tl.join(tl.join(d0, d2), tl.join(d1, d3)), (128,))  # [4 i + 2 p + q] = d_(2 p + q)[i]
    rows = r0 + tl.arange(0, 128)
    _store(s_col + rows.to(tl.int64) * s_s0, d, rows < R, MASK_R)


@triton.jit
def _tile_store_packed(yt_tile, b0, b1, b2, b3, li, lc, r0, cols, Rq, C, syt,
                       MASK_R: tl.constexpr, MASK_C: tl.constexpr):
    """The transposed copy of a tile: the bytes of rows 4 i .. 4 i + 3 of a column are four consecutive
    bytes of yt, packed into one int32 so that the transpose (through shared memory) moves 32-bit words;
    yt_tile points into the int32 view of yt ((C, Rq = R / 4), row stride syt)."""
    packed = b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)
    tmask = _m2(cols < C, (r0 // 4 + li) < Rq, MASK_C, MASK_R)
    _store(yt_tile + lc[:, None] * syt + li[None, :], tl.trans(packed), tmask, MASK_R or MASK_C)


@triton.jit
def _tile_rows_finite(y_tile, u, a, g, k: tl.constexpr, li, lc, r0, cols, R, C, sy,
                      RCEIL: tl.constexpr, USE_HW: tl.constexpr, MASK_R: tl.constexpr, MASK_C: tl.constexpr):
    """1x128 row copy of rows r0 + 4 i + k of a tile without NaN / Inf; returns the rows' exponents."""
    e = _scale_exponent_finite(tl.max(a, axis=1), RCEIL)
    b = _q_finite(u, a, g, e[:, None], USE_HW)
    _tile_store_rows(y_tile, b, k, li, lc, r0, cols, R, C, sy, MASK_R, MASK_C)
    return e


@triton.jit
def _tile_finite(u0, u1, u2, u3, ca, y_tile, yt_tile, s_ptr, st_ptr, s_s0, s_s1, st_s0, st_s1,
                 li, lc, r0, cols, pid_r, pid_c, R, Rq, C, sy, syt,
                 RCEIL: tl.constexpr, USE_HW: tl.constexpr, TILE: tl.constexpr, WRITE_ROW: tl.constexpr,
                 WRITE_COL: tl.constexpr, MASK_R: tl.constexpr, MASK_C: tl.constexpr):
    """Quantize and store a tile without NaN / Inf, held in registers as four (32, 128) row groups u_k
    (rows r0 + 4 i + k); ca: its column amax bits."""
    a0 = u0 & 0x7FFFFFFF
    a1 = u1 & 0x7FFFFFFF
    a2 = u2 & 0x7FFFFFFF
    a3 = u3 & 0x7FFFFFFF
    g0 = (u0 >> 24) & 0x80
    g1 = (u1 >> 24) & 0x80
    g2 = (u2 >> 24) & 0x80
    g3 = (u3 >> 24) & 0x80
    if TILE:
        # one exponent for the 128x128 tile; the transposed copy is the same bytes, transposed
        e = _scale_exponent_finite(tl.max(ca), RCEIL)
        sbits = _descale_bits_finite(e)
        b0 = _q_finite(u0, a0, g0, e, USE_HW)
        b1 = _q_finite(u1, a1, g1, e, USE_HW)
        b2 = _q_finite(u2, a2, g2, e, USE_HW)
        b3 = _q_finite(u3, a3, g3, e, USE_HW)
        if WRITE_ROW:
            tl.store(s_ptr + pid_r * s_s0 + pid_c * s_s1, sbits)
            _tile_store_rows(y_tile, b0, 0, li, lc, r0, cols, R, C, sy, MASK_R, MASK_C)
            _tile_store_rows(y_tile, b1, 1, li, lc, r0, cols, R, C, sy, MASK_R, MASK_C)
            _tile_store_rows(y_tile, b2, 2, li, lc, r0, cols, R, C, sy, MASK_R, MASK_C)
            _tile_store_rows(y_tile, b3, 3, li, lc, r0, cols, R, C, sy, MASK_R, MASK_C)
        if WRITE_COL:
            tl.store(st_ptr + pid_c * st_s0 + pid_r * st_s1, sbits)
            _tile_store_packed(yt_tile, b0, b1, b2, b3, li, lc, r0, cols, Rq, C, syt, MASK_R, MASK_C)
    else:
        if WRITE_ROW:
            e0 = _tile_rows_finite(y_tile, u0, a0, g0, 0, li, lc, r0, cols, R, C, sy,
                                   RCEIL, USE_HW, MASK_R, MASK_C)
            e1 = _tile_rows_finite(y_tile, u1, a1, g1, 1, li, lc, r0, cols, R, C, sy,
                                   RCEIL, USE_HW, MASK_R, MASK_C)
            e2 = _tile_rows_finite(y_tile, u2, a2, g2, 2, li, lc, r0, cols, R, C, sy,
                                   RCEIL, USE_HW, MASK_R, MASK_C)
            e3 = _tile_rows_finite(y_tile, u3, a3, g3, 3, li, lc, r0, cols, R, C, sy,
                                   RCEIL, USE_HW, MASK_R, MASK_C)
            _tile_store_row_scales4(s_ptr + pid_c * s_s1, s_s0, _descale_bits_finite(e0),
                                    _descale_bits_finite(e1), _descale_bits_finite(e2),
                                    _descale_bits_finite(e3), r0, R, MASK_R)
        if WRITE_COL:
            e_c = _scale_exponent_finite(ca, RCEIL)
            _store(st_ptr + cols.to(tl.int64) * st_s0 + pid_r * st_s1, _descale_bits_finite(e_c), cols < C,
                   MASK_C)
            e_q = e_c[None, :]
            b0 = _q_finite(u0, a0, g0, e_q, USE_HW)
            b1 = _q_finite(u1, a1, g1, e_q, USE_HW)
            b2 = _q_finite(u2, a2, g2, e_q, USE_HW)
            b3 = _q_finite(u3, a3, g3, e_q, USE_HW)
            _tile_store_packed(yt_tile, b0, b1, b2, b3, li, lc, r0, cols, Rq, C, syt, MASK_R, MASK_C)


@triton.jit
def _tile_nonfinite(x_tile, y_tile, yt_tile, s_ptr, st_ptr, sxr, sxc, s_s0, s_s1, st_s0, st_s1,
                    li, lc, r0, cols, pid_r, pid_c, R, Rq, C, sy, syt,
                    IN_KIND: tl.constexpr, RCEIL: tl.constexpr, USE_HW: tl.constexpr, TILE: tl.constexpr,
                    WRITE_ROW: tl.constexpr, WRITE_COL: tl.constexpr, MASK_R: tl.constexpr,
                    MASK_C: tl.constexpr):
    """A tile holding NaN / Inf (rare): amaxes over the finite values, NaN scales for the blocks with a
    non-finite value, elements by _quantize. Reads the tile again (from L2) one row group at a time with
    volatile loads, so that it needs few registers; unrolled (no inner loop)."""
    cf = tl.zeros((128,), dtype=tl.int32)  # finite column amax
    for k in tl.static_range(4):
        a = _tile_load(x_tile, li, lc, k, r0, cols, R, C, sxr, sxc, IN_KIND, MASK_R, MASK_C, True)
        a = a & 0x7FFFFFFF
        cf = tl.maximum(cf, tl.max(tl.where(a >= 0x7F800000, 0, a), axis=0))
    if TILE:
        # this tile holds a non-finite value: its one scale is NaN
        e = _scale_exponent(tl.max(cf), RCEIL)
        sbits = _descale_bits(e, False)
        if WRITE_ROW:
            tl.store(s_ptr + pid_r * s_s0 + pid_c * s_s1, sbits)
        if WRITE_COL:
            tl.store(st_ptr + pid_c * st_s0 + pid_r * st_s1, sbits)
        u = _tile_load(x_tile, li, lc, 0, r0, cols, R, C, sxr, sxc, IN_KIND, MASK_R, MASK_C, True)
        b0 = _quantize(u, e, USE_HW)
        u = _tile_load(x_tile, li, lc, 1, r0, cols, R, C, sxr, sxc, IN_KIND, MASK_R, MASK_C, True)
        b1 = _quantize(u, e, USE_HW)
        u = _tile_load(x_tile, li, lc, 2, r0, cols, R, C, sxr, sxc, IN_KIND, MASK_R, MASK_C, True)
        b2 = _quantize(u, e, USE_HW)
        u = _tile_load(x_tile, li, lc, 3, r0, cols, R, C, sxr, sxc, IN_KIND, MASK_R, MASK_C, True)
        b3 = _quantize(u, e, USE_HW)
        if WRITE_ROW:
            _tile_store_rows(y_tile, b0, 0, li, lc, r0, cols, R, C, sy, MASK_R, MASK_C)
            _tile_store_rows(y_tile, b1, 1, li, lc, r0, cols, R, C, sy, MASK_R, MASK_C)
            _tile_store_rows(y_tile, b2, 2, li, lc, r0, cols, R, C, sy, MASK_R, MASK_C)
            _tile_store_rows(y_tile, b3, 3, li, lc, r0, cols, R, C, sy, MASK_R, MASK_C)
        if WRITE_COL:
            _tile_store_packed(yt_tile, b0, b1, b2, b3, li, lc, r0, cols, Rq, C, syt, MASK_R, MASK_C)
    else:
        if WRITE_ROW:
            s_col = s_ptr + pid_c * s_s1
            for k in tl.static_range(4):
                u = _tile_load(x_tile, li, lc, k, r0, cols, R, C, sxr, sxc, IN_KIND, MASK_R, MASK_C, True)
                a = u & 0x7FFFFFFF
                e = _scale_exponent(tl.max(tl.where(a >= 0x7F800000, 0, a), axis=1), RCEIL)
                _tile_store_rows(y_tile, _quantize(u, e[:, None], USE_HW), k, li, lc, r0, cols, R, C, sy,
                                 MASK_R, MASK_C)
                _tile_store_row_scales(s_col, s_s0, e, tl.max(a, axis=1) < 0x7F800000, k, li, r0, R)
        if WRITE_COL:
            e_c = _scale_exponent(cf, RCEIL)
            cn = tl.zeros((128,), dtype=tl.int32)  # column max with the non-finite values
            for k in tl.static_range(4):
                a = _tile_load(x_tile, li, lc, k, r0, cols, R, C, sxr, sxc, IN_KIND, MASK_R, MASK_C, True)
                cn = tl.maximum(cn, tl.max(a & 0x7FFFFFFF, axis=0))
            tl.store(st_ptr + cols.to(tl.int64) * st_s0 + pid_r * st_s1, _descale_bits(e_c, cn < 0x7F800000),
                     mask=cols < C)
            e_q = e_c[None, :]
            u = _tile_load(x_tile, li, lc, 0, r0, cols, R, C, sxr, sxc, IN_KIND, MASK_R, MASK_C, True)
            b0 = _quantize(u, e_q, USE_HW)
            u = _tile_load(x_tile, li, lc, 1, r0, cols, R, C, sxr, sxc, IN_KIND, MASK_R, MASK_C, True)
            b1 = _quantize(u, e_q, USE_HW)
            u = _tile_load(x_tile, li, lc, 2, r0, cols, R, C, sxr, sxc, IN_KIND, MASK_R, MASK_C, True)
            b2 = _quantize(u, e_q, USE_HW)
            u = _tile_load(x_tile, li, lc, 3, r0, cols, R, C, sxr, sxc, IN_KIND, MASK_R, MASK_C, True)
            b3 = _quantize(u, e_q, USE_HW)
            _tile_store_packed(yt_tile, b0, b1, b2, b3, li, lc, r0, cols, Rq, C, syt, MASK_R, MASK_C)


@triton.autotune(
    configs=_TILE_CONFIGS,
    key=["C_BUCKET", "R_BUCKET", "IN_KIND", "TILE", "WRITE_ROW", "WRITE_COL", "MASK_R", "MASK_C", "PAIRS"],
)
@triton.jit
def _tile_kernel(
    x_ptr, y_ptr, s_ptr, yt_ptr, st_ptr, R, Rq, C, sxr, sxc, sy, syt, s_s0, s_s1, st_s0, st_s1, R_BUCKET,
    C_BUCKET,
    IN_KIND: tl.constexpr, RCEIL: tl.constexpr, USE_HW: tl.constexpr, TILE: tl.constexpr,
    WRITE_ROW: tl.constexpr, WRITE_COL: tl.constexpr, MASK_R: tl.constexpr, MASK_C: tl.constexpr,
    PAIRS: tl.constexpr, COL_MAJOR: tl.constexpr, PER_SM: tl.constexpr, STAGES: tl.constexpr,
):
    """Both copies of x (R, C) from one read, one 128x128 tile at a time held in registers (no second
    pass over the tile, one cross-warp column reduction per tile). Persistent: program p takes tiles p,
    p + P, ... (P programs, PER_SM per SM); with STAGES > 1 the compiler prefetches the next STAGES - 1
    tiles into shared memory (cp.async) while this one is quantized. Tile order: row-major over the tile
    grid (concurrent programs cover whole rows of x: long reads and row-copy writes, 128-byte runs of the
    transposed copy side by side) or, COL_MAJOR, down column strips (the old kernel's order).

    TILE: 128x128 blocks (one scale; the transposed copy is the same bytes, transposed). Otherwise 1x128
    blocks along C for the row copy y (R, C), row stride sy, and along R for the transposed copy; yt_ptr
    is its int32 view ((C, Rq = R / 4), row stride syt; R % 4 == 0). The tile is four (32, 128) groups of
    rows r0 + 4 i + k, k = 0..3, so that the four bytes one column of the transposed copy stores side by
    side sit in one thread. MASK_R / MASK_C: R / C not a multiple of 128 (masks on that dim). A tile
    holding NaN / Inf (one scalar test) is skipped, then written by _tile_nonfinite after the main loop."""
    pid = tl.program_id(0)
    n_r = tl.cdiv(R, 128)
    n_c = tl.cdiv(C, 128)
    n_tiles = n_r * n_c
    nprog = tl.num_programs(0)
    li = tl.arange(0, 32)
    lc = tl.arange(0, 128)
    # tile t = outer * n_in + inner; (inner, outer) advance by nprog without a division per tile
    if COL_MAJOR:
        n_in = n_r
    else:
        n_in = n_c
    inner = pid % n_in
    outer = pid // n_in
    step_in = nprog % n_in
    step_out = nprog // n_in
    seen_nonfinite = 0
    for t in tl.range(pid, n_tiles, nprog, num_stages=STAGES):
        if COL_MAJOR:
            pid_r = inner
            pid_c = outer
        else:
            pid_r = outer
            pid_c = inner
        r0 = pid_r * 128
        c0 = pid_c * 128
        cols = c0 + lc
        u0 = _tile_load_main(x_ptr, r0, c0, li, lc, 0, R, C, sxr, sxc, IN_KIND, MASK_R, MASK_C, PAIRS)
        u1 = _tile_load_main(x_ptr, r0, c0, li, lc, 1, R, C, sxr, sxc, IN_KIND, MASK_R, MASK_C, PAIRS)
        u2 = _tile_load_main(x_ptr, r0, c0, li, lc, 2, R, C, sxr, sxc, IN_KIND, MASK_R, MASK_C, PAIRS)
        u3 = _tile_load_main(x_ptr, r0, c0, li, lc, 3, R, C, sxr, sxc, IN_KIND, MASK_R, MASK_C, PAIRS)
        # column amax over every value: a NaN / Inf is an int >= 0x7F800000, so this is the finite amax
        # unless the tile holds one, which its max tells
        ca = tl.max(tl.maximum(tl.maximum(u0 & 0x7FFFFFFF, u1 & 0x7FFFFFFF),
                               tl.maximum(u2 & 0x7FFFFFFF, u3 & 0x7FFFFFFF)), axis=0)
        finite = tl.max(ca) < 0x7F800000
        seen_nonfinite = tl.maximum(seen_nonfinite, 1 - finite.to(tl.int32))
        if finite:
            _tile_finite(u0, u1, u2, u3, ca, y_ptr + r0.to(tl.int64) * sy + c0,
                         yt_ptr + c0.to(tl.int64) * syt + r0 // 4, s_ptr, st_ptr, s_s0, s_s1, st_s0, st_s1,
                         li, lc, r0, cols, pid_r, pid_c, R, Rq, C, sy, syt,
                         RCEIL, USE_HW, TILE, WRITE_ROW, WRITE_COL, MASK_R, MASK_C)
        inner += step_in
        outer += step_out
        wrap = inner >= n_in
        inner = tl.where(wrap, inner - n_in, inner)
        outer = tl.where(wrap, outer + 1, outer)
    if seen_nonfinite != 0:
        # the tiles skipped above (holding NaN / Inf): found again and written by _tile_nonfinite, outside
        # the main loop so that its registers do not weigh on the main loop's
        for t in range(pid, n_tiles, nprog):
            if COL_MAJOR:
                pid_r = t % n_r
                pid_c = t // n_r
            else:
                pid_r = t // n_c
                pid_c = t % n_c
            r0 = pid_r * 128
            c0 = pid_c * 128
            cols = c0 + lc
            x_tile = x_ptr + r0.to(tl.int64) * sxr + c0.to(tl.int64) * sxc
            cmax = tl.zeros((128,), dtype=tl.int32)
            for k in tl.static_range(4):
                a = _tile_load(x_tile, li, lc, k, r0, cols, R, C, sxr, sxc, IN_KIND, MASK_R, MASK_C, True)
                cmax = tl.maximum(cmax, tl.max(a & 0x7FFFFFFF, axis=0))
            if tl.max(cmax) >= 0x7F800000:
                _tile_nonfinite(x_tile, y_ptr + r0.to(tl.int64) * sy + c0,
                                yt_ptr + c0.to(tl.int64) * syt + r0 // 4, s_ptr, st_ptr, sxr, sxc,
                                s_s0, s_s1, st_s0, st_s1, li, lc, r0, cols, pid_r, pid_c, R, Rq, C, sy, syt,
                                IN_KIND, RCEIL, USE_HW, TILE, WRITE_ROW, WRITE_COL, MASK_R, MASK_C)


# ---------------------------------------------------------------------------------------------------
# Launchers


def use_hw_convert(device: torch.device) -> bool:
    """The hardware FP8 conversion path: CUDA sm_89+, not the interpreter, and not switched off with
    GEMCOMPILE_FP8_INT_CONVERT=1 (the integer path: bit-exact everywhere, slower)."""
    if device.type != "cuda" or _INTERPRET or os.environ.get("GEMCOMPILE_FP8_INT_CONVERT") == "1":
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def _check(x: Tensor, rule: str, dims: int | None = 2) -> None:
    if rule not in _RULES:
        raise ValueError(f"unknown scale rule {rule!r}; valid: {', '.join(_RULES)}")
    if x.dtype not in _IN_KIND:
        raise TypeError(f"FP8 quantize kernels take float32, bfloat16 or float16, got {x.dtype}")
    if dims is not None and x.dim() != dims:
        raise ValueError(f"expected a {dims}-D tensor, got shape {tuple(x.shape)}")


def _as_loadable(x: Tensor) -> Tensor:
    # fp32 / bf16 are read as raw integers (see _load_bits); fp16 is read as fp16
    if x.dtype == torch.float32:
        return x.view(torch.int32)
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16)
    return x


def _hw(x: Tensor, use_hw: bool | None) -> bool:
    return use_hw_convert(x.device) if use_hw is None else bool(use_hw)


def mx_quantize_triton(x: Tensor, rule: str = "floor", use_hw: bool | None = None) -> tuple[Tensor, Tensor]:
    """MXFP8 along the last dim (any rank, last dim a multiple of 32): (elements float8_e4m3fn in x's
    shape, contiguous; E8M0 codes uint8 (..., C / 32)), bit for bit ``mx_numerics.mx_quantize(x, -1, rule)``."""
    _check(x, rule, dims=None)
    if x.dim() == 0 or x.shape[-1] % 32:
        raise ValueError(f"MXFP8 needs the last dim to be a multiple of 32, got shape {tuple(x.shape)}")
    C = x.shape[-1]
    x2 = x.reshape(-1, C)  # a view for the usual layouts
    if x2.stride(1) != 1:
        # rows must be contiguous: on the H200 (triton 3.6) a transposed view read through its strides gave
        # wrong blocks (the interpreter reads it right), so it is copied first
        x2 = x2.contiguous()
    R = x2.shape[0]
    y = torch.empty((R, C), dtype=torch.uint8, device=x.device)
    codes = torch.empty((R, C // 32), dtype=torch.uint8, device=x.device)
    if R and C:
        BLOCK_C = 128 if C % 128 == 0 else 32

        def grid(meta):
            return (triton.cdiv(R, meta["BLOCK_R"]), triton.cdiv(C, BLOCK_C))

        _launch(_mx_kernel, grid, (_as_loadable(x2), y, codes, R, C, x2.stride(0), x2.stride(1), _bucket(C)),
                {"IN_KIND": _IN_KIND[x.dtype], "RCEIL": rule == "rceil", "USE_HW": _hw(x, use_hw),
                 "BLOCK_C": BLOCK_C}, (_bucket(C),))
    shape = tuple(x.shape)
    return y.view(torch.float8_e4m3fn).reshape(shape), codes.reshape(*shape[:-1], C // 32)


def _round4(n: int) -> int:
    return (n + 3) // 4 * 4


def _tile_scales(rows: int, cols: int, device) -> Tensor:
    """(ceil(rows/128), ceil(cols/128)) fp32 view of a row-major (.., L4) buffer, L4 = round_up(., 4)."""
    nr, nc = triton.cdiv(rows, 128), triton.cdiv(cols, 128)
    return torch.empty((nr, _round4(nc)), dtype=torch.float32, device=device).narrow(1, 0, nc)


def scale_storage(s: Tensor) -> Tensor:
    """The padded (blocks, L4) row-major storage behind a 128x128 scale view from quantize_128x128."""
    nr = s.shape[0]
    ld = s.stride(0) if nr > 1 else _round4(s.shape[1])
    return s.as_strided((nr, ld), (ld, 1))


def _col_major(rows: int, cols: int, device) -> Tensor:
    return torch.empty((cols, rows), dtype=torch.float32, device=device).t()


def alloc_outputs(R: int, C: int, device, tile: bool, row: bool = True, col: bool = True):
    """The (x8, s, xt8, st) tensors quantize_1x128 (tile False) / quantize_128x128 (tile True) fill for an
    (R, C) input, in the layouts documented above (None for a copy not asked for)."""
    f8 = torch.float8_e4m3fn
    if tile:
        s = _tile_scales(R, C, device) if row else None
        st = _tile_scales(C, R, device) if col else None
    else:
        s = _col_major(R, triton.cdiv(C, 128), device) if row else None
        st = _col_major(C, triton.cdiv(R, 128), device) if col else None
    x8 = torch.empty((R, C), dtype=f8, device=device) if row else None
    xt8 = torch.empty((C, R), dtype=f8, device=device) if col else None
    return x8, s, xt8, st


_DUAL_IMPLS = ("tile", "old")


def dual_impl() -> str:
    """The kernel for the copies that need a whole tile's reduction (quantize_1x128 with col=True, every
    quantize_128x128): "tile" (_tile_kernel, 128x128 tiles held in registers; written to fix the dual
    copy's 670 GB/s, not yet measured on a GPU) or "old" (the default: _block_kernel, the tile walked
    twice in row slices), picked per call by the environment variable
    GEMCOMPILE_DUAL_QUANT_IMPL, so both can be timed in one process. Same bytes either way. The row-only
    1x128 copy always takes _block_kernel (32-row tiles, already at ~2.7 TB/s on the H200), and so does a
    transposed copy of an input with R % 4 != 0 (the tile kernel writes it as 4-byte words)."""
    # "old" stays the default until the tile kernel has been timed and checked byte for byte on the H200
    impl = os.environ.get("GEMCOMPILE_DUAL_QUANT_IMPL", "old").strip().lower() or "old"
    if impl not in _DUAL_IMPLS:
        raise ValueError(f"GEMCOMPILE_DUAL_QUANT_IMPL={impl!r}; valid: {', '.join(_DUAL_IMPLS)}")
    return impl


_SMS: dict = {}


def _num_sms(device: torch.device) -> int:
    """Programs of the persistent tile kernel per ``PER_SM``: the SM count (4 on the CPU interpreter, so
    that its programs loop over several tiles there too)."""
    if device.type != "cuda" or _INTERPRET:
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]


def _pairs(x: Tensor) -> bool:
    """bf16 rows readable as int32 words (see _tile_load_main)."""
    return (x.dtype == torch.bfloat16 and x.shape[1] % 2 == 0 and (x.stride(1) == 1 or x.shape[1] == 1)
            and (x.stride(0) % 2 == 0 or x.shape[0] == 1) and x.data_ptr() % 4 == 0)


def _bucket(n: int) -> int:
    """Autotune key bucket of a row count (powers of two, 8192 and above together)."""
    return min(triton.next_power_of_2(max(n, 1)), 8192)


def _launch_tile(x, rule, tile, row, col, use_hw, out):
    """_tile_kernel on x (R, C), R % 4 == 0 when the transposed copy is asked for. A C that is not a
    multiple of 128 is split: the whole column tiles in one launch, the last partial column of tiles in
    a second one (its column masks cost the kernel registers: spills, which the main launch is spared);
    the outputs are written through views (their strides go to the kernel)."""
    R, C = x.shape
    if x.stride(1) != 1 and C > 1:
        # rows must be contiguous, as for mx_quantize_triton: a transposed view would be read through
        # column-major layouts, the pattern that gave wrong blocks on the H200 (triton 3.6) there
        x = x.contiguous()
    x8, s, xt8, st = out
    c_main = C - C % 128
    if C % 128 and c_main:
        cut = c_main // 128
        for cols, blocks in ((slice(0, c_main), slice(0, cut)), (slice(c_main, C), slice(cut, None))):
            _launch_tile(x[:, cols], rule, tile, row, col, use_hw, (
                x8[:, cols] if x8 is not None else None,
                s[:, blocks] if s is not None else None,
                xt8[cols] if xt8 is not None else None,
                (st[blocks] if tile else st[cols]) if st is not None else None,
            ))
        return
    dummys = s if s is not None else st
    yt32 = xt8.view(torch.uint8).view(torch.int32) if col else dummys.view(torch.int32)  # (C, R / 4)
    args = (
        _as_loadable(x),
        x8.view(torch.uint8) if x8 is not None else dummys,
        (s if s is not None else dummys).view(torch.int32),
        yt32,
        (st if st is not None else dummys).view(torch.int32),
        R, R // 4, C, x.stride(0), x.stride(1),
        x8.stride(0) if x8 is not None else 0, yt32.stride(0) if col else 0,
        s.stride(0) if s is not None else 0, s.stride(1) if s is not None else 0,
        st.stride(0) if st is not None else 0, st.stride(1) if st is not None else 0, _bucket(R), _bucket(C),
    )
    flags = {"IN_KIND": _IN_KIND[x.dtype], "RCEIL": rule == "rceil", "USE_HW": _hw(x, use_hw), "TILE": tile,
             "WRITE_ROW": row, "WRITE_COL": col, "MASK_R": R % 128 != 0, "MASK_C": C % 128 != 0,
             "PAIRS": _pairs(x)}
    n_tiles = triton.cdiv(R, 128) * triton.cdiv(C, 128)
    if C % 128:
        # one partial column of tiles: a fixed config (no autotuning for the small tail launch)
        cfg = _TILE_CONFIGS[0]
        grid = (min(n_tiles, _num_sms(x.device) * cfg.kwargs["PER_SM"]),)
        _tile_kernel.fn[grid](*args, **flags, **cfg.kwargs, num_warps=cfg.num_warps)
        return
    n_sm = _num_sms(x.device)
    _launch(_tile_kernel, lambda meta: (min(n_tiles, n_sm * meta["PER_SM"]),), args, flags,
            (_bucket(R), _bucket(C)))


def _launch_block(x, rule, tile, row, col, use_hw, out, pad_to=None):
    R, C = x.shape
    R_out, C_out = pad_to if pad_to is not None else (R, C)
    x8, s, xt8, st = out
    if tile:  # the padding columns of the scale rows: never used for real blocks, but cuBLAS may read them
        for scale in (s, st):
            if scale is not None and scale.shape[1] % 4:
                scale_storage(scale)[:, scale.shape[1]:].fill_(1.0)
    if R_out == 0 or C_out == 0:
        return
    if (col or tile) and (R_out % 4 == 0 or not col) and dual_impl() == "tile":
        if (R_out, C_out) != (R, C):  # the tile kernel has no padded outputs: pad x (a copy), as before
            x = torch.nn.functional.pad(x, (0, C_out - C, 0, R_out - R))
        _launch_tile(x, rule, tile, row, col, use_hw, out)
        return
    dummy8 = x8 if x8 is not None else xt8
    dummys = s if s is not None else st
    block_r = 128 if (tile or col) else 32
    grid = (triton.cdiv(R_out, block_r), triton.cdiv(C_out, 128))
    _launch(_block_kernel, grid, (
        _as_loadable(x),
        (x8 if x8 is not None else dummy8).view(torch.uint8),
        (s if s is not None else dummys).view(torch.int32),
        (xt8 if xt8 is not None else dummy8).view(torch.uint8),
        (st if st is not None else dummys).view(torch.int32),
        R, C, R_out, C_out, x.stride(0), x.stride(1),
        s.stride(0) if s is not None else 0, s.stride(1) if s is not None else 0,
        st.stride(0) if st is not None else 0, st.stride(1) if st is not None else 0, _bucket(C_out),
    ), {"IN_KIND": _IN_KIND[x.dtype], "RCEIL": rule == "rceil", "USE_HW": _hw(x, use_hw), "TILE": tile,
        "WRITE_ROW": row, "WRITE_COL": col, "BLOCK_R": block_r, "BLOCK_C": 128,
        "EVEN": (R, C) == (R_out, C_out) and R % block_r == 0 and C % 128 == 0}, (_bucket(C_out),))


def _padded_shape(x: Tensor, pad_to, name: str) -> tuple[int, int]:
    if pad_to is None:
        return tuple(x.shape)
    R_out, C_out = (int(n) for n in pad_to)
    if R_out < x.shape[0] or C_out < x.shape[1]:
        raise ValueError(f"{name}: pad_to {(R_out, C_out)} is smaller than the input {tuple(x.shape)}")
    return R_out, C_out


def quantize_1x128(
    x: Tensor, rule: str = "floor", row: bool = True, col: bool = True, use_hw: bool | None = None,
    pad_to: tuple[int, int] | None = None,
) -> tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None]:
    """x (R, C) -> (x8 (R, C), s (R, ceil(C/128)) strides (1, R), xt8 (C, R), st (C, ceil(R/128)) strides
    (1, C)); fp8 copies row-major, scales fp32 descales. ``row`` / ``col`` pick the copies (None for the
    other). x8 with s is the reference's block_quantize(x, (1, 128)); xt8 with st is block_quantize(x.T,
    (1, 128)); one read of x serves both. ``pad_to`` (R', C') >= (R, C): the copies of x zero-padded to
    (R', C') (GEMM operand alignment), written without a padded copy of x."""
    _check(x, rule)
    if not (row or col):
        raise ValueError("quantize_1x128: ask for the row copy, the column copy or both")
    shape = _padded_shape(x, pad_to, "quantize_1x128")
    out = alloc_outputs(*shape, x.device, tile=False, row=row, col=col)
    _launch_block(x, rule, False, row, col, use_hw, out, shape)
    return out


def quantize_128x128(
    w: Tensor, rule: str = "floor", row: bool = True, col: bool = True, use_hw: bool | None = None,
    pad_to: tuple[int, int] | None = None,
) -> tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None]:
    """w (R, C) -> (w8 (R, C), s (ceil(R/128), ceil(C/128)), wt8 (C, R), st (ceil(C/128), ceil(R/128)));
    one scale per 128x128 tile, shared by both copies (st is s transposed). Scale views sit in row-major
    buffers whose rows are padded to a multiple of 4 (see scale_storage). ``pad_to``: as quantize_1x128."""
    _check(w, rule)
    if not (row or col):
        raise ValueError("quantize_128x128: ask for the row copy, the column copy or both")
    shape = _padded_shape(w, pad_to, "quantize_128x128")
    out = alloc_outputs(*shape, w.device, tile=True, row=row, col=col)
    _launch_block(w, rule, True, row, col, use_hw, out, shape)
    return out


def codes_to_descale(codes: Tensor) -> Tensor:
    """E8M0 codes (uint8) -> fp32 descales 2^(code - 127), NaN for 0xFF, built from bits (exact)."""
    c = codes.to(torch.int32)
    bits = torch.where(c == 0, 0x400000, c << 23)
    bits = torch.where(c == 255, 0x7FC00000, bits)
    return bits.view(torch.float32)


# ---------------------------------------------------------------------------------------------------
# A/B on a GPU:  python -m gemcompile.lowering.mx_quantize_triton [--M 65536 --K 4096 --N 4096]


def _same_outputs(a, b) -> bool:
    """Two (x8, s, xt8, st) tuples hold the same bytes (fp8 as uint8, scales as int32 bits)."""

    def raw(t):
        return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)

    return all((p is None and q is None) or (p is not None and q is not None and torch.equal(raw(p), raw(q)))
               for p, q in zip(a, b))


def _bench(argv=None) -> None:
    """Times the transposed-copy kernels both ways (GEMCOMPILE_DUAL_QUANT_IMPL=old and =tile) after
    checking that they write the same bytes; GB/s counts bytes read + written (fp8 copies and scales).
    The first call of each case compiles and autotunes (TRITON_PRINT_AUTOTUNING=1 shows the pick)."""
    import argparse

    from triton.testing import do_bench

    parser = argparse.ArgumentParser(description=_bench.__doc__.split(";")[0])
    parser.add_argument("--M", type=int, default=65536, help="rows of x (tokens)")
    parser.add_argument("--K", type=int, default=4096, help="columns of x and W")
    parser.add_argument("--N", type=int, default=4096, help="rows of W")
    parser.add_argument("--rule", default="rceil", choices=_RULES)
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--json", default=None, help="also write the timings to this JSON file")
    args = parser.parse_args(argv)
    rows = []
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    g = torch.Generator(device="cuda").manual_seed(0)
    M, K, N, rule = args.M, args.K, args.N, args.rule
    x = torch.randn(M, K, device="cuda", generator=g).to(dtype)
    w = (torch.randn(N, K, device="cuda", generator=g) * K**-0.5).to(dtype)
    size = x.element_size()

    def moved(rows, cols, copies, tile):
        return rows * cols * (size + copies) + 4 * copies * rows * cols // (128 * 128 if tile else 128)

    cases = [
        ("x 1x128 dual (x8 + x8^T)", lambda: quantize_1x128(x, rule), moved(M, K, 2, False)),
        ("x 1x128 x8^T only", lambda: quantize_1x128(x, rule, row=False), moved(M, K, 1, False)),
        ("W 128x128 dual (W8 + W8^T)", lambda: quantize_128x128(w, rule), moved(N, K, 2, True)),
        ("x 1x128 rows only (same kernel)", lambda: quantize_1x128(x, rule, col=False),
         moved(M, K, 1, False)),
    ]
    before = os.environ.get("GEMCOMPILE_DUAL_QUANT_IMPL")
    print(f"{torch.cuda.get_device_name()}  triton {triton.__version__}  torch {torch.__version__}  "
          f"x ({M}, {K}) W ({N}, {K}) {args.dtype} {rule}", flush=True)
    try:
        for name, fn, nbytes in cases:
            outs = {}
            for impl in ("old", "tile"):
                os.environ["GEMCOMPILE_DUAL_QUANT_IMPL"] = impl
                outs[impl] = fn()
                torch.cuda.synchronize()
                ms = do_bench(fn, warmup=25, rep=200, return_mode="median")
                print(f"  {name:32s} {impl:4s} {ms:8.3f} ms {nbytes / ms / 1e6:7.0f} GB/s", flush=True)
                rows.append({"case": name, "impl": impl, "ms": ms, "GB_per_s": nbytes / ms / 1e6})
            same = _same_outputs(outs['old'], outs['tile'])
            print(f"  {'':32s} same bytes: {same}", flush=True)
            for row in rows[-2:]:
                row["same_bytes_as_other_impl"] = same
            del outs
        for kernel in (_tile_kernel, _block_kernel):
            print(f"  last autotune pick of {kernel.fn.__name__}: {getattr(kernel, 'best_config', None)}")
        if args.json:
            import json
            import sys

            payload = {"command": "python -m gemcompile.lowering.mx_quantize_triton " + " ".join(sys.argv[1:]),
                       "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "shape": {"M": M, "K": K, "N": N}, "dtype": args.dtype,
                       "rule": rule, "results": rows}
            with open(args.json, "w") as f:
                json.dump(payload, f, indent=1)
    finally:
        if before is None:
            os.environ.pop("GEMCOMPILE_DUAL_QUANT_IMPL", None)
        else:
            os.environ["GEMCOMPILE_DUAL_QUANT_IMPL"] = before


if __name__ == "__main__":
    _bench()
