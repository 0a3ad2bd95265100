"""Unpad under dynamic shapes: Dynamo compiles the first batch with static sizes and, once the batch size or
the padded length changes (a tokenizer padding to the longest sequence of each batch, a smaller last batch),
recompiles once with symbolic sizes for every later batch. That second graph must run packed too, or every
later step pays for the padding again.

The rewrite takes B and N as graph values there (the size inputs Dynamo lifts, graph.size_argument) and adds
no guard on them: each model below sees three batches of different sizes, compiles twice (static, then
dynamic), packs both graphs, and equals eager in outputs and every gradient.

Compiled with the pre-grad passes and aot_eager (the same rewritten graph and ops, no C++ compile)."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

from gemcompile import GemConfig, explain
from gemcompile.backend import allow_warnings_in_graphs
from gemcompile.config import UnpadConfig
from tests.compiled_vs_eager import assert_same_weighted_grads
from tests.model_styles import SASRecBlock
from tests.rewritten import rewritten

H, D = 2, 16
E = H * D
SHAPES = ((3, 8), (4, 11), (2, 9))  # (batch, padded length): static, then one dynamic graph for the rest


class TimelineStack(nn.Module):
    """Two SASRec blocks (tests/model_styles.py) packed by the timeline mask ``ids == 0``."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(SASRecBlock(H, D) for _ in range(2))

    def forward(self, x, ids):
        for block in self.blocks:
            x = block(x, ids)
        return x


