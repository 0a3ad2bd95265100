"""One Linear, y = x W^T, in FP8 blockwise (the Hopper recipe of gemcompile::fp8_mm) against bf16 cuBLAS.

    python benchmarks/mxfp8_linear.py [--quick] [--eager] [--rule rceil|floor] [--budget-s 330] [--out DIR]
    python benchmarks/mxfp8_linear.py --preset gem-medium   # the Linear shapes GEM-ref medium runs (PRESETS)
    python benchmarks/mxfp8_linear.py --shapes 8192x4096x4096,65536x512x1024   # M x K x N, any list
    python benchmarks/mxfp8_linear.py --smoke     # CPU: tiny shapes, the emulated recipes, correctness only
    python benchmarks/mxfp8_linear.py --smoke --preset gem-medium   # CPU: the preset's shapes scaled down

Per shape (x (M, K), W (N, K), dY (M, N), bf16), forward and backward timed separately:
  bf16        forward torch.mm(x, W^T); backward dX = dY W and dW = dY^T x (cuBLAS)
  fp8         forward: one pass over x writes x8 and x8^T (1x128 blocks, quantize_1x128), one pass over W
              writes W8 and W8^T (128x128 tiles, quantize_128x128: the weight is quantized once per step and
              serves dgrad too), the scaled GEMM; backward: one pass over dY writes dY8 and dY8^T, then the
              dgrad and wgrad scaled GEMMs reusing W8^T and x8^T. Quantization included.
  fp8_op      the same through torch.ops.gemcompile.fp8_mm, as a compiled graph calls it: each call
              quantizes its two operands (so x, W and dY are quantized twice, no reuse)
  fp8_gemm    the three scaled GEMMs alone on pre-quantized operands (the cost split: fp8 - fp8_gemm is
              the quantization)
  quantize    each quantize kernel alone, with its achieved GB/s (bytes read + written)
Timing: harness.bench_ms (do_bench median); by default every method is replayed from a CUDA graph (GPU
work alone, as under torch.compile(mode="reduce-overhead"); --eager times plain launches). Inputs rotate
when one set fits in L2. TFLOP/s: forward 2MNK, backward 4MNK. Ratios are bf16 ms / fp8 ms (>1: FP8 is
faster). Correctness: relative Frobenius error of y, dX, dW against fp32 matmuls of the same bf16 inputs,
for fp8 and for bf16.

Targets (issue 7), shapes with K, N >= 4096: forward >= 1.3x, backward >= 1.5x.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import warnings
from pathlib import Path

import torch

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE.parent))
sys.path.insert(0, str(_HERE))

from harness import (bench_ms, environment, format_table, graphed, results_path, rewrite_results, rotation_count,
                     tflops)

import gemcompile.lowering  # noqa: F401  (registers torch.ops.gemcompile.fp8_mm)
from gemcompile.lowering.fp8 import scaled_mm as sm

DTYPE = torch.bfloat16
KN = [(1024, 1024), (4096, 4096), (8192, 8192), (4096, 8192)]
SHAPES = [(m, k, n) for m in (8192, 32768, 65536) for k, n in KN]
QUICK = [(8192, 1024, 1024), (8192, 4096, 4096)]
SMOKE = [(64, 256, 128), (96, 200, 72)]
TARGETS = {"fwd": 1.3, "bwd": 1.5}

# GEM-ref medium at batch 256, fill 0.5 (bench e2e --size medium): (M, K, N, layers, calls per forward),
# from forward pre-hooks on every nn.Linear of GemRef(gem_ref_config("medium")) on the meta device (batch
# 256, fill 0.5), with M of the layers gem_compile runs on packed tokens (explain_gem_ref: M = u0 / u1) set to
# the expected valid tokens, 256 x N_k / 2 (lengths uniform in [0, N_k]: 262144 for N_k 2048, 65536 for 512;
# 200 drawn batches: mean 260994 +- 9759 and 65544 +- 2418). Sorted by forward FLOPs per step.
# Left out (N <= 128 or M = 32): the token-axis Linears of Wukong (residual, lcb, compress; M 131072,
# K 24-224, N 16-128), the softmax gates and towers (N 2), PMA's q_proj of its 32 learned queries (M 32).
_TOKEN_512 = ("layers.{{0,2}}.seq_summary.pma.{k}.{{k,v}}_proj", "final_summary.pma.{k}.{{k,v}}_proj",
              "layers.{{0,2}}.gdpa.{k}.{{q,out}}_proj",
              "layers.{{1,3}}.self_attention.{k}.{{q,k,v,out}}_proj")  # sequence type k's tokens
GEM_MEDIUM = [
    (262144, 512, 512, tuple(t.format(k=0) for t in _TOKEN_512), 18),
    (262144, 512, 1024, ("layers.*.ffn.0.up",), 4),
    (262144, 1024, 512, ("layers.*.ffn.0.down",), 4),
    (65536, 512, 512, tuple(t.format(k=1) for t in _TOKEN_512), 18),
    (256, 2048, 32768, ("layers.*.interaction.experts.*.fm_mlp.4",), 8),
    (65536, 512, 1024, ("layers.*.ffn.1.up",), 4),
    (65536, 1024, 512, ("layers.*.ffn.1.down",), 4),
    (256, 114688, 2048, ("heads.top.0",), 1),
    (256, 14336, 2048, ("layers.{1,2,3}.interaction.experts.*.fm_mlp.0",), 6),
    (12288, 512, 512, ("layers.{0,2}.seq_summary.gate.*", "final_summary.gate.*"), 6),
    (262144, 128, 512, ("seq_embedding.proj.0",), 1),
    (8192, 512, 512, ("layers.{0,2}.seq_summary.pma.*.out_proj", "final_summary.pma.*.out_proj"), 6),
    (4096, 512, 512, ("layers.{0,2}.gdpa.*.{k,v}_proj", "layers.{0,2}.summary.gate"), 10),
    (256, 2048, 2048, ("layers.*.interaction.experts.*.fm_mlp.2",), 8),
    (256, 7680, 2048, ("layers.0.interaction.experts.*.fm_mlp.0",), 2),
    (65536, 128, 512, ("seq_embedding.proj.1",), 1),
    (256, 512, 512, ("nonseq_embedding.group_proj.*",), 16),
    (256, 1024, 4096, ("nonseq_embedding.dense_mlp.2",), 1),
    (256, 2048, 1024, ("heads.top.2",), 1),
    (256, 256, 1024, ("nonseq_embedding.dense_mlp.0",), 1),
]
PRESETS = {"gem-medium": GEM_MEDIUM}
PRESET_SOURCES = {
    "gem-medium": "nn.Linear forward pre-hooks on GemRef medium, batch 256, fill 0.5; the layers gem_compile "
                  "packs at M = valid tokens = 256 x N_k / 2 (GEM_MEDIUM's comment)",
}


def parse_shapes(text: str) -> list[tuple[int, int, int, tuple, None]]:
    """'MxKxN[,MxKxN...]' -> preset-style rows (no layer names, no call counts)."""
    rows = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        dims = item.lower().split("x")
        if len(dims) != 3 or not all(d.isdigit() and int(d) > 0 for d in dims):
            raise argparse.ArgumentTypeError(f"--shapes: {item!r} is not MxKxN (three positive ints)")
        rows.append((*map(int, dims), (), None))
    if not rows:
        raise argparse.ArgumentTypeError("--shapes: no shape given")
    return rows


def smoke_shapes(rows) -> list[tuple[int, int, int]]:
    """A preset's shapes scaled down for the CPU smoke test (M to at most 128, K and N / 16, at least 64)."""
    return list(dict.fromkeys((min(M, 128), max(64, K // 16), max(64, N // 16)) for M, K, N, *_ in rows))


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# ---------------------------------------------------------------------------------------------------
# One Linear, each method as a forward and a backward closure over one input set


class Fp8Linear:
    """The fused FP8 pipeline: quantized copies made once and reused across forward, dgrad, wgrad."""

    def __init__(self, x, w, dy, rule, api):
        from gemcompile.lowering.fp8 import quantize_triton as k

        self.k, self.x, self.w, self.dy, self.rule, self.api = k, x, w, dy, rule, api

    def forward(self):
        k, r = self.k, self.rule
        self.xq = k.quantize_1x128(self.x, r)  # x8, sx, x8^T, sx^T
        self.wq = k.quantize_128x128(self.w, r)  # W8, sW, W8^T, sW^T
        return self.gemm_fwd()

    def backward(self):
        self.dyq = self.k.quantize_1x128(self.dy, self.rule)  # dY8, sdY, dY8^T, sdY^T
        return self.gemm_dgrad(), self.gemm_wgrad()

    def gemm_fwd(self):
        x8, sx, _, _ = self.xq
        w8, sw, _, _ = self.wq
        return sm.scaled_mm_blockwise(x8, sx, False, w8, sw, True, DTYPE, self.api)

    def gemm_dgrad(self):
        dy8, sdy, _, _ = self.dyq
        _, _, wt8, swt = self.wq
        return sm.scaled_mm_blockwise(dy8, sdy, False, wt8, swt, True, DTYPE, self.api)

    def gemm_wgrad(self):
        _, _, dyt8, sdyt = self.dyq
        _, _, xt8, sxt = self.xq
        return sm.scaled_mm_blockwise(dyt8, sdyt, False, xt8, sxt, False, DTYPE, self.api)

    def gemm_bwd(self):
        return self.gemm_dgrad(), self.gemm_wgrad()


def methods(x, w, dy, rule, api):
    ops = torch.ops.gemcompile
    fp8 = Fp8Linear(x, w, dy, rule, api)
    fp8.forward()
    fp8.backward()  # the quantized copies the GEMM-only closures read
    return {
        "bf16": (lambda: torch.mm(x, w.t()), lambda: (torch.mm(dy, w), torch.mm(dy.t(), x))),
        "fp8": (fp8.forward, fp8.backward),
        "fp8_op": (
            lambda: ops.fp8_mm(x, w.t(), "blockwise", False, True, rule),
            lambda: (
                ops.fp8_mm(dy, w, "blockwise", False, True, rule),
                ops.fp8_mm(dy.t(), x, "blockwise", False, False, rule),
            ),
        ),
        "fp8_gemm": (fp8.gemm_fwd, fp8.gemm_bwd),
    }, fp8


def quantize_kernels(x, w, dy, rule):
    """name -> (closure, bytes moved): each quantize kernel alone."""
    from gemcompile.lowering.fp8 import quantize_triton as k

    M, K = x.shape
    N = w.shape[0]

    def moved(rows, cols, copies, tile):
        scales = 4 * (rows * cols // (128 * 128) if tile else rows * cols // 128) * copies
        return rows * cols * 2 + rows * cols * copies + scales

    return {
        "x 1x128 dual (x8 + x8^T)": (lambda: k.quantize_1x128(x, rule), moved(M, K, 2, False)),
        "x 1x128 rows only": (lambda: k.quantize_1x128(x, rule, col=False), moved(M, K, 1, False)),
        "dY 1x128 dual": (lambda: k.quantize_1x128(dy, rule), moved(M, N, 2, False)),
        "W 128x128 dual (W8 + W8^T)": (lambda: k.quantize_128x128(w, rule), moved(N, K, 2, True)),
        "x MX 1x32 (E8M0)": (lambda: k.mx_quantize_triton(x, rule), M * K * 2 + M * K + M * K // 32),
    }


def timed(fns, args):
    """fns: one closure per rotated input set -> median ms (graph replay unless --eager)."""
    if not args.eager:
        fns = [graphed(f) for f in fns]
    return bench_ms(fns)


def run_shape(M, K, N, args, index, dev="cuda"):
    label = f"M{M} K{K} N{N}"
    rec = {"M": M, "K": K, "N": N, "label": label, "ms": {}, "tflops": {}, "speedup": {}, "quantize": {}}
    fwd_flops, bwd_flops = 2 * M * N * K, 4 * M * N * K
    print(f"\n== {label}", flush=True)
    nsets = rotation_count((M * K + M * N + N * K) * 2)
    g = torch.Generator(device=dev).manual_seed(index)
    sets = [
        (torch.randn(M, K, device=dev, generator=g, dtype=DTYPE),
         (torch.randn(N, K, device=dev, generator=g) * K**-0.5).to(DTYPE),
         torch.randn(M, N, device=dev, generator=g, dtype=DTYPE))
        for _ in range(nsets)
    ]
    api = sm.blockwise_api()
    built = [methods(x, w, dy, args.rule, api) for x, w, dy in sets]
    rec["blockwise_api"] = sm.blockwise_api()

    # correctness on the first set, against fp32 matmuls (TF32 off)
    x, w, dy = sets[0]
    fp8 = built[0][1]
    torch.backends.cuda.matmul.allow_tf32 = False
    ref = (x.float() @ w.float().t(), dy.float() @ w.float(), dy.float().t() @ x.float())
    got8 = (fp8.forward(), *fp8.backward())
    got16 = (torch.mm(x, w.t()), torch.mm(dy, w), torch.mm(dy.t(), x))
    gotop = built[0][0]["fp8_op"][0](), *built[0][0]["fp8_op"][1]()
    rec["rel_err"] = {
        "fp8": dict(zip(("y", "dx", "dw"), (rel(a, b) for a, b in zip(got8, ref)))),
        "bf16": dict(zip(("y", "dx", "dw"), (rel(a, b) for a, b in zip(got16, ref)))),
        "fp8_op_vs_fp8": max(rel(a, b) for a, b in zip(gotop, got8)),
    }
    del ref, got8, got16, gotop
    print("   rel err vs fp32: fp8 " + ", ".join(f"{k} {v:.4f}" for k, v in rec["rel_err"]["fp8"].items())
          + " | bf16 " + ", ".join(f"{k} {v:.4f}" for k, v in rec["rel_err"]["bf16"].items())
          + f" | op vs fused {rec['rel_err']['fp8_op_vs_fp8']:.1e}", flush=True)

    for name in ("bf16", "fp8", "fp8_op", "fp8_gemm"):
        for d, i in (("fwd", 0), ("bwd", 1)):
            try:
                rec["ms"][f"{name}_{d}"] = timed([b[0][name][i] for b in built], args)
            except Exception as e:  # noqa: BLE001  (recorded, the run goes on)
                rec["ms"][f"{name}_{d}"] = None
                rec.setdefault("errors", {})[f"{name}_{d}"] = f"{type(e).__name__}: {str(e)[:300]}"
                print(f"   {name} {d} failed: {rec['errors'][f'{name}_{d}'][:200]}", flush=True)
    # the backward's GEMMs one by one (fp8 and bf16), then each quantize kernel alone: the cost split
    rec["ms"]["fp8_gemm_dgrad"] = timed([b[1].gemm_dgrad for b in built], args)
    rec["ms"]["fp8_gemm_wgrad"] = timed([b[1].gemm_wgrad for b in built], args)
    rec["ms"]["bf16_dgrad"] = timed([lambda s=s: torch.mm(s[2], s[1]) for s in sets], args)
    rec["ms"]["bf16_wgrad"] = timed([lambda s=s: torch.mm(s[2].t(), s[0]) for s in sets], args)
    for qname, (fn, nbytes) in quantize_kernels(x, w, dy, args.rule).items():
        ms = timed([fn], args)
        rec["quantize"][qname] = {"ms": ms, "GB/s": nbytes / ms / 1e6}

    ms = rec["ms"]
    for name in ("bf16", "fp8", "fp8_op", "fp8_gemm"):
        rec["tflops"][f"{name}_fwd"] = tflops(fwd_flops, ms.get(f"{name}_fwd"))
        rec["tflops"][f"{name}_bwd"] = tflops(bwd_flops, ms.get(f"{name}_bwd"))
        if name != "bf16":
            for d in ("fwd", "bwd"):
                a, b = ms.get(f"bf16_{d}"), ms.get(f"{name}_{d}")
                rec["speedup"][f"{name}_{d}"] = a / b if a and b else None
    if ms.get("fp8_fwd") and ms.get("fp8_gemm_fwd"):
        rec["quantize_share"] = {d: 1 - ms[f"fp8_gemm_{d}"] / ms[f"fp8_{d}"] for d in ("fwd", "bwd")}
    if K >= 4096 and N >= 4096:
        rec["target_met"] = {d: (rec["speedup"].get(f"fp8_{d}") or 0) >= t for d, t in TARGETS.items()}
    sp = rec["speedup"]
    print(f"   bf16 fwd {ms['bf16_fwd']:.3f} ms bwd {ms['bf16_bwd']:.3f} ms | fp8 fwd {ms.get('fp8_fwd') or 0:.3f} ms "
          f"(x{sp.get('fp8_fwd') or 0:.2f}) bwd {ms.get('fp8_bwd') or 0:.3f} ms (x{sp.get('fp8_bwd') or 0:.2f}) | "
          f"op x{sp.get('fp8_op_fwd') or 0:.2f}/x{sp.get('fp8_op_bwd') or 0:.2f} | GEMM alone "
          f"x{sp.get('fp8_gemm_fwd') or 0:.2f}/x{sp.get('fp8_gemm_bwd') or 0:.2f}", flush=True)
    for q, v in rec["quantize"].items():
        print(f"      {q:28s} {v['ms']:.3f} ms  {v['GB/s']:.0f} GB/s", flush=True)
    del built, sets, fp8
    gc.collect()
    torch.cuda.empty_cache()
    return rec


# ---------------------------------------------------------------------------------------------------
# --smoke: CPU, the emulated recipes, correctness only


def smoke(shapes=SMOKE) -> int:
    ops = torch.ops.gemcompile
    bad = []
    for M, K, N in shapes:
        g = torch.Generator().manual_seed(M)
        x = torch.randn(M, K, generator=g).to(DTYPE)
        w = (torch.randn(N, K, generator=g) * K**-0.5).to(DTYPE)
        dy = torch.randn(M, N, generator=g).to(DTYPE)
        calls = {"y": (x, w.t(), False, True), "dx": (dy, w, False, True), "dw": (dy.t(), x, False, False)}
        for recipe in ("blockwise", "mxfp8_emulated"):
            for rule in ("floor", "rceil"):
                errs = {}
                for name, (a, b, aw, bw) in calls.items():
                    out = ops.fp8_mm(a, b, recipe, aw, bw, rule)
                    if not torch.equal(out, sm.emulated_fp8_mm(a, b, recipe, aw, bw, rule)):
                        bad.append((M, K, N, recipe, rule, name, "differs from emulated_fp8_mm"))
                    errs[name] = rel(out, a.float() @ b.float())
                ok = all(e < 0.08 for e in errs.values())
                print(f"M{M} K{K} N{N} {recipe:15s} {rule:5s} rel err vs fp32: "
                      + ", ".join(f"{k} {v:.4f}" for k, v in errs.items()) + ("" if ok else "  <-- too large"))
                if not ok:
                    bad.append((M, K, N, recipe, rule, errs))
    print(f"\nsmoke: failed checks: {bad or 'none'}")
    return 1 if bad else 0


def print_table(payload):
    rows = []
    for s in payload["shapes"]:
        if "skipped" in s:
            continue
        ms, sp, err = s["ms"], s["speedup"], s["rel_err"]
        rows.append({
            "shape": s["label"], "calls": s.get("calls_per_forward"),
            "saved": (s.get("saved_ms_per_step") or {}).get("fp8_op"),
            "bf16_f": ms.get("bf16_fwd"), "fp8_f": ms.get("fp8_fwd"), "x_f": sp.get("fp8_fwd"),
            "bf16_b": ms.get("bf16_bwd"), "fp8_b": ms.get("fp8_bwd"), "x_b": sp.get("fp8_bwd"),
            "tf_f": s["tflops"].get("fp8_fwd"), "tf_b": s["tflops"].get("fp8_bwd"),
            "op_f": sp.get("fp8_op_fwd"), "op_b": sp.get("fp8_op_bwd"),
            "g_f": sp.get("fp8_gemm_fwd"), "g_b": sp.get("fp8_gemm_bwd"),
            "q_f": (s.get("quantize_share") or {}).get("fwd"), "q_b": (s.get("quantize_share") or {}).get("bwd"),
            "err8": max(err["fp8"].values()), "err16": max(err["bf16"].values()),
        })
    print("\n" + format_table(rows, [
        ("shape", "shape", "s"), ("calls", "calls/fwd", "d"), ("saved", "op saved ms/step", ".2f"),
        ("bf16_f", "bf16 fwd ms", ".3f"), ("fp8_f", "fp8 fwd ms", ".3f"),
        ("x_f", "x fwd", ".2f"), ("bf16_b", "bf16 bwd ms", ".3f"), ("fp8_b", "fp8 bwd ms", ".3f"),
        ("x_b", "x bwd", ".2f"), ("tf_f", "fp8 fwd TF/s", ".0f"), ("tf_b", "fp8 bwd TF/s", ".0f"),
        ("op_f", "op x fwd", ".2f"), ("op_b", "op x bwd", ".2f"), ("g_f", "GEMM x fwd", ".2f"),
        ("g_b", "GEMM x bwd", ".2f"), ("q_f", "quant share fwd", ".2f"), ("q_b", "quant share bwd", ".2f"),
        ("err8", "fp8 rel err", ".4f"), ("err16", "bf16 rel err", ".4f"),
    ]))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--quick", action="store_true", help="two small shapes: a GPU smoke test")
    which.add_argument("--preset", choices=sorted(PRESETS), help="a model's Linear shapes, with each one's "
                       "layers and calls per forward (gem-medium: GEM-ref medium at batch 256, fill 0.5)")
    which.add_argument("--shapes", type=parse_shapes, help="MxKxN[,MxKxN...]: these shapes instead of SHAPES")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, emulated recipes, correctness only")
    parser.add_argument("--eager", action="store_true", help="time eager launches instead of CUDA graph replay")
    parser.add_argument("--rule", default="rceil", choices=["floor", "rceil"])
    parser.add_argument("--budget-s", type=float, default=330.0, help="skip shapes that would start later")
    parser.add_argument("--out", default=None, help="directory of the JSON (default: $OUT, else results/)")
    args = parser.parse_args(argv)
    t0 = time.time()
    rows = PRESETS[args.preset] if args.preset else args.shapes
    if args.smoke:
        sys.exit(smoke(smoke_shapes(rows) if rows else SMOKE))
    if not torch.cuda.is_available():
        sys.exit("benchmarks/mxfp8_linear.py needs a CUDA GPU (or --smoke on CPU)")
    warnings.simplefilter("always", sm.Fp8FallbackWarning)
    # one op call finds the blockwise API that works here (or falls back, warning); the fused pipeline uses it
    probe = torch.randn(256, 256, device="cuda", dtype=DTYPE)
    torch.ops.gemcompile.fp8_mm(probe, probe, "blockwise", False, True, args.rule)
    api = sm.blockwise_api()
    print(f"blockwise GEMM API: {api}; torch {torch.__version__}", flush=True)
    if api not in ("F.scaled_mm", "torch._scaled_mm"):
        sys.exit(f"no native blockwise scaled GEMM here ({sm._BLOCKWISE_STATE['error']}); nothing to time")
    rows = rows or [(M, K, N, (), None) for M, K, N in (QUICK if args.quick else SHAPES)]
    tag = "-quick" if args.quick else f"-{args.preset}" if args.preset else "-shapes" if args.shapes else ""
    path = results_path("mxfp8_linear" + tag + ("-eager" if args.eager else ""), args.out)

    def save(payload):
        rewrite_results(path, payload)

    payload = {
        "benchmark": "mxfp8_linear", "environment": environment(), "dtype": str(DTYPE), "rule": args.rule,
        "recipe": "blockwise: E4M3, pow2 scales, 1x128 (x, dY) x 128x128 (W), cuBLAS blockwise scaled_mm",
        "timing": "eager launches" if args.eager else "CUDA graph replay",
        "flops_convention": "fwd 2MNK, bwd 4MNK", "speedup_convention": "bf16 ms / fp8 ms", "targets": TARGETS,
        "blockwise_api": api, "preset": args.preset, "shapes": [],
    }
    if args.preset:
        payload["preset_source"] = PRESET_SOURCES[args.preset]
    for i, (M, K, N, layers, calls) in enumerate(rows):
        about = {"layers": list(layers), "calls_per_forward": calls} if args.preset else {}
        if time.time() - t0 > args.budget_s:
            payload["shapes"].append({"M": M, "K": K, "N": N, "label": f"M{M} K{K} N{N}", **about,
                                      "skipped": "time budget"})
            print(f"\n== M{M} K{K} N{N}: skipped (time budget)", flush=True)
            continue
        rec = run_shape(M, K, N, args, i)
        if calls:
            # per training step (one forward and backward): bf16 - FP8 ms over the shape's calls (> 0: saves)
            ms = rec["ms"]
            rec["saved_ms_per_step"] = {
                name: calls * (ms["bf16_fwd"] + ms["bf16_bwd"] - ms[f"{name}_fwd"] - ms[f"{name}_bwd"])
                if all(ms.get(f"{n}_{d}") for n in ("bf16", name) for d in ("fwd", "bwd")) else None
                for name in ("fp8", "fp8_op")}
        payload["shapes"].append({**rec, **about})
        payload["wall_s"] = time.time() - t0
        save(payload)  # after every shape: a run stopped by a time limit keeps what it measured
    print_table(payload)
    print(f"results in {path}")


if __name__ == "__main__":
    main()
