"""Recognize a rotary position embedding (RoPE) applied to q or k, proven structurally.

RoPE is ``x * cos + rotate(x) * sin`` where ``rotate`` moves and negates elements of the head dim:

- rotate-half (GPT-NeoX, Llama): ``cat((-x[..., D/2:], x[..., :D/2]), -1)``;
- interleaved (GPT-J, the original paper): ``stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2)``.

Rather than enumerate spellings (slices, ``chunk``, ``split``, ``unbind``, ``view(..., D/2, 2)``,
``cat``/``stack``, ``neg`` or ``* -1``, ``x * cos - rotate'(x) * sin`` with the opposite signs...), the
rotation subgraph is interpreted abstractly: every tensor on the way from x to the rotated tensor is a
*signed index map* over the head dim (entry p holds ``sign[p] * x[..., src[p]]``), computed by running
the same ops on small integer tensors. The result must be exactly one of the two conventions' maps (every
slice boundary and every sign checked); anything else is not fused, with the reason.

Only ops that move or negate elements of the trailing dims while keeping the leading (B, H, L) dims are
modeled; a rotation that reads any other tensor, or an op outside that set, is not a rotation.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from gemcompile.passes.graph import NOOP_CASTS, Unproven, example_value, target_name, through_noop_casts

ROTARY_STYLES = ("half", "interleaved")
"""The conventions the block-attention kernel applies (its ``rotary`` argument, besides "none")."""


@dataclass(frozen=True)
class RotaryMatch:
    """``node == x * cos + rotate_<style>(x) * sin``, exactly (up to the order of commutative operands)."""

    node: fx.Node
    x: fx.Node
    cos: fx.Node
    sin: fx.Node
    style: str


_ADD = ("add", "__add__", "__radd__")
_SUB = ("sub", "__sub__")
_MUL = ("mul", "__mul__", "__rmul__")


def rotation_maps(d: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(src, sign) of each convention over a head dim of d (even): rotated[p] = sign[p] * x[src[p]]."""
    half = d // 2
    idx = torch.arange(d)
    src_half = torch.where(idx < half, idx + half, idx - half)
    sign_half = torch.where(idx < half, -1, 1)
    src_inter = idx ^ 1  # 2m <-> 2m + 1
    sign_inter = torch.where(idx % 2 == 0, -1, 1)
    return {"half": (src_half, sign_half), "interleaved": (src_inter, sign_inter)}


# -- the signed-index-map interpreter -----------------------------------------------------------------

@dataclass
class _Moved:
    """The trailing dims of a tensor derived from x: value[..., t] = sign[t] * x[..., src[t]]."""

    src: torch.Tensor
    sign: torch.Tensor


