"""Token MLPs run on rows flattened to (B*N, ...) (passes/unpad_flat_rows.py): FuxiCTR's DIN attention
``self.attention_layer(attention_input.view(-1, 4 * E)).view(-1, seq_len) * mask.float()`` and its spellings
(reshape, flatten(0, 1), view(B * N, E), a view back to (B, N, E)). The row-by-row ops move onto the (B, N, ...)
rows, so the unpad pass packs them. Near-misses: ops that mix the flattened rows (a batch norm over them, a
softmax over dim 0, a sum over them) keep what feeds them padded. Every model: outputs and gradients equal
eager's (pre-grad passes and aot_eager)."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from gemcompile import explain
from tests.rewritten import unpad_gemms_matching_eager

E = 8


class FuxiDinAttention(nn.Module):
    """FuxiCTR's DIN_Attention (layers/attentions/target_attention.py) as written, over projected history."""

    def __init__(self, use_softmax=False, batch_norm=False):
        super().__init__()
        self.use_softmax = use_softmax
        self.emb, self.proj = nn.Embedding(30, E, padding_idx=0), nn.Linear(E, E)
        norm = [nn.BatchNorm1d(16)] if batch_norm else []
        self.attention_layer = nn.Sequential(nn.Linear(4 * E, 16), *norm, nn.ReLU(), nn.Linear(16, 8), nn.ReLU(),
                                             nn.Linear(8, 1))

    def forward(self, target, ids):
        mask = ids > 0
        history_sequence = self.proj(self.emb(ids))
        seq_len = history_sequence.size(1)
        target_item = self.emb(target).unsqueeze(1).expand(-1, seq_len, -1)
        attention_input = torch.cat([target_item, history_sequence, target_item - history_sequence,
                                     target_item * history_sequence], dim=-1)
        attention_weight = self.attention_layer(attention_input.view(-1, 4 * E))
        attention_weight = attention_weight.view(-1, seq_len)
        attention_weight = attention_weight * mask.float()
        if self.use_softmax:
            attention_weight += -1.e9 * (1 - mask.float())
            attention_weight = attention_weight.softmax(dim=-1)
        return (attention_weight.unsqueeze(-1) * history_sequence).sum(dim=1)


def _inputs():
    """Targets and (4, 9) histories (0 = padding) with a full, a length-1 and an empty sequence."""
    lengths = torch.tensor([9, 1, 0, 5])
    ids = torch.randint(1, 30, (4, 9), generator=torch.Generator().manual_seed(3))
    return torch.tensor([1, 2, 3, 4]), ids * (torch.arange(9)[None, :] < lengths[:, None])


def test_fuxictr_din_attention_packs_its_mlp_on_flattened_rows():
    torch.manual_seed(0)
    # the projection and the MLP's first two Linears (its last gives one score per token: stays padded)
    assert unpad_gemms_matching_eager(FuxiDinAttention(), *_inputs()) == [3]
    report = str(explain(FuxiDinAttention(), *_inputs()))
    assert "0 refusals" in report


def test_fuxictr_din_attention_with_a_finite_fill_before_its_softmax_keeps_the_history_padded():
    # an empty history's softmax weighs every padded row (all -1e9): the history projection reads them
    torch.manual_seed(0)
    assert unpad_gemms_matching_eager(FuxiDinAttention(use_softmax=True), *_inputs()) == [2]


def test_a_batch_norm_over_the_flattened_rows_keeps_the_mlp_padded():
    torch.manual_seed(0)
    assert unpad_gemms_matching_eager(FuxiDinAttention(batch_norm=True).train(), *_inputs()) == []


FLATTENS = {
    "view_minus_one": lambda x: x.view(-1, x.shape[-1]),
    "reshape_product": lambda x: x.reshape(x.shape[0] * x.shape[1], x.shape[-1]),
    "flatten_first_two": lambda x: x.flatten(0, 1),
    "torch_reshape": lambda x: torch.reshape(x, (-1, E)),
}


