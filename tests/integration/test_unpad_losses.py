"""Per-token losses with an ignore_index run on the rows their labels keep (passes/unpad_losses.py).

``F.cross_entropy(logits.view(-1, V), labels.view(-1), ignore_index=k)`` (BERT4Rec, HF's masked LM heads)
reads only the rows whose label is not k: the region that computes the logits packs by ``labels != k``
and the loss reads the packed rows. Matches, as model code writes them: the loss module, the functional
form with reshape / flatten, each reduction, label smoothing, class weights, nll_loss of log_softmax, with
exact token counts and with token buckets. Near-misses keep the loss on every row: the flattened logits
read by an accuracy too, seq-first (N, B, V) logits permuted to (B, V, N). The classes may be dim 1: ``logits.transpose(1,
2)`` against (B, N) labels. Every model: outputs and gradients equal
eager's, for a batch with an empty, a full and a one-token sequence.

Compiled with the pre-grad passes and aot_eager (the same rewritten graph and ops, no C++ compile)."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from gemcompile import GemConfig, explain
from tests.rewritten import rewritten

E, V, B, N = 16, 23, 4, 9
LENGTHS = torch.tensor([9, 1, 0, 5])


def _inputs(ignore: int, keep: float = 0.4, seed: int = 2):
    """Item ids (0 = padding) and labels: the item at a random share ``keep`` of the valid positions (every
    valid position of the full row), ``ignore`` elsewhere."""
    g = torch.Generator().manual_seed(seed)
    valid = torch.arange(N)[None, :] < LENGTHS[:, None]
    ids = torch.randint(1, V, (B, N), generator=g) * valid
    chosen = (torch.rand(B, N, generator=g) < keep) & valid
    chosen[0] = True
    return ids, torch.where(chosen, ids, ignore)


LOSSES = {  # name: (loss of (logits (B, N, V), labels (B, N), class weights), ignore_index)
    "module": (lambda x, y, w: nn.CrossEntropyLoss(ignore_index=0)(x.view(-1, x.size(-1)), y.view(-1)), 0),
    "default_ignore_index": (lambda x, y, w: F.cross_entropy(x.reshape(-1, V), y.reshape(-1)), -100),
    "flatten_sum": (lambda x, y, w: F.cross_entropy(x.flatten(0, 1), y.flatten(), ignore_index=0,
                                                    reduction="sum"), 0),
    "none_over_the_count": (lambda x, y, w: F.cross_entropy(x.view(B * N, V), y.view(B * N), ignore_index=-1,
                                                            reduction="none").sum() / (y != -1).sum(), -1),
    "label_smoothing": (lambda x, y, w: F.cross_entropy(x.view(-1, V), y.view(-1), ignore_index=0,
                                                        label_smoothing=0.1), 0),
    "class_weights": (lambda x, y, w: F.cross_entropy(x.view(-1, V), y.view(-1), weight=w, ignore_index=0), 0),
    "nll_of_log_softmax": (lambda x, y, w: F.nll_loss(F.log_softmax(x, dim=-1).view(-1, V), y.view(-1),
                                                      ignore_index=-100), -100),
    # transformers' ForMaskedLMLoss: logits upcast, labels moved to the logits' device after the view (a no-op)
    "transformers_loss_helper": (lambda x, y, w: F.cross_entropy(x.float().view(-1, V), y.view(-1).to(x.device),
                                                                 ignore_index=-100), -100),
    # the classes at dim 1, (B, V, N) against (B, N) labels
    "logits_transposed": (lambda x, y, w: F.cross_entropy(x.transpose(1, 2), y, ignore_index=0), 0),
    "logits_permuted_none": (lambda x, y, w: (F.cross_entropy(x.permute(0, 2, 1), y, ignore_index=0,
                                                              reduction="none") * torch.arange(1, N + 1)).sum(), 0),
}
NEAR_MISSES = {
    "flat_logits_read_by_an_accuracy": (lambda x, y, w: F.cross_entropy(f := x.view(-1, V), y.view(-1),
                                                                        ignore_index=0)
                                        + 0.0 * (f.argmax(-1) == y.view(-1)).float().mean(), 0),
    # (seq-first (N, B, V) logits permuted to (B, V, N): not the form of a transpose of (B, N, V) rows)
    "seq_first_logits_permuted": (lambda x, y, w: F.cross_entropy(x.transpose(0, 1).contiguous().permute(1, 2, 0),
                                                                  y, ignore_index=0), 0),
}


class ItemHead(nn.Module):
    """Item embeddings, a GELU FFN, the projection onto the items, ``loss``."""

    def __init__(self, loss):
        super().__init__()
        self.loss = loss
        self.emb, self.fc1, self.fc2 = nn.Embedding(V, E, padding_idx=0), nn.Linear(E, 2 * E), nn.Linear(2 * E, E)
        self.out = nn.Linear(E, V)
        self.register_buffer("weights", torch.linspace(0.5, 2.0, V))

    def forward(self, ids, labels):
        return self.loss(self.out(self.fc2(F.gelu(self.fc1(self.emb(ids))))), labels, self.weights)


class MaskedItemModel(nn.Module):
    """BERT4Rec's training step: item embeddings, one encoder block (SDPA with the key-padding mask of the
    ids, a GELU FFN, post-norms), the projection onto the items, cross entropy over the masked positions."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, E, padding_idx=0)
        self.qkv, self.proj = nn.Linear(E, 3 * E), nn.Linear(E, E)
        self.fc1, self.fc2 = nn.Linear(E, 2 * E), nn.Linear(2 * E, E)
        self.norm1, self.norm2 = nn.LayerNorm(E), nn.LayerNorm(E)
        self.out = nn.Linear(E, V)

    def forward(self, ids, labels):
        x = self.emb(ids)
        q, k, v = self.qkv(x).view(B, N, 3, 2, E // 2).permute(2, 0, 3, 1, 4)
        keys = (ids > 0)[:, None, None, :]
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=keys).transpose(1, 2).reshape(B, N, E)
        x = self.norm1(x + self.proj(a))
        x = self.norm2(x + self.fc2(F.gelu(self.fc1(x))))
        logits = self.out(x)
        return F.cross_entropy(logits.view(-1, V), labels.view(-1), ignore_index=0)


