"""Triton kernels of block attention (block-diagonal and/or sliding-window softmax attention over padded
sequences, optional fused rotary on q and k) and their launchers.

Which rows meet which keys. Query row i (every row < L, padded rows too) attends key j iff j < len[b],
same block (block > 0), |i - j| <= window (window >= 0), j <= i (causal). The rows that may see keys
and the keys a tile of rows may see are contiguous ranges, so every program computes its range from
the static block/window and the length it loads from the device, and touches nothing else:
- a query tile [m0, m1] meets keys [lo, hi): lo = max(block start of m0, m0 - window), hi = min(len,
  block end of m1, m1 + window + 1, m1 + 1 if causal); ``lo >= hi`` means no row of the tile has a key
  (tiles past the length): the program writes zeros (lse +inf) and exits;
- a key tile [n0, n1] meets query rows [max(block start of n0, n0 - window, n0 if causal),
  min(L, block end of n1, n1 + window + 1)).
Time is linear in L: each tile meets O(block + window) keys.

q_lengths (optional, constexpr HAS_Q_LENGTHS; without it the kernels compile to the code they had before):
query rows i >= q_len[b] (clamped into [0, L]) are not computed. Query tiles wholly past q_len write zeros
(lse +inf; dQ 0) and exit; the rows past q_len of a tile that straddles it see no key (out 0, lse +inf)
and, in the backward, read dO, lse and delta as 0 / +inf / 0 (so a NaN upstream gradient there cannot
leak): their dQ is exactly 0 and they add nothing to dK, dV, whose query loops stop at q_len.

kv_mask (optional, bool (B, L), any strides, read as a uint8 view): the launcher derives per sample,
with torch ops on the device, [kv_lo, kv_hi) = [first valid key, last valid key + 1] (valid: the mask
and j < len; :func:`kv_mask_range`), which replaces [0, len) above: key loops start at the tile of
kv_lo and stop at kv_hi, and programs whose keys lie wholly outside write zeros (lse +inf) and exit.
Every key tile a program processes ANDs the loaded mask vector into its validity (masked keys and
values read as 0, get exactly zero dK and dV). HAS_KV_MASK is a constexpr: without a mask the kernels
compile to the code they had before.

Packed layout (PACKED constexpr; without it the kernels compile to the code they had before): q, k, v,
out, dO and dQ, dK, dV are (T, H, D) and lse, delta (T, H); the launcher passes them with batch stride 0
and each program starts sequence b at row0 = token_offsets[b] (``_seq_off``). Rows past the length are
the next sequence's: loads and stores stop at the length instead of L (``_row_end``), and query rows past
it are not computed (the q_lengths path with q_lengths = lengths). Positions, blocks, rotary table rows
and the grid stay those of the padded length L (``max_len``); rotary at D = 16 is applied with torch to
the packed rows, with each token's table row.

Dropout on the attention probabilities (DROPOUT constexpr, general kernels only; without it they compile
to the code they had before): the draws of jagged attention by positions in the sequence
(common/attention_triton.dropout_factor, common/dropout.py); a call with dropout runs the general kernels
even where the closed-form ones serve the shape.

Two families of kernels:
- "closed" kernels, for block-diagonal attention whose block divides the tile (power-of-two blocks up
  to the tile size; block 64 with 64-row tiles is one block per program): a query tile's keys are the
  tile's own rows, so the forward is one score tile (no key loop, no online-softmax rescaling, q and
  k rotated with the same table rows), and the backward is ONE fused kernel per tile computing dQ,
  dK and dV together: every block is independent, so no other program touches these rows (no atomics,
  deterministic), nothing is read twice, and delta = rowsum(P * dP) comes from the tile itself instead
  of a separate rowsum(O * dO) pass (O is not even read).
- "general" kernels for everything else (windows without blocks, blocks larger than the tile, blocks
  that are not powers of two): a forward with an online-softmax loop over the key range; the backward
  of jagged attention (the shared delta kernel of common/attention_triton.py, a dK/dV kernel looping
  over query tiles, a dQ kernel looping over key tiles; deterministic, no atomics).

Rotary is fused into the loads: a q or k tile is loaded full width (one vectorized load) and split in
registers into the halves A and B that the rotation mixes (first/second half for "half", even/odd
columns for "interleaved"), rotated in fp32 (A' = A cos_A - B sin_A, B' = B cos_B + A sin_B) and
rounded to the input dtype; scores are A'_q A'_k^T + B'_q B'_k^T (two dots of K = D/2). Gradients
w.r.t. the rotated tiles are accumulated as halves too (dQ_A = dS K'_A, ...), and the transposed
rotation (dA = gA cos_A + gB sin_B, dB = gB cos_B - gA sin_A) is applied once per program before the
store. No extra GEMM work: the half dots add up to the full ones. It needs D/2 >= 16 (tl.dot), so
rotary at D = 16 is rotated with torch around the kernels (see the launchers).

Precision as in jagged attention (jagged_attention/triton.py): fp32 scores, softmax statistics and
accumulators; P and dS cast to the input dtype for their dots; fp32 inputs use 3xTF32 dots unless torch allows TF32.
Autotune keys: bucketed length and window (next power of two), never raw values, plus the static flags.
Under TRITON_INTERPRET=1 each kernel has one small config. No host syncs: grids depend only on shapes
and the static block/window; lengths are read on the device (clamped into [0, L]).
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
    MODE_OFFSETS,
    bwd_delta_kernel,
    dot_precision,
    dropout_args,
    dropout_dv_dp,
    dropout_factor,
    dropout_stream,
    fit_shared_memory,
    length_bucket,
    load_rows,
    mask_key_bounds,
    per_step_jit,
    store_rows,
)
from ..common.packed import packed_rows
from ..common.slack_rows_triton import fill_slack_rows
from ..common.tuned_launch import INTERPRET, autotune, launch
from .reference import apply_rotary, apply_rotary_transpose, rotary_tables, rotate

__all__ = [
    "block_attention_backward_triton",
    "block_attention_forward_triton",
    "closed_tile_serves",
    "kv_mask_range",
]

_LOG2E = 1.4426950408889634
ROTARY_CODES = {"none": 0, "half": 1, "interleaved": 2}
MIN_FUSED_ROTARY_HEAD_DIM = 32
"""Rotary is fused when each half of the head dim can feed tl.dot (D/2 >= 16)."""


# ---------------------------------------------------------------------------------------------------
# Configs. Closed kernels: one tile size BLOCK (rows = keys) and the warps. General kernels: (BLOCK_M,
# BLOCK_N, warps, stages) like jagged_attention/triton.py. Each entry lists the variants it serves:
# "small" (D <= 64) or "large" (D > 64), with "_rot" when rotary is fused. Configs that spill registers
# for a variant (ptxas for sm_90a, bf16 inputs and tables) are left out of it, so tuning stays a handful
# of compiles. fp32 inputs (3xTF32 dots) and fp32 rotary tables need more registers and spill in some of
# these configs: they are served for accuracy, not speed.

_S, _L, _SR, _LR = "small", "large", "small_rot", "large_rot"
_CLOSED_FWD_SHAPES = {(32, 2): (_S,), (64, 4): (_S, _SR, _L), (64, 8): (_L, _LR), (128, 8): (_S, _SR, _L),
                      (64, 8, 4): (_L, _LR), (64, 8, 4, 3): (_S, _SR, _L, _LR)}
_CLOSED_BWD_SHAPES = {(32, 4): (_S,), (64, 4): (_S, _SR, _L), (64, 8): (_S, _SR, _L, _LR),
                      (128, 8): (_S, _SR), (64, 8, 4): (_L, _SR), (64, 8, 4, 3): (_S, _L),
                      (64, 8, 2): (_SR, _LR), (64, 4, "split"): (_LR,), (64, 8, 2, "split"): (_LR,)}
# (BLOCK, warps, HEADS[, stages]): heads of a tile per program, two stages (the next head's loads in flight)
# unless a fourth entry says otherwise. In a sweep of pinned configs on the H200 (B1152 L1024 H4 D 128),
# three stages made the backward without rotary and the forward with it faster, and two heads a program
# the backward with rotary. That last one, (64, 8, 2) at D 128 with rotary, ran on the H200 under Triton
# 3.6; ptxas for sm_90a under Triton 3.9 (benchmarks/kernel_registers.py on the CPU) gives it more shared
# memory than a CTA has and a small spill: there it fails to launch and the autotuner skips it. The small
# variants are offered the same shapes unswept: their autotuner decides (the D 64 claims did not move).
# A trailing "split" sets R_SPLIT: the backward's R^T by reshapes and a split instead of tl.gather (no warp
# shuffles). At D 128 with rotary it made the backward a little faster on the H200 at 4 warps and at the
# two-head config (block_closed_configs-d128-20261204-202617.json), with bitwise the same gradients. The
# 4-warp one spills (556 bytes, ptxas under Triton 3.9 on the CPU) yet timed fastest under 3.6: it is listed
# for the autotuner to time, against this file's rule for spills.
_FWD_SHAPES = {(64, 64, 4, 3): (_S, _SR, _L), (128, 64, 8, 3): (_S, _SR, _L, _LR), (128, 128, 8, 3): (_S,),
               (64, 32, 4, 3): (_S, _SR, _L, _LR)}
_DKDV_SHAPES = {(32, 64, 4, 3): (_S, _SR, _L), (64, 64, 4, 3): (_S,), (64, 128, 8, 3): (_S,),
                (32, 128, 8, 3): (_S, _SR, _L), (32, 64, 8, 2): (_LR,), (32, 64, 8, 3): (_LR,)}
_DQ_SHAPES = {(64, 64, 4, 3): (_S, _SR, _L), (128, 64, 8, 3): (_S, _SR, _L), (64, 32, 4, 3): (_S, _SR, _L),
              (128, 32, 8, 3): (_S, _SR), (64, 32, 8, 2): (_LR,), (64, 64, 8, 2): (_LR,)}


def _closed_configs(shapes):
    """(BLOCK, warps[, HEADS[, stages]][, "split"]) -> a config; HEADS > 1 (heads of a tile per program, a
    loop the compiler pipelines) with two stages unless given; "split" sets R_SPLIT. The interpreter runs two
    heads per program, so the CPU tests cover the loop (and, with an odd H, a head past H)."""
    if INTERPRET:
        return [triton.Config({"BLOCK": 32, "HEADS": 2}, num_warps=4, num_stages=1)]
    configs = []
    for key in shapes:
        shape, split = (key[:-1], {"R_SPLIT": 1}) if key[-1] == "split" else (key, {})
        configs.append(triton.Config({"BLOCK": shape[0], "HEADS": (shape[2:] or (1,))[0], **split},
                                     num_warps=shape[1],
                                     num_stages=1 if len(shape) == 2 else (shape[3:] or (2,))[0]))
    return configs


def _general_configs(shapes, interpret_shape):
    if INTERPRET:
        m, n = interpret_shape
        return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=4, num_stages=1)]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in shapes]


_CLOSED_FWD_CONFIGS = _closed_configs(_CLOSED_FWD_SHAPES)
_CLOSED_BWD_CONFIGS = _closed_configs(_CLOSED_BWD_SHAPES)
_FWD_CONFIGS = _general_configs(_FWD_SHAPES, (32, 16))
_DKDV_CONFIGS = _general_configs(_DKDV_SHAPES, (16, 32))
_DQ_CONFIGS = _general_configs(_DQ_SHAPES, (32, 16))
_AUTOTUNE_KEY = ["L_BUCKET", "WINDOW_BUCKET", "HEAD_D", "ATTN_BLOCK", "HAS_WINDOW", "CAUSAL", "ROTARY",
                 "DOT_PRECISION", "HAS_KV_MASK", "HAS_Q_LENGTHS", "PACKED"]
_GENERAL_KEY = _AUTOTUNE_KEY + ["DROPOUT"]


def _variant(head_dim: int, rotary: int) -> str:
    """The config class of a kernel variant (see the shape tables)."""
    return ("small" if head_dim <= 64 else "large") + ("_rot" if rotary else "")


def _head_class(args) -> str:
    return _variant(args.get("HEAD_D", 64), args.get("ROTARY", 0))


def _closed_shape(config) -> tuple:
    """A closed config's key in the shape tables: (BLOCK, warps), with HEADS when it is above 1 and the
    stages when they are not 2, and "split" last when R_SPLIT is set."""
    heads = config.kwargs.get("HEADS", 1)
    stages = (config.num_stages,) if heads > 1 and config.num_stages != 2 else ()
    split = ("split",) if config.kwargs.get("R_SPLIT") else ()
    return (config.kwargs["BLOCK"], config.num_warps) + ((heads,) + stages if heads > 1 else ()) + split


def _closed_prune(shapes):
    def prune(configs, named_args, **kwargs):
        """Tiles that hold whole blocks, meant for this head dim, not far larger than the length."""
        args = {**named_args, **kwargs}
        block, head = args["ATTN_BLOCK"], _head_class(args)
        fits = [c for c in configs if c.kwargs["BLOCK"] % block == 0]
        kept = [c for c in fits
                if head in shapes.get(_closed_shape(c), (head,))
                and c.kwargs["BLOCK"] <= max(args.get("L_BUCKET", 1 << 30), 64)]
        return kept or fits

    return {"early_config_prune": prune}


def _general_prune(shapes, kind):
    def prune(configs, named_args, **kwargs):
        args = {**named_args, **kwargs}
        head, lb = _head_class(args), args.get("L_BUCKET", 1 << 30)
        kept = []
        for c in configs:
            key = (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages)
            if head not in shapes.get(key, (head,)):
                continue
            if max(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) > max(lb, 64):
                continue
            kept.append(fit_shared_memory(c, kind, args))
        return kept or [fit_shared_memory(configs[0], kind, args)]

    return {"early_config_prune": prune}


# ---------------------------------------------------------------------------------------------------
# Device helpers


@triton.jit
def _coordinates(H, num_tiles):
    """1-D program id -> (tile, batch, head), heads fastest: the heads of one tile run side by side and
    share the rotary tables' rows in L2 (and, for (B, L, H, D) views, neighbouring memory)."""
    pid = tl.program_id(0)
    h = pid % H
    rest = pid // H
    return rest % num_tiles, rest // num_tiles, h


