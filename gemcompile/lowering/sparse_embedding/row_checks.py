"""The checks every sparse Adagrad entry point makes of a table and of the (ids, gradient rows) filed for it:
a clear error instead of a launch that reads the wrong memory."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["check_rows", "check_table"]


def check_table(weight: Tensor, state_sum: Tensor) -> None:
    """A (rows, dim) weight and its Adagrad sum of the same shape, on one device."""
    if weight.dim() != 2 or state_sum.shape != weight.shape:
        raise ValueError(f"adagrad_rows_: weight and state_sum must be one (rows, dim) shape, got "
                         f"{tuple(weight.shape)} and {tuple(state_sum.shape)}")
    if state_sum.device != weight.device:
        raise ValueError("adagrad_rows_: weight, state_sum, ids and grads must be on one device")


def check_rows(weight: Tensor, ids: Tensor, grads: Tensor) -> None:
    """One lookup's ids (n,) and gradient rows (n, dim) against its table (cheap: it runs for every part of
    every step)."""
    if (ids.dim() != 1 or grads.dim() != 2 or grads.shape[0] != ids.shape[0]
            or grads.shape[1] != weight.shape[1]):
        raise ValueError(f"adagrad_rows_: ids must be (n,) and grads (n, {weight.shape[1]}), got "
                         f"{tuple(ids.shape)} and {tuple(grads.shape)}")
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise TypeError(f"adagrad_rows_: ids must be an integer tensor, got {ids.dtype}")
    if ids.device != weight.device or grads.device != weight.device:
        raise ValueError("adagrad_rows_: weight, state_sum, ids and grads must be on one device")