class LengthsEncoder(nn.Module):
    """A length mask from ``arange(N) < lengths``, causal SDPA read on packed tokens, an FFN, zeroed padded rows
    and the last valid token of each sequence (a per-sample row read)."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(E, 3 * E), nn.Linear(E, E)
        self.ff1, self.ff2, self.norm = nn.Linear(E, 2 * E), nn.Linear(2 * E, E), nn.LayerNorm(E)

    def forward(self, x, lengths):
        b, n, _ = x.shape
        valid = torch.arange(n, device=x.device)[None, :] < lengths[:, None]
        x = x * valid[..., None]
        q, k, v = (t.view(b, n, H, D).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        keep = valid[:, None, None, :] & torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=keep).transpose(1, 2).reshape(b, n, E)
        h = self.norm(x + self.out(a))
        h = (h + self.ff2(F.relu(self.ff1(h)))) * valid[..., None]
        last = h[torch.arange(b, device=x.device), (lengths - 1).clamp_min(0)]
        return torch.cat([last[:, None], h], 1)


class MeanPooledEncoder(nn.Module):
    """An integer attention_mask as a tokenizer gives it: the key mask of SDPA, then sentence-transformers'
    mean pooling over the mask expanded to the features with ``expand(h.size())``."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(E, 3 * E), nn.Linear(E, E)
        self.ff1, self.ff2 = nn.Linear(E, 2 * E), nn.Linear(2 * E, E)

    def forward(self, x, attention_mask):
        b, n, _ = x.shape
        q, k, v = (t.view(b, n, H, D).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        keep = attention_mask[:, None, None, :].bool()
        h = x + self.out(F.scaled_dot_product_attention(q, k, v, attn_mask=keep).transpose(1, 2).reshape(b, n, E))
        h = h + self.ff2(F.gelu(self.ff1(h)))
        weights = attention_mask.unsqueeze(-1).expand(h.size()).float()
        return (h * weights).sum(1) / weights.sum(1).clamp(min=1e-9)


class ClsTokenFfn(nn.Module):
    """A learned [CLS] token prepended (padded length N + 1, a size no graph input holds), an FFN, the padded
    rows zeroed by masked_fill."""

    def __init__(self):
        super().__init__()
        self.cls = nn.Parameter(torch.randn(1, 1, E))
        self.fc1, self.fc2 = nn.Linear(E, 2 * E), nn.Linear(2 * E, E)

    def forward(self, x, lengths):
        x = torch.cat([self.cls.expand(x.shape[0], 1, E), x], 1)
        valid = torch.arange(x.shape[1], device=x.device)[None, :] < (lengths + 1)[:, None]
        return self.fc2(F.gelu(self.fc1(x))).masked_fill(~valid[..., None], 0.0)


class AttributeSlotsFfn(nn.Module):
    """Tokens of K attribute slots each (B, N, K, E), an FFN over them, padded tokens zeroed: K changes too."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(E, 2 * E), nn.Linear(2 * E, E)

    def forward(self, x, lengths):
        valid = torch.arange(x.shape[1], device=x.device)[None, :] < lengths[:, None]
        return self.fc2(F.gelu(self.fc1(x))) * valid[:, :, None, None]


MODELS = {"timeline_ids": TimelineStack, "lengths_with_last_token": LengthsEncoder,
          "integer_mask_mean_pooled": MeanPooledEncoder, "cls_token_prepended": ClsTokenFfn}
ATTENTIONS = {"timeline_ids": 2, "lengths_with_last_token": 1, "integer_mask_mean_pooled": 1,
              "cls_token_prepended": 0}


def _batch(name: str, batch: int, n: int, g: torch.Generator) -> list[torch.Tensor]:
    """x and the model's mask input; lengths in [1, n] (one full sequence)."""
    lengths = torch.randint(1, n + 1, (batch,), generator=g)
    lengths[0] = n
    valid = torch.arange(n)[None, :] < lengths[:, None]
    x = torch.randn(batch, n, E, generator=g, requires_grad=True)
    if name == "timeline_ids":
        return [x, torch.randint(1, 50, (batch, n), generator=g) * valid]
    if name in ("lengths_with_last_token", "cls_token_prepended"):
        return [x, lengths]
    return [x, valid.long()]


def check_dynamic_unpad(name: str, device: str = "cpu", compile_with=None) -> None:
    """Three batches of different sizes through one compiled model: outputs and gradients equal eager's, two
    compiles (static, then dynamic), both packed. ``compile_with(model, compiles)`` compiles (default: the
    passes with aot_eager, tests/rewritten.py)."""
    torch.manual_seed(0)
    model = MODELS[name]().to(device)
    allow_warnings_in_graphs()
    counters.clear()
    compiles: list = []
    compiled = (compile_with or rewritten)(model, compiles)
    g = torch.Generator().manual_seed(3)
    for batch, n in SHAPES:
        inputs = [t.detach().to(device).requires_grad_(t.requires_grad) for t in _batch(name, batch, n, g)]
        out, ref = compiled(*inputs), model(*inputs)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
        assert_same_weighted_grads(out, ref, [inputs[0], *model.parameters()])
    assert len(compiles) == 2  # no guard of ours specializes a size: the third batch reuses the dynamic graph
    assert counters["gemcompile"]["unpad"] == 2 and not counters["gemcompile"]["unpad_refused"]
    assert counters["gemcompile"]["jagged_attention"] == 2 * ATTENTIONS[name]


@pytest.mark.parametrize("name", list(MODELS))
def test_the_dynamic_recompile_runs_packed(name):
    check_dynamic_unpad(name)


def test_a_changing_trailing_size_adds_no_recompile():
    """The explain metrics read a symbolic trailing size by its hint: an int() there guarded K, and every
    batch of another K compiled anew."""
    torch.manual_seed(0)
    model = AttributeSlotsFfn()
    counters.clear()
    compiles: list = []
    compiled = rewritten(model, compiles)
    g = torch.Generator().manual_seed(0)
    for slots in (2, 3, 4, 5):
        x, lengths = torch.randn(3, 8, slots, E, generator=g, requires_grad=True), torch.tensor([8, 0, 5])
        out, ref = compiled(x, lengths), model(x, lengths)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
        assert_same_weighted_grads(out, ref, [x, *model.parameters()])
    assert len(compiles) == 2 and counters["gemcompile"]["unpad"] == 2


def _dynamic_inputs(name: str):
    inputs = [t.detach() for t in _batch(name, 3, 8, torch.Generator().manual_seed(1))]
    for t in inputs:
        for dim in range(min(t.dim(), 2)):
            torch._dynamo.mark_dynamic(t, dim)
    return inputs


def test_explain_shows_the_region_over_symbolic_sizes():
    report = explain(LengthsEncoder(), *_dynamic_inputs("lengths_with_last_token"))
    (region,) = [r for r in report.rewrites if r.pass_name == "unpad"]
    assert isinstance(region.metrics["batch"], str) and isinstance(region.metrics["seq"], str), region.metrics
    assert region.metrics["gemms"] == 4 and region.metrics["packed_attention"] == {"jagged_attention": 1}
    assert region.metrics["packed_row_reads"] == {"per_batch": 1}, region.detail
    assert not [r for r in report.refusals if r.pass_name == "unpad"]


def test_token_buckets_under_dynamic_shapes_are_refused_with_the_reason():
    """Bucketed token counts are fractions of a static B * N: under symbolic sizes the region stays padded
    and explain says why (a silent fallback would hide the lost speed)."""
    config = GemConfig(unpad=UnpadConfig(token_buckets=4))
    report = explain(LengthsEncoder(), *_dynamic_inputs("lengths_with_last_token"), config=config)
    assert not [r for r in report.rewrites if r.pass_name == "unpad"]
    reasons = [r.reason for r in report.refusals if r.pass_name == "unpad"]
    assert any("token_buckets needs a static batch size and padded length" in r for r in reasons), reasons
