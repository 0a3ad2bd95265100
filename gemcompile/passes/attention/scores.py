"""The score chain of an attention, read backwards: from where the scores are used to ``q @ k^T``.

Every attention the matchers find (attention/match.py) computes scores ``q @ k^T`` (a matmul with a
transposed k, or a 4-D einsum), scales them by constants, adds bias terms, masks them, casts them, and
uses the result against ``v`` (a matmul or an einsum). The helpers here are that shared vocabulary: the op
names, the einsum layouts, and ``walk_to_scores``, the one walk from an anchor back to ``q @ k^T``.
"""

from __future__ import annotations

import operator
import string
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from gemcompile.passes.graph import Unproven, example_value, target_name

MATMUL = ("matmul", "__matmul__", "bmm")
PRODUCTS = (*MATMUL, "einsum", "baddbmm")
"""What q @ k^T may be spelled with (leads_to_matmul)."""
RESHAPES = ("view", "reshape")
NEGATIONS = ("invert", "__invert__", "logical_not", "bitwise_not")
CASTS = ("to", "float", "half", "bfloat16", "double", "type_as", "type", "contiguous", "clone")
SCALE_OPS = {"mul": operator.mul, "__mul__": operator.mul, "__rmul__": operator.mul,
             "truediv": operator.truediv, "div": operator.truediv, "__truediv__": operator.truediv}
MUL = ("mul", "__mul__", "__rmul__")
DIV = ("truediv", "div", "__truediv__")
ADD = ("add", "__add__", "__radd__")
SUB = ("sub", "__sub__")
SCORE_MAPS = ("tanh", "clamp", "clamp_min", "clamp_max", "clip")
"""Non-linear maps of the scores no kernel applies (Gemma 2's soft-capping c * tanh(s / c), clamps): a softmax
over them is still a candidate, so that explain names the map instead of saying nothing."""


def is_call(node: Any, *names: str) -> bool:
    return isinstance(node, fx.Node) and target_name(node) in names


def constant_float(x: Any) -> float | None:
    """x as a float when it is a constant: a Python number, or a 0-d tensor made of one in the graph
    (``torch.tensor(finfo.min)``, DistilBERT's fill)."""
    if isinstance(x, bool):
        return None
    if isinstance(x, (int, float)):
        return float(x)
    if isinstance(x, fx.Node) and x.op == "call_function" and target_name(x) in ("tensor", "scalar_tensor") \
            and x.args and isinstance(x.args[0], (int, float)) and not isinstance(x.args[0], bool):
        return float(x.args[0])
    return None


_VIEWS = ("getitem", "view", "reshape", "select", "transpose", "permute", "unsqueeze", "squeeze")
_LIKE = ("ones_like", "zeros_like", "empty_like", "full_like", "new_ones", "new_zeros", "new_empty",
         "new_full")


def reads_shape_only(user: fx.Node, node: fx.Node, depth: int = 4) -> bool:
    """``mask.expand_as(scores)`` (DistilBERT) reads the scores' shape, not their values;
    ``p.type_as(scores)`` (T5's and LLaMA's softmax in fp32) reads their dtype; ``torch.ones_like(s[0])``
    (gSASRec's causal mask) reads the shape of a view of them."""
    name = target_name(user) if user.op in ("call_function", "call_method") else ""
    if name in ("expand_as", "view_as", "reshape_as", "type_as"):
        return len(user.args) > 1 and user.args[1] is node and user.args[0] is not node
    if name in _LIKE:
        return user.args[0] is node and node not in user.args[1:] and node not in user.kwargs.values()
    if name in _VIEWS and user.args and user.args[0] is node and depth > 0:  # a view only measured
        return bool(user.users) and all(reads_shape_only(u, user, depth - 1) for u in user.users)
    return name in ("size", "sym_size", "dim", "numel", "sym_numel") and user.args[0] is node


