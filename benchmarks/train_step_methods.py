"""Timing one model's training step under several compile methods, for the small model benchmarks
(masked_item_loss.py, din_pooling.py): each method compiled anew on the same batches, its step timed with CUDA
events (median after a warm-up), its GPU time per step from torch.profiler, its peak memory and first loss, and
its ratio against torch.compile in the same mode written into the result row.

A method is ``inductor`` (torch.compile) or one of gemcompile's, with ``-cudagraphs`` appended for
mode="reduce-overhead"; the script supplies how to compile a gemcompile method and how to run one step.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from harness import environment, results_path, rewrite_results

from gemcompile import explain
from gemcompile.runtime.training.kernel_time import kernel_profile


def add_step_arguments(parser, methods: str) -> None:
    """The options every such benchmark takes: batches, timed steps, warm-up, methods, output folder."""
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--methods", default=methods)
    parser.add_argument("--out", default=None)


def prepare(parser, name: str, make_batch: Callable) -> tuple:
    """(args, device, results path, the batches, the JSON payload with no rows yet): the options parsed, the
    GPU if there is one, ``--batches`` batches from ``make_batch(args, generator, device)`` seeded with 0."""
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator().manual_seed(0)
    batches = [make_batch(args, g, device) for _ in range(args.batches)]
    return args, device, results_path(name, args.out), batches, {"environment": environment(), "args": vars(args),
                                                                  "rows": []}


def record_explain(row: dict, model, *inputs) -> None:
    """explain's rewrite counts and refusals of the model on one batch, into the result row."""
    report = explain(model, *inputs)
    row["explain"] = {k: v for k, v in report.counts.items() if v}
    row["explain_refusals"] = [f"{r.pass_name}: {r.reason}" for r in report.refusals]


def autocast_step(fn, model, inputs, device):
    """One training step: gradients set to None, forward under bf16 autocast (CUDA), backward; the loss."""
    for p in model.parameters():
        p.grad = None
    torch.compiler.cudagraph_mark_step_begin()  # a new step for CUDA graph trees; a no-op otherwise
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        loss = fn(*inputs)
    loss.backward()
    return loss


def cuda_graph_mode(method: str) -> str | None:
    """The torch.compile mode a method name asks for."""
    return "reduce-overhead" if method.endswith("-cudagraphs") else None


def median_step_ms(step: Callable, batches: list, warmup: int, steps: int, device) -> tuple[float, float]:
    """(median ms of ``step(batch)`` over ``steps`` after ``warmup``, the first step's loss)."""
    first = float(step(batches[0]).detach())
    for i in range(warmup):
        step(batches[i % len(batches)])
    times = []
    for i in range(steps):
        batch = batches[i % len(batches)]
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step(batch)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            step(batch)
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), first


def measure_methods(row: dict, methods: list[str], compile_gem: Callable, model, step: Callable, batches: list,
                    args, device, path, payload) -> None:
    """Each method's ``<method>_ms``, ``_first_loss``, ``_compile_s``, ``_kernel_ms``, ``_profile``,
    ``_peak_gib`` and ``speedup_<method>_vs_inductor`` into ``row``; the JSON rewritten after each.
    ``compile_gem(model, method, mode)`` compiles a gemcompile method; ``step(fn, batch)`` runs one step
    (``autocast_step`` on the batch's inputs)."""
    for method in methods:
        torch._dynamo.reset()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        mode = cuda_graph_mode(method)
        fn = torch.compile(model, mode=mode) if method.startswith("inductor") else compile_gem(model, method, mode)
        t0 = time.perf_counter()
        step(fn, batches[0])
        row[f"{method}_compile_s"] = time.perf_counter() - t0
        row[f"{method}_ms"], row[f"{method}_first_loss"] = median_step_ms(
            lambda b: step(fn, b), batches, args.warmup, args.steps, device)
        profiled = kernel_profile(lambda b: step(fn, b), batches, steps=3, top=8)
        if profiled is not None:
            row[f"{method}_kernel_ms"] = profiled.ms_per_step
            row[f"{method}_profile"] = profiled.as_json()
        if device.type == "cuda":
            row[f"{method}_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        peer = "inductor-cudagraphs" if mode else "inductor"
        if f"{peer}_ms" in row and not method.startswith("inductor"):  # (each mode against inductor's)
            row[f"speedup_{method}_vs_inductor"] = row[f"{peer}_ms"] / row[f"{method}_ms"]
        rewrite_results(path, payload)
