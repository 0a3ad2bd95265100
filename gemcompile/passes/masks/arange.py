"""``torch.arange`` as the mask prover reads it: positions ``start + step * index``, exact only where the dtype
holds every value.

Spellings: ``arange(end)``, ``arange(start, end[, step])``, and any of them named (``arange(start=1,
end=L + 1)``, which HF's masking utilities write): reading only the positional ones took ``start=1`` as 0.
The prover's integers neither wrap nor round, torch's do: ``arange(130, dtype=torch.int8)`` holds -128 at
128, ``arange(260, dtype=torch.bfloat16)`` holds 256 at 257. Such an arange is refused unless every value it
holds is exact in its dtype (int32 and int64 taken not to wrap, as ``values.check_no_wrap`` does; nor float32
over a dynamic size: d2l's ``arange(maxlen, dtype=torch.float32)``).
"""

from __future__ import annotations

import sympy
import torch
from torch import fx

from gemcompile.passes.graph import Unproven, example_value
from gemcompile.passes.masks.values import IntTensor, index_symbol

_EXACT_FLOAT_INTEGERS = {torch.float16: 2 ** 11, torch.bfloat16: 2 ** 8, torch.float32: 2 ** 24,
                         torch.float64: 2 ** 53}
"""The largest magnitude up to which a float dtype holds every integer."""


def arange_value(evaluate, node: fx.Node) -> IntTensor:
    """The positions of an arange node; ``evaluate`` reads its (possibly symbolic) bounds."""
    values = [evaluate(a) for a in node.args]
    named = {k: evaluate(v) for k, v in node.kwargs.items() if k in ("start", "end", "step")}
    if len(values) == 1 and "end" not in named:
        fields = {"end": values[0]}
    else:
        fields = dict(zip(("start", "end", "step"), values))
    if set(fields) & set(named):
        raise Unproven("arange with a bound given twice")
    fields.update(named)
    start, step = fields.get("start", 0), fields.get("step", 1)
    if any(isinstance(v, (float, bool)) for v in fields.values()):
        raise Unproven("arange over floats")
    _check_exact(example_value(node), start, step)
    return IntTensor(1, start + step * index_symbol(0))


def _check_exact(value: torch.Tensor, start, step) -> None:
    dtype = value.dtype
    if dtype in (torch.int32, torch.int64):
        return
    if dtype in (torch.int8, torch.uint8, torch.int16):
        info = torch.iinfo(dtype)
        low, high = info.min, info.max
    elif dtype in _EXACT_FLOAT_INTEGERS:
        high = _EXACT_FLOAT_INTEGERS[dtype]
        low = -high
    else:
        raise Unproven(f"arange in {dtype}")
    n = value.shape[0]
    ends = [sympy.sympify(start), sympy.sympify(start) + sympy.sympify(step) * (n - 1)] if n else []
    if dtype in (torch.float32, torch.float64) and not all(e.is_number for e in ends):
        return  # a dynamic size past 2**24 positions: taken not to occur (d2l's float32 sequence_mask)
    if not all(e.is_number and low <= int(e) <= high for e in ends):
        raise Unproven(f"arange in {dtype} holding values it may not hold exactly (it wraps or rounds)")
