"""unpad_reductions: the sums over packed tokens (bias and norm-weight gradients) padded to their static
bound, with eager's outputs and gradients and no recompiles; sums over other dims, and graphs without a
data-dependent token count, left alone."""

import torch
from torch._dynamo.utils import counters

from gemcompile import GemConfig, explain, gem_compile
from gemcompile.passes.unpad_reductions import inductor_splits_unbacked_reductions
from tests.integration.test_unpad_pass import LENGTH_SETS, B, MaskedResidualFfn, N, x_only

PAD = GemConfig(unpad={"pad_reductions": True})


def _train_and_compare(model, config):
    """Compiled training over every length set against eager; caches off, so the post-grad pass runs (and
    counts) even when an earlier process compiled the same graph."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        _train_and_compare_uncached(model, config)


def _train_and_compare_uncached(model, config):
    counters.clear()
    compiled = gem_compile(model, config=config)
    params = list(model.parameters())
    for lengths in LENGTH_SETS:
        x, lengths = x_only(torch.tensor(lengths))
        out = compiled(x, lengths)
        grads = torch.autograd.grad(out.square().sum(), params)
        ref = model(x, lengths)
        ref_grads = torch.autograd.grad(ref.square().sum(), params)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
        for g, g_ref in zip(grads, ref_grads):
            torch.testing.assert_close(g, g_ref, atol=1e-5, rtol=1e-4)
    assert counters["stats"]["unique_graphs"] == 1, "a new token count recompiled"


def test_packed_sums_padded_with_eager_gradients():
    model = MaskedResidualFfn()
    _train_and_compare(model, PAD)
    # one backward graph; its sums over T: the input projection's bias, and per FFN block the norm's
    # weight and bias and the two linear biases (the norms' per-row sums over D stay as they are)
    assert counters["gemcompile"]["unpad_reductions"] == 1
    report = explain(model, *x_only(torch.tensor(LENGTH_SETS[0])), config=PAD)
    (rewrite,) = [r for r in report.rewrites if r.pass_name == "unpad_reductions"]
    assert rewrite.metrics["sums"] == 9
    assert f"[{B * N}]" in rewrite.detail


def test_left_alone_under_dynamic_shapes():
    """With the batch size symbolic (Dynamo's recompile after it changes) T has no integer bound: the sums
    stay as they are, and the compile goes on (it stopped in the pass on torch 2.11, where the pass is on)."""
    x, lengths = x_only(torch.tensor(LENGTH_SETS[0]))
    torch._dynamo.mark_dynamic(x, 0)
    torch._dynamo.mark_dynamic(lengths, 0)
    report = explain(MaskedResidualFfn(), x, lengths, config=PAD)
    assert report.counts["unpad"] == 1 and report.counts["unpad_reductions"] == 0
    assert not [r for r in report.refusals if "internal error" in r.reason], report.refusals


def test_left_alone_without_packed_tokens():
    """unpad off: every sum is over static sizes, nothing to pad."""
    model = MaskedResidualFfn()
    config = GemConfig(unpad={"enabled": False, "pad_reductions": True})
    report = explain(model, *x_only(torch.tensor(LENGTH_SETS[0])), config=config)
    assert report.counts["unpad_reductions"] == 0
    _train_and_compare(model, config)
    assert counters["gemcompile"]["unpad_reductions"] == 0


def test_auto_by_default_follows_inductor():
    model = MaskedResidualFfn()
    inputs = x_only(torch.tensor(LENGTH_SETS[0]))
    default = explain(model, *inputs).counts["unpad_reductions"]
    auto = explain(model, *inputs, config=GemConfig(unpad={"pad_reductions": None})).counts["unpad_reductions"]
    off = explain(model, *inputs, config=GemConfig(unpad={"pad_reductions": False})).counts["unpad_reductions"]
    assert default == auto == (0 if inductor_splits_unbacked_reductions() else 1)
    assert off == 0
