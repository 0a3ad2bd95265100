"""Which side is right on the largest benchmark shape: our forward+backward and padded SDPA's, each
against a float64 computation of a few single sequences (tensors of more than 2**31 elements, so batch
indices on both sides of the int32 boundary are checked).

    python benchmarks/jagged_attention_check_large.py [--B 1152 --L 4096 --H 4 --D 128 --fill 0.5] [--out DIR]

The upstream gradient is zero at padded query rows (as benchmarks/jagged_attention.py draws it): the
float64 reference sees the valid rows only, and padded SDPA gives padded query rows a real output (they
attend to the valid keys), so a gradient drawn at those rows flows into SDPA's dK and dV and into nothing
the reference computes. The first version of this script drew it at every row, and every "error" it
reported for SDPA's dK/dV was sqrt((L - n) / n), the share of upstream gradient the reference leaves out
(benchmarks/check_large_reanalysis.py shows it from that run's JSON). ``--unmasked-upstream`` repeats
that (wrong) comparison, for the record.

Writes ``jagged_attention-check-large-<stamp>.json`` through the one results writer ($OUT, else --out,
else benchmarks/results/).
"""

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE.parent))
sys.path.insert(0, str(_HERE))
from harness import write_json  # noqa: E402

import gemcompile.lowering  # noqa: E402,F401


def reference_one(q, k, v, do, n, scale):
    """float64 attention over the first n rows of one (H, L, D) sequence -> out, dq, dk, dv (valid rows)."""
    q, k, v = (t[:, :n].double().requires_grad_(True) for t in (q, k, v))
    out = torch.softmax(q @ k.transpose(-2, -1) * scale, dim=-1) @ v
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), do[:, :n].double())
    return out.detach(), dq, dk, dv


def rel(x, ref) -> float:
    return float((x.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def run(name, fn, q, k, v, do, picks):
    """Grads of fn at the picked batch indices, copied out so that the big tensors can be freed."""
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    out = fn(*leaves)
    grads = torch.autograd.grad(out, leaves, do)
    kept = {b: [t[b].detach().clone() for t in (out, *grads)] for b in picks}
    del out, grads, leaves
    torch.cuda.empty_cache()
    return kept


def main() -> None:
    p = argparse.ArgumentParser()
    for name, default in (("B", 1152), ("L", 4096), ("H", 4), ("D", 128)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--fill", type=float, default=0.5)
    p.add_argument("--out", default=None, help="directory of the JSON (default: $OUT, else benchmarks/results/)")
    p.add_argument("--unmasked-upstream", action="store_true",
                   help="draw the upstream gradient at padded query rows too (the first version's error)")
    a = p.parse_args()
    B, L, H, D = a.B, a.L, a.H, a.D
    g = torch.Generator(device="cuda").manual_seed(0)
    n = torch.randint(1, max(2, int(2 * a.fill * L)) + 1, (B,), device="cuda", generator=g).clamp(max=L)
    q, k, v, do = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    scale = D**-0.5
    per_batch = H * L * D
    boundary = (2**31 - 1) // per_batch  # first batch whose base offset overflows int32
    picks = sorted({0, 1, B // 2, max(0, boundary - 1), min(B - 1, boundary), min(B - 1, boundary + 1), B - 1}
                   | {int(i) for i in torch.topk(n, 2).indices})
    keymask = torch.arange(L, device="cuda")[None, :] < n[:, None]
    if not a.unmasked_upstream:  # padded query rows get no upstream gradient (in place: no second 4.8 GB copy)
        do.mul_(keymask[:, None, :, None])

    methods = {
        "gemcompile": lambda q_, k_, v_: torch.ops.gemcompile.jagged_attention(q_, k_, v_, n, n, None, False, scale),
        "sdpa_padded_mask": lambda q_, k_, v_: F.scaled_dot_product_attention(
            q_, k_, v_, attn_mask=keymask[:, None, None, :], scale=scale),
    }
    rows = []
    kept = {name: run(name, fn, q, k, v, do, picks) for name, fn in methods.items()}
    for b in picks:
        nb = int(n[b])
        ref = reference_one(q[b], k[b], v[b], do[b], nb, scale)
        row = {"batch": b, "length": nb, "elements_before_batch": b * per_batch}
        for name, by_batch in kept.items():
            row[name] = {
                t: rel(x[:, :nb], r) for t, x, r in zip(("out", "dq", "dk", "dv"), by_batch[b], ref)
            }
        rows.append(row)
        print(json.dumps(row))
    result = {
        "benchmark": "jagged_attention_check_large",
        "shape": {"B": B, "L": L, "H": H, "D": D, "fill": a.fill, "dtype": "bfloat16"},
        "upstream_gradient": "drawn at every row, padded query rows included (the first version's error)"
        if a.unmasked_upstream else "zero at padded query rows (rows >= length)",
        "metric": "relative error norm of each method against float64 on single sequences, valid rows",
        "rows": rows,
    }
    print(f"results in {write_json('jagged_attention-check-large', result, a.out)}")


if __name__ == "__main__":
    main()
