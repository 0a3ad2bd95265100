"""Regressions for the silent wrong answers a finite mask fill or a raw-length normalizer used to give.

- a sequence with no valid key under a finite fill (BERT's (1 - m) * -1e4, HF's finfo.min, -1e9): eager
  averages over the keys; the rewrite must give the same outputs and gradients;
- scores as large as the fill (unscaled products near 1e4 with a -1e4 fill): eager does not drop the padded
  keys; the compiled model must stop with a message rather than drop them;
- GDPA normalized by raw lengths longer than the padded length: eager divides by the raw length.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from gemcompile import explain, gem_compile
from tests.compiled_vs_eager import assert_same_weighted_grads
from tests.rewritten import rewritten

B, H, L, D = 3, 2, 8, 16


def _qkv(seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(B, H, L, D, generator=g) * scale).requires_grad_() for _ in range(3)]


def _fill_attention(fill):
    def attention(q, k, v, lengths):
        keep = (torch.arange(L)[None, :] < lengths[:, None]).float()[:, None, None, :]
        s = q @ k.transpose(-2, -1) / math.sqrt(D)
        if fill == "finfo":
            s = s + (1.0 - keep) * torch.finfo(s.dtype).min
        else:
            s = s + (1.0 - keep) * fill
        return torch.softmax(s, dim=-1) @ v

    return attention


@pytest.mark.parametrize("fill", ["finfo", -1e9, -1e4])
def test_an_empty_sequence_under_a_finite_fill_matches_eager(fill):
    attention = _fill_attention(fill)
    q, k, v = _qkv()
    lengths = torch.tensor([L, 0, 3])
    assert explain(attention, q, k, v, lengths).counts["jagged_attention"] == 1
    out, ref = gem_compile(attention)(q, k, v, lengths), attention(q, k, v, lengths)
    # -1e4: eager rounds s - 1e4 to a grid of 1e-3 (its own rounding); the kernel keeps s exact
    tol = dict(atol=2e-3, rtol=2e-3) if fill == -1e4 else dict(atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(out, ref, **tol)
    w = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    grads_ref = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref, **tol)


@pytest.mark.parametrize("spelling", ["masked_fill", "where", "where_tensor"])
@pytest.mark.parametrize("fill", ["finfo", -1e9, -1e4])
def test_an_empty_sequence_under_a_fill_written_over_the_scores_is_uniform(spelling, fill):
    """masked_fill / where write F itself over every score of an empty sequence: eager's row is uniform
    whatever F is (at -1e4 too, where an added F would leave softmax(s)), and q, k get no gradient there."""
    def attention(q, k, v, lengths):
        keep = (torch.arange(L)[None, :] < lengths[:, None])[:, None, None, :]
        f = torch.finfo(q.dtype).min if fill == "finfo" else fill
        s = q @ k.transpose(-2, -1) / math.sqrt(D)
        if spelling == "where_tensor":  # the fill as a 0-d tensor built in forward
            f = torch.tensor(f)
        s = s.masked_fill(~keep, f) if spelling == "masked_fill" else torch.where(keep, s, f)
        return torch.softmax(s, dim=-1) @ v

    q, k, v = _qkv()
    lengths = torch.tensor([L, 0, 3])
    assert explain(attention, q, k, v, lengths).counts["jagged_attention"] == 1
    out, ref = gem_compile(attention)(q, k, v, lengths), attention(q, k, v, lengths)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    w = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    grads_ref = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("side", ["kept", "dropped", "masked_fill"])
@pytest.mark.parametrize("fill", ["finfo", -1e9, -1e4])
def test_a_bias_gated_by_the_mask_matches_eager_on_an_empty_sequence(side, fill):
    """s + where(keep, bias, F) (transformers 5 folds T5's position bias into its bool mask so): split into
    the mask and a bias on the kept keys only. An empty sequence gets eager's softmax(s + F), and its bias
    gets no gradient, as where's autograd gives."""
    def attention(q, k, v, lengths, bias):
        keep = (torch.arange(L)[None, :] < lengths[:, None])[:, None, None, :]
        f = torch.finfo(q.dtype).min if fill == "finfo" else fill
        gated = {"kept": lambda: torch.where(keep, bias, f), "dropped": lambda: torch.where(~keep, f, bias),
                 "masked_fill": lambda: bias.masked_fill(~keep, f)}[side]()  # Falcon folds its ALiBi so
        return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(D) + gated, dim=-1) @ v

    q, k, v = _qkv()
    bias = torch.randn(1, H, L, L, generator=torch.Generator().manual_seed(2)).requires_grad_()
    lengths = torch.tensor([L, 0, 3])
    assert explain(attention, q, k, v, lengths, bias).counts["jagged_attention"] == 1
    out, ref = gem_compile(attention)(q, k, v, lengths, bias), attention(q, k, v, lengths, bias)
    tol = dict(atol=2e-3, rtol=2e-3) if fill == -1e4 else dict(atol=2e-5, rtol=1e-4)  # eager's rounding
    torch.testing.assert_close(out, ref, **tol)
    w = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad((out * w).sum(), (q, k, v, bias))
    grads_ref = torch.autograd.grad((ref * w).sum(), (q, k, v, bias))
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref, **tol)


