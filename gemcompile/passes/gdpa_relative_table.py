"""GDPA over a relative bias -> GDPA reading the bias's table (pre-grad, after the relative_bias and gdpa
passes).

HSTU's relative bias reaches gemcompile::gdpa as ``relative_bias(table, Lq, Lk, offset)`` brought to 4-D by
views (``rab[None, None]``, or ``rab.permute(2, 0, 1)[None]`` for a per-head table). The kernels can read
``table[j - i + offset, h]`` in place instead (lowering/gdpa/relative_table.py): no (Lq, Lk) tensor is built,
and the table's gradient comes from one diagonal-sum kernel.

A gdpa call qualifies when its bias is a relative_bias output through views only (unsqueeze, None/full-slice
indexing, permute, view/reshape that add or drop size-1 dims, expand of size-1 dims, contiguous) and those
views put the rows on dim 2, the columns on dim 3 and the table's head dim (if any) on dim 1, with the
relative_bias spanning exactly (Lq, Lk) and a table of shape (T,) or (T, Hz), Hz in {1, H}. Anything else
(a scaled or summed bias, rows and columns swapped, a table with more dims) keeps the dense bias, with the
reason reported.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from gemcompile.lowering.gdpa.relative_table import check_relative_table
from gemcompile.passes.base import GemPass
from gemcompile.passes.graph import Unproven, erase_dead, example_value, fed_by, schema_arguments

# what a dim of the bias holds; None: a size-1 or broadcast dim
_ROWS, _COLS, _HEADS = "rows", "cols", "heads"


def _from_relative_bias(node: fx.Node) -> bool:
    """Whether a relative_bias feeds ``node`` within 16 producers (else it is no candidate at all)."""
    relative_bias = torch.ops.gemcompile.relative_bias.default
    return fed_by(node, lambda n: n.op == "call_function" and n.target is relative_bias, limit=16)


def _call(node: fx.Node, names: tuple[str, ...], functions: tuple) -> bool:
    if node.op == "call_method":
        return node.target in names
    return node.op == "call_function" and node.target in functions


def _dims_of(node: fx.Node) -> list[int]:
    """The dims argument of permute / expand / view, whether given as *dims or as one sequence."""
    rest = list(node.args[1:])
    if len(rest) == 1 and isinstance(rest[0], (list, tuple)):
        rest = list(rest[0])
    if not rest and "dims" in node.kwargs:
        rest = list(node.kwargs["dims"])
    return rest


def _layout(node: fx.Node) -> tuple[fx.Node, list]:
    """(the relative_bias node, what each dim of ``node`` holds), following views; Unproven otherwise."""
    chain = []
    while not (node.op == "call_function" and node.target is torch.ops.gemcompile.relative_bias.default):
        chain.append(node)
        inputs = [a for a in node.args[:1] if isinstance(a, fx.Node)]
        if node.op not in ("call_function", "call_method") or not inputs:
            raise Unproven(f"the bias is computed by {node.op} {node.target}, not a view of relative_bias")
        node = inputs[0]
        if len(chain) > 16:
            raise Unproven("the bias is more than 16 views away from a relative_bias")
    table = example_value(node.args[0])
    if table.dim() > 2:
        raise Unproven(f"the table has {table.dim()} dims (served: (T,) or (T, heads))")
    layout = [_ROWS, _COLS] + ([_HEADS] if table.dim() == 2 else [])
    for view in reversed(chain):
        layout = _apply(view, layout, example_value(view.args[0]), example_value(view))
    return node, layout


def _apply(view: fx.Node, layout: list, before: torch.Tensor, after: torch.Tensor) -> list:
    """The layout after one view (Unproven when the view is not one of the served kinds)."""
    if _call(view, ("unsqueeze",), (torch.unsqueeze,)):
        dim = view.args[1] if len(view.args) > 1 else view.kwargs["dim"]
        dim = dim + len(layout) + 1 if dim < 0 else dim
        return layout[:dim] + [None] + layout[dim:]
    if _call(view, ("permute",), (torch.permute,)):
        perm = [d % len(layout) for d in _dims_of(view)]
        return [layout[d] for d in perm]
    if _call(view, ("contiguous",), ()):
        return layout
    if _call(view, ("expand",), ()):
        sizes = _dims_of(view)
        new = [None] * (len(sizes) - len(layout)) + layout
        for size_before, size_after, held in zip(before.shape[::-1], after.shape[::-1], new[::-1]):
            if size_before != size_after and held is not None:
                raise Unproven("expand changes a dim of the relative bias itself")
        return new
    if view.op == "call_function" and view.target is operator.getitem and isinstance(view.args[1], tuple):
        return _index(view.args[1], layout)
    if _call(view, ("view", "reshape"), (torch.reshape,)):
        kept_before = [(s, h) for s, h in zip(before.shape, layout) if s != 1]
        kept_after = [s for s in after.shape if s != 1]
        if [s for s, _ in kept_before] != kept_after or any(h is not None and s == 1
                                                            for s, h in zip(before.shape, layout)):
            raise Unproven("a reshape that does more than add or drop size-1 dims")
        held = iter(h for _, h in kept_before)
        return [None if s == 1 else next(held) for s in after.shape]
    raise Unproven(f"the bias goes through {view.target} (not a served view)")


def _index(index: tuple, layout: list) -> list:
    """Indexing by None, full slices and one Ellipsis only."""
    out, rest = [], list(layout)
    for pos, item in enumerate(index):
        if item is None:
            out.append(None)
        elif item is Ellipsis:
            explicit = sum(1 for x in index[pos + 1:] if x is not None)
            take = len(rest) - explicit
            out.extend(rest[:take])
            rest = rest[take:]
        elif isinstance(item, slice) and item == slice(None):
            out.append(rest.pop(0))
        else:
            raise Unproven(f"the bias is indexed by {item!r} (only None and ':' are views it can follow)")
    return out + rest


class GdpaRelativeTablePass(GemPass):
    """gdpa(..., bias = views of relative_bias(table, ...)) -> gdpa(..., table, relative_offset=offset)."""

    name = "gdpa_relative_table"
    stage = "pre_grad"
    config_section = "gdpa"

    @property
    def enabled(self) -> bool:
        return self.options.enabled and self.options.read_relative_table

    def run(self, graph: fx.Graph) -> None:
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target is not torch.ops.gemcompile.gdpa.default:
                continue
            call = schema_arguments(node)
            bias = call["bias"]
            if not isinstance(bias, fx.Node) or call["relative_offset"] is not None:
                continue  # no bias, or already a table
            if not _from_relative_bias(bias):
                continue
            try:
                rel, offset, table = self._prove(node, bias)
            except Unproven as e:
                self.refused(node, f"gdpa keeps a dense relative bias: {e}")
                continue
            call |= {"bias": table, "relative_offset": offset}
            args = tuple(call[a.name] for a in node.target._schema.arguments)
            before = f"gdpa(..., bias={bias.name}: a view of {rel.name} = relative_bias(...))"
            with graph.inserting_before(node):
                new = graph.call_function(node.target, args)
            new.meta.update(node.meta)
            node.replace_all_uses_with(new)
            graph.erase_node(node)
            erase_dead([bias])
            self.rewrote(new, before, [new], detail=(
                f"the kernels read table {table.name} at j - i + {offset} in place (no (Lq, Lk) bias); its "
                "gradient is one diagonal-sum kernel"), metrics={"offset": offset})

    @staticmethod
    def _prove(node: fx.Node, bias: fx.Node) -> tuple[fx.Node, int, fx.Node]:
        rel, layout = _layout(bias)
        if layout[2:] != [_ROWS, _COLS] or layout[0] is not None or layout[1] not in (None, _HEADS):
            raise Unproven(f"its dims hold {layout} (needed: [None, heads or None, rows, cols])")
        table, rows, cols, offset = rel.args
        q, k = example_value(node.args[0]), example_value(node.args[1])
        if (rows, cols) != (q.shape[2], k.shape[2]):
            raise Unproven(f"the relative bias spans ({rows}, {cols}), the attention "
                           f"({q.shape[2]}, {k.shape[2]})")
        try:  # what the op will check: heads, span, dtype, device
            check_relative_table(example_value(table), int(offset), k.shape[1], rows, cols, q.device)
        except (TypeError, ValueError) as e:
            raise Unproven(str(e)) from e
        return rel, int(offset), table
