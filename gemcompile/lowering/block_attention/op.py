"""``gemcompile::block_attention``: block-diagonal and/or sliding-window softmax attention over padded
sequences, with rotary embeddings on q and k fused into the kernels.

Public op (what the block_attention pass emits; the signature is fixed)::

    torch.ops.gemcompile.block_attention(Tensor q, Tensor k, Tensor v, Tensor lengths, int block,
        int window, bool causal, Tensor? cos, Tensor? sin, str rotary, float scale,
        Tensor? kv_mask=None, Tensor? kv_bounds=None, Tensor? q_lengths=None, Tensor? token_offsets=None,
        int max_len=0, float dropout_p=0.0, Tensor? dropout_seed=None) -> Tensor

q, k, v (B, H, L, D), any strides (permuted or expanded views are read in place); lengths (B,) int32 or
int64, the valid tokens of each sequence. Query row i (EVERY row < L, padded rows included, exactly as
eager padded SDPA with the boolean mask computes them) attends key j iff j < len[b], and
(block > 0) i // block == j // block, and (window >= 0) |i - j| <= window, and (causal) j <= i, and
(kv_mask given) kv_mask[b, j]. block = 0 means no block, window = -1 no window; one of them must be
given (otherwise this is jagged_attention). So padded rows of the last, partial block see that block's
valid keys; rows in blocks wholly past the length see none. A row with no allowed key is exactly 0 with
zero gradients (what SDPA's safe softmax gives). ``scale`` multiplies q.k before the softmax.

q_lengths: None (every row < L is a query row, as above) or (B,) int32/int64 on q's device: query rows
i >= q_lengths[b] (clamped into [0, L]) are not computed: exactly 0, lse +inf, zero dq, and no part in dk
and dv. The pass gives it when the model zeroes those rows after the attention (passes/masks/rows.py).

kv_mask: None or a bool (B, L) tensor on q's device, any strides (a (1, L) mask expanded to (B, L) is
read with batch stride 0). It only removes keys: positions stay absolute (holes or left padding shift
nothing), every query row is still computed, and keys it drops get exactly zero dk and dv. The pass
gives full lengths when the key mask comes from data. The kernels skip key tiles outside each sample's
[first valid key, last valid key + 1) (triton.py): ``kv_bounds`` (optional, int32 (B, 3), the key bounds of
kv_mask and lengths, common/length_order.py) when the graph derived them once per step for every op that
reads this mask (``gemcompile::key_bounds``); left out, each call derives its own. Wrong ones are refused on
CPU and under ``strict_length_checks``.

Packed layout (issue 24: the unpad pass keeps a region's tokens packed through the attention):
``token_offsets`` (B+1,) int32/int64 on q's device, the cumulative valid counts (token_offsets[0] = 0,
token_offsets[b+1] - token_offsets[b] = lengths[b] clamped into [0, L]), and ``max_len`` = L, the padded
length, an int >= 1 (positions, block ids, rotary rows and the tiles are counted in it; it cannot be
read from q, and cos/sin are absent without rotary). q, k, v are then (T, H, D), any strides (a (T, H*D)
projection viewed as (T, H, D) is read in place); token n < lengths[b] of sequence b is row
token_offsets[b] + n, at position n (rotary tables are indexed by n). The result equals the padded op
on the padded tensors restricted to the valid rows: out and dq, dk, dv are (T, H, D), lse is (T, H)
(token-major, as jagged_attention's packed lse: an unbacked T as its leading size keeps it out of the
strides, which CUDA-graph trees compare when they check a graph's inputs for overlap; an (H, T) lse
made Inductor fail with GuardOnDataDependentSymNode Eq(Max(1, u0), 1) on the H200).
Rows past a length do not exist, so q_lengths must be None (it would be lengths) and kv_mask None.
q may have rows past token_offsets[B] (T >= the valid count: the slack rows of a bucketed token index):
they belong to no sequence, their output and gradients are 0 and their lse +inf. Without token_offsets,
max_len must be 0 (L is q.shape[2]). Offsets are value-checked like lengths (CPU always, CUDA under
``strict_length_checks``).

Rotary: ``rotary`` in {"none", "half", "interleaved"}. "none" needs cos = sin = None; otherwise cos and
sin are (L, D), (B, L, D) or (1|B, 1, L, D) (shared tables are read with batch stride 0, never copied),
of any floating dtype, and q and k are rotated before the scores: x * cos + rot(x) * sin, rot =
rotate_half (cat(-x[D/2:], x[:D/2])) or rotate-every-two (out[2i] = -x[2i+1], out[2i+1] = x[2i]). v is
not rotated. The rotation runs in fp32 and is rounded once to q's dtype. cos and sin get no gradient
(an error if they require one); dq and dk are w.r.t. the un-rotated q and k.

dropout_p, dropout_seed: dropout on the attention probabilities in training, drawn in the kernels by
positions in the sequence exactly as jagged_attention draws it (common/dropout.py); the closed-form
kernels have no dropout, so a call with dropout runs the general ones.

Wiring, as every attention op (common/opkit.py says why there are three ops):
``block_attention_fwd -> (out, lse)`` and ``block_attention_bwd -> (dq, dk, dv)`` are custom ops with
fake impls and ``register_autograd``; the public op is ``CompositeImplicitAutograd`` over the fwd op, so
Dynamo sees one node and AOTAutograd splits it into the fwd and bwd ops. Plain eager CUDA calls take
one autograd.Function over the same kernels (:class:`EagerBlockAttention`).

Dispatch: CUDA runs the Triton kernels of triton.py when ``kernel_supports`` (common/checks.py) says
so (head dim a power of two in [16, 128]; not float64); anything else runs the plain-PyTorch reference
of reference.py (dense; the packed layout is padded around it).
No host syncs; length values are checked on CPU (and on CUDA under ``strict_length_checks``).

FLOPs: the fwd and bwd ops have flop_counter formulas counting useful pairs (i, j < len, allowed) from
the actual lengths and kv_mask (the padded count when they are fake): forward 4*H*D*pairs, backward 2.5x.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from ..common import checks
from ..common.flops import BACKWARD_FLOPS_RATIO, forward_flops
from ..common.dropout import check_dropout, new_seed
from ..common.length_order import check_plan, check_plan_values, key_bounds
from ..common.opkit import (LIB, contiguous_vectors, cuda_kernel, ignoring_plan, input_grads, is_fake,
                           save_for_backward, takes_eager_path, use_triton)
from ..common.reference import compute_dtype
from .flops import block_attention_pairs, padded_block_attention_pairs
from .reference import ROTARY_MODES, reference_backward, reference_forward

__all__ = ["EagerBlockAttention", "block_attention", "check_block_attention_args"]

_INPUTS = 18  # q, k, v, lengths, block, window, causal, cos, sin, rotary, scale, kv_mask, kv_bounds,
# q_lengths, token_offsets, max_len, dropout_p, dropout_seed


# ---------------------------------------------------------------------------------------------------
# Argument checks (metadata only: they run on fake tensors too)


def _check_table(name: str, t, B: int, L: int, D: int, device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor when rotary is on, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}; every tensor must be on one device")
    shape = tuple(t.shape)
    ok = (
        (t.dim() == 2 and shape == (L, D))
        or (t.dim() == 3 and shape[0] in (1, B) and shape[1:] == (L, D))
        or (t.dim() == 4 and shape[0] in (1, B) and shape[1] == 1 and shape[2:] == (L, D))
    )
    if not ok:
        raise ValueError(
            f"{name} must be (L, D), (B, L, D) or (B, 1, L, D) with B in {{1, {B}}}, L = {L}, D = {D}; "
            f"got shape {shape}"
        )


def _check_packed(q, k, v, lengths, token_offsets, max_len, kv_mask, q_lengths) -> tuple[int, int, int]:
    """The packed layout's metadata checks; returns (B, L, D)."""
    checks.check_qkv_tensors(q, k, v, 3, "(tokens, heads, head_dim) with token_offsets")
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"q, k and v must have one shape (T, H, D), got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if not isinstance(lengths, torch.Tensor) or lengths.dim() != 1:
        raise ValueError("lengths must be a 1-D (B,) tensor")
    B = lengths.shape[0]
    checks.check_index_vector("lengths", lengths, B, "B", q.device)
    checks.check_index_vector("token_offsets", token_offsets, B + 1, "B + 1", q.device)
    if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
        raise ValueError(f"max_len (the padded length L) must be an int >= 1 with token_offsets, "
                         f"got {max_len!r}")
    if kv_mask is not None:
        raise ValueError("kv_mask is not supported with token_offsets (the packed layout holds exactly the "
                         "tokens below lengths)")
    if q_lengths is not None:
        raise ValueError("q_lengths must be None with token_offsets: the packed rows are exactly the rows "
                         "below lengths (no other query row exists)")
    return B, int(max_len), q.shape[-1]


