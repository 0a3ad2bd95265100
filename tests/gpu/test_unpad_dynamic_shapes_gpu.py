"""Unpad under dynamic shapes on CUDA, through gem_compile itself (Inductor with symbolic B and N and the
unbacked token count, the Triton kernels, float32 with full-precision dots): the models of
tests/integration/test_unpad_dynamic_shapes.py, three batch sizes and padded lengths, two compiles, both packed,
outputs and gradients against eager.

Run on the GPU machine:  python -m pytest -q tests/gpu/test_unpad_dynamic_shapes_gpu.py
"""

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from gemcompile import gem_compile  # noqa: E402
from gemcompile.backend import GemBackend  # noqa: E402
from tests.integration.test_unpad_dynamic_shapes import MODELS, check_dynamic_unpad  # noqa: E402


@pytest.mark.parametrize("name", list(MODELS))
def test_the_dynamic_recompile_runs_packed_on_the_gpu(name, monkeypatch):
    torch.set_float32_matmul_precision("highest")

    def compile_with(model, compiles):
        original = GemBackend.__call__
        monkeypatch.setattr(GemBackend, "__call__",
                            lambda self, *a, **kw: compiles.append(1) or original(self, *a, **kw))
        return gem_compile(model)

    check_dynamic_unpad(name, device="cuda", compile_with=compile_with)
