"""Which AttentionMask a mask's formula is, proven: the one classifier of every attention kernel family.

``classify`` takes the keep-predicate of a mask over the scores' (b, h, i, j) (built by the
MaskEvaluator, masks/evaluator.py) and finds the combination of the terms of masks/terms.py

    j < kv_len[b] + c_k,   i < q_len[b] + c_q,   i // block == j // block,   j <= i,
    i - j <= w (and j - i <= w when not causal)

that is equivalent to it (masks/prover.py), else HSTU's causal target/contextual visibility, else raises
Unproven with the formula it found instead (``Unclassified``: each kernel family says in its own words
which masks it serves). Which family serves the mask is the caller's choice (passes/attention/).
``classify_length_mask`` is the padding-only subset (key padding [and query padding] [and causal]) that
the jagged kernel and the unpad pass's row masks take.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import operator

import sympy
import torch
from torch import fx

from gemcompile.passes.graph import Unproven, input_hint
from gemcompile.passes.masks.evaluator import MaskEvaluator, index_symbol
from gemcompile.passes.masks.model import AttentionMask, KeyVector
from gemcompile.passes.masks.prover import TRUTH_TABLE_ATOMS, decided_by_index_ranges, equivalent, render
from gemcompile.passes.masks.terms import block_atoms, check_constant_windows, length_atoms, window_atoms

LENGTH_MASKS = "(key index < lengths) [and query index < lengths] [and causal]"
"""The masks classify_length_mask accepts, as its refusals spell them."""

JAGGED_MASKS = ("(key index < lengths) [or a key mask read from data] [and query index < lengths] [or a query "
                "mask read from data] [and causal]")
"""The masks the jagged kernel serves, as its refusals spell them."""


class Unclassified(Unproven):
    """The formula is none of the masks AttentionMask models; ``formula`` says what it is instead."""

    def __init__(self, formula: str, key_padding: bool):
        super().__init__(f"the mask is {formula}")
        self.formula = formula
        self.key_padding = key_padding
        """Whether the formula compares the key index with lengths at all."""


def classify(evaluator: MaskEvaluator, keep, batch_is_one: bool = False, hstu: bool = True) -> AttentionMask:
    """The AttentionMask ``keep`` is (module docstring); with a batch of one the batch index is always 0,
    so lengths indexed by 0 are per-sample too. ``hstu=False`` skips the search for HSTU's visibilities (seconds
    per mask: unpad's row masks tried it on every candidate and never take one)."""
    b, h, i, j = (index_symbol(k) for k in (3, 2, 1, 0))
    if batch_is_one:  # the batch index is 0 everywhere: lengths read at 0 are lengths[b] (HSTU's targets too)
        keep = evaluator.lengths_at(keep, b)
    keep = decided_by_index_ranges(evaluator, keep)
    if keep is not sympy.true and len(keep.free_symbols) <= 8 and equivalent(evaluator, keep, sympy.true):
        keep = sympy.true  # (i < j) | (i > j) | (i == j): every pair, in a spelling logic alone does not see
    if keep is sympy.true:
        return AttentionMask(formula="True")
    if keep is sympy.false:
        raise Unproven("the mask drops every score")
    comparisons = [evaluator.atoms.expr_of[a] for a in keep.free_symbols]
    if any(h in e.free_symbols for _, e in comparisons):
        raise Unproven("the mask differs between heads")
    for _, e in comparisons:
        for f in e.atoms(sympy.Function):
            if f.func.__name__ in evaluator.leaves and f.args != (b,):
                why, name = evaluator.why.get(f.func.__name__), evaluator.leaves[f.func.__name__].name
                if all(a == 0 for a in f.args):
                    raise Unproven(f"{name} holds one value for the whole batch: the kernels read one length per "
                                   f"sample (give {name}.expand(B), B lengths)")
                raise Unproven(f"{name} is read per position, not per sample (lengths broadcast along the wrong "
                               "dim, or per-position data such as segment ids)" + (f"; {why}" if why else ""))
    check_data_positions(evaluator, comparisons)
    blocks = block_atoms(evaluator, keep)
    keys, queries = length_atoms(evaluator, comparisons, j), length_atoms(evaluator, comparisons, i)
    formula = render(evaluator, keep)
    found = _search(evaluator, keep, comparisons, keys, queries, blocks)
    if found is None and not blocks and hstu:
        found = _classify_hstu(evaluator, keep, keys, queries)
    if found is None:
        found = _with_key_vector(evaluator, keep, keys, queries, blocks)
    if found is None:
        found = _with_diagonal(evaluator, keep, batch_is_one, hstu)
    if found is not None:
        return dataclasses.replace(found, formula=formula)
    for size, atom in blocks.items():  # a telling reason for the one near-miss people write by accident
        for kv in keys:
            if equivalent(evaluator, keep, sympy.And(kv[2], sympy.Not(atom))):
                raise Unproven(f"the mask keeps pairs of different blocks (i // {size} != j // {size}): not "
                               "block-diagonal")
    check_constant_windows(evaluator, keep)
    # a formula over data says what it is rather than "no key padding"
    raise Unclassified(formula, key_padding=bool(keys) or _reads_data(evaluator, keep))


