"""Masks read from data: SASRec- and BERT-style models train faster with gem_compile than with torch.compile,
and the kernels' data-mask path costs what the length path costs on the same batch.

    python benchmarks/data_masks.py --out $OUT                      # one GPU (H200), the defaults below
    python benchmarks/data_masks.py --batch 2 --length 64 --layers 1 --steps 2 --warmup 1 \
        --kernel-reps 2 --out /tmp/dm                               # CPU smoke run (no timing claims)

Models (tests/model_styles.py, written as their authors' public code writes them):
  sasrec: ``--layers`` SASRecBlocks (nn.MultiheadAttention, causal attn_mask, key_padding_mask = ids == 0,
          timeline mask), item ids from data;
  bert:   ``--layers`` BertStyleLayers (HF-style extended mask (1 - m) * finfo.min added to the scores).
``--attention-dropout p`` (default 0) trains both with dropout p on the attention weights, as their authors
train them (nn.MultiheadAttention(dropout=p), BERT's attention_probs_dropout_prob): gem_compile draws it
inside the kernels, inductor in its own graph.
SASRec with left padding and a key_padding_mask: rows before a sequence's first item see no key, and
nn.MultiheadAttention gives NaN there (the loss of eager and inductor is NaN); gem_compile gives 0.
Batches: lengths uniform in [1, L] scaled to a mean fill of ``--fill`` (0.5: half the tokens are padding),
one full-length sequence; right-padded (tokens first) and left-padded (tokens last, SASRec's and BERT4Rec's
loaders). One train step = forward under bf16 autocast, loss = out.float().square().mean(), backward.

Methods, each in this process on the same batches: ``inductor`` (torch.compile, default options) and ``gem``
(gem_compile, default GemConfig); with ``--modes default,cudagraphs`` also both under mode="reduce-overhead"
(``inductor-cudagraphs``, ``gem-cudagraphs``: a host-bound step replayed as CUDA graphs), each gem mode
compared with inductor in the same mode. Each step first drops the last step's grads (set to None, as
``zero_grad`` does): accumulating into them made both methods raise "accessing tensor output of CUDAGraphs that
has been overwritten by a subsequent run" (benchmarks/results/data_masks-20261202-001356.json).
explain's rewrite counts are recorded. ``--sync-check`` records where a step waits for the GPU. ``--host-profile`` records
each method's top host ops (self CPU time per step). Timing: CUDA events around each
step, median over ``--steps`` steps after ``--warmup`` (the first compiles); ``recompiles`` counts graphs
compiled after warm-up (masks change every step: there should be none). On CUDA three more steps per
method run under torch.profiler: ``<method>_kernel_ms`` is the GPU's own time per step (the rest of the
step's time is the host's) and ``<method>_profile`` its top kernels and kernel classes.

``--varying-lengths``: every batch padded to its own length (uniform in [L/2, L], a multiple of 8), as a
tokenizer padding to the longest sequence of each batch does; torch.compile's automatic dynamic shapes
compile the first batch static and recompile once with symbolic B and N (within the warm-up); the
third method ``gem-unpad-off`` (gem_compile with UnpadConfig.enabled=False) shows what the token-wise layers'
packing buys on the dynamic graph (before 1f9a9f1 unpad refused symbolic sizes). Right padding only.

Kernel path (``kernel``): gemcompile::jagged_attention forward + backward on one batch (B, H, L, D, bf16,
causal and not), with the key padding given as lengths (kv_lengths) and as a kv_mask of the same keys
(right-padded), plus a left-padded kv_mask of the same lengths; ratio = mask ms / lengths ms. Timed with
triton.testing.do_bench (median), and also under CUDA-graph replay; shape ``--kernel-batch`` x ``--heads``
x ``--kernel-length`` x ``--head-dim``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE.parent))  # the repository root: gemcompile and tests.model_styles
sys.path.insert(0, str(_HERE))

from harness import bench_ms, environment, format_table, graphed, results_path, rewrite_results  # noqa: E402

from gemcompile import GemConfig, explain, gem_compile  # noqa: E402
from gemcompile.runtime.training.kernel_time import kernel_profile  # noqa: E402
from tests.model_styles import BertStyleLayer, SASRecBlock  # noqa: E402


def _lengths(batch: int, length: int, fill: float, g: torch.Generator) -> torch.Tensor:
    """Lengths with mean ~ fill * length, each in [1, length], the first one full."""
    raw = torch.rand(batch, generator=g) * 2 * fill * length
    lengths = raw.round().long().clamp(1, length)
    lengths[0] = length
    return lengths


def _padded_length(args, g: torch.Generator) -> int:
    """The batch's padded length: --length, or with --varying-lengths one drawn in [--length / 2, --length] and
    rounded up to a multiple of 8 (a tokenizer padding each batch to its longest, pad_to_multiple_of=8)."""
    if not args.varying_lengths:
        return args.length
    drawn = int(torch.randint(args.length // 2, args.length + 1, (1,), generator=g))
    return min(args.length, -(-drawn // 8) * 8)


def _batch(model: str, args, side: str, g: torch.Generator, device):
    n = _padded_length(args, g)
    lengths = _lengths(args.batch, n, args.fill, g)
    positions = torch.arange(n)[None, :]
    valid = positions < lengths[:, None] if side == "right" else positions >= n - lengths[:, None]
    hidden = torch.randn(args.batch, n, args.heads * args.head_dim, generator=g)
    if model == "sasrec":
        mask_input = torch.randint(1, 1000, (args.batch, n), generator=g) * valid
    else:
        mask_input = valid.long()
    return hidden.to(device).requires_grad_(), mask_input.to(device), int(valid.sum())


class Stack(torch.nn.Module):
    def __init__(self, model: str, layers: int, heads: int, head_dim: int, dropout: float = 0.0):
        super().__init__()
        if model == "sasrec":
            blocks = [SASRecBlock(heads, head_dim, dropout=dropout) for _ in range(layers)]
        else:
            blocks = [BertStyleLayer(heads, head_dim, attention_dropout=dropout) for _ in range(layers)]
        self.layers = torch.nn.ModuleList(blocks)

    def forward(self, hidden, mask_input):
        for layer in self.layers:
            hidden = layer(hidden, mask_input)
        return hidden


def _methods(args) -> list[str]:
    """inductor and gem in each of --modes: 'default' (the names inductor, gem) and 'cudagraphs'
    (inductor-cudagraphs, gem-cudagraphs: mode="reduce-overhead", Inductor's CUDA graph trees)."""
    names = ("inductor", "gem", "gem-unpad-off") if args.varying_lengths else ("inductor", "gem")
    return [name if mode == "default" else f"{name}-{mode}" for mode in args.modes.split(",") for name in names]


def _compiled(model, method: str):
    mode = "reduce-overhead" if method.endswith("-cudagraphs") else None
    if method.startswith("inductor"):
        return torch.compile(model, mode=mode)
    config = GemConfig(unpad={"enabled": False}) if "unpad-off" in method else GemConfig()
    return gem_compile(model, config=config, mode=mode)


def _host_profile(fn, batches, device, steps: int = 3, top: int = 20) -> list[dict]:
    """The host's time per step by op (self CPU time, torch.profiler): where a host-bound step goes."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(steps):
            _step(fn, *batches[i % len(batches)][:2], device)
        torch.cuda.synchronize(device) if device.type == "cuda" else None
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    table = [{"name": e.key[:100], "self_cpu_ms_per_step": e.self_cpu_time_total / 1e3 / steps,
              "cpu_total_ms_per_step": e.cpu_time_total / 1e3 / steps, "calls_per_step": e.count / steps}
             for e in events]
    for r in table:
        print(f"  {r['self_cpu_ms_per_step']:8.3f} {r['cpu_total_ms_per_step']:8.3f} {r['calls_per_step']:6.1f} "
              f"{r['name']}", flush=True)
    return table


def _host_syncs(fn, batches, device) -> list[str]:
    """Where a step waits for the GPU (torch.cuda.set_sync_debug_mode warnings over one step): a sync per
    op call serializes host and GPU, and a host-bound step then costs their sum."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            _step(fn, *batches[0][:2], device)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # the warnings of synchronizing calls only (not torch's notice that the debug mode is a prototype, which
    # benchmarks/results/data_masks-20261202-023253.json counted as one for inductor's SASRec row)
    found = [str(w.message).splitlines()[0][:200] for w in caught
             if "called a synchronizing" in str(w.message)]
    print(f"  host syncs in one step: {len(found)}", *found[:5], sep="\n    ", flush=True)
    return found


def _step(fn, hidden, mask_input, device):
    # A training step's grads start empty (an optimizer's zero_grad(set_to_none=True)): accumulating into the
    # last step's grads would read buffers CUDA graph trees have since overwritten (their documented error).
    hidden.grad = None
    for p in fn.parameters():
        p.grad = None
    torch.compiler.cudagraph_mark_step_begin()  # a new step for CUDA graph trees; a no-op otherwise
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        out = fn(hidden, mask_input)
    loss = out.float().square().mean()
    loss.backward()
    return loss


def _time_steps(fn, batches, args, device) -> tuple[float, float, int]:
    """(median ms per step, first loss, graphs compiled after warm-up)."""
    first = float(_step(fn, *batches[0][:2], device))
    for i in range(args.warmup):
        _step(fn, *batches[i % len(batches)][:2], device)
    graphs = _graph_count()
    times = []
    for i in range(args.steps):
        hidden, mask_input, _ = batches[i % len(batches)]
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            _step(fn, hidden, mask_input, device)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            _step(fn, hidden, mask_input, device)
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), first, _graph_count() - graphs


