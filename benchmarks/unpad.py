"""The unpad pass on the sequence part of the GEM-ref train step: gem_compile with and without it.

    python benchmarks/unpad.py --out $OUT            # one GPU: GEM-ref small, B 256, fills 0.3 0.5 0.7
    python benchmarks/unpad.py --size tiny --batch-size 8 --fills 0.5 --methods eager,gem --steps 2 \
        --warmup 1 --out /tmp/unpad_smoke          # CPU smoke run (gem compiles in a minute or two)

What runs: ``SequenceTower``, GemRef's sequence path built from a GemRef's own modules (the sequence
embedding, each layer's GDPA cross-attention, block self-attention and token FFN per sequence type,
the final sequence summary), with each layer's non-sequence summary X_sum replaced by a fixed random
input. That is where the padding is: the token-wise projections, norms and FFN that the unpad pass
(gemcompile/passes/unpad.py) moves onto packed valid tokens. One train step = zero_grad, forward
(bf16 autocast on CUDA), loss = out.float().square().mean(), backward; no optimizer step, so the
weights never change and every method and step sees the same model.

Methods (``--methods``): eager, inductor (torch.compile default), gem (gem_compile, default GemConfig:
unpad on), gem-no-unpad (``GemConfig(unpad={"enabled": False})``); any other method name of
gemcompile.runtime.training.e2e_bench works too. Each method is compiled once and then runs every fill: the
padded shapes do not depend on the fill and unpad's packed token count is a dynamic (unbacked) size,
so nothing should recompile; ``recompiles`` counts Dynamo graphs compiled after the first step.

Per (method, fill): ``--warmup`` steps (the first one compiles; ``compile_s`` = its wall time minus
a median step), then ``--steps`` timed steps rotating ``--batches`` pre-generated batches, each timed
with CUDA events (median ms; ``wall_ms_per_step`` is the host-side mean of the same loop, which also
carries the host syncs unpad adds: one device-to-host read of the token count per region per step).
``kernel_ms_per_step``: the GPU time of the kernels of ``--kernel-steps`` more steps under
torch.profiler, per step, so that a host-bound step (CUDA-event time = host time) still shows what
each method costs the GPU; the ratios come both ways.
``first_loss`` is the loss of the first step, always the fill's batch 0, so methods can be compared
for correctness. ``ratios`` per fill: peer ms / gem ms (> 1: gem is faster). ``--budget-s`` is a soft
wall-clock budget: (method, fill) pairs not started by then are recorded as skipped. The JSON is
rewritten after every pair, so a killed run keeps what it measured.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import Tensor, nn

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE.parent))  # the repository root: import gemcompile without installing it
sys.path.insert(0, str(_HERE))

from harness import environment, format_table, rewrite_results, write_json

from gemcompile.models.data import SyntheticData
from gemcompile.models.gem import GemRef, gem_ref_config, sequence_arch
from gemcompile.runtime.training.e2e_bench import compile_method, methods_help, step_begin, unknown_methods
from gemcompile.runtime.training.kernel_time import kernel_profile

RATIOS = {  # name -> (peer, ours): peer ms / ours ms
    "gem_vs_inductor": ("inductor", "gem"),
    "gem_vs_gem_no_unpad": ("gem-no-unpad", "gem"),
    "gem_no_unpad_vs_inductor": ("inductor", "gem-no-unpad"),
}


# ----------------------------------------------------------------------------------------------------
# The workload
# ----------------------------------------------------------------------------------------------------


class _SeqLayer(nn.Module):
    """The sequence arch of one GemLayer (its own modules, not copies); None where the layer skips it."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.gdpa = layer.gdpa
        self.self_attention = layer.self_attention
        self.ffn = layer.ffn

    def forward(self, seqs: list[Tensor], valids: list[Tensor], x_sum: Tensor) -> list[Tensor]:
        return sequence_arch(self, seqs, valids, x_sum)  # the per-sequence path of GemLayer.forward


