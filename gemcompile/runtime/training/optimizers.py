"""The optimizers of a single-process run: Adam on dense weights, Adagrad on embedding tables (the parallel
runtime splits the same way per mesh: ParallelRuntime.build_optimizers in runtime/distributed/apply.py).

With ``sparse_embeddings`` the tables train sparsely: their lookups give row gradients instead of a dense
(rows x dim) ``.grad`` and SparseAdagrad updates only the looked-up rows (sparse_tables.py,
sparse_adagrad.py); the update equals dense Adagrad's. Tables that cannot (max_norm, mode "max" bags, ...)
stay dense under torch's Adagrad."""

from __future__ import annotations

import torch
from torch import nn

from gemcompile.runtime.tables.sparse_adagrad import SparseAdagrad
from gemcompile.runtime.tables.sparse_tables import use_sparse_row_gradients
from gemcompile.runtime.training.adam import TritonAdam, triton_adam_enabled, triton_adam_serves
from gemcompile.runtime.training.checkpoint import unwrap_model

__all__ = ["build_optimizers"]


def build_optimizers(model: nn.Module, lr: float, embedding_lr: float,
                     sparse_embeddings: bool = False, triton_adam: bool = True) -> list[torch.optim.Optimizer]:
    """Adam for dense parameters, Adagrad for embedding tables (nn.Embedding / nn.EmbeddingBag weights);
    with `sparse_embeddings`, SparseAdagrad over the tables that can train sparsely (the model's eligible
    tables are turned into SparseGrad tables here, in place: call it before the model's first forward).

    Adagrad on embeddings is the recsys default: a row that is not in the batch has a zero gradient
    and Adagrad leaves it exactly unchanged, where Adam's momentum would keep moving every row of the
    table. Both are deterministic and checkpoint their full state, so resume is bit-exact.

    `triton_adam`: the dense Adam is TritonAdam (adam.py) on CUDA where it serves the parameters; False keeps
    torch's fused Adam (the benchmark's torch.compile peer, set up as plain PyTorch would be).
    """
    module = unwrap_model(model)
    sparse_tables = use_sparse_row_gradients(module) if sparse_embeddings else []
    sparse_ids = {id(t.weight) for t in sparse_tables}
    embedding_ids = {
        id(p)
        for m in module.modules()
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag))
        for p in m.parameters()
    }
    embeddings = [p for p in module.parameters() if id(p) in embedding_ids and id(p) not in sparse_ids]
    dense = [p for p in module.parameters() if id(p) not in embedding_ids]
    optimizers: list[torch.optim.Optimizer] = [_dense_adam(dense, lr, triton_adam)] if dense else []
    if embeddings:
        optimizers.append(torch.optim.Adagrad(embeddings, lr=embedding_lr))
    if sparse_tables:
        optimizers.append(SparseAdagrad(sparse_tables, lr=embedding_lr))
    return optimizers


def _dense_adam(params: list, lr: float, triton_adam: bool) -> torch.optim.Optimizer:
    """TritonAdam (one launch a step, adam.py) where asked for, every parameter is an fp32 contiguous CUDA
    tensor and GEMCOMPILE_TRITON_ADAM is not 0; torch's Adam otherwise (fused on CUDA). Both keep the same
    state, so a checkpoint of one loads into the other."""
    if triton_adam and triton_adam_enabled() and triton_adam_serves(params) and params[0].is_cuda:
        return TritonAdam(params, lr=lr)
    return torch.optim.Adam(params, lr=lr, fused=_fused_adam(params))


def _fused_adam(params: list) -> bool | None:
    """Adam's fused kernel (one kernel per chunk of parameters) when every parameter is a CUDA tensor, else
    torch's default. The default on CUDA is foreach: several multi-tensor kernels per update, over 200
    launches a step on GEM-ref small (H200 kernel profile, e2e-small-fill0.5-20261130-143200.json) that
    the host pays for at every step. Adagrad keeps foreach: torch 2.11 refuses its fused kernel on CUDA,
    and only at the first step."""
    return True if params and all(p.is_cuda for p in params) else None

