"""Block attention's closed kernels, one tile config at a time: which configs the lists should hold.

    python benchmarks/block_closed_configs.py [--head-dim 128] [--rotary none,half] [--which fwd,bwd]
                                              [--only-with R_SPLIT] [--batch 1152 --length 1024 --fill 0.5]
                                              [--budget-s 240] [--out DIR]
    TRITON_INTERPRET=1 python benchmarks/block_closed_configs.py --smoke   # CPU: tiny shape, no timing

The shape is by default the block attention claims' B1152 L1024 H4 (fill 0.5, 64-token blocks, rotate-half
RoPE tables (L, D) in bf16, as benchmarks/block_attention.py builds them); --batch, --length and --fill pick
another. Per rotary mode, the launchers are timed first with both closed kernels autotuned over their lists
("listed"), then with one kernel pinned to each candidate config while the other keeps its autotuned choice:
the candidates are every (BLOCK 64) config in that kernel's list for the variant plus EXTRA (other HEADS and
stages, register caps (``maxnreg``), with rotary the backward's R^T without a gather (``R_SPLIT``), and the
TILES tiles a program). Times are CUDA-graph replays (triton.testing.do_bench median) of the
forward launcher and of the forward and backward launchers; a pinned backward's time is read as
forward+backward minus the forward of the same row. Each row also records the largest difference of out, dQ,
dK, dV from the listed configs' (bf16; a config that computes something else shows here). The JSON is
rewritten after every row, so a run stopped by a time limit keeps what it measured. ``--smoke``: the
kernels' launchers under the Triton interpreter (float16: the interpreter's bf16 dots are wrong), B2 L128 H2,
each pinned config checked against the float64 reference (exit status 1 past the tolerance); no timing, no
file.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from block_attention import draw_lengths, rope_tables  # noqa: E402
from harness import bench_ms, environment, graphed, results_path, rewrite_results  # noqa: E402

import gemcompile.lowering  # noqa: E402,F401  (registers torch.ops.gemcompile.*)
from gemcompile.lowering.block_attention import triton as kernels  # noqa: E402

B, L, H, FILL, BLOCK = 1152, 1024, 4, 0.5, 64
_R_SPLIT = (("R_SPLIT", 1),)  # the backward's R^T without tl.gather (_swap_partners): rotary only
EXTRA = {  # (BLOCK, warps, HEADS, stages, maxnreg[, other constexprs]) tried beyond the lists
    "fwd": [(64, 4, 2, 1, None), (64, 4, 4, 2, None), (64, 8, 2, 2, None), (64, 8, 4, 1, None),
            (64, 8, 1, 1, 128),
            (64, 4, 1, 2, None, (("TILES", 4),)), (64, 4, 1, 3, None, (("TILES", 4),)),
            (64, 8, 1, 3, None, (("TILES", 4),)), (64, 8, 4, 3, None, (("TILES", 2),)),
            (64, 4, 2, 2, None, (("TILES", 4),))],
    "bwd": [(64, 8, 2, 1, None), (64, 8, 2, 2, None), (64, 8, 4, 2, None), (64, 8, 4, 3, None),
            (64, 8, 1, 1, 128), (64, 8, 1, 1, 168), (64, 8, 1, 1, None, _R_SPLIT),
            (64, 8, 2, 2, None, _R_SPLIT), (64, 8, 4, 3, None, _R_SPLIT), (64, 4, 1, 1, None, _R_SPLIT),
            (64, 4, 2, 2, None, _R_SPLIT),
            # TILES tiles a program in one pipelined loop over (tile, head) pairs, in both kernels (ptxas for
            # sm_90a: no spill without rotary at D 128; with rotary, three stages need more shared memory
            # than a CTA has)
            (64, 8, 4, 3, None, (("TILES", 2),)), (64, 8, 2, 3, None, (("TILES", 4),)),
            (64, 8, 1, 3, None, (("TILES", 4),)), (64, 8, 1, 3, None, (("TILES", 8),)),
            (64, 8, 1, 2, None, (("TILES", 4),))],
}
KERNELS = {"fwd": "_closed_fwd_kernel", "bwd": "_closed_bwd_kernel"}
SHAPE_TABLES = {"fwd": "_CLOSED_FWD_SHAPES", "bwd": "_CLOSED_BWD_SHAPES"}


def listed(which: str, head_dim: int, rotary: str) -> list[tuple]:
    """The kernel's listed configs for this variant with BLOCK 64, as (BLOCK, warps, HEADS, stages, None[,
    other constexprs]), EXTRA's form."""
    variant = kernels._variant(head_dim, kernels.ROTARY_CODES[rotary])
    shapes = {s: () for s, kinds in getattr(kernels, SHAPE_TABLES[which]).items() if variant in kinds}
    out = []
    for c in kernels._closed_configs(shapes):
        other = tuple((k, v) for k, v in c.kwargs.items() if k not in ("BLOCK", "HEADS"))  # R_SPLIT
        if c.kwargs["BLOCK"] == BLOCK:
            base = (BLOCK, c.num_warps, c.kwargs["HEADS"], c.num_stages, None)
            out.append(base + ((other,) if other else ()))
    return out


