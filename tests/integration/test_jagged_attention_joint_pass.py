"""The joint-graph half of jagged attention: hand-written padded attention that reaches the AOTAutograd
joint graph (here: a pipeline without the pre-grad pass) is rewritten with eager's outputs and
gradients; masks that are not key-padding masks are left alone with a reason."""

import math

import pytest
import torch

from gemcompile.backend import GemBackend
from gemcompile.explain import explain_with_passes
from gemcompile.passes.attention.joint import JaggedAttentionJointPass

B, H, L, D = 3, 2, 12, 16
JOINT_ONLY = [JaggedAttentionJointPass]


def keep(n):
    return (torch.arange(L)[None, :] < n[:, None])[:, None, None, :]  # (B, 1, 1, L)


def masked_fill_div(q, k, v, n):
    s = q @ k.transpose(-2, -1) / math.sqrt(D)
    return torch.softmax(s.masked_fill(~keep(n), float("-inf")), dim=-1) @ v


def masked_fill_mul(q, k, v, n):
    s = (q @ k.transpose(-2, -1)) * 0.25
    return s.masked_fill(~keep(n), float("-inf")).softmax(-1) @ v


def where_div(q, k, v, n):
    s = q @ k.transpose(-2, -1) / 4.0
    return torch.where(keep(n), s, float("-inf")).softmax(-1) @ v


def additive_mul(q, k, v, n):
    s = (q @ k.transpose(-2, -1)) * 0.25 + (1.0 - keep(n).float()) * -1e9
    return s.softmax(-1) @ v


@pytest.mark.parametrize("idiom", [masked_fill_div, masked_fill_mul, where_div, additive_mul],
                         ids=lambda f: f.__name__)
@pytest.mark.parametrize("training", [True, False], ids=["joint", "inference"])
def test_joint_graph_rewrite_matches_eager(idiom, training):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D, generator=g, requires_grad=training) for _ in range(3))
    n = torch.tensor([L, 5, 1])
    report = explain_with_passes(JOINT_ONLY, idiom, q, k, v, n)
    assert report.counts["jagged_attention_joint"] == 1, report.refusals
    out = torch.compile(idiom, backend=GemBackend(passes=JOINT_ONLY))(q, k, v, n)
    ref = idiom(q, k, v, n)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    if training:
        weights = torch.randn(ref.shape, generator=g)
        grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
        grads_ref = torch.autograd.grad((ref * weights).sum(), (q, k, v))
        for a, b in zip(grads, grads_ref):
            torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)


def mask_from_input(q, k, v, mask):
    return torch.softmax((q @ k.transpose(-2, -1) * 0.25).masked_fill(~mask, float("-inf")), -1) @ v


def key_and_query_mask(q, k, v, n):
    m = keep(n) & keep(n).transpose(-1, -2)  # (B, 1, L, L)
    return torch.softmax((q @ k.transpose(-2, -1) * 0.25).masked_fill(~m, float("-inf")), -1) @ v


@pytest.mark.parametrize("idiom, extra, reason", [
    (mask_from_input, torch.rand(B, 1, 1, L) > 0.5, "not from lengths"),
    (key_and_query_mask, torch.tensor([L, 5, 1]), "not (B, 1, 1, L)"),
], ids=["mask_from_input", "key_and_query_mask"])
def test_joint_graph_near_misses_are_left_alone(idiom, extra, reason):
    q, k, v = (torch.randn(B, H, L, D, requires_grad=True) for _ in range(3))
    report = explain_with_passes(JOINT_ONLY, idiom, q, k, v, extra)
    assert report.counts["jagged_attention_joint"] == 0
    assert any(reason in r.reason for r in report.refusals), report.refusals


def test_the_default_pipeline_rewrites_pre_grad_first():
    """With both halves on, the pre-grad pass takes the attention and the joint pass finds nothing left."""
    from gemcompile import explain

    q, k, v = (torch.randn(B, H, L, D, requires_grad=True) for _ in range(3))
    report = explain(masked_fill_div, q, k, v, torch.tensor([L, 5, 1]))
    assert report.counts["jagged_attention"] == 1 and report.counts["jagged_attention_joint"] == 0
    assert sum(report.counts.values()) == 1  # and no other pass took it


def _joint_graph(fn, *inputs):
    """The joint forward+backward graph AOTAutograd hands to joint_custom_pre_pass for ``fn`` (with
    Inductor's decompositions: softmax as amax / sub / exp / sum / div)."""
    from functorch.compile import nop
    from torch._functorch.aot_autograd import aot_function
    from torch._inductor.decomposition import select_decomp_table

    from torch._functorch.partitioners import default_partition

    joint = []

    def keep_joint(gm, *args, **kwargs):
        joint.append(gm.graph)
        return default_partition(gm, *args, **kwargs)

    compiled = aot_function(fn, fw_compiler=nop, bw_compiler=nop,
                            partition_fn=keep_joint, decompositions=select_decomp_table())
    compiled(*inputs)
    return joint[0]


def test_no_pattern_tracing_without_a_softmax_over_a_matmul(monkeypatch):
    """A softmax over a Linear's output (an expert gate) is no attention: the pass returns before tracing its
    36 patterns (seconds of compile time); a softmax over q @ k^T is a candidate."""
    from gemcompile.passes.attention import joint

    traced = []
    monkeypatch.setattr(joint, "_patterns", lambda: traced.append(1) or joint.PatternMatcherPass())
    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(3, 8, requires_grad=True)
    gate = _joint_graph(lambda x, w: torch.softmax(x @ w.t(), dim=-1) * 2.0, x, w)
    assert any(n.target is torch.ops.aten.amax.default for n in gate.nodes)
    assert not joint._has_candidate(gate)
    JaggedAttentionJointPass(GemBackend().config).run(gate)
    assert traced == []
    q, k, v = (torch.randn(B, H, L, D, requires_grad=True) for _ in range(3))
    attention = _joint_graph(lambda q, k, v: masked_fill_div(q, k, v, torch.tensor([L, 5, 1])), q, k, v)
    assert joint._has_candidate(attention)
    JaggedAttentionJointPass(GemBackend().config).run(attention)
    assert traced == [1]