class FlatFfn(nn.Module):
    """A LayerNorm / GELU FFN with dropout on flattened token rows, viewed back as (B, N, E) (``back``) or
    zeroed while flattened by ``zeroing`` and summed per sample, then a residual and a masked mean; ``mixes`` is
    applied to the FFN's hidden rows while flattened (identity, or an op across rows)."""

    def __init__(self, flatten, back=True, mixes=None, zeroing=None):
        super().__init__()
        self.flatten, self.back, self.mixes = flatten, back, mixes
        self.zeroing = zeroing or (lambda h, valid, x: h * valid.view(-1, 1))
        self.emb = nn.Embedding(30, E)
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(E), nn.Linear(E, 2 * E), nn.Linear(2 * E, E)
        self.drop = nn.Dropout(0.0)

    def forward(self, target, ids):
        B, N = ids.shape
        valid = (ids != 0).float()
        x = self.emb(ids)
        h = F.gelu(self.fc1(self.norm(self.flatten(x))))
        if self.mixes is not None:
            h = self.mixes(h)
        h = self.drop(self.fc2(h)) * 0.5 + 1.0
        if not self.back:  # the flattened rows zeroed by the flattened mask, summed per sample
            return self.zeroing(h, valid, x).view(B, N, E).sum(1) + target[:, None]
        h = x + h.view(B, N, E)
        return (h * valid[..., None]).sum(1) / valid.sum(1, keepdim=True).clamp(min=1) + target[:, None]


@pytest.mark.parametrize("name", list(FLATTENS))
def test_a_ffn_on_flattened_rows_viewed_back_packs(name):
    torch.manual_seed(0)
    assert unpad_gemms_matching_eager(FlatFfn(FLATTENS[name]), *_inputs()) == [2]


FLAT_ZEROINGS = {  # the flattened rows zeroed by the token mask, itself flattened to (B*N, 1)
    "times_the_mask_viewed": lambda h, valid, x: h * valid.view(-1, 1),
    "times_the_mask_reshaped": lambda h, valid, x: valid.reshape(-1, 1) * h,
    "where_by_the_bool_mask_viewed": lambda h, valid, x: torch.where(valid.bool().view(-1, 1), h, 0.0),
    "residual_viewed_then_the_mask": lambda h, valid, x: (h + x.view(-1, E)) * valid.view(-1, 1),
}


@pytest.mark.parametrize("name", list(FLAT_ZEROINGS))
def test_flattened_rows_zeroed_by_a_flattened_mask_pack(name):
    torch.manual_seed(0)
    model = FlatFfn(FLATTENS["view_minus_one"], back=False, zeroing=FLAT_ZEROINGS[name])
    assert unpad_gemms_matching_eager(model, *_inputs()) == [2]


def test_flattened_rows_times_a_per_row_weight_that_is_no_mask_stay_padded():
    torch.manual_seed(0)
    model = FlatFfn(FLATTENS["view_minus_one"], back=False, zeroing=lambda h, valid, x: h * (valid.view(-1, 1) + 1))
    assert unpad_gemms_matching_eager(model, *_inputs()) == []


MIXES = {
    "softmax_over_the_rows": lambda h: h.softmax(dim=0),
    "minus_the_mean_over_the_rows": lambda h: h - h.mean(0, keepdim=True),
    "batch_norm_functional": lambda h: F.batch_norm(h, None, None, training=True),
}


@pytest.mark.parametrize("name", list(MIXES))
def test_an_op_across_the_flattened_rows_keeps_what_feeds_it_padded(name):
    torch.manual_seed(0)
    model = FlatFfn(FLATTENS["view_minus_one"], mixes=MIXES[name])
    assert unpad_gemms_matching_eager(model, *_inputs()) == []
    reasons = [r.reason for r in explain(model, *_inputs()).refusals if r.pass_name == "unpad"]
    assert any("2 GEMM(s)" in r and "reads every row" in r for r in reasons), reasons


def test_an_op_on_the_flattened_rows_that_does_not_mix_them_is_not_blamed():
    """An in-place update on the flattened rows (not moved: it updates the flattened view of the moved rows,
    read back through it) reads no other row: explain does not name it as an op across the rows."""
    torch.manual_seed(0)
    model = FlatFfn(FLATTENS["view_minus_one"], mixes=lambda h: h.add_(1.0))
    reasons = [r.reason for r in explain(model, *_inputs()).refusals if r.pass_name == "unpad"]
    assert not any("reads every row" in r for r in reasons), reasons
    assert unpad_gemms_matching_eager(model, *_inputs()) == [2]


