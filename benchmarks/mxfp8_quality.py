"""MXFP8 quality and step time: GEM-ref trained with bf16 GEMMs against each FP8 recipe (issue 7).

Every run trains the same GEM-ref (same seed, same synthetic batches) under bf16 autocast, compiled with
gem_compile; the FP8 runs turn on the mxfp8 pass (GemConfig.mxfp8), the baseline does not. Reported per
run: the NE per task over the last ``--window`` training steps and on ``--eval-batches`` held-out batches,
the relative NE difference against bf16 (target: within 0.1%), the largest loss, a divergence flag
(non-finite loss, or a final loss 10% above bf16's), the median step time (with and without the pass),
the compile time and how many GEMMs the pass quantized. The per-step losses go into the JSON (the
loss-curve data) and, when matplotlib is importable, into a PNG beside it.

    python benchmarks/mxfp8_quality.py                       # GPU: GEM-ref small, 300 steps, bf16 / blockwise / mxfp8
    python benchmarks/mxfp8_quality.py --smoke               # CPU: GEM-ref tiny, a few steps, emulated recipes
    python benchmarks/mxfp8_quality.py --plot results/mxfp8_quality-....json   # the PNG, from a JSON (CPU)

``--min-dim`` sets the pass's min_m / min_k / min_n (default 1: every Linear the structural rules admit is
quantized, which is what a quality study needs; GEM-ref small has no layer wider than 1024, so the pass's
default sizes, tuned for speed on H200, would quantize nothing). On Hopper "mxfp8" runs emulated (the op
warns once); "blockwise" runs cuBLAS blockwise FP8 GEMMs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE.parent))
sys.path.insert(0, str(_HERE))

from harness import environment, format_table, results_path

RECIPES = ("blockwise", "mxfp8", "mxfp8_emulated")
NE_TOLERANCE = 1e-3
"""Relative NE difference against bf16 that counts as parity (0.1%)."""
BLOWUP = 1.10
"""A final-window loss above BLOWUP x bf16's counts as divergence."""


# -- one run ------------------------------------------------------------------------------------------------

