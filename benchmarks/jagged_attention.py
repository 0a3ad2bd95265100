"""Jagged softmax self-attention: gemcompile::jagged_attention against the peers a user would pick instead.

    python benchmarks/jagged_attention.py [--quick] [--out DIR] [--budget-s 300]
                                          [--only anchors|grid|hopper] [--methods a,b] [--cuda-graph]
                                          [--kernel-profile] [--flex-mode default|max-autotune]

Side by side in one run, forward only and forward+backward, bf16, non-causal, no bias:
  gemcompile           torch.ops.gemcompile.jagged_attention on padded (B, H, L, D) + lengths
  gem_compile_module   gem_compile of a plain padded module (SDPA, key mask from the lengths, output rows
                       zeroed by the same mask): what a user gets without calling our op
  sdpa_padded_mask     F.scaled_dot_product_attention on the padded tensors with a boolean key mask
  compiled_padded      torch.compile of hand-written masked attention (q@k^T*scale, masked_fill, softmax, @v)
  flex_document_mask   compiled FlexAttention over packed tokens with a document mask (block mask built
                       directly from the offsets, 128-token blocks, the blocks wholly inside one document
                       marked full as create_block_mask would; mask_mod as in shared/bench/anchors.py)
  njt_sdpa             nested jagged tensors + SDPA (as in anchors.py), eager

The compiled peers are compiled per shape, as our kernels are autotuned per shape: Dynamo is reset at
the start of every shape and each peer is a fresh ``torch.compile(..., dynamic=False)`` (before issue
28 they were compiled once and reused across shapes under automatic dynamic shapes). The JSON's
``peer_setup`` says how each peer ran.

Useful TFLOP/s count only valid (i, j) pairs: forward 4*H*D*sum(len^2), forward+backward 3.5x that
(ARCHITECTURE.md conventions). ``speedup`` = peer time / gemcompile time. Every shape also records a
correctness spot check of gemcompile against padded SDPA at valid rows (output and gradients), so a
fast wrong kernel cannot go unnoticed. A failing peer records its error and the run goes on. Shapes
run in order (anchors first, largest last); a shape or peer that would start after --budget-s is
skipped and recorded as such (run ``--only anchors`` and ``--only grid`` separately to cover both).
``--only hopper`` runs issue 25's shapes; ``speedup_vs_module`` there is peer time / gem_compile_module time,
and ``--kernel-profile`` records each method's kernels (GPU us per fwd+bwd call, torch.profiler).
The JSON is rewritten after every shape, so a killed run keeps what it measured. ``--cuda-graph`` times
every method replayed from a CUDA graph: the GPU work alone, with the host's Python and launch costs
taken out for all methods alike.

Lengths are drawn as in anchors.py: uniform in [1, 2*fill*L] for fill <= 0.5; for fill > 0.5 (which
that rule cannot reach) uniform in [(2*fill - 1)*L, L]. The realised fill is recorded.
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE.parent))  # the repository root: import gemcompile without installing it
sys.path.insert(0, str(_HERE))

from harness import (bench_ms, environment, format_table, graphed, kernel_times, rewrite_results,  # noqa: E402
                     rotation_count, tflops, write_json)

import gemcompile.lowering  # noqa: E402,F401  (registers torch.ops.gemcompile.*)
from gemcompile.lowering.common.flops import BACKWARD_FLOPS_RATIO  # noqa: E402
from gemcompile.lowering.jagged_attention.flops import attention_pairs  # noqa: E402

DEV = "cuda"
DTYPE = torch.bfloat16
ANCHORS = [  # ARCHITECTURE.md's anchor table
    dict(B=32, L=2048, H=8, D=64, fill=0.5),
    dict(B=64, L=1024, H=4, D=128, fill=0.5),
    dict(B=16, L=8192, H=4, D=64, fill=0.3),
]
GRID = [
    dict(B=B, L=L, H=4, D=128, fill=fill)
    for L in (256, 1024, 4096)
    for B in (256, 1152)
    for fill in (0.5, 0.7)
]
HOPPER = [  # issue 25's must-show shapes (uniform lengths)
    dict(B=1152, L=1024, H=4, D=128, fill=0.5),
    dict(B=256, L=4096, H=4, D=128, fill=0.3),
    dict(B=32, L=2048, H=8, D=64, fill=0.5),
]
QUICK = [dict(B=8, L=512, H=4, D=64, fill=0.5), dict(B=16, L=256, H=2, D=128, fill=0.7)]
METHODS = ["gemcompile", "gem_compile_module", "sdpa_padded_mask", "compiled_padded", "flex_document_mask",
           "njt_sdpa"]


def draw_lengths(B: int, L: int, fill: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if fill <= 0.5:
        hi = max(2, int(2 * fill * L))
        lengths = torch.randint(1, min(hi, L) + 1, (B,), generator=g)
    else:
        lo = max(1, int((2 * fill - 1) * L))
        lengths = torch.randint(lo, L + 1, (B,), generator=g)
    return lengths.to(DEV)


# ---------------------------------------------------------------------------------------------------
# Peers


def plain_padded_module(q, k, v, lengths):
    """What most models write: SDPA with a key-padding mask built from the lengths, then the padded query
    rows zeroed by the same mask (gem_compile'd: the pass folds the zeroing into the kernel's q_lengths)."""
    valid = torch.arange(q.shape[2], device=q.device)[None, :] < lengths[:, None]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=valid[:, None, None, :])
    return o * valid[:, None, :, None]


def padded_masked_attention(q, k, v, keymask, scale):
    """What a modeler writes by hand; torch.compile'd as a peer."""
    s = (q @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(~keymask[:, None, None, :], float("-inf"))
    p = torch.softmax(s.float(), dim=-1).to(q.dtype)
    return p @ v


PEER_SETUP = {
    "sdpa_padded_mask": "F.scaled_dot_product_attention on the padded tensors with the (B, 1, 1, L) bool key mask "
                        "(PyTorch picks the backend)",
    "compiled_padded": "torch.compile(padded_masked_attention, dynamic=False), a fresh compile per shape after "
                       "torch._dynamo.reset()",
    "flex_document_mask": "FlexAttention over packed tokens, document BlockMask with 128-token blocks, full blocks "
                          "marked; torch.compile(flex_attention, dynamic=False), a fresh compile per shape after "
                          "torch._dynamo.reset(); Inductor's default kernel options",
    "njt_sdpa": "nested jagged tensors (torch.nested, layout=jagged) + F.scaled_dot_product_attention, eager",
    "gemcompile": "torch.ops.gemcompile.jagged_attention, eager calls, kernels autotuned per shape",
    "gem_compile_module": "gem_compile(plain_padded_module, dynamic=False): SDPA with a key mask from the lengths, "
                          "output rows zeroed by it; a fresh compile per shape after torch._dynamo.reset()",
}
"""How each method is set up, recorded in the JSON (``peer_setup``)."""


def compiled_padded():
    """A fresh compile of the padded peer with static shapes (run_shape resets Dynamo for every shape)."""
    return torch.compile(padded_masked_attention, dynamic=False)


FLEX_MODES = {"default": None, "max-autotune": "max-autotune-no-cudagraphs"}
"""--flex-mode -> torch.compile mode of the FlexAttention peer. "max-autotune": FlexAttention times its own
tile list per shape (the block attention benchmark's 64-token peer needs it; here it is optional, and the
runs so far used the default)."""
_FLEX = {"mode": None}


def compiled_flex():
    """A fresh compile of FlexAttention with static shapes (run_shape resets Dynamo for every shape), in the
    torch.compile mode --flex-mode picked."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False, mode=_FLEX["mode"])


def document_block_mask(lengths: torch.Tensor, block: int = 128):
    """FlexAttention BlockMask of the block-diagonal document mask over packed tokens, built directly from
    the offsets (create_block_mask would evaluate mask_mod on all T^2 pairs). Blocks fully inside one
    document are 'full' (no mask_mod); blocks on a document boundary are partial."""
    from torch.nn.attention.flex_attention import BlockMask

    dev = lengths.device
    B = lengths.numel()
    offsets = F.pad(lengths.cumsum(0), (1, 0))
    T = int(offsets[-1])
    n = math.ceil(T / block)
    TP = n * block
    doc = torch.full((TP,), -1, dtype=torch.int32, device=dev)
    doc[:T] = torch.repeat_interleave(torch.arange(B, device=dev, dtype=torch.int32), lengths)
    first = torch.arange(n, device=dev) * block
    last = (first + block - 1).clamp(max=T - 1)
    ends = offsets[1:].contiguous()
    d_first = torch.searchsorted(ends, first.clamp(max=T - 1), right=True).clamp(max=B - 1)
    d_last = torch.searchsorted(ends, last, right=True).clamp(max=B - 1)
    lo = offsets[d_first] // block
    hi = (offsets[d_last + 1] + block - 1) // block
    inside = (d_first == d_last) & (offsets[d_first] <= first) & (first + block <= offsets[d_first + 1])
    flo = torch.where(inside, (offsets[d_first] + block - 1) // block, hi)
    fhi = torch.maximum(torch.where(inside, offsets[d_first + 1] // block, hi), flo)
    n1 = flo - lo
    count = torch.where(first < T, n1 + (hi - fhi), 0)
    full_count = torch.where(first < T, fhi - flo, 0)
    j = torch.arange(n, device=dev)[None, :]
    kv_idx = torch.where(j < n1[:, None], lo[:, None] + j, fhi[:, None] + (j - n1[:, None])).clamp(0, n - 1)
    full_idx = (flo[:, None] + j).clamp(0, n - 1)

    def mask_mod(b, h, q_idx, kv_idx_):
        return (doc[q_idx] == doc[kv_idx_]) & (doc[q_idx] >= 0)

    args = [
        count[None, None].int(),
        kv_idx[None, None].int(),
        full_count[None, None].int(),
        full_idx[None, None].int(),
    ]
    try:
        bm = BlockMask.from_kv_blocks(*args, BLOCK_SIZE=block, mask_mod=mask_mod, seq_lengths=(TP, TP))
    except TypeError:  # older signature without seq_lengths: the shapes already say TP
        bm = BlockMask.from_kv_blocks(*args, BLOCK_SIZE=block, mask_mod=mask_mod)
    return bm, TP


def pack(x: torch.Tensor, keymask: torch.Tensor) -> torch.Tensor:
    """(B, H, L, D) -> (T, H, D) valid tokens, in batch order."""
    return x.transpose(1, 2)[keymask]


# ---------------------------------------------------------------------------------------------------
# Per shape


def leaf(x):
    return x.detach().clone().requires_grad_(True)


def make_methods(shape, sets, lengths, keymask):
    """name -> (setup() -> list of per-set (fwd, fwdbwd) closures). Setup runs inside the error guard."""
    D = shape["D"]
    scale = D**-0.5
    am = keymask[:, None, None, :]
    offsets = F.pad(lengths.cumsum(0), (1, 0))
    methods = {}

    def padded(call):
        def setup():
            closures = []
            for q, k, v, g in sets:

                def fwd(q=q, k=k, v=v):
                    with torch.no_grad():
                        call(q, k, v)

                def fwdbwd(q=q, k=k, v=v, g=g):
                    torch.autograd.grad(call(q, k, v), (q, k, v), g)

                closures.append((fwd, fwdbwd))
            return closures

        return setup

    methods["gemcompile"] = padded(
        lambda q, k, v: torch.ops.gemcompile.jagged_attention(q, k, v, lengths, lengths, None, False, scale)
    )
    methods["sdpa_padded_mask"] = padded(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=am)
    )
    from gemcompile import gem_compile

    module = gem_compile(plain_padded_module, dynamic=False)
    methods["gem_compile_module"] = padded(lambda q, k, v: module(q, k, v, lengths))
    padded_peer = compiled_padded()
    methods["compiled_padded"] = padded(lambda q, k, v: padded_peer(q, k, v, keymask, scale))

    def packed_sets():
        return [tuple(leaf(pack(x, keymask)) for x in (q, k, v, g)) for q, k, v, g in sets]

    def flex_setup():
        bm, TP = document_block_mask(lengths)
        fa = compiled_flex()
        closures = []
        for q, k, v, g in packed_sets():
            T = q.shape[0]
            qf, kf, vf, gf = (
                leaf(F.pad(x.detach(), (0, 0, 0, 0, 0, TP - T)).transpose(0, 1)[None].contiguous())
                for x in (q, k, v, g)
            )

            def fwd(qf=qf, kf=kf, vf=vf):
                with torch.no_grad():
                    fa(qf, kf, vf, block_mask=bm, scale=scale)

            def fwdbwd(qf=qf, kf=kf, vf=vf, gf=gf):
                torch.autograd.grad(fa(qf, kf, vf, block_mask=bm, scale=scale), (qf, kf, vf), gf.detach())

            closures.append((fwd, fwdbwd))
        return closures

    methods["flex_document_mask"] = flex_setup

    def njt_setup():
        closures = []
        for q, k, v, g in packed_sets():

            def call(q, k, v):
                qn, kn, vn = (
                    torch.nested.nested_tensor_from_jagged(x, offsets).transpose(1, 2) for x in (q, k, v)
                )
                return F.scaled_dot_product_attention(qn, kn, vn, scale=scale).transpose(1, 2).values()

            def fwd(q=q, k=k, v=v):
                with torch.no_grad():
                    call(q, k, v)

            def fwdbwd(q=q, k=k, v=v, g=g):
                torch.autograd.grad(call(q, k, v), (q, k, v), g.detach())

            closures.append((fwd, fwdbwd))
        return closures

    methods["njt_sdpa"] = njt_setup

    return methods


def memory_guard(name, shape):
    """Reason to skip a peer whose dense intermediates would not fit, else None."""
    B, L, H = shape["B"], shape["L"], shape["H"]
    if name == "compiled_padded":
        need = B * H * L * L * 12  # scores, fp32 softmax, probabilities, and their grads (rough)
        free = torch.cuda.mem_get_info()[0]
        if need > 0.6 * free:
            gib = 2**30
            return f"skipped: dense (B, H, L, L) scores need ~{need / gib:.0f} of {free / gib:.0f} GiB free"
    return None


def correctness(sets, lengths, keymask, shape):
    """gemcompile vs padded SDPA at valid rows (output and gradients, grad_out zero at padded rows)."""
    q, k, v, g = sets[0]
    scale = shape["D"] ** -0.5
    out = torch.ops.gemcompile.jagged_attention(q, k, v, lengths, lengths, None, False, scale)
    grads = torch.autograd.grad(out, (q, k, v), g)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=keymask[:, None, None, :])
    ref_grads = torch.autograd.grad(ref, (q, k, v), g)
    rows = keymask[:, None, :, None].expand_as(out)
    result = {
        "nan_in_output": bool(out.isnan().any()),
        "padded_rows_zero": bool((out.masked_select(~rows) == 0).all()),
    }
    for name, a, b in (
        ("out", out, ref),
        ("dq", grads[0], ref_grads[0]),
        ("dk", grads[1], ref_grads[1]),
        ("dv", grads[2], ref_grads[2]),
    ):
        a, b = a.masked_select(rows).float(), b.masked_select(rows).float()
        result[f"max_abs_diff_{name}"] = float((a - b).abs().max())
        result[f"rel_err_{name}"] = float((a - b).norm() / b.norm().clamp_min(1e-30))
    result["ok"] = (
        not result["nan_in_output"]
        and result["padded_rows_zero"]
        and all(result[f"rel_err_{n}"] < 3e-2 for n in ("out", "dq", "dk", "dv"))
    )
    return result


def run_shape(shape, args, index):
    B, L, H, D = shape["B"], shape["L"], shape["H"], shape["D"]
    lengths = draw_lengths(B, L, shape["fill"], seed=1000 + index)
    T = int(lengths.sum())
    pairs = attention_pairs(lengths, lengths, L, L, False)
    fwd_flops = 4 * H * D * pairs
    train_flops = (1 + BACKWARD_FLOPS_RATIO) * fwd_flops
    label = f"B{B} L{L} H{H} D{D} fill{T / (B * L):.2f}"
    rec = dict(
        shape,
        label=label,
        fill_realised=T / (B * L),
        tokens=T,
        pairs=pairs,
        fwd_flops=fwd_flops,
        fwdbwd_flops=train_flops,
        results={},
        speedup={},
        correctness=None,
    )
    keymask = torch.arange(L, device=DEV)[None, :] < lengths[:, None]
    set_bytes = 4 * B * H * L * D * 2
    n_sets = rotation_count(set_bytes)
    torch.manual_seed(index)
    sets = []
    for _ in range(n_sets):
        q, k, v = (torch.randn(B, H, L, D, device=DEV, dtype=DTYPE, requires_grad=True) for _ in range(3))
        g = torch.randn(B, H, L, D, device=DEV, dtype=DTYPE) * keymask[:, None, :, None]
        sets.append((q, k, v, g))
    rec["input_sets"] = n_sets
    torch._dynamo.reset()  # the compiled peers compile for this shape alone (dynamic=False, fresh compiles)
    print(f"\n== {label}: {T} tokens, {n_sets} input set(s)", flush=True)
    try:
        rec["correctness"] = correctness(sets, lengths, keymask, shape)
    except Exception as e:
        rec["correctness"] = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:500]}"}
    print(f"   correctness vs padded SDPA: {rec['correctness']}", flush=True)

    if "gem_compile_module" in (args.methods or METHODS):  # the pass fired, and folded the query rows
        from gemcompile import GemConfig, explain

        report = explain(plain_padded_module, *sets[0][:3], lengths, config=GemConfig())
        rec["module_rewrites"] = {k: v for k, v in report.counts.items() if v}
        rec["module_refusals"] = [r.reason for r in report.refusals]
    methods = make_methods(shape, sets, lengths, keymask)
    if args.methods:
        methods = {name: setup for name, setup in methods.items() if name in args.methods}
    for name, setup in methods.items():
        entry = rec["results"].setdefault(name, {})
        reason = memory_guard(name, shape)
        if reason is None and args.cuda_graph and name == "njt_sdpa":
            reason = "not run: NJT syncs with the host, so it cannot be captured in a CUDA graph"
        if reason is None and time.time() - args.t0 > args.budget_s:
            reason = "skipped: time budget"
        if reason:
            entry["error"] = reason
            print(f"   {name:20s} {reason}", flush=True)
            continue
        try:
            t = time.time()
            closures = setup()
            for fwd, fwdbwd in closures:  # compile and warm up outside the timing
                fwd()
                fwdbwd()
            if args.cuda_graph:
                closures = [(graphed(fwd), graphed(fwdbwd)) for fwd, fwdbwd in closures]
            torch.cuda.synchronize()
            entry["setup_and_compile_s"] = round(time.time() - t, 1)
            entry["fwd_ms"] = bench_ms([c[0] for c in closures])
            entry["fwdbwd_ms"] = bench_ms([c[1] for c in closures])
            entry["fwd_tflops"] = tflops(fwd_flops, entry["fwd_ms"])
            entry["fwdbwd_tflops"] = tflops(train_flops, entry["fwdbwd_ms"])
            if args.kernel_profile:
                entry["fwdbwd_kernels"] = kernel_times(closures[0][1])
            print(
                f"   {name:20s} fwd {entry['fwd_ms']:8.3f} ms {entry['fwd_tflops']:6.1f} TF/s   "
                f"fwd+bwd {entry['fwdbwd_ms']:8.3f} ms {entry['fwdbwd_tflops']:6.1f} TF/s   "
                f"(setup {entry['setup_and_compile_s']} s)",
                flush=True,
            )
        except Exception as e:
            entry["error"] = f"{type(e).__name__}: {str(e)[:500]}"
            print(f"   {name:20s} failed: {entry['error'][:200]}", flush=True)
        finally:
            gc.collect()
            torch.cuda.empty_cache()
    for key, reference in (("speedup", "gemcompile"), ("speedup_vs_module", "gem_compile_module")):
        ours = rec["results"].get(reference, {})
        rec[key] = {
            name: {mode: (entry[f"{mode}_ms"] / ours[f"{mode}_ms"])
                   if (f"{mode}_ms" in entry and f"{mode}_ms" in ours) else None
                   for mode in ("fwd", "fwdbwd")}
            for name, entry in rec["results"].items() if name != reference
        }
    del sets
    gc.collect()
    torch.cuda.empty_cache()
    rec["autotune_choices"] = autotune_choices()
    return rec


def autotune_choices():
    """The configs Triton's autotuner picked so far for each gemcompile kernel (key -> config)."""
    from gemcompile.lowering.jagged_attention import triton as kernels

    choices = {}
    for name in ("_fwd_kernel", "_bwd_dkdv_kernel", "_bwd_dq_kernel"):
        cache = getattr(getattr(kernels, name), "cache", {}) or {}
        choices[name] = {str(key): str(cfg) for key, cfg in cache.items()}
    return choices


def summary_rows(shapes):
    rows = []
    for rec in shapes:
        for name, entry in rec.get("results", {}).items():
            sp = rec["speedup"].get(name, {})
            sp_module = rec.get("speedup_vs_module", {}).get(name, {})
            rows.append(
                dict(
                    shape=rec["label"],
                    method=name,
                    fwd_ms=entry.get("fwd_ms"),
                    fwd_tf=entry.get("fwd_tflops"),
                    fb_ms=entry.get("fwdbwd_ms"),
                    fb_tf=entry.get("fwdbwd_tflops"),
                    sp_fwd=sp.get("fwd"),
                    sp_fb=sp.get("fwdbwd"),
                    sp_module_fb=sp_module.get("fwdbwd"),
                    note=" ".join((entry.get("error") or "").split())[:60],
                )
            )
        if rec.get("skipped"):
            rows.append(dict(shape=rec["label"], method="-", note=rec["skipped"]))
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="two small shapes: a smoke test")
    parser.add_argument(
        "--out", default=None, help="directory of the JSON (default: $OUT, else benchmarks/results)"
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=300.0,
        help="do not start a shape or peer after this many seconds (default 300)",
    )
    parser.add_argument("--only", default="all", choices=["all", "anchors", "grid", "hopper"],
                        help="which shapes (hopper: issue 25's)")
    parser.add_argument("--methods", default=None, type=lambda s: s.split(","),
                        help=f"comma-separated subset of {','.join(METHODS)} (default: all)")
    parser.add_argument("--kernel-profile", action="store_true",
                        help="record each method's kernels per fwd+bwd call (torch.profiler)")
    parser.add_argument("--flex-mode", default="default", choices=sorted(FLEX_MODES),
                        help="torch.compile mode of the FlexAttention peer (default: Inductor's default)")
    parser.add_argument(
        "--cuda-graph",
        action="store_true",
        help="time every method replayed from a CUDA graph (no host overhead) instead of eager calls",
    )
    args = parser.parse_args(argv)
    unknown = sorted(set(args.methods or ()) - set(METHODS))
    if unknown:
        parser.error(f"unknown methods {unknown}; choose from {METHODS}")
    args.t0 = time.time()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/jagged_attention.py needs a CUDA GPU")
    # the compiled peers see a new shape per benchmark shape: never let them fall back to eager silently
    limits = {"recompile_limit": 64, "cache_size_limit": 64, "accumulated_recompile_limit": 1024,
              "accumulated_cache_size_limit": 1024}
    for name, value in limits.items():
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, value)

    shapes = (
        QUICK
        if args.quick
        else HOPPER
        if args.only == "hopper"
        else (ANCHORS if args.only != "grid" else []) + (GRID if args.only != "anchors" else [])
    )
    _FLEX["mode"] = FLEX_MODES[args.flex_mode]
    peer_setup = dict(PEER_SETUP)
    if _FLEX["mode"] is not None:
        peer_setup["flex_document_mask"] = peer_setup["flex_document_mask"].replace(
            "dynamic=False)", f"dynamic=False, mode={_FLEX['mode']!r})").replace(
            "Inductor's default kernel options", "its tiles autotuned")
    payload = dict(
        benchmark="jagged_attention",
        environment=environment(),
        dtype=str(DTYPE),
        causal=False,
        bias=None,
        methods=METHODS,
        flops_convention="fwd = 4*H*D*sum(len^2) over valid pairs; fwd+bwd = 3.5x fwd",
        speedup_convention="peer ms / gemcompile ms",
        budget_s=args.budget_s,
        timing="CUDA graph replay" if args.cuda_graph else "eager calls",
        peer_setup=peer_setup,
        shapes=[],
    )
    path = None
    for i, shape in enumerate(shapes):
        if time.time() - args.t0 > args.budget_s:
            payload["shapes"].append(
                dict(
                    shape,
                    label=f"B{shape['B']} L{shape['L']} H{shape['H']} D{shape['D']} fill~{shape['fill']}",
                    skipped="time budget",
                    results={},
                    speedup={},
                )
            )
        else:
            try:
                payload["shapes"].append(run_shape(shape, args, i))
            except Exception as e:  # e.g. out of memory for the inputs themselves
                payload["shapes"].append(
                    dict(
                        shape,
                        label=str(shape),
                        skipped=f"{type(e).__name__}: {str(e)[:300]}",
                        results={},
                        speedup={},
                    )
                )
                gc.collect()
                torch.cuda.empty_cache()
        payload["elapsed_s"] = round(time.time() - args.t0, 1)
        if path is None:
            name = "jagged_attention" + ("" if args.quick or args.only == "all" else f"-{args.only}")
            path = write_json(name + ("-cudagraph" if args.cuda_graph else ""), payload, args.out)
        else:
            rewrite_results(path, payload)

    print(
        "\n"
        + format_table(
            summary_rows(payload["shapes"]),
            [
                ("shape", "shape", "s"),
                ("method", "method", "s"),
                ("fwd_ms", "fwd ms", ".3f"),
                ("fwd_tf", "fwd TF/s", ".1f"),
                ("fb_ms", "fwd+bwd ms", ".3f"),
                ("fb_tf", "fwd+bwd TF/s", ".1f"),
                ("sp_fwd", "ours x fwd", ".2f"),
                ("sp_fb", "ours x fwd+bwd", ".2f"),
                ("sp_module_fb", "module x fwd+bwd", ".2f"),
                ("note", "note", "s"),
            ],
        )
    )
    bad = [s["label"] for s in payload["shapes"] if s.get("correctness") and not s["correctness"].get("ok")]
    print(f"\ncorrectness spot checks failed on: {bad}" if bad else "\ncorrectness spot checks: all ok")
    print(f"elapsed {payload['elapsed_s']} s; results in {path}")


if __name__ == "__main__":
    main()
