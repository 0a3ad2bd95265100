"""Sums over packed tokens of a tensor that is written to memory anyway -> gemcompile::token_column_sum
(post-grad).

A Linear applied to packed tokens has its bias gradient as ``sum(dY, [0])`` over the (T, N) output
gradient, T unbacked. Inductor compiles a reduction over an unbacked row count without its size, and its
sums took about twice as long as torch's own reduction on the H200 (lowering/token_column_sum.py). dY is
in memory already (the GEMMs of the input and weight gradients read it), so summing it in a kernel of
its own costs nothing that a fused sum saved.

Matches ``aten.sum.dim_IntList(x, [0] or [-2], keepdim[, dtype=a float dtype])`` on CUDA (torch 2.11
writes a half sum as one with dtype=float32 followed by a cast), x 2-D float16 /
bfloat16 / float32 (through views of one), whose row count is symbolic (packed tokens; a static T is
left to Inductor, which splits it) and whose column count is static and at least ``min_columns``, when x
(or the tensor it views) is materialized anyway: a graph input, the output of a GEMM or of a gemcompile op,
or also read by one. A sum Inductor could fuse into the kernel producing x (x read by pointwise ops only)
stays.
"""

from __future__ import annotations

import torch
from torch import fx

from gemcompile.passes.base import GemPass
from gemcompile.passes.graph import copy_source_meta

aten = torch.ops.aten
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
_EXTERN = (aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default)


def _writes_memory(node: fx.Node) -> bool:
    """A graph input or the result of an op Inductor runs as an external kernel (a GEMM, a gemcompile op)."""
    if node.op == "placeholder":
        return True
    target = node.target
    return node.op == "call_function" and (
        target in _EXTERN or getattr(target, "overloadpacket", None) is aten.mm  # mm.dtype
        or getattr(target, "namespace", None) == "gemcompile")


def _materialized(x: fx.Node) -> bool:
    """Whether x's values are in memory whatever happens to the sum: x, or the tensor it views, is written
    by an external kernel or read by one."""
    source = x
    while source.op == "call_function" and source.target in _VIEWS:
        source = source.args[0]
    nodes = [source, *[u for u in source.users if u.op == "call_function" and u.target in _VIEWS]]
    return _writes_memory(source) or any(_writes_memory(u) for n in nodes for u in n.users)


def _token_sum(node: fx.Node, min_columns: int) -> fx.Node | None:
    """x when ``node`` is a sum over the packed-token rows of a 2-D x this pass takes (module doc)."""
    if node.op != "call_function" or node.target is not aten.sum.dim_IntList:
        return None
    dtype = node.kwargs.get("dtype")
    if set(node.kwargs) - {"dtype"} or (dtype is not None and dtype not in _DTYPES):
        return None
    x, dims = node.args[0], node.args[1]
    if len(node.args) > 3 or not isinstance(x, fx.Node) or list(dims or ()) not in ([0], [-2]):
        return None
    value = x.meta.get("val")
    if not isinstance(value, torch.Tensor) or value.dim() != 2 or value.device.type != "cuda":
        return None
    rows, cols = value.shape
    if value.dtype not in _DTYPES or isinstance(rows, int) or not isinstance(cols, int) or cols < min_columns:
        return None
    return x if _materialized(x) else None


class TokenColumnSumPass(GemPass):
    """sum(x, [0]) over packed tokens of a materialized x -> gemcompile::token_column_sum (module doc)."""

    name = "token_column_sums"
    stage = "post_grad"
    config_section = "token_column_sums"

    def run(self, graph: fx.Graph) -> None:
        import gemcompile.lowering  # noqa: F401  registers gemcompile::token_column_sum

        rewritten = []
        for node in list(graph.nodes):
            x = _token_sum(node, self.options.min_columns)
            if x is None:
                continue
            want = node.meta["val"]
            with graph.inserting_before(node):
                out = graph.call_function(torch.ops.gemcompile.token_column_sum.default, (x,),
                                          {"dtype": node.kwargs["dtype"]} if node.kwargs.get("dtype") else {})
                out.meta["val"] = want.reshape(want.shape[-1])
                if want.dim() == 2:  # keepdim: (1, N)
                    out = graph.call_function(aten.view.default, (out, list(want.shape)))
                    out.meta["val"] = want
            copy_source_meta(node, out)
            node.replace_all_uses_with(out)
            graph.erase_node(node)
            rewritten.append(x)
        if rewritten:
            columns = sum(x.meta["val"].shape[1] for x in rewritten)
            self.rewrote(rewritten[0], f"{len(rewritten)} x sum(x, [0]) over packed tokens",
                         f"{len(rewritten)} x gemcompile.token_column_sum(x)",
                         detail=f"{len(rewritten)} sums over the token rows of tensors in memory anyway "
                                f"(bias gradients), {columns} columns in all, summed by torch.sum",
                         metrics={"sums": len(rewritten), "columns": columns})
