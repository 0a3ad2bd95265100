"""Where the time of one jagged-attention forward+backward goes, kernel by kernel (torch.profiler).

    python benchmarks/jagged_attention_profile.py [--B 32 --L 2048 --H 8 --D 64 --fill 0.5]

Prints the CUDA time of each kernel over a few steps after warm-up (autotuning excluded).
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import gemcompile.lowering  # noqa: E402,F401


def main() -> None:
    p = argparse.ArgumentParser()
    for name, default in (("B", 32), ("L", 2048), ("H", 8), ("D", 64)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--fill", type=float, default=0.5)
    p.add_argument("--steps", type=int, default=5)
    a = p.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    lengths = torch.randint(1, max(2, int(2 * a.fill * a.L)) + 1, (a.B,), device="cuda", generator=g).clamp(max=a.L)
    q, k, v, do = (torch.randn(a.B, a.H, a.L, a.D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(True)

    def step():
        out = torch.ops.gemcompile.jagged_attention(q, k, v, lengths, lengths, None, False, a.D**-0.5)
        torch.autograd.grad(out, (q, k, v), do)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(a.steps):
            step()
        torch.cuda.synchronize()
    print(f"B{a.B} L{a.L} H{a.H} D{a.D} fill {a.fill}: per step, CUDA time by kernel")
    for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:12]:
        print(f"  {e.device_time_total / a.steps / 1000:8.3f} ms  x{e.count // a.steps:<3d} {e.key[:90]}")


if __name__ == "__main__":
    main()
