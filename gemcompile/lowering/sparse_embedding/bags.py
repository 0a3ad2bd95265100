"""gemcompile::sparse_embedding_bags: the lookups of many sparsely trained embedding-bag tables as one op.

A ranking model looks up tens to hundreds of sparse features, one nn.EmbeddingBag each. Looked up one by
one, every table costs its own forward launches, backward launches and Python calls (GEM-ref medium: 64
tables, over a thousand small kernels a step). passes/table_batching.py turns the sparse_embedding calls
of tables that share a mode, a dim, a dtype, a padding id and an ids shape into one call of this op:

- forward: ``ids`` (tables, bags, hot) stacked, ``weights`` the tables' own (separate) weights; one
  launch on CUDA (bags_triton.py), each table's F.embedding_bag elsewhere; out (tables, bags, dim).
- backward: ``gemcompile::file_bag_row_grads_`` computes every table's gradient rows in one go (a bag's
  rows get its gradient, over the bag's size for mean; padding ids filed as -1) and files each table's
  share under its key (pending.py), as sparse_embedding's backward does table by table. The one ``token``
  it bumps keeps it alive in compiled graphs (see op.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..common.opkit import direct_cuda
from .op import MODE_MEAN, MODE_SUM
from .pending import file_rows

__all__ = ["bag_row_grads", "sparse_embedding_bags"]


def _check(ids: Tensor, weights: list[Tensor], mode: int, tables: list[int]) -> None:
    if mode not in (MODE_SUM, MODE_MEAN):
        raise ValueError(f"sparse_embedding_bags: mode must be sum ({MODE_SUM}) or mean ({MODE_MEAN}), got {mode}")
    if ids.dim() != 3 or ids.shape[0] != len(weights) or len(tables) != len(weights) or not weights:
        raise ValueError(f"sparse_embedding_bags: ids must be (tables, bags, hot) with one weight and one key per "
                         f"table, got ids {tuple(ids.shape)}, {len(weights)} weights, {len(tables)} keys")
    if ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"sparse_embedding_bags: ids must be int32 or int64, got {ids.dtype}")
    first = weights[0]
    for w in weights:
        if w.dim() != 2 or w.shape[1] != first.shape[1] or w.dtype != first.dtype or w.device != first.device:
            raise ValueError("sparse_embedding_bags: the weights must be (rows, dim) tables of one dim, dtype "
                             f"and device, got {[(tuple(w.shape), w.dtype, str(w.device)) for w in weights]}")


def _use_triton(ids: Tensor, weights: list[Tensor]) -> bool:
    return (ids.device.type == "cuda" and all(w.stride(1) == 1 for w in weights)
            and weights[0].dtype in (torch.float32, torch.bfloat16, torch.float16))


@torch.library.custom_op("gemcompile::sparse_embedding_bags", mutates_args=())
def _sparse_embedding_bags(ids: Tensor, weights: list[Tensor], token: Tensor, mode: int, padding_idx: int,
                           tables: list[int]) -> Tensor:
    if _use_triton(ids, weights):
        from .bags_triton import embedding_bags_triton

        return embedding_bags_triton(ids, weights, mode == MODE_MEAN, padding_idx)
    padding = padding_idx if padding_idx >= 0 else None
    bag_mode = "mean" if mode == MODE_MEAN else "sum"
    return torch.stack([F.embedding_bag(ids[t], w, mode=bag_mode, padding_idx=padding)
                        for t, w in enumerate(weights)])


direct_cuda(_sparse_embedding_bags)  # CUDA calls skip register_kernel's wrapper (opkit.direct_cuda)


@_sparse_embedding_bags.register_fake
def _sparse_embedding_bags_fake(ids, weights, token, mode, padding_idx, tables):
    return weights[0].new_empty((ids.shape[0], ids.shape[1], weights[0].shape[1]))


def bag_row_grads(grad: Tensor, ids: Tensor, mode: int, padding_idx: int) -> tuple[Tensor, Tensor]:
    """(ids (tables, bags * hot) int64 with padding ids as -1, gradient rows (tables, bags * hot, dim)):
    what each looked-up id adds to its table row, every table at once. Fresh tensors."""
    tables, bags, hot = ids.shape
    dim = grad.shape[-1]
    flat = ids.to(torch.int64, copy=True)
    pad = flat == padding_idx if padding_idx >= 0 else None
    per_bag = grad
    if mode == MODE_MEAN:  # every id of a bag of k (non-padding) ids got out / k
        size = (~pad).sum(-1).clamp(min=1).to(grad.dtype)[:, :, None] if pad is not None else max(hot, 1)
        per_bag = grad / size
    rows = torch.empty((tables, bags * hot, dim), dtype=grad.dtype, device=grad.device)
    rows.view(tables, bags, hot, dim).copy_(per_bag[:, :, None, :].expand(tables, bags, hot, dim))
    if pad is not None:
        flat.masked_fill_(pad, -1)
    return flat.reshape(tables, bags * hot), rows


# cudagraph_unsafe: the filing is a host-side effect that a CUDA-graph replay would skip (Inductor keeps the
# op out of its graphs)
@torch.library.custom_op("gemcompile::file_bag_row_grads_", mutates_args=("token",), tags=(torch.Tag.cudagraph_unsafe,))
def _file_bag_row_grads_(token: Tensor, grad: Tensor, ids: Tensor, lookup: int, padding_idx: int,
                         tables: list[int]) -> None:
    flat, rows = bag_row_grads(grad, ids, lookup, padding_idx)
    for t, table in enumerate(tables):  # views of one fresh pair: each table files its own share
        file_rows(table, flat[t], rows[t], share=(flat, rows, t))
    token.add_(1)


@_file_bag_row_grads_.register_fake
def _file_bag_row_grads_fake(token, grad, ids, lookup, padding_idx, tables) -> None:
    return None


def _setup_context(ctx, inputs, output) -> None:
    ids, weights, token, mode, padding_idx, tables = inputs
    ctx.save_for_backward(ids)
    ctx.token = token
    ctx.args = (mode, padding_idx, tables)
    ctx.n_weights = len(weights)


def _backward(ctx, grad):
    (ids,) = ctx.saved_tensors
    mode, padding_idx, tables = ctx.args
    _file_bag_row_grads_(ctx.token, grad.contiguous(), ids, mode, padding_idx, tables)
    return None, [None] * ctx.n_weights, None, None, None, None


_sparse_embedding_bags.register_autograd(_backward, setup_context=_setup_context)


def sparse_embedding_bags(ids: Tensor, weights: list[Tensor], token: Tensor, mode: int, padding_idx: int | None,
                          tables: list[int]) -> Tensor:
    """Pool every table's bags at once: out[t] = nn.EmbeddingBag(weights[t], mode)(ids[t]) for ids (tables,
    bags, hot); the backward files each table's rows under ``tables[t]`` (pending.py) and gives the weights
    no ``.grad``."""
    _check(ids, weights, mode, tables)
    return _sparse_embedding_bags(ids, list(weights), token, mode, -1 if padding_idx is None else padding_idx,
                                  list(tables))