def max_shift(user: fx.Node, node: fx.Node) -> list[fx.Node] | None:
    """The nodes of ``node - node.max()`` besides the subtraction, when ``user`` is that max: a maximum of the
    scores over every element or over the keys with keepdim (``s.max()``, ``s.amax(-1, True)``,
    ``s.max(-1, keepdim=True)[0]`` / ``.values``, maybe detached), read only by ``node - max``. It shifts every
    row by a constant (ReChorus' numerically safe softmax): the softmax, and its gradient, do not change."""
    name = target_name(user) if user.op in ("call_function", "call_method") else ""
    if name not in ("max", "amax") or not user.args or user.args[0] is not node:
        return None
    chain, value = [user], user
    while len(value.users) == 1:
        (nxt,) = value.users
        if nxt.target is operator.getitem and nxt.args[1] == 0 or target_name(nxt) in ("detach", "values"):
            chain.append(nxt)
            value = nxt
            continue
        break
    shape = getattr(example_value(value), "shape", None)
    (sub,) = value.users if len(value.users) == 1 else (None,)
    if shape is None or (len(shape) and shape[-1] != 1) or sub is None:
        return None
    if target_name(sub) not in ("sub", "__sub__") or sub.args[:2] != (node, value):
        return None
    return chain


_DEAD_READS = {"detach", "clone", "contiguous", "to", "float", "view", "reshape", "transpose", "permute"}
"""Pure reads whose result nothing uses (Whisper's ``qkv_attention`` returns ``qk.detach()``, which every caller
drops): not a use of the attention's values."""


def single_user(node: fx.Node, site_nodes: list[fx.Node]) -> None:
    """Add ``node`` to the site's nodes; Unproven when something besides the attention uses its values (a
    max of the scores they are shifted by, ``max_shift``, goes with the site)."""
    dead = [u for u in node.users if not u.users and target_name(u) in _DEAD_READS]
    users = [u for u in node.users if not reads_shape_only(u, node) and u not in dead]
    shifts = [chain for chain in (max_shift(u, node) for u in users) if chain is not None]
    if len(users) - len(shifts) != 1:
        raise Unproven(f"{node.name} (part of the attention) is also used elsewhere: "
                       "attention weights that are returned or reused cannot be skipped")
    for chain in shifts:
        site_nodes.extend(reversed(chain))
    site_nodes.append(node)
    site_nodes.extend(dead)  # erased before node


def heads_view(node: fx.Node) -> int | None:
    """H when ``node`` reshapes scores between the merged (B * H, Lq, Lk) and the split (B, H, Lq, Lk) frame
    (fairseq's and DeBERTa's ``w.view(B, H, Lq, Lk)`` around a bmm, and back), else None."""
    if not is_call(node, *RESHAPES) or not isinstance(node.args[0], fx.Node):
        return None
    src, out = example_value(node.args[0]), example_value(node)
    if not isinstance(src, torch.Tensor) or not isinstance(out, torch.Tensor):
        return None
    merged, split = (src, out) if src.dim() == 3 and out.dim() == 4 else (out, src)
    if merged.dim() != 3 or split.dim() != 4 or not isinstance(split.shape[1], int):
        return None
    from torch.fx.experimental.symbolic_shapes import statically_known_true as known

    same = (known(merged.shape[0] == split.shape[0] * split.shape[1])
            and known(merged.shape[1] == split.shape[2]) and known(merged.shape[2] == split.shape[3]))
    return int(split.shape[1]) if same else None


def check_plain_arithmetic(node: fx.Node) -> None:
    """Unproven for ``add`` / ``sub`` with ``alpha=`` (s + alpha * m) and ``div`` with ``rounding_mode=``
    (floor(s / c)): not the sums and scales a score chain is read as."""
    if node.kwargs.get("alpha", 1) != 1 or node.kwargs.get("rounding_mode") is not None:
        raise Unproven(f"{node.name} ({target_name(node)}) with alpha= or rounding_mode= on the scores")


def leads_to_matmul(node: Any, depth: int = 12, through: tuple[str, ...] = ()) -> bool:
    """Whether the scores' q @ k^T is upstream of node through the ops a score chain may hold (and the ops
    named in ``through``)."""
    while isinstance(node, fx.Node) and depth > 0:
        if is_call(node, *PRODUCTS):
            return True
        chain_op = is_call(node, *CASTS, *SCALE_OPS, *ADD, *SUB, "masked_fill", "where", *through)
        if not chain_op and heads_view(node) is None:
            return False
        candidates = [a for a in node.args if isinstance(a, fx.Node)]
        if is_call(node, "where"):
            candidates = candidates[1:]
        if is_call(node, "masked_fill"):
            candidates = candidates[:1]
        if len(candidates) == 1:
            node, depth = candidates[0], depth - 1
            continue
        return any(leads_to_matmul(c, depth - 1, through) for c in candidates)
    return False


