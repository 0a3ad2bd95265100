"""UnpadPass: run the token-wise region of a padded sequence on packed tokens, so GEMMs skip padding.

A padded model computes its projections, norms and token FFNs on B x N rows, a (1 - fill) share of them
padding. This pass finds, for each row mask (unpad_masks.py: a length mask ``arange(N) < lengths[:, None]``,
or any per-token vector read from data, ``ids != 0``, an attention_mask, left padding, holes), the connected
region of token-wise ops over its (B, N) rows (token_wise.py has the table) and rewrites the region onto the
packed (T, ...) layout:

    index = gemcompile.valid_token_index(lengths, N)      # (T,), T = valid tokens, data-dependent
          | gemcompile.valid_mask_index(valid)            # (the vector rebuilt from the tensors it reads)
    b, n = index // N, index % N
    entry:  x_packed = x[b, n]                            # one gather per tensor entering the region
    inside: the same ops on (T, ...) rows
    exit:   zeros(B, N, ...).index_put((b, n), y_packed)  # one scatter per tensor leaving it

Why it is exact. Packing commutes with a token-wise op, so every packed value holds exactly the valid
rows of the padded one. What packing loses is the padded rows: an exit writes zeros there. An exit is
therefore allowed only where that cannot change the answer, proven by one of two analyses:
- *pad-zero*: the value is zero at every padded row in the eager model too (a product with the mask,
  sums of such values, a bias-free linear or a zero-preserving activation of one);
- *pad-blind*: every reader ignores the padded rows (a product with the mask; a fill of the padded rows
  by it, ``h.masked_fill(~valid[..., None], -inf)`` before a max; the keys and values of
  a gemcompile attention op with these lengths, or whose kv_mask provably keeps only valid tokens of this
  vector; a token-wise op or attention query whose own result is pad-blind, through views and transposes;
  a reader whose value nothing uses): unpad_pad_blind.py.
"The mask" is always the region's own: a product with another vector (one the prover cannot show equal)
makes nothing harmless, so zeroing with one vector never excuses packing by another.
A value whose exit is neither stays padded (and the region shrinks around it), reported in explain.

Attention ops with a packed layout (block_attention; gdpa's queries, jagged_attention's keys) do not end the
region: where their token-row operands leave it by its own scatters, split into heads, and a token-row
output comes back by its own gather, the op reads and writes the packed rows instead (unpad_attention.py
says why that is exact); explain lists them in the record.
Pad-zero takes 0 * x and 0 / x as 0: where eager's padded rows hold inf or NaN, the packed program has
zeros there instead (the convention the attention rewrites follow for fully masked rows).

Under dynamic shapes (Dynamo recompiles with symbolic B and N once either changes between calls, as with a
tokenizer that pads each batch to its longest sequence) the same rewrite applies: the emitted nodes read B and
N from the size inputs Dynamo lifts (graph.size_argument), never as constants, and add no guard on them, so
one dynamic graph still serves every later batch. Token buckets need static B and N (refused otherwise).

By default T is a dynamic dimension, not a bucketed capacity: ``valid_token_index`` has an unbacked SymInt size,
so one compiled graph serves every batch (no recompiles, no capacity to overflow, no rows wasted on a
bucket's slack). The price is one device-to-host read of T per region per step, measured in the
unpad benchmark (a token vector's T is read once per step for every region it packs). A capacity would
need T on the host just the same (to pick the bucket) and would recompile once per bucket.
The exception is CUDA graphs: CUDA-graph trees record a graph per distinct size, so a new T records anew.
``UnpadConfig.token_buckets = k`` rounds T up to one of k + 1 capacities (the index ops' ``buckets``): the
slack rows gather a real token (row B - 1; x there is finite wherever the model's is), scatter into an extra
batch row B that each exit slices away, and so get a zero gradient; still no recompile.
"""

from __future__ import annotations

import functools
import operator
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch.utils._pytree import tree_map

import gemcompile.lowering.valid_tokens  # noqa: F401  registers gemcompile::valid_token_index
from gemcompile.passes.base import GemPass
from gemcompile.passes.graph import (Emitter, Unproven, copy_source_meta, drop_dead_tensors, erase_dead,
                                     example_value, hoist_before, size_argument, target_name)
