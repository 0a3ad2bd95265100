"""gemcompile::packed_row_gather against its element-by-element reference, forward and backward."""

import pytest
import torch

from gemcompile.lowering.packed_row_gather import packed_row_gather, packed_row_gather_reference


def _rows(total: int, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-1, max(total, 1), shape, generator=g) if total else torch.full(shape, -1)


@pytest.mark.parametrize("total", [0, 1, 7])
@pytest.mark.parametrize("rows_shape,packed_tail", [((5,), ()), ((4, 3), (3,)), ((6, 2), (5,)),
                                                    ((3, 2, 4), (2, 4)), ((0, 3), (3,))])
def test_matches_the_reference_forward_and_backward(total, rows_shape, packed_tail):
    packed = torch.randn(total, *packed_tail, dtype=torch.float64, requires_grad=True)
    rows = _rows(total, rows_shape, seed=total + len(rows_shape))
    out = packed_row_gather(packed, rows)
    torch.testing.assert_close(out, packed_row_gather_reference(packed.detach(), rows), rtol=0, atol=0)
    grad = torch.randn_like(out)
    (dpacked,) = torch.autograd.grad(out, packed, grad, allow_unused=True, materialize_grads=True)
    ref = packed.detach().clone().requires_grad_()
    # (+ 0 * sum: an output that reads no row still depends on packed, with a zero gradient)
    loss = (packed_row_gather_reference(ref, rows) * grad).sum() + 0 * ref.sum()
    (dref,) = torch.autograd.grad(loss, ref)
    torch.testing.assert_close(dpacked, dref)


def test_rows_read_twice_get_both_gradients_and_minus_one_reads_zero():
    packed = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float64, requires_grad=True)
    rows = torch.tensor([[1, 1], [1, -1], [-1, 0]])
    out = packed_row_gather(packed, rows)
    assert out.tolist() == [[3.0, 4.0], [3.0, 0.0], [0.0, 2.0]]
    out.sum().backward()
    assert packed.grad.tolist() == [[0.0, 1.0], [2.0, 1.0]]


def test_gradcheck_and_opcheck():
    packed = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    rows = _rows(6, (5, 3), seed=3)
    assert torch.autograd.gradcheck(packed_row_gather, (packed, rows))
    torch.library.opcheck(torch.ops.gemcompile.packed_row_gather.default, (packed, rows))
    empty_rows = torch.full((2, 4), -1, dtype=torch.int64)
    torch.library.opcheck(torch.ops.gemcompile.packed_row_gather.default, (torch.zeros(0, 4), empty_rows))


@pytest.mark.parametrize("packed,rows,error", [
    (torch.zeros(3, 2), torch.zeros(2, 2, dtype=torch.int32), TypeError),  # rows not int64
    (torch.zeros(3, 2), torch.zeros(2, dtype=torch.int64), ValueError),  # rank differs
    (torch.zeros(3, 2), torch.zeros(2, 3, dtype=torch.int64), ValueError),  # wider than packed
])
def test_bad_rows_are_refused(packed, rows, error):
    with pytest.raises(error, match="packed_row_gather"):
        packed_row_gather(packed, rows)
