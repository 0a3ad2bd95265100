"""Scores masked as rows, then shaped back: ``s.reshape(-1, Lk).masked_fill(m, v).reshape(s.shape)`` is
``s.masked_fill(m.reshape(s.shape), v)``.

d2l's ``masked_softmax`` (copied by many tutorials and recommender ports) flattens the (B * H, Lq, Lk) scores to
rows, masks each row by its own length (the lengths repeat_interleave'd over the query rows) and reshapes back
before the softmax. A masked_fill is elementwise, so it commutes with the reshape when the mask is reshaped the
same way; after this fold the score chain is the one the matchers read, and the mask prover sees the mask in the
scores' shape (its reshape splits the row dim: masks/evaluator.py). Graph-wide and exact, like in_place.py.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true as known

from gemcompile.passes.attention.scores import NEGATIONS, RESHAPES
from gemcompile.passes.graph import Emitter, example_value, target_name


def _reshape_of(node) -> fx.Node | None:
    """The input of ``node`` when it is a reshape / view call, else None."""
    if isinstance(node, fx.Node) and target_name(node) in RESHAPES and node.args and isinstance(node.args[0],
                                                                                                 fx.Node):
        return node.args[0]
    return None


def _same_shape(a, b) -> bool:
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dim() == b.dim()
            and all(known(x == y) for x, y in zip(a.shape, b.shape)))


def _unflattened(emit: Emitter, mask: fx.Node, s) -> fx.Node | None:
    """The mask in the scores' shape when it was built there and flattened with them (``m.reshape(-1, Lk)``,
    or its negation): that tensor itself, which the mask prover reads without undoing a merge of dims."""
    negated = target_name(mask) in NEGATIONS and mask.args
    inner = mask.args[0] if negated else mask
    source = _reshape_of(inner)
    if source is None or not _same_shape(example_value(source), s):
        return None
    return emit.call(torch.logical_not, (source,)) if negated else source


def fold_row_flattened_masks(graph: fx.Graph) -> int:
    """Rewrite each ``reshape(masked_fill(reshape(s, (M, Lk)), m, v), s.shape)`` as ``masked_fill(s,
    m.reshape(s.shape), v)``; returns how many. Each intermediate must have that one reader, and the mask the
    rows' shape (M, Lk)."""
    count = 0
    for back in list(graph.nodes):
        filled = _reshape_of(back)
        if filled is None or target_name(filled) != "masked_fill" or list(filled.users) != [back] or filled.kwargs:
            continue
        if len(filled.args) != 3 or not isinstance(filled.args[1], fx.Node):
            continue
        flat, mask, value = filled.args
        scores = _reshape_of(flat)
        if scores is None or list(flat.users) != [filled]:
            continue
        s, f, m, out = (example_value(n) for n in (scores, flat, mask, back))
        if not (isinstance(s, torch.Tensor) and isinstance(f, torch.Tensor) and s.dim() >= 3 and f.dim() == 2):
            continue
        if not (_same_shape(out, s) and _same_shape(m, f) and known(f.shape[-1] == s.shape[-1])):
            continue
        emit = Emitter(graph)
        with graph.inserting_before(back):
            try:
                shaped = _unflattened(emit, mask, s)
                if shaped is None:
                    shaped = emit.method("reshape_as", (mask, scores))
                new = emit.method("masked_fill", (scores, shaped, value))
            except Exception:  # noqa: BLE001 (the fake mode cannot run it: keep the graph as written)
                emit.rollback()
                continue
        if not _same_shape(example_value(new), out) or example_value(new).dtype != out.dtype:
            emit.rollback()
            continue
        new.meta.update({k: v for k, v in back.meta.items() if k not in ("example_value", "val")})
        back.replace_all_uses_with(new)
        for node in (back, filled, flat):
            graph.erase_node(node)
        count += 1
    return count