def _graph_count() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


_COLUMNS = [("model", "model", "s"), ("padding", "pad", "s"), ("inductor_ms", "inductor ms", ".2f"),
            ("gem_ms", "gem ms", ".2f"), ("speedup_gem_vs_inductor", "x", ".2f"),
            ("inductor_kernel_ms", "inductor GPU ms", ".2f"), ("gem_kernel_ms", "gem GPU ms", ".2f")]


def _run_method(model, method: str, sides, found, args, device) -> None:
    """Compile `model` with `method` and time it on both paddings' batches into found[side]."""
    torch._dynamo.reset()
    fn = _compiled(model, method)
    t0 = time.perf_counter()
    _step(fn, *sides["right"][0][:2], device)  # compiles
    compile_s = time.perf_counter() - t0
    for side, batches in sides.items():
        ms, loss, recompiles = _time_steps(fn, batches, args, device)
        row = found[side]
        row[f"{method}_ms"], row[f"{method}_first_loss"] = ms, loss
        row[f"{method}_recompiles"], row[f"{method}_compile_s"] = recompiles, compile_s
        profiled = kernel_profile(lambda b: _step(fn, b[0], b[1], device), batches, steps=3, top=12)
        if profiled is not None:  # GPU time apart from the host's: is the step host-bound?
            row[f"{method}_kernel_ms"] = profiled.ms_per_step
            row[f"{method}_profile"] = profiled.as_json()
        if args.host_profile and side == "right":
            row[f"{method}_host_top"] = _host_profile(fn, batches, device)
        if args.sync_check and device.type == "cuda" and side == "right":
            row[f"{method}_host_syncs"] = _host_syncs(fn, batches, device)


