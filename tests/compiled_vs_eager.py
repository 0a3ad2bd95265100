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
