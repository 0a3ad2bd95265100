"""Activation memory (issue 26): what GemConfig.memory buys on GEM-ref, side by side in one process.

    python benchmarks/activation_memory.py --out $OUT              # one H200: medium, B 256, fill 0.5
    python benchmarks/activation_memory.py --size tiny --batch-size 4 --device cpu --steps 2 \
        --time-budget-s 3600 --out /tmp/am                         # CPU smoke run (no timing claims)
    python benchmarks/activation_memory.py --parts largest --largest-methods gem,gem-memory-budget-0.5 \
        --out $OUT                                                 # part 2 alone, in its own command
    python benchmarks/activation_memory.py --parts curve --methods gem,gem-memory-budget-0.3+fp8-saved \
        --memory-snapshot --out $OUT                               # what is alive at each method's peak

Part 1, the curve: GEM-ref (``--size``) at ``--batch-size`` and ``--fill`` trained by each method the way
``gemcompile bench e2e`` trains it (runtime/training/e2e_bench.py ``run_method``: a fresh model, the same
seed and batches, ``--warmup`` steps then ``--steps`` measured ones): ``gem`` (gem_compile, default
GemConfig), ``gem-memory-budget-<b>`` for each of ``--budgets`` (the partitioner under that activation
memory budget), ``gem+fp8-saved`` (MemoryConfig.fp8_saved: the input of each qualifying Linear held for its
weight gradient in FP8), ``gem-memory-budget-<b>+fp8-saved`` for each of ``--fp8-budgets``, and the peer
``inductor`` (torch.compile), in that order (gem first: every ratio is against it; the peer last: its
peak at this setting is on record already, and under the time budget it is the one to lose; ``--methods``
replaces the list). The FP8 methods are skipped, with the reason, on a GPU below compute capability 8.9
(fp8_saved's float8_e4m3fn casts; no scaled GEMM); ``partitioner_slot`` records whether this torch's Inductor
takes gemcompile's partitioner (without it gem_compile applies the budget alone and ignores fp8_saved).
Per method: peak memory (CUDA ``max_memory_allocated`` over the warm-up and measured steps), median step
ms, their ratios to gem's, the first loss (the same batch and weights for every method: a recompute or an
FP8 copy changes it by rounding only), MFU, compile time and the method's wall time. With
``--memory-snapshot`` (CUDA), each curve method runs one more step under torch's CUDA memory history after
its measured ones (e2e's ``memory_snapshot``, runtime/training/memory_snapshot.py): the row's
``memory_snapshot`` holds that step's peak, what was alive before it (weights, optimizer state) and the
blocks alive at the peak grouped by their allocation's top user-level frame (an Inductor kernel buffer's
wrapper line, a gemcompile line); the largest groups are printed after the table.

Part 2, the largest batch: for each of ``--largest-methods`` (``gem`` and ``best``, the memory setting of
the curve with the lowest peak among those at most ``--best-max-step-ratio`` times gem's step time, else
the lowest peak of all), the largest batch that trains without a CUDA out-of-memory error: doubling from
``--batch-size`` (known to fit when the curve trained the method there), then bisecting between the last
batch that fit and the first that did not, down to ``--batch-granularity`` or ``--resolution`` x the batch
that fits, capped at ``--max-batch``. One try = ``run_method`` at that batch (``--warmup`` +
``--largest-steps`` steps: a fresh model, compiled anew with static shapes after ``torch._dynamo.reset()``,
as ``gemcompile bench e2e --batch-size B`` would); a torch.cuda.OutOfMemoryError anywhere in it (or an
error whose chain says out of memory) means "does not fit"; any other error stops that method's search.
Memory is freed between tries (gc, ``torch.cuda.empty_cache``, ``torch._dynamo.reset``). Recorded: every
try, the bracket (largest batch that fit, smallest that did not), why the search stopped, and step ms, MFU
and peak memory at the largest batch that fit; ``linear_estimate`` extrapolates the measured peaks to the
device's memory (an estimate, not a measurement). Skipped on the CPU (no out-of-memory to find), with the
reason recorded.

Time: compiling dominates (each method and each try compiles GEM-ref anew). ``--time-budget-s`` bounds the
run: a curve method starts only before ``time budget - --largest-budget-s`` and a try only before the time
budget (each method of part 2 gets an equal share of what is left), so a run ends at most one method or try
(a compile and a few steps) after it; whatever was not started is recorded as skipped, with the reason.
The JSON (benchmarks/harness.py's one writer) is rewritten after every method and every try: a run cut by a
time limit keeps what it measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE.parent))  # the repository root: gemcompile
sys.path.insert(0, str(_HERE))

from harness import environment, format_table, results_path, rewrite_results  # noqa: E402

from gemcompile.config import GemConfig  # noqa: E402
from gemcompile.passes.activation_memory import has_partitioner_slot  # noqa: E402
from gemcompile.runtime.training import e2e_bench  # noqa: E402
from gemcompile.runtime.training.config import SIZES  # noqa: E402
from gemcompile.runtime.training.e2e_bench import E2EBenchConfig, memory_variant, split_method  # noqa: E402
from gemcompile.runtime.training.memory_snapshot import snapshot_lines  # noqa: E402

REFERENCE = "gem"
PARTS = ("curve", "largest")
FP8_CAPABILITY = (8, 9)
"""The float8_e4m3fn casts fp8_saved emits need a GPU that converts to FP8 (Ada / Hopper and later)."""


# -- arguments ---------------------------------------------------------------------------------------------


def _fractions(text: str, flag: str) -> tuple[float, ...]:
    values = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        try:
            value = float(item)
        except ValueError:
            raise ValueError(f"{flag}: {item!r} is not a number (a comma list of fractions in (0, 1])"
                             ) from None
        if not 0.0 < value <= 1.0:
            raise ValueError(f"{flag}: {item} is outside (0, 1] (1.0 = the partitioner's default; lower "
                             "saves less and recomputes more)")
        values.append(value)
    return tuple(values)


def curve_methods(budgets: tuple[float, ...], fp8_budgets: tuple[float, ...], fp8: bool = True,
                  peers: tuple[str, ...] = ("inductor",)) -> list[str]:
    """gem, each budget, gem+fp8-saved, each budget with fp8_saved, the peers; no name twice."""
    names = [REFERENCE, *(memory_variant(b) for b in budgets)]
    if fp8:
        names += [memory_variant(None, fp8_saved=True),
                  *(memory_variant(b, fp8_saved=True) for b in fp8_budgets)]
    return list(dict.fromkeys([*names, *peers]))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="medium", choices=SIZES, help="GEM-ref size")
    p.add_argument("--batch-size", type=int, default=256, help="the curve's batch, where the search starts")
    p.add_argument("--fill", type=float, default=0.5, help="mean sequence length / padded length")
    p.add_argument("--steps", type=int, default=8, help="measured steps per curve method")
    p.add_argument("--warmup", type=int, default=2, help="steps before the measured ones (>= 2)")
    p.add_argument("--budgets", default="0.8,0.5,0.3,0.1",
                   help="activation memory budgets, fractions in (0, 1]")
    p.add_argument("--fp8-budgets", default="0.5", help="budgets also run with fp8_saved ('' for none)")
    p.add_argument("--no-fp8", action="store_true", help="leave out gem+fp8-saved and the --fp8-budgets")
    p.add_argument("--methods", default=None,
                   help="the curve's methods instead of the list built from --budgets (must include gem); "
                        "any `gemcompile bench e2e` method")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--kernel-steps", type=int, default=0,
                   help="steps under torch.profiler per curve method (e2e's kernel time; CUDA)")
    p.add_argument("--memory-snapshot", action="store_true",
                   help="per curve method one more step under torch's CUDA memory history (outside the timing): "
                        "the peak and the live blocks there grouped by allocating frame, in the row's "
                        "memory_snapshot (e2e's E2EBenchConfig.memory_snapshot; CUDA)")
    p.add_argument("--parts", default=",".join(PARTS), help="comma list of curve, largest")
    p.add_argument("--largest-methods", default="gem,best",
                   help="methods whose largest batch is searched; 'best' = the best memory setting of the "
                        "curve run in the same process (--parts largest alone: name the methods)")
    p.add_argument("--best-max-step-ratio", type=float, default=1.10,
                   help="'best' is the lowest peak among the memory settings at most this x gem's step time")
    p.add_argument("--max-batch", type=int, default=8192, help="the search's cap")
    p.add_argument("--batch-granularity", type=int, default=64, help="bisection stops at this many samples")
    p.add_argument("--resolution", type=float, default=0.25,
                   help="... or at this fraction of the batch that fits, whichever is larger")
    p.add_argument("--largest-steps", type=int, default=3, help="measured steps per try (after --warmup)")
    p.add_argument("--together", action="store_true",
                   help="per method one dynamic-batch program: its curve row, then (for --largest-methods, "
                        "named; no 'best') its largest-batch search in the same program")
    p.add_argument("--largest-compile", default="static", choices=["dynamic", "static"],
                   help="static: a fresh static compile per try (as `gemcompile bench e2e --batch-size B`); "
                        "dynamic: one compile per method with the batch dim marked dynamic, every try in it (on "
                        "the H200 at 0a1d77c its first new batch still compiled once, and it peaked higher)")
    p.add_argument("--largest-budget-s", type=float, default=160.0,
                   help="seconds of --time-budget-s kept for the largest-batch part")
    p.add_argument("--time-budget-s", type=float, default=400.0,
                   help="no method or try starts after this many seconds (one may run past it)")
    p.add_argument("--out", default=None, help="directory of the results JSON ($OUT wins)")
    args = p.parse_args(argv)
    try:
        _check(args)
    except ValueError as e:
        p.error(str(e))
    return args


def _check(args: argparse.Namespace) -> None:
    """Refuse bad arguments before anything compiles (clear messages; parse_args reports them)."""
    for name, least in (("batch_size", 1), ("steps", 1), ("warmup", 2), ("kernel_steps", 0), ("max_batch", 1),
                        ("batch_granularity", 1), ("largest_steps", 1)):
        if getattr(args, name) < least:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)}: need >= {least}")
    if not 0.0 < args.fill <= 1.0:
        raise ValueError(f"--fill {args.fill}: need a fraction in (0, 1]")
    for name in ("resolution", "largest_budget_s", "time_budget_s", "best_max_step_ratio"):
        value = getattr(args, name)
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"--{name.replace('_', '-')} {value}: need a finite number >= 0")
    if args.max_batch < args.batch_size:
        raise ValueError(f"--max-batch {args.max_batch} is below --batch-size {args.batch_size}")
    args.parts = tuple(dict.fromkeys(t.strip() for t in args.parts.split(",") if t.strip()))
    if not args.parts or set(args.parts) - set(PARTS):
        raise ValueError(f"--parts {','.join(args.parts)!r}: need a comma list of {', '.join(PARTS)}")
    args.budgets = _fractions(args.budgets, "--budgets")
    args.fp8_budgets = _fractions(args.fp8_budgets, "--fp8-budgets")
    if args.methods is not None:
        args.methods = list(dict.fromkeys(m.strip() for m in args.methods.split(",") if m.strip()))
        if REFERENCE not in args.methods:
            raise ValueError(f"--methods {','.join(args.methods)}: need {REFERENCE} (every ratio is against "
                             "it)")
    else:
        args.methods = curve_methods(args.budgets, args.fp8_budgets, fp8=not args.no_fp8)
    args.largest_methods = list(dict.fromkeys(m.strip() for m in args.largest_methods.split(",")
                                              if m.strip()))
    unknown = e2e_bench.unknown_methods([*args.methods, *(m for m in args.largest_methods if m != "best")])
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; known: {e2e_bench.methods_help()}")
    if "largest" in args.parts and not args.largest_methods:
        raise ValueError("--largest-methods is empty")
    if args.together:
        if set(args.parts) != set(PARTS):
            raise ValueError("--together runs both parts: leave --parts at its default")
        args.largest_compile = "dynamic"  # both parts in one dynamic-batch program per method
        if "best" in args.largest_methods:
            raise ValueError("--together searches each method right after its curve row, before 'best' is "
                             "known: name the methods in --largest-methods")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device here (--device cpu runs the smoke path)")
    _e2e_config(args, args.batch_size, args.steps, args.methods)  # E2EBenchConfig's own checks


def _e2e_config(args: argparse.Namespace, batch_size: int, steps: int, methods, kernel_steps: int = 0,
                memory_snapshot: bool = False) -> E2EBenchConfig:
    """The e2e config of one curve row (``memory_snapshot``: --memory-snapshot, curve rows only) or one try."""
    return E2EBenchConfig(size=args.size, batch_size=batch_size, fill=args.fill, steps=steps,
                          warmup=args.warmup, methods=tuple(methods), device=args.device, dtype=args.dtype,
                          ne_window=steps, kernel_steps=kernel_steps, memory_snapshot=memory_snapshot)


# -- running one method at one batch -------------------------------------------------------------------------


def is_oom(exc: BaseException | None) -> bool:
    """Whether an error, or one in its chain (Inductor wraps what a compile raised), is a CUDA
    out-of-memory."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        text = str(exc)
        if isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in text.lower() \
                or "CUBLAS_STATUS_ALLOC_FAILED" in text:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def free_memory(device: torch.device) -> None:
    """Free what a finished or failed method held: Python's cycles, Dynamo's compiled code, the allocator's
    cache."""
    gc.collect()
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _failure(method: str, batch: int, e: BaseException, log) -> dict[str, Any]:
    oom = is_oom(e)
    result = {"method": method, "outcome": "oom" if oom else "error", "error": f"{type(e).__name__}: {str(e)[:400]}"}
    log(f"  {method} at B {batch}: {'out of memory' if oom else 'failed'}: {result['error'][:200]}")
    return result


