"""MXFP8 / block-scaled FP8 casts around the GEMMs of Linear-like layers, in the forward AND backward graphs.

Post-grad (``post_grad_custom_pre_pass``): only after AOTAutograd are the backward GEMMs of a layer (dgrad,
wgrad) visible as nodes of their own, so that each can be quantized with its own blocking. Every
``aten.mm`` / ``aten.addmm`` / ``aten.bmm`` gets a decision and a reason (``explain`` lists them all); a
qualifying one becomes ``gemcompile::fp8_mm(a, b, recipe, a_is_weight, b_is_weight, scale_rule)``, which
quantizes both operands along the GEMM's reduction dim K. That single rule gives the blockings the FP8
training recipes use:

    forward  Y  = X  @ W^T    X along K (in_features),  W along K
    dgrad    dX = dY @ W      dY along N (out_features), W along N
    wgrad    dW = dY^T @ X    dY and X along the tokens M

``addmm(bias, a, b)`` becomes ``fp8_mm(a, b) + bias``; ``bmm`` becomes a 3-D ``fp8_mm``. The output keeps
the GEMM's dtype and shape. The quantization itself lives in the op (its one-pass quantize kernel): this
pass does not split it into separate pointwise nodes, so Inductor does not fuse it into the producer.

How a GEMM is identified (what survives into the post-grad graphs on torch 2.13; checked by probing):

* **Parameters.** Dynamo lifts parameters to graph inputs; AOTAutograd records which inputs are static
  (parameters and buffers) in ``TracingContext.fw_metadata.static_input_indices``, available while the
  forward and the (lazily compiled) backward graph are compiled. Forward placeholders carry
  ``meta["desc"] = PlainAOTInput(idx)`` (torch >= 2.9 descriptors; without them, placeholder order), and
  the backward graph's output node carries ``GradAOTOutput(grad_of=PlainAOTInput(idx))`` per output
  (without it, output position = forward input index, AOTAutograd's convention).
* **Role.** Forward graph: an operand that is a parameter up to views, transposes and dtype casts
  (autocast) makes a forward GEMM. Backward graph: an operand that is a parameter placeholder makes a
  dgrad; a GEMM whose result reaches a parameter's gradient output (through views, casts and the adds
  that accumulate a shared weight's gradient) is that parameter's wgrad. Under autocast the backward
  does not see the parameter itself but a saved bf16 copy, so a dgrad is also recognized by pairing: a
  backward GEMM of the same forward op (``meta["seq_nr"]``) as a wgrad that shares the gradient operand
  dY with it has the weight as its other operand; failing that, the backward of ``F.linear`` is
  ``mm(dY, W)`` (``fwd_source_fn_stack``). A GEMM with no weight operand that is no wgrad (attention
  scores, ``p @ v`` and their gradients) is never quantized.
* **Module.** Forward nodes carry ``meta["nn_module_stack"]``; backward nodes carry the forward op's
  stack as ``meta["fwd_nn_module_stack"]`` (both were present on every GEMM of GEM-ref in our probes).
  The innermost entry, normalized to a dotted path (``layers.0.ffn.1.up``), is the GEMM's module. A GEMM
  without one (a function compiled outside any module, or metadata lost) is left alone with the reason
  "source module unknown".
* **Shape gate.** M / K / N are judged as the Linear's tokens / in_features / out_features, mapped back
  from each GEMM (dgrad: K and N swap; wgrad: K is the tokens), so the three GEMMs of one layer share one
  size decision. When the wgrad's orientation cannot be told (a ``matmul`` with a raw parameter, not
  ``F.linear``) both orientations must pass.
* **Softmax.** A GEMM whose output reaches a softmax, or whose operands come from one, within a few
  pointwise/view hops (``source_fn_stack``, or ``fwd_source_fn_stack`` in the backward) is kept: gating
  and attention probabilities stay in high precision.

Known limits: the pass judges each graph on its own (no state crosses from the forward to the backward
graph), so the two can only disagree where their metadata does. A Linear applied to a parameter (PMA's
learned queries) has two backward GEMMs that both take a parameter and both feed a parameter gradient;
the one on dY^T is taken as the wgrad. A frozen Linear (no wgrad) under autocast has its dgrad found only
through ``fwd_source_fn_stack`` (``F.linear``); a frozen raw-parameter ``matmul`` under autocast is
left alone ("no weight operand").
"""

