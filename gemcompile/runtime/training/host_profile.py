"""Where the host's time goes in a train step: Python's cProfile over a few steps, summarized per function.

A host-bound step (the GPU idles between kernels: e2e's ``host_share`` and ``kernel_profile.idle``) is paced
by the Python that launches its kernels: Inductor's wrapper, the launchers of our custom ops, autograd,
guards. cProfile's own overhead makes every Python function look slower (C functions less so), so the
numbers rank the host's work rather than time it; ``wall_ms_per_step`` is the profiled steps' wall time.
"""

from __future__ import annotations

import cProfile
import os
import pstats
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from gemcompile.runtime.training.step_timing import sync

__all__ = ["host_profile", "profile_summary"]


def _where(key: tuple[str, int, str]) -> str:
    """'package/file.py:line(function)' (the path cut to its last two parts); built-ins as cProfile names
    them."""
    filename, line, function = key
    if filename == "~":
        return function  # a built-in: "<method 'item' of 'torch._C.TensorBase' objects>"
    return f"{os.sep.join(filename.split(os.sep)[-2:])}:{line}({function})"


def host_profile(step: Callable[[Any], Any], inputs: Sequence[Any], steps: int,
                 device: torch.device = torch.device("cpu"), top: int = 25) -> dict[str, Any]:
    """Run step(inputs[i % len(inputs)]) ``steps`` times under cProfile (``device`` synced before and after)
    and return the ``top`` functions by own time and by cumulative time, per step, with the wall time per
    step."""
    if steps < 1:
        raise ValueError(f"steps = {steps}: need >= 1")
    sync(device)
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    for i in range(steps):
        step(inputs[i % len(inputs)])
    sync(device)
    profiler.disable()
    wall = time.perf_counter() - start
    return {"steps": steps, "wall_ms_per_step": 1e3 * wall / steps, **profile_summary(profiler, steps, top)}


def profile_summary(profiler: cProfile.Profile, steps: int, top: int = 25) -> dict[str, Any]:
    """The ``top`` functions by own time and by cumulative time, per step, of what ``profiler`` saw over
    ``steps`` steps."""
    # {(file, line, function): (primitive calls, calls, own s, cumulative s, callers)}
    stats = pstats.Stats(profiler).stats

    def rows(index: int) -> list[dict[str, Any]]:
        ranked = sorted(stats.items(), key=lambda kv: kv[1][index], reverse=True)[:top]
        return [{"function": _where(key), "calls_per_step": calls / steps,
                 "own_ms_per_step": 1e3 * own / steps, "cumulative_ms_per_step": 1e3 * cumulative / steps}
                for key, (_, calls, own, cumulative, _) in ranked]

    return {"by_own_time": rows(2), "by_cumulative_time": rows(3)}