from gemcompile.passes.graph_liveness import size_hint
from gemcompile.passes.masks.key_vector import emit_token_vector
from gemcompile.passes.masks.zero_one import emit_zero_one_check
from gemcompile.passes.records import input_path
from gemcompile.passes.token_wise import (
    TokenWise,
    classify,
    dtype_of,
    has_rows,
    same_size,
    shape_of,
    zero_preserving,
)
from gemcompile.passes.unpad_attention import RegionIndex, emit_token_offsets, pack_attentions
from gemcompile.passes.unpad_dropout import packed_op, uniform_like_packed
from gemcompile.passes.unpad_losses import insert_label_masks, pack_label_losses, remove_unused_label_masks
from gemcompile.passes.unpad_reasons import checkpointed_reasons, unanchored_reasons
from gemcompile.passes.unpad_row_layouts import move_row_layouts
from gemcompile.passes.unpad_masks import (
    RowFill,
    RowMask,
    check_key,
    emit_row_mask_checks,
    find_row_masks,
    unchecked_zero_one,
    vector_leaves,
    zero_exactly_where_data_is,
    zero_one_checked,
)
from gemcompile.passes.unpad_contractions import zero_at
from gemcompile.passes.unpad_pad_blind import PadAnalysis, keys_of
from gemcompile.passes.unpad_row_reads import pack_row_reads
from gemcompile.passes.unpad_splits import slice_feature_splits
from gemcompile.passes.unpad_zeroed_rows import drop_zeroed_query_rows
from gemcompile.env import env_flag
from gemcompile.passes.masks.mutation import in_place_update, update_after


@dataclass

class Region:
    """The nodes of one length mask's token-wise region that run packed."""

    mask: RowMask
    nodes: list[fx.Node]
    rules: dict[fx.Node, TokenWise]
    stays_padded: dict[fx.Node, str] = field(default_factory=dict)
    """Each node dropped from the region because an exit of it would read its padded rows: why (its root's)."""
    weights: frozenset = frozenset()
    """Integer tensors the masks read as 0/1 that may hold other values (``_weight_leaves``): no check of
    them, and products with their masks stay products."""
    root_of: dict[fx.Node, fx.Node] = field(default_factory=dict)
    """Each dropped node's root: itself when something outside reads its padded rows, else the root of the
    dropped node that reads it (explain names each root once, with a count, not a line per tensor up a chain)."""