def test_scores_as_large_as_the_fill_stop_the_run_instead_of_dropping_keys():
    attention = _fill_attention(-1e4)
    q, k, v = _qkv(scale=40.0)  # scores around +-1e4: eager lets padded keys win
    lengths = torch.tensor([L, 5, 3])
    compiled = gem_compile(attention)
    with pytest.raises(Exception, match="can reach the mask's fill"):
        compiled(q, k, v, lengths)
    small = _qkv()  # ordinary scores: same compiled model, exact
    torch.testing.assert_close(compiled(*small, lengths), attention(*small, lengths), atol=2e-5, rtol=1e-4)


def test_the_rounding_check_reads_the_empty_sequences_own_scores():
    """-1e8: eager's s + F rounds to F only for |s| < 4 (half the fill's ulp). The check that an empty
    sequence is uniform bounds that sequence's own scores: larger scores elsewhere in the batch (up to 12
    here, a whole-batch bound of 31) do not stop a run whose empty sequence holds small ones; large ones
    there do."""
    attention = _fill_attention(-1e8)
    q, k, v = _qkv(scale=2.0)
    with torch.no_grad():
        for t in (q, k):
            t[1] *= 0.2  # the empty sequence: scores well under 4
    lengths = torch.tensor([L, 0, 3])
    compiled = gem_compile(attention)
    out, ref = compiled(q, k, v, lengths), attention(q, k, v, lengths)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    w = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1))
    for g, g_ref in zip(torch.autograd.grad((out * w).sum(), (q, k, v)),
                        torch.autograd.grad((ref * w).sum(), (q, k, v))):
        torch.testing.assert_close(g, g_ref, atol=2e-5, rtol=1e-4)
    big = [t.detach() * 4.0 for t in (q, k, v)]  # the empty sequence's scores up to 8.6: eager rounds them
    with pytest.raises(Exception, match="does not round to the fill"):
        compiled(*big, lengths)


