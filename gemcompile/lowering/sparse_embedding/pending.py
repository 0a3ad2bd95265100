"""The row gradients a table's lookups produced since its optimizer last stepped.

A lookup's backward cannot return its gradient as the table's ``.grad`` without making it dense (rows x
dim): autograd only knows gradients shaped like their input. So the backward op files the ids it saw and
one gradient row per id here, under the table's key, and the sparse optimizer takes them at ``step()``.
Every entry is a pair of fresh tensors (never a view of a graph buffer that Inductor could reuse).
A table looked up several times in one step (an item table shared by several sequences) files one entry
per lookup; the optimizer sums them like autograd would sum dense gradients.
"""

from __future__ import annotations

import itertools

from torch import Tensor

__all__ = ["clear", "file_rows", "new_table_key", "take_rows"]

_PENDING: dict[int, list[tuple[Tensor, Tensor]]] = {}
_KEYS = itertools.count(1)


def new_table_key() -> int:
    """A process-unique key for a table (an int: graphs bake it in as a constant)."""
    return next(_KEYS)


def file_rows(table: int, ids: Tensor, grads: Tensor) -> None:
    """File (ids (n,), grads (n, dim)) of one lookup's backward for `table`; ids < 0 are skipped later."""
    _PENDING.setdefault(table, []).append((ids, grads))


def take_rows(table: int) -> list[tuple[Tensor, Tensor]]:
    """Every entry filed for `table` since the last call, oldest first (and forget them)."""
    return _PENDING.pop(table, [])


def clear(table: int) -> None:
    """Drop what `table` has pending (zero_grad: a backward whose step never came)."""
    _PENDING.pop(table, None)