@triton.jit
def _row0(Offsets, b, PACKED: tl.constexpr):
    """Packed layout: sequence b's first row, token_offsets[b] (int64); 0 in the padded layout (unused)."""
    if PACKED:
        row0 = tl.load(Offsets + b).to(tl.int64)
    else:
        row0 = b.to(tl.int64) * 0
    return row0


@triton.jit
def _seq_off(b64, row0, stride_b, stride_r, PACKED: tl.constexpr):
    """Offset of sequence b's row 0 in a row-indexed tensor: b * stride_b padded, row0 * stride_r packed
    (where the launcher passes batch stride 0)."""
    if PACKED:
        off = row0 * stride_r
    else:
        off = b64 * stride_b
    return off


@triton.jit
def _row_end(L, n, PACKED: tl.constexpr):
    """Rows below this exist: L padded; the length n packed (the rows after it are the next sequence's)."""
    if PACKED:
        end = n
    else:
        end = L
    return end


@triton.jit
def _kv_length(Lengths, b, L):
    return tl.minimum(tl.maximum(tl.load(Lengths + b).to(tl.int32), 0), L)


@triton.jit
def _q_rows(QLengths, b, L, HAS_Q_LENGTHS: tl.constexpr):
    """The query rows of sample b that are computed: [0, q_lengths[b]) clamped into [0, L]; all L without."""
    if HAS_Q_LENGTHS:
        q_hi = tl.minimum(tl.maximum(tl.load(QLengths + b).to(tl.int32), 0), L)
    else:
        q_hi = L
    return q_hi


@triton.jit
def _kv_bounds(Lengths, KvRange, b, L, HAS_KV_MASK: tl.constexpr):
    """(kv_lo, kv_hi): sample b's keys lie in [kv_lo, kv_hi). Without kv_mask [0, clamped length); with it
    the launcher's (first valid key, last valid key + 1), already limited by the length (KvRange: the (B, 3)
    int32 key bounds [lo, hi, holes] of common/length_order.py)."""
    if HAS_KV_MASK:
        kv_lo = tl.load(KvRange + KV_BOUNDS_WIDTH * b)
        kv_hi = tl.load(KvRange + KV_BOUNDS_WIDTH * b + 1)
    else:
        kv_hi = _kv_length(Lengths, b, L)
        kv_lo = kv_hi * 0
    return kv_lo, kv_hi


@triton.jit
def _key_ok(KvMask, b64, cols, kv_hi, stride_mb, stride_mn, HAS_KV_MASK: tl.constexpr):
    """Keys of ``cols`` that take part: cols < kv_hi, AND kv_mask[b, cols] when given."""
    ok = cols < kv_hi
    if HAS_KV_MASK:
        m = tl.load(KvMask + b64 * stride_mb + cols.to(tl.int64) * stride_mn, mask=ok, other=0)
        ok = ok & (m != 0)
    return ok


@triton.jit
def _no_keys(c0, c1, kv_lo, kv_hi, HAS_KV_MASK: tl.constexpr):
    """Whether keys c0..c1 - 1 lie wholly outside [kv_lo, kv_hi)."""
    out = c0 >= kv_hi
    if HAS_KV_MASK:
        out = out | (c1 <= kv_lo)
    return out


