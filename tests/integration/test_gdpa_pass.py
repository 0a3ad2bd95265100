"""The gdpa pass: pointwise-activation attention written the ways modelers write it is rewritten, with
eager's outputs and gradients at the positions the model uses; near-misses are left alone with a reason."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from gemcompile import GemConfig, explain, gem_compile
from tests.compiled_vs_eager import assert_same_weighted_grads
from tests.model_styles import HstuTargetsStyle
from tests.rewritten import rewritten

B, H, L, D = 4, 2, 12, 16
LQ = 5  # learned queries (PMA)
NS = 6  # summary tokens (GDPA cross-attention keys)


def valid(lengths, n=L):
    return torch.arange(n)[None, :] < lengths[:, None]  # (B, n)


# -- idioms: (q, k, v, lengths, extra) -> out; "rows" says which output rows the model uses --------------

def hstu_silu_causal(q, k, v, n, x):
    """HSTU: silu(q k^T + rab) / N with a causal jagged mask, relative bias with a gradient."""
    i = torch.arange(L)
    rab = x["rab_table"][(i[:, None] - i[None, :]).clamp(0, L - 1)]  # (L, L), gathered from a learned table
    a = F.silu(q @ k.transpose(-2, -1) * 0.25 + rab) / L
    m = valid(n)[:, None, None, :] & valid(n)[:, None, :, None] & (i[None, :] <= i[:, None])
    return (a * m) @ v


def silu_key_mask_from_ids(q, k, v, n, x):
    """Key padding read from data (item ids, 0 = padding, with holes) as a bool mask: gdpa's kv_mask."""
    return (F.silu(q @ k.transpose(-2, -1)) * (x["ids"] > 0)[:, None, None, :]) @ v


def gelu_key_padding_float_mask(q, k, v, n, x):
    a = F.gelu(q @ k.transpose(-2, -1) / math.sqrt(D))
    return (a * valid(n)[:, None, None, :].float()) @ v


def gelu_tanh_masked_fill(q, k, v, n, x):
    a = F.gelu(torch.matmul(q, k.transpose(2, 3)), approximate="tanh")
    return a.masked_fill(~valid(n)[:, None, None, :], 0.0) @ v


def relu_squared_where(q, k, v, n, x):
    a = F.relu(q @ k.transpose(-2, -1) * 0.1) ** 2
    return torch.where(valid(n)[:, None, None, :], a, 0.0) @ v


def sigmoid_mean_over_keys(q, k, v, n, x):
    """Per-sample normalizer: the mean over each sample's valid keys."""
    a = torch.sigmoid(q @ k.transpose(-2, -1) * 0.25) * valid(n)[:, None, None, :]
    return (a / n[:, None, None, None].float()) @ v


def silu_over_clamped_lengths_per_head(q, k, v, n, x):
    """A normalizer that is not the key lengths: the clamped count (no 0 / 0), and a per-head factor."""
    a = F.silu(q @ k.transpose(-2, -1)) * valid(n)[:, None, None, :]
    return (a / (n.clamp(min=1)[:, None, None, None] * x["head_scale"])) @ v


def relu_local_window(q, k, v, n, x):
    i = torch.arange(L)
    near = (i[:, None] - i[None, :]).abs() <= 3
    a = torch.relu(q @ k.transpose(-2, -1) * 0.25)
    return (a * (valid(n)[:, None, None, :] & near)) @ v


def silu_blhd_einsum(q, k, v, n, x):
    qb, kb, vb = (t.transpose(1, 2) for t in (q, k, v))  # (B, L, H, D)
    s = torch.einsum("bqhd,bkhd->bhqk", qb, kb) * 0.25
    a = F.silu(s) * valid(n)[:, None, None, :]
    return torch.einsum("bhqk,bkhd->bqhd", a, vb).transpose(1, 2)


def pma_learned_queries(q, k, v, n, x):
    """A few learned queries shared by the batch against jagged keys."""
    a = F.gelu(x["seeds"] @ k.transpose(-2, -1) * 0.25) * valid(n)[:, None, None, :]
    return a @ v


