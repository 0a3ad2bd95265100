"""Token rows transposed to (B, F, N) for a Conv1d or a BatchNorm1d, written back as the (B, N, F) rows they are.

Sequential recommenders run their FFN as kernel-1 convolutions over transposed tokens (SASRec's
PointWiseFeedForward: ``conv2(relu(conv1(x.transpose(-1, -2)))).transpose(-1, -2)``), and DIN's Dice
activation normalizes the scores' hidden features with a BatchNorm1d over (B, F, N). On the (B, N, F) rows:

- a Conv1d with kernel 1 (stride 1, no padding, one group) is ``linear(x, weight[:, :, 0], bias)``;
- a batch norm in eval mode (running statistics) is the per-feature ``(x - mean) * rsqrt(var + eps) * w + b``;
- an elementwise op is itself, its other operands transposed the same way (Dice's (F, 1) alpha is (1, F));
- a softmax over the features (dim 1) is a softmax over the last dim.

Those ops are moved onto the rows (unpad_row_chains.py), and the transpose back reads the result. A batch
norm in training (its statistics read every token, padded ones included), a wider convolution, and
reductions or softmax over the tokens end the chain there, as they must, and explain names them.
"""

from __future__ import annotations

import torch
from torch import fx

from gemcompile.passes.graph import Emitter, permutation, target_name
from gemcompile.passes.token_wise import ELEMENTWISE, SOFTMAX, dtype_of, has_rows, node_argument, \
    same_size, shape_of
from gemcompile.passes.unpad_row_chains import RowLayout, move_chains


def _swaps_last_two(node: fx.Node) -> bool:
    """``x.transpose(1, 2)``, ``x.transpose(-1, -2)``, ``x.permute(0, 2, 1)`` of a 3-D x."""
    return permutation(node) == [0, 2, 1]


def _transposed(node: fx.Node, row_dims: list[tuple]) -> fx.Node | None:
    """x when ``node`` transposes a (B, N, F) float tensor x of ``row_dims`` to (B, F, N), F > 1 (one score per
    token transposed to (B, 1, N) is DIN's row of scores, which the fills and contractions read as it is)."""
    if not _swaps_last_two(node):
        return None
    x = node.args[0]
    dtype = dtype_of(x)
    if dtype is None or not dtype.is_floating_point or not any(has_rows(shape_of(x), b, n) for b, n in row_dims):
        return None
    return None if same_size(shape_of(x)[2], 1) else x


def _operand(emit: Emitter, a, rows: dict) -> fx.Node | object:
    """An operand of an elementwise op on (B, F, N), as the same operand of the op on (B, N, F) rows."""
    if not isinstance(a, fx.Node):
        return a
    if a in rows:
        return rows[a]
    shape = shape_of(a)
    if len(shape) == 0 or len(shape) == 1 and same_size(shape[0], 1):
        return a
    if len(shape) == 1:  # (N,): along the tokens, the rows' dim 1
        return emit.method("unsqueeze", (a, -1))
    return emit.method("transpose", (a, -1, -2))


def _elementwise(emit: Emitter, node: fx.Node, rows: dict) -> fx.Node | None:
    if target_name(node) == "dropout" and node_argument(node, 3, "inplace", False):
        return None
    out = shape_of(node)
    if any(isinstance(v, fx.Node) for v in node.kwargs.values()) or out is None or len(out) != 3:
        return None
    if not all(all(same_size(p, q) for p, q in zip(shape_of(a), out)) for a in node.args
               if isinstance(a, fx.Node) and a in rows):
        return None  # (the transposed rows broadcast to a larger tensor: not one row per row)
    if any(isinstance(a, fx.Node) and a not in rows and (shape_of(a) is None or len(shape_of(a)) > 3)
           for a in node.args):
        return None
    return emit.node(node.op, node.target, tuple(_operand(emit, a, rows) for a in node.args), dict(node.kwargs))


def _kernel_one_conv(emit: Emitter, node: fx.Node, rows: dict) -> fx.Node | None:
    x, weight = node.args[0], node_argument(node, 1, "weight")
    bias = node_argument(node, 2, "bias")
    stride, padding = node_argument(node, 3, "stride", 1), node_argument(node, 4, "padding", 0)
    groups = node_argument(node, 6, "groups", 1)
    if not isinstance(weight, fx.Node) or len(shape_of(weight) or ()) != 3 or not same_size(shape_of(weight)[2], 1):
        return None
    if _single(stride) != 1 or (padding not in ("valid", "same") and _single(padding) != 0) or groups != 1:
        return None
    return emit.call(torch.nn.functional.linear, (rows[x], emit.method("squeeze", (weight, -1)), bias))


