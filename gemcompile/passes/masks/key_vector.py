"""The (B, Lk) bool tensor of a proven key vector: a per-key mask read from data, built in the graph.

A KeyVector (masks/model.py) is a formula over comparisons that read only the sample b and the key
position j: ``x[b, j] > 0``, ``attention_mask[b, j] == 1``, ``j >= L - lengths[b]``. ``emit_key_mask``
writes the graph nodes that compute it, from the very tensors the model's mask was built from, so the
kernels see the same keys the eager mask keeps, for any values (holes included), with no host sync and
no recompile when the values change. ``emit_zero_one_checks`` adds the device-side check of each integer
mask the evaluator read as 0/1 (a value outside {0, 1} would make the eager mask something else).
The unpad pass builds the valid tokens it packs by the same way (``emit_token_vector``).
"""

from __future__ import annotations

import operator

import sympy
import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true as known

from gemcompile.passes.graph import Emitter, Unproven, example_value, size_argument, size_expression
from gemcompile.passes.masks.evaluator import MaskEvaluator, index_symbol
from gemcompile.passes.masks.model import KeyVector


class _Builder:
    """sympy -> graph nodes of shape (B or 1, Lk or 1), broadcasting like the formula's indices."""

    def __init__(self, emit: Emitter, evaluator: MaskEvaluator, batch, keys, device: torch.device,
                 position: int = 0):
        self.emit, self.evaluator, self.device = emit, evaluator, device
        self.batch, self.keys = batch, keys
        # the token index the vector reads: j for a key vector, i for a query vector (KeyVector.position)
        self.b, self.j = index_symbol(3), index_symbol(position)
        self._positions: dict[sympy.Symbol, fx.Node] = {}

    def position(self, symbol: sympy.Symbol) -> fx.Node:
        if symbol not in self._positions:
            size, shape = (self.keys, (1, -1)) if symbol == self.j else (self.batch, (-1, 1))
            ar = self.emit.call(torch.arange, (size,), {"device": self.device})
            self._positions[symbol] = self.emit.call(torch.reshape, (ar, shape))
        return self._positions[symbol]

    def integer(self, e: sympy.Expr):
        """An integer expression as a node (or a Python int)."""
        if e.is_Integer:
            return int(e)
        if e in (self.b, self.j):
            return self.position(e)
        if isinstance(e, sympy.Add):
            return self._fold(operator.add, e.args)
        if isinstance(e, sympy.Mul):
            return self._fold(operator.mul, e.args)
        if isinstance(e, sympy.Function):
            return self.leaf(e)
        if isinstance(e, sympy.Symbol):  # a size compiled as dynamic: j >= L - lengths[b] with L symbolic
            return self.size(e)
        raise Unproven(f"the key mask {e} cannot be built (only sums and products of positions, lengths and "
                       "data are)")

    def size(self, symbol: sympy.Symbol) -> fx.Node:
        """The graph value holding a symbolic size: the batch or key count given, else what the graph's inputs
        hold of it (Dynamo lifts each dynamic size as a placeholder; graph.size_expression)."""
        for size in (self.keys, self.batch):
            value = example_value(size) if isinstance(size, fx.Node) else None
            if isinstance(value, torch.SymInt) and value.node.expr == symbol:
                return size
        try:
            return size_expression(self.emit, symbol)
        except Unproven:
            raise Unproven(f"the key mask reads the dynamic size {symbol}, which no graph input holds (compile "
                           "with static sequence lengths)") from None

    def _fold(self, op, args):
        out = None
        for a in args:
            x = self.integer(a)
            out = x if out is None else self.emit.call(op, (out, x))
        return out

    def leaf(self, f: sympy.Function) -> fx.Node:
        """A lengths (B,) or data tensor read at (b, j): as a (B|1, Lk|1) view."""
        name = f.func.__name__
        data = self.evaluator.data.get(name)
        node = data.node if data is not None else self.evaluator.leaves.get(name)
        if node is None:  # torch's FloorDiv, Mod, ... of dynamic sizes (``m[:, L - L // 4:] = True``)
            raise Unproven(f"the key mask computes {f} from the dynamic sizes, which it is not rebuilt from "
                           "(compile with static sequence lengths)")
        x, picked = node, []
        for dim, arg in enumerate(f.args):  # f's args are the node's dims, left to right
            if arg == 0:
                continue
            shift = sympy.expand(arg - self.j)  # m[b, j + c]: a chunk of m (CANINE's local attention)
            if arg != self.b and not (shift.is_Integer and shift >= 0):
                raise Unproven(f"the key mask reads {node.name} at {arg}: only (b, j + c) are built")
            picked.append((dim, self.b if arg == self.b else self.j, 0 if arg == self.b else int(shift)))
        dims = [arg for _, arg, _ in picked]
        if len(set(dims)) < len(dims):  # cm[j, j]: a diagonal, not a (b, j) view of the tensor
            raise Unproven(f"the key mask reads {node.name} at {f.args}: only (b, j) are built")
        for dim, arg, start in picked:  # am[:, :Lk] of a longer am reads its first Lk columns only
            x = self._narrow(x, node, dim, start, self.keys if arg == self.j else self.batch)
        # drop the dims read at index 0 (size-1 or the first element), last first so dims stay valid
        for dim in reversed([d for d, arg in enumerate(f.args) if arg == 0]):
            x = self.emit.call(torch.select, (x, dim, 0))
        if dims == [self.j, self.b]:
            x = self.emit.call(torch.transpose, (x, 0, 1))
        elif len(dims) == 1:
            x = self.emit.call(torch.unsqueeze, (x, 1 if dims[0] == self.b else 0))
        elif not dims:
            x = self.emit.call(torch.reshape, (x, (1, 1)))
        dtype = example_value(node).dtype
        if dtype in (torch.int8, torch.uint8, torch.int16, torch.int32):  # the formula's integers do not wrap:
            x = self.emit.method("to", (x, torch.int64))  # its sums and differences, rebuilt here, must not
        return x

    def _narrow(self, x: fx.Node, node: fx.Node, dim: int, start: int, size) -> fx.Node:
        """x's ``size`` entries from ``start`` along ``dim`` (the batch or the keys): the formula reads
        ``node`` there only."""
        have = example_value(node).shape[dim]
        want = example_value(size) if isinstance(size, fx.Node) else size
        if start == 0 and known(have == want):  # (with the shape env's replacements: am's batch symbol and
            return x  # k's, unified by a broadcast, are one size under dynamic shapes)
        if isinstance(have, int) and isinstance(want, int) and have < start + want:
            raise Unproven(f"the key mask reads {node.name} (size {have} along dim {dim}) at {want} positions "
                           f"from {start}")
        # (a dynamic size: the model's slice had these `want` entries, or its mask would not have had that shape);
        # the size read from the graph's inputs where it can be, so that the slice depends on inputs alone (unpad
        # moves a token vector's reads before its region)
        try:
            size = size_argument(self.emit, want)
        except Unproven:
            pass
        return self.emit.call(torch.narrow, (x, dim, start, size))

    def proposition(self, atom) -> fx.Node:
        kind, e = self.evaluator.atoms.expr_of[atom]
        x = self.integer(e)
        if not isinstance(x, fx.Node):
            raise Unproven("a constant comparison in a key mask")
        return self.emit.call(operator.lt if kind == "lt" else operator.eq, (x, 0))

    def formula(self, pred) -> fx.Node | bool:
        if pred is sympy.true or pred is sympy.false:
            return bool(pred)
        if isinstance(pred, sympy.Symbol):
            return self.proposition(pred)
        if isinstance(pred, sympy.Not):
            return self.emit.call(torch.logical_not, (self.formula(pred.args[0]),))
        op = {sympy.And: torch.logical_and, sympy.Or: torch.logical_or}.get(type(pred))
        if op is None:
            raise Unproven(f"the key mask {pred} cannot be built")
        parts = [self.formula(a) for a in pred.args]
        out = parts[0]
        for p in parts[1:]:
            out = self.emit.call(op, (out, p))
        return out


