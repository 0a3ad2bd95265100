"""The attention kernels' batch order (lowering/common/length_order_triton.py) under the Triton interpreter: a
stable descending argsort of the lengths, against torch.sort."""

import os

import pytest
import torch

if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("interpreter tests: run on a machine without CUDA (conftest sets TRITON_INTERPRET=1)",
                allow_module_level=True)
pytest.importorskip("triton")

from gemcompile.lowering.common.length_order_triton import longest_first_order


@pytest.mark.parametrize("B", [1, 2, 15, 16, 17, 50])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_stable_descending_argsort(B, dtype):
    key = torch.randint(0, 5, (B,), generator=torch.Generator().manual_seed(B)).to(dtype)  # many ties
    got = longest_first_order(key)
    assert got.dtype == torch.int64
    assert torch.equal(got, torch.sort(key, descending=True, stable=True).indices)


def test_empty_and_bad_keys():
    assert longest_first_order(torch.zeros(0, dtype=torch.int64)).numel() == 0
    assert torch.equal(longest_first_order(torch.tensor([0, 0, 7, 0])), torch.tensor([2, 0, 1, 3]))
    with pytest.raises(ValueError, match="1-D int32/int64"):
        longest_first_order(torch.ones(3))