from __future__ import annotations

import fnmatch
import re
from collections import deque
from dataclasses import dataclass
from typing import Any

import sympy
import torch
from torch import fx
from torch._dynamo.utils import counters
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from gemcompile.passes.base import GemPass
from gemcompile.passes.graph import Emitter
from gemcompile.passes.records import describe_nodes

aten = torch.ops.aten
prims = torch.ops.prims

GEMM_OPS = {aten.mm.default: "mm", aten.addmm.default: "addmm", aten.bmm.default: "bmm"}

# ops a weight or a gradient passes through unchanged in value (up to layout and dtype)
_TRANSPARENT = {
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.t.default, aten.permute.default,
    aten.transpose.int, aten.expand.default, aten.clone.default, aten.alias.default, aten.unsqueeze.default,
    aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, prims.convert_element_type.default,
    aten._to_copy.default,
}
# ops crossed when looking for a neighbouring softmax (views and elementwise ops)
_NEAR = _TRANSPARENT | {
    aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar, aten.add.Tensor, aten.sub.Tensor,
    aten.where.self, aten.neg.default, aten.masked_fill.Scalar, aten.masked_fill.Tensor,
}
_SOFTMAX_TARGETS = {aten._softmax.default, aten._softmax_backward_data.default, aten._log_softmax.default,
                    aten._log_softmax_backward_data.default}
_SOFTMAX_HOPS = 4
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_BLOCK = {"mxfp8": 32, "mxfp8_emulated": 32, "blockwise": 128}

ROLES = ("fwd", "dgrad", "wgrad")

# decision kinds: one counter each, counters["gemcompile"]["mxfp8_<kind>"]
QUANTIZED = ("fp8_fwd", "fp8_dgrad", "fp8_wgrad")
KEPT = ("unknown_module", "no_weight_operand", "softmax", "not_included", "excluded", "bf16_weight_grad",
        "below_min_size", "dtype", "unsupported", "op_unavailable")


# -- module names and patterns --------------------------------------------------------------------------

_ROOT = re.compile(r"""^L\[['"][^'"]*['"]\]""")
_GETATTR = re.compile(r"""getattr\((?P<obj>[^,()]+),\s*['"](?P<name>[^'"]+)['"]\)""")


def module_path(key: str) -> str:
    """Dynamo's module key (``L['self'].layers.0.ffn``, ``L['self'].layers[0]``,
    ``getattr(L['self'].layers, '0')``, ``L['self']._modules['layers']``) -> ``layers.0.ffn``."""
    text = key
    while True:
        new = _GETATTR.sub(lambda m: f"{m['obj']}.{m['name']}", text)
        if new == text:
            break
        text = new
    text = _ROOT.sub("", text.strip())
    text = re.sub(r"\._(?:modules|parameters|buffers)\[", "[", text)
    text = re.sub(r"""\[['"]?([^\]'"]+)['"]?\]""", r".\1", text)
    return text.strip(".")


def _class_name(cls: Any) -> str:
    return cls.__name__ if isinstance(cls, type) else str(cls).rsplit(".", 1)[-1].strip("'>")


def node_modules(node: fx.Node, backward: bool) -> list[tuple[str, str]] | None:
    """(dotted path, class name) of the modules around a GEMM's forward call, outermost first."""
    keys = ("fwd_nn_module_stack", "nn_module_stack") if backward else ("nn_module_stack", "fwd_nn_module_stack")
    for key in keys:
        stack = node.meta.get(key)
        if stack:
            return [(module_path(str(path)), _class_name(cls)) for path, cls in stack.values()]
    return None


def match_pattern(patterns: tuple[str, ...], modules: list[tuple[str, str]]) -> str | None:
    """The first pattern that matches a module path (innermost or enclosing) or a class name."""
    names = [n for path, cls in modules for n in (path, cls) if n]
    for pattern in patterns:
        if pattern.startswith("re:"):
            regex = re.compile(pattern[3:], re.IGNORECASE)
            if any(regex.search(n) for n in names):
                return pattern
        elif any(fnmatch.fnmatchcase(n.lower(), pattern.lower()) for n in names):
            return pattern
    return None


