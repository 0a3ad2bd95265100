"""Whether a set of integer comparisons can hold at once: Fourier-Motzkin over the rationals.

The prover's truth table (masks/prover.py) knows only the order facts between comparisons of one linear
form. A row of the table that differs may still be impossible in integer arithmetic (``i == j``,
``i < n`` and ``j >= n`` together); this module rules such rows out. Sound for the prover: a row is
dropped only when its comparisons have no rational solution, so no integer one; a row with a rational
solution is kept (the prover then says "not equivalent", never "equal" by mistake).
"""

from __future__ import annotations

import functools
import itertools
import math
from fractions import Fraction

import sympy

_MAX_CONSTRAINTS = 400
"""Fourier-Motzkin can square the constraint count per eliminated variable: past this, give up (feasible)."""


def feasible(facts: list[tuple[str, sympy.Expr, bool]], nonnegative: set) -> bool:
    """Whether ``e < 0`` / ``e == 0`` (or their negations) can all hold for integers, indices >= 0. Each
    fact is (kind, e, holds). Non-linear terms (floor, min, max) and fractional coefficients make it answer
    True (unknown)."""
    forms = [_linear_form(e) for _, e, _ in facts]
    if any(form is None or any(c.denominator != 1 for c in form.values()) for form in forms):
        return True  # e < 0 <=> e + 1 <= 0 below holds for integer-valued e only
    variables = sorted({k for form in forms for k in form if k != 1} | set(nonnegative), key=str)
    place = {v: n for n, v in enumerate(variables)}
    row = lambda form, sign=1, shift=0: _integer_row(form, place, sign, shift)  # noqa: E731
    rows = [row({x: Fraction(-1)}) for x in nonnegative]  # each row: sum(c * var) + const <= 0
    splits = []
    for (kind, _, holds), form in zip(facts, forms):
        if kind == "lt":
            rows.append(row(form, 1, 1) if holds else row(form, -1))  # integers: e < 0 <=> e + 1 <= 0
        elif holds:
            rows += [row(form), row(form, -1)]
        else:
            splits.append(form)  # e != 0: e <= -1 or e >= 1
    if len(splits) > 6:
        return True
    for signs in itertools.product((1, -1), repeat=len(splits)):
        branch = rows + [row(form, sign, 1) for sign, form in zip(signs, splits)]
        if _rational_feasible(branch, len(variables)):
            return True
    return False


@functools.lru_cache(maxsize=8192)
def _linear_form(e: sympy.Expr) -> dict | None:
    """e as {variable: coefficient, 1: constant} with exact rational coefficients (a lengths function applied
    to its argument is one variable); None when e is not linear (floor, Min, Max, products)."""
    form: dict = {}
    for term, coeff in sympy.expand(e).as_coefficients_dict().items():
        if not coeff.is_Rational:
            return None
        if term == 1:
            key = 1
        elif isinstance(term, (sympy.Symbol, sympy.core.function.AppliedUndef)):
            key = term
        else:
            return None
        form[key] = form.get(key, Fraction(0)) + Fraction(int(coeff.p), int(coeff.q))
    return form


def _integer_row(form: dict, place: dict, sign: int, shift: int) -> tuple[int, ...]:
    """sign * form + shift as integer coefficients (one per variable, the constant last), scaled by a
    positive number (which keeps `row <= 0`)."""
    values = [Fraction(0)] * (len(place) + 1)
    for k, c in form.items():
        values[-1 if k == 1 else place[k]] += sign * c
    values[-1] += shift
    scale = math.lcm(*(v.denominator for v in values))
    return _normalized([int(v * scale) for v in values])


def _normalized(values: list[int]) -> tuple[int, ...]:
    g = math.gcd(*values)
    return tuple(v // g for v in values) if g > 1 else tuple(values)


def _rational_feasible(rows: list[tuple[int, ...]], width: int) -> bool:
    """Fourier-Motzkin elimination over the rationals (integer rows): whether all rows (<= 0) hold together.
    The variable with the fewest new rows goes first."""
    rows = set(rows)
    remaining = set(range(width))
    while remaining:
        if any(_constant_positive(r) for r in rows):
            return False
        counts = {x: (sum(r[x] > 0 for r in rows), sum(r[x] < 0 for r in rows)) for x in remaining}
        x = min(remaining, key=lambda v: (counts[v][0] * counts[v][1], v))
        remaining.discard(x)
        pos = [r for r in rows if r[x] > 0]
        neg = [r for r in rows if r[x] < 0]
        rows = {r for r in rows if r[x] == 0}
        rows |= {_normalized([a * -n[x] + b * p[x] for a, b in zip(p, n)]) for p in pos for n in neg}
        if len(rows) > _MAX_CONSTRAINTS:
            return True
    return not any(_constant_positive(r) for r in rows)


def _constant_positive(row: tuple[int, ...]) -> bool:
    return row[-1] > 0 and not any(row[:-1])
