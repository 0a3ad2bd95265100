"""Token rows laid out sequence-first, (N, B, ...): PyTorch's encoder layers default to ``batch_first=False``,
so models feed ``nn.TransformerEncoder`` ``x.transpose(0, 1)`` and read its output transposed back. The
residuals, norms and FFNs between the attentions run on (B, N, ...) rows instead
(passes/unpad_seq_first_rows.py) and unpad packs them as it packs a batch-first encoder; reductions or a
softmax over the tokens, and norms over the batch, stay where they are. Every model: outputs and gradients
equal eager's.

Compiled with the pre-grad passes and aot_eager (the same rewritten graph and ops, no C++ compile)."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from gemcompile import explain
from tests.rewritten import rewritten, unpad_gemms_matching_eager

E, N = 32, 9
TO_SEQUENCE_FIRST = {
    "transpose": lambda x: x.transpose(0, 1),
    "permute": lambda x: x.permute(1, 0, 2),
    "swapaxes": lambda x: torch.swapaxes(x, 1, 0),
}


class SequenceFirstEncoder(nn.Module):
    """Item embeddings, an ``nn.TransformerEncoder`` of the default (N, B, E) layout with the key padding mask,
    its output transposed back, zeroed at the padding and averaged (BERT4Rec-style ports)."""

    def __init__(self, to_sequence_first=TO_SEQUENCE_FIRST["transpose"], layers=2, batch_first=False):
        super().__init__()
        self.to_sequence_first, self.batch_first = to_sequence_first, batch_first
        self.emb = nn.Embedding(30, E, padding_idx=0)
        layer = nn.TransformerEncoderLayer(E, 2, 2 * E, dropout=0.0, batch_first=batch_first)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)

    def forward(self, ids):
        pad = ids == 0
        x = self.emb(ids)
        if self.batch_first:
            h = self.encoder(x, src_key_padding_mask=pad)
        else:
            h = self.to_sequence_first(self.encoder(self.to_sequence_first(x), src_key_padding_mask=pad))
        return h.masked_fill(pad[..., None], 0).sum(1) / (~pad).sum(1, keepdim=True).clamp(min=1)


class SequenceFirstFfn(nn.Module):
    """A hand-written block on (N, B, E) tokens: a positional table (N, 1, E) and a per-user vector (B, E) added,
    an FFN with a residual and a LayerNorm, then ``reduce`` of the (N, B, E) result (None: transposed back,
    zeroed at the padding and summed over the tokens)."""

    def __init__(self, reduce=None):
        super().__init__()
        self.reduce = reduce
        self.emb, self.users = nn.Embedding(30, E, padding_idx=0), nn.Embedding(4, E)
        self.positions = nn.Parameter(torch.randn(N, 1, E))
        self.fc1, self.fc2, self.norm = nn.Linear(E, 2 * E), nn.Linear(2 * E, E), nn.LayerNorm(E)

    def forward(self, ids):
        valid = ids != 0
        h = self.emb(ids).transpose(0, 1) + self.positions + self.users(torch.arange(ids.shape[0]))
        h = self.norm(h + self.fc2(F.gelu(self.fc1(h))))
        if self.reduce is not None:
            return self.reduce(h, valid)
        return (h.transpose(0, 1) * valid[..., None]).sum(1)


# reductions of the (N, B, E) tokens that read every row, padded ones too: the FFN stays padded
READS_EVERY_ROW = {
    "mean_over_the_tokens": lambda h, valid: h.mean(0),
    "softmax_over_the_tokens": lambda h, valid: (h.softmax(0) * valid.t()[..., None]).sum(0),
    "norm_over_batch_and_features": lambda h, valid: (
        F.layer_norm(h, h.shape[1:]).transpose(0, 1) * valid[..., None]).sum(1),
}


def _ids():
    """A (4, 9) batch of ids (0 = padding) with a full, a length-1 and a length-3 sequence."""
    lengths = torch.tensor([N, 1, 5, 3])
    ids = torch.randint(1, 30, (4, N), generator=torch.Generator().manual_seed(2))
    return ids * (torch.arange(N)[None, :] < lengths[:, None])


@pytest.mark.parametrize("spelling", list(TO_SEQUENCE_FIRST))
def test_a_sequence_first_encoder_packs_like_a_batch_first_one(spelling):
    torch.manual_seed(0)
    batch_first = unpad_gemms_matching_eager(SequenceFirstEncoder(batch_first=True).eval(), _ids())
    torch.manual_seed(0)
    model = SequenceFirstEncoder(TO_SEQUENCE_FIRST[spelling]).eval()
    assert unpad_gemms_matching_eager(model, _ids()) == batch_first == [8]  # (in, out, 2 FFN) x 2 layers
    assert not [r for r in explain(model, _ids()).refusals if r.pass_name == "unpad"]


def test_a_sequence_first_block_with_positions_and_per_user_vectors_packs():
    torch.manual_seed(0)
    assert unpad_gemms_matching_eager(SequenceFirstFfn(), _ids()) == [2]


@pytest.mark.parametrize("name", list(READS_EVERY_ROW))
def test_a_reduction_over_sequence_first_tokens_keeps_them_padded(name):
    torch.manual_seed(0)
    assert unpad_gemms_matching_eager(SequenceFirstFfn(READS_EVERY_ROW[name]), _ids()) == []


class SequenceFirstLanguageModel(nn.Module):
    """PyTorch's word_language_model: (N, B) ids, an encoder layer of the default layout, a decoder, and the
    (N, B, V) output flattened by ``view(-1, V)`` for the loss, as its training loop does: the moved chain's
    output must keep eager's contiguous strides (a transpose of the rows failed the view)."""

    def __init__(self):
        super().__init__()
        self.emb, self.dec = nn.Embedding(30, E), nn.Linear(E, 30)
        self.layer = nn.TransformerEncoderLayer(E, 2, 2 * E, dropout=0.0)

    def forward(self, src, targets):
        h = self.layer(self.emb(src), src_key_padding_mask=(src == 0).t())
        out = F.log_softmax(self.dec(h), dim=-1)
        return F.nll_loss(out.view(-1, 30), targets.view(-1), ignore_index=0), out


def test_a_sequence_first_output_keeps_eagers_strides():
    torch.manual_seed(0)
    model = SequenceFirstLanguageModel().eval()
    src = _ids().t().contiguous()
    (loss, out), (ref_loss, ref) = rewritten(model)(src, src), model(src, src)
    torch.testing.assert_close(loss, ref_loss)
    assert out.is_contiguous() and out.stride() == ref.stride()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
