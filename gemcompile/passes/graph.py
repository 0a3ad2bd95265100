"""What every pass needs to read and edit an FX graph: the refusal exception, a node's example value and
op name, one node emitter with fake-tensor propagation, and dead-code removal that is safe before
functionalization."""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_leaves, tree_map


class Unproven(Exception):
    """A pass could not prove a rewrite is exact; the message says why, for explain."""


def example_value(node: Any):
    """A node's fake value (``example_value`` in Dynamo graphs, ``val`` after AOTAutograd); non-nodes as is."""
    if isinstance(node, fx.Node):
        return node.meta.get("example_value", node.meta.get("val"))
    return node


def target_name(target: Any) -> str:
    """The op's name without overload: `lt` for operator.lt, Tensor.lt and aten.lt.Tensor alike. Given a
    node, the name of what it calls ('' for a node that calls nothing: placeholder, output, get_attr)."""
    if isinstance(target, fx.Node):
        if target.op not in ("call_function", "call_method"):
            return ""
        target = target.target
    if isinstance(target, torch._ops.OpOverload):
        return target.overloadpacket.__name__
    return target if isinstance(target, str) else getattr(target, "__name__", str(target))


NOOP_CASTS = ("to", "float", "double", "half", "bfloat16", "type_as", "type")
"""The casts ``through_noop_casts`` peels by default."""


