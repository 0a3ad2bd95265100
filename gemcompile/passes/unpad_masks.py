"""The row masks the unpad pass packs by: lengths, or a per-token vector read from data.

A row mask is a boolean (B, N, 1...) node, or a float or integer one that is exactly 0 or 1 by its formula
(a cast of such a boolean: ``valid.float()[..., None]``, ``valid.long()``), that the mask prover
(masks/evaluator.py) reads as a condition on the sample b and the token n alone:

- *lengths*: ``n < lengths[b] + c`` (masks/classify.py), packed by gemcompile::valid_token_index;
- *a token vector*: any other such condition: ``ids != 0`` (SASRec's timeline mask), ``x > 0`` (BERT4Rec),
  an attention_mask read as bool, left padding ``n >= N - lengths[b]``, holes. It is packed by
  gemcompile::valid_mask_index of the vector rebuilt from its formula (masks/key_vector.py, the builder of
  the attention passes' kv_mask), from the very tensors the model's mask reads.

Two token vectors are one row mask only when the prover shows their formulas equal (masks/prover.py):
``ids == 0`` written again in every block is one vector, packed by one index per step; ``ids > 0`` and
``ids != 0`` are two (they differ where ids < 0). A region takes as harmless only the zeroing by its own
row mask (unpad.py's pad analyses), so a product with another vector is an ordinary op there and does not
make an exit's padding harmless.

A row mask may be tiled over features (sentence-transformers' mean pooling multiplies by
``attention_mask.unsqueeze(-1).expand(x.size()).float()``): a cast and broadcast of a (B, N, 1...) mask
whose value the prover shows does not depend on the tiled dims. A mask proven only under a run-time check of
the data (an integer attention_mask read as 0/1, a registered buffer) carries that check: the rewrite emits it
with the region (``emit_row_mask_checks``), and a value outside what was assumed stops the run with a message.

Not a row mask, and said so in explain where it multiplies token rows: a bool mask with a dim besides B and
N (per head, per feature) along which it differs. A vector that holds everywhere or nowhere is nothing to
pack by.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import sympy
import torch
from torch import fx

from gemcompile.passes.graph import Unproven, example_value, schema_arguments, target_name
from gemcompile.passes.masks.classify import classify_length_mask
from gemcompile.passes.masks.evaluator import MaskEvaluator, index_symbol, keep_predicate
from gemcompile.passes.masks.model import KeyVector
from gemcompile.passes.masks.mutation import in_place_update
from gemcompile.passes.masks.prover import equivalent, render
from gemcompile.passes.masks.values import BoolTensor, PiecewiseTensor, simplify_pred
from gemcompile.passes.masks.zero_one import ZERO_ONE_CHECKED, emit_zero_one_check
from gemcompile.passes.token_wise import same_size, shape_of

B, J = index_symbol(3), index_symbol(0)
"""The symbols of a row mask's sample and token (the prover's batch and key index)."""


@dataclass(frozen=True)
class RowMask:
    """(The mask a region packs by; masks.model.AttentionMask is the attention-score mask.) valid[b, n] over
    (batch, seq) rows is ``n < lengths[b] + offset``, or the token ``vector`` when lengths is None."""

    lengths: fx.Node | None
    offset: int
    batch: Any
    seq: Any
    vector: KeyVector | None = None
    vector_id: int = -1
    """Token vectors proven equal share one id."""
    node: fx.Node | None = field(default=None, compare=False)
    """The mask node (for explain): the lengths, or the first node of a token vector."""
    checks: tuple = field(default=(), compare=False)
    """Device-side checks of the data this mask node was proven under (masks/zero_one.py: an integer
    attention_mask read as 0/1): every region that relies on it emits them."""

    def same(self, other: RowMask | None) -> bool:
        if other is None or not (same_size(other.batch, self.batch) and same_size(other.seq, self.seq)):
            return False
        if self.vector is not None:
            return other.vector is not None and other.vector_id == self.vector_id
        return other.vector is None and other.lengths is self.lengths and other.offset == self.offset

    def index_key(self) -> tuple:
        """What regions packed by one valid-token index share: the lengths and offset, or the vector's id."""
        return (self.lengths, self.offset) if self.vector is None else ("vector", self.vector_id)

    def describe(self) -> str:
        """What explain calls the rows: the lengths' name, or where the token vector holds."""
        return self.lengths.name if self.vector is None else f"the tokens where {self.vector.text}"

    def condition(self) -> str:
        """The condition on (b, n) that keeps a token, as explain spells it."""
        if self.vector is not None:
            return self.vector.text
        return f"n < {self.lengths.name}[b]" + (f" + {self.offset}" if self.offset else "")


