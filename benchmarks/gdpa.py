"""Pointwise-activation attention (GDPA): gemcompile::gdpa against what a modeler has without it.

    python benchmarks/gdpa.py [--quick] [--only hstu|cross|pma] [--cuda-graph] [--profile] [--diagnose] [--budget-s 420]
                              [--out DIR]
    python benchmarks/gdpa.py --smoke          # CPU: tiny shapes, correctness only, no timing

Three GEM/HSTU shapes of attention, bf16, side by side in one run, forward and forward+backward:
  hstu    silu(q k^T * alpha + rab) / L, causal, jagged self-attention, relative bias gathered from a
          learned table (its gradient included)
  cross   GDPA cross-attention (PFFN): long jagged queries against a short all-valid summary, gelu, / Lq
  pma     a few learned queries shared by the batch against long jagged keys, gelu
Methods:
  gemcompile       torch.ops.gemcompile.gdpa on the padded tensors + lengths (eager call)
  gem_compile      gem_compile of the padded model code (the gdpa pass rewrites it; checked per shape)
  padded_eager     the padded model code in eager PyTorch
  compiled_padded  torch.compile (default) of the padded model code
FlexAttention is not a peer: its score_mod runs before a softmax that it always applies, so it cannot
express attention without a softmax.

Useful FLOPs count valid (i, j) pairs only: forward 4*H*D*pairs, forward+backward 3.5x (the bias's
gather is not counted; causal counts the lower triangle, so these TFLOP/s are about half of what the
anchor table's convention, 4*H*D*sum(len^2), gives for the same time). ``speedup`` = peer time / gemcompile time, per direction (forward, backward
= fwd+bwd - fwd), so the forward/backward split can be read against Meta's (2x forward, 1.6x backward
for GDPA over their earlier Triton kernel). Each shape records a correctness check of gemcompile and
gem_compile against the padded eager code at the positions the model uses.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE.parent))
sys.path.insert(0, str(_HERE))

from harness import bench_ms, environment, format_table, graphed, kernel_times, tflops, write_json  # noqa: E402

import gemcompile.lowering  # noqa: E402,F401  (registers torch.ops.gemcompile.*)

DTYPE = torch.bfloat16
SHAPES = [
    {"case": "hstu", "B": 32, "L": 1024, "H": 4, "D": 64, "fill": 0.5},
    {"case": "cross", "B": 128, "L": 2048, "H": 4, "D": 128, "fill": 0.5, "keys": 16},
    {"case": "cross", "B": 128, "L": 2048, "H": 4, "D": 128, "fill": 0.5, "keys": 64},
    {"case": "cross", "B": 128, "L": 2048, "H": 4, "D": 128, "fill": 0.5, "keys": 256},
    {"case": "pma", "B": 256, "L": 4096, "H": 4, "D": 128, "fill": 0.5, "queries": 8},
    {"case": "pma", "B": 256, "L": 4096, "H": 4, "D": 128, "fill": 0.5, "queries": 32},
]
QUICK = [
    {"case": "hstu", "B": 4, "L": 256, "H": 2, "D": 64, "fill": 0.5},
    {"case": "cross", "B": 4, "L": 256, "H": 2, "D": 64, "fill": 0.5, "keys": 16},
    {"case": "pma", "B": 4, "L": 256, "H": 2, "D": 64, "fill": 0.5, "queries": 8},
]
SMOKE = [
    {"case": "hstu", "B": 3, "L": 24, "H": 2, "D": 16, "fill": 0.5},
    {"case": "cross", "B": 3, "L": 24, "H": 2, "D": 16, "fill": 0.5, "keys": 5},
    {"case": "pma", "B": 3, "L": 24, "H": 2, "D": 16, "fill": 0.5, "queries": 4},
]
METHODS = ["gemcompile", "gem_compile", "padded_eager", "compiled_padded"]


def draw_lengths(B: int, L: int, fill: float, seed: int, device) -> torch.Tensor:
    """Uniform in [1, 2*fill*L] (fill <= 0.5), as the jagged-attention benchmark draws them."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, max(2, min(L, int(2 * fill * L))) + 1, (B,), generator=g).to(device)


