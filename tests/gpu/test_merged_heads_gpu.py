"""Attention on merged batch and heads around bmm (tests/integration/test_merged_heads.py: fairseq, DeBERTa,
single-head pooling, ALiBi) on CUDA: rewritten to the jagged op and run by its Triton kernels (float32,
3xTF32 dots), outputs and every gradient against eager.

Run on the GPU machine:  python -m pytest -q tests/gpu/test_merged_heads_gpu.py
"""

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from tests.integration.test_merged_heads import MODELS, _check  # noqa: E402


@pytest.mark.parametrize("name", list(MODELS))
def test_merged_heads_on_the_gpu_kernels_equal_eager(name):
    torch.set_float32_matmul_precision("highest")
    _check(name, device="cuda")
