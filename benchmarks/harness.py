"""Shared helpers of the gemcompile benchmarks: timing, the environment record, JSON results, a table.

Results files are written only through the package's one writer
(``gemcompile/runtime/training/results.py``: ``write_json``/``write_results`` for a new file,
``rewrite_results`` to update it after every shape), which adds the environment block (GPU, driver,
torch, triton, CUDA, git commit and dirty flag, source digest, UTC date, host, the exact command,
whether the machine was shared).

Timing is ``triton.testing.do_bench`` (median of many runs after warm-up; do_bench also flushes L2
between runs). ``bench_ms`` can rotate among several input sets so that L2 does not flatter small
shapes either. Results go to ``$OUT/<name>-<date>.json`` when OUT is set (the GPU machine copies OUT
back), else to ``--out DIR``, else to ``benchmarks/results/``.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Callable, Sequence

__all__ = [
    "bench_ms",
    "rotation_count",
    "environment",
    "results_path",
    "write_json",
    "write_results",
    "rewrite_results",
    "tflops",
    "format_table",
    "graphed",
    "kernel_times",
]


def bench_ms(
    fns: Callable[[], object] | Sequence[Callable[[], object]], warmup_ms: int = 25, rep_ms: int = 100
) -> float:
    """Median milliseconds of one call. A sequence of callables is called in rotation (distinct inputs)."""
    import triton

    if callable(fns):
        fns = [fns]
    fns = list(fns)
    state = {"i": 0}

    def call():
        fns[state["i"] % len(fns)]()
        state["i"] += 1

    return float(triton.testing.do_bench(call, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def rotation_count(bytes_per_set: int, l2_bytes: int | None = None, most: int = 4) -> int:
    """How many input sets to rotate so that together they overflow L2 (1 for large inputs)."""
    if l2_bytes is None:
        l2_bytes = _l2_bytes()
    if bytes_per_set <= 0:
        return most
    return max(1, min(most, math.ceil(3 * l2_bytes / bytes_per_set)))


def _l2_bytes() -> int:
    try:
        import torch

        return int(torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size)
    except Exception:
        return 50 * 2**20


def _load_writer():
    """The package's results writer (gemcompile/runtime/training/results.py), loaded from its file: it
    imports nothing of gemcompile, so a script that times another source tree (refactor_ab.py) can use it
    without importing this tree's package."""
    import importlib.util

    name = "_gemcompile_results_writer"
    if name not in sys.modules:
        path = Path(__file__).resolve().parent.parent / "gemcompile" / "runtime" / "training" / "results.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


_writer = _load_writer()
environment = _writer.environment  # GPU, driver, versions, git commit, date, host, command, machine_shared
results_path = _writer.results_path  # $OUT, else --out, else benchmarks/results/; a UTC stamp in the name
write_results = _writer.write_results  # a new stamped file, environment block included
rewrite_results = _writer.rewrite_results  # the same file again (a run that writes after every shape)


def write_json(name: str, payload: dict, out_dir: str | os.PathLike | None = None) -> Path:
    """The one writer (gemcompile.runtime.training.results.write_results)."""
    return write_results(name, payload, out_dir)


def tflops(flops: float | None, ms: float | None) -> float | None:
    if not flops or not ms or not math.isfinite(ms) or ms <= 0:
        return None
    return flops / ms / 1e9


def format_table(rows: Sequence[dict], columns: Sequence[tuple[str, str, str]]) -> str:
    """rows of dicts -> aligned text; columns = (key, header, format spec such as '.2f' or 's')."""

    def cell(row, key, spec):
        value = row.get(key)
        if value is None or (isinstance(value, float) and not math.isfinite(value)):
            return "-"
        return format(value, spec)

    table = [[header for _, header, _ in columns]] + [[cell(r, k, s) for k, _, s in columns] for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def graphed(fn):
    """fn captured once into a CUDA graph (call it eagerly first); the replay has no Python, dispatch or
    launch overhead, as under torch.compile(mode="reduce-overhead"). A method that syncs with the host
    (NJT's offsets) cannot be captured and reports the error."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def kernel_times(fn, reps: int = 5, top: int = 12) -> list[dict]:
    """GPU microseconds per call of each kernel of fn (torch.profiler), the `top` largest first."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    rows = [{"kernel": e.key[:90], "us": e.device_time_total / reps, "calls": e.count / reps}
            for e in prof.key_averages() if e.device_time_total > 0]
    return sorted(rows, key=lambda r: -r["us"])[:top]
