"""Block-diagonal or sliding-window masked self-attention (+ RoPE just before) -> gemcompile::block_attention.

GEM's history self-attention attends within fixed blocks of a sequence (or a window around each
position), so its cost grows linearly with the length; modelers write it as full L x L attention with a
block-diagonal or banded mask and the padding mask from the lengths, usually after rotating q and k
(RoPE). The attention rewrite (attention/rewrite.py) gives this family the softmax attention whose mask has a
block or window term:

1. softmax attention (SDPA with a bool or additive mask, hand-written softmax; attention/match.py);
2. whose mask is proven (masks/) to be key padding ``j < len[b]`` AND fixed blocks ``i // b == j // b``
   and/or a window ``|i - j| <= w`` (``i - j <= w`` causal) [AND causal], with b and w constants;
3. check it is self-attention (one length for queries and keys), that the site has no additive bias, and
   that the kernel serves the block, window and head dim (``kernel_supports`` of the lowering);
4. if q and k are both ``x * cos + rotate(x) * sin`` with one convention (rotate-half or interleaved) and
   one cos/sin table broadcast over heads (attention/rotary.py), pass the un-rotated q, k and the tables so
   the kernel applies RoPE itself (config ``fuse_rotary``); otherwise rotary="none", which is always
   exact (the rotation stays in the graph);
5. replace the attention by one ``block_attention`` call; explain shows block, window, causal and rotary,
   or the reason a candidate was left alone.

Query padding. The op computes every query row, also rows i >= len[b] (their keys j < len[b] in the same
block / window), exactly as eager does for a mask without a query term, unless it is given q_lengths: when
the model zeroes the rows n >= len'[b] + c of the attention's output before any use (``o * valid[..., None]``,
``where``, ``masked_fill``, after merge_heads / out_proj too: masks/rows.py, the proof every family shares,
attention/family.py ``fold_query_rows``), the op skips them (0, with zero gradients). A mask that also has a
query term ``i < len'[b]`` makes eager return 0 (SDPA) or NaN / an average (hand-written) at rows
i >= len'[b]: it is rewritten only when the model zeroes those rows, with the same lengths and an offset no
larger than the mask's; otherwise refused.

Semantics (exact up to rounding at every position the model uses): rows without an allowed key come out
as 0 (eager SDPA also gives 0; a hand-written softmax gives NaN or an average over masked keys there).
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from gemcompile.passes.attention.family import (
    AttentionFamily,
    apart_from_updates,
    check_lengths_device,
    check_qkv,
    dropout_keywords,
    fold_query_rows,
    operands,
    permuted,
    same_size,
    key_mask_operand,
    lengths_operand,
    size_of,
)
from gemcompile.passes.attention.kernels import BLOCK_NO_WINDOW, block_kernel_supports
from gemcompile.passes.attention.match import AttentionSite
from gemcompile.passes.attention.rotary import RotaryMatch, match_rotary_pair, table_layout
from gemcompile.passes.attention.scores import is_call
from gemcompile.passes.attention.finite_fill import check_fill_served
from gemcompile.passes.graph import Emitter, Unproven, erase_dead, example_value
from gemcompile.passes.masks.model import AttentionMask
from gemcompile.passes.records import describe_nodes


class BlockAttention(AttentionFamily):
    """Provable block-diagonal / sliding-window padded self-attention -> gemcompile::block_attention, with
    RoPE fused when it is applied to q and k just before."""

    name = "block_attention"
    config_section = "block_attention"
    masks_served = "key padding and fixed blocks and/or a sliding window [and causal]"
    serves_dropout = True

    def accept(self, site: AttentionSite, mask: AttentionMask) -> None:
        if mask.kv_lengths is None and mask.key_vector is None:
            raise Unproven("no key-padding mask (key index < lengths or a key mask read from data) in the "
                           f"block/window mask; the mask is {mask.formula}")
        check_fill_served(mask)
        if mask.hstu or (mask.block is None and mask.window is None):
            raise Unproven(f"the mask is not {self.masks_served}: it is {mask.formula}")
        if site.bias:
            raise Unproven("an additive bias on the scores (the block-attention kernel has none)")
        if site.heads is not None:
            raise Unproven("batch and heads merged (B * H, L, D) around a bmm: the jagged kernel serves it")

    @staticmethod
    def _query_rows(site: AttentionSite, mask: AttentionMask) -> tuple[AttentionMask, str]:
        """(the mask whose q_lengths the kernel skips, the note for explain): the query rows the model zeroes
        after the attention (attention/family.py). A mask with a query term of its own is rewritten only
        with such a proof (eager's rows past it are 0 or NaN, not attention); Unproven otherwise."""
        if mask.q_lengths is None:
            return fold_query_rows(site, mask)
        why = (f"the mask also drops query rows i >= {mask.q_lengths.name}[b], where eager's rows are not "
               "attention: rewritten only when the model masks those rows after the attention")
        return fold_query_rows(site, mask, within=(mask.q_lengths, mask.q_offset), why=why)

    @staticmethod
    def _check_shapes(q, k, v, block: int, window: int) -> None:
        check_qkv(q, k, v, (1, 1 << 30))
        if not (same_size(q.shape[0], k.shape[0]) and same_size(q.shape[2], k.shape[2])):
            raise Unproven(f"cross-attention (queries {tuple(q.shape)}, keys {tuple(k.shape)}): the block kernel "
                           "serves self-attention, one length for queries and keys")
        reason = block_kernel_supports(block, window, q.shape[-1])
        if reason is not None:
            raise Unproven(f"the block-attention kernel does not serve block={block}, window={window}, "
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
    def _rotated_operands(emit: Emitter, pair: tuple[RotaryMatch, RotaryMatch]):
        """The un-rotated q and k and the cos/sin tables viewed as the kernel takes them."""
        qm, km = pair
        tables = []
        for table in (qm.cos, qm.sin):
            index, _ = table_layout(table, qm.x)
            tables.append(table if index is None else emit.call(operator.getitem, (table, index)))
        return qm.x, km.x, *tables

    # -- emitting ----------------------------------------------------------------------------------
    @staticmethod
    def _lengths(emit: Emitter, mask: AttentionMask, q: fx.Node, k: fx.Node) -> fx.Node:
        """The kernel's (B,) key lengths: the mask's, or every key when the key padding is read from data."""
        if mask.kv_lengths is None:
            kv = example_value(k)
            return emit.call(torch.full, ((size_of(emit, k, 0),), size_of(emit, k, 2)),
                             {"dtype": torch.int32, "device": kv.device})
        check_lengths_device(q, mask.kv_lengths)
        return lengths_operand(emit, mask.kv_lengths, mask.kv_offset, k)  # narrow ints widened (family.py)

    def rewrite(self, emit: Emitter, site: AttentionSite, mask: AttentionMask) -> tuple[str, str]:
        rows, rows_note = self._query_rows(site, mask)
        pair, not_fused = self._rotary(site)
        # what explain shows as replaced: the attention, and the rotations the kernel now applies
        rotations = [] if pair is None else [m.node for m in pair if len(m.node.users) == 1]
        before = describe_nodes(site.matched + rotations)
        block = 0 if mask.block is None else mask.block
        window = BLOCK_NO_WINDOW if mask.window is None else mask.window
        with emit.graph.inserting_before(site.output):
            if pair is not None:
                q, k, cos, sin = self._rotated_operands(emit, pair)
                v = permuted(emit, site.v, site.v_perm)
            else:
                (q, k, v), cos, sin = operands(emit, site), None, None
            self._check_shapes(*(example_value(n) for n in (q, k, v)), block, window)
            lengths = self._lengths(emit, mask, q, k)
            kv_mask = key_mask_operand(emit, mask, k)
            same = rows.q_lengths is mask.kv_lengths and rows.q_offset == mask.kv_offset  # one clamp node
            q_len = lengths if same else lengths_operand(emit, rows.q_lengths, rows.q_offset, q)
            rotary = "none" if pair is None else pair[0].style
            args = (q, k, v, lengths, block, window, bool(mask.causal), cos, sin, rotary, float(site.scale))
            extra = {**({} if q_len is None else {"q_lengths": q_len}), **dropout_keywords(emit, site, q)}
            try:  # the op's own argument checks run on the fake tensors: what they reject is not rewritten
                out = emit.call(torch.ops.gemcompile.block_attention.default,
                                args + ((kv_mask,) if kv_mask is not None else ()), extra)
            except (TypeError, ValueError) as error:
                raise Unproven(f"gemcompile::block_attention rejects the arguments: {error}") from None
            out = apart_from_updates(emit, site, permuted(emit, out, site.out_perm))
        site.output.replace_all_uses_with(out)
        erase_dead(site.matched)
        if pair is not None:
            rope = f"rotary {rotary} fused ({pair[0].cos.name}, {pair[0].sin.name})"
        else:
            rope = "rotary none" + (f" (not fused: {not_fused})" if not_fused else "")
        dropout = f"; dropout p={site.dropout_p:g} in the kernel" if site.dropout_p else ""
        return before, (f"block={block} window={window} causal={mask.causal}; {rope}; "
                        f"mask proven: {mask.describe()}" + (f"; {rows_note}" if rows_note else "") + dropout)


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
