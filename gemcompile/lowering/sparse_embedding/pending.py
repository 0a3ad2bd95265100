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
from typing import Self

from torch import Tensor

__all__ = ["Filed", "clear", "file_rows", "new_table_key", "take_rows"]

_PENDING: dict[int, list[Filed]] = {}
_KEYS = itertools.count(1)


def new_table_key() -> int:
    """A process-unique key for a table (an int: graphs bake it in as a constant)."""
    return next(_KEYS)


class Filed(tuple):
    """One lookup's (ids, grads) pair, and ``share``: for a table's slice of a filing made for several tables
    at once (the batched bag lookups), ``(every table's ids (T, n), every table's rows (T, n, dim), this
    table's index)``, else None. The optimizer reads consecutive shares of one filing as one part, knowing
    they are adjacent without testing their addresses (a test per table that cost more host time than the
    update's launches)."""

    share: tuple[Tensor, Tensor, int] | None

    def __new__(cls, ids: Tensor, grads: Tensor, share: tuple[Tensor, Tensor, int] | None = None) -> Self:
        entry = super().__new__(cls, (ids, grads))
        entry.share = share
        return entry


def file_rows(table: int, ids: Tensor, grads: Tensor, share: tuple[Tensor, Tensor, int] | None = None) -> None:
    """File (ids (n,), grads (n, dim)) of one lookup's backward for `table`; ids < 0 are skipped later.
    `share`: see Filed (ids and grads must then be ``share[0][share[2]]`` and ``share[1][share[2]]``)."""
    _PENDING.setdefault(table, []).append(Filed(ids, grads, share))


def take_rows(table: int) -> list[Filed]:
    """Every entry filed for `table` since the last call, oldest first (and forget them)."""
    return _PENDING.pop(table, [])


def clear(table: int) -> None:
    """Drop what `table` has pending (zero_grad: a backward whose step never came)."""
    _PENDING.pop(table, None)