class _RotationInterpreter:
    def __init__(self, x: fx.Node):
        self.x = x
        value = example_value(x)
        self.lead = tuple(value.shape[:-1])
        self.d = value.shape[-1]
        self.memo: dict[fx.Node, Any] = {}

    def _check_lead(self, node: fx.Node) -> tuple[int, ...]:
        """The node keeps x's leading dims; returns its trailing shape."""
        value = example_value(node)
        if not isinstance(value, torch.Tensor):
            raise Unproven(f"{node.name} is not a tensor")
        shape = tuple(value.shape)
        n = len(self.lead)
        if len(shape) <= n or not all(statically_known_true(a == b) for a, b in zip(shape[:n], self.lead)):
            raise Unproven(f"`{target_name(node)}` ({node.name}) changes the leading (batch, head, position) dims")
        tail = shape[n:]
        if not all(isinstance(s, int) for s in tail):
            raise Unproven(f"{node.name} has a symbolic head-dim size")
        return tail

    def _tail_dim(self, dim: Any, ndim: int) -> int:
        if not isinstance(dim, int):
            raise Unproven(f"a non-constant dim {dim!r} in the rotation")
        dim = dim % ndim
        if dim < len(self.lead):
            raise Unproven("the rotation moves elements across the batch, head or position dims")
        return dim - len(self.lead)

    def run(self, node: Any) -> Any:
        if not isinstance(node, fx.Node):
            raise Unproven(f"a constant {node!r} inside the rotation")
        node = through_noop_casts(node)  # (ModernBERT's rotate_half(q.float()) of a float32 q: q itself)
        if node is self.x:
            if not isinstance(self.d, int):
                raise Unproven("a symbolic head dim")
            return _Moved(torch.arange(self.d), torch.ones(self.d, dtype=torch.long))
        if node not in self.memo:
            self.memo[node] = self._run(node)
        return self.memo[node]

    def _tensor(self, node: Any) -> _Moved:
        value = self.run(node)
        if not isinstance(value, _Moved):
            raise Unproven(f"{node.name} is a list of tensors, not a tensor")
        return value

    def _run(self, node: fx.Node) -> Any:
        name = target_name(node)
        if not name:
            raise Unproven(f"the rotation reads {node.name}, not only {self.x.name}")
        args, kwargs = node.args, node.kwargs
        value = example_value(node)
        if isinstance(value, (tuple, list)):  # chunk / split / unbind
            return self._split(node, name)
        tail = self._check_lead(node)
        out = self._op(node, name, args, kwargs)
        if tuple(out.src.shape) != tail:  # our model of the op disagrees with the real shape: not modeled
            raise Unproven(f"`{name}` ({node.name}) is not modeled exactly")
        return out

    def _op(self, node: fx.Node, name: str, args: tuple, kwargs: dict) -> _Moved:
        if node.target is operator.getitem:
            return self._getitem(node, self.run(args[0]), args[1])
        if name in ("neg", "__neg__"):
            m = self._tensor(args[0])
            return _Moved(m.src, -m.sign)
        if name in _MUL:
            a, b = args[:2]
            if isinstance(a, fx.Node) == isinstance(b, fx.Node):
                raise Unproven(f"{node.name} multiplies inside the rotation by something other than -1")
            tensor, factor = (a, b) if isinstance(a, fx.Node) else (b, a)
            if factor not in (-1, 1) or isinstance(factor, bool):
                raise Unproven(f"{node.name} multiplies inside the rotation by {factor!r}, not by -1")
            m = self._tensor(tensor)
            return _Moved(m.src, m.sign * int(factor))
        if name in ("contiguous", "clone"):
            return self._tensor(args[0])
        if name in ("to", "type_as", "float", "half", "bfloat16", "double"):
            if example_value(args[0]).dtype != example_value(node).dtype:
                raise Unproven(f"{node.name} changes the dtype inside the rotation")
            return self._tensor(args[0])
        if name in ("cat", "concat", "concatenate", "stack"):
            tensors = args[0] if args else kwargs["tensors"]
            dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
            parts = [self._tensor(t) for t in tensors]
            out_ndim = example_value(node).dim()
            d = self._tail_dim(dim, out_ndim)
            fn = torch.stack if name == "stack" else torch.cat
            return _Moved(fn([p.src for p in parts], d), fn([p.sign for p in parts], d))
        if name in ("flatten", "reshape", "view", "unflatten", "view_as", "reshape_as"):
            src = self._tensor(args[0])
            if name == "flatten":
                in_ndim = example_value(args[0]).dim()
                start = kwargs.get("start_dim", args[1] if len(args) > 1 else 0)
                self._tail_dim(start, in_ndim)
            elif name == "unflatten":
                in_ndim = example_value(args[0]).dim()
                self._tail_dim(kwargs.get("dim", args[1] if len(args) > 1 else None), in_ndim)
            # leading dims are kept (checked on the output): a row-major reshape of the trailing dims
            tail = tuple(example_value(node).shape[len(self.lead):])
            return _Moved(src.src.reshape(tail), src.sign.reshape(tail))
        raise Unproven(f"`{name}` ({node.name}) in the rotation is not an op that only moves or negates elements")

    def _split(self, node: fx.Node, name: str) -> list[_Moved]:
        args, kwargs = node.args, node.kwargs
        src = self._tensor(args[0])
        in_ndim = example_value(args[0]).dim()
        if name == "chunk":
            chunks = kwargs.get("chunks", args[1] if len(args) > 1 else None)
            d = self._tail_dim(kwargs.get("dim", args[2] if len(args) > 2 else 0), in_ndim)
            return [_Moved(s, g) for s, g in zip(src.src.chunk(chunks, d), src.sign.chunk(chunks, d))]
        if name == "split":
            sizes = kwargs.get("split_size_or_sections", kwargs.get("split_size", args[1] if len(args) > 1 else None))
            d = self._tail_dim(kwargs.get("dim", args[2] if len(args) > 2 else 0), in_ndim)
            if not (isinstance(sizes, int) or (isinstance(sizes, (list, tuple))
                                               and all(isinstance(s, int) for s in sizes))):
                raise Unproven("a split by non-constant sizes in the rotation")
            return [_Moved(s, g) for s, g in zip(src.src.split(sizes, d), src.sign.split(sizes, d))]
        if name == "unbind":
            d = self._tail_dim(kwargs.get("dim", args[1] if len(args) > 1 else 0), in_ndim)
            return [_Moved(s, g) for s, g in zip(src.src.unbind(d), src.sign.unbind(d))]
        raise Unproven(f"`{name}` ({node.name}) in the rotation returns several tensors")

    def _getitem(self, node: fx.Node, base: Any, index: Any) -> _Moved:
        if isinstance(base, list):
            if not isinstance(index, int):
                raise Unproven(f"{node.name} indexes a list of tensors by {index!r}")
            return base[index]
        ndim = len(self.lead) + base.src.dim()
        index = index if isinstance(index, tuple) else (index,)
        if any(i is None or isinstance(i, (fx.Node, bool)) or not isinstance(i, (int, slice, type(Ellipsis)))
               for i in index):
            raise Unproven(f"{node.name} indexes with something other than constant ints and slices")
        if any(isinstance(i, slice) and not all(isinstance(v, (int, type(None))) for v in (i.start, i.stop, i.step))
               for i in index):
            raise Unproven(f"{node.name} slices with non-constant bounds")
        if Ellipsis in index:
            e = index.index(Ellipsis)
            fill = ndim - (len(index) - 1)
            index = index[:e] + (slice(None),) * fill + index[e + 1:]
        index = index + (slice(None),) * (ndim - len(index))
        n = len(self.lead)
        if any(i != slice(None) for i in index[:n]):
            raise Unproven(f"{node.name} indexes the batch, head or position dims")
        rest = index[n:]
        return _Moved(base.src[rest], base.sign[rest])


