"""The peak live bytes of an fx graph, walking its nodes in order (explain's activation-memory peaks).

Each node that produces a tensor allocates a buffer of its storage's bytes; a view (an op whose schema
return aliases an argument: ``view``, ``permute``, ``split``'s list, an in-place op) and any value sharing a
storage already held allocate nothing and keep their base alive; the outputs of a multi-output op are one
buffer each, which ``getitem`` reads. A buffer is freed after the last node that uses it or any of its views,
except the graph's outputs, kept to the end. The peak is taken at each node with its outputs allocated and
its inputs not yet freed. Inputs (placeholders) are counted only when asked (``counted_inputs``: a backward's
saved values and tangents, what the forward left behind); the others (parameters, the batch) are alive
anyway. Unread inputs are dropped at once (AOTAutograd's boxed calls clear their arguments).

An estimate of the graph's own liveness: Inductor fuses, reuses and holds buffers its own way.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Container
from typing import Any

import torch
import torch.fx as fx

from gemcompile.passes.records import LiveValue, PeakMemory


def token_hinted(size: Any) -> int | None:
    """``size`` with the unbacked packed-token counts of unpad's index ops replaced by their hints (the T the
    pass expects, lowering/valid_tokens.py); None when that leaves it symbolic or it has no such count."""
    node = getattr(size, "node", None)
    shape_env = getattr(node, "shape_env", None)
    if shape_env is None:
        return None
    from gemcompile.lowering.valid_tokens import recorded_hints

    hints = recorded_hints(shape_env)
    expr = node.expr
    if not hints or not (expr.free_symbols & hints.keys()):
        return None
    try:
        return int(expr.xreplace(hints))
    except TypeError:  # another symbol is left: no concrete value
        return None


def size_hint(size: Any) -> int:
    """A concrete value for a (possibly symbolic) size, without guarding: the partitioner's own hint, with
    packed-token counts at unpad's hint (token_hinted) where this torch's hint would fall back."""
    if isinstance(size, int):
        return size
    hinted = token_hinted(size)
    if hinted is not None:
        return hinted
    from torch.fx.experimental import symbolic_shapes

    for name in ("optimization_hint", "hint_int"):  # torch 2.13 / older
        hint = getattr(symbolic_shapes, name, None)
        if hint is not None:
            try:
                return int(hint(size, fallback=4096))
            except Exception:  # noqa: BLE001 - an unhinted size: the partitioner's fallback
                break
    return 4096


def storage_key(val: Any) -> Any:
    """A key of the tensor's storage (views share it), or None when it has none to compare."""
    try:  # what the partitioner compares too (torch._inductor.fx_utils.get_node_storage)
        from torch.multiprocessing.reductions import StorageWeakRef

        return StorageWeakRef(val.untyped_storage())
    except Exception:  # noqa: BLE001 - a tensor subclass or no tensor: no aliasing known
        return None


def storage_bytes(val: torch.Tensor) -> int:
    try:
        return size_hint(val.untyped_storage().nbytes())
    except Exception:  # noqa: BLE001 - no storage (a tensor subclass): its own elements
        return size_hint(val.numel()) * val.element_size()


def _aliased_arg(node: fx.Node) -> fx.Node | None:
    """The argument whose storage an op's (first) return aliases, per its schema's alias_info."""
    target = node.target
    schema = getattr(target, "_schema", None)
    if node.op != "call_function" or schema is None or not schema.returns:
        return None
    alias = schema.returns[0].alias_info
    if alias is None:
        return None
    values = dict(zip((a.name for a in schema.arguments), node.args))
    values.update(node.kwargs)
    for arg in schema.arguments:
        if arg.alias_info is not None and set(arg.alias_info.before_set) & set(alias.before_set):
            value = values.get(arg.name)
            return value if isinstance(value, fx.Node) else None
    return node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None


def _op_text(node: fx.Node) -> str:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return str(target).removesuffix(".default")
    return getattr(target, "__name__", str(target))


def _shape(val: torch.Tensor) -> str:
    return "(" + ", ".join(str(s) for s in val.shape) + ("," if val.dim() == 1 else "") + ")"


def _default_nbytes(val: torch.Tensor) -> int:
    return storage_bytes(val)  # the saved-tensor table's sizes


class _Buffer:
    __slots__ = ("name", "op", "val", "kind", "counted", "last", "nbytes")

    def __init__(self, name: str, op: str, val: torch.Tensor, kind: str, counted: bool):
        self.name, self.op, self.val, self.kind, self.counted = name, op, val, kind, counted
        self.last = -1
        self.nbytes = 0


