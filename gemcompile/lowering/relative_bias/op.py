"""gemcompile::relative_bias: a relative-position bias gathered from a learned table, with a gather-free
backward.

``out[i, j, ...] = table[j - i + offset, ...]`` for i < rows, j < cols: the Toeplitz bias of HSTU and
T5-style relative attention, which models write as ``table[arange(L)[None, :] - arange(L)[:, None] +
L - 1]``. The forward is that gather. Its autograd backward would be an index_put with accumulation: on
the H200 Inductor lowered it to atomic adds of L*L values into 2L-1 slots (199 us at L 1024; every slot
takes ~L adds, so they serialize), and eager PyTorch sorts the indices first.

Here the backward uses the structure instead: the pairs of one table slot are one diagonal of the
gradient. Padding each row with ``rows`` zeros on both sides and reading the padded rows with a row
stride one larger than their length turns the diagonals into columns (skew view); a column sum then gives
every slot at once. Plain torch ops (pad, as_strided, sum): deterministic, traced into the backward graph
under torch.compile, no atomics. Sums in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..common.opkit import direct_cuda

__all__ = ["positions_span", "relative_bias", "relative_bias_backward", "relative_bias_reference"]


def positions_span(rows: int, cols: int, offset: int) -> tuple[int, int]:
    """The first and last table rows that j - i + offset reads for i < rows, j < cols (rows, cols >= 1)."""
    return offset - (rows - 1), offset + cols - 1


def _check(table: Tensor, rows: int, cols: int, offset: int) -> None:
    if table.dim() < 1:
        raise ValueError("relative_bias: table must have at least one dim (the relative positions)")
    if rows < 0 or cols < 0:
        raise ValueError(f"relative_bias: rows and cols must be >= 0, got {rows} and {cols}")
    if rows and cols:
        lo, hi = positions_span(rows, cols, offset)
        if lo < 0 or hi >= table.shape[0]:
            raise ValueError(
                f"relative_bias: positions j - i + {offset} for i < {rows}, j < {cols} span [{lo}, {hi}], "
                f"outside a table of {table.shape[0]} rows"
            )


def relative_bias_reference(table: Tensor, rows: int, cols: int, offset: int) -> Tensor:
    """The gather itself: table[j - i + offset] for i < rows, j < cols -> (rows, cols, *table.shape[1:])."""
    _check(table, rows, cols, offset)
    idx = torch.arange(cols, device=table.device)[None, :] - torch.arange(rows, device=table.device)[:, None]
    return table[idx + offset]


def relative_bias_backward(grad: Tensor, table_rows: int, rows: int, cols: int, offset: int) -> Tensor:
    """d table from d out (rows, cols, *rest): slot d gets the sum of the diagonal j - i = d - offset."""
    rest = grad.shape[2:]
    if rows == 0 or cols == 0:
        return grad.new_zeros((table_rows, *rest))
    acc = torch.promote_types(grad.dtype, torch.float32)  # sums in fp32 at least
    g = grad.reshape(rows, cols, -1).permute(2, 0, 1).to(acc)  # (R, rows, cols)
    width = 2 * rows + cols
    padded = F.pad(g, (rows, rows)).contiguous()  # padded[r, i, rows + j] = g[r, i, j]
    n_rest = padded.shape[0]
    # skew view: element (r, i, c) is padded[r, i, c + i], so column c holds the diagonal j - i = c - rows
    skew = padded.as_strided((n_rest, rows, rows + cols), (rows * width, width + 1, 1))
    diagonals = skew.sum(1)[:, 1:]  # (R, rows + cols - 1): j - i from -(rows - 1) to cols - 1
    lo, _ = positions_span(rows, cols, offset)
    dtable = F.pad(diagonals, (lo, table_rows - lo - (rows + cols - 1)))  # (R, table_rows)
    return dtable.t().reshape(table_rows, *rest).to(grad.dtype)


@torch.library.custom_op("gemcompile::relative_bias", mutates_args=())
def relative_bias(table: Tensor, rows: int, cols: int, offset: int) -> Tensor:
    """out[i, j, ...] = table[j - i + offset, ...], (rows, cols, *table.shape[1:]); every slot read must
    lie in the table (ValueError otherwise: no wrap-around of negative positions)."""
    return relative_bias_reference(table, rows, cols, offset)


direct_cuda(relative_bias)  # CUDA calls skip register_kernel's wrapper (opkit.direct_cuda)


@relative_bias.register_fake
def _relative_bias_fake(table, rows, cols, offset):
    _check(table, rows, cols, offset)
    return table.new_empty((rows, cols, *table.shape[1:]))


def _setup(ctx, inputs, output):
    table, rows, cols, offset = inputs
    ctx.table_rows, ctx.rows, ctx.cols, ctx.offset = table.shape[0], rows, cols, offset


def _backward(ctx, grad):
    return relative_bias_backward(grad, ctx.table_rows, ctx.rows, ctx.cols, ctx.offset), None, None, None


relative_bias.register_autograd(_backward, setup_context=_setup)
