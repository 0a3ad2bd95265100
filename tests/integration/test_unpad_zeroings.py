"""Padded rows zeroed by masked_fill or where instead of a product with the mask: ``h.masked_fill(pad[..., None],
0)``, ``torch.where(valid[..., None], h, 0)``, ``torch.where(pad[..., None], 0, h)``. To the pad analyses each is
``h * valid`` (unpad_masks._row_fills): it ignores h's padded rows and is zero there, so the FFN before it
runs on packed tokens. A fill of another value (``-inf`` before a max: masked max pooling) also ignores h's
padded rows, though it is not zero there (unpad_masks.RowFill). Near-misses (a fill read from h's padded rows,
a per-feature mask) must leave it padded. Every model: outputs and gradients equal eager's.

Compiled with the pre-grad passes and aot_eager (the same rewritten graph and ops, no C++ compile)."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from gemcompile import explain
from tests.rewritten import rewritten, unpad_gemms_matching_eager

E = 32
ZEROINGS = {
    "masked_fill_by_the_padding": lambda h, valid, pad, ids: h.masked_fill(pad[..., None], 0.0),
    "where_valid_keeps_h": lambda h, valid, pad, ids: torch.where(valid[..., None], h, 0.0),
    "where_padding_is_zero": lambda h, valid, pad, ids: torch.where(pad.unsqueeze(-1), 0, h),
    "masked_fill_method_of_ids": lambda h, valid, pad, ids: h.masked_fill((ids == 0)[..., None], 0),
    "where_zeros_like": lambda h, valid, pad, ids: torch.where(valid[..., None], h, torch.zeros_like(h)),
    "masked_fill_tensor_zero": lambda h, valid, pad, ids: h.masked_fill(pad[..., None], torch.tensor(0.0)),
    # RecBole's SequenceAttLayer spelling: keywords, a tensor fill
    "masked_fill_keywords": lambda h, valid, pad, ids: h.masked_fill(mask=pad[..., None], value=torch.tensor(0.0)),
    # DeepCTR-Torch's SequencePoolingLayer: the (B, N, 1) mask widened over the features before the product
    "times_the_mask_repeat_interleaved": lambda h, valid, pad, ids: h * torch.repeat_interleave(
        valid.float().unsqueeze(2), E, dim=2),
    "times_the_mask_repeated": lambda h, valid, pad, ids: h * valid.float().unsqueeze(2).repeat(1, 1, E),
}
NEAR_MISSES = {
    "masked_fill_per_feature": lambda h, valid, pad, ids: h.masked_fill(
        pad[..., None] | (torch.arange(E) % 2 == 0), 0.0),
    # (the fill is read from h's padded rows: a mean over every row)
    "where_filled_with_a_mean_of_h": lambda h, valid, pad, ids: torch.where(
        valid[..., None], h, h.mean(1, keepdim=True)),
}


class ZeroedFfn(nn.Module):
    """Embeddings, a GELU FFN, its padded rows zeroed by ``zeroing``, a mean over the valid tokens."""

    def __init__(self, zeroing):
        super().__init__()
        self.zeroing = zeroing
        self.emb, self.fc1, self.fc2 = nn.Embedding(30, E), nn.Linear(E, 2 * E), nn.Linear(2 * E, E)

    def forward(self, ids, lengths):
        valid = torch.arange(ids.shape[1])[None, :] < lengths[:, None]
        h = self.fc2(F.gelu(self.fc1(self.emb(ids))))
        h = self.zeroing(h, valid, ~valid, ids)
        return h.sum(1) / lengths.clamp(min=1)[:, None]


def _inputs():
    """A (4, 9) batch of ids (0 = padding) with a full, a length-1 and an empty sequence."""
    lengths = torch.tensor([9, 1, 0, 5])
    ids = torch.randint(1, 30, (4, 9), generator=torch.Generator().manual_seed(2))
    return ids * (torch.arange(9)[None, :] < lengths[:, None]), lengths


def _packed_gemms_and_check_eager(zeroing) -> list[int]:
    torch.manual_seed(0)
    return unpad_gemms_matching_eager(ZeroedFfn(zeroing), *_inputs())


@pytest.mark.parametrize("name", list(ZEROINGS))
def test_a_zeroing_by_masked_fill_or_where_packs_the_ffn(name):
    assert _packed_gemms_and_check_eager(ZEROINGS[name]) == [2]


@pytest.mark.parametrize("name", list(NEAR_MISSES))
def test_a_fill_of_another_value_or_by_a_per_feature_mask_stays_padded(name):
    assert _packed_gemms_and_check_eager(NEAR_MISSES[name]) == []


# readers of h's rows filled outside the mask with a value other than 0: they ignore h's padded rows
FILLS = {
    "masked_max_pooling_minus_inf": lambda h, valid, pad: h.masked_fill(pad[..., None], float("-inf")).amax(1),
    "max_values_after_minus_1e9": lambda h, valid, pad: h.masked_fill(~valid.unsqueeze(-1), -1e9).max(dim=1).values,
    "where_finfo_min_max": lambda h, valid, pad: torch.where(valid[..., None], h, torch.finfo(h.dtype).min).max(1)[0],
    "where_padding_first_minus_inf": lambda h, valid, pad: torch.where(pad[..., None], float("-inf"), h).amax(1),
    "masked_fill_tensor_fill": lambda h, valid, pad: h.masked_fill(pad[..., None], torch.tensor(-1e4)).amax(1),
    "where_full_like_fill": lambda h, valid, pad: torch.where(
        valid[..., None], h, torch.full_like(h, -1e4)).amax(1),
    "masked_fill_with_one_then_sum": lambda h, valid, pad: h.masked_fill(pad[..., None], 1.0).sum(1),
    # sentence-transformers' max pooling: the mask expanded over the features as a float, then compared with 0
    "mask_expanded_over_the_features": lambda h, valid, pad: h.masked_fill(
        valid.long().unsqueeze(-1).expand_as(h).to(h.dtype) == 0, float("-inf")).max(dim=1).values,
    # zeros written over in place before the fill: a fill of 2, not of 0 (it was taken for a zeroing)
    "zeros_filled_in_place_then_sum": lambda h, valid, pad: _where_zeros_filled_in_place(h, valid).sum(1),
}


def _where_zeros_filled_in_place(h, valid):
    z = torch.zeros_like(h)
    z.fill_(2.0)
    return torch.where(valid[..., None], h, z)


class FilledPooling(nn.Module):
    """Embeddings, a GELU FFN, a pooling of its rows filled outside the mask (``pool``), a head; an empty sample
    pools -inf, which the clamp keeps finite."""

    def __init__(self, pool):
        super().__init__()
        self.pool = pool
        self.emb, self.fc1, self.fc2 = nn.Embedding(30, E), nn.Linear(E, 2 * E), nn.Linear(2 * E, E)
        self.head = nn.Linear(E, 3)

    def forward(self, ids, lengths):
        valid = torch.arange(ids.shape[1])[None, :] < lengths[:, None]
        h = self.fc2(F.gelu(self.fc1(self.emb(ids))))
        return self.head(self.pool(h, valid, ~valid).clamp(min=-100.0))


@pytest.mark.parametrize("name", list(FILLS))
def test_a_fill_of_the_padded_rows_before_a_pooling_packs_the_ffn(name):
    torch.manual_seed(0)
    assert unpad_gemms_matching_eager(FilledPooling(FILLS[name]), *_inputs()) == [2]


class KeepsTheInputAtPadding(nn.Module):
    """``where(valid, ffn(x), x)``: the FFN's padded rows are replaced by x's (read there, so x stays padded),
    then a sum over every row."""

    def __init__(self):
        super().__init__()
        self.emb, self.fc1, self.fc2 = nn.Embedding(30, E), nn.Linear(E, 2 * E), nn.Linear(2 * E, E)

    def forward(self, ids, lengths):
        valid = torch.arange(ids.shape[1])[None, :] < lengths[:, None]
        x = self.emb(ids)
        return torch.where(valid[..., None], self.fc2(F.gelu(self.fc1(x))), x).sum(1)


def test_a_where_keeping_another_tensor_at_the_padding_packs_only_the_kept_one():
    torch.manual_seed(0)
    assert unpad_gemms_matching_eager(KeepsTheInputAtPadding(), *_inputs()) == [2]


def test_a_max_pooling_without_a_fill_stays_padded():
    torch.manual_seed(0)
    model = FilledPooling(lambda h, valid, pad: h.amax(1))
    assert unpad_gemms_matching_eager(model, *_inputs()) == []


class ScoresTimesRowMask(nn.Module):
    """Per-token scores (B, N) times valid[..., None] (B, N, 1): at B == 1 that broadcasts to (1, N, N), each
    output row reading every token's score, the padded ones too."""

    def __init__(self):
        super().__init__()
        self.emb, self.fc1, self.fc2 = nn.Embedding(30, E), nn.Linear(E, 2 * E), nn.Linear(2 * E, 1)

    def forward(self, ids, lengths):
        valid = torch.arange(ids.shape[1])[None, :] < lengths[:, None]
        s = self.fc2(F.gelu(self.fc1(self.emb(ids)))).squeeze(-1)
        return s * valid[..., None]


