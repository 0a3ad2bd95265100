"""The block_attention pass: block-diagonal and sliding-window attention written the ways modelers write
it (SDPA with bool or additive masks, hand-written softmax), with RoPE just before in either convention,
is rewritten to gemcompile::block_attention with eager's outputs and gradients at the rows the model
defines; near-misses are left alone with a reason."""

import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from gemcompile import GemConfig, explain, gem_compile

B, H, L, D = 3, 2, 40, 16
LQ = 20  # queries of a cross-attention near-miss


def key_mask(n, length=L):
    return torch.arange(length)[None, :] < n[:, None]  # (B, length)


def blocks(b):
    i = torch.arange(L)
    return (i // b)[:, None] == (i // b)[None, :]  # (L, L)


def band(w, causal=False):
    i = torch.arange(L)
    d = i[:, None] - i[None, :]
    return ((d >= 0) & (d <= w)) if causal else (d.abs() <= w)


# -- RoPE, written the ways models write it ----------------------------------------------------------------

def inv_freq():
    return 1.0 / 10000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D)  # (D/2,)


def half_tables(angles):
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos(), emb.sin()


def interleaved_tables(angles):
    emb = angles.repeat_interleave(2, dim=-1)
    return emb.cos(), emb.sin()


def position_angles():
    return torch.arange(L, dtype=torch.float32)[:, None] * inv_freq()[None, :]  # (L, D/2)


def time_gap_angles(times):
    """Per-sample angles from the time gaps between events (B, L) -> (B, L, D/2)."""
    gaps = (times - times[:, :1]).clamp(min=0)
    return torch.log1p(gaps)[..., None] * inv_freq()


