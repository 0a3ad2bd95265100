"""Compile with gemcompile's pre-grad passes run by aot_eager instead of Inductor: the same rewritten graph
and custom ops as gem_compile, without a cold C++ compile per model on CI's CPU. Shared by the integration
tests of the attention and unpad rewrites."""

import torch
from torch._dynamo.backends.registry import lookup_backend

from gemcompile import GemConfig
from gemcompile.passes import PIPELINE
from gemcompile.passes.base import instantiate, run_pre_grad


def rewritten(model, compiles: list | None = None, config: GemConfig | None = None):
    """``model`` (or a function) compiled so (with ``config``, default GemConfig()); each graph Dynamo hands
    over is appended to ``compiles``."""

    def backend(gm, example_inputs):
        if compiles is not None:
            compiles.append(gm)
        run_pre_grad(gm, instantiate(PIPELINE, config or GemConfig()), example_inputs)
        return lookup_backend("aot_eager")(gm, example_inputs)

    return torch.compile(model, backend=backend)


def unpad_gemms_matching_eager(model, *inputs) -> list[int]:
    """The GEMMs of each region unpad packs in ``model`` (explain), after checking that the rewritten model's
    outputs and the gradients of every parameter (an unused one: none or zeros on both sides) equal eager's."""
    from gemcompile import explain

    report = explain(model, *inputs)
    out, ref = rewritten(model)(*inputs), model(*inputs)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
    params = list(model.parameters())
    grads = torch.autograd.grad(out.square().sum(), params, allow_unused=True)
    refs = torch.autograd.grad(ref.square().sum(), params, allow_unused=True)
    for g, r in zip(grads, refs):
        if r is None:
            assert g is None or not g.any()
        else:
            torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-4)
    return [r.metrics["gemms"] for r in report.rewrites if r.pass_name == "unpad"]


def counting_gem_compile(monkeypatch):
    """``compile_with(model, compiles)``: gem_compile itself (Inductor and the kernels), each graph handed to
    its backend appended to ``compiles`` (for the GPU tests that count recompiles)."""
    from gemcompile import gem_compile
    from gemcompile.backend import GemBackend

    def compile_with(model, compiles):
        original = GemBackend.__call__
        monkeypatch.setattr(GemBackend, "__call__",
                            lambda self, *a, **kw: compiles.append(1) or original(self, *a, **kw))
        return gem_compile(model)

    return compile_with