# -- graph facts -----------------------------------------------------------------------------------------

def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _hint(size: Any) -> int | None:
    """A size as an int: static sizes as they are, symbolic ones by their hint (a performance gate only:
    never used to prove anything, and no guard is added)."""
    if isinstance(size, int):
        return size
    try:
        hint = size.node.hint
        if hint is None and free_unbacked_symbols(size):  # unpad's packed token count: no hint of its own
            return _unbacked_hint(size)
        if hint is None:
            hint = size.node.shape_env.size_hint(size.node.expr)
        if hint is not None:
            return int(hint)
    except (AttributeError, TypeError, ValueError, RuntimeError):
        pass
    return _unbacked_hint(size)


def _unbacked_hint(size: Any) -> int | None:
    """A data-dependent size (unpad's packed token count): its explicit hint where the shape env keeps one,
    else its upper bound (B * N for packed tokens)."""
    try:
        env, expr = size.node.shape_env, size.node.expr
        overrides = getattr(env, "var_to_hint_override", {}) or {}
        value = sympy.sympify(expr.xreplace({s: overrides[s] for s in expr.free_symbols if s in overrides}))
        if not value.free_symbols:
            return int(value)
        upper = env.bound_sympy(expr).upper
        return int(upper) if upper.is_finite else None
    except (AttributeError, TypeError, ValueError, RuntimeError, KeyError):
        return None


def _divisible(size: Any, block: int) -> bool:
    if isinstance(size, int):
        return size % block == 0
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return bool(statically_known_true(size % block == 0))


def _same_shape(a: Any, b: Any) -> bool:
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return len(a) == len(b) and all(
        x == y if isinstance(x, int) and isinstance(y, int) else bool(statically_known_true(x == y))
        for x, y in zip(a, b))


def _fmt(size: Any) -> str:
    return str(size) if isinstance(size, int) else f"{size}"


def _input_index(desc: Any) -> int | None:
    """The forward input an AOT descriptor names (PlainAOTInput(idx), ParamAOTInput -> -1)."""
    if desc is None:
        return None
    idx = getattr(desc, "idx", None)
    if isinstance(idx, int):
        return idx
    if type(desc).__name__ == "ParamAOTInput":
        return -1
    return None


def _static_inputs() -> frozenset[int] | None:
    """Forward inputs that are parameters or buffers (AOTAutograd's static inputs) for this compile."""
    try:
        from torch._guards import TracingContext

        context = TracingContext.try_get()
        metadata = getattr(context, "fw_metadata", None) if context is not None else None
        indices = getattr(metadata, "static_input_indices", None)
    except (ImportError, AttributeError, RuntimeError):
        return None
    return None if indices is None else frozenset(indices)


class GraphFacts:
    """What one post-grad graph says about parameters: which placeholders are parameters and which outputs
    are parameter gradients."""

    def __init__(self, graph: fx.Graph):
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        output = next(n for n in reversed(graph.nodes) if n.op == "output")
        self.backward = any(n.name.startswith("tangents") for n in placeholders) or any(
            type(d).__name__ == "GradAOTOutput" for d in (output.meta.get("desc") or ()))
        self.static = _static_inputs()
        param = (lambda i: i == -1 or (self.static is not None and i in self.static))
        self.param_placeholders: set[fx.Node] = set()
        for position, node in enumerate(placeholders):
            idx = _input_index(node.meta.get("desc"))
            if idx is None and not self.backward and node.name.startswith(("primals_", "arg")):
                idx = position  # forward graph without descriptors: placeholders are the inputs in order
            if idx is not None and param(idx):
                self.param_placeholders.add(node)
        # backward: output -> the forward input it is the gradient of
        self.param_grads: set[fx.Node] = set()
        if self.backward:
            values = output.args[0] if isinstance(output.args[0], (list, tuple)) else (output.args[0],)
            descs = output.meta.get("desc")
            for position, value in enumerate(values):
                if not isinstance(value, fx.Node):
                    continue
                desc = descs[position] if isinstance(descs, (list, tuple)) and position < len(descs) else None
                idx = _input_index(getattr(desc, "grad_of", None)) if desc is not None else position
                if idx is not None and param(idx):
                    self.param_grads.add(value)

    @property
    def knows_parameters(self) -> bool:
        return self.static is not None or bool(self.param_placeholders)


