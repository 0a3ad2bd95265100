"""GDPA's per-pair device helpers, shared by the main kernels (triton.py) and the bias-gradient kernel
(bias_grad_triton.py): which pairs of a sequence are valid (:func:`sample_bounds`, :func:`pair_mask`, with
HSTU's targets and contextual prefix on clamped ids; a key mask: :func:`key_keep`, :func:`masked_key_range`),
what a pair contributes (:func:`act`, its derivative :func:`act_grad`; ACT = the activation's index in
GDPA_ACTIVATIONS) and the per-batch output scale (:func:`output_scale`). Semantics: op.py.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..common.attention_triton import KV_BOUNDS_WIDTH, sequence

__all__ = ["act", "act_grad", "key_keep", "masked_key_range", "output_scale", "pair_mask", "query_start",
           "sample_bounds"]


_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
_INV_SQRT_2 = tl.constexpr(0.7071067811865476)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)
_GELU_TANH_C = tl.constexpr(0.044715)


@triton.jit
def _tanh_sfu(x):
    """tanh(x) in one special-function-unit instruction (PTX tanh.approx.f32, sm_75+: max relative error
    about 2^-11, below the 2^-9 of the bf16/fp16 operand the activation is cast to)."""
    return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                                     pack=1)


@triton.jit
def _sigmoid(x, FAST_ACT: tl.constexpr):
    """sigmoid(x) in fp32. tl.sigmoid is 1 / (1 + exp(-x)): two SFU instructions (ex2, and the reciprocal
    of the division), and with D = 64 the SFU, not the tensor cores, bounds the loop (16 SFU results per
    clock per SM against 4096 bf16 FLOPs: 2 per score cost twice the 4 D FLOPs of the forward's two dots).
    FAST_ACT: 0.5 + 0.5 tanh(x / 2), one SFU instruction."""
    if FAST_ACT:
        y = 0.5 + 0.5 * _tanh_sfu(0.5 * x)
    else:
        y = tl.sigmoid(x)
    return y


@triton.jit
def act(x, ACT: tl.constexpr, FAST_ACT: tl.constexpr):
    """act(x) in fp32."""
    if ACT == 0:  # identity
        y = x
    elif ACT == 1:  # relu
        y = tl.maximum(x, 0.0)
    elif ACT == 2:  # relu_squared
        r = tl.maximum(x, 0.0)
        y = r * r
    elif ACT == 3:  # silu
        y = x * _sigmoid(x, FAST_ACT)
    elif ACT == 4:  # sigmoid
        y = _sigmoid(x, FAST_ACT)
    elif ACT == 5:  # gelu (erf)
        y = 0.5 * x * (1.0 + tl.math.erf(x * _INV_SQRT_2))
    else:  # gelu_tanh: 0.5 x (1 + tanh(u)) = x sigmoid(2u)
        u = _SQRT_2_OVER_PI * (x + _GELU_TANH_C * x * x * x)
        y = x * _sigmoid(2.0 * u, FAST_ACT)
    return y


@triton.jit
def act_grad(x, ACT: tl.constexpr, FAST_ACT: tl.constexpr):
    """act'(x) in fp32 (relu, relu_squared: 0 at 0, as torch's autograd)."""
    if ACT == 0:
        g = tl.full(x.shape, 1.0, tl.float32)
    elif ACT == 1:
        g = tl.where(x > 0.0, 1.0, 0.0)
    elif ACT == 2:
        g = 2.0 * tl.maximum(x, 0.0)
    elif ACT == 3:
        sg = _sigmoid(x, FAST_ACT)
        g = sg * (1.0 + x * (1.0 - sg))
    elif ACT == 4:
        sg = _sigmoid(x, FAST_ACT)
        g = sg * (1.0 - sg)
    elif ACT == 5:
        g = 0.5 * (1.0 + tl.math.erf(x * _INV_SQRT_2)) + x * tl.exp(-0.5 * x * x) * _INV_SQRT_2PI
    else:
        u = _SQRT_2_OVER_PI * (x + _GELU_TANH_C * x * x * x)
        du = _SQRT_2_OVER_PI * (1.0 + 3.0 * _GELU_TANH_C * x * x)
        sg = _sigmoid(2.0 * u, FAST_ACT)
        g = sg + 2.0 * x * sg * (1.0 - sg) * du
    return g


@triton.jit
def _clamped_visible(i, j, kv_len, window, n_targets, ctx, HAS_WINDOW: tl.constexpr,
                     HAS_TARGETS: tl.constexpr, HAS_CONTEXT: tl.constexpr):
    """HSTU's causal visibility on clamped ids (targets, contextual prefix); see op.py."""
    ii = i
    jj = j
    m = kv_len
    if HAS_CONTEXT:
        ii = tl.maximum(i - ctx + 1, 0)
        jj = tl.maximum(j - ctx + 1, 0)
        m = kv_len - ctx + 1
    if HAS_TARGETS:
        m = m - n_targets
        ii = tl.minimum(ii, m)
        jj = tl.minimum(jj, m)
    d = ii - jj
    visible = (i == j) | (d > 0)
    if HAS_WINDOW:
        visible = visible & (d <= window)
    if HAS_CONTEXT:
        visible = visible | ((ii == 0) & (jj < m))
    return visible


