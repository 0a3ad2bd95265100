"""What a GDPA mask is, proven: key padding, query padding, causal and a local window, in any
combination (also none), and the query-padding mask a model applies after the attention.

``classify_gdpa_mask`` takes the keep-predicate of a mask over the scores' (b, h, i, j) (built by
mask_provenance's evaluator) and finds the combination of

    j < kv_len[b] + c_k,   i < q_len[b] + c_q,   j <= i,   i - j <= w (and j - i <= w when not causal)

that is propositionally equivalent to it, or raises Unproven with the formula it found instead.
``downstream_row_mask`` proves that an attention output only matters at rows i < q_len[b]: every use
goes through row-wise ops (views that keep the batch and query dims, casts, a Linear over the last
dim) to a multiplication by such a row mask, so padded query rows may come out as anything (the
kernel writes 0) without changing the model.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import sympy
import torch
from sympy.logic.inference import satisfiable
import torch.fx as fx

from gemcompile.passes.mask_provenance import (
    MaskEvaluator,
    Unproven,
    _length_atoms,
    _render,
    equivalent,
    example_value,
    index_symbol,
)


@dataclass(frozen=True)
class GdpaMask:
    """scores[b, h, i, j] are kept iff every present condition holds (None / 0: absent)."""

    kv_lengths: fx.Node | None = None
    kv_offset: int = 0
    q_lengths: fx.Node | None = None
    q_offset: int = 0
    causal: bool = False
    window: int = 0
    num_targets: fx.Node | None = None
    contextual_len: int = 0

    def describe(self) -> str:
        parts = []
        if self.kv_lengths is not None:
            parts.append(f"keys j < {self.kv_lengths.name}[b]" + (f" + {self.kv_offset}" if self.kv_offset else ""))
        if self.q_lengths is not None:
            parts.append(f"queries i < {self.q_lengths.name}[b]" + (f" + {self.q_offset}" if self.q_offset else ""))
        if self.causal:
            parts.append("causal j <= i")
        if self.window:
            parts.append(f"window {'i - j' if self.causal else '|i - j|'} <= {self.window}")
        if self.num_targets is not None:
            parts.append(f"the last {self.num_targets.name}[b] tokens are targets (they see the history and "
                         "themselves)")
        if self.contextual_len:
            parts.append(f"the first {self.contextual_len} tokens are contextual (fully visible)")
        return " and ".join(parts) if parts else "no mask"


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
    return sympy.And(*axioms)


def _differs_on_samples(evaluator: MaskEvaluator, keep, candidate, samples: int = 256) -> bool:
    """A cheap sound rejection: some concrete (b, h, i, j, lengths) where the two masks disagree."""
    atoms = sorted(sympy.And(keep, candidate).free_symbols, key=str)
    exprs = [evaluator.atoms.expr_of[a] for a in atoms]
    functions = sorted({f for _, e in exprs for f in e.atoms(sympy.Function)}, key=str)
    indices = sorted({s for _, e in exprs for s in e.free_symbols}, key=str)
    test = sympy.lambdify(atoms, sympy.Xor(keep, candidate), "math")
    rng = __import__("random").Random(0)
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


def _equivalent(evaluator: MaskEvaluator, keep, candidate) -> bool:
    if _differs_on_samples(evaluator, keep, candidate):
        return False
    axioms = _order_axioms(evaluator, sympy.And(keep, candidate))
    atoms = sorted(sympy.And(keep, candidate).free_symbols, key=str)
    if len(atoms) > 20:
        return not satisfiable(sympy.And(axioms, sympy.Xor(keep, candidate)))
    # few atoms: a truth table is far faster than sympy's CNF conversion of the Xor of two formulas
    differs = sympy.lambdify(atoms, sympy.Xor(keep, candidate), "math")
    consistent = sympy.lambdify(atoms, axioms, "math")
    return not any(differs(*bits) and consistent(*bits)
                   for bits in itertools.product((False, True), repeat=len(atoms)))


def _window_atoms(evaluator: MaskEvaluator, comparisons) -> tuple[dict[int, object], dict[int, object]]:
    """{w: proposition} for `i - j <= w` (back) and `j - i <= w` (forward) comparisons with w >= 1."""
    i, j = index_symbol(1), index_symbol(0)
    back, forward = {}, {}
    for kind, e in comparisons:
        if kind != "lt" or e.free_symbols != {i, j}:
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


def classify_gdpa_mask(evaluator: MaskEvaluator, keep, batch_is_one: bool = False) -> GdpaMask:
    b, h, i, j = (index_symbol(k) for k in (3, 2, 1, 0))
    if keep is sympy.true:
        return GdpaMask()
    if keep is sympy.false:
        raise Unproven("the mask drops every score")
    comparisons = [evaluator.atoms.expr_of[a] for a in keep.free_symbols]
    if any(h in e.free_symbols for _, e in comparisons):
        raise Unproven("the mask differs between heads")
    for _, e in comparisons:
        for f in e.atoms(sympy.Function):
            if f.func.__name__ in evaluator.leaves and f.args != (b,) and not (batch_is_one and f.args == (0,)):
                raise Unproven(f"{evaluator.leaves[f.func.__name__].name} is indexed by a position, not by the batch")
    keys = [None, *_length_atoms(evaluator, comparisons, j)]
    queries = [None, *_length_atoms(evaluator, comparisons, i)]
    causal_atom = evaluator.atoms.compare("le", j, i)
    back, forward = _window_atoms(evaluator, comparisons)
    windows = [(False, 0, [])] + [(True, 0, [causal_atom])]
    windows += [(True, w, [causal_atom, p]) for w, p in back.items()]
    windows += [(False, w, [p, forward[w]]) for w, p in back.items() if w in forward]
    for kv, q, (causal, window, extra) in itertools.product(keys, queries, windows):
        parts = ([kv[2]] if kv else []) + ([q[2]] if q else []) + extra
        if parts and _equivalent(evaluator, keep, sympy.And(*parts)):
            return GdpaMask(kv[0] if kv else None, kv[1] if kv else 0, q[0] if q else None, q[1] if q else 0,
                            causal, window)
    hstu = _classify_hstu(evaluator, keep, keys[1:], queries[1:])
    if hstu is not None:
        return hstu
    raise Unproven("the mask is not a combination of key padding, query padding, causal and a local window "
                   f"over lengths, nor HSTU's target/contextual mask: it is {_render(evaluator, keep)}")


def hstu_visible(evaluator: MaskEvaluator, i, j, n, t, contextual: int, window: int):
    """HSTU's causal visibility of key j from query i in a sequence of n tokens whose last t are targets and
    whose first `contextual` tokens are contextual (position ids clamped as in generative-recommenders'
    reference mask); the kernel implements the same formula."""
    compare = evaluator._compare_exprs
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


def _classify_hstu(evaluator: MaskEvaluator, keep, keys, queries) -> GdpaMask | None:
    """Key padding [and query padding] and HSTU's causal target/contextual visibility, or None."""
    b, i, j = index_symbol(3), index_symbol(1), index_symbol(0)
    constants = set()
    for a in keep.free_symbols:
        for term in sympy.Add.make_args(evaluator.atoms.expr_of[a][1]):
            if term.is_Integer:
                constants.update({abs(int(term)) - 1, abs(int(term)), abs(int(term)) + 1})
    contextual_options = [0] + sorted(c for c in constants if c >= 1)
    for kv_node, kv_offset, kv_atom in keys:
        if kv_offset != 0:
            continue
        n = sympy.Function(f"len_{kv_node.name}")(b)
        target_options = [None] + [node for node in evaluator.leaves.values() if node is not kv_node]
        for t_node, contextual in itertools.product(target_options, contextual_options):
            if t_node is None and not contextual:
                continue  # plain causal: handled above
            t = None if t_node is None else sympy.Function(f"len_{t_node.name}")(b)
            visible = hstu_visible(evaluator, i, j, n, t, contextual, 0)
            for q in [None, *[x for x in queries if x[0] is kv_node and x[1] == 0]]:
                candidate = sympy.And(kv_atom, visible, *([q[2]] if q else []))
                if _equivalent(evaluator, keep, candidate):
                    return GdpaMask(kv_node, 0, q[0] if q else None, 0, True, 0, t_node, contextual)
    return None