@triton.jit
def _key_range(r0, r1, kv_lo, kv_hi, window, ATTN_BLOCK: tl.constexpr, HAS_WINDOW: tl.constexpr,
               CAUSAL: tl.constexpr, HAS_KV_MASK: tl.constexpr):
    """Keys [lo, hi) that query rows r0..r1 (inclusive) may see; lo >= hi: none."""
    lo = r0 * 0
    hi = kv_hi
    if ATTN_BLOCK > 0:
        lo = (r0 // ATTN_BLOCK) * ATTN_BLOCK
        hi = tl.minimum(hi, (r1 // ATTN_BLOCK + 1) * ATTN_BLOCK)
    if HAS_WINDOW:
        lo = tl.maximum(lo, r0 - window)
        hi = tl.minimum(hi, r1 + window + 1)
    if CAUSAL:
        hi = tl.minimum(hi, r1 + 1)
    if HAS_KV_MASK:  # no key tile before the first valid key is visited
        lo = tl.maximum(lo, kv_lo)
    return lo, hi


@triton.jit
def _query_range(c0, c1, L, window, ATTN_BLOCK: tl.constexpr, HAS_WINDOW: tl.constexpr,
                 CAUSAL: tl.constexpr):
    """Query rows [lo, hi) that may see keys c0..c1 (inclusive)."""
    lo = c0 * 0
    hi = c0 * 0 + L
    if ATTN_BLOCK > 0:
        lo = (c0 // ATTN_BLOCK) * ATTN_BLOCK
        hi = tl.minimum(hi, (c1 // ATTN_BLOCK + 1) * ATTN_BLOCK)
    if HAS_WINDOW:
        lo = tl.maximum(lo, c0 - window)
        hi = tl.minimum(hi, c1 + window + 1)
    if CAUSAL:
        lo = tl.maximum(lo, c0)
    return lo, hi


@triton.jit
def _allowed(i, j, kv_len, window, ATTN_BLOCK: tl.constexpr, HAS_WINDOW: tl.constexpr,
             CAUSAL: tl.constexpr):
    """Mask of allowed (row i, key j) pairs; i and j are broadcastable 2-D index arrays."""
    ok = (j < kv_len) & (i >= 0)
    if ATTN_BLOCK > 0:
        ok = ok & ((i // ATTN_BLOCK) == (j // ATTN_BLOCK))
    if HAS_WINDOW:
        ok = ok & (i - j <= window) & (j - i <= window)
    if CAUSAL:
        ok = ok & (j <= i)
    return ok


@triton.jit
def _closed_allowed(rows, kv_len, window, ATTN_BLOCK: tl.constexpr, BLOCK: tl.constexpr,
                    HAS_WINDOW: tl.constexpr, CAUSAL: tl.constexpr):
    """_allowed for a closed tile (keys = the tile's rows); a tile that is one block needs no block test."""
    if ATTN_BLOCK < BLOCK:
        ok = _allowed(rows[:, None], rows[None, :], kv_len, window, ATTN_BLOCK, HAS_WINDOW, CAUSAL)
    else:
        ok = _allowed(rows[:, None], rows[None, :], kv_len, window, 0, HAS_WINDOW, CAUSAL)
    return ok


@triton.jit
def _load_halves(base, rows, mask_rows, stride_r, stride_d, HEAD_D: tl.constexpr, ROTARY: tl.constexpr):
    """The halves (A, B) of a [rows, HEAD_D] tile that the rotation mixes: one contiguous (vectorized)
    load split in registers. (Two half-width loads, or stride-2 loads for "interleaved", needed more
    registers in ptxas for sm_90a.)"""
    x = load_rows(base, rows, tl.arange(0, HEAD_D), stride_r, stride_d, mask_rows, HEAD_D, HEAD_D, True)
    if ROTARY == 1:  # [A_0 .. A_{D/2-1} | B_0 .. B_{D/2-1}]
        xa, xb = tl.split(tl.permute(tl.reshape(x, (x.shape[0], 2, HEAD_D // 2)), (0, 2, 1)))
    else:  # [A_0, B_0, A_1, B_1, ...]
        xa, xb = tl.split(tl.reshape(x, (x.shape[0], HEAD_D // 2, 2)))
    return xa, xb


@triton.jit
def _store_halves(base, rows, mask_rows, stride_r, stride_d, ga, gb, HEAD_D: tl.constexpr,
                  ROTARY: tl.constexpr):
    if ROTARY == 1:
        offs = tl.arange(0, HEAD_D // 2)
        store_rows(base, rows, offs, stride_r, stride_d, ga, mask_rows, HEAD_D)
        store_rows(base, rows, offs + HEAD_D // 2, stride_r, stride_d, gb, mask_rows, HEAD_D)
    else:
        g = tl.reshape(tl.join(ga, gb), (ga.shape[0], HEAD_D))
        store_rows(base, rows, tl.arange(0, HEAD_D), stride_r, stride_d, g, mask_rows, HEAD_D)


@triton.jit
def _load_tile(base, rows, mask_rows, stride_r, stride_d, HEAD_D: tl.constexpr, ROTARY: tl.constexpr):
    """A q or k tile as (A, B) halves for rotary; (x, x) full width without."""
    if ROTARY == 0:
        x = load_rows(base, rows, tl.arange(0, HEAD_D), stride_r, stride_d, mask_rows, HEAD_D, HEAD_D, True)
        xa = x
        xb = x
    else:
        xa, xb = _load_halves(base, rows, mask_rows, stride_r, stride_d, HEAD_D, ROTARY)
    return xa, xb


@triton.jit
def _load_tables(cos_base, sin_base, rows, mask_rows, stride_cm, stride_cd, HEAD_D: tl.constexpr,
                 ROTARY: tl.constexpr):
    """(cos_A, cos_B, sin_A, sin_B) of the rows, fp32."""
    ca, cb = _load_halves(cos_base, rows, mask_rows, stride_cm, stride_cd, HEAD_D, ROTARY)
    sa, sb = _load_halves(sin_base, rows, mask_rows, stride_cm, stride_cd, HEAD_D, ROTARY)
    return ca.to(tl.float32), cb.to(tl.float32), sa.to(tl.float32), sb.to(tl.float32)


@triton.jit
def _rotate(xa, xb, ca, cb, sa, sb):
    af = xa.to(tl.float32)
    bf = xb.to(tl.float32)
    return (af * ca - bf * sa).to(xa.dtype), (bf * cb + af * sb).to(xb.dtype)


@triton.jit
def _partner_columns(HEAD_D: tl.constexpr, ROTARY: tl.constexpr):
    """(columns, each column's rotation partner, whether it is in half A): "half" pairs j with j + D/2,
    "interleaved" pairs 2i with 2i + 1."""
    d = tl.arange(0, HEAD_D)
    if ROTARY == 1:
        partner = (d + HEAD_D // 2) % HEAD_D
        in_a = d < HEAD_D // 2
    else:
        partner = d ^ 1
        in_a = (d % 2) == 0
    return d, partner, in_a


@triton.jit
def _signed_tables(cos_base, sin_base, rows, mask_rows, stride_cm, stride_cd, HEAD_D: tl.constexpr,
                   ROTARY: tl.constexpr):
    """(cos, sin with half A's columns negated), fp32, full width: rot(x)[j] = x[j] cos[j] + x[p(j)] sin'[j]
    for p(j) the partner column (A' = A cos_A - B sin_A, B' = B cos_B + A sin_B)."""
    d, _, in_a = _partner_columns(HEAD_D, ROTARY)
    c = load_rows(cos_base, rows, d, stride_cm, stride_cd, mask_rows, HEAD_D, HEAD_D, True).to(tl.float32)
    s = load_rows(sin_base, rows, d, stride_cm, stride_cd, mask_rows, HEAD_D, HEAD_D, True).to(tl.float32)
    return c, tl.where(in_a[None, :], -s, s)


@triton.jit
def _load_rotated(base, rows, mask_rows, stride_r, stride_d, c, s_signed, HEAD_D: tl.constexpr,
                  ROTARY: tl.constexpr):
    """A q or k tile rotated full width, rounded to its dtype: the tile and its partner columns are two
    loads of the same lines (the second hits L1), so no register shuffle splits the tile into halves (at D 128
    on sm_90a the forward with the split used 255 registers with spills and 35 barriers, full width 136 and
    5: benchmarks/results/kernel_registers-block-closed-d128-*.json)."""
    d, partner, _ = _partner_columns(HEAD_D, ROTARY)
    x = load_rows(base, rows, d, stride_r, stride_d, mask_rows, HEAD_D, HEAD_D, True)
    xp = load_rows(base, rows, partner, stride_r, stride_d, mask_rows, HEAD_D, HEAD_D, True)
    return (x.to(tl.float32) * c + xp.to(tl.float32) * s_signed).to(x.dtype)


@triton.jit
def _load_qk(q_base, k_base, rows, q_ok, k_ok, stride_qm, stride_qd, stride_kn, stride_kd, c, s_signed,
             HEAD_D: tl.constexpr, ROTARY: tl.constexpr):
    """A closed tile's q and k (the same rows), rotated full width with the tables (c, s_signed) when
    ROTARY (unused without)."""
    if ROTARY != 0:
        q = _load_rotated(q_base, rows, q_ok, stride_qm, stride_qd, c, s_signed, HEAD_D, ROTARY)
        k = _load_rotated(k_base, rows, k_ok, stride_kn, stride_kd, c, s_signed, HEAD_D, ROTARY)
    else:
        offs_d = tl.arange(0, HEAD_D)
        q = load_rows(q_base, rows, offs_d, stride_qm, stride_qd, q_ok, HEAD_D, HEAD_D, True)
        k = load_rows(k_base, rows, offs_d, stride_kn, stride_kd, k_ok, HEAD_D, HEAD_D, True)
    return q, k


@triton.jit
def _swap_partners(t, HEAD_D: tl.constexpr, ROTARY: tl.constexpr):
    """t[:, p(j)] for every column j (the rotation partner) by reshapes and a split: no cross-thread gather
    where one warpgroup holds a row's columns (4 warps at a 64-row tile), a layout change through shared
    memory where two do. The closed backward's R_SPLIT configs ("split" in the shape tables)."""
    if ROTARY == 1:  # swap the halves [A | B] -> [B | A]
        lo, hi = tl.split(tl.permute(tl.reshape(t, (t.shape[0], 2, HEAD_D // 2)), (0, 2, 1)))
        return tl.reshape(tl.permute(tl.join(hi, lo), (0, 2, 1)), (t.shape[0], HEAD_D))
    else:  # swap neighbours (2i, 2i + 1)
        even, odd = tl.split(tl.reshape(t, (t.shape[0], HEAD_D // 2, 2)))
        return tl.reshape(tl.join(odd, even), (t.shape[0], HEAD_D))


@triton.jit
def _unrotate_pair(ga, gb, cos_base, sin_base, rows, mask_rows, stride_cm, stride_cd, HEAD_D: tl.constexpr,
                   ROTARY: tl.constexpr, R_SPLIT: tl.constexpr = 0):
    """The gradients w.r.t. the un-rotated rows from ga and gb, two gradients w.r.t. the same rotated rows
    (dQ and dK of a closed tile), full width, the tables loaded once: R^T g = g cos + (g sin')[:, p(j)]
    (dA = gA cos_A + gB sin_B, dB = gB cos_B - gA sin_A). The partner columns come from one tl.gather along
    the head dim, not a split of g into halves (at D 128 on sm_90a the backward with the split used 255
    registers with spills, this form 189 at 8 warps without, when it loaded the tables for each gradient),
    or with R_SPLIT from _swap_partners (no warp shuffles)."""
    _, partner, _ = _partner_columns(HEAD_D, ROTARY)
    c, s_signed = _signed_tables(cos_base, sin_base, rows, mask_rows, stride_cm, stride_cd, HEAD_D, ROTARY)
    ta = ga * s_signed
    tb = gb * s_signed
    if R_SPLIT:
        return ga * c + _swap_partners(ta, HEAD_D, ROTARY), gb * c + _swap_partners(tb, HEAD_D, ROTARY)
    index = tl.broadcast_to(partner[None, :], ta.shape)
    return ga * c + tl.gather(ta, index, 1), gb * c + tl.gather(tb, index, 1)


@triton.jit
def _rotate_transpose(ga, gb, ca, cb, sa, sb):
    """Gradient w.r.t. the un-rotated halves from the gradient w.r.t. the rotated ones."""
    return ga * ca + gb * sb, gb * cb - ga * sa


@triton.jit
def _dot_rows(xa, xb, ya, yb, ROTARY: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """x @ y^T over the head dim (sum of the two half dots with rotary)."""
    s = tl.dot(xa, tl.trans(ya), input_precision=DOT_PRECISION)
    if ROTARY != 0:
        s += tl.dot(xb, tl.trans(yb), input_precision=DOT_PRECISION)
    return s


@triton.jit
def _store_tile(base, rows, mask_rows, stride_r, stride_d, ga, gb, HEAD_D: tl.constexpr,
                ROTARY: tl.constexpr):
    if ROTARY == 0:
        store_rows(base, rows, tl.arange(0, HEAD_D), stride_r, stride_d, ga, mask_rows, HEAD_D)
    else:
        _store_halves(base, rows, mask_rows, stride_r, stride_d, ga, gb, HEAD_D, ROTARY)


@triton.jit
def _store_zero_rows(base, rows, mask_rows, stride_r, stride_d, BLOCK_R: tl.constexpr, HEAD_D: tl.constexpr):
    store_rows(base, rows, tl.arange(0, HEAD_D), stride_r, stride_d, tl.zeros([BLOCK_R, HEAD_D], tl.float32),
               mask_rows, HEAD_D)


@triton.jit
def _finish_softmax(acc, l_i, m_i):
    """(out, lse) of the accumulated rows; a row with no allowed key gets out 0 and lse +inf."""
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("inf"), (m_i + tl.log2(l_safe)) * LN2)
    return out, lse


# ---------------------------------------------------------------------------------------------------
# Closed kernels: block | BLOCK, one tile of BLOCK rows holds whole blocks and all their keys


@triton.jit
def _tile_of_loop(m0, b64, kv_lo, kv_hi, q_hi, KvMask, stride_mb, stride_mn, L, window,
                  ATTN_BLOCK: tl.constexpr, HAS_WINDOW: tl.constexpr, CAUSAL: tl.constexpr,
                  HAS_KV_MASK: tl.constexpr, PACKED: tl.constexpr, BLOCK: tl.constexpr):
    """The rows and masks of the closed tile at row m0 inside a TILES loop (no branch there): rows, row_ok
    (rows that exist), read_ok, col_ok and q_ok (rows whose q, k / v, dO are read; all False for a tile with
    no key or no computed row, so it reads nothing) and ok (pairs kept)."""
    rows = m0 + tl.arange(0, BLOCK)
    row_ok = rows < _row_end(L, q_hi, PACKED)
    live = (m0 < q_hi) & (_no_keys(m0, m0 + BLOCK, kv_lo, kv_hi, HAS_KV_MASK) == 0)
    read_ok = tl.where(live, row_ok, False)
    key_ok = _key_ok(KvMask, b64, rows, kv_hi, stride_mb, stride_mn, HAS_KV_MASK)
    col_ok = tl.where(live, key_ok, False)
    q_ok = tl.where(live, rows < q_hi, False)
    ok = _closed_allowed(rows, kv_hi, window, ATTN_BLOCK, BLOCK, HAS_WINDOW, CAUSAL)
    ok = ok & col_ok[None, :] & q_ok[:, None]
    return rows, row_ok, read_ok, col_ok, q_ok, ok


@triton.jit
def _closed_fwd_head(q_seq, k_seq, v_seq, o_seq, l_rows, h, H, rows, row_ok, col_ok, out_ok, ok, c, s_signed,
                     stride_qh, stride_qm, stride_qd, stride_kh, stride_kn, stride_kd, stride_vh, stride_vn,
                     stride_vd, stride_oh, stride_om, stride_od, stride_lh, qk_scale, HEAD_D: tl.constexpr,
                     ROTARY: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """out and the log-sum-exp of head h of a closed tile (rows = keys); q read at row_ok, k and v at col_ok,
    scores kept where ok; stored at rows out_ok when h < H. (Addresses formed where they are used, as in the
    loop body this came from: the same live ranges.)"""
    offs_d = tl.arange(0, HEAD_D)
    h64 = tl.minimum(h, H - 1).to(tl.int64)  # a head past H (H not a multiple of HEADS): read, not stored
    q, k = _load_qk(q_seq + h64 * stride_qh, k_seq + h64 * stride_kh, rows, row_ok, col_ok, stride_qm,
                    stride_qd, stride_kn, stride_kd, c, s_signed, HEAD_D, ROTARY)
    v = load_rows(v_seq + h64 * stride_vh, rows, offs_d, stride_vn, stride_vd, col_ok, HEAD_D, HEAD_D, True)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    s = tl.where(ok, s, float("-inf"))
    m = tl.max(s, 1)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    p = tl.exp2(s - m_use[:, None])
    acc = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    out, lse = _finish_softmax(acc, tl.sum(p, 1), m_use)
    store_ok = tl.where(h < H, out_ok, False)  # (not &: the interpreter mistypes it)
    store_rows(o_seq + h64 * stride_oh, rows, offs_d, stride_om, stride_od, out, store_ok, HEAD_D)
    tl.store(l_rows + h64 * stride_lh, lse, mask=store_ok)


@triton.jit
def _closed_fwd_tiles(Q, K, V, Cos, Sin, Out, Lse, KvMask, tile, b64, row0, group, kv_lo, kv_hi, q_hi,
                      stride_qb, stride_qh, stride_qm, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
                      stride_vb, stride_vh, stride_vn, stride_vd, stride_cb, stride_cm, stride_cd,
                      stride_ob, stride_oh, stride_om, stride_od, stride_lb, stride_lh, stride_lm,
                      stride_mb, stride_mn, H, L, window, qk_scale,
                      HEAD_D: tl.constexpr, ATTN_BLOCK: tl.constexpr, HAS_WINDOW: tl.constexpr,
                      CAUSAL: tl.constexpr, ROTARY: tl.constexpr, DOT_PRECISION: tl.constexpr,
                      HAS_KV_MASK: tl.constexpr, PACKED: tl.constexpr, BLOCK: tl.constexpr,
                      HEADS: tl.constexpr, TILES: tl.constexpr):
    """The closed forward's TILES tiles x HEADS heads of one program in one loop, so the compiler pipelines
    the next pair's loads across tiles too. No branch in it: a tile with no key or no computed row reads
    nothing (every load masked off) and stores what no key gives, out 0 and lse +inf."""
    q_seq = Q + _seq_off(b64, row0, stride_qb, stride_qm, PACKED)
    k_seq = K + _seq_off(b64, row0, stride_kb, stride_kn, PACKED)
    v_seq = V + _seq_off(b64, row0, stride_vb, stride_vn, PACKED)
    o_seq = Out + _seq_off(b64, row0, stride_ob, stride_om, PACKED)
    l_seq = Lse + _seq_off(b64, row0, stride_lb, stride_lm, PACKED)
    for it in tl.range(0, TILES * HEADS):
        m0 = (tile * TILES + it // HEADS) * BLOCK
        rows, row_ok, read_ok, col_ok, q_ok, ok = _tile_of_loop(
            m0, b64, kv_lo, kv_hi, q_hi, KvMask, stride_mb, stride_mn, L, window, ATTN_BLOCK, HAS_WINDOW,
            CAUSAL, HAS_KV_MASK, PACKED, BLOCK)
        c, s_signed = 0.0, 0.0
        if ROTARY != 0:
            c, s_signed = _signed_tables(Cos + b64 * stride_cb, Sin + b64 * stride_cb, rows, read_ok,
                                         stride_cm, stride_cd, HEAD_D, ROTARY)
        h = group * HEADS + it % HEADS
        _closed_fwd_head(q_seq, k_seq, v_seq, o_seq, l_seq + rows * stride_lm, h, H, rows, read_ok, col_ok,
                         row_ok, ok, c, s_signed, stride_qh, stride_qm, stride_qd, stride_kh, stride_kn,
                         stride_kd, stride_vh, stride_vn, stride_vd, stride_oh, stride_om, stride_od,
                         stride_lh, qk_scale, HEAD_D, ROTARY, DOT_PRECISION)


@autotune(configs=_CLOSED_FWD_CONFIGS, key=_AUTOTUNE_KEY,
          prune_configs_by=_closed_prune(_CLOSED_FWD_SHAPES))
@per_step_jit
def _closed_fwd_kernel(
    Q, K, V, Cos, Sin, Out, Lse, Lengths, KvMask, KvRange, QLengths, Offsets,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_cb, stride_cm, stride_cd,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_lb, stride_lh, stride_lm,
    stride_mb, stride_mn,
    H, L, window, qk_scale,
    L_BUCKET, WINDOW_BUCKET,
    HEAD_D: tl.constexpr, ATTN_BLOCK: tl.constexpr, HAS_WINDOW: tl.constexpr, CAUSAL: tl.constexpr,
    ROTARY: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_KV_MASK: tl.constexpr, HAS_Q_LENGTHS: tl.constexpr,
    PACKED: tl.constexpr,
    BLOCK: tl.constexpr, HEADS: tl.constexpr = 1, TILES: tl.constexpr = 1,
):
    # HEADS heads of one tile per program: the rows' bounds, masks and rotary tables are loaded once, and
    # the loop over heads lets the next head's loads overlap this head's dots (num_stages > 1). TILES > 1:
    # TILES consecutive tiles too, in one loop (_closed_fwd_tiles)
    tile, b, group = _coordinates(tl.cdiv(H, HEADS), tl.cdiv(L, BLOCK * TILES))
    kv_lo, kv_hi = _kv_bounds(Lengths, KvRange, b, L, HAS_KV_MASK)
    q_hi = _q_rows(QLengths, b, L, HAS_Q_LENGTHS)
    b64 = b.to(tl.int64)
    row0 = _row0(Offsets, b, PACKED)
    if TILES > 1:
        _closed_fwd_tiles(Q, K, V, Cos, Sin, Out, Lse, KvMask, tile, b64, row0, group, kv_lo, kv_hi, q_hi,
                          stride_qb, stride_qh, stride_qm, stride_qd, stride_kb, stride_kh, stride_kn,
                          stride_kd, stride_vb, stride_vh, stride_vn, stride_vd, stride_cb, stride_cm,
                          stride_cd, stride_ob, stride_oh, stride_om, stride_od, stride_lb, stride_lh,
                          stride_lm, stride_mb, stride_mn, H, L, window, qk_scale, HEAD_D, ATTN_BLOCK,
                          HAS_WINDOW, CAUSAL, ROTARY, DOT_PRECISION, HAS_KV_MASK, PACKED, BLOCK, HEADS, TILES)
        return
    m0 = tile * BLOCK
    rows = m0 + tl.arange(0, BLOCK)
    row_ok = rows < _row_end(L, q_hi, PACKED)
    o_seq = Out + _seq_off(b64, row0, stride_ob, stride_om, PACKED)
    l_seq = Lse + _seq_off(b64, row0, stride_lb, stride_lm, PACKED) + rows * stride_lm
    # the tile's blocks hold no valid key, or no computed query row
    if _no_keys(m0, m0 + BLOCK, kv_lo, kv_hi, HAS_KV_MASK) | (m0 >= q_hi):
        for i in tl.static_range(HEADS):
            h = group * HEADS + i
            store_ok = tl.where(h < H, row_ok, False)  # (not &: the interpreter mistypes it)
            h64 = tl.minimum(h, H - 1).to(tl.int64)
            _store_zero_rows(o_seq + h64 * stride_oh, rows, store_ok, stride_om, stride_od, BLOCK, HEAD_D)
            tl.store(l_seq + h64 * stride_lh, tl.full([BLOCK], float("inf"), tl.float32), mask=store_ok)
        return
    col_ok = _key_ok(KvMask, b64, rows, kv_hi, stride_mb, stride_mn, HAS_KV_MASK)
    q_seq = Q + _seq_off(b64, row0, stride_qb, stride_qm, PACKED)
    k_seq = K + _seq_off(b64, row0, stride_kb, stride_kn, PACKED)
    v_seq = V + _seq_off(b64, row0, stride_vb, stride_vn, PACKED)
    ok = _closed_allowed(rows, kv_hi, window, ATTN_BLOCK, BLOCK, HAS_WINDOW, CAUSAL)
    if HAS_KV_MASK:
        ok = ok & col_ok[None, :]
    if HAS_Q_LENGTHS:  # rows not computed see no key: out 0, lse +inf
        ok = ok & (rows < q_hi)[:, None]
    c, s_signed = 0.0, 0.0
    if ROTARY != 0:  # q and k of the same rows: one load of the table rows for all heads
        c, s_signed = _signed_tables(Cos + b64 * stride_cb, Sin + b64 * stride_cb, rows, row_ok, stride_cm,
                                     stride_cd, HEAD_D, ROTARY)
    for i in tl.range(0, HEADS):
        _closed_fwd_head(q_seq, k_seq, v_seq, o_seq, l_seq, group * HEADS + i, H, rows, row_ok, col_ok,
                         row_ok, ok, c, s_signed, stride_qh, stride_qm, stride_qd, stride_kh, stride_kn,
                         stride_kd, stride_vh, stride_vn, stride_vd, stride_oh, stride_om, stride_od,
                         stride_lh, qk_scale, HEAD_D, ROTARY, DOT_PRECISION)


@triton.jit
def _closed_bwd_head(q_seq, k_seq, v_seq, do_seq, l_rows, DQ, DK, DV, x_off, h64, cos_base, sin_base,
                     rows, row_ok, col_ok, q_ok, store_ok, ok,
                     stride_qh, stride_qm, stride_qd, stride_kh, stride_kn, stride_kd, stride_vh, stride_vn,
                     stride_vd, stride_cm, stride_cd, stride_gh, stride_gm, stride_gd, stride_lh, stride_xm,
                     stride_xd, qk_scale, scale,
                     HEAD_D: tl.constexpr, ROTARY: tl.constexpr, DOT_PRECISION: tl.constexpr,
                     R_SPLIT: tl.constexpr):
    """dQ, dK, dV of head h64 of a closed tile (rows = keys), stored at rows store_ok. q is read at row_ok,
    k and v at col_ok, dO and the log-sum-exp at q_ok; P is kept where ok. (Each address is formed where it
    is used, as the loop body did before this helper: the same live ranges, the same registers.)"""
    offs_d = tl.arange(0, HEAD_D)
    c, s_signed = 0.0, 0.0
    if ROTARY != 0:  # full-width rotations (_load_rotated); R^T reloads them once (cache hits)
        c, s_signed = _signed_tables(cos_base, sin_base, rows, row_ok, stride_cm, stride_cd, HEAD_D, ROTARY)
    q, k = _load_qk(q_seq + h64 * stride_qh, k_seq + h64 * stride_kh, rows, row_ok, col_ok, stride_qm,
                    stride_qd, stride_kn, stride_kd, c, s_signed, HEAD_D, ROTARY)
    do = load_rows(do_seq + h64 * stride_gh, rows, offs_d, stride_gm, stride_gd, q_ok, HEAD_D, HEAD_D, True)
    lse = tl.load(l_rows + h64 * stride_lh, mask=q_ok, other=float("inf"))
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    p = tl.where(ok, tl.exp2(s - lse[:, None] * LOG2E), 0.0)
    dv = tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=DOT_PRECISION)
    store_rows(DV + x_off, rows, offs_d, stride_xm, stride_xd, dv, store_ok, HEAD_D)  # early: frees registers
    v = load_rows(v_seq + h64 * stride_vh, rows, offs_d, stride_vn, stride_vd, col_ok, HEAD_D, HEAD_D, True)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
    # every key of these rows is in the tile: delta = rowsum(P * dP) = rowsum(O * dO), without reading O
    delta = tl.sum(p * dp, 1)
    ds = (p * (dp - delta[:, None])).to(q.dtype)
    dq = tl.dot(ds, k, input_precision=DOT_PRECISION) * scale
    if ROTARY != 0:
        # dQ and dK have the same rows (a closed tile's queries are its keys): R^T for both from one load of
        # the tables
        dk = tl.dot(tl.trans(ds), q, input_precision=DOT_PRECISION) * scale
        dq, dk = _unrotate_pair(dq, dk, cos_base, sin_base, rows, row_ok, stride_cm, stride_cd, HEAD_D,
                                ROTARY, R_SPLIT)
        store_rows(DQ + x_off, rows, offs_d, stride_xm, stride_xd, dq, store_ok, HEAD_D)
    else:  # dQ is stored before dK is computed: fewer live registers
        store_rows(DQ + x_off, rows, offs_d, stride_xm, stride_xd, dq, store_ok, HEAD_D)
        dk = tl.dot(tl.trans(ds), q, input_precision=DOT_PRECISION) * scale
    store_rows(DK + x_off, rows, offs_d, stride_xm, stride_xd, dk, store_ok, HEAD_D)


@autotune(configs=_CLOSED_BWD_CONFIGS, key=_AUTOTUNE_KEY,
          prune_configs_by=_closed_prune(_CLOSED_BWD_SHAPES))
@per_step_jit
def _closed_bwd_kernel(
    Q, K, V, Cos, Sin, DO, Lse, DQ, DK, DV, Lengths, KvMask, KvRange, QLengths, Offsets,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_cb, stride_cm, stride_cd,
    stride_gb, stride_gh, stride_gm, stride_gd,
    stride_lb, stride_lh, stride_lm,
    stride_xb, stride_xh, stride_xm, stride_xd,
    stride_mb, stride_mn,
    H, L, window, qk_scale, scale,
    L_BUCKET, WINDOW_BUCKET,
    HEAD_D: tl.constexpr, ATTN_BLOCK: tl.constexpr, HAS_WINDOW: tl.constexpr, CAUSAL: tl.constexpr,
    ROTARY: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_KV_MASK: tl.constexpr, HAS_Q_LENGTHS: tl.constexpr,
    PACKED: tl.constexpr,
    BLOCK: tl.constexpr, HEADS: tl.constexpr = 1, R_SPLIT: tl.constexpr = 0, TILES: tl.constexpr = 1,
):
    # dQ, dK and dV are allocated contiguous (B, H, L, D): one set of strides (stride_x*). HEADS heads of
    # TILES consecutive tiles per program.
    tile, b, group = _coordinates(tl.cdiv(H, HEADS), tl.cdiv(L, BLOCK * TILES))
    kv_lo, kv_hi = _kv_bounds(Lengths, KvRange, b, L, HAS_KV_MASK)
    q_hi = _q_rows(QLengths, b, L, HAS_Q_LENGTHS)
    b64 = b.to(tl.int64)
    row0 = _row0(Offsets, b, PACKED)
    x_seq = _seq_off(b64, row0, stride_xb, stride_xm, PACKED)
    q_seq = Q + _seq_off(b64, row0, stride_qb, stride_qm, PACKED)
    k_seq = K + _seq_off(b64, row0, stride_kb, stride_kn, PACKED)
    v_seq = V + _seq_off(b64, row0, stride_vb, stride_vn, PACKED)
    do_seq = DO + _seq_off(b64, row0, stride_gb, stride_gm, PACKED)
    l_seq = Lse + _seq_off(b64, row0, stride_lb, stride_lm, PACKED)
    cos_base, sin_base = Cos + b64 * stride_cb, Sin + b64 * stride_cb
    if TILES == 1:
        m0 = tile * BLOCK
        rows = m0 + tl.arange(0, BLOCK)
        row_ok = rows < _row_end(L, q_hi, PACKED)
        # no valid key, or no computed query row (whose keys are the tile's own: no dK, dV either)
        if _no_keys(m0, m0 + BLOCK, kv_lo, kv_hi, HAS_KV_MASK) | (m0 >= q_hi):
            for i in tl.static_range(HEADS):
                h = group * HEADS + i
                store_ok = tl.where(h < H, row_ok, False)  # (not &: the interpreter mistypes it)
                x_off = x_seq + tl.minimum(h, H - 1).to(tl.int64) * stride_xh
                _store_zero_rows(DQ + x_off, rows, store_ok, stride_xm, stride_xd, BLOCK, HEAD_D)
                _store_zero_rows(DK + x_off, rows, store_ok, stride_xm, stride_xd, BLOCK, HEAD_D)
                _store_zero_rows(DV + x_off, rows, store_ok, stride_xm, stride_xd, BLOCK, HEAD_D)
            return
        col_ok = _key_ok(KvMask, b64, rows, kv_hi, stride_mb, stride_mn, HAS_KV_MASK)
        q_ok = rows < q_hi  # rows not computed: dO read as 0, no P (their dQ is 0, no part in dK, dV)
        ok = _closed_allowed(rows, kv_hi, window, ATTN_BLOCK, BLOCK, HAS_WINDOW, CAUSAL)
        if HAS_KV_MASK:
            ok = ok & col_ok[None, :]
        if HAS_Q_LENGTHS:
            ok = ok & q_ok[:, None]
        l_rows = l_seq + rows * stride_lm
        for i in tl.range(0, HEADS):
            h = group * HEADS + i
            h64 = tl.minimum(h, H - 1).to(tl.int64)  # a head past H (H not a multiple of HEADS): not stored
            store_ok = tl.where(h < H, row_ok, False)  # (not &: the interpreter mistypes it)
            x_off = x_seq + h64 * stride_xh
            _closed_bwd_head(q_seq, k_seq, v_seq, do_seq, l_rows, DQ, DK, DV, x_off, h64, cos_base, sin_base,
                             rows, row_ok, col_ok, q_ok, store_ok, ok, stride_qh, stride_qm, stride_qd,
                             stride_kh, stride_kn, stride_kd, stride_vh, stride_vn, stride_vd, stride_cm,
                             stride_cd, stride_gh, stride_gm, stride_gd, stride_lh, stride_xm, stride_xd,
                             qk_scale, scale, HEAD_D, ROTARY, DOT_PRECISION, R_SPLIT)
    else:
        # one loop over (tile, head) pairs, so the compiler pipelines the next pair's loads across tiles
        # too. No branch in it: a tile with no key or no computed row reads nothing (every load masked
        # off) and stores the zeros its P of zeros gives.
        for it in tl.range(0, TILES * HEADS):
            m0 = (tile * TILES + it // HEADS) * BLOCK
            h = group * HEADS + it % HEADS
            h64 = tl.minimum(h, H - 1).to(tl.int64)
            rows, row_ok, read_ok, col_ok, q_ok, ok = _tile_of_loop(
                m0, b64, kv_lo, kv_hi, q_hi, KvMask, stride_mb, stride_mn, L, window, ATTN_BLOCK, HAS_WINDOW,
                CAUSAL, HAS_KV_MASK, PACKED, BLOCK)
            store_ok = tl.where(h < H, row_ok, False)
            x_off = x_seq + h64 * stride_xh
            _closed_bwd_head(q_seq, k_seq, v_seq, do_seq, l_seq + rows * stride_lm, DQ, DK, DV, x_off, h64,
                             cos_base, sin_base, rows, read_ok, col_ok, q_ok, store_ok, ok, stride_qh,
                             stride_qm, stride_qd, stride_kh, stride_kn, stride_kd, stride_vh, stride_vn,
                             stride_vd, stride_cm, stride_cd, stride_gh, stride_gm, stride_gd, stride_lh,
                             stride_xm, stride_xd, qk_scale, scale, HEAD_D, ROTARY, DOT_PRECISION, R_SPLIT)


# ---------------------------------------------------------------------------------------------------
# General kernels: loops over the key range (forward, dQ) or the query range (dK/dV)


@autotune(configs=_FWD_CONFIGS, key=_GENERAL_KEY, prune_configs_by=_general_prune(_FWD_SHAPES, "fwd"))
@per_step_jit
def _fwd_kernel(
    Q, K, V, Cos, Sin, Out, Lse, Lengths, KvMask, KvRange, QLengths, Offsets, Seed,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_cb, stride_cm, stride_cd,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_lb, stride_lh, stride_lm,
    stride_mb, stride_mn,
    H, L, window, qk_scale, drop_below, dropout_scale,
    L_BUCKET, WINDOW_BUCKET,
    HEAD_D: tl.constexpr, ATTN_BLOCK: tl.constexpr, HAS_WINDOW: tl.constexpr, CAUSAL: tl.constexpr,
    ROTARY: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_KV_MASK: tl.constexpr, HAS_Q_LENGTHS: tl.constexpr,
    PACKED: tl.constexpr, DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    tile, b, h = _coordinates(H, tl.cdiv(L, BLOCK_M))
    kv_lo, kv_hi = _kv_bounds(Lengths, KvRange, b, L, HAS_KV_MASK)
    q_hi = _q_rows(QLengths, b, L, HAS_Q_LENGTHS)
    b64 = b.to(tl.int64)
    row0 = _row0(Offsets, b, PACKED)
    h64 = h.to(tl.int64)
    seed, row_counters = dropout_stream(Seed, b64, h64, H, L, DROPOUT)
    m0 = tile * BLOCK_M
    rows = m0 + tl.arange(0, BLOCK_M)
    row_ok = rows < _row_end(L, q_hi, PACKED)
    offs_d = tl.arange(0, HEAD_D)
    o_base = Out + _seq_off(b64, row0, stride_ob, stride_om, PACKED) + h64 * stride_oh
    l_ptrs = Lse + _seq_off(b64, row0, stride_lb, stride_lm, PACKED) + h64 * stride_lh + rows * stride_lm
    lo, hi = _key_range(m0, tl.minimum(m0 + BLOCK_M, q_hi) - 1, kv_lo, kv_hi, window, ATTN_BLOCK,
                        HAS_WINDOW, CAUSAL, HAS_KV_MASK)
    # no row of the tile has a key (e.g. a tile past the length), or none is computed
    if (lo >= hi) | (m0 >= q_hi):
        _store_zero_rows(o_base, rows, row_ok, stride_om, stride_od, BLOCK_M, HEAD_D)
        tl.store(l_ptrs, tl.full([BLOCK_M], float("inf"), tl.float32), mask=row_ok)
        return
    cos_base = Cos + b64 * stride_cb
    sin_base = Sin + b64 * stride_cb
    k_base = K + _seq_off(b64, row0, stride_kb, stride_kn, PACKED) + h64 * stride_kh
    v_base = V + _seq_off(b64, row0, stride_vb, stride_vn, PACKED) + h64 * stride_vh
    q_base = Q + _seq_off(b64, row0, stride_qb, stride_qm, PACKED) + h64 * stride_qh
    qa, qb = _load_tile(q_base, rows, row_ok, stride_qm, stride_qd, HEAD_D, ROTARY)
    if ROTARY != 0:
        ca, cb, sa, sb = _load_tables(cos_base, sin_base, rows, row_ok, stride_cm, stride_cd, HEAD_D, ROTARY)
        qa, qb = _rotate(qa, qb, ca, cb, sa, sb)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_D], tl.float32)
    for start_n in range((lo // BLOCK_N) * BLOCK_N, hi, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        col_ok = _key_ok(KvMask, b64, cols, kv_hi, stride_mb, stride_mn, HAS_KV_MASK)
        ka, kb = _load_tile(k_base, cols, col_ok, stride_kn, stride_kd, HEAD_D, ROTARY)
        if ROTARY != 0:
            kca, kcb, ksa, ksb = _load_tables(cos_base, sin_base, cols, col_ok, stride_cm, stride_cd, HEAD_D,
                                              ROTARY)
            ka, kb = _rotate(ka, kb, kca, kcb, ksa, ksb)
        s = _dot_rows(qa, qb, ka, kb, ROTARY, DOT_PRECISION) * qk_scale
        ok = _allowed(rows[:, None], cols[None, :], kv_hi, window, ATTN_BLOCK, HAS_WINDOW, CAUSAL)
        if HAS_KV_MASK:
            ok = ok & col_ok[None, :]
        if HAS_Q_LENGTHS:  # rows not computed see no key: out 0, lse +inf
            ok = ok & (rows < q_hi)[:, None]
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key so far: avoid inf - inf
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        if DROPOUT:  # the softmax statistics are P's own; only P @ V sees the dropped pairs
            p = p * dropout_factor(seed, rows, start_n, row_counters, drop_below, dropout_scale, BLOCK_N)
        v = load_rows(v_base, cols, offs_d, stride_vn, stride_vd, col_ok, HEAD_D, HEAD_D, True)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    out, lse = _finish_softmax(acc, l_i, m_i)
    store_rows(o_base, rows, offs_d, stride_om, stride_od, out, row_ok, HEAD_D)
    tl.store(l_ptrs, lse, mask=row_ok)


@autotune(configs=_DKDV_CONFIGS, key=_GENERAL_KEY,
          prune_configs_by=_general_prune(_DKDV_SHAPES, "dkdv"))
@per_step_jit
def _bwd_dkdv_kernel(
    Q, K, V, Cos, Sin, DO, Lse, Delta, DK, DV, Lengths, KvMask, KvRange, QLengths, Offsets, Seed,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_cb, stride_cm, stride_cd,
    stride_gb, stride_gh, stride_gm, stride_gd,
    stride_lb, stride_lh, stride_lm,
    stride_xb, stride_xh, stride_xm, stride_xd,
    stride_mb, stride_mn,
    H, L, window, qk_scale, scale, drop_below, dropout_scale,
    L_BUCKET, WINDOW_BUCKET,
    HEAD_D: tl.constexpr, ATTN_BLOCK: tl.constexpr, HAS_WINDOW: tl.constexpr, CAUSAL: tl.constexpr,
    ROTARY: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_KV_MASK: tl.constexpr, HAS_Q_LENGTHS: tl.constexpr,
    PACKED: tl.constexpr, DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program per key tile; loops over the query rows that may see it. dK, dV: contiguous."""
    tile, b, h = _coordinates(H, tl.cdiv(L, BLOCK_N))
    kv_lo, kv_hi = _kv_bounds(Lengths, KvRange, b, L, HAS_KV_MASK)
    q_hi = _q_rows(QLengths, b, L, HAS_Q_LENGTHS)
    b64 = b.to(tl.int64)
    row0 = _row0(Offsets, b, PACKED)
    h64 = h.to(tl.int64)
    seed, row_counters = dropout_stream(Seed, b64, h64, H, L, DROPOUT)
    n0 = tile * BLOCK_N
    cols = n0 + tl.arange(0, BLOCK_N)
    store_ok = cols < _row_end(L, kv_hi, PACKED)
    x_off = _seq_off(b64, row0, stride_xb, stride_xm, PACKED) + h64 * stride_xh
    if _no_keys(n0, n0 + BLOCK_N, kv_lo, kv_hi, HAS_KV_MASK):  # no valid key here: no gradient
        _store_zero_rows(DK + x_off, cols, store_ok, stride_xm, stride_xd, BLOCK_N, HEAD_D)
        _store_zero_rows(DV + x_off, cols, store_ok, stride_xm, stride_xd, BLOCK_N, HEAD_D)
        return
    col_ok = _key_ok(KvMask, b64, cols, kv_hi, stride_mb, stride_mn, HAS_KV_MASK)
    offs_d = tl.arange(0, HEAD_D)
    cos_base = Cos + b64 * stride_cb
    sin_base = Sin + b64 * stride_cb
    q_base = Q + _seq_off(b64, row0, stride_qb, stride_qm, PACKED) + h64 * stride_qh
    do_base = DO + _seq_off(b64, row0, stride_gb, stride_gm, PACKED) + h64 * stride_gh
    l_base = Lse + _seq_off(b64, row0, stride_lb, stride_lm, PACKED) + h64 * stride_lh
    d_base = Delta + _seq_off(b64, row0, stride_lb, stride_lm, PACKED) + h64 * stride_lh
    k_base = K + _seq_off(b64, row0, stride_kb, stride_kn, PACKED) + h64 * stride_kh
    ka, kb = _load_tile(k_base, cols, col_ok, stride_kn, stride_kd, HEAD_D, ROTARY)
    if ROTARY != 0:
        ca, cb, sa, sb = _load_tables(cos_base, sin_base, cols, col_ok, stride_cm, stride_cd, HEAD_D, ROTARY)
        ka, kb = _rotate(ka, kb, ca, cb, sa, sb)
        dka = tl.zeros([BLOCK_N, HEAD_D // 2], tl.float32)
        dkb = tl.zeros([BLOCK_N, HEAD_D // 2], tl.float32)
    else:
        dka = tl.zeros([BLOCK_N, HEAD_D], tl.float32)
        dkb = dka
    v = load_rows(V + _seq_off(b64, row0, stride_vb, stride_vn, PACKED) + h64 * stride_vh,
                  cols, offs_d, stride_vn, stride_vd, col_ok, HEAD_D,
                  HEAD_D, True)
    dv = tl.zeros([BLOCK_N, HEAD_D], tl.float32)
    c0 = n0
    if HAS_KV_MASK:
        c0 = tl.maximum(n0, kv_lo)
    # the computed query rows only (q_hi <= L): the others have no part in dK, dV
    lo, hi = _query_range(c0, tl.minimum(n0 + BLOCK_N, kv_hi) - 1, q_hi, window, ATTN_BLOCK, HAS_WINDOW,
                          CAUSAL)
    for start_m in range((lo // BLOCK_M) * BLOCK_M, hi, BLOCK_M):
        rows = start_m + tl.arange(0, BLOCK_M)
        row_ok = rows < q_hi
        qa, qb = _load_tile(q_base, rows, row_ok, stride_qm, stride_qd, HEAD_D, ROTARY)
        if ROTARY != 0:
            qca, qcb, qsa, qsb = _load_tables(cos_base, sin_base, rows, row_ok, stride_cm, stride_cd, HEAD_D,
                                              ROTARY)
            qa, qb = _rotate(qa, qb, qca, qcb, qsa, qsb)
        do = load_rows(do_base, rows, offs_d, stride_gm, stride_gd, row_ok, HEAD_D, HEAD_D, True)
        lse = tl.load(l_base + rows * stride_lm, mask=row_ok, other=float("inf"))
        delta = tl.load(d_base + rows * stride_lm, mask=row_ok, other=0.0)
        s_t = _dot_rows(ka, kb, qa, qb, ROTARY, DOT_PRECISION) * qk_scale
        ok = _allowed(rows[None, :], cols[:, None], kv_hi, window, ATTN_BLOCK, HAS_WINDOW, CAUSAL)
        if HAS_KV_MASK:
            ok = ok & col_ok[:, None]
        p_t = tl.where(ok, tl.exp2(s_t - lse[None, :] * LOG2E), 0.0)
        if DROPOUT:  # (ptxas serializes this kernel's wgmma with it at D 128, C7515; the jagged kernel's not)
            dv, dp_t = dropout_dv_dp(dv, p_t, v, do, seed, rows, n0, row_counters, drop_below, dropout_scale,
                                     BLOCK_N, DOT_PRECISION)
        else:
            dv += tl.dot(p_t.to(do.dtype), do, input_precision=DOT_PRECISION)
            dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        ds_t = (p_t * (dp_t - delta[None, :])).to(qa.dtype)
        dka += tl.dot(ds_t, qa, input_precision=DOT_PRECISION)
        if ROTARY != 0:
            dkb += tl.dot(ds_t, qb, input_precision=DOT_PRECISION)
    dka = dka * scale
    dkb = dkb * scale
    if ROTARY != 0:  # tables loaded again rather than kept live through the loop
        ca, cb, sa, sb = _load_tables(cos_base, sin_base, cols, col_ok, stride_cm, stride_cd, HEAD_D, ROTARY)
        dka, dkb = _rotate_transpose(dka, dkb, ca, cb, sa, sb)
    _store_tile(DK + x_off, cols, store_ok, stride_xm, stride_xd, dka, dkb, HEAD_D, ROTARY)
    store_rows(DV + x_off, cols, offs_d, stride_xm, stride_xd, dv, store_ok, HEAD_D)


@autotune(configs=_DQ_CONFIGS, key=_GENERAL_KEY, prune_configs_by=_general_prune(_DQ_SHAPES, "dq"))
@per_step_jit
def _bwd_dq_kernel(
    Q, K, V, Cos, Sin, DO, Lse, Delta, DQ, Lengths, KvMask, KvRange, QLengths, Offsets, Seed,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_cb, stride_cm, stride_cd,
    stride_gb, stride_gh, stride_gm, stride_gd,
    stride_lb, stride_lh, stride_lm,
    stride_xb, stride_xh, stride_xm, stride_xd,
    stride_mb, stride_mn,
    H, L, window, qk_scale, scale, drop_below, dropout_scale,
    L_BUCKET, WINDOW_BUCKET,
    HEAD_D: tl.constexpr, ATTN_BLOCK: tl.constexpr, HAS_WINDOW: tl.constexpr, CAUSAL: tl.constexpr,
    ROTARY: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_KV_MASK: tl.constexpr, HAS_Q_LENGTHS: tl.constexpr,
    PACKED: tl.constexpr, DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program per query tile; loops over its key range. dQ: contiguous."""
    tile, b, h = _coordinates(H, tl.cdiv(L, BLOCK_M))
    kv_lo, kv_hi = _kv_bounds(Lengths, KvRange, b, L, HAS_KV_MASK)
    q_hi = _q_rows(QLengths, b, L, HAS_Q_LENGTHS)
    b64 = b.to(tl.int64)
    row0 = _row0(Offsets, b, PACKED)
    h64 = h.to(tl.int64)
    seed, row_counters = dropout_stream(Seed, b64, h64, H, L, DROPOUT)
    m0 = tile * BLOCK_M
    rows = m0 + tl.arange(0, BLOCK_M)
    row_ok = rows < _row_end(L, q_hi, PACKED)
    x_off = _seq_off(b64, row0, stride_xb, stride_xm, PACKED) + h64 * stride_xh
    lo, hi = _key_range(m0, tl.minimum(m0 + BLOCK_M, q_hi) - 1, kv_lo, kv_hi, window, ATTN_BLOCK,
                        HAS_WINDOW, CAUSAL, HAS_KV_MASK)
    if (lo >= hi) | (m0 >= q_hi):
        _store_zero_rows(DQ + x_off, rows, row_ok, stride_xm, stride_xd, BLOCK_M, HEAD_D)
        return
    offs_d = tl.arange(0, HEAD_D)
    cos_base = Cos + b64 * stride_cb
    sin_base = Sin + b64 * stride_cb
    k_base = K + _seq_off(b64, row0, stride_kb, stride_kn, PACKED) + h64 * stride_kh
    v_base = V + _seq_off(b64, row0, stride_vb, stride_vn, PACKED) + h64 * stride_vh
    q_base = Q + _seq_off(b64, row0, stride_qb, stride_qm, PACKED) + h64 * stride_qh
    qa, qb = _load_tile(q_base, rows, row_ok, stride_qm, stride_qd, HEAD_D, ROTARY)
    if ROTARY != 0:
        ca, cb, sa, sb = _load_tables(cos_base, sin_base, rows, row_ok, stride_cm, stride_cd, HEAD_D, ROTARY)
        qa, qb = _rotate(qa, qb, ca, cb, sa, sb)
        dqa = tl.zeros([BLOCK_M, HEAD_D // 2], tl.float32)
        dqb = tl.zeros([BLOCK_M, HEAD_D // 2], tl.float32)
    else:
        dqa = tl.zeros([BLOCK_M, HEAD_D], tl.float32)
        dqb = dqa
    do_base = DO + _seq_off(b64, row0, stride_gb, stride_gm, PACKED) + h64 * stride_gh
    q_ok = rows < q_hi  # rows not computed: dO read as 0 and P = 0, so their dQ is exactly 0
    do = load_rows(do_base, rows, offs_d, stride_gm, stride_gd, q_ok, HEAD_D, HEAD_D, True)
    l_rows = _seq_off(b64, row0, stride_lb, stride_lm, PACKED) + h64 * stride_lh + rows * stride_lm
    lse2 = tl.load(Lse + l_rows, mask=q_ok, other=float("inf")) * LOG2E
    delta = tl.load(Delta + l_rows, mask=q_ok, other=0.0)
    for start_n in range((lo // BLOCK_N) * BLOCK_N, hi, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        col_ok = _key_ok(KvMask, b64, cols, kv_hi, stride_mb, stride_mn, HAS_KV_MASK)
        ka, kb = _load_tile(k_base, cols, col_ok, stride_kn, stride_kd, HEAD_D, ROTARY)
        if ROTARY != 0:
            kca, kcb, ksa, ksb = _load_tables(cos_base, sin_base, cols, col_ok, stride_cm, stride_cd, HEAD_D,
                                              ROTARY)
            ka, kb = _rotate(ka, kb, kca, kcb, ksa, ksb)
        v = load_rows(v_base, cols, offs_d, stride_vn, stride_vd, col_ok, HEAD_D, HEAD_D, True)
        s = _dot_rows(qa, qb, ka, kb, ROTARY, DOT_PRECISION) * qk_scale
        ok = _allowed(rows[:, None], cols[None, :], kv_hi, window, ATTN_BLOCK, HAS_WINDOW, CAUSAL)
        if HAS_KV_MASK:
            ok = ok & col_ok[None, :]
        p = tl.where(ok, tl.exp2(s - lse2[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        if DROPOUT:
            dp = dp * dropout_factor(seed, rows, start_n, row_counters, drop_below, dropout_scale, BLOCK_N)
        ds = (p * (dp - delta[:, None])).to(ka.dtype)
        dqa += tl.dot(ds, ka, input_precision=DOT_PRECISION)
        if ROTARY != 0:
            dqb += tl.dot(ds, kb, input_precision=DOT_PRECISION)
    dqa = dqa * scale
    dqb = dqb * scale
    if ROTARY != 0:  # tables loaded again rather than kept live through the loop
        ca, cb, sa, sb = _load_tables(cos_base, sin_base, rows, row_ok, stride_cm, stride_cd, HEAD_D, ROTARY)
        dqa, dqb = _rotate_transpose(dqa, dqb, ca, cb, sa, sb)
    _store_tile(DQ + x_off, rows, row_ok, stride_xm, stride_xd, dqa, dqb, HEAD_D, ROTARY)


# ---------------------------------------------------------------------------------------------------
# Launchers


def _closed_tiles(kernel, shapes, variant: str) -> list[int]:
    """Tile sizes of a closed kernel's configs meant for this variant (configs missing from the table,
    e.g. pinned by tests, serve every variant)."""
    return [c.kwargs["BLOCK"] for c in kernel.configs if variant in shapes.get(_closed_shape(c), (variant,))]


def _closed_programs(meta: dict, B: int, H: int, L: int) -> int:
    """A closed kernel's grid: one program per (TILES tiles, batch, group of HEADS heads)."""
    return triton.cdiv(L, meta["BLOCK"] * meta.get("TILES", 1)) * B * triton.cdiv(H, meta.get("HEADS", 1))


def closed_tile_serves(block: int, head_dim: int, rotary: str = "none") -> bool:
    """Whether both closed kernels have a config whose tile holds whole blocks of this size (block a power
    of two dividing the tile) for this variant; otherwise the general kernels run."""
    if block <= 0 or block & (block - 1):
        return False
    variant = _variant(head_dim, 0 if _unfused_rotary(rotary, head_dim) else ROTARY_CODES[rotary])
    return all(
        any(t % block == 0 for t in _closed_tiles(kernel, shapes, variant))
        for kernel, shapes in ((_closed_fwd_kernel, _CLOSED_FWD_SHAPES),
                               (_closed_bwd_kernel, _CLOSED_BWD_SHAPES))
    )


def _window_bucket(window: int) -> int:
    return 0 if window < 0 else length_bucket(window + 1)


def _tables(cos, sin, q, B):
    """(cos, sin, strides (batch, row, col)) as the kernels read them; q stands in without rotary."""
    if cos is None:
        return q, q, (0, 0, 0)
    cos3, sin3 = rotary_tables(cos, B), rotary_tables(sin, B)
    if cos3.shape != sin3.shape or cos3.stride() != sin3.stride():  # the kernels take one set of strides
        Bc = max(cos3.shape[0], sin3.shape[0])
        cos3, sin3 = cos3.expand(Bc, -1, -1).contiguous(), sin3.expand(Bc, -1, -1).contiguous()
    sb, sm, sd = cos3.stride()
    return cos3, sin3, ((0 if cos3.shape[0] == 1 else sb), sm, sd)


def _unfused_rotary(rotary: str, D: int) -> bool:
    """Rotary at head dims whose halves cannot feed tl.dot is applied with torch around the kernels."""
    return rotary != "none" and D < MIN_FUSED_ROTARY_HEAD_DIM


def _token_tables(cos, sin, token_offsets, T: int):
    """Packed layout: the fp32 (T, 1, D) rows of cos and sin at each token's (sample, position); rows outside
    every sequence (a bucketed index's slack) read a real row, and no kernel computes them."""
    rows = []
    for table in (cos, sin):
        t3 = rotary_tables(table, 0)  # (Bc, L, D), Bc in {1, B}
        batch, position, _ = packed_rows(token_offsets, T, t3.shape[1])
        rows.append(t3[batch if t3.shape[0] > 1 else 0, position].float()[:, None, :])
    return rows


def _rotated_inputs(q, k, cos, sin, rotary, token_offsets=None):
    if token_offsets is not None:  # (T, H, D) rows against their (T, 1, D) table rows
        c, s_ = _token_tables(cos, sin, token_offsets, q.shape[0])
        rot = lambda x: (x.float() * c + rotate(x.float(), rotary) * s_).to(x.dtype)  # noqa: E731
        return rot(q), rot(k)
    qr = apply_rotary(q.float(), cos, sin, rotary).to(q.dtype)
    kr = apply_rotary(k.float(), cos, sin, rotary).to(k.dtype)
    return qr, kr


def _rotary_transpose(g, cos, sin, rotary, token_offsets=None):
    """The gradient w.r.t. the un-rotated rows (g * cos + rot^T(g * sin), rot^T = -rot)."""
    if token_offsets is None:
        return apply_rotary_transpose(g, cos, sin, rotary)
    c, s_ = _token_tables(cos, sin, token_offsets, g.shape[0])
    return g * c - rotate(g * s_, rotary)


def _consts(D, block, window, causal, rotary, dtype, kv_mask=None, q_lengths=None, packed=False):
    return {"HEAD_D": D, "ATTN_BLOCK": int(block), "HAS_WINDOW": window >= 0, "CAUSAL": bool(causal),
            "ROTARY": ROTARY_CODES[rotary], "DOT_PRECISION": dot_precision(dtype),
            "HAS_KV_MASK": kv_mask is not None, "HAS_Q_LENGTHS": q_lengths is not None, "PACKED": packed}


def _packed_layout(q, lengths, token_offsets, max_len):
    """(B, H, L, D) and the stride functions of the call's layout. Packed, q is (T, H, D) and every
    row-indexed tensor (q, k, v, out, dO, dQ, dK, dV as (T, H, D); lse and delta as (T, H)) is given batch
    stride 0 and its row stride; the kernels start sequence b at row token_offsets[b]."""
    if token_offsets is None:
        B, H, L, D = q.shape
        return (B, H, L, D), (lambda t: t.stride()), (lambda t: t.stride())
    T, H, D = q.shape
    assert max_len >= 1, "the packed layout needs max_len (the padded length)"
    return ((lengths.shape[0], H, int(max_len), D), (lambda t: (0, t.stride(1), t.stride(0), t.stride(2))),
            (lambda t: (0, t.stride(1), t.stride(0))))


def kv_mask_range(kv_mask, lengths, L: int) -> torch.Tensor:
    """(B, 2) int32 per sample: [first valid key (L if none), last valid key + 1 (0 if none)], a key
    valid when kv_mask[b, j] and j < lengths[b] (a view of the key bounds). No host sync."""
    assert kv_mask.shape[1] == L
    return mask_key_bounds(kv_mask, lengths)[:, :2]


def _kv_mask_args(kv_mask, lengths, given_bounds=None) -> tuple:
    """(KvMask, KvRange, stride_mb, stride_mn) kernel arguments; lengths stand in without a mask. KvRange:
    the (B, 3) key bounds, ``given_bounds`` when the graph derived them once per step."""
    if kv_mask is None:
        return lengths, lengths, 0, 0
    # a uint8 view of the bool mask (same strides, no copy: an expanded mask keeps batch stride 0)
    return (kv_mask.view(torch.uint8), mask_key_bounds(kv_mask, lengths, given_bounds), *kv_mask.stride())


def block_attention_forward_triton(q, k, v, lengths, block: int, window: int, causal: bool, cos, sin,
                                   rotary: str, scale: float, kv_mask=None, *, kv_bounds=None,
                                   q_lengths=None, token_offsets=None, max_len: int = 0, dropout_p: float = 0.0,
                                   dropout_seed=None):
    """q, k, v (B, H, L, D), any strides -> (out (B, H, L, D) contiguous, lse (B, H, L) fp32). Packed
    (token_offsets, max_len = L; op.py): q, k, v (T, H, D) -> (out (T, H, D), lse (T, H))."""
    packed = token_offsets is not None
    (B, H, L, D), rows4, rows3 = _packed_layout(q, lengths, token_offsets, max_len)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((q.shape[0], H) if packed else (B, H, L), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse
    if packed:  # rows past the last offset (a bucketed index's slack) belong to no program: 0, lse +inf
        fill_slack_rows(token_offsets, (out, 0.0), (lse, float("inf")))
    if _unfused_rotary(rotary, D):
        q, k = _rotated_inputs(q, k, cos, sin, rotary, token_offsets)
        cos = sin = None
        rotary = "none"
    if packed:  # rows past a length do not exist: computed query rows are [0, len)
        q_lengths = lengths
    cos, sin, c_strides = _tables(cos, sin, q, B)
    buckets = (length_bucket(L), _window_bucket(window))
    mask, kv_range, *m_strides = _kv_mask_args(kv_mask, lengths, kv_bounds)
    q_rows = lengths if q_lengths is None else q_lengths  # (unread without q_lengths)
    offsets = token_offsets if packed else lengths  # (unread when not packed)
    args = (q, k, v, cos, sin, out, lse, lengths, mask, kv_range, q_rows, offsets, *rows4(q), *rows4(k),
            *rows4(v), *c_strides, *rows4(out), *rows3(lse), *m_strides, H, L, int(window),
            float(scale) * _LOG2E, *buckets)
    consts = _consts(D, block, window, causal, rotary, q.dtype, kv_mask, q_lengths, packed)
    if closed_tile_serves(block, D, rotary) and not dropout_p:
        launch(_closed_fwd_kernel, lambda meta: (_closed_programs(meta, B, H, L),), args, consts, buckets)
    else:
        seed, *dropout = dropout_args(dropout_p, dropout_seed, lengths)
        general = (*args[:12], seed, *args[12:-2], *dropout, *args[-2:])
        launch(_fwd_kernel, lambda meta: (triton.cdiv(L, meta["BLOCK_M"]) * B * H,), general,
               dict(consts, DROPOUT=bool(dropout_p)), buckets)
    return out, lse


def _delta(out, grad_out, lengths, token_offsets, B, H, L, D, rows4, rows3):
    """delta = rowsum(O * dO) (fp32, lse's layout): every row < L padded (MODE_FULL), the packed rows of
    each sequence packed (MODE_OFFSETS, the offsets mode of the shared kernel)."""
    packed = token_offsets is not None
    delta = torch.empty((out.shape[0], H) if packed else (B, H, L), dtype=torch.float32, device=out.device)
    delta_block = 32 if INTERPRET else 64
    # the lengths arguments are unused in MODE_FULL
    bwd_delta_kernel[(triton.cdiv(L, delta_block) * B * H,)](
        out, grad_out, delta, token_offsets if packed else lengths, lengths, *rows4(out), *rows4(grad_out),
        *rows3(delta), H, L, out.shape[0] if packed else L, HEAD_D=D, BLOCK_D=D,
        Q_MODE=MODE_OFFSETS if packed else MODE_FULL, BLOCK_M=delta_block, num_warps=4)
    return delta


def block_attention_backward_triton(grad_out, q, k, v, out, lse, lengths, block: int, window: int,
                                    causal: bool, cos, sin, rotary: str, scale: float, kv_mask=None, *,
                                    kv_bounds=None, q_lengths=None, token_offsets=None, max_len: int = 0,
                                    dropout_p: float = 0.0, dropout_seed=None):
    """-> (dq, dk, dv), contiguous, shaped like q (B, H, L, D) or packed (T, H, D), in the inputs' dtypes;
    deterministic (no atomics)."""
    packed = token_offsets is not None
    (B, H, L, D), rows4, rows3 = _packed_layout(q, lengths, token_offsets, max_len)
    lse = lse.contiguous()  # the dK/dV and dQ kernels read lse and delta with one set of strides
    unfused = _unfused_rotary(rotary, D)
    # unfused rotary: the kernels' dq, dk stay fp32 until the transposed rotation (one rounding)
    dq = torch.empty(q.shape, dtype=torch.float32 if unfused else q.dtype, device=q.device)
    dk = torch.empty(q.shape, dtype=torch.float32 if unfused else k.dtype, device=q.device)
    dv = torch.empty(q.shape, dtype=v.dtype, device=q.device)
    if dq.numel() == 0:
        return dq.to(q.dtype), dk.to(k.dtype), dv
    if packed:  # zero gradients on rows outside every sequence
        fill_slack_rows(token_offsets, (dq, 0.0), (dk, 0.0), (dv, 0.0))
    if unfused:
        tables = (cos, sin, rotary)
        q, k = _rotated_inputs(q, k, cos, sin, rotary, token_offsets)
        cos = sin = None
        rotary = "none"
    if packed:
        q_lengths = lengths
    cos, sin, c_strides = _tables(cos, sin, q, B)
    buckets = (length_bucket(L), _window_bucket(window))
    consts = _consts(D, block, window, causal, rotary, q.dtype, kv_mask, q_lengths, packed)
    inputs = (q, k, v, cos, sin, grad_out)
    mask, kv_range, *m_strides = _kv_mask_args(kv_mask, lengths, kv_bounds)
    q_rows = lengths if q_lengths is None else q_lengths  # (unread without q_lengths)
    sequences = (lengths, mask, kv_range, q_rows, token_offsets if packed else lengths)
    strides = (*rows4(q), *rows4(k), *rows4(v), *c_strides, *rows4(grad_out), *rows3(lse))
    scalars = (*m_strides, H, L, int(window), float(scale) * _LOG2E, float(scale), *buckets)
    if closed_tile_serves(block, D, rotary) and not dropout_p:
        launch(_closed_bwd_kernel, lambda meta: (_closed_programs(meta, B, H, L),),
               (*inputs, lse, dq, dk, dv, *sequences, *strides, *rows4(dq), *scalars), consts, buckets)
    else:
        delta = _delta(out, grad_out, lengths, token_offsets, B, H, L, D, rows4, rows3)
        seed, *dropout = dropout_args(dropout_p, dropout_seed, lengths)
        scalars = (*scalars[:-2], *dropout, *scalars[-2:])
        consts = dict(consts, DROPOUT=bool(dropout_p))
        launch(_bwd_dkdv_kernel, lambda meta: (triton.cdiv(L, meta["BLOCK_N"]) * B * H,),
               (*inputs, lse, delta, dk, dv, *sequences, seed, *strides, *rows4(dk), *scalars), consts, buckets)
        launch(_bwd_dq_kernel, lambda meta: (triton.cdiv(L, meta["BLOCK_M"]) * B * H,),
               (*inputs, lse, delta, dq, *sequences, seed, *strides, *rows4(dq), *scalars), consts, buckets)
    if unfused:
        cos0, sin0, rotary0 = tables
        dq = _rotary_transpose(dq, cos0, sin0, rotary0, token_offsets).to(out.dtype)
        dk = _rotary_transpose(dk, cos0, sin0, rotary0, token_offsets).to(out.dtype)
    return dq, dk, dv
