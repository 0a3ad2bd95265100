"""The pad-blind analysis of the unpad pass: whether every reader of a value ignores its padded rows.

A region's exit writes zeros at the padded rows (unpad.py); that is exact where every reader ignores them:
a product with the region's own row mask; the keys and values of a gemcompile attention op with these
lengths, or whose kv_mask provably keeps only valid tokens of the region's token vector; a fill of the
padded rows by the row mask (masked max pooling); a per-token loss that ignores the rows outside the mask
by their labels (unpad_losses.py); a token-wise op,
or an attention query, whose own result is pad-blind, through views, transposes, permutes and the
selection of one piece of a fused projection (``qkv.unbind(0)``, ``qkv[0]``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from gemcompile.passes.attention.scores import reads_shape_only
from gemcompile.passes.graph import target_name, unused
from gemcompile.passes.token_wise import ELEMENTWISE, classify, node_argument, same_size, shape_of
from gemcompile.passes.unpad_contractions import CONTRACTIONS, contraction_blind, zero_at
from gemcompile.passes.unpad_losses import LabelLoss, loss_reading
from gemcompile.passes.unpad_attention import lengths_arg_mask
from gemcompile.passes.unpad_masks import EMPTY_SAMPLES_READ_EVERY_KEY, RowFill, RowMask, kept_at, keys_within

# gemcompile attention ops: argument positions of (q, k, v) and of the lengths that mask q and k/v.
# Output row (b, i) reads query row (b, i) only, and key/value rows (b, j) only for j < kv_lengths[b] (and
# where kv_mask[b, j], when the op has one).
ATTENTION_ARGS: dict[str, dict[str, int | None]] = {
    "block_attention": {"q": 0, "k": 1, "v": 2, "q_lengths": None, "kv_lengths": 3},
    "gdpa": {"q": 0, "k": 1, "v": 2, "q_lengths": 3, "kv_lengths": 4},
    "jagged_attention": {"q": 0, "k": 1, "v": 2, "q_lengths": 3, "kv_lengths": 4},
}
ATTENTION_ROWS = (0, 2)
"""(B, H, N, D): the batch and sequence dims of an attention op's q, k, v and output."""


def _attention_name(node: fx.Node) -> str | None:
    target = node.target
    if node.op == "call_function" and isinstance(target, torch._ops.OpOverload) and \
            target.namespace == "gemcompile":
        name = target.overloadpacket.__name__
        return name if name in ATTENTION_ARGS else None
    return None


def _kv_lengths(attention: fx.Node) -> Any:
    """The attention op's kv_lengths argument (None where it has none)."""
    index = ATTENTION_ARGS[_attention_name(attention)]["kv_lengths"]
    return attention.args[index] if index is not None and len(attention.args) > index else None


_VIEWS = ("transpose", "unflatten", "flatten", "getitem", "permute", "view", "reshape")


def keys_of(user: fx.Node, node: fx.Node, depth: int = 4) -> fx.Node | None:
    """The attention op whose keys or values ``node`` is, read by ``user`` through views (head split,
    transposes), if any: for explain."""
    name = _attention_name(user)
    if name is not None:
        spec = ATTENTION_ARGS[name]
        return user if any(len(user.args) > spec[r] and user.args[spec[r]] is node for r in ("k", "v")) else None
    if depth == 0 or target_name(user) not in _VIEWS:
        return None
    return next(filter(None, (keys_of(u, user, depth - 1) for u in user.users)), None)


def _aligned(product: fx.Node, factor: Any) -> bool:
    """A factor of ``product`` of its rank, with the product's B and N as its first two sizes: its rows line up
    with the product's (a (B, N, 1) mask times (B, N) scores broadcasts to (B, N, N) at B == 1)."""
    shape, out = shape_of(factor), shape_of(product)
    return shape is not None and out is not None and len(shape) == len(out) and \
        same_size(shape[0], out[0]) and same_size(shape[1], out[1])


