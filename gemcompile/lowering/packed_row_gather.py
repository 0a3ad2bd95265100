"""gemcompile::packed_row_gather: read rows of packed tokens by row number, -1 reading zeros.

The unpad pass runs a padded model's token-wise region on packed (T, ...) rows and scatters a value back to
(B, N, ...) where something outside the region reads it. When that reader only picks a few rows (the last
valid token of each sequence, the most recent k, position 0), the scatter writes B x N rows to read B x k.
This op reads them from the packed rows instead (passes/unpad_row_reads.py builds ``rows``):

    out[r, f...] = packed[rows[r, f...], f...]   where rows[r, f...] >= 0, else 0

``packed`` is (T, *F), ``rows`` int64 (R, *F') with F' no larger than F dim by dim (torch.gather's rule),
every entry in [-1, T). -1 marks a padded position: the scattered tensor holds 0 there, and so does out.
The gradient adds each read row's gradient into its packed row (rows read twice get both).

Why an op rather than ``packed.gather(0, rows.clamp(min=0))`` in the graph: with T = 0 (every sequence
empty in the batch, or an empty token bucket) there is no row 0 to read, and a CUDA gather out of range is
a device-side assert. Here T = 0 returns zeros (forward) and an empty gradient (backward); the branch
reads shapes only, never data, so it costs no host sync.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch import Tensor

from .common.opkit import direct_cuda

__all__ = ["packed_row_gather", "packed_row_gather_reference"]


def _check(packed: Tensor, rows: Tensor) -> None:
    if rows.dtype != torch.int64:
        raise TypeError(f"packed_row_gather: rows must be int64, got {rows.dtype}")
    if packed.dim() < 1 or rows.dim() != packed.dim():
        raise ValueError(f"packed_row_gather: rows must have packed's rank (R, *F'), got packed "
                         f"{tuple(packed.shape)} and rows {tuple(rows.shape)}")
    if any(r > p for r, p in zip(rows.shape[1:], packed.shape[1:])):
        raise ValueError(f"packed_row_gather: rows {tuple(rows.shape)} is larger than packed "
                         f"{tuple(packed.shape)} in a trailing dim")


def packed_row_gather_reference(packed: Tensor, rows: Tensor) -> Tensor:
    """The op's meaning, one element at a time (tests): out[r, f] = packed[rows[r, f], f], 0 where
    rows < 0."""
    _check(packed, rows)
    out = packed.new_zeros(rows.shape)
    for position in itertools.product(*map(range, rows.shape)):
        row = int(rows[position])
        if row >= 0:
            out[position] = packed[(row, *position[1:])]
    return out


@torch.library.custom_op("gemcompile::packed_row_gather", mutates_args=())
def packed_row_gather(packed: Tensor, rows: Tensor) -> Tensor:
    """out = packed.gather(0, rows) where rows >= 0, else 0 (module doc); rows in [-1, T)."""
    _check(packed, rows)
    if packed.shape[0] == 0 or rows.numel() == 0:
        return packed.new_zeros(rows.shape)
    read = packed.gather(0, rows.clamp(min=0))
    return read.masked_fill(rows < 0, 0)


direct_cuda(packed_row_gather)  # CUDA calls skip register_kernel's wrapper (opkit.direct_cuda)


@packed_row_gather.register_fake
def _packed_row_gather_fake(packed: Tensor, rows: Tensor) -> Tensor:
    _check(packed, rows)
    return packed.new_empty(rows.shape)


@torch.library.custom_op("gemcompile::packed_row_gather_backward", mutates_args=())
def packed_row_gather_backward(grad: Tensor, rows: Tensor, packed_shape: Sequence[int]) -> Tensor:
    """d packed: each read row's gradient added into its packed row; rows -1 contribute nothing."""
    dpacked = grad.new_zeros(packed_shape)
    if dpacked.shape[0] == 0 or rows.numel() == 0:
        return dpacked
    return dpacked.scatter_add(0, rows.clamp(min=0), grad.masked_fill(rows < 0, 0))


direct_cuda(packed_row_gather_backward)


@packed_row_gather_backward.register_fake
def _packed_row_gather_backward_fake(grad: Tensor, rows: Tensor, packed_shape: Sequence[int]) -> Tensor:
    return grad.new_empty(packed_shape)


def _setup(ctx, inputs, output):
    packed, rows = inputs
    ctx.save_for_backward(rows)
    ctx.packed_shape = tuple(packed.shape)


def _backward(ctx, grad):
    (rows,) = ctx.saved_tensors
    return packed_row_gather_backward(grad.contiguous(), rows, ctx.packed_shape), None


packed_row_gather.register_autograd(_backward, setup_context=_setup)