# -- einsum ----------------------------------------------------------------------------------------

def _parse_einsum(node: fx.Node) -> tuple[list[str], str, list[fx.Node]]:
    equation, *operands = node.args
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = list(operands[0])
    if not isinstance(equation, str) or "->" not in equation:
        raise Unproven("an einsum without an explicit output")
    lhs, out = equation.replace(" ", "").split("->")
    terms = lhs.split(",")
    if "..." in equation:  # Grok / Phoenix: '...qhd,...khd->...hqk'
        terms, out = _without_ellipsis(terms, out, operands)
    return terms, out, operands


def _without_ellipsis(terms: list[str], out: str, operands: list) -> tuple[list[str], str]:
    """The equation with '...' spelled as letters of its own: the dims it stands for in every operand."""
    counts = {len(example_value(x).shape) - len(t) + 3 for t, x in zip(terms, operands) if "..." in t}
    if len(counts) != 1 or any("." in t.replace("...", "") for t in (*terms, out)):
        raise Unproven("an einsum whose '...' stands for different dims in its operands")
    (count,) = counts
    free = [c for c in string.ascii_letters if c not in "".join(terms) + out][:count]
    spelled = "".join(free)
    return [t.replace("...", spelled) for t in terms], out.replace("...", spelled)


def _perm(src: str, dst: str) -> tuple[int, ...] | None:
    perm = tuple(src.index(c) for c in dst)
    return None if perm == tuple(range(len(dst))) else perm


def scores_einsum(node: fx.Node, site: dict) -> None:
    """q, k and their permutations to (B, H, L, D) from a score einsum ``q.k^T`` over the head dim."""
    (a, b), out, (q, k) = _parse_einsum(node)
    if len(out) != 4 or len(a) != 4 or len(b) != 4:
        raise Unproven("a score einsum that is not 4-D")
    batch, head, qi, kj = out
    (d,) = [c for c in a if c not in out] or [None]
    if d is None or d not in b or set(a) != {batch, head, qi, d} or set(b) != {batch, head, kj, d}:
        raise Unproven(f"the score einsum {a},{b}->{out} is not q.k^T over the head dim")
    site.update(q=q, k=k, q_perm=_perm(a, batch + head + qi + d), k_perm=_perm(b, batch + head + kj + d),
                roles=(batch, head, qi, kj))


def values_einsum(node: fx.Node, probs: fx.Node, site: dict) -> None:
    """v, its permutation to (B, H, L, D) and the output's from an einsum of the weights with v."""
    (a, b), out, (p, v) = _parse_einsum(node)
    if p is not probs or len(a) != 4 or len(b) != 4 or len(out) != 4:
        raise Unproven("the attention weights are not the first operand of a 4-D einsum")
    batch, head, qi, kj = a  # the weights are in the (B, H, Lq, Lk) frame of the scores
    (d,) = [c for c in b if c not in a] or [None]
    if d is None or set(b) != {batch, head, kj, d} or set(out) != {batch, head, qi, d}:
        raise Unproven(f"the value einsum {a},{b}->{out} does not contract the key dim")
    site.update(v=v, v_perm=_perm(b, batch + head + kj + d), out_perm=_perm(batch + head + qi + d, out))


def values(user: fx.Node, weights: fx.Node, info: dict, what: str) -> None:
    """v (and the layouts) when ``user`` is ``weights @ v``; Unproven otherwise."""
    if is_call(user, *MATMUL) and user.args[0] is weights:
        info["v"] = user.args[1]
    elif is_call(user, "einsum"):
        values_einsum(user, weights, info)
    else:
        raise Unproven(f"{what} to `{target_name(user)}`, not to a matmul with the values")


