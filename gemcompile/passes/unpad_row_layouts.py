"""Token rows in every layout the unpad pass moves onto (B, N, ...) before it packs them: flattened to
(B*N, ...) (unpad_flat_rows.py), transposed to (B, F, N) (unpad_transposed_rows.py) and sequence-first
(N, B, ...) (unpad_seq_first_rows.py), all through unpad_row_chains.move_chains."""

from __future__ import annotations

from torch import fx

from gemcompile.passes.unpad_flat_rows import unflatten_token_rows
from gemcompile.passes.unpad_seq_first_rows import batch_first_token_rows
from gemcompile.passes.unpad_transposed_rows import untranspose_token_rows


def move_row_layouts(graph: fx.Graph, row_dims: list[tuple]) -> tuple[int, list[tuple[fx.Node, str]]]:
    """Move the chains of every layout onto the (B, N, ...) rows of ``row_dims``: the number of ops moved, and
    (node, reason) for each op across the rows that leaves GEMMs padded."""
    if not row_dims:  # (no row mask: no graph walk)
        return 0, []
    flat = unflatten_token_rows(graph, row_dims)
    transposed = untranspose_token_rows(graph, row_dims)
    sequence_first = batch_first_token_rows(graph, row_dims)
    return flat[0] + transposed[0] + sequence_first, [*flat[1], *transposed[1]]
