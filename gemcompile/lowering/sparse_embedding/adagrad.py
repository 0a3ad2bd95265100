"""Adagrad on the looked-up rows of a table: the Triton kernel on CUDA, the plain-PyTorch reference elsewhere."""

from __future__ import annotations

import torch
from torch import Tensor

from .reference import adagrad_rows_reference_
from .row_checks import check_rows, check_table

__all__ = ["adagrad_rows_", "adagrad_tables_"]


def adagrad_rows_(weight: Tensor, state_sum: Tensor, ids: Tensor, grads: Tensor, lr: float, eps: float,
                  deterministic: bool | None = None) -> None:
    """``sum += g * g; w -= lr * g / (sqrt(sum) + eps)`` on the rows in `ids` only, g a row's summed
    gradient rows; in place. Equals torch.optim.Adagrad (lr_decay = weight_decay = 0) on the dense gradient.
    `deterministic`: True sums each row's gradient rows in a fixed order on CUDA too (replicas that must
    stay bit for bit identical); None follows torch.are_deterministic_algorithms_enabled(). The CPU
    reference is deterministic either way."""
    check_table(weight, state_sum)
    check_rows(weight, ids, grads)
    if weight.device.type == "cuda" and weight.stride(1) == 1 and state_sum.stride(1) == 1:
        from .adagrad_triton import adagrad_rows_triton_

        adagrad_rows_triton_(weight, state_sum, ids, grads, lr, eps, deterministic=deterministic)
    else:
        adagrad_rows_reference_(weight, state_sum, ids, grads, lr, eps)


def adagrad_tables_(weights: list[Tensor], state_sums: list[Tensor], ids: list, grads: list, lr: float,
                    eps: float, shares: list | None = None) -> None:
    """adagrad_rows_ on several CUDA tables of one dim and dtype in one sort and one launch
    (adagrad_tables_triton_: every table and part checked as adagrad_rows_ checks them); ``ids[t]`` /
    ``grads[t]`` a table's tensors or lists of parts (one per lookup); ``shares``: see
    adagrad_tables_triton_."""
    from .adagrad_triton import adagrad_tables_triton_

    adagrad_tables_triton_(weights, state_sums, ids, grads, lr, eps, shares)
