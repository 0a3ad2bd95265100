"""runtime.distributed.apply.grad_norm_ on plain tensors (one process): the norm and the clipping of
torch.nn.utils.clip_grad_norm_, over mixed dtypes and empty gradients."""

import pytest
import torch

from gemcompile.runtime.distributed.apply import grad_norm_


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    shapes_dtypes = [((7, 5), torch.float32), ((0, 3), torch.float32), ((11,), torch.float64),
                     ((3, 4, 2), torch.float32), ((2,), torch.float64)]
    params = []
    for shape, dtype in shapes_dtypes:
        p = torch.nn.Parameter(torch.randn(shape, generator=g, dtype=dtype))
        p.grad = torch.randn(shape, generator=g, dtype=dtype) * 3
        params.append(p)
    params.append(torch.nn.Parameter(torch.randn(4)))  # no gradient: ignored
    return params


@pytest.mark.parametrize("max_norm", [None, 1.0, 1e6])
def test_matches_clip_grad_norm(max_norm):
    ours, ref = _params(0), _params(0)
    norm = grad_norm_(ours, max_norm)
    want = torch.nn.utils.clip_grad_norm_(ref, max_norm if max_norm is not None else float("inf"))
    torch.testing.assert_close(norm, want.float(), rtol=1e-6, atol=0)
    for a, b in zip(ours, ref):
        if a.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-12)


def test_no_gradients_is_zero():
    p = torch.nn.Parameter(torch.ones(3))
    assert grad_norm_([p]).item() == 0.0
