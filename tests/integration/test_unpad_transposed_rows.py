"""Token rows transposed to (B, F, N) for a kernel-1 Conv1d FFN (SASRec's PointWiseFeedForward) or a
BatchNorm1d (DIN's Dice in eval mode) run on the (B, N, F) rows they are, so unpad packs them
(passes/unpad_transposed_rows.py); a batch norm in training or a wider convolution reads other tokens, keeps
them padded and is named in explain. Every model: outputs and gradients equal eager's.

Compiled with the pre-grad passes and aot_eager (the same rewritten graph and ops, no C++ compile)."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from gemcompile import explain
from tests.rewritten import unpad_gemms_matching_eager

E = 16


class PointWiseFeedForward(nn.Module):
    """SASRec.pytorch's FFN: kernel-``kernel`` Conv1d layers over the transposed tokens, dropout, a residual."""

    def __init__(self, kernel=1, transpose=lambda t: t.transpose(-1, -2)):
        super().__init__()
        self.transpose = transpose
        self.conv1 = nn.Conv1d(E, E, kernel_size=kernel, padding=kernel // 2)
        self.conv2 = nn.Conv1d(E, E, kernel_size=kernel, padding=kernel // 2)
        self.dropout1, self.dropout2 = nn.Dropout(0.0), nn.Dropout(0.0)

    def forward(self, inputs):
        outputs = self.dropout2(self.conv2(torch.relu(self.dropout1(self.conv1(self.transpose(inputs))))))
        return self.transpose(outputs) + inputs


class ConvFfnEncoder(nn.Module):
    """Item embeddings zeroed at the padding, the FFN, the rows zeroed by the timeline mask, a LayerNorm and a
    masked mean: the FFN's rows are never read where the ids are 0."""

    def __init__(self, **ffn):
        super().__init__()
        self.emb = nn.Embedding(30, E, padding_idx=0)
        self.ffn, self.norm = PointWiseFeedForward(**ffn), nn.LayerNorm(E)

    def forward(self, ids):
        keep = (ids != 0).unsqueeze(-1)
        seqs = self.emb(ids) * keep
        seqs = self.norm(self.ffn(seqs)) * keep
        return seqs.sum(1) / keep.sum(1).clamp(min=1)


class DiceScores(nn.Module):
    """DeepCTR-Torch's DIN attention unit with Dice (BatchNorm1d over the transposed hidden features, a
    per-feature alpha of shape (F, 1)) and a softmax over the features, then scores zeroed at the padding
    (its ``torch.where(keys_masks, outputs, paddings)``) and the keys pooled by them."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(30, E, padding_idx=0)
        self.fc1, self.fc2 = nn.Linear(2 * E, E), nn.Linear(E, 1)
        self.bn = nn.BatchNorm1d(E, eps=1e-8)
        self.alpha = nn.Parameter(torch.rand(E, 1))

    def forward(self, target, ids):
        keys = self.emb(ids)
        query = self.emb(target)[:, None].expand_as(keys)
        x = self.fc1(torch.cat([query, keys], -1)).transpose(1, 2)  # (B, F, N)
        p = torch.sigmoid(self.bn(x))
        x = (self.alpha * (1 - p) * x + p * x).softmax(dim=1).transpose(1, 2)
        scores = self.fc2(x).squeeze(-1).masked_fill(ids == 0, 0.0)
        return (scores.unsqueeze(-1) * keys).sum(1)


def _ids():
    """(4, 9) ids (0 = padding) with a full, a length-1 and an empty sequence, and targets."""
    lengths = torch.tensor([9, 1, 0, 5])
    ids = torch.randint(1, 30, (4, 9), generator=torch.Generator().manual_seed(3))
    return ids * (torch.arange(9)[None, :] < lengths[:, None])


TRANSPOSES = {
    "transpose_last_two": lambda t: t.transpose(-1, -2),
    "transpose_one_two": lambda t: t.transpose(1, 2),
    "permute": lambda t: t.permute(0, 2, 1),
}


@pytest.mark.parametrize("name", list(TRANSPOSES))
def test_a_kernel_one_conv_ffn_over_transposed_tokens_packs(name):
    torch.manual_seed(0)
    assert unpad_gemms_matching_eager(ConvFfnEncoder(transpose=TRANSPOSES[name]), _ids()) == [2]


def test_a_wider_conv_reads_the_neighbours_and_is_named():
    torch.manual_seed(0)
    model = ConvFfnEncoder(kernel=3)
    assert unpad_gemms_matching_eager(model, _ids()) == []
    reasons = [r.reason for r in explain(model, _ids()).refusals if r.pass_name == "unpad"]
    assert any("(`conv1d`) reads its neighbouring rows" in r for r in reasons), reasons


def test_dice_in_eval_packs_its_attention_unit():
    torch.manual_seed(0)
    model = DiceScores().eval()
    model.bn.running_mean.uniform_(-1, 1)
    model.bn.running_var.uniform_(0.5, 2)
    # fc1 (its output transposed through the Dice); the score GEMM, squeezed to (B, N), is not token-wise yet
    assert unpad_gemms_matching_eager(model, torch.tensor([1, 2, 3, 4]), _ids()) == [1]


def test_dice_in_training_stays_padded_and_says_why():
    torch.manual_seed(0)
    model = DiceScores().train()
    assert unpad_gemms_matching_eager(model, torch.tensor([1, 2, 3, 4]), _ids()) == []
    reasons = [r.reason for r in explain(model, torch.tensor([1, 2, 3, 4]), _ids()).refusals
               if r.pass_name == "unpad"]
    assert any("transposed to (B, F, N)" in r and "(`batch_norm`) reads every row" in r for r in reasons), reasons


def test_an_eval_batch_norm_of_bfloat16_rows_keeps_their_dtype():
    """bf16 activations with fp32 running statistics: the batch norm gives bf16, so does its arithmetic on
    the rows (the promotion to fp32 is cast back)."""
    from tests.rewritten import rewritten

    torch.manual_seed(0)
    model = DiceScores().eval()
    model.bn.running_mean.uniform_(-1, 1)
    model.bn.running_var.uniform_(0.5, 2)
    model = model.to(torch.bfloat16)
    model.bn.float()
    inputs = (torch.tensor([1, 2, 3, 4]), _ids())
    out, ref = rewritten(model)(*inputs), model(*inputs)
    assert out.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)


class TokenAxisMixer(nn.Module):
    """GEM-ref's Wukong layer beside a masked pooling: Linears over the token axis of (B, K, d) features
    (``self.residual(x.transpose(1, 2)).transpose(1, 2)``) then a LayerNorm over d. With d equal to the mask's N
    the residual (B, d, K') looks like transposed token rows; it is not, and nothing about it is moved or said."""

    def __init__(self, n):
        super().__init__()
        self.emb, self.fc = nn.Embedding(30, n), nn.Linear(n, n)
        self.residual, self.norm = nn.Linear(5, 3, bias=False), nn.LayerNorm(n)

    def forward(self, ids, features):
        pooled = (self.fc(self.emb(ids)) * (ids != 0)[..., None]).sum(1)
        res = self.residual(features.transpose(1, 2)).transpose(1, 2)  # (B, 3, d)
        return self.norm(features[:, :3] + res).sum(1) + pooled


def test_features_whose_sizes_look_transposed_are_left_as_written():
    torch.manual_seed(0)
    ids = _ids()
    features = torch.randn(ids.shape[0], 5, ids.shape[1])  # d == N
    model = TokenAxisMixer(ids.shape[1])
    reasons = [r.reason for r in explain(model, ids, features).refusals if r.pass_name == "unpad"]
    assert not any("transposed to (B, F, N)" in r for r in reasons), reasons
    assert unpad_gemms_matching_eager(model, ids, features) == [1]
