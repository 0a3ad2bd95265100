"""The real-model zoo (tests/integration/test_real_model_masks.py), the merged-heads models around bmm
(tests/integration/test_merged_heads.py: fairseq, DeBERTa, single-head pooling, ALiBi) and the gdpa pass's
idioms (tests/integration/test_gdpa_pass.py: HSTU, fills before the activation, PMA, windows, ...) on CUDA:
each model's attention rewritten and run by the Triton kernels on the GPU (float32, 3xTF32 dots), outputs and
every gradient against eager. The gdpa idioms build their masks with ``torch.arange`` on the default device,
so they run under ``torch.device("cuda")``.

Run on the GPU machine:  python -m pytest -q tests/gpu/test_real_model_masks_gpu.py
"""

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from tests.integration import test_merged_heads as merged  # noqa: E402
from tests.integration.test_gdpa_pass import IDIOMS, check_idiom  # noqa: E402
from tests.integration.test_real_model_masks import MODELS, _check_against_eager  # noqa: E402


@pytest.mark.parametrize("name", list(MODELS))
def test_model_on_the_gpu_kernels_equals_eager(name):
    torch.set_float32_matmul_precision("highest")  # eager fp32 matmuls stay fp32; the kernels use 3xTF32
    _check_against_eager(name, seed=3, device="cuda")


@pytest.mark.parametrize("name", list(merged.MODELS))
def test_merged_heads_on_the_gpu_kernels_equal_eager(name):
    torch.set_float32_matmul_precision("highest")
    merged._check(name, device="cuda")


@pytest.mark.parametrize("name", list(IDIOMS))
def test_gdpa_idiom_on_the_gpu_kernels_equals_eager(name):
    torch._dynamo.reset()
    torch.set_float32_matmul_precision("highest")
    with torch.device("cuda"):
        check_idiom(name, device="cuda", atol=1e-4)
