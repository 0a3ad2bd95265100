"""MXFP8 and activation memory quality: GEM-ref trained in bf16 against FP8 recipes or memory settings.

Issue 7: bf16 GEMMs against each FP8 recipe, quality and step time; issue 26: activation memory settings.

Every run trains the same GEM-ref (same seed, same synthetic batches) under bf16 autocast, compiled with
gem_compile; the FP8 runs turn on the mxfp8 pass (GemConfig.mxfp8), the baseline does not. Every
``--eval-every`` steps a run measures the NE per task on ``--eval-batches`` held-out batches (and over the
last ``--window`` training steps). Reported per run, at the last checkpoint it shares with bf16: the
relative NE difference against bf16 (target: within 0.1%), the largest loss, a divergence flag (non-finite
loss, or a final loss 10% above bf16's), the median step time (with and without the pass), the compile
time and how many GEMMs the pass quantized. ``--baseline-repeats 2`` adds a bf16 run that differs only in
its initialization seed: its gap is the noise floor. The per-step losses go into the JSON (the
loss-curve data) and, when matplotlib is importable, into a PNG beside it.

    python benchmarks/mxfp8_quality.py                       # GPU: GEM-ref small, 300 steps, bf16 / blockwise / mxfp8
    python benchmarks/mxfp8_quality.py --smoke               # CPU: GEM-ref tiny, a few steps, emulated recipes
    python benchmarks/mxfp8_quality.py --plot results/mxfp8_quality-....json   # the PNG, from a JSON (CPU)

``--min-dim`` sets the pass's min_m / min_k / min_n (default 1: every Linear the structural rules admit is
quantized, which is what a quality study needs; GEM-ref small has no layer wider than 1024, so the pass's
default sizes, tuned for speed on H200, would quantize nothing). On Hopper "mxfp8" runs emulated (the op
warns once); "blockwise" runs cuBLAS blockwise FP8 GEMMs.

The same machinery checks gem_compile against eager (issue 10: the same NE as eager within 0.1%):
``--baseline eager --recipes none`` trains the baseline eagerly (no compile at all) and compares
gem_compile with its default passes (recipe "none": no FP8) against it:

    python benchmarks/mxfp8_quality.py --baseline eager --baseline-repeats 2 --recipes none

``--tables sparse-rows`` makes that gem_compile run train its tables as ``gemcompile bench e2e``'s gem does
(row gradients and SparseAdagrad), against the eager baseline's dense gradients and torch's Adagrad.

The same again for activation memory (issue 26: held-out NE with FP8 saved activations within the
run-to-run noise of bf16 saved activations): a recipe may also be an activation memory setting, named as
``gemcompile bench e2e`` names it (e2e_bench.memory_variant): ``gem+fp8-saved`` (GemConfig.memory.fp8_saved:
the input of each qualifying Linear held for its weight gradient in FP8; no mxfp8 pass) or
``gem-memory-budget-<fraction>[+fp8-saved]``. Such a run records how many tensors its backward received in
FP8 (``saved_in_fp8``, from the partitioner's record); one that saved none proves nothing and says so
(``inert`` in the verdict). Its verdict is ``within_noise_floor``: on every task its relative held-out NE
gap to the bf16 seed-0 run is at most the noise floor, the largest gap of the bf16 seed-1 run over the tasks
(VERDICT_RULES, also in the JSON). GEM-ref small, 300 steps, B 256, warm-up and cosine decay; bf16 seed 0,
bf16 seed 1 and gem+fp8-saved as three processes on one H200, about 8 minutes:

    python benchmarks/mxfp8_quality.py --steps 300 --batch-size 256 --lr-warmup 30 --lr-schedule cosine \
        --eval-every 50 --eval-batches 40 --baseline-repeats 2 --recipes gem+fp8-saved \
        --gpus 1 --procs-per-gpu 3 --deadline-s 450
    python benchmarks/mxfp8_quality.py --plot results/mxfp8_quality-....json  # activation_memory_quality.png

On the CPU, against eager (the smoke's batch of 16 leaves every Linear input of GEM-ref tiny below
fp8_saved.MIN_ELEMENTS, so that run is inert; at 128 five are saved in FP8):

    python benchmarks/mxfp8_quality.py --smoke --baseline eager --recipes gem+fp8-saved --batch-size 128
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE.parent))
sys.path.insert(0, str(_HERE))

from harness import environment, format_table, results_path, rewrite_results

from gemcompile.runtime.training.e2e_bench import memory_section

RECIPES = ("blockwise", "mxfp8", "mxfp8_emulated")
NO_FP8 = "none"
"""The recipe name of a compared run without the mxfp8 pass (gem_compile's defaults)."""
MEMORY_RECIPES = "gem+fp8-saved, gem-memory-budget-<fraction in (0, 1]>[+fp8-saved]"
"""Activation memory settings, by e2e_bench's method names (memory_section reads them)."""
NE_TOLERANCE = 1e-3
"""Relative NE difference against bf16 that counts as parity (0.1%)."""
BLOWUP = 1.10
"""A final-window loss above BLOWUP x bf16's counts as divergence."""
VERDICT_RULES = {
    "ne_within_0.1%": f"every task's |relative held-out NE gap| to the baseline (the first "
    f"run) at the last checkpoint both reached is at most {NE_TOLERANCE:g} (the training-window NE where a "
    "held-out NE is undefined)",
    "within_noise_floor": "every task's |relative NE gap| to the baseline is at most the noise floor: the "
    "largest |relative NE gap| to the baseline of a baseline repeat (same batches, initialization seed "
    "seed + i) over the tasks; null without --baseline-repeats 2 or more",
    "diverged": f"a non-finite loss, or a final-window loss above {BLOWUP:g} x the baseline's",
    "inert": "why the run proves nothing about its recipe (an FP8 recipe that quantized no GEMM, an "
    "fp8_saved setting whose backward received no tensor in FP8); null when it did its work",
}
"""How the verdict judges each compared run (written into the JSON beside it)."""


# -- one run ------------------------------------------------------------------------------------------------

def _gem_config(recipe: str | None, min_dim: int | None, bf16_weight_grad: tuple[str, ...]):
    """gem_compile's config of a run: the defaults (the baseline, recipe "none"), an activation memory
    setting (the mxfp8 pass off), or the mxfp8 pass with an FP8 recipe."""
    from gemcompile import GemConfig

    if recipe in (None, NO_FP8):
        return GemConfig()
    if (memory := memory_section(recipe)) is not None:
        return GemConfig(memory=memory)
    mx = {"enabled": True, "recipe": recipe, "bf16_weight_grad": bf16_weight_grad}
    if min_dim is not None:
        mx.update(min_m=min_dim, min_k=min_dim, min_n=min_dim)
    return GemConfig(mxfp8=mx)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_one(name: str, recipe: str | None, args, device: torch.device, init_seed: int | None = None,
            on_checkpoint=None, baseline: bool | None = None) -> dict:
    """Train GEM-ref with one GEMM precision; returns losses, NE checkpoints, timings and what the pass did.
    Compile caches are off: a graph served from a cache is not compiled, so the pass would count nothing
    (and the compile time would flatter a rerun). `on_checkpoint(partial_result)` runs after each held-out
    evaluation, so a run cut short by a time limit still leaves its checkpoints behind."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    from gemcompile.passes.records import PassLog, recording

    log = PassLog()  # every compile of the run reports here (one per graph and recompile), not to its own log
    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False), \
            recording(log):
        result = _run_one(name, recipe, args, device, args.seed if init_seed is None else init_seed, on_checkpoint,
                          recipe is None if baseline is None else baseline, log)
    return result


def lr_factor(step: int, steps: int, warmup: int, schedule: str) -> float:
    """The learning-rate multiplier after `step` optimizer steps. A linear warm-up over the first `warmup`
    steps keeps the first updates small: at the full rate the loss of GEM-ref small jumps to ~2.8 at step 4,
    and that jump is where two runs that differ only in rounding part ways. Then `cosine` decays to 0 at the
    last step, so runs settle instead of still moving when they are compared (what the seed-to-seed noise
    floor is made of at a constant rate); `constant` holds the rate."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if schedule == "cosine":
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))
    return 1.0


