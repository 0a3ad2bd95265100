"""GEMMs over a data-dependent token count -> gemcompile::token_mm, GEMMs of bucketed sizes (post-grad).

Packed tokens (passes/unpad.py) make a GEMM's token dim new at every step, and cuBLAS chooses a kernel on
the host for each new shape: 0.2 to 4 ms a call on an H200 (benchmarks/gemm_host_time.py), with the GPU
idle while the forward waits for it. Each ``mm`` / ``addmm`` whose token dim is data-dependent becomes
gemcompile::token_mm (lowering/token_gemm.py), which covers that dim with GEMMs of a few sizes per
octave, so that cuBLAS meets each shape once.

Matches (forward and backward graphs alike):
- ``mm(a, b)`` and ``addmm(bias, a, b)`` (beta = alpha = 1, a bias of N elements) of floating tensors;
- with a's rows (the tokens of a Linear's forward or dgrad) or the reduction dim (the tokens a weight
  gradient sums over) data-dependent (an unbacked symbol: unpad's token count): the first such one of the
  two is split. A symbolic N only is left alone: the output's columns are not a token dim the op splits.
Static shapes are left as they are (cuBLAS caches them), and so are sizes that are symbolic only because the
batch's shape varies (Dynamo's dynamic B and N, backed by the input's sizes): a padded length comes from a
few values that recur (a tokenizer pads to the batch's longest), so cuBLAS meets each new one once (about
0.2-0.4 ms a GEMM on an H200, benchmarks/results/gemm_host_time-20261203-005811.json), while token_mm's own
host time is paid every step (30 such GEMMs of a dynamic SASRec step took 2.5 ms as token_mm,
benchmarks/results/data_masks-varying-lengths-20261207-125929.json, host profile of gem-unpad-off).
"""

from __future__ import annotations

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols, statically_known_true

from gemcompile.lowering.token_gemm import token_mm  # noqa: F401 (registers the op)
from gemcompile.passes.base import GemPass
from gemcompile.passes.graph import copy_source_meta, schema_arguments

aten = torch.ops.aten
_GEMMS = (aten.mm.default, aten.addmm.default)


def _symbolic(size) -> bool:
    """A data-dependent size (module doc): new at nearly every step."""
    return isinstance(size, torch.SymInt) and bool(free_unbacked_symbols(size.node.expr))


def _split_dim(a: torch.Tensor) -> int | None:
    """0 when a's rows are data-dependent, else 1 when the reduction dim is, else None."""
    return next((d for d in (0, 1) if _symbolic(a.shape[d])), None)


class TokenGemmPass(GemPass):
    """mm / addmm with a data-dependent token dim -> gemcompile::token_mm (see the module doc)."""

    name = "token_gemm"
    stage = "post_grad"
    config_section = "token_gemm"

    def run(self, graph: fx.Graph) -> None:
        options = self.options
        splits: dict[int, int] = {0: 0, 1: 0}
        anchor, symbols = None, set()
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target not in _GEMMS:
                continue
            call = schema_arguments(node)
            if node.target is aten.addmm.default:
                bias, a, b = call["self"], call["mat1"], call["mat2"]
            else:
                a, b, bias = call["self"], call["mat2"], None
            values = [x.meta.get("val") if isinstance(x, fx.Node) else None for x in (a, b)]
            if not all(isinstance(v, torch.Tensor) and v.dim() == 2 for v in values):
                continue
            split = _split_dim(values[0])
            if split is None or not values[0].dtype.is_floating_point:
                continue
            if bias is not None and not self._bias_row(node, call, bias, values[1].shape[1]):
                continue
            with graph.inserting_before(node):
                new = graph.call_function(torch.ops.gemcompile.token_mm.default,
                                          (a, b, bias, split, options.per_octave, options.min_rows))
            new.meta["val"] = node.meta["val"]
            copy_source_meta(node, new)
            if anchor is None:
                anchor = new
            splits[split] += 1
            symbols.add(str(values[0].shape[split]))
            node.replace_all_uses_with(new)
            graph.erase_node(node)
        if anchor is not None:  # one report per graph: a step's graphs hold tens to hundreds of these GEMMs
            n = splits[0] + splits[1]
            self.rewrote(anchor, f"{n} mm / addmm over token counts {sorted(symbols)}", f"{n} token_mm",
                         detail=f"{splits[0]} GEMMs over token rows and {splits[1]} summed over tokens, each as "
                                f"GEMMs of {options.per_octave} sizes per octave of the token count",
                         metrics={"gemms": n, "token_rows": splits[0], "token_sums": splits[1]})

    def _bias_row(self, node: fx.Node, call: dict, bias, n) -> bool:
        """Whether addmm's bias is one row of N broadcast over the tokens, with beta = alpha = 1."""
        value = bias.meta.get("val") if isinstance(bias, fx.Node) else None
        if call["beta"] != 1 or call["alpha"] != 1 or not isinstance(value, torch.Tensor):
            self.refused(node, "addmm with beta or alpha other than 1, or a bias that is not a tensor")
            return False
        if not (value.dim() == 1 or (value.dim() == 2 and statically_known_true(value.shape[0] == 1))) or \
                not statically_known_true(value.shape[-1] == n):
            self.refused(node, f"addmm with a bias of shape {tuple(value.shape)}: only a row of N = {n} "
                               f"broadcast over the tokens is supported")
            return False
        return True