class UnpadPass(GemPass):
    name = "unpad"
    stage = "pre_grad"
    config_section = "unpad"

    @property
    def _buckets(self) -> int:
        """UnpadConfig.token_buckets (None, left for the backend to decide, packs exact counts)."""
        return self.options.token_buckets or 0

    # -- finding --------------------------------------------------------------------------------
    def regions(self, graph: fx.Graph, masks: dict[fx.Node, RowMask], fills: dict[fx.Node, RowFill]) -> list[Region]:
        claimed: set[fx.Node] = set()
        regions: list[Region] = []
        distinct: list[RowMask] = []
        # lengths first: a region claims its nodes, and lengths masks are what unpad packed before vectors
        kept = [f.kept for f in fills.values()]
        for m in sorted([*masks.values(), *kept], key=lambda m: m.vector is not None):
            if not any(m.same(d) for d in distinct):
                distinct.append(m)
        order = {n: i for i, n in enumerate(graph.nodes)}
        checked = zero_one_checked(graph)
        unanchored: dict[fx.Node, tuple] = {}  # first node -> (component, mask, attention reading every key | None)
        # (said only of the keys and values of an attention that masks them by this mask: other (B, x) tensors
        # may match the mask's shape by chance)
        for mask in distinct:
            rules = {}
            for node in graph.nodes:
                dtype = dtype_of(node)
                if node in claimed or node in masks or (dtype is not None and not dtype.is_floating_point):
                    continue  # integer and bool values (ids, the masks' own arithmetic) hold no GEMM work
                rule = classify(node, mask.batch, mask.seq)
                if rule is not None:
                    rules[node] = rule
            analysis = PadAnalysis(mask, masks, fills, self._losses)
            weights = self._weight_leaves(checked, mask, [*masks.values(), *kept])
            for component in _components(rules):
                if not self._anchored(component, analysis):
                    attention = next((a for n in component for u in n.users
                                      if (a := keys_of(u, n)) is not None and analysis.keys_masked(a)), None)
                    if attention is not None:
                        unanchored.setdefault(component[0], (component, mask, analysis.reads_every_key(attention)))
                    continue
                updated = _updated_in_place(component, order)
                if updated is not None:
                    node, update = updated
                    how = "" if node in update.all_input_nodes else ", through an alias"
                    self.refused(node, f"{node.name} is updated in place by {update.name} (`{target_name(update)}`"
                                       f"{how}): a packed copy would not see the update")
                    continue
                region = Region(mask, component, {n: rules[n] for n in component}, weights=weights)
                self._shrink_to_safe_exits(region, analysis)
                if region.nodes:
                    claimed.update(region.nodes)
                    regions.append(region)
        for node, reason in unanchored_reasons(unanchored, claimed):
            self.refused(node, reason)
        return regions

    @staticmethod
    def _weight_leaves(checked: set[fx.Node], mask: RowMask, masks: list[RowMask]) -> frozenset:
        """The integer tensors this mask's class reads as 0/1 that no other rewrite checks (an attention pass
        checks HF's attention_mask), when every mask reading them is their plain cast: zero exactly where the
        data is, so packing by them is exact for any values (integer weights: counts, ratings) without the
        device check, which would stop such a valid run. Empty otherwise (the check is emitted)."""
        leaves = unchecked_zero_one(checked, mask, masks)
        readers = [m for m in masks if mask.same(m) and m.checks]
        if not leaves or not all(m.vector is not None and m.node is not None and
                                 any(zero_exactly_where_data_is(m.node, leaf) for leaf in leaves) for m in readers):
            return frozenset()
        return frozenset(leaves)

    @staticmethod
    def _anchored(component: list[fx.Node], analysis: PadAnalysis) -> bool:
        """The component is this mask's: it multiplies by the mask, or a reader outside it ignores the mask's
        padded rows (an attention op reading it as keys or values by these lengths, as queries whose output
        is read that way too: the q, k, v projections of a model that never masks its input)."""
        inside = set(component)
        return any(
            (target_name(n) == "mul" and any(analysis.mask_factor(n, a) for a in n.args)) or analysis.fill_of(n)
            or any(u not in inside and analysis.reader_blind(u, n, (0, 1)) for u in n.users)
            for n in component)

    def _shrink_to_safe_exits(self, region: Region, analysis: PadAnalysis) -> None:
        """Drop nodes whose exit would change the answer, until every exit is pad-zero or pad-blind."""
        while True:
            packed = set(region.nodes)
            zero = self._pad_zero(region, analysis)
            unsafe = None
            for node in region.nodes:
                if _one_per_token(node) and any(u not in packed for u in node.users):
                    unsafe = (node, None)
                    break
                for user in node.users:
                    if user in packed or zero[node] or analysis.reader_blind(user, node, (0, 1)):
                        continue
                    unsafe = (node, user)
                    break
                if unsafe:
                    break
            if unsafe is None:
                return
            node, user = unsafe
            if user is None:  # (one value per token: padded, it costs nothing; no line for explain)
                region.root_of[node] = node
                region.nodes = [n for n in region.nodes if n is not node]
                continue
            note = analysis.other_mask(user, node)
            if user in region.root_of and not note:  # read by a node dropped before: part of its chain
                region.root_of[node] = region.root_of[user]
            else:
                region.stays_padded[node] = (
                    f"{node.name} stays padded: its padded rows are not provably zero and {user.name} "
                    f"({target_name(user) if user.op != 'output' else 'the graph output'}) reads them{note}"
                )
                region.root_of[node] = node
            region.nodes = [n for n in region.nodes if n is not node]

    @staticmethod
    def _pad_zero(region: Region, analysis: PadAnalysis) -> dict[fx.Node, bool]:
        zero: dict[fx.Node, bool] = {}

        def zero_input(a, node: fx.Node) -> bool:
            """A region node's value, or an operand from outside the region aligned with the node's rows and
            zero at the padding by its formula (FuxiCTR's ``(w * mask).unsqueeze(-1) * h``: the one score per
            token stays padded, unpad._one_per_token)."""
            if a in zero or not isinstance(a, fx.Node):
                return zero.get(a, False)
            shape = shape_of(a)
            return shape is not None and len(shape) == len(shape_of(node)) and \
                has_rows(shape, analysis.mask.batch, analysis.mask.seq) and zero_at(analysis, a, (0, 1))

        for node in region.nodes:  # graph order: inputs first
            zero[node] = analysis.zeroing_of(node) is not None or \
                zero_preserving(region.rules[node], lambda a, node=node: zero_input(a, node),
                                lambda a, node=node: analysis.mask_factor(node, a))
        return zero

    # -- rewriting --------------------------------------------------------------------------------
    def run(self, graph: fx.Graph) -> None:
        # first: a zeroing of query rows the attention op writes as 0 anyway reads the output's padded rows;
        # values the attention rewrites left unread (k.transpose(-1, -2) of a replaced matmul) read them too
        self._zeroings_dropped = drop_zeroed_query_rows(graph)
        drop_dead_tensors(graph)
        for node, reason in checkpointed_reasons(graph):
            self.refused(node, reason)
        self._losses = {}
        try:  # analysis only: a bug of ours there leaves the graph as it is instead of failing the compile
            if self.options.packed_losses:  # (labels != ignore_index: masks no model node computes)
                self._losses = insert_label_masks(graph)
            masks, near_misses, fills = find_row_masks(graph)
            # ops on (B*N, ...), (B, F, N) or (N, B, ...) rows, moved onto (B, N, ...)
            moved, layout_stops = move_row_layouts(graph, [(m.batch, m.seq) for m in masks.values()])
            if moved:
                masks, near_misses, fills = find_row_masks(graph)  # (their old nodes are gone)
        except Exception as error:  # noqa: BLE001
            if env_flag("GEMCOMPILE_STRICT", False):
                raise
            reason = f"internal error of gemcompile, nothing unpadded: {type(error).__name__}: {error}"
            warnings.warn(f"gemcompile: unpad: {reason}", stacklevel=2)
            self.refused(next(iter(graph.nodes)), reason)
            remove_unused_label_masks(self._losses)
            return
        for node, reason in [*near_misses, *layout_stops]:  # (ops across laid-out rows)
            self.refused(node, reason)
        try:
            self._run_regions(graph, masks, fills)
        finally:
            remove_unused_label_masks(self._losses)

    def _run_regions(self, graph: fx.Graph, masks: dict[fx.Node, RowMask], fills: dict[fx.Node, RowFill]) -> None:
        if not masks:
            return
        slice_feature_splits(graph, [(m.batch, m.seq) for m in masks.values()], keep=masks)
        # (lengths, offset, padded length) or the token vector's id -> the index nodes of a region already
        # packed: every region over the same rows reuses them (one valid_token_index or valid_mask_index,
        # i.e. one host read of T, per lengths or vector per step)
        self._indices: dict[tuple, tuple[fx.Node, ...]] = {}
        self._offsets: dict[tuple, fx.Node] = {}  # the token offsets of packed attention, per index key
        self._sizes: dict[tuple, tuple] = {}  # (B, N) as graph arguments (ints, or size nodes), per index key
        self._checked: set = set()  # the run-time checks of the masks' data emitted so far
        self._fills = fills
        regions = self.regions(graph, masks, fills)
        packed = {n for region in regions for n in region.nodes}
        for region in regions:
            gemms = [n for n in region.nodes if target_name(n) == "linear"]
            for root, reason in region.stays_padded.items():
                if root in packed:
                    continue  # (packed by another mask's region: the rows of a loss's labels)
                followers = [n for n, r in region.root_of.items() if r is root and n is not root]
                if followers:
                    names = ", ".join(n.name for n in followers[:4]) + (", ..." if len(followers) > 4 else "")
                    reason += f"; so do {len(followers)} value(s) it is computed from ({names})"
                self.refused(region.mask.node, reason)
            if not gemms:
                continue  # a product with a mask and nothing else: nothing for packing to skip
            if len(gemms) < self.options.min_gemms:
                self.refused(region.nodes[0], f"a token-wise region over {region.mask.describe()} with "
                             f"{len(gemms)} GEMM(s) (min_gemms={self.options.min_gemms}): packing would cost "
                             "more than it saves")
                continue
            emit = Emitter(graph, untraceable="does not trace on packed rows")
            try:
                self._rewrite(graph, region, gemms, masks, emit)
            except Unproven as e:
                emit.rollback()  # nothing was rewired yet: the region stays as it was
                self.refused(region.nodes[0], str(e))

    def _rewrite(self, graph: fx.Graph, region: Region, gemms: list[fx.Node],
                 masks: dict[fx.Node, RowMask], emit: Emitter) -> None:
        mask = region.mask
        for node in region.nodes:  # an earlier region's exits may feed this one now: its rules as they are
            region.rules[node] = classify(node, mask.batch, mask.seq)
            if region.rules[node] is None:
                raise Unproven(f"{node.name} is no longer token-wise after an earlier region was packed")
        order = {n: i for i, n in enumerate(graph.nodes)}
        first = min(region.nodes, key=order.__getitem__)
        if mask.vector is None and order[mask.lengths] > order[first]:
            raise Unproven(f"the lengths {mask.lengths.name} are computed after the region starts")
        for source in [] if mask.vector is None else vector_leaves(mask.vector):
            if order[source] > order[first]:  # (the vector is rebuilt before the region from what it reads)
                try:  # (a slice of an input, attention_mask.narrow(1, 0, N), an attention rewrite emitted)
                    hoist_before(source, first, fixed=set(region.nodes))
                except Unproven:
                    raise Unproven(f"the token vector ({mask.vector.text}) reads {source.name}, computed after "
                                   "the region starts") from None
                order = {n: i for i, n in enumerate(graph.nodes)}
            if in_place_update(source) is not None:  # through any alias (masks/mutation.py)
                raise Unproven(f"the token vector ({mask.vector.text}) reads {source.name}, which the model "
                               "changes in place")
        if any(same_size(d, 0) for n in region.nodes for d in shape_of(n)):
            raise Unproven("the region is empty (a batch or length of 0): no padding to skip")
        buckets = self._buckets
        if buckets and not all(isinstance(d, int) for d in (mask.batch, mask.seq)):
            raise Unproven("token_buckets needs a static batch size and padded length (the capacities are "
                           "fractions of B * N); compile with dynamic=False or keep both fixed")
        index_key = (*mask.index_key(), _size_key(mask.seq))
        shared = self._indices.get(index_key)
        if shared is None or order[shared[0]] > order[first]:  # (regions come in graph order)
            with graph.inserting_before(first):
                # under dynamic shapes (Dynamo recompiles with symbolic sizes once B or N changes between calls)
                # the emitted nodes take B and N as graph values: the size inputs Dynamo lifts, or sums of them
                self._sizes[index_key] = size_argument(emit, mask.batch), size_argument(emit, mask.seq)
                shared = self._token_indices(emit, mask, *self._sizes[index_key], example_value(first).device)
        index, batch_index, seq_index, gather_batch = shared
        batch, seq = self._sizes[index_key]  # (made with the index: before every use of either)
        with graph.inserting_before(first):  # what the proof of the masks assumed of the data
            skipped = {check_key(functools.partial(emit_zero_one_check, node=leaf)) for leaf in region.weights}
            checked = emit_row_mask_checks(emit, mask, [*masks.values(), *(f.kept for f in self._fills.values())],
                                           self._checked | skipped)
        # products with masks read from integer weights stay products (Region.weights)
        identities = {n: m for n, m in masks.items() if not m.checks} if region.weights else masks
        packed: dict[fx.Node, fx.Node] = {}
        entries: dict[tuple, fx.Node] = {}
        members = set(region.nodes)
        snapshot = _describe(region.nodes)
        macs = sum(_macs_per_token(n) for n in gemms)
        n_exits = 0
        uniform = functools.partial(uniform_like_packed, emit, batch, seq, gather_batch, seq_index)  # (dropout)
        for node in sorted(region.nodes, key=order.__getitem__):
            rule = region.rules[node]
            operand = functools.partial(self._operand, node=node, rule=rule, members=members, packed=packed,
                                        entries=entries, emit=emit, batch_index=gather_batch,
                                        seq_index=seq_index, mask=mask)
            with graph.inserting_before(node):
                identity = _mask_product_identity(node, rule, mask, identities, self._fills)
                if identity is not None:
                    packed[node] = operand(identity)
                    continue
                translated = rule.translate(node.args, node.kwargs)
                if translated is None:
                    raise Unproven(f"{node.name}: its dims cannot be moved to the packed layout")
                args, kwargs = tree_map(functools.partial(_map_node, operand), translated)
                packed[node] = packed_op(emit, node, args, kwargs, uniform)
        exits = [n for n in region.nodes if any(u not in members for u in n.users)]
        with graph.inserting_before(first):  # the exits' trailing sizes, before any use is rewired (may refuse)
            trailing = {n: [size_argument(emit, d) for d in example_value(n).shape[2:]] for n in exits}
        for node in exits:
            outside = [u for u in node.users if u not in members]
            with graph.inserting_before(node):  # (B, N, trailing sizes of the packed value)
                shape = [batch + 1 if buckets else batch, seq, *trailing[node]]
                zeros = emit.call(torch.ops.aten.new_zeros.default, (packed[node], shape))
                scattered = emit.call(torch.ops.aten.index_put.default, (zeros, [batch_index, seq_index],
                                                                          packed[node]))
                if buckets:
                    scattered = emit.call(torch.ops.aten.slice.Tensor, (scattered, 0, 0, batch))
            copy_source_meta(node, zeros)
            copy_source_meta(node, scattered)
            n_exits += 1
            for user in outside:
                user.replace_input_with(node, scattered)
        dropped_inputs = {a for n in region.nodes for a in n.all_input_nodes if a not in members}
        for node in sorted(region.nodes, key=order.__getitem__, reverse=True):
            if not node.users:
                graph.erase_node(node)
        erase_dead([a for a in dropped_inputs if not a.users])  # e.g. the valid[..., None] views
        attention = self._pack_attentions(graph, emit, mask, seq, index_key, shared)
        index = RegionIndex(mask, batch_index, seq_index, gather_batch, offsets=None, seq=seq)
        reads, reads_removed = ({}, 0) if not self.options.packed_row_reads else pack_row_reads(graph, emit, index)
        losses, losses_removed = pack_label_losses(graph, emit, index, self._losses, masks, bool(buckets))
        if losses:
            reads = {**reads, "per-token loss": losses}
            reads_removed += losses_removed
        self._indices[index_key] = shared
        self._checked.update(checked)
        self._record(region, first, snapshot, gemms, macs, attention, reads=reads,
                     gathers=len(entries) - attention["gathers"],
                     scatters=n_exits - attention["scatters"] - reads_removed)

    def _record(self, region: Region, first: fx.Node, snapshot: list[str], gemms: list[fx.Node], macs: int,
                attention: dict, reads: dict[str, int], gathers: int, scatters: int) -> None:
        """The region's rewrite record for explain: what ran packed, the gathers and scatters left, the
        attention ops packed, the zeroings dropped before it (unpad_zeroed_rows.py)."""
        mask, seq, buckets = region.mask, region.mask.seq, self._buckets
        ops: dict[str, int] = {}
        for n in region.nodes:
            ops[target_name(n)] = ops.get(target_name(n), 0) + 1
        op_text = ", ".join(f"{k} x{v}" for k, v in sorted(ops.items(), key=lambda kv: -kv[1]))
        rows = f"{mask.lengths.name} rows" if mask.vector is None else mask.describe()
        zeroings = sum(1 for _, lengths in self._zeroings_dropped if lengths is mask.lengths)
        dropped = f"{zeroings} zeroing(s) of attention rows the op writes as 0 dropped; " if zeroings else ""
        read_text = "".join(f"{form} row read x{count}, " for form, count in reads.items())
        detail = (f"region over {rows} (B, N) = ({mask.batch}, {seq}): "
                  f"{len(region.nodes)} ops on packed tokens ({op_text}); "
                  f"{attention['text']}{read_text}{dropped}"
                  f"{gathers} gathers in, {scatters} scatters out; GEMMs skip padding: {macs} MACs per "
                  f"padding token forward, saves 6 x {macs} x (B*N - T) FLOPs per training step")
        extra = f", buckets={buckets}" if buckets else ""
        call = f"valid_token_index({mask.lengths.name}, {seq}{extra})" if mask.vector is None else \
            f"valid_mask_index({mask.vector.text}{extra})"
        self.rewrote(first, "\n".join(snapshot), (
            f"index = gemcompile.{call}  # T valid tokens\n"
            f"{len(region.nodes)} ops on (T, ...) rows; x[index // {seq}, index % {seq}] in"
            + (f", zeros(B, {seq}, ...).index_put(...) out" if scatters else "")), detail,
            metrics={"lengths": mask.describe(), "seq": _size_metric(seq), "batch": _size_metric(mask.batch),
                     "ops": len(region.nodes),
                     "lengths_input": input_path(mask.lengths) if mask.vector is None else None,
                     "gemms": len(gemms), "op_counts": ops, "macs_per_token": macs, "gathers": gathers,
                     "scatters": scatters, "packed_attention": attention["ops"], "packed_row_reads": reads,
                     "zeroings_dropped": zeroings})

    def _pack_attentions(self, graph: fx.Graph, emit: Emitter, mask: RowMask, seq, index_key: tuple,
                         shared: tuple) -> dict:
        """Attention ops that now read and write this region's packed rows (unpad_attention.py): their
        counts by op, the scatters and gathers that went away, and the text for explain."""
        result = {"ops": {}, "scatters": 0, "gathers": 0, "text": ""}
        # packed by lengths; a bucketed index's slack rows come after the last offset, where the packed
        # ops write zero outputs and gradients (lowering/common/packed.py)
        if not self.options.packed_attention or mask.vector is not None:
            return result

        def offsets() -> fx.Node:  # one per lengths per graph, right after the token index
            cached = self._offsets.get(index_key)
            if cached is None or getattr(cached, "_erased", False):
                with graph.inserting_before(shared[0].next):
                    cached = emit_token_offsets(emit, mask.lengths, mask.offset, seq)
                self._offsets[index_key] = cached
            return cached

        index, batch_index, seq_index, gather_batch = shared
        names, result["scatters"], result["gathers"] = pack_attentions(
            graph, emit, RegionIndex(mask, batch_index, seq_index, gather_batch, offsets, seq))
        for name in names:
            result["ops"][name] = result["ops"].get(name, 0) + 1
        if names:
            result["text"] = ", ".join(f"{k} x{v}" for k, v in result["ops"].items()) + " on packed tokens; "
        return result

    def _token_indices(self, emit: Emitter, mask: RowMask, batch, seq, device: torch.device) -> tuple:
        """(index, its batch and sequence positions for the scatters, the batch positions for the gathers);
        ``batch`` and ``seq`` are ints or size nodes."""
        buckets = self._buckets
        # bucketed: slack rows hold the sentinel B * N (their scatter row B is dropped at each exit)
        index = self._index(emit, mask, batch, seq, device)
        batch_index = emit.call(operator.floordiv, (index, seq))
        seq_index = emit.call(operator.mod, (index, seq))
        # gathers read the slack rows from a real position (row B - 1, finite wherever x is)
        gather_batch = (emit.call(torch.ops.aten.clamp_max.default, (batch_index, batch - 1))
                        if buckets else batch_index)
        return index, batch_index, seq_index, gather_batch

    def _hint(self, mask: RowMask) -> int:
        """Inductor's guess of T: the expected fill of B * N (under dynamic shapes, of their hints: the
        sizes of the batch that compiled)."""
        return max(1, round(size_hint(mask.batch) * size_hint(mask.seq) * self.options.expected_fill))

    def _index(self, emit: Emitter, mask: RowMask, batch, seq, device: torch.device) -> fx.Node:
        """The (T,) flat positions of the mask's valid tokens: from lengths, or from the token vector rebuilt
        from the tensors it reads (valid_mask_index)."""
        hint, buckets = self._hint(mask), self._buckets
        if mask.vector is None:
            lengths = mask.lengths
            if mask.offset != 0:
                lengths = emit.call(operator.add, (lengths, mask.offset))
            return emit.call(torch.ops.gemcompile.valid_token_index.default, (lengths, seq, hint, buckets))
        valid = emit_token_vector(emit, mask.vector, batch, seq, device, "the packed region")
        return emit.call(torch.ops.gemcompile.valid_mask_index.default, (valid, hint, buckets))

    def _operand(self, a, *, node, rule, members, packed, entries, emit, batch_index, seq_index, mask):
        if a in packed:
            return packed[a]
        shape = shape_of(a)
        if shape is None:
            return a
        out_rank = len(shape_of(node))
        if a in rule.rows:
            key = ("rows", a)
            if key not in entries:
                entries[key] = emit.call(torch.ops.aten.index.Tensor, (a, [batch_index, seq_index]))
            return entries[key]
        if rule.kind != "elementwise":
            return a  # a parameter of a structural op (weight, bias, table)
        rank = len(shape)
        if rank <= out_rank - 2:
            return a
        if rank == out_rank - 1:  # right-aligned: its dim 0 is the sequence dim
            if same_size(shape[0], 1):
                return a
            if same_size(shape[0], mask.seq):
                return _cached(entries, ("pos", a), lambda: emit.call(torch.ops.aten.index.Tensor, (a, [seq_index])))
            raise Unproven(f"{a.name} broadcasts against the sequence dim with size {shape[0]}")
        b1, n1 = same_size(shape[0], 1), same_size(shape[1], 1)
        if b1 and n1:
            return _cached(entries, ("one", a), lambda: emit.call(torch.ops.aten.select.int, (a, 0, 0)))
        if b1 and same_size(shape[1], mask.seq):
            return _cached(entries, ("pos", a), lambda: emit.call(
                torch.ops.aten.index.Tensor, (emit.call(torch.ops.aten.select.int, (a, 0, 0)), [seq_index])))
        if n1 and same_size(shape[0], mask.batch):
            return _cached(entries, ("batch", a), lambda: emit.call(
                torch.ops.aten.index.Tensor, (emit.call(torch.ops.aten.select.int, (a, 1, 0)), [batch_index])))
        raise Unproven(f"{a.name} of shape {shape} does not broadcast over the (B, N) rows")


