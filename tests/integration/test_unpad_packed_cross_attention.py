"""The unpad region continues through GEM-ref's two cross-attention sites on packed tokens (issues 24, 26).

* PMA pooling (gem.py PMA): learned queries over the sequence's keys, norm -> k_proj / v_proj -> head split
  -> SDPA with the key padding mask. gemcompile::jagged_attention reads k and v packed (T, H, D); its output
  (B, H, P, D) stays dense.
* GDPA cross-attention (gem.py GDPACrossAttention): the sequence's queries over a few dense summary keys,
  norm -> q_proj -> head split -> gelu(q k^T) / N v -> merge heads -> out_proj -> masked residual.
  gemcompile::gdpa reads q packed and writes its output packed (T, H, D).

Compiled (CPU, the ops' reference path) equals eager, outputs and every gradient, fp32, over length sets
with 0 and N, one compile; no scatter feeds the packed operands and explain names the op. Near-misses (keys
over other lengths, a data (holes) mask, output rows zeroed by other lengths) and
UnpadConfig.packed_attention=False keep the padded boundary and still equal eager.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gemcompile import GemConfig, gem_compile
from tests.integration.test_unpad_packed_attention import (B, D, H, N, compare, fed_by_scatter, length_mask,
                                                           unpad_record)
from tests.rewritten import rewritten

P, S = 3, 5  # PMA's learned queries; GDPA's summary keys


def split_heads(x):
    return x.unflatten(-1, (H, -1)).transpose(1, 2)


def token_mask(variant, lengths, ids):
    """The region's row mask: by lengths, or read from data (holes)."""
    return ids != 0 if variant == "holes" else length_mask(lengths)


class PoolingModel(nn.Module):
    """Input projection and a token FFN over the padded sequence, then PMA pooling of it."""

    def __init__(self, variant="lengths"):
        super().__init__()
        self.variant = variant
        self.inp, self.up, self.down = nn.Linear(D, D), nn.Linear(D, 2 * D), nn.Linear(2 * D, D)
        self.queries = nn.Parameter(torch.randn(P, D))
        self.norm = nn.LayerNorm(D)
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(D, D) for _ in range(4))

    def forward(self, x, lengths, ids):
        valid = token_mask(self.variant, lengths, ids)
        keys = length_mask((lengths - 1).clamp(min=0)) if self.variant == "other_keys" else valid
        s = self.inp(x) * valid[..., None]
        s = s + self.down(F.gelu(self.up(s))) * valid[..., None]
        q = split_heads(self.q_proj(self.queries)[None]).expand(x.shape[0], -1, -1, -1)
        h = self.norm(s)
        k, v = split_heads(self.k_proj(h)), split_heads(self.v_proj(h))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=keys[:, None, None, :])
        pooled = self.out_proj(o.transpose(1, 2).flatten(2))
        return torch.cat([s * valid[..., None], pooled], dim=1)


class CrossModel(nn.Module):
    """Input projection, GDPA cross-attention of the sequence to dense summary keys, a token FFN."""

    def __init__(self, variant="lengths"):
        super().__init__()
        self.variant = variant
        self.inp, self.up, self.down = nn.Linear(D, D), nn.Linear(D, 2 * D), nn.Linear(2 * D, D)
        self.summary = nn.Parameter(torch.randn(S, D))
        self.norm = nn.LayerNorm(D)
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(D, D) for _ in range(4))

    def forward(self, x, lengths, ids):
        valid = token_mask(self.variant, lengths, ids)
        rows = length_mask((lengths - 2).clamp(min=0)) if self.variant == "other_rows" else valid
        s = self.inp(x) * valid[..., None]
        x_sum = self.summary[None].expand(x.shape[0], -1, -1) * x.sum(1, keepdim=True).tanh()
        q = split_heads(self.q_proj(self.norm(s)))
        k, v = split_heads(self.k_proj(x_sum)), split_heads(self.v_proj(x_sum))
        o = (F.gelu(q @ k.transpose(-2, -1)) / N) @ v
        s = s + self.out_proj(o.transpose(1, 2).flatten(2)) * rows[..., None]
        s = s + self.down(F.gelu(self.up(s))) * valid[..., None]
        return s * valid[..., None]


