"""Attention dropout in training: what the kernel's in-tile Philox draws cost, and the peers a user would
train with dropout instead.

    python benchmarks/attention_dropout.py [--p 0.1] [--quick] [--cuda-graph] [--kernels] [--shapes 0,1]
                                           [--out DIR]

Forward+backward, bf16, non-causal, side by side in one run per shape (issue 25's shapes and the D 64
anchor):
  gemcompile            torch.ops.gemcompile.jagged_attention (padded + lengths), no dropout
  gemcompile_dropout    the same with dropout_p = p (a fresh seed every call, drawn on the device)
  sdpa_padded_dropout   F.scaled_dot_product_attention on the padded tensors, bool key mask, dropout_p = p
                        (PyTorch picks the backend that serves a mask with dropout)
  njt_sdpa_dropout      nested jagged tensors + SDPA with dropout_p = p (flash attention on varlen)
FlexAttention has no dropout, so it is no peer here. ``dropout_cost`` = gemcompile_dropout / gemcompile;
``speedup`` = peer time / gemcompile_dropout time. Useful TFLOP/s count valid (i, j) pairs, as in
jagged_attention.py. A failing method records its error and the run goes on. ``--cuda-graph`` replays
every method but NJT from a CUDA graph: NJT reads its offsets on the host, cannot be captured, and a failed
capture leaves the CUDA generator unusable for the rest of the process, so it runs eagerly (``eager`` lists
it). ``--kernels`` adds the GPU time of each kernel of gemcompile with and without dropout (torch.profiler).
The JSON is rewritten after every shape.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE.parent))
sys.path.insert(0, str(_HERE))

from harness import bench_ms, format_table, graphed, kernel_times, rewrite_results, tflops, write_json  # noqa: E402
from jagged_attention import draw_lengths  # noqa: E402

import gemcompile.lowering  # noqa: E402,F401
from gemcompile.lowering.common.dropout import new_seed  # noqa: E402
from gemcompile.lowering.common.flops import BACKWARD_FLOPS_RATIO  # noqa: E402
from gemcompile.lowering.jagged_attention.flops import attention_pairs  # noqa: E402

SHAPES = [dict(B=1152, L=1024, H=4, D=128, fill=0.5), dict(B=256, L=4096, H=4, D=128, fill=0.3),
          dict(B=32, L=2048, H=8, D=64, fill=0.5)]
QUICK = [dict(B=8, L=512, H=4, D=64, fill=0.5)]
METHODS = ["gemcompile", "gemcompile_dropout", "sdpa_padded_dropout", "njt_sdpa_dropout"]
UNCAPTURABLE = {"njt_sdpa_dropout"}


def _methods(shape, p: float):
    """name -> a fwd+bwd closure on one input set."""
    B, L, H, D = shape["B"], shape["L"], shape["H"], shape["D"]
    lengths = draw_lengths(B, L, shape["fill"], seed=0)
    q, k, v, g = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    keymask = torch.arange(L, device="cuda")[None, :] < lengths[:, None]
    ops = torch.ops.gemcompile

    def ours(dropout_p):
        def run():
            seed = new_seed("cuda") if dropout_p else None
            out = ops.jagged_attention(q, k, v, lengths, lengths, None, False, D ** -0.5, dropout_p=dropout_p,
                                       dropout_seed=seed)
            torch.autograd.grad(out, (q, k, v), g)
        return run

    def sdpa():
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keymask[:, None, None, :], dropout_p=p)
        torch.autograd.grad(out, (q, k, v), g)

    offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
    packed = [x.detach().transpose(1, 2)[keymask].requires_grad_() for x in (q, k, v, g)]  # (T, H, D)

    def njt():
        qn, kn, vn = (torch.nested.nested_tensor_from_jagged(x, offsets).transpose(1, 2) for x in packed[:3])
        out = F.scaled_dot_product_attention(qn, kn, vn, dropout_p=p).transpose(1, 2).values()
        torch.autograd.grad(out, packed[:3], packed[3])

    pairs = attention_pairs(lengths, lengths, L, L, False)
    return {"gemcompile": ours(0.0), "gemcompile_dropout": ours(p), "sdpa_padded_dropout": sdpa,
            "njt_sdpa_dropout": njt}, pairs, float(lengths.float().mean() / L)


def run_shape(shape, args) -> dict:
    methods, pairs, fill = _methods(shape, args.p)
    flops = (1 + BACKWARD_FLOPS_RATIO) * 4 * shape["H"] * shape["D"] * pairs
    row = dict(shape, realised_fill=round(fill, 3), p=args.p, ms={}, errors={}, eager=[])
    # profiled first, eagerly: after a CUDA graph captured a dropout draw, torch 2.11 refused an eager draw on
    # the same generator ("Offset increment outside graph capture"); each method runs once before, so that
    # the autotuner's runs are not in the profile
    if args.kernels:
        row["kernels_us"] = {}
        for name in ("gemcompile", "gemcompile_dropout"):
            methods[name]()
            torch.cuda.synchronize()
            row["kernels_us"][name] = kernel_times(methods[name])
        row["kernels_warmed_up"] = True
    for name in METHODS:
        try:
            fn = methods[name]
            fn()
            capture = args.cuda_graph and name not in UNCAPTURABLE
            if args.cuda_graph and not capture:
                row["eager"].append(name)
            row["ms"][name] = bench_ms(graphed(fn) if capture else fn)
        except Exception as error:  # noqa: BLE001 - a peer that fails is recorded, the run goes on
            row["errors"][name] = f"{type(error).__name__}: {str(error)[:300]}"
        torch.cuda.synchronize()
    ms = row["ms"]
    row["tflops"] = {n: tflops(flops, t) for n, t in ms.items()}
    if "gemcompile_dropout" in ms:
        base = ms["gemcompile_dropout"]
        row["dropout_cost"] = base / ms["gemcompile"] if "gemcompile" in ms else None
        row["speedup"] = {n: t / base for n, t in ms.items() if n.endswith("dropout") and n != "gemcompile_dropout"}
    return row


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--p", type=float, default=0.1, help="dropout probability")
    parser.add_argument("--quick", action="store_true", help="one small shape: a smoke test")
    parser.add_argument("--cuda-graph", action="store_true", help="replay every method from a CUDA graph")
    parser.add_argument("--kernels", action="store_true", help="per-kernel GPU times of gemcompile's two methods")
    parser.add_argument("--shapes", default=None,
                        help="indices into the shape list, e.g. 1,2 (one process per shape keeps one shape's CUDA "
                             "graphs from touching the next's RNG state)")
    parser.add_argument("--out", default=None, help="results folder (default: $OUT or benchmarks/results)")
    args = parser.parse_args(argv)
    payload = {"benchmark": "attention_dropout", "methods": METHODS, "cuda_graph": args.cuda_graph, "rows": []}
    name = "attention_dropout" + ("-cudagraph" if args.cuda_graph else "")
    path = write_json(name, payload, args.out)
    shapes = QUICK if args.quick else SHAPES
    if args.shapes:
        shapes = [shapes[int(i)] for i in args.shapes.split(",")]
    for shape in shapes:
        payload["rows"].append(run_shape(shape, args))
        rewrite_results(path, payload)
    print(format_table([dict(shape=f"B{r['B']} L{r['L']} H{r['H']} D{r['D']}", **{m: r["ms"].get(m) for m in METHODS},
                             cost=r.get("dropout_cost")) for r in payload["rows"]],
                       [("shape", "shape", "s")] + [(m, m, ".3f") for m in METHODS] + [("cost", "cost", ".2f")]))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
