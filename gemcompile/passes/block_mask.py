"""What a block-diagonal or sliding-window attention mask is, proven.

``classify_block_mask`` takes the keep-predicate of a mask over the scores' (b, h, i, j) (built by
mask_provenance's evaluator) and finds the combination of

    j < len[b] + c                      key padding (required)
    i // block == j // block            fixed blocks, block a constant           (optional)
    |i - j| <= w   (i - j <= w causal)  a sliding window, w a constant           (optional)
    j <= i                              causal                                   (optional)
    i < len'[b] + c'                    query padding                            (optional, see below)

that is equivalent to it (gdpa_mask's proof: sampled rejection, then a truth table over the comparisons
with the facts of integer order), or says why not. A mask with neither a block nor a window term is
not a block mask (``None``): plain padding and causal masks are the jagged-attention pass's.

Block terms are ``floor(i / b) - floor(j / b) == 0`` propositions; each one that is not exactly that (an
offset ``(i + 1) // b``, different query and key block sizes, a symbolic or tensor block size) gives the
reason for the refusal. Window terms are gdpa_mask's window comparisons (``i - j <= w``, ``j - i <= w``).
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass

import sympy
import torch
from torch import fx

from gemcompile.passes.gdpa_mask import _equivalent, _window_atoms
from gemcompile.passes.mask_provenance import (
    MaskEvaluator,
    Unproven,
    _length_atoms,
    _name_of,
    _render,
    example_value,
    index_symbol,
)


class BlockMaskEvaluator(MaskEvaluator):
    """mask_provenance's evaluator, plus ``torch.div(a, b, rounding_mode="floor")`` of integer indices
    (the block index spelled without ``//``); "trunc" is left unmodeled (it differs from floor below 0)."""

    def _evaluate_node(self, node: fx.Node):
        value = example_value(node)
        if (node.op in ("call_function", "call_method") and _name_of(node.target) in ("div", "divide")
                and node.kwargs.get("rounding_mode") == "floor" and isinstance(value, torch.Tensor)
                and not value.dtype.is_floating_point and value.dtype != torch.bool and len(node.args) >= 2):
            return self._arith(operator.floordiv, node.args[0], node.args[1], value.dim(), value)
        return super()._evaluate_node(node)


@dataclass(frozen=True)
class BlockMask:
    """scores[b, h, i, j] are kept iff j < lengths[b] + offset and every present condition holds."""

    lengths: fx.Node
    offset: int = 0
    block: int = 0
    """Block size; 0: no block term."""
    window: int = -1
    """|i - j| <= window (i - j <= window when causal); -1: no window term."""
    causal: bool = False
    q_lengths: fx.Node | None = None
    q_offset: int = 0

    def describe(self) -> str:
        parts = [f"keys j < {self.lengths.name}[b]" + (f" + {self.offset}" if self.offset else "")]
        if self.block:
            parts.append(f"blocks i // {self.block} == j // {self.block}")
        if self.window >= 0:
            parts.append(f"window {'i - j' if self.causal else '|i - j|'} <= {self.window}")
        if self.causal:
            parts.append("causal j <= i")
        if self.q_lengths is not None:
            parts.append(f"queries i < {self.q_lengths.name}[b]" + (f" + {self.q_offset}" if self.q_offset else ""))
        return " and ".join(parts)


# -- the block and window comparisons ------------------------------------------------------------------

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


def _block_atoms(evaluator: MaskEvaluator, keep) -> dict[int, object]:
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


def _check_constant_windows(evaluator: MaskEvaluator, keep) -> None:
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


def classify_block_mask(evaluator: MaskEvaluator, keep, batch_is_one: bool = False) -> BlockMask | None:
    """The block/window mask ``keep`` is (see the module docstring); None when it has no block or window
    term; Unproven with the reason when it has one but is not a combination the kernel computes."""
    b, h, i, j = (index_symbol(k) for k in (3, 2, 1, 0))
    if keep is sympy.true or keep is sympy.false or not is_structured(evaluator, keep):
        return None
    comparisons = [evaluator.atoms.expr_of[a] for a in keep.free_symbols]
    if any(h in e.free_symbols for _, e in comparisons):
        raise Unproven("the mask differs between heads")
    blocks = _block_atoms(evaluator, keep)
    _check_constant_windows(evaluator, keep)
    for _, e in comparisons:
        for f in e.atoms(sympy.Function):
            if f.func.__name__ in evaluator.leaves and f.args != (b,) and not (batch_is_one and f.args == (0,)):
                raise Unproven(f"{evaluator.leaves[f.func.__name__].name} is indexed by a position, not by the batch")
    keys = _length_atoms(evaluator, comparisons, j)
    if not keys:
        raise Unproven("no key-padding mask (key index < lengths) in the block/window mask: the kernel needs "
                       f"the lengths; the mask is {_render(evaluator, keep)}")
    queries = [None, *_length_atoms(evaluator, comparisons, i)]
    causal_atom = evaluator.atoms.compare("le", j, i)
    back, forward = _window_atoms(evaluator, comparisons)
    windows = [(False, -1, []), (True, -1, [causal_atom])]
    windows += [(True, w, [causal_atom, p]) for w, p in sorted(back.items())]
    windows += [(False, w, [p, forward[w]]) for w, p in sorted(back.items()) if w in forward]
    block_options = [(size, [atom]) for size, atom in sorted(blocks.items())] + [(0, [])]
    for (block, block_part), (causal, window, extra), kv, q in itertools.product(block_options, windows, keys, queries):
        if not block and window < 0:
            continue  # no structure: not ours
        parts = [kv[2], *block_part, *extra] + ([q[2]] if q else [])
        if _equivalent(evaluator, keep, sympy.And(*parts)):
            return BlockMask(kv[0], kv[1], block, window, causal, q[0] if q else None, q[1] if q else 0)
    for size, atom in blocks.items():  # a telling reason for the one near-miss people write by accident
        for kv in keys:
            if _equivalent(evaluator, keep, sympy.And(kv[2], sympy.Not(atom))):
                raise Unproven(f"the mask keeps pairs of different blocks (i // {size} != j // {size}): not "
                               "block-diagonal")
    raise Unproven("the mask is not key padding and fixed blocks and/or a sliding window [and causal]: "
                   f"it is {_render(evaluator, keep)}")


# -- reporting: which unprovable masks are worth a refusal from this pass --------------------------------

_STRUCTURE_OPS = ("floordiv", "floor_divide", "div", "divide", "abs", "remainder", "mod", "fmod", "block_diag",
                  "__floordiv__", "__mod__", "__abs__")


def mentions_structure(mask_nodes: list[fx.Node], depth: int = 16) -> bool:
    """Whether the mask's subgraph holds an op that block or window masks are built with (floor division,
    abs, a shifted tril/triu): a mask this pass cannot evaluate is reported only then (reporting only;
    no rewrite depends on it)."""
    seen: set[fx.Node] = set()
    work = [(n, depth) for n in mask_nodes]
    while work:
        node, d = work.pop()
        if node in seen or d < 0:
            continue
        seen.add(node)
        if node.op in ("call_function", "call_method"):
            name = _name_of(node.target)
            if name in _STRUCTURE_OPS or node.target in (abs, operator.floordiv, operator.mod):
                return True
            if name in ("tril", "triu") and node.kwargs.get("diagonal", node.args[1] if len(node.args) > 1 else 0):
                return True
        work.extend((a, d - 1) for a in node.all_input_nodes)
    return False
