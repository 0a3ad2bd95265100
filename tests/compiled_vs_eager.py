"""gem_compile(model) against the eager model, outputs and gradients: shared by the unpad integration tests."""

import torch

from gemcompile import gem_compile


def assert_compiled_matches_eager(model, *inputs, atol: float = 2e-5, rtol: float = 1e-4,
                                  config=None) -> None:
    """Every output of the compiled model equals eager's, and so do the gradients of the outputs' squared sum
    with respect to the inputs that require grad and every parameter (an unused one gets zeros on both
    sides)."""
    wrt = [*(t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad), *model.parameters()]

    def run(fn):
        outs = fn(*inputs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        loss = sum(o.float().square().sum() for o in outs)
        return outs, torch.autograd.grad(loss, wrt, allow_unused=True, materialize_grads=True)

    (outs, grads), (refs, ref_grads) = run(gem_compile(model, config=config)), run(model)
    for out, ref in zip(outs, refs, strict=True):
        torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, atol=atol, rtol=rtol)


def assert_same_weighted_grads(out, ref, leaves, *, seed: int = 2, atol: float = 5e-5,
                               rtol: float = 1e-4) -> None:
    """The gradients of a random-weighted sum of ``out`` and of ``ref`` with respect to ``leaves`` are equal
    (a leaf that neither reaches is None on both sides)."""
    weights = torch.randn(ref.shape, generator=torch.Generator().manual_seed(seed)).to(ref.device)
    grads = torch.autograd.grad((out * weights).sum(), leaves, allow_unused=True)
    grads_ref = torch.autograd.grad((ref * weights).sum(), leaves, allow_unused=True)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        assert (g is None) == (g_ref is None)
        if g is not None:
            torch.testing.assert_close(g, g_ref, atol=atol, rtol=rtol)
