"""Attention on batch and heads merged, (B * H, L, D), around torch.bmm, as fairseq's, DeBERTa's and
Bloom's attention, single-head self-attention pooling and SASRec's TensorFlow original (heads concatenated
into the batch, query rows masked on the weights) write it: the scores viewed as (B, H, Lq, Lk) to
be masked (and back), a relative bias computed in the merged frame, k scaled inside the product, ALiBi's
bias added by baddbmm. Each:
rewritten to the jagged kernel (q, k, v viewed per head), compiled == eager on outputs and every gradient;
a mask applied per merged (b, h) row is refused with the reason."""

import math

import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import counters

from gemcompile import explain
from tests.compiled_vs_eager import assert_same_weighted_grads
from tests.rewritten import rewritten

B, L, H, D = 4, 10, 2, 16
E = H * D
LENGTHS = torch.tensor([L, 3, 7, 1])


class FairseqStyle(nn.Module):
    """(T, B, E) in; q scaled first; the key padding mask applied to the (B, H, T, S) view of bmm's scores."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(E, E) for _ in range(3))

    def forward(self, x, pad):
        t, b, _ = x.shape
        q = (self.q(x) * D ** -0.5).contiguous().view(t, b * H, D).transpose(0, 1)
        k = self.k(x).contiguous().view(-1, b * H, D).transpose(0, 1)
        v = self.v(x).contiguous().view(-1, b * H, D).transpose(0, 1)
        w = torch.bmm(q, k.transpose(1, 2)).view(b, H, t, t)
        w = w.masked_fill(pad.unsqueeze(1).unsqueeze(2), float("-inf")).view(b * H, t, t)
        o = torch.bmm(torch.softmax(w, dim=-1), v)
        return o.transpose(0, 1).contiguous().view(t, b, E)


class FairseqFiveDimStyle(FairseqStyle):
    """fairseq's current MultiheadAttention: the (B, H, T, S) view viewed again as (kv_bsz, -1, H, T, S) to
    take the key padding mask unsqueezed thrice, then back to (B * H, T, S); softmax in float32, type_as."""

    def forward(self, x, pad):
        t, b, _ = x.shape
        q = (self.q(x) * D ** -0.5).contiguous().view(t, b * H, D).transpose(0, 1)
        k = self.k(x).contiguous().view(-1, b * H, D).transpose(0, 1)
        v = self.v(x).contiguous().view(-1, b * H, D).transpose(0, 1)
        w = torch.bmm(q, k.transpose(1, 2)).view(b, H, t, t).view(b, -1, H, t, t)
        w = w.masked_fill(pad.unsqueeze(1).unsqueeze(2).unsqueeze(3).to(torch.bool), float("-inf"))
        w = w.view(b * H, t, t)
        w = torch.softmax(w, dim=-1, dtype=torch.float32).type_as(w)
        return torch.bmm(w, v).transpose(0, 1).contiguous().view(t, b, E)


class DebertaStyle(nn.Module):
    """k scaled inside the product, a content-to-position bias from a second bmm in the merged frame, the
    4-D view masked with finfo.min by the pairwise token mask, softmax per head, viewed back for bmm."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(E, E) for _ in range(3))
        self.rel = nn.Parameter(torch.randn(2 * L, E) * 0.1)

    def split(self, x):  # (B, L, E) -> (B * H, L, D)
        return x.view(x.shape[0], -1, H, D).permute(0, 2, 1, 3).reshape(-1, x.shape[1], D)

    def forward(self, x, attention_mask):
        q, k, v = self.split(self.q(x)), self.split(self.k(x)), self.split(self.v(x))
        scale = math.sqrt(D * 2)
        scores = torch.bmm(q, k.transpose(-1, -2) / scale)
        pos = self.split(self.rel[None].expand(x.shape[0], -1, -1))  # (B * H, 2L, D)
        c2p = torch.bmm(q, pos.transpose(-1, -2))  # (B * H, L, 2L): query i against relative distances
        ar = torch.arange(L, device=x.device)
        rel = ar[None, :] - ar[:, None] + L  # key j of query i at distance j - i
        c2p = torch.gather(c2p, dim=-1, index=rel[None].expand(c2p.shape[0], -1, -1))
        scores = scores + c2p / scale  # (B * H, L, L)
        scores = scores.view(-1, H, scores.size(-2), scores.size(-1))
        m = attention_mask[:, None, None, :]
        m = (m * m.squeeze(-2).unsqueeze(-1)).bool()  # DeBERTa's pairwise mask
        scores = scores.masked_fill(~m, torch.finfo(q.dtype).min)
        p = torch.softmax(scores, dim=-1)
        o = torch.bmm(p.view(-1, p.size(-2), p.size(-1)), v)
        return o.view(-1, H, L, D).permute(0, 2, 1, 3).reshape(x.shape[0], L, E)