def cross_attention_rows_masked_after(q, k, v, n, x):
    """GEM-ref's PFFN: long jagged queries, a short all-valid summary as keys, rows masked afterwards."""
    ks, vs = x["summary_k"], x["summary_v"]
    o = (F.gelu(q @ ks.transpose(-2, -1)) / L) @ vs  # (B, H, L, D)
    o = F.linear(o.transpose(1, 2).reshape(q.shape[0], L, H * D), x["w_out"])
    return o * valid(n)[..., None]


def hstu_valid_mask(n, targets, contextual):
    """HSTU's causal mask written the way generative-recommenders' reference builds it: position ids clamped
    so that the last `targets` tokens see the history and themselves, the first `contextual` tokens
    see (and are seen by) every history token; then the padding of both sides."""
    ids = torch.arange(L)[None, :]
    max_ids = n[:, None]
    if contextual:
        ids = torch.clamp(ids - contextual + 1, min=0)
        max_ids = max_ids - contextual + 1
    if targets is not None:
        max_ids = max_ids - targets[:, None]
        ids = torch.clamp(ids, max=max_ids)
    row, col = ids[..., :, None], ids[..., None, :]
    keep = torch.eye(L, dtype=torch.bool) | (row - col > 0)
    if contextual:
        keep = keep | ((row == 0) & (col < max_ids[..., None]))
    return keep & valid(n)[:, None, :] & valid(n)[:, :, None]  # (B, L, L)


def hstu_targets(q, k, v, n, x):
    a = F.silu(q @ k.transpose(-2, -1) * 0.25) / L
    return (a * hstu_valid_mask(n, x["targets"], 0)[:, None]) @ v


def hstu_contextual(q, k, v, n, x):
    a = F.silu(q @ k.transpose(-2, -1) * 0.25) / L
    return (a * hstu_valid_mask(n, None, 2)[:, None]) @ v


def hstu_contextual_one(q, k, v, n, x):
    """A prefix of one contextual token: ids - 1 + 1 shifts nothing, so no constant in the mask shows it."""
    a = F.silu(q @ k.transpose(-2, -1) * 0.25) / L
    return (a * hstu_valid_mask(n, None, 1)[:, None]) @ v


def hstu_targets_and_contextual(q, k, v, n, x):
    a = F.silu(q @ k.transpose(-2, -1) * 0.25) / L
    return (a * hstu_valid_mask(n, x["targets"], 2)[:, None]) @ v


def hstu_bidirectional_mask(n, window, threshold=0):
    """generative-recommenders' non-causal visibility: the distance made absolute by
    ``torch.where(d > 0, d, -d)``, kept within ``window`` (0: everywhere), then the padding of both sides.
    ``threshold`` other than 0 writes a near-miss (``d > 1``: d == 1 is not made positive)."""
    ids = torch.arange(L)
    dist = ids[:, None] - ids[None, :]
    dist = torch.where(dist > threshold, dist, -dist)
    keep = torch.eye(L, dtype=torch.bool) | (dist > 0)
    if window:
        keep = keep & (dist <= window)
    return keep[None] & valid(n)[:, None, :] & valid(n)[:, :, None]  # (B, L, L)


def hstu_bidirectional(q, k, v, n, x):
    a = F.silu(q @ k.transpose(-2, -1) * 0.25) / L
    return (a * hstu_bidirectional_mask(n, 0)[:, None]) @ v


def hstu_bidirectional_window(q, k, v, n, x):
    a = F.silu(q @ k.transpose(-2, -1) * 0.25) / L
    return (a * hstu_bidirectional_mask(n, 3)[:, None]) @ v


def identity_linear_attention(q, k, v, n, x):
    """No activation at all (linear attention), key padding by a float mask, a constant normalizer."""
    a = q @ k.transpose(-2, -1) * 0.25
    return (a * valid(n)[:, None, None, :].float() / L) @ v


