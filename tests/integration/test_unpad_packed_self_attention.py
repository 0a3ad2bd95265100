"""Self-attention layers written the way BERT-style model code writes them run on packed tokens end to end.

The layer: biased q, k, v projections of an input whose padded rows are never zeroed, head splits written
``x.view(x.size()[:-1] + (H, Dh)).permute(0, 2, 1, 3)``, SDPA with the key-padding mask of the lengths, the
merge ``o.permute(0, 2, 1, 3).contiguous().view(B, N, D)``, and the padded rows zeroed only at the end. The
unpad pass takes the projections into its region (view / reshape are token-wise; the attention reads them
only at rows the lengths allow, and its padded output rows only reach the region through its gather), and
the jagged attention op takes q, k, v and its output packed: one gather in, one scatter out for the whole
stack. Near-misses keep the padded boundary and stay exact: keys valid by other lengths (nothing packed
through the attention), and an attention output that is read at its padded rows (q stays padded; k and v
go in packed, the op's packed-keys layout).
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gemcompile import GemConfig, explain
from tests.compiled_vs_eager import assert_compiled_matches_eager

B, N, H, DH = 3, 8, 2, 16
D = H * DH
LENGTHS = torch.tensor([8, 0, 5])


class PermuteHeadsLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        self.norm = nn.LayerNorm(D)
        self.ff = nn.Linear(D, D)

    @staticmethod
    def heads(x):
        return x.view(x.size()[:-1] + (H, DH)).permute(0, 2, 1, 3)

    def attend(self, x, key_valid):
        q, k, v = self.heads(self.q(x)), self.heads(self.k(x)), self.heads(self.v(x))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=key_valid[:, None, None, :])

    def forward(self, x, key_valid):
        o = self.attend(x, key_valid).permute(0, 2, 1, 3).contiguous()
        x = self.norm(x + self.o(o.view(o.size()[:-2] + (D,))))
        return x + F.gelu(self.ff(x))


class Stack(nn.Module):
    def __init__(self, layers=2):
        super().__init__()
        self.layers = nn.ModuleList(PermuteHeadsLayer() for _ in range(layers))

    def forward(self, x, lengths):
        valid = torch.arange(N)[None, :] < lengths[:, None]
        for layer in self.layers:
            x = layer(x, valid)
        return x * valid[..., None]


class OtherKeys(Stack):
    """Keys valid by other lengths than the rows the output keeps."""

    def forward(self, x, lengths):
        valid = torch.arange(N)[None, :] < lengths[:, None]
        keys = torch.arange(N)[None, :] < (lengths[:, None] + 1).clamp(max=N)
        return self.layers[0](x, keys) * valid[..., None]


class OutputReadPadded(Stack):
    """The attention output is also returned whole: its padded rows are observable."""

    def forward(self, x, lengths):
        valid = torch.arange(N)[None, :] < lengths[:, None]
        layer = self.layers[0]
        o = layer.attend(x, valid)
        y = layer.o(o.permute(0, 2, 1, 3).reshape(B, N, D))
        return y * valid[..., None], o


def _unpad(report):
    return [r.metrics for r in report.rewrites if r.pass_name == "unpad"]


def test_bert_style_stack_runs_packed_from_first_gather_to_last_scatter():
    torch.manual_seed(0)
    model = Stack()
    x = torch.randn(B, N, D, requires_grad=True)
    (metrics,) = _unpad(explain(model, x, LENGTHS))
    assert metrics["gemms"] == 10  # q, k, v, o, ff of both layers
    assert metrics["packed_attention"] == {"jagged_attention": 2}
    assert (metrics["gathers"], metrics["scatters"]) == (1, 1)
    assert metrics["op_counts"]["view"] >= 8  # four head splits / merges per layer
    assert_compiled_matches_eager(model, x, LENGTHS)


def test_keys_by_other_lengths_keep_the_attention_padded():
    torch.manual_seed(0)
    model = OtherKeys(layers=1)
    x = torch.randn(B, N, D, requires_grad=True)
    for metrics in _unpad(explain(model, x, LENGTHS)):
        assert not metrics["packed_attention"]
    assert_compiled_matches_eager(model, x, LENGTHS)


def test_an_attention_output_read_at_its_padded_rows_keeps_its_queries_padded():
    torch.manual_seed(0)
    model = OutputReadPadded(layers=1)
    x = torch.randn(B, N, D, requires_grad=True)
    regions = _unpad(explain(model, x, LENGTHS))
    # q stays padded (its attention's padded output rows are returned); k and v are read only at valid keys,
    # so the op still takes them packed (its packed-keys layout), with its dense queries and output
    assert sum(m["gemms"] for m in regions) == 3  # k, v and o; not q
    assert [m["packed_attention"] for m in regions if m["packed_attention"]] == [{"jagged_attention": 1}]
    assert_compiled_matches_eager(model, x, LENGTHS)


@pytest.mark.parametrize("buckets", [1, 4])
def test_bert_style_stack_under_token_buckets(buckets):
    """Token buckets (CUDA graphs' default): the packed rows end with slack rows of no sequence; both
    attentions still run packed and the compiled stack equals eager, gradients included."""
    torch.manual_seed(0)
    model = Stack()
    x = torch.randn(B, N, D, requires_grad=True)
    config = GemConfig(unpad={"token_buckets": buckets})
    (metrics,) = _unpad(explain(model, x, LENGTHS, config=config))
    assert metrics["packed_attention"] == {"jagged_attention": 2}
    assert_compiled_matches_eager(model, x, LENGTHS, config=config)
