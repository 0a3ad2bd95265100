"""AttentionFamily: what one attention kernel contributes to the attention rewrite, and the emission
helpers the families share.

A family says which masks and sites its kernel serves (``accept``; refusals in its own words) and how it
replaces a site by one call of its op (``rewrite``); attention/rewrite.py finds and classifies each site
and picks the family. A family is a GemPass for its name (counts and explain rows), config section
(``enabled`` and options), cache uuid and reporting; it runs only inside AttentionRewritePass.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import ClassVar

import torch
import torch.fx as fx

from gemcompile.passes.attention.match import AttentionSite, GatedBias, MergedBias
from gemcompile.passes.base import GemPass
from gemcompile.lowering.common.dropout import new_seed
from gemcompile.passes.graph import Emitter, Unproven, erase_dead, example_value, hoist_before
from gemcompile.passes.masks.classify import Unclassified
from gemcompile.passes.masks.key_vector import emit_key_mask
from gemcompile.passes.masks.mutation import in_place_update
from gemcompile.passes.masks.model import AttentionMask
from gemcompile.passes.masks.rows import RowFold, downstream_row_mask
from gemcompile.passes.records import describe_nodes


class AttentionFamily(GemPass):
    """One attention kernel: which masks and sites it serves, and how it emits its op."""

    stage = "pre_grad"
    masks_served: ClassVar[str]
    """The masks the kernel serves, as refusals spell them ("the mask is not <this>: it is ...")."""
    serves_query_vector: ClassVar[bool] = False
    """Whether the family serves query padding read from data (AttentionMask.query_vector)."""
    serves_dropout: ClassVar[bool] = False
    """Whether the family's kernel draws dropout on the attention weights (AttentionSite.dropout_p)."""
    serves_kept_diagonal: ClassVar[bool] = False
    """Whether the family serves masks that keep the diagonal besides the rest (AttentionMask.diagonal)."""

    def run(self, graph: fx.Graph) -> None:
        raise TypeError(f"{type(self).__name__} is a kernel family: AttentionRewritePass runs it")

    def refusal(self, error: Unclassified) -> Unproven:
        """The refusal of a mask that is no AttentionMask at all."""
        return Unproven(f"the mask is not {self.masks_served}: it is {error.formula}")

    def accept(self, site: AttentionSite, mask: AttentionMask) -> None:
        """Unproven, with the reason, when the kernel does not serve this mask on this site."""

    def rewrite(self, emit: Emitter, site: AttentionSite, mask: AttentionMask) -> tuple[str, str]:
        """Replace the site by the op: (the replaced nodes, as explain shows them; the detail)."""
        before = describe_nodes(site.matched)
        with emit.graph.inserting_before(site.output):
            q, k, v = operands(emit, site)
            out, detail = self.emit(emit, site, mask, q, k, v)
            if not site.pv_merged:
                out = _rows_as_the_weights_were(emit, out, site.row_ops)
            out = permuted(emit, out, site.out_perm)
            if site.pv_merged:  # (B, H, Lq, D) -> (B * H, Lq, D), as the model's bmm gave it
                out = emit.call(torch.reshape, (out, (-1, size_of(emit, out, 2), size_of(emit, out, 3))))
                # the weights were (N, Lq, Lk) (one head a batch row: match.py), so are their row factors
                out = _rows_as_the_weights_were(emit, out, site.row_ops)
            out = apart_from_updates(emit, site, out)
        site.output.replace_all_uses_with(out)
        erase_dead(site.matched)
        return before, detail

    def emit(self, emit: Emitter, site: AttentionSite, mask: AttentionMask, q: fx.Node, k: fx.Node,
             v: fx.Node) -> tuple[fx.Node, str]:
        """The op's output for (B, H, L, D) q, k, v (before the output permutation), and the detail."""
        raise NotImplementedError


# -- what the families emit --------------------------------------------------------------------------

