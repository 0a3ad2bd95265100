"""Whether two mask formulas are the same mask: the one equivalence prover of the mask classifier.

Formulas are propositional over the comparisons of one MaskEvaluator (``evaluator.atoms``). Equivalence is
decided soundly (never equal by mistake): a sampled rejection first (concrete indices and lengths where
the two disagree), then a truth table (or SAT for many atoms) under the facts of integer order that
propositional logic alone does not know (``x < 0`` implies ``x - 1 < 0``...).
"""

from __future__ import annotations

import itertools
import random

import sympy
from sympy.logic.boolalg import Boolean
from sympy.logic.inference import satisfiable

from gemcompile.passes.masks.evaluator import MaskEvaluator, index_symbol
from gemcompile.passes.masks.linear import feasible


def _order_axioms(evaluator: MaskEvaluator, formula):
    """Implications between comparisons of one linear form (x < 0 implies x - 1 < 0, ...): facts of integer
    order that propositional equivalence alone does not know. Sound: each axiom holds for all integers."""
    lts = [(a, e) for a in formula.free_symbols for kind, e in [evaluator.atoms.expr_of[a]] if kind == "lt"]
    axioms = []
    for (a, ea), (b, eb) in itertools.combinations(lts, 2):
        for sign in (1, -1):
            c = sympy.expand(eb - sign * ea)
            if not c.is_number:
                continue
            if sign == 1:  # eb = ea + c
                axioms.append(sympy.Implies(a, b) if c <= 0 else sympy.Implies(b, a))
            else:  # eb = -ea + c
                if c >= -1:
                    axioms.append(sympy.Implies(a, sympy.Not(b)))
                if c <= -1:
                    axioms.append(sympy.Implies(sympy.Not(a), b))
    axioms += _equality_axioms(evaluator, formula, lts)
    return sympy.And(*axioms)


def _equality_axioms(evaluator: MaskEvaluator, formula, lts) -> list:
    """Facts linking an equality e == 0 with comparisons of the same form (e + c < 0 or -e + c < 0): the
    equality fixes each comparison, and two comparisons that pin e to 0 imply it. HSTU writes causal as
    ``(i == j) | (i - j > 0)``: equal to ``j <= i`` only with these."""
    axioms = []
    for eq_atom in formula.free_symbols:
        kind, e = evaluator.atoms.expr_of[eq_atom]
        if kind != "eq":
            continue
        lower, upper = [], []  # literals meaning e >= 0 and e <= 0
        for atom, lt in lts:
            for sign in (1, -1):
                c = sympy.expand(lt - sign * e)
                if not c.is_number:
                    continue
                # with e = 0 the comparison is c < 0
                axioms.append(sympy.Implies(eq_atom, atom if c < 0 else sympy.Not(atom)))
                if sign == 1:  # e + c < 0 <=> e <= -c - 1;  not: e >= -c
                    (upper if -c - 1 == 0 else []).append(atom)
                    (lower if -c == 0 else []).append(sympy.Not(atom))
                else:  # -e + c < 0 <=> e >= c + 1;  not: e <= c
                    (lower if c + 1 == 0 else []).append(atom)
                    (upper if c == 0 else []).append(sympy.Not(atom))
        axioms += [sympy.Implies(sympy.And(lo, up), eq_atom) for lo in lower for up in upper]
    return axioms


def decided_by_index_ranges(evaluator: MaskEvaluator, keep: Boolean) -> Boolean:
    """``keep`` with each comparison that index ranges alone decide replaced by its value: indices are never
    negative, so ``i < 0`` is False and ``i >= 0`` True (transformers 5 ands its padding mask with
    ``q_idx >= 0``). Sound: a comparison is replaced only when its negation has no solution with indices
    >= 0 (linear.feasible)."""
    indices = {index_symbol(k) for k in range(4)}
    values = {}
    for atom in keep.free_symbols:
        kind, e = evaluator.atoms.expr_of[atom]
        if not feasible([(kind, e, True)], indices):
            values[atom] = sympy.false
        elif not feasible([(kind, e, False)], indices):
            values[atom] = sympy.true
    return keep.xreplace(values) if values else keep