def rotate_half_chunk(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_half_slices(x):
    return torch.cat((-x[..., D // 2:], x[..., : D // 2]), dim=-1)


def rotate_half_split_minus(x):
    """The opposite-sign spelling, used as x * cos - rot(x) * sin."""
    x1, x2 = torch.split(x, D // 2, dim=-1)
    return torch.cat((x2, -x1), dim=-1)


def rotate_interleaved(x):
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def rotate_interleaved_unbind(x):
    x0, x1 = x.unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack((-x1, x0), dim=-1).reshape(x.shape)


def rope(x, cos, sin, rotate=rotate_half_chunk):
    return x * cos + rotate(x) * sin


# -- idioms: (q, k, v, lengths, extra) -> out (B, H, L, D) -------------------------------------------------

def sdpa_block16_bool(q, k, v, n, x):
    """GEM-ref's spelling: block ids compared, AND the key padding."""
    mask = blocks(16)[None, None] & key_mask(n)[:, None, None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def sdpa_block32_additive(q, k, v, n, x):
    keep = blocks(32)[None, None] & key_mask(n)[:, None, None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(1.0 - keep.float()) * -1e9)


def sdpa_block32_additive_inf(q, k, v, n, x):
    keep = blocks(32)[None, None] & key_mask(n)[:, None, None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.zeros(keep.shape).masked_fill(~keep, -math.inf))


def hand_block64_div_floor_masked_fill(q, k, v, n, x):
    i = torch.arange(L)
    ids = torch.div(i, 64, rounding_mode="floor")
    keep = (ids[None, :] == ids[:, None]) & key_mask(n)[:, None, :]  # (B, L, L)
    s = q @ k.transpose(-2, -1) / math.sqrt(D)
    return torch.softmax(s.masked_fill(~keep[:, None], float("-inf")), dim=-1) @ v


def hand_block16_where_causal(q, k, v, n, x):
    causal = torch.tril(torch.ones(L, L, dtype=torch.bool))
    keep = blocks(16) & causal & key_mask(n)[:, None, None, :]
    s = torch.matmul(q, k.transpose(2, 3)) * 0.25
    return F.softmax(torch.where(keep, s, torch.finfo(s.dtype).min), dim=-1) @ v


def hand_block16_where_causal_inf(q, k, v, n, x):
    causal = torch.tril(torch.ones(L, L, dtype=torch.bool))
    keep = blocks(16) & causal & key_mask(n)[:, None, None, :]
    s = torch.matmul(q, k.transpose(2, 3)) * 0.25
    return F.softmax(torch.where(keep, s, -math.inf), dim=-1) @ v


def sdpa_window_abs(q, k, v, n, x):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=band(3) & key_mask(n)[:, None, None, :])


def sdpa_window_abs_less_than(q, k, v, n, x):
    i = torch.arange(L)
    near = (i[:, None] - i[None, :]).abs() < 5 + 1
    return F.scaled_dot_product_attention(q, k, v, attn_mask=near & key_mask(n)[:, None, None, :])


def sdpa_window_rows_transposed(q, k, v, n, x):  # ModernBERT's local layers: abs(rows - rows.T) <= w
    rows = torch.arange(L).unsqueeze(0)
    near = torch.abs(rows - rows.T) <= 4
    return F.scaled_dot_product_attention(q, k, v, attn_mask=near[None, None] & key_mask(n)[:, None, None, :])


def sdpa_window_two_comparisons(q, k, v, n, x):
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
    keep = (j >= i - 4) & (j <= i + 4) & key_mask(n)[:, None, None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)


def sdpa_window_causal(q, k, v, n, x):
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
    keep = (j <= i) & (i - j <= 6)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep & key_mask(n)[:, None, None, :])


def sdpa_window_tril_triu(q, k, v, n, x):
    causal_band = torch.ones(L, L, dtype=torch.bool).tril().triu(diagonal=-5)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_band & key_mask(n)[:, None, None, :])


def hand_window_band_additive(q, k, v, n, x):
    ones = torch.ones(L, L)
    near = torch.tril(ones, diagonal=2) * torch.triu(ones, diagonal=-2)  # 1 inside |i - j| <= 2
    keep = near[None, None] * key_mask(n)[:, None, None, :].float()
    s = q @ k.transpose(-2, -1) * 0.25 + (1 - keep) * -1e9
    return s.softmax(-1) @ v


def hand_window_band_bool(q, k, v, n, x):
    ones = torch.ones(L, L)
    near = torch.tril(ones, diagonal=2) * torch.triu(ones, diagonal=-2)  # 1 inside |i - j| <= 2
    keep = (near[None, None] * key_mask(n)[:, None, None, :].float()) > 0
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)


def block_mask_also_from_input(q, k, v, n, x):
    keep = blocks(16) & key_mask(n)[:, None, None, :] & x["bool_mask"][:, None, None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)


def sdpa_block_and_window(q, k, v, n, x):
    mask = blocks(16) & band(4) & key_mask(n)[:, None, None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def hand_blhd_einsum_blocks(q, k, v, n, x):
    qb, kb, vb = (t.transpose(1, 2) for t in (q, k, v))  # the (B, L, H, D) layout
    s = torch.einsum("bqhd,bkhd->bhqk", qb, kb) / math.sqrt(D)
    s = s.masked_fill(~(blocks(16) & key_mask(n)[:, None, None, :]), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), vb).transpose(1, 2)


def sdpa_rope_half_positions(q, k, v, n, x):
    cos, sin = half_tables(position_angles())  # (L, D)
    q, k = rope(q, cos, sin), rope(k, cos, sin)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=blocks(16) & key_mask(n)[:, None, None, :])


def sdpa_rope_half_slices_4d_tables(q, k, v, n, x):
    cos, sin = half_tables(position_angles())
    cos, sin = cos[None, None], sin[None, None]  # (1, 1, L, D)
    q, k = rope(q, cos, sin, rotate_half_slices), rope(k, cos, sin, rotate_half_slices)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=band(3) & key_mask(n)[:, None, None, :])