def root(node: Any) -> Any:
    """Strip views, transposes, copies and dtype casts."""
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target in _TRANSPARENT:
        node = node.args[0]
    return node


def _transposed(node: Any) -> bool:
    """Whether a transpose (t, permute of the last two dims, transpose) lies on the view chain of node."""
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target in _TRANSPARENT:
        if node.target in (aten.t.default, aten.transpose.int):
            return True
        if node.target is aten.permute.default:
            perm = list(node.args[1])
            if len(perm) >= 2 and perm[-2:] == [len(perm) - 1, len(perm) - 2]:
                return True
        node = node.args[0]
    return False


def reaches_param_grad(node: fx.Node, facts: GraphFacts) -> bool:
    """Whether the value flows (through views, casts and gradient accumulation) into a parameter gradient."""
    seen, work = set(), deque([(node, 0)])
    while work:
        n, depth = work.popleft()
        if n in facts.param_grads:
            return True
        if depth >= 8:
            continue
        for user in n.users:
            if user not in seen and user.op == "call_function" and (
                    user.target in _TRANSPARENT or user.target is aten.add.Tensor):
                seen.add(user)
                work.append((user, depth + 1))
    return False


def _is_softmax(node: fx.Node) -> bool:
    if node.target in _SOFTMAX_TARGETS:
        return True
    for key in ("source_fn_stack", "fwd_source_fn_stack"):
        stack = node.meta.get(key)
        if stack:
            name, fn = stack[-1]
            if "softmax" in str(name).lower() or "softmax" in getattr(fn, "__name__", str(fn)).lower():
                return True
    return False


def near_softmax(gemm: fx.Node) -> str | None:
    """'feeds a softmax' / 'is fed by a softmax' when one is a few view/pointwise hops away."""
    def search(start: list[fx.Node], forward: bool) -> bool:
        seen, work = set(start), deque((n, 1) for n in start)
        while work:
            n, depth = work.popleft()
            if not isinstance(n, fx.Node) or n.op != "call_function":
                continue
            if _is_softmax(n):
                return True
            if n.target not in _NEAR or depth >= _SOFTMAX_HOPS:
                continue
            for nxt in (n.users if forward else n.all_input_nodes):
                if nxt not in seen:
                    seen.add(nxt)
                    work.append((nxt, depth + 1))
        return False

    if search(list(gemm.users), forward=True):
        return "its output feeds a softmax"
    if search([a for a in gemm.args[-2:] if isinstance(a, fx.Node)], forward=False):
        return "an operand comes from a softmax"
    return None


# -- one GEMM --------------------------------------------------------------------------------------------

@dataclass
class Gemm:
    """One GEMM of a post-grad graph and what the pass decided for it."""

    node: fx.Node
    op: str
    a: fx.Node
    b: fx.Node
    bias: Any = None
    role: str | None = None
    a_is_weight: bool = False
    b_is_weight: bool = False
    modules: list[tuple[str, str]] | None = None
    m: Any = None
    k: Any = None
    n: Any = None
    batch: Any = None
    wgrad_dy: str | None = None
    """Which operand of a wgrad holds dY: "a" (F.linear's dW = dY^T @ X, M = out_features), "b"
    (matmul's dW = X^T @ dY, M = in_features), None when unknown."""

    @property
    def module(self) -> str:
        if not self.modules:
            return "?"
        path, _ = self.modules[-1]
        return path or "<root>"

    @property
    def module_class(self) -> str:
        return self.modules[-1][1] if self.modules else "?"

    def facts(self) -> dict[str, str]:
        """What explain reports of this GEMM as metrics (decisions() reads them back)."""
        return {"role": self.role or "gemm", "module": self.module, "module_class": self.module_class,
                "m": _fmt(self.m), "k": _fmt(self.k), "n": _fmt(self.n)}

    def header(self) -> str:
        batch = f" batch={_fmt(self.batch)}" if self.batch is not None else ""
        return (f"{self.role or 'gemm'} {self.module} ({self.module_class}) "
                f"M={_fmt(self.m)} K={_fmt(self.k)} N={_fmt(self.n)}{batch}")

    def layer_shape(self) -> list[tuple[Any, Any, Any]]:
        """(tokens, in_features, out_features) of the layer, one tuple per possible orientation."""
        m, k, n = self.m, self.k, self.n
        if self.role == "fwd":
            return [(n, k, m)] if self.a_is_weight and not self.b_is_weight else [(m, k, n)]
        if self.role == "dgrad":
            return [(n, m, k)] if self.a_is_weight and not self.b_is_weight else [(m, n, k)]
        if self.wgrad_dy == "a":  # dW = dY^T @ X: M = out_features
            return [(k, n, m)]
        if self.wgrad_dy == "b":  # dW = X^T @ dY: M = in_features
            return [(k, m, n)]
        return [(k, n, m), (k, m, n)]