def find_row_masks(graph: fx.Graph) -> tuple[dict[fx.Node, RowMask], list[tuple[fx.Node, str]]]:
    """Every row mask node of the graph (module doc), and the masks that multiply token rows without being
    one, each with the reason (for explain)."""
    found: dict[fx.Node, RowMask] = {}
    why_not: dict[fx.Node, str] = {}
    evaluator = MaskEvaluator()
    vectors: list[RowMask] = []  # the first of each class of equal token vectors
    for node in graph.nodes:
        value = example_value(node)
        if node.op not in ("call_function", "call_method") or not isinstance(value, torch.Tensor):
            continue
        if value.dim() < 2 or value.is_complex():
            continue
        shape = tuple(value.shape)
        if same_size(shape[1], 1) or not (all(same_size(s, 1) for s in shape[2:]) or _tiled_rows(node)):
            continue
        if value.dtype != torch.bool and not _zero_one(evaluator, node):
            continue
        try:
            mask = _row_mask(evaluator, node, shape, vectors)
        except Unproven as reason:
            why_not[node] = str(reason)
            continue
        if mask is not None:
            found[node] = mask
    return found, _near_misses(graph, found, why_not), _row_fills(graph, evaluator, vectors)


class RowFill(NamedTuple):
    """``x.masked_fill(~valid, value)`` or ``where(valid, x, value)``: x where a row mask holds, ``value``
    elsewhere. Its result never reads x's padded rows; it is ``x * valid`` (zero there) when value is 0."""

    x: fx.Node
    kept: RowMask
    """The row mask of the rows it keeps."""
    zero: bool
    """The fill is 0 (a zeroing)."""
    rows: tuple[int, int] = (0, 1)
    """The dims of x that are the mask's batch and tokens: (0, 1), or (0, 2) for scores transposed to (B, 1, N)
    (DeepCTR-Torch's DIN fills ``att.transpose(1, 2)`` by a (B, 1, N) mask before its matmul with the keys)."""
    value: float | None = None
    """The fill when it is a constant (``-inf``: a softmax over it is 0 or NaN at the padding)."""


def _fill_form(node: fx.Node) -> tuple[fx.Node, fx.Node, bool, Any] | None:
    """(x, m, negate, value) when ``node`` replaces rows of x by ``value`` by a bool m: ``x.masked_fill(m,
    value)`` keeps where m does not hold (negate), ``where(m, x, value)`` where it holds, ``where(m, value,
    x)`` where it does not."""
    if node.op not in ("call_function", "call_method"):
        return None
    name = target_name(node)
    if name not in ("masked_fill", "where"):
        return None
    args = _call_arguments(node, ("input", "mask", "value") if name == "masked_fill" else ("condition", "input", "other"))
    if args is None or len(args) != 3:
        return None
    out = example_value(node)
    if name == "masked_fill":
        (x, m, value), negate = args, True
    elif _rows_of(args[1], out) and _constant(args[1]) is None:  # where(valid, x, fill)
        (m, x, value), negate = args, False
    else:  # where(pad, fill, x)
        (m, value, x), negate = args, True
    if not isinstance(x, fx.Node) or not isinstance(m, fx.Node) or value is x:
        return None
    xv, mv = example_value(x), example_value(m)
    if not all(isinstance(v, torch.Tensor) for v in (xv, mv, out)) or mv.dtype != torch.bool or \
            not xv.is_floating_point() or xv.dtype != out.dtype or xv.dim() != mv.dim() or xv.dim() < 2 or \
            not all(same_size(a, b) for a, b in zip(xv.shape, out.shape)):
        return None  # (a mask of another rank would align its dims with others of x)
    return x, m, negate, value


