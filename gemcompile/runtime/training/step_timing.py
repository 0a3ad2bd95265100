"""The timed steps of the e2e benchmark (runtime/training/e2e_bench.py): warm-up steps (compilation), then
measured steps, each timed alone between device syncs, with Dynamo's graph count around them and the CUDA
peaks of both phases. The compiled state is frozen for Python's collector once the warm-up is done
(gc_policy.py), as a training loop should run.

``run`` is e2e_bench's per-method run: ``cfg`` (warmup, steps), ``device``, ``data``, ``train_step``,
``formula`` and ``window``.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from gemcompile.runtime.training.gc_policy import compiled_state_frozen, freeze_compiled_state
from gemcompile.runtime.training.graph_captures import recording_graph_captures
from gemcompile.runtime.training.triton_compiles import recording_triton_compiles

__all__ = ["Timings", "graph_count", "sync", "timed_steps"]


def graph_count() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@dataclass
class Timings:
    """Wall times of the warm-up and measured steps, and Dynamo's graph count around them."""

    graphs_before: int
    warmup_s: float = 0.0
    graphs_after_warmup: int | None = None
    step_ms: list[float] = field(default_factory=list)
    """Measured steps only."""
    useful: list[float] = field(default_factory=list)
    """Useful FLOPs of each measured step."""
    losses: list[float] = field(default_factory=list)
    """Every step's loss, warm-up included."""
    peak_warmup_bytes: int | None = None
    """CUDA peak allocated over the warm-up steps (compilation and autotuning included)."""
    peak_steady_bytes: int | None = None
    """CUDA peak allocated over the measured steps alone: what training needs once compiled."""
    triton_compiles: list = field(default_factory=list)
    """Kernels the Triton JIT compiled inside measured steps, as (step, kernel name) (triton_compiles.py)."""
    graph_captures: list = field(default_factory=list)
    """CUDA graphs captured inside measured steps, as (step, captures) for the steps with any
    (graph_captures.py; CUDA-graph trees under mode="reduce-overhead")."""
    kernel_tuning: dict = field(default_factory=dict)
    """Our Triton kernels' autotuning over the warm-up (lowering/common/tuned_launch.TUNING): tuning keys,
    seconds (compile and timing of the configs), of which the parallel compile; part of compile_s."""
    compile_phases: dict = field(default_factory=dict)
    """Where the warm-up's compile time went: ``torch_s``, torch's own compile-phase timers over the warm-up
    (torch._dynamo.utils.compilation_time_metrics, seconds per phase; phases nest, so they do not add up),
    and ``gemcompile_passes_s``, seconds per gemcompile pass (passes/base.PASS_SECONDS; inside torch's
    phases)."""


def compile_phase_seconds() -> tuple[dict[str, float], dict[str, float]]:
    """(torch's compile-phase seconds so far, gemcompile's pass seconds so far), this process."""
    from torch._dynamo.utils import compilation_time_metrics

    from gemcompile.passes.base import PASS_SECONDS

    return {k: sum(v) for k, v in compilation_time_metrics.items()}, dict(PASS_SECONDS)


def compile_phases_since(before: tuple[dict[str, float], dict[str, float]], at_least_s: float = 0.05) -> dict:
    """The seconds added to each phase and pass since ``before`` (compile_phase_seconds), phases of at least
    ``at_least_s`` only, largest first."""
    def grown(now: dict[str, float], then: dict[str, float]) -> dict[str, float]:
        added = {k: v - then.get(k, 0.0) for k, v in now.items()}
        return {k: round(v, 3) for k, v in sorted(added.items(), key=lambda kv: -kv[1]) if v >= at_least_s}

    torch_now, passes_now = compile_phase_seconds()
    return {"torch_s": grown(torch_now, before[0]), "gemcompile_passes_s": grown(passes_now, before[1])}


def _tuned_since(before: dict) -> dict:
    """Per kernel: keys tuned, seconds and configs timed since ``before`` (TUNING.by_kernel's copy)."""
    from gemcompile.lowering.common.tuned_launch import TUNING

    out = {}
    for name, (keys, seconds, configs) in TUNING.by_kernel.items():
        k0, s0, c0 = before.get(name, (0, 0.0, 0))
        if keys > k0:
            out[name] = {"keys": keys - k0, "seconds": round(seconds - s0, 3), "configs": configs - c0}
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["seconds"]))


def timed_steps(run: Any) -> Timings:
    """warmup + steps training steps, each timed alone (device synced before and after)."""
    timings = Timings(graphs_before=graph_count())
    with compiled_state_frozen():
        _run_steps(run, timings)
    if run.device.type == "cuda":
        timings.peak_steady_bytes = torch.cuda.max_memory_allocated()
    return timings


def _run_steps(run: Any, timings: Timings) -> None:
    from gemcompile.lowering.common.tuned_launch import TUNING

    cfg, device = run.cfg, run.device
    tuning_before = dataclasses.replace(TUNING, by_kernel={k: list(v) for k, v in TUNING.by_kernel.items()})
    phases_before = compile_phase_seconds()
    for step in range(cfg.warmup + cfg.steps):
        if step == cfg.warmup:
            timings.compile_phases = compile_phases_since(phases_before)
            timings.kernel_tuning = {"keys": TUNING.keys - tuning_before.keys,
                                     "seconds": round(TUNING.seconds - tuning_before.seconds, 3),
                                     "parallel_compile_seconds": round(
                                         TUNING.compile_seconds - tuning_before.compile_seconds, 3),
                                     "by_kernel": _tuned_since(tuning_before.by_kernel)}
            timings.graphs_after_warmup = graph_count()
            freeze_compiled_state()  # no full collection over the compiled state inside a measured step
            if device.type == "cuda":  # the compile's transients (autotuning buffers): the warm-up's peak
                timings.peak_warmup_bytes = torch.cuda.max_memory_allocated()
                torch.cuda.reset_peak_memory_stats()
        cpu_batch = run.data.batch(step)
        batch = cpu_batch.to(device)
        sync(device)
        compiled: list[str] = []
        captures: list[int] = []
        t0 = time.perf_counter()
        with recording_triton_compiles(compiled), recording_graph_captures(captures):
            logits, loss_value = run.train_step(batch)
            sync(device)
        elapsed = time.perf_counter() - t0
        timings.losses.append(loss_value)
        if step < cfg.warmup:
            timings.warmup_s += elapsed
            continue
        timings.step_ms.append(1e3 * elapsed)
        timings.triton_compiles += [(step - cfg.warmup, name) for name in compiled]
        if captures:
            timings.graph_captures.append((step - cfg.warmup, len(captures)))
        timings.useful.append(run.formula.train_flops(cpu_batch.seq_lengths, run.batch_size))
        run.window.update(logits.detach().float(), batch.labels, batch.label_mask)