def _describe(src: torch.Tensor, sign: torch.Tensor, limit: int = 6) -> str:
    items = [f"{'-' if s < 0 else '+'}x[{int(p)}]" for p, s in zip(src.tolist()[:limit], sign.tolist()[:limit])]
    return "[" + ", ".join(items) + (", ...]" if src.numel() > limit else "]")


def rotation_style(x: fx.Node, rotated: fx.Node, sign: int = 1) -> str:
    """"half" or "interleaved" when ``sign * rotated`` is exactly that rotation of x; Unproven otherwise."""
    try:
        moved = _RotationInterpreter(x)._tensor(rotated)
    except (RuntimeError, IndexError, TypeError, ValueError, KeyError) as error:  # an op we model wrongly
        raise Unproven(f"the rotation of {x.name} could not be read: {error}") from None
    d = example_value(x).shape[-1]
    if tuple(moved.src.shape) != (d,):
        raise Unproven(f"{rotated.name} does not have x's head dim")
    if d % 2:
        raise Unproven(f"an odd head dim ({d}) cannot be rotated")
    src, signs = moved.src, moved.sign * sign
    for style, (ref_src, ref_sign) in rotation_maps(d).items():
        if torch.equal(src, ref_src) and torch.equal(signs, ref_sign):
            return style
    raise Unproven(f"the rotation of {x.name} is neither rotate-half [-x[D/2:], x[:D/2]] nor interleaved "
                   f"[-x[1::2], x[::2]]: it computes {_describe(src, signs)}")