def _is_linear_source(node: fx.Node) -> bool:
    """Whether the GEMM comes from F.linear / nn.Linear (source_fn_stack, fwd_source_fn_stack backward)."""
    for key in ("fwd_source_fn_stack", "source_fn_stack"):
        stack = node.meta.get(key)
        if stack:
            name, fn = stack[-1]
            return "linear" in getattr(fn, "__name__", str(fn)).lower() or str(name).startswith("linear")
    return False


class Mxfp8Pass(GemPass):
    """Quantizes the forward, dgrad and wgrad GEMMs of qualifying Linear-like layers (see the module doc)."""

    name = "mxfp8"
    stage = "post_grad"
    config_section = "mxfp8"

    def run(self, graph: fx.Graph) -> None:
        gemms = [n for n in graph.nodes if n.op == "call_function" and n.target in GEMM_OPS]
        if not gemms:
            return
        op = _fp8_mm_op()
        facts = GraphFacts(graph)
        sites = [self._site(n) for n in gemms]
        self._roles(sites, facts)
        for site in sites:
            kind, reason = self._decide(site, facts, op is not None)
            if kind in QUANTIZED:
                kind, reason = self._rewrite(graph, site, op)
            counters["gemcompile"][f"mxfp8_{kind}"] += 1
            if kind not in QUANTIZED:
                self.refused(site.node, f"{site.header()}: {reason}", metrics=site.facts() | {"reason": reason})

    # -- analysis ----------------------------------------------------------------------------------------
    @staticmethod
    def _site(node: fx.Node) -> Gemm:
        op = GEMM_OPS[node.target]
        if op == "addmm":
            bias, a, b = node.args[:3]
        else:
            (a, b), bias = node.args[:2], None
        site = Gemm(node, op, a, b, bias)
        va, vb = _val(a), _val(b)
        if va is not None and vb is not None:
            site.m, site.k, site.n = va.shape[-2], va.shape[-1], vb.shape[-1]
            if op == "bmm":
                site.batch = va.shape[0]
        return site

    @staticmethod
    def _roles(sites: list[Gemm], facts: GraphFacts) -> None:
        for site in sites:
            site.modules = node_modules(site.node, facts.backward)
            site.a_is_weight = root(site.a) in facts.param_placeholders
            site.b_is_weight = root(site.b) in facts.param_placeholders
            if not facts.backward:
                site.role = "fwd" if (site.a_is_weight or site.b_is_weight) else None
            elif site.a_is_weight or site.b_is_weight:
                site.role = "dgrad"
                # F.linear applied to a parameter (PMA's learned queries): both backward GEMMs have a
                # parameter operand and feed a parameter gradient; the wgrad is the one on dY^T
                if (_is_linear_source(site.node) and _transposed(site.a) and site.b_is_weight
                        and reaches_param_grad(site.node, facts)):
                    site.role, site.b_is_weight, site.wgrad_dy = "wgrad", False, "a"
            elif reaches_param_grad(site.node, facts):
                site.role = "wgrad"
                site.wgrad_dy = "a" if _is_linear_source(site.node) else None
        if not facts.backward:
            return
        # F.linear applied to a parameter under autocast: two "wgrads" of one forward op (both outputs are
        # parameter gradients); the one that is not on dY^T is the dgrad of the parameter input
        for site in sites:
            seq = site.node.meta.get("seq_nr")
            if (site.role == "wgrad" and seq is not None and _is_linear_source(site.node) and not _transposed(site.a)
                    and any(o.role == "wgrad" and o is not site and o.node.meta.get("seq_nr") == seq
                            and _transposed(o.a) and root(o.a) == root(site.a) for o in sites)):
                site.role, site.b_is_weight = "dgrad", True
        # dgrad whose weight is a saved copy (autocast): paired with the wgrad of the same forward op
        wgrads = [s for s in sites if s.role == "wgrad"]
        for site in sites:
            if site.role is not None:
                continue
            seq = site.node.meta.get("seq_nr")
            mine = {root(site.a): "a", root(site.b): "b"}
            for w in wgrads:
                if seq is not None and w.node.meta.get("seq_nr") != seq:
                    continue
                shared = [side for r, side in mine.items() if r in (root(w.a), root(w.b))]
                if len(shared) == 1 and len(mine) == 2:
                    site.role = "dgrad"
                    site.a_is_weight, site.b_is_weight = shared[0] == "b", shared[0] == "a"
                    if w.wgrad_dy is None:  # the shared operand is dY: it tells the wgrad's orientation
                        w.wgrad_dy = "a" if root(w.a) == root(site.a if shared[0] == "a" else site.b) else "b"
                    break
            if site.role is None and site.op == "mm" and _is_linear_source(site.node) and not any(
                    seq is not None and w.node.meta.get("seq_nr") == seq and w.node is not site.node
                    and root(site.a) in (root(w.a), root(w.b)) and root(site.b) in (root(w.a), root(w.b))
                    for w in wgrads):
                site.role, site.b_is_weight = "dgrad", True  # F.linear's backward: dX = mm(dY, W)

    def _decide(self, site: Gemm, facts: GraphFacts, have_op: bool) -> tuple[str, str]:
        cfg = self.options
        va, vb = _val(site.a), _val(site.b)
        if va is None or vb is None or _val(site.node) is None:
            return "unsupported", "kept: no shape information on the operands"
        if va.dtype not in _FLOAT_DTYPES or vb.dtype != va.dtype:
            return "dtype", f"kept: dtype {va.dtype} x {vb.dtype} (quantizes float32/bfloat16/float16 only)"
        if not site.modules:
            return "unknown_module", ("kept: source module unknown (no nn_module_stack metadata: a plain function, "
                                      "or code in the compiled module's own forward; move it into a submodule)")
        if site.role is None:
            if not facts.knows_parameters:
                return "no_weight_operand", ("kept: cannot tell parameters in this graph (no AOTAutograd "
                                             "static-input metadata)")
            return "no_weight_operand", ("kept: no weight operand (a GEMM of two activations: attention "
                                         "scores, p @ v or their gradients)")
        near = near_softmax(site.node)
        if near is not None:
            return "softmax", f"kept: {near} (softmax and gating stay in high precision)"
        modules = site.modules
        if match_pattern(cfg.include, modules) is None:
            return "not_included", f"kept: module matches no include pattern {cfg.include}"
        pattern = match_pattern(cfg.exclude, modules)
        if pattern is not None:
            return "excluded", f"kept: module excluded by pattern {pattern!r}"
        if site.role == "wgrad":
            pattern = match_pattern(cfg.bf16_weight_grad, modules)
            if pattern is not None:
                return "bf16_weight_grad", f"kept: weight gradient stays high precision (bf16_weight_grad {pattern!r})"
        small = self._below_min(site)
        if small is not None:
            return "below_min_size", f"kept: {small}"
        if cfg.recipe == "blockwise" and site.a_is_weight and site.b_is_weight:
            return "unsupported", ("kept: both operands are weights (blockwise would need a 128x128 x 128x128 "
                                   "GEMM, which cuBLAS does not offer)")
        if site.op == "addmm" and (site.node.kwargs.get("beta", 1) != 1 or site.node.kwargs.get("alpha", 1) != 1):
            return "unsupported", "kept: addmm with alpha or beta != 1"
        if not have_op:
            return "op_unavailable", "kept: gemcompile::fp8_mm is not available (gemcompile.lowering.fp8.scaled_mm)"
        return f"fp8_{site.role}", ""

    def _below_min(self, site: Gemm) -> str | None:
        """Why the layer is too small, or None; with two possible orientations both must pass."""
        cfg = self.options
        reasons = []
        for shape in site.layer_shape():
            why = []
            for value, minimum, what, knob in zip(shape, (cfg.min_m, cfg.min_k, cfg.min_n),
                                                  ("tokens M", "in_features K", "out_features N"),
                                                  ("min_m", "min_k", "min_n")):
                hint = _hint(value)
                if hint is None:
                    why.append(f"layer {what} = {_fmt(value)} has no size hint")
                elif hint < minimum:
                    why.append(f"layer {what} = {hint} < {knob} = {minimum}")
            if why:
                reasons.append(", ".join(why))
        if not reasons:
            return None
        return "; ".join(dict.fromkeys(reasons)) + " (narrow layers lose to bf16)"

    # -- rewrite -----------------------------------------------------------------------------------------
    def _rewrite(self, graph: fx.Graph, site: Gemm, op: Any) -> tuple[str, str]:
        """Replace the GEMM by fp8_mm (+ bias); returns the decision kind (and a reason if it could not)."""
        cfg = self.options
        node = site.node
        before = describe_nodes([node])
        args = (site.a, site.b, cfg.recipe, site.a_is_weight, site.b_is_weight, cfg.scale_rule)
        emit = Emitter(graph, value_key="val")
        with graph.inserting_before(node):
            out = emit.call(op, args)
            if site.op == "addmm":
                out = emit.call(aten.add.Tensor, (out, site.bias))
        expected = _val(node)
        got = out.meta["val"]
        if not _same_shape(got.shape, expected.shape) or got.dtype != expected.dtype:
            emit.rollback()
            return "unsupported", (f"kept: fp8_mm would give {got.dtype} {tuple(got.shape)}, the GEMM gives "
                                   f"{expected.dtype} {tuple(expected.shape)}")
        for new in emit.created:
            _inherit_meta(node, new)
        node.replace_all_uses_with(out)
        after = describe_nodes(emit.created)
        weight = " and ".join(x for x, w in (("a", site.a_is_weight), ("b", site.b_is_weight)) if w) or "none"
        block = _BLOCK[cfg.recipe]
        padded = "" if _divisible(site.k, block) else f", K zero-padded to a multiple of {block} for the blocks"
        how = f"fp8 {cfg.recipe} ({cfg.scale_rule}), both operands along K, weight operand: {weight}{padded}"
        self.rewrote(out, before, after, detail=f"{site.header()}: {how}", metrics=site.facts() | {"reason": how})
        graph.erase_node(node)
        return f"fp8_{site.role}", ""