class SequenceTower(nn.Module):
    """GemRef's sequence path: embedding -> per layer GDPA, block self-attention, FFN -> final summary.

    Written as GemRef.forward writes it (the same mask idiom, the same modules), so the passes see the
    padded model code they see in the full model. x_sums[l] stands in for layer l's NonSeqSummary output.
    """

    def __init__(self, gem: GemRef) -> None:
        super().__init__()
        self.seq_embedding = gem.seq_embedding
        self.layers = nn.ModuleList(_SeqLayer(layer) for layer in gem.layers)
        self.final_summary = gem.final_summary

    def forward(
        self,
        seq_items: list[Tensor],
        seq_actions: list[Tensor],
        seq_times: list[Tensor],
        seq_lengths: list[Tensor],
        x_sums: list[Tensor],
    ) -> Tensor:
        valids = []
        for items, lengths in zip(seq_items, seq_lengths):
            n = items.shape[1]
            valids.append(torch.arange(n, device=items.device)[None, :] < lengths[:, None])  # (B, N_k)
        seqs = self.seq_embedding(seq_items, seq_actions, seq_times, valids)  # [(B, N_k, d)]
        for layer, x_sum in zip(self.layers, x_sums):
            seqs = layer(seqs, valids, x_sum)
        return self.final_summary(seqs, seq_lengths)  # (B, n_seq * (n_pma + n_recent), d)


def build_tower(size: str, seed: int, device: torch.device) -> tuple[SequenceTower, object]:
    """A seeded GemRef built on the device (fast init); only its sequence modules are kept."""
    model_cfg = gem_ref_config(size)
    torch.manual_seed(seed)
    with torch.device(device):
        gem = GemRef(model_cfg)
    tower = SequenceTower(gem)
    del gem  # the non-sequence parts (the big sparse tables) are freed here
    gc.collect()
    return tower, model_cfg


def make_x_sums(model_cfg, batch_size: int, seed: int, device: torch.device, dtype: torch.dtype) -> list:
    """Fixed random (B, n_sum, d) per layer, in the dtype NonSeqSummary produces under autocast."""
    gen = torch.Generator().manual_seed(seed + 1)
    return [
        torch.randn(batch_size, model_cfg.n_sum, model_cfg.d, generator=gen).to(device, dtype)
        for _ in range(model_cfg.n_layers)
    ]


# ----------------------------------------------------------------------------------------------------
# Measuring
# ----------------------------------------------------------------------------------------------------


def _counter(group: str, name: str) -> int:
    from torch._dynamo.utils import counters

    return int(counters[group][name])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_fill(runner, method, tower, batches, x_sums, args, device, autocast, first_fill: bool) -> dict:
    """Warm-up then timed train steps of one (method, fill); the method is already wrapped (runner)."""

    def step(batch) -> Tensor:
        tower.zero_grad(set_to_none=True)
        step_begin(method)
        with autocast():
            out = runner(batch.seq_items, batch.seq_actions, batch.seq_times, batch.seq_lengths, x_sums)
        loss = out.float().square().mean()
        loss.backward()
        return loss

    graphs_before = _counter("stats", "unique_graphs")
    unpad_before = _counter("gemcompile", "unpad")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    _sync(device)
    t0 = time.perf_counter()
    first_loss = step(batches[0]).item()
    first_step_s = time.perf_counter() - t0
    # The first fill's first step compiles; anything compiled after it is a recompile.
    graphs_after_first = _counter("stats", "unique_graphs")
    for i in range(1, args.warmup):
        step(batches[i % len(batches)])
    _sync(device)

    times_ms: list[float] = []
    t0 = time.perf_counter()
    if device.type == "cuda":
        # Events recorded without syncing in between: each step's span on the stream, host stalls included.
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(args.steps)]
        for i, (start, end) in enumerate(events):
            start.record()
            step(batches[i % len(batches)])
            end.record()
        torch.cuda.synchronize()
        times_ms = [start.elapsed_time(end) for start, end in events]
    else:
        for i in range(args.steps):
            s0 = time.perf_counter()
            step(batches[i % len(batches)])
            times_ms.append(1e3 * (time.perf_counter() - s0))
    wall_ms = 1e3 * (time.perf_counter() - t0) / args.steps
    median_ms = statistics.median(times_ms)
    profiled = None
    if device.type == "cuda" and args.kernel_steps > 0:
        profiled = kernel_profile(step, batches, args.kernel_steps)
    kernel_ms = profiled.ms_per_step if profiled is not None else None
    graphs_end = _counter("stats", "unique_graphs")
    return {
        "ms_per_step": median_ms,
        "ms_per_step_min": min(times_ms),
        "ms_per_step_max": max(times_ms),
        "step_ms": [round(t, 4) for t in times_ms],  # in order: shows a slow tail (late compiles, pools)
        "wall_ms_per_step": wall_ms,
        "kernel_ms_per_step": kernel_ms,
        "kernel_profile": profiled.as_json() if profiled is not None else None,  # the largest kernels
        "samples_per_s": args.batch_size / median_ms * 1e3,
        "first_step_s": first_step_s,
        "compile_s": max(0.0, first_step_s - median_ms / 1e3),
        "graphs_compiled": graphs_end - graphs_before,
        "recompiles": graphs_end - (graphs_after_first if first_fill else graphs_before),
        "unpad_rewrites": _counter("gemcompile", "unpad") - unpad_before,
        "first_loss": first_loss,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
    }