def sdpa_rope_half_minus_spelling(q, k, v, n, x):
    cos, sin = half_tables(position_angles())
    q = q * cos - rotate_half_split_minus(q) * sin
    k = k * cos - rotate_half_split_minus(k) * sin
    return F.scaled_dot_product_attention(q, k, v, attn_mask=blocks(32) & key_mask(n)[:, None, None, :])


def sdpa_rope_interleaved_positions(q, k, v, n, x):
    cos, sin = interleaved_tables(position_angles())
    q, k = rope(q, cos, sin, rotate_interleaved), rope(k, cos, sin, rotate_interleaved)
    mask = band(6, causal=True) & key_mask(n)[:, None, None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def sdpa_rope_half_time_gaps(q, k, v, n, x):
    """Per-sample tables from time gaps (B, L, D), broadcast over heads; each call unsqueezes again."""
    cos, sin = half_tables(time_gap_angles(x["times"]))
    q = rope(q, cos.unsqueeze(1), sin.unsqueeze(1))
    k = rope(k, cos.unsqueeze(1), sin.unsqueeze(1))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=blocks(16) & key_mask(n)[:, None, None, :])


def sdpa_rope_half_upcast_and_cast_back(q, k, v, n, x):
    """transformers 5's ModernBERT: ``(q.float() * cos) + (rotate_half(q.float()) * sin)`` then
    ``.to(original_dtype)``, each ``.float()`` its own node; in float32 every cast is a no-op."""
    cos, sin = half_tables(position_angles())
    dtype = q.dtype
    q = ((q.float() * cos) + (rotate_half_chunk(q.float()) * sin)).to(dtype)
    k = ((k.float() * cos) + (rotate_half_chunk(k.float()) * sin)).to(dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=band(3) & key_mask(n)[:, None, None, :])


def hand_rope_interleaved_time_gaps(q, k, v, n, x):
    cos, sin = interleaved_tables(time_gap_angles(x["times"]))
    cos, sin = cos[:, None], sin[:, None]  # (B, 1, L, D)
    q, k = rope(q, cos, sin, rotate_interleaved_unbind), rope(k, cos, sin, rotate_interleaved_unbind)
    s = (q @ k.transpose(-2, -1)) / math.sqrt(D)
    s = s.masked_fill(~(blocks(16) & key_mask(n)[:, None, None, :]), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def rope_rotated_q_also_returned(q, k, v, n, x):
    """The rotated q has another user: the rotation stays for it, the kernel rotates its own copy."""
    cos, sin = half_tables(position_angles())
    q, k = rope(q, cos, sin), rope(k, cos, sin)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=blocks(16) & key_mask(n)[:, None, None, :])
    return o + 0.5 * q


def sdpa_block_query_rows_masked_after(q, k, v, n, x):
    """A query term in the mask, harmless because the model masks those rows after the attention."""
    m = key_mask(n)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=blocks(16) & m[:, None, None, :] & m[:, None, :, None])
    o = F.linear(o.transpose(1, 2).reshape(q.shape[0], L, H * D), x["w_out"])
    return (o * m[..., None]).unflatten(-1, (H, D)).transpose(1, 2)


# RoPE that looks right but is not (a wrong sign, a wrong split, tables with a gradient): the attention is
# still rewritten (rotary "none" is always exact), the rotation is not fused.
def rope_wrong_sign(q, k, v, n, x):
    cos, sin = half_tables(position_angles())
    wrong = lambda t: torch.cat(t.chunk(2, dim=-1)[::-1], dim=-1)  # (x2, x1): the minus is missing
    q, k = rope(q, cos, sin, wrong), rope(k, cos, sin, wrong)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=blocks(16) & key_mask(n)[:, None, None, :])


def rope_wrong_split(q, k, v, n, x):
    cos, sin = half_tables(position_angles())
    wrong = lambda t: torch.cat((-t[..., 6:], t[..., :6]), dim=-1)  # split at 6, not at D/2
    q, k = rope(q, cos, sin, wrong), rope(k, cos, sin, wrong)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=blocks(16) & key_mask(n)[:, None, None, :])


