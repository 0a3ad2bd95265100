"""GemConfig.memory.fp8_saved on CUDA: Inductor compiles the quantize / dequantize into Triton kernels, and the
weight gradients must still equal the eager reference (dW = dy^T fake_quantize(x)). Bit for bit for the FP8
copy itself; for the whole step within bf16 GEMM rounding (cuBLAS may order the sums differently in the
compiled and the eager graph), and the FP8 tensor really crosses into the backward.

Run on the GPU machine:  python -m pytest -q tests/gpu/test_fp8_saved_gpu.py
"""

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from gemcompile import GemConfig  # noqa: E402
from gemcompile.backend import GemBackend  # noqa: E402
from gemcompile.passes import fp8_saved  # noqa: E402
from gemcompile.passes.activation_memory import has_partitioner_slot  # noqa: E402
from tests.integration.test_fp8_saved_activations import D, SHAPE, Residual  # noqa: E402


def test_fake_quantize_on_cuda_equals_cpu_bit_for_bit():
    torch.manual_seed(0)
    x = torch.randn(512, 384) * torch.logspace(-20, 20, 512)[:, None]
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        assert torch.equal(fp8_saved.fake_quantize(xd.cuda()).cpu(), fp8_saved.fake_quantize(xd))


def test_compiled_step_on_cuda_reads_the_fp8_copy_for_the_weight_gradient():
    if not has_partitioner_slot():
        pytest.skip("this torch's Inductor has no custom_partitioner_fn")
    torch.manual_seed(0)
    model = Residual().to("cuda", torch.bfloat16)
    x = torch.randn(SHAPE, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    backend = GemBackend(GemConfig(memory={"fp8_saved": ("b",)}))
    out = torch.compile(model, backend=backend)(x)
    grads = torch.autograd.grad(out, [x, *model.parameters()])
    torch._dynamo.reset()
    (record,) = backend.last_log.memory
    (data,) = [t for t in record.tensors if t.dtype_before]
    assert (data.dtype, data.dtype_before, data.nbytes) == ("float8_e4m3fn", "bfloat16", 256 * D)
    model.reference = True
    want = model(x)
    want_grads = torch.autograd.grad(want, [x, *model.parameters()])
    model.reference = False
    plain_grads = torch.autograd.grad(model(x), [x, *model.parameters()])
    torch.testing.assert_close(out, want, rtol=2e-2, atol=1e-2)
    names = ["x", *(n for n, _ in model.named_parameters())]
    for name, got, expected, plain in zip(names, grads, want_grads, plain_grads):
        torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2 * expected.abs().max().item())
        if name == "b.weight":  # the FP8 copy changed it: closer to the fake-quantized reference than to exact
            assert (got.float() - expected.float()).norm() < (got.float() - plain.float()).norm()