def emit_key_mask(emit: Emitter, vector: KeyVector, k: fx.Node, batch, keys) -> fx.Node:
    """The (B, Lk) bool kv_mask of ``vector`` for keys ``k`` (B, H, Lk, D); ``batch`` and ``keys`` are the
    sizes (ints, or sym_size nodes when dynamic). A query vector (position 1) gives the (B, Lq) rows kept
    for queries ``k`` (B, H, Lq, D) the same way."""
    return emit_token_vector(emit, vector, batch, keys, example_value(k).device, "the attention")


def emit_token_vector(emit: Emitter, vector: KeyVector, batch, keys, device: torch.device,
                      user: str) -> fx.Node:
    """The (batch, keys) bool tensor of ``vector`` on ``device`` (where ``user``, named in refusals, runs):
    a kv_mask, query rows, or the valid tokens unpad packs."""
    builder = _Builder(emit, vector.evaluator, batch, keys, device, vector.position)
    mask = builder.formula(vector.formula)
    if isinstance(mask, bool):
        raise Unproven("the key mask is constant")
    if example_value(mask).dtype != torch.bool:
        mask = emit.call(torch.ne, (mask, 0))
    if example_value(mask).device != device:
        raise Unproven(f"the key mask is on {example_value(mask).device}, {user} on {device}")
    return emit.call(torch.Tensor.expand, (mask, batch, keys))
