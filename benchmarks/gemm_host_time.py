"""Host time of one cuBLAS GEMM call when its row count M is new, as packed tokens make it every step.

    python benchmarks/gemm_host_time.py --out $OUT

For the (K, N) of GEM-ref medium's token-wise Linears, bf16, with and without a bias (addmm takes
cuBLASLt's bias epilogue, mm plain cuBLAS), the host's wall time of one call (the GPU idle before it, so
the host is what is timed) for: an M never seen before, an M seen before, and an M from a small set of
multiples of 4096 after warm-up. Each under each ``torch.backends.cuda.preferred_blas_library``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import write_json  # noqa: E402

SHAPES = [(128, 512), (512, 512), (512, 1024), (1024, 512), (512, 128)]


def _call_us(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    us = 1e6 * (time.perf_counter() - t0)
    torch.cuda.synchronize()
    return us


def measure(k: int, n: int, bias: bool, rng: random.Random, calls: int) -> dict:
    dev = torch.device("cuda")
    big = torch.randn(300_000, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(k, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, device=dev, dtype=torch.bfloat16)

    def gemm(m):
        a = big[:m]
        return (lambda: torch.addmm(b, a, w)) if bias else (lambda: torch.mm(a, w))

    new_ms = [rng.randrange(50_000, 290_000) for _ in range(calls)]
    new = [_call_us(gemm(m)) for m in new_ms]
    seen = [_call_us(gemm(m)) for m in new_ms]
    buckets = [4096 * rng.randrange(12, 70) for _ in range(calls)]
    for m in sorted(set(buckets)):
        _call_us(gemm(m))
    bucketed = [_call_us(gemm(m)) for m in buckets]
    return {"k": k, "n": n, "bias": bias, "new_m_us": statistics.median(new), "new_m_max_us": max(new),
            "new_m_mean_us": statistics.mean(new), "seen_m_us": statistics.median(seen),
            "bucketed_m_us": statistics.median(bucketed)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    rows = []
    for library in ("cublaslt", "cublas"):
        torch.backends.cuda.preferred_blas_library(library)
        rng = random.Random(0)
        for k, n in SHAPES:
            for bias in (True, False):
                row = {"library": library, **measure(k, n, bias, rng, args.calls)}
                rows.append(row)
                print(row, flush=True)
    path = write_json("gemm_host_time", {"benchmark": "gemm_host_time", "rows": rows}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
