"""GDPA's bias gradient for a bias shared by batches and/or heads (HSTU's relative bias), reduced in-kernel.

dBias[bz, hz, i, j] = sum over the (b, h) that read bias[bz, hz] of c_b * m_bhij * (dO_bhi . V_bhj) *
act'(s_bhij), with s = scale q.k + bias and m the pair mask (op.py). The dQ kernel used to write that
summand for every (b, h, i, j) into a zeroed fp32 (B, H, Lq, Lk) buffer that torch then summed: on HSTU's
B32 L1024 H4 relative bias the buffer's zero fill and sum took 250 us of an 840 us forward+backward (H200,
benchmarks/results/gdpa-hstu-cudagraph-20261130-033800.json), plus the dQ kernel's 537 MB of writes.

Here one program owns a (BLOCK_M, BLOCK_N) tile of one (bz, hz) slice of the gradient and loops over the
(b, h) pairs that read it, recomputing s and dO.V^T for the tile (two small dots per pair, as in the dQ
kernel) and accumulating in fp32 registers; nothing of size B x H x Lq x Lk is written. A grid of
Lq/BLOCK_M x Lk/BLOCK_N x Bz x Hz tiles is small (256 programs for one 1024 x 1024 bias), so the loop over
pairs is split into ``splits`` interleaved parts, each writing its own fp32 partial sum; torch adds the
parts. Deterministic: no atomics, and a fixed order of additions for a given ``splits``.

Only the pairs that can reach a tile are visited. The batches come longest-query first (``Order``), so
those with q_len past the tile's first row (causal without a contextual prefix: past its first row and
column) are a prefix of that order, found by a binary search; the loop runs over that prefix with no
branch in its body. The first version
skipped unreached pairs with an ``if`` inside the loop over every pair: 169 us on HSTU's B32 L1024 H4
bias against 78 us for the dQ kernel, which does more work (H200, gdpa-hstu-cudagraph-20261130-143144);
this one takes 130 us there, and no tiling in benchmarks/gdpa_bias_grad.py's sweep does better than 125
(gdpa_bias_grad-20261130-145055).
Whatever else a pair's tile misses (columns past kv_len, targets, a window, keys a kv_mask drops) is left
to the pair mask.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from ..common.attention_triton import load_rows, per_step_jit
from ..common.tuned_launch import INTERPRET
from .pairs_triton import act_grad, key_keep, output_scale, pair_mask, query_start, sample_bounds

__all__ = ["bias_grad_parts", "bias_grad_triton", "default_splits", "full_bias_grad_supported"]


@triton.jit
def _reached_prefix(Order, QLengths, KVLengths, NumTargets, m0, n0, B, search_steps, max_q_len, max_kv_len,
                    contextual_len, Q_MODE: tl.constexpr, KV_MODE: tl.constexpr, HAS_TARGETS: tl.constexpr,
                    HAS_CONTEXT: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, total_q_rows):
    """How many batches, longest-query first, have a row in the tile (and, causal without a prefix, a
    row at or past its first column): q_len > threshold is a prefix of Order, found by binary search."""
    threshold = m0
    if CAUSAL:  # noqa: SIM102 (constexprs: no boolean operator on them in device code)
        if not HAS_CONTEXT:  # rows i >= j: a row past n0 must exist; a prefix row sees keys after it
            threshold = tl.maximum(m0, n0)
    lo = m0 * 0
    hi = lo + B
    for _ in range(search_steps):
        mid = (lo + hi) // 2
        b = tl.load(Order + tl.minimum(mid, B - 1)).to(tl.int32)
        q_len, _, _, _ = sample_bounds(QLengths, KVLengths, NumTargets, b, max_q_len, max_kv_len, contextual_len,
                                       Q_MODE, KV_MODE, HAS_TARGETS, HAS_CONTEXT, total_q_rows)
        longer = (q_len > threshold) & (mid < hi)
        lo = tl.where(longer, mid + 1, lo)
        hi = tl.where(longer, hi, mid)
    if CAUSAL:  # noqa: SIM102
        if not HAS_CONTEXT:  # a tile wholly above the diagonal has no pair
            lo = tl.where(n0 < m0 + BLOCK_M, lo, 0)
    return lo


@per_step_jit
def _gdpa_bwd_dbias_kernel(
    Q, K, V, Bias, DO, Part,
    QLengths, KVLengths, NumTargets, Order, KVMask,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_zb, stride_zh, stride_zm, stride_zn,
    stride_gb, stride_gh, stride_gm, stride_gd,
    stride_ps, stride_pz, stride_pm,
    stride_mb, stride_mn,
    B, H, Bz, Hz, splits, search_steps, max_q_len, max_kv_len, scale, out_scale, window, contextual_len,
    total_q_rows, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, Q_MODE: tl.constexpr, KV_MODE: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_TARGETS: tl.constexpr, HAS_CONTEXT: tl.constexpr,
    HAS_KV_MASK: tl.constexpr, ACT: tl.constexpr, FAST_ACT: tl.constexpr, DIVIDE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SHARED_B: tl.constexpr, SHARED_H: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(max_kv_len, BLOCK_N)
    tiles_m = tl.cdiv(max_q_len, BLOCK_M)
    tile_n = pid % tiles_n
    rest = pid // tiles_n
    tile_m = rest % tiles_m
    rest = rest // tiles_m
    zslice = rest % (Bz * Hz)  # (bz, hz) flattened
    split = rest // (Bz * Hz)
    bz = zslice // Hz
    hz = zslice % Hz
    # the (b, h) pairs that read bias[bz, hz]: every b when the bias is shared by the batch, else b = bz
    n_b = 1
    if SHARED_B:
        n_b = B
    n_h = 1
    if SHARED_H:
        n_h = H

    m0 = tile_m * BLOCK_M
    n0 = tile_n * BLOCK_N
    rows = m0 + tl.arange(0, BLOCK_M)
    cols = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    # every pair of this program reads the same tile, bias[bz, hz]: loaded once, not once per pair (the
    # pair mask below decides which of its values count)
    z_ptrs = (Bias + bz.to(tl.int64) * stride_zb + hz.to(tl.int64) * stride_zh
              + rows.to(tl.int64)[:, None] * stride_zm + cols.to(tl.int64)[None, :] * stride_zn)
    z = tl.load(z_ptrs, mask=(rows < max_q_len)[:, None] & (cols < max_kv_len)[None, :], other=0.0).to(tl.float32)
    if SHARED_B:
        n_b = _reached_prefix(Order, QLengths, KVLengths, NumTargets, m0, n0, B, search_steps, max_q_len,
                              max_kv_len, contextual_len, Q_MODE, KV_MODE, HAS_TARGETS, HAS_CONTEXT, CAUSAL,
                              BLOCK_M, total_q_rows)
    else:  # one batch: the prefix search over [bz] alone (Order is the identity then)
        n_b = _reached_prefix(Order + bz, QLengths, KVLengths, NumTargets, m0, n0, 1, 1, max_q_len, max_kv_len,
                              contextual_len, Q_MODE, KV_MODE, HAS_TARGETS, HAS_CONTEXT, CAUSAL, BLOCK_M,
                              total_q_rows)
    for pair in range(split, n_b * n_h, splits):
        b = bz
        if SHARED_B:
            b = tl.load(Order + pair // n_h).to(tl.int32)
        h = hz
        if SHARED_H:
            h = pair % n_h
        q_len, kv_len, n_targets, _ = sample_bounds(QLengths, KVLengths, NumTargets, b, max_q_len, max_kv_len,
                                                    contextual_len, Q_MODE, KV_MODE, HAS_TARGETS, HAS_CONTEXT,
                                                    total_q_rows)
        b64 = b.to(tl.int64)
        h64 = h.to(tl.int64)
        row_ok = rows < q_len
        col_ok = cols < kv_len
        if HAS_KV_MASK:  # masked-out keys load as 0 and leave the pair mask
            col_ok = col_ok & key_keep(KVMask + b64 * stride_mb, cols, col_ok, stride_mn)
        q_base = Q + b64 * stride_qb + h64 * stride_qh
        do_base = DO + b64 * stride_gb + h64 * stride_gh
        if Q_MODE == 2:  # packed queries and grad_out: rows from token_offsets[b]
            row0 = query_start(QLengths, b, total_q_rows)
            q_base += row0 * stride_qm
            do_base += row0 * stride_gm
        q = load_rows(q_base, rows, offs_d, stride_qm, stride_qd, row_ok, HEAD_D, BLOCK_D, True)
        do = load_rows(do_base, rows, offs_d, stride_gm, stride_gd, row_ok, HEAD_D, BLOCK_D, True)
        k = load_rows(K + b64 * stride_kb + h64 * stride_kh, cols, offs_d, stride_kn, stride_kd, col_ok,
                      HEAD_D, BLOCK_D, True)
        v = load_rows(V + b64 * stride_vb + h64 * stride_vh, cols, offs_d, stride_vn, stride_vd, col_ok,
                      HEAD_D, BLOCK_D, True)
        valid = pair_mask(rows[:, None], cols[None, :], q_len, kv_len, window, n_targets, contextual_len,
                          CAUSAL, HAS_WINDOW, HAS_TARGETS, HAS_CONTEXT)
        if HAS_KV_MASK:
            valid = valid & col_ok[None, :]
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale + z
        da = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = tl.where(valid, da * act_grad(s, ACT, FAST_ACT), 0.0)
        acc += ds * output_scale(out_scale, kv_len, DIVIDE)
    p_ptrs = (Part + split.to(tl.int64) * stride_ps + zslice.to(tl.int64) * stride_pz
              + rows.to(tl.int64)[:, None] * stride_pm + cols.to(tl.int64)[None, :])
    tl.store(p_ptrs, acc, mask=(rows < max_q_len)[:, None] & (cols < max_kv_len)[None, :])


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """How the gradient is tiled and launched (benchmarks/gdpa_bias_grad.py sweeps these on the GPU)."""

    block_m: int = 16 if INTERPRET else 64
    """Gradient rows per program."""
    block_n: int = 16 if INTERPRET else 64
    """Gradient columns per program."""
    num_warps: int = 4
    num_stages: int = 1 if INTERPRET else 2
    """Software-pipeline depth of the loop over pairs."""
    programs_per_sm: int = 4
    """The pair loop is split until the grid has about this many programs per SM. 4 rather than 8 since the
    table path: fewer parts for the diagonal sums to read, the kernel as fast (HSTU on the H200: 0.254
    against 0.256 ms forward+backward, results/gdpa_bias_grad-20261130-185623.json)."""


TILE_CONFIG = TileConfig()


def full_bias_grad_supported(bias: torch.Tensor, Lq: int, Lk: int) -> bool:
    """This kernel serves a bias with full (Lq, Lk) dims (any of its batch and head dims may be 1); a bias
    broadcast along rows or columns (a per-key bias) keeps the dQ kernel's buffer and torch's sum."""
    return bias.dim() == 4 and bias.shape[2] == Lq and bias.shape[3] == Lk


def default_splits(tiles: int, pairs: int, device: torch.device, programs_per_sm: int = 4) -> int:
    """Parts of the pair loop: enough programs for ``programs_per_sm`` per SM on CUDA (causal leaves half
    the tiles idle), never more parts than pairs."""
    if device.type != "cuda" or INTERPRET:
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(pairs, triton.cdiv(programs_per_sm * sms, max(tiles, 1))))


def bias_grad_parts(q, k, v, bias, Bz: int, Hz: int, grad_out, q_side, kv_side, targets, q_order, q_strides,
                    z_strides, flags: dict, scalars: tuple, splits: int | None = None, *,
                    key_mask: tuple | None = None, g_strides: tuple | None = None) -> torch.Tensor:
    """The bias gradient's fp32 partial sums, (splits, Bz * Hz, Lq, Lk): their sum is dBias[bz, hz]. ``bias``:
    the tensor the kernels read the bias through (any strides, ``z_strides``: expanded to (B, H, Lq, Lk));
    ``q_strides``, ``g_strides``: q's and grad_out's (b, h, m, d) strides as the GDPA kernels read them
    (batch stride 0 for shared or packed queries; g_strides None: grad_out's own); ``flags``: the GDPA
    kernels' constexprs (HAS_BIAS unused); ``scalars``: (H, Lq, Lk, scale, out_scale, window, contextual_len); ``key_mask``: (the kv_mask as the kernels read it, its (b, n)
    strides) when flags["HAS_KV_MASK"]."""
    B, H, Lk, _ = k.shape
    Lq = q_side.max_len  # (q.shape[2] unless q is packed)
    cfg = TILE_CONFIG
    tiles = triton.cdiv(Lq, cfg.block_m) * triton.cdiv(Lk, cfg.block_n) * Bz * Hz
    shared_b, shared_h = Bz == 1 and B > 1, Hz == 1 and H > 1
    pairs = (B if shared_b else 1) * (H if shared_h else 1)
    splits = default_splits(tiles, pairs, q.device, cfg.programs_per_sm) if splits is None else max(1, min(int(splits), pairs))
    part = torch.empty((splits, Bz * Hz, Lq, Lk), dtype=torch.float32, device=q.device)
    # q_order: the batches longest-query first (the dK/dV kernel's order; any order when q has no lengths)
    order = q_order if shared_b else torch.arange(B, device=q.device)
    _, Lq_, Lk_, scale, out_scale, window, contextual_len = scalars
    consts = {name: flags.get(name, False) for name in (
        "HEAD_D", "BLOCK_D", "Q_MODE", "KV_MODE", "CAUSAL", "HAS_WINDOW", "HAS_TARGETS", "HAS_CONTEXT",
        "HAS_KV_MASK", "ACT", "FAST_ACT", "DIVIDE", "DOT_PRECISION")}
    mask_t, m_strides = key_mask if key_mask is not None else (targets, (0, 0))  # (a dummy pointer when None)
    _gdpa_bwd_dbias_kernel[(tiles * splits,)](
        q, k, v, bias, grad_out, part, q_side.lengths, kv_side.lengths, targets, order, mask_t,
        *q_strides, *k.stride(), *v.stride(), *z_strides, *(g_strides or grad_out.stride()),
        part.stride(0), part.stride(1), part.stride(2), *m_strides,
        B, H, Bz, Hz, splits, B.bit_length(), Lq_, Lk_, scale, out_scale, window, contextual_len,
        q_side.total_rows if consts["Q_MODE"] == 2 else 0,  # T of packed queries (unread otherwise)
        SHARED_B=shared_b, SHARED_H=shared_h, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **consts)
    return part


def bias_grad_triton(q, k, v, bias, grad_out, q_side, kv_side, targets, q_order, q_strides, z_strides,
                     flags: dict, scalars: tuple, splits: int | None = None, *,
                     key_mask: tuple | None = None, g_strides: tuple | None = None) -> torch.Tensor:
    """dBias like ``bias`` (Bz, Hz, Lq, Lk): bias_grad_parts summed in order (deterministic)."""
    part = bias_grad_parts(q, k, v, bias, bias.shape[0], bias.shape[1], grad_out, q_side, kv_side, targets,
                           q_order, q_strides, z_strides, flags, scalars, splits, key_mask=key_mask,
                           g_strides=g_strides)
    total = part[0] if part.shape[0] == 1 else part.sum(0)
    return total.reshape(bias.shape).to(bias.dtype)