def _single(value):
    return value[0] if isinstance(value, (tuple, list)) and len(value) == 1 else value


def _eval_batch_norm(emit: Emitter, node: fx.Node, rows: dict) -> fx.Node | None:
    mean, var = node_argument(node, 1, "running_mean"), node_argument(node, 2, "running_var")
    weight, bias = node_argument(node, 3, "weight"), node_argument(node, 4, "bias")
    if node_argument(node, 5, "training", False) is not False or not all(isinstance(t, fx.Node) for t in (mean, var)):
        return None
    eps = node_argument(node, 7, "eps", 1e-5)
    out = emit.call(torch.mul, (emit.call(torch.sub, (rows[node.args[0]], mean)),
                                emit.call(torch.rsqrt, (emit.call(torch.add, (var, eps)),))))
    if weight is not None:
        out = emit.call(torch.mul, (out, weight))
    out = out if bias is None else emit.call(torch.add, (out, bias))
    # (a bf16 input with fp32 statistics: the batch norm gives bf16, the arithmetic promotes to fp32)
    return out if dtype_of(out) == dtype_of(node) else emit.method("to", (out, dtype_of(node)))


def _move(emit: Emitter, node: fx.Node, rows: dict) -> fx.Node | None:
    name = target_name(node)
    dtype = dtype_of(node)
    if node.op not in ("call_function", "call_method") or dtype is None or not dtype.is_floating_point:
        return None
    if name in ELEMENTWISE:
        return _elementwise(emit, node, rows)
    first = node.args[0] if node.args else None
    if not isinstance(first, fx.Node) or first not in rows or \
            any(a in rows for a in node.args[1:] if isinstance(a, fx.Node)):
        return None  # (a cat's list of tensors, an op reading two transposed values: not moved)
    if name == "conv1d":
        return _kernel_one_conv(emit, node, rows)
    if name == "batch_norm":
        return _eval_batch_norm(emit, node, rows)
    if name in SOFTMAX and node_argument(node, 1, "dim") in (1, -2):  # over the features: the rows' last dim
        if len(node.args) > 1:
            return emit.node(node.op, node.target, (rows[first], -1, *node.args[2:]), dict(node.kwargs))
        return emit.node(node.op, node.target, (rows[first],), {**node.kwargs, "dim": -1})
    return None


def _mixes_tokens(node: fx.Node) -> bool:
    """Whether ``node`` normalizes or convolves across the tokens (dim 2) of a (B, F, N) operand (a batch norm
    in training, a convolution wider than one token). Reductions and softmax over the tokens are pooling or
    attention, whose masks the other analyses read, and a LayerNorm there is more often a (B, N, d) value whose
    sizes look transposed: not reported here."""
    return target_name(node) in ("batch_norm", "conv1d", "instance_norm")


def untranspose_token_rows(graph: fx.Graph, row_dims: list[tuple]) -> tuple[int, list[tuple[fx.Node, str]]]:
    """Run the row-by-row ops of every chain on (B, F, N) transposed tokens on their (B, N, F) rows (module
    doc): the number of ops moved, and (node, reason) for each op across the tokens that leaves GEMMs padded."""
    def transposed_rows(node):
        shape = shape_of(node)
        return shape is not None and len(shape) == 3 and \
            any(same_size(shape[0], b) and same_size(shape[2], n) for b, n in row_dims)

    def reads_back(graph_, user, row_form):
        return row_form if _swaps_last_two(user) and transposed_rows(user.args[0]) else None

    layout = RowLayout(
        name="token rows transposed to (B, F, N)",
        start=lambda node: _transposed(node, row_dims),
        move=_move,
        reads_back=reads_back,
        back=lambda graph_, row_form: graph_.call_method("transpose", (row_form, 1, 2)),
        mixes=_mixes_tokens,
        # (a (B, d, n) value whose d equals a mask's N looks transposed too: moved only for what it is for)
        worth=lambda ops: any(target_name(n) in ("conv1d", "batch_norm") for n in ops),
        keeps=lambda node: transposed_rows(node) or any(has_rows(shape_of(node), b, n) for b, n in row_dims))
    return move_chains(graph, layout)
