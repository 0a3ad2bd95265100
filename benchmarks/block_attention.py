"""Block attention with fused rotary: gemcompile::block_attention against the peers a user would pick instead.

    python benchmarks/block_attention.py [--quick] [--only grid|linear|claims] [--budget-s 360] [--out DIR]
                                         [--flex-blocks 64[,128]] [--cuda-graph] [--head-dims 128]
                                         [--shapes 3,5,8]
    python benchmarks/block_attention.py --smoke          # CPU: tiny shapes, correctness only, no timing

The workload (issue 5, the TLX BlockAttention regime): jagged sequences in padded (B, H, L, D) tensors,
64-token blocks (block-diagonal, non-causal), rotate-half RoPE on q and k, bf16, H = 4. Side by side in
one run, forward and forward+backward:
  ours_fused_rotary     torch.ops.gemcompile.block_attention with cos/sin (rotary fused in the kernels)
  ours_rotary_outside   the rotation in eager PyTorch (x * cos + rotate_half(x) * sin), then the op
                        with rotary="none": the same kernels, rotary unfused
  ours_no_rotary        the op without any rotary: attention alone
  flex_no_rotary        compiled FlexAttention on the padded tensors, set up as its documentation
                        recommends for this mask: a BlockMask with BLOCK_SIZE = the mask's 64-token
                        block, built from the lengths (query block i meets key block i only; a block
                        wholly below the length is a *full* block, where mask_mod is not evaluated; the
                        block the length cuts is partial, with mask_mod "same 64-block and key <
                        length"; nothing past the length), compiled per shape with Inductor's
                        max-autotune (torch._dynamo.reset(), dynamic=False,
                        mode="max-autotune-no-cudagraphs": FlexAttention autotunes its tiles among
                        those that divide the 64-token sparse block; see FLEX_MODE):
                        attention alone. What create_block_mask(mask_mod, ..., BLOCK_SIZE=64) would
                        build, without evaluating mask_mod on all B * L * L pairs
                        (tests/unit/test_benchmark_peers.py checks the two agree)
  flex_no_rotary_b128   the set-up of the runs before issue 28, for comparison: 128-token BlockMask
                        blocks, all partial (no full blocks): FlexAttention evaluates the mask on about
                        twice the valid pairs (``--flex-blocks 64,128``)
  flex_rotary_outside   the eager rotation, then FlexAttention
  sdpa_rotary_outside   the eager rotation, then padded SDPA with the (B, 1, L, L) bool mask (skipped,
                        recorded as "skipped: memory", when the mask would exceed 8 GB, and as
                        "skipped: dense cost" when its dense work would take seconds per call)
Ratios (peer ms / our ms) in each shape's ``speedup``: ``fused_vs_rotary_outside`` (target >= 1.3),
``vs_flex`` = the fastest FlexAttention set-up measured (flex_no_rotary, flex_no_rotary_b128) /
ours_no_rotary (attention alone, target >= 2; ``vs_flex_b64``, ``vs_flex_b128`` per set-up),
``vs_flex_with_rotary`` and ``vs_sdpa`` against ours_fused_rotary.

Shapes. ``grid`` (the default): B from 4 to 1152, L up to 16384, fill 0.5 and 0.7, D 64 and 128, with
B * L <= 2^22 tokens so that every method's tensors fit (q, k, v, their rotated copies and all
gradients: at most ~60 GB at D 128). ``linear``: fixed B = 64, L = 2k, 4k, 8k, 16k (D 64, fill 0.7):
time per valid token should stay flat (time linear in L). ``claims``: the shapes the README's
claims against FlexAttention rest on (the two smallest, where the target was missed, and B1152 L1024 at
D 64 and D 128), without flex_rotary_outside: what scratch/issue28_gpu.sh re-runs. ``--quick``: two
small GPU shapes.
``--smoke``: CPU, tiny shapes, no timing: every method runs once (FlexAttention uncompiled) and is
checked against the float64 reference.

Useful FLOPs count valid pairs (i, j < length, same block): forward 4*H*D*pairs, forward+backward 3.5x.
The kernels are memory-bound at block 64 (about 32 FLOP per byte), so each shape also records
``ours_no_rotary`` forward bandwidth against the bytes it must move (q, k, v read and out written for
the rows of every block that holds a valid token). Every shape records a correctness check of
ours_fused_rotary (out, dq, dk, dv) and of the peers' outputs against a float64 reference on three
sequences (longest, median, shortest), the valid rows of [0, 2048) (rows past a sequence's length
are padding: padded SDPA gives them a value, the reference and our op do not, so they are not
compared; their upstream gradient is zero): block attention is exact on a block-aligned slice. The
JSON is rewritten after every shape (through the one results writer), so a killed run keeps what it
measured.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE.parent))  # the repository root: import gemcompile without installing it
sys.path.insert(0, str(_HERE))

from harness import (bench_ms, environment, format_table, graphed,  # noqa: E402
                     rewrite_results, rotation_count, tflops, write_json)

import gemcompile.lowering  # noqa: F401  (registers torch.ops.gemcompile.*)
from gemcompile.lowering.block_attention.flops import block_attention_pairs
from gemcompile.lowering.block_attention.reference import reference_backward, reference_forward
from gemcompile.lowering.common.flops import BACKWARD_FLOPS_RATIO

DTYPE = torch.bfloat16
BLOCK = 64
H = 4
MAX_MASK_BYTES = 8 * 2**30
MAX_DENSE_FLOPS = 1.5e15  # padded SDPA fwd+bwd work above which one timed call takes seconds
CHECK_ROWS = 2048

GRID = [  # the production regime (B 1152, L up to 4k, D 64/128) first, then long histories
    {"B": 1152, "L": 1024, "D": 64, "fill": 0.5},
    {"B": 1152, "L": 2048, "D": 128, "fill": 0.7},
    {"B": 1024, "L": 4096, "D": 128, "fill": 0.7},
    {"B": 1152, "L": 2048, "D": 64, "fill": 0.7},
    {"B": 1152, "L": 1024, "D": 128, "fill": 0.5},
    {"B": 256, "L": 16384, "D": 64, "fill": 0.7},
    {"B": 64, "L": 4096, "D": 64, "fill": 0.5},
    {"B": 4, "L": 16384, "D": 64, "fill": 0.5},
    {"B": 64, "L": 16384, "D": 128, "fill": 0.5},
]
LINEAR = [{"B": 64, "L": L, "D": 64, "fill": 0.7, "sweep": "linear"} for L in (2048, 4096, 8192, 16384)]
QUICK = [{"B": 8, "L": 1024, "D": 64, "fill": 0.5}, {"B": 16, "L": 512, "D": 128, "fill": 0.7}]
SMOKE = [{"B": 3, "L": 160, "D": 32, "fill": 0.5}, {"B": 2, "L": 96, "D": 16, "fill": 0.7}]
METHODS = ["ours_fused_rotary", "ours_rotary_outside", "ours_no_rotary", "flex_no_rotary",
           "flex_rotary_outside", "sdpa_rotary_outside"]
LINEAR_METHODS = ["ours_fused_rotary", "ours_no_rotary", "flex_no_rotary"]
CLAIMS = [GRID[6], GRID[7], GRID[0], GRID[4]]  # B64 L4096 D64, B4 L16384 D64, B1152 L1024 D64 and D128
CLAIMS_METHODS = ["ours_fused_rotary", "ours_no_rotary", "flex_no_rotary", "ours_rotary_outside",
                  "sdpa_rotary_outside", "flex_no_rotary_b128"]
FLEX_MODE = "max-autotune-no-cudagraphs"
"""How the 64-token-block FlexAttention peer is compiled. Inductor's single default tile at head dim 64
and 128 on sm90 (128 wide) does not divide a 64-token sparse block. Capping the tiles with kernel_options
works for the forward only: torch 2.11 filters the backward's configs by their own tiles before it applies
kernel_options, so none was left (NoValidChoicesError in block_attention-claims-20261204-140035.json).
Under max-autotune FlexAttention times its tile list (32 and 64 tiles among them), keeps those that divide
the block and picks the fastest, the set-up its documentation recommends for speed."""


def draw_lengths(B: int, L: int, fill: float, seed: int, device) -> torch.Tensor:
    """Uniform in [1, 2*fill*L] for fill <= 0.5, else in [(2*fill - 1)*L, L] (as jagged_attention.py)."""
    g = torch.Generator().manual_seed(seed)
    if fill <= 0.5:
        lengths = torch.randint(1, max(2, min(L, int(2 * fill * L))) + 1, (B,), generator=g)
    else:
        lengths = torch.randint(max(1, int((2 * fill - 1) * L)), L + 1, (B,), generator=g)
    return lengths.to(device)


def rope_tables(L: int, D: int, device, dtype):
    """Standard rotate-half RoPE tables (L, D), shared by the batch, in the input dtype."""
    inv = 10000.0 ** (-torch.arange(0, D, 2, device=device, dtype=torch.float64) / D)
    angle = torch.arange(L, device=device, dtype=torch.float64)[:, None] * inv[None, :]
    angle = torch.cat((angle, angle), dim=-1)
    return angle.cos().to(dtype), angle.sin().to(dtype)


def rotate_outside(x, cos, sin):
    """What a model does without the fused kernel: x * cos + rotate_half(x) * sin, in eager PyTorch."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


