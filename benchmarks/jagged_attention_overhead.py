"""CPU launch overhead of one jagged-attention forward+backward: eager enqueue time, GPU time, and the
same step replayed from a CUDA graph (what mode="reduce-overhead" would give).

    python benchmarks/jagged_attention_overhead.py [--B 32 --L 2048 --H 8 --D 64 --fill 0.5]
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import gemcompile.lowering  # noqa: E402,F401


def main() -> None:
    p = argparse.ArgumentParser()
    for name, default in (("B", 32), ("L", 2048), ("H", 8), ("D", 64)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--fill", type=float, default=0.5)
    a = p.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    n = torch.randint(1, max(2, int(2 * a.fill * a.L)) + 1, (a.B,), device="cuda", generator=g).clamp(max=a.L)
    q, k, v, do = (torch.randn(a.B, a.H, a.L, a.D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(True)

    def step():
        out = torch.ops.gemcompile.jagged_attention(q, k, v, n, n, None, False, a.D**-0.5)
        return torch.autograd.grad(out, (q, k, v), do)

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    reps = 30
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
    print(f"B{a.B} L{a.L} H{a.H} D{a.D}: eager enqueue {1e3 * (t1 - t0) / reps:.3f} ms/step, eager wall "
          f"{1e3 * (t2 - t0) / reps:.3f} ms/step, CUDA graph replay {start.elapsed_time(end) / reps:.3f} ms/step")


if __name__ == "__main__":
    main()