class TokensTimesWiderMask(nn.Module):
    """h (B, N, E) times valid[:, :, None, None]: at B == N the mask's B and N broadcast onto h's N and E."""

    def __init__(self):
        super().__init__()
        self.emb, self.fc1, self.fc2 = nn.Embedding(30, E), nn.Linear(E, 2 * E), nn.Linear(2 * E, E)

    def forward(self, ids, lengths):
        valid = torch.arange(ids.shape[1])[None, :] < lengths[:, None]
        return self.fc2(F.gelu(self.fc1(self.emb(ids)))) * valid[:, :, None, None]


@pytest.mark.parametrize("model, lengths", [(ScoresTimesRowMask, [3]), (TokensTimesWiderMask, [4, 1, 0, 2])])
def test_a_mask_of_higher_rank_than_the_tokens_is_no_row_mask_of_them(model, lengths):
    """The product's dims do not line up with the tokens' (B, N): it reads their padded rows."""
    torch.manual_seed(0)
    model, lengths = model(), torch.tensor(lengths)
    ids = torch.randint(1, 30, (len(lengths), 4), generator=torch.Generator().manual_seed(2))
    report = explain(model, ids, lengths)
    assert not [r for r in report.rewrites if r.pass_name == "unpad"], report
    out, ref = rewritten(model)(ids, lengths), model(ids, lengths)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
    weights = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1))
    params = list(model.parameters())
    for g, r in zip(torch.autograd.grad((out * weights).sum(), params),
                    torch.autograd.grad((ref * weights).sum(), params)):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-4)