def _rows_as_the_weights_were(emit: Emitter, out: fx.Node, row_ops) -> fx.Node:
    """(p * r) @ v = r * (p @ v) for r constant along the keys: the weights' row ops, on the output rows."""
    for kind, x in row_ops:
        if kind == "mul":
            dtype = example_value(out).dtype
            if example_value(x).dtype != dtype:  # the output keeps its dtype, as eager's cast before @ v
                x = emit.call(torch.Tensor.to, (x, dtype))
            out = emit.call(operator.mul, (out, x))
        elif kind == "masked_fill":
            out = emit.call(torch.Tensor.masked_fill, (out, x, 0.0))
        else:
            out = emit.call(torch.where, (x, out, 0.0))
    return out


def dropout_keywords(emit: Emitter, site: AttentionSite, q: fx.Node) -> dict:
    """The op's dropout keywords for the site's dropout on the weights: p, and a seed the graph draws from
    torch's generator at every call (none without dropout). The kernels draw the keep mask from the seed
    (lowering/common/dropout.py): eager's distribution, not eager's numbers (as with torch.compile)."""
    if not site.dropout_p:
        return {}
    seed = emit.call(new_seed, (example_value(q).device,))  # traced to aten.randint by AOTAutograd
    return {"dropout_p": float(site.dropout_p), "dropout_seed": seed}


def permuted(emit: Emitter, node: fx.Node, perm) -> fx.Node:
    return node if perm is None else emit.call(torch.permute, (node, perm))


def operands(emit: Emitter, site: AttentionSite) -> tuple[fx.Node, fx.Node, fx.Node]:
    """q, k, v as (B, H, L, D) views; scores were q @ kT: kT.transpose(-2, -1) is k as a view, no copy. A
    tensor factor of the scores (site.q_factor: constant along the keys, in the scores' (B, H, Lq, 1)
    frame) is folded into q: (q c) . k = (q . k) c, and so is its gradient."""
    q = permuted(emit, site.q, site.q_perm)
    if site.q_factor is not None:
        factor, divides = site.q_factor
        factor = emit.method("to", (factor, example_value(q).dtype))
        q = emit.call(operator.truediv if divides else operator.mul, (q, factor))
    k = emit.call(torch.transpose, (site.k, -2, -1)) if site.k_is_transposed else permuted(emit, site.k, site.k_perm)
    v = permuted(emit, site.v, site.v_perm)
    if site.kv_repeats > 1:  # SDPA's enable_gqa: k/v head h // r serves query head h
        k, v = (emit.call(torch.repeat_interleave, (x, site.kv_repeats), {"dim": 1}) for x in (k, v))
    if site.qk_merged:
        q, k = split_heads(emit, q, site.heads), split_heads(emit, k, site.heads)
    if site.pv_merged:
        v = split_heads(emit, v, site.heads)
    return q, k, v


def split_heads(emit: Emitter, x: fx.Node, heads: int) -> fx.Node:
    """(B * H, L, D) -> (B, H, L, D): dim 0 of a bmm's operand is b * H + h (the model's view of its
    scores)."""
    return emit.call(torch.reshape, (x, (-1, heads, size_of(emit, x, 1), size_of(emit, x, 2))))


def size_of(emit: Emitter, node: fx.Node, dim: int):
    """A dim's size: the int when static, a sym_size node when dynamic (a SymInt cannot be a constant)."""
    size = example_value(node).shape[dim]
    return size if isinstance(size, int) else emit.call(torch.ops.aten.sym_size.int, (node, dim))


def clamped_lengths(emit: Emitter, node: fx.Node, offset: int, padded) -> fx.Node:
    """lengths + offset, clamped to [0, padded]: exactly what `arange(padded) < lengths + offset` keeps
    (a length past the padded size keeps every position, a negative one none). Narrower integer lengths
    (int8, int16, uint8) are widened to int32 (exact), the kernels' smallest index dtype; with an offset
    they are refused: the model adds it in the narrow dtype, where it may wrap."""
    value = example_value(node)
    if isinstance(value, torch.Tensor) and value.dtype in (torch.int8, torch.int16, torch.uint8):
        if offset != 0:
            raise Unproven(f"the lengths ({node.name}) are {value.dtype} and the mask adds {offset} to them: "
                           "the sum may wrap in that dtype (int32 or int64 lengths are rewritten)")
        node = emit.method("to", (node, torch.int32))
    if offset != 0:
        node = emit.call(operator.add, (node, offset))
    return emit.call(torch.clamp, (node, 0, padded))


