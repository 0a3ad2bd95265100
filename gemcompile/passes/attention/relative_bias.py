"""Relative-position bias gathers -> gemcompile::relative_bias (pre-grad).

HSTU and T5-style attention add ``table[j - i + c]`` to the scores, written as a gather with an index
built from aranges: ``table[arange(L)[None, :] - arange(L)[:, None] + L - 1]``. The gather's autograd
backward scatters L*L gradients into 2L-1 table rows with accumulation (atomic adds under Inductor).
gemcompile::relative_bias computes the same values and sums each diagonal instead
(lowering/relative_bias/op.py).

A gather ``table[idx]`` (operator.getitem or aten.index on a tensor index) qualifies when:
- the table is a floating tensor;
- the index is a 2-D integer tensor of static shape (rows, cols);
- evaluated over index symbols (passes/masks/evaluator.py), the index is exactly ``j - i + offset`` for an
  integer constant offset (i the row, j the column);
- every position it reads lies in the table (a negative one would wrap around in eager: left alone).

Anything else the gather is left as it is. An index built from an arange that the evaluator cannot
prove Toeplitz (a clamped or bucketed relative position, for instance) is reported as a refusal with the
reason, so explain shows why; gathers by data (embedding-style lookups) are not candidates at all.
"""

from __future__ import annotations

import operator

import sympy
import torch
from torch import fx

from gemcompile.lowering.relative_bias.op import positions_span
from gemcompile.passes.base import GemPass
from gemcompile.passes.graph import Unproven, example_value, fed_by
from gemcompile.passes.masks.evaluator import IntTensor, MaskEvaluator, index_symbol

aten = torch.ops.aten


def _gather_operands(node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(table, index) of a gather by one 2-D integer tensor index, else None."""
    if node.op != "call_function":
        return None
    if node.target is operator.getitem and len(node.args) == 2:
        table, idx = node.args
    elif node.target is aten.index.Tensor and len(node.args) == 2 and len(node.args[1]) == 1:
        table, (idx,) = node.args
    else:
        return None
    if not isinstance(table, fx.Node) or not isinstance(idx, fx.Node):
        return None
    t, i = example_value(table), example_value(idx)
    if not isinstance(t, torch.Tensor) or not isinstance(i, torch.Tensor):
        return None
    if not t.dtype.is_floating_point or t.dim() < 1 or i.dim() != 2:
        return None
    if i.dtype.is_floating_point or i.dtype == torch.bool or i.dtype.is_complex:
        return None
    return table, idx


def _built_from_arange(idx: fx.Node) -> bool:
    """Whether an arange feeds the index (within 64 nodes): a relative position, not a data lookup."""
    return fed_by(idx, lambda n: n.op == "call_function" and "arange" in str(n.target))


def _absolute_positions(idx: fx.Node) -> bool:
    """Whether the index reads one position only (Whisper's and CodeGen's ``weight[position_ids]``): an
    absolute position embedding, no pairwise bias to look for."""
    try:
        value = MaskEvaluator().tensor(idx)
    except Unproven:
        return False
    return isinstance(value, IntTensor) and not {index_symbol(1), index_symbol(0)} <= value.expr.free_symbols


def toeplitz_offset(idx: fx.Node) -> int:
    """The constant c of an index proven to be ``idx[i, j] = j - i + c``; Unproven otherwise."""
    value = MaskEvaluator().tensor(idx)
    if not isinstance(value, IntTensor):
        raise Unproven("the index is not an integer tensor the evaluator can follow")
    i, j = index_symbol(1), index_symbol(0)
    rest = sympy.expand(value.expr - (j - i))
    if rest.free_symbols or not rest.is_integer:
        raise Unproven(f"the index is {value.expr} (i = r1 the row, j = r0 the column), not j - i + constant")
    return int(rest)


class RelativeBiasPass(GemPass):
    """Gathers of a Toeplitz relative-position index -> gemcompile::relative_bias (see the module doc)."""

    name = "relative_bias"
    stage = "pre_grad"
    config_section = "relative_bias"

    def run(self, graph: fx.Graph) -> None:
        import gemcompile.lowering  # noqa: F401  registers gemcompile::relative_bias

        rewrote = False
        for node in list(graph.nodes):
            operands = _gather_operands(node)
            if operands is None or not _built_from_arange(operands[1]) or _absolute_positions(operands[1]):
                continue
            table, idx = operands
            rows, cols = example_value(idx).shape
            table_rows = example_value(table).shape[0]
            if not all(isinstance(s, int) for s in (rows, cols, table_rows)):
                self.refused(node, "relative bias: the index or table has a dynamic shape")
                continue
            try:
                offset = toeplitz_offset(idx)
            except Unproven as e:
                self.refused(node, f"relative bias: the gather index is not a relative position j - i + c: {e}")
                continue
            lo, hi = positions_span(rows, cols, offset)
            if rows and cols and (lo < 0 or hi >= table_rows):
                self.refused(node, f"relative bias: positions j - i + {offset} span [{lo}, {hi}], outside the "
                                   f"table's {table_rows} rows (negative ones wrap around in eager)")
                continue
            with graph.inserting_before(node):
                new = graph.call_function(torch.ops.gemcompile.relative_bias.default, (table, rows, cols, offset))
            new.meta.update(node.meta)
            self.rewrote(node, [node], [new], detail=(
                f"table {table.name} ({table_rows} rows) gathered at j - i + {offset}, i < {rows}, j < {cols}: "
                "the backward sums diagonals (no scatter with accumulation)"),
                metrics={"rows": rows, "cols": cols, "offset": offset})
            node.replace_all_uses_with(new)
            graph.erase_node(node)
            rewrote = True
        if rewrote:
            graph.eliminate_dead_code()  # the index's arange arithmetic