def identity_causal_masked_fill_with_bias(q, k, v, n, x):
    i = torch.arange(L)
    s = q @ k.transpose(-2, -1) / math.sqrt(D) + x["rab_table"][(i[:, None] - i[None, :]).clamp(0, L - 1)]
    keep = valid(n)[:, None, None, :] & (i[None, :] <= i[:, None])
    return s.masked_fill(~keep, 0.0) @ v


def silu_filled_before_the_activation(q, k, v, n, x):
    """torch-rechub's HSTULayer: the dropped pairs filled with -1e4 before the SiLU (silu(-1e4) is exactly 0)."""
    i = torch.arange(L)
    keep = valid(n)[:, None, None, :] & (i[None, :] <= i[:, None])
    return F.silu((q @ k.transpose(-2, -1)).masked_fill(~keep, -1e4)) / L @ v


def gelu_filled_then_scaled(q, k, v, n, x):
    """A fill, then a scale, then the GELU: it sees -5e3, and gelu(-5e3) is exactly 0."""
    return F.gelu((q @ k.transpose(-2, -1)).masked_fill(~valid(n)[:, None, None, :], -1e4) * 0.5) / L @ v


IDIOMS = {f.__name__: f for f in (
    silu_filled_before_the_activation, gelu_filled_then_scaled,
    identity_linear_attention, identity_causal_masked_fill_with_bias,
    hstu_targets, hstu_contextual, hstu_contextual_one, hstu_targets_and_contextual, hstu_bidirectional, hstu_bidirectional_window,
    hstu_silu_causal, gelu_key_padding_float_mask, gelu_tanh_masked_fill, relu_squared_where,
    sigmoid_mean_over_keys, silu_over_clamped_lengths_per_head, relu_local_window, silu_blhd_einsum,
    pma_learned_queries,
    cross_attention_rows_masked_after, silu_key_mask_from_ids,
)}


def _inputs(seed=0, device="cpu"):
    """Drawn on the CPU (the same values on every device), then moved: leaves on ``device``."""
    g = torch.Generator().manual_seed(seed)

    def leaf(*shape):
        return torch.randn(*shape, generator=g, device="cpu").to(device).requires_grad_()

    q, k, v = (leaf(B, H, L, D) for _ in range(3))
    lengths = torch.tensor([L, 5, 1, 0], device=device)
    extra = {
        "rab_table": leaf(L),
        "seeds": leaf(1, H, LQ, D),
        "summary_k": leaf(B, H, NS, D),
        "summary_v": leaf(B, H, NS, D),
        "w_out": leaf(H * D, H * D),
        "targets": torch.tensor([2, 1, 1, 0], device=device),  # at most each sample's length
        "ids": torch.randint(0, 4, (B, L), generator=g, device="cpu").to(device),
        "head_scale": (torch.rand(1, H, 1, 1, generator=g, device="cpu") + 0.5).to(device),
    }
    return q, k, v, lengths, extra


def _used(name, out, lengths):
    """The output positions the model defines: rows of valid queries (all rows for PMA)."""
    if name == "pma_learned_queries":
        return torch.ones_like(out, dtype=torch.bool)
    if name in ("cross_attention_rows_masked_after", "silu_key_mask_from_ids"):
        return torch.ones_like(out, dtype=torch.bool)  # masked by the model itself / every row computed
    return valid(lengths)[:, None, :, None].expand_as(out)


@pytest.mark.parametrize("name", list(IDIOMS))
def test_idiom_is_rewritten_with_eager_outputs_and_gradients(name):
    check_idiom(name)