def _rotary_or_reason(node: fx.Node) -> bool:
    """Whether ``node`` is a RoPE sum, exact or not (a reason to give rather than none)."""
    try:
        return match_rotary(node) is not None
    except Unproven:
        return True


def _same_shape(a: fx.Node, b: fx.Node) -> bool:
    """Whether two nodes' shapes are provably equal (symbolic sizes too, without adding guards)."""
    sa, sb = example_value(a).shape, example_value(b).shape
    return len(sa) == len(sb) and all(statically_known_true(x == y) for x, y in zip(sa, sb))


def _products(node: Any) -> tuple[Any, Any] | None:
    """(a, b) when node is a * b."""
    if isinstance(node, fx.Node) and target_name(node) in _MUL and len(node.args) >= 2 and not node.kwargs:
        return node.args[0], node.args[1]
    return None


def match_rotary(node: Any) -> RotaryMatch | None:
    """``node = x * cos + rotate(x) * sin`` (or ``x * cos - rotate'(x) * sin``) with rotate one of the two
    conventions: the match; None when node is not a sum of two products (no RoPE at all); Unproven when it
    is one but not an exact RoPE (a wrong sign or split), with the reason."""
    outer, node = node, through_noop_casts(node)  # (``q_embed.to(original_dtype)``, a no-op in that dtype)
    name = target_name(node) if isinstance(node, fx.Node) else ""
    if name in NOOP_CASTS and node.args and isinstance(node.args[0], fx.Node) and _rotary_or_reason(node.args[0]):
        raise Unproven(f"RoPE is computed in {example_value(node.args[0]).dtype} and cast to "
                       f"{example_value(node).dtype} (`{name}`): the kernel rotates in q's dtype")
    if name not in _ADD + _SUB or len(node.args) < 2 or node.kwargs:
        return None  # also add(..., alpha=...): not a plain sum
    terms = [_products(node.args[0]), _products(node.args[1])]
    terms = [t if t is None else tuple(through_noop_casts(a) for a in t) for t in terms]
    if terms[0] is None or terms[1] is None:
        return None
    reasons = []
    orders = [(0, 1)] if name in _SUB else [(0, 1), (1, 0)]  # a - b: the cos term must come first
    for cos_side, sin_side in orders:
        sign = -1 if name in _SUB else 1
        for x, cos in (terms[cos_side], terms[cos_side][::-1]):
            if not isinstance(x, fx.Node) or not isinstance(cos, fx.Node):
                continue
            if not _same_shape(x, node):
                continue  # x has the full (B, H, L, D) shape; cos/sin broadcast onto it
            for rotated, sin in (terms[sin_side], terms[sin_side][::-1]):
                if not isinstance(rotated, fx.Node) or not isinstance(sin, fx.Node):
                    continue
                try:
                    style = rotation_style(x, rotated, sign)
                except Unproven as reason:
                    reasons.append(str(reason))
                    continue
                return RotaryMatch(outer, x, cos, sin, style)
    if not reasons:
        return None
    # the most telling reason: one where the rotation was read completely but is the wrong one
    telling = [r for r in reasons if "neither rotate-half" in r]
    raise Unproven((telling or reasons)[0])


# -- q and k together --------------------------------------------------------------------------------

_NONDETERMINISTIC = ("rand", "dropout", "bernoulli", "normal", "multinomial", "uniform", "exponential",
                     "poisson", "empty")


def same_value(a: Any, b: Any, depth: int = 12) -> bool:
    """Whether two graph values are provably equal: the same node, or the same pure deterministic op applied
    to provably equal arguments (what calling one helper twice, e.g. ``cos.unsqueeze(1)``, produces)."""
    if a is b:
        return True
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y, depth) for x, y in zip(a, b))
    if isinstance(a, fx.Node) != isinstance(b, fx.Node):
        return False
    if not isinstance(a, fx.Node):
        return type(a) is type(b) and a == b
    if depth == 0 or a.op != b.op or a.op not in ("call_function", "call_method") or a.target != b.target:
        return False
    name = target_name(a).lower()
    if any(word in name for word in _NONDETERMINISTIC) or (name.endswith("_") and not name.endswith("__")):
        return False
    if a.is_impure() or set(a.kwargs) != set(b.kwargs):
        return False
    return same_value(a.args, b.args, depth - 1) and all(
        same_value(a.kwargs[k], b.kwargs[k], depth - 1) for k in a.kwargs)


