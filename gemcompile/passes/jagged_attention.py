"""Padded softmax attention with a length-derived mask -> gemcompile::jagged_attention.

Runs on the Dynamo graph (pre-grad), where SDPA and nn.MultiheadAttention are single nodes and the
``arange < lengths`` chain is visible, so the custom op's own autograd formula gives the backward.
For each attention (see attention_match.py) the pass proves the mask keeps exactly the scores with
key index < kv_lengths[b] (and, where present, query index < q_lengths[b] and key <= query) by
evaluating the mask's subgraph (mask_provenance.py), then replaces the chain by one op call. What it
cannot prove it leaves alone, with the reason in ``explain``.

Semantics (exact up to rounding at every position the eager model defines): rows with no valid key,
where eager SDPA returns 0 or NaN and a finite fill returns an average over padding, come out as 0;
query rows past q_lengths come out as 0 (eager leaves them masked or NaN too).
"""

from __future__ import annotations

import math
import operator

import sympy
import torch
import torch.fx as fx

from gemcompile.passes.attention_match import (
    AttentionSite,
    check_mha,
    is_call,
    match_sdpa,
    match_softmax,
)
from gemcompile.passes.base import GemPass
from gemcompile.passes.mask_provenance import (
    LengthMask,
    MaskEvaluator,
    Unproven,
    classify_length_mask,
    example_value,
    index_symbol,
    keep_predicate,
)
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

KERNEL_HEAD_DIMS = (16, 128)
"""Head dims the Triton kernel serves (inclusive); other sizes are left to the eager path."""