def _indexed_rows(index, rows: tuple[int, int], rank: int) -> tuple[int, int] | None:
    """Where the batch and token dims at ``rows`` of a rank-``rank`` tensor go in ``x[index]`` when the index
    keeps both whole: full slices there, None (a new dim) or ints (a dim dropped) elsewhere, an Ellipsis for
    the dims it skips; None for any other index."""
    index = index if isinstance(index, tuple) else (index,)
    if sum(i is Ellipsis for i in index) > 1:
        return None
    consumed = sum(1 for i in index if i is not None and i is not Ellipsis)
    if consumed > rank:
        return None
    where, dim, out = {}, 0, 0
    for i in index:
        if i is Ellipsis:
            for _ in range(rank - consumed):
                where[dim], dim, out = out, dim + 1, out + 1
        elif i is None:
            out += 1
        elif isinstance(i, slice) and i == slice(None):
            where[dim], dim, out = out, dim + 1, out + 1
        elif type(i) is int and dim not in rows:
            dim += 1
        else:
            return None
    for rest in range(dim, rank):
        where[rest], out = out, out + 1
    return (where[rows[0]], where[rows[1]]) if rows[0] in where and rows[1] in where else None


_MOST_POSITIONS = 64
"""The most token positions a constant slice may read for ``_constant_positions`` to list them."""


def _constant_positions(user: fx.Node, node: fx.Node, shape: tuple) -> list | None:
    """The token positions (dim 1 of ``node``) that ``user`` reads, when they are constants and nothing else
    of ``node`` is read: ``node[:, p, ...]``, ``node[:, a:b, ...]`` (a static token count for slices and
    negative positions), ``node.select(1, p)``; None otherwise."""
    name = target_name(user)
    if not user.args or user.args[0] is not node or user.kwargs or len(shape) < 2:
        return None
    if name == "select" and len(user.args) == 3 and type(user.args[1]) is int and user.args[1] % len(shape) == 1:
        index = user.args[2]
    elif name == "getitem" and isinstance(user.args[1], tuple) and len(user.args[1]) >= 2 and \
            isinstance(user.args[1][0], slice) and user.args[1][0] == slice(None) and \
            not any(isinstance(i, fx.Node) or i is None or i is Ellipsis for i in user.args[1]):
        index = user.args[1][1]
    else:
        return None
    n = shape[1]
    if type(index) is int:
        if index >= 0:
            return [index]
        return [n + index] if isinstance(n, int) else [n.node.expr + index] if isinstance(n, torch.SymInt) else None
    if isinstance(index, slice) and isinstance(n, int) and \
            all(v is None or type(v) is int for v in (index.start, index.stop, index.step)):
        positions = list(range(n))[index]
        return positions if 0 < len(positions) <= _MOST_POSITIONS else None
    return None