def _differs_on_samples(evaluator: MaskEvaluator, keep, candidate, samples: int = 256) -> bool:
    """A cheap sound rejection: some concrete (b, h, i, j, lengths) where the two masks disagree."""
    atoms = sorted(sympy.And(keep, candidate).free_symbols, key=str)
    exprs = [evaluator.atoms.expr_of[a] for a in atoms]
    functions = sorted({f for _, e in exprs for f in e.atoms(sympy.Function)}, key=str)
    indices = sorted({s for _, e in exprs for s in e.free_symbols}, key=str)
    test = sympy.lambdify(atoms, sympy.Xor(keep, candidate), "math")
    rng = random.Random(0)
    for _ in range(samples):
        hi = rng.choice((3, 6, 12, 24))  # small ranges too: boundary cases (t == n, i == j) come up often
        point = {f: rng.randint(0, hi) for f in functions}
        point.update({s: rng.randint(0, hi) for s in indices})
        truth = []
        for kind, e in exprs:
            value = e.xreplace(point)
            truth.append(bool(value < 0) if kind == "lt" else bool(value == 0))
        if test(*truth):
            return True
    return False


def equivalent(evaluator: MaskEvaluator, keep: Boolean, candidate: Boolean) -> bool:
    """Whether the two formulas keep the same scores, for all integer indices and lengths."""
    if _differs_on_samples(evaluator, keep, candidate):
        return False
    axioms = _order_axioms(evaluator, sympy.And(keep, candidate))
    atoms = sorted(sympy.And(keep, candidate).free_symbols, key=str)
    if len(atoms) > TRUTH_TABLE_ATOMS:
        return not satisfiable(sympy.And(axioms, sympy.Xor(keep, candidate)))
    # few atoms: a truth table is far faster than sympy's CNF conversion of the Xor of two formulas
    differs = sympy.lambdify(atoms, sympy.Xor(keep, candidate), "math")
    consistent = sympy.lambdify(atoms, axioms, "math")
    rows = [bits for bits in itertools.product((False, True), repeat=len(atoms))
            if differs(*bits) and consistent(*bits)]
    if not rows:
        return True
    if len(rows) > _LINEAR_ROWS:
        return False
    # rows that differ but are impossible in integer arithmetic (the order axioms relate one form only)
    indices = {index_symbol(k) for k in range(4)}
    exprs = [evaluator.atoms.expr_of[a] for a in atoms]
    return not any(feasible([(kind, e, bit) for (kind, e), bit in zip(exprs, bits)], indices) for bits in rows)


TRUTH_TABLE_ATOMS = 20
"""The most comparisons a formula pair is decided for by a truth table; past it, sympy's SAT (slow on big formulas)."""

_LINEAR_ROWS = 1024
"""The most differing truth-table rows checked by linear arithmetic (each a Fourier-Motzkin run)."""


def render(evaluator: MaskEvaluator, pred: Boolean, names: dict | None = None) -> str:
    """The formula with its comparisons spelled over b, h, i, j (or ``names``: index symbol -> name), for
    explain (data read as x[b, j])."""
    if names is None:
        names = {index_symbol(3): "b", index_symbol(2): "h", index_symbol(1): "i", index_symbol(0): "j"}
    names = {s: sympy.Symbol(n) if isinstance(n, str) else n for s, n in names.items()}
    replace = {}
    for atom in pred.free_symbols:
        kind, e = evaluator.atoms.expr_of[atom]
        if kind == "eq" and sympy.Add.make_args(e)[0].could_extract_minus_sign():
            e = -e  # e == 0 reads better with a positive lead
        data = {f: sympy.Symbol(f"{evaluator.data[f.func.__name__].node.name}"
                                f"[{', '.join(str(sympy.sympify(a).subs(names)) for a in f.args)}]")
                for f in e.atoms(sympy.Function) if f.func.__name__ in evaluator.data}
        e = e.xreplace(data).subs(names)
        replace[atom] = sympy.Symbol(f"({e} {'< 0' if kind == 'lt' else '== 0'})")
    return str(pred.xreplace(replace))
