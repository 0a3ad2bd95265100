"""Scores masked in a view that only adds a size-1 dim, spelled without that dim.

fairseq's MultiheadAttention (its current code) masks its (B * H, T, S) scores in a 5-D frame:

    w = w.view(B, H, T, S).view(kv_bsz, -1, H, T, S)                  # kv_bsz == B: the -1 is 1
    w = w.masked_fill(kpm.unsqueeze(1).unsqueeze(2).unsqueeze(3), -inf)
    w = w.view(B * H, T, S)

The matchers read the (B * H, T, S) <-> (B, H, T, S) views (scores.heads_view), not a 5-D frame. The 5-D
view adds one size-1 dim that the mask has too; masking the 4-D scores by the mask with that dim squeezed
gives the same elements, and every reader of the masked tensor is a view or reshape, which reads them in
the same order. Other readers (a 5-D value that is returned, reduced, ...) leave the graph as written.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true as known

from gemcompile.passes.attention.scores import is_call
from gemcompile.passes.graph import Emitter, example_value

__all__ = ["drop_unit_dim_views"]

_RESHAPES = ("view", "reshape")


def _inserted_unit_dim(src: torch.Tensor, out: torch.Tensor) -> int | None:
    """d when ``out`` is ``src`` with a size-1 dim inserted at d (sizes known), else None."""
    if out.dim() != src.dim() + 1 or out.dim() < 5:  # up to 4-D a unit dim may be a heads view (B = 1)
        return None
    for d in range(out.dim()):
        if known(out.shape[d] == 1) and all(known(a == b) for a, b in zip(out.shape[:d] + out.shape[d + 1:],
                                                                             src.shape)):
            return d
    return None


def drop_unit_dim_views(graph: fx.Graph) -> int:
    """Rewrite each masked_fill through a size-1-dim view (module doc); returns how many."""
    count = 0
    for view in list(graph.nodes):
        if not is_call(view, *_RESHAPES) or not isinstance(view.args[0], fx.Node) or len(view.users) != 1:
            continue
        src, out = example_value(view.args[0]), example_value(view)
        if not isinstance(src, torch.Tensor) or not isinstance(out, torch.Tensor):
            continue
        d = _inserted_unit_dim(src, out)
        fill = next(iter(view.users))
        if d is None or not is_call(fill, "masked_fill") or len(fill.args) != 3 or fill.kwargs or \
                fill.args[0] is not view or not isinstance(fill.args[1], fx.Node):
            continue
        mask = example_value(fill.args[1])
        if not isinstance(mask, torch.Tensor) or mask.dim() != out.dim() or not known(mask.shape[d] == 1):
            continue
        if not fill.users or not all(is_call(u, *_RESHAPES) and u.args[0] is fill for u in fill.users):
            continue
        emit = Emitter(graph, untraceable="")
        with graph.inserting_before(fill):
            squeezed = emit.call(torch.squeeze, (fill.args[1], d))
            masked = emit.method("masked_fill", (view.args[0], squeezed, fill.args[2]))
        masked.meta.update({k: v for k, v in fill.meta.items() if k not in ("example_value", "val")})
        for user in list(fill.users):
            user.replace_input_with(fill, masked)
        graph.erase_node(fill)
        graph.erase_node(view)
        count += 1
    return count