def filled_with(x: Any) -> Any:
    """The constant ``x`` holds everywhere: a Python number, or a tensor made full of one (TF-style
    ``ones_like(s) * (-2 ** 32 + 1)``, ``torch.ones(shape) * c``, ``full_like(s, c)``, ``s.new_full(shape, c)``,
    ``zeros_like(s)``, ``torch.tensor(c)``); None for anything else."""
    if not isinstance(x, fx.Node):
        return x
    if is_call(x, "full_like", "new_full", "full"):
        value = x.args[1] if len(x.args) > 1 and not is_call(x, "new_full") else None
        value = x.kwargs.get("fill_value", x.args[2] if is_call(x, "new_full") and len(x.args) > 2 else value)
        return value if constant_float(value) is not None else None
    if is_call(x, "tensor", "scalar_tensor", "as_tensor") and x.args and not isinstance(x.args[0], fx.Node):
        value = example_value(x)  # ``torch.tensor(-1e9)`` built in forward: a 0-d constant
        return x.args[0] if getattr(value, "ndim", None) == 0 and constant_float(x.args[0]) is not None else None
    if is_call(x, "zeros_like", "new_zeros", "zeros"):
        return 0.0
    if is_call(x, "ones_like", "new_ones", "ones"):
        return 1.0
    if is_call(x, *MUL) and len(x.args) == 2:  # also TiSASRec's ``torch.ones(w.shape) * (-2 ** 32 + 1)``
        a, b = x.args
        one, c = (a, b) if isinstance(a, fx.Node) else (b, a)
        ones = isinstance(one, fx.Node) and is_call(one, "ones_like", "new_ones", "ones")
        if ones and constant_float(c) is not None:
            return c
    return None


# -- the walk back to q @ k^T ----------------------------------------------------------------------

Step = Callable[[fx.Node, list], "fx.Node | None"]


def _scale(node: fx.Node, positive: bool) -> tuple[float, fx.Node]:
    """(factor, the scores' side) of a multiplication or division of the scores by a constant."""
    a, b = node.args[:2]
    divides = SCALE_OPS[target_name(node)] is operator.truediv
    if divides and not isinstance(a, fx.Node):
        raise Unproven("a constant divided by the scores")
    c = constant_float(b) if isinstance(a, fx.Node) else constant_float(a)
    if c is None:
        raise Unproven("the scores are scaled by a tensor or a symbolic value, not a constant")
    if positive and c <= 0:
        raise Unproven("the scores are scaled by a non-positive constant")
    if c == 0:
        raise Unproven("the scores are scaled by 0")
    return (1.0 / c if divides else c), (a if isinstance(a, fx.Node) else b)


def _tensor_factor(node: fx.Node) -> tuple[fx.Node, bool, fx.Node] | None:
    """(the tensor, whether it divides, the scores' side) when ``node`` scales the scores by a tensor that
    is constant along the keys (a learned temperature, a per-head logit scale): q times it gives the same
    scores. None for a constant factor (``_scale`` takes it); Unproven for one that varies along the keys."""
    a, b = node.args[:2]
    divides = SCALE_OPS[target_name(node)] is operator.truediv
    if isinstance(a, fx.Node) and leads_to_matmul(a):
        scores, other = a, b
    elif not divides and isinstance(b, fx.Node) and leads_to_matmul(b):
        scores, other = b, a
    else:
        return None
    if not isinstance(other, fx.Node) or constant_float(other) is not None:
        return None
    value = example_value(other)
    if not isinstance(value, torch.Tensor) or value.dim() > 4 or not value.is_floating_point():
        return None
    if value.dim() and value.shape[-1] != 1:
        raise Unproven(f"the scores are scaled by {other.name}, which varies along the keys (a mask or "
                       "weights, not a scale)")
    return other, divides, scores