def peak_liveness(graph: fx.Graph, *, counted_inputs: Container[str] = (), top: int = 8,
                  nbytes: Callable[[torch.Tensor], int] | None = None) -> PeakMemory:
    """The peak of ``graph``'s live bytes (module docstring). ``counted_inputs``: names of the placeholders
    whose bytes count (a ``tangents_*`` one as a tangent, any other as saved); ``top``: how many of the
    largest live values to keep; ``nbytes``: a tensor's bytes (default: its storage's, symbolic sizes at
    their hints, as the saved-tensor records size them)."""
    nodes = list(graph.nodes)
    created = _assign_buffers(nodes, counted_inputs)
    peak, peak_node, peak_live = _walk(nodes, created, nbytes or _default_nbytes)
    values = sorted(peak_live.values(), key=lambda b: -b.nbytes)
    split = {kind: sum(b.nbytes for b in values if b.kind == kind)
             for kind in ("saved", "tangent", "produced")}
    return PeakMemory(
        nbytes=max(peak, 0), node=peak_node.name if peak_node is not None else "",
        op=_op_text(peak_node) if peak_node is not None and peak_node.op == "call_function" else "",
        saved_bytes=split["saved"], tangent_bytes=split["tangent"], produced_bytes=split["produced"],
        top=tuple(LiveValue(b.name, b.op, _shape(b.val), str(b.val.dtype).removeprefix("torch."), b.nbytes,
                            b.kind) for b in values[:top]))


def _assign_buffers(nodes: list[fx.Node], counted_inputs: Container[str]) -> dict[fx.Node, list[_Buffer]]:
    """The buffers each node allocates (views and getitems hold their base's), each with the index of the
    last node that uses it (the graph's outputs: len(nodes), kept to the end)."""
    index = {n: i for i, n in enumerate(nodes)}
    held: dict[fx.Node, Any] = {}  # node -> a _Buffer, or a (nested) list of them for a tuple, or None
    by_storage: dict[Any, _Buffer] = {}
    created: dict[fx.Node, list[_Buffer]] = {}  # the buffers a node allocates

    def new(node: fx.Node, val: Any, name: str, op: str, kind: str, counted: bool) -> Any:
        if isinstance(val, (list, tuple)):
            return [new(node, v, f"{name}[{i}]", f"{op}[{i}]", kind, counted) for i, v in enumerate(val)]
        if not isinstance(val, torch.Tensor):
            return None
        key = storage_key(val)
        if key is not None and key in by_storage:  # shares a storage already held: no new bytes
            return by_storage[key]
        buffer = _Buffer(name, op, val, kind, counted)
        if key is not None:
            by_storage[key] = buffer
        created.setdefault(node, []).append(buffer)
        return buffer

    def buffers(value: Any) -> list[_Buffer]:
        if isinstance(value, _Buffer):
            return [value]
        if isinstance(value, list):
            return [b for v in value for b in buffers(v)]
        return []

    for node in nodes:
        val = node.meta.get("val")
        if node.op == "placeholder":
            tangent = "tangents" in str(node.target)
            kind = "tangent" if tangent else "saved"
            held[node] = new(node, val, node.name, kind, kind, node.name in counted_inputs)
        elif node.op == "get_attr":
            held[node] = new(node, val, node.name, "constant", "saved", False)
        elif node.target is operator.getitem and isinstance(node.args[0], fx.Node):
            parent, i = held.get(node.args[0]), node.args[1]
            if isinstance(parent, list) and isinstance(i, int) and -len(parent) <= i < len(parent):
                held[node] = parent[i]
                for b in buffers(parent[i]):
                    if b.name.startswith(f"{node.args[0].name}["):  # the getitem names an output of a tuple
                        b.name = node.name
            else:
                held[node] = buffers(parent)[0] if isinstance(parent, _Buffer) else parent
        elif node.op == "output":
            held[node] = None
        else:
            base = _aliased_arg(node)
            base_held = held.get(base) if base is not None else None
            if isinstance(base_held, _Buffer):  # a view (or a list of views) of one buffer
                held[node] = [base_held] * len(val) if isinstance(val, (list, tuple)) else base_held
            else:
                held[node] = new(node, val, node.name, _op_text(node), "produced", True)
        for b in buffers(held[node]):
            b.last = max(b.last, index[node])
        for arg in node.all_input_nodes:
            for b in buffers(held.get(arg)):
                b.last = max(b.last, index[node])
    end = len(nodes)
    output = next((n for n in reversed(nodes) if n.op == "output"), None)
    if output is not None:
        for arg in output.all_input_nodes:
            for b in buffers(held.get(arg)):
                b.last = end  # kept to the end
    return created


def _walk(nodes: list[fx.Node], created: dict[fx.Node, list[_Buffer]], size: Callable[[torch.Tensor], int]
          ) -> tuple[int, fx.Node | None, dict[int, _Buffer]]:
    """Allocate each node's counted buffers, take the peak, free what a node read last: (peak bytes, the
    node where it is reached, the buffers live there)."""
    dying: dict[int, list[_Buffer]] = {}
    for node_buffers in created.values():
        for b in node_buffers:
            dying.setdefault(b.last, []).append(b)
    live: dict[int, _Buffer] = {}
    current, peak, peak_node, peak_live = 0, -1, None, {}
    for i, node in enumerate(nodes):
        for b in created.get(node, ()):
            if not b.counted:
                continue
            if node.op == "placeholder" and b.last == i:  # unread input: dropped at once
                continue
            b.nbytes = size(b.val)
            live[id(b)] = b
            current += b.nbytes
        if node.op != "placeholder" and current > peak:
            peak, peak_node, peak_live = current, node, dict(live)
        for b in dying.get(i, ()):
            if id(b) in live:
                current -= live.pop(id(b)).nbytes
    if peak_node is None:  # no op at all: the inputs are the peak
        peak, peak_node, peak_live = current, (nodes[-1] if nodes else None), dict(live)
    return peak, peak_node, peak_live
