"""Adagrad on the rows of one table, in plain PyTorch: what ``torch.optim.Adagrad`` does to a dense gradient
that is zero outside the given rows, restricted to those rows.

Dense Adagrad (lr_decay = weight_decay = 0) does ``sum += g * g; w += -lr * g / (sqrt(sum) + eps)``. A row
with g = 0 keeps its sum and its weight exactly, so only the looked-up rows need to be read and written.
The gradient of a row is the sum of its ids' gradient rows in the order they were filed, starting from 0,
as the dense embedding backward on the CPU adds them; the update uses the same tensor ops as Adagrad's
single-tensor path, so on the CPU in fp32 the result is bit for bit dense Adagrad's.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["adagrad_rows_reference_"]


@torch.no_grad()
def adagrad_rows_reference_(weight: Tensor, state_sum: Tensor, ids: Tensor, grads: Tensor, lr: float,
                            eps: float) -> None:
    """In place on `weight` and `state_sum` (rows x dim): ids (n,) with their gradient rows (n, dim);
    ids < 0 (padding) are ignored."""
    keep = ids >= 0
    ids, grads = ids[keep], grads[keep].to(state_sum.dtype)
    if ids.numel() == 0:
        return
    rows, inverse = torch.unique(ids, sorted=True, return_inverse=True)
    g = grads.new_zeros((rows.numel(), grads.shape[1])).index_add_(0, inverse, grads)
    s = state_sum.index_select(0, rows).addcmul_(g, g, value=1)
    state_sum.index_copy_(0, rows, s)
    std = s.sqrt().add_(eps)
    w = weight.index_select(0, rows).to(g.dtype).addcdiv_(g, std, value=-lr)
    weight.index_copy_(0, rows, w.to(weight.dtype))