def through_noop_casts(node: Any, names: tuple[str, ...] = NOOP_CASTS) -> Any:
    """``node`` under calls of ``names`` that change nothing: the same dtype, device and shape (``q.float()`` of
    a float32 q, ``labels.to(logits.device)`` on that device)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    while isinstance(node, fx.Node) and target_name(node) in names and node.args and isinstance(node.args[0], fx.Node):
        value, source = example_value(node), example_value(node.args[0])
        if not (isinstance(value, torch.Tensor) and isinstance(source, torch.Tensor) and value.dtype == source.dtype
                and value.device == source.device and value.dim() == source.dim()
                and all(statically_known_true(a == b) for a, b in zip(value.shape, source.shape))):
            break
        node = node.args[0]
    return node


def permutation(node: Any) -> list[int] | None:
    """The dims a ``transpose`` / ``swapaxes`` / ``swapdims`` / ``permute`` node reads its input in (output dim i
    is input dim order[i]), all given as ints; None for any other node."""
    if not isinstance(node, fx.Node) or node.kwargs or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    name, args = target_name(node), node.args
    value = example_value(args[0])
    rank = value.dim() if isinstance(value, torch.Tensor) else 0
    if name in ("transpose", "swapaxes", "swapdims") and len(args) == 3 and all(type(d) is int for d in args[1:]):
        a, b = (d % rank for d in args[1:]) if rank else (None, None)
        if a is None:
            return None
        order = list(range(rank))
        order[a], order[b] = b, a
        return order
    if name == "permute":
        order = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list)) else args[1:]
        if rank and len(order) == rank and all(type(d) is int for d in order):
            order = [d % rank for d in order]
            return order if sorted(order) == list(range(rank)) else None
    return None


def schema_arguments(node: fx.Node) -> dict[str, Any]:
    """An OpOverload call's arguments by their schema names, defaults filled in (never by position: a
    schema may grow)."""
    call = {}
    for i, argument in enumerate(node.target._schema.arguments):
        if i < len(node.args):
            call[argument.name] = node.args[i]
        elif argument.name in node.kwargs:
            call[argument.name] = node.kwargs[argument.name]
        else:
            call[argument.name] = argument.default_value if argument.has_default_value() else None
    return call


class Emitter:
    """Inserts nodes at the graph's insertion point with their fake value computed in the fake mode the
    inputs live in (the tracing context may hold another one), so later passes (ours and Inductor's) see
    shapes on new nodes as on the tracer's. ``created`` lists the new nodes, for reports and rollback.

    ``value_key`` is where the value goes (``example_value`` in Dynamo graphs, ``val`` after AOTAutograd);
    ``untraceable``, when set, turns a failure to trace a new node into ``Unproven(f"{node} {untraceable}:
    {error}")`` (else the error propagates). A new data-dependent size is bound (``unbacked_bindings``)
    so later tracing does not trip on it."""

    def __init__(self, graph: fx.Graph, value_key: str = "example_value", untraceable: str | None = None):
        self.graph = graph
        self.value_key = value_key
        self.untraceable = untraceable
        self.created: list[fx.Node] = []

    def mark(self) -> int:
        return len(self.created)

    def _graph_mode(self):
        """The fake mode of the graph's inputs, for a node built from constants alone (torch.arange(n))."""
        for node in self.graph.nodes:
            value = node.meta.get(self.value_key)
            if isinstance(value, FakeTensor):
                return value.fake_mode
        return None

    def rollback(self, mark: int = 0) -> None:
        """Erase the nodes created since ``mark`` (a rewrite that was abandoned)."""
        for node in reversed(self.created[mark:]):
            if not node.users:
                self.graph.erase_node(node)
        del self.created[mark:]

    def call(self, target, args: tuple, kwargs: dict | None = None) -> fx.Node:
        return self.node("call_function", target, args, kwargs or {})

    def method(self, name: str, args: tuple, kwargs: dict | None = None) -> fx.Node:
        return self.node("call_method", name, args, kwargs or {})

    def node(self, op: str, target, args: tuple, kwargs: dict) -> fx.Node:
        from torch.fx.experimental.symbolic_shapes import compute_unbacked_bindings

        node = self.graph.create_node(op, target, args, kwargs)
        self.created.append(node)
        to_value = lambda a: example_value(a) if isinstance(a, fx.Node) else a  # noqa: E731
        fake_args, fake_kwargs = tree_map(to_value, args), tree_map(to_value, kwargs)
        leaves = [*tree_leaves(fake_args), *tree_leaves(fake_kwargs)]
        mode = next((a.fake_mode for a in leaves if isinstance(a, FakeTensor)), None) or self._graph_mode()
        if mode is None:
            return node
        try:
            # identity hooks: a checkpoint(...) whose forward compiles us must not see our fake ops' saved tensors
            with mode, torch.autograd.graph.saved_tensors_hooks(_same, _same):
                if op == "call_method":
                    value = getattr(fake_args[0], target)(*fake_args[1:], **fake_kwargs)
                else:
                    value = target(*fake_args, **fake_kwargs)
        except (RuntimeError, TypeError, ValueError, IndexError) as e:
            if self.untraceable is None:
                raise
            raise Unproven(f"{node.name} {self.untraceable}: {e}") from e
        if mode.shape_env is not None:
            bindings = compute_unbacked_bindings(mode.shape_env, value)
            if bindings:
                node.meta["unbacked_bindings"] = bindings
        node.meta[self.value_key] = value
        return node


def size_argument(emit: Emitter, size: Any):
    """A size as an argument of emitted nodes: the int when static; under dynamic shapes, the graph input
    Dynamo lifts for its symbol, else ``sym_size`` of an input tensor with a dim of exactly that size (a raw
    SymInt is no valid argument: it would be traced as a constant)."""
    if not isinstance(size, torch.SymInt):
        return size
    return size_expression(emit, size.node.expr)


def size_expression(emit: Emitter, expr):
    """A size expression as a graph value: an input holding it, else its sum or product built from its terms
    (``N + 1`` of a [CLS] token prepended to N tokens)."""
    if expr.is_Integer:
        return int(expr)
    placeholders = list(emit.graph.find_nodes(op="placeholder"))
    for node in placeholders:
        value = node.meta.get(emit.value_key)
        if isinstance(value, torch.SymInt) and value.node.expr == expr:
            return node
    for node in placeholders:
        value = node.meta.get(emit.value_key)
        if isinstance(value, torch.Tensor):
            for dim, d in enumerate(value.shape):
                if isinstance(d, torch.SymInt) and d.node.expr == expr:
                    return emit.call(torch.ops.aten.sym_size.int, (node, dim))
    if expr.is_Add or expr.is_Mul:
        terms = [size_expression(emit, term) for term in expr.args]
        out = terms[0]
        for term in terms[1:]:
            out = emit.call(operator.add if expr.is_Add else operator.mul, (out, term))
        return out
    raise Unproven(f"the dynamic size {expr} is held by no graph input")


CHECKPOINT_REGION_INPUT = "gemcompile_checkpoint_region_input"
"""Meta flag of a placeholder of an activation-checkpointed region's subgraph (base.run_pre_grad): refusals of
masks read from it say where such an input comes from."""

INPUT_HINT = ("a mask the model builds before a graph break reaches the next graph as an input "
              "(TORCH_LOGS=graph_breaks shows the breaks)")
REGION_INPUT_HINT = ("a mask built outside a torch.utils.checkpoint region reaches the region as an input: build "
                     "it inside the checkpointed function (from the lengths) to have it proven there")


def input_hint(node: fx.Node) -> str:
    """Where a graph input that a mask reads often comes from."""
    return REGION_INPUT_HINT if node.meta.get(CHECKPOINT_REGION_INPUT) else INPUT_HINT


_BINARY = ("input", "other")
_POSITIONAL: dict[str, tuple[str, ...]] = {
    **{name: _BINARY for name in (
        "lt", "le", "gt", "ge", "eq", "ne", "less", "less_equal", "greater", "greater_equal", "not_equal",
        "logical_and", "logical_or", "logical_xor", "bitwise_and", "bitwise_or", "bitwise_xor", "add", "sub",
        "subtract", "mul", "multiply", "div", "divide", "true_divide", "floor_divide", "remainder", "fmod",
        "maximum", "minimum", "matmul")},
    **{name: ("input", "mat2") for name in ("bmm", "mm")},  # torch names their second operand mat2
    "baddbmm": ("input", "batch1", "batch2"),
    "addmm": ("input", "mat1", "mat2"),
    **{name: ("input",) for name in ("logical_not", "bitwise_not", "abs", "neg", "exp")},
    "where": ("condition", "input", "other"),
    "masked_fill": ("input", "mask", "value"),
    "masked_fill_": ("input", "mask", "value"),
    "transpose": ("input", "dim0", "dim1"),
    "swapaxes": ("input", "axis0", "axis1"),
    "permute": ("input", "dims"),
    "unsqueeze": ("input", "dim"),
    "softmax": ("input", "dim"),
    "tril": ("input", "diagonal"),
    "triu": ("input", "diagonal"),
}
"""Ops whose leading operands the passes read by position (a method's ``self`` is ``input``): model code may
name them (RecBole's ``masked_fill(mask=m, value=v)``, ``torch.lt(input=j, other=n)``,
``torch.where(condition=m, input=s, other=x)``); left named, the matchers raised inside (an internal error) or
lost an operand. Keyword-only arguments (``alpha``, ``rounding_mode``) stay keywords: readers check them by name."""


def positional_arguments(graph: fx.Graph) -> None:
    """Move the named leading operands of the ops in _POSITIONAL into their positional places: the same call.
    A call naming a later operand but not an earlier one is left as written."""
    for node in graph.nodes:
        if node.op == "call_method" and node.target == "where":
            _where_as_function(node)
            continue
        names = _POSITIONAL.get(target_name(node)) if node.op in ("call_function", "call_method") else None
        if not names or not node.kwargs:
            continue
        args, kwargs = list(node.args), dict(node.kwargs)
        for name in names[len(args):]:
            key = "self" if name == "input" and "self" in kwargs else name
            if key not in kwargs:
                break
            args.append(kwargs.pop(key))
        if not any(name in kwargs for name in (*names, "self")):
            node.args, node.kwargs = tuple(args), kwargs


def _where_as_function(node: fx.Node) -> None:
    """``x.where(c, y)`` is ``torch.where(c, x, y)``: written so, every reader of ``where`` reads one order (the
    method form was read as where(x, c, y))."""
    args, kwargs = list(node.args), dict(node.kwargs)
    x = args.pop(0) if args else kwargs.pop("self", None)
    condition = args.pop(0) if args else kwargs.pop("condition", None)
    other = args.pop(0) if args else kwargs.pop("other", None)
    if x is not None and condition is not None and other is not None and not args and not kwargs:
        node.op, node.target = "call_function", torch.where
        node.args, node.kwargs = (condition, x, other), {}


def _same(x):
    return x


SOURCE_META = ("nn_module_stack", "stack_trace", "source_fn_stack", "custom", "from_node")
"""Where a node came from in the user's model: later passes (mxfp8's module patterns, explain's source
lines) read these, so a rewritten copy carries its original's."""


def copy_source_meta(original: fx.Node, copy: fx.Node) -> None:
    for key in SOURCE_META:
        if key in original.meta and key not in copy.meta:
            copy.meta[key] = original.meta[key]


def _may_erase(node: fx.Node) -> bool:
    """Pure ops only: Dynamo graphs may hold in-place methods whose result is unused but whose effect is
    not (``x.add_(1)``), so a graph-wide dead-code pass is unsafe before functionalization."""
    return not node.users and _effect_free(node) and not _draws(node) and not node.is_impure()


def _effect_free(node: fx.Node) -> bool:
    """No in-place write, run-time check or print: its only effect is its value (and random draws)."""
    if node.op not in ("call_function", "call_method"):
        return False
    name = target_name(node)
    if name.endswith("_") and not name.endswith("__") or "out" in node.kwargs or name in IN_PLACE_DUNDERS or \
            node.target in IN_PLACE_OPERATORS or has_inplace_flag(node):  # (F.relu(h, inplace=True) as a statement)
        return False
    return not (name.startswith(("_check", "_constrain", "sym_constrain", "_assert")) or name == "print")


def _draws(node: fx.Node) -> bool:
    """Random draws (erased, the next draws would differ from eager's) FX does not count impure."""
    name = target_name(node)
    return name.startswith("rand") or name in _RANDOM or "dropout" in name


def unused(node: fx.Node, depth: int = 8) -> bool:
    """Whether ``node``'s value reaches neither the output nor an effect: every reader is an effect-free op
    whose value is unused too (a dead dropout of the probabilities an attention rewrite replaced)."""
    if depth == 0 or not _effect_free(node) or _impure_besides_draws(node):
        return False
    return all(unused(user, depth - 1) for user in node.users)


def _impure_besides_draws(node: fx.Node) -> bool:
    try:
        return node.is_impure(impure_random=False)
    except TypeError:  # a torch whose is_impure takes no impure_random: draws count as effects there
        return node.is_impure()


_F = torch.nn.functional
INPLACE_FLAG = {_F.relu: 1, _F.relu6: 1, _F.silu: 1, _F.hardswish: 1, _F.hardsigmoid: 1, _F.selu: 1, _F.mish: 1,
                _F.elu: 2, _F.celu: 2, _F.leaky_relu: 2, _F.hardtanh: 3, _F.threshold: 3, _F.dropout: 3,
                _F.alpha_dropout: 3, _F.dropout1d: 3, _F.dropout2d: 3, _F.rrelu: 4}
"""Functions with an ``inplace`` flag (nn.ReLU(inplace=True) is F.relu(x, inplace=True)): its position."""


def has_inplace_flag(node: fx.Node) -> bool:
    """Whether ``node`` calls a function of INPLACE_FLAG with inplace=True, by keyword or by position."""
    index = INPLACE_FLAG.get(node.target) if node.op == "call_function" else None
    if node.kwargs.get("inplace") is True:
        return True
    return index is not None and len(node.args) > index and node.args[index] is True


def dropout_arguments(args: tuple, kwargs: dict) -> tuple:
    """(x, p, training) of ``F.dropout(x, p=0.5, training=True)`` or ``torch.dropout(x, p, train)``."""
    x = args[0] if args else kwargs.get("input")
    p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
    training = args[2] if len(args) > 2 else kwargs.get("training", kwargs.get("train", True))
    return x, p, training


IN_PLACE_OPERATORS = {operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv,
                      operator.ifloordiv, operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor,
                      operator.ilshift, operator.irshift, operator.imatmul}
"""``x[i] = v``, ``x += y`` on a tensor: Dynamo records operator.setitem / iadd, which update x in place."""
IN_PLACE_DUNDERS = {f"__{op.__name__}__" for op in IN_PLACE_OPERATORS}
"""The same as methods (``x.__iadd__(y)``, ``x.__setitem__(i, v)``)."""

_RANDOM = {"bernoulli", "multinomial", "normal", "poisson", "native_dropout", "rrelu"}
"""Random ops whose names say nothing of it (plus every ``rand*`` and ``*dropout*``)."""


def erase_dead(nodes: list[fx.Node], only=None) -> None:
    """Erase the given nodes and then their inputs, as long as each is pure and has no users left (and
    satisfies ``only``, when given)."""
    work = list(nodes)
    seen: set[fx.Node] = set()
    while work:
        node = work.pop()
        if node in seen or getattr(node, "_erased", False):
            continue
        if not _may_erase(node) or only is not None and not only(node):
            continue
        seen.add(node)
        inputs = list(node.all_input_nodes)
        node.graph.erase_node(node)
        work.extend(inputs)


def drop_dead_tensors(graph: fx.Graph) -> None:
    """Erase the tensors nobody reads, made by pure ops of tensors (and what only they read): Dynamo leaves
    them (BertModel's pooler under a mean-pooling caller), and the passes would count them as readers.
    Only tensor values: Dynamo's vmap bookkeeping (functorch nesting calls) has no users and is not pure."""

    def tensor_op(node: fx.Node) -> bool:
        module = getattr(node.target, "__module__", None) or ""
        return isinstance(example_value(node), torch.Tensor) and \
            not module.startswith(("torch._C._functorch", "torch._functorch"))

    erase_dead([n for n in graph.nodes if not n.users and tensor_op(n)], only=tensor_op)


def fed_by(node: fx.Node, predicate, limit: int = 64) -> bool:
    """Whether a node satisfying ``predicate`` is ``node`` or one of its first ``limit`` producers."""
    seen, todo = set(), [node]
    while todo and len(seen) < limit:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if predicate(n):
            return True
        todo.extend(n.all_input_nodes)
    return False


def _mutates(node: fx.Node) -> bool:
    name = target_name(node)
    return (name.endswith("_") and not name.endswith("__")) or node.is_impure()


def hoist_before(node: fx.Node, anchor: fx.Node, fixed: frozenset | set = frozenset()) -> None:
    """Move ``node`` and the producers it has after ``anchor`` to just before ``anchor``, in their order, so
    that a rewrite at ``anchor`` can read it (a row mask the model computes after the attention). Unproven
    when ``node`` depends on ``anchor`` or on a node of ``fixed`` (which must stay where it is: a packed
    region's members), or when an op between the two may mutate what they read."""
    order = {n: i for i, n in enumerate(anchor.graph.nodes)}
    start = order[anchor]
    if order[node] < start:
        return
    moved, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in moved or order[n] < start:
            continue
        if n is anchor:
            raise Unproven(f"{node.name} depends on the attention's output")
        if n in fixed:
            raise Unproven(f"{node.name} depends on {n.name}, which stays after {anchor.name}")
        moved.add(n)
        todo.extend(n.all_input_nodes)
    between = [n for n in anchor.graph.nodes if start <= order[n] <= order[node]]
    if any(_mutates(n) for n in between):
        raise Unproven(f"{node.name} is computed after the attention, past an in-place op")
    for n in sorted(moved, key=order.__getitem__):
        anchor.prepend(n)


BUFFER_VALUE = "gemcompile_buffer_value"
"""Placeholder meta key: the compile-time value of a small 2-D graph input (a registered mask buffer, or a
mask passed in such as nn.Transformer.generate_square_subsequent_mask(L)); masks/constants.py reads it to
recognize a triangle, which the rewrite then checks on the device at every call."""


def mark_buffer_values(graph: fx.Graph, example_inputs) -> None:
    """Attach the compile-time value of each small 2-D registered buffer (or 2-D behind size-1 dims), and of each
    square float input (an additive causal mask passed in), to its placeholder. Integer and bool inputs stay
    data: their values change from batch to batch, and the data path is exact for any of them."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_inputs):
        return
    for node, value in zip(placeholders, example_inputs):
        if not isinstance(value, torch.Tensor) or isinstance(value, FakeTensor) or value.requires_grad:
            continue
        if value.dim() < 2 or any(n != 1 for n in value.shape[:-2]) or value.numel() > 1 << 24:
            continue  # 2-D, or 2-D behind size-1 dims (GPT-2's and nanoGPT's (1, 1, n, n) causal buffer)
        source = getattr(node.meta.get("grapharg"), "source", None)
        buffer = source is not None and "._buffers[" in source.name
        if buffer or (value.is_floating_point() and value.shape[-2] == value.shape[-1]):
            node.meta[BUFFER_VALUE] = value
