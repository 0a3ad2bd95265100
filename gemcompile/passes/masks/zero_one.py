"""Integer masks read from data as 0/1: HF's ``attention_mask`` cast to float (``(1 - mask) * min``) or added
to a float mask (StableLM's and Falcon's ``causal + attention_mask[:, None, None, :] == 0``). The prover reads
such a tensor as 1 where it is nonzero and 0 elsewhere, and the rewrite (an attention pass, or unpad packing
by it: unpad_masks.py) checks on the device that it holds only 0 and 1: a value outside {0, 1} stops the run
with a message instead of a silent wrong answer."""

from __future__ import annotations

import functools
import operator

import sympy
import torch
import torch.fx as fx

from gemcompile.passes.graph import Emitter
from gemcompile.passes.masks.values import IntTensor, piecewise


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