def rope_learned_tables(q, k, v, n, x):
    cos, sin = x["learned_cos"], x["learned_sin"]  # (L, D), require grad
    q, k = rope(q, cos, sin), rope(k, cos, sin)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=blocks(16) & key_mask(n)[:, None, None, :])


def rope_only_on_q(q, k, v, n, x):
    cos, sin = half_tables(position_angles())
    return F.scaled_dot_product_attention(rope(q, cos, sin), k, v,
                                          attn_mask=blocks(16) & key_mask(n)[:, None, None, :])


# idiom -> (block, window, causal, rotary)
IDIOMS = {
    sdpa_block16_bool: (16, -1, False, "none"),
    sdpa_block32_additive_inf: (32, -1, False, "none"),
    hand_block64_div_floor_masked_fill: (64, -1, False, "none"),
    hand_block16_where_causal_inf: (16, -1, True, "none"),
    sdpa_window_abs: (0, 3, False, "none"),
    sdpa_window_abs_less_than: (0, 5, False, "none"),
    sdpa_window_rows_transposed: (0, 4, False, "none"),
    sdpa_window_two_comparisons: (0, 4, False, "none"),
    sdpa_window_causal: (0, 6, True, "none"),
    sdpa_window_tril_triu: (0, 5, True, "none"),
    hand_window_band_bool: (0, 2, False, "none"),
    block_mask_also_from_input: (16, -1, False, "none"),
    sdpa_block_and_window: (16, 4, False, "none"),
    hand_blhd_einsum_blocks: (16, -1, False, "none"),
    sdpa_rope_half_positions: (16, -1, False, "half"),
    sdpa_rope_half_slices_4d_tables: (0, 3, False, "half"),
    sdpa_rope_half_minus_spelling: (32, -1, False, "half"),
    sdpa_rope_interleaved_positions: (0, 6, True, "interleaved"),
    sdpa_rope_half_time_gaps: (16, -1, False, "half"),
    sdpa_rope_half_upcast_and_cast_back: (0, 3, False, "half"),
    hand_rope_interleaved_time_gaps: (16, -1, False, "interleaved"),
    rope_rotated_q_also_returned: (16, -1, False, "half"),
    sdpa_block_query_rows_masked_after: (16, -1, False, "none"),
    rope_wrong_sign: (16, -1, False, "none"),
    rope_wrong_split: (16, -1, False, "none"),
    rope_learned_tables: (16, -1, False, "none"),
    rope_only_on_q: (16, -1, False, "none"),
}
NOT_FUSED = {rope_wrong_sign: "neither rotate-half", rope_wrong_split: "neither rotate-half",
             rope_learned_tables: "requires grad", rope_only_on_q: "only q is rotated"}
# a masked_fill(-inf) softmax gives NaN on rows without any allowed key, whose NaN then reaches eager's
# gradients of v: those idioms are compared with eager on lengths where every row keeps a key, and an empty
# sequence, where the two differ, is checked against the documented 0 (_empty_sequence_is_zero)
# rows i >= len[b] without an allowed key: eager's additive / finite-fill / -inf softmax gives an average or
# NaN there, the kernel 0 (the documented exception); every other idiom is compared on every row
ROWS_PAST_THE_LENGTH_DIFFER = {sdpa_block32_additive_inf, hand_block64_div_floor_masked_fill,
                               hand_block16_where_causal_inf, hand_rope_interleaved_time_gaps,
                               hand_blhd_einsum_blocks, block_mask_also_from_input}
NO_EMPTY_ROWS = {hand_block64_div_floor_masked_fill, hand_rope_interleaved_time_gaps, hand_blhd_einsum_blocks,
                 hand_block16_where_causal_inf}


