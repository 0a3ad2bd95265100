"""Attention recompiled with dynamic shapes keeps its rewrite.

torch.compile's default (automatic dynamic shapes) compiles the first batch with static sizes and, at the
first batch of another batch size or padded length, recompiles once with symbolic sizes for every later
one. That second graph must be rewritten too, or every later batch runs eager attention:
- q, k and v handed in separately get a size symbol each; the kernel needs k's and v's lengths equal, which
  becomes a guard of the graph (attention/family.py ``same_size``) instead of a refusal;
- a left-padding mask ``j >= L - lengths[b]`` reads the padded length L itself: the key mask is built from
  the graph input Dynamo lifts for that size (masks/key_vector.py ``_Builder.size``);
- HSTU divides by the padded length, a size (attention/gdpa.py); block attention with a data mask hands
  the kernel lengths ``full((B,), L)``, which the unpad pass then reads with L symbolic (masks/evaluator.py).
Each model: three batches of different sizes, outputs and gradients equal to eager, the attention rewritten
in both compiles, and no third compile.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

from gemcompile.backend import allow_warnings_in_graphs
from tests.compiled_vs_eager import assert_same_weighted_grads
from tests.model_styles import HstuStyleAttention
from tests.rewritten import rewritten

H, D = 2, 16
SHAPES = ((2, 6), (3, 9), (4, 11))  # (batch, padded length)


def separate_inputs_right_padded(q, k, v, lengths):
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    keep = torch.arange(k.shape[2], device=k.device)[None, :] < lengths[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :])


def separate_inputs_left_padded_causal(q, k, v, lengths):
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    n = k.shape[2]
    keep = (torch.arange(n, device=k.device)[None, :] >= n - lengths[:, None])[:, None, None, :]
    keep = keep & torch.tril(torch.ones(n, n, dtype=torch.bool, device=k.device))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)


class Projected(nn.Module):
    """(B, L, E) in, one qkv projection; key padding read from item ids, or left padding from lengths."""

    def __init__(self, source: str):
        super().__init__()
        self.qkv, self.source = nn.Linear(H * D, 3 * H * D), source

    def forward(self, x, data):
        b, n, _ = x.shape
        q, k, v = (t.view(b, n, H, D).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        if self.source == "ids":
            keep = (data != 0)[:, None, None, :]
        else:
            keep = (torch.arange(n, device=x.device)[None, :] >= n - data[:, None])[:, None, None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep).transpose(1, 2).reshape(b, n, H * D)


class BlockDiagonalIds(nn.Module):
    """Blocks of 4 tokens with the key padding read from item ids, behind a qkv projection (block family)."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(H * D, 3 * H * D)

    def forward(self, x, ids):
        b, n, _ = x.shape
        q, k, v = (t.view(b, n, H, D).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        block = torch.arange(n, device=x.device) // 4
        keep = (block[:, None] == block[None, :])[None, None] & (ids != 0)[:, None, None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep).transpose(1, 2).reshape(b, n, H * D)


def _inputs(name: str, batch: int, n: int, g: torch.Generator):
    lengths = torch.randint(1, n + 1, (batch,), generator=g)
    lengths[0] = n
    if name.startswith("separate"):
        return [torch.randn(batch, n, H, D, generator=g, requires_grad=True) for _ in range(3)] + [lengths]
    x = torch.randn(batch, n, H * D, generator=g, requires_grad=True)
    if name in ("projected_ids", "block_diagonal_ids"):
        ids = torch.randint(1, 9, (batch, n), generator=g) * (torch.arange(n)[None] < lengths[:, None])
        return [x, ids]
    if name == "hstu_divided_by_the_padded_length":
        return [x, torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])]
    return [x, lengths]


MODELS = {
    "separate_right_padded": lambda: separate_inputs_right_padded,
    "separate_left_padded_causal": lambda: separate_inputs_left_padded_causal,
    "projected_ids": lambda: Projected("ids"),
    "projected_left_padded": lambda: Projected("left"),
    # HSTU divides the activated scores by the padded length n = x.shape[1]: a size, symbolic once recompiled
    "hstu_divided_by_the_padded_length": lambda: HstuStyleAttention(H, D),
    "block_diagonal_ids": BlockDiagonalIds,
}
FAMILY = {"hstu_divided_by_the_padded_length": "gdpa", "block_diagonal_ids": "block_attention"}


def _defined_rows(name: str, inputs) -> torch.Tensor | None:
    """Rows eager defines: a left-padded causal row before the first token sees no key (NaN in eager)."""
    if name not in ("separate_left_padded_causal",):
        return None
    lengths, n = inputs[-1], inputs[0].shape[1]
    return (torch.arange(n)[None, :] >= n - lengths[:, None])[:, None, :, None]  # out is (B, H, L, D)


def check_dynamic_recompile(name: str, device: str = "cpu", compile_with=None) -> None:
    """Three batches of different sizes through one compiled model: outputs and gradients equal eager's on
    the rows eager defines, two compiles (static, then dynamic), each rewritten. ``compile_with(model,
    compiles)`` compiles (default: the passes with aot_eager, tests/rewritten.py)."""
    torch.manual_seed(0)
    model = MODELS[name]()
    if isinstance(model, nn.Module):
        model = model.to(device)
    allow_warnings_in_graphs()
    compiles: list = []
    counters.clear()
    compiled = (compile_with or rewritten)(model, compiles)
    g = torch.Generator().manual_seed(5)
    for batch, n in SHAPES:
        inputs = [t.detach().to(device).requires_grad_(t.requires_grad) for t in _inputs(name, batch, n, g)]
        out, ref = compiled(*inputs), model(*inputs)
        rows = _defined_rows(name, [t.cpu() for t in inputs])
        if rows is not None:
            rows = rows.to(device)
            out, ref = torch.where(rows, out, 0), torch.where(rows, ref, 0)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
        leaves = [t for t in inputs if t.requires_grad] + list(getattr(model, "parameters", list)())
        assert_same_weighted_grads(out, ref, leaves)
    assert len(compiles) == 2  # static, then dynamic for every later size (the third call reuses it)
    assert counters["gemcompile"][FAMILY.get(name, "jagged_attention")] == 2  # both graphs rewritten


