"""What the many-table kernels read about each table: a small int64 tensor of addresses, row counts and
strides on the device, and the Triton dtype of the weights.

``device_table`` keeps one tensor per distinct content (a model's tables keep their storage while they
train), so a step copies nothing from the host; it holds addresses and shapes, never values.
"""

from __future__ import annotations

import torch
import triton.language as tl

from ..common.opkit import kept_tensor

__all__ = ["TL_DTYPES", "device_table"]

TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
"""The weight dtypes the kernels serve, as Triton names them."""

_CACHE: dict[tuple, torch.Tensor] = {}
_CACHE_SIZE = 1024


def device_table(rows: tuple[tuple[int, ...], ...], device: torch.device) -> torch.Tensor:
    """``torch.tensor(rows, dtype=int64)`` on ``device``, built once per (rows, device)."""
    key = (rows, device)
    table = _CACHE.get(key)
    if table is None:
        if len(_CACHE) >= _CACHE_SIZE and not _capturing(device):
            if device.type == "cuda":
                torch.cuda.synchronize()  # kept tensors are freed only once nothing queued reads them
            _CACHE.clear()
        # (kept_tensor: the bag lookups read it inside compiled graphs, CUDA-graph trees included)
        table = _CACHE[key] = kept_tensor(lambda: torch.tensor(rows, dtype=torch.int64).to(device), device)
    return table


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()
