"""Unpad regions packed by a per-token vector read from data (issue 23): SASRec's timeline mask
``ids == 0`` on right-padded, left-padded and holed batches, left padding by lengths; compiled == eager for
outputs and every gradient, one compile for batches whose token counts change, one index per vector, and
the near-misses (zeroing by one vector and packing by another, a per-head mask, a mask proven only under a
run-time check) refused with the reason.

Compiled with the pre-grad passes and aot_eager (the same rewritten graph and ops, no C++ compile)."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from gemcompile import explain
from gemcompile.passes.records import PassLog, recording
from tests.compiled_vs_eager import assert_same_weighted_grads
from tests.model_styles import SASRecBlock
from tests.rewritten import rewritten

B, L, H, D = 4, 12, 2, 16
E = H * D
ITEMS = 50


class SASRecStack(nn.Module):
    """SASRec: item and position embeddings, blocks that zero the padded rows with the timeline mask
    (tests/model_styles.py), a last LayerNorm and the logits of the next items."""

    def __init__(self, blocks: int = 2, key_padding: bool = True):
        super().__init__()
        self.item_emb = nn.Embedding(ITEMS, E, padding_idx=0)
        self.pos_emb = nn.Embedding(L + 1, E)
        self.blocks = nn.ModuleList(SASRecBlock(H, D, key_padding=key_padding) for _ in range(blocks))
        self.last_norm = nn.LayerNorm(E)

    def forward(self, ids, next_ids):
        seqs = self.item_emb(ids) * E ** 0.5
        seqs = seqs + self.pos_emb(torch.arange(1, L + 1, device=ids.device)[None, :] * (ids != 0))
        for block in self.blocks:
            seqs = block(seqs, ids)
        return (self.last_norm(seqs) * self.item_emb(next_ids)).sum(-1)


def _ids(kind: str, g: torch.Generator) -> torch.Tensor:
    """Item ids, 0 = padding: right padded, left padded (empty sequences too), or with holes anywhere but
    the first position (a causal row whose keys are all padding is NaN in eager)."""
    items = torch.randint(1, ITEMS, (B, L), generator=g)
    lengths = torch.randint(0 if kind == "left" else 1, L + 1, (B,), generator=g)  # (a causal row with
    lengths[0] = L  # no valid key is NaN in eager: empty sequences only where the keys are not masked)
    positions = torch.arange(L)[None, :]
    if kind == "right":
        return items * (positions < lengths[:, None])
    if kind == "left":
        return items * (positions >= L - lengths[:, None])
    holes = torch.rand(B, L, generator=g) < 0.4
    holes[:, 0] = False
    return items.masked_fill(holes, 0)


def _compiled(model):
    """(the model compiled with gemcompile's pre-grad passes and aot_eager, the list of its compiles)."""
    compiles = []
    return rewritten(model, compiles), compiles


def _assert_eager(model, compiled, inputs):
    """Outputs and the gradients of every parameter and float input equal eager's."""
    floats = [t for t in inputs if t.is_floating_point()]
    for t in floats:
        t.requires_grad_(True)
    leaves = [*model.parameters(), *floats]
    out, ref = compiled(*inputs), model(*inputs)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    assert_same_weighted_grads(out, ref, leaves, seed=7)


def _indices(report) -> int:
    """How many valid-token indices (host reads of T per step) the rewritten graph computes."""
    return sum("valid_mask_index" in str(n.target) for n in report.graph_after.graph.nodes)


def _unpad(report):  # (an ExplainReport or the PassLog of a compile)
    return [r for r in report.rewrites if r.pass_name == "unpad"]


def _reasons(report):
    return [r.reason for r in report.refusals if r.pass_name == "unpad"]


@pytest.mark.parametrize("kinds, key_padding, gemms", [
    (("right", "holes", "right"), True, 10),  # q, kv, out projections and the FFN of both blocks
    (("left", "holes", "left"), False, 8),  # the 2020 timeline version: causal keys include padding
])
def test_sasrec_stack_runs_packed_by_its_timeline_mask(kinds, key_padding, gemms):
    torch.manual_seed(0)
    model = SASRecStack(key_padding=key_padding)
    g = torch.Generator().manual_seed(1)
    report = explain(model, _ids(kinds[0], g), torch.randint(1, ITEMS, (B, L), generator=g))
    (region,) = _unpad(report)
    assert report.counts["jagged_attention"] == 2
    assert region.metrics["gemms"] == gemms, region.detail
    assert "region over the tokens where ~(l_ids_[b, n] == 0)" in region.detail
    assert _indices(report) == 1  # one index for the timeline masks of both blocks
    if not key_padding:  # k and v of padded rows are read by the valid rows: they stay padded
        assert any("stays padded" in r and "reads keys not provably among the tokens where" in r
                   for r in _reasons(report)), _reasons(report)
    compiled, compiles = _compiled(model)
    for kind in kinds:  # the masks and token counts change from batch to batch: no recompile
        _assert_eager(model, compiled, (_ids(kind, g), torch.randint(1, ITEMS, (B, L), generator=g)))
    assert len(compiles) == 1
    assert sum("valid_mask_index" in str(n.target) for n in compiles[0].graph.nodes) == 1  # it ran packed


class Ffn(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(E), nn.Linear(E, 2 * E), nn.Linear(2 * E, E)

    def forward(self, h):
        return self.down(F.gelu(self.up(self.norm(h))))


class LeftPaddedFfn(nn.Module):
    """Left padding by lengths (``n >= N - lengths[b]``): a token vector without data, masked mean pooling."""

    def __init__(self):
        super().__init__()
        self.inp, self.ffn = nn.Linear(E, E), Ffn()

    def forward(self, x, lengths):
        valid = (torch.arange(L)[None, :] >= L - lengths[:, None])[..., None]
        h = self.inp(x) * valid
        h = h + self.ffn(h) * valid
        return h.sum(1) / lengths.clamp(min=1)[:, None]


def test_left_padding_by_lengths_runs_packed():
    torch.manual_seed(0)
    model = LeftPaddedFfn()
    x = torch.randn(B, L, E)
    report = explain(model, x, torch.tensor([12, 0, 3, 7]))
    (region,) = _unpad(report)
    assert region.metrics["gemms"] == 3 and "l_lengths_" in region.detail, region.detail
    compiled, compiles = _compiled(model)
    for lengths in ([12, 0, 3, 7], [1, 5, 12, 0], [0, 0, 0, 0]):
        _assert_eager(model, compiled, (torch.randn(B, L, E), torch.tensor(lengths)))
    assert len(compiles) == 1


class TwoVectors(nn.Module):
    """Near-misses: the rows are packed by ``ids > 0``, but the attention's keys (``miss="keys"``) or the
    output's zeroing (``miss="zeroing"``) use ``ids != 0``, which also keeps negative ids."""

    def __init__(self, miss: str):
        super().__init__()
        self.inp, self.ffn = nn.Linear(E, E), Ffn()
        self.attention = nn.MultiheadAttention(E, H, batch_first=True)
        self.miss = miss

    def forward(self, x, ids):
        valid = (ids > 0)[..., None]
        h = self.inp(x) * valid
        if self.miss == "keys":
            out, _ = self.attention(h, h, h, key_padding_mask=ids == 0)
            return (h + out + self.ffn(h)) * valid
        return (h + self.ffn(h)) * (ids != 0)[..., None]


def _signed_ids(g):
    ids = torch.randint(-2, 6, (B, L), generator=g)
    ids[:, 0] = 5  # every sequence has a valid key
    return ids


@pytest.mark.parametrize("miss", ["keys", "zeroing"])
def test_zeroing_by_one_vector_does_not_excuse_packing_by_another(miss):
    torch.manual_seed(0)
    model = TwoVectors(miss)
    g = torch.Generator().manual_seed(2)
    compiled, compiles = _compiled(model)
    with recording(PassLog()) as log:  # what explain reports, from the compile itself
        _assert_eager(model, compiled, (torch.randn(B, L, E), _signed_ids(g)))
    _assert_eager(model, compiled, (torch.randn(B, L, E), _signed_ids(g)))
    assert len(compiles) == 1
    reasons = _reasons(log)
    if miss == "keys":  # the q/k/v projection stays padded, the rest runs packed by ids > 0
        assert any("reads keys not provably among the tokens where" in r for r in reasons), reasons
        assert [r.metrics["gemms"] for r in _unpad(log)] == [4]  # inp, out projection, FFN up and down
    else:  # the FFN's output is zeroed by ids != 0: its own region, packed by that vector (so explain says
        # nothing of it staying padded for the region of ids > 0)
        assert not any("stays padded" in r for r in reasons), reasons
        assert sum("valid_mask_index" in str(n.target) for n in compiles[0].graph.nodes) == 2


def test_masks_that_are_no_token_vector_are_refused_with_the_reason():
    lin = nn.Linear(E, E)

    def per_head(x, ids):  # (B, N, H): a mask per token and head
        heads = ids[..., None] > torch.arange(H)
        return (lin(x).unflatten(-1, (H, D)) * heads[..., None]).sum((1, 2, 3))

    report = explain(per_head, torch.randn(B, L, E), torch.randint(0, 3, (B, L)))
    assert report.counts["unpad"] == 0
    assert any("per head" in r for r in _reasons(report)), _reasons(report)


class SentenceEncoder(nn.Module):
    """HF BERT's attention (an integer attention_mask from the tokenizer, ``(1 - mask) * finfo.min`` added to
    the scores, SDPA) and sentence-transformers' mean pooling, as it writes it: the mask cast to float and
    expanded over the features. Every token-wise op runs packed by the tokens where attention_mask != 0;
    the prover reads the integer mask as 0/1 only under a device-side check, which the rewrite emits."""

    def __init__(self):
        super().__init__()
        self.emb, self.qkv, self.out, self.ffn = nn.Embedding(ITEMS, E), nn.Linear(E, 3 * E), nn.Linear(E, E), Ffn()

    def forward(self, ids, attention_mask):
        x = self.emb(ids)
        extended = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * torch.finfo(x.dtype).min
        q, k, v = (t.view(B, L, H, D).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=extended)
        x = x + self.out(a.transpose(1, 2).reshape(B, L, E))
        token_embeddings = x + self.ffn(x)
        input_mask_expanded = attention_mask.unsqueeze(-1).expand(token_embeddings.size()).float()
        sum_embeddings = torch.sum(token_embeddings * input_mask_expanded, 1)
        return sum_embeddings / torch.clamp(input_mask_expanded.sum(1), min=1e-9)


def _attention_mask(g, lengths):
    return (torch.arange(L)[None, :] < torch.tensor(lengths)[:, None]).long()


def test_integer_attention_mask_expanded_for_mean_pooling_runs_packed():
    torch.manual_seed(0)
    model = SentenceEncoder()
    g = torch.Generator().manual_seed(3)
    report = explain(model, torch.randint(1, ITEMS, (B, L), generator=g), _attention_mask(g, [L, 5, 1, 9]))
    (region,) = _unpad(report)
    assert report.counts["jagged_attention"] == 1 and not _reasons(report), _reasons(report)
    assert region.metrics["gemms"] == 4, region.detail  # qkv, out, FFN up and down: nothing stays padded
    compiled, compiles = _compiled(model)
    for lengths in ([L, 5, 1, 9], [3, 0, L, 7], [L, L, L, L]):  # an empty sentence reads every key in eager
        _assert_eager(model, compiled, (torch.randint(1, ITEMS, (B, L), generator=g), _attention_mask(g, lengths)))
    assert len(compiles) == 1
    nodes = [str(n.target) for n in compiles[0].graph.nodes]
    assert sum("valid_mask_index" in t for t in nodes) == 1 and sum("_assert_async" in t for t in nodes) >= 1
    bad = _attention_mask(g, [L, 5, 1, 9])
    bad[0, 0] = 2  # not the 0/1 mask the rewrite read: the run stops, no silent answer
    with pytest.raises(Exception, match="holds values other than 0 and 1"):
        compiled(torch.randint(1, ITEMS, (B, L), generator=g), bad)


class ComparedIntegerMask(nn.Module):
    """The float of an integer mask, compared: a row mask only for 0/1 values."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(E, E)

    def forward(self, x, attention_mask):
        valid = attention_mask.float()[..., None] > 0.5
        return (self.lin(x) * valid).sum((1, 2))


def test_integer_mask_read_as_zero_one_packs_under_its_check():
    """Without attention: unpad alone emits the check of the integer mask it packs by."""
    model = ComparedIntegerMask()
    g = torch.Generator().manual_seed(4)
    report = explain(model, torch.randn(B, L, E), torch.randint(0, 2, (B, L), generator=g))
    assert report.counts["unpad"] == 1, _reasons(report)
    compiled, _ = _compiled(model)
    _assert_eager(model, compiled, (torch.randn(B, L, E), torch.randint(0, 2, (B, L), generator=g)))
    with pytest.raises(Exception, match="holds values other than 0 and 1"):
        compiled(torch.randn(B, L, E), torch.randint(0, 3, (B, L), generator=g) + 1)


class AugmentedView(nn.Module):
    """A crop / item-masking view as contrastive sequence models write it: the ids times a per-position or
    per-item 0/1 integer (``keep``), then ``!= 0`` as the token mask. The ids are item ids (any integer),
    not a 0/1 mask: reading them as one stopped the run with the 0/1 check's message."""

    def __init__(self, keep):
        super().__init__()
        self.keep = keep
        self.lin = nn.Linear(E, E)

    def forward(self, x, ids, drop):
        valid = (ids * self.keep(ids, drop)) != 0
        return (self.lin(x) * valid[..., None]).sum(1)


KEEPS = {
    "crop_positions_long": lambda ids, drop: (torch.arange(ids.shape[1]) >= 2).long(),
    "bool_data": lambda ids, drop: ~drop,
    "bool_data_long": lambda ids, drop: (~drop).long(),
}


@pytest.mark.parametrize("name", list(KEEPS))
def test_ids_times_a_zero_one_keep_are_ids_not_a_mask(name):
    model = AugmentedView(KEEPS[name])
    g = torch.Generator().manual_seed(5)
    lengths = torch.tensor([2, L, 5, 0])
    ids = torch.randint(1, ITEMS, (B, L), generator=g) * (torch.arange(L)[None] < lengths[:, None])
    inputs = (torch.randn(B, L, E), ids, torch.rand(B, L, generator=g) < 0.3)
    report = explain(model, *inputs)
    assert report.counts["unpad"] == 1, _reasons(report)
    compiled, _ = _compiled(model)
    _assert_eager(model, compiled, inputs)


def test_row_masks_are_not_searched_for_hstu_visibilities(monkeypatch):
    """A row mask (B, N) never is one of HSTU's pairwise visibilities, which no length mask takes: unpad's
    candidates skip that search (seconds each: HF LongT5's transient-global encoder compiled in ~400 s)."""
    from gemcompile.passes.masks import classify as classify_module

    searched = []
    search = classify_module._classify_hstu
    monkeypatch.setattr(classify_module, "_classify_hstu", lambda *a: searched.append(a) or search(*a))
    g = torch.Generator().manual_seed(1)
    report = explain(LeftPaddedFfn(), torch.randn(B, L, E), torch.randint(0, L + 1, (B,), generator=g))
    assert len(_unpad(report)) == 1 and not searched


class RecBoleStyleEncoder(nn.Module):
    """RecBole's SASRec: the additive mask ``where(item_seq != 0, 0., -10000.)``, the output read at the last
    valid position; no product with the mask anywhere, so nothing shows the padded rows unused."""

    def __init__(self):
        super().__init__()
        self.emb, self.qkv, self.out = nn.Embedding(ITEMS, E, padding_idx=0), nn.Linear(E, 3 * E), nn.Linear(E, E)

    def forward(self, ids, lengths):
        b, n = ids.shape
        keep = (ids != 0)[:, None, None, :]
        additive = torch.where(keep, 0.0, -10000.0)
        q, k, v = (t.view(b, n, H, D).transpose(1, 2) for t in self.qkv(self.emb(ids)).chunk(3, -1))
        o = torch.softmax(q @ k.transpose(-1, -2) / D ** 0.5 + additive, -1) @ v
        h = self.out(o.transpose(1, 2).reshape(b, n, E))
        return h.gather(1, (lengths - 1).clamp(min=0).view(-1, 1, 1).expand(-1, 1, E)).squeeze(1)


def test_projections_no_row_mask_anchors_are_said_to_run_padded():
    """explain said nothing about unpad here: the K and V projections feed an attention that masks its keys
    by the ids, but its finite fill lets an empty sample read every key, so the region has no anchor."""
    g = torch.Generator().manual_seed(3)
    ids = _ids("right", g)
    lengths = (ids != 0).sum(1)
    report = explain(RecBoleStyleEncoder(), ids, lengths)
    reasons = _reasons(report)
    assert report.counts["jagged_attention"] == 1 and not _unpad(report), reasons
    # the reason is the finite fill (not "no attention reads them only as keys": the rewritten one does)
    assert any("run on the padded rows too" in r and "a sample with none reads every key" in r and
               "Fill with -inf" in r for r in reasons), reasons


class FftFilterEncoder(nn.Module):
    """BSARec's layer: projected tokens read by an attention with the key padding mask and by a filter over
    the sequence (an FFT: every token mixed into every other, padded ones included), the two summed, then a
    product with the mask."""

    def __init__(self, masked_pooling):
        super().__init__()
        self.masked_pooling = masked_pooling
        self.emb, self.proj = nn.Embedding(ITEMS, E, padding_idx=0), nn.Linear(E, E)
        self.weight = nn.Parameter(torch.randn(L // 2 + 1, E, dtype=torch.cfloat))

    def forward(self, ids):
        b, n = ids.shape
        x = self.proj(self.emb(ids))
        heads = x.view(b, n, H, D).transpose(1, 2)
        keep = (ids != 0)[:, None, None, :]
        a = F.scaled_dot_product_attention(heads, heads, heads, attn_mask=keep).transpose(1, 2).reshape(b, n, E)
        y = torch.fft.irfft(torch.fft.rfft(x, dim=1, norm="ortho") * self.weight, n=n, dim=1, norm="ortho")
        return ((a + y) * (ids != 0)[..., None]).sum(1) if self.masked_pooling else (a + y)[:, 0]


@pytest.mark.parametrize("masked_pooling", [True, False])
def test_projections_before_an_fft_over_the_tokens_are_said_to_be_read_by_it(masked_pooling):
    """explain advised zeroing the padded rows first (when no product with the mask anchored the projection),
    which would change the model: the FFT reads them into every valid row."""
    report = explain(FftFilterEncoder(masked_pooling), _ids("right", torch.Generator().manual_seed(3)))
    reasons = _reasons(report)
    assert not _unpad(report)
    assert any("fft_rfft" in r and ("mixes every token" in r or "reads them" in r) for r in reasons), reasons
    assert not any("zero the padded rows" in r for r in reasons), reasons


class ClsTokensFloatMask(nn.Module):
    """torch-rechub's InterFormer: the float mask ``(ids != 0).float()`` with float ones ``prepend``ed for the
    CLS tokens (``torch.cat([torch.ones(B, k), mask], 1)``), the attention filled where it is 0, the FFN, and a
    mean pooled by it. A cat of 0/1 masks holds 0 and 1 only: the encoder packs by it as by the bool cat."""

    def __init__(self, prepend):
        super().__init__()
        self.prepend = prepend
        self.emb = nn.Embedding(ITEMS, E, padding_idx=0)
        self.cls = nn.Parameter(torch.randn(1, 2, E))
        self.qkv, self.out = nn.Linear(E, 3 * E), nn.Linear(E, E)
        self.ffn = nn.Sequential(nn.Linear(E, 2 * E), nn.ReLU(), nn.Linear(2 * E, E))

    def forward(self, ids):
        batch = ids.shape[0]
        m = self.prepend((ids != 0).float(), batch)
        x = torch.cat([self.cls.expand(batch, -1, -1), self.emb(ids)], 1)
        q, k, v = self.qkv(x).view(batch, -1, 3, H, D).permute(2, 0, 3, 1, 4)
        s = (q @ k.transpose(-1, -2) / D ** 0.5).masked_fill(m[:, None, None, :] == 0, float("-inf"))
        h = x + self.out((s.softmax(-1) @ v).transpose(1, 2).flatten(2))
        h = h + self.ffn(h)
        return (h * m.unsqueeze(-1)).sum(1) / m.sum(1, keepdim=True)


PREPENDS = {
    "cat_ones": lambda m, b: torch.cat([torch.ones(b, 2), m], 1),
    "cat_ones_like": lambda m, b: torch.cat([torch.ones_like(m[:, :2]), m], dim=1),
    "concat_full_of_one": lambda m, b: torch.concat([torch.full((b, 2), 1.0), m], dim=-1),
}


@pytest.mark.parametrize("name", list(PREPENDS))
def test_a_float_mask_cat_with_ones_for_cls_tokens_packs(name):
    torch.manual_seed(0)
    model = ClsTokensFloatMask(PREPENDS[name])
    ids = _ids("holes", torch.Generator().manual_seed(2))
    report = explain(model, ids)
    assert report.counts["unpad"] == 1 and report.counts["jagged_attention"] == 1, _reasons(report)
    _assert_eager(model, _compiled(model)[0], (ids,))


def test_a_float_mask_cat_with_a_weight_that_is_no_mask_stays_padded():
    """Half weights prepended (0.5 is neither 0 nor 1): the cat is no 0/1 mask, the pooling is a weighted sum."""
    torch.manual_seed(0)
    model = ClsTokensFloatMask(lambda m, b: torch.cat([torch.full((b, 2), 0.5), m], 1))
    ids = _ids("holes", torch.Generator().manual_seed(2))
    assert explain(model, ids).counts["unpad"] == 0
    _assert_eager(model, _compiled(model)[0], (ids,))