def run_one(cfg: E2EBenchConfig, method: str, log=print) -> dict[str, Any]:
    """e2e_bench.run_method in a clean process state; an error (an OOM included) is recorded, and the memory
    the failed run held is freed before returning (the traceback holding it is gone by then)."""
    device = torch.device(cfg.device)
    free_memory(device)
    t0 = time.perf_counter()
    try:
        result = e2e_bench.run_method(cfg, method, log)
        result["outcome"] = "fits"
    except Exception as e:  # noqa: BLE001 - recorded: one method that cannot run keeps the others' rows
        result = _failure(method, cfg.batch_size, e, log)
    free_memory(device)
    result["batch_size"] = cfg.batch_size
    result["wall_s"] = time.perf_counter() - t0
    return result


# -- part 1: the curve ---------------------------------------------------------------------------------------


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def curve_rows(results: list[dict]) -> list[dict]:
    """One compact row per method: peak memory, median step, their ratios to gem's, the first loss."""
    ref = next((r for r in results if r["method"] == REFERENCE and r.get("outcome") == "fits"), {})
    rows = []
    for r in results:
        row = {"method": r["method"], "outcome": r.get("outcome"),
               "peak_memory_gib": r.get("peak_memory_gib"),
               "peak_memory_steady_gib": r.get("peak_memory_steady_gib"), "step_ms_median": r.get("step_ms_median"),
               "first_loss": (r.get("losses") or [None])[0], "mfu": r.get("mfu"),
               "compile_s": r.get("compile_s"), "wall_s": r.get("wall_s"), "diverged": r.get("diverged")}
        row["peak_memory_ratio_vs_gem"] = _ratio(row["peak_memory_gib"], ref.get("peak_memory_gib"))
        row["steady_peak_ratio_vs_gem"] = _ratio(row["peak_memory_steady_gib"], ref.get("peak_memory_steady_gib"))
        row["step_time_ratio_vs_gem"] = _ratio(row["step_ms_median"], ref.get("step_ms_median"))
        row["memory_saving_vs_gem"] = (None if row["peak_memory_ratio_vs_gem"] is None
                                       else 1.0 - row["peak_memory_ratio_vs_gem"])
        ref_loss = (ref.get("losses") or [None])[0]
        row["first_loss_rel_diff_vs_gem"] = (abs(row["first_loss"] - ref_loss) / abs(ref_loss)
                                             if row["first_loss"] is not None and ref_loss else None)
        row["note"] = r.get("skipped") or r.get("error") or ""
        rows.append(row)
    return rows