def _with_key_vector(evaluator: MaskEvaluator, keep, keys, queries, blocks) -> AttentionMask | None:
    """keep = K and R, with K the clauses over the sample and key position only (data, left padding: what
    no length term says) and R an AttentionMask of the other terms; None when keep does not split so."""
    clauses = _clauses(keep)
    if clauses is None:
        return None
    plain = {kv[2] for kv in keys} | {sympy.Not(kv[2]) for kv in keys}
    vector = [c for c in clauses if is_key_clause(evaluator, c) and c not in plain]
    # clauses over (b, i) that read data: a per-query vector (plain query lengths stay query padding)
    plain_q = {q[2] for q in queries} | {sympy.Not(q[2]) for q in queries}
    # (left padding i >= L - lengths[b] is one too: no query-length term says it)
    query = [c for c in clauses if c not in vector and c not in plain_q and _reads_only(evaluator, c, 1)]
    if not vector and not query:
        return None
    rest = sympy.And(*[c for c in clauses if c not in vector and c not in query])
    if rest is sympy.true:
        found = AttentionMask()
    else:
        comparisons = [evaluator.atoms.expr_of[a] for a in rest.free_symbols]
        rest_keys = [kv for kv in keys if kv[2] in rest.free_symbols]
        rest_queries = [q for q in queries if q[2] in rest.free_symbols]
        found = _search(evaluator, rest, comparisons, rest_keys, rest_queries, blocks)
        if found is None and not blocks:
            found = _classify_hstu(evaluator, rest, rest_keys, rest_queries)
        if found is None:
            return None
    if vector:
        formula = sympy.And(*vector)
        found = dataclasses.replace(found, key_vector=KeyVector(formula, evaluator, render(evaluator, formula)))
    if query:
        formula = sympy.And(*query)
        found = dataclasses.replace(found, query_vector=KeyVector(formula, evaluator, render(evaluator, formula),
                                                                  position=1))
    return found


def _with_diagonal(evaluator: MaskEvaluator, keep, batch_is_one: bool, hstu: bool) -> AttentionMask | None:
    """keep = M or i == j with M a mask of the other terms (the diagonal is kept even where M drops it: BST,
    XLNet's content stream); None when keep does not split so."""
    diagonal = evaluator.atoms.compare("eq", index_symbol(1), index_symbol(0))
    if diagonal not in keep.free_symbols:
        return None
    rest = keep.subs(diagonal, sympy.false)
    if not equivalent(evaluator, keep, sympy.Or(rest, diagonal)):
        return None
    try:
        found = classify(evaluator, rest, batch_is_one, hstu)
    except Unproven:
        return None
    return dataclasses.replace(found, diagonal=True)


def _clauses(keep) -> tuple | None:
    """keep's clauses in conjunctive normal form (None when that form is too large to be useful)."""
    if len(keep.free_symbols) > 12:
        return None
    if len(keep.free_symbols) > 8 and _cnf_clause_bound(sympy.to_nnf(keep, simplify=False)) > _MAX_CLAUSES:
        return None  # distributing would take minutes (generative-recommenders' contextual HSTU mask)
    cnf = sympy.to_cnf(keep, simplify=len(keep.free_symbols) <= 8, force=True)
    return cnf.args if isinstance(cnf, sympy.And) else (cnf,)


_MAX_CLAUSES = 256
"""Largest conjunctive normal form _clauses builds without simplification."""


def _cnf_clause_bound(nnf) -> int:
    """An upper bound on the clauses of nnf's CNF by distribution: an And adds its parts', an Or multiplies."""
    if isinstance(nnf, sympy.And):
        return sum(_cnf_clause_bound(a) for a in nnf.args)
    if isinstance(nnf, sympy.Or):
        return math.prod(_cnf_clause_bound(a) for a in nnf.args)
    return 1


def is_key_clause(evaluator: MaskEvaluator, clause) -> bool:
    """Whether every comparison of the clause reads only the sample b and the key position j."""
    return _reads_only(evaluator, clause, 0)