def _inputs(idiom=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, L, D, generator=g, requires_grad=True) for _ in range(3))
    lengths = torch.tensor([L, 35, 33]) if idiom in NO_EMPTY_ROWS else torch.tensor([L, 17, 0])
    extra = {
        "times": torch.cumsum(torch.rand(B, L, generator=g) * 100.0, dim=1),
        "learned_cos": (1.0 + 0.1 * torch.randn(L, D, generator=g)).requires_grad_(),
        "learned_sin": (0.3 * torch.randn(L, D, generator=g)).requires_grad_(),
        "w_out": torch.randn(H * D, H * D, generator=g, requires_grad=True) / 8,
        "bool_mask": torch.rand(B, L, generator=g) > 0.3,
    }
    return q, k, v, lengths, extra


def _op_args(report):
    (node,) = [n for n in report.graph_after.graph.nodes if "block_attention" in str(n.target)]
    return node.args


@pytest.mark.parametrize("idiom", list(IDIOMS), ids=lambda f: f.__name__)
def test_idiom_is_rewritten_with_eager_outputs_and_gradients(idiom):
    block, window, causal, rotary = IDIOMS[idiom]
    q, k, v, lengths, extra = _inputs(idiom)
    report = explain(idiom, q, k, v, lengths, extra)
    assert report.counts["block_attention"] == 1, report.refusals
    assert report.counts["jagged_attention"] == 0
    args = _op_args(report)
    assert tuple(args[4:7]) == (block, window, causal) and args[9] == rotary, args
    (rewrite,) = [r for r in report.rewrites if r.pass_name == "block_attention"]
    assert f"block={block} window={window} causal={causal}" in rewrite.detail
    assert (f"rotary {rotary} fused" if rotary != "none" else "rotary none") in rewrite.detail
    if idiom in NOT_FUSED:
        assert NOT_FUSED[idiom] in rewrite.detail, rewrite.detail

    counters.clear()
    compiled = gem_compile(idiom, fullgraph=True)
    out = compiled(q, k, v, lengths, extra)
    ref = idiom(q, k, v, lengths, extra)
    rows = key_mask(lengths)[:, None, :, None]  # the rows every idiom defines: queries i < len[b]
    if idiom not in ROWS_PAST_THE_LENGTH_DIFFER:  # SDPA with a bool mask: every row is defined (0 if empty)
        rows = torch.ones_like(rows)
    torch.testing.assert_close(torch.where(rows, out, 0), torch.where(rows, ref, 0), atol=1e-5, rtol=1e-4)
    assert torch.isfinite(out).all()
    weights = torch.randn(ref.shape, generator=torch.Generator().manual_seed(2))
    leaves = [q, k, v, *(t for t in extra.values() if t.requires_grad)]
    grads = torch.autograd.grad((torch.where(rows, out, 0) * weights).sum(), leaves, allow_unused=True)
    grads_ref = torch.autograd.grad((torch.where(rows, ref, 0) * weights).sum(), leaves, allow_unused=True)
    for g, g_ref in zip(grads, grads_ref):
        assert (g is None) == (g_ref is None)
        if g is not None:
            torch.testing.assert_close(g, g_ref, atol=1e-5, rtol=1e-4)
    if idiom in NO_EMPTY_ROWS:
        _empty_sequence_is_zero(compiled, idiom, q, k, v, lengths, extra, weights)
    assert counters["gemcompile"]["block_attention"] == 1


