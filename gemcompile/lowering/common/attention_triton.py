"""The Triton toolkit the three attention kernels share (jagged attention, block attention, GDPA).

Host side: how a kernel finds the sequences of one side (:class:`Side`, the modes), the batch order
longest first (:func:`batch_order`: the order given to the op when the graph derived it once per step,
common/length_order.py, else one launch here), the key bounds of a kv_mask (:func:`mask_key_bounds`,
likewise), the autotune key of a length (:func:`length_bucket`), config lists
and their prune (:func:`kernel_configs`, :func:`make_prune`, fewer pipeline stages until the tiles fit
the shared memory), strides and dot precision. Device side (``@triton.jit``): a sequence's start row and
length (:func:`sequence`), the program -> (tile, batch, head) map (:func:`program_coordinates`), the
branch-free split of a tile loop into masked and unmasked ranges (:func:`loop_split`), masked row-tile
loads and stores (:func:`load_rows`, :func:`store_rows`), the dropout factor of a tile of probabilities
(:func:`dropout_factor`, the stream of common/dropout.py), and the softmax backward's
delta = rowsum(dO * O) kernel (:func:`bwd_delta_kernel`, jagged and block attention).

Every sequence is addressed by (start row, length): in the padded layout (B, H, L, D) the start row is 0
and the length comes from a lengths tensor (clamped into [0, L]) or is the padded length. The offsets
mode (a packed (T, H, D) layout, MODE_OFFSETS) serves the packed layouts: block attention's delta kernel
and the jagged attention launchers of packed keys/values (jagged_attention/packed_triton.py).
"""
from __future__ import annotations

import inspect

import torch
import triton
import triton.language as tl

from . import length_order
from .dropout import drop_threshold, keep_scale
from .jagged import bucket_length
from .length_order_triton import key_bounds_and_span, longest_first_order
from .tuned_launch import INTERPRET
from gemcompile.env import env_flag

__all__ = [
    "KV_BOUNDS_WIDTH",
    "LN2",
    "LOG2E",
    "MODE_FULL",
    "MODE_LENGTHS",
    "MODE_OFFSETS",
    "SHARED_MEMORY_BUDGET",
    "Side",
    "batch_order",
    "bhld_strides",
    "block_d",
    "bwd_delta_kernel",
    "dot_precision",
    "dropout_args",
    "dropout_dv_dp",
    "dropout_factor",
    "dropout_stream",
    "fit_shared_memory",
    "in_registers",
    "q_in_registers",
    "kernel_configs",
    "mask_key_bounds",
    "kv_mask_bounds",
    "length_bucket",
    "load_rows",
    "loop_split",
    "make_prune",
    "program_coordinates",
    "same_sequences",
    "sequence",
    "store_rows",
]


LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
KV_BOUNDS_WIDTH = tl.constexpr(length_order.KV_BOUNDS_WIDTH)
"""int32 entries per sample of the key bounds (lo, hi, holes): the kernels read sample b's at 3 * b."""


PER_STEP_SIZES = ("total_q_rows", "total_kv_rows", "stride_lh")
"""Kernel arguments whose values change with every batch: the packed token counts and the head stride of a
packed lse / delta laid out (H, T) (none is now: both packed lse are (T, H)). Triton specializes an int
argument on its divisibility by 16 and compiles the kernel again for a value that changes it, so every
kernel taking T compiled anew, inside a training step, the first time a batch's T was a multiple of 16; the
kernels are declared with :func:`per_step_jit`."""


def per_step_jit(fn):
    """``triton.jit`` with the PER_STEP_SIZES that ``fn`` takes in ``do_not_specialize`` (by name, only the
    ones it has: some Triton versions look every listed name up among the parameters)."""
    names = [name for name in inspect.signature(fn).parameters if name in PER_STEP_SIZES]
    return triton.jit(fn, do_not_specialize=names)


# How a side (queries or keys) finds its sequences.
MODE_FULL = 0  # every sequence has the padded length
MODE_LENGTHS = 1  # padded layout, lengths (B,) tensor, start row 0
MODE_OFFSETS = 2  # packed layout, offsets (B+1,) tensor


def length_bucket(n: int) -> int:
    """Autotune key of a maximum length: the project's length bucket (next power of two), at least 16."""
    return bucket_length(max(int(n), 16))


def kernel_configs(shapes, interpret_shape, pre_hook=None, kwargs=None):
    """Configs of (BLOCK_M, BLOCK_N, warps, stages) shapes; ``pre_hook``: a variant's configs (the TMA
    loads': their hook sets the descriptors' boxes, common/ragged_tma.py); ``kwargs``: constexprs the
    variant sets (WS=True: the warp-specialized loop, common/warp_specialize.py)."""
    extra = dict(kwargs or {})
    if INTERPRET:
        m, n = interpret_shape
        return [triton.Config({"BLOCK_M": m, "BLOCK_N": n, **extra}, num_warps=4, num_stages=1,
                              pre_hook=pre_hook)]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n, **extra}, num_warps=w, num_stages=s, pre_hook=pre_hook)
            for m, n, w, s in shapes]