def lengths_operand(emit: Emitter, lengths: fx.Node | None, offset: int, x: fx.Node) -> fx.Node | None:
    """The op's lengths along x's dim 2, or None without lengths."""
    return None if lengths is None else clamped_lengths(emit, lengths, offset, size_of(emit, x, 2))


def zero_query_rows(emit: Emitter, mask: AttentionMask, out: fx.Node,
                    filler: fx.Node | None = None) -> fx.Node:
    """The op's output (B, H, Lq, D) with the rows a query vector drops set to 0: such a row sees no key,
    which the kernels' rule for rows without a valid key makes 0 (values and gradients); the kernel computes
    it over the keys, and the zeroing makes it exact. ``filler`` (broadcast to the rows) instead of 0: what
    eager gives such rows under a finite fill (finite_fill.uniform_dropped_rows)."""
    if mask.query_vector is None:
        return out
    rows = emit_key_mask(emit, mask.query_vector, out, size_of(emit, out, 0), size_of(emit, out, 2))
    rows = emit.call(torch.reshape, (rows, (size_of(emit, out, 0), 1, size_of(emit, out, 2), 1)))
    return emit.call(torch.where, (rows, out, 0.0 if filler is None else filler))


def key_mask_operand(emit: Emitter, mask: AttentionMask, k: fx.Node) -> fx.Node | None:
    """The op's (B, Lk) bool kv_mask when the key padding is read from data, or None."""
    if mask.key_vector is None:
        return None
    return emit_key_mask(emit, mask.key_vector, k, size_of(emit, k, 0), size_of(emit, k, 2))


def output_row_mask(site: AttentionSite) -> RowFold:
    """The query-row mask the model applies to the site's output before any use (masks/rows.py), read in the
    output's own layout: (B, H, Lq, D) permuted by ``out_perm``; nn.MultiheadAttention's (Lq, B, E)."""
    if site.pv_merged:
        raise Unproven("the output holds batch and heads merged (B * H, Lq, D)")
    if site.kind == "mha":
        outs = [u for u in site.output.users if u.target is operator.getitem and u.args[1] == 0]
        if len(outs) != 1:
            raise Unproven(f"{site.output.name}'s output is read {len(outs)} times")
        return downstream_row_mask(outs[0], batch_dim=1, row_dim=0)
    perm = [0, 1, 2, 3] if site.out_perm is None else [p % 4 for p in site.out_perm]
    return downstream_row_mask(site.output, batch_dim=perm.index(0), row_dim=perm.index(2))


def fold_query_rows(site: AttentionSite, mask: AttentionMask, *, within: tuple[fx.Node, int] | None = None,
                    why: str = "") -> tuple[AttentionMask, str]:
    """(the mask the kernel computes, the note for explain): the query rows the model zeroes after the
    attention (``n >= lengths[b] + c`` on every use, masks/rows.py) become the kernel's q_lengths, so that it
    skips them and writes them as 0 (which the model's zeroing keeps exact, values and gradients).

    No proof: the mask as it is and '' (every query row is computed, as in eager), or, with ``why`` (the
    reason the fold is needed), Unproven. ``within`` = (lengths, offset): the fold must keep no row past
    lengths[b] + offset (rows the model's mask treats in a way the kernel does not compute)."""
    try:
        fold = output_row_mask(site)
        lengths = example_value(fold.lengths)
        if lengths.device != example_value(site.q).device:
            raise Unproven(f"the row mask's lengths ({fold.lengths.name}) are on {lengths.device}, the "
                           f"attention on {example_value(site.q).device}")
        if within is not None and (fold.lengths is not within[0] or fold.offset > within[1]):
            raise Unproven(f"the model masks rows by {fold.rows()} instead")
        hoist_before(fold.lengths, site.output)  # the model may count its rows after the attention
    except Unproven as reason:
        if why:
            raise Unproven(f"{why} ({reason})") from None
        return mask, ""
    return dataclasses.replace(mask, q_lengths=fold.lengths, q_offset=fold.offset), fold.describe()


