"""Query rows the model zeroes after an attention are skipped by the kernel (issue 25: the pass).

A padded attention whose output is zeroed at padded query rows afterwards (``o * valid[..., None]``, a
``torch.where`` or ``masked_fill``, before or after merge_heads / out_proj) gets those rows folded into the
kernel's q_lengths, for the jagged and block kernels as for GDPA, through one proof (masks/rows.py): explain
names the fold, and the rewritten graph (run by aot_eager, as test_real_model_masks does) gives eager's
outputs and gradients. Near-misses, where some use reads a padded row before it is zeroed, keep every row
(they are still rewritten), each for its own reason.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

from gemcompile.passes.graph import Unproven
from gemcompile.passes.masks.rows import downstream_row_mask
from gemcompile.passes.records import PassLog, recording
from tests.rewritten import rewritten

B, L, H, D, BLOCK = 4, 12, 2, 16, 4
E = H * D
LENGTHS = (12, 5, 0, 7)  # full, partial blocks, empty
OTHER_LENGTHS = (3, 9, 2, 0)


def _zero(spelling: str, x, keep):
    """x with the rows where ``keep`` is False set to zero, spelled as models write it."""
    if spelling == "mul":
        return x * keep
    if spelling == "mul_float":
        return x * keep.to(x.dtype)
    if spelling == "where":
        return torch.where(keep, x, 0.0)
    if spelling == "where_not":
        return torch.where(~keep, torch.zeros_like(x), x)
    if spelling == "masked_fill":
        return x.masked_fill(~keep, 0.0)
    raise ValueError(spelling)


class RowMasked(nn.Module):
    """Self-attention over a padded batch whose output rows are zeroed by the lengths mask afterwards."""

    def __init__(self, kernel="jagged", spelling="mul", at="out_proj", keys="lengths", rows="lengths",
                 miss=None):
        super().__init__()
        self.kernel, self.spelling, self.at = kernel, spelling, at
        self.keys, self.rows, self.miss = keys, rows, miss
        self.qkv = nn.Linear(E, 3 * E)
        self.out_proj = nn.Linear(E, E)

    def forward(self, x, lengths, other, lengths2):
        i = torch.arange(L)
        valid = i[None, :] < lengths[:, None]
        if self.keys == "left":  # left padding: the valid tokens are the last ones
            valid = i[None, :] >= L - lengths[:, None]
        keys = valid if self.keys != "data" else other > 0  # a key mask read from data (item ids)
        rows = valid if self.rows == "lengths" else i[None, :] < lengths2[:, None]  # another lengths tensor
        if self.miss == "partial":
            rows = valid & (other > 0)
        q, k, v = self.qkv(x).view(B, L, 3, H, D).permute(2, 0, 3, 1, 4)
        mask = keys[:, None, None, :]
        if self.kernel == "block":
            mask = mask & ((i // BLOCK)[:, None] == (i // BLOCK)[None, :])
        if self.kernel == "softmax":  # a finite fill: the empty sequence averages every key in eager
            s = (q @ k.transpose(-2, -1)) * D**-0.5
            o = torch.softmax(s.masked_fill(~mask, -1e9), dim=-1) @ v
        elif self.kernel == "einsum":  # the output in (B, L, H, D): the rows are on dim 1
            s = torch.einsum("bhqd,bhkd->bhqk", q, k) * D**-0.5
            p = torch.softmax(s.masked_fill(~mask, -1e9), dim=-1)
            y = self.out_proj(torch.einsum("bhqk,bhkd->bqhd", p, v).reshape(B, L, E))
            return x + _zero(self.spelling, y, rows[..., None])
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, H, L, D)
        if self.rows == "late":  # the row count taken after the attention, as a model may write it
            rows = i[None, :] < keys.sum(-1)[:, None]
        if self.miss == "sum_rows":
            pooled = o.sum(2, keepdim=True).transpose(1, 2).reshape(B, 1, E)  # reads every row
            return x + self.out_proj(pooled) * valid[..., None]
        if self.at == "heads":  # zeroed before merge_heads and out_proj
            o = _zero(self.spelling, o, rows[:, None, :, None])
            return x + self.out_proj(o.transpose(1, 2).reshape(B, L, E))
        y = self.out_proj(o.transpose(1, 2).reshape(B, L, E))
        if self.at == "gelu":
            y = F.gelu(y) * 2.0
        if self.miss == "residual":
            return _zero(self.spelling, x + y, rows[..., None])
        out = x + _zero(self.spelling, y, rows[..., None])
        return (out, y) if self.miss == "returned" else out


class MhaRowMasked(nn.Module):
    """nn.MultiheadAttention (batch_first) with a key padding mask, output rows zeroed by the lengths."""

    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(E, H, batch_first=True)

    def forward(self, x, lengths, other, lengths2):
        valid = torch.arange(L)[None, :] < lengths[:, None]
        o, _ = self.mha(x, x, x, key_padding_mask=~valid, need_weights=False)
        return x + o * valid[..., None]


def _inputs():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, L, E, generator=g, requires_grad=True)
    lengths = torch.tensor(LENGTHS)
    other = torch.randint(0, 3, (B, L), generator=g) * (torch.arange(L)[None, :] < lengths[:, None])
    return x, lengths, other, torch.tensor(OTHER_LENGTHS)


def _check_against_eager(model, family: str, folded: str | None) -> None:
    """One compile: the family rewrites the attention (its record names the fold, or none), and the rewritten
    model's outputs and gradients are eager's."""
    torch.manual_seed(0)
    inputs = _inputs()
    counters.clear()
    with recording(PassLog()) as log:
        out = rewritten(model)(*inputs)
    records = [r for r in log.rewrites if r.pass_name == family]
    assert counters["gemcompile"][family] == 1 and len(records) == 1, [r.reason for r in log.refusals]
    detail = records[0].detail
    if folded is None:
        assert "query rows:" not in detail, detail
    else:
        note = f"query rows: n < {folded}[b], from the output row mask at test_query_row_fold.py:"
        assert note in detail, detail
    ref = model(*inputs)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    w = torch.randn(ref.shape, generator=torch.Generator().manual_seed(2))
    leaves = [inputs[0], *model.parameters()]
    grads = torch.autograd.grad((out * w).sum(), leaves)
    for g, g_ref in zip(grads, torch.autograd.grad((ref * w).sum(), leaves)):
        torch.testing.assert_close(g, g_ref, atol=5e-5, rtol=1e-4)


FOLDS = {
    "jagged-mul-out_proj": dict(kernel="jagged", spelling="mul", at="out_proj"),
    "jagged-where-heads": dict(kernel="jagged", spelling="where", at="heads"),
    "jagged-masked_fill-gelu": dict(kernel="jagged", spelling="masked_fill", at="gelu"),
    "jagged-softmax_fill-mul_float-heads": dict(kernel="softmax", spelling="mul_float", at="heads"),
    "jagged-data_keys-where_not": dict(kernel="jagged", spelling="where_not", keys="data"),
    "jagged-einsum_blhd-mul": dict(kernel="einsum", spelling="mul"),
    "jagged-other_lengths": dict(kernel="jagged", rows="half"),
    "block-mul-out_proj": dict(kernel="block", spelling="mul", at="out_proj"),
    "block-masked_fill-heads": dict(kernel="block", spelling="masked_fill", at="heads"),
}


@pytest.mark.parametrize("name", list(FOLDS))
def test_zeroed_query_rows_are_folded_into_q_lengths(name):
    spec = FOLDS[name]
    family = "block_attention" if spec["kernel"] == "block" else "jagged_attention"
    folded = "l_lengths_" if spec.get("rows", "lengths") == "lengths" else "l_lengths2_"
    _check_against_eager(RowMasked(**spec), family, folded)


def test_multihead_attention_rows_are_folded():
    _check_against_eager(MhaRowMasked(), "jagged_attention", "l_lengths_")


def test_rows_counted_after_the_attention_are_hoisted_before_the_kernel():
    """The row count is computed after the attention in the model: the fold moves it (and what it reads)
    before the kernel, which reads it as q_lengths."""
    _check_against_eager(RowMasked(rows="late"), "jagged_attention", "sum_1")


def test_left_padded_rows_are_not_a_prefix_and_stay_computed():
    _check_against_eager(RowMasked(keys="left", rows="lengths"), "jagged_attention", None)


@pytest.mark.parametrize("kernel", ["jagged", "block"])
def test_a_residual_add_before_the_zeroing_keeps_every_row(kernel):
    _check_against_eager(RowMasked(kernel=kernel, miss="residual"), f"{kernel}_attention", None)


# -- near-misses: the proof itself, on the captured graph (no compile) -----------------------------------

def _attention_output(model) -> torch.fx.Node:
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(model, backend=capture)(*_inputs())
    (gm,) = graphs
    (node,) = [n for n in gm.graph.nodes if "scaled_dot_product_attention" in str(n.target)]
    return node


NEAR_MISSES = {
    "residual": ("add", dict(miss="residual")),
    "sum_rows": ("sum", dict(miss="sum_rows")),
    "returned": ("an output of the graph", dict(miss="returned")),
    "partial": ("not where `n < lengths[b] + c`", dict(miss="partial")),
    "left": ("not where `n < lengths[b] + c`", dict(keys="left")),
}


@pytest.mark.parametrize("name", list(NEAR_MISSES))
def test_a_padded_row_read_before_the_zeroing_refuses_the_fold(name):
    reason, spec = NEAR_MISSES[name]
    node = _attention_output(RowMasked(**spec))
    with pytest.raises(Unproven, match=reason.replace("`", ".").replace("+", r"\+").replace("[", r"\[")):
        downstream_row_mask(node, batch_dim=0, row_dim=2)


def test_dropout_after_out_proj_keeps_the_proof():
    class Dropped(RowMasked):
        def __init__(self):
            super().__init__()
            self.dropout = nn.Dropout(0.1)

        def forward(self, x, lengths, other, lengths2):
            q, k, v = self.qkv(x).view(B, L, 3, H, D).permute(2, 0, 3, 1, 4)
            valid = torch.arange(L)[None, :] < lengths[:, None]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=valid[:, None, None, :])
            return x + self.dropout(self.out_proj(o.transpose(1, 2).reshape(B, L, E))) * valid[..., None]

    fold = downstream_row_mask(_attention_output(Dropped().train()), batch_dim=0, row_dim=2)
    assert fold.rows() == "n < l_lengths_[b]"


def test_uses_masked_by_different_lengths_refuse_the_fold():
    class TwoMasks(RowMasked):
        def forward(self, x, lengths, other, lengths2):
            q, k, v = self.qkv(x).view(B, L, 3, H, D).permute(2, 0, 3, 1, 4)
            i = torch.arange(L)
            valid, half = i[None, :] < lengths[:, None], i[None, :] < lengths2[:, None]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=valid[:, None, None, :])
            y = self.out_proj(o.transpose(1, 2).reshape(B, L, E))
            return y * valid[..., None] + y * half[..., None]

    with pytest.raises(Unproven, match="masked by different lengths"):
        downstream_row_mask(_attention_output(TwoMasks()), batch_dim=0, row_dim=2)


def test_weights_and_row_masks_of_other_dims_refuse_the_fold():
    class Weighted(RowMasked):
        def forward(self, x, lengths, other, lengths2):
            q, k, v = self.qkv(x).view(B, L, 3, H, D).permute(2, 0, 3, 1, 4)
            valid = torch.arange(L)[None, :] < lengths[:, None]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=valid[:, None, None, :])
            return o * valid[:, :H, None, None]  # the head index, not the query row

    with pytest.raises(Unproven, match="not where"):
        downstream_row_mask(_attention_output(Weighted()), batch_dim=0, row_dim=2)