class SingleHead(nn.Module):
    """One head on (B, L, D): bmm, the (B, 1, L) key mask added, softmax, bmm."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(E, E) for _ in range(3))

    def forward(self, x, attention_mask):
        s = torch.bmm(self.q(x), self.k(x).transpose(1, 2)) / math.sqrt(E)
        s = s + (1.0 - attention_mask[:, None, :].float()) * -1e9
        return torch.bmm(torch.softmax(s, dim=-1), self.v(x))


class AlibiStyle(nn.Module):
    """Bloom's: per-head linear biases over key positions (B * H, 1, Lk), added by baddbmm with the scaled
    product (k passed transposed), the (B, H, Lq, Lk) view plus a finfo.min causal and padding mask, softmax
    in fp32 (its dtype argument), viewed back for bmm."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(E, 3 * E)

    def forward(self, x, attention_mask):
        b = x.shape[0]
        q, k, v = (t.view(b, L, H, D).transpose(1, 2).reshape(b * H, L, D) for t in self.qkv(x).chunk(3, -1))
        slopes = torch.tensor([2.0 ** -(h + 1) for h in range(H)], device=x.device)
        positions = torch.arange(L, device=x.device)
        alibi = (slopes[None, :, None] * positions[None, None, :]).expand(b, H, L).reshape(b * H, 1, L)
        scores = alibi.baddbmm(batch1=q, batch2=k.transpose(-1, -2), beta=1.0, alpha=D ** -0.5)
        causal = torch.tril(torch.ones(L, L, dtype=torch.bool, device=x.device))
        keep = causal[None, None] & attention_mask.bool()[:, None, None, :]
        w = scores.view(b, H, L, L) + torch.where(keep, 0.0, torch.finfo(x.dtype).min)
        p = torch.softmax(w, dim=-1, dtype=torch.float32).to(x.dtype)
        o = torch.bmm(p.view(b * H, L, L), v)
        return o.view(b, H, L, D).transpose(1, 2).reshape(b, L, E)


class SasrecTfStyle(nn.Module):
    """SASRec's TensorFlow original and its PyTorch ports (gSASRec): heads concatenated into the batch
    (cat(chunk(H, dim=2), dim=0), head-major), the key mask tiled over them, the NaN of empty rows zeroed,
    then the query rows masked on the weights (w * query_mask), before the bmm with v."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(E, E) for _ in range(3))

    def forward(self, x, attention_mask):
        keep = attention_mask.float()  # (B, L)
        q, k, v = (torch.cat(f(x).chunk(H, dim=2), dim=0) for f in (self.q, self.k, self.v))  # (H * B, L, D)
        s = torch.bmm(q, k.transpose(1, 2)) / D ** 0.5
        s = s.masked_fill(keep.repeat(H, 1).unsqueeze(1) == 0, float("-inf"))
        w = torch.nan_to_num(torch.softmax(s, dim=-1))
        w = self.query_masked(w, keep.repeat(H, 1))
        return torch.cat(torch.bmm(w, v).chunk(H, dim=0), dim=2)

    def query_masked(self, w, query_keep):
        return w * query_keep.unsqueeze(-1)


class GsasrecStyle(SasrecTfStyle):
    """gSASRec's port of the same: the query mask copied along the keys first, as the TF original tiles it
    (``query_masks.unsqueeze(-1).repeat(1, 1, keys.size(1))``), and applied in place."""

    def query_masked(self, w, query_keep):
        w *= query_keep.unsqueeze(-1).repeat(1, 1, w.shape[-1])
        return w


def _inputs(name: str, seed: int = 1, device: str = "cpu", samples: slice = slice(None)):
    g = torch.Generator().manual_seed(seed)
    keep = (torch.arange(L)[None, :] < LENGTHS[samples, None]).to(device)
    batch = keep.shape[0]
    shape = (L, batch, E) if name.startswith("fairseq") else (batch, L, E)
    x = torch.randn(*shape, generator=g).to(device).requires_grad_()
    return (x, ~keep) if name.startswith("fairseq") else (x, keep.long())


MODELS = {"fairseq": FairseqStyle, "fairseq_5d": FairseqFiveDimStyle, "deberta": DebertaStyle,
          "single_head": SingleHead, "alibi": AlibiStyle, "sasrec_tf": SasrecTfStyle, "gsasrec": GsasrecStyle}


@pytest.mark.parametrize("name", list(MODELS))
def test_merged_heads_are_rewritten_and_equal_eager(name):
    _check(name)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the Triton interpreter on a machine without CUDA")
@pytest.mark.parametrize("name", ["deberta", "alibi"])
def test_merged_heads_through_the_triton_launchers(name, monkeypatch):
    """The same through the jagged op's Triton launchers (interpreter, float32): the per-head views and the
    mean-of-v rows reach the kernels."""
    pytest.importorskip("triton")
    from gemcompile.lowering.jagged_attention import op as jagged_op

    monkeypatch.setattr(jagged_op, "use_triton", lambda q: q.dtype != torch.float64)
    _check(name)


@pytest.mark.parametrize("name", list(MODELS))
def test_merged_heads_at_a_batch_of_one(name):
    """B * H merged with B = 1 (a last batch of one sample, serving): the lengths are still the batch's."""
    _check(name, samples=slice(1, 2))