class PadAnalysis:
    """The pad-blind analysis over the original graph, for one length mask."""

    def __init__(self, mask: RowMask, masks: dict[fx.Node, RowMask], fills: dict[fx.Node, RowFill] | None = None,
                 losses: dict[fx.Node, LabelLoss] | None = None):
        self.mask = mask
        self.masks = masks
        self.fills = fills or {}
        """{masked_fill / where node: its RowFill} (unpad_masks._row_fills)."""
        self.losses = losses or {}
        """{flattened input of a per-token loss: its LabelLoss} (unpad_losses.py)."""
        self._memo: dict[tuple[fx.Node, tuple[int, int]], bool] = {}

    def is_mask(self, node: Any) -> bool:
        return isinstance(node, fx.Node) and self.mask.same(self.masks.get(node))

    def mask_factor(self, product: fx.Node, factor: Any) -> bool:
        """``factor`` is this mask, its B and N on the product's first two dims (``_aligned``)."""
        return self.is_mask(factor) and _aligned(product, factor)

    def zero_factor(self, product: fx.Node, factor: Any) -> bool:
        """``factor`` is zero at this mask's padded rows (the mask itself, or sentence-transformers' weighted
        mean ``h * (mask * positions)``: unpad_contractions.zero_at), or NaN there (a softmax over a -inf
        fill: the product, computed on the padded rows, is then the same at any finite h), its B and N on the
        product's first two dims."""
        return _aligned(product, factor) and zero_at(self, factor, (0, 1), empty_nan=True)

    def fill_of(self, node: fx.Node, rows: tuple[int, int] = (0, 1)) -> fx.Node | None:
        """x when ``node`` replaces x's rows outside this mask (``x.masked_fill(~valid, -inf)``, ``where(valid,
        x, 0)``), its B and N at ``rows``: it ignores x's padded rows."""
        found = self.fills.get(node)
        return found.x if found is not None and found.rows == rows and self.mask.same(found.kept) else None

    def zeroing_of(self, node: fx.Node, rows: tuple[int, int] = (0, 1)) -> fx.Node | None:
        """x when ``node`` zeroes x's rows outside this mask (``x.masked_fill(~valid, 0)``), its B and N at
        ``rows``: like ``x * valid``, it ignores x's padded rows and is zero there."""
        found = self.fills.get(node)
        return self.fill_of(node, rows) if found is not None and found.zero else None

    def blind(self, node: fx.Node, rows: tuple[int, int] = (0, 1)) -> bool:
        """Every reader of ``node`` ignores its padded rows (rows = the positions of its B and N dims)."""
        key = (node, rows)
        if key not in self._memo:
            self._memo[key] = False  # a cycle cannot occur in a DAG; this guards recursion anyway
            self._memo[key] = bool(node.users) and all(self.reader_blind(user, node, rows) for user in node.users)
        return self._memo[key]

    def reader_blind(self, user: fx.Node, node: fx.Node, rows: tuple[int, int]) -> bool:
        """Whether ``user`` ignores the padded rows of its input ``node``."""
        if user.op == "output":
            return False
        if unused(user):  # (what an attention rewrite left of the scores it replaced)
            return True
        if reads_shape_only(user, node):  # (sym_size under dynamic shapes; torch.where(valid, h, zeros_like(h)))
            return True  # the exit's scatter has the value's shape, dtype and device
        shape = shape_of(node)
        if shape is None:
            return False
        rank = len(shape)
        name = target_name(user)
        attention = _attention_name(user)
        if attention is not None:
            return self._attention_blind(user, node, rows, attention)
        if name == "mul" and rows == (0, 1):
            others = [a for a in user.args if a is not node]
            if len(user.args) == 2 and len(others) == 1 and len(shape_of(user) or ()) == rank and \
                    self.zero_factor(user, others[0]):
                return True
        if self.fill_of(user, rows) is node:
            return True  # (masked max pooling: ``h.masked_fill(~valid[..., None], -inf).amax(1)``)
        if rows == (0, 1) and (loss := loss_reading(self.losses, user, node)) is not None:
            return self.is_mask(loss.mask)  # (cross_entropy(x.view(-1, V), labels.view(-1), ignore_index=k))
        if name in CONTRACTIONS and contraction_blind(self, user, node, rows):
            return True  # (else a token-wise x @ W, below)
        if rows == (0, 1) and self._kept_positions_read(user, node, shape):
            return True  # (BST's target appended after the history, read alone: out[:, -1])
        if name == "getitem" and user.args[0] is node and (moved := _indexed_rows(user.args[1], rows, rank)) \
                is not None and moved != rows:
            return self.blind(user, moved)  # (x[:, None] adds a head dim: single-head SDPA's q[:, None], o[:, 0])
        if name in ("select", "unbind") and user.args[0] is node or \
                name == "getitem" and user.args[0] is node and type(user.args[1]) is int:
            return self._piece_blind(user, rows, rank, name)
        out_shape = shape_of(user)
        if out_shape is None:
            return False
        if name == "transpose":
            if len(user.args) != 3 or user.kwargs:
                return False
            a, b = (d % rank if isinstance(d, int) else None for d in user.args[1:3])
            if a is None or b is None:
                return False
            swap = {a: b, b: a}
            return self.blind(user, tuple(swap.get(r, r) for r in rows))
        if name in ("view", "reshape", "contiguous") and user.args[0] is node and len(out_shape) == rank and \
                all(same_size(a, b) for a, b in zip(out_shape, shape)):
            return self.blind(user, rows)  # the same shape: the same rows (HF's reshape(B, -1, N, D) of SDPA's output)
        if name == "permute":  # x.permute(0, 2, 1, 3): the head split of model code
            dims = user.args[1] if len(user.args) == 2 else user.args[1:]
            if user.kwargs or not isinstance(dims, (list, tuple)) or not all(isinstance(d, int) for d in dims):
                return False
            order = [d % rank for d in dims]
            return sorted(order) == list(range(rank)) and self.blind(user, tuple(order.index(r) for r in rows))
        if name in ("unflatten", "flatten"):
            return self._reshape_blind(user, rows, rank, name)
        if name in ("squeeze", "unsqueeze") and user.args[0] is node:
            return self._squeeze_blind(user, rows, rank, name)
        if rows == (0, 1):
            rule = classify(user, self.mask.batch, self.mask.seq)
            if rule is not None and node in rule.rows:
                return self.blind(user, rows)
            return False
        # B and N elsewhere (an attention layout): elementwise ops and norms over the last dims keep rows
        if len(out_shape) != rank or not all(same_size(out_shape[r], shape[r]) for r in rows):
            return False
        if name in ("rms_norm", "layer_norm"):
            normalized = user.args[1]
            n = 1 if isinstance(normalized, int) else len(normalized)
            return user.args[0] is node and max(rows) < rank - n and self.blind(user, rows)
        if name in ELEMENTWISE and all(
            len(shape_of(a) or ()) < rank - min(rows) or a is node
            for a in user.all_input_nodes
        ):
            return self.blind(user, rows)
        return False

    def _kept_positions_read(self, user: fx.Node, node: fx.Node, shape: tuple) -> bool:
        """``user`` reads only constant token positions (``x[:, -1]``, ``x[:, 0]``, ``x.select(1, -1)``,
        ``x[:, -4:]``) that the mask keeps in every sample (unpad_masks.kept_at): it reads no padded row."""
        positions = _constant_positions(user, node, shape)
        return positions is not None and all(kept_at(self.mask, p) for p in positions)

    def _piece_blind(self, user: fx.Node, rows: tuple[int, int], rank: int, name: str) -> bool:
        """One piece along a dim besides B and N, of a fused projection split into heads (``qkv[0]``,
        ``qkv.select(0, 1)``, ``qkv.unbind(0)`` of a (3, B, H, N, D) layout): the rows of each piece."""
        # (which piece does not matter: each has the rows of the others)
        dim = 0 if name == "getitem" else \
            user.args[1] if len(user.args) > 1 else user.kwargs.get("dim", 0 if name == "unbind" else None)
        if type(dim) is not int or dim % rank in rows:
            return False
        piece = tuple(r - 1 if r > dim % rank else r for r in rows)
        if name != "unbind":
            return self.blind(user, piece)
        return bool(user.users) and all(target_name(u) == "getitem" and self.blind(u, piece) for u in user.users)

    def _reshape_blind(self, user: fx.Node, rows: tuple[int, int], rank: int, name: str) -> bool:
        if name == "unflatten":
            dim, sizes = user.args[1], user.args[2]
            dim = dim % rank if isinstance(dim, int) else None
            if dim is None or dim in rows:
                return False
            grow = len(sizes) - 1
            return self.blind(user, tuple(r + grow if r > dim else r for r in rows))
        start = user.args[1] if len(user.args) > 1 else user.kwargs.get("start_dim", 0)
        end = user.args[2] if len(user.args) > 2 else user.kwargs.get("end_dim", -1)
        start, end = start % rank, end % rank
        if any(start <= r <= end for r in rows) and start != end:
            return False
        shrink = end - start
        return self.blind(user, tuple(r - shrink if r > end else r for r in rows))

    def _squeeze_blind(self, user: fx.Node, rows: tuple[int, int], rank: int, name: str) -> bool:
        """A size-1 dim dropped or added beside the rows (DIN's ``dense(h).squeeze(-1)``, ``w.unsqueeze(1)``)."""
        dim = node_argument(user, 1, "dim")
        if not isinstance(dim, int):
            return False  # (squeeze() of every size-1 dim would drop B or N when they are 1)
        if name == "unsqueeze":
            dim %= rank + 1
            return self.blind(user, tuple(r + (r >= dim) for r in rows))
        dim %= rank
        return dim not in rows and same_size(shape_of(user.args[0])[dim], 1) and \
            self.blind(user, tuple(r - (r > dim) for r in rows))

    def _attention_blind(self, user: fx.Node, node: fx.Node, rows: tuple[int, int], attention: str) -> bool:
        if rows != ATTENTION_ROWS:
            return False
        spec = ATTENTION_ARGS[attention]
        roles = [role for role in ("q", "k", "v") if len(user.args) > spec[role] and user.args[spec[role]] is node]
        if len(roles) != sum(1 for a in user.args if a is node) or not roles:
            return False  # read through an argument we do not model (cos, sin, bias, ...)
        shape = shape_of(node)
        for role in roles:
            if role == "q":
                if not self.blind(user, ATTENTION_ROWS):
                    return False
                continue
            if not (same_size(shape[0], self.mask.batch) and same_size(shape[2], self.mask.seq)):
                return False
            kv_lengths = _kv_lengths(user)
            if self.mask.vector is not None:
                within = keys_within(self.mask, user, kv_lengths)
                if not within or (within == EMPTY_SAMPLES_READ_EVERY_KEY and not self.blind(user, ATTENTION_ROWS)):
                    return False
                continue
            found = lengths_arg_mask(kv_lengths, shape[2])
            if found is None or found[0] is not self.mask.lengths or found[1] != self.mask.offset:
                return False
        return True

    def keys_masked(self, attention: fx.Node) -> bool:
        """Whether the attention op masks its keys by this mask (its lengths, or a kv_mask of no key outside
        this vector's tokens, where a sample with none may read them all: finite fills)."""
        kv_lengths = _kv_lengths(attention)
        if self.mask.vector is not None:
            return bool(keys_within(self.mask, attention, kv_lengths))
        found = lengths_arg_mask(kv_lengths, self.mask.seq)
        return found is not None and found[0] is self.mask.lengths and found[1] == self.mask.offset

    def reads_every_key(self, attention: fx.Node) -> fx.Node | None:
        """``attention`` when it reads every key of a sample with no valid key (a finite fill,
        ``keys_within``'s EMPTY_SAMPLES_READ_EVERY_KEY) and its output rows are not pad-blind: why its keys
        and values stay padded. None otherwise."""
        if self.mask.vector is None:
            return None
        within = keys_within(self.mask, attention, _kv_lengths(attention))
        return attention if within == EMPTY_SAMPLES_READ_EVERY_KEY and not self.blind(attention, ATTENTION_ROWS) \
            else None

    def other_mask(self, user: fx.Node, node: fx.Node) -> str:
        """Why a reader that zeroes or reads rows by a mask does not excuse this region's padding ('' if
        it does not), for explain."""
        if target_name(user) == "mul" and len(user.args) == 2:
            other = next((a for a in user.args if a is not node), None)
            found = self.masks.get(other) if isinstance(other, fx.Node) else None
            if found is not None and not self.mask.same(found):
                return (f"; it zeroes them where {found.condition()}, the region packs the tokens where "
                        f"{self.mask.condition()}")
        attention = keys_of(user, node)
        if self.mask.vector is not None and attention is not None:
            return (f"; {attention.name} reads keys not provably among the tokens where "
                    f"{self.mask.condition()}")
        return ""
