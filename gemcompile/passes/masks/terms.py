"""The comparisons a mask's formula is made of: lengths, sliding windows and fixed blocks.

Each function reads the propositions of a MaskEvaluator's formula over the scores' (b, h, i, j) and finds
the terms of one kind, as (proposition, parameters) for masks/classify.py to combine:

    j < len[b] + c,  i < len[b] + c     key and query padding (length_atoms)
    i - j <= w,  j - i <= w             window comparisons, w >= 1 a constant (window_atoms)
    i // b == j // b                    fixed blocks, b a constant (block_atoms)

Block terms are ``floor(i / b) - floor(j / b) == 0`` propositions; each one that is not exactly that (an
offset ``(i + 1) // b``, different query and key block sizes, a symbolic or tensor block size) gives the
reason for the refusal.
"""

from __future__ import annotations

import operator

import sympy
from torch import fx

from gemcompile.passes.graph import Unproven, target_name
from gemcompile.passes.masks.evaluator import MaskEvaluator, index_symbol


def length_atoms(evaluator: MaskEvaluator, comparisons, index: sympy.Symbol):
    """(lengths node, offset, proposition) for each comparison `index < len[b] + offset`."""
    found = []
    for kind, e in comparisons:
        if kind != "lt":
            continue
        for sign in (1, -1):
            # e < 0 with e = index - len(b) - offset, or its complement form
            candidate = e if sign == 1 else sympy.expand(-e - 1)
            rest = sympy.expand(index - candidate)  # = len(b) + offset
            funcs = [f for f in rest.atoms(sympy.Function) if f.func.__name__ in evaluator.leaves]
            if len(funcs) != 1:
                continue
            offset = sympy.expand(rest - funcs[0])
            if offset.free_symbols or not offset.is_integer:
                continue
            node = evaluator.leaves[funcs[0].func.__name__]
            found.append((node, int(offset), evaluator.atoms.lt0(candidate)))
    unique = {}
    for node, offset, prop in found:
        unique[(node, offset)] = (node, offset, prop)
    return list(unique.values())


def window_atoms(evaluator: MaskEvaluator, comparisons) -> tuple[dict[int, object], dict[int, object]]:
    """{w: proposition} for `i - j <= w` (back) and `j - i <= w` (forward) comparisons with w >= 1."""
    i, j = index_symbol(1), index_symbol(0)
    back, forward = {}, {}
    for kind, e in comparisons:
        if kind != "lt" or e.free_symbols != {i, j}:
            continue
        if not e.is_polynomial(i, j):  # a data function of a position, say: not a window
            continue
        for candidate in (e, sympy.expand(-e - 1)):  # the comparison and its complement
            poly = sympy.Poly(candidate, i, j)
            if poly.total_degree() != 1:
                continue
            a, b = poly.coeff_monomial(i), poly.coeff_monomial(j)
            c = poly.coeff_monomial(1)
            w = -c - 1  # a*i + b*j + c < 0  <=>  a*i + b*j <= -c - 1
            if not (w.is_integer and w >= 1):
                continue
            if (a, b) == (1, -1):
                back[int(w)] = evaluator.atoms.lt0(candidate)
            elif (a, b) == (-1, 1):
                forward[int(w)] = evaluator.atoms.lt0(candidate)
    return back, forward


def _floor_index(term: sympy.floor, evaluator: MaskEvaluator) -> tuple[sympy.Symbol, object, object]:
    """floor(a * x + c) with x the query or key index: (x, the block size 1/a, the offset c/a), where size
    and offset may be non-constant (the caller says why that is refused)."""
    i, j = index_symbol(1), index_symbol(0)
    arg = sympy.expand(term.args[0])
    indices = arg.free_symbols & {i, j}
    if len(indices) != 1:
        raise Unproven(f"the block index {_show(term)} is not a function of one position")
    (x,) = indices
    a = arg.coeff(x)
    if a == 0 or a.free_symbols & {i, j}:
        raise Unproven(f"the block index {_show(term)} is not linear in the position")
    c = sympy.expand(arg - a * x)
    return x, sympy.simplify(1 / a), sympy.simplify(c / a)


def _show(e) -> str:
    names = {index_symbol(3): "b", index_symbol(2): "h", index_symbol(1): "i", index_symbol(0): "j"}
    return str(sympy.sympify(e).subs(names))