# ---------------------------------------------------------------------------------------------------
# The padded model code of each case (what the gdpa pass sees) and the same computation as one op call


def hstu_padded(q, k, v, n, x):
    """As ARCHITECTURE.md's anchor (shared/bench/anchors.py) writes it: a relative-position bias gathered
    from a learned (2L - 1) table, causal, both sides padded, / L."""
    L = q.shape[2]
    i = torch.arange(L, device=q.device)
    rab = x["rab_table"][(i[None, :] - i[:, None]) + L - 1]  # (L, L)
    a = F.silu(q @ k.transpose(-2, -1) * x["alpha"] + rab) / L
    valid = i[None, :] < n[:, None]
    m = valid[:, None, None, :] & valid[:, None, :, None] & (i[None, :] <= i[:, None])
    return (a * m) @ v


def hstu_op(q, k, v, n, x):
    # as gem_compile rewrites the gather (passes/attention/relative_bias.py, passes/gdpa_relative_table.py): the
    # kernels read the (2L - 1) table in place at j - i + L - 1
    L = q.shape[2]
    return torch.ops.gemcompile.gdpa(q, k, v, n, n, x["rab_table"], "silu", x["alpha"], 1.0 / L, False, True, 0,
                                     None, 0, L - 1)


def hstu_op_dense_bias(q, k, v, n, x):
    # the code before the table path: the gathered (L, L) bias, a dense operand of the kernels
    L = q.shape[2]
    rab = torch.ops.gemcompile.relative_bias(x["rab_table"], L, L, L - 1)
    return torch.ops.gemcompile.gdpa(q, k, v, n, n, rab[None, None], "silu", x["alpha"], 1.0 / L, False, True, 0)


def cross_padded(q, k, v, n, x):
    L = q.shape[2]
    valid = torch.arange(L, device=q.device)[None, :] < n[:, None]
    a = F.gelu(q @ k.transpose(-2, -1) * x["alpha"]) / L
    return (a * valid[:, None, :, None]) @ v


def cross_op(q, k, v, n, x):
    return torch.ops.gemcompile.gdpa(q, k, v, n, None, None, "gelu", x["alpha"], 1.0 / q.shape[2], False, False, 0)


def pma_padded(q, k, v, n, x):
    valid = torch.arange(k.shape[2], device=k.device)[None, :] < n[:, None]
    a = F.gelu(q @ k.transpose(-2, -1) * x["alpha"])
    return (a * valid[:, None, None, :]) @ v


def pma_op(q, k, v, n, x):
    return torch.ops.gemcompile.gdpa(q, k, v, None, n, None, "gelu", x["alpha"], 1.0, False, False, 0)


CASES = {"hstu": (hstu_padded, hstu_op), "cross": (cross_padded, cross_op), "pma": (pma_padded, pma_op)}


# --diagnose (hstu only): the same shape with one ingredient changed at a time, to tell what the GDPA
# kernels' time is spent on. Each computes another function than the model: timed, never checked against it.
def hstu_op_no_bias(q, k, v, n, x):
    L = q.shape[2]
    return torch.ops.gemcompile.gdpa(q, k, v, n, n, None, "silu", x["alpha"], 1.0 / L, False, True, 0)


def hstu_op_relu(q, k, v, n, x):  # no sigmoid per score
    L = q.shape[2]
    return torch.ops.gemcompile.gdpa(q, k, v, n, n, x["rab_table"], "relu", x["alpha"], 1.0 / L, False, True, 0,
                                     None, 0, L - 1)


def hstu_softmax_causal(q, k, v, n, x):  # the jagged softmax kernels on the same shape, causal, no bias
    return torch.ops.gemcompile.jagged_attention(q, k, v, n, n, None, True, x["alpha"])


