"""Do Inductor's GEMM templates with epilogue fusion (max-autotune) pay on GEM-ref medium's token layers?

    python benchmarks/gemm_epilogue.py [--tokens 262144,65536] [--out DIR]

Issue 24, item 3. GEM-ref's token FFN (``s + down(gelu(up(norm(s)))) * valid``, models/gem.py TokenFFN)
and its attention input projection (``qkv(norm(s))``, d -> 3d), at medium's widths (d 512, hidden 1024)
over packed tokens (medium at B 256 fill 0.5 packs about 262k tokens of its long sequence, 65k of its short
one), fp32 parameters under bf16 autocast as the e2e step runs them, forward+backward. Compiled two ways,
each a fresh compile with static shapes:
  default       torch.compile: cuBLAS GEMMs, the norm, GELU, bias and residual in Inductor's own kernels
  max-autotune  torch.compile(options={"max_autotune": True}): Inductor also times its Triton GEMM
                templates (which can take the GELU, bias and residual as a fused epilogue) against cuBLAS
                and keeps the faster per GEMM. mode="max-autotune" would add coordinate-descent tuning of
                every kernel, which is a separate question (bench e2e's @reduce-overhead-cdt) and made the
                compile of this module alone take over two minutes on the H200
Timed as CUDA-graph replays (no host time), median of triton.testing.do_bench; the JSON holds each method's
time, the ratio, the compile seconds and the kernels of one forward+backward (torch.profiler), which say
whether a template won and what it fused.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import bench_ms, environment, graphed, kernel_times, write_json  # noqa: E402

MODES = {"default": {}, "max-autotune": {"options": {"max_autotune": True}}}
"""Method name -> torch.compile keyword arguments."""


class TokenFFN(nn.Module):
    """GEM-ref's token FFN on packed tokens (T, d), the row mask a (T,) float."""

    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d)

    def forward(self, s, valid):
        return s + self.down(F.gelu(self.up(self.norm(s)))) * valid[:, None]


class QKVProjection(nn.Module):
    """The attention input: a norm, then one d -> 3d Linear, split into q, k, v."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, s, valid):
        q, k, v = self.qkv(self.norm(s)).chunk(3, dim=-1)
        return q * valid[:, None], k, v


MODULES = {"token_ffn": lambda d: TokenFFN(d, 2 * d), "qkv_projection": QKVProjection}


def gemm_flops(name: str, T: int, d: int) -> float:
    """Forward+backward GEMM FLOPs (3x the forward's 2*T*K*N)."""
    kn = 2 * d * 2 * d if name == "token_ffn" else d * 3 * d
    return 3 * 2 * T * kn


def run_case(name: str, T: int, d: int) -> dict:
    torch.manual_seed(0)
    module = MODULES[name](d).cuda()
    s = torch.randn(T, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    valid = (torch.rand(T, device="cuda") > 0.01).to(torch.bfloat16)
    grads = None
    rec = {"module": name, "tokens": T, "d": d, "methods": {}}
    for method, kwargs in MODES.items():
        torch._dynamo.reset()
        compiled = torch.compile(module, dynamic=False, **kwargs)

        def step(compiled=compiled):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = compiled(s, valid)
            outs = out if isinstance(out, tuple) else (out,)
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

        entry = rec["methods"].setdefault(method, {})
        try:
            t0 = time.time()
            step()
            torch.cuda.synchronize()
            entry["compile_s"] = round(time.time() - t0, 1)
            got = [p.grad.float().clone() for p in module.parameters()] + [s.grad.float().clone()]
            if grads is None:
                grads = got
            else:  # the same module compiled another way: the same gradients within bf16 rounding
                err = max(float((a - b).norm() / b.norm().clamp_min(1e-12)) for a, b in zip(got, grads))
                entry["grad_rel_err_vs_default"] = err
            replay = graphed(step)
            entry["fwd_bwd_ms"] = bench_ms(replay)
            entry["gemm_tflops"] = gemm_flops(name, T, d) / entry["fwd_bwd_ms"] / 1e9
            entry["kernels"] = kernel_times(replay, top=16)
            print(f"  {name:15s} T {T:7d} {method:13s} {entry['fwd_bwd_ms']:.3f} ms "
                  f"(compile {entry['compile_s']} s)", flush=True)
        except Exception as e:  # noqa: BLE001  (recorded: a failing compile must not lose the other method)
            entry["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            print(f"  {name} T {T} {method} failed: {entry['error'][:200]}", flush=True)
        finally:
            for p in list(module.parameters()) + [s]:
                p.grad = None
            gc.collect()
    a = rec["methods"].get("default", {}).get("fwd_bwd_ms")
    b = rec["methods"].get("max-autotune", {}).get("fwd_bwd_ms")
    rec["max_autotune_speedup"] = a / b if a and b else None
    return rec


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="262144,65536", help="packed token counts, comma-separated")
    parser.add_argument("--dim", type=int, default=512, help="model width d (GEM-ref medium: 512)")
    parser.add_argument("--modules", default=",".join(MODULES), help=f"some of {', '.join(MODULES)}")
    parser.add_argument("--out", default=None, help="directory of the JSON (default: $OUT, else results/)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("benchmarks/gemm_epilogue.py needs a CUDA GPU")
    cases = []
    for name in args.modules.split(","):
        if name not in MODULES:
            sys.exit(f"unknown module {name!r}: expected some of {', '.join(MODULES)}")
        for T in (int(t) for t in args.tokens.split(",")):
            cases.append(run_case(name, T, args.dim))
    payload = {"benchmark": "gemm_epilogue", "environment": environment(), "modes": MODES,
               "timing": "CUDA graph replay of one forward+backward, triton.testing.do_bench median",
               "dtype": "fp32 parameters, bf16 autocast", "cases": cases}
    path = write_json("gemm_epilogue", payload, args.out)
    for c in cases:
        speedup = c["max_autotune_speedup"]
        print(f"{c['module']:15s} T {c['tokens']:7d}  max-autotune / default speedup: {speedup}")
    print(f"results in {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
