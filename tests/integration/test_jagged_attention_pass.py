"""The jagged_attention pass: every idiom a modeler writes is rewritten, with eager's outputs and
gradients at valid positions; every near-miss is left alone with a reason."""

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

from gemcompile import GemConfig, explain, gem_compile
from gemcompile.backend import GemBackend
from tests.compiled_vs_eager import assert_same_weighted_grads
from tests.rewritten import rewritten

B, H, L, D = 4, 2, 12, 16
LQ = 7  # queries of cross attention


def key_mask(lengths, n=L):
    return torch.arange(n)[None, :] < lengths[:, None]  # (B, n)


# -- idioms: (q, k, v, lengths, extra) -> out (B, H, Lq, D) ---------------------------------------------

def sdpa_key(q, k, v, n, x):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask(n)[:, None, None, :])


def sdpa_every_argument_by_keyword(q, k, v, n, x):  # ALBERT's SDPA call: query=, key=, value=, scale=
    mask = key_mask(n)[:, None, None, :]
    return F.scaled_dot_product_attention(query=q, key=k, value=v, attn_mask=mask, dropout_p=0.0, scale=0.3)


def hand_causal_plus_int_mask(q, k, v, n, x):
    """transformers before 4.53 (and StableLM, Falcon after): a finfo.min triangle from torch.full(...,
    fill_value=...), the integer attention_mask added to it, `== 0` refilled with min, added to the scores of
    the eager attention (SDPA's CPU kernel differs from float64 math on a row with no valid key)."""
    lo = torch.finfo(q.dtype).min
    causal = torch.triu(torch.full((L, L), fill_value=lo, dtype=q.dtype), diagonal=1)
    causal = causal[None, None].expand(q.shape[0], 1, L, L).clone()
    padding = causal + key_mask(n).long()[:, None, None, :]
    s = torch.matmul(q, k.transpose(2, 3)) * (1.0 / math.sqrt(D)) + causal.masked_fill(padding == 0, lo)
    return torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype) @ v


def hand_causal_integer_tril_and_numpy(q, k, v, n, x):
    """ReChorus' SASRec: an integer causal triangle (np.tril(np.ones(..., dtype=int)) through torch.from_numpy,
    here beside torch's own integer tril and numpy's triu with k=1) and the key padding from the lengths,
    filled with -1e9."""
    import numpy as np

    ints = torch.tril(torch.ones((1, 1, L, L), dtype=torch.int64))
    numpy_tril = torch.from_numpy(np.tril(np.ones((1, 1, L, L), dtype=np.int64)))
    numpy_above = torch.from_numpy(np.triu(np.ones((L, L), dtype=np.int64), k=1))  # 1 above the diagonal
    s = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(D)
    drop = (ints == 0) | (numpy_tril == 0) | (numpy_above == 1) | ~key_mask(n)[:, None, None, :]
    return torch.softmax(s.masked_fill(drop, -1e9), dim=-1) @ v


def hand_key_mask_from_numpy_arange(q, k, v, n, x):
    """ReChorus' BERT4RecEncoder (ContraRec, KDA): the positions from numpy, ``torch.from_numpy(np.arange(L))``
    (Dynamo's wrapped_arange), compared with the lengths, filled with -inf."""
    import numpy as np

    len_range = torch.from_numpy(np.arange(L)).to(q.device)
    valid_mask = len_range[None, :] < n[:, None]
    s = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(D)
    return torch.softmax(s.masked_fill(valid_mask.view(q.shape[0], 1, 1, L) == 0, -np.inf), dim=-1) @ v


def _hf_4d_mask_written_in_place(q, n, upto):
    """transformers 4.4x's _prepare_4d_causal_attention_mask_with_cache_position: the triangle scaled in place,
    expanded and cloned, then its first `upto` keys refilled through a slice assignment."""
    lo = torch.finfo(q.dtype).min
    causal = torch.triu(torch.full((L, L), fill_value=lo, dtype=q.dtype), diagonal=1)
    causal *= torch.arange(L) > torch.arange(L).reshape(-1, 1)
    causal = causal[None, None, :, :].expand(q.shape[0], 1, -1, -1).clone()
    padding = causal[:, :, :, :upto] + key_mask(n).long()[:, None, None, :upto]
    causal[:, :, :, :upto] = causal[:, :, :, :upto].masked_fill(padding == 0, lo)
    return causal


def hand_hf_mask_slice_assigned(q, k, v, n, x):
    s = torch.matmul(q, k.transpose(2, 3)) * (1.0 / math.sqrt(D)) + _hf_4d_mask_written_in_place(q, n, L)
    return torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype) @ v


def sdpa_key_causal_tril(q, k, v, n, x):
    causal = torch.tril(torch.ones(L, L, dtype=torch.bool))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask(n)[:, None, None, :] & causal)


def sdpa_key_causal_index(q, k, v, n, x):
    i = torch.arange(L)
    keep = (i[None, :] <= i[:, None])[None, None] & ~(i[None, :] >= n[:, None])[:, None, None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)


def sdpa_additive(q, k, v, n, x):
    additive = torch.zeros(q.shape[0], 1, 1, L).masked_fill(~key_mask(n)[:, None, None, :], float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=additive)


def sdpa_key_and_query(q, k, v, n, x):
    m = key_mask(n)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=m[:, None, None, :] & m[:, None, :, None])


def hand_masked_fill_inf(q, k, v, n, x):
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~key_mask(n)[:, None, None, :], float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def hand_masked_fill_large_negative(q, k, v, n, x):
    s = torch.matmul(q, k.transpose(2, 3)) * (1.0 / math.sqrt(D))
    s = s.masked_fill(key_mask(n)[:, None, None, :] == 0, -1e9)
    return s.softmax(-1) @ v


def hand_where(q, k, v, n, x):
    s = q @ k.transpose(-2, -1) * 0.25
    s = torch.where(key_mask(n)[:, None, None, :], s, torch.finfo(s.dtype).min)
    return F.softmax(s, dim=-1) @ v


def hand_where_ones_times_fill(q, k, v, n, x):
    # TiSASRec: paddings = torch.ones(w.shape) * (-2 ** 32 + 1), then torch.where(mask, paddings, w)
    s = q @ k.transpose(-2, -1) * 0.25
    paddings = torch.ones(s.shape) * (-2 ** 32 + 1)
    return F.softmax(torch.where(~key_mask(n)[:, None, None, :], paddings, s), dim=-1) @ v


def hand_additive(q, k, v, n, x):
    s = q @ k.transpose(-2, -1) * 0.25
    s = s + (1 - key_mask(n)[:, None, None, :].float()) * -1e9
    return torch.softmax(s, -1) @ v


def hand_blhd_einsum(q, k, v, n, x):
    qb, kb, vb = (t.transpose(1, 2) for t in (q, k, v))  # the (B, L, H, D) layout
    s = torch.einsum("bqhd,bkhd->bhqk", qb, kb) / math.sqrt(D)
    s = s.masked_fill(~key_mask(n)[:, None, None, :], float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), vb)
    return out.transpose(1, 2)


def hand_blhd_permute(q, k, v, n, x):
    qb, kb = q.transpose(1, 2), k.transpose(1, 2)  # stored (B, L, H, D)
    s = qb.transpose(1, 2) @ kb.permute(0, 2, 3, 1) * 0.25
    s = s.masked_fill(~key_mask(n)[:, None, None, :], float("-inf"))
    return s.softmax(dim=-1) @ v


