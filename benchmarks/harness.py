"""Shared helpers of the gemcompile benchmarks: timing, the environment record, JSON results, a table.

Timing is ``triton.testing.do_bench`` (median of many runs after warm-up; do_bench also flushes L2
between runs). ``bench_ms`` can rotate among several input sets so that L2 does not flatter small
shapes either. Results go to ``$OUT/<name>-<date>.json`` when OUT is set (the GPU machine copies OUT
back), else to ``--out DIR``, else to ``benchmarks/results/``.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import shlex
import sys
from pathlib import Path
from typing import Callable, Sequence

__all__ = [
    "bench_ms",
    "rotation_count",
    "environment",
    "results_path",
    "write_json",
    "tflops",
    "format_table",
    "graphed",
]

RESULTS_DIR = Path(__file__).resolve().parent / "results"


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


def environment() -> dict:
    """GPU, versions, date and the exact command line of this run."""
    import torch

    env = {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "host": platform.node(),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception as e:  # pragma: no cover - triton missing
        env["triton"] = f"unavailable: {e}"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        env.update(
            gpu=props.name,
            gpu_count=torch.cuda.device_count(),
            sm_count=props.multi_processor_count,
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            capability=".".join(map(str, torch.cuda.get_device_capability())),
        )
    else:
        env["gpu"] = None
    return env


def results_path(name: str, out_dir: str | os.PathLike | None = None) -> Path:
    """$OUT wins over out_dir, which wins over benchmarks/results/."""
    base = Path(os.environ["OUT"]) if os.environ.get("OUT") else Path(out_dir) if out_dir else RESULTS_DIR
    base.mkdir(parents=True, exist_ok=True)
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    return base / f"{name}-{stamp}.json"


def write_json(name: str, payload: dict, out_dir: str | os.PathLike | None = None) -> Path:
    path = results_path(name, out_dir)
    with open(path, "w") as fh:
        json.dump(payload, fh, indent=1, default=str)
    return path


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
