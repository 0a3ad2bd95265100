"""Tensors updated in place: the one thing the mask prover must not read past.

The evaluator (masks/evaluator.py) reads a mask from the ops that built it, and the rewrite re-reads their
inputs at run time. A tensor changed in place holds other values than those ops give (FuxiCTR TransAct's
``mask[mask.all(-1), -1] = 0``, MEANTIME's ``m.tril_()`` on a repeated key mask), and a tensor read at run
time after the change (``lengths[:, None]`` when the model later does ``lengths.clamp_(max=3)``) holds other
values than the model's mask saw: either way the rewrite would give another answer without a word.

So the graph is split into alias classes: an op joins the class of its tensor inputs unless it is known to
return a new tensor (``_FRESH``: arithmetic, comparisons, reductions, products, factories, clone, ...).
Views, casts that may return their input (``.long()`` of an int64 tensor, ``.to(same)``, ``.bool()``),
``.data``, ``getitem`` and every op not listed join it. A class is *updated* when any member is written in
place: a method or function named ``*_`` (``tril_``, ``copy_``, ``aten.copy_``), an in-place operator
(``x[i] = v``, ``x += y``), ``out=``, ``inplace=True``. A mask that reads a member of an updated class is
refused with the update named, and no member becomes an opaque leaf read at run time. Updates of fresh
tensors that nothing else sees were made out of place earlier (attention/in_place.py, which forgets the
index of a graph it changes).
"""

from __future__ import annotations

import weakref

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from gemcompile.passes.graph import (IN_PLACE_DUNDERS, IN_PLACE_OPERATORS, INPLACE_FLAG, Unproven, dropout_arguments,
                                     example_value, has_inplace_flag, target_name)

__all__ = ["INPLACE_FLAG", "check_not_updated", "forget_mutations", "has_inplace_flag", "in_place_update",
           "returns_new_tensor", "update_after"]

_NOT_UPDATES = {"requires_grad_", "retain_grad", "record_stream"}
_FRESH = {
    # arithmetic, comparisons and logic (method, function and operator spellings)
    "add", "sub", "mul", "div", "truediv", "floordiv", "floor_divide", "mod", "remainder", "fmod", "pow",
    "neg", "abs", "rsub", "sign", "sqrt", "rsqrt", "exp", "log", "sin", "cos", "tanh", "sigmoid", "relu",
    "gelu", "silu", "erf", "floor", "ceil", "round", "reciprocal", "square",
    "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__",
    "__floordiv__", "__rfloordiv__", "__mod__", "__pow__", "__rpow__", "__neg__", "__abs__", "__matmul__",
    "__rmatmul__", "eq", "ne", "lt", "le", "gt", "ge", "__eq__", "__ne__", "__lt__", "__le__", "__gt__",
    "__ge__", "and_", "or_", "xor", "invert", "not_", "__and__", "__or__", "__xor__", "__invert__",
    "__rand__", "__ror__", "__rxor__", "logical_and", "logical_or", "logical_xor", "logical_not",
    "bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_not", "where", "masked_fill", "clamp", "clip",
    "clamp_min", "clamp_max", "minimum", "maximum", "isnan", "isinf", "isfinite", "nan_to_num",
    # reductions, products, normalizations
    "sum", "mean", "amax", "amin", "any", "all", "prod", "cumsum", "cumprod", "count_nonzero", "argmax",
    "argmin", "matmul", "bmm", "mm", "baddbmm", "addmm", "einsum", "linear", "softmax", "log_softmax",
    "layer_norm", "group_norm", "rms_norm", "embedding", "embedding_bag", "scaled_dot_product_attention",
    "multi_head_attention_forward", "max", "min", "sort", "topk", "std", "var", "norm", "logsumexp",
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "convolution",
    "batch_norm", "instance_norm", "normalize", "cosine_similarity", "cdist", "outer", "addcmul", "addcdiv",
    "leaky_relu", "elu", "selu", "celu", "softplus", "mish", "hardswish", "hardsigmoid", "log1p", "expm1",
    "glu", "pad", "scatter", "scatter_add", "index_add", "index_put", "masked_select", "nonzero",
    # factories and copies
    "arange", "ones", "zeros", "full", "empty", "rand", "randn", "randint", "tensor", "ones_like",
    "zeros_like", "full_like", "empty_like", "rand_like", "randn_like", "new_ones", "new_zeros", "new_full",
    "new_empty", "new_tensor", "eye", "clone", "cat", "concat", "concatenate", "stack", "tril", "triu",
    "repeat", "repeat_interleave", "tile", "gather", "index_select", "flip", "roll", "one_hot", "_to_copy",
}
"""Ops whose result is a new tensor, never an alias of an input."""


def returns_new_tensor(node: fx.Node) -> bool:
    """Whether ``node``'s op is known to return a new tensor, never an alias of an input (``_FRESH``)."""
    if node.op not in ("call_function", "call_method"):
        return False
    if isinstance(node.target, torch._ops.OpOverload) and node.target.namespace == "gemcompile":
        return True  # gemcompile's own ops return new tensors
    if has_inplace_flag(node):
        return False  # F.relu(x, inplace=True) returns x itself
    if target_name(node) == "einsum":  # einsum("bl->lb", x) of one operand is a view of it
        return len(_tensor_inputs(node)) > 1
    if target_name(node) == "dropout":  # x itself when not training or p == 0 (or x has no elements)
        _, p, training = dropout_arguments(node.args, node.kwargs)
        return training is True and isinstance(p, (int, float)) and p > 0
    return target_name(node) in _FRESH