def _updated_in_place(component: list[fx.Node], order: dict) -> tuple[fx.Node, fx.Node] | None:
    """(value, update) when a packed copy would miss an in-place update: of a member through any alias
    (``q = f[..., :E]; q.mul_(2)``), or of an input after the region's first read of it (``h`` read, then
    ``h.mul_(2)``, read again: gathered once before its first reader)."""
    updated = next(((n, u) for n in component if (u := in_place_update(n)) is not None), None)
    if updated is not None:
        return updated
    members, first_reader = set(component), {}
    for n in sorted(component, key=order.__getitem__):
        for a in n.all_input_nodes:
            if a not in members:
                first_reader.setdefault(a, n)
    return next(((a, u) for a, r in first_reader.items() if (u := update_after(a, r)) is not None), None)


def _mask_product_identity(node: fx.Node, rule: TokenWise, mask: RowMask, masks: dict[fx.Node, RowMask],
                           fills: dict[fx.Node, RowFill]) -> fx.Node | None:
    """x * mask, or a fill of x's rows outside the mask (masked_fill, where), on packed rows is x (every
    packed row is valid): the operand to forward, or None."""
    if node in fills:
        fill = fills[node]
        return fill.x if mask.same(fill.kept) and fill.x in rule.rows else None
    if target_name(node) != "mul" or len(node.args) != 2 or node.kwargs:
        return None
    a, b = node.args
    for x, m in ((a, b), (b, a)):
        if isinstance(m, fx.Node) and mask.same(masks.get(m)) and x in rule.rows and \
                dtype_of(x) == dtype_of(node) and tuple(shape_of(x)) == tuple(shape_of(node)):
            return x
    return None