def _empty_sequence_is_zero(compiled, idiom, q, k, v, lengths, extra, weights, empty=2):
    """Where eager and the kernel differ, an empty sequence (every row past its length): eager's softmax over
    all -inf gives NaN there, the kernel 0 with no gradient into that sequence's q, k, v (the documented
    exception above ROWS_PAST_THE_LENGTH_DIFFER). The other sequences keep eager's values and gradients. The
    same compiled function: no recompile."""
    lengths = lengths.clone()
    lengths[empty] = 0
    out, ref = compiled(q, k, v, lengths, extra), idiom(q, k, v, lengths, extra)
    assert ref[empty].isnan().all()
    assert (out[empty] == 0).all() and torch.isfinite(out).all()
    keep = torch.arange(out.shape[0]) != empty
    rows = key_mask(lengths)[:, None, :, None]  # the rows every idiom defines: queries i < len[b]
    torch.testing.assert_close(torch.where(rows, out, 0)[keep], torch.where(rows, ref, 0)[keep], atol=1e-5,
                               rtol=1e-4)
    # the same rows for the kernel, plus every row of the empty sequence: its 0 must carry no gradient
    with_empty = rows | ~keep[:, None, None, None]
    grads = torch.autograd.grad((torch.where(with_empty, out, 0) * weights).sum(), (q, k, v))
    grads_ref = torch.autograd.grad((torch.where(rows, ref, 0) * weights).sum(), (q, k, v))
    for g, g_ref in zip(grads, grads_ref):
        assert (g[empty] == 0).all()
        torch.testing.assert_close(g[keep], g_ref[keep], atol=1e-5, rtol=1e-4)


def test_fused_rope_passes_the_unrotated_q_and_k():
    q, k, v, lengths, extra = _inputs()
    report = explain(sdpa_rope_half_positions, q, k, v, lengths, extra)
    args = _op_args(report)
    assert (args[0].op, args[0].name, args[1].op, args[1].name) == ("placeholder", "l_q_", "placeholder", "l_k_")
    assert tuple(args[7].meta["example_value"].shape) == (L, D)
    assert not [n for n in report.graph_after.graph.nodes if "neg" in str(n.target)]  # the rotation is gone
    args = _op_args(explain(sdpa_rope_half_time_gaps, q, k, v, lengths, extra))
    assert tuple(args[7].meta["example_value"].shape) == (B, L, D)


def test_plain_padding_is_left_to_the_jagged_pass_silently():
    def padding_only(q, k, v, n, x):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask(n)[:, None, None, :])

    report = explain(padding_only, *_inputs())
    assert report.counts["block_attention"] == 0 and report.counts["jagged_attention"] == 1
    assert not [r for r in report.refusals if r.pass_name == "block_attention"]


# -- near-misses ------------------------------------------------------------------------------------------

def miss_block_size_from_tensor(q, k, v, n, x):
    i = torch.arange(L)
    ids = i // x["block"]  # a 0-d tensor
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=(ids[:, None] == ids[None, :]) & key_mask(n)[:, None, None, :])


def miss_block_size_per_sample(q, k, v, n, x):
    i = torch.arange(L)
    ids = i[None, :] // x["block_per_sample"][:, None]  # (B, L)
    keep = ids[:, :, None] == ids[:, None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None] & key_mask(n)[:, None, None, :])


def miss_blocks_offset(q, k, v, n, x):
    i = torch.arange(L)
    ids = (i + 1) // 16
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=(ids[:, None] == ids[None, :]) & key_mask(n)[:, None, None, :])


def miss_query_and_key_blocks_differ(q, k, v, n, x):
    i = torch.arange(L)
    keep = (i[:, None] // 16) == (i[None, :] // 8)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep & key_mask(n)[:, None, None, :])


def miss_not_equal_blocks(q, k, v, n, x):
    i = torch.arange(L)
    keep = (i[:, None] // 16) != (i[None, :] // 16)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep & key_mask(n)[:, None, None, :])


def miss_window_from_tensor(q, k, v, n, x):
    i = torch.arange(L)
    near = (i[:, None] - i[None, :]).abs() <= x["window"]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=near & key_mask(n)[:, None, None, :])


def miss_window_per_sample(q, k, v, n, x):
    i = torch.arange(L)
    near = (i[None, :, None] - i[None, None, :]).abs() <= x["window_per_sample"][:, None, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=near[:, None] & key_mask(n)[:, None, None, :])


def miss_window_through_an_op_not_modeled(q, k, v, n, x):  # flip: the column index becomes data
    rows = torch.arange(L).unsqueeze(0)
    near = torch.abs(rows - rows.T.flip(0).flip(0)) <= 4
    return F.scaled_dot_product_attention(q, k, v, attn_mask=near[None, None] & key_mask(n)[:, None, None, :])


def miss_block_without_padding(q, k, v, n, x):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=blocks(16))


