"""Attention recompiled with dynamic shapes keeps its rewrite on CUDA, and unpad packs the dynamic graph, through
gem_compile itself (Inductor with symbolic B and N and the unbacked token count, the Triton kernels, float32
with full-precision dots): the models of tests/integration/test_dynamic_shape_attention.py and
test_unpad_dynamic_shapes.py, three batch sizes and padded lengths, outputs and gradients against eager.

Run on the GPU machine:  python -m pytest -q tests/gpu/test_dynamic_shape_attention_gpu.py
"""

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from tests.integration.test_dynamic_shape_attention import MODELS, check_dynamic_recompile  # noqa: E402
from tests.integration.test_unpad_dynamic_shapes import MODELS as UNPAD_MODELS  # noqa: E402
from tests.integration.test_unpad_dynamic_shapes import check_dynamic_unpad  # noqa: E402
from tests.rewritten import counting_gem_compile  # noqa: E402


@pytest.mark.parametrize("name", list(MODELS))
def test_the_dynamic_recompile_keeps_the_rewrite_on_the_gpu(name, monkeypatch):
    torch.set_float32_matmul_precision("highest")
    check_dynamic_recompile(name, device="cuda", compile_with=counting_gem_compile(monkeypatch))


@pytest.mark.parametrize("name", list(UNPAD_MODELS))
def test_the_dynamic_recompile_runs_packed_on_the_gpu(name, monkeypatch):
    torch.set_float32_matmul_precision("highest")
    check_dynamic_unpad(name, device="cuda", compile_with=counting_gem_compile(monkeypatch))
