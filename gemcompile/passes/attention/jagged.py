"""The jagged family: padded softmax attention with a length-derived mask -> gemcompile::jagged_attention.

Serves softmax attention (SDPA, a hand-written softmax, nn.MultiheadAttention with its projections)
whose mask keeps exactly the scores with key index < kv_lengths[b] (and, where present, query index <
q_lengths[b] and key <= query); blocks, windows and HSTU masks are other families' or refused here.

Key padding may also be read from data (a per-key vector: ``x > 0``, ``attention_mask``, left padding):
the kernel then takes it as a (B, Lk) kv_mask built in the graph from the same tensors. Query padding read
from data (``valid[b, i]`` in a pairwise ``valid[:, :, None] & valid[:, None, :]``) is a (B, Lq) row vector:
its rows see no key, and the output is zeroed there after the kernel (family.zero_query_rows).

nn.MultiheadAttention(batch_first=True) is rewritten batch first: its in- and out-projections run on the
(B, L, E) tensors around it (the transposes MHA makes of them are skipped), so they are token-wise over
(B, L) rows like any Linear and the unpad pass can pack them.

Query rows the model zeroes after the attention (``o * valid[..., None]``, ``where``, ``masked_fill``, after
merge_heads / out_proj too; masks/rows.py proves every use goes through the zeroing) become the kernel's
q_lengths when the mask has no query term: the kernel skips them and writes them as 0, which the zeroing
keeps exact (values, and gradients: the rows' upstream gradient is 0); explain says "query rows: ...".

Dropout on the weights in training (``dropout(softmax(s))``, SDPA's dropout_p, MultiheadAttention's
dropout) is drawn inside the kernel from a seed the graph draws once per call from torch's generator
(``torch.randint``): the same distribution as eager's, not eager's numbers (as with torch.compile itself).

Semantics (exact up to rounding at every position the eager model defines): rows with no valid key,
where eager SDPA returns 0 and a softmax of -inf returns NaN, come out as 0; with a finite fill
(-1e9, finfo.min) they come out as eager computes them (attention/finite_fill.py); query rows past
q_lengths come out as 0 (eager leaves them masked or NaN too; a finite fill with query padding is refused).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from gemcompile.passes.attention.family import (
    AttentionFamily,
    check_lengths_device,
    check_qkv,
    dropout_keywords,
    fold_query_rows,
    key_mask_operand,
    lengths_operand,
    size_of,
    summed_bias,
    zero_query_rows,
)
from gemcompile.passes.attention.finite_fill import check_fill_served, keep_fill_exact, uniform_dropped_rows
from gemcompile.passes.attention.kept_diagonal import check_kept_diagonal, merge_diagonal
from gemcompile.passes.attention.kernels import HEAD_DIMS
from gemcompile.passes.attention.match import AttentionSite
from gemcompile.passes.attention.mha import check_mha
from gemcompile.passes.graph import Emitter, Unproven, erase_dead, example_value, fed_by, target_name
from gemcompile.passes.masks.classify import JAGGED_MASKS, Unclassified, length_refusal, require_padding_or_causal
from gemcompile.passes.masks.model import AttentionMask
from gemcompile.passes.records import describe_nodes


def _bias_node(term) -> fx.Node:
    """A bias term's node (through the wrappers of match.py)."""
    while not isinstance(term, fx.Node):
        term = term.value
    return term


def _bias_name(term) -> str:
    return _bias_node(term).name


