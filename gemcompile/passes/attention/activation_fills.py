"""A fill of the scores before a pointwise attention's activation, read as a mask that drops those pairs.

torch-rechub's HSTU writes ``F.silu(scores.masked_fill(~(causal & key_mask), -1e4)) / max_seq_len``: silu(-1e4)
is exactly -0.0 in float32, bfloat16 and float16 (the sigmoid underflows), and the fill stops the gradient, so
those pairs add nothing, as a mask after the activation would drop them. A fill counts as a drop only where the
activation of the value reaching it (the fill times the scales between them, no bias) is exactly 0 in every
float dtype; -inf is not (silu(-inf) is NaN), nor is a fill before an activation that is not 0 there.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.nn.functional as F

from gemcompile.passes.attention.scores import constant_float
from gemcompile.passes.graph import Unproven

_ZERO_AT_LARGE_NEGATIVE = {"silu": F.silu, "sigmoid": torch.sigmoid, "relu": torch.relu, "gelu": F.gelu,
                           "gelu_tanh": functools.partial(F.gelu, approximate="tanh")}
"""The activations that map a large negative score to exactly 0 (underflow): a fill before them drops a pair."""


def fill_dropped(fill: Any, ops: list, activation: str) -> None:
    """A fill of the scores before the activation drops those pairs when the activation of the value that
    reaches it (the fill times the scales between them; no bias there) is exactly 0 in every float dtype
    (torch-rechub's HSTU: ``silu(scores.masked_fill(~mask, -1e4))``; silu(-inf) is NaN, so not -inf)."""
    act = _ZERO_AT_LARGE_NEGATIVE.get(activation)
    value = constant_float(fill)
    if act is None or value is None or not math.isfinite(value) or any(kind != "scale" for kind, _ in ops):
        raise Unproven(f"a fill of the scores before the activation ({activation}) that it does not turn into 0")
    for _, factor in ops:
        if type(factor) not in (int, float):
            raise Unproven(f"the scores are filled before the activation ({activation}) and then scaled by "
                           f"{factor!r}: not a constant")
        value *= factor
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        if act(torch.tensor(value, dtype=torch.float32).to(dtype)).item() != 0.0:
            raise Unproven(f"the scores are filled with {fill!r} before the activation ({activation}), which "
                           f"is not exactly 0 there in {dtype}")