def check_idiom(name, device="cpu", atol=2e-5):
    """IDIOMS[name] rewritten by gdpa alone, with eager's outputs and gradients at the rows the model uses
    (tests/gpu/test_real_model_masks_gpu.py runs it on CUDA, the idioms' own tensors made there by the default
    device)."""
    idiom = IDIOMS[name]
    q, k, v, lengths, extra = _inputs(device=device)
    if name == "sigmoid_mean_over_keys":  # eager divides 0 by 0 on an empty sample: _empty_sample_stays_nan
        lengths = torch.tensor([L, 5, 1, 3], device=device)
    report = explain(idiom, q, k, v, lengths, extra)
    assert report.counts["gdpa"] == 1, report.refusals
    assert report.counts.get("jagged_attention", 0) == 0
    counters.clear()
    compiled = gem_compile(idiom, fullgraph=True)
    out = compiled(q, k, v, lengths, extra)
    ref = idiom(q, k, v, lengths, extra)
    used = _used(name, ref, lengths)
    torch.testing.assert_close(torch.where(used, out, 0), torch.where(used, ref, 0), atol=atol, rtol=1e-4)
    assert torch.isfinite(torch.where(used, out, 0)).all()
    weights = torch.randn(ref.shape, generator=torch.Generator().manual_seed(2), device="cpu").to(device)
    leaves = [t for t in (q, k, v, *extra.values()) if t.requires_grad]
    grads = torch.autograd.grad((torch.where(used, out, 0) * weights).sum(), leaves, allow_unused=True)
    grads_ref = torch.autograd.grad((torch.where(used, ref, 0) * weights).sum(), leaves, allow_unused=True)
    for g, g_ref in zip(grads, grads_ref):
        assert (g is None) == (g_ref is None)
        if g is not None:
            torch.testing.assert_close(g, g_ref, atol=2.5 * atol, rtol=1e-4)
    if name == "sigmoid_mean_over_keys":
        _empty_sample_stays_nan(compiled, idiom, q, k, v, lengths, extra, weights)
    assert counters["gemcompile"]["gdpa"] == 1


def _empty_sample_stays_nan(compiled, idiom, q, k, v, lengths, extra, weights, empty=3):
    """A mean over a sample's valid keys, on an empty sample: eager divides 0 by 0, and so does gem_compile (the
    model's own divisor is applied to the op's output: "0 / 0 stays eager's NaN", passes/attention/gdpa.py).
    Both are NaN on that sample and nowhere else; the other samples keep eager's values and q/k/v gradients.
    The same compiled function: no recompile."""
    lengths = lengths.clone()
    lengths[empty] = 0
    out, ref = compiled(q, k, v, lengths, extra), idiom(q, k, v, lengths, extra)
    assert ref[empty].isnan().all() and out[empty].isnan().all()
    keep = torch.arange(out.shape[0]) != empty
    assert torch.isfinite(out[keep]).all()
    torch.testing.assert_close(out[keep], ref[keep], atol=2e-5, rtol=1e-4)
    rows = keep[:, None, None, None]
    grads = torch.autograd.grad((torch.where(rows, out, 0) * weights).sum(), (q, k, v))
    grads_ref = torch.autograd.grad((torch.where(rows, ref, 0) * weights).sum(), (q, k, v))
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g[keep], g_ref[keep], atol=5e-5, rtol=1e-4)


def test_explain_describes_the_proven_mask():
    q, k, v, lengths, extra = _inputs()
    (rewrite,) = [r for r in explain(hstu_silu_causal, q, k, v, lengths, extra).rewrites if r.pass_name == "gdpa"]
    assert "silu" in rewrite.detail and "causal j <= i" in rewrite.detail and "keys j <" in rewrite.detail
    (rewrite,) = [r for r in explain(cross_attention_rows_masked_after, q, k, v, lengths, extra).rewrites if r.pass_name == "gdpa"]
    assert "query rows: n < l_n_[b], from the output row mask at test_gdpa_pass.py:" in rewrite.detail
    (rewrite,) = [r for r in explain(relu_local_window, q, k, v, lengths, extra).rewrites if r.pass_name == "gdpa"]
    assert "window |i - j| <= 3" in rewrite.detail
    (rewrite,) = [r for r in explain(hstu_targets_and_contextual, q, k, v, lengths, extra).rewrites if r.pass_name == "gdpa"]
    assert "targets" in rewrite.detail and "first 2 tokens are contextual" in rewrite.detail


