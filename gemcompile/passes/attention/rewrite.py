"""AttentionRewritePass: padded attention -> one custom-op call, for every attention kernel family.

Runs on the Dynamo graph (pre-grad), where SDPA and nn.MultiheadAttention are single nodes and the
``arange < lengths`` chains are visible, so each op's own autograd formula gives the backward. One walk
over the graph; for each attention it

1. finds the site once (attention/match.py): SDPA, nn.MultiheadAttention, a hand-written softmax, or a
   pointwise activation (GDPA; identity attention anchored on its first mask op);
2. proves its mask once: the mask terms' subgraphs are evaluated over index symbols (masks/evaluator.py)
   into one formula, classified as an AttentionMask (masks/classify.py);
3. picks the kernel family, here and only here: pointwise attention -> gdpa (attention/gdpa.py); softmax
   attention with a block or window term -> block_attention (attention/block.py) when that family is on,
   else -> jagged_attention (attention/jagged.py);
4. lets the family accept the mask and site (or say why not) and emit its op, rolling the graph back when
   it refuses midway.

Then every attention op gets the batch order / key bounds of its lengths and mask from one shared node per
distinct lengths or mask (attention/plans.py), instead of deriving them on each call, forward and backward.

What cannot be proven is left alone, with the reason in ``explain`` under the family that would have
served it. An error of the pass itself while it takes a site apart (a bug, or a graph it never saw) leaves
that site alone too, named as an internal error in ``explain`` and in a warning, rather than failing the
user's compile; ``GEMCOMPILE_STRICT=1`` (the test suite's setting) raises it instead. Each family keeps
its name, config section and row in explain; its rewrites and refusals are recorded family by family
(block, jagged, gdpa), each in graph order.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import warnings
from collections.abc import Callable
from typing import ClassVar

import sympy
import torch.fx as fx

from gemcompile.passes.attention.block import BlockAttention
from gemcompile.passes.attention.family import AttentionFamily
from gemcompile.passes.attention.gdpa import Gdpa
from gemcompile.passes.attention.finite_fill import fill_dtype
from gemcompile.passes.attention.in_place import functionalize_fresh_updates
from gemcompile.passes.attention.unit_dims import drop_unit_dim_views
from gemcompile.passes.attention.row_flattened import fold_row_flattened_masks
from gemcompile.passes.attention.jagged import JaggedAttention
from gemcompile.passes.attention.match import (
    AttentionSite,
    activation_of,
    feeds_from_scores,
    identity_scores,
    looks_like_attention,
    match_pointwise,
    match_sdpa,
    match_softmax,
)
from gemcompile.passes.attention.mha import match_mha
from gemcompile.passes.attention.plans import share_derived_tensors
from gemcompile.passes.attention.scores import is_call
from gemcompile.passes.base import GemPass
from gemcompile.passes.graph import Emitter, Unproven, example_value
from gemcompile.passes.masks.vmap import lower_vmapped_masks
from gemcompile.passes.masks.classify import Unclassified, classify
from gemcompile.passes.masks.evaluator import MaskEvaluator, index_symbol, keep_predicate
from gemcompile.passes.masks.model import AttentionMask
from gemcompile.passes.masks.values import piecewise
from gemcompile.passes.masks.terms import mentions_structure
from gemcompile.passes.records import describe_nodes
from gemcompile.env import env_flag

Matcher = Callable[[], AttentionSite]


class AttentionRewritePass(GemPass):
    """Rewrites provable padded attention into the op of the kernel family that serves it."""

    name = "attention"
    stage = "pre_grad"
    source_modules = ("gemcompile.passes.graph", "gemcompile.passes.attention.match",
                      "gemcompile.passes.attention.scores", "gemcompile.passes.attention.rotary",
                      "gemcompile.passes.attention.kernels", "gemcompile.passes.attention.finite_fill",
                      "gemcompile.passes.attention.plans",
                      "gemcompile.passes.masks.values", "gemcompile.passes.masks.constants",
                      "gemcompile.passes.masks.key_vector", "gemcompile.passes.masks.evaluator",
                      "gemcompile.passes.masks.terms", "gemcompile.passes.masks.prover",
                      "gemcompile.passes.masks.model", "gemcompile.passes.masks.classify",
                      "gemcompile.passes.masks.rows")
    family_types: ClassVar[tuple[type[AttentionFamily], ...]] = (BlockAttention, JaggedAttention, Gdpa)
    """The kernel families, in the order explain lists them and their records."""

    def __init__(self, config):
        super().__init__(config)
        self.families = tuple(family(config) for family in self.family_types)
        self.block, self.jagged, self.gdpa = self.families

    @property
    def parts(self) -> tuple[GemPass, ...]:
        return self.families

    @property
    def enabled(self) -> bool:
        return any(family.enabled for family in self.families)

    def uuid(self) -> str:
        """Each family's uuid covers its module, config section and options; this one the shared modules."""
        h = hashlib.sha256(super().uuid().encode())
        for family in self.families:
            h.update(family.uuid().encode())
        return h.hexdigest()

    def run(self, graph: fx.Graph) -> None:
        lower_vmapped_masks(graph)  # transformers' masks built under torch.vmap, as broadcast ops
        # `s /= c`, `s.masked_fill_(pad, -inf)`: chains the matchers read (run_pre_grad did the top graph
        # already; a checkpointed region's graph comes here directly)
        functionalize_fresh_updates(graph)
        drop_unit_dim_views(graph)  # fairseq's 5-D view of the scores around its masked_fill
        fold_row_flattened_masks(graph)  # d2l: the scores masked as (M, Lk) rows, then shaped back
        emit = Emitter(graph)
        transformed = _functorch_transform(graph)
        records: dict[str, list[Callable[[], None]]] = {family.name: [] for family in self.families}
        for node in list(graph.nodes):
            if getattr(node, "_erased", False) or node.op not in ("call_function", "call_method"):
                continue  # erased: part of an attention rewritten earlier in this loop
            found = self._candidate(node)
            if found is None:
                continue
            family, match = found
            mark = emit.mark()
            try:
                site = match()
                if transformed:
                    raise Unproven(f"the graph runs torch.func.{transformed} (functorch): the kernels' autograd "
                                   "does not run under functorch transforms")
                family, mask = self._prove(site, family)
                if family is None:
                    continue
                if isinstance(mask, Unproven):
                    raise mask
                family.accept(site, mask)
                if mask.diagonal and not family.serves_kept_diagonal:
                    raise Unproven(f"the mask keeps the diagonal besides the rest ({mask.describe()}): the "
                                   f"{family.name} kernel does not serve it")
                if site.dropout_p >= 1.0:
                    raise Unproven(f"dropout p={site.dropout_p:g} on the attention weights drops every weight "
                                   "(eager's output is 0): nothing for a kernel to compute")
                if site.dropout_p and not family.serves_dropout:
                    raise Unproven(f"dropout (p={site.dropout_p:g}) on the attention weights in training: the "
                                   f"{family.name} kernel has none (eval() or p=0 runs it)")
                if mask.query_vector is not None and not family.serves_query_vector:
                    raise Unproven(f"query padding read from data ({mask.query_vector.text}) is served by the "
                                   "jagged kernel only")
                with graph.inserting_before(site.output):
                    for check in mask.checks:
                        check(emit)
                before, detail = family.rewrite(emit, site, mask)
            except Unproven as reason:
                emit.rollback(mark)
                if family.enabled:
                    records[family.name].append(functools.partial(family.refused, node, str(reason)))
                continue
            except Exception as error:  # noqa: BLE001 (module doc: a bug of ours must not fail the compile)
                if env_flag("GEMCOMPILE_STRICT", False):
                    raise
                emit.rollback(mark)
                reason = ("internal error of gemcompile, the attention is left as written: "
                          f"{type(error).__name__}: {error}")
                warnings.warn(f"gemcompile: {node.name}: {reason}", stacklevel=2)
                records[family.name].append(functools.partial(family.refused, node, reason))
                continue
            after = describe_nodes(emit.created[mark:])
            records[family.name].append(functools.partial(family.rewrote, site.anchor, before, after, detail))
        share_derived_tensors(graph)  # one order / key bounds per lengths or mask, for every op (plans.py)
        for family in self.families:
            for record in records[family.name]:
                record()

    def _candidate(self, node: fx.Node) -> tuple[AttentionFamily, Matcher] | None:
        """(the family that reports on the site, its matcher) when node anchors an attention that an enabled
        family could serve."""
        softmax_served = self.jagged.enabled or self.block.enabled
        if is_call(node, "scaled_dot_product_attention"):
            return (self.jagged, functools.partial(match_sdpa, node)) if softmax_served else None
        if is_call(node, "softmax"):
            found = softmax_served and looks_like_attention(node)
            return (self.jagged, functools.partial(match_softmax, node)) if found else None
        if is_call(node, "multi_head_attention_forward"):
            return (self.jagged, functools.partial(match_mha, node)) if self.jagged.enabled else None
        if is_call(node, "_transformer_encoder_layer_fwd") and self.jagged.enabled:
            return self.jagged, functools.partial(_fused_encoder_layer, node)
        if not self.gdpa.enabled:
            return None
        if activation_of(node) is not None and feeds_from_scores(node):
            return self.gdpa, functools.partial(match_pointwise, node)
        identity = identity_scores(node)
        if identity is not None:
            return self.gdpa, functools.partial(match_pointwise, identity, identity=True)
        return None

    def _prove(self, site: AttentionSite, family: AttentionFamily
               ) -> tuple[AttentionFamily | None, AttentionMask | Unproven]:
        """The family that serves the site (None: that family is off, leave the site alone) and the site's
        mask, or the refusal in that family's words when the mask is not proven."""
        evaluator = MaskEvaluator()
        try:
            keep = keep_formula(evaluator, site)
            mask = classify(evaluator, keep, batch_is_one=_batch_is_one(site))
            if site.activation is None:
                fill, replaces = finite_fill(evaluator, site)
                stacked = fill is not None and sum(_adds_a_fill(evaluator, t) for t in site.masks) > 1
                mask = dataclasses.replace(mask, fill=fill, fill_replaces=replaces, fill_stacked=stacked,
                                           fill_dtype=fill_dtype(site))
            mask = dataclasses.replace(mask, checks=tuple(evaluator.checks))
        except Unproven as error:
            if site.activation is None and self.block.enabled and mentions_structure([t.node for t in site.masks]):
                family = self.block  # a mask meant as blocks or a window: the block family's refusal
            refusal = family.refusal(error) if isinstance(error, Unclassified) else error
            return (family if family.enabled else None), refusal
        if site.activation is None and (mask.block is not None or mask.window is not None) and self.block.enabled:
            family = self.block
            if site.kind == "mha":
                return family, Unproven(f"nn.MultiheadAttention with a {'block' if mask.block else 'sliding-window'}"
                                        " attn_mask: the block kernel serves F.scaled_dot_product_attention or a "
                                        "hand-written softmax over (B, H, L, D) tensors, not MultiheadAttention")
        return (family if family.enabled else None), mask