# scores transposed to (B, 1, N) and filled there by a (B, 1, N) mask before they weigh the keys: DeepCTR-Torch's
# DIN (AttentionSequencePoolingLayer: ``torch.where(keys_masks, att.transpose(1, 2), paddings)``, then a
# softmax when weight_normalization, then ``torch.matmul(att, keys)``); the fill rows are (0, 2)
TRANSPOSED_FILLS = {
    "deepctr_zeros": lambda s, km: torch.where(km, s, torch.zeros_like(s)),
    "deepctr_weight_normalization": lambda s, km: F.softmax(torch.where(km, s, torch.ones_like(s) * (-2 ** 32 + 1)),
                                                            dim=-1),
    "masked_fill_minus_inf_softmax": lambda s, km: F.softmax(s.masked_fill(~km, float("-inf")), dim=-1).nan_to_num(),
    "masked_fill_zero": lambda s, km: s.masked_fill(~km, 0.0),
}
TRANSPOSED_NEAR_MISSES = {
    # (the fill reads the padded scores: their mean over every key)
    "fill_with_the_mean_score": lambda s, km: torch.where(km, s, s.mean(-1, keepdim=True)),
    # (two rows of scores, the second filled by a mask that also drops the odd keys: it differs along dim 1)
    "fill_by_a_mask_per_row": lambda s, km: torch.where(
        torch.cat([km, km & (torch.arange(km.shape[-1], device=km.device) % 2 == 0)], 1), torch.cat([s, 2 * s], 1),
        0.0),
}