def _rows_of(a: Any, out: Any) -> bool:
    """``a`` is a tensor of ``out``'s shape (the kept operand of a where, not its fill)."""
    value = example_value(a) if isinstance(a, fx.Node) else None
    return isinstance(value, torch.Tensor) and isinstance(out, torch.Tensor) and value.dim() == out.dim() and \
        all(same_size(x, y) for x, y in zip(value.shape, out.shape))


def _call_arguments(node: fx.Node, names: tuple[str, ...]) -> list | None:
    """The call's arguments by position, keywords among ``names`` put in their place (RecBole's
    ``masked_fill(mask=mask, value=torch.tensor(0.0))``); None for any other shape of call."""
    if len(node.args) + len(node.kwargs) != len(names) or set(node.kwargs) != set(names[len(node.args):]):
        return None
    return [node.args[i] if i < len(node.args) else node.kwargs[n] for i, n in enumerate(names)]


_ZERO_FACTORIES = frozenset({"zeros_like", "new_zeros", "zeros"})
_FILL_FACTORIES = {"full_like": 1, "new_full": 2, "full": 1, "tensor": 0, "scalar_tensor": 0}
"""Factories of a constant tensor: the position of the fill value."""


def _constant(value) -> float | None:
    """The number ``value`` is: a Python number, or a tensor filled with one (``torch.zeros_like(h)``,
    ``torch.tensor(-1e9)``, ``full_like(h, float("-inf"))``) and never written in place (``z.fill_(2.0)``);
    None for anything else."""
    if isinstance(value, fx.Node):
        name = target_name(value)
        if value.op not in ("call_function", "call_method") or not isinstance(example_value(value), torch.Tensor):
            return None
        if in_place_update(value) is not None:
            return None
        if name in _ZERO_FACTORIES:
            return 0.0
        position = _FILL_FACTORIES.get(name)
        fill = value.args[position] if position is not None and len(value.args) > position else None
        return None if isinstance(fill, fx.Node) else _constant(fill)
    return float(value) if type(value) in (int, float) else None


def _is_zero(value) -> bool:
    """0, or a tensor of zeros built for it (``_constant``)."""
    return _constant(value) == 0


def _row_fills(graph: fx.Graph, evaluator: MaskEvaluator, vectors: list[RowMask]) -> dict[fx.Node, RowFill]:
    """{node: its RowFill} for ``masked_fill`` and ``where`` fills of token rows x (B, N, ...) outside a bool
    (B, N, 1...) row mask m: to the pad analyses, a reader that ignores x's padded rows, and where the fill
    is 0, the product ``x * valid``."""
    fills = {}
    for node in graph.nodes:
        form = _fill_form(node)
        if form is None:
            continue
        x, m, negate, value = form
        shape, x_shape = tuple(example_value(m).shape), tuple(example_value(x).shape)
        tokens = _token_dim(shape) if not _tiled_condition(m) else 1
        if tokens is None or not (same_size(shape[0], x_shape[0]) and same_size(shape[tokens], x_shape[tokens])):
            continue
        try:
            mask = _row_mask(evaluator, m, shape, vectors, negate=negate, rows=(0, tokens))
        except Unproven:
            continue
        if mask is not None:
            fills[node] = RowFill(x, replace(mask, node=mask.node if mask.vector is None else m), _is_zero(value),
                                  (0, tokens), _constant(value))
    return fills


def _token_dim(shape: tuple) -> int | None:
    """The tokens' dim of a fill's mask: 1 for (B, N, 1...), the one dim past the batch that is not 1 for
    (B, 1, N) and the like; None when more than one is (a mask per head or feature) or none."""
    rest = [d for d in range(1, len(shape)) if not same_size(shape[d], 1)]
    return rest[0] if len(rest) == 1 else None