def _functorch_transform(graph: fx.Graph) -> str | None:
    """"grad" / "jvp" when Dynamo traced a functorch transform into the graph (torch.func.grad inside the
    compiled function), else None. vmap is no transform here: its masks are lowered to broadcast ops."""
    for node in graph.nodes:
        name = getattr(node.target, "__name__", "")
        if node.op == "call_function" and name in ("_grad_increment_nesting", "_jvp_increment_nesting"):
            return name[1:].split("_")[0]
    return None


def _fused_encoder_layer(node: fx.Node) -> None:
    raise Unproven("nn.TransformerEncoderLayer's fast path (torch._transformer_encoder_layer_fwd, taken in eval "
                   "mode with autograd off) runs the whole layer as one op, attention inside; "
                   "torch.backends.mha.set_fastpath_enabled(False) keeps the layer's ops in the graph")


def keep_formula(evaluator: MaskEvaluator, site: AttentionSite):
    """The condition under which the site keeps the score (b, h, i, j): every mask term of the site, and
    SDPA's is_causal, in one formula over the scores' index symbols."""
    keep = sympy.true
    for term in site.masks:
        value = evaluator.tensor(term.node)
        if term.negated:
            value = piecewise(value.ndim, [(-v, c) for v, c in value.pieces])
        if term.dims:
            value = evaluator.relabel(value, term.dims, 4)
        pieces = getattr(value, "pieces", None)
        if term.kind == "keep" and pieces is not None and any(v not in (0.0, 1.0) for v, _ in pieces):
            raise Unproven(f"the activated scores are multiplied by {term.node.name}, which holds values other "
                           "than 0 and 1 (weights, not a mask)")
        pred = keep_predicate(evaluator, value, "additive" if term.kind == "additive" else "bool")
        keep = sympy.And(keep, sympy.Not(pred) if term.kind == "drop" else pred)
    if site.causal_flag:
        keep = sympy.And(keep, evaluator.atoms.compare("le", index_symbol(0), index_symbol(1)))
    if 0 < len(keep.free_symbols) <= 8:  # exponential in the atoms: simplify small formulas only
        keep = sympy.simplify_logic(keep, force=True)
    return keep


