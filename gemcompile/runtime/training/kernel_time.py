"""GPU kernel time of a train step: what a step costs the GPU, apart from the host.

A host-bound step (launch overhead, Python in the loop, host syncs) shows the host's time in wall-clock and
CUDA-event timings alike: the GPU idles between kernels. The profiler's per-kernel device times, summed,
are the GPU's own share; wall time minus it is what the host adds. Used by `gemcompile bench e2e` and
benchmarks/unpad.py.

`kernel_profile` also says where that GPU time goes: the kernels that take the most of it, the number of
kernels a step launches, and a coarse split by kernel class (GEMM, Inductor's Triton, gemcompile's
Triton, copies, other), so that a results JSON carries what holds a step's MFU back. And where the GPU
waits: ``idle_gaps`` sums the time between one kernel's end and the next one's start, and names the
kernels the largest waits came before (the host was late to launch them: a sync, Python, many tiny ops).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["KernelProfile", "idle_gaps", "kernel_class", "kernel_ms_per_step", "kernel_profile", "summarize_kernels"]

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

    idle: dict[str, Any] | None = None
    """Where the GPU waited between kernels (idle_gaps), None when the trace had no kernel times."""

    def as_json(self) -> dict[str, Any]:
        return {"ms_per_step": self.ms_per_step, "kernels_per_step": self.kernels_per_step,
                "by_class_ms": self.by_class, "top": self.top, "idle": self.idle}


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


def idle_gaps(spans: Iterable[tuple[float, float, str]], steps: int, top: int = 12, min_us: float = 20.0,
              name_chars: int = 90) -> dict[str, Any] | None:
    """Where the device waited: spans (start us, end us, kernel name) of `steps` steps, on one device.
    Returns idle ms per step (time between the first kernel's start and the last one's end with no kernel
    running), the share of that time in gaps of at least ``min_us``, and the ``top`` kernels whose launch the
    device waited for longest in total (gaps of at least ``min_us`` before them, per step), with the kernel
    that ran before the gap (``waited_for``, ``after``). None without spans."""
    if steps < 1:
        raise ValueError(f"steps = {steps}: need >= 1")
    spans = sorted(spans)
    if not spans:
        return None
    idle_us, long_us, busy_until, previous = 0.0, 0.0, spans[0][1], spans[0][2]
    waits: dict[tuple[str, str], list[float]] = {}
    for start, end, name in spans[1:]:
        gap = start - busy_until
        if gap > 0:
            idle_us += gap
            if gap >= min_us:
                long_us += gap
                entry = waits.setdefault((name[:name_chars], previous[:name_chars]), [0.0, 0])  # late, before it
                entry[0] += gap
                entry[1] += 1
        if end > busy_until:
            busy_until, previous = end, name
    ranked = sorted(waits.items(), key=lambda kv: kv[1][0], reverse=True)[:top]
    return {"idle_ms_per_step": idle_us / 1e3 / steps, "min_gap_us": min_us,
            "long_gaps_ms_per_step": long_us / 1e3 / steps,
            "waits": [{"waited_for": late, "after": previous, "ms_per_step": us / 1e3 / steps,
                       "gaps_per_step": n / steps} for (late, previous), (us, n) in ranked]}


def _kernel_spans(prof) -> list[tuple[float, float, str]]:
    """(start us, end us, name) of every device event of a finished profile (kernels, copies, sets)."""
    spans = []
    for event in prof.events():
        device_type = getattr(event, "device_type", None)
        if device_type is not None and getattr(device_type, "name", "") in ("CUDA", "PrivateUse1"):
            spans.append((event.time_range.start, event.time_range.end, event.name))
    return spans


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
    profiled = summarize_kernels(prof.key_averages(), steps, top=top)
    profiled.idle = idle_gaps(_kernel_spans(prof), steps)
    return profiled


def kernel_ms_per_step(step: Callable[[Any], Any], inputs: Sequence[Any], steps: int) -> float | None:
    """Summed device time (kernels and copies) of `steps` calls step(inputs[i % len(inputs)]) under
    torch.profiler, per call, in ms; None without CUDA (nothing runs on a device)."""
    profiled = kernel_profile(step, inputs, steps)
    return None if profiled is None else profiled.ms_per_step
