"""Adagrad on the looked-up rows of a table: the Triton kernel on CUDA, the plain-PyTorch reference elsewhere."""

from __future__ import annotations

from torch import Tensor

from .reference import adagrad_rows_reference_
from .row_checks import check_rows, check_table

__all__ = ["adagrad_rows_"]


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