SHARED_MEMORY_BUDGET = 227 * 1024
"""Bytes of shared memory a block may use on Hopper. The tile estimate below matched what Triton asked
for on an H200 (256 KiB for fp32, D=128, 128x64 tiles, 3 stages: refused)."""


# per kernel: (tiles streamed per pipeline stage, tiles resident) in units of (rows x BLOCK_D) for each
# of BLOCK_M and BLOCK_N: fwd streams K and V (2 x BLOCK_N) and holds Q (BLOCK_M); dK/dV streams Q and
# dO (2 x BLOCK_M) and holds K and V (2 x BLOCK_N); dQ streams K and V and holds Q and dO.
_SMEM_TILES = {"fwd": ((0, 2), (1, 0)), "dkdv": ((2, 0), (0, 2)), "dq": ((0, 2), (2, 0))}


def _shared_memory(kind: str, block_m: int, block_n: int, stages: int, block_d: int,
                   element_size: int) -> int:
    (sm, sn), (rm, rn) = _SMEM_TILES[kind]
    if element_size == 4:  # fp32 dots run as 3xTF32: Triton keeps the transposed operands too (measured:
        sm, sn = 2 * sm, 2 * sn  # the dQ kernel at 64x64, 2 stages, D=128 asked for 256 KiB)
    rows = stages * (sm * block_m + sn * block_n) + rm * block_m + rn * block_n
    return rows * block_d * element_size


def fit_shared_memory(config, kind: str, args: dict):
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
    return triton.Config(dict(config.kwargs), num_warps=config.num_warps, num_stages=stages,
                         maxnreg=config.maxnreg, pre_hook=config.pre_hook)


_WS_REFUSES = ("HAS_BIAS", "HAS_KV_MASK", "HAS_UNIFORM", "DROPOUT")
"""Launch flags the warp-specialized configs do not serve (their one masked loop reads only the bounds)."""


def make_prune(shapes, kind, tma_shapes=None, ws_shapes=None):
    """The configs' prune: ``shapes`` (``tma_shapes``: the TMA variant's, ``ws_shapes``: the warp-specialized
    configs', WS=True, which ride on the TMA variant) map a config's (BLOCK_M, BLOCK_N, warps, stages) to the
    head dims it serves; a launch with USE_TMA keeps only the TMA variant's configs (those with a pre_hook,
    kernel_configs), one without only the others; a launch with any of ``_WS_REFUSES`` drops the WS ones."""

    def prune(configs, named_args, **kwargs):
        """Keep the configs meant for this variant and head dim whose tiles are not far larger than the
        lengths."""
        args = {**named_args, **kwargs}
        head = "small" if args.get("HEAD_D", 64) <= 64 else "large"
        lq, lk = args.get("LQ_BUCKET", 1 << 30), args.get("LK_BUCKET", 1 << 30)
        variant = [c for c in configs if (c.pre_hook is not None) == bool(args.get("USE_TMA", False))]
        if any(args.get(flag) for flag in _WS_REFUSES):
            variant = [c for c in variant if not c.kwargs.get("WS")]
            if not variant:
                raise ValueError(f"{kind} kernel: only warp-specialized configs are listed, and they do not "
                                 f"serve a launch with {', '.join(f for f in _WS_REFUSES if args.get(f))}")
        kept = []
        for c in variant:
            key = (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages)
            listed = (ws_shapes if c.kwargs.get("WS") else shapes if c.pre_hook is None else tma_shapes) or {}
            if head not in listed.get(key, ("small", "large")):
                continue
            if c.kwargs["BLOCK_M"] > max(lq, 64) or c.kwargs["BLOCK_N"] > max(lk, 64):
                continue
            kept.append(fit_shared_memory(c, kind, args))
        return kept or [fit_shared_memory(variant[0], kind, args)]

    return {"early_config_prune": prune}


