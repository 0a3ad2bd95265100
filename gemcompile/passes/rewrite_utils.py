"""Small tools for passes that insert nodes into a Dynamo graph and remove what they replaced."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_map

from gemcompile.passes.mask_provenance import Unproven, example_value


class FakeRunner:
    """Inserts call_function nodes with ``meta["example_value"]`` computed on fake tensors, so later
    passes (ours and Inductor's pre-grad passes) see shapes on new nodes as on Dynamo's."""

    def __init__(self, graph: fx.Graph):
        self.graph = graph
        self.created: list[fx.Node] = []

    def rollback(self, mark: int) -> None:
        """Erase the nodes created since ``len(self.created) == mark`` (a rewrite that was abandoned)."""
        for node in reversed(self.created[mark:]):
            if not node.users:
                node.graph.erase_node(node)
        del self.created[mark:]

    def call(self, graph: fx.Graph, target, args: tuple, kwargs: dict | None = None) -> fx.Node:
        kwargs = kwargs or {}
        node = graph.call_function(target, args, kwargs)
        self.created.append(node)
        to_value = lambda a: example_value(a) if isinstance(a, fx.Node) else a  # noqa: E731
        fake_args, fake_kwargs = tree_map(to_value, args), tree_map(to_value, kwargs)
        # the mode the example values live in (the tracing context may hold another one)
        mode = next((a.fake_mode for a in (*fake_args, *fake_kwargs.values()) if isinstance(a, FakeTensor)), None)
        if mode is not None:
            with mode:
                node.meta["example_value"] = target(*fake_args, **fake_kwargs)
        return node


def _may_erase(node: fx.Node) -> bool:
    """Pure ops only: Dynamo graphs may hold in-place methods whose result is unused but whose effect is
    not (``x.add_(1)``), so a graph-wide dead-code pass is unsafe before functionalization."""
    if node.op not in ("call_function", "call_method") or node.users:
        return False
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    if name.endswith("_") and not name.endswith("__"):
        return False
    return not node.is_impure()


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


def erase_dead(nodes: list[fx.Node]) -> None:
    """Erase the given nodes and then their inputs, as long as each is pure and has no users left."""
    work = list(nodes)
    seen: set[fx.Node] = set()
    while work:
        node = work.pop()
        if node in seen or getattr(node, "_erased", False):
            continue
        if not _may_erase(node):
            continue
        seen.add(node)
        inputs = [a for a in node.all_input_nodes]
        node.graph.erase_node(node)
        work.extend(inputs)


# -- what the attention rewrites emit ----------------------------------------------------------------

def size_of(graph: fx.Graph, fake: FakeRunner, node: fx.Node, dim: int):
    """A dim's size: the int when static, a sym_size node when dynamic (a SymInt cannot be a constant)."""
    size = example_value(node).shape[dim]
    return size if isinstance(size, int) else fake.call(graph, torch.ops.aten.sym_size.int, (node, dim))


def clamped_lengths(graph: fx.Graph, fake: FakeRunner, node: fx.Node, offset: int, padded) -> fx.Node:
    """lengths + offset, clamped to [0, padded]: exactly what `arange(padded) < lengths + offset` keeps
    (a length past the padded size keeps every position, a negative one none)."""
    if offset != 0:
        node = fake.call(graph, operator.add, (node, offset))
    return fake.call(graph, torch.clamp, (node, 0, padded))


def summed_bias(graph: fx.Graph, fake: FakeRunner, terms: list[tuple[fx.Node, float]]) -> fx.Node | None:
    """sum(coefficient * term) as one 4-D node (leading dims of size 1 added), or None without terms."""
    total = None
    for node, coefficient in terms:
        term = node if coefficient == 1.0 else fake.call(graph, operator.mul, (node, coefficient))
        total = term if total is None else fake.call(graph, operator.add, (total, term))
    if total is None:
        return None
    while example_value(total).dim() < 4:
        total = fake.call(graph, torch.unsqueeze, (total, 0))
    if example_value(total).dim() > 4:
        raise Unproven("an additive bias with more than 4 dims")
    return total


def permuted(graph: fx.Graph, fake: FakeRunner, node: fx.Node, perm) -> fx.Node:
    return node if perm is None else fake.call(graph, torch.permute, (node, perm))


def check_qkv(q, k, v, head_dims: tuple[int, int]) -> None:
    """q (B|1, H, Lq, D), k and v (B, H, Lk, D) of one floating dtype and device, D within head_dims."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true as known

    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise Unproven(f"q, k, v must be 4-D (B, H, L, D); got {q.dim()}-D, {k.dim()}-D, {v.dim()}-D")
    if not (q.dtype == k.dtype == v.dtype) or not q.dtype.is_floating_point:
        raise Unproven(f"q, k, v dtypes differ or are not floating ({q.dtype}, {k.dtype}, {v.dtype})")
    if not (q.device == k.device == v.device):
        raise Unproven(f"q, k, v are on different devices ({q.device}, {k.device}, {v.device})")
    if not (known(q.shape[-1] == k.shape[-1]) and known(k.shape[-1] == v.shape[-1])):
        raise Unproven("q, k and v head dims differ (the kernel needs one head dim)")
    if not (known(k.shape[0] == v.shape[0]) and known(k.shape[2] == v.shape[2])):
        raise Unproven("k and v disagree on batch or length")
    if not (known(q.shape[0] == k.shape[0]) or known(q.shape[0] == 1)):
        raise Unproven("q's batch is neither k's nor 1")
    if not (known(q.shape[1] == k.shape[1]) and known(k.shape[1] == v.shape[1])):
        raise Unproven("q, k and v have different head counts (grouped-query attention is not served)")
    lo, hi = head_dims
    if not isinstance(q.shape[-1], int) or not lo <= q.shape[-1] <= hi:
        raise Unproven(f"head dim {q.shape[-1]} is outside what the kernel serves ({lo}..{hi})")


def site_keep_predicate(evaluator, site):
    """The condition under which an attention site (attention_match.AttentionSite) keeps the score
    (b, h, i, j): every mask term of the site, and SDPA's is_causal, evaluated with ``evaluator``
    (a mask_provenance.MaskEvaluator) into one formula over the scores' index symbols."""
    import sympy

    from gemcompile.passes.mask_provenance import index_symbol, keep_predicate

    keep = sympy.true
    for term in site.masks:
        value = evaluator.tensor(term.node)
        if term.dims:
            value = evaluator.relabel(value, term.dims, 4)
        pred = keep_predicate(evaluator, value, "additive" if term.kind == "additive" else "bool")
        keep = sympy.And(keep, sympy.Not(pred) if term.kind == "drop" else pred)
    if site.causal_flag:
        keep = sympy.And(keep, evaluator.atoms.compare("le", index_symbol(0), index_symbol(1)))
    if 0 < len(keep.free_symbols) <= 8:  # exponential in the atoms: simplify small formulas only
        keep = sympy.simplify_logic(keep, force=True)
    return keep