def _zero_one(evaluator: MaskEvaluator, node: fx.Node) -> bool:
    """A float or integer tensor that is exactly 0 or 1 at every position, by its formula (``valid.float()``,
    ``valid.long()``, ``valid.to(x.dtype)[..., None]``): a product with it masks as the bool mask does.
    Anything the evaluator cannot read (data, arithmetic) is not one, silently: most float (B, N, 1) tensors
    are no mask. One read as 0/1 only under a run-time check (an integer mask from data, cast) passes here
    and is refused by ``_row_mask``, as its bool comparison is."""
    try:
        value = evaluator.tensor(node)
    except Unproven:
        return False
    return isinstance(value, PiecewiseTensor) and all(v in (0, 1) for v, _ in value.pieces)


def _row_mask(evaluator: MaskEvaluator, node: fx.Node, shape: tuple, vectors: list[RowMask],
              negate: bool = False, rows: tuple[int, int] = (0, 1)) -> RowMask | None:
    """The row mask ``node`` (B, N, 1...) is (``negate``: the rows where it does not hold), None when it keeps
    every token or none; Unproven when the prover reads it only under a run-time check. ``rows``: the dims of
    the batch and the tokens, when not the first two (a (B, 1, N) fill's mask)."""
    rank = len(shape)
    others = [k for k in range(rank) if rank - 1 - k not in rows]  # right-aligned positions of the other dims
    tiled = {k: 4 + i for i, k in enumerate(k for k in others if not same_size(shape[rank - 1 - k], 1))}
    mapping = {rank - 1 - rows[0]: 3, rank - 1 - rows[1]: 0, **{k: tiled.get(k) for k in others}}
    keep = keep_predicate(evaluator, evaluator.relabel(evaluator.tensor(node), mapping, 4 + len(tiled)), "bool")
    if negate:
        keep = simplify_pred(sympy.Not(keep))
    if keep.free_symbols & {index_symbol(j) for j in tiled.values()}:
        raise Unproven(f"{node.name} differs along a dim besides the batch and the tokens: no row mask")
    try:
        lm = classify_length_mask(evaluator, keep, batch_is_one=same_size(shape[0], 1))
        if lm.q_lengths is None and not lm.causal:
            return RowMask(lm.kv_lengths, lm.kv_offset, shape[rows[0]], shape[rows[1]], node=lm.kv_lengths,
                           checks=_checks_of(node, evaluator))
    except Unproven:
        pass  # not lengths: a token vector, below
    if keep is sympy.true or keep is sympy.false:
        return None
    if not vector_leaves(KeyVector(keep, evaluator)):
        return None  # positions only (a causal (L, L) mask read as rows): no token marked by data
    checks = _checks_of(node, evaluator)
    for first in vectors:
        if same_size(first.batch, shape[rows[0]]) and same_size(first.seq, shape[rows[1]]) and \
                equivalent(evaluator, keep, first.vector.formula):
            return replace(first, node=node, checks=checks)
    text = re.sub(r"len_(\w+)\((\w+)\)", r"\1[\2]", render(evaluator, keep, {B: "b", J: "n"}))  # lengths[b]
    mask = RowMask(None, 0, shape[rows[0]], shape[rows[1]], KeyVector(keep, evaluator, text), len(vectors), node,
                   checks)
    vectors.append(mask)
    return mask


def kept_at(mask: RowMask, position) -> bool:
    """Whether ``mask`` keeps token ``position`` (an int, or a sympy expression of the sizes) of every sample,
    by its formula alone: BST's ``cat([hist == 0, zeros(B, 1)])`` keeps the appended target at N - 1 whatever
    the history. Each comparison that the position decides is replaced by its value; what is left must hold
    for any value of the others. A lengths mask keeps no position for every sample (a length may be 0)."""
    if mask.vector is None:
        return False
    vector = mask.vector
    token = index_symbol(vector.position)
    values = {}
    for atom in vector.formula.free_symbols:
        kind, e = vector.evaluator.atoms.expr_of[atom]
        at = e.xreplace({token: position})
        reads = {read: value for read in at.atoms(sympy.Function)
                 if (value := _constant_read(vector.evaluator, read)) is not None}
        at = sympy.expand(at.xreplace(reads))
        if at.is_number:
            values[atom] = sympy.true if (at < 0 if kind == "lt" else at == 0) else sympy.false
    return simplify_pred(vector.formula.xreplace(values)) is sympy.true