def _reads_only(evaluator: MaskEvaluator, clause, position: int) -> bool:
    """Whether every comparison of the clause reads only the sample b and index ``position`` (0: j, 1: i)."""
    allowed = {index_symbol(3), index_symbol(position)}
    indices = {index_symbol(k) for k in range(4)}
    for atom in clause.free_symbols:
        _, e = evaluator.atoms.expr_of[atom]
        if not (e.free_symbols & indices) <= allowed:
            return False
    return True


def _reads_data(evaluator: MaskEvaluator, clause) -> bool:
    """Whether a comparison of the clause reads a tensor the evaluator took as data."""
    for atom in clause.free_symbols:
        _, e = evaluator.atoms.expr_of[atom]
        if any(evaluator.data_function(f) is not None for f in e.atoms(sympy.Function)):
            return True
    return False


def check_data_positions(evaluator: MaskEvaluator, comparisons) -> None:
    """A mask read from data must be a per-key (b, j) or a per-query (b, i) vector: Unproven, naming the tensor,
    otherwise."""
    b, i, j = index_symbol(3), index_symbol(1), index_symbol(0)
    for _, e in comparisons:
        reads = [(f, evaluator.data_function(f)) for f in e.atoms(sympy.Function)]
        reads = [(f, leaf) for f, leaf in reads if leaf is not None]
        if not reads:
            continue
        where = set().union(*[a.free_symbols for f, _ in reads for a in f.args])
        leaf = reads[0][1]
        names = ", ".join(sorted({r.node.name for _, r in reads}))
        why = f" ({leaf.why})" if leaf.why else ""  # the first one's: why the prover reads it as data
        if {i, j} <= where and leaf.why and leaf.node.name in evaluator.fallback:
            # a pairwise tensor read as data only because an op building it is not modeled: that op is why
            raise Unproven(f"{leaf.why}; so {names} is read as data, at both the query and the key position "
                           "(only a per-key vector (b, j) read from data is served)")
        if {i, j} <= where:
            raise Unproven(f"the mask reads {names}{why} as data at both the query and the key position: only a "
                           "per-key vector (b, j) read from data is served" + _input_hint(reads))
        if not (where <= {b, j} or where <= {b, i}):
            raise Unproven(f"the mask reads {names}{why} as data at positions other than (b, j)")


def _input_hint(reads) -> str:
    """For a mask that is a graph input: where such an input often comes from."""
    inputs = [leaf.node for _, leaf in reads if leaf.node.op == "placeholder"]
    return "; " + input_hint(inputs[0]) if inputs else ""


def _search(evaluator: MaskEvaluator, keep, comparisons, keys, queries, blocks) -> AttentionMask | None:
    """The first combination of padding, block, causal and window terms equivalent to ``keep``."""
    i, j = index_symbol(1), index_symbol(0)
    causal_atom = evaluator.atoms.compare("le", j, i)
    back, forward = window_atoms(evaluator, comparisons)
    windows = [(False, None, []), (True, None, [causal_atom])]
    windows += [(True, w, [causal_atom, p]) for w, p in sorted(back.items())]
    windows += [(False, w, [p, forward[w]]) for w, p in sorted(back.items()) if w in forward]
    block_options = [(None, [])] + [(size, [atom]) for size, atom in sorted(blocks.items())]
    # key lengths first: an equivalent mask without them (i < n and j <= i implies j < n) tells the kernels
    # and unpad less
    for kv, q, (block, block_part), (causal, window, extra) in itertools.product(
            [*keys, None], [None, *queries], block_options, windows):
        parts = ([kv[2]] if kv else []) + ([q[2]] if q else []) + block_part + extra
        if parts and equivalent(evaluator, keep, sympy.And(*parts)):
            return AttentionMask(kv_lengths=kv[0] if kv else None, kv_offset=kv[1] if kv else 0,
                                 q_lengths=q[0] if q else None, q_offset=q[1] if q else 0, block=block,
                                 causal=causal, window=window)
    return None


def require_lengths(mask: AttentionMask) -> AttentionMask:
    """``mask`` when it is key padding by lengths [and query padding] [and causal]; Unproven otherwise."""
    if mask.key_vector is not None:
        raise Unproven(f"the key padding is read from data ({mask.key_vector.text}), not from lengths")
    if mask.query_vector is not None:
        raise Unproven(f"the query padding is read from data ({mask.query_vector.text}), not from lengths")
    if mask == AttentionMask():
        raise Unproven("the mask keeps every score: nothing to skip")
    if mask.diagonal:
        raise Unproven(f"the mask keeps the diagonal i == j besides the lengths: it is {mask.formula}")
    if mask.kv_lengths is None:
        raise Unproven("no key-padding mask (index < lengths along the key dim) was found in the mask")
    if mask.structured:
        raise Unproven(f"the mask is not {LENGTH_MASKS}: it is {mask.formula}")
    return mask


