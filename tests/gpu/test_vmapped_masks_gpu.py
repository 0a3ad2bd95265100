"""Masks built under torch.vmap (tests/integration/test_vmapped_masks.py) on CUDA: the lowering's broadcast
ops and the Triton kernels on the GPU (float32, 3xTF32 dots), outputs and q, k, v gradients against eager.

Run on the GPU machine:  python -m pytest -q tests/gpu/test_vmapped_masks_gpu.py
"""

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from gemcompile import explain, gem_compile  # noqa: E402
from tests.integration.test_vmapped_masks import HfStyleAttention, _inputs  # noqa: E402


@pytest.mark.parametrize("causal, fill, left", [(True, None, False), (False, None, False),
                                                (True, torch.finfo(torch.float32).min, True)])
def test_vmapped_mask_on_the_gpu_kernels_equals_eager(causal, fill, left):
    torch.set_float32_matmul_precision("highest")
    model = HfStyleAttention(causal, fill)
    q, k, v, mask = (t.detach().cuda().requires_grad_(t.requires_grad) for t in _inputs(left=left))
    report = explain(model, q, k, v, mask)
    assert report.counts["jagged_attention"] == 1, [r.reason for r in report.refusals]
    out, ref = gem_compile(model)(q, k, v, mask), model(q, k, v, mask)
    valid = mask.bool()[:, None, :, None]  # rows with a valid key (left padding: a valid row sees itself)
    torch.testing.assert_close(out * valid, ref * valid, atol=1e-4, rtol=1e-3)
    grads = torch.autograd.grad((out * valid).square().sum(), (q, k, v))
    grads_ref = torch.autograd.grad((ref * valid).square().sum(), (q, k, v))
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref, atol=1e-4, rtol=1e-3)
