"""gemcompile::sparse_embedding: an nn.Embedding / nn.EmbeddingBag (sum, mean) lookup whose backward produces
no (rows x dim) gradient.

Forward: the table's own kernels (F.embedding / F.embedding_bag), so outputs are bit for bit the module's.
Backward: ``gemcompile::file_row_grads_`` turns the output gradient into one gradient row per looked-up id
(a bag's rows get their bag's gradient, divided by its size for mean) and files (ids, rows) in pending.py
under the table's key; the table's weight gets no ``.grad``. The sparse optimizer
(runtime/tables/sparse_adagrad.py) reads and writes only those rows at ``step()``.

The filing op mutates a one-element ``token`` (a counter of filed lookups, a buffer of the table's module):
an op that returns nothing and mutates nothing would be dead code to AOTAutograd and Inductor. Mutating
a forward input from the backward is supported by AOTAutograd and Inductor leaves it in place (no copy).
The token is kept on ``ctx``, not saved for backward: a table looked up twice in one step bumps it in the
first lookup's backward, and a saved tensor's version check would then fail in the second's.

Padding ids (``padding_idx``) get no gradient, as in the modules; their ids are filed as -1.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..common.opkit import direct_cuda
from .pending import file_rows

__all__ = ["MODE_LOOKUP", "MODE_MEAN", "MODE_SUM", "per_id_grads", "sparse_embedding"]

MODE_LOOKUP, MODE_SUM, MODE_MEAN = 0, 1, 2
"""nn.Embedding, nn.EmbeddingBag(mode="sum"), nn.EmbeddingBag(mode="mean")."""
_BAG_MODES = {MODE_SUM: "sum", MODE_MEAN: "mean"}


def _check(ids: Tensor, weight: Tensor, offsets: Optional[Tensor], mode: int) -> None:
    if weight.dim() != 2:
        raise ValueError(f"sparse_embedding: weight must be (rows, dim), got {tuple(weight.shape)}")
    if ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"sparse_embedding: ids must be int32 or int64, got {ids.dtype}")
    if mode not in (MODE_LOOKUP, MODE_SUM, MODE_MEAN):
        raise ValueError(f"sparse_embedding: unknown mode {mode}")
    if mode != MODE_LOOKUP:
        if offsets is None and ids.dim() != 2:
            raise ValueError(f"sparse_embedding: a bag lookup takes 2-D ids (bags, ids per bag) or 1-D ids with "
                             f"offsets, got ids of shape {tuple(ids.shape)} and no offsets")
        if offsets is not None and (ids.dim() != 1 or offsets.dim() != 1):
            raise ValueError("sparse_embedding: with offsets, ids and offsets must both be 1-D")


@torch.library.custom_op("gemcompile::sparse_embedding", mutates_args=())
def _sparse_embedding(ids: Tensor, weight: Tensor, offsets: Optional[Tensor], token: Tensor, mode: int,
                      padding_idx: int, table: int) -> Tensor:
    padding = padding_idx if padding_idx >= 0 else None
    if mode == MODE_LOOKUP:
        return F.embedding(ids, weight, padding)
    return F.embedding_bag(ids, weight, offsets, mode=_BAG_MODES[mode], padding_idx=padding)


direct_cuda(_sparse_embedding)  # CUDA calls skip register_kernel's wrapper (opkit.direct_cuda)


@_sparse_embedding.register_fake
def _sparse_embedding_fake(ids, weight, offsets, token, mode, padding_idx, table):
    if mode == MODE_LOOKUP:
        return weight.new_empty((*ids.shape, weight.shape[1]))
    bags = ids.shape[0] if offsets is None else offsets.shape[0]
    return weight.new_empty((bags, weight.shape[1]))


def _bag_of_ids(ids: Tensor, offsets: Optional[Tensor]) -> Tensor:
    """The bag index of every id of a bag lookup, flat."""
    if offsets is None:  # (bags, ids per bag)
        per_bag = ids.shape[1]
        return torch.arange(ids.numel(), device=ids.device) // max(per_bag, 1)
    positions = torch.arange(ids.numel(), device=ids.device, dtype=offsets.dtype)
    return torch.searchsorted(offsets, positions, right=True) - 1


def per_id_grads(grad: Tensor, ids: Tensor, offsets: Optional[Tensor], mode: int,
                 padding_idx: int) -> tuple[Tensor, Tensor]:
    """(ids (n,) int64 with padding ids as -1, gradient rows (n, dim)): the gradient each looked-up id
    contributes to its table row. Fresh tensors, never views of `grad` or `ids`."""
    flat = ids.reshape(-1).to(torch.int64, copy=True)
    pad = flat == padding_idx if padding_idx >= 0 else None
    dim = grad.shape[-1]
    if mode == MODE_LOOKUP:
        rows = grad.reshape(-1, dim).clone()
    else:
        bag = _bag_of_ids(ids, offsets)
        rows = grad.index_select(0, bag)
        if mode == MODE_MEAN:  # every id of a bag of k (non-padding) ids got out / k
            real = torch.ones_like(flat) if pad is None else (~pad).to(torch.int64)
            size = torch.zeros(grad.shape[0], dtype=torch.int64, device=grad.device).index_add_(0, bag, real)
            rows = rows / size.clamp(min=1).index_select(0, bag).to(rows.dtype)[:, None]
    if pad is not None:
        flat = torch.where(pad, -1, flat)
    return flat, rows


# cudagraph_unsafe: the filing is a host-side effect that a CUDA-graph replay would skip (Inductor keeps the
# op out of its graphs)
@torch.library.custom_op("gemcompile::file_row_grads_", mutates_args=("token",), tags=(torch.Tag.cudagraph_unsafe,))
def _file_row_grads_(token: Tensor, grad: Tensor, ids: Tensor, offsets: Optional[Tensor], lookup: int,
                     padding_idx: int, table: int) -> None:
    # (`lookup` is the mode: auto_functionalized takes a keyword argument named `mode` itself)
    flat, rows = per_id_grads(grad, ids, offsets, lookup, padding_idx)
    file_rows(table, flat, rows)
    token.add_(1)


@_file_row_grads_.register_fake
def _file_row_grads_fake(token, grad, ids, offsets, lookup, padding_idx, table) -> None:
    return None


def _setup_context(ctx, inputs, output) -> None:
    ids, weight, offsets, token, mode, padding_idx, table = inputs
    ctx.save_for_backward(ids, offsets)
    ctx.token = token
    ctx.args = (mode, padding_idx, table)


def _backward(ctx, grad):
    ids, offsets = ctx.saved_tensors
    mode, padding_idx, table = ctx.args
    _file_row_grads_(ctx.token, grad.contiguous(), ids, offsets, mode, padding_idx, table)
    return None, None, None, None, None, None, None


_sparse_embedding.register_autograd(_backward, setup_context=_setup_context)


def sparse_embedding(ids: Tensor, weight: Tensor, offsets: Optional[Tensor], token: Tensor, mode: int,
                     padding_idx: int | None, table: int) -> Tensor:
    """Look `ids` up in `weight` like nn.Embedding (mode MODE_LOOKUP) or nn.EmbeddingBag (MODE_SUM,
    MODE_MEAN; 2-D ids, or 1-D ids with offsets); the backward files the rows' gradients under `table`
    (pending.py) instead of giving `weight` a gradient."""
    _check(ids, weight, offsets, mode)
    return _sparse_embedding(ids, weight, offsets, token, mode, -1 if padding_idx is None else padding_idx, table)