def _gem_config(recipe: str | None, min_dim: int | None, bf16_weight_grad: tuple[str, ...]):
    from gemcompile import GemConfig

    if recipe is None:
        return GemConfig()
    mx = {"enabled": True, "recipe": recipe, "bf16_weight_grad": bf16_weight_grad}
    if min_dim is not None:
        mx.update(min_m=min_dim, min_k=min_dim, min_n=min_dim)
    return GemConfig(mxfp8=mx)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_one(name: str, recipe: str | None, args, device: torch.device) -> dict:
    """Train GEM-ref with one GEMM precision; returns losses, NE, timings and what the pass did. Compile
    caches are off: a graph served from a cache is not compiled, so the pass would count nothing (and
    the compile time would flatter a rerun)."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        return _run_one(name, recipe, args, device)


def _run_one(name: str, recipe: str | None, args, device: torch.device) -> dict:
    from torch._dynamo.utils import counters

    from gemcompile import gem_compile
    from gemcompile.models.data import SyntheticData
    from gemcompile.models.gem import GemRef, gem_ref_config, masked_bce_loss
    from gemcompile.runtime.metrics import MetricWindow
    from gemcompile.runtime.train import build_optimizers

    torch._dynamo.reset()
    counters.clear()
    model_cfg = gem_ref_config(args.size)
    data = SyntheticData(model_cfg.data_config(args.batch_size, fill=args.fill, seed=args.seed))
    torch.manual_seed(args.seed)
    model = GemRef(model_cfg).to(device)
    optimizers = build_optimizers(model, args.lr, args.embedding_lr)
    runner = gem_compile(model, config=_gem_config(recipe, args.min_dim, tuple(args.bf16_weight_grad)))
    autocast = (torch.autocast(device_type=device.type, dtype=torch.bfloat16) if args.dtype == "bfloat16"
                else contextlib.nullcontext())
    window = MetricWindow(model_cfg.n_tasks, window=args.window)
    losses: list[float] = []
    step_ms: list[float] = []
    compile_s = math.nan
    model.train()
    for step in range(args.steps):
        batch = data.batch(step).to(device)
        _sync(device)
        start = time.perf_counter()
        with autocast:
            logits = runner(**batch.features())
        loss = masked_bce_loss(logits.float(), batch.labels, batch.label_mask)
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
        loss.backward()
        for optimizer in optimizers:
            optimizer.step()
        value = loss.item()  # syncs
        elapsed = time.perf_counter() - start
        if step == 0:
            compile_s = elapsed
        elif step > args.warmup:
            step_ms.append(1e3 * elapsed)
        losses.append(value)
        window.update(logits.detach().float(), batch.labels, batch.label_mask)
        if not math.isfinite(value):
            print(f"  {name}: non-finite loss {value} at step {step + 1}; stopping this run", flush=True)
            break
        if args.log_every and (step + 1) % args.log_every == 0:
            print(f"  {name}: step {step + 1}/{args.steps} loss {value:.4f}", flush=True)
    train_ne = window.compute().ne
    # held-out batches (steps the run never trained on), grad mode kept so the training graph is reused
    eval_window = MetricWindow(model_cfg.n_tasks, window=None)
    for i in range(args.eval_batches):
        batch = data.batch(args.eval_offset + i).to(device)
        with autocast:
            logits = runner(**batch.features())
        eval_window.update(logits.detach().float(), batch.labels, batch.label_mask)
    eval_ne = eval_window.compute().ne if args.eval_batches else ()
    found = counters["gemcompile"]
    quantized = {role: found.get(f"mxfp8_fp8_{role}", 0) for role in ("fwd", "dgrad", "wgrad")}
    kept = {k.removeprefix("mxfp8_"): v for k, v in found.items()
            if k.startswith("mxfp8_") and not k.startswith("mxfp8_fp8_") and k != "mxfp8_refused"}
    return {
        "name": name,
        "recipe": recipe,
        "losses": losses,
        "train_ne": list(train_ne),
        "eval_ne": list(eval_ne),
        "max_loss": max(losses) if losses else math.nan,
        "final_loss": statistics.fmean(losses[-args.window:]) if losses else math.nan,
        "nonfinite": any(not math.isfinite(v) for v in losses),
        "step_ms": statistics.median(step_ms) if step_ms else math.nan,
        "compile_s": compile_s,
        "quantized_gemms": quantized,
        "kept_gemms": kept,
    }


# -- report -------------------------------------------------------------------------------------------------

def _rel(value: float, base: float) -> float:
    return (value - base) / base if base and math.isfinite(base) and math.isfinite(value) else math.nan


def _finite(values: list[float]) -> list[float]:
    return [v for v in values if math.isfinite(v)]


def summarize(runs: list[dict]) -> list[dict]:
    """Adds the comparison against the first (bf16) run: relative NE, divergence, step-time ratio."""
    base = runs[0]
    rows = []
    for run in runs:
        rel_train = [_rel(v, b) for v, b in zip(run["train_ne"], base["train_ne"])]
        rel_eval = [_rel(v, b) for v, b in zip(run["eval_ne"], base["eval_ne"])]
        # parity is judged on the held-out NE; on the training-window NE when the eval NE is undefined
        # (NaN: a task with one label value in the held-out batches), and not at all when both are
        basis = "eval" if rel_eval and len(_finite(rel_eval)) == len(rel_eval) else "train"
        compared = _finite(rel_eval) if basis == "eval" else _finite(rel_train)
        blowup = (math.isfinite(run["final_loss"]) and math.isfinite(base["final_loss"])
                  and run["final_loss"] > BLOWUP * base["final_loss"])
        run.update(
            rel_train_ne=rel_train,
            rel_eval_ne=rel_eval,
            diverged=bool(run["nonfinite"] or blowup),
            step_time_ratio=run["step_ms"] / base["step_ms"] if base["step_ms"] else math.nan,
            ne_basis=basis,
            ne_within_tolerance=(all(abs(r) <= NE_TOLERANCE for r in compared) if compared else None),
        )
        row = {
            "run": run["name"],
            "final_loss": run["final_loss"],
            "max_loss": run["max_loss"],
            "diverged": "yes" if run["diverged"] else "no",
            "step_ms": run["step_ms"],
            "x_bf16": run["step_time_ratio"],
            "compile_s": run["compile_s"],
            "fp8": "/".join(str(run["quantized_gemms"][r]) for r in ("fwd", "dgrad", "wgrad")),
        }
        for t, ne in enumerate(run["train_ne"]):
            row[f"train_ne{t}"] = ne
            row[f"rel_train{t}"] = 100 * rel_train[t] if t < len(rel_train) else math.nan
        for t, ne in enumerate(run["eval_ne"]):
            row[f"eval_ne{t}"] = ne
            row[f"rel_eval{t}"] = 100 * rel_eval[t] if t < len(rel_eval) else math.nan
        rows.append(row)
    return rows


def table(rows: list[dict], n_tasks: int, task_names=("CTR", "CVR")) -> str:
    columns = [("run", "run", "s")]
    for t in range(n_tasks):
        name = task_names[t] if t < len(task_names) else str(t)
        columns += [(f"eval_ne{t}", f"eval NE {name}", ".5f"), (f"rel_eval{t}", "vs base %", "+.3f"),
                    (f"train_ne{t}", f"train NE {name}", ".5f"), (f"rel_train{t}", "vs base %", "+.3f")]
    columns += [("final_loss", "final loss", ".5f"), ("max_loss", "max loss", ".4f"), ("diverged", "diverged", "s"),
                ("step_ms", "step ms", ".2f"), ("x_bf16", "x base", ".3f"), ("compile_s", "compile s", ".1f"),
                ("fp8", "fp8 fwd/dgrad/wgrad", "s")]
    return format_table(rows, columns)


def _smooth(values: list[float], width: int) -> list[float]:
    out, total, queue = [], 0.0, []
    for v in values:
        queue.append(v)
        total += v
        if len(queue) > width:
            total -= queue.pop(0)
        out.append(total / len(queue))
    return out


def plot(payload: dict, png: Path, smooth: int = 10) -> bool:
    """Loss curves (moving average) and each recipe's loss minus bf16's; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    runs = payload["runs"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True, height_ratios=(2, 1))
    base = _smooth(runs[0]["losses"], smooth)
    for i, run in enumerate(runs):
        color = f"C{i % 10}"
        curve = _smooth(run["losses"], smooth)
        top.plot(range(1, len(curve) + 1), curve, label=run["name"], linewidth=1.2, color=color)
        if i:
            n = min(len(curve), len(base))
            bottom.plot(range(1, n + 1), [c - b for c, b in zip(curve[:n], base[:n])], label=run["name"],
                        linewidth=1.0, color=color)
    cfg = payload["config"]
    precision = "bf16 autocast" if cfg["dtype"] == "bfloat16" else "float32"
    top.set_title(f"GEM-ref {cfg['size']}: training loss, {precision}, batch {cfg['batch_size']}, "
                  f"seed {cfg['seed']} (moving average over {smooth} steps)", fontsize=9)
    top.set_ylabel("BCE loss")
    top.legend()
    bottom.axhline(0.0, color="black", linewidth=0.6)
    bottom.set_ylabel(f"loss - {runs[0]['name']} loss")
    bottom.set_xlabel("step")
    bottom.legend(fontsize=8)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return True