def _constant_read(evaluator: MaskEvaluator, read: sympy.Expr) -> int | None:
    """The value of a data read ``dat_x(b, p)`` at a constant token p where x is a ``cat`` along its tokens
    whose part there is a constant (BST's ``cat([hist == 0, zeros(B, 1)])`` at the appended target); None
    otherwise."""
    leaf = evaluator.data.get(type(read).__name__)
    node = leaf.node if leaf is not None else None
    if node is None or target_name(node) not in ("cat", "concat") or len(read.args) != 2 or \
            read.args[1].free_symbols & {index_symbol(k) for k in range(4)} or not node.args or \
            not isinstance(node.args[0], (list, tuple)):
        return None
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    if not isinstance(dim, int) or dim % 2 != 1:
        return None
    position, start = read.args[1], sympy.Integer(0)  # (symbolic under dynamic shapes: N - 1 is s0 + 1 - 1)
    for part in node.args[0]:
        size = shape_of(part)[1] if isinstance(part, fx.Node) and shape_of(part) is not None else None
        size = size.node.expr if isinstance(size, torch.SymInt) else size
        if not isinstance(size, (int, sympy.Expr)):
            return None
        after_start, before_end = sympy.expand(position - start), sympy.expand(start + size - position)
        inside = after_start.is_nonnegative and before_end.is_positive  # (sizes' symbols are positive integers)
        if not inside and not (after_start.is_negative or before_end.is_nonpositive):
            return None  # (undecided: a position not fixed relative to this part)
        if inside:
            try:
                value = MaskEvaluator().tensor(part)
            except Unproven:
                return None
            if isinstance(value, BoolTensor) and value.pred in (sympy.true, sympy.false):
                return int(value.pred is sympy.true)
            if isinstance(value, PiecewiseTensor) and len(value.pieces) == 1 and float(value.pieces[0][0]).is_integer():
                return int(value.pieces[0][0])
            return None
        start += size
    return None


def _checks_of(node: fx.Node, shared: MaskEvaluator) -> tuple:
    """The run-time checks the prover reads ``node`` under (an evaluator shared by many masks adds a check
    once, for the first mask that reads the checked tensor: ask a fresh one)."""
    if not shared.checks:
        return ()
    fresh = MaskEvaluator()
    fresh.tensor(node)
    return tuple(fresh.checks)


_CASTS = {"float", "half", "bfloat16", "double", "long", "int", "bool", "to", "type", "type_as"}
_TILES = {"expand", "expand_as", "broadcast_to", "repeat", "tile", "repeat_interleave"}


def _tiled_condition(node: fx.Node) -> bool:
    """A fill's condition on a row mask tiled over the features (sentence-transformers' max pooling:
    ``mask = attention_mask.unsqueeze(-1).expand_as(h).to(h.dtype)``, then ``masked_fill(mask == 0, -inf)``)."""
    while target_name(node) in ("eq", "ne", "logical_not", "invert", "bool") and node.args and \
            isinstance(node.args[0], fx.Node) and all(not isinstance(a, fx.Node) for a in node.args[1:]):
        node = node.args[0]
    return _tiled_rows(node)


def _tiled_rows(node: fx.Node) -> bool:
    """Whether ``node`` is casts and broadcasts of a (B, N, 1...) tensor (``m.unsqueeze(-1).expand(x.size())
    .float()``): worth asking the prover whether it is a row mask tiled over features. Other (B, N, E)
    tensors (every activation) are not evaluated at all."""
    for _ in range(6):
        if target_name(node) not in _CASTS | _TILES or not node.args or not isinstance(node.args[0], fx.Node):
            return False
        node = node.args[0]
        shape = shape_of(node)
        if shape is not None and len(shape) >= 2 and all(same_size(s, 1) for s in shape[2:]):
            return True
    return False


