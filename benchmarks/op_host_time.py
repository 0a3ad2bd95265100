"""Host time of one attention op call on CUDA: what a host-bound step pays per call, and where it goes.

    python benchmarks/op_host_time.py --out $OUT

For gemcompile::jagged_attention_fwd and _bwd (called as the compiled graph calls them: through
torch.ops, with and without a kv_mask and the plan tensors the graph passes), the host's wall time per
call (no synchronization inside the timed loop; the GPU work is small, so the host is what is timed) and
the top functions of one cProfile run by cumulative time. Shape ``--batch`` x ``--heads`` x ``--length``
x ``--head-dim``, bf16.
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
    rows = []
    for name, c in cases.items():
        fwd_args = (q, k, v, None, c["kv_lengths"], None, True, D ** -0.5, c["kv_mask"], c["uniform"], *c["plan"])
        out, lse = ops.jagged_attention_fwd(*fwd_args)
        bwd_args = (out, q, k, v, out, lse, None, c["kv_lengths"], None, True, D ** -0.5, False, c["kv_mask"],
                    c["uniform"], *c["plan"])
        row = {"case": name}
        for part, fn in (("fwd", lambda: ops.jagged_attention_fwd(*fwd_args)),
                         ("bwd", lambda: ops.jagged_attention_bwd(*bwd_args))):
            row[f"{part}_host_us"] = _host_us(fn, args.calls)
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
