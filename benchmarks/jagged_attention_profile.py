"""Where the time of one jagged-attention forward+backward goes: the GPU time of each kernel
(torch.profiler), the eager step time (CPU enqueue and wall) and the same step replayed from a CUDA
graph (what mode="reduce-overhead" would give: no Python or launch overhead), and where the CPU time of
an eager step goes (enqueue time of each layer of the call, and the top functions under cProfile).

    python benchmarks/jagged_attention_profile.py [--B 32 --L 2048 --H 8 --D 64 --fill 0.5] [--cprofile] [--out DIR]

What it prints also goes to ``jagged_attention-profile-<stamp>.json`` through the one results writer
(harness.write_json: $OUT, else --out, else benchmarks/results/): nothing of it is typed in by hand.
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import write_json  # noqa: E402

import gemcompile.lowering  # noqa: E402,F401


def make_inputs(a):
    g = torch.Generator(device="cuda").manual_seed(0)
    n = torch.randint(1, max(2, int(2 * a.fill * a.L)) + 1, (a.B,), device="cuda", generator=g).clamp(max=a.L)
    q, k, v, do = (torch.randn(a.B, a.H, a.L, a.D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    return n, q, k, v, do


def enqueue_us(fn, reps: int = 200) -> float:
    """CPU microseconds to enqueue one call (the GPU is not waited for inside the timed loop)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return 1e6 * (t1 - t0) / reps


def layer_costs(a) -> dict:
    """Enqueue time of each layer: raw launchers, the custom ops, autograd around them."""
    from gemcompile.lowering.jagged_attention import triton as jt

    n, q, k, v, do = make_inputs(a)
    s = a.D**-0.5
    out, lse = jt.jagged_attention_forward_triton(q, k, v, n, n, None, False, s)
    qg, kg, vg = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    rows = {
        "launcher forward (3 torch allocs, argsort, 1 Triton launch)":
            lambda: jt.jagged_attention_forward_triton(q, k, v, n, n, None, False, s),
        "launcher backward (allocs, argsort, 3 Triton launches)":
            lambda: jt.jagged_attention_backward_triton(do, q, k, v, out, lse, n, n, None, False, s, False),
        "op jagged_attention_fwd, no grad":
            lambda: torch.ops.gemcompile.jagged_attention_fwd(q, k, v, n, n, None, False, s),
        "op jagged_attention_bwd":
            lambda: torch.ops.gemcompile.jagged_attention_bwd(do, q, k, v, out, lse, n, n, None, False, s, False),
        "autograd step, public op (eager autograd.Function path)":
            lambda: torch.autograd.grad(
                torch.ops.gemcompile.jagged_attention(qg, kg, vg, n, n, None, False, s), (qg, kg, vg), do),
        "autograd step through the custom ops (register_autograd)":
            lambda: torch.autograd.grad(
                torch.ops.gemcompile.jagged_attention_fwd(qg, kg, vg, n, n, None, False, s)[0], (qg, kg, vg), do),
        "one torch.empty": lambda: torch.empty(16, device="cuda"),
        "one argsort": lambda: torch.argsort(n, descending=True),
    }
    costs = {}
    for name, fn in rows.items():
        costs[name] = enqueue_us(fn)
        print(f"  {costs[name]:8.1f} us  {name}")
    return costs


def cprofile_step(step, reps: int = 200) -> list[dict]:
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(reps):
        step()
    prof.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(prof).sort_stats("tottime")
    stats.print_stats(25)
    top = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:25]  # (file, line, fn) -> (cc, nc, tt, ct, ...)
    return [{"function": f"{f}:{line}({fn})", "calls_per_step": nc / reps, "tottime_us_per_step": 1e6 * tt / reps,
             "cumtime_us_per_step": 1e6 * ct / reps} for (f, line, fn), (cc, nc, tt, ct, _) in top]


def make_step(a):
    n, q, k, v, do = make_inputs(a)
    for t in (q, k, v):
        t.requires_grad_(True)

    def step():
        out = torch.ops.gemcompile.jagged_attention(q, k, v, n, n, None, False, a.D**-0.5)
        return torch.autograd.grad(out, (q, k, v), do)

    return step


def kernel_times(step, steps: int) -> list[dict]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    rows = []
    for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:8]:
        rows.append({"kernel": e.key, "ms_per_step": e.device_time_total / steps / 1000,
                     "calls_per_step": e.count // steps})
        print(f"  {rows[-1]['ms_per_step']:8.3f} ms  x{e.count // steps:<3d} {e.key[:90]}")
    return rows


def step_times(step, reps: int) -> tuple[float, float, float]:
    t0 = time.perf_counter()
    for _ in range(reps):
        step()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * (t1 - t0) / reps, 1e3 * (t2 - t0) / reps, start.elapsed_time(end) / reps


def main() -> None:
    p = argparse.ArgumentParser()
    for name, default in (("B", 32), ("L", 2048), ("H", 8), ("D", 64)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--fill", type=float, default=0.5)
    p.add_argument("--cprofile", action="store_true", help="also: enqueue cost per layer and a cProfile table")
    p.add_argument("--out", default=None, help="directory of the JSON (default: $OUT, else benchmarks/results/)")
    a = p.parse_args()
    step = make_step(a)
    for _ in range(5):  # autotune and warm up
        step()
    torch.cuda.synchronize()
    print(f"B{a.B} L{a.L} H{a.H} D{a.D} fill {a.fill}: GPU time per step by kernel")
    payload = {"benchmark": "jagged_attention_profile", "dtype": "bfloat16", "causal": False,
               "shape": {"B": a.B, "L": a.L, "H": a.H, "D": a.D, "fill": a.fill},
               "kernel_ms_per_fwd_bwd_step": kernel_times(step, 5)}
    enqueue, wall, graph = step_times(step, 30)
    payload["step_ms"] = {"eager_enqueue": enqueue, "eager_wall": wall, "cuda_graph_replay": graph}
    print(f"  eager enqueue {enqueue:.3f} ms/step, eager wall {wall:.3f} ms/step, CUDA graph replay {graph:.3f} ms/step")
    if a.cprofile:
        print("CPU enqueue time per call, by layer")
        payload["enqueue_us_per_call"] = layer_costs(a)
        payload["cprofile_top"] = cprofile_step(step)
    print(f"results in {write_json('jagged_attention-profile', payload, a.out)}")


if __name__ == "__main__":
    main()