def ops_named(report, name):
    return [n for n in report.graph_after.graph.nodes if f"gemcompile.{name}." in str(n.target)]


def test_pma_reads_packed_keys():
    report = compare(PoolingModel(), gem_compile)
    record = unpad_record(report)
    assert record.metrics["packed_attention"] == {"jagged_attention": 1}
    assert "jagged_attention x1 on packed tokens" in record.detail
    (node,) = ops_named(report, "jagged_attention")
    # token_offsets and packed_len (then the schema's dropout_p, dropout_seed at their defaults)
    assert node.args[13] is not None and node.args[14] == N and node.args[15:] in ((), (0.0, None)), \
        node.format_node()
    assert not any(fed_by_scatter(a) for a in node.args[1:3]), node.format_node()  # k, v packed
    assert tuple(node.meta["example_value"].shape) == (B, H, P, D // H)  # the output stays dense


def test_gdpa_reads_and_writes_packed_queries():
    report = compare(CrossModel(), gem_compile)
    record = unpad_record(report)
    assert record.metrics["packed_attention"] == {"gdpa": 1}
    assert "gdpa x1 on packed tokens" in record.detail
    assert record.metrics["gathers"] == 1 and record.metrics["scatters"] == 1  # the input in, the output out
    (node,) = ops_named(report, "gdpa")
    assert len(node.args) == 21 and node.args[19] is not None and node.args[20] == N, node.format_node()
    assert not fed_by_scatter(node.args[0]), node.format_node()


@pytest.mark.parametrize("model, variant", [(PoolingModel, "other_keys"), (CrossModel, "other_rows"),
                                            (CrossModel, "holes")])
def test_cross_attention_near_misses_keep_the_padded_boundary(model, variant):
    """Keys over other lengths, a region of a data mask, GDPA output rows zeroed by other lengths: the op
    keeps its padded layout, and the compiled model still equals eager."""
    report = compare(model(variant), rewritten)
    records = [r for r in report.rewrites if r.pass_name == "unpad"]
    assert records and all(not r.metrics.get("packed_attention") for r in records)
    nodes = ops_named(report, "jagged_attention") + ops_named(report, "gdpa")
    assert nodes and all(len(n.args) < 15 or n.args[-2] is None for n in nodes)


def test_packed_attention_off_keeps_the_pma_boundary():
    """UnpadConfig.packed_attention=False: k and v leave the region by its scatters, as before."""
    config = GemConfig(unpad={"packed_attention": False})
    report = compare(PoolingModel(), lambda m: gem_compile(m, config=config), config)
    assert not unpad_record(report).metrics["packed_attention"]
    (node,) = ops_named(report, "jagged_attention")
    assert len(node.args) < 15 or node.args[13] is None
    assert all(fed_by_scatter(a) for a in node.args[1:3]), node.format_node()


@pytest.mark.parametrize("model, op", [(PoolingModel, "jagged_attention"), (CrossModel, "gdpa")])
@pytest.mark.parametrize("buckets", [1, 3])
def test_token_buckets_keep_cross_attention_packed(model, op, buckets):
    """Token buckets (CUDA graphs' default) end the packed rows with slack rows of no sequence: the op still
    reads (and gdpa writes) the packed rows, the slack rows get zeros, and the compiled model equals eager,
    gradients included."""
    config = GemConfig(unpad={"token_buckets": buckets})
    report = compare(model(), lambda m: gem_compile(m, config=config), config)
    assert unpad_record(report).metrics["packed_attention"] == {op: 1}
    (node,) = ops_named(report, op)
    assert node.args[-2] is not None, node.format_node()  # token_offsets
