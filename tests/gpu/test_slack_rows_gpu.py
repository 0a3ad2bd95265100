"""fill_slack_rows on CUDA: the rows from token_offsets[B] on take the value, the others keep their bytes
(tests/unit/test_slack_rows_triton.py does the same under the interpreter).

Run on the GPU machine:  python -m pytest -q tests/gpu/test_slack_rows_gpu.py
"""

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from gemcompile.lowering.common.slack_rows_triton import fill_slack_rows, fill_slack_rows_reference


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T, last, row", [(131072, 120000, (4, 64)), (131072, 131072, (4, 64)), (5000, 0, (4,)),
                                          (333, 17, (3, 5))])
@pytest.mark.parametrize("value", [0.0, float("inf")])
def test_fill_slack_rows_on_cuda(dtype, T, last, row, value):
    x = torch.randn(T, *row, device="cuda").to(dtype)
    offsets = torch.tensor([0, last // 2, last], device="cuda", dtype=torch.int32)
    want = fill_slack_rows_reference(offsets, x, value)
    fill_slack_rows(offsets, (x, value))
    assert torch.equal(x, want)