def miss_cross_attention(q, k, v, n, x):
    iq, ik = torch.arange(LQ), torch.arange(L)
    keep = ((iq[:, None] // 16) == (ik[None, :] // 16)) & key_mask(n)[:, None, None, :]
    return F.scaled_dot_product_attention(q[:, :, :LQ], k, v, attn_mask=keep)


def miss_additive_bias(q, k, v, n, x):
    s = q @ k.transpose(-2, -1) * 0.25 + x["bias"]  # a learned (L, L) bias
    s = s.masked_fill(~(blocks(16) & key_mask(n)[:, None, None, :]), float("-inf"))
    return s.softmax(-1) @ v


def miss_query_rows_not_masked_after(q, k, v, n, x):
    m = key_mask(n)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=blocks(16) & m[:, None, None, :] & m[:, None, :, None])


def miss_chunk_causal(q, k, v, n, x):  # WeNet's chunk mask: key chunks up to the query's (block-causal)
    pos = torch.arange(L)
    ends = (torch.div(pos, 16, rounding_mode="trunc") + 1) * 16
    keep = pos.unsqueeze(0) < ends.unsqueeze(1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep & key_mask(n)[:, None, None, :])


def miss_chunks_rounded_toward_zero(q, k, v, n, x):  # i - 8 may be negative: trunc is not floor there
    pos = torch.arange(L)
    keep = torch.div(pos[:, None] - 8, 16, rounding_mode="trunc") == torch.div(pos[None, :] - 8, 16,
                                                                                rounding_mode="trunc")
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep & key_mask(n)[:, None, None, :])


NEAR_MISSES = {
    miss_chunk_causal: "not query blocks against key blocks",
    miss_chunks_rounded_toward_zero: "rounding toward zero",
    miss_block_size_from_tensor: r"integer tensor of shape \(\)",
    miss_block_size_per_sample: "block size .* not a constant",
    miss_blocks_offset: "blocks are offset",
    miss_query_and_key_blocks_differ: "query blocks of 16 and key blocks of 8 differ",
    miss_not_equal_blocks: "different blocks",
    miss_window_from_tensor: r"integer tensor of shape \(\)",
    miss_window_per_sample: "window .* depends on the tensor",
    miss_window_through_an_op_not_modeled: "flip",
    sdpa_block32_additive: "finite fill .* blocks",
    hand_block16_where_causal: "finite fill .* blocks",
    hand_window_band_additive: "finite fill .* sliding window",
    miss_block_without_padding: "no key-padding mask",
    miss_cross_attention: "cross-attention",
    miss_additive_bias: "additive bias",
    miss_query_rows_not_masked_after: "query rows",
}


def _near_miss_inputs():
    q, k, v, lengths, extra = _inputs()
    extra.update(block=torch.tensor(16), block_per_sample=torch.tensor([16, 8, 4]), window=torch.tensor(3),
                 window_per_sample=torch.tensor([3, 2, 1]), bool_mask=torch.rand(B, L) > 0.3,
                 bias=torch.randn(L, L, requires_grad=True))
    return q, k, v, lengths, extra


@pytest.mark.parametrize("idiom,reason", list(NEAR_MISSES.items()), ids=[f.__name__ for f in NEAR_MISSES])
def test_near_miss_is_left_alone_with_a_reason(idiom, reason):
    report = explain(idiom, *_near_miss_inputs())
    assert report.counts["block_attention"] == 0
    messages = [r.reason for r in report.refusals if r.pass_name == "block_attention"]
    assert any(re.search(reason, m) for m in messages), messages