def walk_to_scores(node: fx.Node, matched: list[fx.Node], info: dict, step: Step, *, positive: bool,
                   what: str, added: Callable | None = None) -> list[tuple[str, Any]]:
    """Walk from ``node`` back to q @ k^T, recording q, k (and layouts) in ``info``, and return the ops met
    on the way, in backward order: ("scale", factor), ("tensor_scale", (tensor, divides)) for a tensor
    factor constant along the keys (at most one, with no bias or mask applied before it: the families fold
    it into q), and what ``step`` records for the ops it takes (it returns the next node, or None for an op
    it does not take: Unproven, naming ``what`` it is not); ``added`` classifies baddbmm's input (a bias
    when None)."""
    ops: list[tuple[str, Any]] = []
    frames: list[int] = []  # the ndim of the scores each op was applied in: 3 = batch and heads merged
    info["op_frames"] = frames
    tensor_scaled = None
    while True:
        frames.extend([example_value(node).dim()] * (len(ops) - len(frames)))
        single_user(node, matched)
        heads = heads_view(node)
        if heads is not None:  # the scores between (B * H, Lq, Lk) and (B, H, Lq, Lk)
            if info.setdefault("heads", heads) != heads:
                raise Unproven(f"the scores are viewed with {info['heads']} and {heads} heads")
            node = node.args[0]
            continue
        if is_call(node, *MATMUL):
            info.update(q=node.args[0], k=node.args[1], k_is_transposed=True)
            return ops
        if is_call(node, "baddbmm"):  # beta * input + alpha * (q @ kT): Bloom's alibi.baddbmm(q, kT)
            _baddbmm(node, ops, info, added)
            frames.extend([example_value(node).dim()] * (len(ops) - len(frames)))
            return ops
        if is_call(node, "einsum"):
            scores_einsum(node, info)
            return ops
        if is_call(node, *CASTS):
            node = node.args[0]
            continue
        if is_call(node, *SCALE_OPS):
            check_plain_arithmetic(node)
            tensor = _tensor_factor(node)
            if tensor is not None:
                if tensor_scaled is not None:
                    raise Unproven(f"the scores are scaled by two tensors ({tensor_scaled.name}, "
                                   f"{tensor[0].name})")
                tensor_scaled, node = tensor[0], tensor[2]
                ops.append(("tensor_scale", tensor[:2]))
                continue
            factor, node = _scale(node, positive)
            ops.append(("scale", factor))
            continue
        if tensor_scaled is not None:
            raise Unproven(f"`{target_name(node)}` ({node.name}) is applied to the scores before they are "
                           f"scaled by the tensor {tensor_scaled.name}")
        if is_call(node, *SCORE_MAPS):
            raise Unproven(f"`{target_name(node)}` ({node.name}) between the scores and {what}: a non-linear "
                           "map of the scores (soft-capping as c * tanh(s / c), or a clamp), which the "
                           "attention kernels do not apply")
        following = step(node, ops)
        if following is None:
            raise Unproven(f"`{target_name(node)}` ({node.name}) between the scores and {what}")
        frames.extend([example_value(node).dim()] * (len(ops) - len(frames)))
        node = following


def _baddbmm(node: fx.Node, ops: list, info: dict, added: Callable | None) -> None:
    """q, k and the ops of ``baddbmm(input, q, kT, beta=, alpha=)``: input is a bias (times beta) added after
    the product's scale alpha, or, with beta 1, what ``added`` reads it as (a mask, a bias or both)."""
    names = ("input", "batch1", "batch2", "beta", "alpha")
    a = dict(zip(names, node.args))
    a.update(node.kwargs)
    beta, alpha = constant_float(a.get("beta", 1.0)), constant_float(a.get("alpha", 1.0))
    if beta is None or alpha is None:
        raise Unproven("baddbmm with a non-constant beta or alpha")
    if alpha <= 0:
        raise Unproven(f"baddbmm scales the scores by {alpha!r}, not a positive constant")
    if beta == 1 and added is not None:  # CARCA's where(mask, 0, -2 ** 32 + 1) as baddbmm's input
        ops.extend(added(a["input"]))
    elif beta != 0:
        ops.append(("bias", (a["input"], beta)))
    ops.append(("scale", alpha))
    info.update(q=a["batch1"], k=a["batch2"], k_is_transposed=True)


def tensor_factor(ops: list[tuple[str, Any]]) -> tuple[fx.Node, bool] | None:
    """The (tensor, divides) factor of walk_to_scores' ops, if any."""
    return next((arg for kind, arg in ops if kind == "tensor_scale"), None)


def replay(ops: list[tuple[str, Any]]) -> tuple[float, list[tuple[fx.Node, float]], list]:
    """(scale, bias terms with their coefficients, masks) of the ops of walk_to_scores, replayed forward:
    a scale multiplies the bias terms added before it."""
    scale, bias, masks = 1.0, [], []
    for kind, arg in reversed(ops):
        if kind == "tensor_scale":
            continue  # folded into q by the families (tensor_factor): no bias or mask comes before it
        if kind == "scale":
            scale *= arg
            bias = [(term, c * arg) for term, c in bias]
        elif kind == "mask":
            masks.append(arg)
        else:
            bias.append(arg)
    return scale, bias, masks