def _one_per_token(node: fx.Node) -> bool:
    """A (B, N, 1...) value: its exit would be a scatter of one number per token, which saves nothing over
    computing it padded, and which Inductor (torch 2.13, CPU) orders wrongly: its buffer's zero fill fused
    with a reader that feeds a bmm (DIN's ``matmul(scores.squeeze(-1).masked_fill(pad, 0).unsqueeze(1), h)``)
    read the zeros before the scatter wrote the scores (reproduced in plain torch with a custom op of
    data-dependent size as the index; tests/integration/test_unpad_contractions.py: the model)."""
    shape = shape_of(node)
    return shape is not None and len(shape) >= 2 and all(same_size(d, 1) for d in shape[2:])


def _size_key(size) -> Any:
    """A size as a dict key (a SymInt is unhashable): its expression."""
    return size.node.expr if isinstance(size, torch.SymInt) else size


def _size_metric(size) -> int | str:
    """A size for explain's JSON: the int, or a symbolic size's expression (``s1``)."""
    return size if isinstance(size, int) else str(size)


def _map_node(fn, a: Any) -> Any:
    return fn(a) if isinstance(a, fx.Node) else a


def _cached(cache: dict, key: tuple, make) -> fx.Node:
    if key not in cache:
        cache[key] = make()
    return cache[key]