@triton.jit
def sequence(Offsets, Lengths, b, max_len, total_rows, MODE: tl.constexpr):
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
def program_coordinates(Order, H, num_tiles, REVERSE: tl.constexpr):
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
def loop_split(lo, mid_lo, mid_hi, hi, all_masked):
    """A tile loop over [lo, hi) split into masked [lo, mid_lo), unmasked [mid_lo, mid_hi) and masked
    [mid_hi, hi), the bounds clamped so that each range is empty or inside [lo, hi) and they run in
    order; ``all_masked`` (a scalar: e.g. the key tile is the sequence's last, partial one) empties the
    unmasked range, so that the two masked loops visit every tile. Computed with selects, never with an
    ``if`` around the loops: a branch that chooses between loop nests makes ptxas serialize every wgmma
    of the kernel on sm_90a ("C7515 ... wgmma.mma_async instructions are serialized due to non wgmma
    instructions defining accumulator registers": the merge moves the accumulators inside the wgmma
    pipeline; tests/unit/test_wgmma_serialization_sm90.py), whereas loops with computed bounds keep
    them asynchronous."""
    hi = tl.maximum(hi, lo)
    mid_lo = tl.minimum(tl.maximum(mid_lo, lo), hi)
    mid_hi = tl.where(all_masked, mid_lo, tl.minimum(tl.maximum(mid_hi, mid_lo), hi))
    return lo, mid_lo, mid_hi, hi


WGMMA_A_REGISTERS = env_flag("GEMCOMPILE_WGMMA_A_REGISTERS", True)
"""Whether forward kernels may feed their q tile to the wgmma from registers (:func:`q_in_registers`);
GEMCOMPILE_WGMMA_A_REGISTERS=0 keeps it in shared memory (A/B timings)."""


def q_in_registers(head_dim: int) -> bool:
    """Whether a forward kernel's loop-invariant q tile goes to its S = q k^T wgmma from registers
    (:func:`in_registers`): at head dims up to 64. Measured on an H100 with the jagged forward (CUDA graphs, two
    alternating pairs, benchmarks/README.md "wgmma operands in registers"): at D 64 its kernel took 203-207 us
    against 223-226; at D 128 within 1% either way. The backward kernels' loop-invariant operands (dK/dV's k and
    v, dQ's q and dO) in registers made them slower at both head dims (more registers: up to 255 at D 128), so
    no backward kernel uses it; nor does GDPA's forward, slower with it at the HSTU shape (D 64) on an H100
    (0.055-0.057 against 0.049-0.050 ms, a scratch A/B not kept as a results file)."""
    return WGMMA_A_REGISTERS and head_dim <= 64


@triton.jit
def in_registers(x, rows_ok, ON: tl.constexpr):
    """``x`` as loaded (rows outside ``rows_ok`` are 0 already), but as a computed value: a loop-invariant
    tile that is the first operand of a loop's dots then stays in registers for the wgmma (A from registers)
    instead of being read from shared memory again by every wgmma of the loop, which Triton does for a tile
    that comes straight from a load. Costs the tile's registers (16 a thread at 64 rows x 64 columns)."""
    if ON:
        x = tl.where(rows_ok[:, None], x, 0.0)
    return x


@triton.jit
def load_rows(base, rows, offs_d, stride_r, stride_d, mask_rows, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr,
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
def dropout_stream(Seed, b64, h64, H, key_len, DROPOUT: tl.constexpr):
    """(Philox key of this (batch, head), Philox counters per query row) of the dropout draws over key_len
    keys (common/dropout.py: one counter per eight keys); without dropout a key of 0 that is never read."""
    seed = 0
    if DROPOUT:
        seed = tl.load(Seed) + b64 * H + h64
    return seed, (key_len + 7) // 8


@triton.jit
def dropout_factor(seed, rows, col_start, row_counters, drop_below, dropout_scale, BLOCK_N: tl.constexpr):
    """(rows, BLOCK_N) tile of keep / (1 - p) for the query rows ``rows`` and keys col_start + [0, BLOCK_N)
    (positions inside the sequence; col_start a multiple of 8) under the (batch, head)'s Philox key ``seed``:
    one tl.randint4x per eight keys, each key deciding on 16 bits (kept when >= drop_below), the draws of
    common/dropout.keep_mask bit for bit."""
    counters = col_start // 8 + tl.arange(0, BLOCK_N // 8)
    w0, w1, w2, w3 = tl.randint4x(seed, rows[:, None] * row_counters + counters[None, :])
    words = tl.interleave(tl.interleave(w0, w2), tl.interleave(w1, w3))  # word k of counter c at 4c + k
    halves = tl.interleave(words & 0xFFFF, words >> 16)  # key 8c + 2k + h <- 16-bit half h of word k
    return tl.where(halves.to(tl.int32) >= drop_below, dropout_scale, 0.0)


@triton.jit
def dropout_dv_dp(dv, p_t, v, do, seed, rows, n0, row_counters, drop_below, dropout_scale, BLOCK_N: tl.constexpr,
                  DOT_PRECISION: tl.constexpr):
    """A dK/dV step with dropout on the transposed probabilities p_t (keys n0 + [0, BLOCK_N) x ``rows``):
    (dv + dropout(P)^T dO, dP^T = the dropout factor times V dO^T)."""
    f_t = tl.trans(dropout_factor(seed, rows, n0, row_counters, drop_below, dropout_scale, BLOCK_N))
    dv += tl.dot((p_t * f_t).to(do.dtype), do, input_precision=DOT_PRECISION)
    return dv, tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION) * f_t


