"""Sums over packed tokens, padded back to a static row count so that Inductor can split them (post-grad).

Unpad's token count T is an unbacked SymInt. torch 2.13's Inductor sizes a reduction over T with the
hint unpad gives it (UnpadConfig.expected_fill). Earlier Inductors (2.11) split no reduction whose size
holds an unbacked symbol: a column sum over T rows then runs as one program per column that walks all
T rows. On GEM-ref small (H200, fill 0.7) the bias and norm-weight gradients, sums over T, took up to
5 ms each that way (benchmarks/results/unpad-profile-20261130-064413.json).

This pass rewrites such a sum into a sum over ``constant_pad_nd(x)`` that pads T up to U, its static
upper bound (B * N). Zero rows leave a sum unchanged; the padded size is a plain integer, so Inductor
splits the reduction; and Inductor lowers the pad as a masked load fused into the reduction, so no
buffer of U rows is ever written. Only sums qualify (a mean or a max would change).
"""

from __future__ import annotations

import operator

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from gemcompile.passes.base import GemPass

aten = torch.ops.aten

SUMS = (aten.sum.dim_IntList, aten.sum.default)


def inductor_splits_unbacked_reductions() -> bool:
    """Whether this torch's Inductor splits a reduction over a hinted unbacked size (torch >= 2.13)."""
    from gemcompile.lowering.valid_tokens import inductor_reads_unbacked_hints

    return inductor_reads_unbacked_hints()


def _static_bound(size) -> int | None:
    """The finite integer upper bound of a data-dependent size, None for a static or unbounded one (under
    dynamic shapes T's bound B * N is symbolic: torch's int_oo, no integer)."""
    if isinstance(size, int) or not free_unbacked_symbols(size):
        return None
    node = size.node
    upper = node.shape_env.bound_sympy(node.expr).upper
    return int(upper) if getattr(upper, "is_Integer", False) else None


def _reduced_dims(node: fx.Node, rank: int) -> list[int]:
    if node.target is aten.sum.default:
        return list(range(rank))
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if not dims:  # sum(x, []) reduces every dim
        return list(range(rank))
    return sorted({d % rank for d in dims})


class UnpadReductionsPass(GemPass):
    """Pads the packed-token dimension of each sum over it to its static bound (see the module doc)."""

    name = "unpad_reductions"
    stage = "post_grad"
    config_section = "unpad"
    # how Inductor then compiles these sums (its block sizes) changes the kernels: part of the cache key
    source_modules = ("gemcompile.passes.packed_reduction_blocks",)

    @property
    def enabled(self) -> bool:
        options = self.options
        if not options.enabled:
            return False
        if options.pad_reductions is None:
            return not inductor_splits_unbacked_reductions()
        return options.pad_reductions

    def run(self, graph: fx.Graph) -> None:
        rewritten, bounds = [], set()
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target not in SUMS:
                continue
            x = node.args[0]
            val = x.meta.get("val") if isinstance(x, fx.Node) else None
            if not isinstance(val, torch.Tensor) or val.dim() == 0:
                continue
            pads = {d: _static_bound(val.shape[d]) for d in _reduced_dims(node, val.dim())}
            pads = {d: bound for d, bound in pads.items() if bound is not None}
            if not pads:
                continue
            node.replace_input_with(x, self._pad(graph, node, x, val, pads))
            rewritten.append(node)
            bounds.update(pads.values())
        if rewritten:
            self.rewrote(rewritten[0], rewritten, f"{len(rewritten)} sums over packed tokens, padded",
                         detail=f"{len(rewritten)} sums over a data-dependent token count padded to its bound "
                                f"{sorted(bounds)} (zero rows), so that Inductor splits them",
                         metrics={"sums": len(rewritten)})

    @staticmethod
    def _pad(graph: fx.Graph, before: fx.Node, x: fx.Node, val: torch.Tensor, pads: dict[int, int]) -> fx.Node:
        """constant_pad_nd(x) with dim d grown from its size to pads[d] (zeros at the end)."""
        rank = val.dim()
        amounts: list = [0] * (2 * rank)
        with graph.inserting_before(before):
            for d, bound in pads.items():
                size = graph.call_function(aten.sym_size.int, (x, d))
                size.meta["val"] = val.shape[d]
                amount = graph.call_function(operator.sub, (bound, size))
                amount.meta["val"] = bound - val.shape[d]
                slot = 2 * (rank - 1 - d) + 1  # constant_pad_nd lists (low, high) pairs from the last dim
                amounts[slot] = amount
            padded = graph.call_function(aten.constant_pad_nd.default, (x, amounts, 0.0))
        # (the op's own meta wants concrete pads; its output is a fresh contiguous tensor of the bounds)
        with val.fake_mode:
            padded.meta["val"] = val.new_empty([pads.get(d, size) for d, size in enumerate(val.shape)])
        for key in ("stack_trace", "nn_module_stack", "source_fn_stack", "original_aten"):
            if key in before.meta:
                padded.meta[key] = before.meta[key]
        return padded