def is_memory_setting(method: str) -> bool:
    """A gem method whose GemConfig.memory is not the default's."""
    base = split_method(method)[0]
    try:
        config = e2e_bench._gem_config(base)
    except ValueError:  # not a gem method (eager, inductor)
        return False
    return config.memory != GemConfig().memory


def pick_best(rows: list[dict], max_step_ratio: float) -> tuple[str | None, str]:
    """The memory setting whose largest batch is searched as 'best', and why it was chosen."""
    measured = [r for r in rows if r.get("outcome") == "fits" and is_memory_setting(r["method"])
                and r.get("peak_memory_gib") is not None]
    if not measured:
        return None, "no memory setting of the curve has a measured peak memory"
    within = [r for r in measured if r.get("step_time_ratio_vs_gem") is not None
              and r["step_time_ratio_vs_gem"] <= max_step_ratio]
    best = min(within or measured, key=lambda r: r["peak_memory_gib"])
    if within:
        return best["method"], (f"the lowest peak memory among the memory settings at most "
                                f"{max_step_ratio:g}x gem's median step time")
    return best["method"], (f"no memory setting within {max_step_ratio:g}x gem's median step time: the "
                            "lowest peak memory of all")


# -- part 2: the largest batch -------------------------------------------------------------------------------


class _Stop(Exception):
    pass