def test_block_size_the_kernel_cannot_serve_is_left_alone(monkeypatch):
    """The kernel serves every block size today; a refusal of kernel_supports must reach explain."""
    import gemcompile.lowering.common.checks as lowering

    served = lowering.kernel_supports
    monkeypatch.setattr(lowering, "kernel_supports",
                        lambda b, w, d: "blocks of 24 are not served" if b == 24 else served(b, w, d))

    def blocks_of_24(q, k, v, n, x):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=blocks(24) & key_mask(n)[:, None, None, :])

    report = explain(blocks_of_24, *_inputs())
    assert report.counts["block_attention"] == 0
    (refusal,) = [r for r in report.refusals if r.pass_name == "block_attention"]
    assert "block=24" in refusal.reason and "blocks of 24 are not served" in refusal.reason


def test_head_dim_the_kernel_cannot_serve_is_left_alone():
    q = torch.randn(B, H, L, 8)
    report = explain(sdpa_block16_bool, q, q, q, torch.tensor([L, 17, 0]), {})
    assert report.counts["block_attention"] == 0
    (refusal,) = [r for r in report.refusals if r.pass_name == "block_attention"]
    assert "head dim 8" in refusal.reason


def block_rope_any_length(qkv, n):
    q, k, v = qkv.unbind(0)  # one tensor: one symbolic length for q, k and v
    length = q.shape[2]
    i = torch.arange(length)
    angles = i.float()[:, None] * inv_freq()[None, :]
    cos, sin = half_tables(angles)
    q, k = rope(q, cos, sin), rope(k, cos, sin)
    keep = ((i // 16)[:, None] == (i // 16)[None, :]) & (i[None, :] < n[:, None])[:, None, None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)


def test_dynamic_padded_length_compiles_once_and_is_rewritten(monkeypatch):
    from gemcompile.backend import GemBackend

    calls = []
    original = GemBackend.__call__
    monkeypatch.setattr(GemBackend, "__call__", lambda self, *a, **kw: calls.append(1) or original(self, *a, **kw))
    counters.clear()
    compiled = gem_compile(block_rope_any_length)
    g = torch.Generator().manual_seed(4)
    for length in (40, 24, 33):
        qkv = torch.randn(3, B, H, length, D, generator=g)
        torch._dynamo.mark_dynamic(qkv, 3)
        lengths = torch.randint(0, length + 1, (B,), generator=g)
        torch.testing.assert_close(compiled(qkv, lengths), block_rope_any_length(qkv, lengths), atol=1e-5, rtol=1e-4)
    assert len(calls) == 1
    assert counters["gemcompile"]["block_attention"] == 1


# -- config ------------------------------------------------------------------------------------------------

def test_disabled_pass_rewrites_nothing():
    report = explain(sdpa_block16_bool, *_inputs(), config=GemConfig(block_attention={"enabled": False}))
    assert report.counts["block_attention"] == 0
    assert not [r for r in report.refusals if r.pass_name == "block_attention"]


def test_fuse_rotary_off_keeps_the_rotation_in_the_graph():
    q, k, v, lengths, extra = _inputs()
    config = GemConfig(block_attention={"fuse_rotary": False})
    report = explain(sdpa_rope_half_positions, q, k, v, lengths, extra, config=config)
    assert report.counts["block_attention"] == 1
    assert _op_args(report)[9] == "none" and "fuse_rotary is off" in report.rewrites[0].detail
    out = gem_compile(sdpa_rope_half_positions, config=config)(q, k, v, lengths, extra)
    rows = key_mask(lengths)[:, None, :, None]
    torch.testing.assert_close(torch.where(rows, out, 0),
                               torch.where(rows, sdpa_rope_half_positions(q, k, v, lengths, extra), 0),
                               atol=1e-5, rtol=1e-4)