def config(t: tuple) -> triton.Config:
    block, warps, heads, stages, maxnreg, *other = t
    return triton.Config({"BLOCK": block, "HEADS": heads, **dict(*other)}, num_warps=warps,
                         num_stages=stages, maxnreg=maxnreg)


SMOKE_TOL = 2e-2
"""Largest relative error (norm of the difference over the reference's) of float16 kernels in --smoke."""


def make_inputs(head_dim: int, device, b: int = B, length: int = L, heads: int = H, dtype=torch.bfloat16,
                fill: float = FILL):
    lengths = draw_lengths(b, length, fill, seed=1003, device=device)
    cos, sin = rope_tables(length, head_dim, device, dtype)
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v, go = (torch.randn(b, heads, length, head_dim, device=device, dtype=dtype, generator=g)
                   for _ in range(4))
    return [x.requires_grad_(True) for x in (q, k, v)], go, lengths, cos, sin


def launch_once(leaves, go, lengths, cos, sin, rotary: str, head_dim: int) -> list[torch.Tensor]:
    """(out, dQ, dK, dV) from the Triton launchers themselves (on the CPU the op takes its reference)."""
    c, s = (cos, sin) if rotary != "none" else (None, None)
    q, k, v = (x.detach() for x in leaves)
    args = (lengths, BLOCK, -1, False, c, s, rotary, head_dim ** -0.5)
    out, lse = kernels.block_attention_forward_triton(q, k, v, *args)
    return [out, *kernels.block_attention_backward_triton(go, q, k, v, out, lse, *args)]


def reference_once(leaves, go, lengths, cos, sin, rotary: str, head_dim: int) -> list[torch.Tensor]:
    from gemcompile.lowering.block_attention.reference import reference_backward, reference_forward

    d64 = [x.detach().double() for x in leaves]
    tables = [t.double() for t in (cos, sin)] if rotary != "none" else [None, None]
    args = (lengths, BLOCK, -1, False, *tables, rotary, head_dim ** -0.5)
    out, lse = reference_forward(*d64, *args)
    return [out, *reference_backward(go.double(), *d64, out, lse, *args)]


def measure(leaves, go, lengths, cos, sin, rotary: str, head_dim: int, timed: bool = True) -> dict:
    """fwd and fwd+bwd ms (CUDA-graph replays of the launchers) and the outputs (out, dQ, dK, dV) of one call.
    The launchers, not the op: autograd adds nothing a replay would time, and its leaves' gradient
    accumulators (made on the default stream) cannot join a capture on torch 2.11."""
    outputs = launch_once(leaves, go, lengths, cos, sin, rotary, head_dim)
    if not timed:
        return {"outputs": outputs}
    c, s = (cos, sin) if rotary != "none" else (None, None)
    q, k, v = (x.detach() for x in leaves)
    args = (lengths, BLOCK, -1, False, c, s, rotary, head_dim ** -0.5)

    def fwd():
        return kernels.block_attention_forward_triton(q, k, v, *args)

    def fwdbwd():
        out, lse = fwd()
        return kernels.block_attention_backward_triton(go, q, k, v, out, lse, *args)

    fwdbwd()
    return {"outputs": outputs, "fwd_ms": bench_ms(graphed(fwd)), "fwdbwd_ms": bench_ms(graphed(fwdbwd))}


