"""Padded pointwise-activation attention -> gemcompile::gdpa (pre-grad, Dynamo graph).

For each activation that sits between ``q @ k^T`` and ``@ v`` (gdpa_match.py; for identity attention, the
first mask op on the raw scores) the pass proves the mask
(gdpa_mask.py: key padding, query padding, causal, local window, or none), reads the normalizer (a
constant, or the key lengths per sample), and replaces the chain by one op call. Query rows are
skipped when the mask says so or when the model multiplies the attention's output by a query-row mask
downstream (what GEM-ref's PFFN cross-attention does); otherwise every query row is computed, as in
eager. What cannot be proven is left alone, with the reason in ``explain``.

Semantics (exact up to rounding at every position the model uses): pairs the mask drops contribute
nothing; rows without a valid pair, and skipped query rows, come out as 0.
"""

from __future__ import annotations

import dataclasses
import operator

import sympy
import torch
import torch.fx as fx

from gemcompile.passes.base import GemPass
from gemcompile.passes.gdpa_mask import GdpaMask, classify_gdpa_mask, downstream_row_mask
from gemcompile.passes.gdpa_match import GdpaSite, activation_of, identity_scores, match_gdpa
from gemcompile.passes.jagged_attention import KERNEL_HEAD_DIMS
from gemcompile.passes.mask_provenance import MaskEvaluator, Unproven, example_value, keep_predicate
from gemcompile.passes.records import describe_nodes
from gemcompile.passes.rewrite_utils import (
    FakeRunner,
    check_qkv,
    clamped_lengths,
    erase_dead,
    permuted,
    size_of,
    summed_bias,
)

_LENGTH_VIEWS = ("view", "reshape", "unsqueeze", "to", "float", "double", "half", "bfloat16", "type_as",
                 "getitem", "expand", "expand_as", "contiguous")