def relative_bias(q, k, v, n, x):
    table = x["table"]  # learned (2L - 1, H) relative-position bias, needs a gradient
    i = torch.arange(L)
    bias = table[(i[None, :] - i[:, None]) + L - 1].permute(2, 0, 1)  # (H, L, L)
    s = q @ k.transpose(-2, -1) * 0.25 + bias
    s = s.masked_fill(~key_mask(n)[:, None, None, :], float("-inf"))
    return torch.softmax(s, -1) @ v


def cross_attention_own_query_lengths(q, k, v, n, x):
    qn = x["q_lengths"]
    qc = q[:, :, :LQ]
    keep = key_mask(n)[:, None, None, :] & key_mask(qn, LQ)[:, None, :, None]
    return F.scaled_dot_product_attention(qc, k, v, attn_mask=keep)


def pma_learned_queries(q, k, v, n, x):
    seeds = x["seeds"]  # (H, n_pma, D) shared by the batch
    qs = seeds[None].expand(k.shape[0], -1, -1, -1)
    return F.scaled_dot_product_attention(qs, k, v, attn_mask=key_mask(n)[:, None, None, :])


def sdpa_key_mask_from_input(q, k, v, n, x):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=x["bool_mask"][:, None, None, :])


def sdpa_keys_below_float_lengths(q, k, v, n, x):
    keep = torch.arange(L)[None, :] < (n.float() * 0.5)[:, None]  # a bool tensor from data: read as such
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :])


def hand_float_mask_input_expanded_over_heads(q, k, v, n, x):
    # FuxiCTR: a float 0/1 mask handed in, viewed (B, 1, 1, L) and expanded over the heads, compared with 0
    # (the comparison reads data the prover does not derive, at a node whose head dim is an expanded copy)
    mask = x["float_keep"].view(q.shape[0], 1, 1, -1).expand(-1, q.shape[1], -1, -1)
    s = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(D)
    return torch.matmul(s.masked_fill(mask == 0, -1e9).softmax(dim=-1), v)


def hand_causal_from_ones_like_scores(q, k, v, n, x):
    # gSASRec: the causal mask from tril(ones_like(scores[0])), which reads only the scores' shape
    s = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(D)
    causal = torch.tril(torch.ones_like(s[0, 0]))
    s = s.masked_fill(~key_mask(n)[:, None, None, :], float("-inf")).masked_fill(causal == 0, float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v)


def hand_global_max_shifted(q, k, v, n, x):
    # ReChorus: (s - s.max()).softmax(), NaN rows zeroed (a global max: the same softmax). ReChorus fills with
    # -inf; then eager's gradient is NaN wherever the max sits once a row is empty (its NaN flows back through
    # the max), so this test fills with -1e9
    s = (q @ k.transpose(-2, -1) / math.sqrt(D)).masked_fill(~key_mask(n)[:, None, None, :], -1e9)
    p = (s - s.max()).softmax(dim=-1)
    return p.masked_fill(torch.isnan(p), 0) @ v


def hand_row_max_shifted_before_the_mask(q, k, v, n, x):
    # the older ReChorus order: the row max subtracted (detached) before the fill; and .values of torch.max
    s = q @ k.transpose(-2, -1) / math.sqrt(D)
    s = s - torch.max(s, -1, keepdim=True).values.detach()
    return s.masked_fill(~key_mask(n)[:, None, None, :], -1e9).softmax(-1) @ v


def hand_query_rows_zeroed_in_the_weights(q, k, v, n, x):
    # the weights' padded query rows zeroed before @ v (a safe softmax's other spelling)
    s = (q @ k.transpose(-2, -1) / math.sqrt(D)).masked_fill(~key_mask(n)[:, None, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1).masked_fill(~key_mask(n)[:, None, :, None], 0.0)
    return p @ v


def hand_weights_times_row_weights(q, k, v, n, x):
    # the weights' rows scaled by a float per query (TF SASRec's query masking, p * query_mask)
    s = (q @ k.transpose(-2, -1) / math.sqrt(D)).masked_fill(~key_mask(n)[:, None, None, :], -1e9)
    return (torch.softmax(s, dim=-1) * x["row_weights"][:, None, :, None]) @ v


IDIOMS = [hand_global_max_shifted, hand_row_max_shifted_before_the_mask, hand_query_rows_zeroed_in_the_weights, hand_weights_times_row_weights, sdpa_key_mask_from_input,
          sdpa_keys_below_float_lengths, hand_float_mask_input_expanded_over_heads,
          hand_causal_from_ones_like_scores, sdpa_key, sdpa_every_argument_by_keyword, hand_causal_plus_int_mask,
          hand_causal_integer_tril_and_numpy, hand_key_mask_from_numpy_arange,
          hand_hf_mask_slice_assigned, sdpa_key_causal_tril, sdpa_key_causal_index,
          sdpa_additive, sdpa_key_and_query, hand_masked_fill_inf, hand_masked_fill_large_negative,
          hand_where, hand_where_ones_times_fill, hand_additive, hand_blhd_einsum, hand_blhd_permute, relative_bias,
          cross_attention_own_query_lengths, pma_learned_queries]
# eager returns NaN (a softmax over all -inf) on a row with no valid key, whose NaN reaches its gradients:
# those idioms are compared with eager on lengths >= 1, and the empty sequence, where the two differ, is
# checked against the documented semantics (_empty_sequence_is_zero; finite fills: test_finite_fills.py)
NO_EMPTY_ROWS = {hand_masked_fill_inf, hand_causal_from_ones_like_scores, hand_blhd_einsum, hand_blhd_permute,
                 relative_bias, hand_key_mask_from_numpy_arange}


def _empty_sequence_is_zero(compiled, idiom, q, k, v, lengths, extra, weights, empty=3):
    """Where eager and the kernel differ, a sequence with no valid key: eager gives NaN (a softmax over all -inf),
    gemcompile 0 with no gradient into that sequence's q, k, v (passes/attention/jagged.py, Semantics). The
    other sequences keep eager's values and q/k/v gradients. The same compiled function: no recompile."""
    lengths = lengths.clone()
    lengths[empty] = 0
    out, ref = compiled(q, k, v, lengths, extra), idiom(q, k, v, lengths, extra)
    assert ref[empty].isnan().all()
    assert (out[empty] == 0).all() and torch.isfinite(out).all()
    keep = torch.arange(out.shape[0]) != empty
    torch.testing.assert_close(out[keep], ref[keep], atol=2e-5, rtol=1e-4)
    grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
    kept_rows = keep.view(-1, *([1] * (ref.dim() - 1)))
    grads_ref = torch.autograd.grad((torch.where(kept_rows, ref, 0) * weights).sum(), (q, k, v))
    for g, g_ref in zip(grads, grads_ref):
        assert (g[empty] == 0).all()
        torch.testing.assert_close(g[keep], g_ref[keep], atol=2e-5, rtol=1e-4)


def _inputs(idiom):
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, H, L, D, generator=g, requires_grad=True) for _ in range(3))
    lengths = torch.tensor([L, 5, 1, 0]) if idiom not in NO_EMPTY_ROWS else torch.tensor([L, 5, 1, 8])
    extra = {
        "table": torch.randn(2 * L - 1, H, generator=g, requires_grad=True),
        "q_lengths": torch.tensor([LQ, 0, 3, 7]),
        "seeds": torch.randn(H, 3, D, generator=g, requires_grad=True),
        "bool_mask": torch.rand(B, L, generator=g) > 0.3,
    }
    extra["float_keep"] = extra["bool_mask"].float()
    extra["row_weights"] = torch.rand(B, L, generator=g)
    extra["float_keep_heads"] = (torch.rand(B, H, L, generator=g) > 0.3).float()
    return q, k, v, lengths, extra