def _check(name, device="cpu", samples=slice(None)):
    torch.manual_seed(0)
    model = MODELS[name]().to(device)
    x, mask = _inputs(name, device=device, samples=samples)
    report = explain(model, x, mask)
    assert report.counts["jagged_attention"] == 1, [r.reason for r in report.refusals]
    counters.clear()
    out, ref = rewritten(model)(x, mask), model(x, mask)
    assert counters["gemcompile"]["jagged_attention"] == 1
    # DeBERTa's pairwise mask leaves padded query rows with no valid key: eager averages them (finfo.min),
    # the rewrite too; compare every row
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    assert_same_weighted_grads(out, ref, [x, *model.parameters()])


def test_a_mask_per_merged_batch_and_head_is_refused():
    """A (B * H, 1, Lk) mask added to bmm's merged scores next to a (B, H, Lq, Lk) view: its rows are (b, h)
    pairs, which the pass does not map onto the view's frame: refused with the reason, and eager."""
    class MergedMask(FairseqStyle):
        def forward(self, x, pad):
            t, b, _ = x.shape
            q, k, v = (f(x).contiguous().view(t, b * H, D).transpose(0, 1) for f in (self.q, self.k, self.v))
            merged = torch.zeros(b * H, 1, t) + (torch.arange(b * H) >= 99)[:, None, None] * -1e9
            w = torch.bmm(q, k.transpose(1, 2)) + merged
            w = w.view(b, H, t, t).masked_fill(pad.unsqueeze(1).unsqueeze(2), float("-inf")).view(b * H, t, t)
            return torch.bmm(torch.softmax(w, dim=-1), v).transpose(0, 1).contiguous().view(t, b, E)

    model = MergedMask()
    x, pad = _inputs("fairseq")
    report = explain(model, x, pad)
    assert report.counts["jagged_attention"] == 0
    assert any("merged" in r.reason for r in report.refusals), [r.reason for r in report.refusals]
    torch.testing.assert_close(rewritten(model)(x, pad), model(x, pad))


