"""Block-diagonal or sliding-window masked self-attention (+ RoPE just before) -> gemcompile::block_attention.

GEM's history self-attention attends within fixed blocks of a sequence (or a window around each
position), so its cost grows linearly with the length; modelers write it as full L x L attention with a
block-diagonal or banded mask and the padding mask from the lengths, usually after rotating q and k
(RoPE). This pass runs on the Dynamo graph (pre-grad) before gdpa and jagged_attention:

1. find softmax attention (SDPA with a bool or additive mask, hand-written softmax; attention_match.py);
2. evaluate its mask (mask_provenance.py) and prove it is key padding ``j < len[b]`` AND fixed blocks
   ``i // b == j // b`` and/or a window ``|i - j| <= w`` (``i - j <= w`` causal) [AND causal], with b and
   w constants (block_mask.py). A mask with neither a block nor a window term is left, silently, to the
   jagged-attention pass;
3. check it is self-attention (one length for queries and keys), that the site has no additive bias, and
   that the kernel serves the block, window and head dim (``kernel_supports`` of the lowering);
4. if q and k are both ``x * cos + rotate(x) * sin`` with one convention (rotate-half or interleaved) and
   one cos/sin table broadcast over heads (rotary_match.py), pass the un-rotated q, k and the tables so
   the kernel applies RoPE itself (config ``fuse_rotary``); otherwise rotary="none", which is always
   exact (the rotation stays in the graph);
5. replace the attention by one ``block_attention`` call; explain shows block, window, causal and rotary,
   or the reason a candidate was left alone.

Query padding. The op computes every query row, also rows i >= len[b] (their keys j < len[b] in the same
block / window), exactly as eager does for a mask without a query term. A mask that also has a query term
``i < len'[b]`` makes eager return 0 (SDPA) or NaN / an average (hand-written) at rows i >= len'[b], where
the op would return nonzero values. Such a mask is rewritten only when the rows do not matter: the model
multiplies the attention's output by ``row < len'[b] + c`` downstream (gdpa_mask.downstream_row_mask,
through row-wise ops), with the same lengths and an offset no larger than the mask's; otherwise refused.

Semantics (exact up to rounding at every position the model uses): rows without an allowed key come out
as 0 (eager SDPA also gives 0; a hand-written softmax gives NaN or an average over masked keys there).
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from gemcompile.passes.attention_match import (
    AttentionSite,
    _leads_to_matmul,
    is_call,
    match_sdpa,
    match_softmax,
)
from gemcompile.passes.base import GemPass
from gemcompile.passes.block_mask import (
    BlockMask,
    BlockMaskEvaluator,
    classify_block_mask,
    mentions_structure,
)
from gemcompile.passes.gdpa_mask import downstream_row_mask
from gemcompile.passes.jagged_attention import KERNEL_HEAD_DIMS
from gemcompile.passes.mask_provenance import Unproven, example_value
from gemcompile.passes.records import describe_nodes
from gemcompile.passes.rewrite_utils import (
    FakeRunner,
    check_qkv,
    clamped_lengths,
    erase_dead,
    permuted,
    site_keep_predicate,
    size_of,
)
from gemcompile.passes.rotary_match import RotaryMatch, match_rotary_pair, table_layout


def kernel_support(block: int, window: int, head_dim: int) -> str | None:
    """None when the block-attention kernel serves (block, window, head_dim), else the reason; the
    lowering's ``kernel_supports`` decides (before it exists: the jagged kernel's head dims)."""
    try:
        from gemcompile.lowering.common.checks import kernel_supports
    except ImportError:
        lo, hi = KERNEL_HEAD_DIMS
        return None if lo <= head_dim <= hi else f"head dim {head_dim} is outside what the kernel serves ({lo}..{hi})"
    return kernel_supports(block, window, head_dim)


def _op_available() -> bool:
    import gemcompile.lowering  # noqa: F401  (registers torch.ops.gemcompile.*)

    return hasattr(torch.ops.gemcompile, "block_attention")


def _transposed_source(node: fx.Node) -> fx.Node | None:
    """X when node is X with its last two dims swapped (``k.transpose(-2, -1)``, ``k.mT``), else None."""
    if not isinstance(node, fx.Node) or example_value(node) is None or example_value(node).dim() != 4:
        return None
    if is_call(node, "transpose", "swapaxes") and len(node.args) == 3 and {
            d % 4 for d in node.args[1:3] if isinstance(d, int)} == {2, 3}:
        return node.args[0]
    if is_call(node, "permute"):
        dims = node.args[1] if isinstance(node.args[1], (list, tuple)) else node.args[1:]
        if [d % 4 for d in dims] == [0, 1, 3, 2]:
            return node.args[0]
    if node.op == "call_function" and node.target is getattr and node.args[1] == "mT":
        return node.args[0]
    return None


class BlockAttentionPass(GemPass):
    """Rewrites provable block-diagonal / sliding-window padded self-attention into
    gemcompile::block_attention, with RoPE fused when it is applied to q and k just before."""

    name = "block_attention"
    stage = "pre_grad"
    config_section = "block_attention"

    def run(self, graph: fx.Graph) -> None:
        fake = FakeRunner(graph)
        for node in list(graph.nodes):
            if getattr(node, "_erased", False) or node.op not in ("call_function", "call_method"):
                continue
            if is_call(node, "scaled_dot_product_attention"):
                matcher = match_sdpa
            elif is_call(node, "softmax") and node.args and _leads_to_matmul(node.args[0]):
                matcher = match_softmax
            else:
                continue
            try:
                site = matcher(node)
            except Unproven:
                continue  # not attention this pass could take: the jagged-attention pass reports it
            mask_nodes = [t.node for t in site.masks]
            try:
                mask = self._prove(site)
            except Unproven as reason:
                if mentions_structure(mask_nodes):
                    self.refused(node, str(reason))
                continue
            if mask is None:
                continue  # no block or window: the jagged-attention pass's
            mark = len(fake.created)
            try:
                self._rewrite(graph, fake, site, mask)
            except Unproven as reason:
                fake.rollback(mark)
                self.refused(node, str(reason))

    # -- proofs ------------------------------------------------------------------------------------
    @staticmethod
    def _prove(site: AttentionSite) -> BlockMask | None:
        if not site.masks:
            return None
        q, k = example_value(site.q), example_value(site.k)
        evaluator = BlockMaskEvaluator()
        keep = site_keep_predicate(evaluator, site)
        return classify_block_mask(evaluator, keep, batch_is_one=q.shape[0] == 1 and k.shape[0] == 1)

    @staticmethod
    def _check_rows(site: AttentionSite, mask: BlockMask) -> str:
        """'' without a query term; the note for explain when a query term is harmless; Unproven otherwise."""
        if mask.q_lengths is None:
            return ""
        why = (f"the mask also drops query rows i >= {mask.q_lengths.name}[b], which the kernel computes: "
               "rewritten only when the model masks those rows after the attention")
        if site.out_perm is not None:
            raise Unproven(why)
        try:
            rows, offset = downstream_row_mask(site.output, batch_dim=0, row_dim=2)
        except Unproven as reason:
            raise Unproven(f"{why} ({reason})") from None
        if rows is not mask.q_lengths or offset > mask.q_offset:
            raise Unproven(f"{why} (the model masks rows by {rows.name}[b] + {offset} instead)")
        return " (the query rows it drops are masked after the attention)"

    def _check_shapes(self, q, k, v, mask: BlockMask) -> None:
        from torch.fx.experimental.symbolic_shapes import statically_known_true as known

        check_qkv(q, k, v, (1, 1 << 30))
        if not (known(q.shape[0] == k.shape[0]) and known(q.shape[2] == k.shape[2])):
            raise Unproven(f"cross-attention (queries {tuple(q.shape)}, keys {tuple(k.shape)}): the block kernel "
                           "serves self-attention, one length for queries and keys")
        reason = kernel_support(mask.block, mask.window, q.shape[-1])
        if reason is not None:
            raise Unproven(f"the block-attention kernel does not serve block={mask.block}, window={mask.window}, "
                           f"head dim {q.shape[-1]}: {reason}")

    # -- RoPE --------------------------------------------------------------------------------------
    def _rotary(self, site: AttentionSite) -> tuple[tuple[RotaryMatch, RotaryMatch] | None, str]:
        """The fusable (q, k) rotations, or None and why not ('' when q and k are not rotated)."""
        if site.q_perm is not None or site.k_perm is not None:
            return None, ""
        k = _transposed_source(site.k) if site.k_is_transposed else site.k
        if k is None:
            return None, ""
        try:
            pair = match_rotary_pair(site.q, k)
        except Unproven as reason:
            return None, str(reason)
        if pair is not None and not self.options.fuse_rotary:
            return None, "fuse_rotary is off"
        return pair, ""

    @staticmethod
    def _table(graph: fx.Graph, fake: FakeRunner, table: fx.Node, x: fx.Node) -> fx.Node:
        index, _ = table_layout(table, x)
        return table if index is None else fake.call(graph, operator.getitem, (table, index))

    # -- emitting ----------------------------------------------------------------------------------
    def _rewrite(self, graph: fx.Graph, fake: FakeRunner, site: AttentionSite, mask: BlockMask) -> None:
        if site.bias:
            raise Unproven("an additive bias on the scores (the block-attention kernel has none)")
        if not _op_available():
            raise Unproven("the gemcompile::block_attention op is not available")
        rows_note = self._check_rows(site, mask)
        start = len(fake.created)
        pair, not_fused = self._rotary(site)
        # what explain shows as replaced: the attention, and the rotations the kernel now applies
        rotations = [] if pair is None else [m.node for m in pair if len(m.node.users) == 1]
        before = describe_nodes(site.matched + rotations)
        with graph.inserting_before(site.output):
            if pair is not None:
                qm, km = pair
                q, k = qm.x, km.x
                cos, sin = self._table(graph, fake, qm.cos, q), self._table(graph, fake, qm.sin, q)
                rotary = qm.style
            else:
                q = permuted(graph, fake, site.q, site.q_perm)
                if site.k_is_transposed:
                    k = fake.call(graph, torch.transpose, (site.k, -2, -1))
                else:
                    k = permuted(graph, fake, site.k, site.k_perm)
                cos = sin = None
                rotary = "none"
            v = permuted(graph, fake, site.v, site.v_perm)
            qv, kv, vv = (example_value(n) for n in (q, k, v))
            self._check_shapes(qv, kv, vv, mask)
            lv = example_value(mask.lengths)
            if lv.device != qv.device:
                raise Unproven(f"the lengths ({mask.lengths.name}) are on {lv.device}, the attention on {qv.device}")
            if lv.dtype not in (torch.int32, torch.int64):
                raise Unproven(f"the lengths ({mask.lengths.name}) are {lv.dtype}, not int32 or int64")
            lengths = clamped_lengths(graph, fake, mask.lengths, mask.offset, size_of(graph, fake, k, 2))
            try:  # the op's own argument checks run on the fake tensors: what they reject is not rewritten
                out = fake.call(graph, torch.ops.gemcompile.block_attention.default,
                                (q, k, v, lengths, int(mask.block), int(mask.window), bool(mask.causal), cos, sin,
                                 rotary, float(site.scale)))
            except (TypeError, ValueError) as error:
                raise Unproven(f"gemcompile::block_attention rejects the arguments: {error}") from None
            out = permuted(graph, fake, out, site.out_perm)
        site.output.replace_all_uses_with(out)
        erase_dead(site.matched)
        if rotary != "none":
            rope = f"rotary {rotary} fused ({pair[0].cos.name}, {pair[0].sin.name})"
        else:
            rope = "rotary none" + (f" (not fused: {not_fused})" if not_fused else "")
        self.rewrote(site.anchor, before, fake.created[start:],
                     detail=f"block={mask.block} window={mask.window} causal={mask.causal}; {rope}; "
                            f"mask proven: {mask.describe()}{rows_note}")
