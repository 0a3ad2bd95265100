"""One Adam step over GEM-ref's dense weights: torch's fused Adam against TritonAdam (one Triton launch), with a
plain copy of the same bytes as the bandwidth reference.

    python benchmarks/adam_step.py [--size medium] [--reps 30]     (CUDA; --smoke: CPU interpreter, tiny)

The parameters are GEM-ref's non-embedding parameters (1.05B fp32 at medium, 380 tensors) with random
gradients; each method steps the same tensors (the values drift, which does not change the work). Adam moves
28 bytes a parameter (parameter, gradient, two moments read; parameter, two moments written): the GB/s column
is that over the median step (CUDA events through triton.testing.do_bench). The copy moves 8 bytes a
parameter (one fp32 buffer of all of them read and written). Writes benchmarks/results/adam_step-*.json.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gemcompile.models.gem import GemRef, gem_ref_config
from gemcompile.runtime.training.adam import TritonAdam
from gemcompile.runtime.training.results import environment, write_results


def dense_shapes(size: str) -> list[tuple[int, ...]]:
    """The shapes of GEM-ref's parameters that build_optimizers gives to Adam (all but the tables)."""
    with torch.device("meta"):
        model = GemRef(gem_ref_config(size))
    tables = {id(p) for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) for p in m.parameters()}
    return [tuple(p.shape) for p in model.parameters() if id(p) not in tables]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="medium")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--smoke", action="store_true", help="CPU, GEM-ref tiny, correctness of the run only")
    args = ap.parse_args()
    device = "cpu" if args.smoke else "cuda"
    size = "tiny" if args.smoke else args.size
    shapes = dense_shapes(size)
    n = sum(torch.Size(s).numel() for s in shapes)
    params = [nn.Parameter(torch.randn(s, device=device)) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p)

    if args.smoke:
        import time

        def bench(fn):
            fn()
            t0 = time.perf_counter()
            fn()
            return 1e3 * (time.perf_counter() - t0)
    else:
        from triton.testing import do_bench

        def bench(fn):
            fn()
            torch.cuda.synchronize()
            return do_bench(fn, warmup=3, rep=args.reps, return_mode="median")

    rows = []
    torch_name = "torch_cpu" if args.smoke else "torch_fused"
    methods = {
        torch_name: lambda: torch.optim.Adam(params, lr=1e-4, fused=not args.smoke),
        "triton_adam": lambda: TritonAdam(params, lr=1e-4),
    }
    for name, make in methods.items():
        opt = make()
        ms = bench(opt.step)
        rows.append({"method": name, "ms": ms, "gb_per_s": 28 * n / ms / 1e6})
        print(rows[-1], flush=True)
        del opt
    src = torch.empty(n, device=device)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    rows.append({"method": "copy", "ms": ms, "gb_per_s": 8 * n / ms / 1e6})
    print(rows[-1], flush=True)
    fused = rows[0]["ms"]
    payload = {
        "benchmark": "adam_step", "environment": environment(),
        "config": {"size": size, "tensors": len(shapes), "parameters": n, "reps": args.reps, "smoke": args.smoke},
        "conventions": {"gb_per_s": "28 bytes a parameter for Adam, 8 for the copy, over the median ms",
                        "speedup_vs_torch_fused": "the first row's ms (torch's fused Adam; its CPU default under "
                                                  "--smoke) / this method's ms"},
        "results": [{**r, "speedup_vs_torch_fused": fused / r["ms"]} for r in rows],
    }
    print("wrote", write_results("adam_step" + ("-smoke" if args.smoke else ""), payload,
                                 out_dir="/tmp" if args.smoke else None))


if __name__ == "__main__":
    main()
