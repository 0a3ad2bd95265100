"""Query rows a model zeroes right after a gemcompile attention op that already writes them as zero.

Models zero the padded query rows of an attention output, ``o = attention(...) * valid[:, None, :, None]``
(issue 25's plain padded module; ``torch.where(m, o, 0)`` and ``o.masked_fill(~m, 0)`` too). The attention
passes fold that zeroing into the op's q_lengths (attention/family.py ``fold_query_rows``): the op then
writes exact zeros at rows n >= q_lengths[b] and ignores the output gradient there (the ops' contract: their
references zero ``grad_out`` at those rows, and the kernel tests feed NaN there). The zeroing stays in the
graph, in the head layout (B, H, N, D), where the unpad pass reads it as one more reader of the output's
padded rows: the q projection then stayed padded and the attention was never packed (a two-layer BERT-style
stack had 3 gathers and 5 scatters instead of 1 and 1).

``drop_zeroed_query_rows`` replaces such a zeroing by the op's output where it changes nothing: it zeroes
rows n >= lengths[b] + c (masks/rows.py, the proof the attention passes fold with) of an op whose q_lengths
are the same lengths node with an offset <= c (unpad_attention.lengths_arg_mask: the clamp the passes emit),
and its result has the output's shape and dtype (no broadcast, no type promotion). Exact: where the zeroing
keeps a row it multiplies by 1 (or keeps it), where it zeroes one the op wrote 0 already; in the backward it
passed the gradient where it kept the row, and 0 where the op ignores it.
"""

from __future__ import annotations

import torch
from torch import fx

from gemcompile.passes.graph import Unproven, erase_dead, example_value, schema_arguments, target_name
from gemcompile.passes.masks.rows import zeroing_rows
from gemcompile.passes.token_wise import shape_of
from gemcompile.passes.unpad_attention import PACKED_LAYOUTS, lengths_arg_mask

BATCH_DIM, ROW_DIM = 0, 2
"""(B, H, N, D): where an attention op's output holds the batch and its query rows."""


def _query_rows(node: fx.Node) -> tuple[fx.Node, int] | None:
    """(lengths, offset) of a gemcompile attention op that writes zeros at rows n >= lengths[b] + offset."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload) or \
            node.target.namespace != "gemcompile" or target_name(node) not in PACKED_LAYOUTS:
        return None
    shape = shape_of(node)
    if shape is None or len(shape) != 4:
        return None
    return lengths_arg_mask(schema_arguments(node).get("q_lengths"), shape[ROW_DIM])


def _redundant(user: fx.Node, node: fx.Node, rows: tuple[fx.Node, int]) -> bool:
    """Whether ``user`` zeroes rows of ``node`` that the op already writes as zero, and nothing else."""
    value, out = example_value(user), example_value(node)
    if not isinstance(value, torch.Tensor) or value.shape != out.shape or value.dtype != out.dtype:
        return False
    try:
        zeroed = zeroing_rows(user, node, BATCH_DIM, ROW_DIM)
    except Unproven:  # zeroes by another mask: a reader like any other
        return False
    return zeroed is not None and zeroed[0] is rows[0] and zeroed[1] >= rows[1]


def drop_zeroed_query_rows(graph: fx.Graph) -> list[tuple[fx.Node, fx.Node]]:
    """Replace each zeroing the op already did by the op's output (module doc). Returns (op, lengths) per
    zeroing dropped, for the record."""
    dropped = []
    for node in list(graph.nodes):
        rows = _query_rows(node)
        if rows is None:
            continue
        for user in list(node.users):
            if _redundant(user, node, rows):
                user.replace_all_uses_with(node)
                erase_dead([user])  # and the valid[:, None, :, None] views and casts only it read
                dropped.append((node, rows[0]))
    return dropped