def _valid_rows(idiom, out, lengths, extra):
    """(B, 1, Lq, 1) rows whose eager value is defined."""
    lq = out.shape[2]
    rows = torch.ones(out.shape[0], lq, dtype=torch.bool)
    if idiom in (sdpa_key_and_query,):
        rows = key_mask(lengths, lq)
    if idiom is cross_attention_own_query_lengths:
        rows = key_mask(extra["q_lengths"], lq)
    return rows[:, None, :, None]


def _leaves(q, k, v, extra):
    return [q, k, v, extra["table"], extra["seeds"]]


@pytest.mark.parametrize("idiom", IDIOMS, ids=lambda f: f.__name__)
def test_idiom_is_rewritten_with_eager_outputs_and_gradients(idiom):
    q, k, v, lengths, extra = _inputs(idiom)
    report = explain(idiom, q, k, v, lengths, extra)
    assert report.counts["jagged_attention"] == 1, report.refusals
    counters.clear()
    compiled = gem_compile(idiom, fullgraph=True)
    out = compiled(q, k, v, lengths, extra)
    ref = idiom(q, k, v, lengths, extra)
    rows = _valid_rows(idiom, ref, lengths, extra)
    torch.testing.assert_close(torch.where(rows, out, 0), torch.where(rows, ref, 0), atol=2e-5, rtol=1e-4)
    assert torch.isfinite(out).all()
    weights = torch.randn(ref.shape, generator=torch.Generator().manual_seed(2))
    leaves = [t for t in _leaves(q, k, v, extra)]
    grads = torch.autograd.grad((torch.where(rows, out, 0) * weights).sum(), leaves, allow_unused=True)
    grads_ref = torch.autograd.grad((torch.where(rows, ref, 0) * weights).sum(), leaves, allow_unused=True)
    for g, g_ref in zip(grads, grads_ref):
        assert (g is None) == (g_ref is None)
        if g is not None:
            torch.testing.assert_close(g, g_ref, atol=2e-5, rtol=1e-4)
    if idiom in NO_EMPTY_ROWS:
        _empty_sequence_is_zero(compiled, idiom, q, k, v, lengths, extra, weights)
    assert counters["gemcompile"]["jagged_attention"] == 1


# -- nn.MultiheadAttention ------------------------------------------------------------------------------

class MHAModel(nn.Module):
    """nn.MultiheadAttention over x with a key padding mask; ``projections``: "packed" (one in_proj_weight),
    "kdim_vdim" (keys and values of other widths: separate q/k/v weights), "no_bias" (bias=False), or
    "fairseq" (fairseq's MultiheadAttention: F.multi_head_attention_forward with use_separate_proj_weight,
    an empty in_proj_weight and its three Linear biases concatenated, sequence-first)."""

    def __init__(self, need_weights_used=False, projections="packed"):
        super().__init__()
        self.projections = projections
        kv = {"kdim": 24, "vdim": 40} if projections == "kdim_vdim" else {}
        if projections != "fairseq":
            self.mha = nn.MultiheadAttention(H * D, H, batch_first=True, bias=projections != "no_bias", **kv)
        if projections == "kdim_vdim":
            self.to_k, self.to_v = nn.Linear(H * D, 24), nn.Linear(H * D, 40)
        if projections == "fairseq":
            self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(H * D, H * D) for _ in range(4))
        self.need_weights_used = need_weights_used

    def forward(self, x, lengths):
        padding = ~key_mask(lengths)
        if self.projections == "fairseq":
            t = x.transpose(0, 1)
            out = F.multi_head_attention_forward(
                t, t, t, H * D, H, torch.empty([0]), torch.cat((self.q_proj.bias, self.k_proj.bias, self.v_proj.bias)),
                None, None, False, 0.0, self.out_proj.weight, self.out_proj.bias, self.training, padding, False,
                None, use_separate_proj_weight=True, q_proj_weight=self.q_proj.weight,
                k_proj_weight=self.k_proj.weight, v_proj_weight=self.v_proj.weight)[0]
            return out.transpose(0, 1)
        k, v = (self.to_k(x), self.to_v(x)) if self.projections == "kdim_vdim" else (x, x)
        out, weights = self.mha(x, k, v, key_padding_mask=padding)
        return out + weights.sum() if self.need_weights_used else out


@pytest.mark.parametrize("projections", ["packed", "kdim_vdim", "no_bias", "fairseq"])
def test_multihead_attention_with_key_padding_mask(projections):
    torch.manual_seed(0)
    model = MHAModel(projections=projections)
    x = torch.randn(B, L, H * D, requires_grad=True)
    lengths = torch.tensor([L, 5, 1, 9])
    report = explain(model, x, lengths)
    assert report.counts["jagged_attention"] == 1, report.refusals
    compiled = gem_compile(model)
    out, ref = compiled(x, lengths), model(x, lengths)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    params = [x, *model.parameters()]
    g = torch.autograd.grad(out.square().sum(), params)
    g_ref = torch.autograd.grad(ref.square().sum(), params)
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, atol=5e-5, rtol=1e-4)


class PerHeadMaskMHA(nn.Module):
    """A (B * H, L, L) bool attn_mask: key padding and causal, built per sample and repeated over the heads
    (BST-style `.unsqueeze(1).repeat(1, H, 1, 1).flatten(end_dim=1)`, or `repeat_interleave(H, dim=0)`);
    `.repeat(H, 1, 1)` gives sample b another sample's rows, which eager runs as written."""

    def __init__(self, spelling: str):
        super().__init__()
        self.mha = nn.MultiheadAttention(H * D, H, batch_first=True)
        self.spelling = spelling

    def forward(self, x, lengths):
        n = x.shape[1]
        dropped = ~key_mask(lengths, n)[:, None, :] | torch.ones(n, n, dtype=torch.bool).triu(1)  # (B, L, L)
        if self.spelling in ("shared_expand", "shared_window"):  # one causal (or band) mask for every row
            i = torch.arange(n)
            shared = (i[None, :] > i[:, None]) | ((i[:, None] - i[None, :]) > 3 if self.spelling == "shared_window"
                                                  else torch.zeros(n, n, dtype=torch.bool))
            mask = shared[None].expand(x.shape[0] * H, n, n)
            return self.mha(x, x, x, attn_mask=mask, key_padding_mask=~key_mask(lengths, n), need_weights=False)[0]
        if self.spelling == "flatten":
            mask = dropped.unsqueeze(1).repeat(1, H, 1, 1).flatten(end_dim=1)
        elif self.spelling == "repeat_interleave":
            mask = dropped.repeat_interleave(H, dim=0)
        elif self.spelling == "negated_after_tiling":  # FuxiCTR DMIN's get_mask: ~ after the tiling, read back
            keep = ~dropped.unsqueeze(1).repeat(1, H, 1, 1).flatten(end_dim=1)
            mask = torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))
        else:
            mask = dropped.repeat(H, 1, 1)
        return self.mha(x, x, x, attn_mask=mask, need_weights=False)[0]


@pytest.mark.parametrize("spelling", ["flatten", "repeat_interleave", "repeat", "shared_expand", "shared_window",
                                      "negated_after_tiling"])
def test_multihead_attention_with_a_mask_repeated_over_the_heads(spelling):
    torch.manual_seed(0)
    model = PerHeadMaskMHA(spelling)
    x = torch.randn(B, L, H * D, requires_grad=True)
    lengths = torch.tensor([L, 5, 1, 9])
    report = explain(model, x, lengths)
    if spelling in ("repeat", "shared_window", "negated_after_tiling"):
        assert report.counts["jagged_attention"] == report.counts["block_attention"] == 0
        expected = {"repeat": "not a per-sample mask repeated", "shared_window": "not MultiheadAttention",
                    "negated_after_tiling": "apply the op before tiling"}[spelling]
        assert any(expected in r.reason for r in report.refusals), [r.reason for r in report.refusals]
        return
    assert report.counts["jagged_attention"] == 1, [r.reason for r in report.refusals]
    out, ref = rewritten(model)(x, lengths), model(x, lengths)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    assert_same_weighted_grads(out, ref, [x, *model.parameters()])


