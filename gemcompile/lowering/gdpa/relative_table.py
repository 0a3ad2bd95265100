"""GDPA's relative-position bias read from its table: ``bias[b, h, i, j] = table[j - i + offset, h]``.

HSTU adds a learned relative bias ``rab[i, j] = table[j - i + L - 1]`` to its scores. Passed to GDPA as a
dense (1, Hz, Lq, Lk) tensor (the output of gemcompile::relative_bias), it costs on the H200, at HSTU's
B32 L1024 H4 shape (benchmarks/results/gdpa-hstu-cudagraph-sfu-20261130-173828.json): the gather that
builds it (7 us), its (Lq, Lk) tile loads in the three attention kernels (about 55 us together), the sum of
the bias-gradient kernel's fp32 parts (11 us) and the diagonal sums of relative_bias's backward (7 us).

With ``relative_offset`` set, gemcompile::gdpa takes the table itself, (T,) or (T, Hz) with Hz in {1, H}:

- the kernels read it as a strided (Lq, Lk) view: element (i, j) of head slice hz sits at
  ``table + (offset + j - i) * stride0 + hz * stride1``, a row stride of -stride0 and a column stride of
  +stride0 (a view torch cannot hold, negative strides, but a Triton pointer can). Nothing is gathered,
  and the (2L - 1) table stays in L1 where the dense bias streamed (L, L) tiles from L2;
- the bias-gradient kernel's fp32 parts (splits, Hz, Lq, Lk) are summed along their diagonals by one
  kernel (diagonal_sums_triton.py), straight into the table's rows.

Every position j - i + offset for i < Lq, j < Lk must lie in the table (checked: no wrap-around). Rows of
the table that no pair reads get a zero gradient. The reference path materializes the dense bias and sums
its gradient's diagonals (relative_bias/op.py): the definition the kernels are tested against.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..relative_bias.op import positions_span, relative_bias_backward, relative_bias_reference

__all__ = ["check_relative_table", "dense_relative_bias", "relative_table_grad", "table_heads",
           "toeplitz_view"]


def check_relative_table(table, offset, H: int, Lq: int, Lk: int, device) -> None:
    """Metadata checks of a relative-bias table (also on fake tensors); TypeError/ValueError."""
    if isinstance(offset, bool) or not isinstance(offset, (int, torch.SymInt)):
        raise TypeError(f"relative_offset must be an int or None, got {type(offset).__name__}")
    if not isinstance(table, torch.Tensor):
        raise TypeError("relative_offset is set: bias must be the relative-position table (a tensor), got "
                        f"{type(table).__name__}")
    if not table.is_floating_point():
        raise TypeError(f"the relative-position table must be floating point, got {table.dtype}")
    if table.device != device:
        raise ValueError(f"the relative-position table is on {table.device} but q is on {device}")
    if table.dim() not in (1, 2) or (table.dim() == 2 and table.shape[1] not in (1, H)):
        raise ValueError(
            f"with relative_offset, bias must be the relative-position table, shape (T,) or (T, Hz) with Hz "
            f"1 or the {H} heads; got shape {tuple(table.shape)}"
        )
    if isinstance(offset, int) and isinstance(Lq, int) and isinstance(Lk, int) and Lq > 0 and Lk > 0:
        lo, hi = positions_span(Lq, Lk, offset)
        if lo < 0 or hi >= table.shape[0]:
            raise ValueError(
                f"relative bias: positions j - i + {offset} for i < {Lq}, j < {Lk} span [{lo}, {hi}], "
                f"outside a table of {table.shape[0]} rows"
            )


def table_heads(table: Tensor) -> int:
    """Hz of a table (T,) or (T, Hz): the bias's head dim (1: shared by the heads)."""
    return 1 if table.dim() == 1 else table.shape[1]


def dense_relative_bias(table: Tensor, offset: int, Lq: int, Lk: int) -> Tensor:
    """The bias the table stands for, (1, Hz, Lq, Lk) in the table's dtype."""
    dense = relative_bias_reference(table.reshape(table.shape[0], table_heads(table)), Lq, Lk, offset)
    return dense.permute(2, 0, 1).unsqueeze(0)


def relative_table_grad(dbias: Tensor, table: Tensor, offset: int) -> Tensor:
    """d table (like table) from the gradient of its dense bias, (1, Hz, Lq, Lk): each row's diagonal sum."""
    Lq, Lk = dbias.shape[2], dbias.shape[3]
    grad = relative_bias_backward(dbias[0].permute(1, 2, 0), table.shape[0], Lq, Lk, offset)  # (T, Hz)
    return grad.reshape(table.shape).to(table.dtype)


def toeplitz_view(table: Tensor, offset: int, B: int, H: int) -> tuple[Tensor, tuple[int, int, int, int]]:
    """(base, (b, h, m, n) strides) through which the GDPA kernels read bias[b, h, i, j] from the table:
    base is the table's row ``offset`` (j - i = 0), the row stride is negative."""
    s0 = table.stride(0)
    sh = table.stride(1) if table_heads(table) == H > 1 else 0
    return table[offset:], (0, sh, -s0, s0)
