"""Attention recompiled with dynamic shapes keeps its rewrite on CUDA, through gem_compile itself (Inductor
and the Triton kernels, float32 with 3xTF32 dots): tests/integration/test_dynamic_shape_attention.py's
models, three batch sizes and padded lengths, outputs and gradients against eager.

Run on the GPU machine:  python -m pytest -q tests/gpu/test_dynamic_shape_attention_gpu.py
"""

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from gemcompile import gem_compile  # noqa: E402
from gemcompile.backend import GemBackend  # noqa: E402
from tests.integration.test_dynamic_shape_attention import MODELS, check_dynamic_recompile  # noqa: E402


@pytest.mark.parametrize("name", list(MODELS))
def test_the_dynamic_recompile_keeps_the_rewrite_on_the_gpu(name, monkeypatch):
    torch.set_float32_matmul_precision("highest")

    def compile_with(model, compiles):
        original = GemBackend.__call__
        monkeypatch.setattr(GemBackend, "__call__",
                            lambda self, *a, **kw: compiles.append(1) or original(self, *a, **kw))
        return gem_compile(model)

    check_dynamic_recompile(name, device="cuda", compile_with=compile_with)