class LengthsMerged(nn.Module):
    """Heads merged for bmm, the key mask built from lengths in the (B, H, L, L) view."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(E, 3 * E)

    def forward(self, x, lengths):
        b = x.shape[0]
        q, k, v = (t.reshape(b, L, H, D).transpose(1, 2).reshape(b * H, L, D) for t in self.qkv(x).chunk(3, -1))
        s = torch.bmm(q, k.transpose(1, 2)) / math.sqrt(D)
        pad = torch.arange(L, device=x.device)[None, :] >= lengths[:, None]
        s = s.view(b, H, L, L).masked_fill(pad[:, None, None, :], float("-inf")).view(b * H, L, L)
        return torch.bmm(torch.softmax(s, dim=-1), v).view(b, H, L, D).transpose(1, 2).reshape(b, L, E)


@pytest.mark.parametrize("batch", [4, 1])
def test_merged_heads_with_lengths_at_any_batch(batch):
    """At B = 1 the merged dim is H: lengths read at index 0 are still the batch's (they were refused as
    indexed by a position)."""
    torch.manual_seed(0)
    model = LengthsMerged()
    x = torch.randn(batch, L, E, requires_grad=True)
    lengths = LENGTHS[1:1 + batch] if batch == 1 else LENGTHS
    report = explain(model, x, lengths)
    assert report.counts["jagged_attention"] == 1, [r.reason for r in report.refusals]
    out, ref = rewritten(model)(x, lengths), model(x, lengths)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    assert_same_weighted_grads(out, ref, [x, *model.parameters()])


class CarcaStyle(nn.Module):
    """CARCA (its PyTorch port): heads concatenated into the batch (split on the features, cat on dim 0), the
    pairwise mask an outer product of the float token mask by ``torch.bmm``, tiled over the heads, added by
    ``baddbmm`` as ``where(mask, 0, -2 ** 32 + 1)``, and the weights multiplied by the same mask."""

    def __init__(self, heads: int):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v = (nn.Linear(E, E, bias=False) for _ in range(3))

    def forward(self, x, ids):
        token = (ids > 0).float()
        q, k, v = (torch.cat(torch.split(f(x), E // self.heads, dim=2), dim=0) for f in (self.q, self.k, self.v))
        pair = torch.bmm(token.unsqueeze(1).transpose(1, 2), token.unsqueeze(1)).bool()
        pair = torch.tile(pair, (self.heads, 1, 1))
        s = torch.baddbmm(torch.where(pair, 0.0, -(2 ** 32) + 1.0), q, k.transpose(1, 2))
        w = torch.softmax(s / (E // self.heads) ** 0.5, dim=-1) * pair
        return torch.cat(torch.split(torch.bmm(w, v), x.shape[0], dim=0), dim=2)


def test_carca_single_head_is_rewritten_and_its_tiled_heads_refused_with_the_tile_named():
    """One head: the bmm outer product is the (query, key) mask read from the ids, the baddbmm input the
    scores' mask, the weights' product by it that mask again: rewritten, == eager on every row (padded query
    rows are 0 in both). Two heads: the mask tiled over (H * B) rows is refused naming `tile` (it was called
    "a float mask handed in from outside the graph")."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 9, (4, L), generator=g) * (torch.arange(L)[None, :] < LENGTHS[:, None])
    x = torch.randn(4, L, E, generator=g, requires_grad=True)
    torch.manual_seed(0)
    model = CarcaStyle(heads=1)
    report = explain(model, x, ids)
    assert report.counts["jagged_attention"] == 1, [r.reason for r in report.refusals]
    out, ref = rewritten(model)(x, ids), model(x, ids)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    assert_same_weighted_grads(out, ref, [x, *model.parameters()])

    report = explain(CarcaStyle(heads=2), x, ids)
    assert report.counts["jagged_attention"] == 0
    reasons = [r.reason for r in report.refusals if r.pass_name == "jagged_attention"]
    assert reasons and all("`tile`" in r and "outside the graph" not in r for r in reasons), reasons