def find_largest_batch(attempt: Callable[[int], str], start: int, cap: int, *, granularity: int = 64,
                       resolution: float = 0.25, start_fits: bool = False,
                       may_start: Callable[[], str | None] = lambda: None) -> dict[str, Any]:
    """The largest batch for which ``attempt(batch)`` returns "fits", by doubling from ``start`` (known to fit
    when ``start_fits``) up to ``cap``, then bisecting between the largest batch that fit and the smallest
    that did not ("oom") until they are at most max(granularity, resolution x the fit) apart, trying
    multiples of granularity. Any other outcome of attempt stops the search, as does a reason from
    ``may_start()`` (asked before each try). Returns the bracket, the tries and why it stopped."""
    lo: int | None = start if start_fits else None
    hi: int | None = None
    tries: list[dict] = []

    def run(batch: int) -> str:
        if (reason := may_start()) is not None:
            raise _Stop(reason)
        outcome = attempt(batch)
        tries.append({"batch": batch, "outcome": outcome})
        if outcome not in ("fits", "oom"):
            raise _Stop(f"{outcome} at batch {batch}")
        return outcome

    try:
        if lo is None:
            if run(start) == "fits":
                lo = start
            else:
                lo, hi = 0, start  # nothing known to fit: bisect below the start
        while hi is None:  # doubling
            if lo >= cap:
                raise _Stop(f"reached --max-batch {cap}")
            batch = min(2 * lo, cap)
            if run(batch) == "fits":
                lo = batch
            else:
                hi = batch
        while hi - lo > max(granularity, resolution * lo):  # bisection
            mid = (lo + (hi - lo) // 2) // granularity * granularity
            if mid <= lo:
                mid = lo + granularity
            if mid >= hi:
                break
            if run(mid) == "fits":
                lo = mid
            else:
                hi = mid
        stopped = "bracketed" if lo else f"nothing fits down to {hi}"
    except _Stop as e:
        stopped = str(e)
    return {"largest_fit": lo or None, "smallest_oom": hi, "stopped": stopped, "tries": tries}


def linear_estimate(points: list[tuple[int, float]], capacity_gib: float | None) -> dict | None:
    """Peak memory = a + b x batch fitted to the measured (batch, peak GiB) points, and the batch where it
    reaches the device's memory: an extrapolation, recorded beside the measured bracket."""
    points = sorted(dict(points).items())
    if len(points) < 2 or not capacity_gib:
        return None
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    if slope <= 0:
        return None
    intercept = my - slope * mx
    return {"gib_per_sample": slope, "fixed_gib": intercept, "device_gib": capacity_gib,
            "batch_at_device_memory": int((capacity_gib - intercept) / slope), "points": points}


class DynamicBatchTries:
    """The tries of one method's search in one compiled program: GEM-ref compiled once with its batch dim
    dynamic (e2e_bench.start_method(dynamic_batch=True)), then trained at each tried batch by the same
    model and optimizers. A static compile per batch costs a whole compile per try (~100 s for medium on
    the H200); this one compiles once, and a batch that does not fit leaves the program usable."""

    def __init__(self, args, method: str, log=print) -> None:
        self.args, self.method, self.log = args, method, log
        self.run = None

    def __call__(self, batch: int, steps: int | None = None, memory_snapshot: bool = False) -> dict[str, Any]:
        cfg = _e2e_config(self.args, batch, steps or self.args.largest_steps, (self.method,),
                          memory_snapshot=memory_snapshot)
        t0 = time.perf_counter()
        try:
            if self.run is None:
                self.run = e2e_bench.start_method(cfg, self.method, dynamic_batch=True)
            result = e2e_bench.measure(self.run.at_batch(cfg))
            result["outcome"] = "fits"
        except Exception as e:  # noqa: BLE001 - an OOM is an answer; anything else stops the search
            result = _failure(self.method, batch, e, self.log)
        gc.collect()  # the failed step's tensors (its traceback is gone by now)
        if torch.device(self.args.device).type == "cuda":
            torch.cuda.empty_cache()
        result.update(batch_size=batch, wall_s=time.perf_counter() - t0, compile="dynamic batch")
        return result

    def close(self) -> None:
        self.run = None
        free_memory(torch.device(self.args.device))


def search_method(args, method: str, curve: dict[str, dict], deadline: float, clock, log=print,
                  on_try: Callable[[dict], None] = lambda r: None,
                  tries: DynamicBatchTries | None = None) -> dict[str, Any]:
    """The largest-batch search of one method (find_largest_batch over run_one, or over DynamicBatchTries
    with ``--largest-compile dynamic``), with every try's result. ``tries``: the dynamic program the
    curve's row of this method was measured in (``--together``), searched on and left open."""
    given = tries is not None
    owned = not given and args.largest_compile == "dynamic"
    if owned:
        tries = DynamicBatchTries(args, method, log)
    known = curve.get(method)
    # the curve's row describes the searched program when both are static compiles at that batch, or when
    # the search runs in the program the row was measured in; else the search measures its start itself
    same_program = given or args.largest_compile == "static"
    start_fits = (same_program and known is not None and known.get("outcome") == "fits"
                  and known.get("batch_size") == args.batch_size)
    results: dict[int, dict] = {args.batch_size: known} if start_fits else {}

    def attempt(batch: int) -> str:
        log(f"-- {method} at batch {batch}")
        if tries is not None:
            result = tries(batch)
        else:
            result = run_one(_e2e_config(args, batch, args.largest_steps, (method,)), method, log)
        results[batch] = result
        on_try(result)
        return result["outcome"] if result["outcome"] != "error" else f"error ({result['error'][:120]})"

    def may_start() -> str | None:
        if clock() >= deadline:
            return f"time budget: this method's share ran out at {clock():.0f} s"
        return None

    try:
        found = find_largest_batch(attempt, args.batch_size, args.max_batch,
                                   granularity=args.batch_granularity, resolution=args.resolution,
                                   start_fits=start_fits, may_start=may_start)
    finally:
        if owned:
            tries.close()
    best = results.get(found["largest_fit"]) if found["largest_fit"] else None
    at_largest = None
    if best is not None:  # the numbers of the largest batch that fit, from its try (or the curve's row)
        at_largest = {k: best.get(k) for k in ("step_ms_median", "samples_per_s", "mfu", "useful_tflops",
                                               "peak_memory_gib")}
        at_largest.update(first_loss=(best.get("losses") or [None])[0],
                          source="curve" if best is known else "try")
    points = [(b, r["peak_memory_gib"]) for b, r in results.items()
              if r.get("outcome") == "fits" and r.get("peak_memory_gib") is not None]
    capacity = torch.cuda.get_device_properties(0).total_memory / 2**30 if args.device == "cuda" else None
    return {"method": method, "start": args.batch_size, "start_known_from_curve": start_fits,
            "compile": args.largest_compile, **found,
            "at_largest": at_largest, "linear_estimate": linear_estimate(points, capacity),
            "try_results": [r for b, r in results.items() if r is not known]}


def largest_part(args, curve_results: list[dict], rows: list[dict], clock, deadline: float, payload: dict,
                 save: Callable[[], None], log=print) -> None:
    part = payload["largest_batch"]
    if args.device != "cuda":
        part["skipped"] = ("--device cpu: no CUDA out-of-memory to find (the largest-batch search needs "
                           "--device cuda)")
        return
    methods = []
    for name in args.largest_methods:
        if name == "best":
            best, why = pick_best(rows, args.best_max_step_ratio)
            part["best"] = {"method": best, "rule": why}
            if best is None:
                part.setdefault("not_searched", []).append({"method": "best", "reason": why})
                continue
            name = best
        methods.append(name)
    methods = list(dict.fromkeys(methods))
    curve = {r["method"]: r for r in curve_results}
    part["methods"] = []
    for i, method in enumerate(methods):
        share = clock() + (deadline - clock()) / (len(methods) - i)
        record = {"method": method, "searching": True, "try_results": []}
        part["methods"].append(record)

        def on_try(result: dict, record=record) -> None:  # after every try: a cut run keeps it
            record["try_results"].append(result)
            save()

        found = search_method(args, method, curve, share, clock, log, on_try)
        record.clear()
        record.update(found)
        gem = next((m for m in part["methods"] if m["method"] == REFERENCE), None)
        if gem is not None and gem.get("largest_fit") and record.get("largest_fit"):
            record["largest_fit_ratio_vs_gem"] = record["largest_fit"] / gem["largest_fit"]
        save()


def together_part(args, payload: dict, save: Callable[[], None], clock, log=print) -> list[dict]:
    """``--together``: per method, one program compiled with a dynamic batch (DynamicBatchTries) gives its
    curve row at ``--batch-size`` and then, for the ``--largest-methods``, its largest-batch search; one
    compile per method instead of one per method plus one per try. Returns the curve's results."""
    part = payload["largest_batch"]
    part["methods"], results = [], []
    searched = [m for m in args.methods if m in args.largest_methods]
    search_share = args.largest_budget_s / max(1, len(searched))
    fp8_ok = args.device != "cuda" or torch.cuda.get_device_capability() >= FP8_CAPABILITY
    for method in args.methods:
        skipped = None
        if results and clock() >= args.time_budget_s:
            skipped = f"time budget: --time-budget-s {args.time_budget_s:.0f} s ran out at {clock():.0f} s"
        elif not fp8_ok and "fp8-saved" in method:
            skipped = f"FP8 casts need compute capability >= {FP8_CAPABILITY}"
        if skipped:
            results.append({"method": method, "outcome": "skipped", "skipped": skipped})
        else:
            log(f"-- {method} (B {args.batch_size}, one dynamic-batch program, {clock():.0f} s in)")
            tries = DynamicBatchTries(args, method, log)
            try:
                results.append(tries(args.batch_size, steps=args.steps, memory_snapshot=args.memory_snapshot))
                payload["curve"]["results"], payload["curve"]["rows"] = results, curve_rows(results)
                save()
                if method in searched and args.device == "cuda" and results[-1]["outcome"] == "fits":
                    record = {"method": method, "searching": True, "try_results": []}
                    part["methods"].append(record)

                    def on_try(result: dict, record=record) -> None:
                        record["try_results"].append(result)
                        save()

                    found = search_method(args, method, {method: results[-1]}, clock() + search_share, clock,
                                          log, on_try, tries=tries)
                    record.clear()
                    record.update(found)
                    gem = next((m for m in part["methods"] if m["method"] == REFERENCE), None)
                    if gem is not None and gem.get("largest_fit") and record.get("largest_fit"):
                        record["largest_fit_ratio_vs_gem"] = record["largest_fit"] / gem["largest_fit"]
            finally:
                tries.close()
        payload["curve"]["results"], payload["curve"]["rows"] = results, curve_rows(results)
        save()
    if args.device != "cuda":
        part["skipped"] = ("--device cpu: no CUDA out-of-memory to find (the largest-batch search needs "
                           "--device cuda)")
    return results


# -- the run -------------------------------------------------------------------------------------------------


_CURVE_COLUMNS = [("method", "method", "s"), ("peak_memory_gib", "peak GiB", ".2f"),
                  ("peak_memory_ratio_vs_gem", "x gem mem", ".3f"),
                  ("peak_memory_steady_gib", "steady GiB", ".2f"), ("steady_peak_ratio_vs_gem", "x gem steady", ".3f"),
                  ("step_ms_median", "step ms", ".2f"),
                  ("step_time_ratio_vs_gem", "x gem time", ".3f"), ("first_loss", "first loss", ".6f"),
                  ("mfu", "MFU", ".3f"), ("compile_s", "compile s", ".1f"), ("note", "note", ".60s")]
_LARGEST_COLUMNS = [("method", "method", "s"), ("largest_fit", "largest fit", "d"),
                    ("smallest_oom", "smallest OOM", "d"), ("tries", "tries", "d"),
                    ("step_ms", "step ms", ".2f"), ("mfu", "MFU", ".3f"), ("peak_gib", "peak GiB", ".2f"),
                    ("stopped", "stopped", ".50s")]


def print_snapshots(results: list[dict], top: int = 8, log=print) -> None:
    """--memory-snapshot: per curve method, its peak and the largest groups of blocks alive there."""
    for r in results:
        if r.get("memory_snapshot"):
            log(f"-- {r['method']}")
            for line in snapshot_lines(r["memory_snapshot"], top=top):
                log(f"  {line}")
    sys.stdout.flush()


def largest_rows(part: dict) -> list[dict]:
    rows = []
    for m in part.get("methods", []):
        at = m.get("at_largest") or {}
        rows.append({"method": m["method"], "largest_fit": m.get("largest_fit"),
                     "smallest_oom": m.get("smallest_oom"), "tries": len(m.get("tries", [])),
                     "step_ms": at.get("step_ms_median"), "mfu": at.get("mfu"),
                     "peak_gib": at.get("peak_memory_gib"), "stopped": m.get("stopped")})
    return rows


def separate_parts(args, curve_cfg: E2EBenchConfig, payload: dict, save: Callable[[], None], elapsed,
                   ) -> None:
    """The curve (a fresh static compile per method), then the largest-batch search (its own programs)."""
    device = torch.device(args.device)
    results: list[dict] = []
    if "curve" in args.parts:
        largest_reserve = args.largest_budget_s if "largest" in args.parts and device.type == "cuda" else 0.0
        curve_deadline = args.time_budget_s - largest_reserve
        fp8_ok = device.type != "cuda" or torch.cuda.get_device_capability() >= FP8_CAPABILITY
        for method in args.methods:
            skipped = None
            if results and elapsed() >= curve_deadline:
                skipped = (f"time budget: the curve's {curve_deadline:.0f} s (--time-budget-s minus "
                           f"--largest-budget-s) ran out at {elapsed():.0f} s")
            elif not fp8_ok and "fp8-saved" in method:
                skipped = f"FP8 casts need compute capability >= {FP8_CAPABILITY}"
            if skipped:
                results.append({"method": method, "outcome": "skipped", "skipped": skipped})
            else:
                print(f"-- {method} (B {args.batch_size}, {elapsed():.0f} s in)", flush=True)
                results.append(run_one(curve_cfg, method))
            payload["curve"]["results"] = results
            payload["curve"]["rows"] = curve_rows(results)
            save()
        print(format_table(payload["curve"]["rows"], _CURVE_COLUMNS), flush=True)
        print_snapshots(results)
    else:
        payload["curve"]["skipped"] = "--parts without curve"
    if "largest" in args.parts:
        largest_part(args, results, payload["curve"]["rows"], elapsed, args.time_budget_s, payload, save)
        if "skipped" in payload["largest_batch"]:
            print("largest batch:", payload["largest_batch"]["skipped"], flush=True)
        else:
            print(format_table(largest_rows(payload["largest_batch"]), _LARGEST_COLUMNS), flush=True)
    else:
        payload["largest_batch"]["skipped"] = "--parts without largest"


def main(argv: list[str] | None = None, clock: Callable[[], float] = time.monotonic) -> dict[str, Any]:
    args = parse_args(argv)
    t0 = clock()
    elapsed = lambda: clock() - t0  # noqa: E731
    device = torch.device(args.device)
    path = results_path(f"activation_memory-{args.size}-b{args.batch_size}", args.out)
    curve_cfg = _e2e_config(args, args.batch_size, args.steps, args.methods, args.kernel_steps,
                            memory_snapshot=args.memory_snapshot)
    payload: dict[str, Any] = {
        "benchmark": "activation_memory", "environment": environment(),
        "args": {k: list(v) if isinstance(v, tuple) else v for k, v in vars(args).items()},
        "device_memory_gib": (torch.cuda.get_device_properties(0).total_memory / 2**30
                              if device.type == "cuda" else None),
        # without Inductor's custom_partitioner_fn, gem_compile applies the budget alone (fp8_saved is ignored
        # with a warning): the memory methods' rows mean something else then
        "partitioner_slot": has_partitioner_slot(),
        "conventions": {
            "peak_memory_gib": "torch.cuda.max_memory_allocated (weights, optimizer state, activations, "
                               "workspaces) over a method's warm-up and measured steps, compilation included; "
                               "reset once the model is on the device",
            "ratios_vs_gem": "method / gem (default GemConfig), same process, same batches: memory below 1 "
                             "saves, time above 1 costs",
            "first_loss": "loss of the first step: same weights and batch for every method",
            "largest_fit": "the largest batch that trained warm-up + largest-steps steps without a CUDA OOM; "
                           "smallest_oom the smallest that did not; per method 'compile' says how: 'dynamic' "
                           "(one program compiled with a dynamic batch dim, every try in it, the same model "
                           "and optimizer state) or 'static' (compiled anew per batch)",
            "peak_memory_steady_gib": "torch.cuda.max_memory_allocated over the measured steps alone (the "
                                      "compile's and the warm-up's transients left out)",
            "memory_snapshot": "--memory-snapshot: one more step per curve method under torch's CUDA memory "
                               "history, after the measured steps; its peak (replayed from the allocator's "
                               "trace), what was alive before it, and the blocks alive at the peak grouped by "
                               "their allocation's top user-level frame (runtime/training/memory_snapshot.py)",
            "linear_estimate": "peaks fitted linearly in the batch and extrapolated to the device's memory: "
                               "not measured",
        },
        "curve": {"config": dataclasses.asdict(curve_cfg), "rows": [], "results": []},
        "largest_batch": {},
    }

    def save() -> None:
        rewrite_results(path, payload)

    if args.together:
        together_part(args, payload, save, elapsed)
        print(format_table(payload["curve"]["rows"], _CURVE_COLUMNS), flush=True)
        print_snapshots(payload["curve"]["results"])
        if "skipped" not in payload["largest_batch"]:
            print(format_table(largest_rows(payload["largest_batch"]), _LARGEST_COLUMNS), flush=True)
    else:
        separate_parts(args, curve_cfg, payload, save, elapsed)
    payload["wall_s"] = elapsed()
    save()
    print(f"wrote {path} ({payload['wall_s']:.0f} s)", flush=True)
    return payload


if __name__ == "__main__":
    main()