def check_block_attention_args(q, k, v, lengths, block, window, causal, cos, sin, rotary, scale,
                               kv_mask=None, kv_bounds=None, q_lengths=None, token_offsets=None,
                               max_len=0, dropout_p=0.0, dropout_seed=None) -> None:
    """TypeError/ValueError naming the argument for anything the op does not accept."""
    if token_offsets is not None:
        B, L, D = _check_packed(q, k, v, lengths, token_offsets, max_len, kv_mask, q_lengths)
    else:
        if max_len != 0:
            raise ValueError(f"max_len is the padded length of packed q, k, v: give it only with "
                             f"token_offsets (0 otherwise), got {max_len!r}")
        checks.check_qkv_tensors(q, k, v, 4, "(batch, heads, length, head_dim)")
        if k.shape != q.shape or v.shape != q.shape:
            raise ValueError(
                f"q, k and v must have one shape (B, H, L, D) (self-attention), got q {tuple(q.shape)}, "
                f"k {tuple(k.shape)}, v {tuple(v.shape)}"
            )
        B, _, L, D = q.shape
        checks.check_index_vector("lengths", lengths, B, "B", q.device)
    if q_lengths is not None:
        checks.check_index_vector("q_lengths", q_lengths, B, "B", q.device)
    for name, value in (("block", block), ("window", window)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if block < 0:
        raise ValueError(f"block must be >= 0 (0: no block constraint), got {block}")
    if window < -1:
        raise ValueError(f"window must be >= -1 (-1: no window), got {window}")
    if block == 0 and window == -1:
        raise ValueError(
            "block_attention needs a block (block > 0) or a window (window >= 0); without either it is "
            "plain jagged attention: use gemcompile::jagged_attention"
        )
    checks.check_flags(causal, scale)
    check_dropout(dropout_p, dropout_seed, L, L, q.device)
    checks.check_kv_mask(kv_mask, B, L, q.device)
    check_plan(B, q.device, kv_mask, kv_bounds=kv_bounds)
    if not isinstance(rotary, str) or rotary not in ROTARY_MODES:
        raise ValueError(f"rotary must be one of {ROTARY_MODES}, got {rotary!r}")
    if rotary == "none":
        if cos is not None or sin is not None:
            raise ValueError("cos and sin must be None when rotary is 'none' (say 'half' or 'interleaved')")
        return
    if D % 2:
        raise ValueError(f"rotary needs an even head dim, got {D}")
    _check_table("cos", cos, B, L, D, q.device)
    _check_table("sin", sin, B, L, D, q.device)


def _check_tables_need_no_grad(cos, sin) -> None:
    for name, t in (("cos", cos), ("sin", sin)):
        if t is not None and t.requires_grad and torch.is_grad_enabled():
            raise ValueError(
                f"{name} requires grad, but block_attention gives the rotary tables no gradient; pass "
                f"{name}.detach() (or compute it under torch.no_grad())"
            )


def _check_values(q, lengths, kv_mask=None, kv_bounds=None, q_lengths=None, token_offsets=None,
                  max_len=0) -> None:
    L = max_len if token_offsets is not None else q.shape[2]
    checks.check_length_values("lengths", lengths, L)
    checks.check_length_values("q_lengths", q_lengths, L)
    if kv_bounds is not None and checks.should_check_values(kv_bounds):
        check_plan_values(None, lengths, kv_mask, kv_bounds=kv_bounds)
    if token_offsets is not None and checks.should_check_values(token_offsets):
        want = torch.cat([lengths.new_zeros(1), lengths.clamp(0, L).cumsum(0)]).to(token_offsets.device)
        # rows past the last offset (a bucketed token index's slack rows) belong to no sequence: output 0
        if not torch.equal(token_offsets.long(), want.long()) or int(want[-1]) > q.shape[0]:
            raise ValueError(f"token_offsets must be [0, cumsum(lengths)] ending at most at T = {q.shape[0]} "
                             f"(the rows of q), got {token_offsets.tolist()} for lengths {lengths.tolist()}")


def _kernels(q: Tensor, block: int, window: int):
    """(forward, backward): the Triton launchers when the kernels serve the call (imported lazily: CPU-only
    installs never need triton), else the dense reference."""
    if use_triton(q) and checks.kernel_supports(block, window, q.shape[-1]) is None:
        from . import triton as kernels

        return (contiguous_vectors(kernels.block_attention_forward_triton),
                contiguous_vectors(kernels.block_attention_backward_triton))
    return ignoring_plan(reference_forward), ignoring_plan(reference_backward)


# ---------------------------------------------------------------------------------------------------
# Forward


@torch.library.custom_op("gemcompile::block_attention_fwd", mutates_args=())
def block_attention_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lengths: Tensor,
    block: int,
    window: int,
    causal: bool,
    cos: Tensor | None,
    sin: Tensor | None,
    rotary: str,
    scale: float,
    kv_mask: Tensor | None = None,
    kv_bounds: Tensor | None = None,
    q_lengths: Tensor | None = None,
    token_offsets: Tensor | None = None,
    max_len: int = 0,
    dropout_p: float = 0.0,
    dropout_seed: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """(out (B, H, L, D), lse (B, H, L) fp32 (fp64 for fp64); +inf on rows without an allowed key).
    Packed: (out (T, H, D), lse (T, H))."""
    return _forward(q, k, v, lengths, block, window, causal, cos, sin, rotary, scale, kv_mask, kv_bounds,
                    q_lengths, token_offsets, max_len, dropout_p, dropout_seed)


def _forward(q, k, v, lengths, block, window, causal, cos, sin, rotary, scale, kv_mask, kv_bounds,
             q_lengths, token_offsets, max_len, dropout_p=0.0, dropout_seed=None):
    check_block_attention_args(q, k, v, lengths, block, window, causal, cos, sin, rotary, scale, kv_mask,
                               kv_bounds, q_lengths, token_offsets, max_len, dropout_p, dropout_seed)
    _check_values(q, lengths, kv_mask, kv_bounds, q_lengths, token_offsets, max_len)
    # the reference on CPU (tests may route CPU tensors to the interpreter)
    forward, _ = _kernels(q, block, window)
    return forward(q, k, v, lengths, block, window, causal, cos, sin, rotary, scale, kv_mask,
                   kv_bounds=kv_bounds, q_lengths=q_lengths, token_offsets=token_offsets, max_len=max_len,
                   **_dropout(dropout_p, dropout_seed))


def _dropout(dropout_p, dropout_seed) -> dict:
    """The launchers' dropout keywords (none without dropout: the calls are unchanged)."""
    return {"dropout_p": dropout_p, "dropout_seed": dropout_seed} if dropout_p else {}


@cuda_kernel(block_attention_fwd)
def _block_attention_fwd_cuda(q, k, v, lengths, block, window, causal, cos, sin, rotary, scale, kv_mask=None,
                              kv_bounds=None, q_lengths=None, token_offsets=None, max_len=0, dropout_p=0.0,
                              dropout_seed=None):
    return _forward(q, k, v, lengths, block, window, causal, cos, sin, rotary, scale, kv_mask, kv_bounds,
                    q_lengths, token_offsets, max_len, dropout_p, dropout_seed)


@block_attention_fwd.register_fake
def _block_attention_fwd_fake(q, k, v, lengths, block, window, causal, cos, sin, rotary, scale, kv_mask=None,
                              kv_bounds=None, q_lengths=None, token_offsets=None, max_len=0, dropout_p=0.0,
                              dropout_seed=None):
    check_block_attention_args(q, k, v, lengths, block, window, causal, cos, sin, rotary, scale, kv_mask,
                               kv_bounds, q_lengths, token_offsets, max_len, dropout_p, dropout_seed)
    lse_dtype = compute_dtype(q.dtype)
    if token_offsets is not None:
        T, H, D = q.shape
        return q.new_empty((T, H, D)), q.new_empty((T, H), dtype=lse_dtype)
    B, H, L, D = q.shape
    return q.new_empty((B, H, L, D)), q.new_empty((B, H, L), dtype=lse_dtype)


# ---------------------------------------------------------------------------------------------------
# Backward


@torch.library.custom_op("gemcompile::block_attention_bwd", mutates_args=())
def block_attention_bwd(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    lengths: Tensor,
    block: int,
    window: int,
    causal: bool,
    cos: Tensor | None,
    sin: Tensor | None,
    rotary: str,
    scale: float,
    kv_mask: Tensor | None = None,
    kv_bounds: Tensor | None = None,
    q_lengths: Tensor | None = None,
    token_offsets: Tensor | None = None,
    max_len: int = 0,
    dropout_p: float = 0.0,
    dropout_seed: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv), contiguous, shaped and typed like q, k, v; dq, dk w.r.t. the un-rotated q, k."""
    return _block_attention_bwd_cuda(grad_out, q, k, v, out, lse, lengths, block, window, causal, cos, sin,
                                     rotary, scale, kv_mask, kv_bounds, q_lengths, token_offsets, max_len,
                                     dropout_p, dropout_seed)


@cuda_kernel(block_attention_bwd)
def _block_attention_bwd_cuda(grad_out, q, k, v, out, lse, lengths, block, window, causal, cos, sin, rotary,
                              scale, kv_mask=None, kv_bounds=None, q_lengths=None, token_offsets=None,
                              max_len=0, dropout_p=0.0, dropout_seed=None):
    _, backward = _kernels(q, block, window)
    return backward(grad_out, q, k, v, out, lse, lengths, block, window, causal, cos, sin, rotary, scale,
                    kv_mask, kv_bounds=kv_bounds, q_lengths=q_lengths, token_offsets=token_offsets,
                    max_len=max_len, **_dropout(dropout_p, dropout_seed))


@block_attention_bwd.register_fake
def _block_attention_bwd_fake(grad_out, q, k, v, out, lse, lengths, block, window, causal, cos, sin, rotary,
                              scale, kv_mask=None, kv_bounds=None, q_lengths=None, token_offsets=None,
                              max_len=0, dropout_p=0.0, dropout_seed=None):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _fwd_setup_context(ctx, inputs, output):
    (q, k, v, lengths, block, window, causal, cos, sin, rotary, scale, kv_mask, kv_bounds, q_lengths,
     token_offsets, max_len, dropout_p, dropout_seed) = inputs
    if ctx.needs_input_grad[7] or ctx.needs_input_grad[8]:
        _check_tables_need_no_grad(cos, sin)
    out, lse = output
    save_for_backward(ctx, (q, k, v, out, lse, lengths, cos, sin, kv_mask, kv_bounds, q_lengths,
                            token_offsets, dropout_seed), (block, window, causal, rotary, scale, max_len,
                                                           dropout_p), lse=lse)


def _fwd_backward(ctx, grad_out, grad_lse):
    # grad_lse is ignored: lse is an internal, non-differentiable output
    (q, k, v, out, lse, lengths, cos, sin, kv_mask, kv_bounds, q_lengths, token_offsets,
     dropout_seed) = ctx.saved_tensors
    block, window, causal, rotary, scale, max_len, dropout_p = ctx.args
    dq, dk, dv = torch.ops.gemcompile.block_attention_bwd(
        grad_out, q, k, v, out, lse, lengths, block, window, causal, cos, sin, rotary, scale, kv_mask,
        kv_bounds, q_lengths, token_offsets, max_len, dropout_p, dropout_seed
    )
    return input_grads(_INPUTS, dq, dk, dv)


block_attention_fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup_context)


# ---------------------------------------------------------------------------------------------------
# The eager fast path (common/opkit.py says why)


class EagerBlockAttention(torch.autograd.Function):
    """out = block_attention(q, k, v, lengths, block, window, causal, cos, sin, rotary, scale, kv_mask);
    arguments checked by the caller. The lse stays inside the Function: no gradient is materialized for it."""

    @staticmethod
    def forward(ctx, q, k, v, lengths, block, window, causal, cos, sin, rotary, scale, kv_mask=None,
                kv_bounds=None, q_lengths=None, token_offsets=None, max_len=0, dropout_p=0.0, dropout_seed=None):
        _check_values(q, lengths, kv_mask, kv_bounds, q_lengths, token_offsets, max_len)
        forward, _ = _kernels(q, block, window)
        if kv_mask is not None and kv_bounds is None:  # derived once here and saved: the backward reuses it
            kv_bounds = key_bounds(kv_mask, lengths)
        out, lse = forward(q, k, v, lengths, block, window, causal, cos, sin, rotary, scale, kv_mask,
                           kv_bounds=kv_bounds, q_lengths=q_lengths, token_offsets=token_offsets,
                           max_len=max_len, **_dropout(dropout_p, dropout_seed))
        save_for_backward(ctx, (q, k, v, out, lse, lengths, cos, sin, kv_mask, kv_bounds, q_lengths,
                                token_offsets, dropout_seed), (block, window, causal, rotary, scale, max_len,
                                                               dropout_p))
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (q, k, v, out, lse, lengths, cos, sin, kv_mask, kv_bounds, q_lengths, token_offsets,
         dropout_seed) = ctx.saved_tensors
        block, window, causal, rotary, scale, max_len, dropout_p = ctx.args
        _, backward = _kernels(q, block, window)
        dq, dk, dv = backward(grad_out, q, k, v, out, lse, lengths, block, window, causal, cos, sin, rotary,
                              scale, kv_mask, kv_bounds=kv_bounds, q_lengths=q_lengths,
                              token_offsets=token_offsets, max_len=max_len, **_dropout(dropout_p, dropout_seed))
        return input_grads(_INPUTS, dq, dk, dv)


# ---------------------------------------------------------------------------------------------------
# The public op


LIB.define(
    "block_attention(Tensor q, Tensor k, Tensor v, Tensor lengths, int block, int window, bool causal, "
    "Tensor? cos, Tensor? sin, str rotary, float scale, Tensor? kv_mask=None, Tensor? kv_bounds=None, "
    "Tensor? q_lengths=None, Tensor? token_offsets=None, int max_len=0, float dropout_p=0.0, "
    "Tensor? dropout_seed=None) -> Tensor"
)


def _block_attention_composite(q, k, v, lengths, block, window, causal, cos, sin, rotary, scale,
                               kv_mask=None, kv_bounds=None, q_lengths=None, token_offsets=None, max_len=0,
                               dropout_p=0.0, dropout_seed=None):
    check_block_attention_args(q, k, v, lengths, block, window, causal, cos, sin, rotary, scale, kv_mask,
                               kv_bounds, q_lengths, token_offsets, max_len, dropout_p, dropout_seed)
    _check_tables_need_no_grad(cos, sin)
    if takes_eager_path(q):  # plain eager CUDA call: the same kernels, less host time
        return EagerBlockAttention.apply(q, k, v, lengths, block, window, causal, cos, sin, rotary, scale,
                                         kv_mask, kv_bounds, q_lengths, token_offsets, max_len, dropout_p,
                                         dropout_seed)
    return torch.ops.gemcompile.block_attention_fwd(
        q, k, v, lengths, block, window, causal, cos, sin, rotary, scale, kv_mask, kv_bounds, q_lengths,
        token_offsets, max_len, dropout_p, dropout_seed
    )[0]


LIB.impl("block_attention", _block_attention_composite, "CompositeImplicitAutograd")


def block_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lengths: Tensor,
    block: int = 0,
    window: int = -1,
    causal: bool = False,
    cos: Tensor | None = None,
    sin: Tensor | None = None,
    rotary: str = "none",
    scale: float | None = None,
    kv_mask: Tensor | None = None,
    kv_bounds: Tensor | None = None,
    q_lengths: Tensor | None = None,
    token_offsets: Tensor | None = None,
    max_len: int = 0,
    dropout_p: float = 0.0,
    dropout_seed: Tensor | None = None,
) -> Tensor:
    """Python convenience wrapper of ``torch.ops.gemcompile.block_attention`` (scale defaults to D**-0.5).

    Example: 64-token blocks with rotate-half RoPE on q and k::

        out = block_attention(q, k, v, lengths, block=64, cos=cos, sin=sin, rotary="half")
    """
    if scale is None and isinstance(q, torch.Tensor):
        scale = q.shape[-1] ** -0.5
    # checked here too so that a wrongly typed argument gets our message, not the dispatcher's
    if dropout_p and dropout_seed is None:
        dropout_seed = new_seed(q.device)
    check_block_attention_args(q, k, v, lengths, block, window, causal, cos, sin, rotary, scale, kv_mask,
                               kv_bounds, q_lengths, token_offsets, max_len, float(dropout_p), dropout_seed)
    return torch.ops.gemcompile.block_attention(
        q, k, v, lengths, block, window, causal, cos, sin, rotary, float(scale), kv_mask, kv_bounds,
        q_lengths, token_offsets, max_len, float(dropout_p), dropout_seed
    )


# ---------------------------------------------------------------------------------------------------
# FLOP formulas (raw tensors: the lengths and kv_mask are read when they are real; padded count when fake)


def _forward_flops(q, lengths, block, window, causal, kv_mask=None, token_offsets=None, max_len=0) -> int:
    if token_offsets is not None:  # packed (T, H, D): the same pairs, counted from lengths and max_len
        (_, H, D), B, L = q.shape, lengths.shape[0], max_len
    else:
        B, H, L, D = q.shape
    if is_fake(lengths) or (kv_mask is not None and is_fake(kv_mask)):
        pairs = padded_block_attention_pairs(B, L, block, window, causal)
    else:
        pairs = block_attention_pairs(lengths, L, block, window, causal, kv_mask)
    return forward_flops(H, D, pairs)


@register_flop_formula(torch.ops.gemcompile.block_attention_fwd, get_raw=True)
def _fwd_flops(q, k, v, lengths, block, window, causal, cos=None, sin=None, rotary="none", scale=1.0,
               kv_mask=None, kv_bounds=None, q_lengths=None, token_offsets=None, max_len=0, dropout_p=0.0,
               dropout_seed=None, *, out_val=None, **kwargs) -> int:
    return _forward_flops(q, lengths, block, window, causal, kv_mask, token_offsets, max_len)


@register_flop_formula(torch.ops.gemcompile.block_attention_bwd, get_raw=True)
def _bwd_flops(grad_out, q, k, v, out, lse, lengths, block, window, causal, cos=None, sin=None,
               rotary="none", scale=1.0, kv_mask=None, kv_bounds=None, q_lengths=None, token_offsets=None,
               max_len=0, dropout_p=0.0, dropout_seed=None, *, out_val=None, **kwargs) -> int:
    flops = _forward_flops(q, lengths, block, window, causal, kv_mask, token_offsets, max_len)
    return int(BACKWARD_FLOPS_RATIO * flops)