def checkpoint_steps(steps: int, every: int) -> list[int]:
    """The steps after which the held-out NE is measured: every `every` steps, and always the last one."""
    marks = list(range(every, steps + 1, every)) if every > 0 else []
    return marks if marks and marks[-1] == steps else marks + [steps]


def _run_one(name, recipe, args, device, init_seed, on_checkpoint, baseline: bool, log) -> dict:
    from torch._dynamo.utils import counters

    from gemcompile import gem_compile
    from gemcompile.models.data import SyntheticData
    from gemcompile.models.gem import GemRef, gem_ref_config, masked_bce_loss
    from gemcompile.runtime.training.metrics import MetricWindow
    from gemcompile.runtime.training.optimizers import build_optimizers

    torch._dynamo.reset()
    counters.clear()
    model_cfg = gem_ref_config(args.size)
    data = SyntheticData(model_cfg.data_config(args.batch_size, fill=args.fill, seed=args.seed,
                                               ctr_target=args.ctr, cvr_target=args.cvr))
    torch.manual_seed(init_seed)  # the batches follow args.seed whatever the initialization
    model = GemRef(model_cfg).to(device)
    eager = baseline and args.baseline == "eager"  # the baseline of the gem_compile-vs-eager check
    # --tables sparse-rows: the gem_compile runs train their tables as ``bench e2e``'s gem does (row gradients,
    # SparseAdagrad); an eager baseline keeps dense gradients and torch's Adagrad, the reference they must match
    sparse_rows = args.tables == "sparse-rows" and not eager
    optimizers = build_optimizers(model, args.lr, args.embedding_lr, sparse_embeddings=sparse_rows)
    factor = functools.partial(lr_factor, steps=args.steps, warmup=args.lr_warmup, schedule=args.lr_schedule)
    schedules = ([torch.optim.lr_scheduler.LambdaLR(o, factor) for o in optimizers]
                 if args.lr_schedule != "constant" or args.lr_warmup else [])
    runner = model if eager else gem_compile(model, config=_gem_config(recipe, args.min_dim,
                                                                       tuple(args.bf16_weight_grad)))
    autocast = (torch.autocast(device_type=device.type, dtype=torch.bfloat16) if args.dtype == "bfloat16"
                else contextlib.nullcontext())

    held_out: list = []  # the held-out batches, drawn once (on the CPU) for every checkpoint

    def held_out_ne() -> list[float]:
        # batches the run never trains on; grad mode kept so the training graph is reused (no recompile)
        if not held_out:
            held_out.extend(data.batch(args.eval_offset + i) for i in range(args.eval_batches))
        ne_window = MetricWindow(model_cfg.n_tasks, window=None)
        for cpu_batch in held_out:
            batch = cpu_batch.to(device)
            with autocast:
                logits = runner(**batch.features())
            ne_window.update(logits.detach().float(), batch.labels, batch.label_mask)
        return list(ne_window.compute().ne) if args.eval_batches else []

    window = MetricWindow(model_cfg.n_tasks, window=args.window)
    marks = set(checkpoint_steps(args.steps, args.eval_every))
    result = {"name": name, "recipe": recipe, "baseline": baseline, "compiled": not eager,
              "init_seed": init_seed, "optimizers": [type(o).__name__ for o in optimizers],
              "losses": [], "checkpoints": [],
              "step_ms": math.nan, "compile_s": math.nan, "complete": False}
    losses: list[float] = result["losses"]
    started = time.perf_counter()
    step_ms: list[float] = []
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
        for schedule in schedules:
            schedule.step()
        value = loss.item()  # syncs
        elapsed = time.perf_counter() - start
        if step == 0:
            result["compile_s"] = elapsed
        elif step > args.warmup:
            step_ms.append(1e3 * elapsed)
        losses.append(value)
        window.update(logits.detach().float(), batch.labels, batch.label_mask)
        if not math.isfinite(value):
            print(f"  {name}: non-finite loss {value} at step {step + 1}; stopping this run", flush=True)
            break
        if args.log_every and (step + 1) % args.log_every == 0:
            print(f"  {name}: step {step + 1}/{args.steps} loss {value:.4f} "
                  f"({time.perf_counter() - started:.0f} s since the run began)", flush=True)
        if step + 1 in marks:
            result["checkpoints"].append({"step": step + 1, "train_ne": list(window.compute().ne),
                                          "eval_ne": held_out_ne()})
            result["step_ms"] = statistics.median(step_ms) if step_ms else math.nan
            _fill_pass_counts(result, counters["gemcompile"], log)
            print(f"  {name}: checkpoint at step {step + 1}, held-out NE "
                  f"{[round(v, 5) for v in result['checkpoints'][-1]['eval_ne']]} "
                  f"({time.perf_counter() - started:.0f} s since the run began)", flush=True)
            if on_checkpoint is not None:
                on_checkpoint(result)
    result["step_ms"] = statistics.median(step_ms) if step_ms else math.nan
    result["final_lr"] = [o.param_groups[0]["lr"] for o in optimizers]
    _fill_pass_counts(result, counters["gemcompile"], log)
    result["complete"] = len(losses) == args.steps and all(math.isfinite(v) for v in losses)
    return result