def _macs_per_token(node: fx.Node) -> int:
    """Multiply-adds of one token row through a linear (its extra dims included)."""
    weight = node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
    w = shape_of(weight)
    x = shape_of(node.args[0])
    if w is None or x is None or len(w) != 2:
        return 0
    extra = 1
    for s in x[2:-1]:
        extra *= size_hint(s)  # (a hint, never int(): that would guard a symbolic size for an explain metric)
    return size_hint(w[0]) * size_hint(w[1]) * extra


def _describe(nodes: Iterable[fx.Node]) -> list[str]:
    from gemcompile.passes.records import describe_node

    nodes = list(nodes)
    lines = [describe_node(n) for n in nodes[:12]]
    if len(nodes) > 12:
        lines.append(f"... and {len(nodes) - 12} more ops on (B, N, ...) rows")
    return lines


def _components(rules: dict[fx.Node, TokenWise]) -> list[list[fx.Node]]:
    """Connected components of token-wise nodes linked through row operands (in the table or not: the q, k
    and v projections of one input are one region, which gathers that input once), each in graph order."""
    parent = {n: n for n in rules}
    readers: dict[fx.Node, fx.Node] = {}  # a row operand outside the table -> its first token-wise reader

    def find(n):
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for node, rule in rules.items():
        for a in rule.rows:
            if a in rules:
                parent[find(a)] = find(node)
            elif a in readers:
                parent[find(readers[a])] = find(node)
            else:
                readers[a] = node
    groups: dict[fx.Node, list[fx.Node]] = {}
    for node in rules:  # rules is in graph order
        groups.setdefault(find(node), []).append(node)
    return list(groups.values())