def require_padding_or_causal(mask: AttentionMask) -> AttentionMask:
    """``mask`` when it is key padding (by lengths or read from data) [and query padding] [and causal], or
    causal alone (the kernel skips the upper triangle); Unproven otherwise."""
    if mask.structured:
        raise Unproven(f"the mask is not {JAGGED_MASKS}: it is {mask.formula}")
    if (mask.kv_lengths is not None or mask.key_vector is not None or mask.query_vector is not None
            or (mask.causal and mask.q_lengths is None)):
        return mask
    if mask == AttentionMask():
        raise Unproven("the mask keeps every score: nothing to skip")
    raise Unproven("no key-padding mask (index < lengths along the key dim) was found in the mask")


def length_refusal(error: Unclassified) -> Unproven:
    """classify_length_mask's words for a formula that is no AttentionMask."""
    if not error.key_padding:
        return Unproven("no key-padding mask (index < lengths along the key dim) was found in the mask")
    return Unproven(f"the mask is not {JAGGED_MASKS}: it is {error.formula}")


def classify_length_mask(evaluator: MaskEvaluator, keep, batch_is_one: bool = False) -> AttentionMask:
    """``keep`` as key padding [and query padding] [and causal]; Unproven otherwise."""
    try:
        return require_lengths(classify(evaluator, keep, batch_is_one, hstu=False))  # HSTU's: never lengths
    except Unclassified as error:
        raise length_refusal(error) from None


# -- HSTU: causal visibility with targets and a contextual prefix --------------------------------------

def hstu_visible(evaluator: MaskEvaluator, i, j, n, t, contextual: int, window: int):
    """HSTU's causal visibility of key j from query i in a sequence of n tokens whose last t are targets and
    whose first `contextual` tokens are contextual (position ids clamped as in generative-recommenders'
    reference mask); the kernel implements the same formula."""
    compare = evaluator.compare_exprs
    ii, jj, m = i, j, n
    if contextual:
        ii, jj, m = sympy.Max(i - contextual + 1, 0), sympy.Max(j - contextual + 1, 0), n - contextual + 1
    if t is not None:
        m = m - t
        ii, jj = sympy.Min(ii, m), sympy.Min(jj, m)
    visible = sympy.Or(evaluator.atoms.compare("eq", i, j), compare("gt", ii - jj, 0))
    if window:
        visible = sympy.And(visible, compare("le", ii - jj, window))
    if contextual:
        visible = sympy.Or(visible, sympy.And(compare("eq", ii, 0), compare("lt", jj, m)))
    return visible


def _classify_hstu(evaluator: MaskEvaluator, keep, keys, queries) -> AttentionMask | None:
    """Key padding [and query padding] and HSTU's causal target/contextual visibility [within a window], or
    None. The contextual lengths tried are the constants the formula holds (and their neighbours), the
    windows its `i - j <= w` comparisons (the case of HSTU's clamped distance where neither id is clamped)."""
    b, i, j = index_symbol(3), index_symbol(1), index_symbol(0)
    constants = set()
    for a in keep.free_symbols:
        for term in sympy.Add.make_args(evaluator.atoms.expr_of[a][1]):
            if term.is_Integer:
                constants.update({abs(int(term)) - 1, abs(int(term)), abs(int(term)) + 1})
    sizes = sorted(c for c in constants | {1} if c >= 1)  # (a prefix of 1 shifts no id: no constant shows it)
    back, _ = window_atoms(evaluator, [evaluator.atoms.expr_of[a] for a in keep.free_symbols])
    options = [(c, w) for w in [0, *sorted(back)] for c in [0, *sizes]]  # (contextual, window), no window first
    for kv_node, kv_offset, kv_atom in keys:
        if kv_offset != 0:
            continue
        n = sympy.Function(f"len_{kv_node.name}")(b)
        target_options = [None] + [node for node in evaluator.leaves.values() if node is not kv_node]
        for t_node, (contextual, window) in itertools.product(target_options, options):
            if t_node is None and not contextual:
                continue  # plain causal [and window]: handled above
            t = None if t_node is None else sympy.Function(f"len_{t_node.name}")(b)
            visible = hstu_visible(evaluator, i, j, n, t, contextual, window)
            for q in [None, *[x for x in queries if x[0] is kv_node and x[1] == 0]]:
                candidate = sympy.And(kv_atom, visible, *([q[2]] if q else []))
                if window and not _by_truth_table(keep, candidate):
                    continue
                if equivalent(evaluator, keep, candidate):
                    if t_node is not None and window:  # the kernels' tile ranges with a window assume t >= 0
                        _require_nonnegative(evaluator, t_node)
                    return AttentionMask(kv_lengths=kv_node, q_lengths=q[0] if q else None, causal=True,
                                         num_targets=t_node, contextual_len=contextual, window=window or None)
    # no padding term on the rows (a contextual term may still compare j with n): rows i >= n dropped after?
    # HSTU's masks keep the diagonal (eye | ...): without a key term or that, none of its visibilities
    diagonal = next(iter(evaluator.atoms.compare("eq", i, j).free_symbols))
    if not keys or diagonal in keep.free_symbols:
        return _hstu_without_padding(evaluator, keep, options)
    return None