def ratios(results: list[dict], fills: list[float]) -> dict:
    """Per fill: peer ms / ours ms for each pair of RATIOS, and each method's first loss vs the reference."""
    out = {}
    for fill in fills:
        ms = {r["method"]: r["ms_per_step"] for r in results if r["fill"] == fill and "ms_per_step" in r}
        kernel_ms = {r["method"]: r["kernel_ms_per_step"] for r in results
                     if r["fill"] == fill and r.get("kernel_ms_per_step")}
        losses = {r["method"]: r["first_loss"] for r in results if r["fill"] == fill and "first_loss" in r}
        entry = {name: ms[peer] / ms[ours] if peer in ms and ours in ms else None
                 for name, (peer, ours) in RATIOS.items()}
        entry.update({f"{name}_kernel_time": kernel_ms[peer] / kernel_ms[ours]
                      for name, (peer, ours) in RATIOS.items() if peer in kernel_ms and ours in kernel_ms})
        ref = "eager" if "eager" in losses else next(iter(losses), None)
        if ref is not None and losses[ref]:
            entry["first_loss_reference"] = ref
            entry["first_loss_rel_diff"] = {m: abs(v - losses[ref]) / abs(losses[ref])
                                            for m, v in losses.items() if m != ref}
        out[str(fill)] = entry
    return out


