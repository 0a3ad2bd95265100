"""Where one e2e training step's GPU time and GPU idle time go, op by op (a diagnostic, not a benchmark).

    python benchmarks/e2e_profile.py --size medium --batch-size 256 --method gem --out $OUT

Trains a fresh GEM-ref the way `gemcompile bench e2e` does (same batches, same optimizers), then profiles
``--steps`` steps with host and device activity and writes a JSON with:
  ops:  the host ops (aten, gemcompile, Inductor's kernel launches) whose launched kernels take the most
        device time, with their input shapes: which op a kernel of the bench's top list belongs to;
  idle: the GPU's idle time (no kernel running) split by the host ops that were running meanwhile, each
        gap's time given to the innermost op open at each instant: what the host was doing while the GPU
        waited for it;
and, with ``--trace``, the profiler's Chrome trace (gzip) for a closer look.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import write_json  # noqa: E402

from gemcompile.runtime.training.e2e_bench import E2EBenchConfig, start_method  # noqa: E402


def _device_us(event) -> float:
    return getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0.0)


def device_time_by_op(prof, steps: int, top: int) -> list[dict]:
    rows = [e for e in prof.key_averages(group_by_input_shape=True) if _device_us(e) > 0
            and getattr(getattr(e, "device_type", None), "name", "CPU") == "CPU"]
    rows.sort(key=_device_us, reverse=True)
    return [{"op": e.key[:120], "shapes": str(e.input_shapes)[:300], "device_ms_per_step": _device_us(e) / 1e3 / steps,
             "calls_per_step": e.count / steps} for e in rows[:top]]


_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
_HOST_CATS = ("cpu_op", "user_annotation", "python_function", "cuda_runtime", "cuda_driver")


def _busy_gaps(spans, min_us: float) -> list[tuple[float, float]]:
    spans = sorted(spans)
    gaps, busy_until = [], spans[0][1] if spans else 0.0
    for start, end in spans[1:]:
        if start - busy_until >= min_us:
            gaps.append((busy_until, start))
        busy_until = max(busy_until, end)
    return gaps


def idle_by_host_op(trace_events: list[dict], steps: int, top: int, min_us: float = 20.0) -> dict:
    """GPU idle time in gaps >= min_us (from a Chrome trace's events), given at each instant to the
    innermost host op open then (the latest-started one, any thread)."""
    complete = [e for e in trace_events if e.get("ph") == "X" and "dur" in e]
    gaps = _busy_gaps([(e["ts"], e["ts"] + e["dur"]) for e in complete if e.get("cat") in _DEVICE_CATS], min_us)
    host = sorted(((e["ts"], e["ts"] + e["dur"], e["name"]) for e in complete
                   if e.get("cat") in _HOST_CATS and e["dur"] > 0), key=lambda h: (h[0], -h[1]))
    totals: dict[str, float] = {}
    active: list[tuple[float, float, str]] = []  # host ops open at some instant of the current gap
    j = 0
    for g0, g1 in gaps:  # gaps and ops both in time order: one sweep
        while j < len(host) and host[j][0] < g1:
            active.append(host[j])
            j += 1
        active = [h for h in active if h[1] > g0]
        t = g0
        while t < g1:  # 5 us samples
            inner = max((h for h in active if h[0] <= t < h[1]), key=lambda h: h[0], default=None)
            name = inner[2][:100] if inner else "(no host op)"
            dt = min(5.0, g1 - t)
            totals[name] = totals.get(name, 0.0) + dt
            t += dt
    ranked = sorted(totals.items(), key=lambda kv: kv[1], reverse=True)[:top]
    return {"gaps_per_step": len(gaps) / steps, "idle_ms_per_step": sum(b - a for a, b in gaps) / 1e3 / steps,
            "min_gap_us": min_us, "by_innermost_host_op": [{"op": k, "ms_per_step": v / 1e3 / steps} for k, v in ranked]}


def _trace_events(prof, path: Path) -> list[dict]:
    prof.export_chrome_trace(str(path))
    with open(path) as f:
        return json.load(f)["traceEvents"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="medium")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--fill", type=float, default=0.5)
    parser.add_argument("--method", default="gem")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--top", type=int, default=80)
    parser.add_argument("--trace", action="store_true", help="also write the Chrome trace (gzip)")
    parser.add_argument("--device", default="cuda", help="cpu only to try the script (no device times)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    cfg = E2EBenchConfig(size=args.size, batch_size=args.batch_size, fill=args.fill, methods=[args.method],
                         warmup=args.warmup, steps=args.steps, device=args.device)
    run = start_method(cfg, args.method)
    for i in range(args.warmup):
        run.train_step(run.data.batch(i).to(run.device))
    batches = [run.data.batch(args.warmup + i).to(run.device) for i in range(args.steps)]
    sync = torch.cuda.synchronize if run.device.type == "cuda" else (lambda: None)
    sync()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        for batch in batches:
            run.train_step(batch)
        sync()
    raw = Path(args.out or "/tmp") / f"e2e_profile-{args.size}-{args.method}.trace.json"
    if os.environ.get("OUT"):
        raw = Path(os.environ["OUT"]) / raw.name
    events = _trace_events(prof, raw)
    payload = {"config": vars(args), "ops": device_time_by_op(prof, args.steps, args.top),
               "idle": idle_by_host_op(events, args.steps, args.top)}
    path = write_json(f"e2e_profile-{args.size}-{args.method}", {"benchmark": "e2e_profile", **payload}, args.out)
    print(f"wrote {path}")
    for row in payload["ops"][:30]:
        print(f"{row['device_ms_per_step']:8.3f} ms {row['calls_per_step']:6.1f}x  {row['op']}  {row['shapes'][:100]}")
    print(f"idle {payload['idle']['idle_ms_per_step']:.2f} ms/step in {payload['idle']['gaps_per_step']:.0f} gaps")
    for row in payload["idle"]["by_innermost_host_op"][:30]:
        print(f"{row['ms_per_step']:8.3f} ms  {row['op']}")
    if args.trace:
        with open(raw, "rb") as src, gzip.open(str(raw) + ".gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
    raw.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