def _fill_pass_counts(result: dict, found, log) -> None:
    result["quantized_gemms"] = {role: found.get(f"mxfp8_fp8_{role}", 0) for role in ("fwd", "dgrad", "wgrad")}
    result["kept_gemms"] = {k.removeprefix("mxfp8_"): v for k, v in found.items()
                            if k.startswith("mxfp8_") and not k.startswith("mxfp8_fp8_") and k != "mxfp8_refused"}
    result["saved_in_fp8"] = saved_in_fp8(log)


def saved_in_fp8(log) -> dict:
    """What the backward graphs received in FP8 (GemConfig.memory.fp8_saved), from the partitioner's record
    of each graph it partitioned (a recompile is partitioned, and counted, again): the FP8 tensors, their
    bytes with their scales, and the bytes they would have kept in their own dtype."""
    fp8 = [t for graph in log.memory for t in graph.tensors if t.dtype_before and t.status != "recomputed"]
    return {"tensors": len(fp8), "fp8_bytes": sum(g.fp8_bytes for g in log.memory),
            "bytes_before": sum(g.fp8_bytes_before for g in log.memory), "partitions": len(log.memory)}


# -- report -------------------------------------------------------------------------------------------------

def _rel(value: float, base: float) -> float:
    return (value - base) / base if base and math.isfinite(base) and math.isfinite(value) else math.nan


