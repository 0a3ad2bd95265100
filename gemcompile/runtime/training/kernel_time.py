"""GPU kernel time of a train step: what a step costs the GPU, apart from the host.

A host-bound step (launch overhead, Python in the loop, host syncs) shows the host's time in wall-clock and
CUDA-event timings alike: the GPU idles between kernels. The profiler's per-kernel device times, summed,
are the GPU's own share; wall time minus it is what the host adds. Used by `gemcompile bench e2e` and
benchmarks/unpad.py.

`kernel_profile` also says where that GPU time goes: the kernels that take the most of it, the number of
kernels a step launches, and a coarse split by kernel class (GEMM, Inductor's Triton, gemcompile's
Triton, copies, other), so that a results JSON carries what holds a step's MFU back.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["KernelProfile", "kernel_class", "kernel_ms_per_step", "kernel_profile", "summarize_kernels"]

# Kernel-name rules, first match wins. cuBLAS/CUTLASS GEMM kernels carry gemm / nvjet / sm90_xmma /
# cutlass in their names; Inductor's generated kernels start with triton_ (triton_poi_, triton_red_,
# triton_per_, triton_tem_ for its GEMM templates); gemcompile's Triton kernels are module-level
# functions named _..._kernel.
_CLASSES = (
    ("gemm", re.compile(r"gemm|nvjet|xmma|cutlass|cublas|triton_tem_", re.IGNORECASE)),
    ("inductor", re.compile(r"^triton_")),
    ("gemcompile", re.compile(r"^_\w*kernel", re.IGNORECASE)),
    ("copy", re.compile(r"memcpy|memset|copy", re.IGNORECASE)),
)


def kernel_class(name: str) -> str:
    """'gemm', 'inductor', 'gemcompile', 'copy' or 'other', from a kernel's name."""
    for label, pattern in _CLASSES:
        if pattern.search(name):
            return label
    return "other"


@dataclass
class KernelProfile:
    """Device time of one step, from the profiler's per-kernel totals."""

    ms_per_step: float
    """Summed device time (kernels and copies) per step, ms."""

    kernels_per_step: float
    """Kernel launches (and copies) per step."""

    by_class: dict[str, float] = field(default_factory=dict)
    """ms per step per kernel_class(), largest first."""

    top: list[dict[str, Any]] = field(default_factory=list)
    """The kernels with the most device time: name (truncated), class, ms and calls per step, share."""

    def as_json(self) -> dict[str, Any]:
        return {"ms_per_step": self.ms_per_step, "kernels_per_step": self.kernels_per_step,
                "by_class_ms": self.by_class, "top": self.top}


def _device_us(event) -> float:
    # torch >= 2.4 names it self_device_time_total; older releases self_cuda_time_total
    return getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0.0)


def summarize_kernels(events: Iterable[Any], steps: int, top: int = 15, name_chars: int = 120) -> KernelProfile:
    """KernelProfile from profiler key averages (objects with .key, .count and a self device time) of
    `steps` steps. Events with no device time (host-side ops) are left out."""
    if steps < 1:
        raise ValueError(f"steps = {steps}: need >= 1")
    rows = [(e.key, _device_us(e), e.count) for e in events]
    rows = [r for r in rows if r[1] > 0]
    total_us = sum(us for _, us, _ in rows)
    by_class: dict[str, float] = {}
    for name, us, _ in rows:
        label = kernel_class(name)
        by_class[label] = by_class.get(label, 0.0) + us / 1e3 / steps
    rows.sort(key=lambda r: r[1], reverse=True)
    return KernelProfile(
        ms_per_step=total_us / 1e3 / steps,
        kernels_per_step=sum(count for _, _, count in rows) / steps,
        by_class=dict(sorted(by_class.items(), key=lambda kv: kv[1], reverse=True)),
        top=[{"name": name[:name_chars], "class": kernel_class(name), "ms_per_step": us / 1e3 / steps,
              "calls_per_step": count / steps, "share": us / total_us if total_us else 0.0}
             for name, us, count in rows[:top]],
    )


def kernel_profile(step: Callable[[Any], Any], inputs: Sequence[Any], steps: int,
                   top: int = 40) -> KernelProfile | None:
    """Profile `steps` calls step(inputs[i % len(inputs)]) on CUDA; None without CUDA (nothing runs on
    a device, and the step is not run). ``top`` is 40 by default: a GEM-ref step spreads its glue over
    thousands of kernels, and the largest 15 held under half of medium's GPU time."""
    if not torch.cuda.is_available() or steps < 1:
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            step(inputs[i % len(inputs)])
        torch.cuda.synchronize()
    return summarize_kernels(prof.key_averages(), steps, top=top)


def kernel_ms_per_step(step: Callable[[Any], Any], inputs: Sequence[Any], steps: int) -> float | None:
    """Summed device time (kernels and copies) of `steps` calls step(inputs[i % len(inputs)]) under
    torch.profiler, per call, in ms; None without CUDA (nothing runs on a device)."""
    profiled = kernel_profile(step, inputs, steps)
    return None if profiled is None else profiled.ms_per_step
