"""In-place updates of fresh tensors, rewritten as the out-of-place ops they equal.

Models write the score chain in place too: ``s /= math.sqrt(d)``, ``s += mask``, ``s.masked_fill_(pad,
-inf)``, ``s[~mask] = -1e6`` (d2l's masked_softmax: a boolean index of s's own shape is a masked_fill).
Dynamo records the operator forms as ``operator.itruediv(s, c)`` whose result later code reads, and the
method forms as a call whose result nobody reads while the softmax reads ``s`` itself, mutated. The
matchers walk values back from the softmax (attention/scores.py), so they missed such a chain without a
word in explain.

Where ``s`` is a fresh tensor that nothing else can see, an in-place update is exactly the out-of-place op
whose result every later reader of ``s`` takes instead: ``s`` must be the result of an op that returns a new
tensor (a matmul, an einsum, arithmetic, masked_fill, where, arange: transformers' ``kv_arange +=
offset``; never a view, a cast that may return its input,
or a graph input), read by nothing before the update (but slices of it that ops making new tensors read
before the update: transformers' ``m[..., :n] = m[..., :n].masked_fill(pad, min)``, an assignment to every
element, which is the value assigned), and the out-of-place op must give ``s``'s dtype and
shape (``s += mask`` with a wider mask dtype would promote out of place, so it stays as written). Graph-wide:
this is what functionalization does later anyway, here early enough for the matchers.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true as known

from gemcompile.passes.attention.index_assign import emit_index_assign, index_assign_parts
from gemcompile.passes.attention.scores import reads_shape_only
from gemcompile.passes.graph import Emitter, example_value, target_name
from gemcompile.passes.masks.mutation import INPLACE_FLAG, forget_mutations, has_inplace_flag, returns_new_tensor

_OPERATORS = {operator.itruediv: operator.truediv, operator.iadd: operator.add, operator.isub: operator.sub,
              operator.imul: operator.mul, operator.iand: operator.and_, operator.ior: operator.or_}
_METHODS = {"masked_fill_": "masked_fill", "add_": "add", "sub_": "sub", "mul_": "mul", "div_": "div",
            "tril_": "tril", "triu_": "triu",  # MEANTIME's attn_mask.tril_()
            **{f"{name}_": name for name in ("relu", "sigmoid", "tanh", "clamp", "clamp_min", "clamp_max", "exp",
                                             "neg", "abs", "sqrt", "pow")}}  # h.relu_() in an MLP
_VIEWS = ("reshape", "view", "unsqueeze", "squeeze", "flatten", "unflatten", "permute", "transpose")
"""Views through which an update of a fresh tensor seen by nothing else is still an update of a fresh one."""
_MAY_RETURN_INPUT = ("dropout", "contiguous")
"""Ops that return their input itself or a new tensor (dropout when not training or p == 0): like a view,
fresh where their input is fresh and read by nothing else (FuxiCTR BST's ``s = self.dropout1(a); s += x``)."""


def _out_of_place(node: fx.Node) -> tuple[str, object] | None:
    """(fx op, target) of the out-of-place form of an in-place update, or None."""
    if node.op == "call_function" and node.target in _OPERATORS:
        return "call_function", _OPERATORS[node.target]
    if node.op == "call_method" and node.target in _METHODS:
        return "call_method", _METHODS[node.target]
    if node.op == "call_function" and node.target in INPLACE_FLAG and has_inplace_flag(node):
        return "flag", node.target  # nn.ReLU(inplace=True) in an MLP
    if node.op == "call_function" and node.target is operator.setitem and _bool_mask_fill(node):
        return "call_method", "masked_fill"  # x[mask] = value is x.masked_fill_(mask, value): the same args
    if node.op == "call_function" and node.target is operator.setitem and _whole_slice(node):
        return "assign", None  # x[:, :, :, :n] = value with n the last dim's size: x holds a copy of value
    if node.op == "call_function" and node.target is operator.setitem and index_assign_parts(node) is not None:
        return "index_assign", None  # x[:, 0] = v: where(the indexed elements, v, x)
    return None


def _without_flag(node: fx.Node) -> tuple[tuple, dict]:
    """The args and kwargs of an activation called with inplace=True, with inplace=False."""
    index = INPLACE_FLAG[node.target]
    args = tuple(False if i == index else a for i, a in enumerate(node.args))
    return args, {**node.kwargs, **({"inplace": False} if "inplace" in node.kwargs else {})}


def _whole_slice(node: fx.Node) -> bool:
    """``x[:, :, :, :n] = value`` (transformers' pre-4.53 mask: n the padding mask's length, the last dim's
    size) where every slice covers its whole dim and value is a tensor of x's dtype."""
    if len(node.args) != 3 or node.kwargs or not isinstance(node.args[2], fx.Node):
        return False
    x, index, value = example_value(node.args[0]), node.args[1], example_value(node.args[2])
    index = index if isinstance(index, tuple) else (index,)
    if not (isinstance(x, torch.Tensor) and isinstance(value, torch.Tensor) and value.dtype == x.dtype) or \
            len(index) > x.dim():
        return False
    for size, i in zip(x.shape, index):
        if not isinstance(i, slice) or i.step not in (None, 1) or i.start not in (None, 0):
            return False
        stop = example_value(i.stop) if isinstance(i.stop, fx.Node) else i.stop
        if stop is not None and not (isinstance(stop, (int, torch.SymInt)) and known(stop >= size)):
            return False
    return True


def _seen_only_before(user: fx.Node, update: fx.Node, order: dict) -> bool:
    """A slice of the base read before the update whose every reader makes a new tensor before it (the value
    ``x[..., :n].masked_fill(pad, min)`` assigned back), or a new tensor made from the base before it
    (FuxiCTR's ``mask.all(-1)`` in ``mask[mask.all(-1), -1] = 0``): no reader can see the mutation."""
    if order[user] < order[update] and returns_new_tensor(user):
        return True
    if not (user.target is operator.getitem and order[user] < order[update]):
        return False
    return all(order.get(u, len(order)) < order[update] and returns_new_tensor(u) for u in user.users)


def _bool_mask_fill(node: fx.Node) -> bool:
    """``x[mask] = value`` with mask a bool tensor of x's shape and value a scalar (a number or a 0-d tensor):
    boolean indexing by a full-shape mask selects exactly the elements masked_fill sets."""
    if len(node.args) != 3 or node.kwargs:
        return False
    x, mask, value = (example_value(a) if isinstance(a, fx.Node) else a for a in node.args)
    if not (isinstance(x, torch.Tensor) and isinstance(mask, torch.Tensor) and mask.dtype == torch.bool):
        return False
    if mask.dim() != x.dim() or not all(known(a == b) for a, b in zip(mask.shape, x.shape)):
        return False
    return isinstance(value, (int, float, bool)) or (isinstance(value, torch.Tensor) and value.dim() == 0)


def _fresh(node) -> bool:
    """A new tensor no one else can see: an op that returns one, or a view (reshape, unsqueeze, ...) or
    ``_MAY_RETURN_INPUT`` op whose base is such a tensor read by nothing else (d2l writes ``x = s.reshape(-1,
    L); x[~mask] = v``: s is seen only through x; MEANTIME ``m = pad.repeat(1, L, 1).unsqueeze(1); m.tril_()``)."""
    if not (isinstance(node, fx.Node) and node.op in ("call_function", "call_method")
            and isinstance(example_value(node), torch.Tensor)):
        return False
    if returns_new_tensor(node):
        return True
    if (target_name(node) in _VIEWS or target_name(node) in _MAY_RETURN_INPUT and not has_inplace_flag(node)) and \
            node.args and isinstance(node.args[0], fx.Node):
        base = node.args[0]  # (reads of its shape alone, ``shape = s.shape`` under dynamic shapes, see nothing)
        return [u for u in base.users if not reads_shape_only(u, base)] == [node] and _fresh(base)
    return False


def _same_layout(before: torch.Tensor, after) -> bool:
    if not isinstance(after, torch.Tensor) or after.dtype != before.dtype or after.dim() != before.dim():
        return False
    return all(known(a == b) for a, b in zip(after.shape, before.shape))


def functionalize_fresh_updates(graph: fx.Graph) -> int:
    """Rewrite each in-place update of a fresh tensor (module doc) out of place; returns how many."""
    count = 0
    for node in list(graph.nodes):
        form = _out_of_place(node)
        if form is None or not node.args or not _fresh(node.args[0]):
            continue
        base = node.args[0]
        order = {n: i for i, n in enumerate(graph.nodes)}
        if any(order[user] < order[node] and not reads_shape_only(user, base) and not _seen_only_before(
                user, node, order) for user in base.users):
            continue  # read before the update (a view of it, a saved copy): the mutation is visible there
        emit = Emitter(graph, untraceable="")
        with graph.inserting_before(node):
            try:
                if form[0] == "assign":
                    new = emit.method("clone", (emit.method("expand_as", (node.args[2], base)),))
                elif form[0] == "index_assign":
                    new = emit_index_assign(emit, base, *index_assign_parts(node))
                elif form[0] == "flag":
                    new = emit.node("call_function", form[1], *_without_flag(node))
                else:
                    new = emit.node(*form, node.args, dict(node.kwargs))
            except Exception:  # noqa: BLE001 (an op the fake mode cannot run out of place: keep it as written)
                emit.rollback()
                continue
        if not _same_layout(example_value(base), example_value(new)):
            emit.rollback()
            continue
        new.meta.update({k: v for k, v in node.meta.items() if k not in ("example_value", "val")})
        node.replace_all_uses_with(new)
        for user in [u for u in base.users if u is not new and order.get(u, -1) > order[node]]:
            user.replace_input_with(base, new)
        graph.erase_node(node)
        count += 1
    if count:
        forget_mutations(graph)  # the alias index (masks/mutation.py) still lists the updates just removed
    return count
