"""Integer masks read from data as 0/1: HF's ``attention_mask`` cast to float (``(1 - mask) * min``) or added
to a float mask (StableLM's and Falcon's ``causal + attention_mask[:, None, None, :] == 0``). The prover reads
such a tensor as 1 where it is nonzero and 0 elsewhere, and the rewrite (an attention pass, or unpad packing
by it: unpad_masks.py) checks on the device that it holds only 0 and 1: a value outside {0, 1} stops the run
with a message instead of a silent wrong answer.

A float tensor that an op the prover does not model selects from 0/1 masks (torch-rechub's InterFormer:
``torch.cat([torch.ones(B, k), (ids != 0).float()], 1)``, the float mask with ones prepended for its CLS tokens)
holds only 0 and 1 by construction: it is read as a 0/1 data mask too, with no check."""

from __future__ import annotations

import functools
import operator

import sympy
import torch
import torch.fx as fx

from gemcompile.passes.graph import Emitter, Unproven, example_value, target_name
from gemcompile.passes.masks.values import IntTensor, PiecewiseTensor, piecewise


ZERO_ONE_CHECKED = "gemcompile_zero_one_checked"
"""Node meta of an emitted check: the integer mask it checks."""


def zero_one_pieces(evaluator, src):
    """``src`` (an integer data leaf) as the float pieces 1 / 0, the check registered once per leaf; None when
    src is anything else (an index expression, a bool or float mask, a number)."""
    leaf = evaluator.data_function(src.expr) if isinstance(src, IntTensor) else None
    if leaf is None:
        return None
    name = src.expr.func.__name__
    if name not in evaluator.zero_one:
        evaluator.checks.append(functools.partial(emit_zero_one_check, node=leaf.node))
    evaluator.zero_one[name] = leaf.node
    nonzero = sympy.Not(evaluator.atoms.eq0(src.expr))
    return piecewise(src.ndim, [(1.0, nonzero), (0.0, sympy.Not(nonzero))])


_SELECTING = {  # op -> the positions of the arguments its values come from (cat: a list of tensors)
    "cat": (0,), "concat": (0,), "concatenate": (0,), "stack": (0,), "flip": (0,), "roll": (0,), "narrow": (0,),
    "index_select": (0,), "gather": (0,), "take_along_dim": (0,),
}


def selected_zero_one(evaluator, node: fx.Node):
    """A float ``node`` of rank >= 2 whose op only selects values of 0/1 masks (_SELECTING): pieces 1 where it
    is nonzero, 0 elsewhere, as a data leaf (the rewrites read the node itself at run time); None otherwise."""
    value = example_value(node)
    if target_name(node) not in _SELECTING or not isinstance(value, torch.Tensor) or \
            not value.is_floating_point() or value.dim() < 2:
        return None
    sources = []
    for position in _SELECTING[target_name(node)]:
        arg = node.args[position] if position < len(node.args) else None
        sources.extend(arg if isinstance(arg, (list, tuple)) else [arg])
    if not sources or not all(isinstance(a, fx.Node) for a in sources):
        return None
    try:
        values = [evaluator.tensor(a) for a in sources]
    except Unproven:  # (a source the prover cannot read: not proven 0/1)
        return None
    if not all(isinstance(v, PiecewiseTensor) and all(float(x) in (0.0, 1.0) for x, _ in v.pieces) for v in values):
        return None
    nonzero = sympy.Not(evaluator.atoms.eq0(evaluator._leaf(node, why="a 0/1 mask selected by an unmodelled op").expr))
    return piecewise(value.dim(), [(1.0, nonzero), (0.0, sympy.Not(nonzero))])


def emit_zero_one_check(emit: Emitter, node: fx.Node) -> None:
    """A device-side assert (no host sync) that an integer mask read as 0/1 holds only 0 and 1: the run stops
    with this message instead of computing a mask the model did not mean."""
    ok = emit.call(torch.logical_or, (emit.call(operator.eq, (node, 0)), emit.call(operator.eq, (node, 1))))
    ok = emit.call(torch.all, (ok,))
    ok.meta[ZERO_ONE_CHECKED] = node  # (unpad_masks.unchecked_zero_one: another pass relies on it too)
    emit.call(torch._assert_async, (ok,
                                    f"gemcompile: the mask {node.name} holds values other than 0 and 1; "
                                    "gemcompile's rewrites (attention, unpad) read it as a 0/1 mask: pass a "
                                    "bool mask, or turn those passes off for this model"))