# ---------------------------------------------------------------------------------------------------
# FlexAttention


PEER_SETUP = {
    "flex_no_rotary": "FlexAttention, BlockMask BLOCK_SIZE 64 (= the mask's block) with full blocks marked; "
                      f"torch.compile(flex_attention, dynamic=False, mode={FLEX_MODE!r}) "
                      "(its tiles autotuned), "
                      "compiled per shape after torch._dynamo.reset()",
    "flex_no_rotary_b128": "FlexAttention, BlockMask BLOCK_SIZE 128, all blocks partial (the set-up before issue "
                           "28), Inductor's default tiles; compiled per shape as above",
    "sdpa_rotary_outside": "F.scaled_dot_product_attention with the (B, 1, L, L) bool mask built once per shape "
                           "(PyTorch picks the backend)",
    "ours": "our kernels autotuned per shape (Triton autotune keys on the shape)",
}
"""How each peer is set up, recorded in the JSON (``peer_setup``)."""


def flex(compiled: bool, mode: str | None = None):
    """FlexAttention; compiled: a fresh torch.compile with static shapes (the caller resets Dynamo per shape,
    so each shape gets its own compile, as our kernels get their own autotuning), in torch.compile's
    `mode`."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False, mode=mode) if compiled else flex_attention


def flex_block_mask(lengths: torch.Tensor, L: int, block: int = BLOCK, flex_block: int = BLOCK):
    """BlockMask of "same `block`-token block and key < length" over padded (B, L) sequences, built
    directly (create_block_mask would evaluate mask_mod on all B * L * L pairs).

    flex_block == block (the documented set-up): query block i meets key block i only; the block is full
    (no mask_mod) when it lies wholly below the length, partial when the length cuts it, absent past it.
    flex_block a multiple of block (the earlier set-up): query block i meets key block i, always partial
    (the off-diagonal sub-blocks are masked by mask_mod), nothing once i * flex_block >= length."""
    from torch.nn.attention.flex_attention import BlockMask

    if flex_block != block and flex_block % block:
        raise ValueError(f"flex_block {flex_block} must equal the mask block {block} or be a multiple of it")
    B = lengths.numel()
    n = math.ceil(L / flex_block)
    starts = torch.arange(n, device=lengths.device) * flex_block
    ends = starts + flex_block
    started = starts[None, :] < lengths[:, None]  # (B, n): the block holds a valid key
    if flex_block == block:
        full = (ends[None, :] <= lengths[:, None]).to(torch.int32)[:, None]
        partial = (started & (ends[None, :] > lengths[:, None])).to(torch.int32)[:, None]
    else:
        full, partial = None, started.to(torch.int32)[:, None]
    indices = torch.arange(n, device=lengths.device, dtype=torch.int32).view(1, 1, n, 1).expand(B, 1, n, n)
    indices = indices.contiguous()  # column 0 holds block i; the rest are never read (counts <= 1)

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx // block == kv_idx // block) & (kv_idx < lengths[b])

    kwargs = dict(BLOCK_SIZE=flex_block, mask_mod=mask_mod)
    if full is not None:
        kwargs.update(full_kv_num_blocks=full, full_kv_indices=indices)
    try:
        return BlockMask.from_kv_blocks(partial, indices, seq_lengths=(L, L), **kwargs)
    except TypeError:  # older signature without seq_lengths
        return BlockMask.from_kv_blocks(partial, indices, **kwargs)


# ---------------------------------------------------------------------------------------------------
# Methods: name -> call(q, k, v) on padded (B, H, L, D) tensors


def make_methods(shape, lengths, cos, sin, device, names, compiled_flex=True):
    L, D = shape["L"], shape["D"]
    scale = D**-0.5
    ops = torch.ops.gemcompile
    methods = {
        "ours_fused_rotary": lambda q, k, v: ops.block_attention(q, k, v, lengths, BLOCK, -1, False, cos, sin,
                                                                 "half", scale),
        "ours_rotary_outside": lambda q, k, v: ops.block_attention(
            rotate_outside(q, cos, sin), rotate_outside(k, cos, sin), v, lengths, BLOCK, -1, False, None,
            None, "none", scale),
        "ours_no_rotary": lambda q, k, v: ops.block_attention(q, k, v, lengths, BLOCK, -1, False, None, None,
                                                              "none", scale),
    }
    bm = flex_block_mask(lengths, L)
    fa = flex(compiled_flex, FLEX_MODE)
    methods["flex_no_rotary"] = lambda q, k, v: fa(q, k, v, block_mask=bm, scale=scale)
    methods["flex_rotary_outside"] = lambda q, k, v: fa(
        rotate_outside(q, cos, sin), rotate_outside(k, cos, sin), v, block_mask=bm, scale=scale)
    if "flex_no_rotary_b128" in names:
        bm128, fa128 = flex_block_mask(lengths, L, flex_block=128), flex(compiled_flex)
        methods["flex_no_rotary_b128"] = lambda q, k, v: fa128(q, k, v, block_mask=bm128, scale=scale)

    if "sdpa_rotary_outside" in names and skip_reason("sdpa_rotary_outside", shape) is None:
        # the mask is built once, as a model would
        i = torch.arange(L, device=device)
        same_block = (i[:, None] // BLOCK == i[None, :] // BLOCK)[None, None]
        mask = same_block & (i < lengths[:, None])[:, None, None, :]  # (B, 1, L, L)

        def sdpa(q, k, v):
            return F.scaled_dot_product_attention(rotate_outside(q, cos, sin), rotate_outside(k, cos, sin), v,
                                                  attn_mask=mask, scale=scale)

        methods["sdpa_rotary_outside"] = sdpa
    return methods


def skip_reason(name, shape):
    B, L, D = shape["B"], shape["L"], shape["D"]
    if name == "sdpa_rotary_outside":
        if B * L * L > MAX_MASK_BYTES:
            return f"skipped: memory (the bool mask needs {B * L * L / 2**30:.0f} GiB)"
        if 3.5 * 4 * B * H * L * L * D > MAX_DENSE_FLOPS:
            return "skipped: dense cost (padded SDPA computes all L x L scores: seconds per call)"
    return None


# ---------------------------------------------------------------------------------------------------
# Correctness on a block-aligned slice, against float64


def correctness(methods, q, k, v, g, lengths, cos, sin, names):
    """Three sequences (longest, median, shortest), rows [0, CHECK_ROWS): ours_fused_rotary's output and
    gradients, the others' outputs, relative to float64 block attention (with rotary, or without for the
    *_no_rotary methods)."""
    L, D = q.shape[2], q.shape[3]
    rows = min(L, CHECK_ROWS)
    order = torch.argsort(lengths, descending=True)
    pick = order[torch.tensor([0, len(order) // 2, len(order) - 1], device=order.device)].unique()
    sl = (pick, slice(None), slice(0, rows))
    n = lengths[pick].clamp(max=rows)
    valid = (torch.arange(rows, device=q.device)[None, :] < n[:, None])[:, None, :, None]  # (P, 1, rows, 1)
    d64 = [x.detach()[sl].double() for x in (q, k, v)]
    t64 = [t[:rows].double() for t in (cos, sin)]
    refs = {
        rotary: reference_forward(*d64, n, BLOCK, -1, False, *(t64 if rotary == "half" else (None, None)),
                                  rotary, D**-0.5)
        for rotary in ("half", "none")
    }
    ref, ref_lse = refs["half"]
    ref_grads = reference_backward(g[sl].double(), *d64, ref, ref_lse, n, BLOCK, -1, False, *t64, "half",
                                   D**-0.5)
    result = {}

    def rel(a, b):  # over the valid rows only: a padded row has no defined value
        m = valid.expand_as(b)
        a, b = a.double()[m], b[m]
        return float((a - b).norm() / b.norm().clamp_min(1e-30))

    for name in names:
        try:
            want = refs["none" if "no_rotary" in name else "half"][0]
            if name == "ours_fused_rotary":
                leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]
                out = methods[name](*leaves)
                grads = torch.autograd.grad(out, leaves, g)
                entry = {"out": rel(out.detach()[sl], want), "nan": bool(out.isnan().any())}
                entry.update({f"d{x}": rel(gr[sl], w) for x, gr, w in zip("qkv", grads, ref_grads)})
            else:
                with torch.no_grad():
                    entry = {"out": rel(methods[name](*(x.detach() for x in (q, k, v)))[sl], want)}
            entry["ok"] = not entry.get("nan") and all(
                value < 3e-2 for key, value in entry.items() if key not in ("ok", "nan"))
            result[name] = entry
        except Exception as e:  # noqa: BLE001  (recorded: a failing method must not stop the run)
            result[name] = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        finally:
            gc.collect()
    return result


# ---------------------------------------------------------------------------------------------------
# Per shape


def label_of(shape, fill):
    return f"B{shape['B']} L{shape['L']} H{H} D{shape['D']} fill{fill:.2f}"


def run_shape(shape, args, index, device, names):
    B, L, D = shape["B"], shape["L"], shape["D"]
    lengths = draw_lengths(B, L, shape["fill"], seed=1000 + index, device=device)
    valid = int(lengths.sum())
    pairs = block_attention_pairs(lengths, L, BLOCK, -1, False)
    fwd_flops = 4 * H * D * pairs
    train_flops = (1 + BACKWARD_FLOPS_RATIO) * fwd_flops
    touched_rows = int(((lengths + BLOCK - 1) // BLOCK * BLOCK).clamp(max=L).sum())
    fwd_bytes = 4 * touched_rows * H * D * q_bytes()  # q, k, v read and out written, per touched row
    rec = dict(shape, label=label_of(shape, valid / (B * L)), fill_realised=valid / (B * L), tokens=valid,
               pairs=pairs, fwd_flops=fwd_flops, fwdbwd_flops=train_flops, fwd_min_bytes=fwd_bytes,
               results={}, speedup={})
    print(f"\n== {rec['label']}: {valid} valid tokens", flush=True)
    torch.manual_seed(index)
    if not args.smoke:
        torch._dynamo.reset()  # the compiled peers compile for this shape alone (dynamic=False, fresh compile)
    cos, sin = rope_tables(L, D, device, DTYPE)
    n_sets = 1 if args.smoke else rotation_count(3 * B * H * L * D * q_bytes())
    row_valid = (torch.arange(L, device=device)[None, :] < lengths[:, None])[:, None, :, None]
    sets = [tuple(torch.randn(B, H, L, D, device=device, dtype=DTYPE) for _ in range(3))  # q, k, v
            + ((torch.randn(B, H, L, D, device=device, dtype=DTYPE) * row_valid),)  # grad: 0 at padded rows
            for _ in range(n_sets)]
    del row_valid
    rec["input_sets"] = n_sets
    methods = make_methods(shape, lengths, cos, sin, device, names, compiled_flex=not args.smoke)
    check_names = [m for m in names if skip_reason(m, shape) is None]
    rec["correctness"] = correctness(methods, *sets[0], lengths, cos, sin, check_names)
    checks = ", ".join(f"{m}: {'ok' if c.get('ok') else c}" for m, c in rec["correctness"].items())
    print(f"   correctness: {checks}", flush=True)
    if args.smoke:
        return rec
    for name in names:
        entry = rec["results"].setdefault(name, {})
        reason = skip_reason(name, shape)
        if reason is None and time.time() - args.t0 > args.budget_s:
            reason = "skipped: time budget"
        if reason:
            entry["error"] = reason
            print(f"   {name:20s} {reason}", flush=True)
            continue
        call = methods[name]
        try:
            closures = []
            for q, k, v, g in sets:
                leaves = [x.requires_grad_(True) for x in (q, k, v)]

                def fwd(leaves=leaves, call=call):
                    with torch.no_grad():
                        call(*leaves)

                def fwdbwd(leaves=leaves, g=g, call=call):
                    torch.autograd.grad(call(*leaves), leaves, g)

                closures.append((fwd, fwdbwd))
            t = time.time()
            for fwd, fwdbwd in closures:  # compile, autotune and warm up outside the timing
                fwd()
                fwdbwd()
            if args.cuda_graph:  # captured after the warm-up: autotuning and compiles are done by then
                closures = [(graphed(fwd), graphed(fwdbwd)) for fwd, fwdbwd in closures]
            torch.cuda.synchronize()
            entry["setup_and_compile_s"] = round(time.time() - t, 1)
            entry["fwd_ms"] = bench_ms([c[0] for c in closures])
            entry["fwdbwd_ms"] = bench_ms([c[1] for c in closures])
            entry["fwd_tflops"] = tflops(fwd_flops, entry["fwd_ms"])
            entry["fwdbwd_tflops"] = tflops(train_flops, entry["fwdbwd_ms"])
            entry["fwd_us_per_valid_token"] = 1000 * entry["fwd_ms"] / valid
            entry["fwdbwd_us_per_valid_token"] = 1000 * entry["fwdbwd_ms"] / valid
            if name == "ours_no_rotary":
                entry["fwd_gbps_min_bytes"] = fwd_bytes / entry["fwd_ms"] / 1e6
            print(f"   {name:20s} fwd {entry['fwd_ms']:8.3f} ms {entry['fwd_tflops']:6.1f} TF/s   fwd+bwd "
                  f"{entry['fwdbwd_ms']:8.3f} ms {entry['fwdbwd_tflops']:6.1f} TF/s   "
                  f"(setup {entry['setup_and_compile_s']} s)", flush=True)
        except Exception as e:  # noqa: BLE001  (a failing peer, OOM or compile error, is recorded)
            entry["error"] = f"{type(e).__name__}: {str(e)[:500]}"
            print(f"   {name:20s} failed: {entry['error'][:200]}", flush=True)
        finally:
            for q, k, v, _ in sets:
                for x in (q, k, v):
                    x.grad = None
            gc.collect()
            torch.cuda.empty_cache()
    rec["speedup"] = speedups(rec["results"])
    del sets
    gc.collect()
    torch.cuda.empty_cache()
    return rec


def q_bytes() -> int:
    return torch.tensor([], dtype=DTYPE).element_size()


def speedups(results):
    def ratio(peer, ours):
        a, b = results.get(peer, {}), results.get(ours, {})
        return {m: (a[f"{m}_ms"] / b[f"{m}_ms"]) if (f"{m}_ms" in a and f"{m}_ms" in b) else None
                for m in ("fwd", "fwdbwd")}

    def best_flex(mode):  # the fastest FlexAttention set-up measured, per mode
        times = [results.get(name, {}).get(f"{mode}_ms") for name in ("flex_no_rotary", "flex_no_rotary_b128")]
        ours = results.get("ours_no_rotary", {}).get(f"{mode}_ms")
        times = [t for t in times if t is not None]
        return min(times) / ours if times and ours else None

    return {
        "fused_vs_rotary_outside": ratio("ours_rotary_outside", "ours_fused_rotary"),
        "vs_flex": {m: best_flex(m) for m in ("fwd", "fwdbwd")},
        "vs_flex_b64": ratio("flex_no_rotary", "ours_no_rotary"),
        "vs_flex_b128": ratio("flex_no_rotary_b128", "ours_no_rotary"),
        "vs_flex_with_rotary": ratio("flex_rotary_outside", "ours_fused_rotary"),
        "vs_sdpa": ratio("sdpa_rotary_outside", "ours_fused_rotary"),
        # what the fused rotary costs: fused time / time without rotary (issue 25: at most 1.3 at D 128)
        "rotary_over_no_rotary": ratio("ours_fused_rotary", "ours_no_rotary"),
    }


def autotune_choices():
    """The configs the autotuner picked so far for each block-attention kernel (key -> config)."""
    from gemcompile.lowering.block_attention import triton as kernels

    choices = {}
    names = ("_closed_fwd_kernel", "_closed_bwd_kernel", "_fwd_kernel", "_bwd_dkdv_kernel", "_bwd_dq_kernel")
    for name in names:
        cache = getattr(getattr(kernels, name), "cache", {}) or {}
        choices[name] = {str(key): str(cfg) for key, cfg in cache.items()}
    return choices


def summary(shapes):
    rows = []
    for rec in shapes:
        sp = rec.get("speedup", {})
        ours = rec.get("results", {}).get("ours_fused_rotary", {})
        plain = rec.get("results", {}).get("ours_no_rotary", {})

        def pick(key, mode, sp=sp):
            return (sp.get(key) or {}).get(mode)

        rows.append({
            "shape": rec["label"], "fused_fwd": ours.get("fwd_ms"), "fused_fb": ours.get("fwdbwd_ms"),
            "fused_tf": ours.get("fwdbwd_tflops"), "plain_gbps": plain.get("fwd_gbps_min_bytes"),
            "rot_fwd": pick("fused_vs_rotary_outside", "fwd"),
            "rot_fb": pick("fused_vs_rotary_outside", "fwdbwd"),
            "flex_fwd": pick("vs_flex", "fwd"), "flex_fb": pick("vs_flex", "fwdbwd"),
            "flexr_fb": pick("vs_flex_with_rotary", "fwdbwd"), "sdpa_fb": pick("vs_sdpa", "fwdbwd"),
            "check": "ok" if all(c.get("ok") for c in rec.get("correctness", {}).values()) else "FAILED",
            "note": rec.get("skipped", ""),
        })
    return format_table(rows, [
        ("shape", "shape", "s"), ("fused_fwd", "fused fwd ms", ".3f"), ("fused_fb", "fused f+b ms", ".3f"),
        ("fused_tf", "fused f+b TF/s", ".0f"), ("plain_gbps", "plain fwd GB/s", ".0f"),
        ("rot_fwd", "x outside fwd", ".2f"), ("rot_fb", "x outside f+b", ".2f"),
        ("flex_fwd", "x flex fwd", ".2f"), ("flex_fb", "x flex f+b", ".2f"),
        ("flexr_fb", "x flex+rot f+b", ".2f"), ("sdpa_fb", "x sdpa f+b", ".2f"), ("check", "check", "s"),
        ("note", "note", "s"),
    ])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="two small GPU shapes")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, correctness only")
    parser.add_argument("--only", default="grid", choices=["grid", "linear", "claims"],
                        help="which shapes (default grid; claims: the shapes the README's claims rest on)")
    parser.add_argument("--flex-blocks", default=None,
                        help="FlexAttention BlockMask block sizes to time: 64 (the documented set-up, "
                             "flex_no_rotary) and/or 128 (the earlier one, flex_no_rotary_b128); default 64,128 "
                             "for --only claims, else 64")
    parser.add_argument("--cuda-graph", action="store_true",
                        help="time CUDA-graph replays of each call (no host time, as under reduce-overhead); "
                             "the small shapes are host-bound as eager calls")
    parser.add_argument("--head-dims", default=None,
                        help="only the shapes of these head dims, comma-separated (e.g. 128)")
    parser.add_argument("--shapes", default=None,
                        help="only these shapes of the sweep, by index (e.g. 3,5,8 of the grid)")
    parser.add_argument("--budget-s", type=float, default=360.0,
                        help="do not start a shape or method after this many seconds (default 360)")
    parser.add_argument("--out", default=None, help="directory of the JSON (default: $OUT, else results/)")
    args = parser.parse_args(argv)
    args.t0 = time.time()
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("benchmarks/block_attention.py needs a CUDA GPU (or --smoke on CPU)")
    limits = {"recompile_limit": 64, "cache_size_limit": 64, "accumulated_recompile_limit": 1024,
              "accumulated_cache_size_limit": 1024}
    for name, value in limits.items():
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, value)
    if args.smoke:
        shapes, names = SMOKE, METHODS
    elif args.quick:
        shapes, names = QUICK, METHODS
    elif args.only == "linear":
        shapes, names = LINEAR, LINEAR_METHODS
    elif args.only == "claims":
        shapes, names = CLAIMS, CLAIMS_METHODS
    else:
        shapes, names = GRID, METHODS
    if args.shapes:
        picked = [int(i) for i in args.shapes.split(",")]
        if not all(0 <= i < len(shapes) for i in picked):
            sys.exit(f"--shapes {args.shapes}: this sweep has shapes 0..{len(shapes) - 1}")
        shapes = [shapes[i] for i in picked]
    if args.head_dims:
        head_dims = {int(d) for d in args.head_dims.split(",")}
        shapes = [shape for shape in shapes if shape["D"] in head_dims]
        if not shapes:
            sys.exit(f"--head-dims {args.head_dims}: no shape of this sweep has that head dim")
    blocks = (args.flex_blocks or ("64,128" if args.only == "claims" and not (args.smoke or args.quick) else "64"))
    blocks = {b.strip() for b in blocks.split(",")}
    names = [m for m in names if m != "flex_no_rotary_b128"]
    if "64" not in blocks:
        names = [m for m in names if m not in ("flex_no_rotary", "flex_rotary_outside")]
    if "128" in blocks:
        names.append("flex_no_rotary_b128")
    payload = {
        "benchmark": "block_attention", "environment": environment(), "dtype": str(DTYPE), "block": BLOCK,
        "heads": H,
        "causal": False, "rotary": "half (tables shared by the batch, in the input dtype)", "methods": names,
        "sweep": "smoke" if args.smoke else "quick" if args.quick else args.only,
        "shape_indices": args.shapes,
        "flops_convention": "fwd = 4*H*D*valid pairs (i, j < length, same 64-block); fwd+bwd = 3.5x fwd",
        "speedup_convention": "peer ms / our ms (see the docstring for which of ours)",
        "budget_s": args.budget_s,
        "timing": ("CUDA graph replay" if args.cuda_graph else "eager calls")
                  + ", triton.testing.do_bench median",
        "shapes": [],
        "peer_setup": {k: v for k, v in PEER_SETUP.items() if k == "ours" or k in names},
        "correctness_convention": "relative error norm against float64 over the valid rows of [0, 2048) of three "
                                  "sequences; upstream gradient zero at padded rows",
    }
    path = None
    for i, shape in enumerate(shapes):
        if time.time() - args.t0 > args.budget_s:
            payload["shapes"].append(dict(shape, label=label_of(shape, shape["fill"]), skipped="time budget",
                                          results={}, speedup={}))
        else:
            try:
                payload["shapes"].append(run_shape(shape, args, i, device, names))
            except Exception as e:  # noqa: BLE001  (e.g. out of memory for the inputs themselves)
                payload["shapes"].append(dict(shape, label=label_of(shape, shape["fill"]),
                                              skipped=f"{type(e).__name__}: {str(e)[:300]}", results={},
                                              speedup={}))
                gc.collect()
                if device == "cuda":
                    torch.cuda.empty_cache()
        payload["elapsed_s"] = round(time.time() - args.t0, 1)
        if args.smoke:
            continue
        if path is None:
            suffix = "-quick" if args.quick else {"linear": "-linear", "claims": "-claims"}.get(args.only, "")
            suffix += "-cudagraph" if args.cuda_graph else ""
            path = write_json("block_attention" + suffix, payload, args.out)
        else:
            rewrite_results(path, payload)
    bad = [(s["label"], m) for s in payload["shapes"] for m, c in s.get("correctness", {}).items()
           if not c.get("ok")]
    if args.smoke:
        for s in payload["shapes"]:
            print(s["label"], json.dumps(s["correctness"], default=str))
        print(f"\nsmoke: failed checks: {bad or 'none'}")
        sys.exit(1 if bad else 0)
    payload["autotune_choices"] = autotune_choices()
    rewrite_results(path, payload)
    print("\n" + summary(payload["shapes"]))
    print(f"\ncorrectness checks failed on: {bad}" if bad else "\ncorrectness checks: all ok")
    print(f"elapsed {payload['elapsed_s']} s; results in {path}")


if __name__ == "__main__":
    main()
