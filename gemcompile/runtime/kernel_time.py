"""GPU kernel time of a train step: what a step costs the GPU, apart from the host.

A host-bound step (launch overhead, Python in the loop, host syncs) shows the host's time in wall-clock and
CUDA-event timings alike: the GPU idles between kernels. The profiler's per-kernel device times, summed,
are the GPU's own share; wall time minus it is what the host adds. Used by `gemcompile bench e2e` and
benchmarks/unpad.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["kernel_ms_per_step"]


def kernel_ms_per_step(step: Callable[[Any], Any], inputs: Sequence[Any], steps: int) -> float | None:
    """Summed device time (kernels and copies) of `steps` calls step(inputs[i % len(inputs)]) under
    torch.profiler, per call, in ms; None without CUDA (nothing runs on a device)."""
    if not torch.cuda.is_available() or steps < 1:
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            step(inputs[i % len(inputs)])
        torch.cuda.synchronize()
    total_us = 0.0
    for event in prof.key_averages():
        # torch >= 2.4 names it self_device_time_total; older releases self_cuda_time_total
        total_us += getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0.0)
    return total_us / 1e3 / steps
