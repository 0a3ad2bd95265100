"""The unpad region continues through gemcompile::block_attention on packed tokens (issues 24, 26).

A two-layer sequence stack written as GEM-ref's sequence layer (LayerNorm -> q, k, v Linears -> head split
-> QK RMSNorm -> masked SDPA with a block mask AND the length mask -> merge heads -> out proj -> masked
residual -> token FFN) compiled with gem_compile on CPU (the reference path of the ops) equals eager: outputs
and every gradient, fp32, over several length sets (0 and N among them) with one compile. The attention
reads the region's packed rows: no scatter feeds it, and explain says so. Near-misses keep the old boundary
(scatter, padded attention, gather) and still equal eager: keys over another lengths tensor, a region packed
by a data (holes) mask, query rows zeroed by other lengths.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters

from gemcompile import GemConfig, explain, gem_compile
from tests.rewritten import rewritten

B, N, D, H, BLOCK = 4, 24, 32, 2, 8
LENGTH_SETS = [[24, 0, 7, 13], [1, 24, 24, 9], [5, 16, 0, 3]]


def length_mask(lengths, n=N):
    return torch.arange(n)[None, :] < lengths[:, None]


class SequenceLayer(nn.Module):
    """Block self-attention and a token FFN, as GEM-ref's BlockSelfAttention + TokenFFN. ``keys`` and
    ``rows`` pick the masks of the near-misses: the key mask and the mask the output rows are zeroed by
    (None: not zeroed, as GEM-ref)."""

    def __init__(self, qk_norm=True):
        super().__init__()
        self.norm, self.ffn_norm = nn.LayerNorm(D), nn.LayerNorm(D)
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(D, D) for _ in range(4))
        self.q_norm = nn.RMSNorm(D // H) if qk_norm else nn.Identity()
        self.k_norm = nn.RMSNorm(D // H) if qk_norm else nn.Identity()
        self.up, self.down = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, s, valid, keys, rows):
        x = self.norm(s)
        q, k, v = (p(x).unflatten(-1, (H, -1)).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = self.q_norm(q), self.k_norm(k)
        i = torch.arange(N)
        block = (i // BLOCK)[:, None] == (i // BLOCK)[None, :]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=block[None, None] & keys[:, None, None, :])
        if rows is not None:  # the model zeroes the output rows past other lengths: q_lengths
            o = o * rows[:, None, :, None]
        s = s + self.out_proj(o.transpose(1, 2).flatten(2)) * valid[..., None]
        return s + self.down(F.gelu(self.up(self.ffn_norm(s)))) * valid[..., None]


class Stack(nn.Module):
    """Two layers over one padded sequence; ``variant`` picks the masks (see the near-miss tests)."""

    def __init__(self, variant="lengths", qk_norm=True):
        super().__init__()
        self.variant = variant
        self.inp = nn.Linear(D, D)
        self.layers = nn.ModuleList(SequenceLayer(qk_norm) for _ in range(2))

    def forward(self, x, lengths, ids):
        valid = length_mask(lengths) if self.variant != "holes" else ids != 0
        keys = valid
        if self.variant == "other_keys":  # other lengths from the same tensor
            keys = length_mask((lengths - 1).clamp(min=0))
        elif self.variant == "other_tensor":  # lengths from another tensor (the ids)
            keys = length_mask((ids != 0).sum(1))
        rows = length_mask((lengths - 2).clamp(min=0)) if self.variant == "other_rows" else \
            valid if self.variant == "same_rows" else None
        s = self.inp(x) * valid[..., None]
        for layer in self.layers:
            s = layer(s, valid, keys, rows)
        return s * valid[..., None]


def inputs(lengths):
    torch.manual_seed(1)
    ids = torch.randint(0, 3, (B, N)) * length_mask(lengths)  # holes inside the lengths
    ids[:, 0] = 1  # a holes row keeps its first token (a fully masked row is NaN in eager SDPA)
    return torch.randn(B, N, D, requires_grad=True), lengths, ids


def compare(model, compile_fn, config=None):
    """The compiled model against eager over every length set: outputs and all gradients; one compile."""
    counters.clear()
    compiled = compile_fn(model)
    for lengths in LENGTH_SETS:
        x, lengths, ids = inputs(torch.tensor(lengths))
        params = [x, *model.parameters()]
        out = compiled(x, lengths, ids)
        grads = torch.autograd.grad(out.square().sum(), params)
        ref = model(x, lengths, ids)
        ref_grads = torch.autograd.grad(ref.square().sum(), params)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
        for g, g_ref in zip(grads, ref_grads):
            torch.testing.assert_close(g, g_ref, atol=1e-5, rtol=1e-4)
    assert counters["stats"]["unique_graphs"] == 1, "a new token count recompiled"
    return explain(model, *inputs(torch.tensor(LENGTH_SETS[0])), config=config)


def attention_nodes(report):
    return [n for n in report.graph_after.graph.nodes if "block_attention" in str(n.target)]


def fed_by_scatter(node, depth=6):
    """Whether an index_put (an exit scatter) feeds ``node`` within a few producers."""
    if depth == 0 or not isinstance(node, torch.fx.Node):
        return False
    return "index_put" in str(node.target) or any(fed_by_scatter(a, depth - 1) for a in node.all_input_nodes)


def unpad_record(report):
    (record,) = [r for r in report.rewrites if r.pass_name == "unpad"]
    return record


@pytest.mark.parametrize("qk_norm", [True, False], ids=["qk_norm", "plain"])
def test_sequence_stack_attention_runs_on_packed_tokens(qk_norm):
    report = compare(Stack(qk_norm=qk_norm), gem_compile)
    record = unpad_record(report)
    assert record.metrics["packed_attention"] == {"block_attention": 2}
    assert "block_attention x2 on packed tokens" in record.detail
    # one gather (the input) in, one scatter (the output) out: no boundary at the attention any more
    assert record.metrics["gathers"] == 1 and record.metrics["scatters"] == 1
    nodes = attention_nodes(report)
    assert len(nodes) == 2
    for node in nodes:
        args = torch.fx.node.map_arg(node.args, lambda a: a)
        assert args[14] is not None and args[15] == N  # token_offsets, max_len
        assert not any(fed_by_scatter(a) for a in args[:3]), node.format_node()
    cumsums = [n for n in report.graph_after.graph.nodes if n.target is torch.ops.aten.cumsum.default]
    assert len(cumsums) == 1  # token offsets once per lengths
    assert all(n.args[14] is cumsums[0].next for n in nodes)  # (constant_pad_nd: [0, cumsum])


def test_attention_rows_zeroed_by_the_same_lengths_stay_packed():
    """``o * valid[:, None, :, None]`` after the block attention: the op writes those rows as 0 already (its
    q_lengths), the zeroing is dropped (passes/unpad_zeroed_rows.py) and the stack packs as without it."""
    report = compare(Stack("same_rows"), gem_compile)
    record = unpad_record(report)
    assert record.metrics["packed_attention"] == {"block_attention": 2}
    assert (record.metrics["gathers"], record.metrics["scatters"], record.metrics["zeroings_dropped"]) == (1, 1, 2)


@pytest.mark.parametrize("variant", ["other_keys", "other_tensor", "holes", "other_rows"])
def test_near_misses_keep_the_padded_boundary(variant):
    """Keys over other lengths (of the same tensor, of another one), a region of a data mask, rows zeroed by
    other lengths: the attention keeps the padded layout (the region still packs the projections and
    FFNs), and the compiled model still equals eager."""
    report = compare(Stack(variant), rewritten)
    records = [r for r in report.rewrites if r.pass_name == "unpad"]
    assert records and all(not r.metrics.get("packed_attention") for r in records)
    for node in attention_nodes(report):
        assert len(node.args) <= 14 or node.args[14] is None


@pytest.mark.parametrize("buckets", [1, 2, 7])
def test_token_buckets_keep_attention_packed(buckets):
    """With token buckets the packed rows end with slack rows that belong to no sequence: the attention
    still reads the packed rows (the op gives the slack rows zeros and zero gradients), and the compiled
    model equals eager, gradients included."""
    config = GemConfig(unpad={"token_buckets": buckets})
    report = compare(Stack(), lambda m: gem_compile(m, config=config), config)
    assert unpad_record(report).metrics["packed_attention"]
    assert any(len(n.args) > 14 and n.args[14] is not None for n in attention_nodes(report))


def test_packed_attention_off_keeps_the_padded_boundary():
    """UnpadConfig.packed_attention=False: every attention op stays a region boundary, as before."""
    config = GemConfig(unpad={"packed_attention": False})
    report = compare(Stack(), lambda m: gem_compile(m, config=config), config)
    record = unpad_record(report)
    assert not record.metrics["packed_attention"] and record.metrics["scatters"] > 1
    assert all(len(n.args) <= 14 or n.args[14] is None for n in attention_nodes(report))