# ----------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="small", choices=["tiny", "small", "medium"], help="GEM-ref preset")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--fills", default="0.3,0.5,0.7", help="comma list of mean fills (0, 1]")
    parser.add_argument("--methods", default="inductor,gem,gem-no-unpad", help="comma list, run in order")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per (method, fill)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (the first compiles)")
    parser.add_argument("--batches", type=int, default=8, help="pre-generated batches rotated per fill")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kernel-steps", type=int, default=3,
                        help="steps profiled for the GPU kernel time per step (CUDA only; 0: skip)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--budget-s", type=float, default=420.0,
                        help="do not start a (method, fill) pair after this many seconds (default 420)")
    parser.add_argument("--out", default=None, help="directory of the JSON (default: $OUT, else results/)")
    args = parser.parse_args(argv)
    args.fills = [float(f) for f in args.fills.split(",") if f.strip()]
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = unknown_methods(args.methods)
    if unknown:
        parser.error(f"unknown method(s) {unknown}; known: {methods_help()}")
    if any(not 0.0 < f <= 1.0 for f in args.fills):
        parser.error(f"--fills must be in (0, 1], got {args.fills}")
    if args.warmup < 1 or args.steps < 1 or args.batches < 1:
        parser.error("--warmup, --steps and --batches must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("benchmarks/unpad.py: no CUDA GPU here (use --device cpu for a smoke run)")
    if device.type == "cpu":  # a smoke run: OpenMP threads that spin stall badly on a busy small machine
        torch.set_num_threads(1)
    use_bf16 = device.type == "cuda"
    act_dtype = torch.bfloat16 if use_bf16 else torch.float32

    def autocast():
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=use_bf16)

    tower, model_cfg = build_tower(args.size, args.seed, device)
    x_sums = make_x_sums(model_cfg, args.batch_size, args.seed, device, act_dtype)
    # The same batches for every method: generated once per fill, moved to the device up front.
    batches, efficiency = {}, {}
    for fill in args.fills:
        data = SyntheticData(model_cfg.data_config(args.batch_size, fill=fill, seed=args.seed))
        cpu = [data.batch(i) for i in range(args.batches)]
        efficiency[fill] = statistics.mean(b.padding_efficiency() for b in cpu)
        batches[fill] = [b.to(device) for b in cpu]

    results: list[dict] = []
    env = environment()
    payload = {
        "benchmark": "unpad",
        "command": env["command"],
        "environment": env,
        "config": {
            "size": args.size, "batch_size": args.batch_size, "fills": args.fills, "methods": args.methods,
            "steps": args.steps, "warmup": args.warmup, "batches": args.batches, "seed": args.seed,
            "device": str(device), "autocast": "bfloat16" if use_bf16 else None, "budget_s": args.budget_s,
            "seq_max_lens": list(model_cfg.seq_max_lens), "n_layers": model_cfg.n_layers, "d": model_cfg.d,
        },
        "workload": "SequenceTower (GemRef's sequence embedding, layers' GDPA + block SA + FFN, final "
                    "summary; X_sum fixed random); step = zero_grad + forward + square-mean loss + backward",
        "conventions": {
            "ms_per_step": "median over timed steps (CUDA events; perf_counter on CPU)",
            "compile_s": "first step wall time minus the median step",
            "recompiles": "Dynamo graphs compiled after the method's first step",
            "ratios": "peer ms / gem ms per fill (> 1: gem faster)",
        },
        "results": results,
        "ratios": {},
    }
    path = None

    def save() -> None:
        nonlocal path
        payload["ratios"] = ratios(results, args.fills)
        payload["elapsed_s"] = round(time.perf_counter() - started, 1)
        if path is None:
            path = write_json("unpad", payload, out_dir=args.out)
        else:
            rewrite_results(path, payload)

    for method in args.methods:
        torch._dynamo.reset()  # each method compiles from scratch (and its counts start clean)
        runner = compile_method(tower, method)
        failed = None
        for index, fill in enumerate(args.fills):
            row = {"method": method, "fill": fill, "padding_efficiency": efficiency[fill]}
            if time.perf_counter() - started > args.budget_s:
                row["skipped"] = "time budget"
            elif failed is not None:
                row["skipped"] = f"first fill failed: {failed}"
            else:
                print(f"-- {method} fill {fill} (padding efficiency {efficiency[fill]:.3f})", flush=True)
                try:
                    row.update(run_fill(runner, method, tower, batches[fill], x_sums, args, device, autocast,
                                        first_fill=index == 0))
                except Exception as e:  # noqa: BLE001  (OOM, a compile error): record it, go on
                    row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
                    if index == 0:
                        failed = row["error"][:120]
                    print(f"   failed: {row['error'][:200]}", flush=True)
                if "ms_per_step" in row:
                    print(f"   {row['ms_per_step']:9.3f} ms/step  compile {row['compile_s']:6.1f} s  "
                          f"recompiles {row['recompiles']}  unpad rewrites {row['unpad_rewrites']}  "
                          f"first loss {row['first_loss']:.6g}", flush=True)
            results.append(row)
            save()
        del runner
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    print()
    print(format_table(results, [
        ("method", "method", "s"), ("fill", "fill", "g"), ("padding_efficiency", "pad eff", ".3f"),
        ("ms_per_step", "ms/step", ".3f"), ("kernel_ms_per_step", "kernel ms", ".3f"),
        ("samples_per_s", "samples/s", ".0f"), ("compile_s", "compile s", ".1f"), ("recompiles", "recompiles", "d"),
        ("unpad_rewrites", "unpad rewrites", "d"), ("first_loss", "first loss", ".6g"),
        ("peak_memory_gib", "peak GiB", ".2f"),
    ]))
    rows = [{"fill": fill, **entry} for fill, entry in payload["ratios"].items()]
    print()
    print(format_table(rows, [("fill", "fill", "s"), *[(name, name, ".3f") for name in RATIOS],
                              *[(f"{name}_kernel_time", f"{name} (kernel time)", ".3f") for name in RATIOS]]))
    skipped = [f"{r['method']}@{r['fill']}: {r.get('skipped') or r.get('error')}" for r in results
               if "ms_per_step" not in r]
    if skipped:
        print("\nnot measured: " + "; ".join(skipped))
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