class JaggedAttention(AttentionFamily):
    """Provable padded softmax attention -> gemcompile::jagged_attention."""

    name = "jagged_attention"
    config_section = "jagged_attention"
    masks_served = JAGGED_MASKS
    serves_query_vector = True
    serves_dropout = True
    serves_kept_diagonal = True

    def refusal(self, error: Unclassified) -> Unproven:
        return length_refusal(error)

    def accept(self, site: AttentionSite, mask: AttentionMask) -> None:
        if mask == AttentionMask() and site.bias:  # say what was read instead of "keeps every score"
            names = ", ".join(_bias_name(term) for term, _ in site.bias)
            learned = _learned_input([_bias_node(term) for term, _ in site.bias])
            if learned:  # s - (~valid) * self.mask_scale
                raise Unproven(f"no mask among the scores' terms: {names} added as a bias; it is scaled by "
                               f"{learned}, which requires grad (a learned value), so it is no fixed fill "
                               "the kernels could drop keys for")
            raise Unproven(f"no mask among the scores' terms: {names} added as a bias (a float mask handed "
                           "in from outside the graph cannot be proven; build it from lengths or ids in the "
                           "compiled code, and with no graph break between it and the attention: a mask "
                           "built before a break reaches the next graph as an input; TORCH_LOGS=graph_breaks "
                           "shows the breaks)")
        require_padding_or_causal(mask)

    def _check_shapes(self, q: fx.Node, k: fx.Node, v: fx.Node) -> None:
        check_qkv(*(example_value(n) for n in (q, k, v)), HEAD_DIMS)
        kv_len = example_value(k).shape[2]
        if isinstance(kv_len, int) and kv_len < self.options.min_kv_len:
            raise Unproven(f"only {kv_len} keys (< min_kv_len={self.options.min_kv_len})")

    def emit(self, emit: Emitter, site: AttentionSite, mask: AttentionMask, q: fx.Node, k: fx.Node,
             v: fx.Node) -> tuple[fx.Node, str]:
        self._check_shapes(q, k, v)
        check_lengths_device(q, mask.kv_lengths, mask.q_lengths)
        dropout = dropout_keywords(emit, site, q)
        if mask.diagonal:  # every row keeps a key (its own): no row is blind, whatever the fill
            check_kept_diagonal(site, mask, q, k)
        elif not site.zero_blind_rows:
            check_fill_served(mask)
        # query rows the model zeroes afterwards are skipped (the fill's rules are about the model's own mask)
        rows, rows_note = (mask, "") if mask.q_lengths is not None or mask.diagonal else fold_query_rows(site, mask)
        kv_len = lengths_operand(emit, mask.kv_lengths, mask.kv_offset, k)
        kv_mask = key_mask_operand(emit, mask, k)
        q_len = lengths_operand(emit, rows.q_lengths, rows.q_offset, q)
        bias = summed_bias(emit, site.bias)
        detail, uniform, blind = "mask proven: " + mask.describe(), None, None
        if mask.fill is not None:
            q, k, kv_len, kv_mask, uniform, blind, bias = keep_fill_exact(
                emit, mask, float(site.scale), q, k, kv_len, kv_mask, bias,
                blind_rows_zero=site.zero_blind_rows or mask.diagonal)
            detail += f"; fill {mask.fill:g} kept exact"
        if rows_note:
            detail += f"; {rows_note}"
        args = (q, k, v, q_len, kv_len, bias, mask.causal, float(site.scale))
        extra = {k: v for k, v in (("kv_mask", kv_mask), ("uniform_keys", uniform)) if v is not None}
        if dropout:
            detail += f"; dropout p={site.dropout_p:g} in the kernel"
        if mask.diagonal:
            out_lse = emit.call(torch.ops.gemcompile.jagged_attention_lse.default, args, {**extra, **dropout})
            out = merge_diagonal(emit, out_lse, q, k, v, float(site.scale), bias, kv_len, kv_mask, dropout)
            return out, detail + "; the diagonal merged into rows whose own key the mask drops"
        out = emit.call(torch.ops.gemcompile.jagged_attention.default, args, {**extra, **dropout})
        if blind is not None:  # rows that see no valid key: eager's softmax(s + F) over every key
            extra = {"uniform_keys": blind.uniform_keys} if blind.uniform_keys is not None else {}
            extra.update(dropout)  # the same draws: these rows are not the first call's
            rows = emit.call(torch.ops.gemcompile.jagged_attention.default,
                             (blind.q, blind.k, v, blind.rows, None, blind.bias, False, float(site.scale)), extra)
            out = emit.call(operator.add, (out, rows))
            detail += " (rows with no valid key in a second call over every key)"
        filler = None if site.zero_blind_rows else uniform_dropped_rows(emit, mask, q, k, v, float(site.scale),
                                                                          dropout)
        return zero_query_rows(emit, mask, out, filler), detail

    def rewrite(self, emit: Emitter, site: AttentionSite, mask: AttentionMask) -> tuple[str, str]:
        return self._rewrite_mha(emit, site, mask) if site.kind == "mha" else super().rewrite(emit, site, mask)

    @staticmethod
    def _in_projections(emit: Emitter, sources: tuple, a: dict, embed: int, batch_first: bool):
        """(source, projection) for q, k, v in MHA's (L, B, E) layout (or (B, L, E) when ``batch_first``);
        inputs that are one tensor share one GEMM over their rows of the packed weight, as
        nn.MultiheadAttention does (self-attention: one). With use_separate_proj_weight (kdim/vdim, fairseq's
        q/k/v_proj) each input has its own weight and its third of in_proj_bias, as the functional does."""
        b = a.get("in_proj_bias")
        separate = a.get("use_separate_proj_weight")
        w = None if separate else a["in_proj_weight"]
        out, i = [], 0
        while i < 3:
            n = 1
            while not separate and i + n < 3 and sources[i + n] is sources[i]:
                n += 1
            rows = slice(i * embed, (i + n) * embed)
            wi = a[("q_proj_weight", "k_proj_weight", "v_proj_weight")[i]] if separate else \
                emit.call(operator.getitem, (w, rows))
            bi = None if b is None else emit.call(operator.getitem, (b, rows))
            proj = emit.call(torch.nn.functional.linear, (sources[i], wi, bi))
            if n == 1:
                out.append((sources[i], proj))
            elif batch_first:  # slices of the last dim: token-wise, so unpad packs through them
                parts = [(Ellipsis, slice(p * embed, (p + 1) * embed)) for p in range(n)]
                out += [(sources[i], emit.call(operator.getitem, (proj, part))) for part in parts]
            else:
                chunks = emit.call(torch.chunk, (proj, n, -1))
                out += [(sources[i], emit.call(operator.getitem, (chunks, p))) for p in range(n)]
            i += n
        return out

    def _rewrite_mha(self, emit: Emitter, site: AttentionSite, mask: AttentionMask) -> tuple[str, str]:
        """nn.MultiheadAttention (one Dynamo node): in-projection, jagged attention, out-projection."""
        node = site.anchor
        a = check_mha(node)
        embed, heads = a["embed_dim_to_check"], a["num_heads"]
        users = list(node.users)
        before = describe_nodes([node])
        batch_first = _batch_first_sources(site)
        out_bias = a["out_proj_bias"]
        with emit.graph.inserting_before(node):
            heads_view = []
            sources = batch_first or (site.q, site.k, site.v)
            projections = self._in_projections(emit, sources, a, embed, batch_first is not None)
            for src, proj in projections:
                if batch_first is not None:  # (B, L, E) -> (B, H, L, Dh)
                    split = emit.call(torch.unflatten, (proj, -1, (heads, embed // heads)))
                    heads_view.append(emit.call(torch.transpose, (split, 1, 2)))
                    continue
                length, batch = size_of(emit, src, 0), size_of(emit, src, 1)  # (size nodes when dynamic)
                split = emit.call(torch.reshape, (proj, (length, batch, heads, embed // heads)))
                heads_view.append(emit.call(torch.permute, (split, (1, 2, 0, 3))))  # (B, H, L, Dh)
            out, detail = self.emit(emit, site, mask, *heads_view)
            if batch_first is not None:  # (B, H, L, Dh) -> (B, L, E), projected; MHA's (L, B, E) a view of it
                merged = emit.call(torch.flatten, (emit.call(torch.transpose, (out, 1, 2)), 2))
                rows = emit.call(torch.nn.functional.linear, (merged, a["out_proj_weight"], out_bias))
                result = emit.call(torch.transpose, (rows, 0, 1))
            else:
                length, batch = size_of(emit, site.q, 0), size_of(emit, site.q, 1)
                merged = emit.call(torch.permute, (out, (2, 0, 1, 3)))  # (L, B, H, Dh)
                merged = emit.call(torch.reshape, (merged, (length, batch, embed)))
                result = emit.call(torch.nn.functional.linear, (merged, a["out_proj_weight"], out_bias))
        for user in users:
            if user.target is operator.getitem:
                if user.args[1] == 0:
                    user.replace_all_uses_with(result)
                erase_dead([user])
        if batch_first is not None:
            _skip_transposes_back(result, rows)
        return before, detail


def _swaps_first_dims(node: fx.Node) -> bool:
    """Whether ``node`` is x.transpose(0, 1) (or (1, 0)) of a 3-D x."""
    value = example_value(node)
    if target_name(node) != "transpose" or len(node.args) != 3 or node.kwargs:
        return False
    if not isinstance(value, torch.Tensor):
        return False
    return value.dim() == 3 and all(isinstance(d, int) for d in node.args[1:]) and \
        sorted(d % 3 for d in node.args[1:]) == [0, 1]


def _batch_first_sources(site: AttentionSite) -> tuple[fx.Node, fx.Node, fx.Node] | None:
    """The (B, L, E) tensors MHA(batch_first=True) transposed into its (L, B, E) q, k, v, or None."""
    if not all(_swaps_first_dims(x) for x in (site.q, site.k, site.v)):
        return None
    return tuple(x.args[0] for x in (site.q, site.k, site.v))


def _skip_transposes_back(result: fx.Node, rows: fx.Node) -> None:
    """MHA(batch_first=True) transposes its (L, B, E) output back: those readers read ``rows`` instead."""
    for user in list(result.users):
        if _swaps_first_dims(user) and user.args[0] is result:
            user.replace_all_uses_with(rows)
            erase_dead([user])
    erase_dead([result])



def _learned_input(terms) -> str | None:
    """The name of a graph input requiring grad (a parameter) that feeds one of the bias terms, if any."""
    found: list[str] = []

    def learned(node: fx.Node) -> bool:
        value = example_value(node)
        if node.op in ("placeholder", "get_attr") and isinstance(value, torch.Tensor) and value.requires_grad:
            found.append(node.name)
            return True
        return False

    any(fed_by(term, learned, limit=32) for term in terms)
    return found[0] if found else None