class TransposedScorePooling(nn.Module):
    """DIN's attention pooling as DeepCTR-Torch writes it: an MLP scores each key against the query (its
    rows over (B, N)), the scores are transposed to (B, 1, N), filled outside the keys' mask by ``fill``, and
    weigh the keys, which are a projection of the embeddings when ``projected`` (so that the pooling itself
    must ignore their padded rows for them to pack)."""

    def __init__(self, fill, projected=False):
        super().__init__()
        self.fill, self.projected = fill, projected
        self.emb = nn.Embedding(30, E)
        self.proj = nn.Linear(E, E)
        self.mlp = nn.Sequential(nn.Linear(4 * E, 2 * E), nn.ReLU(), nn.Linear(2 * E, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, ids, lengths):
        B, N = ids.shape
        keys_masks = (torch.arange(N, device=ids.device).repeat(B, 1) < lengths.view(-1, 1)).unsqueeze(1)
        keys = self.emb(ids)
        if self.projected:
            keys = self.proj(keys)
        query = self.emb(ids[:, :1] + 1)  # (B, 1, E): the target item's embedding, expanded over the keys
        q = query.expand(-1, N, -1)
        scores = self.mlp(torch.cat([q, keys, q - keys, q * keys], dim=-1)).transpose(1, 2)
        return torch.matmul(self.fill(scores, keys_masks), keys).sum(1)


@pytest.mark.parametrize("name", list(TRANSPOSED_FILLS))
def test_scores_filled_after_a_transpose_pack_the_score_mlp(name):
    torch.manual_seed(0)
    # (the last Linear gives one score per token: it stays padded, unpad._one_per_token)
    assert unpad_gemms_matching_eager(TransposedScorePooling(TRANSPOSED_FILLS[name]), *_inputs()) == [2]


@pytest.mark.parametrize("name", list(TRANSPOSED_NEAR_MISSES))
def test_scores_filled_after_a_transpose_from_their_padding_stay_padded(name):
    torch.manual_seed(0)
    assert unpad_gemms_matching_eager(TransposedScorePooling(TRANSPOSED_NEAR_MISSES[name]), *_inputs()) == []


def test_keys_weighed_by_transposed_zeroed_scores_pack_with_them():
    """A zero fill: the matmul ignores the projected keys' padded rows, so the projection packs too. A finite
    fill before a softmax weighs every key of an empty sample (uniformly): the projection stays padded, the
    score MLP still packs."""
    torch.manual_seed(0)
    zeroed = TransposedScorePooling(TRANSPOSED_FILLS["deepctr_zeros"], projected=True)
    assert unpad_gemms_matching_eager(zeroed, *_inputs()) == [3]
    torch.manual_seed(0)
    normalized = TransposedScorePooling(TRANSPOSED_FILLS["deepctr_weight_normalization"], projected=True)
    assert unpad_gemms_matching_eager(normalized, *_inputs()) == [2]
    report = str(explain(normalized, *_inputs()))
    assert "stays padded" in report and "matmul" in report


# weights from a softmax over scores filled with -inf outside the mask: exactly 0 at the padding, or NaN on a whole
# sample with no valid token, where eager's pooling is NaN whatever the tokens hold; so the pooling ignores the
# tokens' padded rows (unpad_contractions.zero_at, empty_nan) and their projection packs. NARM's and DIN's
# ``softmax(s.masked_fill(~valid, -inf), 1)``, the weights squeezed to (B, N) or kept (B, N, 1).
SOFTMAX_POOLINGS = {
    "times_weights_kept_then_summed": lambda s, h, valid: (
        F.softmax(s.masked_fill(~valid[..., None], float("-inf")), dim=1) * h).sum(1),
    "squeezed_weights_bmm": lambda s, h, valid: torch.bmm(
        torch.softmax(s.squeeze(-1).masked_fill(~valid, float("-inf")), dim=-1).unsqueeze(1), h).squeeze(1),
    "where_einsum": lambda s, h, valid: torch.einsum(
        "bn,bnd->bd", F.softmax(torch.where(valid, s.squeeze(-1), float("-inf")), dim=-1), h),
    "transposed_matmul_with_dropout": lambda s, h, valid: torch.matmul(F.dropout(F.softmax(
        torch.where(valid[:, None], s.transpose(1, 2), torch.full_like(s.transpose(1, 2), float("-inf"))), -1),
        0.0), h).squeeze(1),
    "squeezed_weights_unsqueezed_times_h": lambda s, h, valid: (
        torch.softmax(s.squeeze(2).masked_fill(~valid, -torch.inf), 1).unsqueeze(-1) * h).sum(1),
    # RecBole's SequenceAttLayer: the filled scores divided by sqrt(E) before the softmax (-inf stays -inf)
    "temperature_after_the_fill": lambda s, h, valid: torch.bmm(torch.softmax(
        s.squeeze(-1).masked_fill(~valid, float("-inf")) / E ** 0.5, dim=-1).unsqueeze(1), h)[:, 0],
    # (a mask with holes besides the padding: the tokens it drops are packed away too)
    "fill_by_a_mask_with_holes": lambda s, h, valid: torch.bmm(torch.softmax(s.squeeze(-1).masked_fill(
        ~valid | (torch.arange(valid.shape[1]) % 3 == 0), float("-inf")), -1).unsqueeze(1), h)[:, 0],
}
SOFTMAX_NEAR_MISSES = {
    # (a finite fill: a sample with no valid token weighs every padded row alike)
    "finite_fill": lambda s, h, valid: torch.bmm(
        torch.softmax(s.squeeze(-1).masked_fill(~valid, -1e9), dim=-1).unsqueeze(1), h).squeeze(1),
    # (NaN cast to an integer is no NaN)
    "weights_cast_to_an_integer": lambda s, h, valid: torch.bmm(
        torch.softmax(s.squeeze(-1).masked_fill(~valid, float("-inf")), -1).long().float().unsqueeze(1), h)[:, 0],
    # (weights no longer 0 at the padding)
    "weights_plus_a_constant": lambda s, h, valid: torch.bmm(
        (torch.softmax(s.squeeze(-1).masked_fill(~valid, float("-inf")), -1) + 1e-3).unsqueeze(1), h)[:, 0],
}


class SoftmaxPooling(nn.Module):
    """Projected embeddings pooled by weights a score MLP gives each token (``weigh(scores, h, valid)``)."""

    def __init__(self, weigh):
        super().__init__()
        self.weigh = weigh
        self.emb, self.proj = nn.Embedding(30, E), nn.Linear(E, E)
        self.score = nn.Sequential(nn.Linear(E, E), nn.Tanh(), nn.Linear(E, 1))

    def forward(self, ids, lengths):
        valid = torch.arange(ids.shape[1])[None, :] < lengths[:, None]
        h = self.proj(self.emb(ids))
        return self.weigh(self.score(h), h, valid)


def _softmax_pooling_gemms_matching_eager(weigh) -> list[int]:
    """Unpad's GEMMs; outputs equal eager's on _inputs() (an empty sample's NaN row too) and every gradient
    on lengths without an empty sample (eager's NaN weights there make every gradient NaN)."""
    torch.manual_seed(0)
    model = SoftmaxPooling(weigh)
    ids, lengths = _inputs()
    out, ref = rewritten(model)(ids, lengths), model(ids, lengths)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4, equal_nan=True)
    lengths = lengths.clamp(min=2)
    ids = torch.randint(1, 30, ids.shape, generator=torch.Generator().manual_seed(3)) * \
        (torch.arange(ids.shape[1])[None, :] < lengths[:, None])
    out, ref = rewritten(model)(ids, lengths), model(ids, lengths)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
    params = list(model.parameters())
    grads = torch.autograd.grad(out.square().sum(), params, allow_unused=True)
    for g, r in zip(grads, torch.autograd.grad(ref.square().sum(), params, allow_unused=True)):
        assert (g is None) == (r is None)
        if r is not None:
            torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-4)
    return [r.metrics["gemms"] for r in explain(model, *_inputs()).rewrites if r.pass_name == "unpad"]


@pytest.mark.parametrize("name", list(SOFTMAX_POOLINGS))
def test_a_pooling_by_a_softmax_over_a_minus_inf_fill_packs_the_tokens(name):
    # (the projection and the score MLP's first Linear; its last gives one score per token and stays padded)
    assert _softmax_pooling_gemms_matching_eager(SOFTMAX_POOLINGS[name]) == [2]


@pytest.mark.parametrize("name", list(SOFTMAX_NEAR_MISSES))
def test_a_pooling_by_a_softmax_over_a_finite_or_data_fill_keeps_the_tokens_padded(name):
    # (the score MLP's first Linear still packs where the fill ignores the padded scores; the projection not)
    assert _softmax_pooling_gemms_matching_eager(SOFTMAX_NEAR_MISSES[name]) == [1]