def test_a_slice_assignment_that_covers_part_of_the_mask_is_refused_and_runs_as_written():
    """Only an assignment to every element reads as the value assigned: keys [: L - 1] leave the last key as
    the triangle made it, so the mask is refused (updated in place), and compiled == eager."""
    def part(q, k, v, n):
        s = torch.matmul(q, k.transpose(2, 3)) * (1.0 / math.sqrt(D)) + _hf_4d_mask_written_in_place(q, n, L - 1)
        return torch.softmax(s, dim=-1) @ v

    q, k, v, lengths, _ = _inputs(hand_hf_mask_slice_assigned)
    lengths = torch.tensor([L, 5, 1, 8])
    report = explain(part, q, k, v, lengths)
    assert report.counts["jagged_attention"] == 0
    assert any("in place" in r.reason for r in report.refusals), [r.reason for r in report.refusals]
    torch.testing.assert_close(gem_compile(part)(q, k, v, lengths), part(q, k, v, lengths))


def test_an_integer_mask_added_to_a_float_one_is_checked_to_hold_zeros_and_ones():
    """The integer attention_mask of hand_causal_plus_int_mask is read as 0/1: a 2 in it stops the run with the
    device check's message instead of a mask the model did not mean."""
    q, k, v, lengths, extra = _inputs(hand_causal_plus_int_mask)

    def with_mask(q, k, v, m):
        lo = torch.finfo(q.dtype).min
        causal = torch.triu(torch.full((L, L), fill_value=lo, dtype=q.dtype), diagonal=1)
        padding = causal[None, None].expand(q.shape[0], 1, L, L).clone() + m[:, None, None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal.masked_fill(padding == 0, lo))

    mask = key_mask(lengths).long()
    counters.clear()
    compiled = gem_compile(with_mask)
    torch.testing.assert_close(compiled(q, k, v, mask)[:, :, :1], with_mask(q, k, v, mask)[:, :, :1], atol=2e-5,
                               rtol=1e-4)
    assert counters["gemcompile"]["jagged_attention"] == 1
    with pytest.raises(Exception, match="holds values other than 0 and 1"):
        compiled(q, k, v, mask * 2)


