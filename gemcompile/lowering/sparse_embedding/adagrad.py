"""Adagrad on the looked-up rows of a table: the Triton kernel on CUDA, the plain-PyTorch reference elsewhere."""

from __future__ import annotations

import torch
from torch import Tensor

from .reference import adagrad_rows_reference_

__all__ = ["adagrad_rows_", "adagrad_tables_"]


def _check_table(weight: Tensor, state_sum: Tensor) -> None:
    if weight.dim() != 2 or state_sum.shape != weight.shape:
        raise ValueError(f"adagrad_rows_: weight and state_sum must be one (rows, dim) shape, got "
                         f"{tuple(weight.shape)} and {tuple(state_sum.shape)}")
    if state_sum.device != weight.device:
        raise ValueError("adagrad_rows_: weight, state_sum, ids and grads must be on one device")


def _check_rows(weight: Tensor, ids: Tensor, grads: Tensor) -> None:
    """One lookup's ids and gradient rows against its table (cheap: it runs for every part of every step)."""
    if ids.dim() != 1 or grads.dim() != 2 or grads.shape[0] != ids.shape[0] or grads.shape[1] != weight.shape[1]:
        raise ValueError(f"adagrad_rows_: ids must be (n,) and grads (n, {weight.shape[1]}), got "
                         f"{tuple(ids.shape)} and {tuple(grads.shape)}")
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise TypeError(f"adagrad_rows_: ids must be an integer tensor, got {ids.dtype}")
    if ids.device != weight.device or grads.device != weight.device:
        raise ValueError("adagrad_rows_: weight, state_sum, ids and grads must be on one device")


def adagrad_rows_(weight: Tensor, state_sum: Tensor, ids: Tensor, grads: Tensor, lr: float, eps: float,
                  deterministic: bool | None = None) -> None:
    """``sum += g * g; w -= lr * g / (sqrt(sum) + eps)`` on the rows in `ids` only, g a row's summed
    gradient rows; in place. Equals torch.optim.Adagrad (lr_decay = weight_decay = 0) on the dense gradient.
    `deterministic`: True sums each row's gradient rows in a fixed order on CUDA too (replicas that must
    stay bit for bit identical); None follows torch.are_deterministic_algorithms_enabled(). The CPU
    reference is deterministic either way."""
    _check_table(weight, state_sum)
    _check_rows(weight, ids, grads)
    if weight.device.type == "cuda" and weight.stride(1) == 1 and state_sum.stride(1) == 1:
        from .adagrad_triton import adagrad_rows_triton_

        adagrad_rows_triton_(weight, state_sum, ids, grads, lr, eps, deterministic=deterministic)
    else:
        adagrad_rows_reference_(weight, state_sum, ids, grads, lr, eps)


def adagrad_tables_(weights: list[Tensor], state_sums: list[Tensor], ids: list, grads: list, lr: float,
                    eps: float, shares: list | None = None) -> None:
    """adagrad_rows_ on several CUDA tables of one dim and dtype in one sort and one launch
    (adagrad_tables_triton_); ``ids[t]`` / ``grads[t]`` a table's tensors or lists of parts (one per lookup),
    each part checked as adagrad_rows_ checks a table's (a part that is a share of a filing for several
    tables, through that filing, once); ``shares``: see adagrad_tables_triton_."""
    from .adagrad_triton import adagrad_tables_triton_, table_parts

    checked = None  # the ids tensor of the filing whose shares were checked last (a filing's shares come in a row)
    for t, (w, s, i, g) in enumerate(zip(weights, state_sums, ids, grads, strict=True)):
        _check_table(w, s)
        for i_part, g_part, share in table_parts(i, g, shares[t] if shares is not None else None):
            if share is None:
                _check_rows(w, i_part, g_part)
            elif share[0] is not checked:
                ids_all, rows_all, _ = share
                _check_rows(w, ids_all.reshape(-1), rows_all.reshape(-1, rows_all.shape[-1]))
                checked = ids_all
    adagrad_tables_triton_(weights, state_sums, ids, grads, lr, eps, shares)
