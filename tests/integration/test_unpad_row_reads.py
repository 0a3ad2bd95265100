"""Readers that pick a few rows of a packed region's output read them from the packed rows (no scatter).

The region: two Linears and a GELU over padded tokens, zeroed by the row mask. Its readers, as recommender
code writes them: the k most recent tokens by ``gather`` (GEM-ref's sequence summary), the last valid token
by ``x[torch.arange(B), lengths - 1]`` (SASRec / HSTU), the first position by ``x[:, 0]`` (a BERT pooler),
and the last position ``x[:, -1]`` under a token mask read from data (left padding). Each must leave no
scatter and equal eager, gradients included, with exact token counts and with token buckets, for
sequences that are empty, full and in between. Near-misses keep their scatter: a reader of every row
(a sum over N), a gather along the feature dim, a slice of positions.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gemcompile import GemConfig, explain
from tests.compiled_vs_eager import assert_compiled_matches_eager
from tests.grids import pairwise

B, N, D = 5, 12, 16
LENGTHS = torch.tensor([0, 3, 12, 1, 7])


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def encode(self, x, valid):
        return (x + self.down(F.gelu(self.up(x)))) * valid[..., None]

    @staticmethod
    def valid(lengths):
        return torch.arange(N, device=lengths.device)[None, :] < lengths[:, None]


class Recent(Encoder):
    def forward(self, x, lengths):
        h = self.encode(x, self.valid(lengths))
        index = lengths[:, None] - 1 - torch.arange(3, device=x.device)[None, :]
        recent = torch.gather(h, 1, index.clamp(min=0)[..., None].expand(-1, -1, h.shape[-1]))
        return recent * (index >= 0)[..., None]


class Last(Encoder):
    def forward(self, x, lengths):
        h = self.encode(x, self.valid(lengths))
        # length 0 reads position -1: a padded row (zeros)
        return h[torch.arange(h.shape[0], device=h.device), lengths - 1]


class First(Encoder):
    def forward(self, x, lengths):
        return self.encode(x, self.valid(lengths))[:, 0]


class LeftPaddedLast(Encoder):
    """Left padding, the tokens marked by ids != 0: the newest token is always at position N - 1."""

    def forward(self, x, ids):
        return self.encode(x, ids != 0)[:, -1]


class ReadsEveryRow(Encoder):
    def forward(self, x, lengths):
        return self.encode(x, self.valid(lengths)).sum(1)


class GathersFeatures(Encoder):
    def forward(self, x, lengths):
        h = self.encode(x, self.valid(lengths))
        return torch.gather(h, 2, torch.zeros(B, N, 2, dtype=torch.int64))


class SlicesPositions(Encoder):
    def forward(self, x, lengths):
        return self.encode(x, self.valid(lengths))[:, 1:3]


def _left_padded_ids(lengths):
    return (torch.arange(N)[None, :] >= N - lengths[:, None]).long() * 7


def _unpad(model, *inputs, config=None):
    return [r.metrics for r in explain(model, *inputs, config=config).rewrites if r.pass_name == "unpad"]


def _config(buckets):
    return GemConfig(unpad={"token_buckets": buckets, "min_gemms": 1})


@pytest.mark.parametrize("lengths,model_form,buckets", pairwise(
    {"partial": LENGTHS, "empty": torch.zeros(B, dtype=torch.int64), "full": torch.full((B,), N)},
    {"Recent": (Recent, "gather"), "Last": (Last, "per_batch"), "First": (First, "position")},
    {"no_buckets": 0, "buckets3": 3}))
def test_row_reads_come_from_packed_rows(lengths, model_form, buckets):
    model_type, form = model_form
    torch.manual_seed(0)
    model = model_type()
    x = torch.randn(B, N, D, requires_grad=True)
    (metrics,) = _unpad(model, x, lengths, config=_config(buckets))
    assert metrics["packed_row_reads"] == {form: 1}
    assert metrics["scatters"] == 0
    assert_compiled_matches_eager(model, x, lengths, config=_config(buckets))


@pytest.mark.parametrize("buckets", [0, 3])
def test_a_token_mask_from_data_reads_its_last_position_packed(buckets):
    torch.manual_seed(0)
    model = LeftPaddedLast()
    x = torch.randn(B, N, D, requires_grad=True)
    ids = _left_padded_ids(LENGTHS)
    (metrics,) = _unpad(model, x, ids, config=_config(buckets))
    assert metrics["packed_row_reads"] == {"position": 1} and metrics["scatters"] == 0
    assert_compiled_matches_eager(model, x, ids, config=_config(buckets))


@pytest.mark.parametrize("model_type", [ReadsEveryRow, GathersFeatures, SlicesPositions])
def test_readers_of_more_than_a_few_rows_keep_the_scatter(model_type):
    torch.manual_seed(0)
    model = model_type()
    x = torch.randn(B, N, D, requires_grad=True)
    (metrics,) = _unpad(model, x, LENGTHS, config=_config(0))
    assert not metrics["packed_row_reads"] and metrics["scatters"] == 1
    assert_compiled_matches_eager(model, x, LENGTHS, config=_config(0))


def test_the_option_off_keeps_the_scatter():
    torch.manual_seed(0)
    model = Recent()
    x = torch.randn(B, N, D, requires_grad=True)
    config = GemConfig(unpad={"packed_row_reads": False, "min_gemms": 1})
    (metrics,) = _unpad(model, x, LENGTHS, config=config)
    assert not metrics["packed_row_reads"] and metrics["scatters"] == 1


class AppendedTarget(nn.Module):
    """BST (torch-rechub, the BST paper): the target item appended after the padded history, the padding mask
    ``cat([hist == 0, zeros(B, 1)])``, an encoder that never zeroes its padded rows (nn.TransformerEncoder with
    that key padding mask, or SDPA with it and a GELU FFN), and only the rows at ``read`` read (the target's:
    ``out[:, -1]``). Every sample keeps position N - 1 by the mask's formula, so the encoder packs."""

    def __init__(self, read, transformer=True):
        super().__init__()
        self.read, self.transformer = read, transformer
        self.emb = nn.Embedding(30, D)
        self.qkv, self.up, self.down = nn.Linear(D, 3 * D), nn.Linear(D, 2 * D), nn.Linear(2 * D, D)
        layer = nn.TransformerEncoderLayer(D, 1, 2 * D, dropout=0.0, batch_first=True)  # (head dim 16)
        self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)

    def forward(self, hist, target):
        seq = torch.cat([self.emb(hist), self.emb(target).unsqueeze(1)], dim=1)
        pad = torch.cat([hist == 0, torch.zeros(hist.size(0), 1, dtype=torch.bool, device=hist.device)], dim=1)
        if self.transformer:
            return self.read(self.encoder(seq, src_key_padding_mask=pad))
        q, k, v = self.qkv(seq).unflatten(-1, (3, 1, D)).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=~pad[:, None, None, :]).transpose(1, 2).flatten(2)
        h = seq + a
        return self.read(h + self.down(F.gelu(self.up(h))))