@pytest.mark.parametrize("fill", ["finfo", -1e4])
def test_a_fill_added_by_two_terms_stops_on_an_empty_sequence_and_is_exact_otherwise(fill):
    """Two padding masks added one after the other: a key both drop gets 2F (-inf for finfo.min), so eager's
    empty sequence attends only to the keys one term drops, which no kernel computes: the run stops with
    the reason there, and is eager's everywhere else."""
    def attention(q, k, v, lengths, ids):
        f = torch.finfo(q.dtype).min if fill == "finfo" else fill
        by_length = (torch.arange(L)[None, :] < lengths[:, None]).float()[:, None, None, :]
        by_id = (ids != 0).float()[:, None, None, :]
        s = q @ k.transpose(-2, -1) / math.sqrt(D) + (1.0 - by_length) * f + (1.0 - by_id) * f
        return torch.softmax(s, dim=-1) @ v

    q, k, v = _qkv()
    ids = torch.tensor([[1, 2, 0, 3, 4, 5, 6, 7], [1, 0, 1, 0, 1, 1, 1, 1], [1, 1, 0, 1, 1, 1, 1, 1]])
    lengths = torch.tensor([L, 6, 4])
    assert explain(attention, q, k, v, lengths, ids).counts["jagged_attention"] == 1
    compiled = gem_compile(attention)
    tol = dict(atol=2e-3, rtol=2e-3) if fill == -1e4 else dict(atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(compiled(q, k, v, lengths, ids), attention(q, k, v, lengths, ids), **tol)
    with pytest.raises(Exception, match="adds its fill .* in several terms"):
        compiled(q, k, v, torch.tensor([L, 0, 4]), ids)


def test_a_finite_fill_with_a_window_is_refused_with_the_reason():
    def windowed(q, k, v, lengths):
        i = torch.arange(L)
        keep = (i[None, :] < lengths[:, None])[:, None, None, :] & ((i[:, None] - i[None, :]).abs() <= 2)
        s = (q @ k.transpose(-2, -1)).masked_fill(~keep, -1e9)
        return s.softmax(-1) @ v

    report = explain(windowed, *_qkv(), torch.tensor([L, 5, 3]))
    assert report.counts["block_attention"] == 0 and report.counts["jagged_attention"] == 0
    assert any("finite fill" in r.reason for r in report.refusals), [r.reason for r in report.refusals]


def test_gdpa_divides_by_the_raw_lengths_like_eager():
    def normalized(q, k, v, lengths):
        keep = (torch.arange(L)[None, :] < lengths[:, None])[:, None, None, :]
        a = F.silu(q @ k.transpose(-2, -1)) * keep / lengths[:, None, None, None]
        return a @ v

    q, k, v = _qkv()
    lengths = torch.tensor([20, 5, 8])  # a history longer than the padded length L = 8
    assert explain(normalized, q, k, v, lengths).counts["gdpa"] == 1
    out, ref = gem_compile(normalized)(q, k, v, lengths), normalized(q, k, v, lengths)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    grads_ref = torch.autograd.grad(ref.sum(), (q, k, v))
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref, atol=2e-5, rtol=1e-4)


def _masked_twice(fill, post: str, causal: bool, added: bool = False):
    """The scores' mask applied again to the weights after the softmax (masked_fill or where, 0; or the weights
    multiplied by it, as CARCA writes ``w * attn_mask``); ``added``: the scores' mask added as
    ``where(keep, 0, fill)``."""
    def attention(q, k, v, ids):
        keep = (ids != 0)[:, None, None, :]
        if causal:
            keep = keep & torch.tril(torch.ones(L, L, dtype=torch.bool))
        s = q @ k.transpose(-2, -1) / math.sqrt(D)
        s = s + torch.where(keep, 0.0, fill) if added else s.masked_fill(~keep, fill)
        p = torch.softmax(s, dim=-1)
        if post == "masked_fill":
            p = p.masked_fill(~keep, 0.0)
        elif post == "where":
            p = torch.where(keep, p, 0.0)
        else:
            p = p * keep if post == "mul" else keep.float() * p
        return p @ v

    return attention


# weights * mask keeps eager's NaN on a row with no key under -inf: those rows are not compared
_TWICE = [(fill, post, added) for fill in (float("-inf"), -1e9, -1e4) for post in ("masked_fill", "where", "mul",
          "mul_float") for added in (False, True) if not (post.startswith("mul") and math.isinf(fill))
          and not (added and (post == "where" or math.isinf(fill)))]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("fill, post, added", _TWICE)
def test_the_mask_applied_again_after_the_softmax_zeroes_rows_without_a_key(fill, post, added, causal):
    """Rows with no valid key (an empty sequence, holes before a causal row's first key) are 0 in eager
    whatever the fill: the second mask zeroes them. The rewrite gives them 0 too, without the fill's
    blind-row work; every other row and every gradient equal eager's."""
    attention = _masked_twice(fill, post, causal, added)
    q, k, v = _qkv(seed=4)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1, 9, (B, L), generator=g) * (torch.rand(B, L, generator=g) > 0.3)
    ids[1] = 0
    report = explain(attention, q, k, v, ids)
    assert report.counts["jagged_attention"] == 1, [r.reason for r in report.refusals]
    assert "second call" not in report.rewrites[0].detail
    out, ref = rewritten(attention)(q, k, v, ids), attention(q, k, v, ids)
    assert (ref[1] == 0).all() and (out[1] == 0).all()
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    assert_same_weighted_grads(out, ref, [q, k, v])


