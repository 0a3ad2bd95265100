"""Parameter grids that cover every pair of values instead of every combination.

A kernel or pass test over three or more independent axes (shapes x masks x splits, ...) grows as their
product. ``pairwise(...)`` returns a subset of that product in which every value of every axis meets every
value of every other axis at least once (a greedy covering array, deterministic): most of what a full grid
catches depends on one or two axes at once, at a fraction of the cases. ``GEMCOMPILE_FULL_GRIDS=1`` gives
the full product back (run it before changing a kernel; the GPU tier runs its own grids).
"""
from __future__ import annotations

import itertools
import os
from typing import Mapping, Sequence


def full_grids() -> bool:
    return os.environ.get("GEMCOMPILE_FULL_GRIDS", "0") == "1"


def _pairs(case: tuple) -> set[tuple]:
    return {(i, case[i], j, case[j]) for i, j in itertools.combinations(range(len(case)), 2)}


def pairwise(*axes: Sequence | Mapping) -> list:
    """Cases covering every pair of values of any two axes; the whole product under GEMCOMPILE_FULL_GRIDS=1
    or with fewer than three axes. An axis is a sequence of values, or a mapping {test id: value}: with any
    mapping axis the cases are ``pytest.param``s named by those ids, else tuples of values in axis order."""
    labels = [list(axis) if isinstance(axis, Mapping) else None for axis in axes]
    values = [list(axis.values()) if isinstance(axis, Mapping) else list(axis) for axis in axes]
    if any(len(axis) == 0 for axis in values):
        raise ValueError("pairwise: every axis needs at least one value")
    indices = list(itertools.product(*(range(len(axis)) for axis in values)))
    if full_grids() or len(axes) < 3:
        chosen = indices
    else:
        uncovered = set().union(*(_pairs(case) for case in indices))
        chosen = []
        while uncovered:  # the case that covers the most pairs still uncovered; the first such in order
            best = max(indices, key=lambda case: len(_pairs(case) & uncovered))
            chosen.append(best)
            uncovered -= _pairs(best)
        chosen.sort()
    cases = [tuple(axis[i] for axis, i in zip(values, case)) for case in chosen]
    if all(label is None for label in labels):
        return cases
    import pytest

    return [pytest.param(*case, id="-".join(_label(labels[a], values[a], i) for a, i in enumerate(chosen_case)))
            for case, chosen_case in zip(cases, chosen)]


def _label(labels: list | None, values: list, i: int) -> str:
    if labels is not None:
        return str(labels[i])
    value = values[i]
    return str(value) if value is None or isinstance(value, (str, int, float, bool)) else f"{i}"