def _finite(values: list[float]) -> list[float]:
    return [v for v in values if math.isfinite(v)]


def _checkpoint_at(run: dict, step: int) -> dict | None:
    return next((c for c in run["checkpoints"] if c["step"] == step), None)


def summarize(runs: list[dict], window: int) -> list[dict]:
    """Adds the comparison against the first (bf16) run at the last held-out checkpoint both reached (a
    run cut by a time limit is compared where it stopped): relative NE, divergence, step-time ratio, and the
    relative NE at every shared checkpoint (does the gap close or grow?)."""
    base = runs[0]
    base_steps = {c["step"] for c in base["checkpoints"]}
    rows = []
    for run in runs:
        shared = sorted(base_steps & {c["step"] for c in run["checkpoints"]})
        step = shared[-1] if shared else None
        mine, theirs = (_checkpoint_at(run, step), _checkpoint_at(base, step)) if step else (None, None)
        rel_train = [_rel(v, b) for v, b in zip(mine["train_ne"], theirs["train_ne"])] if mine else []
        rel_eval = [_rel(v, b) for v, b in zip(mine["eval_ne"], theirs["eval_ne"])] if mine else []
        # parity is judged on the held-out NE; on the training-window NE when the eval NE is undefined
        # (NaN: a task with one label value in the held-out batches), and not at all when both are
        basis = "eval" if rel_eval and len(_finite(rel_eval)) == len(rel_eval) else "train"
        compared = _finite(rel_eval) if basis == "eval" else _finite(rel_train)
        n = step or min(len(run["losses"]), len(base["losses"]))
        final = statistics.fmean(run["losses"][max(0, n - window):n]) if n else math.nan
        base_final = statistics.fmean(base["losses"][max(0, n - window):n]) if n else math.nan
        blowup = math.isfinite(final) and math.isfinite(base_final) and final > BLOWUP * base_final
        nonfinite = any(not math.isfinite(v) for v in run["losses"])
        run.update(
            compared_step=step,
            rel_train_ne=rel_train,
            rel_eval_ne=rel_eval,
            rel_eval_curve=[{"step": k, "rel_eval_ne": [_rel(v, b) for v, b in zip(
                _checkpoint_at(run, k)["eval_ne"], _checkpoint_at(base, k)["eval_ne"])]} for k in shared],
            final_loss=final,
            max_loss=max(run["losses"][:n]) if n else math.nan,
            diverged=bool(nonfinite or blowup),
            step_time_ratio=run["step_ms"] / base["step_ms"] if base["step_ms"] else math.nan,
            ne_basis=basis,
            ne_within_tolerance=(all(abs(r) <= NE_TOLERANCE for r in compared) if compared else None),
        )
        row = {
            "run": run["name"],
            "step": step if step else 0,
            "final_loss": final,
            "max_loss": run["max_loss"],
            "diverged": "yes" if run["diverged"] else "no",
            "step_ms": run["step_ms"],
            "x_bf16": run["step_time_ratio"],
            "compile_s": run["compile_s"],
            "fp8": "/".join(str(run["quantized_gemms"][r]) for r in ("fwd", "dgrad", "wgrad")),
            "saved_fp8": run.get("saved_in_fp8", {}).get("tensors", 0),  # JSONs before fp8_saved lack it
        }
        for t, r in enumerate(rel_eval):
            row[f"eval_ne{t}"] = mine["eval_ne"][t]
            row[f"rel_eval{t}"] = 100 * r
        for t, r in enumerate(rel_train):
            row[f"train_ne{t}"] = mine["train_ne"][t]
            row[f"rel_train{t}"] = 100 * r
        rows.append(row)
    return rows