def block_atoms(evaluator: MaskEvaluator, keep) -> dict[int, object]:
    """{block size: proposition} for each `i // b == j // b` comparison; Unproven with the reason for a
    comparison of block indices that is not exactly that."""
    i, j = index_symbol(1), index_symbol(0)
    found = {}
    for atom in sorted(keep.free_symbols, key=str):
        kind, e = evaluator.atoms.expr_of[atom]
        floors = sorted(e.atoms(sympy.floor), key=sympy.default_sort_key)
        if not floors:
            continue
        parsed = [(_floor_index(f, evaluator), f) for f in floors]
        for (x, size, offset), f in parsed:
            if size.free_symbols or any(getattr(g, "func", None) is not None and g.func.__name__ in evaluator.leaves
                                        for g in sympy.sympify(size).atoms(sympy.Function)):
                raise Unproven(f"the block size in {_show(f)} is not a constant")
            if not (size.is_Integer and size > 0):
                raise Unproven(f"the block size in {_show(f)} is {_show(size)}, not a positive integer")
        by_index = {}
        for (x, size, offset), f in parsed:
            by_index.setdefault(x, []).append((int(size), offset, f))
        if set(by_index) != {i, j} or len(floors) != 2:
            raise Unproven(f"the mask compares {_show(e)} {'< 0' if kind == 'lt' else '== 0'}: not query blocks "
                           "against key blocks")
        ((size_i, off_i, f_i),), ((size_j, off_j, f_j),) = by_index[i], by_index[j]
        if size_i != size_j:
            raise Unproven(f"query blocks of {size_i} and key blocks of {size_j} differ "
                           f"({_show(f_i)} vs {_show(f_j)})")
        if off_i != 0 or off_j != 0:
            raise Unproven(f"the blocks are offset ({_show(f_i)}, {_show(f_j)}): the kernel's blocks start at "
                           "position 0")
        rest = sympy.expand(e - (f_i - f_j))
        rest_neg = sympy.expand(e + (f_i - f_j))
        if kind != "eq" or not (rest == 0 or rest_neg == 0):
            raise Unproven(f"the mask compares block indices as {_show(e)} {'< 0' if kind == 'lt' else '== 0'}, "
                           "not i // b == j // b")
        found[size_i] = atom
    return found


def check_constant_windows(evaluator: MaskEvaluator, keep) -> None:
    """Every comparison of the query and key positions has a constant distance; Unproven otherwise."""
    i, j = index_symbol(1), index_symbol(0)
    for atom in keep.free_symbols:
        _, e = evaluator.atoms.expr_of[atom]
        if not {i, j} <= e.free_symbols or e.atoms(sympy.floor):
            continue
        leaves = [f for f in e.atoms(sympy.Function) if f.func.__name__ in evaluator.leaves]
        if leaves:
            raise Unproven(f"the window {_show(e)} < 0 depends on the tensor "
                           f"{evaluator.leaves[leaves[0].func.__name__].name}: not a constant size")
        others = e.free_symbols - {index_symbol(k) for k in range(4)}
        if others:
            raise Unproven(f"the window {_show(e)} < 0 has a symbolic size ({', '.join(map(str, others))}): "
                           "not a constant")


def is_structured(evaluator: MaskEvaluator, keep) -> bool:
    """Whether the mask relates query and key positions beyond causality (a block or window term)."""
    i, j = index_symbol(1), index_symbol(0)
    causal = evaluator.atoms.compare("le", j, i)
    causal_atom = next(iter(causal.free_symbols)) if causal.free_symbols else None
    for atom in keep.free_symbols:
        _, e = evaluator.atoms.expr_of[atom]
        if e.atoms(sympy.floor) and e.free_symbols & {i, j}:
            return True
        if {i, j} <= e.free_symbols and atom is not causal_atom:
            return True
    return False


# -- reporting: which unprovable masks were meant as blocks or windows ---------------------------------

_STRUCTURE_OPS = ("floordiv", "floor_divide", "div", "divide", "abs", "remainder", "mod", "fmod", "block_diag",
                  "__floordiv__", "__mod__", "__abs__")


def mentions_structure(mask_nodes: list[fx.Node], depth: int = 16) -> bool:
    """Whether the mask's subgraph holds an op that block or window masks are built with (floor division,
    abs, a shifted tril/triu): a softmax mask that cannot be proven is the block family's refusal only
    then, else the jagged family's (reporting only; no rewrite depends on it)."""
    seen: set[fx.Node] = set()
    work = [(n, depth) for n in mask_nodes]
    while work:
        node, d = work.pop()
        if node in seen or d < 0:
            continue
        seen.add(node)
        if node.op in ("call_function", "call_method"):
            name = target_name(node)
            if name in _STRUCTURE_OPS or node.target in (abs, operator.floordiv, operator.mod):
                return True
            if name in ("tril", "triu") and node.kwargs.get("diagonal", node.args[1] if len(node.args) > 1 else 0):
                return True
        work.extend((a, d - 1) for a in node.all_input_nodes)
    return False
