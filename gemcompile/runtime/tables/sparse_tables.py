"""Embedding tables whose lookups give the optimizer only the looked-up rows (no dense table gradient).

``use_sparse_row_gradients(model)`` turns every eligible ``nn.Embedding`` / ``nn.EmbeddingBag`` of a model
into its ``SparseGrad*`` subclass in place (same parameters, names, state_dict keys and outputs). Their
forward calls gemcompile::sparse_embedding, whose backward files (ids, gradient rows) for the table's
optimizer (sparse_adagrad.py) instead of writing a (rows x dim) ``.grad``. Eligible: plain modules (not a
subclass) with ``sparse=False``, no ``max_norm`` (it renormalizes the table inside the forward), no
``scale_grad_by_freq``, and for bags mode "sum" or "mean". Others keep their dense gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from gemcompile.lowering.sparse_embedding.op import MODE_LOOKUP, MODE_MEAN, MODE_SUM, sparse_embedding
from gemcompile.lowering.sparse_embedding.pending import new_table_key

__all__ = ["SparseGradEmbedding", "SparseGradEmbeddingBag", "is_sparse_grad_table", "use_sparse_row_gradients"]


class _FreshKeyOnCopy:
    """A copied or unpickled table (deepcopy, an EMA copy) files under a key of its own, never its source's."""

    def __setstate__(self, state):
        super().__setstate__(state)
        self.table_key = new_table_key()


class SparseGradEmbedding(_FreshKeyOnCopy, nn.Embedding):
    """nn.Embedding whose backward files row gradients under ``table_key`` (see the module docstring)."""

    table_key: int

    def forward(self, input: Tensor) -> Tensor:
        return sparse_embedding(input, self.weight, None, self.row_grad_token, MODE_LOOKUP, self.padding_idx,
                                self.table_key)


class SparseGradEmbeddingBag(_FreshKeyOnCopy, nn.EmbeddingBag):
    """nn.EmbeddingBag (sum, mean) whose backward files row gradients under ``table_key``."""

    table_key: int

    def forward(self, input: Tensor, offsets: Tensor | None = None,
                per_sample_weights: Tensor | None = None) -> Tensor:
        if per_sample_weights is not None:
            raise ValueError(f"{type(self).__name__}: per_sample_weights are not supported with sparse row "
                             "gradients (their gradient would need the dense path); build the optimizers with "
                             "sparse_embeddings=False for this model")
        if input.dim() == 1 and offsets is None:
            raise ValueError("EmbeddingBag: offsets has to be a 1D Tensor but got None (1-D input)")
        if input.dim() == 2 and offsets is not None:
            raise ValueError("EmbeddingBag: if input is 2D, then offsets has to be None")
        if offsets is not None and self.include_last_offset:
            offsets = offsets[:-1]  # bag i is [offsets[i], offsets[i + 1]) either way
        mode = MODE_SUM if self.mode == "sum" else MODE_MEAN
        return sparse_embedding(input, self.weight, offsets, self.row_grad_token, mode, self.padding_idx,
                                self.table_key)


def _eligible(module: nn.Module) -> bool:
    if type(module) is nn.Embedding:
        return not module.sparse and module.max_norm is None and not module.scale_grad_by_freq
    if type(module) is nn.EmbeddingBag:
        return (not module.sparse and module.max_norm is None and not module.scale_grad_by_freq
                and module.mode in ("sum", "mean"))
    return False


def is_sparse_grad_table(module: nn.Module) -> bool:
    """A SparseGrad table, or a sharded table of the parallel runtime that files row gradients
    (runtime/distributed/embedding.py ShardedTable.use_sparse_row_gradients)."""
    return (isinstance(module, (SparseGradEmbedding, SparseGradEmbeddingBag))
            or getattr(module, "files_row_gradients", False) is True)


def use_sparse_row_gradients(model: nn.Module) -> list[nn.Module]:
    """Turn the eligible tables of `model` into SparseGrad tables, in place; returns every SparseGrad table
    of the model (those turned now and before). Call it before the optimizers are built and before the
    first forward of a compiled model."""
    tables = []
    for module in model.modules():
        if _eligible(module):
            module.__class__ = SparseGradEmbedding if type(module) is nn.Embedding else SparseGradEmbeddingBag
            module.table_key = new_table_key()
            # a counter the backward bumps (see lowering/sparse_embedding/op.py); not part of checkpoints
            module.register_buffer("row_grad_token", torch.zeros(1, dtype=torch.int64,
                                                                  device=module.weight.device), persistent=False)
        if is_sparse_grad_table(module):
            tables.append(module)
    return tables