# -- main ---------------------------------------------------------------------------------------------------

def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default=None, choices=["tiny", "small", "large"],
                        help="GEM-ref size (default small; tiny with --smoke)")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default 300; 6 with --smoke)")
    parser.add_argument("--batch-size", type=int, default=None, help="samples per step (default 256; 16 with --smoke)")
    parser.add_argument("--recipes", nargs="+", choices=RECIPES, default=None,
                        help="FP8 recipes to compare with bf16 (default blockwise mxfp8; emulated ones with --smoke)")
    parser.add_argument("--min-dim", type=int, default=1,
                        help="the pass's min_m / min_k / min_n (default 1: every qualifying Linear); 0 = the "
                        "pass's own defaults")
    parser.add_argument("--bf16-weight-grad", nargs="*", default=[], metavar="PATTERN",
                        help="module patterns whose wgrad stays bf16 (Mxfp8Config.bf16_weight_grad)")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                        help="autocast dtype of the forward (default bfloat16; float32 with --smoke)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--embedding-lr", type=float, default=0.01)
    parser.add_argument("--fill", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--window", type=int, default=None, help="training steps the train NE covers (default 50)")
    parser.add_argument("--eval-batches", type=int, default=None, help="held-out batches for the eval NE (default 20)")
    parser.add_argument("--eval-offset", type=int, default=1_000_000, help="first held-out batch index")
    parser.add_argument("--warmup", type=int, default=5, help="steps after the first left out of the step time")
    parser.add_argument("--baseline-repeats", type=int, default=1,
                        help="train the bf16 baseline this many times (>1 shows the run-to-run noise floor)")
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None)
    parser.add_argument("--gpus", type=int, default=1,
                        help="train the runs concurrently, one process per GPU (CUDA_VISIBLE_DEVICES=i); the "
                        "losses are those of sequential runs, the step times share the host's CPUs")
    parser.add_argument("--only-run", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--part", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--smoke", action="store_true", help="CPU: tiny, a few steps, emulated recipes")
    parser.add_argument("--out", default=None, help="directory of the JSON (and PNG); $OUT wins")
    parser.add_argument("--plot", default=None, metavar="FROM_JSON", help="only render the PNG of a results JSON")
    parser.add_argument("--png", default=None, help="where --plot writes (default docs/mxfp8_quality.png)")
    args = parser.parse_args(argv)
    smoke = args.smoke
    defaults = {"size": "tiny" if smoke else "small", "steps": 6 if smoke else 300,
                "batch_size": 16 if smoke else 256, "dtype": "float32" if smoke else "bfloat16",
                "window": 3 if smoke else 50, "eval_batches": 2 if smoke else 20,
                "recipes": ["mxfp8_emulated", "blockwise"] if smoke else ["blockwise", "mxfp8"],
                "device": "cpu" if smoke else "cuda"}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.min_dim == 0:
        args.min_dim = None
    if smoke:
        args.warmup = min(args.warmup, 1)
        args.log_every = 0
    return args


