"""GemConfig.memory: the partitioner's activation budget, gemcompile's attention never recomputed, explain's
table of saved tensors, and the compiled model still equal to eager (outputs and gradients).

Cheap by construction: every test but one runs the graphs as plain ATen through explain's backend (the
same pre-grad, joint and post-grad passes, and the same partitioner Inductor is given); one test compiles a
tiny function with Inductor to check that the partitioner and the budget reach a real compile."""

import re

import pytest
import torch
import torch._functorch.config as functorch_config
import torch.nn as nn
import torch.nn.functional as F

from gemcompile import GemConfig, explain
from gemcompile.backend import GemBackend
from gemcompile.explain import _ExplainBackend
from gemcompile.passes.activation_memory import KEPT_OPS, format_bytes, has_partitioner_slot
from gemcompile.passes.records import PassLog, recording

B, L, D, H = 8, 32, 32, 2  # head dim 16: the smallest the jagged kernel serves


class Block(nn.Module):
    """Pre-norm attention over a key-length mask (rewritten into gemcompile::jagged_attention) + an FFN; the
    token-wise layers run on packed tokens (unpad), the final masked sum making their padded rows unread."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.q, self.k, self.v = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)
        self.out = nn.Linear(D, D)
        self.ffn = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

    def forward(self, x, lengths):
        h = self.norm(x)
        q, k, v = (proj(h).view(B, L, H, D // H).transpose(1, 2) for proj in (self.q, self.k, self.v))
        keep = (torch.arange(L)[None, :] < lengths[:, None])[:, None, None, :]
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=keep).transpose(1, 2).reshape(B, L, D)
        x = x + self.out(a)
        return x + self.ffn(x)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, x, lengths):
        for block in self.blocks:
            x = block(x, lengths)
        valid = torch.arange(L)[None, :, None] < lengths[:, None, None]
        return (x * valid).sum()


def _inputs():
    return torch.randn(B, L, D, requires_grad=True), torch.tensor([32, 1, 17, 5, 32, 9, 24, 12])


def _attention_in_backward(graphs) -> list[str]:
    """gemcompile ops of KEPT_OPS that a backward graph computes (recomputes) itself."""
    kept = {f"gemcompile.{op}.default" for op in KEPT_OPS}
    return [str(n.target) for kind, gm in graphs if kind == "backward" for n in gm.graph.nodes
            if n.op == "call_function" and str(n.target) in kept]


def test_compiled_equals_eager_under_a_budget_and_attention_stays_saved():
    model, (x, lengths) = Model(), _inputs()
    backend = _ExplainBackend(GemConfig(memory={"budget": 0.1}))
    log = PassLog()
    with recording(log):
        out = torch.compile(model, backend=backend)(x, lengths)
    grads = torch.autograd.grad(out, [x, *model.parameters()])
    eager_out = model(x, lengths)
    eager_grads = torch.autograd.grad(eager_out, [x, *model.parameters()])
    torch.testing.assert_close(out, eager_out)
    for got, want in zip(grads, eager_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    forward_ops = {str(n.target) for kind, gm in backend.aot_graphs if kind == "forward"
                   for n in gm.graph.nodes}
    assert "gemcompile.jagged_attention_fwd.default" in forward_ops, "no attention rewritten: nothing proven"
    assert "gemcompile.valid_token_index.default" in forward_ops, "no region unpacked: packed tokens untested"
    (record,) = log.memory
    assert record.budget == 0.1 and record.kept >= 4  # two attentions, their batch order, the token index
    assert not _attention_in_backward(backend.aot_graphs)
    assert not any("gemcompile" in op for op in record.recomputed_ops)


def test_explain_tables_the_saved_tensors_and_the_budget_saves_less():
    report = explain(Model(), *_inputs(), config=GemConfig(memory={"budget": 0.1}))
    (record,) = report.memory
    # the default is measured on the same joint graph, with no budget: a real partition, not an estimate
    assert record.default_bytes is not None and record.saved_bytes < 0.5 * record.default_bytes
    statuses = {t.status for t in record.tensors}
    assert {"saved", "recomputed"} <= statuses
    attention = [t for t in record.tensors if t.op.startswith("gemcompile.jagged_attention_fwd")]
    assert attention and all(t.status == "saved" for t in attention)  # out (through an alias) and lse
    lse = next(t for t in attention if t.op.endswith("[1]"))
    # the attention reads unpad's packed tokens (self-attention layout): lse is (T, H) in float32, T sized at
    # unpad's hint
    assert re.fullmatch(rf"\(u\d+, {H}\)", lse.shape) and lse.dtype == "float32"
    assert lse.nbytes > 0 and lse.nbytes % (H * 4) == 0
    text = report.render(width=200)
    assert "saved for backward, graph 0" in text and "of the" in text and "budget 0.1" in text
    assert "recomputed" in text and "total" in text and "saved with no budget" in text

    no_budget = explain(Model(), *_inputs())
    (plain,) = no_budget.memory
    assert plain.budget is None and {t.status for t in plain.tensors} == {"saved"}
    kinds = {t.kind for t in plain.tensors if t.op in ("input", "parameter")}
    # the weights are parameters, not counted (x itself is not saved: unpad gathers it into packed rows)
    assert kinds == {"parameter"}
    assert plain.parameter_bytes > 0
    assert plain.saved_bytes == record.default_bytes  # the measured default is what no budget saves
    assert "no budget" in no_budget.render(width=200)


def test_recompute_attention_hands_the_attention_back_to_the_partitioner():
    """The control: without the MUST_SAVE tags the same budget recomputes the attention forward (torch 2.13),
    which is why they are there."""
    config = GemConfig(memory={"budget": 0.1, "recompute_attention": True})
    report = explain(Model(), *_inputs(), config=config)
    (record,) = report.memory
    assert record.kept == 1  # the token index only: a data-dependent size is never recomputed
    recomputed = _attention_in_backward(report.aot_graphs)
    assert any("jagged_attention_fwd" in op for op in recomputed)
    assert not any("valid_token_index" in op for op in recomputed)


class DropoutBlock(Block):
    """Block with dropout on the attention weights (SDPA's dropout_p in training): the graph draws the kernel's
    seed with aten.randint."""

    def forward(self, x, lengths):
        h = self.norm(x)
        q, k, v = (proj(h).view(B, L, H, D // H).transpose(1, 2) for proj in (self.q, self.k, self.v))
        keep = (torch.arange(L)[None, :] < lengths[:, None])[:, None, None, :]
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=0.3).transpose(1, 2).reshape(B, L, D)
        x = x + self.out(a)
        return x + self.ffn(x)


@pytest.mark.parametrize("recompute_attention", [False, True])
def test_a_budget_never_recomputes_the_dropout_seed(recompute_attention):
    """Under a budget torch's partitioner may recompute any op outside its own short list of random ops, and
    aten.randint is not on it: recomputed, the backward would draw another seed than the forward used (wrong
    gradients, silently). The seed is kept, even where the attention itself is recomputed."""
    model, (x, lengths) = Model(), _inputs()
    model.blocks = nn.ModuleList([DropoutBlock(), DropoutBlock()])
    backend = _ExplainBackend(GemConfig(memory={"budget": 0.05, "recompute_attention": recompute_attention}))
    torch.compile(model, backend=backend)(x, lengths)
    draws = {kind: [n for n in gm.graph.nodes if n.op == "call_function" and "randint" in str(n.target)]
             for kind, gm in backend.aot_graphs}
    assert len(draws["forward"]) == 2 and draws["backward"] == []
    backward = dict(backend.aot_graphs)["backward"]
    ops = [str(n.target) for n in backward.graph.nodes if n.op == "call_function"]
    assert ops.count("gemcompile.jagged_attention_bwd.default") == 2
    if recompute_attention:  # the control: the attention forward itself did move into the backward
        assert ops.count("gemcompile.jagged_attention_fwd.default") == 2


def _two_matmuls(x, w1, w2):
    """By default the backward reads h = x @ w1 (for w2's gradient); under a budget it recomputes h from x
    and w1. Only GEMMs: Inductor emits no C++ kernel for it, so the compile is cheap."""
    return (x @ w1) @ w2


@pytest.mark.skipif(not has_partitioner_slot(), reason="this torch's Inductor has no custom_partitioner_fn")
def test_no_memory_setting_leaves_inductors_partitioner_alone():
    backend = GemBackend(GemConfig())
    assert backend.partitioner({}) == {}
    assert "custom_partitioner_fn" in GemBackend(GemConfig(memory={"budget": 0.5})).partitioner({}) or \
        not has_partitioner_slot()


def test_inductor_runs_the_partitioner_under_the_budget_and_the_budget_does_not_leak():
    try:
        from torch._inductor.utils import fresh_cache
    except ImportError:  # torch < 2.8
        from torch._inductor.utils import fresh_inductor_cache as fresh_cache
    x = torch.randn(256, 8)
    w1, w2 = torch.randn(8, 256, requires_grad=True), torch.randn(256, 4, requires_grad=True)
    want = _two_matmuls(x, w1, w2)
    want_grads = torch.autograd.grad(want, [w1, w2], torch.ones_like(want))
    before = functorch_config.activation_memory_budget
    saved = {}
    for budget in (1.0, 0.1):  # 1.0: torch's default partition (no budget installs no partitioner at all)
        backend = GemBackend(GemConfig(memory={"budget": budget}))
        with fresh_cache():  # a cache hit would skip the partition
            out = torch.compile(_two_matmuls, backend=backend)(x, w1, w2)
            grads = torch.autograd.grad(out, [w1, w2], torch.ones_like(out))
        torch.testing.assert_close(out, want)
        for got, expected in zip(grads, want_grads):
            torch.testing.assert_close(got, expected)
        (record,) = backend.last_log.memory
        assert record.budget == (None if budget == 1.0 else budget) and record.default_bytes is None  # 1.0: the default
        saved[budget] = record.saved_bytes
        assert functorch_config.activation_memory_budget == before  # patched for the compile only
        torch._dynamo.reset()
    assert saved[1.0] >= 256 * 256 * 4  # h
    assert saved[0.1] < saved[1.0] / 4  # h recomputed: only x and the weights are read back


class _MLP(nn.Module):
    """Two Linear-GELU-Linear layers: by default the backward reads each GELU's input and output; under a
    budget it recomputes them from the Linear outputs."""

    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(*(nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
                                      for _ in range(2)))

    def forward(self, x):
        return self.layers(x).square().sum()


@pytest.mark.parametrize("model, inputs", [(_MLP, lambda: (torch.randn(128, 64, requires_grad=True),)),
                                           (Model, _inputs)], ids=["mlp", "attention"])
def test_the_record_has_the_peaks_and_the_budget_lowers_the_saved_bytes(model, inputs):
    report = explain(model(), *inputs(), config=GemConfig(memory={"budget": 0.3}))
    (record,) = report.memory
    assert record.saved_bytes < record.default_bytes
    peaks = (record.forward_peak, record.backward_peak, record.default_forward_peak,
             record.default_backward_peak)
    assert all(p is not None for p in peaks)
    for peak in peaks:
        assert peak.nbytes == peak.saved_bytes + peak.tangent_bytes + peak.produced_bytes > 0
        assert peak.top and sum(v.nbytes for v in peak.top) <= peak.nbytes
        assert list(peak.top) == sorted(peak.top, key=lambda v: -v.nbytes)
    # the backward starts with what the forward left: every saved value (and the tangent) alive at once
    assert record.backward_peak.nbytes >= record.saved_bytes
    assert record.default_backward_peak.nbytes >= record.default_bytes
    assert record.forward_peak.saved_bytes == 0  # a forward's inputs are alive anyway: not counted
    saved_names = {t.name: t.op for t in record.tensors if t.status != "recomputed"}
    for v in record.backward_peak.top:  # a saved value is named and produced as in the saved-tensor table
        assert v.kind != "saved" or saved_names[v.name] == v.op
    text = report.render(width=200)
    b = record.backward_peak
    assert f"graph 0: backward peak {format_bytes(b.nbytes)} at {b.node} (default " in text
    assert "produced in the backward" in text and "largest values alive at the backward peak" in text
    assert text.count("peaks: an estimate") == 1


def test_without_a_budget_the_peaks_are_the_defaults():
    report = explain(_MLP(), torch.randn(128, 64, requires_grad=True))
    (record,) = report.memory
    assert record.backward_peak == record.default_backward_peak is not None
    assert "(default" not in report.render(width=200).split("backward peak")[1].split("\n")[0]
