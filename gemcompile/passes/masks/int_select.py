"""Integer values chosen by a condition, and comparisons that split them exactly.

HSTU's non-causal mask takes the distance's magnitude as ``torch.where(d > 0, d, -d)``; others clamp
positions (``min``, ``max``) or take ``abs``. Each is an integer expression with cases, and a comparison
of it is the disjunction of the comparison in each case. ``Select(e, u, w)`` is ``u where e < 0, else w``;
an integer ``where`` over any formula of the comparisons becomes nested Selects (one per proposition the
formula reads, by Shannon expansion), so a where's condition is carried as expressions in the index
symbols: substituting an index (a transpose, a broadcast) moves the condition with the values.
"""

from __future__ import annotations

import sympy
from sympy.core.logic import fuzzy_and
from sympy.logic.boolalg import Boolean

from gemcompile.passes.graph import Unproven
from gemcompile.passes.masks.values import Atoms

_MAX_PROPOSITIONS = 6
"""A where's condition reading more propositions than this is not expanded (2**n cases)."""


class Select(sympy.Function):
    """``Select(e, u, w)``: u where the integer e < 0, else w."""

    nargs = 3

    @classmethod
    def eval(cls, e, u, w):
        if e.is_number:
            return u if e < 0 else w
        if u == w:
            return u
        return None

    def _eval_is_integer(self):
        return fuzzy_and(a.is_integer for a in self.args[1:])


def select(atoms: Atoms, cond: Boolean, u: sympy.Expr, w: sympy.Expr) -> sympy.Expr:
    """The integer ``where(cond, u, w)`` as nested Selects over the comparisons ``cond`` reads."""
    if cond is sympy.true:
        return u
    if cond is sympy.false:
        return w
    props = sorted(cond.free_symbols, key=str)
    if len(props) > _MAX_PROPOSITIONS:
        raise Unproven(f"an integer where whose condition reads {len(props)} comparisons (at most "
                       f"{_MAX_PROPOSITIONS} are expanded)")
    prop = props[0]
    yes = select(atoms, cond.xreplace({prop: sympy.true}), u, w)
    no = select(atoms, cond.xreplace({prop: sympy.false}), u, w)
    kind, e = atoms.expr_of[prop]
    if kind == "lt":
        return Select(e, yes, no)
    return Select(e, no, Select(-e, no, yes))  # e == 0: neither e < 0 nor -e < 0


def compare_split(atoms: Atoms, op: str, ea, eb) -> Boolean:
    """``ea op eb``; an |u|, min(u, w), max(u, w) or Select inside is split exactly into its two cases,
    innermost first."""
    cases = sympy.sympify(ea - eb).atoms(sympy.Abs, sympy.Min, sympy.Max, Select)
    if not cases:
        return atoms.compare(op, ea, eb)
    term = sorted(cases, key=lambda t: (sympy.count_ops(t), sympy.default_sort_key(t)))[0]
    if isinstance(term, sympy.Abs):
        u, w = term.args[0], -term.args[0]
        first = atoms.compare("ge", u, 0)  # |u| = u when u >= 0, else -u
    elif isinstance(term, Select):
        first, u, w = atoms.lt0(term.args[0]), term.args[1], term.args[2]
    else:
        if len(term.args) != 2:
            raise Unproven("a min/max of more than two index expressions")
        u, w = term.args
        first = atoms.compare("le" if isinstance(term, sympy.Min) else "ge", u, w)
    sub = lambda e, r: sympy.sympify(e).xreplace({term: r})  # noqa: E731
    return sympy.Or(sympy.And(first, compare_split(atoms, op, sub(ea, u), sub(eb, u))),
                    sympy.And(sympy.Not(first), compare_split(atoms, op, sub(ea, w), sub(eb, w))))
