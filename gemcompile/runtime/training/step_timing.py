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
    tuning_before = dataclasses.replace(TUNING)
    for step in range(cfg.warmup + cfg.steps):
        if step == cfg.warmup:
            timings.kernel_tuning = {"keys": TUNING.keys - tuning_before.keys,
                                     "seconds": round(TUNING.seconds - tuning_before.seconds, 3),
                                     "parallel_compile_seconds": round(
                                         TUNING.compile_seconds - tuning_before.compile_seconds, 3)}
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
