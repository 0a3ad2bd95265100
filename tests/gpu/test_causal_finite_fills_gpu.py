"""Causal finite fills on the GPU kernels (tests/integration/test_causal_finite_fills.py): rows that see no
valid key, computed by the second call over every key, equal eager on every row and gradient (float32,
3xTF32 dots).

Run on the GPU machine:  python -m pytest -q tests/gpu/test_causal_finite_fills_gpu.py
"""

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from tests.integration.test_causal_finite_fills import FILLS, SPELLINGS, _check  # noqa: E402


@pytest.mark.parametrize("layout", ["left", "holes"])
@pytest.mark.parametrize("fill_name", list(FILLS))
@pytest.mark.parametrize("spelling", SPELLINGS)
def test_rows_that_see_no_valid_key_equal_eager_on_the_gpu(spelling, fill_name, layout):
    torch.set_float32_matmul_precision("highest")
    _check(spelling, fill_name, layout, seed=3, device="cuda")
