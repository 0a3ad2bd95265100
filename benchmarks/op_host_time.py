"""Host time of one attention op call on CUDA: what a host-bound step pays per call, and where it goes.

    python benchmarks/op_host_time.py --out $OUT

For gemcompile::jagged_attention_fwd and _bwd (called as the compiled graph calls them: through
torch.ops, with and without a kv_mask and the plan tensors the graph passes), the host's wall time per
call (no synchronization inside the timed loop; the GPU work is small, so the host is what is timed) and
the top functions of one cProfile run by cumulative time. Shape ``--batch`` x ``--heads`` x ``--length``
x ``--head-dim``, bf16.

Breakdown of one call (``<part>_breakdown_us``), each timed the same way:
  op:        torch.ops.gemcompile.<op> (dispatcher, custom-op wrappers, checks, launcher, launches);
  cuda_impl: the op's registered CUDA function called directly (checks, launcher, launches);
  launcher:  the Triton launcher function called directly (allocation, argument building, launches);
  in_run:    of ``op``, the time spent inside triton's JITFunction.run (the launches themselves);
  direct:    the same launches through each kernel's CompiledKernel[grid](*args) (no binder, no cache key):
             what a launch costs below JITFunction.run.
And ``key_bounds``: the host time of one gemcompile::key_bounds call (2 launches).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE.parent))
sys.path.insert(0, str(_HERE))

from harness import environment, results_path, rewrite_results  # noqa: E402

import gemcompile.lowering  # noqa: E402,F401  (registers the ops)

ops = torch.ops.gemcompile


def _host_us(fn, calls: int) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return host


def _cprofile(fn, calls: int, top: int) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(top)
    return text.getvalue()


class _RunTimer:
    """Accumulates the time spent inside triton's JITFunction.run and keeps each launch's compiled kernel,
    grid and bound arguments (to replay them through CompiledKernel[grid])."""

    def __init__(self):
        from triton.runtime.jit import JITFunction

        self.cls, self.original, self.seconds, self.launches, self.record = JITFunction, JITFunction.run, 0.0, [], False
        timer = self

        def run(fn, *args, grid, warmup, **kwargs):
            t0 = time.perf_counter()
            kernel = timer.original(fn, *args, grid=grid, warmup=warmup, **kwargs)
            timer.seconds += time.perf_counter() - t0
            if timer.record and kernel is not None and not warmup:
                device = torch.cuda.current_device()
                bound, _, _ = fn.device_caches[device][4](*args, **kwargs)
                values = tuple(bound.values())
                g = grid(bound) if callable(grid) else grid
                g = tuple(g) + (1,) * (3 - len(g))
                timer.launches.append((kernel, g, values))
            return kernel

        JITFunction.run = run

    def restore(self):
        self.cls.run = self.original


def _breakdown(fn, cuda_impl, launcher, calls: int) -> dict:
    timer = _RunTimer()
    try:
        out = {"op": _host_us(fn, calls)}
        timer.seconds = 0.0
        t_calls = calls
        for _ in range(t_calls):
            fn()
        torch.cuda.synchronize()
        out["in_run"] = timer.seconds / t_calls * 1e6
        out["cuda_impl"] = _host_us(cuda_impl, calls)
        out["launcher"] = _host_us(launcher, calls)
        timer.record, timer.launches = True, []
        fn()
        timer.record = False
    finally:
        timer.restore()
    launches = list(timer.launches)

    def direct():
        for kernel, g, values in launches:
            kernel[g](*values)

    try:
        out["direct"] = _host_us(direct, calls)
        out["launches_per_call"] = len(launches)
    except Exception as e:  # noqa: BLE001  (an API this triton lacks: recorded, the rest stands)
        out["direct_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    print("   breakdown us:", {k: round(v, 1) if isinstance(v, float) else v for k, v in out.items()}, flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dev = torch.device("cuda")
    B, H, L, D = args.batch, args.heads, args.length, args.head_dim
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D, generator=g).to(dev, torch.bfloat16) for _ in range(3))
    lengths = torch.randint(1, L + 1, (B,), generator=g).to(dev)
    mask = torch.arange(L, device=dev)[None, :] < lengths[:, None]
    uniform = torch.zeros(B, dtype=torch.bool, device=dev)
    order = ops.length_order(lengths)
    bounds, span_order = ops.key_bounds(mask, None)
    cases = {
        "lengths": dict(kv_lengths=lengths, kv_mask=None, uniform=None, plan=(None, order, None)),
        "kv_mask": dict(kv_lengths=None, kv_mask=mask, uniform=None, plan=(None, span_order, bounds)),
        "kv_mask_uniform": dict(kv_lengths=None, kv_mask=mask, uniform=uniform, plan=(None, span_order, bounds)),
        "kv_mask_no_plan": dict(kv_lengths=None, kv_mask=mask, uniform=None, plan=(None, None, None)),
    }
    from gemcompile.lowering.jagged_attention import op as op_mod
    from gemcompile.lowering.jagged_attention import triton as tri

    rows = [{"case": "key_bounds", "host_us": _host_us(lambda: ops.key_bounds(mask, None), args.calls)}]
    print("== key_bounds:", rows[0], flush=True)
    for name, c in cases.items():
        fwd_args = (q, k, v, None, c["kv_lengths"], None, True, D ** -0.5, c["kv_mask"], c["uniform"], *c["plan"])
        out, lse = ops.jagged_attention_fwd(*fwd_args)
        bwd_args = (out, q, k, v, out, lse, None, c["kv_lengths"], None, True, D ** -0.5, False, c["kv_mask"],
                    c["uniform"], *c["plan"])
        row = {"case": name}
        impl = {"fwd": (lambda: op_mod._jagged_attention_fwd_cuda(*fwd_args),
                        lambda: tri.jagged_attention_forward_triton(*fwd_args[:10], q_order=fwd_args[10],
                                                                    kv_order=fwd_args[11], kv_bounds=fwd_args[12])),
                "bwd": (lambda: op_mod._jagged_attention_bwd_cuda(*bwd_args),
                        lambda: tri.jagged_attention_backward_triton(*bwd_args[:14], q_order=bwd_args[14],
                                                                     kv_order=bwd_args[15], kv_bounds=bwd_args[16]))}
        for part, fn in (("fwd", lambda: ops.jagged_attention_fwd(*fwd_args)),
                         ("bwd", lambda: ops.jagged_attention_bwd(*bwd_args))):
            row[f"{part}_host_us"] = _host_us(fn, args.calls)
            row[f"{part}_breakdown_us"] = _breakdown(fn, *impl[part], args.calls)
            profile = _cprofile(fn, 20, args.top)
            row[f"{part}_cprofile"] = profile
            print(f"== {name} {part}: {row[f'{part}_host_us']:.1f} us per call", flush=True)
            print(profile[:6000], flush=True)
        rows.append(row)
    path = results_path("op_host_time", args.out)
    rewrite_results(path, {"environment": environment(), "args": vars(args), "cases": rows})
    print("wrote", path)


if __name__ == "__main__":
    main()