# -- the query-padding mask applied after the attention ----------------------------------------------

_VIEWS = ("view", "reshape", "flatten", "contiguous", "to", "float", "half", "bfloat16", "type_as")
_PERMUTES = ("transpose", "permute", "swapaxes")


def _name(node: fx.Node) -> str:
    t = node.target
    if hasattr(t, "overloadpacket"):
        return t.overloadpacket.__name__
    return t if isinstance(t, str) else getattr(t, "__name__", str(t))


def _permuted_dim(node: fx.Node, dim: int) -> int:
    """Where dim goes under a transpose/permute node."""
    ndim = example_value(node.args[0]).dim()
    if _name(node) == "permute":
        perm = node.args[1] if isinstance(node.args[1], (list, tuple)) else node.args[1:]
        return [p % ndim for p in perm].index(dim)
    a, b = (x % ndim for x in node.args[1:3])
    return b if dim == a else a if dim == b else dim


def downstream_row_mask(output: fx.Node, batch_dim: int, row_dim: int) -> tuple[fx.Node, int]:
    """(lengths node, offset) when every use of ``output`` (dims: batch_dim, query rows at row_dim) ends in a
    multiplication by `row < lengths[b] + offset` through row-wise ops; Unproven otherwise."""
    node, rows, batch = output, row_dim, batch_dim
    while True:
        if len(node.users) != 1:
            raise Unproven(f"{node.name} has {len(node.users)} uses before any query-row mask")
        (user,) = node.users
        name = _name(user) if user.op in ("call_function", "call_method") else ""
        value = example_value(user)
        if name in _PERMUTES:
            rows, batch = _permuted_dim(user, rows), _permuted_dim(user, batch)
        elif name in _VIEWS:
            before = example_value(node).shape
            keep = max(rows, batch) + 1
            if value.dim() < keep or tuple(value.shape[:keep]) != tuple(before[:keep]):
                raise Unproven(f"`{name}` ({user.name}) reshapes the batch or query-row dims")
        elif name == "linear":
            if user.args[0] is not node or rows == value.dim() - 1 or batch == value.dim() - 1:
                raise Unproven(f"{user.name} is not a Linear over the feature dim")
        elif name in ("mul", "__mul__", "__rmul__"):
            other = user.args[1] if user.args[0] is node else user.args[0]
            if not isinstance(other, fx.Node):
                raise Unproven(f"{user.name} multiplies by a constant, not by a row mask")
            return _row_mask(other, value.dim(), batch, rows)
        else:
            raise Unproven(f"the attention output goes to `{name or user.op}` ({user.name}) before any "
                           "query-row mask")
        node = user


