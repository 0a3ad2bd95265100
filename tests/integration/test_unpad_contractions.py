"""Pooling that sums over the tokens against a weight zero at the padding: ``einsum("bld,bl->bd", h, valid)``,
``bmm(w.unsqueeze(1), h)``, DIN's ``matmul(scores.masked_fill(pad, 0).unsqueeze(1), h)``. Each ignores h's
padded rows (unpad_contractions.py), so the FFN that makes h runs on packed tokens. Near-misses (a sum over
the tokens without such a weight, a weight that is not zero at every padded row, a contraction over the
features) must leave it padded; a weight zero outside another row mask packs the tokens that mask keeps. Every model: outputs and gradients equal eager's.

Compiled with the pre-grad passes and aot_eager (the same rewritten graph and ops, no C++ compile)."""

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.rewritten import unpad_gemms_matching_eager

E = 16


def _mean_weights(valid):
    w = valid.float()
    return w / w.sum(-1, keepdim=True).clamp(min=1)


def _weighted_mean(h, valid):
    weights = torch.arange(1, h.shape[1] + 1).unsqueeze(0).unsqueeze(-1).expand(h.size()).to(h.dtype)
    expanded = valid.unsqueeze(-1).expand(h.size()).to(h.dtype) * weights
    return torch.sum(h * expanded, 1) / torch.clamp(expanded.sum(1), min=1e-9)


def _din_scores(model, h, valid, pad):
    """RecBole's SequenceAttLayer: scores (B, 1, N) from a dense layer, zeroed at the padding by keyword
    masked_fill with a tensor fill, scaled, matmul with the keys."""
    scores = torch.transpose(model.score(h), -1, -2).squeeze(1)
    scores = scores.masked_fill(mask=pad, value=torch.tensor(0.0)).unsqueeze(1) / math.sqrt(E)
    return torch.matmul(scores, h).squeeze(1)


POOLINGS = {
    "einsum_by_the_mask": lambda m, h, valid, pad: torch.einsum("bld,bl->bd", h, valid.float()),
    "einsum_weights_first": lambda m, h, valid, pad: torch.einsum("bn,bnd->bd", _mean_weights(valid), h),
    "bmm_mean_weights": lambda m, h, valid, pad: torch.bmm(_mean_weights(valid).unsqueeze(1), h).squeeze(1),
    "matmul_of_transposed_tokens": lambda m, h, valid, pad: (h.transpose(1, 2) @ valid.float()[..., None])[..., 0],
    "din_masked_fill_keywords": _din_scores,
    "din_scores_times_mask": lambda m, h, valid, pad: torch.matmul(
        (m.score(h).squeeze(-1) * valid).unsqueeze(1), h).squeeze(1),
    "where_zeroed_weights": lambda m, h, valid, pad: torch.bmm(
        torch.where(valid, torch.sigmoid(m.score(h)[..., 0]), 0.0)[:, None, :], h)[:, 0],
    # sentence-transformers' Pooling(mode="weightedmean"): a product, then sums
    "weighted_mean_positions": lambda m, h, valid, pad: _weighted_mean(h, valid),
    # weights of another row mask: the tokens that mask keeps are packed (the padding; one token more)
    "bmm_by_the_padding": lambda m, h, valid, pad: torch.bmm(pad.float().unsqueeze(1), h).squeeze(1),
    "einsum_by_a_longer_mask": lambda m, h, valid, pad: torch.einsum(
        "bld,bl->bd", h, F.pad(valid, (1, 0), value=True)[:, :-1].float()),
}
NEAR_MISSES = {
    "einsum_sums_tokens_unweighted": lambda m, h, valid, pad: torch.einsum("bld,bm->bd", h, valid.float()),
    "einsum_keeps_the_weight_tokens_apart": lambda m, h, valid, pad: torch.einsum(
        "bld,bm->bdm", h, valid.float()).sum(-1),
    "bmm_weights_nonzero_at_the_padding": lambda m, h, valid, pad: torch.bmm(
        (valid.float() * 0.5 + pad.float()).unsqueeze(1), h).squeeze(1),
    "bmm_unmasked_softmax": lambda m, h, valid, pad: torch.bmm(
        torch.softmax(m.score(h).squeeze(-1), -1).unsqueeze(1), h).squeeze(1),
    "product_weights_plus_constant": lambda m, h, valid, pad: (h * (valid.float() + 0.5)[..., None]).sum(1),
    "bmm_weight_plus_constant": lambda m, h, valid, pad: torch.bmm(
        (valid.float() + 0.1).unsqueeze(1), h).squeeze(1),
    "matmul_over_the_features": lambda m, h, valid, pad: (h @ h.new_ones(h.shape[0], E, E)).sum(1),
}


class PooledFfn(nn.Module):
    """Embeddings, a GELU FFN over the tokens, pooled over them by ``pooling``, a head."""

    def __init__(self, pooling):
        super().__init__()
        self.pooling = pooling
        self.emb, self.fc1, self.fc2 = nn.Embedding(30, E), nn.Linear(E, 2 * E), nn.Linear(2 * E, E)
        self.score, self.head = nn.Linear(E, 1), nn.Linear(E, 3)

    def forward(self, ids, lengths):
        valid = torch.arange(ids.shape[1])[None, :] < lengths[:, None]
        h = self.fc2(F.gelu(self.fc1(self.emb(ids))))
        return self.head(self.pooling(self, h, valid, ~valid))


def _inputs():
    """A (4, 9) batch of ids (0 = padding, a real embedding row) with a full, a length-1 and an empty row."""
    lengths = torch.tensor([9, 1, 0, 5])
    ids = torch.randint(1, 30, (4, 9), generator=torch.Generator().manual_seed(3))
    return ids * (torch.arange(9)[None, :] < lengths[:, None]), lengths


def _packed_ffn_gemms_and_check_eager(pooling) -> list[int]:
    torch.manual_seed(0)
    return unpad_gemms_matching_eager(PooledFfn(pooling), *_inputs())


@pytest.mark.parametrize("name", list(POOLINGS))
def test_pooling_by_weights_zero_at_the_padding_packs_the_ffn(name):
    gemms = _packed_ffn_gemms_and_check_eager(POOLINGS[name])
    assert len(gemms) == 1 and gemms[0] >= 2, gemms  # fc1, fc2 (and the score layer where it reads h)


@pytest.mark.parametrize("name", list(NEAR_MISSES))
def test_a_sum_over_tokens_not_zeroed_at_every_padded_row_stays_padded(name):
    assert _packed_ffn_gemms_and_check_eager(NEAR_MISSES[name]) == []


def test_din_pooling_through_inductor_equals_eager():
    """The whole gem_compile (Inductor's CPU code, not aot_eager): the (B, N, 1) scores once left the region
    by a scatter whose zero fill Inductor fused with the masked_fill feeding the bmm, which then read zeros
    (N = 4: the pooled vector was 0 in every row). One value per token stays padded (unpad._one_per_token)."""
    from gemcompile import gem_compile

    torch.manual_seed(0)
    model = PooledFfn(POOLINGS["din_scores_times_mask"])
    lengths = torch.tensor([4, 1, 0, 4])
    ids = torch.randint(1, 30, (4, 4), generator=torch.Generator().manual_seed(3))
    ids = ids * (torch.arange(4)[None, :] < lengths[:, None])
    out, ref = gem_compile(model)(ids, lengths), model(ids, lengths)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
    params = list(model.parameters())
    for g, r in zip(torch.autograd.grad(out.square().sum(), params, allow_unused=True),
                    torch.autograd.grad(ref.square().sum(), params, allow_unused=True)):
        if r is not None:
            torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-4)