def test_a_batch_norm_in_a_flattened_mlp_is_said_in_explain():
    """FuxiCTR's MLP_Block with batch_norm: its GEMMs and the projection before stay padded; explain says why."""
    reasons = [r.reason for r in explain(FuxiDinAttention(batch_norm=True).train(), *_inputs()).refusals
               if r.pass_name == "unpad"]
    assert any(r.startswith("4 GEMM(s)") and "(`batch_norm`) reads every row" in r for r in reasons), reasons


class PairwiseFlatRows(nn.Module):
    """Every flattened token row against every other (``y.view(-1, 1, E) - y.view(-1, E)``: (B*N, B*N, E)),
    beside a masked pooling that gives unpad its rows. The two flattened operands broadcast against each
    other: no row-by-row op (moved onto (B, N, ...) rows it would be (B, N, N, E) when B == N)."""

    def __init__(self):
        super().__init__()
        self.emb, self.fc = nn.Embedding(30, E), nn.Linear(E, E)

    def forward(self, ids):
        B, N = ids.shape
        valid = (ids != 0).float()
        pooled = (self.fc(self.emb(ids)) * valid[..., None]).sum(1)
        y = self.emb(ids)
        return (y.view(-1, 1, E) - y.view(-1, E)).abs().sum(1).view(B, N, E).sum(1) + pooled


def test_flattened_rows_broadcast_against_each_other_stay_as_written():
    torch.manual_seed(0)
    ids = torch.randint(1, 30, (4, 4), generator=torch.Generator().manual_seed(1))
    ids[1, 2:] = 0
    assert unpad_gemms_matching_eager(PairwiseFlatRows(), ids) == [1]


class FlatSkipTakenBeforeAnUpdate(nn.Module):
    """A flattened skip taken from a conv output transposed back (``s.reshape(-1, E)`` copies it: not
    mergeable), then ``s`` or the copy updated in place before the flattened MLP adds the skip: the op must
    read the skip as it was taken, not ``s`` at the op."""

    def __init__(self, update_the_copy):
        super().__init__()
        self.update_the_copy = update_the_copy
        self.emb, self.conv, self.fc = nn.Embedding(30, E), nn.Conv1d(E, E, 3, padding=1), nn.Linear(E, E)

    def forward(self, target, ids):
        B, N = ids.shape
        x = self.emb(ids)
        s = self.conv(x.transpose(1, 2)).transpose(1, 2)
        skip = s.reshape(-1, E)
        if self.update_the_copy:
            skip.mul_(0.5)
        else:
            s.relu_()
        h = self.fc(x.view(-1, E)) + skip
        return (h.view(B, N, E) * (ids != 0)[..., None]).sum(1) + s.sum(1) + target[:, None]


@pytest.mark.parametrize("update_the_copy", [False, True])
def test_a_flattened_operand_updated_in_place_is_read_as_taken(update_the_copy):
    torch.manual_seed(0)
    # (the skip updated in place is not read through s: the flattened MLP beside it stays as written)
    assert unpad_gemms_matching_eager(FlatSkipTakenBeforeAnUpdate(update_the_copy), *_inputs()) == []


class FlatCat(nn.Module):
    """An MLP on flattened rows whose second layer reads ``cat([h, x.view(-1, E)], dim)``: along the features
    the cat is row by row (packs); along dim 0 it stacks the rows of both (stays as written)."""

    def __init__(self, dim):
        super().__init__()
        self.dim = dim
        self.emb, self.fc1, self.fc2 = nn.Embedding(30, E), nn.Linear(E, E), nn.Linear(2 * E, E)

    def forward(self, target, ids):
        B, N = ids.shape
        x = self.emb(ids)
        h = torch.relu(self.fc1(x.view(-1, E)))
        if self.dim == 0:
            h = self.fc2(torch.cat([h, x.view(-1, E)], 0).view(2 * B * N // 2, 2 * E))
        else:
            h = self.fc2(torch.cat([h, x.view(-1, E)], self.dim))
        return (h.view(B, N, E) * (ids != 0)[..., None]).sum(1) + target[:, None]


@pytest.mark.parametrize("dim, gemms", [(-1, [2]), (1, [2]), (0, [])])
def test_a_cat_of_flattened_rows_along_the_features_packs(dim, gemms):
    torch.manual_seed(0)
    assert unpad_gemms_matching_eager(FlatCat(dim), *_inputs()) == gemms