def _is_baseline(run: dict) -> bool:
    return run.get("baseline", run["recipe"] is None)  # JSONs before --baseline: the runs without a recipe


def inert(run: dict) -> str | None:
    """Why a compared run proves nothing about its recipe (VERDICT_RULES), or None: an FP8 recipe that
    quantized no GEMM, an fp8_saved setting whose backward received no tensor in FP8. A budget alone and
    recipe "none" change no precision: nothing to prove."""
    recipe = run["recipe"]
    if _is_baseline(run) or recipe == NO_FP8:
        return None
    memory = memory_section(recipe)
    if memory is None:
        return None if sum(run["quantized_gemms"].values()) else "the mxfp8 pass quantized no GEMM"
    if memory.get("fp8_saved") and not run.get("saved_in_fp8", {}).get("tensors"):
        return "fp8_saved saved no tensor in FP8 (every candidate left alone: see gemcompile.explain)"
    return None


def judge(run: dict, floor: float | None) -> dict:
    """The verdict on one compared run after summarize, against the noise floor (VERDICT_RULES)."""
    rel = run["rel_eval_ne"] if run["ne_basis"] == "eval" else run["rel_train_ne"]
    return {"ne_within_0.1%": run["ne_within_tolerance"], "ne_basis": run["ne_basis"],
            "at_step": run["compared_step"], "complete": run["complete"], "rel_ne": rel,
            # a run with no checkpoint shared with the baseline has no gap to judge
            "within_noise_floor": None if floor is None or not rel else all(abs(x) <= floor for x in rel),
            "diverged": run["diverged"], "inert": inert(run),
            "saved_in_fp8": run.get("saved_in_fp8", {}).get("tensors", 0)}


def _recipe(name: str) -> str:
    """--recipes: an FP8 recipe, "none", or an activation memory setting."""
    if name in (*RECIPES, NO_FP8) or memory_section(name) is not None:
        return name
    raise argparse.ArgumentTypeError(f"unknown recipe {name!r}: one of {', '.join((*RECIPES, NO_FP8))}, "
                                     f"or an activation memory setting ({MEMORY_RECIPES})")


def default_png(payload: dict) -> Path:
    """Where --plot writes by default: docs/activation_memory_quality.png when the JSON compares an activation
    memory setting, docs/mxfp8_quality.png otherwise (neither study overwrites the other's curves)."""
    memory = any(memory_section(r) is not None for r in payload["config"]["recipes"])
    return _HERE.parent / "docs" / ("activation_memory_quality.png" if memory else "mxfp8_quality.png")


def noise_floor(runs: list[dict]) -> float | None:
    """The largest relative NE gap between bf16 runs that differ only in their initialization seed (the
    repeats of --baseline-repeats), on the basis each was judged on: the spread a recipe's gap is read
    against. None without repeats."""
    gaps = [abs(r) for run in runs[1:] if _is_baseline(run)
            for r in (run["rel_eval_ne"] if run["ne_basis"] == "eval" else run["rel_train_ne"]) if math.isfinite(r)]
    return max(gaps) if gaps else None


