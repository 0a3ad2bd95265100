"""Attention inside activation-checkpointed regions of the compiled model.

torch.utils.checkpoint around a block (HF's gradient_checkpointing, torchtitan's AC) reaches Dynamo's graph as
a ``tag_activation_checkpoint`` call of a subgraph; AOTAutograd later inlines the region with its recomputation
tags, our ops included. The attention passes run in that subgraph. A mask the model builds once outside the
blocks (HF's extended mask, SASRec's timeline mask, HSTU's invalid_attn_mask) reaches the subgraph as an input,
which no proof can read: the ops that build it are copied into the subgraph first (``bring_masks_inside``),
from the enclosing graph's inputs, which the region then receives as extra operands. The copies are pure,
small and recomputed in the backward, like the region's own ops.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx as fx

from gemcompile.passes.graph import CHECKPOINT_REGION_INPUT, example_value, positional_arguments, target_name
from gemcompile.passes.masks.mutation import in_place_update, returns_new_tensor

_DONE = "gemcompile_region_rewritten"
"""GraphModule meta flag: a region's subgraph, called by several checkpoint calls, is rewritten once."""

_MAX_COPIED = 64
"""Most ops copied into a region for one of its inputs (a mask is a handful)."""

_RANDOM = ("rand", "dropout", "bernoulli", "normal", "multinomial", "uniform", "exponential")

_VIEWS = {"getitem", "view", "reshape", "unsqueeze", "squeeze", "expand", "expand_as", "permute", "transpose",
          "to", "float", "bool", "long", "int", "half", "bfloat16", "type_as", "contiguous", "flip", "t", "mT",
          "size", "sym_size", "dim"}


def is_checkpoint_call(node: fx.Node) -> bool:
    """A call of torch.utils.checkpoint's region (the ``tag_activation_checkpoint`` higher-order op)."""
    return node.op == "call_function" and "tag_activation_checkpoint" in str(node.target)


def _checkpoint_calls(gm: fx.GraphModule) -> dict[fx.GraphModule, list[fx.Node]]:
    calls: dict[fx.GraphModule, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if not is_checkpoint_call(node):
            continue
        ref = node.args[0]
        body = getattr(gm, ref.target, None) if getattr(ref, "op", None) == "get_attr" else None
        if isinstance(body, fx.GraphModule):
            calls.setdefault(body, []).append(node)
    return calls


def run_in_checkpointed_regions(gm: fx.GraphModule, run_passes: Callable[[fx.Graph], None]) -> None:
    """Run ``run_passes`` on the subgraph of every checkpointed region of ``gm`` (nested ones too)."""
    regions = _checkpoint_calls(gm)
    for body, calls in regions.items():
        if body.meta.get(_DONE):
            continue
        body.meta[_DONE] = True
        positional_arguments(body.graph)
        bring_masks_inside(body, calls)
        for placeholder in body.graph.find_nodes(op="placeholder"):
            placeholder.meta[CHECKPOINT_REGION_INPUT] = True
        run_passes(body.graph)
        body.recompile()
        run_in_checkpointed_regions(body, run_passes)
    if regions:  # the calls may have gained operands
        gm.recompile()


def _copyable(node: fx.Node) -> bool:
    name = target_name(node)
    return (node.op in ("call_function", "call_method") and not any(r in name for r in _RANDOM)
            and (returns_new_tensor(node) or name in _VIEWS) and in_place_update(node) is None)


def _builders(operand: fx.Node) -> list[fx.Node] | None:
    """The ops that build ``operand`` from the enclosing graph's inputs, in graph order; None when they are not
    all pure, few, and free of learned values (then the input stays an input)."""
    seen: dict[fx.Node, None] = {}
    stack = [operand]
    while stack:
        node = stack.pop()
        if node in seen or node.op == "placeholder":
            continue
        value = example_value(node)
        if not _copyable(node) or (isinstance(value, torch.Tensor) and value.requires_grad):
            return None
        seen[node] = None
        if len(seen) > _MAX_COPIED:
            return None
        stack.extend(node.all_input_nodes)
    for leaf in {n for node in seen for n in node.all_input_nodes if n not in seen}:
        value = example_value(leaf)
        if leaf.op != "placeholder" or (isinstance(value, torch.Tensor) and value.requires_grad) \
                or in_place_update(leaf) is not None:
            return None  # an activation or a parameter: the mask is no function of the batch's metadata alone
    order = {n: i for i, n in enumerate(operand.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def bring_masks_inside(body: fx.GraphModule, calls: list[fx.Node]) -> None:
    """Copy into ``body`` the ops that build each of its inputs that every call passes as the same pure,
    small function of the enclosing graph's inputs; those inputs become extra operands of every call."""
    placeholders = list(body.graph.find_nodes(op="placeholder"))
    operands = [call.args[1:] for call in calls]
    if any(len(o) != len(placeholders) for o in operands):
        return
    leaves: dict[fx.Node, fx.Node] = {}  # enclosing graph input -> the region's placeholder for it
    for index, placeholder in enumerate(placeholders):
        outside = operands[0][index]
        if not placeholder.users or not isinstance(outside, fx.Node) or any(o[index] is not outside for o in operands):
            continue
        builders = _builders(outside)
        if not builders:
            continue
        env: dict[fx.Node, fx.Node] = {}
        first = next(n for n in body.graph.nodes if n.op != "placeholder")  # the copies go before it, in order
        for node in builders:
            for leaf in node.all_input_nodes:
                if leaf not in env and leaf not in leaves:
                    leaves[leaf] = _region_input(body, leaf)
            with body.graph.inserting_before(first):
                env[node] = body.graph.node_copy(node, lambda n: env[n] if n in env else leaves[n])
        placeholder.replace_all_uses_with(env[outside])
    for call in calls:
        call.args = (*call.args, *leaves)


def _region_input(body: fx.GraphModule, outside: fx.Node) -> fx.Node:
    """A new last placeholder of ``body`` standing for the enclosing graph's input ``outside``."""
    last = list(body.graph.find_nodes(op="placeholder"))[-1]
    with body.graph.inserting_after(last):
        placeholder = body.graph.placeholder(f"outer_{outside.name}")
    placeholder.meta.update({k: v for k, v in outside.meta.items() if k != "grapharg"})
    return placeholder
