"""fill_slack_rows: rows before token_offsets[0] and from token_offsets[B] on take the value, every other row
keeps its bytes; under the Triton interpreter against the plain-PyTorch reference, on shapes where the slack
is empty, the whole tensor, or a part that ends off the kernel's block, with offsets from 0 and past 0."""

import os

import pytest
import torch

from gemcompile.lowering.common.slack_rows_triton import fill_slack_rows, fill_slack_rows_reference

pytestmark = pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
                                reason="interpreter test: runs on a machine without CUDA")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T, last, row", [(10, 7, (3, 4)), (10, 10, (3, 4)), (10, 0, (2,)), (1, 0, ()),
                                          (3000, 5, (2,)), (777, 700, (5, 3))])
@pytest.mark.parametrize("value", [0.0, float("inf")])
@pytest.mark.parametrize("first", ["zero", "past zero"])
def test_fill_slack_rows(dtype, T, last, row, value, first):
    g = torch.Generator().manual_seed(T + last)
    x = torch.randn(T, *row, generator=g).to(dtype)
    start = 0 if first == "zero" else last // 4 + (last > 0)
    offsets = torch.tensor([start, max(last // 3, start), last])
    want = fill_slack_rows_reference(offsets, x, value)
    fill_slack_rows(offsets, (x, value))
    assert torch.equal(x, want)
    if start:  # the head rows were filled, the first sequence's first row kept
        assert torch.equal(x[:start], torch.full_like(x[:start], value)) and torch.equal(x[start], want[start])


def test_several_tensors_and_empty_ones():
    offsets = torch.tensor([0, 2, 4], dtype=torch.int32)
    a, b, empty = torch.ones(6, 2, 3), torch.ones(6, 2), torch.ones(0, 4)
    fill_slack_rows(offsets, (a, 0.0), (b, float("inf")), (empty, 0.0))
    assert (a[:4] == 1).all() and (a[4:] == 0).all()
    assert (b[:4] == 1).all() and torch.isposinf(b[4:]).all()
    c = torch.ones(6, 2)
    fill_slack_rows(torch.tensor([1, 3, 5]), (c, 0.0))
    assert (c[0] == 0).all() and (c[1:5] == 1).all() and (c[5] == 0).all()


def test_offsets_outside_the_rows_write_nothing_outside_x():
    """Unchecked bad offsets (negative, past T) stay inside x: all rows, or none."""
    base = torch.ones(3, 4, 2)
    fill_slack_rows(torch.tensor([0, -5]), (base[1], 0.0))  # x is the middle third of base
    assert (base[0] == 1).all() and (base[1] == 0).all() and (base[2] == 1).all()
    fill_slack_rows(torch.tensor([0, 9]), (base[2], 0.0))
    assert (base[2] == 1).all()


def test_non_contiguous_is_refused():
    x = torch.ones(4, 6)[:, ::2]
    with pytest.raises(ValueError, match="contiguous"):
        fill_slack_rows(torch.tensor([0, 2]), (x, 0.0))