def check_lengths_device(q: fx.Node, *lengths: fx.Node | None) -> None:
    """The kernels read lengths on the attention's device."""
    device = example_value(q).device
    for node in lengths:
        if node is not None and example_value(node).device != device:
            raise Unproven(f"the lengths ({node.name}) are on {example_value(node).device}, the attention on "
                           f"{device}")


def summed_bias(emit: Emitter, terms: list[tuple[fx.Node, float]]) -> fx.Node | None:
    """sum(coefficient * term) as one 4-D node (leading dims of size 1 added), or None without terms."""
    total = None
    for node, coefficient in terms:
        heads = None
        if isinstance(node, MergedBias):
            node, heads = node.value, node.heads
        if isinstance(node, GatedBias):  # broadcast as the model's where broadcasts
            sides = (node.value, 0.0) if node.kept else (0.0, node.value)
            node = emit.call(torch.where, (node.cond, *sides))
        if heads is not None and example_value(node).dim() == 3 and example_value(node).shape[0] != 1:
            node = split_heads(emit, node, heads)
        term = node if coefficient == 1.0 else emit.call(operator.mul, (node, coefficient))
        total = term if total is None else emit.call(operator.add, (total, term))
    if total is None:
        return None
    while example_value(total).dim() < 4:
        total = emit.call(torch.unsqueeze, (total, 0))
    if example_value(total).dim() > 4:
        raise Unproven("an additive bias with more than 4 dims")
    return total


def same_size(a, b) -> bool:
    """a == b for sizes that may be symbolic. Two inputs compiled with dynamic shapes get a symbol each even
    where the model needs them equal (k's and v's lengths): their equality then becomes a guard of the
    compiled graph (as Inductor's own specializations do), and a call where they differ recompiles."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    if statically_known_true(a == b):
        return True
    try:
        from torch.fx.experimental.symbolic_shapes import guard_or_false
    except ImportError:  # an older torch: only what is statically known
        return False
    return guard_or_false(a == b)


def check_qkv(q, k, v, head_dims: tuple[int, int]) -> None:
    """q (B|1, H, Lq, D), k and v (B, H, Lk, D) of one floating dtype and device, D within head_dims."""
    known = same_size

    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise Unproven(f"q, k, v must be 4-D (B, H, L, D); got {q.dim()}-D, {k.dim()}-D, {v.dim()}-D")
    if not (q.dtype == k.dtype == v.dtype) or not q.dtype.is_floating_point:
        raise Unproven(f"q, k, v dtypes differ or are not floating ({q.dtype}, {k.dtype}, {v.dtype})")
    if not (q.device == k.device == v.device):
        raise Unproven(f"q, k, v are on different devices ({q.device}, {k.device}, {v.device})")
    if not (known(q.shape[-1], k.shape[-1]) and known(k.shape[-1], v.shape[-1])):
        raise Unproven("q, k and v head dims differ (the kernel needs one head dim)")
    if not (known(k.shape[0], v.shape[0]) and known(k.shape[2], v.shape[2])):
        raise Unproven("k and v disagree on batch or length")
    if not (known(q.shape[0], k.shape[0]) or known(q.shape[0], 1)):
        raise Unproven("q's batch is neither k's nor 1")
    if not (known(q.shape[1], k.shape[1]) and known(k.shape[1], v.shape[1])):
        raise Unproven("q, k and v have different head counts (grouped-query attention is not served)")
    lo, hi = head_dims
    if not isinstance(q.shape[-1], int) or not lo <= q.shape[-1] <= hi:
        raise Unproven(f"head dim {q.shape[-1]} is outside what the kernel serves ({lo}..{hi})")


def apart_from_updates(emit: Emitter, site: AttentionSite, out: fx.Node) -> fx.Node:
    """The op's output, copied when the model updates the attention output (or a view of it) in place and
    reads it elsewhere too (``a.permute(0, 2, 1, 3).add_(x)``, then ``a``: attention/in_place.py leaves such an
    update as written): the op saves its output for its backward, and autograd stops a backward whose saved
    tensor was changed; the matmul it replaces saved none of its output."""
    return out if in_place_update(site.output) is None else emit.method("clone", (out,))
