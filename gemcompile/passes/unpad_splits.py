"""A fused projection split along a feature dim, written as the slices it is, so the unpad pass can pack it.

GPT-2 and nanoGPT write ``q, k, v = self.c_attn(x).split(E, dim=2)``: one Linear, then ``split`` (or
``chunk`` / ``tensor_split`` / ``unbind``) and a ``getitem`` per piece. The pieces are token-wise, but the
split node returns a tuple, which the token-wise table (token_wise.py, one tensor per node) does not describe:
the unpad pass read the split as an unknown reader of the projection's padded rows and left the whole
region before attention padded (the same model with three Linears was packed).

``slice_feature_splits`` replaces each piece ``split(x, ..., dim)[k]`` of a tensor with the row dims
(batch, seq) first and ``dim >= 2`` by ``x[:, :, ..., a:b]`` (``x[:, :, ..., k]`` for ``unbind``), with a
and b read from the pieces' traced shapes. Exact: both are views of the same elements, the same strides,
offset and autograd; the table already packs such a getitem. Splits of any other dim, pieces with symbolic
sizes, and split results used other than by an integer getitem stay as they are.
"""

from __future__ import annotations

import operator
from collections.abc import Container

from torch import fx

from gemcompile.passes.graph import example_value, target_name
from gemcompile.passes.token_wise import has_rows, node_argument, shape_of

SPLITS = {"split": 2, "chunk": 2, "tensor_split": 2, "split_with_sizes": 2, "unbind": 1}
"""The ops that cut a tensor into pieces along one dim: name -> position of their ``dim`` argument."""


def _pieces(node: fx.Node, batch, seq) -> tuple[fx.Node, int, list[tuple[int, int]] | None] | None:
    """(x, dim, [(start, stop)] per piece, None for unbind) of a split of a (batch, seq, ...) tensor along a
    feature dim, or None."""
    name = target_name(node)
    if node.op not in ("call_function", "call_method") or name not in SPLITS or not node.args:
        return None
    x = node.args[0]
    shape = shape_of(x)
    pieces = example_value(node)
    dim = node_argument(node, SPLITS[name], "dim", 0)
    if shape is None or not has_rows(shape, batch, seq) or not isinstance(dim, int) or \
            not isinstance(pieces, (tuple, list)):
        return None
    dim %= len(shape)
    if dim < 2 or not isinstance(shape[dim], int):
        return None
    if name == "unbind":
        return x, dim, None
    sizes = [p.shape[dim] if len(p.shape) == len(shape) else None for p in pieces]
    if not all(isinstance(s, int) for s in sizes) or sum(sizes) != shape[dim]:
        return None
    starts = [sum(sizes[:k]) for k in range(len(sizes))]
    return x, dim, [(a, a + s) for a, s in zip(starts, sizes)]


def slice_feature_splits(graph: fx.Graph, row_dims: list[tuple], keep: Container[fx.Node] = ()) -> int:
    """Rewrite the pieces of feature-dim splits of tensors with rows (batch, seq) for any of ``row_dims``
    into slices, except pieces in ``keep`` (the row masks found); the number of split nodes rewritten."""
    rewritten = 0
    for node in list(graph.nodes):
        found = next(filter(None, (_pieces(node, b, n) for b, n in row_dims)), None)
        if found is None or not node.users:
            continue
        users = list(node.users)
        if not all(u not in keep and u.op == "call_function" and u.target is operator.getitem and len(u.args) == 2 and not u.kwargs
                   and isinstance(u.args[1], int) and not isinstance(u.args[1], bool) for u in users):
            continue
        x, dim, bounds = found
        for user in users:
            k = user.args[1]
            piece = k if bounds is None else slice(*bounds[k])
            index = (*[slice(None)] * dim, piece)
            with graph.inserting_before(user):
                sliced = graph.call_function(operator.getitem, (x, index))
            sliced.meta.update(user.meta)
            user.replace_all_uses_with(sliced)
            graph.erase_node(user)
        graph.erase_node(node)
        rewritten += 1
    return rewritten