def _tensor_inputs(node: fx.Node) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), lambda n: found.append(n))
    return found


def _aliased_inputs(node: fx.Node) -> list[fx.Node]:
    """The inputs ``node``'s result may share storage with (every one, for an op not known to be fresh)."""
    if node.op not in ("call_function", "call_method"):
        return []
    written = _updated_by(node)
    if written:  # x *= m, x.masked_fill_(m, v), add(a, b, out=c): the result is the written tensor, m is read
        return written
    if returns_new_tensor(node):
        return []
    if target_name(node) in _SELF_ONLY and node.args and isinstance(node.args[0], fx.Node):
        return [node.args[0]]  # x.to(q), x.type_as(q): x itself or a copy of it, never q
    return _tensor_inputs(node)


_SELF_ONLY = frozenset({"to", "type_as", "expand_as", "view_as", "reshape_as"})
"""Ops whose result may alias their first tensor only: the other gives a dtype, device or shape."""


def _updated_by(node: fx.Node) -> list[fx.Node]:
    """The tensors ``node`` writes in place."""
    if node.op not in ("call_function", "call_method"):
        return []
    written: list[fx.Node] = []
    out = node.kwargs.get("out")
    fx.node.map_arg(out, lambda n: written.append(n))
    first = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
    if first is not None and (has_inplace_flag(node) or _writes_first(node)):
        written.append(first)
    return written


def _writes_first(node: fx.Node) -> bool:
    if node.target in IN_PLACE_OPERATORS:
        return True
    if node.op == "call_function" and getattr(node.target, "__module__", None) in ("_operator", "operator"):
        return False  # operator.and_ / or_ / not_ are out of place; the in-place ones are graph.IN_PLACE_OPERATORS
    name = target_name(node)
    if name in IN_PLACE_DUNDERS:
        return True
    return name.endswith("_") and not name.startswith("__") and name not in _NOT_UPDATES


def _input_storage(node: fx.Node):
    """A key for the storage of a graph input's example value (Dynamo's fake inputs share one fake storage
    where the real ones do), else None."""
    value = example_value(node) if node.op == "placeholder" else None
    if not isinstance(value, torch.Tensor) or value.is_sparse:
        return None
    try:
        return StorageWeakRef(value.untyped_storage())
    except (RuntimeError, NotImplementedError):
        return None


class _MutationIndex:
    """The alias classes of one graph and, for each updated class, the first op that writes it."""

    def __init__(self, graph: fx.Graph):
        self.parent: dict[fx.Node, fx.Node] = {}
        storages: dict = {}  # inputs passed as views of one tensor (model(n, n.view(-1))): one class
        for node in graph.nodes:
            self.parent[node] = node
            for source in _aliased_inputs(node):
                self._union(node, source)
            storage = _input_storage(node)
            if storage is not None:
                self._union(node, storages.setdefault(storage, node))
        self.updates: dict[fx.Node, fx.Node] = {}
        self.every_update: dict[fx.Node, list[fx.Node]] = {}  # in graph order
        for node in graph.nodes:
            for written in _updated_by(node):
                self.updates.setdefault(self._find(written), node)
                self.every_update.setdefault(self._find(written), []).append(node)

    def _find(self, node: fx.Node) -> fx.Node:
        root = node
        while self.parent.setdefault(root, root) is not root:
            root = self.parent[root]
        while self.parent[node] is not root:  # path compression
            self.parent[node], node = root, self.parent[node]
        return root

    def _union(self, a: fx.Node, b: fx.Node) -> None:
        ra, rb = self._find(a), self._find(b)
        if ra is not rb:
            self.parent[ra] = rb

    def update_of(self, node: fx.Node, depth: int = 32) -> fx.Node | None:
        if not self.updates:
            return None
        if node in self.parent:
            return self.updates.get(self._find(node))
        if depth <= 0:  # a node added after the index was built: through what it may alias
            return None
        return next((u for s in _aliased_inputs(node) if (u := self.update_of(s, depth - 1)) is not None), None)


_INDEXES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _index(graph: fx.Graph) -> _MutationIndex:
    index = _INDEXES.get(graph)
    if index is None:
        index = _INDEXES[graph] = _MutationIndex(graph)
    return index


def forget_mutations(graph: fx.Graph) -> None:
    """Drop the graph's alias index: call after removing in-place updates from it (adding ops that are not
    in place needs nothing: new nodes are looked up through their inputs)."""
    _INDEXES.pop(graph, None)


def in_place_update(node: fx.Node) -> fx.Node | None:
    """The first op that writes ``node``'s tensor or any tensor it may alias in place, or None."""
    return _index(node.graph).update_of(node)


def update_after(node: fx.Node, reader: fx.Node) -> fx.Node | None:
    """An op that writes ``node``'s tensor (or one it may alias) in place after ``reader`` reads it in graph
    order, or None: a copy of the value taken at ``reader`` would miss it. (None for nodes added after the
    graph's index was built.)"""
    index = _index(node.graph)
    if node not in index.parent or not index.updates:
        return None
    updates = index.every_update.get(index._find(node), [])
    if not updates:
        return None
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    return next((u for u in updates if order.get(u, -1) > order.get(reader, -1)), None)


def check_not_updated(node: fx.Node) -> None:
    """Unproven, naming the update, when ``node``'s tensor (or one it may alias) is updated in place."""
    update = in_place_update(node)
    if update is not None:
        raise Unproven(f"{node.name} (in the mask) is updated in place by {update.name} "
                       f"(`{target_name(update)}`): the prover reads a mask only as it was built")
