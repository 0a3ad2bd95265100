"""The FLOP conventions of the attention ops: only the (i, j) pairs that take part count.

forward = 4 * H * D * pairs (q.k and p.v, 2 FLOPs per MAC); backward = 2.5 x forward (ARCHITECTURE.md
conventions: recompute is not counted as useful work). Each op counts its pairs (its flops.py) and
registers torch.utils.flop_counter formulas for its fwd and bwd ops; the benchmarks use the same helpers.
"""

from __future__ import annotations

__all__ = ["BACKWARD_FLOPS_RATIO", "forward_flops"]

BACKWARD_FLOPS_RATIO = 2.5
"""Backward FLOPs / forward FLOPs of attention (dQ, dK, dV, dP: four GEMMs vs two, plus half for dS)."""


def forward_flops(H: int, D: int, pairs: int) -> int:
    return 4 * int(H) * int(D) * int(pairs)
