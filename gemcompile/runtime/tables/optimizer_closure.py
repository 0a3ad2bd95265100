"""The closure protocol of ``torch.optim.Optimizer.step(closure)``, shared by gemcompile's optimizers
(SparseAdagrad here, TritonAdam in runtime/training/adam.py): on the lowest floor that holds an optimizer."""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["run_closure"]


def run_closure(closure: Callable[[], torch.Tensor] | None) -> torch.Tensor | None:
    """The loss of ``closure()`` evaluated with gradients on (a step runs under no_grad), or None without one."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()