@triton.jit
def pair_mask(i, j, q_len, kv_len, window, n_targets, ctx, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
              HAS_TARGETS: tl.constexpr, HAS_CONTEXT: tl.constexpr):
    """Valid pairs, from broadcastable 2-D query indices i and key indices j (e.g. rows[:, None] and
    cols[None, :]; the dK/dV kernel passes them the other way round, so no transpose is needed).
    n_targets (this sequence's targets) and ctx (the contextual length) are read only under their flag."""
    valid = (i < q_len) & (j < kv_len)
    # two arms rather than `HAS_TARGETS or HAS_CONTEXT`: no boolean operator on constexprs in device code
    if HAS_TARGETS:  # (causal implied)
        valid = valid & _clamped_visible(i, j, kv_len, window, n_targets, ctx, HAS_WINDOW, HAS_TARGETS,
                                         HAS_CONTEXT)
    elif HAS_CONTEXT:
        valid = valid & _clamped_visible(i, j, kv_len, window, n_targets, ctx, HAS_WINDOW, HAS_TARGETS,
                                         HAS_CONTEXT)
    else:
        if CAUSAL:
            valid = valid & (j <= i)
        if HAS_WINDOW:
            dist = i - j
            if CAUSAL:
                valid = valid & (dist <= window)
            else:
                valid = valid & (dist <= window) & (dist >= -window)
    return valid


@triton.jit
def _history_len(kv_len, n_targets, ctx, HAS_TARGETS: tl.constexpr, HAS_CONTEXT: tl.constexpr):
    """u in [0, kv_len]: with targets or a contextual prefix (causal), a key j < u is seen by every row
    i > j and by the contextual rows i < ctx; keys j >= u (the targets) only by themselves. u = kv_len - t
    when kv_len - t >= ctx (clamped id m >= 1), else 0; kv_len without either."""
    u = kv_len
    if HAS_TARGETS:
        u = kv_len - n_targets
    if HAS_CONTEXT:
        u = tl.where(u >= ctx, u, 0)
    return tl.minimum(tl.maximum(u, 0), kv_len)


@triton.jit
def sample_bounds(QLengths, KVLengths, NumTargets, b, max_q_len, max_kv_len, ctx, Q_MODE: tl.constexpr,
                  KV_MODE: tl.constexpr, HAS_TARGETS: tl.constexpr, HAS_CONTEXT: tl.constexpr, total_q_rows):
    """Batch b's (q_len, kv_len, number of targets, history length u): what every kernel reads first.
    Packed queries (Q_MODE 2): QLengths holds token_offsets and total_q_rows is T (else unused)."""
    _, q_len = sequence(QLengths, QLengths, b, max_q_len, total_q_rows, Q_MODE)
    _, kv_len = sequence(KVLengths, KVLengths, b, max_kv_len, max_kv_len, KV_MODE)
    n_targets = b * 0
    if HAS_TARGETS:  # used as given (no clamp): it only shapes the mask and the (clamped) loop bounds
        n_targets = tl.load(NumTargets + b).to(tl.int32)
    return q_len, kv_len, n_targets, _history_len(kv_len, n_targets, ctx, HAS_TARGETS, HAS_CONTEXT)


@triton.jit
def query_start(QOffsets, b, total_q_rows):
    """Packed queries: the int64 row of batch b's first query, token_offsets[b] clamped into [0, T] as
    common/attention_triton.sequence clamps it (no access leaves q)."""
    start = tl.load(QOffsets + b).to(tl.int64)
    return tl.minimum(tl.maximum(start, 0), total_q_rows)


@triton.jit
def output_scale(out_scale, kv_len, DIVIDE: tl.constexpr):
    c = out_scale
    if DIVIDE:
        c = out_scale / tl.maximum(kv_len, 1).to(tl.float32)
    return c


@triton.jit
def key_keep(mask_base, cols, col_ok, stride_mn):
    """kv_mask[b, cols] as a bool vector, False where not col_ok (mask_base: the mask's row b, uint8)."""
    return tl.load(mask_base + cols.to(tl.int64) * stride_mn, mask=col_ok, other=0) != 0


@triton.jit
def masked_key_range(KVBounds, b, lo, mid_lo, mid_hi, hi, BLOCK_N: tl.constexpr):
    """A query tile's key range (lo, mid_lo, mid_hi, hi) cut to batch b's kv_mask span [kv_lo, kv_hi)
    (KVBounds: the (B, 3) int32 key bounds [lo, hi, holes], common/length_order.py): tiles wholly in left or
    right padding are not visited. lo stays a multiple of BLOCK_N and the unmasked tiles [mid_lo, mid_hi)
    stay whole (below kv_hi)."""
    kv_lo = tl.load(KVBounds + KV_BOUNDS_WIDTH * b)
    kv_hi = tl.load(KVBounds + KV_BOUNDS_WIDTH * b + 1)
    lo = tl.maximum(lo, (kv_lo // BLOCK_N) * BLOCK_N)
    hi = tl.maximum(tl.minimum(hi, kv_hi), lo)
    mid_hi = tl.minimum(mid_hi, (kv_hi // BLOCK_N) * BLOCK_N)
    mid_lo = tl.minimum(tl.maximum(mid_lo, lo), hi)
    mid_hi = tl.minimum(tl.maximum(mid_hi, mid_lo), hi)
    return lo, mid_lo, mid_hi, hi
