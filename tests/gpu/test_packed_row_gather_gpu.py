"""packed_row_gather on CUDA against its reference (an empty packed tensor included), and the row reads of
tests/integration/test_unpad_row_reads.py compiled on CUDA, with token buckets and CUDA graphs (the last
valid row, the recent rows, the target appended after the history and read alone).

Run on the GPU machine:  python -m pytest -q tests/gpu/test_packed_row_gather_gpu.py
"""

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from gemcompile import GemConfig, explain, gem_compile
from gemcompile.lowering.packed_row_gather import packed_row_gather, packed_row_gather_reference
from tests.compiled_vs_eager import assert_compiled_matches_eager
from tests.integration.test_unpad_row_reads import (READS_OF_KEPT_POSITIONS, AppendedTarget, B, D, LENGTHS, N, Last,
                                                   Recent, _history)


@pytest.mark.parametrize("total", [0, 1, 300])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_matches_the_reference_on_cuda(total, dtype):
    g = torch.Generator().manual_seed(total)
    packed = torch.randn(total, 2, 8, generator=g).to(dtype)
    rows = torch.randint(-1, max(total, 1), (40, 2, 8), generator=g) if total else torch.full((40, 2, 8), -1)
    want = packed_row_gather_reference(packed, rows)
    cuda_packed = packed.cuda().requires_grad_()
    got = packed_row_gather(cuda_packed, rows.cuda())
    assert torch.equal(got.cpu(), want)
    got.float().sum().backward()
    counts = torch.zeros(total, 2, 8)
    if total:
        counts.scatter_add_(0, rows.clamp(min=0), (rows >= 0).float())
    torch.testing.assert_close(cuda_packed.grad.float().cpu(), counts)


@pytest.mark.parametrize("model_type", [Recent, Last])
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_row_reads_compiled_on_cuda(model_type, mode):
    torch.manual_seed(0)
    model = model_type().cuda()
    config = GemConfig(unpad={"token_buckets": 3, "min_gemms": 1})
    compiled = gem_compile(model, config=config, mode=mode)
    for lengths in (LENGTHS, torch.zeros(B, dtype=torch.int64), torch.full((B,), N)):
        x = torch.randn(B, N, D, device="cuda")
        lengths = lengths.cuda()
        xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
        want = model(xe, lengths)
        got = compiled(xc, lengths)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
        want.square().sum().backward()
        got.square().sum().backward()
        torch.testing.assert_close(xc.grad, xe.grad, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("transformer", [False, True])
def test_an_appended_target_read_alone_packs_the_encoder_on_cuda(transformer):
    """BST's encoder (the target appended after the padded history, only ``out[:, -1]`` read) packed on CUDA."""
    torch._dynamo.reset()
    torch.set_float32_matmul_precision("highest")
    torch.manual_seed(0)
    model = AppendedTarget(READS_OF_KEPT_POSITIONS["last"], transformer).eval().cuda()
    inputs = [t.cuda() for t in _history()]
    config = GemConfig(unpad={"min_gemms": 1})
    gemms = [r.metrics["gemms"] for r in explain(model, *inputs, config=config).rewrites if r.pass_name == "unpad"]
    assert gemms == [4 if transformer else 3], gemms
    assert_compiled_matches_eager(model, *inputs, atol=1e-4, config=config)