@pytest.mark.parametrize("fastpath", [True, False])
def test_transformer_encoder_layer_in_inference_names_torch_fast_path(fastpath):
    """Eval mode with autograd off: nn.TransformerEncoderLayer runs torch's fused fast path, one op with the
    attention inside: refused with the switch that keeps the layer's ops (then rewritten, == eager)."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(H * D, H, 2 * H * D, dropout=0.0, batch_first=True).eval()
    x = torch.randn(B, L, H * D)
    lengths = torch.tensor([L, 5, 1, 9])
    before = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(fastpath)
    try:
        with torch.no_grad():
            report = explain(layer, x, src_key_padding_mask=~key_mask(lengths))
            if fastpath:
                assert report.counts["jagged_attention"] == 0
                assert any("set_fastpath_enabled(False)" in r.reason for r in report.refusals), report.refusals
                return
            assert report.counts["jagged_attention"] == 1, [r.reason for r in report.refusals]
            out = gem_compile(layer)(x, src_key_padding_mask=~key_mask(lengths))
            ref = layer(x, src_key_padding_mask=~key_mask(lengths))
    finally:
        torch.backends.mha.set_fastpath_enabled(before)
    valid = key_mask(lengths)[..., None]
    torch.testing.assert_close(out * valid, ref * valid, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kv_heads", [1, H])
def test_sdpa_with_enable_gqa(kv_heads):
    """Grouped-query attention: SDPA repeat_interleaves k and v over the query heads; so does the rewrite."""
    if "enable_gqa" not in F.scaled_dot_product_attention.__doc__:
        pytest.skip("this torch has no enable_gqa")

    def gqa(q, k, v, n):
        keep = key_mask(n)[:, None, None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=True)

    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, 2 * H, L, D, generator=g, requires_grad=True)
    k, v = (torch.randn(B, kv_heads, L, D, generator=g, requires_grad=True) for _ in range(2))
    lengths = torch.tensor([L, 5, 1, 9])
    assert explain(gqa, q, k, v, lengths).counts["jagged_attention"] == 1
    out, ref = rewritten(gqa)(q, k, v, lengths), gqa(q, k, v, lengths)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    assert_same_weighted_grads(out, ref, [q, k, v])


# -- near-misses: left alone, with a reason ---------------------------------------------------------------

def miss_mask_from_float_input(q, k, v, n, x):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=x["float_mask"][:, None, None, :])


def miss_softmax_over_queries(q, k, v, n, x):
    s = (q @ k.transpose(-2, -1) * 0.25).masked_fill(~key_mask(n)[:, None, None, :], float("-inf"))
    return torch.softmax(s, dim=-2) @ v


def miss_sliding_window(q, k, v, n, x):
    i = torch.arange(L)
    window = (i[None, :] - i[:, None]).abs() <= 2
    return F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask(n)[:, None, None, :] & window)


def miss_small_fill(q, k, v, n, x):
    s = (q @ k.transpose(-2, -1) * 0.25).masked_fill(~key_mask(n)[:, None, None, :], -10.0)
    return s.softmax(-1) @ v


def miss_two_dropouts_in_training(q, k, v, n, x):
    s = (q @ k.transpose(-2, -1) * 0.25).masked_fill(~key_mask(n)[:, None, None, :], float("-inf"))
    return F.dropout(F.dropout(s.softmax(-1), p=0.1, training=True), p=0.2, training=True) @ v


def miss_weights_returned(q, k, v, n, x):
    s = (q @ k.transpose(-2, -1) * 0.25).masked_fill(~key_mask(n)[:, None, None, :], float("-inf"))
    p = s.softmax(-1)
    return p @ v, p


def miss_lengths_on_the_query_dim_only(q, k, v, n, x):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask(n)[:, None, :, None])


def miss_length_le(q, k, v, n, x):
    # `<=` keeps one more key than `<`: still a length mask (lengths + 1), so this one IS rewritten
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(torch.arange(L)[None, :] <= n[:, None])[:, None, None])


def miss_block_diagonal(q, k, v, n, x):
    i = torch.arange(L)
    block = (i[:, None] // 4) == (i[None, :] // 4)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask(n)[:, None, None, :] & block)


def miss_constant_over_scores(q, k, v, n, x):
    s = 4.0 / (q @ k.transpose(-2, -1))
    s = s.masked_fill(~key_mask(n)[:, None, None, :], float("-inf"))
    return s.softmax(-1) @ v


def miss_additive_mask_handed_in(q, k, v, n, x):
    # a float mask that enters the graph as an input (after a graph break, CTRL's): its values are unknown
    return torch.softmax(q @ k.transpose(-2, -1) * 0.25 + x["float_mask"][:, None, None, :], dim=-1) @ v


def miss_soft_capped_scores(q, k, v, n, x):
    # Gemma 2's soft-capping: c * tanh(s / c) before the mask (no kernel applies it)
    s = torch.tanh(q @ k.transpose(-2, -1) * 0.25 / 30.0) * 30.0
    return s.masked_fill(~key_mask(n)[:, None, None, :], float("-inf")).softmax(-1) @ v


def miss_float_mask_per_head(q, k, v, n, x):
    # a (B, H, L) float mask handed in, compared with 0: it may differ between heads (unlike an expand)
    s = torch.matmul(q, k.transpose(-1, -2)) * 0.25
    return torch.matmul(s.masked_fill(x["float_keep_heads"][:, :, None, :] == 0, -1e9).softmax(-1), v)


def miss_weights_rows_filled_with_one(q, k, v, n, x):
    s = (q @ k.transpose(-2, -1) * 0.25).masked_fill(~key_mask(n)[:, None, None, :], float("-inf"))
    return s.softmax(-1).masked_fill(~key_mask(n)[:, None, :, None], 1.0) @ v


def miss_weights_scaled_along_the_keys(q, k, v, n, x):
    s = (q @ k.transpose(-2, -1) * 0.25).masked_fill(~key_mask(n)[:, None, None, :], float("-inf"))
    return (s.softmax(-1) * x["row_weights"][:, None, None, :]) @ v


def miss_clamped_scores(q, k, v, n, x):
    s = (q @ k.transpose(-2, -1) * 0.25).clamp(-5.0, 5.0)
    return torch.softmax(s + (~key_mask(n)[:, None, None, :]) * -1e9, dim=-1) @ v


def miss_max_over_the_queries(q, k, v, n, x):
    s = (q @ k.transpose(-2, -1) * 0.25).masked_fill(~key_mask(n)[:, None, None, :], float("-inf"))
    return (s - s.amax(-2, keepdim=True)).softmax(-1) @ v


NEAR_MISSES = {
    miss_soft_capped_scores: "`tanh` (tanh) between the scores and the softmax",
    miss_clamped_scores: "a non-linear map of the scores",
    miss_float_mask_per_head: "differs between heads",
    miss_weights_rows_filled_with_one: "the softmax output goes to `masked_fill`",
    miss_weights_scaled_along_the_keys: "the softmax output goes to `mul`",
    miss_constant_over_scores: "divided by the scores",
    miss_mask_from_float_input: "reads the float input",
    miss_softmax_over_queries: "not over the keys",
    miss_sliding_window: "the mask is not (key index < lengths)",
    miss_small_fill: "large negative",
    miss_two_dropouts_in_training: "two dropouts",
    miss_max_over_the_queries: "subtracted from the scores",
    miss_weights_returned: "used elsewhere",
    miss_lengths_on_the_query_dim_only: "no key-padding mask",
    miss_block_diagonal: "floor",
}


@pytest.mark.parametrize("idiom, reason", list(NEAR_MISSES.items()), ids=lambda f: getattr(f, "__name__", ""))
def test_near_miss_is_left_alone_with_a_reason(idiom, reason):
    q, k, v, lengths, extra = _inputs(idiom)
    extra["float_mask"] = torch.zeros(B, L).masked_fill(torch.rand(B, L) > 0.7, -math.inf)
    # (block-diagonal and windowed masks are the block_attention pass's: off here, to see this pass refuse)
    report = explain(idiom, q, k, v, lengths, extra, config=GemConfig(block_attention={"enabled": False}))
    assert report.counts["jagged_attention"] == 0
    assert len(report.refusals) == 1
    assert reason in report.refusals[0].reason, report.refusals[0].reason


def _uint8_ids(n):
    return ((torch.arange(L)[None, :] < n[:, None]) * (torch.arange(L) * 23 % 60 + 1)).to(torch.uint8)  # 1..60


def _previous_key(n):  # pad[b, kv - 1]: at kv = 0 eager reads the last key
    pad = key_mask(n)
    return pad[torch.arange(n.shape[0])[:, None], torch.arange(L)[None, :] - 1]


def _previous_key_vmapped(n):
    pad = key_mask(n)
    per_key = torch.vmap(lambda b, j: pad[b, j - 1], in_dims=(None, 0))
    return torch.vmap(per_key, in_dims=(0, None))(torch.arange(n.shape[0]), torch.arange(L))


READ_AS_TORCH_DOES = {  # keep (B, L) masks whose integers torch does not compute as unbounded integers
    "uint8_ne_wrapped_constant": lambda n: _uint8_ids(n) != -256,  # -256 is 0 in uint8: ids != 0
    "uint8_lt_wrapped_constant": lambda n: (_uint8_ids(n) < 300) & (_uint8_ids(n) != 0),  # 300 is 44
    "int8_abs_of_min": lambda n: torch.zeros(n.shape[0], L, dtype=torch.int8).masked_fill(key_mask(n), -128).abs() < 0,
    "ids_viewed_as_float64": lambda n: _uint8_ids(n).long().view(torch.float64) != 1.0,  # bits of 1: not 1.0
    "index_tensor_minus_one": _previous_key,
    "vmapped_index_minus_one": _previous_key_vmapped,
}


@pytest.mark.parametrize("spelling", list(READ_AS_TORCH_DOES))
def test_a_mask_is_read_as_torch_computes_it(spelling):
    """Comparisons of uint8 with constants outside its range (torch casts the constant, wrapping it),
    ``abs`` of int8 -128 (-128), a view as another dtype (the bits read as other values) and an index that
    may be -1 (the last key) were each read as the unbounded integer formula (2-2.6 off); now each is eager's
    answer, the mask read as data where the formula does not hold."""
    make = READ_AS_TORCH_DOES[spelling]

    def attention(q, k, v, n):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=make(n)[:, None, None, :])

    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(B, H, L, D, generator=g, requires_grad=True) for _ in range(3))
    n = torch.tensor([L, 5, 1, 8])
    out, ref = rewritten(attention)(q, k, v, n), attention(q, k, v, n)
    defined = torch.isfinite(ref)  # a row with no valid key: NaN in eager, 0 in the kernel
    torch.testing.assert_close(torch.where(defined, out, 0), torch.where(defined, ref, 0), atol=2e-5, rtol=1e-4)


def test_a_float_mask_handed_in_is_refused_as_a_bias_not_as_no_mask():
    """Its values are unknown, so it is added as a bias: the refusal says that, not "keeps every score"."""
    q, k, v, lengths, extra = _inputs(miss_additive_mask_handed_in)
    extra["float_mask"] = torch.zeros(B, L).masked_fill(torch.rand(B, L) > 0.7, -math.inf)
    report = explain(miss_additive_mask_handed_in, q, k, v, lengths, extra)
    assert report.counts["jagged_attention"] == 0
    reasons = [r.reason for r in report.refusals]
    assert any("added as a bias" in r for r in reasons) and not any("keeps every score" in r for r in reasons)


def test_length_le_is_rewritten_with_lengths_plus_one():
    q, k, v, lengths, extra = _inputs(miss_length_le)
    report = explain(miss_length_le, q, k, v, lengths, extra)
    assert report.counts["jagged_attention"] == 1
    assert "+ 1" in report.rewrites[0].detail
    out = gem_compile(miss_length_le)(q, k, v, lengths, extra)
    torch.testing.assert_close(out, miss_length_le(q, k, v, lengths, extra), atol=2e-5, rtol=1e-4)


def test_multihead_attention_whose_weights_are_used_is_left_alone():
    report = explain(MHAModel(need_weights_used=True), torch.randn(B, L, H * D), torch.tensor([L, 5, 1, 9]))
    assert report.counts["jagged_attention"] == 0
    assert "weights" in report.refusals[0].reason


def test_disabled_pass_rewrites_nothing():
    q, k, v, lengths, extra = _inputs(sdpa_key)
    report = explain(sdpa_key, q, k, v, lengths, extra, config=GemConfig(jagged_attention={"enabled": False}))
    assert report.counts["jagged_attention"] == 0 and not report.refusals


def test_min_kv_len_leaves_short_attention_alone():
    q, k, v, lengths, extra = _inputs(sdpa_key)
    report = explain(sdpa_key, q, k, v, lengths, extra, config=GemConfig(jagged_attention={"min_kv_len": 64}))
    assert report.counts["jagged_attention"] == 0
    assert "min_kv_len" in report.refusals[0].reason


def test_unsupported_head_dim_is_left_alone():
    q = torch.randn(B, H, L, 8)
    report = explain(sdpa_key, q, q, q, torch.tensor([L, 5, 1, 0]), {})
    assert report.counts["jagged_attention"] == 0
    assert "head dim" in report.refusals[0].reason


def test_twenty_batches_of_different_lengths_compile_once(monkeypatch):
    calls = []
    original = GemBackend.__call__
    monkeypatch.setattr(GemBackend, "__call__", lambda self, *a, **kw: calls.append(1) or original(self, *a, **kw))
    compiled = gem_compile(hand_masked_fill_inf)
    q, k, v, _, extra = _inputs(hand_masked_fill_inf)
    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        lengths = torch.randint(1, L + 1, (B,), generator=g)
        out = compiled(q, k, v, lengths, extra)
        torch.testing.assert_close(out, hand_masked_fill_inf(q, k, v, lengths, extra), atol=2e-5, rtol=1e-4)
    assert len(calls) == 1


def masked_attention_any_length(q, k, v, n):
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~(torch.arange(q.shape[2])[None, :] < n[:, None])[:, None, None, :], float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def test_dynamic_padded_length_compiles_once_and_is_rewritten(monkeypatch):
    """The padded length marked dynamic: one compile serves every padded size."""
    calls = []
    original = GemBackend.__call__
    monkeypatch.setattr(GemBackend, "__call__", lambda self, *a, **kw: calls.append(1) or original(self, *a, **kw))
    counters.clear()
    compiled = gem_compile(masked_attention_any_length)
    g = torch.Generator().manual_seed(4)
    for length in (12, 20, 9):
        q, k, v = (torch.randn(B, H, length, D, generator=g) for _ in range(3))
        for t in (q, k, v):
            torch._dynamo.mark_dynamic(t, 2)
        lengths = torch.randint(1, length + 1, (B,), generator=g)
        torch.testing.assert_close(compiled(q, k, v, lengths), masked_attention_any_length(q, k, v, lengths),
                                   atol=2e-5, rtol=1e-4)
    assert len(calls) == 1
    assert counters["gemcompile"]["jagged_attention"] == 1


def test_a_symbolic_scale_is_left_alone():
    q = torch.randn(B, H, L, D)
    torch._dynamo.mark_dynamic(q, 3)  # the head dim, hence 1/sqrt(head dim), becomes symbolic
    report = explain(masked_attention_any_length, q, q, q, torch.tensor([L, 5, 1, 0]))
    assert report.counts["jagged_attention"] == 0
    assert "symbolic" in report.refusals[0].reason


def scores_in_double_values_in_float(q, k, v, n, x):
    s = q.double() @ k.double().transpose(-2, -1) * 0.25
    s = s.masked_fill(~key_mask(n)[:, None, None, :], float("-inf"))
    return s.softmax(-1).float() @ v


def test_mismatched_dtypes_are_left_alone():
    q, k, v, lengths, extra = _inputs(scores_in_double_values_in_float)
    report = explain(scores_in_double_values_in_float, q, k, v, lengths, extra)
    assert report.counts["jagged_attention"] == 0
    assert "dtypes differ" in report.refusals[0].reason


@pytest.mark.parametrize("update", ["fuxictr_last_key", "transact_first_key", "int_tensor_index"])
def test_a_mask_updated_in_place_is_read_with_its_update(update):
    """Masks fixed up in place after they are built: FuxiCTR TransAct's mask[mask.all(-1), -1] = False lets an
    empty sequence attend to its last key; Pinterest TransAct's mask[:, 0] = zeros(B) keeps every sequence's
    first key. Read from `ids == 0` alone the mask would miss the update (a silent wrong answer on those rows):
    both are read as the where() they equal, for nn.MultiheadAttention (which takes the updated tensor) and
    SDPA (a view of it), and compiled == eager with sample 1 empty. An update by an integer index tensor (a
    scatter, not a region) is the near miss: MultiheadAttention is refused with the update named."""
    mha = nn.MultiheadAttention(H * D, H, batch_first=True)

    def fixed_up(x, ids, sdpa):
        mask = ids == 0
        if update == "fuxictr_last_key":
            mask[mask.all(dim=-1), -1] = False
        elif update == "transact_first_key":
            mask[:, 0] = torch.zeros(mask.shape[0], dtype=mask.dtype, device=mask.device)
        else:
            mask[torch.arange(mask.shape[0]), (L - 1) - ids.sum(-1).clamp(max=L - 1)] = False
        if not sdpa:
            return mha(x, x, x, key_padding_mask=mask, need_weights=False)[0]
        q = x.view(x.shape[0], L, H, D).transpose(1, 2)
        return F.scaled_dot_product_attention(q, q, q, attn_mask=~mask[:, None, None, :])

    g = torch.Generator().manual_seed(2)
    x = torch.randn(B, L, H * D, generator=g, requires_grad=True)
    ids = (torch.arange(L)[None, :] >= L - torch.tensor([L, 0, 3, 5])[:, None]).long()  # left padded, 1 empty
    for sdpa in (False, True):
        report = explain(lambda x, ids: fixed_up(x, ids, sdpa), x, ids.clone())
        if update != "int_tensor_index":
            assert report.counts["jagged_attention"] == 1, [r.reason for r in report.refusals]
            assert "j" in report.rewrites[0].detail and "l_ids_" in report.rewrites[0].detail
        elif not sdpa:
            assert report.counts["jagged_attention"] == 0
            assert any("updated in place by setitem" in r.reason for r in report.refusals), report.refusals
        torch._dynamo.reset()
        out = rewritten(lambda x, ids: fixed_up(x, ids, sdpa))(x, ids.clone())
        ref = fixed_up(x, ids.clone(), sdpa)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
        assert_same_weighted_grads(out, ref, [x, *mha.parameters()])


@pytest.mark.parametrize("update", ["tril_", "mul_", "iand", "copy_"])
def test_a_repeated_key_mask_made_causal_in_place(update):
    """MEANTIME's SASRec: the key mask repeated over the query rows, then made causal in place
    (``m = (ids > 0).unsqueeze(1).repeat(1, L, 1).unsqueeze(1); m.tril_()``). tril_, mul_ and &= are read as
    their out-of-place ops (causal, rewritten); copy_ stays in place, and the repeat's rows are then no longer
    copies of one row: refused as data at both positions (the rows were read at row 0 before: the causal
    part silently dropped, outputs 1.35 off). compiled == eager on the rows eager defines, every gradient."""
    qkv = nn.Linear(H * D, 3 * H * D)

    def meantime(x, ids):
        m = (ids > 0).unsqueeze(1).repeat(1, ids.shape[1], 1).unsqueeze(1)
        causal = torch.ones(L, L, dtype=torch.bool).tril()
        if update == "tril_":
            m.tril_()
        elif update == "mul_":
            m.mul_(causal)
        elif update == "iand":
            m &= causal
        else:
            m.copy_(m & causal)
        q, k, v = (t.view(x.shape[0], L, H, D).transpose(1, 2) for t in qkv(x).chunk(3, -1))
        s = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(D)
        s = s.masked_fill(m == 0, -1e9)
        return (torch.softmax(s, dim=-1) @ v).transpose(1, 2).reshape(x.shape[0], L, H * D)

    g = torch.Generator().manual_seed(5)
    x = torch.randn(B, L, H * D, generator=g, requires_grad=True)
    valid = torch.arange(L)[None, :] >= L - torch.tensor([L, 1, 7, 0])[:, None]  # left padded, one empty
    ids = torch.randint(1, 50, (B, L), generator=g) * valid
    report = explain(meantime, x, ids)
    if update == "copy_":
        assert report.counts["jagged_attention"] == 0
        assert any("both the query and the key" in r.reason for r in report.refusals), report.refusals
    else:
        assert report.counts["jagged_attention"] == 1, [r.reason for r in report.refusals]
        assert "causal" in report.rewrites[0].detail, report.rewrites[0].detail
    out, ref = rewritten(meantime)(x, ids), meantime(x, ids)
    rows = valid[..., None]  # a left-padded row before the first token sees no valid key (eager: uniform)
    torch.testing.assert_close(out * rows, ref * rows, atol=2e-5, rtol=1e-4)
    assert_same_weighted_grads(out * rows, ref * rows, [x, *qkv.parameters()])


def test_an_internal_error_leaves_the_attention_as_written(monkeypatch):
    """A bug of the pass on one site (here: the jagged family's emit raising) must not fail the user's
    compile: the site stays as written, explain names the error, a warning says it, outputs equal eager.
    GEMCOMPILE_STRICT=1, the test suite's default, raises instead."""
    from gemcompile.passes.attention.jagged import JaggedAttention

    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(JaggedAttention, "emit", broken)
    q, k, v, lengths, extra = _inputs(sdpa_key)
    monkeypatch.setenv("GEMCOMPILE_STRICT", "0")
    with pytest.warns(UserWarning, match="internal error of gemcompile"):
        report = explain(sdpa_key, q, k, v, lengths, extra)
    assert report.counts["jagged_attention"] == 0
    assert any("internal error of gemcompile" in r.reason and "a bug" in r.reason for r in report.refusals)
    torch._dynamo.reset()
    with pytest.warns(UserWarning):
        out = rewritten(sdpa_key)(q, k, v, lengths, extra)
    torch.testing.assert_close(out, sdpa_key(q, k, v, lengths, extra))
    monkeypatch.setenv("GEMCOMPILE_STRICT", "1")
    torch._dynamo.reset()
    with pytest.raises(Exception, match="a bug"):
        explain(sdpa_key, q, k, v, lengths, extra)


def _padded_pool(q, k, v, lengths):
    valid = torch.arange(k.shape[2])[None, :] < lengths[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=valid[:, None, None, :])


def _padded_pool_plus_one(q, k, v, lengths):
    valid = torch.arange(k.shape[2])[None, :] < lengths[:, None] + 1
    return F.scaled_dot_product_attention(q, k, v, attn_mask=valid[:, None, None, :])


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.uint8])
def test_narrow_integer_lengths_are_widened(dtype):
    """int8 / int16 / uint8 lengths (the op takes int32 or int64): rewritten with lengths widened to int32, eager's
    outputs; the same lengths plus an offset the model adds in that dtype (it may wrap) are the sum as the model
    computes it, read as data (the wrap included), and eager's outputs too."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(4, 2, n, 16, generator=g) for n in (5, 12, 12))
    lengths = torch.tensor([12, 0, 3, 7], dtype=dtype)
    report = explain(_padded_pool, q, k, v, lengths)
    assert report.counts["jagged_attention"] == 1, report.refusals
    torch.testing.assert_close(gem_compile(_padded_pool)(q, k, v, lengths), _padded_pool(q, k, v, lengths),
                               atol=2e-5, rtol=1e-4)
    report = explain(_padded_pool_plus_one, q, k, v, lengths)
    assert report.counts["jagged_attention"] == 1, report.refusals
    assert "1 <" not in report.rewrites[0].detail and "+ 1" not in report.rewrites[0].detail  # no offset
    torch.testing.assert_close(gem_compile(_padded_pool_plus_one)(q, k, v, lengths),
                               _padded_pool_plus_one(q, k, v, lengths), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("spelling", ["int8_offsets", "int8_scaled", "uint8_minus"])
def test_lengths_wrapped_in_a_narrow_integer_type_keep_eagers_mask(spelling):
    """Lengths that go through int8 / uint8 arithmetic or casts wrap (16 + 120 in int8 is -120; 3 - 8 in
    uint8 is 251): the prover's integers do not, so such values are read as data where the model computes
    them, and the key vector rebuilt from them is computed in int64. It proved the unwrapped lengths before
    (outputs 2.9 off, grad of v 72-82 off)."""
    def wrapped(q, k, v, n):
        j = torch.arange(L)
        if spelling == "int8_offsets":
            keep = j[None, :] + 120 < n.to(torch.int8)[:, None] + 120
        elif spelling == "int8_scaled":
            keep = j[None, :] * 10 < n.to(torch.int8)[:, None] * 10
        else:
            keep = j[None, :] < (n.to(torch.uint8) - 8)[:, None]
        keep = keep | (j[None, :] == 0)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :])

    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(B, H, L, D, generator=g, requires_grad=True) for _ in range(3))
    n = torch.tensor([L, 11, 7, 3])
    out, ref = rewritten(wrapped)(q, k, v, n), wrapped(q, k, v, n)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    assert_same_weighted_grads(out, ref, [q, k, v])


def test_a_detached_copy_of_the_scores_nothing_reads_is_not_a_second_use():
    """openai/whisper's ``qkv_attention`` returns ``qk.detach()`` beside the output and every caller drops it:
    a node with no users in Dynamo's graph, which made the attention "also used elsewhere" (4 refusals)."""
    def attention(q, k, v, n):
        qk = (q @ k.transpose(-1, -2) * 0.25).masked_fill(~key_mask(n)[:, None, None, :], float("-inf"))
        out = torch.softmax(qk, dim=-1) @ v
        return out, qk.detach()

    def model(q, k, v, n):
        return attention(q, k, v, n)[0]

    q, k, v, lengths, _ = _inputs(sdpa_key)
    lengths = torch.tensor([L, 5, 1, 8])
    report = explain(model, q, k, v, lengths)
    assert report.counts["jagged_attention"] == 1, [r.reason for r in report.refusals]
    out, ref = rewritten(model)(q, k, v, lengths), model(q, k, v, lengths)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    assert_same_weighted_grads(out, ref, [q, k, v])