def _mutated(node: fx.Node) -> bool:
    """Whether an in-place op writes node (moving a computation past it could change the result)."""
    for user in node.users:
        name = target_name(user)
        if name.endswith("_") and not name.endswith("__") and user.args and user.args[0] is node:
            return True
    return False


def table_layout(table: fx.Node, x: fx.Node) -> tuple[Any, str]:
    """How to view a cos/sin table broadcast onto x (B, H, L, D) as the kernel's (L, D) or (B, L, D):
    (the index to apply, or None when it is (L, D) already, "L, D" or "B, L, D"). Unproven when it
    varies over heads or does not have one entry per position and head-dim element."""
    t, xv = example_value(table), example_value(x)
    shape = (1,) * (4 - t.dim()) + tuple(t.shape) if 2 <= t.dim() <= 4 else None
    if shape is None or xv.dim() != 4:
        raise Unproven(f"{table.name} of shape {tuple(t.shape)} does not broadcast onto (B, H, L, D)")
    cb, ch, cl, cd = shape
    b, _, length, d = xv.shape
    if not statically_known_true(ch == 1):
        raise Unproven(f"{table.name} varies over heads (the kernel takes one table per position)")
    if not (statically_known_true(cl == length) and statically_known_true(cd == d)):
        raise Unproven(f"{table.name} of shape {tuple(t.shape)} is not one entry per position and head-dim "
                       "element")
    lead = t.dim() - 2  # the table's dims before (L, D)
    if statically_known_true(cb == 1):
        return (None if lead == 0 else (0,) * lead), "L, D"
    if not statically_known_true(cb == b):
        raise Unproven(f"{table.name}'s batch dim is neither 1 nor q's batch")
    return (slice(None), 0), "B, L, D"  # (B, 1, L, D) -> (B, L, D)


def match_rotary_pair(q: fx.Node, k: fx.Node) -> tuple[RotaryMatch, RotaryMatch] | None:
    """RoPE applied to both q and k with the same convention and the same cos and sin, fusable into the
    block-attention kernel: the two matches; None when neither is rotated; Unproven (the reason it is not
    fused) otherwise."""
    qm, km = match_rotary(q), match_rotary(k)
    if qm is None and km is None:
        return None
    if qm is None or km is None:
        raise Unproven(f"only {'k' if qm is None else 'q'} is rotated")
    if qm.style != km.style:
        raise Unproven(f"q is rotated {qm.style}, k {km.style}")
    if not (same_value(qm.cos, km.cos) and same_value(qm.sin, km.sin)):
        raise Unproven("q and k are rotated with different cos/sin tables")
    for m, which in ((qm, "q"), (km, "k")):
        xv = example_value(m.x)
        for table in (m.cos, m.sin):
            tv = example_value(table)
            if tv.requires_grad:
                raise Unproven(f"{table.name} requires grad (the kernel does not differentiate cos/sin)")
            if tv.dtype != xv.dtype:
                raise Unproven(f"{table.name} is {tv.dtype}, {which} is {xv.dtype} (the product would promote)")
            if tv.device != xv.device:
                raise Unproven(f"{table.name} is on {tv.device}, {which} on {xv.device}")
        if example_value(m.node).dtype != xv.dtype:
            raise Unproven(f"the rotated {which} has another dtype than {which}")
        if not _same_shape(m.cos, m.sin):
            raise Unproven("cos and sin have different shapes")
        for n in (m.x, m.cos, m.sin):
            if _mutated(n):
                raise Unproven(f"{n.name} is modified in place")
        table_layout(m.cos, m.x)
    return qm, km
