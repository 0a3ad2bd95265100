"""GDPA's in-kernel bias gradient (lowering/gdpa/bias_grad_triton.py): its tiling, swept on one shape.

    python benchmarks/gdpa_bias_grad.py [--out DIR] [--budget-s 120]

HSTU's shape from benchmarks/gdpa.py (B32 L1024 H4 D64, fill 0.5, bf16, a relative bias read from its
(2L - 1) table in place, causal, silu, / L): the kernel's parts are summed along their diagonals into the
table's gradient (diagonal_sums_triton.py), which the forward+backward time includes. For every TileConfig in CONFIGS, one run of the op's forward
and backward: the bias gradient's error against the fp32 padded reference (the other gradients do not
depend on the config), the bias-gradient kernel's GPU time (torch.profiler, mean of 10 calls) and the
whole forward+backward's (CUDA-graph replay, median). The fastest config that passes the check is the
candidate for TileConfig's defaults; the JSON records every row.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE.parent))
sys.path.insert(0, str(_HERE))

from gdpa import hstu_op, hstu_padded, leaves_of, make_inputs, used_positions
from harness import bench_ms, environment, format_table, graphed, write_json

from gemcompile.lowering.gdpa import bias_grad_triton as bias_grad

SHAPE = {"case": "hstu", "B": 32, "L": 1024, "H": 4, "D": 64, "fill": 0.5}
TC = bias_grad.TileConfig
CONFIGS = [  # the default first: every other row is read against it
    TC(),
    TC(num_stages=3),
    TC(num_stages=3, programs_per_sm=4),
    TC(num_stages=3, programs_per_sm=16),
    TC(programs_per_sm=2),  # fewer parts: less to write and to sum along the diagonals
    TC(programs_per_sm=8),  # the default before the table path
    TC(num_warps=8),
    TC(block_m=128, block_n=64, num_warps=8, num_stages=2),
    TC(block_m=64, block_n=128, num_warps=8, num_stages=3),
    TC(block_m=32, block_n=64, num_warps=4, num_stages=3),
]
KERNEL = "_gdpa_bwd_dbias_kernel"


def _rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def dbias_kernel_us(fn, reps: int = 10) -> float:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    return sum(e.device_time_total for e in prof.key_averages() if e.key.startswith(KERNEL)) / reps


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="directory of the JSON (default: $OUT, else results/)")
    parser.add_argument("--budget-s", type=float, default=120.0, help="skip configs that would start later")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("benchmarks/gdpa_bias_grad.py needs a CUDA GPU (the unit tests cover the CPU)")
    t0 = time.time()
    q, k, v, n, x, pairs = make_inputs(SHAPE, "cuda", seed=0)
    leaves = leaves_of(q, k, v, x)
    ref_in = [t.detach().float().requires_grad_(True) for t in leaves]
    ref_x = dict(x, rab_table=ref_in[3])
    ref = hstu_padded(*ref_in[:3], n, ref_x)
    used = used_positions(SHAPE, ref, n)
    g = torch.randn(ref.shape, generator=torch.Generator(device="cuda").manual_seed(7), device="cuda")
    ref_dtable = torch.autograd.grad(torch.where(used, ref, 0), ref_in[3], g)[0]
    g = torch.where(used, g, 0).to(q.dtype)

    def fwdbwd():
        torch.autograd.grad(hstu_op(q, k, v, n, x), leaves, g)

    rows = []
    for cfg in CONFIGS:
        row = {"config": vars(cfg).copy()}
        rows.append(row)
        if time.time() - t0 > args.budget_s:
            row["error"] = "skipped: time budget"
            continue
        bias_grad.TILE_CONFIG = cfg
        try:
            dtable = torch.autograd.grad(hstu_op(q, k, v, n, x), leaves, g)[3]
            row["dtable_rel_err"] = _rel(dtable, ref_dtable)
            row["ok"] = row["dtable_rel_err"] < 3e-2
            row["dbias_kernel_us"] = dbias_kernel_us(fwdbwd)
            row["fwdbwd_ms"] = bench_ms(graphed(fwdbwd))
        except Exception as e:  # a config that does not compile (shared memory) is recorded, the sweep goes on
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        torch.cuda.synchronize()
        print(row, flush=True)
    base = rows[0].get("dbias_kernel_us")
    for row in rows:
        if base and row.get("dbias_kernel_us"):
            row["kernel_speedup_vs_default"] = base / row["dbias_kernel_us"]
    payload = {"benchmark": "gdpa_bias_grad", "environment": environment(), "shape": SHAPE, "pairs": pairs,
               "command": "python " + " ".join(sys.argv), "rows": rows,
               "timing": "dbias kernel: torch.profiler mean of 10 calls; fwd+bwd: CUDA-graph replay median"}
    path = write_json("gdpa_bias_grad", payload, args.out)
    table = [dict(r["config"], us=r.get("dbias_kernel_us"), ms=r.get("fwdbwd_ms"), err=r.get("dtable_rel_err"),
                  x=r.get("kernel_speedup_vs_default"), note=(r.get("error") or "")[:50]) for r in rows]
    print(format_table(table, [("block_m", "BM", "d"), ("block_n", "BN", "d"), ("num_warps", "warps", "d"),
                               ("num_stages", "stages", "d"), ("programs_per_sm", "prog/SM", "d"),
                               ("us", "dbias us", ".1f"), ("x", "x default", ".2f"), ("ms", "fwd+bwd ms", ".3f"),
                               ("err", "dtable err", ".2e"), ("note", "note", "s")]))
    print(f"results in {path}")


if __name__ == "__main__":
    main()
