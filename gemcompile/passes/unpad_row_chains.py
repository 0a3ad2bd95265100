"""Chains of ops on token rows laid out other than (B, N, ...), moved onto the (B, N, ...) rows they are.

The token-wise table (token_wise.py) describes ops over (B, N, ...) rows. Models also run per-token layers on
the same rows in other layouts: flattened to (B*N, ...) for an MLP (FuxiCTR, unpad_flat_rows.py), or
transposed to (B, F, N) for a kernel-1 Conv1d FFN or a BatchNorm1d (SASRec's PointWiseFeedForward, DIN's
Dice: unpad_transposed_rows.py). A :class:`RowLayout` says how one layout starts (a view or transpose of a
(B, N, ...) tensor), which ops compute each row from the same row and how they run on the (B, N, ...) form,
and how a reader outside the chain reads the layout back. ``move_chains`` rewrites every chain onto the rows;
the values are the same elements, and the unpad pass then packs the chain like any other.

An op that computes across the rows of the layout (a batch norm's statistics, a reduction over the tokens)
ends its chain there, as it must; with GEMMs around it, it is reported (explain says why they run padded).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from torch import fx

from gemcompile.passes.graph import Emitter, copy_source_meta, erase_dead, example_value, target_name
from gemcompile.passes.masks.mutation import forget_mutations, in_place_update


@dataclasses.dataclass(frozen=True)
class RowLayout:
    """One layout of token rows other than (B, N, ...), for the (B, N) sizes of ``row_dims``."""

    name: str
    """How explain says the layout: 'token rows flattened to (B*N, ...)'."""
    start: Callable[[fx.Node], fx.Node | None]
    """A node that lays out a (B, N, ...) tensor this way: that tensor; None for any other node."""
    move: Callable[[Emitter, fx.Node, dict], fx.Node | None]
    """Emit ``node`` on the (B, N, ...) rows, its laid-out operands read through ``rows`` (laid-out value ->
    row form): the new node, or None (nothing emitted) when the op does not compute each row from that row."""
    reads_back: Callable[[fx.Graph, fx.Node, fx.Node], fx.Node | None]
    """For a reader that lays the value back out as (B, N, ...) rows, what replaces it, from the row form
    (inserted before it); None for any other reader."""
    back: Callable[[fx.Graph, fx.Node], fx.Node]
    """The laid-out value, from the row form (for other readers outside the chain)."""
    mixes: Callable[[fx.Node], bool]
    """An op that computes across the rows of a laid-out operand (reported when GEMMs are around it)."""
    keeps: Callable[[fx.Node], bool]
    """A value in the layout or in the (B, N, ...) rows (to find the GEMMs around an op across the rows)."""
    worth: Callable[[list[fx.Node]], bool] = lambda ops: True
    """Whether a chain of these ops is moved (a layout told from shapes alone may be a coincidence of sizes:
    then only chains with the ops the layout is for)."""


def move_chains(graph: fx.Graph, layout: RowLayout) -> tuple[int, list[tuple[fx.Node, str]]]:
    """Move every chain of ``layout`` onto its rows: the number of ops moved, and (node, reason) for each op
    across the rows that leaves GEMMs in the layout padded."""
    moved, stops = 0, []
    for node in list(graph.nodes):
        if getattr(node, "_erased", False):
            continue  # (erased with an earlier chain)
        source = layout.start(node)
        if source is None or in_place_update(node) is not None:
            continue
        count = _move_chain(graph, node, source, layout, stops)
        if count:
            forget_mutations(graph)  # (the alias index of the graph's in-place updates: rebuilt for the next chain)
        moved += count
    return moved, _stop_reasons(stops, layout)


def _move_chain(graph: fx.Graph, start: fx.Node, source: fx.Node, layout: RowLayout, stops: list) -> int:
    rows: dict[fx.Node, fx.Node] = {start: source}  # laid-out value -> its (B, N, ...) form
    emit = Emitter(graph)
    order = {n: i for i, n in enumerate(graph.nodes)}
    pending = sorted(start.users, key=order.get)
    chain_stops = []
    try:
        while pending:  # graph order: every laid-out operand of a node has its row form before the node
            user = pending.pop(0)
            if user in rows or in_place_update(user) is not None:
                continue
            with graph.inserting_before(user):
                new = layout.move(emit, user, rows)
            if new is None:
                if layout.mixes(user):
                    chain_stops.append(user)
                continue
            rows[user] = new
            copy_source_meta(user, new)
            pending = sorted({*pending, *user.users}, key=order.get)
    except Exception:  # noqa: BLE001  (a copy that does not trace: the chain stays as written)
        emit.rollback()
        return 0
    ops = [n for n in rows if n is not start]
    before = [*_gemms(source, layout, lambda n: [a for a in n.all_input_nodes if layout.keeps(a)]),
              *(n for n in ops if target_name(n) in _GEMMS)]
    stops.extend((stop, before) for stop in chain_stops)
    if not ops or not layout.worth(ops):
        emit.rollback()
        return 0
    replaced = []  # the readers that lay the rows back out, replaced by the row form
    for laid_out in ops:  # other readers outside the chain read the layout from the row form
        row_form = rows[laid_out]
        for user in [u for u in laid_out.users if u not in rows]:
            with graph.inserting_before(user):
                read = layout.reads_back(graph, user, row_form)
                if read is not None:
                    user.replace_all_uses_with(read)
                    replaced.append(user)
                    continue
                back = layout.back(graph, row_form)
                back.meta.update(laid_out.meta)
                value = example_value(laid_out)
                if isinstance(value, torch.Tensor) and value.is_contiguous():  # (eager's strides: a reader may
                    back = graph.call_method("contiguous", (back,))             # view it, the graph return it)
                    back.meta.update(laid_out.meta)
            user.replace_input_with(laid_out, back)
    for node in [*replaced, *reversed(ops)]:  # (every reader moved or redirected; a dropout too, which
        if not node.users:                    # erase_dead keeps as impure, and would keep the chain alive)
            graph.erase_node(node)
    erase_dead([start])
    return len(ops)


def _stop_reasons(stops: list, layout: RowLayout) -> list[tuple[fx.Node, str]]:
    """A reason per op across the rows with GEMMs in the layout before (moved, then read back) or after it:
    they run on the padded rows too."""
    reasons, said = [], set()
    for stop, before in stops:
        if stop in said:
            continue
        said.add(stop)
        gemms = [*before, *_gemms(stop, layout, lambda n: [u for u in n.users if layout.keeps(u)])]
        gemms = list(dict.fromkeys(g for g in gemms if g is not stop))
        if not gemms:
            continue
        names = ", ".join(n.name for n in gemms[:4]) + (", ..." if len(gemms) > 4 else "")
        reads = ("reads its neighbouring rows, padded ones included (a convolution wider than one token)"
                 if target_name(stop).startswith("conv") else "reads every row, padded ones included (a batch "
                 "norm's statistics, an op across the rows)")
        reasons.append((stop, f"{len(gemms)} GEMM(s) ({names}) around {layout.name} run on the padded rows too: "
                              f"{stop.name} (`{target_name(stop)}`) {reads}, so what feeds it and what follows it "
                              "depend on the padding; an op over each row (a LayerNorm, a kernel-1 convolution) "
                              "keeps the rows independent"))
    return reasons


_GEMMS = ("linear", "conv1d")


def _gemms(node: fx.Node, layout: RowLayout, step: Callable, limit: int = 60) -> list[fx.Node]:
    """``node`` and the GEMMs reached from it by ``step`` (producers or readers in the layout or the rows)."""
    seen, todo, gemms = set(), [node], []
    while todo and len(seen) < limit:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if target_name(n) in _GEMMS:
            gemms.append(n)
        todo.extend(x for x in step(n) if x not in seen)
    return gemms
