"""Ops that keep device tensors across calls (token_mm's window row masks, the bag lookups' table
addresses) under CUDA-graph trees (torch.compile mode="reduce-overhead"): the kept tensors must not land in
a graph's private pool, or the trees fail the step ("tensor(s) in the cudagraph pool not tracked as
outputs", seen on GEM-ref small at 2f139f3). Three steps, each against eager."""

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from gemcompile.lowering import token_gemm  # noqa: E402  (also registers the ops)
from gemcompile.lowering.sparse_embedding import table_meta  # noqa: E402
from gemcompile.lowering.sparse_embedding.bags import sparse_embedding_bags  # noqa: E402
from gemcompile.lowering.sparse_embedding.op import MODE_SUM  # noqa: E402
from gemcompile.lowering.sparse_embedding.pending import new_table_key, take_rows  # noqa: E402


def _step(x, w, ids, weights, token, keys):
    # a reduction over 300 tokens (as in a weight gradient; token_mm has no autograd of its own): per_octave
    # 4 -> a 256-token head and a 64-token window, whose row mask is kept
    y = torch.ops.gemcompile.token_mm(x.t(), w, None, 1, 4, 16)
    pooled = sparse_embedding_bags(ids, weights, token, MODE_SUM, 0, keys)
    return y * 1.0, pooled.float().square().mean()


def test_kept_tensors_stay_out_of_cudagraph_pools():
    token_gemm._ROW_STEPS.clear()
    table_meta._CACHE.clear()
    g = torch.Generator(device="cuda").manual_seed(0)
    weights = [torch.randn(50, 16, device="cuda", generator=g, requires_grad=True) for _ in range(3)]
    keys = [new_table_key() for _ in weights]
    token = torch.zeros((), device="cuda")
    compiled = torch.compile(_step, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):
        x = torch.randn(300, 32, device="cuda", generator=g)
        w = torch.randn(300, 8, device="cuda", generator=g)
        ids = torch.randint(0, 50, (3, 4, 5), device="cuda", generator=g)
        torch.compiler.cudagraph_mark_step_begin()
        y, loss = compiled(x, w, ids, weights, token, keys)
        loss.backward()
        got_y, got_loss, got_rows = y.clone(), loss.detach().clone(), [take_rows(k) for k in keys]
        want_y, want_loss = _step(x, w, ids, weights, token, keys)
        want_loss.backward()
        want_rows = [take_rows(k) for k in keys]
        torch.testing.assert_close(got_y, x.t().double() @ w.double(), rtol=1e-4, atol=1e-4, check_dtype=False)
        torch.testing.assert_close(got_y, want_y)
        torch.testing.assert_close(got_loss, want_loss.detach(), rtol=1e-5, atol=1e-6)
        for got, exp in zip(got_rows, want_rows):
            assert len(got) == len(exp) == 1
            torch.testing.assert_close(got[0][0], exp[0][0])
            torch.testing.assert_close(got[0][1], exp[0][1], rtol=1e-5, atol=1e-6)
    assert token_gemm._ROW_STEPS and table_meta._CACHE  # the caches were used (else nothing was tested)