def _check(model, ids, labels, config: GemConfig) -> list[dict]:
    """The unpad rewrites' metrics, after checking outputs and gradients against eager."""
    report = explain(model, ids, labels, config=config)
    params = list(model.parameters())
    out, ref = rewritten(model, config=config)(ids, labels), model(ids, labels)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4, equal_nan=True)
    for g, r in zip(torch.autograd.grad(out, params, allow_unused=True, materialize_grads=True),
                    torch.autograd.grad(ref, params, allow_unused=True, materialize_grads=True), strict=True):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-4)
    return [r.metrics for r in report.rewrites if r.pass_name == "unpad"]


def _loss_reads(metrics: list[dict]) -> list[int]:
    return [m["packed_row_reads"].get("per-token loss", 0) for m in metrics]


@pytest.mark.parametrize("buckets", [0, 3])
@pytest.mark.parametrize("name", list(LOSSES))
def test_a_loss_ignoring_rows_by_their_labels_reads_them_packed(name, buckets):
    loss, ignore = LOSSES[name]
    torch.manual_seed(0)
    metrics = _check(ItemHead(loss), *_inputs(ignore), GemConfig(unpad={"token_buckets": buckets}))
    assert _loss_reads(metrics) == [1], metrics
    assert metrics[0]["gemms"] == 3 and metrics[0]["scatters"] == 0


@pytest.mark.parametrize("name", list(NEAR_MISSES))
def test_a_loss_reading_the_logits_otherwise_reads_every_row(name):
    loss, ignore = NEAR_MISSES[name]
    torch.manual_seed(0)
    metrics = _check(ItemHead(loss), *_inputs(ignore), GemConfig())
    assert not any(_loss_reads(metrics)), metrics


def test_no_label_kept_gives_eager_nan_mean_and_gradients():
    torch.manual_seed(0)
    ids, labels = _inputs(0, keep=0.0)
    labels = torch.zeros_like(labels)
    metrics = _check(ItemHead(LOSSES["module"][0]), ids, labels, GemConfig())
    assert _loss_reads(metrics) == [1]


def test_a_masked_item_model_packs_its_head_by_the_labels():
    torch.manual_seed(0)
    ids, labels = _inputs(0)
    metrics = _check(MaskedItemModel(), ids, labels, GemConfig())
    by_labels = [m for m in metrics if m["packed_row_reads"].get("per-token loss")]
    assert len(by_labels) == 1 and by_labels[0]["gemms"] >= 3, metrics


def test_the_option_off_leaves_the_loss_on_every_row():
    torch.manual_seed(0)
    metrics = _check(ItemHead(LOSSES["module"][0]), *_inputs(0), GemConfig(unpad={"packed_losses": False}))
    assert not any(_loss_reads(metrics)), metrics