# -- near-misses ----------------------------------------------------------------------------------------

def miss_mask_inside_the_activation(q, k, v, n, x):
    s = (q @ k.transpose(-2, -1) * 0.25).masked_fill(~valid(n)[:, None, None, :], 0.0)
    return torch.sigmoid(s) @ v  # sigmoid(0) = 0.5: the padded keys still contribute


def miss_mask_from_input(q, k, v, n, x):
    return (F.silu(q @ k.transpose(-2, -1)) * x["float_mask"][:, None, None, :]) @ v


def miss_weighted_not_masked(q, k, v, n, x):
    w = valid(n).float() * 0.5 + 0.5  # 0.5 / 1.0 weights: not a mask
    return (F.silu(q @ k.transpose(-2, -1)) * w[:, None, None, :]) @ v


def miss_block_diagonal(q, k, v, n, x):
    i = torch.arange(L)
    block = (i[:, None] // 4) == (i[None, :] // 4)
    return (F.gelu(q @ k.transpose(-2, -1)) * (valid(n)[:, None, None, :] & block)) @ v


def miss_scores_used_elsewhere(q, k, v, n, x):
    a = F.silu(q @ k.transpose(-2, -1)) * valid(n)[:, None, None, :]
    return a @ v, a.sum()


def miss_divided_per_key(q, k, v, n, x):
    a = F.silu(q @ k.transpose(-2, -1)) * valid(n)[:, None, None, :]
    return (a / (torch.arange(L) + 1.0)) @ v  # a divisor that varies along the keys is not a normalizer


def miss_targets_without_the_diagonal(q, k, v, n, x):
    """Targets that do not see themselves: not HSTU's mask (no kernel serves it)."""
    m = hstu_valid_mask(n, x["targets"], 0) & ~torch.eye(L, dtype=torch.bool)
    return (F.silu(q @ k.transpose(-2, -1)) * m[:, None]) @ v


def miss_identity_without_a_mask(q, k, v, n, x):
    """Two plain matmuls: nothing for the kernel to skip, so nothing is rewritten (and nothing reported)."""
    return (q @ k.transpose(-2, -1) * 0.25) @ v


def miss_mask_on_heads(q, k, v, n, x):
    m = torch.arange(H)[None, :, None, None] < n[:, None, None, None]
    return (F.silu(q @ k.transpose(-2, -1)) * m) @ v


def miss_fill_before_silu_minus_inf(q, k, v, n, x):
    return F.silu((q @ k.transpose(-2, -1)).masked_fill(~valid(n)[:, None, None, :], float("-inf"))) @ v


def miss_fill_before_silu_too_small(q, k, v, n, x):
    return F.silu((q @ k.transpose(-2, -1)).masked_fill(~valid(n)[:, None, None, :], -10.0)) @ v  # -4.5e-4


def miss_fill_then_a_bias_before_silu(q, k, v, n, x):
    s = (q @ k.transpose(-2, -1)).masked_fill(~valid(n)[:, None, None, :], -1e4)
    return F.silu(s + x["rab_table"]) @ v


NEAR_MISSES = {
    miss_mask_inside_the_activation: "before the activation",
    miss_fill_before_silu_minus_inf: "does not turn into 0",
    miss_fill_before_silu_too_small: "not exactly 0",
    miss_fill_then_a_bias_before_silu: "does not turn into 0",
    miss_mask_from_input: "mask reads the float input",
    miss_weighted_not_masked: "values other than 0 and 1",
    miss_block_diagonal: "not a combination of key padding",
    miss_scores_used_elsewhere: "also used elsewhere",
    miss_divided_per_key: "varies along the keys",
    miss_mask_on_heads: "differs between heads",
    miss_targets_without_the_diagonal: "nor HSTU's target/contextual mask",
}


@pytest.mark.parametrize("idiom,reason", list(NEAR_MISSES.items()), ids=[f.__name__ for f in NEAR_MISSES])
def test_near_miss_is_left_alone_with_a_reason(idiom, reason):
    q, k, v, lengths, extra = _inputs()
    extra["float_mask"] = valid(lengths).float()
    report = explain(idiom, q, k, v, lengths, extra)
    assert report.counts.get("gdpa", 0) == 0
    messages = " | ".join(r.reason for r in report.refusals)
    assert any(__import__("re").search(reason, r.reason) for r in report.refusals), messages


def test_identity_without_a_mask_is_not_reported():
    q, k, v, lengths, extra = _inputs()
    report = explain(miss_identity_without_a_mask, q, k, v, lengths, extra)
    assert report.counts.get("gdpa", 0) == 0 and not [r for r in report.refusals if r.pass_name == "gdpa"]


def test_softmax_attention_left_to_jagged_is_not_an_identity_site():
    """masked_fill on raw scores followed by softmax is softmax attention: gdpa reports nothing."""
    q, k, v, lengths, extra = _inputs()

    def softmax_attention(q, k, v, n, x):
        s = (q @ k.transpose(-2, -1)).masked_fill(~valid(n)[:, None, None, :], float("-inf"))
        return torch.softmax(s, dim=-1).nan_to_num() @ v

    report = explain(softmax_attention, q, k, v, lengths, extra)
    assert report.counts.get("gdpa", 0) == 0 and not [r for r in report.refusals if r.pass_name == "gdpa"]


def test_mlp_activations_are_not_reported():
    """An activation between two Linears is not attention: no rewrite and no refusal noise."""
    mlp = torch.nn.Sequential(torch.nn.Linear(D, 32), torch.nn.GELU(), torch.nn.Linear(32, D))
    report = explain(mlp, torch.randn(B, L, D))
    assert report.counts.get("gdpa", 0) == 0 and not [r for r in report.refusals if r.pass_name == "gdpa"]


def test_disabled_pass_rewrites_nothing():
    q, k, v, lengths, extra = _inputs()
    report = explain(gelu_key_padding_float_mask, q, k, v, lengths, extra, config=GemConfig(gdpa={"enabled": False}))
    assert report.counts.get("gdpa", 0) == 0


def test_a_normalizer_that_is_not_the_key_lengths_must_not_hold_zero():
    """Divided term by term, eager turns a 0 divisor into NaN/inf per term; divided after the sum, the op's
    output would differ, so the rewrite checks the divisor on the device and stops with a message."""
    q, k, v, lengths, extra = _inputs()
    (rewrite,) = [r for r in explain(silu_over_clamped_lengths_per_head, q, k, v, lengths, extra).rewrites
                  if r.pass_name == "gdpa"]
    assert "normalized by " in rewrite.detail and "the key lengths" not in rewrite.detail
    compiled = gem_compile(silu_over_clamped_lengths_per_head, fullgraph=True)
    compiled(q, k, v, lengths, extra)
    extra["head_scale"] = extra["head_scale"].detach().clone()
    extra["head_scale"][0, 1] = 0.0
    with pytest.raises(RuntimeError, match="normalizer .* holds a 0"):
        compiled(q, k, v, lengths, extra)


def _divided_then_masked(normalizer: str):
    """silu(q k^T) divided per sample, then the mask written over it (where): a sample whose normalizer is
    0 has every score replaced by 0, so its output is 0 in eager, not 0 / 0."""
    def attention(q, k, v, n, ids):
        count = n[:, None, None, None] if normalizer == "lengths" else (ids != 0).sum(-1)[:, None, None, None]
        a = F.silu(q @ k.transpose(-2, -1)) / count
        keep = (ids != 0)[:, None, None, :] if normalizer == "count" else valid(n)[:, None, None, :]
        return torch.where(keep, a, 0.0) @ v

    return attention


@pytest.mark.parametrize("normalizer", ["lengths", "count"])
def test_an_empty_sequence_divided_then_masked_is_zero_as_in_eager(normalizer):
    attention = _divided_then_masked(normalizer)
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(B, H, L, D, generator=g, requires_grad=True) for _ in range(3))
    lengths = torch.tensor([L, 0, 5, 1])
    ids = torch.randint(1, 9, (B, L), generator=g) * valid(lengths)
    assert explain(attention, q, k, v, lengths, ids).counts["gdpa"] == 1
    out, ref = gem_compile(attention)(q, k, v, lengths, ids), attention(q, k, v, lengths, ids)
    assert (ref[1] == 0).all() and (out[1] == 0).all()
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    keep = torch.arange(B) != 1  # eager's backward is NaN through the empty sample's 0 / 0: compare the rest
    w = torch.randn(ref.shape, generator=g) * keep[:, None, None, None]
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    grads_ref = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a[keep], b[keep], atol=5e-5, rtol=1e-4)