def _row_mask(mask: fx.Node, ndim: int, batch: int, rows: int) -> tuple[fx.Node, int]:
    evaluator = MaskEvaluator()
    value = evaluator.tensor(mask)
    pieces = getattr(value, "pieces", None)
    if pieces is not None:
        if any(v not in (0.0, 1.0) for v, _ in pieces):
            raise Unproven("the output is multiplied by weights, not by a 0/1 row mask")
        keep = value.as_bool()
    elif hasattr(value, "pred"):
        keep = value.pred
    else:
        raise Unproven("the output is multiplied by an integer tensor")
    offset = ndim - value.ndim  # right-aligned broadcasting
    b, i = index_symbol(ndim - 1 - batch), index_symbol(ndim - 1 - rows)
    if batch - offset < 0 or rows - offset < 0:
        raise Unproven("the row mask does not span the batch and query-row dims")
    comparisons = [evaluator.atoms.expr_of[a] for a in keep.free_symbols]
    for _, e in comparisons:
        for f in e.atoms(sympy.Function):
            if f.func.__name__ in evaluator.leaves and f.args != (b,):
                raise Unproven("the row mask's lengths are not indexed by the batch dim")
    for node, off, prop in _length_atoms(evaluator, comparisons, i):
        if equivalent(keep, prop):
            if example_value(node).dtype not in (torch.int32, torch.int64):
                raise Unproven(f"{node.name} is not an integer lengths tensor")
            return node, off
    raise Unproven(f"the output is multiplied by {_render(evaluator, keep)}, not by `row < lengths[b]`")