def emit_row_mask_checks(emit, mask: RowMask, masks: Iterable[RowMask], done: set) -> list:
    """Emit the run-time checks of every mask of ``mask``'s class (the region may rely on any of them where
    it drops a product with it or a zeroing by it) not emitted before (``done``: keys of emitted checks).
    Returns the keys emitted, for the caller to add to ``done`` once the region is rewritten."""
    emitted = []
    for found in masks:
        if not mask.same(found):
            continue
        for check in found.checks:
            key = check_key(check)
            if key not in done and key not in emitted:
                check(emit)
                emitted.append(key)
    return emitted


def check_key(check) -> tuple:
    """What identifies a run-time check (a partial of an emit function over one node): the function and node."""
    return getattr(check, "func", check), getattr(check, "keywords", {}).get("node")


def zero_one_checked(graph: fx.Graph) -> set[fx.Node]:
    """The integer tensors whose 0/1 check a rewrite already emitted into ``graph`` (an attention pass's)."""
    return {n.meta[ZERO_ONE_CHECKED] for n in graph.nodes if ZERO_ONE_CHECKED in n.meta}


def unchecked_zero_one(checked: set[fx.Node], mask: RowMask, masks: Iterable[RowMask]) -> list[fx.Node]:
    """The integer tensors that the masks of ``mask``'s class read as 0/1 (masks/zero_one.py) and that no
    other rewrite of the graph checks already (``checked``: zero_one_checked): an attention pass relies on HF's
    attention_mask being 0/1 and checks it, so packing by it adds nothing; but integer weights (counts,
    ratings) only multiplied into the tokens are no mask, and a check would stop a valid run."""
    leaves: list[fx.Node] = []
    for found in masks:
        if not mask.same(found):
            continue
        for check in found.checks:
            function, leaf = check_key(check)
            if function is emit_zero_one_check and leaf not in checked and leaf not in leaves:
                leaves.append(leaf)
    return leaves


_INDEX_MAPS = {"unsqueeze", "view", "reshape", "expand", "expand_as", "contiguous", "getitem"}


def zero_exactly_where_data_is(node: fx.Node, leaf: fx.Node, depth: int = 8) -> bool:
    """Whether ``node`` is ``leaf`` (integer data) through index maps and casts that keep zero and nonzero
    apart (to a float or bool, to int64): 0 exactly where the data is, whatever its other values. A mask
    read as 0/1 from such a cast is exact for weights too (counts), as long as its product stays a product
    (UnpadPass: the region keeps it instead of dropping it as the identity)."""
    while node is not leaf and depth:
        value = example_value(node)
        name = target_name(node)
        if not isinstance(node, fx.Node) or not node.args or not isinstance(value, torch.Tensor):
            return False
        if name in _CASTS:
            if not (value.is_floating_point() or value.dtype in (torch.bool, torch.int64)):
                return False  # (int64 -> int32 wraps 2**32 to 0)
        elif name not in _INDEX_MAPS:
            return False
        node, depth = node.args[0], depth - 1
    return node is leaf


def _near_misses(graph: fx.Graph, found: dict[fx.Node, RowMask], why_not: dict[fx.Node, str]):
    """(mul, reason) for each product of token rows x (B, N, ...) with a bool mask that is no row mask: one
    proven only under run-time checks, or one with a dim besides B and N that x broadcasts over (per head:
    (B, N, H, 1))."""
    misses = []
    for node in graph.nodes:
        if target_name(node) != "mul" or len(node.args) != 2 or node.kwargs:
            continue
        for x, m in (node.args, node.args[::-1]):
            xs, ms = shape_of(x), shape_of(m)
            if xs is None or ms is None or m in found or example_value(m).dtype != torch.bool or \
                    not example_value(x).is_floating_point() or len(xs) != len(ms) or len(xs) < 3:
                continue
            if not (same_size(ms[0], xs[0]) and same_size(ms[1], xs[1])) or same_size(ms[1], 1):
                continue
            if m in why_not:
                misses.append((node, f"{x.name} is multiplied by {m.name}, which is no row mask to pack by: "
                                     f"{why_not[m]}"))
                break
            extra = [d for d in range(2, len(ms)) if not same_size(ms[d], 1)]
            broadcast = [d for d in range(2, len(ms)) if same_size(ms[d], 1) and not same_size(xs[d], 1)]
            if extra and broadcast:
                misses.append((node, f"{x.name} is multiplied by {m.name} of shape {tuple(ms)}: a mask that "
                                     f"differs along dim {extra[0]} too (per head or per feature), not a "
                                     "per-token vector (B, N, 1...): nothing is packed by it"))
                break
    return misses