@pytest.mark.parametrize("batch", [1, 3])
def test_hstu_with_targets_at_a_batch_of_one(batch):
    """A batch of one (serving, and Dynamo's first compile of it) reads the lengths at index 0, which is the
    batch index there: HSTU's target mask and its dropped rows are proven as at any batch size."""
    torch.manual_seed(0)
    model = HstuTargetsStyle(H, D)
    g = torch.Generator().manual_seed(batch)
    n = torch.randint(2, L + 1, (batch,), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), n.cumsum(0)])
    targets = torch.ones(batch, dtype=torch.long)
    x = torch.randn(batch, L, H * D, generator=g, requires_grad=True)
    report = explain(model, x, offsets, targets)
    assert report.counts["gdpa"] == 1, [r.reason for r in report.refusals]
    out, ref = rewritten(model)(x, offsets, targets), model(x, offsets, targets)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    assert_same_weighted_grads(out, ref, [x, *model.parameters()])


TARGET_COUNTS = {  # num_targets as models hand them over, for lengths (B = 3) from offsets
    "column_of_metadata": lambda: torch.tensor([[1, 9], [2, 9], [0, 9]])[:, 0],  # stride 2
    "expanded_one": lambda: torch.tensor([2]).expand(3),  # stride 0
    "int16": lambda: torch.tensor([1, 2, 0], dtype=torch.int16),
    "uint8": lambda: torch.tensor([1, 2, 0], dtype=torch.uint8),
    "more_than_the_length": lambda: torch.tensor([1, 50, 2]),
    "negative": lambda: torch.tensor([-3, 1, 2]),
}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the Triton interpreter on a machine without CUDA")
@pytest.mark.parametrize("spelling", list(TARGET_COUNTS))
def test_hstu_target_counts_of_any_layout_dtype_or_range_equal_eager(spelling, monkeypatch):
    """num_targets through the Triton launchers (interpreter, float32): a strided or expanded vector was read as
    contiguous (14-29% off), int16/uint8 ones stopped the rewrite with an internal error, and counts outside
    [0, length] raised on the CPU while eager computes its mask from them. The op now takes them widened,
    contiguous and clamped to [0, length], which keeps the mask's keys for any value."""
    pytest.importorskip("triton")
    from gemcompile.lowering.gdpa import op as gdpa_op

    monkeypatch.setattr(gdpa_op, "use_triton", lambda q: q.dtype != torch.float64)
    torch.manual_seed(0)
    model = HstuTargetsStyle(H, D)
    g = torch.Generator().manual_seed(4)
    offsets = torch.tensor([0, L, L + 5, L + 14])  # lengths L, 5, 9
    targets = TARGET_COUNTS[spelling]()
    x = torch.randn(3, L, H * D, generator=g, requires_grad=True)
    report = explain(model, x, offsets, targets)
    assert report.counts["gdpa"] == 1, [r.reason for r in report.refusals]
    out, ref = rewritten(model)(x, offsets, targets), model(x, offsets, targets)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    assert_same_weighted_grads(out, ref, [x, *model.parameters()])