def finite_fill(evaluator: MaskEvaluator, site: AttentionSite) -> tuple[float | None, bool]:
    """(the one finite value the site's softmax mask drops scores with, or None for -inf and bool masks;
    whether it replaces the scores (masked_fill, where) rather than adding to them). Unproven when dropped
    scores get several values (eager then ranks them: rows with no valid key attend to the least negative)
    or both spellings (their gradients differ)."""
    gated = {t.fill for t in site.masks if t.fill_added}  # where(keep, bias, F) added: F is added
    added = {f for f in evaluator.fills if math.isfinite(f)} | gated
    replaced = {t.fill for t in site.masks if t.fill is not None and not t.fill_added}
    fills = set(evaluator.fills) | replaced | gated
    finite = sorted(f for f in fills if math.isfinite(f))
    if not finite:
        return None, False
    if len(fills) > 1:
        shown = ", ".join(f"{f:g}" for f in sorted(fills))
        raise Unproven(f"the mask drops scores with several values ({shown}): a row with no valid key would "
                       "attend, in eager, to the keys of the least negative one")
    if added and replaced:
        raise Unproven(f"the fill {finite[0]:g} is both added to the scores and written over them: the two "
                       "spellings give a row with no valid key different gradients")
    return finite[0], bool(replaced)


def _adds_a_fill(evaluator: MaskEvaluator, term) -> bool:
    """Whether a mask term adds a fill to some score: an additive term that is 0 everywhere (HF T5's
    ``position_bias = torch.zeros(...)`` of a layer without a relative bias) adds none."""
    if term.fill_added:
        return True
    if term.kind != "additive":
        return False
    pieces = getattr(evaluator.tensor(term.node), "pieces", None)
    return pieces is None or any(value != 0 for value, _ in pieces)


def _batch_is_one(site: AttentionSite) -> bool:
    """Whether q and k have a batch of one (then lengths indexed by 0 are per-sample too)."""
    if site.kind == "mha":  # (L, B, E)
        return example_value(site.q).shape[1] == 1
    batch = [example_value(x).shape[perm[0] if perm else 0] for x, perm in ((site.q, site.q_perm),
                                                                           (site.k, site.k_perm))]
    if site.qk_merged:  # (B * H, L, D): the batch is that dim over the heads
        batch = [b // site.heads if isinstance(b, int) and site.heads else b for b in batch]
    return batch == [1, 1]