def test_a_pairwise_mask_handed_in_names_graph_breaks_as_a_likely_source():
    """transformers' 4-D bool mask reaches a layer as a graph input after a break (LayerDrop): the refusal
    says where such an input comes from, as the float-bias one does."""
    def attention(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    q, k, v, lengths, _ = _inputs(sdpa_key)
    pairwise = (key_mask(lengths)[:, :, None] & key_mask(lengths)[:, None, :])[:, None]
    reasons = [r.reason for r in explain(attention, q, k, v, pairwise).refusals]
    assert any("both the query and the key" in r and "graph break" in r for r in reasons), reasons


def test_a_float_mask_input_added_to_the_triangle_is_refused_for_the_float_input():
    """T5's decoder mask as transformers 4.57 builds it, ``(causal[i, j] + attention_mask[b, j]) == 0``, given
    a float attention_mask: the reason is the float input (not proven), not that the pairwise result it
    became reads data at both positions."""
    def attention(q, k, v, attention_mask):
        causal = torch.tril(torch.ones(L, L))
        drop = (causal[None, None] + attention_mask[:, None, None, :]) == 0
        return torch.softmax((q @ k.transpose(-1, -2)).masked_fill(drop, float("-inf")), dim=-1) @ v

    q, k, v, lengths, _ = _inputs(sdpa_key)
    reasons = [r.reason for r in explain(attention, q, k, v, key_mask(lengths).float()).refusals]
    assert reasons and all(r.startswith("the mask reads the float input") for r in reasons), reasons


def _ids_of(n):
    return (torch.arange(L)[None, :] < n[:, None]) * (torch.arange(L) % 3 + 1)


def _cat_along_queries(q, k, v, n):  # cat(axis=1): rows of one half keep keys id > 0, of the other id > 1
    ids = _ids_of(n)
    halves = [(ids > c)[:, None, None, :].expand(-1, 1, L // 2, -1) for c in (0, 1)]
    keep = torch.cat(halves, axis=2) | (torch.arange(L) == 0)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)


def _matmul_of_a_vector(q, k, v, n):  # ones(1) @ (B, 1, L): a (B, L) key mask, not an outer product
    keep = (torch.ones(1) @ (_ids_of(n) > 0).float()[:, None, :]).bool()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :])