def vector_leaves(vector: KeyVector) -> list[fx.Node]:
    """The graph nodes a token vector's formula reads (data and lengths), to rebuild it from."""
    evaluator = vector.evaluator
    names = {f.func.__name__ for a in vector.formula.free_symbols
             for f in evaluator.atoms.expr_of[a][1].atoms(sympy.Function)}
    nodes = [evaluator.data[n].node if n in evaluator.data else evaluator.leaves.get(n) for n in names]
    return sorted({n for n in nodes if n is not None}, key=lambda n: n.name)


EMPTY_SAMPLES_READ_EVERY_KEY = "empty samples read every key"
"""keys_within's answer for an op that, where a sample has no valid key, reads all its keys (finite fills)."""


def keys_within(mask: RowMask, op: fx.Node, kv_lengths: Any) -> bool | str:
    """Whether every key the attention ``op`` reads (where its kv_mask and its ``kv_lengths`` argument
    allow) is a valid token of the token vector ``mask``: then the op ignores the padded key rows.

    A finite fill's rewrite lets a sample with no valid key read every key (``base | ~any(valid)[:, None]``,
    attention/finite_fill.py). Where the valid keys are exactly the vector's tokens, such a sample has no valid
    token either, so only its own (padded) query rows read padding: the answer is then
    EMPTY_SAMPLES_READ_EVERY_KEY, which holds only when the op's output rows are pad-blind too."""
    evaluator = mask.vector.evaluator
    kv_mask = schema_arguments(op).get("kv_mask")
    empty_rows = _every_key_when_empty(kv_mask) if isinstance(kv_mask, fx.Node) else None
    if empty_rows is not None:
        kv_mask = empty_rows[0]
    parts = []
    try:
        if isinstance(kv_mask, fx.Node):  # (B, Lk): its dims are the sample and the token
            parts.append(_keys_predicate(evaluator, kv_mask))
        if isinstance(kv_lengths, fx.Node):
            lengths = evaluator.relabel(evaluator.tensor(kv_lengths), {0: 3}, 4)
            if not hasattr(lengths, "expr"):
                return False
            parts.append(evaluator.compare_exprs("lt", J, lengths.expr))
        if not parts:
            return False
        keys = sympy.And(*parts)
        if not equivalent(evaluator, sympy.And(keys, mask.vector.formula), keys):  # keys read => valid tokens
            return False
        if empty_rows is None:
            return True
        empty_test = _keys_predicate(evaluator, empty_rows[1])  # "no valid key" is judged on these keys
        exact = equivalent(evaluator, empty_test, keys) and \
            equivalent(evaluator, sympy.And(keys, mask.vector.formula), mask.vector.formula)
        return EMPTY_SAMPLES_READ_EVERY_KEY if exact else False
    except Unproven:
        return False


def _keys_predicate(evaluator: MaskEvaluator, keys: fx.Node):
    """A (B, Lk) bool tensor as a condition on the sample and the key."""
    return keep_predicate(evaluator, evaluator.relabel(evaluator.tensor(keys), {1: 3, 0: 0}, 4), "bool")


def _every_key_when_empty(kv_mask: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(base, valid) when kv_mask is ``logical_or(base, unsqueeze(logical_not(any(valid, -1)), 1))``."""
    if target_name(kv_mask) != "logical_or" or len(kv_mask.args) != 2 or kv_mask.kwargs:
        return None
    base, extra = kv_mask.args
    empty = extra.args[0] if target_name(extra) == "unsqueeze" and tuple(extra.args[1:]) == (1,) else None
    if not isinstance(empty, fx.Node) or target_name(empty) != "logical_not":
        return None
    found = empty.args[0]
    if target_name(found) != "any" or tuple(found.args[1:]) != (-1,) or found.kwargs:
        return None
    return (base, found.args[0]) if isinstance(base, fx.Node) and isinstance(found.args[0], fx.Node) else None
