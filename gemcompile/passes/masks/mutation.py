"""Masks updated in place: the one thing the mask prover must not read past.

The evaluator (masks/evaluator.py) reads a mask from the ops that built it, and the rewrite re-reads their
inputs at run time. A mask changed in place after it was built (FuxiCTR TransAct's ``mask[mask.all(-1), -1]
= 0``, which lets an empty sequence attend to its last key) holds other values than those ops give: read
from them, the rewrite would give that sequence another answer without a word. So a tensor in a mask's
provenance that anything updates in place (itself or through a view of it) stops the proof, with the op
named. Updates of fresh score tensors were made out of place earlier (attention/in_place.py) and are no
longer in the graph.
"""

from __future__ import annotations

import operator

import torch.fx as fx

from gemcompile.passes.graph import Unproven, target_name

_IN_PLACE_OPERATORS = {operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv,
                       operator.ifloordiv, operator.imod, operator.ipow, operator.iand, operator.ior,
                       operator.ixor, operator.ilshift, operator.irshift}
_IN_PLACE_DUNDERS = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                     "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__"}
_NOT_UPDATES = {"requires_grad_", "retain_grad", "record_stream"}
_VIEWS = {"getitem", "view", "reshape", "view_as", "reshape_as", "transpose", "permute", "t", "mT",
          "unsqueeze", "squeeze", "select", "narrow", "expand", "expand_as", "flatten", "unflatten",
          "diagonal", "as_strided", "split", "chunk", "unbind", "contiguous", "detach", "alias"}


def check_not_updated(node: fx.Node) -> None:
    """Unproven, naming the update, when ``node``'s tensor is updated in place (module doc)."""
    update = in_place_update(node)
    if update is not None:
        raise Unproven(f"{node.name} (in the mask) is updated in place by {update.name} "
                       f"(`{target_name(update)}`): the prover reads a mask only as it was built")


def in_place_update(node: fx.Node, depth: int = 6) -> fx.Node | None:
    """The first op that updates ``node``'s tensor in place (directly or through a view of it), or None."""
    for user in node.users:
        if user.op not in ("call_function", "call_method") or not user.args or user.args[0] is not node:
            continue
        if _updates(user):
            return user
        if depth > 0 and target_name(user) in _VIEWS:
            found = in_place_update(user, depth - 1)
            if found is not None:
                return found
    return None


def _updates(node: fx.Node) -> bool:
    if node.target in _IN_PLACE_OPERATORS:
        return True
    if node.op == "call_function" and getattr(node.target, "__module__", None) in ("_operator", "operator"):
        return False  # operator.and_ / or_ / not_ are out of place; the in-place operators are listed above
    name = target_name(node)
    if name in _IN_PLACE_DUNDERS:
        return True
    return name.endswith("_") and not name.startswith("__") and name not in _NOT_UPDATES