def bench_models(args, device, model_name: str) -> list[dict]:
    """One compile per method, then the right- and the left-padded batches (same shapes, other mask values:
    nothing may recompile)."""
    rows = []
    g = torch.Generator().manual_seed(0)
    sides = {side: [_batch(model_name, args, side, g, device) for _ in range(args.batches)]
             for side in (("right",) if args.varying_lengths else ("right", "left"))}
    torch.manual_seed(0)
    model = Stack(model_name, args.layers, args.heads, args.head_dim, args.attention_dropout).to(device)
    report = explain(model, *sides["right"][0][:2])
    found = {side: {"model": model_name, "padding": side, "batch": args.batch, "length": args.length,
                    "padded_lengths": [int(b[0].shape[1]) for b in batches],
                    "layers": args.layers, "heads": args.heads, "head_dim": args.head_dim,
                    "attention_dropout": args.attention_dropout, "valid_tokens": statistics.mean(b[2] for b in batches) / (args.batch * args.length),
                    "rewrites": {k: v for k, v in report.counts.items() if v},
                    "refusals": [r.reason for r in report.refusals]}
             for side, batches in sides.items()}
    for method in _methods(args):
        try:
            _run_method(model, method, sides, found, args, device)
        except Exception as e:  # noqa: BLE001  (recorded: one method that cannot run keeps the others' rows)
            for row in found.values():
                row[f"{method}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            print(f"{model_name} {method}: {type(e).__name__}: {str(e)[:300]}", flush=True)
        model.zero_grad(set_to_none=True)
    for row in found.values():
        for method in _methods(args):
            peer = method.replace("gem", "inductor", 1)
            if method.startswith("gem") and f"{method}_ms" in row and f"{peer}_ms" in row:
                row[f"speedup_{method}_vs_{peer}"] = row[f"{peer}_ms"] / row[f"{method}_ms"]
        if "gem_ms" in row and "gem-unpad-off_ms" in row:
            row["speedup_gem_vs_gem-unpad-off"] = row["gem-unpad-off_ms"] / row["gem_ms"]
        rows.append(row)
    columns = _COLUMNS + [(f"{m}_ms", f"{m} ms", ".2f") for m in _methods(args) if m not in ("inductor", "gem")]
    columns += [("speedup_gem_vs_gem-unpad-off", "x unpad off", ".2f")] * args.varying_lengths
    columns += [(f"speedup_gem-cudagraphs_vs_inductor-cudagraphs", "x graphs", ".2f")] * ("cudagraphs" in args.modes)
    print(format_table(list(found.values()), columns), flush=True)
    return rows


def bench_kernel(args, device) -> list[dict]:
    """jagged_attention forward + backward: lengths vs kv_mask on one batch."""
    from gemcompile.lowering.jagged_attention.op import jagged_attention

    g = torch.Generator().manual_seed(1)
    B, H, L, D = args.kernel_batch, args.heads, args.kernel_length, args.head_dim
    lengths = _lengths(B, L, args.fill, g).to(device)
    q, k, v = (torch.randn(B, H, L, D, generator=g).to(device, torch.bfloat16).requires_grad_() for _ in range(3))
    dout = torch.randn(B, H, L, D, generator=g).to(device, torch.bfloat16)
    positions = torch.arange(L, device=device)[None, :]
    right = positions < lengths[:, None]
    left = positions >= L - lengths[:, None]
    rows = []
    for causal in (False, True):
        paths = {
            "lengths": lambda: jagged_attention(q, k, v, None, lengths, None, causal, D ** -0.5),
            "mask_right": lambda: jagged_attention(q, k, v, None, None, None, causal, D ** -0.5, kv_mask=right),
            "mask_left": lambda: jagged_attention(q, k, v, None, None, None, causal, D ** -0.5, kv_mask=left),
        }
        row = {"B": B, "H": H, "L": L, "D": D, "causal": causal, "dtype": "bfloat16"}
        for name, fwd in paths.items():
            def train(fwd=fwd):
                out = fwd()
                torch.autograd.grad(out, (q, k, v), dout)

            row[f"{name}_ms"] = bench_ms(train, rep_ms=args.kernel_reps * 50)
            if device.type == "cuda":
                row[f"{name}_graph_ms"] = bench_ms(graphed(train), rep_ms=args.kernel_reps * 50)
        for key in ("", "_graph"):
            if f"lengths{key}_ms" in row:
                for side in ("right", "left"):
                    row[f"mask_{side}_vs_lengths{key}"] = row[f"mask_{side}{key}_ms"] / row[f"lengths{key}_ms"]
        rows.append(row)
        print(row, flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="sasrec,bert")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--fill", type=float, default=0.5)
    p.add_argument("--attention-dropout", type=float, default=0.0, help="dropout on the attention weights")
    p.add_argument("--batches", type=int, default=4)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--kernel-batch", type=int, default=16)
    p.add_argument("--kernel-length", type=int, default=2048)
    p.add_argument("--kernel-reps", type=int, default=4)
    p.add_argument("--skip-kernel", action="store_true")
    p.add_argument("--modes", default="default",
                   help="comma list of default (torch.compile's default mode) and cudagraphs (reduce-overhead)")
    p.add_argument("--host-profile", action="store_true", help="record each method's top host ops per step")
    p.add_argument("--sync-check", action="store_true",
                   help="record where one step of each method synchronizes with the GPU (sync debug mode)")
    p.add_argument("--varying-lengths", action="store_true",
                   help="each batch padded to its own length (right padding only; torch.compile's automatic "
                        "dynamic shapes recompile once, symbolic), and gem with unpad off as a third method")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    path = results_path("data_masks" + ("-dropout" if args.attention_dropout else "")
                        + ("-varying-lengths" if args.varying_lengths else ""), args.out)
    payload = {"environment": environment(), "args": vars(args), "kernel": [], "models": []}

    def save():  # after every part: a run cut short keeps what it measured
        rewrite_results(path, payload)

    if not args.skip_kernel and device.type == "cuda":
        payload["kernel"] = bench_kernel(args, device)
        save()
    for name in args.models.split(","):
        payload["models"] += bench_models(args, device, name)
        save()
    print("wrote", path)


if __name__ == "__main__":
    main()
