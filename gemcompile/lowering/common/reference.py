"""Plain-PyTorch helpers the attention references share: the compute dtype, row masks of lengths,
zeroing rows past a length, and summing a gradient down to a broadcast bias's shape."""

from __future__ import annotations

import torch

__all__ = ["compute_dtype", "key_mask", "reduce_bias_grad", "reduce_to_shape", "row_mask", "zero_invalid_rows"]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for float64 inputs, else float32: the math of the references and the log-sum-exp's dtype."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def row_mask(lengths: torch.Tensor | None, B: int, L: int, device) -> torch.Tensor:
    """(B, L) bool: position < length (all True without lengths)."""
    pos = torch.arange(L, device=device)
    if lengths is None:
        return torch.ones(B, L, dtype=torch.bool, device=device)
    return pos[None, :] < lengths.to(device)[:, None]


def key_mask(kv_lengths, kv_mask, B: int, Lk: int, device) -> torch.Tensor:
    """(B, Lk) bool: the valid keys, j < kv_len and kv_mask[b, j] (either may be None)."""
    kv_ok = row_mask(kv_lengths, B, Lk, device)
    return kv_ok if kv_mask is None else kv_ok & kv_mask.to(device, torch.bool)


def zero_invalid_rows(x: torch.Tensor, row_ok: torch.Tensor) -> torch.Tensor:
    """x (Bx, H, L, D), row_ok (B, L) -> (B, H, L, D) with rows >= length set to 0 (broadcasts Bx=1)."""
    return torch.where(row_ok[:, None, :, None], x, x.new_zeros(()))


def reduce_to_shape(x: torch.Tensor, shape) -> torch.Tensor:
    """x summed over the dims where ``shape`` has 1 (a broadcast), reshaped to ``shape``."""
    dims = [d for d, (s, t) in enumerate(zip(shape, x.shape)) if s == 1 and t != 1]
    if dims:
        x = x.sum(dim=dims, keepdim=True)  # deterministic reduction, in the dtype of x
    return x.reshape(shape)


def reduce_bias_grad(ds: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The gradient of a broadcast bias from the per-pair gradient ds: contiguous, in the bias's dtype."""
    return reduce_to_shape(ds, bias.shape).to(bias.dtype).contiguous()