@pytest.mark.parametrize("post", ["masked_fill", "mul"])
def test_a_different_mask_after_the_softmax_is_refused(post):
    def attention(q, k, v, ids):
        keep = (ids != 0)[:, None, None, :]
        s = (q @ k.transpose(-2, -1)).masked_fill(~keep, -1e9)
        s = s.masked_fill(~torch.tril(torch.ones(L, L, dtype=torch.bool)), -1e9)  # a second term
        p = torch.softmax(s, dim=-1)
        return (p.masked_fill(~keep, 0.0) if post == "masked_fill" else p * keep) @ v

    q, k, v = _qkv()
    ids = torch.randint(1, 9, (B, L), generator=torch.Generator().manual_seed(1))
    report = explain(attention, q, k, v, ids)
    assert report.counts["jagged_attention"] == 0
    reasons = [r.reason for r in report.refusals]
    assert any("not the scores' own" in r for r in reasons), reasons


@pytest.mark.parametrize("factor", ["doubled", "long", "learned"])
def test_weights_multiplied_by_what_is_not_the_masks_zero_one_are_refused(factor):
    """``w * (2 * keep)``, ``w * keep.long()`` and a learned per-key weight are not the mask's 0/1 applied again
    (the kernels would drop the factor): refused, and eager."""
    scale = torch.rand(L) + 0.5

    def attention(q, k, v, ids):
        keep = (ids != 0)[:, None, None, :]
        p = torch.softmax((q @ k.transpose(-2, -1)).masked_fill(~keep, -1e9), dim=-1)
        other = {"doubled": 2.0 * keep, "long": keep.long(), "learned": scale}[factor]
        return (p * other) @ v

    q, k, v = _qkv()
    ids = torch.randint(0, 9, (B, L), generator=torch.Generator().manual_seed(1))
    assert explain(attention, q, k, v, ids).counts["jagged_attention"] == 0
    torch.testing.assert_close(rewritten(attention)(q, k, v, ids), attention(q, k, v, ids))


def test_a_zero_bias_added_beside_the_mask_is_not_a_second_fill_term():
    """HF T5's cross attention without a relative bias adds position_bias = torch.zeros(1, H, Lq, Lk) and then
    its finfo.min mask: one fill term. An empty sequence is uniform over its keys in eager; the rewrite gives
    the same rather than stopping on a 'fill in several terms' check."""
    def attention(q, k, v, keep):
        s = q @ k.transpose(-2, -1) / math.sqrt(D) + torch.zeros((1, H, L, L), dtype=q.dtype)
        s = s + torch.where(keep.bool()[:, None, None, :], 0.0, torch.finfo(q.dtype).min)
        return torch.softmax(s, dim=-1) @ v

    q, k, v = _qkv(seed=5)
    keep = (torch.arange(L)[None, :] < torch.tensor([L, 0, 3])[:, None]).long()
    assert explain(attention, q, k, v, keep).counts["jagged_attention"] == 1
    out, ref = gem_compile(attention)(q, k, v, keep), attention(q, k, v, keep)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    assert_same_weighted_grads(out, ref, [q, k, v])


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("spelling", ["masked_fill", "where"])
def test_a_learned_bias_gets_no_gradient_from_rows_the_fill_replaces(spelling, causal):
    """A fill written over the scores passes nothing back to the bias where it replaces every score of a row
    (an empty sequence; with a causal mask and left padding, a sample's leading rows): eager's bias gradient
    comes only from the other rows, and so must the rewrite's (it computed those rows from s itself)."""
    rel = torch.randn(H, L, L, requires_grad=True)
    fill = torch.finfo(torch.float32).min

    def attention(q, k, v, lengths, rel):
        pos = torch.arange(L)
        valid = pos[None, :] >= L - lengths[:, None] if causal else pos[None, :] < lengths[:, None]
        keep = valid[:, None, None, :] & (pos[None, :] <= pos[:, None] if causal else True)
        s = q @ k.transpose(-1, -2) / math.sqrt(D) + rel
        s = s.masked_fill(~keep, fill) if spelling == "masked_fill" else torch.where(keep, s, fill)
        return s.softmax(-1) @ v

    q, k, v = (torch.randn(B, H, L, D, requires_grad=True) for _ in range(3))
    lengths = torch.tensor([L, 3, 0])
    report = explain(attention, q, k, v, lengths, rel)
    assert report.counts["jagged_attention"] == 1, [r.reason for r in report.refusals]
    out, ref = rewritten(attention)(q, k, v, lengths, rel), attention(q, k, v, lengths, rel)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    assert_same_weighted_grads(out, ref, [q, k, v, rel])