def _inherit_meta(source: fx.Node, target: fx.Node) -> None:
    """The replaced GEMM's metadata (stack trace, source fn, ...) on a new node, with the new node's own value."""
    from torch.fx.passes.shape_prop import _extract_tensor_metadata

    for key, value in source.meta.items():
        if key not in ("val", "tensor_meta", "original_aten"):
            target.meta[key] = value
    target.meta["tensor_meta"] = _extract_tensor_metadata(target.meta["val"])


def _fp8_mm_op() -> Any:
    """torch.ops.gemcompile.fp8_mm.default, registered by gemcompile.lowering.fp8.scaled_mm; None if missing."""
    try:
        import gemcompile.lowering.fp8.scaled_mm  # noqa: F401  (registers the op)
    except ImportError:
        pass
    try:
        return torch.ops.gemcompile.fp8_mm.default
    except (AttributeError, RuntimeError):
        return None


# -- reading decisions back (tests, benchmarks) -------------------------------------------------------------


@dataclass(frozen=True)
class GemmDecision:
    """One GEMM as explain reports it."""

    role: str
    """"fwd", "dgrad", "wgrad", or "gemm" when the GEMM belongs to no Linear-like layer."""
    module: str
    module_class: str
    m: str
    k: str
    n: str
    quantized: bool
    reason: str
    """Why it was kept in high precision (empty when quantized), or the recipe it was quantized with."""


def decisions(report: Any) -> list[GemmDecision]:
    """Every GEMM the mxfp8 pass judged, from an ExplainReport (or anything with rewrites / refusals)."""
    return [GemmDecision(m["role"], m["module"], m["module_class"], m["m"], m["k"], m["n"], quantized, m["reason"])
            for records, quantized in ((report.rewrites, True), (report.refusals, False))
            for m in (r.metrics for r in records if r.pass_name == Mxfp8Pass.name)]