@pytest.mark.parametrize("name", list(MODELS))
def test_the_dynamic_recompile_keeps_the_rewrite(name):
    check_dynamic_recompile(name)


def test_a_window_from_the_padded_length_is_refused_when_it_turns_symbolic():
    """A band whose width comes from the padded length (tril().triu(-(L // 2))): a block-attention window
    while L is static; once recompiled with L symbolic the width is no constant, and the site is refused with
    that reason instead of the compile failing. Outputs equal eager's throughout."""
    def band(q, k, v, lengths):
        n = q.shape[2]
        keep = torch.ones(n, n, dtype=torch.bool).tril().triu(-(n // 2))
        keep = keep[None, None] & (torch.arange(n)[None, :] < lengths[:, None])[:, None, None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)

    from gemcompile.passes.records import PassLog, recording

    compiled = rewritten(band)
    g = torch.Generator().manual_seed(8)
    reasons = []
    for batch, n in SHAPES[:2]:
        q, k, v = (torch.randn(batch, H, n, D, generator=g) for _ in range(3))
        lengths = torch.randint(1, n + 1, (batch,), generator=g)
        log = PassLog()
        with recording(log):
            out = compiled(q, k, v, lengths)
        reasons += [r.reason for r in log.refusals]
        torch.testing.assert_close(out, band(q, k, v, lengths), atol=2e-5, rtol=1e-4)
    assert any("symbolic size" in r for r in reasons), reasons


class Bert4RecWeights(nn.Module):
    """BERT4Rec's attention: a (B, 1, L, L) mask repeated from ids, masked_fill(mask == 0, -1e9), softmax, @ v."""

    def __init__(self):
        super().__init__()
        self.emb, self.qkv = nn.Embedding(30, H * D, padding_idx=0), nn.Linear(H * D, 3 * H * D)

    def forward(self, ids):
        mask = (ids > 0).unsqueeze(1).repeat(1, ids.size(1), 1).unsqueeze(1)
        b = ids.size(0)
        q, k, v = (t.view(b, -1, H, D).transpose(1, 2) for t in self.qkv(self.emb(ids)).chunk(3, -1))
        scores = torch.matmul(q, k.transpose(-2, -1)) / D ** 0.5
        return torch.matmul(F.softmax(scores.masked_fill(mask == 0, -1e9), dim=-1), v)


def test_a_batch_padded_to_the_head_dim_adds_no_recompile():
    """Comparing the weights' shape (B, H, L, L) with p @ v's (B, H, L, D) by == guarded L != D: a batch of
    padded length D compiled a third graph."""
    torch.manual_seed(0)
    model, compiles = Bert4RecWeights(), []
    counters.clear()
    compiled = rewritten(model, compiles)
    g = torch.Generator().manual_seed(0)
    for batch, n in ((4, 9), (3, 12), (4, D), (2, 10)):
        ids = torch.randint(1, 30, (batch, n), generator=g)
        ids[1:, n // 2:] = 0
        torch.testing.assert_close(compiled(ids), model(ids), atol=1e-5, rtol=1e-4)
    assert len(compiles) == 2 and counters["gemcompile"]["jagged_attention"] == 2


class SequenceFirstMha(nn.Module):
    """nn.MultiheadAttention on (L, B, E) tensors (batch_first=False, as fairseq and pmixer's SASRec feed it),
    a [CLS] token prepended: L + 1 rows."""

    def __init__(self):
        super().__init__()
        self.emb, self.cls = nn.Embedding(30, H * D, padding_idx=0), nn.Parameter(torch.randn(1, 1, H * D))
        self.mha = nn.MultiheadAttention(H * D, H)

    def forward(self, ids):
        x = torch.cat([self.cls.expand(1, ids.shape[0], H * D), self.emb(ids).transpose(0, 1)], 0)
        pad = torch.cat([torch.zeros_like(ids[:, :1], dtype=torch.bool), ids == 0], 1)
        return self.mha(x, x, x, key_padding_mask=pad)[0]


def test_sequence_first_multihead_attention_takes_its_sizes_as_graph_values():
    """The rewrite's head split reshapes by (L, B) read from the graph (a raw SymInt argument warned on every
    dynamic compile and was traced as whatever symbol its printed name matched)."""
    import warnings

    torch.manual_seed(0)
    model, compiles = SequenceFirstMha(), []
    counters.clear()
    compiled = rewritten(model, compiles)
    g = torch.Generator().manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch, n in ((4, 9), (3, 12), (2, 7)):
            lengths = torch.randint(1, n + 1, (batch,), generator=g)
            ids = torch.randint(1, 30, (batch, n), generator=g) * (torch.arange(n)[None, :] < lengths[:, None])
            torch.testing.assert_close(compiled(ids), model(ids), atol=1e-5, rtol=1e-4)
    assert not [w for w in caught if "Raw SymInt" in str(w.message)]
    assert len(compiles) == 2 and counters["gemcompile"]["jagged_attention"] == 2