def table(rows: list[dict], n_tasks: int, task_names=("CTR", "CVR")) -> str:
    columns = [("run", "run", "s"), ("step", "at step", "d")]
    for t in range(n_tasks):
        name = task_names[t] if t < len(task_names) else str(t)
        columns += [(f"eval_ne{t}", f"eval NE {name}", ".5f"), (f"rel_eval{t}", "vs base %", "+.3f"),
                    (f"train_ne{t}", f"train NE {name}", ".5f"), (f"rel_train{t}", "vs base %", "+.3f")]
    columns += [("final_loss", "final loss", ".5f"), ("max_loss", "max loss", ".4f"), ("diverged", "diverged", "s"),
                ("step_ms", "step ms", ".2f"), ("x_bf16", "x base", ".3f"), ("compile_s", "compile s", ".1f"),
                ("fp8", "fp8 fwd/dgrad/wgrad", "s"), ("saved_fp8", "saved fp8", "d")]
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
    labels = f", labels CTR {cfg['ctr']:g} CVR {cfg['cvr']:g}" if "ctr" in cfg else ""  # older JSONs lack them
    top.set_title(f"GEM-ref {cfg['size']}: training loss, {precision}, batch {cfg['batch_size']}{labels}, "
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
    parser.add_argument("--size", default=None, choices=["tiny", "small", "medium", "large"],
                        help="GEM-ref size (default small; tiny with --smoke)")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default 300; 6 with --smoke)")
    parser.add_argument("--batch-size", type=int, default=None, help="samples per step (default 256; 16 with --smoke)")
    parser.add_argument("--baseline", choices=["gem", "eager"], default="gem",
                        help="how the baseline trains: gem_compile without the mxfp8 pass (default), or eager "
                             "(no compile: the gem_compile-vs-eager NE check, with --recipes none)")
    parser.add_argument("--recipes", nargs="+", type=_recipe, default=None,
                        help=f"FP8 recipes ({', '.join(RECIPES)}), {NO_FP8} or activation memory settings "
                        f"({MEMORY_RECIPES}) to compare with bf16 (default blockwise mxfp8; emulated ones "
                        "with --smoke)")
    parser.add_argument("--min-dim", type=int, default=1,
                        help="the pass's min_m / min_k / min_n (default 1: every qualifying Linear); 0 = the "
                        "pass's own defaults")
    parser.add_argument("--bf16-weight-grad", nargs="*", default=[], metavar="PATTERN",
                        help="module patterns whose wgrad stays bf16 (Mxfp8Config.bf16_weight_grad)")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                        help="autocast dtype of the forward (default bfloat16; float32 with --smoke)")
    parser.add_argument("--tables", choices=["dense", "sparse-rows"], default="dense",
                        help="how the gem_compile runs train the embedding tables: dense gradients and torch's "
                             "Adagrad, or row gradients and SparseAdagrad (bench e2e's gem); an eager baseline "
                             "is always dense")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--embedding-lr", type=float, default=0.01)
    parser.add_argument("--lr-warmup", type=int, default=0,
                        help="steps of linear learning-rate warm-up before the schedule (default 0)")
    parser.add_argument("--lr-schedule", choices=["constant", "cosine"], default="constant",
                        help="cosine: both learning rates decay to 0 at the last step (runs settle before they "
                        "are compared)")
    parser.add_argument("--fill", type=float, default=0.5)
    # At the data's production-like rates (CTR 2%, CVR 0.5%) a 256-sample batch holds ~5 clicks and ~1
    # conversion: after a few hundred steps GEM-ref small is still at NE ~1.0 and the held-out NE of two
    # bf16 seeds differs by 1-6%, so a 0.1% comparison reads noise. Denser labels let it learn the teacher
    # (whose own NE is ~0.75) within the run, with ~10x the positives in every eval batch.
    parser.add_argument("--ctr", type=float, default=0.2, help="mean click rate of the synthetic labels")
    parser.add_argument("--cvr", type=float, default=0.05, help="mean conversion rate (< --ctr)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--window", type=int, default=None, help="training steps the train NE covers (default 50)")
    parser.add_argument("--eval-batches", type=int, default=None, help="held-out batches for the eval NE (default 20)")
    parser.add_argument("--eval-offset", type=int, default=1_000_000, help="first held-out batch index")
    parser.add_argument("--warmup", type=int, default=5, help="steps after the first left out of the step time")
    parser.add_argument("--eval-every", type=int, default=None,
                        help="measure the held-out NE every this many steps (default 50; the last step always)")
    parser.add_argument("--baseline-repeats", type=int, default=1,
                        help="train the bf16 baseline this many times, repeat i with initialization seed "
                        "seed + i on the same batches: their NE spread is the noise floor a recipe is read against")
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None)
    parser.add_argument("--gpus", type=int, default=1,
                        help="train the runs concurrently, one process per GPU (CUDA_VISIBLE_DEVICES=i); the "
                        "losses are those of sequential runs, the step times share the host's CPUs")
    parser.add_argument("--procs-per-gpu", type=int, default=1,
                        help="with --gpus: this many runs share each GPU (memory permitting); step times are then "
                        "contended and not comparable")
    parser.add_argument("--threads", type=int, default=None,
                        help="intra-op threads per worker (default: the host's cores / the concurrent workers; "
                             "set it when two invocations share one host)")
    parser.add_argument("--deadline-s", type=float, default=None,
                        help="with --gpus: stop the runs still training after this many seconds and compare "
                        "every run at the last held-out checkpoint it shares with bf16")
    parser.add_argument("--only-run", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--part", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--smoke", action="store_true", help="CPU: tiny, a few steps, emulated recipes")
    parser.add_argument("--out", default=None, help="directory of the JSON (and PNG); $OUT wins")
    parser.add_argument("--plot", default=None, metavar="FROM_JSON", help="only render the PNG of a results JSON")
    parser.add_argument("--png", default=None, help="where --plot writes (default docs/mxfp8_quality.png; "
                        "docs/activation_memory_quality.png for a JSON that compares an activation memory "
                        "setting)")
    args = parser.parse_args(argv)
    smoke = args.smoke
    defaults = {"size": "tiny" if smoke else "small", "steps": 6 if smoke else 300,
                "batch_size": 16 if smoke else 256, "dtype": "float32" if smoke else "bfloat16",
                "window": 3 if smoke else 50, "eval_batches": 2 if smoke else 20, "eval_every": 3 if smoke else 50,
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


def _work(run: dict) -> str:
    return f"fp8 GEMMs {run['quantized_gemms']}, saved in FP8 {run['saved_in_fp8']['tensors']} tensors"


def _dump(path: Path, payload: dict) -> None:
    rewrite_results(path, payload)


def _concurrent_workers(plan, args) -> int:
    """How many worker processes run at once: procs_per_gpu on each GPU, no more than the plan has runs."""
    return min(len(plan), args.gpus * max(1, args.procs_per_gpu))


def _run_concurrently(plan, args, argv) -> list[dict]:
    """Each run of the plan in its own process, `args.gpus * args.procs_per_gpu` at a time, run i on GPU
    i % gpus; results in plan order. Every process trains from the same seed on the same batches, so the
    comparison is the sequential one. A worker rewrites its part file at each held-out checkpoint: past
    --deadline-s the workers still training are stopped and keep what their last checkpoint wrote."""
    import subprocess
    import tempfile

    argv = list(sys.argv[1:] if argv is None else argv)
    slots = _concurrent_workers(plan, args)
    # GPU i is the i-th GPU this process may see: two invocations can share a host, one per GPU
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    deadline = time.monotonic() + args.deadline_s if args.deadline_s else None
    results: list[dict | None] = [None] * len(plan)
    with tempfile.TemporaryDirectory() as tmp:
        pending = list(range(len(plan)))
        while pending:
            batch, pending = pending[:slots], pending[slots:]
            procs = []
            for slot, index in enumerate(batch):
                gpu = slot % args.gpus
                part = Path(tmp) / f"run{index}.json"
                env = {**os.environ, "CUDA_VISIBLE_DEVICES": visible[gpu] if gpu < len(visible) else str(gpu)}
                cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--only-run", str(index),
                       "--part", str(part)]
                where = f"GPU {gpu}" if args.device == "cuda" else f"process {slot + 1} (CPU)"
                print(f"run {plan[index][0]} on {where} ...", flush=True)
                procs.append((index, part, subprocess.Popen(cmd, env=env)))
            for index, part, proc in procs:
                try:
                    proc.wait(timeout=max(1.0, deadline - time.monotonic()) if deadline else None)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                    print(f"  {plan[index][0]}: stopped at the deadline ({args.deadline_s:.0f} s)", flush=True)
                if not part.exists():
                    print(f"  {plan[index][0]}: no checkpoint reached (exit {proc.returncode})", flush=True)
                    continue
                r = results[index] = json.loads(part.read_text())
                print(f"  {r['name']} {'done' if r['complete'] else 'cut'}: {len(r['losses'])} steps, "
                      f"step {r['step_ms']:.2f} ms, {_work(r)}", flush=True)
            if deadline and time.monotonic() > deadline:
                break
    return results


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.plot:
        payload = json.loads(Path(args.plot).read_text())
        png = Path(args.png) if args.png else default_png(payload)
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
    if args.baseline == "eager":
        base = f"eager {base}"
    # (name, recipe, initialization seed): repeats of the baseline differ only in their initialization
    plan = [(f"{base} seed {args.seed + i}" if args.baseline_repeats > 1 else base, None, args.seed + i)
            for i in range(args.baseline_repeats)]
    plan += [("gem_compile" if recipe == NO_FP8 else recipe, recipe, args.seed) for recipe in args.recipes]
    runs: list[dict] = []
    started = time.perf_counter()
    path = results_path("mxfp8_quality-smoke" if args.smoke else "mxfp8_quality", args.out)
    payload = {
        "benchmark": "mxfp8_quality",
        "environment": environment(),
        "config": {k: v for k, v in vars(args).items() if k not in ("plot", "png", "out", "only_run", "part")},
        "runs": runs,
    }
    if args.only_run is not None:  # a worker of --gpus: one run; its result and warnings to --part
        name, recipe, init_seed = plan[args.only_run]
        # the host's cores are shared by the concurrent workers: torch's default (one intra-op thread per
        # core in every process) oversubscribes them, and the CPU-side batch generation then ran ~10x
        # slower (1.5 s a step with 4 workers on a 32-core H200 host; 0.04 -> 0.3-0.8 s here)
        torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // _concurrent_workers(plan, args)))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")

            def write_part(run: dict) -> None:
                run["fallback_warnings"] = sorted({str(w.message) for w in caught
                                                   if type(w.message).__name__ == "Fp8FallbackWarning"})
                tmp = Path(args.part).with_suffix(".tmp")
                _dump(tmp, run)
                tmp.replace(args.part)  # never a half-written part file when the parent kills this worker

            write_part(run_one(name, recipe, args, device, init_seed, on_checkpoint=write_part))
        return 0
    if args.gpus > 1 or args.procs_per_gpu > 1:  # (on the CPU: concurrent processes, a check of this path)
        done = _run_concurrently(plan, args, argv)
        missing = [plan[i][0] for i, r in enumerate(done) if r is None]
        runs.extend(r for r in done if r is not None)
        fallbacks = sorted({m for r in runs for m in r.pop("fallback_warnings", [])})
    else:
        missing = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for name, recipe, init_seed in plan:
                print(f"run {name} ...", flush=True)
                runs.append(run_one(name, recipe, args, device, init_seed))
                print(f"  done: {len(runs[-1]['losses'])} steps, step {runs[-1]['step_ms']:.2f} ms, "
                      f"{_work(runs[-1])}, {time.perf_counter() - started:.0f} s so far",
                      flush=True)
                _dump(path, payload)  # what is done so far survives a run cut short by a time limit
        fallbacks = sorted({str(w.message) for w in caught if type(w.message).__name__ == "Fp8FallbackWarning"})
    payload["missing_runs"] = missing
    if not runs or runs[0]["recipe"] is not None or not runs[0]["checkpoints"]:
        _dump(path, payload)
        print(f"the {base} baseline reached no checkpoint: nothing to compare (wrote {path})", file=sys.stderr)
        return 1
    rows = summarize(runs, args.window)
    n_tasks = len(runs[0]["checkpoints"][-1]["train_ne"])
    text = table(rows, n_tasks)
    print()
    print(text)
    floor = noise_floor(runs)
    fp8_runs = [r for r in runs if not _is_baseline(r)]
    verdict = {r["name"]: judge(r, floor) for r in fp8_runs}
    print(f"\nverdict (NE within {100 * NE_TOLERANCE:.1f}% of {base} on every task, no divergence): {verdict}")
    if floor is not None:
        print(f"noise floor ({base} runs that differ only in initialization seed): {100 * floor:.3f}% relative NE")
    if missing:
        print(f"runs with no checkpoint (not compared): {missing}")
    for message in fallbacks:
        print(f"note: {message}")
    for name, judged in verdict.items():
        if judged["inert"]:
            print(f"WARNING: {name} proves nothing: {judged['inert']}")
    payload.update(table=text, verdict=verdict, verdict_rules=VERDICT_RULES, noise_floor=floor,
                   fallback_warnings=fallbacks, wall_s=time.perf_counter() - started)
    _dump(path, payload)
    print(f"wrote {path}")
    png = path.with_suffix(".png")
    if plot(payload, png):
        print(f"wrote {png}")
    else:
        print(f"matplotlib not installed: render the loss curves later with --plot {path}")
    if args.smoke:
        bad = [r["name"] for r in runs if any(not math.isfinite(v) for v in r["losses"])]
        idle = [r["name"] for r in fp8_runs if inert(r)]
        if bad or idle:
            print(f"smoke FAILED: non-finite {bad}, proving nothing {idle}")
            return 1
        print("smoke ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