@triton.jit
def store_rows(base, rows, offs_d, stride_r, stride_d, value, mask_rows, HEAD_D: tl.constexpr):
    ptrs = base + rows.to(tl.int64)[:, None] * stride_r + offs_d[None, :] * stride_d
    tl.store(ptrs, value.to(base.dtype.element_ty), mask=mask_rows[:, None] & (offs_d < HEAD_D)[None, :])


@per_step_jit
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
    q_start, q_len = sequence(QOffsets, QLengths, b, max_q_len, total_q_rows, Q_MODE)
    if m0 >= q_len:
        return
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    start64 = q_start.to(tl.int64)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < q_len
    o = load_rows(Out + b64 * stride_ob + h64 * stride_oh + start64 * stride_om, offs_m, offs_d,
                  stride_om, stride_od, row_ok, HEAD_D, BLOCK_D, True)
    do = load_rows(DO + b64 * stride_gb + h64 * stride_gh + start64 * stride_gm, offs_m, offs_d,
                   stride_gm, stride_gd, row_ok, HEAD_D, BLOCK_D, True)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(Delta + b64 * stride_lb + h64 * stride_lh + (start64 + offs_m) * stride_lm, delta, mask=row_ok)


bwd_delta_kernel = _bwd_delta_kernel
"""delta = rowsum(dO * O) per query row (the softmax backward's correction term), one program per
(query tile, batch*head). The kernel keeps its ``_..._kernel`` name: runtime/kernel_time.py tells
gemcompile's kernels apart by it in profiles."""


class Side:
    """How a kernel finds the sequences of one side (queries or keys/values)."""

    def __init__(self, mode: int, offsets, lengths, max_len: int, total_rows: int, dummy: torch.Tensor,
                 order: torch.Tensor | None = None):
        self.mode = mode
        self.order = order
        """The longest-first order of this side's lengths when the caller has it (derived once per step in
        the graph), else None: :func:`batch_order` computes it."""
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


def batch_order(primary: Side, B: int, device) -> torch.Tensor:
    """Batch indices, longest sequence first: the side's given order (its lengths', packed or not: the graph
    derives it once per step), else a device-side stable argsort in one launch (no host sync); arange
    without lengths."""
    key = primary.sort_key()
    if key is None:
        return torch.arange(B, device=device)
    if primary.order is not None:
        return primary.order
    return longest_first_order(key)


def same_sequences(a: Side, b: Side) -> bool:
    return a.mode == b.mode and a.lengths is b.lengths and a.offsets is b.offsets


def dropout_args(dropout_p: float, dropout_seed, dummy) -> tuple:
    """(seed pointer, drop_below, keep scale) of a kernel with dropout (common/dropout.py's threshold and
    scale); without dropout a dummy pointer never read."""
    if not dropout_p:
        return dummy, 0, 1.0
    return dropout_seed, drop_threshold(dropout_p), keep_scale(dropout_p)


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs follow torch's matmul policy: near-fp32 accuracy unless the user allowed TF32. 3xTF32
    # keeps tensor cores (plain "ieee" FMA dots spill registers heavily on sm_90); half inputs ignore it.
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return "tf32x3"
    return "tf32"


def block_d(D: int) -> int:
    return max(16, triton.next_power_of_2(D))


def bhld_strides(t: torch.Tensor, batch_broadcast: bool):
    """Strides (b, h, l, d) of a padded (B, H, L, D) tensor; batch stride 0 when shared by the batch."""
    sb, sh, sl, sd = t.stride()
    return (0 if batch_broadcast else sb), sh, sl, sd


def mask_key_bounds(kv_mask: torch.Tensor, kv_lengths: torch.Tensor | None,
              given: torch.Tensor | None = None) -> torch.Tensor:
    """The (B, 3) int32 key bounds [lo, hi, holes] of a kv_mask (common/length_order.py): ``given`` when the
    graph derived them once per step, else computed here on the device (no host sync). Kernels visit key
    tiles from (lo // BLOCK_N) * BLOCK_N up to hi only; without holes the valid keys are exactly [lo, hi),
    so they mask by the bounds like the length-only path and read the mask vector only when holes."""
    return given if given is not None else key_bounds_and_span(kv_mask, kv_lengths)[0]


def kv_mask_bounds(kv_mask: torch.Tensor, kv_lengths: torch.Tensor | None, L: int):
    """(lo, hi, holes) int32 (B,) views of :func:`mask_key_bounds` (L = kv_mask.shape[1])."""
    assert kv_mask.shape[1] == L
    bounds = mask_key_bounds(kv_mask, kv_lengths)
    return bounds[:, 0], bounds[:, 1], bounds[:, 2]