class JaggedAttentionPass(GemPass):
    """Rewrites provable padded softmax attention into gemcompile::jagged_attention."""

    name = "jagged_attention"
    stage = "pre_grad"
    config_section = "jagged_attention"

    def run(self, graph: fx.Graph) -> None:
        import gemcompile.lowering  # noqa: F401  (registers torch.ops.gemcompile.*)

        fake = FakeRunner(graph)
        for node in list(graph.nodes):
            if getattr(node, "_erased", False) or node.op not in ("call_function", "call_method"):
                continue  # erased: part of an attention rewritten earlier in this loop
            mark = len(fake.created)
            try:
                if is_call(node, "scaled_dot_product_attention"):
                    self._rewrite(graph, fake, match_sdpa(node))
                elif is_call(node, "softmax"):
                    if not self._looks_like_attention(node):
                        continue
                    self._rewrite(graph, fake, match_softmax(node))
                elif is_call(node, "multi_head_attention_forward"):
                    self._rewrite_mha(graph, fake, node)
            except Unproven as reason:
                fake.rollback(mark)
                self.refused(node, str(reason))

    @staticmethod
    def _looks_like_attention(softmax: fx.Node) -> bool:
        """Only report softmaxes that sit on a matmul: a softmax over logits is none of our business."""
        from gemcompile.passes.attention_match import _leads_to_matmul

        return _leads_to_matmul(softmax.args[0])

    # -- proving the mask --------------------------------------------------------------------------
    def _prove(self, site: AttentionSite, batch_is_one: bool) -> LengthMask:
        evaluator = MaskEvaluator()
        keep = sympy.true
        for term in site.masks:
            value = evaluator.tensor(term.node)
            if term.dims:
                value = evaluator.relabel(value, term.dims, 4)
            if term.kind == "additive":
                pred = keep_predicate(evaluator, value, "additive")
            else:
                pred = keep_predicate(evaluator, value, "bool")
                if term.kind == "drop":
                    pred = sympy.Not(pred)
            keep = sympy.And(keep, pred)
        if site.causal_flag:
            keep = sympy.And(keep, evaluator.atoms.compare("le", index_symbol(0), index_symbol(1)))
        keep = sympy.simplify_logic(keep, force=True) if keep.free_symbols else keep
        return classify_length_mask(evaluator, keep, batch_is_one=batch_is_one)

    # -- shapes ------------------------------------------------------------------------------------
    def _check_shapes(self, q, k, v) -> None:
        check_qkv(q, k, v, KERNEL_HEAD_DIMS)
        kv_len = k.shape[2]
        if isinstance(kv_len, int) and kv_len < self.options.min_kv_len:
            raise Unproven(f"only {kv_len} keys (< min_kv_len={self.options.min_kv_len})")

    # -- emitting ----------------------------------------------------------------------------------
    def _emit(self, graph: fx.Graph, fake: FakeRunner, site: AttentionSite, q: fx.Node, k: fx.Node, v: fx.Node,
              lengths: LengthMask) -> fx.Node:
        device = example_value(q).device
        for node in (lengths.kv_lengths, lengths.q_lengths):
            if node is not None and example_value(node).device != device:
                raise Unproven(f"the lengths ({node.name}) are on {example_value(node).device}, the attention on "
                               f"{device}")
        kv_len = clamped_lengths(graph, fake, lengths.kv_lengths, lengths.kv_offset, size_of(graph, fake, k, 2))
        q_len = None if lengths.q_lengths is None else clamped_lengths(
            graph, fake, lengths.q_lengths, lengths.q_offset, size_of(graph, fake, q, 2))
        bias = summed_bias(graph, fake, site.bias)
        out = fake.call(graph, torch.ops.gemcompile.jagged_attention.default,
                        (q, k, v, q_len, kv_len, bias, lengths.causal, float(site.scale)))
        return out

    def _rewrite(self, graph: fx.Graph, fake: FakeRunner, site: AttentionSite) -> None:
        before = describe_nodes(site.matched)
        start = len(fake.created)
        with graph.inserting_before(site.output):
            q = permuted(graph, fake, site.q, site.q_perm)
            if site.k_is_transposed:  # scores were q @ kT: kT.transpose(-2, -1) is k as a view, no copy
                k = fake.call(graph, torch.transpose, (site.k, -2, -1))
            else:
                k = permuted(graph, fake, site.k, site.k_perm)
            v = permuted(graph, fake, site.v, site.v_perm)
            qv, kv, vv = (example_value(n) for n in (q, k, v))
            self._check_shapes(qv, kv, vv)
            lengths = self._prove(site, batch_is_one=qv.shape[0] == 1 and kv.shape[0] == 1)
            out = self._emit(graph, fake, site, q, k, v, lengths)
            out = permuted(graph, fake, out, site.out_perm)
        site.output.replace_all_uses_with(out)
        erase_dead(site.matched)
        self.rewrote(site.anchor, before, fake.created[start:], detail=_describe_mask(lengths))

    def _rewrite_mha(self, graph: fx.Graph, fake: FakeRunner, node: fx.Node) -> None:
        """nn.MultiheadAttention (one Dynamo node): in-projection, jagged attention, out-projection."""
        a = check_mha(node)
        query, key, value = a["query"], a["key"], a["value"]  # (L, B, E): MHA's internal layout
        heads = a["num_heads"]
        embed = a["embed_dim_to_check"]
        head_dim = embed // heads
        mask = a["key_padding_mask"]
        # key_padding_mask (B, S): True (or -inf) marks padding; its dims are (b, j) -> scores' (b, ., ., j)
        mask_kind = "drop" if example_value(mask).dtype == torch.bool else "additive"
        from gemcompile.passes.attention_match import MaskTerm

        site = AttentionSite(anchor=node, output=node, q=query, k=key, v=value, scale=1.0 / math.sqrt(head_dim),
                             masks=[MaskTerm(mask, mask_kind, dims={1: 3, 0: 0})], matched=[node], kind="mha")
        users = list(node.users)
        before = describe_nodes([node])
        start = len(fake.created)
        with graph.inserting_before(node):
            w, b = a["in_proj_weight"], a["in_proj_bias"]
            heads_view = []
            for i, src in enumerate((query, key, value)):
                wi = fake.call(graph, operator.getitem, (w, slice(i * embed, (i + 1) * embed)))
                bi = fake.call(graph, operator.getitem, (b, slice(i * embed, (i + 1) * embed)))
                proj = fake.call(graph, torch.nn.functional.linear, (src, wi, bi))
                length, batch = example_value(src).shape[:2]
                split = fake.call(graph, torch.reshape, (proj, (length, batch, heads, head_dim)))
                heads_view.append(fake.call(graph, torch.permute, (split, (1, 2, 0, 3))))  # (B, H, L, Dh)
            q, k, v = heads_view
            self._check_shapes(*(example_value(n) for n in (q, k, v)))
            lengths = self._prove(site, batch_is_one=example_value(q).shape[0] == 1)
            out = self._emit(graph, fake, site, q, k, v, lengths)
            length, batch = example_value(query).shape[:2]
            merged = fake.call(graph, torch.permute, (out, (2, 0, 1, 3)))  # (L, B, H, Dh)
            merged = fake.call(graph, torch.reshape, (merged, (length, batch, embed)))
            result = fake.call(graph, torch.nn.functional.linear, (merged, a["out_proj_weight"], a["out_proj_bias"]))
        for user in users:
            if user.target is operator.getitem:
                if user.args[1] == 0:
                    user.replace_all_uses_with(result)
                erase_dead([user])
        self.rewrote(node, before, fake.created[start:], detail=_describe_mask(lengths))


def _describe_mask(lengths: LengthMask) -> str:
    parts = [f"keys j < {lengths.kv_lengths.name}[b]" + (f" + {lengths.kv_offset}" if lengths.kv_offset else "")]
    if lengths.q_lengths is not None:
        parts.append(f"queries i < {lengths.q_lengths.name}[b]" + (f" + {lengths.q_offset}" if lengths.q_offset else ""))
    if lengths.causal:
        parts.append("causal j <= i")
    return "mask proven: " + " and ".join(parts)
