"""Whether a set of integer comparisons can hold at once: Fourier-Motzkin over the rationals.

The prover's truth table (masks/prover.py) knows only the order facts between comparisons of one linear
form. A row of the table that differs may still be impossible in integer arithmetic (``i == j``,
``i < n`` and ``j >= n`` together); this module rules such rows out. Sound for the prover: a row is
dropped only when its comparisons have no rational solution, so no integer one; a row with a rational
solution is kept (the prover then says "not equivalent", never "equal" by mistake).
"""

from __future__ import annotations

import itertools

import sympy

_MAX_CONSTRAINTS = 400
"""Fourier-Motzkin can square the constraint count per eliminated variable: past this, give up (feasible)."""


def feasible(facts: list[tuple[str, sympy.Expr, bool]], nonnegative: set) -> bool:
    """Whether ``e < 0`` / ``e == 0`` (or their negations) can all hold for integers, indices >= 0. Each
    fact is (kind, e, holds). Non-linear terms (floor, min, max) make it answer True (unknown)."""
    rows: list[sympy.Expr] = [-x for x in nonnegative]  # each row: expression <= 0
    splits = []
    for kind, e, holds in facts:
        if kind == "lt":
            rows.append(e + 1 if holds else -e)  # integers: e < 0 <=> e + 1 <= 0
        elif holds:
            rows += [e, -e]
        else:
            splits.append(e)  # e != 0: e <= -1 or e >= 1
    if len(splits) > 6:
        return True
    for signs in itertools.product((1, -1), repeat=len(splits)):
        branch = rows + [s * e + 1 for s, e in zip(signs, splits)]
        if _rational_feasible(branch):
            return True
    return False


def _rational_feasible(rows: list[sympy.Expr]) -> bool:
    symbols = set().union(*[r.free_symbols for r in rows]) if rows else set()
    functions = set().union(*[r.atoms(sympy.Function) for r in rows]) if rows else set()
    if any(not isinstance(f, sympy.core.function.AppliedUndef) for f in functions):
        return True  # floor / Min / Max: not linear
    names = {f: sympy.Dummy() for f in functions}
    rows = [sympy.expand(r.xreplace(names)) for r in rows]
    variables = sorted(set().union(*[r.free_symbols for r in rows]) | (symbols - set()), key=str)
    for x in variables:
        pos, neg, rest = [], [], []
        for r in rows:
            c = r.coeff(x)
            if not c.is_number:
                return True
            (pos if c > 0 else neg if c < 0 else rest).append((c, r))
        rows = [r for _, r in rest]
        rows += [sympy.expand(r1 / c1 - r2 / c2) for c1, r1 in pos for c2, r2 in neg]  # x eliminated
        if len(rows) > _MAX_CONSTRAINTS:
            return True
        if any(r.is_number and r > 0 for r in rows):
            return False
    return not any(r.is_number and r > 0 for r in rows)