class GdpaPass(GemPass):
    """Rewrites provable padded pointwise attention into gemcompile::gdpa."""

    name = "gdpa"
    stage = "pre_grad"
    config_section = "gdpa"

    def run(self, graph: fx.Graph) -> None:
        import gemcompile.lowering  # noqa: F401  (registers torch.ops.gemcompile.*)

        fake = FakeRunner(graph)
        for node in list(graph.nodes):
            if getattr(node, "_erased", False) or node.op not in ("call_function", "call_method"):
                continue
            identity = None
            if activation_of(node) is None or not _feeds_from_scores(node):
                identity = identity_scores(node)
                if identity is None:
                    continue  # an activation in an MLP is none of our business
            mark = len(fake.created)
            try:
                site = match_gdpa(node) if identity is None else match_gdpa(identity, identity=True)
                self._rewrite(graph, fake, site)
            except Unproven as reason:
                fake.rollback(mark)
                self.refused(node, str(reason))

    # -- proofs ------------------------------------------------------------------------------------
    def _prove(self, site: GdpaSite, batch_is_one: bool) -> GdpaMask:
        evaluator = MaskEvaluator()
        keep = sympy.true
        for node, kind in site.masks:
            value = evaluator.tensor(node)
            pieces = getattr(value, "pieces", None)
            if kind == "keep" and pieces is not None and any(v not in (0.0, 1.0) for v, _ in pieces):
                raise Unproven(f"the activated scores are multiplied by {node.name}, which holds values other "
                               "than 0 and 1 (weights, not a mask)")
            pred = keep_predicate(evaluator, value, "bool")
            keep = sympy.And(keep, pred if kind == "keep" else sympy.Not(pred))
        if 0 < len(keep.free_symbols) <= 8:  # simplify only small formulas: it is exponential in the atoms
            keep = sympy.simplify_logic(keep, force=True)
        return classify_gdpa_mask(evaluator, keep, batch_is_one=batch_is_one)

    @staticmethod
    def _divides_by_kv_length(site: GdpaSite, mask: GdpaMask) -> bool:
        if site.divisor is None:
            return False
        node = site.divisor
        while node.op in ("call_function", "call_method") and (
            (node.target is operator.getitem) or getattr(node.target, "__name__", node.target) in _LENGTH_VIEWS
        ):
            node = node.args[0]
        shape = example_value(site.divisor).shape
        if mask.kv_lengths is None or node is not mask.kv_lengths or mask.kv_offset != 0:
            raise Unproven(f"the activated scores are divided by {site.divisor.name}, which is not the key "
                           "lengths of the mask")
        if len(shape) != 4 or any(s != 1 for s in shape[1:]):
            raise Unproven(f"the per-sample normalizer {site.divisor.name} does not have shape (B, 1, 1, 1)")
        return True

    def _rewrite(self, graph: fx.Graph, fake: FakeRunner, site: GdpaSite) -> None:
        before = describe_nodes(site.matched)
        start = len(fake.created)
        with graph.inserting_before(site.output):
            q = permuted(graph, fake, site.q, site.q_perm)
            if site.k_is_transposed:
                k = fake.call(graph, torch.transpose, (site.k, -2, -1))
            else:
                k = permuted(graph, fake, site.k, site.k_perm)
            v = permuted(graph, fake, site.v, site.v_perm)
            qv, kv, vv = (example_value(n) for n in (q, k, v))
            check_qkv(qv, kv, vv, KERNEL_HEAD_DIMS)
            mask = self._prove(site, batch_is_one=qv.shape[0] == 1 and kv.shape[0] == 1)
            divide = self._divides_by_kv_length(site, mask)
            detail = mask.describe()
            if mask.q_lengths is None:
                row_mask = self._downstream_rows(site)
                if row_mask is not None:
                    mask = dataclasses.replace(mask, q_lengths=row_mask[0], q_offset=row_mask[1])
                    detail = f"{mask.describe()} (query rows masked after the attention)"
            for node in (mask.kv_lengths, mask.q_lengths, mask.num_targets):
                if node is not None and example_value(node).device != qv.device:
                    raise Unproven(f"the lengths ({node.name}) are on {example_value(node).device}, the attention "
                                   f"on {qv.device}")
            kv_len = None if mask.kv_lengths is None else clamped_lengths(
                graph, fake, mask.kv_lengths, mask.kv_offset, size_of(graph, fake, k, 2))
            q_len = None if mask.q_lengths is None else clamped_lengths(
                graph, fake, mask.q_lengths, mask.q_offset, size_of(graph, fake, q, 2))
            bias = summed_bias(graph, fake, site.bias)
            args = (q, k, v, q_len, kv_len, bias, site.activation, float(site.scale), float(site.out_scale),
                    divide, mask.causal, int(mask.window))
            if mask.num_targets is not None or mask.contextual_len:
                if qv.shape[0] != kv.shape[0] or qv.shape[2] != kv.shape[2]:
                    raise Unproven("HSTU's target/contextual mask needs self-attention (q and k of one shape)")
                args += (mask.num_targets, int(mask.contextual_len))
            out = fake.call(graph, torch.ops.gemcompile.gdpa.default, args)
            out = permuted(graph, fake, out, site.out_perm)
        site.output.replace_all_uses_with(out)
        erase_dead(site.matched)
        self.rewrote(site.anchor, before, fake.created[start:],
                     detail=f"{site.activation}; mask proven: {detail}"
                     + ("; normalized by the key lengths" if divide else ""))

    @staticmethod
    def _downstream_rows(site: GdpaSite):
        """The query-row mask a model applies after the attention, if it is provable (else None: every row
        is computed, exactly as in eager)."""
        if site.out_perm is not None:
            return None
        try:
            return downstream_row_mask(site.output, batch_dim=0, row_dim=2)
        except Unproven:
            return None


def _feeds_from_scores(node: fx.Node) -> bool:
    from gemcompile.passes.attention_match import _leads_to_matmul

    arg = node.args[0] if node.args else node.kwargs.get("input")
    if not isinstance(arg, fx.Node) or not _leads_to_matmul(arg):
        return False
    value = example_value(arg)
    return isinstance(value, torch.Tensor) and value.dim() == 4  # (B, H, Lq, Lk) scores