@contextlib.contextmanager
def sigmoid_path(name):
    """gdpa_tl_sigmoid: HSTU's op with the kernels' silu through tl.sigmoid (exp + division per score), not
    the SFU's tanh; held over the forward and the backward (the flag is read at each launch)."""
    from gemcompile.lowering.gdpa import triton as gdpa_triton

    saved = gdpa_triton.SFU_ACTIVATIONS
    gdpa_triton.SFU_ACTIVATIONS = saved and name != "gdpa_tl_sigmoid"
    try:
        yield
    finally:
        gdpa_triton.SFU_ACTIVATIONS = saved


DIAGNOSTICS = {"hstu": {"gdpa_dense_bias": hstu_op_dense_bias, "gdpa_tl_sigmoid": hstu_op,
                        "gdpa_no_bias": hstu_op_no_bias,
                        "gdpa_relu": hstu_op_relu, "jagged_softmax_causal": hstu_softmax_causal}}


def make_inputs(shape, device, seed):
    B, L, H, D = shape["B"], shape["L"], shape["H"], shape["D"]
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*size):
        return (torch.randn(*size, generator=g, device=device) * 0.5).to(DTYPE).requires_grad_(True)

    n = draw_lengths(B, L, shape["fill"], seed, device)
    x = {"alpha": D**-0.5}
    if shape["case"] == "hstu":
        q, k, v = randn(B, H, L, D), randn(B, H, L, D), randn(B, H, L, D)
        x["rab_table"] = randn(2 * L - 1)
        pairs = int((n * (n + 1) // 2).sum())
    elif shape["case"] == "cross":
        q, k, v = randn(B, H, L, D), randn(B, H, shape["keys"], D), randn(B, H, shape["keys"], D)
        pairs = int(n.sum()) * shape["keys"]
    else:
        q, k, v = randn(1, H, shape["queries"], D), randn(B, H, L, D), randn(B, H, L, D)
        pairs = int(n.sum()) * shape["queries"]
    return q, k, v, n, x, pairs


def used_positions(shape, out, n):
    """Rows the model defines: valid query rows (every row for PMA's learned queries)."""
    if shape["case"] == "pma":
        return torch.ones_like(out, dtype=torch.bool)
    rows = torch.arange(out.shape[2], device=out.device)[None, :] < n[:, None]
    return rows[:, None, :, None].expand_as(out)


def leaves_of(q, k, v, x):
    return [q, k, v] + [t for t in x.values() if isinstance(t, torch.Tensor)]


def correctness(shape, fns, q, k, v, n, x) -> dict:
    """Each method against the padded eager code, fp32 reference of the same bf16 inputs."""
    padded, _ = CASES[shape["case"]]
    ref_in = [t.detach().float().requires_grad_(True) for t in (q, k, v)]
    ref_x = {key: (t.detach().float().requires_grad_(True) if isinstance(t, torch.Tensor) else t)
             for key, t in x.items()}
    ref = padded(*ref_in, n, ref_x)
    used = used_positions(shape, ref, n)
    g = torch.randn(ref.shape, generator=torch.Generator(device=ref.device).manual_seed(7), device=ref.device)
    ref_grads = torch.autograd.grad(torch.where(used, ref, 0), leaves_of(*ref_in, ref_x), g)
    result = {}
    for name, fn in fns.items():
        out = fn(q, k, v, n, x)
        grads = torch.autograd.grad(torch.where(used, out, 0), leaves_of(q, k, v, x), g.to(out.dtype))
        errs = {"out": _rel(torch.where(used, out, 0), torch.where(used, ref, 0))}
        for label, a, b in zip(("dq", "dk", "dv", "dbias"), grads, ref_grads):
            errs[label] = _rel(a, b)
        errs["ok"] = all(e < 3e-2 for e in errs.values())
        result[name] = errs
    return result


def _rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def run_shape(shape, args, index, device):
    padded, op = CASES[shape["case"]]
    from gemcompile import GemConfig, explain, gem_compile

    q, k, v, n, x, pairs = make_inputs(shape, device, seed=index)
    H, D = shape["H"], shape["D"]
    extra = {"keys": shape.get("keys"), "queries": shape.get("queries")}
    label = f"{shape['case']} B{shape['B']} L{shape['L']} H{H} D{D} fill{float(n.sum()) / (shape['B'] * shape['L']):.2f}"
    label += "".join(f" {k}{v}" for k, v in extra.items() if v)
    fwd_flops = 4 * H * D * pairs
    rec = dict(shape, label=label, pairs=pairs, fwd_flops=fwd_flops, fwdbwd_flops=3.5 * fwd_flops, results={},
               speedup={})
    print(f"\n== {label}", flush=True)
    report = explain(padded, q, k, v, n, x, config=GemConfig())
    rec["gem_compile_rewrites"] = dict(report.counts)
    rec["gem_compile_refusals"] = [r.reason for r in report.refusals]
    fns = {
        "gemcompile": op,
        "gem_compile": gem_compile(padded),
        "padded_eager": padded,
        "compiled_padded": torch.compile(padded),
    }
    rec["correctness"] = correctness(shape, fns, q, k, v, n, x)
    if args.diagnose:  # after the check: these compute other functions (see DIAGNOSTICS)
        fns.update(DIAGNOSTICS.get(shape["case"], {}))
    print(f"   gdpa rewrites under gem_compile: {report.counts.get('gdpa', 0)}; correctness: "
          + ", ".join(f"{m}: {'ok' if c['ok'] else c}" for m, c in rec["correctness"].items()), flush=True)
    if args.smoke:
        return rec
    leaves = leaves_of(q, k, v, x)
    g = torch.randn(k.shape[0], H, q.shape[2], D, device=device, dtype=DTYPE)
    for name, fn in fns.items():
        entry = rec["results"].setdefault(name, {})
        if time.time() - args.t0 > args.budget_s:
            entry["error"] = "skipped: time budget"
            continue
        try:
            def fwd(fn=fn, name=name):
                with torch.no_grad(), sigmoid_path(name):
                    fn(q, k, v, n, x)

            def fwdbwd(fn=fn, name=name):
                with sigmoid_path(name):  # diagnostics skip the bias
                    torch.autograd.grad(fn(q, k, v, n, x), leaves, g, allow_unused=True)

            fwd(), fwdbwd()
            torch.cuda.synchronize()
            if args.profile:
                entry["fwdbwd_kernels"] = kernel_times(fwdbwd)
                for r in entry["fwdbwd_kernels"][:6]:
                    print(f"      {r['us']:9.1f} us  x{r['calls']:.0f}  {r['kernel']}", flush=True)
            if args.cuda_graph:
                fwd, fwdbwd = graphed(fwd), graphed(fwdbwd)
            entry["fwd_ms"] = bench_ms(fwd)
            entry["fwdbwd_ms"] = bench_ms(fwdbwd)
            entry["bwd_ms"] = entry["fwdbwd_ms"] - entry["fwd_ms"]
            entry["fwd_tflops"] = tflops(fwd_flops, entry["fwd_ms"])
            entry["fwdbwd_tflops"] = tflops(3.5 * fwd_flops, entry["fwdbwd_ms"])
            print(f"   {name:16s} fwd {entry['fwd_ms']:8.3f} ms {entry['fwd_tflops']:6.1f} TF/s   fwd+bwd "
                  f"{entry['fwdbwd_ms']:8.3f} ms {entry['fwdbwd_tflops']:6.1f} TF/s", flush=True)
        except Exception as e:  # a peer that fails (OOM, compile error) is recorded and the run goes on
            entry["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            print(f"   {name:16s} failed: {entry['error'][:200]}", flush=True)
        finally:
            gc.collect()
            torch.cuda.empty_cache()
    ours = rec["results"]["gemcompile"]
    for name, entry in rec["results"].items():
        if name in METHODS and name != "gemcompile" and "fwd_ms" in entry and "fwd_ms" in ours:
            rec["speedup"][name] = {d: entry[f"{d}_ms"] / ours[f"{d}_ms"] for d in ("fwd", "bwd", "fwdbwd")}
    return rec


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shapes: a GPU smoke test")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, correctness only")
    parser.add_argument("--budget-s", type=float, default=420.0, help="skip methods that would start later")
    parser.add_argument("--out", default=None, help="directory of the JSON (default: $OUT, else results/)")
    parser.add_argument("--only", default=None, choices=sorted(CASES), help="run one case's shapes")
    parser.add_argument("--cuda-graph", action="store_true",
                        help="time every method replayed from a CUDA graph (GPU work alone, no host overhead)")
    parser.add_argument("--profile", action="store_true", help="record the GPU time of each kernel per method")
    parser.add_argument("--diagnose", action="store_true",
                        help="hstu: also time the op with the gathered dense (L, L) bias (not the table read in "
                        "place), with silu through tl.sigmoid (not the SFU's tanh), without the bias, with relu, "
                        "and the jagged softmax kernels (causal) on the same shape: what the GDPA kernels spend "
                        "their time on")
    args = parser.parse_args(argv)
    args.t0 = time.time()
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("benchmarks/gdpa.py needs a CUDA GPU (or --smoke on CPU)")
    if hasattr(torch._dynamo.config, "recompile_limit"):
        torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.cache_size_limit = 64
    shapes = SMOKE if args.smoke else QUICK if args.quick else SHAPES
    shapes = [sh for sh in shapes if args.only in (None, sh["case"])]
    payload = {"benchmark": "gdpa", "environment": environment(), "dtype": str(DTYPE), "methods": METHODS,
               "command": "python " + " ".join(sys.argv),
               "flops_convention": "fwd = 4*H*D*valid pairs; fwd+bwd = 3.5x fwd",
               "speedup_convention": "peer ms / gemcompile ms; bwd = fwd+bwd - fwd",
               "timing": "CUDA graph replay" if args.cuda_graph else "eager calls", "shapes": []}
    for i, shape in enumerate(shapes):
        payload["shapes"].append(run_shape(shape, args, i, device))
    if args.smoke:
        bad = [(s["label"], m) for s in payload["shapes"] for m, c in s["correctness"].items() if not c["ok"]]
        rewrites = [s["gem_compile_rewrites"].get("gdpa", 0) for s in payload["shapes"]]
        print(f"\nsmoke: rewrites per shape {rewrites}; failed checks: {bad or 'none'}")
        sys.exit(1 if bad or 0 in rewrites else 0)
    path = write_json("gdpa" + (f"-{args.only}" if args.only else "") + ("-cudagraph" if args.cuda_graph else ""),
                      payload, args.out)
    rows = []
    for s in payload["shapes"]:
        for name, e in s["results"].items():
            sp = s["speedup"].get(name, {})
            rows.append({"shape": s["label"], "method": name, "fwd_ms": e.get("fwd_ms"),
                         "fwd_tf": e.get("fwd_tflops"), "fb_ms": e.get("fwdbwd_ms"), "fb_tf": e.get("fwdbwd_tflops"),
                         "sp_fwd": sp.get("fwd"), "sp_bwd": sp.get("bwd"), "note": (e.get("error") or "")[:60]})
    print("\n" + format_table(rows, [("shape", "shape", "s"), ("method", "method", "s"), ("fwd_ms", "fwd ms", ".3f"),
                                     ("fwd_tf", "fwd TF/s", ".1f"), ("fb_ms", "fwd+bwd ms", ".3f"),
                                     ("fb_tf", "fwd+bwd TF/s", ".1f"), ("sp_fwd", "ours x fwd", ".2f"),
                                     ("sp_bwd", "ours x bwd", ".2f"), ("note", "note", "s")]))
    print(f"results in {path}")


if __name__ == "__main__":
    main()
