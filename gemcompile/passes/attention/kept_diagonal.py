"""A mask that keeps the diagonal besides the rest: ``(key padding [and causal]) or i == j``.

FuxiCTR's BST (``padding_mask & ~eye`` as the dropped scores) and XLNet's content stream let a padded query
row attend to the valid keys and to itself, so that no row is empty. On a row whose own key the rest keeps,
the diagonal changes nothing. On the others (padded rows), eager's softmax runs over the kept keys plus key
i: with ``o, lse`` the kernel's output and log-sum-exp over the kept keys, and ``s = scale q_i . k_i (+ the
bias at (i, i))``, that is

    out_i = (1 - w) o_i + w v_i,   w = sigmoid(s - lse)

(lse = -inf where the rest keeps no key: w = 1, the row is v_i). The op is ``gemcompile::jagged_attention_lse``
(lse differentiable: its gradient enters the kernel's backward), so outputs and every gradient are exact.
With dropout the kernel drops the kept keys' weights and the merged key is dropped with pair (i, i)'s draw
(lowering/common/dropout.diagonal_keep_factor): ``out_i = (1 - w) o_i + w d_ii v_i``, eager's
dropout(softmax) over the kept keys and key i. Served for self-attention (Lq == Lk) without query padding;
otherwise refused with the reason.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from gemcompile.lowering.common.dropout import diagonal_keep_factor
from gemcompile.lowering.common.reference import compute_dtype
from gemcompile.passes.attention.family import same_size, size_of
from gemcompile.passes.attention.match import AttentionSite
from gemcompile.passes.graph import Emitter, Unproven, example_value
from gemcompile.passes.masks.model import AttentionMask


def check_kept_diagonal(site: AttentionSite, mask: AttentionMask, q: fx.Node, k: fx.Node) -> None:
    """Unproven unless the family can merge the diagonal into this site (module doc)."""
    if mask.q_lengths is not None or mask.query_vector is not None:
        raise Unproven("a mask that keeps the diagonal with query padding: rows the padding drops would see "
                       "only themselves")
    if not same_size(example_value(q).shape[2], example_value(k).shape[2]):
        raise Unproven("a mask that keeps the diagonal i == j on cross attention (Lq != Lk)")


def merge_diagonal(emit: Emitter, out_lse: fx.Node, q: fx.Node, k: fx.Node, v: fx.Node, scale: float,
                   bias: fx.Node | None, kv_len: fx.Node | None, kv_mask: fx.Node | None,
                   dropout: dict) -> fx.Node:
    """The (B, H, L, D) output with key i merged into every row i whose own key the kernel's mask drops;
    ``dropout``: the op's dropout keywords (empty without dropout)."""
    out = emit.call(operator.getitem, (out_lse, 0))
    lse = emit.call(operator.getitem, (out_lse, 1))
    dtype = example_value(out).dtype
    cdt = compute_dtype(dtype)  # the kernel's: float32 for half inputs, float64 for float64

    def up(x):
        return emit.call(torch.Tensor.to, (x, cdt))

    qf, kf = up(q), up(k)
    own = emit.call(torch.sum, (emit.call(operator.mul, (qf, kf)), -1))  # (B, H, L): q_i . k_i
    own = emit.call(operator.mul, (own, float(scale)))
    if bias is not None:  # (B|1, H|1, L, L) -> its diagonal (B|1, H|1, L)
        diagonal = emit.call(torch.diagonal, (bias,), {"dim1": -2, "dim2": -1})
        own = emit.call(operator.add, (own, up(diagonal)))
    empty = emit.call(torch.isinf, (lse,))  # +inf: the mask keeps no key on this row
    lse = emit.call(torch.where, (empty, float("-inf"), lse))
    weight = emit.call(torch.sigmoid, (emit.call(operator.sub, (own, lse)),))
    weight = emit.call(torch.where, (_own_key_kept(emit, k, kv_len, kv_mask), 0.0, weight))
    keep = emit.call(torch.unsqueeze, (emit.call(torch.rsub, (weight, 1.0)), -1))
    if dropout:  # the merged key's weight dropped with pair (i, i)'s draw
        sizes = [size_of(emit, v, dim) for dim in range(3)]  # B, H, L
        factor = emit.call(diagonal_keep_factor, (dropout["dropout_seed"], dropout["dropout_p"], *sizes))
        weight = emit.call(operator.mul, (weight, factor))
    weight = emit.call(torch.unsqueeze, (weight, -1))
    merged = emit.call(operator.add, (emit.call(operator.mul, (up(out), keep)),
                                      emit.call(operator.mul, (up(v), up(weight)))))
    return emit.call(torch.Tensor.to, (merged, dtype))


def _own_key_kept(emit: Emitter, k: fx.Node, kv_len: fx.Node | None, kv_mask: fx.Node | None) -> fx.Node:
    """(B, 1, L) bool: row i's own key is one the kernel's mask keeps (key padding by lengths and/or data)."""
    B, L = size_of(emit, k, 0), size_of(emit, k, 2)
    kept = None
    if kv_len is not None:
        positions = emit.call(torch.arange, (L,), {"device": example_value(k).device})
        kept = emit.call(operator.lt, (emit.call(operator.getitem, (positions, (None, slice(None)))),
                                       emit.call(operator.getitem, (kv_len, (slice(None), None)))))
    if kv_mask is not None:
        kept = kv_mask if kept is None else emit.call(operator.and_, (kept, kv_mask))
    if kept is None:
        raise Unproven("a mask that keeps the diagonal without key padding")
    return emit.call(torch.reshape, (kept, (B, 1, L)))