def _dump(path: Path, payload: dict) -> None:
    with open(path, "w") as fh:
        json.dump(payload, fh, indent=1, default=str)


def _run_concurrently(plan, args, argv) -> list[dict]:
    """Each run of the plan in its own process on its own GPU, `args.gpus` at a time; results in plan order.
    Every process trains from the same seed on the same batches, so the comparison is the sequential one."""
    import os
    import subprocess
    import tempfile

    argv = list(sys.argv[1:] if argv is None else argv)
    results: list[dict | None] = [None] * len(plan)
    with tempfile.TemporaryDirectory() as tmp:
        pending = list(range(len(plan)))
        while pending:
            batch, pending = pending[: args.gpus], pending[args.gpus:]
            procs = []
            for gpu, index in enumerate(batch):
                part = Path(tmp) / f"run{index}.json"
                env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(gpu)}
                cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--only-run", str(index),
                       "--part", str(part)]
                where = f"GPU {gpu}" if args.device == "cuda" else f"process {gpu + 1} (CPU)"
                print(f"run {plan[index][0]} on {where} ...", flush=True)
                procs.append((index, part, subprocess.Popen(cmd, env=env)))
            for index, part, proc in procs:
                if proc.wait() != 0 or not part.exists():
                    raise SystemExit(f"run {plan[index][0]} failed (exit {proc.returncode})")
                results[index] = json.loads(part.read_text())
                r = results[index]
                print(f"  {r['name']} done: final loss {r['final_loss']:.5f}, step {r['step_ms']:.2f} ms, "
                      f"fp8 GEMMs {r['quantized_gemms']}", flush=True)
    return results


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.plot:
        payload = json.loads(Path(args.plot).read_text())
        png = Path(args.png) if args.png else _HERE.parent / "docs" / "mxfp8_quality.png"
        if not plot(payload, png):
            print("matplotlib is not installed: pip install matplotlib", file=sys.stderr)
            return 1
        print(f"wrote {png}")
        return 0
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("benchmarks/mxfp8_quality.py needs a CUDA GPU (or --smoke / --device cpu)")
    if device.type == "cpu":
        torch.set_num_threads(max(1, min(4, torch.get_num_threads())))
    base = "bf16" if args.dtype == "bfloat16" else "fp32"  # the baseline: the same model without the pass
    plan = [(f"{base} #{i + 1}" if args.baseline_repeats > 1 else base, None) for i in range(args.baseline_repeats)]
    plan += [(recipe, recipe) for recipe in args.recipes]
    runs: list[dict] = []
    started = time.perf_counter()
    path = results_path("mxfp8_quality-smoke" if args.smoke else "mxfp8_quality", args.out)
    payload = {
        "benchmark": "mxfp8_quality",
        "environment": environment(),
        "config": {k: v for k, v in vars(args).items() if k not in ("plot", "png", "out", "only_run", "part")},
        "runs": runs,
    }
    if args.only_run is not None:  # a worker of --gpus: one run, its result and warnings to --part
        name, recipe = plan[args.only_run]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run = run_one(name, recipe, args, device)
        run["fallback_warnings"] = sorted({str(w.message) for w in caught
                                           if type(w.message).__name__ == "Fp8FallbackWarning"})
        _dump(Path(args.part), run)
        return 0
    if args.gpus > 1:  # (on the CPU: concurrent processes, a check of this path)
        runs.extend(_run_concurrently(plan, args, argv))
        fallbacks = sorted({m for r in runs for m in r.pop("fallback_warnings", [])})
    else:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for name, recipe in plan:
                print(f"run {name} ...", flush=True)
                runs.append(run_one(name, recipe, args, device))
                print(f"  done: final loss {runs[-1]['final_loss']:.5f}, step {runs[-1]['step_ms']:.2f} ms, "
                      f"fp8 GEMMs {runs[-1]['quantized_gemms']}, {time.perf_counter() - started:.0f} s so far",
                      flush=True)
                _dump(path, payload)  # what is done so far survives a run cut short by a time limit
        fallbacks = sorted({str(w.message) for w in caught if type(w.message).__name__ == "Fp8FallbackWarning"})
    rows = summarize(runs)
    n_tasks = len(runs[0]["train_ne"])
    text = table(rows, n_tasks)
    print()
    print(text)
    fp8_runs = [r for r in runs if r["recipe"] is not None]
    verdict = {r["name"]: {"ne_within_0.1%": r["ne_within_tolerance"], "ne_basis": r["ne_basis"],
                           "diverged": r["diverged"]} for r in fp8_runs}
    print(f"\nverdict (NE within {100 * NE_TOLERANCE:.1f}% of bf16 on every task, no divergence): {verdict}")
    for message in fallbacks:
        print(f"note: {message}")
    payload.update(table=text, verdict=verdict, fallback_warnings=fallbacks, wall_s=time.perf_counter() - started)
    _dump(path, payload)
    print(f"wrote {path}")
    png = path.with_suffix(".png")
    if plot(payload, png):
        print(f"wrote {png}")
    else:
        print(f"matplotlib not installed: render the loss curves later with --plot {path}")
    if args.smoke:
        bad = [r["name"] for r in runs if r["nonfinite"]]
        if bad or not all(sum(r["quantized_gemms"].values()) for r in fp8_runs):
            print(f"smoke FAILED: non-finite {bad}, fp8 GEMMs {[r['quantized_gemms'] for r in fp8_runs]}")
            return 1
        print("smoke ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