@pytest.mark.parametrize("targets", [[L, 2, 0], [3, 2, 0], [L + 5, 0, 9]])
def test_hstu_targets_of_a_history_longer_than_the_padded_length_equal_eager(targets):
    """A sequence longer than L (a history truncated to L, its length kept raw): eager's target rows start at
    n - num_targets with the raw n; the op counts from its clamped length, so the count is shifted by what
    the length exceeds L (the rewrite gave every row of that sample as a target: 0.53 off)."""
    torch.manual_seed(0)
    model = HstuTargetsStyle(H, D)
    g = torch.Generator().manual_seed(5)
    offsets = torch.tensor([0, L + 3, L + 8, L + 17])  # lengths L + 3, 5, 9
    x = torch.randn(3, L, H * D, generator=g, requires_grad=True)
    num_targets = torch.tensor(targets)
    report = explain(model, x, offsets, num_targets)
    assert report.counts["gdpa"] == 1, [r.reason for r in report.refusals]
    out, ref = rewritten(model)(x, offsets, num_targets), model(x, offsets, num_targets)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    assert_same_weighted_grads(out, ref, [x, *model.parameters()])


def test_hstu_distance_made_absolute_by_a_near_miss_where_is_not_a_two_sided_window():
    """``where(d > 1, d, -d)`` leaves d == 1 negative: the key right before the query is not kept, so the mask
    is no window of 3 on both sides: refused, with the mask it is instead, and the compiled model equals eager."""
    q, k, v, lengths, extra = _inputs()

    def near_miss(q, k, v, n, x):
        a = F.silu(q @ k.transpose(-2, -1) * 0.25) / L
        return (a * hstu_bidirectional_mask(n, 3, threshold=1)[:, None]) @ v

    report = explain(near_miss, q, k, v, lengths, extra)
    assert report.counts["gdpa"] == 0, [r.detail for r in report.rewrites]
    assert any("the mask is" in r.reason for r in report.refusals), [r.reason for r in report.refusals]
    out, ref = gem_compile(near_miss)(q, k, v, lengths, extra), near_miss(q, k, v, lengths, extra)
    used = _used("near_miss", ref, lengths)
    torch.testing.assert_close(torch.where(used, out, 0), torch.where(used, ref, 0), atol=2e-5, rtol=1e-4)