class NovaStyle(nn.Module):
    """NOVA-BERT's attention: heads concatenated into the batch, the key mask copied per head by
    ``torch.cat([m] * H, 0)`` (``m.repeat(H, 1, 1)`` was already read)."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(E, E, bias=False) for _ in range(3))

    def forward(self, x, lengths):
        valid = torch.arange(L)[None, :] < lengths[:, None]
        m = torch.cat([valid[:, None, :].expand(-1, L, -1) for _ in range(H)], 0)
        q, k, v = (torch.cat(f(x).split(D, 2), 0) for f in (self.q, self.k, self.v))
        s = (q.bmm(k.transpose(1, 2)) / math.sqrt(D)).masked_fill(m == 0, -1e8)
        return torch.cat(torch.softmax(s, -1).bmm(v).split(x.shape[0], 0), 2)


def test_a_key_mask_concatenated_over_the_heads_is_read_as_a_key_mask():
    """Refused before as "read as data at both the query and the key position"."""
    torch.manual_seed(0)
    model = NovaStyle()
    x = torch.randn(4, L, E, generator=torch.Generator().manual_seed(2), requires_grad=True)
    report = explain(model, x, LENGTHS)
    assert report.counts["jagged_attention"] == 1, [r.reason for r in report.refusals]
    out, ref = rewritten(model)(x, LENGTHS), model(x, LENGTHS)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    assert_same_weighted_grads(out, ref, [x, *model.parameters()])


def _tiled(keep, heads: int, how: str):
    """A (B, L, L) mask tiled over the heads into (B * H, L, L) rows, as models write it."""
    b = keep.shape[0]
    return {
        "repeat_flatten": lambda: keep.unsqueeze(1).repeat(1, heads, 1, 1).flatten(end_dim=1),  # FuxiCTR DMIN
        "repeat_interleave": lambda: keep.repeat_interleave(heads, 0),
        "expand_reshape": lambda: keep.unsqueeze(1).expand(b, heads, *keep.shape[1:]).reshape(b * heads, L, L),
        "repeat_view": lambda: keep.unsqueeze(1).repeat(1, heads, 1, 1).view(b * heads, L, L),
        "repeat_over_batch": lambda: keep.repeat(heads, 1, 1),  # row b * H + h is sample (b * H + h) % B's
    }[how]()


class TiledBackStyle(nn.Module):
    """FuxiCTR DMIN's attention: a per-sample causal padding mask tiled over the heads into the batch, read back
    as ``mask.view_as(scores)`` on the (B, H, L, L) scores."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.qkv = nn.Linear(E, 3 * E)

    def forward(self, x, lengths):
        b = x.shape[0]
        q, k, v = (t.view(b, L, H, D).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        s = q @ k.transpose(-1, -2) / D ** 0.5
        i = torch.arange(L)
        keep = (i[None, None, :] < lengths[:, None, None]) & (i[:, None] >= i[None, :])
        mask = _tiled(keep, H, self.how).view_as(s)
        return (s.masked_fill(~mask, -1e9).softmax(-1) @ v).transpose(1, 2).reshape(b, L, E)


@pytest.mark.parametrize("how", ["repeat_flatten", "repeat_interleave", "expand_reshape", "repeat_view",
                                 "repeat_over_batch"])
def test_a_mask_tiled_over_the_heads_and_viewed_back_is_each_samples_mask(how):
    """Tiled so that rows b * H .. b * H + H - 1 are sample b's: merged and split again, the mask is sample b's
    for every head (``(b * H + h) // H == b``), rewritten, == eager. ``repeat(H, 1, 1)`` gives head h of sample
    b another sample's mask: refused, == eager."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(4, L, E, generator=g, requires_grad=True)
    lengths = torch.tensor([L, 0, 7, 1])
    torch.manual_seed(0)
    model = TiledBackStyle(how)
    report = explain(model, x, lengths)
    if how == "repeat_over_batch":
        assert report.counts["jagged_attention"] == 0
        assert any("differs between heads" in r.reason for r in report.refusals), report.refusals
    else:
        assert report.counts["jagged_attention"] == 1, [r.reason for r in report.refusals]
        assert "causal" in report.rewrites[0].detail
    out, ref = rewritten(model)(x, lengths), model(x, lengths)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    assert_same_weighted_grads(out, ref, [x, *model.parameters()])


def test_mha_mask_inverted_after_tiling_names_the_op_and_equals_eager():
    """nn.MultiheadAttention given ``~(keep tiled over the heads)``: the op after the tiling is named in the
    refusal (only the tiling itself is read per sample), and the module runs as written."""
    mha = nn.MultiheadAttention(E, H, batch_first=True)
    x = torch.randn(4, L, E, generator=torch.Generator().manual_seed(5))
    i = torch.arange(L)

    def attend(x, lengths):
        keep = (i[None, None, :] < lengths[:, None, None]) | (i[:, None] == i[None, :])
        drop = ~keep.unsqueeze(1).repeat(1, H, 1, 1).flatten(end_dim=1)
        return mha(x, x, x, attn_mask=drop, need_weights=False)[0]

    report = explain(attend, x, LENGTHS)
    assert report.counts["jagged_attention"] == 0
    assert any("of the mask tiled over the heads" in r.reason for r in report.refusals), report.refusals
    torch.testing.assert_close(rewritten(attend)(x, LENGTHS), attend(x, LENGTHS), atol=2e-5, rtol=1e-4)
