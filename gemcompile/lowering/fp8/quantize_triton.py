"""Triton quantize kernels for block-scaled FP8 (E4M3 elements, power-of-two scales), bit-exact with the
reference of numerics.py on every input (the one documented exception is below).

Kernels and what they write
---------------------------
* :func:`mx_quantize_triton` -- MXFP8, blocks of 32 along the last dim, E8M0 codes: the same output as
  ``numerics.mx_quantize(x, dim=-1, rule)``.
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

One pass: :func:`_block_kernel` walks a tile in CHUNK-row slices; the copies that need a whole tile's
reduction (the transposed 1x128 copy, the 128x128 tiles) re-read the slices from L1/L2 after the column
amax, so HBM sees x once. On the H200 that walk made the dual 1x128 copy ~5x slower than the row copy (a
cross-warp column reduction with barriers per slice, and byte-wise shared-memory transposes); a one-pass
tile kernel, faster but never shown byte-exact on the GPU (benchmarks/README.md), was dropped.

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

Known difference from numerics.py (reference bug, reported): with the rceil rule and an fp32 block whose
amax < 448 * 2^-150 (about 2.6e-43, fp32 subnormal inputs only), the reference's fp32 division amax / 448
underflows to 0 and frexp(0) yields exponent 0, so it writes code 127 (scale 1) instead of the clamped
minimum 0 (scale 2^-127). The elements are 0 either way, so dequantized values agree; the kernels write
code 0, which is what the spec's clamp gives.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl
from torch import Tensor

from ..common.tuned_launch import INTERPRET, autotune, launch  # once per key, then the tuned kernel
from gemcompile.env import env_flag

__all__ = [
    "alloc_outputs",
    "codes_to_descale",
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


# memory-bound kernels: tune only the tile height / warps; one config under the interpreter
_MX_CONFIGS = (
    [triton.Config({"BLOCK_R": 32}, num_warps=4)]
    if INTERPRET
    else [triton.Config({"BLOCK_R": r}, num_warps=w) for r, w in ((16, 4), (32, 8))]  # 86-94 registers
)
# (CHUNK, warps) without register spills on sm_90 (checked with cuobjdump -res-usage: 63-172 registers)
_BLOCK_SHAPES = ((16, 4), (16, 8), (32, 8))
# the transposed copy with int32 codes transposed (TRANSPOSE_CODES): (32, 4) only, the one config seen both
# byte-exact and faster on an H100 (8 warps slower than today's kernel, 16 warps wrong bytes under triton 3.6)
_TRANSPOSED_CODES_SHAPES = ((32, 4),)
_BLOCK_CONFIGS = (
    [triton.Config({"CHUNK": 32}, num_warps=4)]
    if INTERPRET
    else [triton.Config({"CHUNK": c}, num_warps=w) for c, w in _BLOCK_SHAPES + _TRANSPOSED_CODES_SHAPES]
)
TRANSPOSE_CODES = env_flag("GEMCOMPILE_FP8_TRANSPOSE_CODES", True)
"""The transposed copies (1x128 and 128x128) transpose the int32 E4M3 codes through shared memory before the cast
to bytes (a byte-wise transpose held the dual copies at ~620-680 GB/s). On an H100 (2026-12-06) they wrote the CPU
reference's bytes (tests/gpu/test_mx_quantize_gpu.py) and ran the dual copies at ~900-1130 GB/s
(benchmarks/README.md, `mx-transpose-codes-ab`). `GEMCOMPILE_FP8_TRANSPOSE_CODES=0` keeps the byte transpose."""


def _block_prune(configs, named_args, **kwargs):
    """The configs of a launch's code path: TRANSPOSE_CODES with a transposed copy (1x128 or 128x128) takes its
    own list."""
    args = {**named_args, **kwargs}
    own = bool(args.get("TRANSPOSE_CODES")) and bool(args.get("WRITE_COL"))
    shapes = _TRANSPOSED_CODES_SHAPES if own else _BLOCK_SHAPES
    kept = [c for c in configs if (c.kwargs["CHUNK"], c.num_warps) in shapes]
    return kept or configs


@autotune(configs=_MX_CONFIGS, key=["C_BUCKET", "IN_KIND", "BLOCK_C"])
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


@autotune(configs=_BLOCK_CONFIGS,
          key=["C_BUCKET", "IN_KIND", "TILE", "WRITE_ROW", "WRITE_COL", "EVEN", "TRANSPOSE_CODES"],
          prune_configs_by={"early_config_prune": _block_prune})
@triton.jit
def _block_kernel(
    x_ptr, y_ptr, s_ptr, yt_ptr, st_ptr, R, C, R_OUT, C_OUT, sxr, sxc, s_s0, s_s1, st_s0, st_s1, C_BUCKET,
    IN_KIND: tl.constexpr, RCEIL: tl.constexpr, USE_HW: tl.constexpr, TILE: tl.constexpr,
    WRITE_ROW: tl.constexpr, WRITE_COL: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    CHUNK: tl.constexpr, EVEN: tl.constexpr, TRANSPOSE_CODES: tl.constexpr = False,
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
            codes = _quantize(u2, e_q, USE_HW)
            b2 = codes.to(tl.uint8)
            if TILE and WRITE_ROW:
                out_mask2 = ((r0 + rl2) < R_OUT)[:, None] & (cols < C_OUT)[None, :]
                _store(y_tile + rl2[:, None] * C_OUT + lc[None, :], b2, out_mask2, not EVEN)
            if WRITE_COL:
                tmask = (cols < C_OUT)[:, None] & ((r0 + rl2) < R_OUT)[None, :]
                if TRANSPOSE_CODES:  # 32-bit elements through shared memory, then bytes
                    bt = tl.trans(codes).to(tl.uint8)
                else:
                    bt = tl.trans(b2)
                _store(yt_tile + lc[:, None] * R_OUT + rl2[None, :], bt, tmask, not EVEN)


# ---------------------------------------------------------------------------------------------------
# Launchers


def use_hw_convert(device: torch.device) -> bool:
    """The hardware FP8 conversion path: CUDA sm_89+, not the interpreter, and not switched off with
    GEMCOMPILE_FP8_INT_CONVERT=1 (the integer path: bit-exact everywhere, slower)."""
    if device.type != "cuda" or INTERPRET or env_flag("GEMCOMPILE_FP8_INT_CONVERT", False):
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
    shape, contiguous; E8M0 codes uint8 (..., C / 32)), bit for bit ``numerics.mx_quantize(x, -1, rule)``."""
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

        launch(_mx_kernel, grid, (_as_loadable(x2), y, codes, R, C, x2.stride(0), x2.stride(1), _bucket(C)),
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


def _bucket(n: int) -> int:
    """Autotune key bucket of a row count (powers of two, 8192 and above together)."""
    return min(triton.next_power_of_2(max(n, 1)), 8192)


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
    dummy8 = x8 if x8 is not None else xt8
    dummys = s if s is not None else st
    block_r = 128 if (tile or col) else 32
    grid = (triton.cdiv(R_out, block_r), triton.cdiv(C_out, 128))
    launch(_block_kernel, grid, (
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
        "EVEN": (R, C) == (R_out, C_out) and R % block_r == 0 and C % 128 == 0,
        "TRANSPOSE_CODES": TRANSPOSE_CODES and col}, (_bucket(C_out),))


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