def _history():
    """(B, N - 1) ids with 0 as padding: empty, partial and full histories."""
    lengths = LENGTHS.clamp(max=N - 1)
    hist = torch.randint(1, 30, (B, N - 1), generator=torch.Generator().manual_seed(4))
    return hist * (torch.arange(N - 1)[None, :] < lengths[:, None]), torch.arange(B) + 1


READS_OF_KEPT_POSITIONS = {
    "last": lambda out: out[:, -1, :],
    "select_last": lambda out: out.select(1, -1),
    "last_as_slice": lambda out: out[:, -1:].sum(1),
}
READS_OF_OTHER_POSITIONS = {  # position 0 and N - 2 are history: padded in some samples
    "first": lambda out: out[:, 0],
    "last_two": lambda out: out[:, -2:].sum(1),
}


@pytest.mark.parametrize("name", list(READS_OF_KEPT_POSITIONS))
@pytest.mark.parametrize("transformer", [False, True])
def test_a_read_of_a_position_every_sample_keeps_packs_the_encoder(name, transformer):
    torch.manual_seed(0)
    model = AppendedTarget(READS_OF_KEPT_POSITIONS[name], transformer).eval()
    metrics = _unpad(model, *_history(), config=_config(0))
    # (the in- and out-projections and the FFN; the SDPA form's qkv projection and its FFN)
    assert len(metrics) == 1 and metrics[0]["gemms"] == (4 if transformer else 3), metrics
    assert_compiled_matches_eager(model, *_history(), config=_config(0))


@pytest.mark.parametrize("name", list(READS_OF_OTHER_POSITIONS))
def test_a_read_of_a_position_some_sample_pads_keeps_the_encoder_padded(name):
    torch.manual_seed(0)
    model = AppendedTarget(READS_OF_OTHER_POSITIONS[name])
    assert _unpad(model, *_history(), config=_config(0)) == []
    assert_compiled_matches_eager(model, *_history(), config=_config(0))


def test_a_read_of_the_appended_target_packs_under_a_symbolic_length():
    """The history's length symbolic (Dynamo's recompile once batches differ in length): the target's position
    is N - 1 = s0 and the mask's constant part starts at s0, decided by the sizes' expressions."""
    torch.manual_seed(0)
    model = AppendedTarget(READS_OF_KEPT_POSITIONS["last"], transformer=False)
    hist, target = _history()
    torch._dynamo.mark_dynamic(hist, 1)
    metrics = _unpad(model, hist, target, config=_config(0))
    assert len(metrics) == 1 and metrics[0]["gemms"] == 3, metrics
    assert_compiled_matches_eager(model, hist, target, config=_config(0))
