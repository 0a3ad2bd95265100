"""A refactor must not slow a kernel: the same attention ops, timed from two source trees in one run.

Each tree's ops are timed in a process of their own (two versions of one package cannot share a
process), on the same GPU, alternating before / after ``--repeats`` times so that clock drift falls on
both; the medians and the ratio after / before go to one JSON. The ops are called by their schema
(``torch.ops.gemcompile.*``), which both trees share, with the same seeded inputs.

    python benchmarks/refactor_ab.py --before .base --after . --out $OUT

Cases: jagged softmax attention (the anchor shape B32 L2048 H8 D64), GDPA as HSTU uses it (SiLU,
causal, a relative-position table read in place, B32 L1024 H4 D64) and block attention (64-token blocks,
B16 L4096 H4 D128; and with rotate-half RoPE fused, B64 L2048 H4 D128), bf16, forward and
forward+backward; eager calls and CUDA-graph replay of each (the kernels alone, no host time); and the
host's time per eager forward call at a tiny shape (B2 L64 H1 D64), where nothing else shows.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

CASES = ("jagged_attention", "gdpa_hstu", "block_attention", "block_attention_rope")


SHAPES = {"jagged_attention": (32, 8, 2048, 64), "gdpa_hstu": (32, 4, 1024, 64),
          "block_attention": (16, 4, 4096, 128), "block_attention_rope": (64, 4, 2048, 128)}
"""(B, H, L, D) of each case: the kernels' anchor shapes, GPU-bound."""
SMALL = (2, 1, 64, 64)
"""A shape whose kernels take a few microseconds: the host's time per call shows alone."""


def _inputs(case: str, shape: tuple[int, int, int, int]):
    import torch

    gen = torch.Generator(device="cuda").manual_seed(0)
    B, H, L, D = shape
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
               for _ in range(3))
    lengths = torch.randint(0, L + 1, (B,), device="cuda", generator=gen)
    table = torch.randn(2 * L - 1, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    return q, k, v, lengths, table


def _op_call(case: str, q, k, v, lengths, table):
    import torch

    ops = torch.ops.gemcompile
    if case == "jagged_attention":
        return lambda: ops.jagged_attention(q, k, v, None, lengths, None, False, q.shape[-1] ** -0.5)
    if case == "gdpa_hstu":
        L = q.shape[2]  # HSTU: silu(q k^T * alpha + table[j - i + L - 1]) / L, causal, the table read in place
        return lambda: ops.gdpa(q, k, v, lengths, lengths, table, "silu", q.shape[-1] ** -0.5, 1.0 / L, False,
                                True, 0, None, 0, L - 1)
    if case == "block_attention_rope":  # rotate-half RoPE fused; one fp32 (L, D) table pair for the batch
        L, D = q.shape[2], q.shape[3]
        inv_freq = 10000.0 ** (-torch.arange(0, D, 2, device=q.device) / D)
        angles = torch.arange(L, device=q.device)[:, None] * inv_freq
        angles = torch.cat((angles, angles), dim=-1).float()
        cos, sin = angles.cos(), angles.sin()
        return lambda: ops.block_attention(q, k, v, lengths, 64, -1, False, cos, sin, "half", D ** -0.5)
    return lambda: ops.block_attention(q, k, v, lengths, 64, -1, False, None, None, "none", q.shape[-1] ** -0.5)


def host_ms(forward, calls: int = 400) -> float:
    """Milliseconds of host time per eager forward call (no sync inside the loop; tiny kernels)."""
    import time

    import torch

    for _ in range(20):
        forward()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        forward()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed * 1e3 / calls


def child(cases: list[str]) -> dict:
    """Times each case with the gemcompile found on sys.path; returns {case: {metric: ms}}."""
    import torch

    import gemcompile.lowering  # noqa: F401  registers the ops
    from harness import bench_ms, graphed

    out = {"gemcompile": str(Path(gemcompile.lowering.__file__).parents[1])}
    for case in cases:
        small = _op_call(case, *_inputs(case, SMALL))
        host = host_ms(small)
        q, k, v, lengths, table = _inputs(case, SHAPES[case])
        forward = _op_call(case, q, k, v, lengths, table)
        grad = torch.randn_like(q)

        def step():
            q.grad = k.grad = v.grad = table.grad = None
            forward().backward(grad)

        with torch.no_grad():
            forward()
        step()
        torch.cuda.synchronize()
        with torch.no_grad():
            fwd_graph = graphed(forward)
        out[case] = {"fwd_ms": bench_ms(lambda: forward().detach()), "fwd_bwd_ms": bench_ms(step),
                     "fwd_graph_ms": bench_ms(fwd_graph), "fwd_bwd_graph_ms": bench_ms(graphed(step)),
                     "fwd_host_ms_small": host}
        del q, k, v, grad
        torch.cuda.empty_cache()
    return out


def _rows(cases: list[str], runs: dict[str, list[dict]]) -> list[dict]:
    rows = []
    for case in cases:
        for metric in ("fwd_ms", "fwd_bwd_ms", "fwd_graph_ms", "fwd_bwd_graph_ms", "fwd_host_ms_small"):
            if any(metric not in r[case] for r in runs["before"] + runs["after"]):
                continue  # a tree whose script predates the metric
            before = statistics.median(r[case][metric] for r in runs["before"])
            after = statistics.median(r[case][metric] for r in runs["after"])
            rows.append({"case": case, "metric": metric, "before_ms": before, "after_ms": after,
                         "after_over_before": after / before})
    return rows


def parent(args) -> int:
    from harness import environment, results_path, rewrite_results

    path = results_path("refactor_ab", args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    for repeat in range(args.repeats):
        for side, tree in (("before", args.before), ("after", args.after)):
            env = dict(os.environ, PYTHONPATH=str(Path(tree).resolve()))
            done = subprocess.run([sys.executable, __file__, "--child", "--cases", ",".join(args.cases)],
                                  env=env, capture_output=True, text=True, timeout=args.timeout_s)
            if done.returncode != 0:
                print(done.stdout[-2000:], done.stderr[-4000:], file=sys.stderr)
                return done.returncode
            runs[side].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(side, runs[side][-1], flush=True)
        rows = _rows(args.cases, runs)  # written after every round: a run cut short keeps what it measured
        payload = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "environment": environment(),
                   "before": args.before, "after": args.after, "repeats_done": repeat + 1, "rows": rows,
                   "runs": runs}
        rewrite_results(path, payload)
    for row in rows:
        print(f"{row['case']:18s} {row['metric']:13s} before {row['before_ms']:8.3f} ms  "
              f"after {row['after_ms']:8.3f} ms  after/before {row['after_over_before']:.3f}")
    print(path)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default=".base", help="source tree of the code before the change")
    parser.add_argument("--after", default=".", help="source tree of the code after the change")
    parser.add_argument("--repeats", type=int, default=2, help="before/after process pairs, alternating")
    parser.add_argument("--cases", type=lambda s: s.split(","), default=list(CASES), help="comma-separated")
    parser.add_argument("--timeout-s", type=float, default=240.0, help="the most one timing process may take")
    parser.add_argument("--out", default=None, help="directory of the JSON (default: $OUT, else results/)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    unknown = sorted(set(args.cases) - set(CASES))
    if unknown:
        parser.error(f"unknown case(s) {unknown}; cases: {', '.join(CASES)}")
    if args.child:
        print(json.dumps(child(args.cases)))
        return 0
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