def _weights_read_and_dropped(q, k, v, n):  # p.detach() whose result nothing uses
    s = (q @ k.transpose(-1, -2) * 0.25).masked_fill(~key_mask(n)[:, None, None, :], float("-inf"))
    p = torch.softmax(s, -1)
    p.detach()
    return p @ v


def _axis_keywords(q, k, v, n):  # unsqueeze(axis=) and softmax(axis=), numpy's spelling
    s = (q @ k.transpose(-1, -2) * 0.25).masked_fill(~key_mask(n).unsqueeze(axis=1).unsqueeze(axis=1), -1e9)
    return torch.softmax(s, axis=-1) @ v


SPELLINGS_READ_RIGHT = {  # (attention, rewritten)
    "cat_along_queries_with_axis": (_cat_along_queries, False),  # data at both positions: refused
    "matmul_of_a_vector": (_matmul_of_a_vector, True),
    "weights_read_and_dropped": (_weights_read_and_dropped, True),
    "axis_keywords": (_axis_keywords, True),
}


@pytest.mark.parametrize("spelling", list(SPELLINGS_READ_RIGHT))
def test_spellings_found_by_the_second_probe_equal_eager(spelling):
    """``torch.cat(..., axis=1)`` was read as joined along dim 0 (every query row read row 0: 2.5 off), a 1-D
    matmul operand as an outer product (3.0 off); a dropped ``p.detach()`` and ``axis=`` keywords stopped
    the rewrite with internal errors."""
    attention, served = SPELLINGS_READ_RIGHT[spelling]
    q, k, v, _, _ = _inputs(sdpa_key)
    n = torch.tensor([L, 5, 1, 8])
    report = explain(attention, q, k, v, n)
    assert report.counts["jagged_attention"] == int(served), [r.reason for r in report.refusals]
    assert not any("internal error" in r.reason for r in report.refusals)
    out, ref = rewritten(attention)(q, k, v, n), attention(q, k, v, n)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    assert_same_weighted_grads(out, ref, [q, k, v])


