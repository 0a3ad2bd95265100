"""The unpad pass's per-token losses: a loss that ignores rows by their labels runs on those rows alone.

Masked language models (BERT4Rec, HF's ``*ForMaskedLM``) and sequence models trained on every position
score each token against a vocabulary and take

    F.cross_entropy(logits.view(-1, V), labels.view(-1), ignore_index=k)    (or F.nll_loss of log-probs)

A row whose label is k adds nothing to the loss, to its mean's count, or to any gradient: the loss, and
therefore everything computed only for it (the output projection to V, the head's norm and activation),
reads the rows where ``labels != k`` only. That is a row mask read from data, a token vector to the unpad
pass (unpad_masks.py), although no node of the model computes it: ``insert_label_masks`` adds the node
``labels != k`` before the analysis, so that unpad finds it like any other; the pad analysis counts the
flatten-then-loss reader as ignoring every row outside it (``LabelLoss``); and once a region over that
vector is packed, ``pack_label_losses`` lets the loss read the packed rows, ``loss(P, labels[b, n])``,
instead of a scatter of B x N rows of V logits (the largest activation of such models). Exact: the packed
rows are exactly the rows the loss does not ignore, so sums, the mean's count and, for
``reduction="none"``, the zeros of the ignored rows are the loss's own. With token buckets the slack rows
get the label k, so the loss ignores them too.

The classes may also be the loss's dim 1, ``F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=k)``
(or ``permute(0, 2, 1)``) against (B, N) labels: the same rows, the same rewrite; ``reduction="none"`` then
gives the (B, N) losses.

Not covered (the loss then reads every row, as before): probabilities as targets, the deprecated
``size_average`` / ``reduce`` arguments, an ignore_index that is not a constant.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true as known

from gemcompile.passes.graph import (Emitter, copy_source_meta, erase_dead, example_value, permutation,
                                     size_argument, target_name, through_noop_casts)
from gemcompile.passes.token_wise import same_size, shape_of
from gemcompile.passes.unpad_attention import RegionIndex, scattered_rows

aten = torch.ops.aten

LOSSES = {F.cross_entropy: inspect.signature(F.cross_entropy), F.nll_loss: inspect.signature(F.nll_loss)}
"""The per-token losses with an ignore_index, and their signatures (to read arguments given either way)."""
_FLATTENS = ("view", "reshape", "flatten")
_LABEL_MOVES = ("to", "long", "contiguous", "clone")


@dataclass(frozen=True)
class LabelLoss:
    """``loss(x.view(-1, V), labels.view(-1), ignore_index=k)`` over (B, N) rows of x."""

    loss: fx.Node
    flat: fx.Node
    """The loss's input: x's (B, N) rows flattened to (B * N, V)."""
    labels: fx.Node
    """The (B, N) labels."""
    ignore_index: int
    reduction: str
    mask: fx.Node
    """The inserted ``labels != ignore_index`` (B, N) node: the row mask of the rows the loss reads."""
    classes_dim_one: bool = False
    """The loss reads x as (B, V, N) (``x.transpose(1, 2)``) against (B, N) labels, not flattened."""


def _flattened(node, rank: int) -> fx.Node | None:
    """x when ``node`` merges the first two dims of x, of the given rank (``x.view(-1, V)``,
    ``x.reshape(B * N, V)``, ``x.flatten(0, 1)``; views are row-major, so the shape alone says it)."""
    if not isinstance(node, fx.Node) or target_name(node) not in _FLATTENS or not node.args:
        return None
    x = node.args[0]
    shape, out = shape_of(x), shape_of(node)
    if shape is None or out is None or len(shape) != rank or len(out) != rank - 1:
        return None
    if not known(out[0] == shape[0] * shape[1]) or not all(same_size(a, b) for a, b in zip(out[1:], shape[2:])):
        return None
    return x


def _classes_moved(node) -> fx.Node | None:
    """x when ``node`` is a (B, N, V) x with its classes moved to dim 1: ``x.transpose(1, 2)``,
    ``x.transpose(-1, 1)``, ``x.permute(0, 2, 1)``."""
    return node.args[0] if permutation(node) == [0, 2, 1] else None


def _arguments(node: fx.Node) -> dict | None:
    signature = LOSSES.get(node.target) if node.op == "call_function" else None
    if signature is None:
        return None
    try:
        bound = signature.bind(*node.args, **node.kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    return dict(bound.arguments)


def insert_label_masks(graph: fx.Graph) -> dict[fx.Node, LabelLoss]:
    """{the loss's flattened input: its LabelLoss} for each per-token loss of the module doc's form, with the
    node ``labels != ignore_index`` inserted before the loss (``remove_unused_label_masks`` takes it out
    again where no region packs by it)."""
    found = {}
    for node in list(graph.nodes):
        args = _arguments(node)
        if args is None or args["size_average"] is not None or args["reduce"] is not None:
            continue
        ignore, reduction = args["ignore_index"], args["reduction"]
        if type(ignore) is not int or reduction not in ("mean", "sum", "none"):
            continue
        flat, target = args["input"], args["target"]
        # (transformers' loss helpers move the labels after the view: labels.view(-1).to(logits.device))
        x, labels = _flattened(flat, 3), _flattened(through_noop_casts(target, _LABEL_MOVES), 2)
        moved = x is None and len(shape_of(target) or ()) == 2
        if moved:  # (B, V, N) logits against (B, N) labels
            x, labels = _classes_moved(flat), target
        value = example_value(labels) if labels is not None else None
        if x is None or value is None or value.dtype != torch.int64 or flat in found or \
                not (same_size(shape_of(x)[0], value.shape[0]) and same_size(shape_of(x)[1], value.shape[1])):
            continue
        if any(u is not node for u in flat.users):
            continue  # (the flattened logits read by something else too, an accuracy: it reads every row)
        emit = Emitter(graph)
        with graph.inserting_before(node):
            mask = emit.call(torch.ne, (labels, ignore))
        found[flat] = LabelLoss(node, flat, labels, ignore, reduction, mask, moved)
    return found


def loss_reading(losses: dict[fx.Node, LabelLoss], user: fx.Node, node: fx.Node) -> LabelLoss | None:
    """The LabelLoss whose flattened input ``user`` is, of ``node``'s rows: it reads only the rows its mask
    keeps."""
    loss = losses.get(user)
    return loss if loss is not None and user.args[0] is node else None


def pack_label_losses(graph: fx.Graph, emit: Emitter, index: RegionIndex, losses: dict[fx.Node, LabelLoss],
                      masks: dict, buckets: bool) -> tuple[int, int]:
    """Each loss reading a scatter of this region's rows, by this region's own mask, reads the packed rows
    instead (module doc). Returns (losses rewritten, scatters removed)."""
    count, removed = 0, 0
    for flat, loss in losses.items():
        if flat not in graph.nodes or loss.loss not in graph.nodes or not index.mask.same(masks.get(loss.mask)):
            continue
        scattered = flat.args[0]
        packed = scattered_rows(scattered, index) if isinstance(scattered, fx.Node) else None
        if packed is None:
            continue
        with graph.inserting_before(loss.loss):
            _replace(emit, loss, packed, index, buckets)
        count += 1
        removed += bool(getattr(scattered, "_erased", False))
    return count, removed


def _replace(emit: Emitter, loss: LabelLoss, packed: fx.Node, index: RegionIndex, buckets: bool) -> None:
    # (token buckets need a static batch size: then ``batch`` is an int)
    batch = size_argument(emit, index.mask.batch)
    labels = emit.call(aten.index.Tensor, (loss.labels, [index.gather_batch, index.seq_index]))
    if buckets:  # slack rows (batch index B) read a real row: their label is the ignored one
        real = emit.call(aten.lt.Scalar, (index.batch_index, batch))
        labels = emit.call(aten.where.ScalarOther, (real, labels, loss.ignore_index))
    args = _arguments(loss.loss)
    args.update(input=packed, target=labels)
    out = emit.call(loss.loss.target, (), args)
    if loss.reduction == "none":  # (B * N,) or (B, N) with the ignored rows' zeros, as the loss writes them
        zeros = emit.call(aten.new_zeros.default, (out, [batch + 1 if buckets else batch, index.seq]))
        out = emit.call(aten.index_put.default, (zeros, [index.batch_index, index.seq_index], out))
        if buckets:
            out = emit.call(aten.slice.Tensor, (out, 0, 0, batch))
        if not loss.classes_dim_one:
            out = emit.call(aten.reshape.default, (out, [-1]))
    copy_source_meta(loss.loss, out)
    loss.loss.replace_all_uses_with(out)
    inputs = loss.loss.all_input_nodes
    loss.loss.graph.erase_node(loss.loss)
    erase_dead(inputs)


def remove_unused_label_masks(losses: dict[fx.Node, LabelLoss]) -> None:
    erase_dead([loss.mask for loss in losses.values() if not loss.mask.users])