def run(args) -> dict:
    device = "cpu" if args.smoke else "cuda"
    shape = (2, 128, 2) if args.smoke else (args.batch, args.length, H)
    fill = FILL if args.smoke else args.fill
    path = results_path(f"block_closed_configs-d{args.head_dim}", args.out)
    payload = {"benchmark": "block_closed_configs", "environment": environment(),
               "shape": {"B": shape[0], "L": shape[1], "H": shape[2], "D": args.head_dim, "fill": fill,
                         "block": BLOCK},
               "timing": "none (smoke)" if args.smoke else "CUDA graph replay, do_bench median",
               "config_key": "(BLOCK, warps, HEADS, stages, maxnreg)", "rows": []}
    dtype = torch.float16 if args.smoke else torch.bfloat16
    leaves, go, lengths, cos, sin = make_inputs(args.head_dim, device, *shape, dtype=dtype, fill=fill)
    worst = 0.0
    saved = {w: getattr(kernels, KERNELS[w]).configs for w in KERNELS}
    # the closed kernels run only when both have a tile that holds the block; the interpreter's one config
    # (32 rows) does not, so --smoke takes a 64-row config as the "listed" one
    listed_configs = {w: [config((BLOCK, 4, 1, 1, None))] for w in KERNELS} if args.smoke else saved
    t0 = time.time()
    try:
        for rotary in args.rotary:
            for w in KERNELS:
                setattr(getattr(kernels, KERNELS[w]), "configs", listed_configs[w])
            base = measure(leaves, go, lengths, cos, sin, rotary, args.head_dim, timed=not args.smoke)
            ref = reference_once(leaves, go, lengths, cos, sin, rotary, args.head_dim) if args.smoke else None
            payload["rows"].append({"rotary": rotary, "pinned": "none (listed configs, autotuned)",
                                    **{k: base.get(k) for k in ("fwd_ms", "fwdbwd_ms")}})
            print(payload["rows"][-1], flush=True)
            for which in args.which:
                in_list = listed(which, args.head_dim, rotary)
                candidates = list(dict.fromkeys(in_list + EXTRA[which]))
                if rotary == "none":  # R_SPLIT changes nothing without rotary
                    candidates = [t for t in candidates if "R_SPLIT" not in repr(t)]
                if args.only_with:
                    candidates = [t for t in candidates if args.only_with in repr(t)]
                for t in candidates:
                    row = {"rotary": rotary, "pinned": which, "config": list(t),
                           "in_list": t in in_list}
                    if time.time() - t0 > args.budget_s:
                        row["skipped"] = "time budget"
                    else:
                        for w in KERNELS:
                            setattr(getattr(kernels, KERNELS[w]), "configs", listed_configs[w])
                        getattr(kernels, KERNELS[which]).configs = [config(t)]
                        # a config listed for other variants only would not serve this one (the general
                        # kernels would run): the table lists it for this variant while it is pinned
                        table = getattr(kernels, SHAPE_TABLES[which])
                        key = kernels._closed_shape(config(t))
                        before = table.get(key)
                        if before is not None:
                            table[key] = tuple(before) + (kernels._variant(args.head_dim,
                                                                           kernels.ROTARY_CODES[rotary]),)
                        row["closed_kernels"] = kernels.closed_tile_serves(BLOCK, args.head_dim, rotary)
                        try:
                            got = measure(leaves, go, lengths, cos, sin, rotary, args.head_dim,
                                          timed=not args.smoke)
                            row.update({k: got.get(k) for k in ("fwd_ms", "fwdbwd_ms")})
                            if which == "bwd" and got.get("fwdbwd_ms") is not None:
                                row["bwd_ms"] = got["fwdbwd_ms"] - got["fwd_ms"]
                            row["max_abs_diff_vs_listed"] = max(
                                (a.float() - b.float()).abs().max().item()
                                for a, b in zip(got["outputs"], base["outputs"]))
                            if ref is not None:
                                row["max_rel_err_vs_float64"] = max(
                                    ((a.double() - r).norm() / r.norm().clamp_min(1e-30)).item()
                                    for a, r in zip(got["outputs"], ref))
                                worst = max(worst, row["max_rel_err_vs_float64"])
                        except Exception as e:  # noqa: BLE001  a config that fails to compile or launch
                            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                        finally:
                            if before is not None:
                                table[key] = before
                    payload["rows"].append(row)
                    print(row, flush=True)
                    if not args.smoke:
                        rewrite_results(path, payload)
    finally:
        for w in KERNELS:
            setattr(getattr(kernels, KERNELS[w]), "configs", saved[w])
    if not args.smoke:
        rewrite_results(path, payload)
        print(f"results in {path}")
    payload["worst_rel_err_vs_float64"] = worst
    return payload


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=B)
    parser.add_argument("--length", type=int, default=L, help="padded length L")
    parser.add_argument("--fill", type=float, default=FILL, help="mean length / L (as block_attention.py)")
    parser.add_argument("--rotary", default="none,half", type=lambda s: s.split(","))
    parser.add_argument("--budget-s", type=float, default=240.0, help="rows started after this are skipped")
    parser.add_argument("--which", default="fwd,bwd", type=lambda s: s.split(","),
                        help="the kernels whose candidates are pinned (fwd, bwd or both)")
    parser.add_argument("--only-with", default=None,
                        help="only the candidates whose config tuple's repr holds this string (e.g. R_SPLIT)")
    parser.add_argument("--out", default=None, help="directory of the JSON (default: $OUT, else results/)")
    parser.add_argument("--smoke", action="store_true", help="CPU under TRITON_INTERPRET=1, no timing")
    args = parser.parse_args(argv)
    bad = sorted(set(args.rotary) - {"none", "half", "interleaved"})
    if bad:
        parser.error(f"--rotary: unknown modes {bad}")
    if sorted(set(args.which) - set(KERNELS)):
        parser.error(f"--which: unknown kernels {sorted(set(args.which) - set(KERNELS))}")
    if args.smoke and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("--smoke runs the kernels under the Triton interpreter: set TRITON_INTERPRET=1")
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("benchmarks/block_closed_configs.py needs a CUDA GPU (or --smoke on CPU)")
    payload = run(args)
    if args.smoke:
        errors = [r for r in payload["rows"] if r.get("error")]
        worst = payload["worst_rel_err_vs_float64"]
        print(f"smoke: {len(payload['rows'])} rows, {len(errors)} errors, worst rel. error vs float64 "
              f"{worst:.2e}")
        sys.exit(1 if errors or worst > SMOKE_TOL else 0)


if __name__ == "__main__":
    main()