def test_hstu_targets_with_a_window_stop_on_a_negative_target_count():
    """HSTU's target mask with a window (max_attn_len) and a key-padding term, every row returned: the kernels'
    tile ranges with a window assume target counts >= 0 (a negative one gave the padded rows other values):
    checked on the device, so a negative count stops the run; counts >= 0 (larger than the length too) equal
    eager on every row."""
    def attention(q, k, v, n, x):
        ids = torch.clamp(torch.arange(L).view(1, L), max=(n - x["targets"]).view(-1, 1, 1))
        dist = ids.view(-1, L, 1) - ids.view(-1, 1, L)
        keep = (torch.eye(L, dtype=torch.bool) | (dist > 0)) & (dist <= 3) & valid(n)[:, None, :]
        return (F.silu(q @ k.transpose(-2, -1) * 0.25) / L * keep[:, None]) @ v

    q, k, v, lengths, extra = _inputs()
    report = explain(attention, q, k, v, lengths, extra)
    assert report.counts["gdpa"] == 1, [r.reason for r in report.refusals]
    compiled = gem_compile(attention)
    for targets in ([2, 1, 1, 0], [0, 9, 1, 0]):
        extra["targets"] = torch.tensor(targets)
        torch.testing.assert_close(compiled(q, k, v, lengths, extra), attention(q, k, v, lengths, extra),
                                   atol=2e-5, rtol=1e-4)
    extra["targets"] = torch.tensor([2, -1, 1, 0])
    with pytest.raises(Exception, match="negative target count"):
        compiled(q, k, v, lengths, extra)