@pytest.mark.parametrize("post", ["mul", "masked_fill", "where"])
def test_a_post_softmax_mask_that_broadcasts_the_weights_up_is_not_the_scores_mask_again(post):
    """Merged (B * H, L, L) weights times a (B, 1, 1, L) mask broadcast to (B, B * H, L, L) in eager (matmul
    keeps it): not the scores' own mask applied again; the rewrite returned (B * H, L, D)."""
    def attention(q, k, v, lengths):
        keep = key_mask(lengths)[:, None, None, :]
        s = torch.bmm(q, k.transpose(1, 2)).view(B, H, L, L).masked_fill(~keep, -1e9).view(B * H, L, L)
        p = torch.softmax(s, -1)
        p = p * keep if post == "mul" else p.masked_fill(~keep, 0.0) if post == "masked_fill" else \
            torch.where(keep, p, 0.0)
        return torch.matmul(p, v)

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(B * H, L, D, generator=g) for _ in range(3))
    lengths = torch.tensor([L, 3, 5, 1])
    out, ref = rewritten(attention)(q, k, v, lengths), attention(q, k, v, lengths)
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("keywords", [("mask",), ("mask", "value")])
def test_masked_fill_with_keyword_arguments(keywords):
    # RecBole's SequenceAttLayer: scores.masked_fill(mask=mask, value=...) (the passes read them by position)
    torch.manual_seed(0)
    torch._dynamo.reset()
    B, H, L, D = 3, 2, 10, 16

    def f(q, k, v, n):
        drop = (torch.arange(L)[None, :] >= n[:, None])[:, None, None, :]
        s = q @ k.transpose(-1, -2)
        kwargs = {"mask": drop, "value": -1e9} if "value" in keywords else {"mask": drop}
        s = s.masked_fill(**kwargs) if "value" in keywords else s.masked_fill(value=-1e9, **kwargs)
        return torch.softmax(s, -1) @ v

    q, k, v = (torch.randn(B, H, L, D, requires_grad=True) for _ in range(3))
    n = torch.tensor([10, 3, 1])
    assert explain(f, q, k, v, n).counts.get("jagged_attention", 0) == 1
    torch.testing.assert_close(gem_compile(f)(q, k, v, n), f(q, k, v, n))


def test_einsum_with_an_ellipsis():
    # Grok / Phoenix write their attention einsums over '...' batch dims
    torch.manual_seed(0)
    torch._dynamo.reset()
    B, H, L, D = 3, 2, 10, 16

    def f(q, k, v, n):
        s = torch.einsum("...qhd,...khd->...hqk", q, k)
        keep = (torch.arange(L)[None, :] < n[:, None])[:, None, None, :]
        p = torch.softmax(torch.where(keep, s, -1e30), -1)
        return torch.einsum("...hqk,...khd->...qhd", p, v)

    q, k, v = (torch.randn(B, L, H, D, requires_grad=True) for _ in range(3))
    n = torch.tensor([10, 3, 1])
    assert explain(f, q, k, v, n).counts.get("jagged_attention", 0) == 1
    torch.testing.assert_close(gem_compile(f)(q, k, v, n), f(q, k, v, n))


def test_a_mask_scaled_by_a_learned_value_is_refused_naming_it():
    # s - (~valid) * self.mask_scale: built in the graph, no break; the reason is the learned scale
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mask_scale = torch.nn.Parameter(torch.tensor(1e4))

        def forward(self, q, k, v, n):
            valid = torch.arange(q.shape[1])[None, :] < n[:, None]
            s = q @ k.transpose(-1, -2) - (~valid)[:, None, :].float() * self.mask_scale
            return s.softmax(-1) @ v

    q, k, v = (torch.randn(3, 10, 16) for _ in range(3))
    reasons = [r.reason for r in explain(Scaled(), q, k, v, torch.tensor([10, 3, 1])).refusals]
    assert any("mask_scale" in r and "requires grad" in r for r in reasons), reasons


@pytest.mark.parametrize("lengths, says", [(torch.tensor([5]), "one value for the whole batch"),
                                           (torch.arange(L) % 5, "read per position, not per sample")])
def test_lengths_not_one_per_sample_are_refused_for_what_they_are(lengths, says):
    """One length shared by the batch (shape (1,), broadcast), or an (L,) integer tensor read at the key
    position: each refusal says which (both were 'indexed by a position ... broadcast along the wrong dim')."""
    def attention(q, k, v, n):
        if n.shape[0] == 1:
            keep = torch.arange(L)[None, :] < n[:, None]  # (1, L): the same keys for every sample
        else:
            keep = (torch.arange(L)[None, :] < n[None, :]) | (torch.arange(L) == 0)  # n[j]: one per key
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :])

    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D) for _ in range(3))
    reasons = [r.reason for r in explain(attention, q, k, v, lengths).refusals if r.pass_name == "jagged_attention"]
    assert reasons and says in reasons[0], reasons
    torch.testing.assert_close(gem_compile(attention)(q, k, v, lengths), attention(q, k, v, lengths))