def _hstu_without_padding(evaluator: MaskEvaluator, keep, options) -> AttentionMask | None:
    """generative-recommenders' target (or contextual) mask has no `j < n` term (padded keys are zeros there,
    padded rows are dropped afterwards): the mask that equals HSTU's visibility with key padding on every row
    i < n, with ``rows_dropped_after`` set (the family must prove the model drops rows i >= n, or refuse)."""
    b, i, j = index_symbol(3), index_symbol(1), index_symbol(0)
    leaves = list(evaluator.leaves.values())
    for n_node, t_node in [*itertools.permutations(leaves, 2), *((n_node, None) for n_node in leaves)]:
        n = sympy.Function(f"len_{n_node.name}")(b)
        t = None if t_node is None else sympy.Function(f"len_{t_node.name}")(b)
        rows = evaluator.atoms.compare("lt", i, n)
        for contextual, window in options:
            if t is None and not contextual:
                continue  # plain causal [and window] reads no lengths
            visible = hstu_visible(evaluator, i, j, n, t, contextual, window)
            lhs, rhs = sympy.And(keep, rows), sympy.And(visible, evaluator.atoms.compare("lt", j, n), rows)
            if window and not _by_truth_table(lhs, rhs):
                continue
            if not equivalent(evaluator, lhs, rhs):
                if t is None or not contextual or not _by_truth_table(lhs, rhs, 1):
                    continue
                # with a contextual prefix, negative target counts let the prefix see padded keys: assume
                # t >= 0 (what HSTU's data holds) and check it on the device at every call
                at_least_zero = evaluator.atoms.compare("ge", t, 0)
                if not equivalent(evaluator, sympy.And(lhs, at_least_zero), sympy.And(rhs, at_least_zero)):
                    continue
                _require_nonnegative(evaluator, t_node)
            elif t is not None and window:  # the kernels' tile ranges with a window assume t >= 0
                _require_nonnegative(evaluator, t_node)
            return AttentionMask(kv_lengths=n_node, causal=True, num_targets=t_node, contextual_len=contextual,
                                 window=window or None, rows_dropped_after=True)
    return None


def _by_truth_table(keep, candidate, extra: int = 0) -> bool:
    """Whether the prover decides the pair by its truth table: the windows and assumptions HSTU's search adds
    are tried only then (past it sympy's SAT took minutes on a prefix, targets and a window together)."""
    return len(keep.free_symbols | candidate.free_symbols) + extra <= TRUTH_TABLE_ATOMS


def _require_nonnegative(evaluator: MaskEvaluator, node: fx.Node) -> None:
    """Ask the rewrite for the device check that ``node``'s target counts are >= 0, once per mask."""
    if not any(getattr(c, "func", None) is _emit_nonnegative_check and c.keywords["node"] is node
               for c in evaluator.checks):
        evaluator.checks.append(functools.partial(_emit_nonnegative_check, node=node))


def _emit_nonnegative_check(emit, node: fx.Node) -> None:
    """A device-side assert (no host sync) that target counts are >= 0, which the rewrite of HSTU's mask with a
    contextual prefix or a window assumed: the run stops with this message instead of computing a mask the
    model did not mean."""
    ok = emit.call(torch.all, (emit.call(operator.ge, (node, 0)),))
    emit.call(torch._assert_async, (ok, f"gemcompile: {node.name} holds a negative target count; the attention "
                                        "rewrite of HSTU's mask with a contextual prefix or a window assumed "
                                        "counts >= 0"))
