"""Every measured number in README.md and benchmarks/README.md, rendered from the committed results files.

    python benchmarks/render_report.py              # print every block
    python benchmarks/render_report.py --write      # rewrite the blocks in both READMEs (and docs/benchmarks.png)
    python benchmarks/render_report.py --check      # exit 1 if a block is stale, a number in it is not in its
                                                    # cited files, or a README states a performance number
                                                    # outside a block (tests/unit/test_readme_numbers.py)

A rendered block sits between ``<!-- render:NAME -->`` and ``<!-- /render:NAME -->`` in a README; its
text (tables and headline sentences) is produced by the function registered here under NAME and cites
every file it reads as ``benchmarks/results/<file>``. Between the markers nothing is written by hand:
``--write`` replaces it, and ``--check`` fails when re-rendering would change it.

The check (``check()``), besides staleness:

- every number in a block (outside inline code) is found in the files that block cites: as a JSON number
  at the printed precision (or times 100, for a percentage), or as a number inside a JSON string (shape
  labels, commands); for a JUnit XML log, in its attributes. A block prints fields of its files; it
  does not compute ratios of its own, so a ratio between two runs cannot appear;
- a block that prints numbers cites at least one file;
- outside the blocks, neither README states a performance number (an ``Nx`` ratio, ms/us, TFLOP/s,
  GB/s, samples/s, MFU %, a scaling ratio, seconds or minutes), except where ``ALLOWED`` lists the
  phrase with its reason (targets, shapes, limits: numbers that are not measurements);
- every results file carries the writer's environment block (gemcompile/runtime/training/results.py)
  or is one of the files written before it, listed in ``LEGACY`` with what its environment lacks;
- files in ``HAND_MADE`` are never rendered (``load`` refuses them); files in ``HAND_ANNOTATED`` are
  rendered with their hand-added fields named.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Callable, Iterable

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"
DOCS = (REPO / "README.md", HERE / "README.md")
PLOT = REPO / "docs" / "benchmarks.png"

# ---------------------------------------------------------------------------------------------------
# Provenance of the files written before the one writer existed (issue 28's audit)

HAND_MADE = {
    "jagged_attention-overhead-20261130.json":
        "typed in from the printed output of benchmarks/jagged_attention_profile.py (which wrote no JSON then), "
        "and edited in a later commit (f9ccc67): not a measurement record; nothing is rendered from it",
}
"""Files that no script wrote: the renderer refuses them (``load`` raises HandMadeResult)."""

HAND_ANNOTATED = {
    # file: (fields added by hand after the run, whether the file says so itself)
    "e2e-small-b1024-fill0.5-20261130-123647.json": (("command", "command_note"), True),
    "e2e-small-b1024-fill0.5-contended-20261130-145337.json": (("note",), True),
    "e2e-tiny-cpu-50steps-recompiles-20261130-180216.json": (("note",), False),
    "gdpa-20261130.json": (("note",), False),
    "jagged_attention-anchors-20261130.json": (("command",), False),
    "jagged_attention-anchors-cudagraph-20261130.json": (("command",), False),
    "mxfp8_linear-tile-20261130-104329.json": (("note", "dual_quant_impl", "command_env"), True),
    "mxfp8_quality-cut-20261130-110533.json": (("note",), False),
    "mxfp8_quality-eager-seeds-20261130-145327.json": (("note",), True),
    "mxfp8_quality-gpu-small-bf16-rerun-20261130-171807.json": (("note",), False),
    "mxfp8_quality-gpu-small-blockwise-warmup-cosine-20261130-171810.json": (("note",), False),
    "mxfp8_quality-gpu-small-mxfp8-warmup-cosine-20261130-172835.json": (("note",), False),
    "ne_vs_eager-gpu-small-300steps-warmup-cosine-20261130-171806.json": (("note",), False),
    "unpad-b1024-20261130-104556.json": (("note",), False),
    "unpad-b1024-pad-reductions-20261130-105705.json": (("note",), False),
    "mx_dual_quant_ab-20261130-070600.json": (("note",), False),
}
"""Files a script wrote, with fields added by hand afterwards (fields its script does not write)."""

ENV_REQUIRED = ("gpu", "driver", "torch", "triton", "cuda", "git_commit", "git_dirty", "date_utc", "host", "argv",
                "command", "machine_shared")
"""What the writer's environment block holds (gemcompile.runtime.training.results.ENV_FIELDS)."""


def _env_gaps(payload: dict) -> list[str]:
    env = payload.get("environment")
    if not isinstance(env, dict):
        return ["the whole environment block"]
    return [k for k in ENV_REQUIRED if k not in env]


LEGACY = frozenset({
    "block_attention-20261130-044416.json",
    "block_attention-linear-20261130-044611.json",
    "data_masks-20261201-190904.json",
    "e2e-medium-fill0.5-20261130-143850.json",
    "e2e-small-b1024-fill0.5-20261130-123647.json",
    "e2e-small-b1024-fill0.5-contended-20261130-145337.json",
    "e2e-small-fill0.5-20261130-045136.json",
    "e2e-small-fill0.5-20261130-070225.json",
    "e2e-small-fill0.5-20261130-143200.json",
    "e2e-small-mxfp8-all-fill0.5-20261130-144014.json",
    "e2e-tiny-cpu-50steps-recompiles-20261130-180216.json",
    "gdpa-20261130.json",
    "gdpa-hstu-20261130-033819.json",
    "gdpa-hstu-20261130.json",
    "gdpa-hstu-cudagraph-20261130-033800.json",
    "gdpa-hstu-cudagraph-20261130-143144.json",
    "gdpa-hstu-cudagraph-20261130-145124.json",
    "gdpa-hstu-cudagraph-20261130-183648.json",
    "gdpa-hstu-cudagraph-20261130-184623.json",
    "gdpa-hstu-cudagraph-20261130-185604.json",
    "gdpa-hstu-cudagraph-sfu-20261130-173828.json",
    "gdpa-hstu-cudagraph-sumheads-20261130-043449.json",
    "gdpa_bias_grad-20261130-145055.json",
    "gdpa_bias_grad-20261130-185623.json",
    "gdpa_bias_grad-sfu-20261130-173848.json",
    "jagged_attention-anchors-20261129.json",
    "jagged_attention-anchors-20261130.json",
    "jagged_attention-anchors-cudagraph-20261130.json",
    "jagged_attention-check-large-20261130.json",
    "jagged_attention-grid-20261130.json",
    "jagged_attention-overhead-20261130.json",
    "mx_dual_quant_ab-20261130-070600.json",
    "mxfp8_linear-20261130-043316.json",
    "mxfp8_linear-tile-20261130-104329.json",
    "mxfp8_quality-20261130-045143.json",
    "mxfp8_quality-20261130-080022.json",
    "mxfp8_quality-20261130-123916.json",
    "mxfp8_quality-cpu-tiny-1000steps-20261130-124730.json",
    "mxfp8_quality-cpu-tiny-20261130-092705.json",
    "mxfp8_quality-cpu-tiny-300steps-cosine-20261130-155546.json",
    "mxfp8_quality-ctr2pct-20261130-121931.json",
    "mxfp8_quality-cut-20261130-110533.json",
    "mxfp8_quality-eager-seeds-20261130-145327.json",
    "mxfp8_quality-gpu-small-bf16-rerun-20261130-171807.json",
    "mxfp8_quality-gpu-small-blockwise-warmup-cosine-20261130-171810.json",
    "mxfp8_quality-gpu-small-mxfp8-warmup-cosine-20261130-172835.json",
    "ne_vs_eager-cpu-tiny-300steps-20261130-150024.json",
    "ne_vs_eager-cpu-tiny-300steps-cosine-20261130-155021.json",
    "ne_vs_eager-gpu-small-300steps-warmup-cosine-20261130-171806.json",
    "parallel_scaling-20261130-075314.json",
    "parallel_scaling-20261130-080018.json",
    "parallel_scaling-20261130-081802.json",
    "refactor_ab-20261201-165639.json",
    "refactor_ab-20261201-170317.json",
    "unpad-20261130-063658.json",
    "unpad-20261130-065003.json",
    "unpad-20261130-082656.json",
    "unpad-b1024-20261130-104556.json",
    "unpad-b1024-20261130-123137.json",
    "unpad-b1024-pad-reductions-20261130-105705.json",
    "unpad-profile-20261130-064413.json",
})
"""The files written before the one writer (issue 28). Any other results file must carry its complete
environment block; what each of these lacks is listed by the results-index block."""


class HandMadeResult(Exception):
    pass


def _stamp(path: Path) -> str:
    m = re.search(r"(\d{8}(?:-\d{6})?)", path.name)
    return m.group(1) if m else ""


def all_results() -> list[Path]:
    return sorted([*RESULTS.glob("*.json"), *RESULTS.glob("*.xml"), *RESULTS.glob("*/*.xml")])


def rel(path: Path) -> str:
    path = path.resolve()
    return path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else str(path)


def load(name: str) -> tuple[Path, dict]:
    path = RESULTS / name
    if path.name in HAND_MADE:
        raise HandMadeResult(f"{path.name} is hand-made ({HAND_MADE[path.name]}): not rendered")
    return path, json.loads(path.read_text())


def newest(prefix: str | tuple[str, ...], written_by_writer: bool = False) -> tuple[Path, dict] | None:
    """The newest results file named <prefix>-<stamp>.json (the stamp right after the prefix; any of several)."""
    prefixes = (prefix,) if isinstance(prefix, str) else prefix
    pattern = re.compile("(?:" + "|".join(re.escape(p) for p in prefixes) + r")-\d{8}(?:-\d{6})?\.json$")
    found = []
    for path in RESULTS.glob("*.json"):
        if not pattern.fullmatch(path.name) or path.name in HAND_MADE:
            continue
        payload = json.loads(path.read_text())
        if written_by_writer and "writer" not in (payload.get("environment") or {}):
            continue
        found.append((_stamp(path), path, payload))
    if not found:
        return None
    _, path, payload = max(found, key=lambda t: t[0])
    return path, payload


def cite(path: Path) -> str:
    return f"`{rel(path)}`"


def f(x: Any, spec: str = ".2f") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return format(x, spec)


def pct(x: Any, spec: str = ".1f", sign: bool = False) -> str:
    if x is None:
        return "-"
    return format(100 * x, ("+" if sign else "") + spec)


def env_line(path: Path, payload: dict) -> str:
    """Where and how a file was measured, as the file says (and what it does not say)."""
    env = payload.get("environment")
    if not isinstance(env, dict):
        top = {k: payload.get(k) for k in ("gpu", "torch", "triton") if payload.get(k)}
        if top:
            return ", ".join(f"{k} {v}" if k != "gpu" else str(v) for k, v in top.items()) + \
                "; no environment block (no date, CUDA or host recorded)"
        return "the file records no environment (no GPU, torch, triton or date)" + (
            "" if payload.get("command") else ", nor its command")
    parts = [str(env.get("gpu") or "no GPU"), f"torch {env.get('torch', '?')}"]
    if env.get("triton"):
        parts.append(f"triton {env['triton']}")
    if env.get("date_utc"):
        parts.append(str(env["date_utc"])[:10])
    if "machine_shared" in env:
        parts.append(f"machine shared: {env['machine_shared']}")
    if env.get("source_digest"):  # names the code even where the commit field lagged (a device copy's HEAD)
        parts.append(f"sources `{str(env['source_digest'])[:8]}`")
    return ", ".join(parts)


def provenance(path: Path) -> str:
    if path.name in HAND_ANNOTATED:
        fields, said = HAND_ANNOTATED[path.name]
        names = ", ".join(f"`{x}`" for x in fields)
        return f"; {names} added to the file by hand after the run" + ("" if said else ", which the file does not say")
    return ""


def source_line(*items: tuple[Path, dict]) -> str:
    """Each file with its environment (as it records it) and its hand-added fields; ends with a period."""
    return "; ".join(f"{cite(p)} ({env_line(p, d)}{provenance(p)})" for p, d in items) + "."


def table(header: list[str], rows: Iterable[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return lines


# ---------------------------------------------------------------------------------------------------
# The blocks

BLOCKS: dict[str, Callable[[], str]] = {}


def block(name: str):
    def register(fn):
        BLOCKS[name] = fn
        return fn

    return register


def _speed(shape: dict, peer: str, mode: str, key: str = "speedup"):
    return (shape.get(key, {}).get(peer) or {}).get(mode)


def _res(shape: dict, method: str, key: str):
    return (shape.get("results", {}).get(method) or {}).get(key)


def _fwd_and_train_ms(shape: dict, method: str) -> str:
    """'fwd ms / fwd+bwd ms' of a method in a block attention shape."""
    return f"{f(_res(shape, method, 'fwd_ms'), '.3f')} / {f(_res(shape, method, 'fwdbwd_ms'), '.3f')}"


# --- the dense weights' Adam (issue 24) ---------------------------------------------------------------

ADAM_STEP_FILES = ["adam_step-20261206-091318.json", "adam_step-20261206-091450.json"]
"""adam_step runs, oldest first (benchmarks/adam_step.py): approximate then IEEE sqrt and division."""
ADAM_E2E_FILE = "e2e-medium-fill0.5-20261206-091456.json"
ADAM_E2E_AB = ("e2e-medium-fill0.5-20261206-113535.json", "e2e-medium-fill0.5-20261206-113811.json")
"""The whole step with torch's fused Adam (GEMCOMPILE_TRITON_ADAM=0), then TritonAdam, one lease."""


def _adam_kernel_ms(run: dict) -> tuple[str, float]:
    """(the dense optimizer's kernel, its ms a step) in a run's kernel profile."""
    top = run["kernel_profile"]["top"]
    for name, match in (("_adam_kernel", lambda t: t["name"] == "_adam_kernel"),
                        ("torch fused Adam (multi_tensor_apply)", lambda t: "FusedOptimizerTenso" in t["name"])):
        ms = sum(t["ms_per_step"] for t in top if match(t))
        if ms:
            return name, ms
    return "-", float("nan")


@block("adam-step")
def adam_step() -> str:
    items = [load(name) for name in ADAM_STEP_FILES]
    rows = []
    for path, payload in items:
        cfg = payload["config"]
        for r in payload["results"]:
            speed = f(r["speedup_vs_torch_fused"]) if r["method"] != "copy" else "-"
            rows.append([cite(path), f"{cfg['size']}: {cfg['tensors']} tensors, {cfg['parameters'] / 1e9:.2f}B",
                         r["method"], f(r["ms"], ".2f"), f(r["gb_per_s"], ".0f"), speed])
    e2e_path, e2e = load(ADAM_E2E_FILE)
    run = e2e["results"][0]
    adam_ms = _adam_kernel_ms(run)[1]
    ab, ab_items = [], []
    for name in ADAM_E2E_AB:
        path, payload = load(name)
        ab_items.append((path, payload))
        r = payload["results"][0]
        kernel, ms = _adam_kernel_ms(r)
        ab.append([cite(path), ", ".join(r["optimizers"]), kernel, f(ms, ".2f"), f(r["step_ms_median"], ".1f"),
                   f(r["samples_per_s"], ".0f"), f(100 * r["mfu"], ".1f")])
    base, new = (p["results"][0]["samples_per_s"] for _, p in ab_items)
    return "\n".join([
        "One Adam step over GEM-ref's dense weights (fp32, random gradients), median of CUDA-event timings "
        "(triton.testing.do_bench); GB/s: 28 bytes a parameter for Adam, 8 for the copy of the same parameters. "
        "`python benchmarks/adam_step.py --size medium`. Sources: " + source_line(*items), "",
        *table(["file", "parameters", "method", "ms", "GB/s", "x torch fused"], rows), "",
        f"In the whole step ({cite(e2e_path)}, {env_line(e2e_path, e2e)}; `{run['method']}` alone, no peer): "
        f"optimizers {', '.join(run['optimizers'])}; `_adam_kernel` {f(adam_ms, '.2f')} ms a step in the kernel "
        f"profile, step {f(run['step_ms_median'], '.1f')} ms (median), {f(run['samples_per_s'], '.0f')} samples/s, "
        f"MFU {f(100 * run['mfu'], '.1f')}%.", "",
        "The whole step both ways in one lease (`gemcompile bench e2e --size medium --batch-size 256 --warmup 20 "
        "--steps 50 --kernel-steps 3 --methods gem@reduce-overhead`, first with `GEMCOMPILE_TRITON_ADAM=0`; the "
        "second run's compile found the first's Inductor cache, so compile times are not compared). Sources: "
        + source_line(*ab_items), "",
        *table(["file", "optimizers", "dense optimizer kernel", "its ms a step", "step ms (median)", "samples/s",
                "MFU %"], ab), "",
        f"TritonAdam over torch's fused Adam in the whole step: {f(new / base, '.3f')}x samples/s."])


PACKED_EMPTY_FILES = ("e2e-medium-fill0.5-20261206-113811.json", "e2e-medium-fill0.5-20261206-120924.json")
"""The whole step before (TritonAdam, 79607bc's run) and after jagged attention's packed outputs were allocated
empty (71e3343): two leases of an H100."""


@block("packed-empty-outputs")
def packed_empty_outputs() -> str:
    rows, items = [], []
    for name in PACKED_EMPTY_FILES:
        path, payload = load(name)
        items.append((path, payload))
        r = payload["results"][0]
        kp = r["kernel_profile"]
        cutoff = min(t["ms_per_step"] for t in kp["top"])
        fills = []
        for label, match in (("bf16 fill (FillFunctor)", "FillFunctor<c10::BFloat16>"),
                             ("_fill_slack_rows_kernel", "_fill_slack_rows_kernel")):
            hit = [t for t in kp["top"] if match in t["name"]]
            fills.append(f"{f(hit[0]['ms_per_step'], '.2f')} ms, {f(hit[0]['calls_per_step'], '.0f')} calls" if hit
                         else f"below the top {len(kp['top'])} (< {f(cutoff, '.2f')} ms)")
        rows.append([cite(path), *fills, f(kp["kernels_per_step"], ".0f"), f(kp["ms_per_step"], ".1f"),
                     f(r["step_ms_median"], ".1f"), f(r["samples_per_s"], ".0f")])
    return "\n".join([
        "GEM-ref medium, batch 256, fill 0.5, `gem@reduce-overhead` alone, kernel profile of 3 steps "
        "(`gemcompile bench e2e --size medium --batch-size 256 --warmup 20 --steps 50 --kernel-steps 3 --methods "
        "gem@reduce-overhead`), before and after jagged attention's packed outputs and gradients were allocated "
        "empty with only the rows outside every sequence filled; two leases of the same GPU model, so the step "
        "times are not a same-lease A/B. Sources: " + source_line(*items), "",
        *table(["file", "bf16 fills a step", "slack-row fills a step", "kernels a step", "kernel ms a step",
                "step ms (median)", "samples/s"], rows)])


# --- jagged attention --------------------------------------------------------------------------------

JAGGED_PEERS = [("sdpa_padded_mask", "x padded SDPA+mask"), ("flex_document_mask", "x FlexAttention doc mask"),
                ("njt_sdpa", "x NJT+SDPA"), ("compiled_padded", "x torch.compile padded")]


def _jagged_table(path: Path, payload: dict) -> list[str]:
    rows = []
    for s in payload["shapes"]:
        if not s.get("results"):
            rows.append([s.get("label", "?"), s.get("skipped", "not run")] + ["-"] * (2 + len(JAGGED_PEERS)))
            continue
        ours = [f"{f(_res(s, 'gemcompile', 'fwd_ms'), '.3f')} / {f(_res(s, 'gemcompile', 'fwdbwd_ms'), '.3f')}",
                f"{f(_res(s, 'gemcompile', 'fwd_tflops'), '.0f')} / {f(_res(s, 'gemcompile', 'fwdbwd_tflops'), '.0f')}"]
        peers = [f"{f(_speed(s, p, 'fwd'))} / {f(_speed(s, p, 'fwdbwd'))}" for p, _ in JAGGED_PEERS]
        rows.append([s["label"]] + ours + peers + [_jagged_check(s.get("correctness") or {})])
    return table(["shape", "ours ms fwd / fwd+bwd", "ours useful TFLOP/s fwd / fwd+bwd"] + [h for _, h in JAGGED_PEERS]
                 + ["check vs SDPA (valid rows)"], rows)


def _jagged_check(check: dict) -> str:
    if not check:
        return "-"
    if check.get("ok"):
        return "ok"
    if check.get("error"):
        return f"not run ({check['error'].split(':')[0]})"
    off = [f"{k[len('rel_err_'):]} {f(v, '.4f')}" for k, v in check.items() if k.startswith("rel_err_") and v > 0.01]
    return "differs: " + ", ".join(off) if off else "differs"


def _jagged_peer_setup(payload: dict) -> str:
    setup = payload.get("peer_setup")
    if setup:
        return "Peers as this run set them up: " + "; ".join(f"{k}: {v}" for k, v in setup.items()) + "."
    return ("Peers as this run set them up (its JSON does not record it; it predates the per-shape set-up): the "
            "torch.compile and FlexAttention peers were compiled once and reused across shapes under automatic "
            "dynamic shapes, while our kernels are autotuned per shape; FlexAttention's BlockMask used 128-token "
            "blocks with full blocks marked.")


@block("jagged-anchors")
def jagged_anchors() -> str:
    path, payload = load("jagged_attention-anchors-20261130.json")
    lines = [f"Timing: {payload.get('timing', 'eager calls')}, every method in one run; ratios are peer time / our "
             f"time. Source: {source_line((path, payload))}", ""]
    lines += _jagged_table(path, payload)
    lines += ["", _jagged_peer_setup(payload)]
    return "\n".join(lines)


@block("jagged-anchors-cudagraph")
def jagged_anchors_cudagraph() -> str:
    path, payload = load("jagged_attention-anchors-cudagraph-20261130.json")
    lines = [f"Every method replayed from a CUDA graph (no host time for any method; NJT cannot be captured). "
             f"Source: {source_line((path, payload))}", ""]
    lines += _jagged_table(path, payload)
    return "\n".join(lines)


@block("jagged-grid")
def jagged_grid() -> str:
    path, payload = load("jagged_attention-grid-20261130.json")
    lines = [f"Eager calls, measured before the eager fast path (short shapes carry more host time per call than "
             f"today's code). Source: {source_line((path, payload))}", ""]
    lines += _jagged_table(path, payload)
    return "\n".join(lines)


@block("jagged-rerun")
def jagged_rerun() -> str:
    found = newest(("jagged_attention-anchors", "jagged_attention"), written_by_writer=True)
    if found is None:
        return ("**Not re-run yet** with the corrected peers (the torch.compile and FlexAttention peers compiled "
                "per shape, `dynamic=False`): `scratch/issue28_gpu.sh` does it; until then the ratios above are "
                "against peers compiled once for all shapes.")
    path, payload = found
    lines = [f"**Re-run with the peers compiled per shape**, {payload.get('timing', 'eager calls')}. "
             f"Source: {source_line((path, payload))}", ""]
    lines += _jagged_table(path, payload)
    lines += ["", _jagged_peer_setup(payload)]
    return "\n".join(lines)


JAGGED_HOPPER = ["jagged_attention-hopper-20261203-111746.json", "jagged_attention-hopper-20261203-131724.json",
                 "jagged_attention-hopper-cudagraph-20261203-135057.json",
                 "jagged_attention-hopper-cudagraph-20261206-045015.json",
                 "jagged_attention-hopper-cudagraph-20261206-063814.json"]
"""Issue 25's shapes through gem_compile of a plain padded module, against FlexAttention on packed tokens:
eager calls twice (the second with the per-kernel profile), then under CUDA-graph replay (2026-12-03, pointer
loads; 2026-12-06, TMA loads and the tile configs of 2026-12-05; the last, an H100, with the 24th session's
delta in dQ, dK/dV config and forward q in registers)."""


@block("jagged-hopper")
def jagged_hopper() -> str:
    lines = []
    for name in JAGGED_HOPPER:
        lines += _jagged_hopper_run(*load(name)) + [""]
    lines += ["The module is `plain_padded_module` (benchmarks/jagged_attention.py): SDPA with a key mask built "
              "from the lengths, output rows zeroed by the same mask. Each run's explain of it counted one "
              "jagged_attention rewrite per shape (`module_rewrites`); that the zeroed query rows become the "
              "kernel's q_lengths is checked by tests/unit/test_benchmark_peers.py. In the first run the "
              "per-kernel profile failed (a missing import in the harness, fixed after it). At D 64 the eager "
              "calls are host-bound (the module's time moved from run to run); CUDA-graph replay removes the "
              "host from both sides.", ""]
    lines += _jagged_hopper_kernels(*load(JAGGED_HOPPER[1]))
    lines += ["", _jagged_peer_setup(load(JAGGED_HOPPER[-1])[1])]
    return "\n".join(lines)


JAGGED_TMA = [("jagged_attention-hopper-cudagraph-20261205-173626.json",
               "jagged_attention-hopper-cudagraph-20261205-173711.json"),
              ("jagged_attention-hopper-cudagraph-20261205-180156.json",
               "jagged_attention-hopper-cudagraph-20261205-180257.json")]
"""(TMA loads on, GEMCOMPILE_TMA=0) pairs of the issue-25 shapes run back to back on one machine."""


@block("jagged-tma")
def jagged_tma() -> str:
    lines = []
    for on_name, off_name in JAGGED_TMA:
        (on_path, on), (off_path, off) = load(on_name), load(off_name)
        assert (off["environment"].get("gemcompile_env") or {}).get("GEMCOMPILE_TMA") == "0", off_name
        assert not (on["environment"].get("gemcompile_env") or {}).get("GEMCOMPILE_TMA"), on_name
        rows = []
        for s_on, s_off in zip(on["shapes"], off["shapes"]):
            assert s_on["label"] == s_off["label"]
            ms_on = _res(s_on, "gem_compile_module", "fwdbwd_ms")
            ms_off = _res(s_off, "gem_compile_module", "fwdbwd_ms")
            rows.append([s_on["label"], f(ms_off, ".3f"), f(ms_on, ".3f"),
                         f(_res(s_on, "gem_compile_module", "fwdbwd_tflops"), ".0f"),
                         f(_speed(s_on, "flex_document_mask", "fwdbwd", key="speedup_vs_module")),
                         _jagged_check(s_on.get("correctness") or {})])
        lines += [f"The jagged kernels with their streamed row tiles loaded through TMA (ragged descriptors, "
                  f"lowering/common/ragged_tma.py) against pointer loads (`GEMCOMPILE_TMA=0`), the module through "
                  f"gem_compile, forward+backward, {on.get('timing', 'eager calls')}, the two runs back to back. "
                  f"Sources: {source_line((on_path, on), (off_path, off))}", ""]
        lines += table(["shape", "pointer loads ms", "TMA ms", "TMA useful TFLOP/s",
                        "TMA module x FlexAttention", "check vs SDPA (valid rows)"], rows) + [""]
    lines += ["Each descriptor costs host time at every launch (Triton's launcher encodes it): in the alternating "
              "host-time runs of `benchmarks/op_host_time.py` (B32 H8 L512 D64; `op_host_time-20261205-180950`, "
              "`-181014`, `-181029`, `-181045`) the backward with TMA took more host time per call than without. So "
              "a launch whose padded work B x H x Lq x Lk x D is below `ragged_tma.TMA_MIN_WORK` keeps its pointer "
              "loads; the shapes above are all above it."]
    return "\n".join(lines).rstrip()


def _fwdbwd_kernel_us(shape: dict, method: str) -> dict:
    return {k["kernel"]: k["us"] for k in (shape["results"].get(method) or {}).get("fwdbwd_kernels") or []}


def _chosen(shape: dict, kernel: str) -> str:
    """The config the autotuner chose for a kernel at this shape's length bucket."""
    bucket = f"({shape['L']}, {shape['L']}, {shape['D']},"
    chosen = [v for k, v in shape.get("autotune_choices", {}).get(kernel, {}).items() if k.startswith(bucket)]
    return chosen[0].split(", num_ctas")[0] if chosen else "-"


def _jagged_ab(pairs, before_env: tuple[str, str | None], what: str, kernels: tuple[str, ...],
               chosen: str | None = None) -> str:
    """(after, before) runs of issue 25's shapes, each pair back to back in one lease; the 'before' file is
    told apart by ``before_env`` = (GEMCOMPILE_ variable, its value; None: only that it is set)."""
    var, value = before_env
    rows, cited, timing = [], [], "eager calls"
    for after_name, before_name in pairs:
        (a_path, a), (b_path, b) = load(after_name), load(before_name)
        b_env, a_env = b["environment"].get("gemcompile_env") or {}, a["environment"].get("gemcompile_env") or {}
        assert var in b_env and (value is None or b_env[var] == value), before_name
        assert var not in a_env, after_name
        cited += [(a_path, a), (b_path, b)]
        timing = a.get("timing", timing)
        for s_a, s_b in zip(a["shapes"], b["shapes"]):
            assert s_a["label"] == s_b["label"]
            k_a, k_b = _fwdbwd_kernel_us(s_a, "gemcompile"), _fwdbwd_kernel_us(s_b, "gemcompile")
            row = [s_a["label"], cite(b_path)]
            for method, mode in (("gemcompile", "fwd"), ("gemcompile", "fwdbwd"), ("gem_compile_module", "fwdbwd")):
                row.append(f"{f(_res(s_b, method, mode + '_ms'), '.3f')} -> {f(_res(s_a, method, mode + '_ms'), '.3f')}")
            row.append(", ".join(f"{name.strip('_').removesuffix('_kernel')} {f(k_b.get(name), '.0f')} -> "
                                 f"{f(k_a.get(name), '.0f')}" for name in kernels))
            if chosen:
                row.append(f"`{_chosen(s_a, chosen)}`")
            rows.append(row)
    head = [f"{what}, forward and forward+backward, {timing}, before -> after, each pair back to back on one "
            f"machine. Sources: {source_line(*cited)}", ""]
    header = ["shape", "the 'before' file", "op fwd ms", "op fwd+bwd ms", "module fwd+bwd ms",
              "per kernel us, one fwd+bwd of the op (torch.profiler)"] + (
        [f"{chosen.strip('_')} config chosen (after)"] if chosen else [])
    return "\n".join(head + table(header, rows))


@block("jagged-delta-in-dq")
def jagged_delta_in_dq() -> str:
    return _jagged_ab([("jagged_attention-hopper-cudagraph-20261206-060427.json",
                        "jagged_attention-hopper-cudagraph-20261206-060525.json")],
                      ("GEMCOMPILE_DELTA_IN_DQ", "0"),
                      "After: delta = rowsum(dO * O) computed by the dQ kernel for its own rows, the dQ kernel "
                      "launched before dK/dV; before: delta by a kernel of its own (`GEMCOMPILE_DELTA_IN_DQ=0`)",
                      ("_bwd_delta_kernel", "_bwd_dq_kernel", "_bwd_dkdv_kernel"))


@block("jagged-dkdv-64x64")
def jagged_dkdv_64x64() -> str:
    return _jagged_ab([("jagged_attention-hopper-cudagraph-20261206-061612.json",
                        "jagged_attention-hopper-cudagraph-20261206-061714.json"),
                       ("jagged_attention-hopper-cudagraph-20261206-061748.json",
                        "jagged_attention-hopper-cudagraph-20261206-061815.json")],
                      ("GEMCOMPILE_BENCH_VARIANT", None),
                      "The dK/dV autotune list with 64x64 w4 s2 at D 128 (after) against the same code without it "
                      "(before: run as scratch/dev/bench_without_dkdv64.py, now benchmarks/jagged_without_config.py; "
                      "its files say so in `gemcompile_env`), two alternating pairs",
                      ("_bwd_dkdv_kernel",), chosen="_bwd_dkdv_kernel")


@block("jagged-a-registers")
def jagged_a_registers() -> str:
    every = _jagged_ab([("jagged_attention-hopper-cudagraph-20261206-063111.json",
                         "jagged_attention-hopper-cudagraph-20261206-063207.json"),
                        ("jagged_attention-hopper-cudagraph-20261206-063237.json",
                         "jagged_attention-hopper-cudagraph-20261206-063308.json")],
                       ("GEMCOMPILE_WGMMA_A_REGISTERS", "0"),
                       "First try, every kernel's loop-invariant first dot operands in registers (forward q, dK/dV k "
                       "and v, dQ q and dO; after) against shared memory (`GEMCOMPILE_WGMMA_A_REGISTERS=0`, before), "
                       "two alternating pairs",
                       ("_fwd_kernel", "_bwd_dkdv_kernel", "_bwd_dq_kernel"), chosen="_bwd_dkdv_kernel")
    kept = _jagged_ab([("jagged_attention-hopper-cudagraph-20261206-063814.json",
                        "jagged_attention-hopper-cudagraph-20261206-063859.json"),
                       ("jagged_attention-hopper-cudagraph-20261206-063921.json",
                        "jagged_attention-hopper-cudagraph-20261206-063942.json")],
                      ("GEMCOMPILE_WGMMA_A_REGISTERS", "0"),
                      "What was kept, the forward's q in registers at head dims up to 64 only (after) against shared "
                      "memory (`GEMCOMPILE_WGMMA_A_REGISTERS=0`, before), two alternating pairs",
                      ("_fwd_kernel", "_bwd_dkdv_kernel", "_bwd_dq_kernel"))
    return every + "\n\n" + kept


@block("jagged-grid-session-ab")
def jagged_grid_session_ab() -> str:
    (a_path, a), (b_path, b) = (load("jagged_attention-grid-cudagraph-20261206-064519.json"),
                                load("jagged_attention-grid-cudagraph-20261206-064549.json"))
    env = b["environment"].get("gemcompile_env") or {}
    assert env.get("GEMCOMPILE_DELTA_IN_DQ") == "0" and env.get("GEMCOMPILE_WGMMA_A_REGISTERS") == "0"
    assert "GEMCOMPILE_BENCH_VARIANT" in env and not a["environment"].get("gemcompile_env")
    rows = []
    for s_a, s_b in zip(a["shapes"], b["shapes"]):
        assert s_a["label"] == s_b["label"]
        rows.append([s_a["label"], _fwd_and_train_ms(s_b, "gemcompile"), _fwd_and_train_ms(s_a, "gemcompile"),
                     f(_res(s_b, "gemcompile", "fwdbwd_tflops"), ".0f"), f(_res(s_a, "gemcompile", "fwdbwd_tflops"), ".0f")])
    head = [f"The jagged grid (the op, D 128), this session's kernels (after) against the same code set back to the "
            f"session's start (before: `GEMCOMPILE_DELTA_IN_DQ=0 GEMCOMPILE_WGMMA_A_REGISTERS=0 python "
            f"benchmarks/jagged_without_config.py dkdv:64,64,4,2 -- --only grid --cuda-graph --methods gemcompile`), "
            f"{a.get('timing', 'eager calls')}, back to back on one machine. Sources: "
            f"{source_line((a_path, a), (b_path, b))}", ""]
    return "\n".join(head + table(["shape", "before ms fwd / fwd+bwd", "after ms fwd / fwd+bwd",
                                    "before useful TFLOP/s fwd+bwd", "after useful TFLOP/s fwd+bwd"], rows))


def _jagged_hopper_kernels(path, payload) -> list[str]:
    """Per shape and method, the GPU time of each kernel of one forward+backward (torch.profiler)."""
    rows = []
    for s in payload["shapes"]:
        for method in ("gem_compile_module", "flex_document_mask"):
            for k in (s["results"].get(method) or {}).get("fwdbwd_kernels") or []:
                if k["us"] >= 5:
                    rows.append([s["label"], method, f"`{k['kernel'][:60]}`", f(k["us"], ".0f"), f(k["calls"], ".0f")])
    lines = [f"Per kernel, one forward+backward (torch.profiler, kernels of at least 5 us). Source: "
             f"{source_line((path, payload))}", ""]
    return lines + table(["shape", "method", "kernel", "us", "calls"], rows)


def _jagged_hopper_run(path, payload) -> list[str]:
    rows = []
    for s in payload["shapes"]:
        target = "`>= 1.5x, >= 300`" if s["D"] == 128 else "`>= 1.8x`"  # code spans: targets, not results
        rows.append([s["label"], f(_res(s, "gem_compile_module", "fwdbwd_ms"), ".3f"),
                     f(_res(s, "gem_compile_module", "fwdbwd_tflops"), ".0f"),
                     f(_res(s, "flex_document_mask", "fwdbwd_tflops"), ".0f"),
                     f(_speed(s, "flex_document_mask", "fwdbwd", key="speedup_vs_module")),
                     f(_res(s, "gemcompile", "fwdbwd_tflops"), ".0f"), target, _jagged_check(s.get("correctness") or {})])
    lines = [f"The shapes of `issue 25`, forward+backward, {payload.get('timing', 'eager calls')}, every method in one run. "
             f"Source: {source_line((path, payload))}", ""]
    return lines + table(["shape", "gem_compile module ms", "module useful TFLOP/s", "FlexAttention packed TFLOP/s",
                          "module x FlexAttention", "our op alone TFLOP/s", "target (x Flex, TFLOP/s)",
                          "check vs SDPA (valid rows)"], rows)


@block("kernel-registers")
def kernel_registers() -> str:
    path, payload = load("kernel_registers-d128-20261205-182145.json")  # (triton 3.6, the GPU machine's)
    rows = [[r["kernel"], f"{r['BLOCK_M']}x{r['BLOCK_N']}", str(r["num_warps"]), str(r["num_stages"]),
             str(r["maxnreg"] or "-"), str(r.get("registers", "-")), str(r.get("spill_store_bytes", "-")),
             str(r.get("shared_bytes", "-")), "yes" if r.get("wgmma_serialized") else "no"]
            for r in payload["rows"]]
    lines = [f"The jagged kernels at D 128 compiled for {payload['target']}, per tile config and register cap; "
             f"`-tma`: the streamed tiles loaded through TMA (ragged descriptors, lowering/common/ragged_tma.py). "
             f"Source: {source_line((path, payload))}", ""]
    lines += table(["kernel", "tile", "warps", "stages", "maxnreg", "registers", "spill bytes", "shared bytes",
                    "wgmma serialized"], rows)
    return "\n".join(lines)


@block("block-kernel-registers")
def block_kernel_registers() -> str:
    """Block attention's closed kernels at D 128 before (5b6bcd0's kernels: rotary on halves) and after (full
    width, four-heads configs, then 3ebb57d's three-stage configs, then the R_SPLIT configs listed and the
    per-head helpers), compiled for sm_90a on the CPU."""
    lines, rows = [], []
    for name in ("kernel_registers-block-closed-d128-20261204-150019.json",
                 "kernel_registers-block-closed-d128-20261204-150013.json",
                 "kernel_registers-block-closed-d128-20261204-165838.json",
                 "kernel_registers-block-closed-d128-20261204-184403.json",
                 "kernel_registers-block-closed-d128-20261204-211956.json"):
        path, payload = load(name)
        lines.append(f"Source: {source_line((path, payload))} Code {code_of(payload['environment'])}.")
        code = code_of(payload["environment"])
        rows += [[code, r["kernel"], r["rotary"], str(r["BLOCK"]),
                  str(r.get("HEADS", 1)) + (", R^T split" if r.get("R_SPLIT") else ""), str(r["num_warps"]),
                  str(r["num_stages"]), str(r.get("registers", "-")), str(r.get("spill_store_bytes", "-")),
                  str(r.get("shared_bytes", "-")), str(r.get("barriers", "-")), str(r.get("cp_async", "-")),
                  str(r.get("ld_global", "-")), str(r.get("shfl", "-")),
                  f"{r.get('ld_shared', '-')} / {r.get('st_shared', '-')}"]
                 for r in payload["rows"]]
    header = ["code", "kernel", "rotary", "tile", "heads", "warps", "stages", "registers", "spill bytes",
              "shared bytes", "barriers (bar.sync)", "cp.async in the PTX", "ld.global in the PTX",
              "shfl.sync in the PTX", "ld.shared / st.shared in the PTX"]
    return "\n".join(lines + [""] + table(header, rows))


@block("jagged-check-large")
def jagged_check_large() -> str:
    path, payload = load("jagged_attention-check-large-20261130.json")
    re_path, re_payload = load(newest("jagged_attention-check-large-reanalysis")[0].name)
    by_batch = {r["batch"]: r for r in re_payload["rows"]}
    rows = []
    for r in payload["rows"]:
        ours, sdpa, ra = r["gemcompile"], r["sdpa_padded_mask"], by_batch.get(r["batch"], {})
        rows.append([str(r["batch"]), str(r["length"]),
                     " / ".join(f(ours[k], ".4f") for k in ("out", "dq", "dk", "dv")),
                     " / ".join(f(sdpa[k], ".4f") for k in ("out", "dq", "dk", "dv")),
                     f(ra.get("predicted_sqrt_padded_over_valid"), ".4f")])
    shape = payload["shape"]
    lines = [f"B{shape['B']} L{shape['L']} H{shape['H']} D{shape['D']}, relative error against float64 on single "
             f"sequences, valid rows. The first check, {source_line((path, payload))} Its upstream gradient was "
             f"drawn at every row, padded query rows included; the last column is sqrt((L - n) / n) from "
             f"{source_line((re_path, re_payload))}", ""]
    lines += table(["batch", "length n", "ours out / dQ / dK / dV", "padded SDPA out / dQ / dK / dV",
                    "sqrt((L - n) / n)"], rows)
    return "\n".join(lines)


@block("jagged-check-large-rerun")
def jagged_check_large_rerun() -> str:
    found = newest("jagged_attention-check-large", written_by_writer=True)
    if found is None or found[1].get("upstream_gradient", "").startswith("drawn at every row"):
        return ("**Not re-run yet** with the padded rows' upstream gradient masked "
                "(`python benchmarks/jagged_attention_check_large.py`, in `scratch/issue28_gpu.sh`). Until it is, "
                "nothing is claimed about padded SDPA's dK and dV on this shape, and the dQ difference from the "
                "first batch past the int32 element boundary on is unconfirmed.")
    path, payload = found
    rows = [[str(r["batch"]), str(r["length"]), str(r["elements_before_batch"]),
             " / ".join(f(r["gemcompile"][k], ".4f") for k in ("out", "dq", "dk", "dv")),
             " / ".join(f(r["sdpa_padded_mask"][k], ".4f") for k in ("out", "dq", "dk", "dv"))]
            for r in payload["rows"]]
    lines = [f"**Re-run with the upstream gradient {payload['upstream_gradient']}.** Source: "
             f"{source_line((path, payload))}", ""]
    lines += table(["batch", "length n", "elements before the batch", "ours out / dQ / dK / dV",
                    "padded SDPA out / dQ / dK / dV"], rows)
    return "\n".join(lines)


# --- GDPA --------------------------------------------------------------------------------------------

@block("gdpa-first-run")
def gdpa_first_run() -> str:
    path, payload = load("gdpa-20261130.json")
    rows = []
    for s in payload["shapes"]:
        if s.get("case") == "hstu":
            continue  # superseded (the file's own note): a clamped per-head table, not the anchor's
        r = s["results"]["gemcompile"]
        rows.append([s["label"], f"{f(r['fwd_ms'], '.3f')} / {f(r['bwd_ms'], '.3f')}",
                     f"{f(r['fwd_tflops'], '.0f')} / {f(r['fwdbwd_tflops'], '.0f')}",
                     f"{f(_speed(s, 'compiled_padded', 'fwd'))} / {f(_speed(s, 'compiled_padded', 'bwd'))}",
                     f"{f(_speed(s, 'padded_eager', 'fwd'))} / {f(_speed(s, 'padded_eager', 'bwd'))}",
                     f(_res(s, "gem_compile", "fwdbwd_ms"), ".3f")])
    lines = [f"Eager calls; ratios peer / our op, backward = fwd+bwd - fwd. Source: {source_line((path, payload))}",
             ""]
    lines += table(["shape (bf16)", "ours ms fwd / bwd", "ours useful TFLOP/s fwd / fwd+bwd",
                    "x torch.compile padded fwd / bwd", "x padded eager fwd / bwd", "gem_compile ms fwd+bwd"], rows)
    return "\n".join(lines)


GDPA_HISTORY = [
    ("before (dS buffer, table gather)", "gdpa-hstu-cudagraph-20261130-033800.json"),
    ("in-kernel dBias, first version", "gdpa-hstu-cudagraph-20261130-143144.json"),
    ("dBias over the reached pairs only", "gdpa-hstu-cudagraph-20261130-145124.json"),
    ("silu through the SFU's tanh", "gdpa-hstu-cudagraph-sfu-20261130-173828.json"),
    ("the table read in place", "gdpa-hstu-cudagraph-20261130-183648.json"),
    ("one-pass diagonal sums, one-launch batch order", "gdpa-hstu-cudagraph-20261130-184623.json"),
    ("table rows summed by 2-D loads", "gdpa-hstu-cudagraph-20261130-185604.json"),
]


@block("gdpa-hstu-history")
def gdpa_hstu_history() -> str:
    rows = []
    for step, name in GDPA_HISTORY:
        path, payload = load(name)
        s = payload["shapes"][0]
        rows.append([f"{step}, {cite(path)}",
                     f"{f(_res(s, 'gemcompile', 'fwd_ms'), '.3f')} / {f(_res(s, 'gemcompile', 'fwdbwd_ms'), '.3f')}",
                     f(_res(s, "gem_compile", "fwdbwd_ms"), ".3f"), f(_res(s, "compiled_padded", "fwdbwd_ms"), ".3f"),
                     " / ".join(f(_speed(s, "compiled_padded", m)) for m in ("fwd", "bwd", "fwdbwd")),
                     f(_res(s, "gemcompile", "fwdbwd_tflops"), ".0f")])
    path, payload = load(GDPA_HISTORY[-1][1])
    lines = [f"HSTU (silu, causal, relative bias with its gradient), {payload['shapes'][0]['label']}, CUDA-graph "
             f"replay, one run per row, each with its own torch.compile peer. Environment of the last row: "
             f"{env_line(path, payload)}. Useful TFLOP/s: the file's convention (valid causal pairs).", ""]
    lines += table(["run", "op ms fwd / fwd+bwd", "gem_compile ms fwd+bwd", "torch.compile padded ms fwd+bwd",
                    "op x torch.compile (fwd / bwd / fwd+bwd)", "op useful TFLOP/s fwd+bwd"], rows)
    return "\n".join(lines)


GDPA_VARIANTS = [("gemcompile", "gemcompile::gdpa, table read in place (default)"),
                 ("gdpa_dense_bias", "the same with a dense (L, L) bias"),
                 ("gdpa_tl_sigmoid", "silu through `tl.sigmoid`"), ("gdpa_no_bias", "no bias"),
                 ("gdpa_relu", "relu instead of silu, with the bias"),
                 ("jagged_softmax_causal", "jagged softmax kernels, causal, no bias")]


@block("gdpa-hstu-variants")
def gdpa_hstu_variants() -> str:
    path, payload = load(GDPA_HISTORY[-1][1])
    s = payload["shapes"][0]
    rows = []
    for key, what in GDPA_VARIANTS:
        r = s["results"].get(key) or {}
        kernels = ", ".join(f"{k['kernel'].strip('_')[:32]} {f(k['us'], '.1f')}" for k in (r.get("fwdbwd_kernels") or [])[:5])
        rows.append([what, f"{f(r.get('fwd_ms'), '.3f')} / {f(r.get('fwdbwd_ms'), '.3f')}", kernels or "-"])
    lines = [f"Variants timed in the same run (`--diagnose`), CUDA-graph replay, {s['label']}. Source: "
             f"{source_line((path, payload))}", ""]
    lines += table(["variant", "fwd / fwd+bwd ms", "largest kernels of fwd+bwd (us)"], rows)
    return "\n".join(lines)


@block("gdpa-hstu-headline")
def gdpa_hstu_headline() -> str:
    path, payload = load(GDPA_HISTORY[-1][1])
    s = payload["shapes"][0]
    corr = s.get("correctness", {})
    return (f"{s['label']} under CUDA-graph replay ({cite(path)}): the op {f(_res(s, 'gemcompile', 'fwdbwd_ms'), '.3f')} ms "
            f"forward+backward, gem_compile {f(_res(s, 'gem_compile', 'fwdbwd_ms'), '.3f')} ms, torch.compile of the "
            f"padded code {f(_res(s, 'compiled_padded', 'fwdbwd_ms'), '.3f')} ms in the same run: the op is "
            f"{f(_speed(s, 'compiled_padded', 'fwdbwd'))}x torch.compile ({f(_speed(s, 'compiled_padded', 'fwd'))}x "
            f"forward, {f(_speed(s, 'compiled_padded', 'bwd'))}x backward). Table gradient against float64: "
            f"gem_compile {pct((corr.get('gem_compile') or {}).get('dbias'), '.2f')}%, torch.compile "
            f"{pct((corr.get('compiled_padded') or {}).get('dbias'), '.1f')}%.")


@block("gdpa-bias-grad-sweeps")
def gdpa_bias_grad_sweeps() -> str:
    lines = []
    for name in ("gdpa_bias_grad-20261130-145055.json", "gdpa_bias_grad-sfu-20261130-173848.json",
                 "gdpa_bias_grad-20261130-185623.json"):
        path, payload = load(name)
        us = [r["dbias_kernel_us"] for r in payload["rows"] if r.get("dbias_kernel_us") is not None]
        default = payload["rows"][0]
        lines.append(f"- {cite(path)}: dBias kernel {f(min(us), '.1f')}-{f(max(us), '.1f')} us over the configs swept; "
                     f"the default config {f(default.get('dbias_kernel_us'), '.1f')} us, op fwd+bwd "
                     f"{f(default.get('fwdbwd_ms'), '.3f')} ms.")
    return "\n".join(lines)


# --- block attention ---------------------------------------------------------------------------------

def _block_table(payload: dict, with_sdpa: bool = True) -> list[str]:
    per_setup = "peer_setup" in payload  # runs since issue 28: each Flex set-up's ratio, SDPA checked on valid rows
    rows = []
    for s in payload["shapes"]:
        if not s.get("results"):
            rows.append([s.get("label", "?"), s.get("skipped", "not run"), "-", "-", "-", "-"])
            continue
        check = s.get("correctness") or {}
        fused = (check.get("ours_fused_rotary") or {})
        row = [s["label"],
               f"{f(_res(s, 'ours_fused_rotary', 'fwd_ms'), '.3f')} / {f(_res(s, 'ours_fused_rotary', 'fwdbwd_ms'), '.3f')}",
               f"{f(_res(s, 'ours_no_rotary', 'fwd_ms'), '.3f')} / {f(_res(s, 'ours_no_rotary', 'fwdbwd_ms'), '.3f')}",
               f(_speed(s, "fused_vs_rotary_outside", "fwdbwd")),
               f(_speed(s, "vs_flex", "fwdbwd"))]
        if per_setup:
            row.append(f"{f(_speed(s, 'vs_flex_b64', 'fwdbwd'))} / {f(_speed(s, 'vs_flex_b128', 'fwdbwd'))}")
        if with_sdpa:
            sd = _speed(s, "vs_sdpa", "fwdbwd")
            err = (_res(s, "sdpa_rotary_outside", "error") or "")
            row.append(f(sd) if sd is not None else (err.split(" (")[0] or "-"))
        row.append("ok" if fused.get("ok") else "FAILED" if fused else "-")
        if per_setup:
            sdpa_check = check.get("sdpa_rotary_outside") or {}
            row.append(f(sdpa_check.get("out"), ".4f") if "out" in sdpa_check else "-")
        rows.append(row)
    header = ["shape", "ours, RoPE fused, ms fwd / fwd+bwd", "ours, no RoPE, ms fwd / fwd+bwd",
              "x same kernel, RoPE outside (fwd+bwd)", "x Flex, no RoPE either side (fwd+bwd)"]
    if per_setup:
        header.append("x Flex per set-up: 64-token mask blocks / 128-token (fwd+bwd)")
    if with_sdpa:
        header.append("x padded SDPA + mask, RoPE outside (fwd+bwd)")
    return table(header + ["ours vs float64"] + (["padded SDPA output vs float64, valid rows"] if per_setup else []),
                 rows)


def _block_peer_setup(payload: dict) -> str:
    setup = payload.get("peer_setup")
    if setup:
        return "Peers as this run set them up: " + "; ".join(f"{k}: {v}" for k, v in setup.items()) + "."
    return ("Peers as this run set them up (its JSON does not record it; it predates the corrected set-up): "
            "FlexAttention's BlockMask blocks were twice the mask's block, with no full blocks, so its kernel "
            "evaluated the mask on about twice the valid pairs, and FlexAttention was compiled once per head dim and "
            "reused across shapes under automatic dynamic shapes. The x Flex column is against that set-up.")


@block("block-attention-grid")
def block_attention_grid() -> str:
    path, payload = load("block_attention-20261130-044416.json")
    lines = [f"Eager calls, every method in one run; ratios peer / ours. Source: {source_line((path, payload))}", ""]
    lines += _block_table(payload)
    lines += ["", _block_peer_setup(payload)]
    return "\n".join(lines)


@block("block-attention-linear")
def block_attention_linear() -> str:
    path, payload = load("block_attention-linear-20261130-044611.json")
    rows = []
    for s in payload["shapes"]:
        rows.append([s["label"], f(_res(s, "ours_no_rotary", "fwdbwd_ms"), ".3f"),
                     f(_res(s, "ours_fused_rotary", "fwdbwd_ms"), ".3f"), f(_res(s, "flex_no_rotary", "fwdbwd_ms"), ".3f"),
                     f(_speed(s, "vs_flex", "fwdbwd"))])
    lines = [f"B fixed, L doubling, forward+backward. Source: {source_line((path, payload))}", ""]
    lines += table(["shape", "ours, no RoPE, ms", "ours, RoPE fused, ms", "Flex, no RoPE, ms (set-up as above)",
                    "x Flex (no RoPE)"], rows)
    return "\n".join(lines)


@block("block-attention-rerun")
def block_attention_rerun() -> str:
    found = newest(("block_attention-claims", "block_attention"), written_by_writer=True)
    if found is None:
        return ("**Not re-run yet** with the corrected FlexAttention peer (a BlockMask at the mask's block size with "
                "full blocks marked, kernel tiles that fit it, compiled per shape): `scratch/issue28_gpu.sh` does it. "
                "Until then no claim is made about block attention against FlexAttention.")
    path, payload = found
    lines = [f"**Re-run with the corrected peers**, {payload.get('timing', 'eager calls')}. Source: "
             f"{source_line((path, payload))}", ""]
    lines += _block_table(payload)
    lines += ["", _block_peer_setup(payload)]
    return "\n".join(lines)


BLOCK_CLAIMS_CUDAGRAPH = ["block_attention-claims-cudagraph-20261204-181621.json",  # --head-dims 64
                          "block_attention-claims-cudagraph-20261204-181530.json"]  # --head-dims 128
"""The claims shapes as CUDA-graph replays, at 3ebb57d (the closed kernels' three-stage configs)."""

BLOCK_ROTARY_STEPS = [
    ("4e1fb6f: partner columns as a second load", ["block_attention-claims-cudagraph-20261204-161959.json",
                                                   "block_attention-claims-cudagraph-20261204-163655.json"]),
    ("a84d2bc: half-width loads (reverted)", ["block_attention-claims-cudagraph-20261204-175853.json",
                                              "block_attention-claims-cudagraph-20261204-175742.json"]),
    ("3ebb57d: 4e1fb6f's loads, three-stage configs", BLOCK_CLAIMS_CUDAGRAPH),
    ("0dfc935: R_SPLIT listed for the rotary backward at D 128 (D 64 re-run at 89b70e1, kernels unchanged)",
     ["block_attention-claims-cudagraph-20261205-051015.json",
      "block_attention-claims-cudagraph-20261205-040254.json"]),
]
"""The claims runs of block attention's rotary steps (each pair: D 64, D 128), CUDA-graph replays."""


@block("block-attention-claims-cudagraph")
def block_attention_claims_cudagraph() -> str:
    rows, sources = [], []
    for name in BLOCK_CLAIMS_CUDAGRAPH:
        path, payload = load(name)
        sources.append(source_line((path, payload)))
        for s in payload["shapes"]:
            if _res(s, "ours_no_rotary", "fwdbwd_ms") is None:  # not run (the first run's time budget)
                continue
            fused, plain = _res(s, "ours_fused_rotary", "fwdbwd_ms"), _res(s, "ours_no_rotary", "fwdbwd_ms")
            # (the ratio itself is not printed: these files do not hold it, and the check prints only
            # numbers a cited file holds)
            flex = _speed(s, "vs_flex", "fwdbwd")  # against the faster of the two Flex set-ups
            rotary = fused / plain if fused and plain else None
            rows.append([s["label"], _fwd_and_train_ms(s, "ours_fused_rotary"),
                         _fwd_and_train_ms(s, "ours_no_rotary"),
                         f"{f(_speed(s, 'vs_flex_b64', 'fwd'))} / {f(_speed(s, 'vs_flex_b64', 'fwdbwd'))}",
                         f(_speed(s, "vs_flex_b128", "fwdbwd")),
                         "met" if flex is not None and flex >= 2.0 else "missed",
                         "met" if rotary is not None and rotary <= 1.3 else "missed",
                         "ok" if (s.get("correctness", {}).get("ours_fused_rotary") or {}).get("ok")
                         else "FAILED"])
    lines = ["CUDA-graph replays (the kernels' time, no host), triton.testing.do_bench median; every method of a "
             "shape in one run. Sources: " + " ".join(sources), ""]
    lines += table(["shape", "ours, RoPE fused, ms fwd / fwd+bwd", "ours, no RoPE, ms fwd / fwd+bwd",
                    "x Flex 64-token blocks (autotuned), fwd / fwd+bwd",
                    "x Flex 128-token blocks, fwd+bwd", "target `>= 2x` the faster Flex",
                    "target: RoPE fused fwd+bwd `<= 1.3x` no RoPE",
                    "ours vs float64"], rows)
    path, payload = load(BLOCK_CLAIMS_CUDAGRAPH[-1])
    lines += ["", _block_peer_setup(payload)]
    return "\n".join(lines)


BLOCK_GRID_CUDAGRAPH = [
    ("block_attention-claims-cudagraph-20261204-181621.json", (0, 6, 7)),  # --only claims --head-dims 64
    ("block_attention-cudagraph-20261204-202827.json", (1, 2, 4)),  # --head-dims 128 (its 8 past the budget)
    ("block_attention-cudagraph-20261204-203535.json", (3, 5, 8)),  # --shapes 3,5,8
]
"""Every grid shape as CUDA-graph replays with the 64-token Flex set-up: three runs, the grid indices each
holds (the grid order of benchmarks/block_attention.py)."""


@block("block-attention-grid-cudagraph")
def block_attention_grid_cudagraph() -> str:
    rows, sources = [], []
    for name, _ in BLOCK_GRID_CUDAGRAPH:
        path, payload = load(name)
        sources.append((path, payload))
        for s in payload["shapes"]:
            if _res(s, "ours_no_rotary", "fwdbwd_ms") is None:  # past a run's time budget: another run has it
                continue
            flex = _speed(s, "vs_flex", "fwdbwd")  # the faster Flex set-up the run timed
            checks = s.get("correctness") or {"none recorded": None}
            rows.append([s["label"], cite(path), _fwd_and_train_ms(s, "ours_fused_rotary"),
                         _fwd_and_train_ms(s, "ours_no_rotary"),
                         f(_res(s, "ours_no_rotary", "fwd_gbps_min_bytes"), ".0f"),
                         f"{f(_speed(s, 'vs_flex', 'fwd'))} / {f(flex)}",
                         "met" if flex is not None and flex >= 2.0 else "missed",
                         "ok" if all((c or {}).get("ok") for c in checks.values()) else "FAILED"])
    lines = ["CUDA-graph replays, triton.testing.do_bench median; every method of a shape in one run; ratios "
             "peer / ours, no RoPE either side. Sources: " + source_line(*sources), ""]
    lines += table(["shape", "file", "ours, RoPE fused, ms fwd / fwd+bwd", "ours, no RoPE, ms fwd / fwd+bwd",
                    "ours, no RoPE, fwd GB/s of the bytes it must move", "x the faster Flex, fwd / fwd+bwd",
                    "target `>= 2x` (fwd+bwd)", "every method vs float64"], rows)
    path, payload = load(BLOCK_GRID_CUDAGRAPH[-1][0])
    lines += ["", _block_peer_setup(payload)]
    return "\n".join(lines)


def _block_closed_sweep(name: str, command: str, pinned_header: str) -> str:
    """One block_closed_configs file as a table: the listed configs, then each pinned candidate."""
    path, payload = load(name)
    shape = payload["shape"]
    rows = []
    for r in payload["rows"]:
        listed = r["pinned"].startswith("none")
        pinned = "listed configs, autotuned" if listed else f"{r['pinned']} {r['config']}"
        error = r.get("error", "-").split(":")[0]  # the type alone: its text holds numbers
        rows.append([r["rotary"], pinned, f(r.get("fwd_ms"), ".3f"), f(r.get("fwdbwd_ms"), ".3f"),
                     f(r.get("bwd_ms"), ".3f"), error])
    lines = [f"B{shape['B']} L{shape['L']} H{shape['H']} D{shape['D']} fill {shape['fill']}, "
             f"{payload['timing']}; config (BLOCK, warps, HEADS, stages, maxnreg, constexprs). "
             f"`{command}`. Source: {source_line((path, payload))}", ""]
    lines += table(["rotary", pinned_header, "fwd ms", "fwd+bwd ms", "bwd ms (fwd+bwd minus fwd)", "error"],
                   rows)
    return "\n".join(lines)


@block("block-closed-r-split")
def block_closed_r_split() -> str:
    return _block_closed_sweep("block_closed_configs-d128-20261204-202617.json",
                               "python benchmarks/block_closed_configs.py --head-dim 128 --rotary half --which "
                               "bwd --only-with R_SPLIT", "pinned (the listed configs then: gather only)")


@block("block-closed-tiles")
def block_closed_tiles() -> str:
    return _block_closed_sweep("block_closed_configs-d128-20261205-015406.json",
                               "python benchmarks/block_closed_configs.py --head-dim 128 --rotary none "
                               "--only-with TILES --length 2048 --fill 0.7", "pinned (the listed configs: no TILES)")


@block("block-rotary-steps")
def block_rotary_steps() -> str:
    rows, sources = [], []
    for label, names in BLOCK_ROTARY_STEPS:
        for name in names:
            path, payload = load(name)
            sources.append((path, payload))
            for sh in payload["shapes"]:
                if _res(sh, "ours_no_rotary", "fwdbwd_ms") is None:
                    continue
                rows.append([label, cite(path), sh["label"],
                             _fwd_and_train_ms(sh, "ours_fused_rotary"),
                             _fwd_and_train_ms(sh, "ours_no_rotary"),
                             f(_speed(sh, "vs_flex", "fwdbwd"))])
    lines = ["CUDA-graph replays, `python benchmarks/block_attention.py --only claims --cuda-graph "
             "--head-dims 64` (then `128`) at each step. Sources: " + source_line(*sources), ""]
    lines += table(["step", "file", "shape", "ours, RoPE fused, ms fwd / fwd+bwd",
                    "ours, no RoPE, ms fwd / fwd+bwd", "x the faster Flex, fwd+bwd"], rows)
    return "\n".join(lines)


@block("gemm-epilogue")
def gemm_epilogue() -> str:
    path, payload = load("gemm_epilogue-20261204-163726.json")
    rows = []
    for c in payload["cases"]:
        for method, e in c["methods"].items():
            kernels = e.get("kernels") or []
            templates = any(k["kernel"].startswith("triton_tem") for k in kernels)
            err = e.get("grad_rel_err_vs_default")
            rows.append([f"{c['module']} T {c['tokens']} d {c['d']}", method, f(e.get("fwd_bwd_ms"), ".3f"),
                         f(e.get("gemm_tflops"), ".0f"), f(e.get("compile_s"), ".1f"),
                         "yes" if templates else "none", f(err, ".6f") if err is not None else "-"])
        rows.append([f"{c['module']} T {c['tokens']} d {c['d']}", "max-autotune / default, speed", "-",
                     f(c.get("max_autotune_speedup")), "-", "-", "-"])
    lines = [f"{payload['timing']}; {payload['dtype']}. Source: {source_line((path, payload))}", ""]
    lines += table(["case", "method", "fwd+bwd ms", "GEMM FLOPs / fwd+bwd time, TFLOP/s", "compile s",
                    "Triton GEMM templates in the kernel profile", "gradients vs default (rel.)"], rows)
    return "\n".join(lines)


# --- MXFP8 --------------------------------------------------------------------------------------------

def _mx_table(payload: dict, big_only: bool = True, share: bool = True) -> list[str]:
    rows = []
    for s in payload["shapes"]:
        if big_only and min(s["K"], s["N"]) < 4096:
            continue
        sp = s.get("speedup", {})
        row = [f"{s['M']} x {s['K']} x {s['N']}", f"{f(sp.get('fp8_fwd'))} / {f(sp.get('fp8_bwd'))}",
               f"{f(sp.get('fp8_op_fwd'))} / {f(sp.get('fp8_op_bwd'))}",
               f"{f(sp.get('fp8_gemm_fwd'))} / {f(sp.get('fp8_gemm_bwd'))}"]
        if share:
            qs = s.get("quantize_share") or {}
            row.append(f"{pct(qs.get('fwd'), '.0f')}% / {pct(qs.get('bwd'), '.0f')}%")
        rows.append(row)
    header = ["M x K x N", "fused pipeline x fwd / x bwd", "op x fwd / x bwd", "GEMM alone x fwd / x bwd"]
    return table(header + (["quantize share fwd / bwd"] if share else []), rows)


@block("mxfp8-linear")
def mxfp8_linear() -> str:
    path, payload = load("mxfp8_linear-20261130-043316.json")
    lines = [f"{payload.get('timing')}; ratios bf16 time / FP8 time, shapes with K, N of at least 4096. Source: "
             f"{source_line((path, payload))}", ""]
    lines += _mx_table(payload)
    s = max(payload["shapes"], key=lambda s: s["M"] * s["K"])
    q = s.get("quantize", {})
    lines += ["", f"Quantize kernels at {s['label']}: " + "; ".join(
        f"{k} {f(v.get('ms'), '.3f')} ms ({f(v.get('GB/s'), '.0f')} GB/s)" for k, v in q.items()) + "."]
    return "\n".join(lines)


MX_TRANSPOSE_CODES_AB = {
    "mxfp8_linear-shapes-20261206-113010.json": "bytes transposed",
    "mxfp8_linear-shapes-20261206-113033.json": "int32 codes, 1x128 copies",
    "mxfp8_linear-shapes-20261206-120904.json": "int32 codes, 1x128 and 128x128 copies",
}
"""The dual quantize's transposed copies: at 04a05f6 (bytes), with GEMCOMPILE_FP8_TRANSPOSE_CODES=1 (one lease),
and at 71e3343 with the 128x128 weight copy on the codes path too (a later lease)."""


@block("mx-transpose-codes-ab")
def mx_transpose_codes_ab() -> str:
    """The dual quantize's transposed copy, bytes transposed against int32 codes transposed (the default since
    2026-12-06)."""
    rows, items = [], []
    for name, how in MX_TRANSPOSE_CODES_AB.items():
        path, payload = load(name)
        items.append((path, payload))
        for s in payload["shapes"]:
            if s.get("skipped"):
                continue
            sp, q = s.get("speedup", {}), s.get("quantize", {})
            dual, w = q.get("dY 1x128 dual", {}), q.get("W 128x128 dual (W8 + W8^T)", {})
            rows.append([f"{s['M']} x {s['K']} x {s['N']}", how, f"{f(sp.get('fp8_fwd'))} / {f(sp.get('fp8_bwd'))}",
                         f"{f(sp.get('fp8_gemm_fwd'))} / {f(sp.get('fp8_gemm_bwd'))}",
                         f"{f(dual.get('ms'), '.3f')} ({f(dual.get('GB/s'), '.0f')} GB/s)",
                         f"{f(w.get('ms'), '.3f')} ({f(w.get('GB/s'), '.0f')} GB/s)"])
    lines = [f"{items[0][1].get('timing')}; ratios bf16 time / FP8 time; `python benchmarks/mxfp8_linear.py --shapes "
             f"32768x4096x4096,65536x4096x4096,32768x8192x8192,65536x4096x8192` at 04a05f6, where the byte "
             f"transpose was the default, then with `GEMCOMPILE_FP8_TRANSPOSE_CODES=1` in the same lease; the last "
             f"file is a later lease (two of the shapes) after the 128x128 weight copy took the codes path too. "
             f"Sources: {source_line(*items)}", ""]
    lines += table(["M x K x N", "transposed copies", "fused pipeline x fwd / x bwd", "GEMM alone x fwd / x bwd",
                    "dY 1x128 dual quantize ms", "W 128x128 dual quantize ms"], rows)
    return "\n".join(lines)


@block("mxfp8-gem-medium")
def mxfp8_gem_medium() -> str:
    path, payload = load("mxfp8_linear-gem-medium-20261204-181808.json")
    rows = []
    for s in payload["shapes"]:
        if s.get("skipped"):
            rows.append([f"{s['M']} x {s['K']} x {s['N']}", ", ".join(s.get("layers", [])), "skipped"]
                        + ["-"] * 3)
            continue
        sp, saved = s.get("speedup", {}), s.get("saved_ms_per_step") or {}
        rows.append([f"{s['M']} x {s['K']} x {s['N']}", ", ".join(f"`{x}`" for x in s.get("layers", [])),
                     str(s.get("calls_per_forward")),
                     f"{f(sp.get('fp8_op_fwd'))} / {f(sp.get('fp8_op_bwd'))}",
                     f"{f(sp.get('fp8_gemm_fwd'))} / {f(sp.get('fp8_gemm_bwd'))}",
                     f(saved.get("fp8_op"), ".2f")])
    lines = [f"{payload.get('timing')}; ratios bf16 time / FP8 time (above 1: FP8 faster); the shapes "
             f"GEM-ref medium's Linears run at batch 256, fill 0.5 ({payload.get('preset_source')}). Source: "
             f"{source_line((path, payload))}", ""]
    lines += table(["M x K x N", "layers", "calls a forward", "op x fwd / x bwd", "GEMM alone x fwd / x bwd",
                    "ms saved a step by the op (negative: lost)"], rows)
    return "\n".join(lines)


@block("mxfp8-linear-tile")
def mxfp8_linear_tile() -> str:
    path, payload = load("mxfp8_linear-tile-20261130-104329.json")
    lines = [f"The same benchmark with the one-pass tile kernel for the dual copies (since removed; not byte-exact on "
             f"the GPU). Source: {source_line((path, payload))}", ""]
    lines += _mx_table(payload, share=False)
    return "\n".join(lines)


@block("mx-dual-quant-ab")
def mx_dual_quant_ab() -> str:
    path, payload = load("mx_dual_quant_ab-20261130-070600.json")
    rows = [[r["case"], r["impl"], f(r["ms"], ".3f"), f(r["GB_per_s"], ".0f"), "yes" if r["same_bytes_as_other_impl"]
             else "no"] for r in payload["results"]]
    shape = payload["shape"]
    lines = [f"x {shape['M']} x {shape['K']} bf16, {payload.get('rule')}; written by an A/B script removed with the "
             f"tile kernel. Source: {source_line((path, payload))}", ""]
    lines += table(["copy", "kernel", "ms", "GB/s", "same bytes as the other kernel"], rows)
    return "\n".join(lines)


QUALITY_GPU = ["mxfp8_quality-gpu-small-blockwise-warmup-cosine-20261130-171810.json",
               "mxfp8_quality-gpu-small-mxfp8-warmup-cosine-20261130-172835.json",
               "mxfp8_quality-gpu-small-bf16-rerun-20261130-171807.json",
               "ne_vs_eager-gpu-small-300steps-warmup-cosine-20261130-171806.json"]


def _quality_rows(path: Path, payload: dict) -> list[list[str]]:
    rows = []
    for r in payload["runs"]:
        last = (r.get("checkpoints") or [{}])[-1]
        ev = last.get("eval_ne") or [None, None]
        rel_ = r.get("rel_eval_ne") or [None, None]
        rows.append([r["name"], cite(path), str(last.get("step", "-")),
                     f"{f(ev[0], '.5f')} ({pct(rel_[0], '.3f', sign=True)}%)",
                     f"{f(ev[1], '.5f')} ({pct(rel_[1], '.3f', sign=True)}%)",
                     f(r.get("max_loss"), ".3f"), "yes" if r.get("diverged") else "no"])
    return rows


def _quality_block(names: list[str], intro: str) -> str:
    rows, items = [], []
    for name in names:
        path, payload = load(name)
        rows += _quality_rows(path, payload)
        items.append((path, payload))
    lines = [intro + " Sources: " + source_line(*items), ""]
    lines += table(["run", "file", "step", "held-out NE CTR (vs the file's baseline)",
                    "held-out NE CVR (vs the file's baseline)", "max loss", "diverged"], rows)
    return "\n".join(lines)


@block("mxfp8-quality-gpu")
def mxfp8_quality_gpu() -> str:
    return _quality_block(QUALITY_GPU, "GEM-ref small, bf16 autocast, warm-up and cosine decay; each file's baseline is "
                                       "its first run.")


@block("mxfp8-quality-gpu-constant-lr")
def mxfp8_quality_gpu_constant() -> str:
    return _quality_block(["mxfp8_quality-20261130-123916.json", "mxfp8_quality-ctr2pct-20261130-121931.json"],
                          "GEM-ref small, bf16 autocast, constant learning rate, no warm-up.")


@block("mxfp8-quality-cpu")
def mxfp8_quality_cpu() -> str:
    return _quality_block(["mxfp8_quality-cpu-tiny-1000steps-20261130-124730.json",
                           "mxfp8_quality-cpu-tiny-300steps-cosine-20261130-155546.json",
                           "mxfp8_quality-cpu-tiny-20261130-092705.json",
                           "ne_vs_eager-cpu-tiny-300steps-20261130-150024.json",
                           "ne_vs_eager-cpu-tiny-300steps-cosine-20261130-155021.json"],
                          "CPU stand-ins: GEM-ref tiny, fp32, emulated recipes.")


# --- end to end ---------------------------------------------------------------------------------------

E2E_FILES = ["e2e-small-fill0.5-20261130-045136.json", "e2e-small-fill0.5-20261130-070225.json",
             "e2e-small-b1024-fill0.5-20261130-123647.json", "e2e-small-b1024-fill0.5-contended-20261130-145337.json",
             "e2e-medium-fill0.5-20261130-143850.json", "e2e-small-fill0.5-20261130-143200.json",
             "e2e-small-mxfp8-all-fill0.5-20261130-144014.json",
             "e2e-tiny-cpu-50steps-recompiles-20261130-180216.json"]


def _e2e_table(path: Path, payload: dict) -> list[str]:
    cfg = payload.get("config", {})
    rows = []
    for r in payload.get("results", []):
        if "error" in r:
            rows.append([r["method"], "failed"] + ["-"] * 8)
            continue
        rows.append([r["method"], f(r.get("samples_per_s"), ".0f"), f(r.get("useful_tflops"), ".1f"),
                     f"{pct(r.get('mfu'))}%" if r.get("mfu") is not None else "-",
                     f(r.get("speedup_vs_inductor")),
                     f"{f(r.get('kernel_ms_per_step'), '.1f')} / {f(r.get('step_ms_median'), '.1f')}",
                     f(r.get("compile_s"), ".0f"), str(r.get("recompiles_after_warmup", "-")),
                     f(r.get("peak_memory_gib"), ".1f")])
    head = [f"GEM-ref {cfg.get('size')}, batch {cfg.get('batch_size')}, fill {cfg.get('fill')}, {cfg.get('steps')} "
            f"measured steps, {cfg.get('device')} {cfg.get('dtype')}. Source: {source_line((path, payload))}", ""]
    return head + table(["method", "samples/s", "useful TFLOP/s", "MFU", "x torch.compile (samples/s)",
                         "kernel ms / step ms", "compile s", "recompiles after warm-up", "peak GiB"], rows)


@block("e2e-runs")
def e2e_runs() -> str:
    lines: list[str] = []
    for name in E2E_FILES:
        lines += _e2e_table(*load(name)) + [""]
    return "\n".join(lines).rstrip()


@block("e2e-kernel-classes")
def e2e_kernel_classes() -> str:
    rows = []
    for name in ("e2e-small-b1024-fill0.5-contended-20261130-145337.json", "e2e-medium-fill0.5-20261130-143850.json",
                 "e2e-small-fill0.5-20261130-143200.json", "e2e-small-mxfp8-all-fill0.5-20261130-144014.json"):
        path, payload = load(name)
        for r in payload["results"]:
            kp = r.get("kernel_profile") or {}
            by = kp.get("by_class_ms") or {}
            rows.append([cite(path), r["method"], f(kp.get("ms_per_step"), ".1f")]
                        + [f(by.get(c), ".1f") for c in ("gemm", "inductor", "gemcompile", "other", "copy")]
                        + [f(kp.get("kernels_per_step"), ".0f")])
    lines = ["Kernel time per step by class (torch.profiler), from the files' `kernel_profile`. These files record "
             "no GPU, torch, triton or date (written before the environment block reached `gemcompile bench e2e`).",
             ""]
    lines += table(["file", "method", "kernel ms / step", "GEMM", "Inductor Triton", "gemcompile Triton", "other",
                    "copies", "kernels / step"], rows)
    return "\n".join(lines)


E2E_MEDIUM_BEFORE_AFTER = [("before (2026-11-30)", "e2e-medium-fill0.5-20261130-143850.json"),
                           ("sparse tables (2026-12-01)", "e2e-medium-fill0.5-20261201-214826.json"),
                           ("+ packed fusion hints (2a07862)", "e2e-medium-fill0.5-20261202-214640.json"),
                           ("+ table batching (33ed1cb)", "e2e-medium-fill0.5-20261202-224724.json"),
                           ("+ token GEMMs (eb5aa10)", "e2e-medium-fill0.5-20261203-060217.json"),
                           ("+ padded sums' blocks (b83dbb7)", "e2e-medium-fill0.5-20261203-061809.json"),
                           ("+ parallel config compile (f3126db)", "e2e-medium-fill0.5-20261203-090042.json"),
                           ("+ direct CUDA calls (2349e45), peer cut", "e2e-medium-fill0.5-20261203-131812.json"),
                           ("+ sparse Adagrad host time, no JIT in a step (999fa8d)",
                            "e2e-medium-fill0.5-20261203-160229.json"),
                           ("+ CUDA graphs, attention packed under token buckets (9c2273e)",
                            "e2e-medium-fill0.5-20261204-031049.json"),
                           ("+ packed row reads, float32 weight-gradient GEMMs (ea9c6a1)",
                            "e2e-medium-fill0.5-20261204-054114.json"),
                           ("+ joint attention patterns traced only where they can match (5b6bcd0)",
                            "e2e-medium-fill0.5-20261204-134247.json"),
                           ("+ block attention rotary full width (`5560202`)",
                            "e2e-medium-fill0.5-20261204-141339.json"),
                           ("+ block attention four heads a program, one table load for R^T (4e1fb6f)",
                            "e2e-medium-fill0.5-20261204-162825.json"),
                           ("+ block attention three-stage configs (3ebb57d)",
                            "e2e-medium-fill0.5-20261204-181910.json"),
                           ("+ TritonAdam, packed attention outputs allocated empty (d83876d), on an H100",
                            "e2e-medium-fill0.5-20261206-144853.json")]
"""GEM-ref medium, B 256, fill 0.5: before issue 24, and after each of its steps (each row a file of its own
run; the peer re-run in every file)."""
KERNEL_CLASSES = ("gemm", "inductor", "gemcompile", "other", "copy")


@block("e2e-medium-before-after")
def e2e_medium_before_after() -> str:
    rows = []
    for label, name in E2E_MEDIUM_BEFORE_AFTER:
        path, payload = load(name)
        for r in payload["results"]:
            kp = r.get("kernel_profile") or {}
            by = kp.get("by_class_ms") or {}
            rows.append([label, cite(path), r["method"], f(r.get("samples_per_s"), ".0f"),
                         f(r.get("speedup_vs_inductor")), f"{pct(r.get('mfu'))}%", f(kp.get("ms_per_step"), ".1f")]
                        + [f(by.get(c), ".1f") for c in KERNEL_CLASSES]
                        + [f(kp.get("kernels_per_step"), ".0f"), f(r.get("peak_memory_gib"), ".1f")])
    lines = ["GEM-ref medium, batch 256, fill 0.5, one H200: before issue 24 and after its steps (sparse embedding "
             "tables and once-per-step length work; torch 2.11's fusion over packed buffers, passes/packed_size_hints.py; "
             "the tables' lookups in one call, passes/table_batching.py; GEMMs over packed tokens at bucketed "
             "sizes, passes/token_gemm.py; the static-shape block config for sums over packed tokens, "
             "passes/packed_reduction_blocks.py). Kernel ms per step by class (torch.profiler; `other` holds cuDNN's SDPA "
             "and torch's own CUDA kernels such as the optimizers' multi_tensor_apply). Plot: "
             "`docs/e2e_kernel_classes.png` (`python benchmarks/render_report.py --write --plot`). In the run after "
             "direct CUDA calls the peer was cut by the device call's time limit during its kernel profile (no ratio), and "
             "gem_compile's first measured step held a Triton JIT compile of the sparse Adagrad update kernel "
             "(`triton_compiles_after_warmup`: the kernel specialized on the alignment of a view whose offset is "
             "the step's id count), which lowers its mean; ee30311 removes that specialization (not re-measured "
             "here). The last run has both methods and no kernel profile (`--kernel-steps 0`, to fit the device call's "
             "limit; its kernel columns are empty): ee30311's fix and the embedding optimizer's host-time cuts "
             "(2349e45 to 999fa8d; `sparse-optimizer-host` in this file). The run after it is gem_compile under "
             "CUDA graphs (`gem@reduce-overhead`: unpad's token counts bucketed, so the attention ops stay on "
             "packed tokens with slack rows, d3c05b6, and only the slack rows filled, 9c2273e) against "
             "torch.compile's default mode, warm-up 20 steps, with a kernel profile. The next run is the same "
             "command at ea9c6a1: readers of a few rows of the sequence (the sequence summary's recent tokens) "
             "read the packed rows, passes/unpad_row_reads.py, so no sequence is scattered back to (B, N) rows; "
             "and weight gradients under autocast are float32 GEMM outputs, passes/fp32_gemm_out.py. At 5b6bcd0 "
             "the joint-graph attention pass stopped tracing its 36 patterns for graphs with no softmax over a "
             "batched matmul (GEM-ref's only softmax is its expert gate), which cut the compile (the files' "
             "`compile_phases` split it by torch phase and gemcompile pass, and `kernel_tuning.by_kernel` the "
             "autotuning by kernel). The last run (`5560202`) has block attention's rotary applied full width in "
             "its forward and backward (`_closed_fwd_kernel`, `_closed_bwd_kernel`), and a third method with "
             "the token_column_sums pass off: that pass took no sum on torch 2.11 at that commit (2.11 writes a "
             "bf16 sum with dtype=float32, which it did not match until 4b72e3e), so the two gem rows run the "
             "same graphs. The run after it (4e1fb6f) has block attention's four heads a program (e401e50) and "
             "its backward's R^T of dQ and dK from one load of the tables, and a third method with the "
             "token_column_sums pass on (`gem+token_column_sums`; off by default): it moved the bias-gradient "
             "sums from Inductor to torch's reduction kernels (`other`) and the step did not change. The last run is an "
             "H100 (no H200 came): its MFU counts against the same dense bf16 peak, and the peer's time is the "
             "H100's too, so its ratio compares the methods on that card, not with the H200 rows.", ""]
    lines += table(["run", "file", "method", "samples/s", "x torch.compile", "MFU", "kernel ms / step", "GEMM",
                    "Inductor Triton", "gemcompile Triton", "other", "copies", "kernels / step", "peak GiB"], rows)
    return "\n".join(lines)


def _captures(result: dict) -> str:
    """CUDA graphs captured inside measured steps ("-": a file from before they were recorded, or no
    @reduce-overhead)."""
    if "cuda_graph_captures_after_warmup" not in result or "reduce-overhead" not in result["method"]:
        return "-"
    return str(sum(n for _, n in result["cuda_graph_captures_after_warmup"]))


@block("e2e-small-steps")
def e2e_small_steps() -> str:
    rows = []
    for name in E2E_SMALL_STEPS:
        path, payload = load(name)
        for r in payload["results"]:
            steps = r.get("step_ms")
            rows.append([cite(path), code_of(payload["environment"]), str(payload["config"]["batch_size"]),
                         r["method"], f(r.get("samples_per_s"), ".0f"), f(r.get("speedup_vs_inductor")),
                         f(r.get("step_ms_median"), ".1f"), f(r.get("step_ms_mean"), ".1f"),
                         f(max(steps), ".1f") if steps else "-", f(r.get("kernel_ms_per_step"), ".1f"),
                         f(((r.get("kernel_profile") or {}).get("idle") or {}).get("idle_ms_per_step"), ".1f"),
                         str(payload["config"].get("warmup", "-")), _captures(r),
                         f(payload["environment"].get("load_average_1min"), ".1f")])
    lines = ["GEM-ref small, fill 0.5, one H200. samples/s is over the mean step. In the first run at batch 1024 "
             "gem_compile's median step was under half the peer's and its mean far above its median. The likely "
             "cause, read from the code (the file has no per-step times): kernels taking the packed token count "
             "as an argument compile again whenever a batch's count is the first one divisible by sixteen "
             "(Triton specializes int arguments on that); 8f4892e keeps those arguments unspecialized. The second "
             "run (only gem_compile finished before the session's device time ran out; a machine with a higher "
             "load, where the step is host-bound: GPU idle per step under the profiler) still had one slow step "
             "(slowest column); 35b2819 then freezes the compiled state for Python's collector after the warm-up "
             "(runtime/training/gc_policy.py). The third run (both methods, both fixes) still had one step of "
             "about two seconds (the eighth measured step, every other step under 200 ms), which no Dynamo "
             "recompile and no autotuning explains (recompiles 0, all autotuning inside the warm-up: "
             "kernel_tuning). 3c1db10 then records the Triton JIT compiles inside measured steps "
             "(triton_compiles_after_warmup) and keeps the sparse Adagrad kernels from specializing on the "
             "step's id count. The fifth run (gem_compile alone: the session's device time allowed no peer, so "
             "its ratio column is empty; the peer's two earlier runs read 3707 and 3646 samples/s) has no slow "
             "step and no JIT compile inside a step. At batch 256 (fourth run) both methods are host-bound: the "
             "GPU idles most of gem_compile's step, and the ratio is what each host needs to launch a step. The "
             "last two runs try CUDA graphs at batch 256 (`@reduce-overhead`, the peer's too; gem_compile with "
             "unpad's token counts rounded to 16 capacities, gem-token-buckets). In the sixth, gem_compile's "
             "failed: CUDA-graph trees found a tensor of a graph's memory pool that outlived the call (a cache "
             "inside our ops); 9605d02 makes those caches outside any graph pool (opkit.kept_tensor). In the "
             "seventh it runs, with 0 recompiles, but slower than without graphs: its GPU idles most of the step "
             "(GPU idle column), so the graphs as partitioned around our ops do not remove the host's time. The "
             "eighth is batch 1024 again with both methods at ec6c110 (no kernel profile: `--kernel-steps 0`), "
             "after the embedding optimizer's host-time cuts. Why the seventh's graphs did not pay (read on the "
             "H200 with TORCH_LOGS=cudagraphs): the bucketing was a separate op after the exact token index, so "
             "two graph partitions read the exact token count, and CUDA-graph trees recorded them, and every "
             "partition after them in the tree, at nearly every step. e893c59 buckets inside the index ops "
             "(no tensor of the exact count in the graph: the forward's one large partition and the backward's "
             "read only the two capacities) and turns buckets on by default when the compile captures CUDA "
             "graphs, so the ninth run's method is plain gem@reduce-overhead. At batch 256 it records 4 "
             "capacity pairs in all; its first measured step still recorded one (the warm-up of 10 steps had "
             "not drawn it: the slowest step), which lowers its mean and so its samples/s, not its median. "
             "The tenth to twelfth runs (gem_compile alone: each call's peer was cut by the call's time limit, "
             "so no ratio) take a longer warm-up: no capture inside a measured step at batch 256; at batch 1024 "
             "the graphs give nothing (the step is the GPU's). The thirteenth is batch 256 with all three methods and a "
             "warm-up of 20 steps, so that every capacity pair is recorded before the measured steps. The "
             "fourteenth profiles batch 1024 with and without CUDA graphs (gem_compile alone): under graphs "
             "the GPU idles "
             "only a few ms a step, but its kernel time is higher, mostly Inductor's gathers and scatters "
             "(index and index_put kernels): with token buckets on, the unpad pass kept every attention op a "
             "region boundary, so q, k and v were scattered to padded rows and the outputs gathered back. "
             "75f5490 kept the attention on packed tokens under buckets (block_attention gives the slack "
             "rows "
             "zero outputs and gradients; tested on the CPU, under the Triton interpreter and in the "
             "stack's compiled-vs-eager test). In the fifteenth run (75f5490) gem_compile's compile failed "
             "on the H200 (InductorError: GuardOnDataDependentSymNode, Eq(Max(1, u0), 1) on the bucketed size; "
             "the error is in the file's gem@reduce-overhead row), so the pass again kept attention a "
             "region boundary under buckets. The cause (found on the CPU from the error's origin, "
             "complex_memory_overlap: CUDA-graph trees compare the strides of every graph input): "
             "block_attention's packed lse was (H, T), so the unbacked token count stood in a stride "
             "(Max(1, u0)). d3c05b6 makes it (T, H), as jagged_attention's, tests every packed op's outputs "
             "for strides free of T, and packs attention under buckets again. The sixteenth run is batch "
             "1024 at d3c05b6 with a kernel profile (the index and index_put kernels of the fourteenth are "
             "gone); the seventeenth batch 256 at d3c05b6 with all three methods. Both still allocate the "
             "packed outputs with zeros (88 bf16 fills, 3.8 ms a step in the sixteenth's profile); "
             "9c2273e fills only the slack rows (measured in medium's run under CUDA graphs, "
             "e2e-medium-before-after: 28 fill kernels, 0.66 ms a step; small not re-measured).", ""]
    lines += table(["file", "code", "batch", "method", "samples/s", "x torch.compile", "median step ms",
                    "mean step ms", "slowest step ms", "kernel ms / step", "GPU idle ms / step", "warm-up steps",
                    "CUDA graphs captured in measured steps", "load average"],
                   rows)
    return "\n".join(lines)


def render_kernel_class_plot(plt, path: Path = REPO / "docs" / "e2e_kernel_classes.png") -> Path:
    """Stacked bars: GPU ms per step by kernel class, per method, before and after (E2E_MEDIUM_BEFORE_AFTER)."""
    bars = []
    for label, name in E2E_MEDIUM_BEFORE_AFTER:
        _, payload = load(name)
        for r in payload["results"]:
            by = (r.get("kernel_profile") or {}).get("by_class_ms")
            if by:  # a run without a kernel profile has no bar (not a bar of zeros)
                bars.append((f"{r['method']}, {label}", [by.get(c, 0.0) for c in KERNEL_CLASSES]))
    fig, ax = plt.subplots(figsize=(11, 5.5))
    bottoms = [0.0] * len(bars)
    for i, cls in enumerate(KERNEL_CLASSES):
        heights = [ms[i] for _, ms in bars]
        ax.bar(range(len(bars)), heights, bottom=bottoms, label=cls)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    ax.set_xticks(range(len(bars)), [name for name, _ in bars], fontsize=7, rotation=30, ha="right")
    ax.set_ylabel("GPU ms per step (torch.profiler)")
    ax.set_title("GEM-ref medium, B 256, fill 0.5, H200 (the last pair: H100): GPU time by kernel class", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


# --- unpad -------------------------------------------------------------------------------------------

UNPAD_FILES = ["unpad-20261130-063658.json", "unpad-20261130-065003.json", "unpad-20261130-082656.json",
               "unpad-b1024-20261130-104556.json", "unpad-b1024-pad-reductions-20261130-105705.json",
               "unpad-b1024-20261130-123137.json"]


@block("unpad-runs")
def unpad_runs() -> str:
    lines: list[str] = []
    for name in UNPAD_FILES:
        path, payload = load(name)
        cfg = payload.get("config", {})
        rows = [[r["method"], str(r["fill"]), f(r.get("padding_efficiency"), ".3f"), f(r.get("ms_per_step"), ".1f"),
                 f(r.get("ms_per_step_min"), ".1f"), f(r.get("kernel_ms_per_step"), ".1f"),
                 str(r.get("recompiles", "-")), f(r.get("peak_memory_gib"), ".1f")]
                for r in payload["results"] if "error" not in r]
        lines += [f"Batch {cfg.get('batch_size')}. Source: {source_line((path, payload))}", ""]
        lines += table(["method", "fill", "padding efficiency", "ms / step (events, median)", "fastest step ms",
                        "kernel ms / step", "recompiles", "peak GiB"], rows)
        ratios = payload.get("ratios") or {}
        parts = []
        for fill, rr in ratios.items():
            got = [f"{k.replace('_', ' ')} {f(v)}" for k, v in rr.items() if isinstance(v, (int, float))]
            if got:
                parts.append(f"fill {fill}: " + ", ".join(got))
        if parts:
            lines += ["", "Ratios in the file (peer ms / gem ms): " + "; ".join(parts) + "."]
        lines += [""]
    return "\n".join(lines).rstrip()


@block("unpad-profile")
def unpad_profile() -> str:
    path, payload = load("unpad-profile-20261130-064413.json")
    rows = []
    for variant, v in payload.get("variants", {}).items():
        top = v.get("top_kernels_ms_per_step") or []
        first = ", ".join(f"{name[:40]} {f(ms, '.2f')}" for name, ms in top[:3])
        rows.append([variant, f(v.get("ms_per_step"), ".1f"), f(v.get("gpu_kernel_ms_per_step"), ".1f"), first or "-"])
    lines = [f"Fill {payload.get('fill')}. Source: {source_line((path, payload))}", ""]
    lines += table(["variant", "ms / step", "kernel ms / step", "largest three kernels (ms / step)"], rows)
    return "\n".join(lines)


# --- parallel scaling, refactor A/B, data masks -----------------------------------------------------------

@block("parallel-scaling")
def parallel_scaling() -> str:
    rows, items = [], []
    for name in ("parallel_scaling-20261130-075314.json", "parallel_scaling-20261130-080018.json",
                 "parallel_scaling-20261130-081802.json"):
        path, payload = load(name)
        items.append((path, payload))
        by = {r["world"]: r for r in payload["runs"]}
        one, two = by.get(1, {}), by.get(2, {})
        rows.append([cite(path), f(one.get("step_ms"), ".1f"), f(two.get("step_ms"), ".1f"),
                     f"{f(one.get('samples_per_s_per_gpu'), '.0f')} / {f(two.get('samples_per_s_per_gpu'), '.0f')}",
                     f(payload.get("scaling_ratio"), ".3f"),
                     "yes" if two.get("collectives_as_planned") else "no"])
    lines = ["GEM-ref small, eager, bf16 autocast, the same per-GPU batch at world 1 (plain model) and world 2 (the "
             "plan); step time is the slowest rank's. Sources: " + source_line(*items), ""]
    lines += table(["run", "world 1 ms", "world 2 ms", "samples/s per GPU (1 / 2)", "scaling ratio",
                    "collectives as planned"], rows)
    prow = []
    for path, payload in items:
        for r in payload["runs"]:
            ph = r.get("phase_ms_synchronized") or {}
            prow.append([cite(path), str(r["world"])] + [f(ph.get(k), ".1f") for k in ("forward", "backward", "gradients",
                                                                                      "optimizer")]
                        + [", ".join(f"{k} {v}" for k, v in (r.get("collectives_observed") or {}).items()) or "-",
                           " / ".join(f(x, ".1f") for x in r.get("peak_memory_gib_per_rank") or []) or "-"])
    lines += ["", "Synchronized phase split (ms a step), collectives observed in one step, peak memory per rank (GiB):",
              ""]
    lines += table(["run", "world", "forward", "backward", "gradients", "optimizer", "collectives observed",
                    "peak GiB per rank"], prow)
    return "\n".join(lines)


def _refactor_ab_tables(names) -> str:
    lines = []
    for name in names:
        path, payload = load(name)
        rows = [[r["case"], r["metric"], f(r["before_ms"], ".3f"), f(r["after_ms"], ".3f"), f(r["after_over_before"], ".3f")]
                for r in payload["rows"]]
        lines += [f"{payload.get('repeats_done')} rounds. Source: {source_line((path, payload))}", ""]
        lines += table(["op", "metric", "before ms", "after ms", "after / before"], rows) + [""]
    return "\n".join(lines).rstrip()


@block("refactor-ab")
def refactor_ab() -> str:
    return _refactor_ab_tables(("refactor_ab-20261201-165639.json", "refactor_ab-20261201-170317.json"))


@block("block-rotary-ab")
def block_rotary_ab() -> str:
    """Block attention's closed kernels with rotary applied full width: the tree before (halves) against the
    backward's R^T by tl.gather (140600, the code kept) and by a second dot (140743); then four heads per
    program as an autotune option (142844, before = the full-width tree)."""
    return _refactor_ab_tables(("refactor_ab-20261204-140600.json", "refactor_ab-20261204-140743.json",
                                "refactor_ab-20261204-142844.json"))


DATA_MASK_FILES = ["data_masks-20261201-190904.json", "data_masks-20261202-000141.json",
                   "data_masks-20261202-005728.json", "data_masks-20261202-010423.json",
                   "data_masks-20261202-023253.json", "data_masks-20261202-025640.json"]
"""Oldest first. 000141 adds the GPU's own time per step; 005728 and 010423 are after unpad packs SASRec's
tokens from its data mask and key bounds take one launch (005728 was cut after its SASRec rows); 023253 adds
both methods under CUDA graphs (reduce-overhead; each step drops the last step's grads); 025640 is after the
op host-time cuts (kernels at the CUDA dispatch key, direct launches of seen specializations), at B 128."""


def _data_masks(name: str = DATA_MASK_FILES[-1]) -> tuple[Path, dict]:
    return load(name)


def _data_mask_rows(path: Path, payload: dict) -> list[list[str]]:
    rows = []
    for m in payload["models"]:
        shape = f"B{m['batch']} L{m['length']} H{m['heads']}x{m['head_dim']}, {m['layers']} layers"
        rows.append([cite(path), shape, m["model"], m["padding"],
                     ", ".join(f"{v} {k}" for k, v in (m.get("rewrites") or {}).items()),
                     f(m.get("inductor_ms"), ".2f"), f(m.get("gem_ms"), ".2f"), f(m.get("speedup_gem_vs_inductor")),
                     f"{f(m.get('inductor_kernel_ms'), '.2f')} / {f(m.get('gem_kernel_ms'), '.2f')}",
                     f"{m.get('inductor_recompiles')} / {m.get('gem_recompiles')}",
                     f"{f(m.get('inductor-cudagraphs_ms'), '.2f')} / {f(m.get('gem-cudagraphs_ms'), '.2f')}",
                     f(m.get("speedup_gem-cudagraphs_vs_inductor-cudagraphs"))])
    return rows


@block("data-masks")
def data_masks() -> str:
    loaded = [load(name) for name in DATA_MASK_FILES]
    rows = [r for path, payload in loaded for r in _data_mask_rows(path, payload)]
    lines = ["Sources: " + "; ".join(source_line(item) for item in loaded), "",
             "Step = forward (bf16 autocast) + backward, CUDA events, median; GPU ms = the summed kernel time of a "
             "step (torch.profiler): where it is far below the step time, the host sets the pace. CUDA graphs: both "
             "methods compiled with mode=\"reduce-overhead\" (\"-\": not run in that file).", ""]
    lines += table(["file", "shape", "model", "padding", "rewrites", "torch.compile ms / step",
                    "gem_compile ms / step", "gem vs torch.compile", "GPU ms / step (torch.compile / gem)",
                    "recompiles (torch.compile / gem)", "CUDA graphs ms / step (torch.compile / gem)",
                    "gem vs torch.compile, CUDA graphs"], rows)
    krows = []
    for path, payload in loaded:
        for k in payload["kernel"]:
            krows.append([cite(path), f"B{k['B']} L{k['L']} H{k['H']} D{k['D']}, "
                                      f"{'causal' if k['causal'] else 'not causal'}",
                          f"{f(k['lengths_ms'], '.3f')} / {f(k['lengths_graph_ms'], '.3f')}",
                          f"{f(k['mask_right_ms'], '.3f')} / {f(k['mask_right_graph_ms'], '.3f')}",
                          f"{f(k['mask_right_vs_lengths'])} / {f(k['mask_right_vs_lengths_graph'])}",
                          f"{f(k['mask_left_ms'], '.3f')} / {f(k['mask_left_graph_ms'], '.3f')}"])
    lines += ["", "gemcompile::jagged_attention forward+backward, key padding given as lengths or as a kv_mask of the "
                  "same keys:", ""]
    lines += table(["file", "shape", "lengths ms (eager / graph)", "kv_mask right ms (eager / graph)",
                    "kv_mask right / lengths (eager / graph)", "kv_mask left ms (eager / graph)"], krows)
    return "\n".join(lines)


DATA_MASK_VARYING_FILES = ["data_masks-varying-lengths-20261207-103641.json",
                           "data_masks-varying-lengths-20261207-104129.json",
                           "data_masks-varying-lengths-20261207-104213.json",
                           "data_masks-varying-lengths-20261207-104250.json"]
"""Session 34 (one H100): each batch padded to its own length, so the first steps compile a static graph and
then the dynamic one (unpad packs it since 1f9a9f1); gem with unpad off beside it. Four runs of one command
but for the warm-up and the host profile (104129), to show the run-to-run spread of the host-bound step."""


@block("data-masks-varying-lengths")
def data_masks_varying_lengths() -> str:
    loaded = [load(name) for name in DATA_MASK_VARYING_FILES]
    rows = []
    for path, payload in loaded:
        args = payload["args"]
        for m in payload["models"]:
            rows.append([cite(path), f"B{m['batch']} N<={m['length']} H{m['heads']}x{m['head_dim']}, {m['layers']} layers",
                         ", ".join(str(n) for n in m["padded_lengths"]), f"{args['warmup']} / {args['steps']}",
                         f(m.get("inductor_ms"), ".2f"), f(m.get("gem_ms"), ".2f"), f(m.get("gem-unpad-off_ms"), ".2f"),
                         f"{f(m.get('inductor_kernel_ms'), '.2f')} / {f(m.get('gem_kernel_ms'), '.2f')} / "
                         f"{f(m.get('gem-unpad-off_kernel_ms'), '.2f')}",
                         f(m.get("speedup_gem_vs_inductor")), f(m.get("speedup_gem_vs_gem-unpad-off")),
                         f"{m.get('inductor_recompiles')} / {m.get('gem_recompiles')} / {m.get('gem-unpad-off_recompiles')}"])
    lines = ["Sources: " + "; ".join(source_line(item) for item in loaded), "",
             "SASRec-style stack (model sasrec, right padding), each batch padded to its own length: torch.compile's "
             "automatic dynamic shapes compile the first batch static and the next one with symbolic B and N. "
             "Step = forward (bf16 autocast) + backward, CUDA events, median over the timed steps; GPU ms = summed kernel time of a "
             "step (torch.profiler). `gem unpad off`: gem_compile with UnpadConfig.enabled=False.", ""]
    lines += table(["file", "shape", "padded lengths of the batches", "warm-up / timed steps", "torch.compile ms / step",
                    "gem ms / step", "gem unpad off ms / step", "GPU ms / step (torch.compile / gem / unpad off)",
                    "gem vs torch.compile", "gem vs unpad off", "recompiles after warm-up"], rows)
    return "\n".join(lines)


MASKED_ITEM_LOSS_FILES = ["masked_item_loss-20261207-165151.json", "masked_item_loss-20261207-165035.json",
                          "masked_item_loss-20261207-172025.json"]
"""BERT4Rec's step without and with dropout (H100, 2026-12-07): the second at a tree whose packed dropout did
not trace on torch 2.11, the third after 23c6abd (random numbers drawn for the padded rows there)."""


@block("masked-item-loss")
def masked_item_loss() -> str:
    loaded = [load(name) for name in MASKED_ITEM_LOSS_FILES]
    rows = []
    for path, payload in loaded:
        row, args = payload["rows"][0], payload["args"]
        for method in args["methods"].split(","):
            rows.append([cite(path), f(args["dropout"], ".1f"), method, f(row.get(f"{method}_ms"), ".2f"),
                         "1.00" if method.startswith("inductor") else f(row.get(f"speedup_{method}_vs_inductor")),
                         f(row.get(f"{method}_kernel_ms"), ".2f"), f(row.get(f"{method}_peak_gib"), ".2f"),
                         f(row.get(f"{method}_first_loss"), ".4f")])
    first = loaded[0][1]["args"]
    lines = ["Sources: " + "; ".join(source_line(item) for item in loaded), "",
             f"B {first['batch']}, N {first['length']}, {first['items']} items, hidden {first['hidden']}, "
             f"{first['layers']} layers, fill {first['fill']}, {first['mask_prob']:.0%} of the valid positions masked "
             f"({loaded[0][1]['rows'][0]['masked_positions']:.0f} labelled rows of {loaded[0][1]['rows'][0]['tokens']} "
             "on average). Step = forward (bf16 autocast) + backward, CUDA events, median; GPU ms = summed kernel "
             "time of a step (torch.profiler). Ratios against torch.compile in the same mode (`-cudagraphs`: "
             "mode=\"reduce-overhead\"). explain of the model (default GemConfig) at each run's tree: "
             + "; ".join(f"{cite(path)}: " + ", ".join(f"{k} {v}" for k, v in payload["rows"][0]["explain"].items())
                         for path, payload in loaded) + ".", ""]
    lines += table(["file", "dropout", "method", "ms / step", "x torch.compile", "GPU ms / step", "peak GiB",
                    "first loss"], rows)
    return "\n".join(lines)


DIN_POOLING = "din_pooling-20261207-193251.json"


@block("din-pooling")
def din_pooling() -> str:
    path, payload = load(DIN_POOLING)
    args = payload["args"]
    rows = []
    for row in payload["rows"]:
        for method in args["methods"].split(","):
            rows.append([row["form"], method, f(row.get(f"{method}_ms"), ".2f"),
                         "1.00" if method.startswith("inductor") else f(row.get(f"speedup_{method}_vs_inductor")),
                         f(row.get(f"{method}_kernel_ms"), ".2f"), f(row.get(f"{method}_peak_gib"), ".2f"),
                         f(row.get(f"{method}_first_loss"), ".4f")])
    first = payload["rows"][0]
    lines = ["Source: " + source_line((path, payload)), "",
             f"B {args['batch']}, history N {args['length']}, {args['items']} items, dim {args['dim']}, attention "
             f"unit {args['att_hidden']}, top MLP {args['top_hidden']}, fill {args['fill']} "
             f"({first['valid_tokens']:.0f} valid history items of {first['tokens']} on average). Step = forward "
             "(bf16 autocast) + backward, CUDA events, median; GPU ms = summed kernel time of a step "
             "(torch.profiler). Ratios against torch.compile in the same mode (`-cudagraphs`: "
             "mode=\"reduce-overhead\"). explain per form: "
             + "; ".join(f"{r['form']}: " + ", ".join(f"{k} {v}" for k, v in r["explain"].items())
                         for r in payload["rows"]) + ".", ""]
    lines += table(["form", "method", "ms / step", "x torch.compile", "GPU ms / step", "peak GiB", "first loss"],
                   rows)
    return "\n".join(lines)


OP_HOST_TIME_FILES = ["op_host_time-20261202-024518.json", "op_host_time-20261202-025630.json"]
"""Before (6ba9ad2) and after (b67ea93) the op host-time cuts: CUDA kernels at the dispatcher's CUDA key
(opkit.cuda_kernel) and direct launches of seen specializations (common/tuned_launch.py)."""


GEMM_HOST_TIME = "gemm_host_time-20261203-005811.json"


@block("gemm-host-time")
def gemm_host_time() -> str:
    path, payload = load(GEMM_HOST_TIME)
    rows = [[r["library"], str(r["k"]), str(r["n"]), "addmm" if r["bias"] else "mm", f(r["new_m_us"], ".0f"),
             f(r["new_m_max_us"], ".0f"), f(r["seen_m_us"], ".0f"), f(r["bucketed_m_us"], ".0f")]
            for r in payload["rows"]]
    lines = [f"Host time of one bf16 GEMM call at a row count M cuBLAS has not seen ({cite(path)}, "
             "`python benchmarks/gemm_host_time.py`; the GPU idle before each call, median of 20 calls, us): "
             "packed tokens make M new at every step. `bucketed`: M from a few fixed sizes, each seen "
             "once before, what passes/token_gemm.py asks of cuBLAS. The first row's max holds the process's first GEMM (cuBLAS's set-up).", ""]
    lines += table(["preferred library", "K", "N", "op", "new M", "new M, max", "seen M", "bucketed M"], rows)
    return "\n".join(lines)


TOKEN_SUM_REDUCTION = "token_sum_reduction-20261203-020406.json"


@block("token-sum-reduction")
def token_sum_reduction() -> str:
    path, payload = load(TOKEN_SUM_REDUCTION)
    rows = [[r["case"], f(r.get("ms"), ".3f"), f(r.get("tb_per_s"), ".2f")] for r in payload["rows"]]
    lines = [f"A norm-weight gradient, the sum over {payload['tokens']} tokens of a bf16 ({payload['tokens']}, "
             f"{payload['dim']}) product, compiled by Inductor with the token count known four ways "
             f"({cite(path)}, `python benchmarks/token_sum_reduction.py`; median ms of CUDA-event timings). "
             "`_padded`: padded to the static bound first (unpad_reductions, torch 2.11). `_xA_rB_wC`: a fixed "
             "block config (XBLOCK, R0_BLOCK, warps) through an InductorChoices; passes/packed_reduction_blocks.py "
             "gives padded sums over packed tokens the static-shape config (here x32_r64_w4) and leaves unsplit "
             "sums to Inductor.", ""]
    lines += table(["case", "ms", "TB/s read"], rows)
    return "\n".join(lines)


@block("op-host-time")
def op_host_time() -> str:
    loaded = [load(name) for name in OP_HOST_TIME_FILES]
    cases = {}
    for i, (_, payload) in enumerate(loaded):
        for c in payload["cases"]:
            if c["case"] == "key_bounds":
                cases.setdefault(("key_bounds", ""), [None, None])[i] = c["host_us"]
                continue
            for part in ("fwd", "bwd"):
                cases.setdefault((c["case"], part), [None, None])[i] = c[f"{part}_host_us"]
    rows = [[case, part, f(a, ".0f"), f(b, ".0f")] for (case, part), (a, b) in cases.items()]
    args = loaded[0][1]["args"]
    lines = ["Sources: " + source_line(*loaded), "",
             f"Host microseconds per call (no sync in the timed loop), B{args['batch']} H{args['heads']} "
             f"L{args['length']} D{args['head_dim']} bf16, through torch.ops as a compiled graph calls them. One "
             "run each; how much host timings vary between runs of one commit was not measured.", ""]
    lines += table(["case", "op", f"before us ({rel(loaded[0][0]).split('/')[-1]})",
                    f"after us ({rel(loaded[1][0]).split('/')[-1]})"], rows)
    return "\n".join(lines)


ACTIVATION_MEMORY_FILES = ["activation_memory-medium-b256-20261202-050426.json",
                           "activation_memory-medium-b256-20261202-053105.json",
                           "activation_memory-medium-b256-20261202-054045.json",
                           "activation_memory-medium-b256-20261202-082235.json",
                           "activation_memory-medium-b256-20261202-133527.json",
                           "activation_memory-medium-b256-20261202-160745.json",
                           "activation_memory-medium-b256-20261202-162316.json",
                           "activation_memory-medium-b256-20261202-163314.json"]
"""Issue 26's H200 runs (2026-12-02): static compiles per method (050426, 054045), one run of --together,
dynamic-batch programs (053105, cut by its command's time limit after gem), the first run after the
partitioner sized packed tokens at unpad's hint, with CUDA memory snapshots (082235), gem beside budget
0.5 after packed attention and the gradients cleared before the forward (133527), the snapshots that placed
budget 0.5's peak in the backward with gemcompile's partitioner at budget 1 equal to gem (160745), and the
cost curve after Inductor's peak-memory reordering sized packed tensors at unpad's hint (162316, 163314)."""

CURVE_FILES = ACTIVATION_MEMORY_FILES[-2:]
"""The cost curve at one commit (325a9da): two runs of one lease, gem in each."""


def _code(payload: dict) -> str:
    """The code a run measured: its git commit and the digest of its sources (results.source_digest), which
    names the code even where the commit field does not (a device copy whose git HEAD lagged its files)."""
    env = payload.get("environment", {})
    return f"`{str(env.get('git_commit') or '-')[:7]}` / `{str(env.get('source_digest') or '-')[:8]}`"


def _snapshot_rows(name: str, payload: dict) -> list[list[str]]:
    rows = []
    for r in payload["curve"]["results"]:
        snap = r.get("memory_snapshot") or {}
        at_peak, state = snap.get("at_peak") or {}, snap.get("model_state") or {}
        if not at_peak:
            continue
        kinds = at_peak.get("by_kind_gib", {})
        where = (snap.get("peak_event") or {}).get("where", "-")
        rows.append([f"`{name}`", r["method"], f(snap.get("peak_allocated_gib")),
                     f(at_peak.get("before_step_gib")), f(at_peak.get("step_gib")),
                     f(kinds.get("inductor_buffers")), f(state.get("parameters_gib")),
                     f(state.get("gradients_gib")), f(state.get("optimizer_state_gib")), f"`{where}`"])
    return rows


@block("activation-memory")
def activation_memory() -> str:
    loaded = [load(name) for name in ACTIVATION_MEMORY_FILES]
    rows, tries, snapshots = [], [], []
    for path, payload in loaded:
        name = rel(path).split("/")[-1]
        snapshots += _snapshot_rows(name, payload)
        dynamic = any(m.get("compile") == "dynamic" for m in payload["largest_batch"].get("methods", []))
        ratios = {row["method"]: row for row in payload["curve"].get("rows", [])}
        for r in payload["curve"]["results"]:
            if r.get("outcome") != "fits":
                continue
            ratio = ratios.get(r["method"], {})
            rows.append([f"`{name}`", _code(payload), r["method"], str(r["batch_size"]),
                         "dynamic batch" if dynamic else "static",
                         f(r.get("peak_memory_gib")), f(r.get("peak_memory_steady_gib")),
                         f(ratio.get("peak_memory_ratio_vs_gem"), ".3f"), f(r.get("step_ms_median"), ".1f"),
                         f(ratio.get("step_time_ratio_vs_gem"), ".3f"), pct(r.get("mfu")),
                         f(r.get("compile_s"), ".0f")])
        for m in payload["largest_batch"].get("methods", []):
            for t in m.get("try_results", []):
                tries.append([f"`{name}`", m["method"], str(t.get("batch_size")), t.get("outcome", "-"),
                              f(t.get("peak_memory_gib")), f(t.get("step_ms_median"), ".1f"), pct(t.get("mfu")),
                              str(t.get("graphs_compiled", "-"))])
    lines = ["Sources: " + source_line(*loaded), "",
             "GEM-ref medium, fill 0.5, one H200, bf16 autocast, trained as `gemcompile bench e2e` trains it. "
             "Peak: CUDA max allocated over warm-up and measured steps; steady: over the measured steps only "
             "(recorded from 0a1d77c on). Each row is one method in one process; rows of different files ran "
             "on different leases of the machine.", ""]
    lines += table(["file", "code (commit / sources)", "method", "batch", "compile", "peak GiB", "steady GiB",
                    "x gem peak", "step ms", "x gem step", "MFU %", "compile s"], rows)
    if snapshots:
        lines += ["", "CUDA memory snapshot of one more step (`--memory-snapshot`): the peak, what was allocated "
                  "before the step and what the step itself held there (Inductor's buffers among it), the model's "
                  "state, and the allocation that reached the peak:", ""]
        lines += table(["file", "method", "peak GiB", "before the step", "the step's", "Inductor buffers",
                        "parameters", "gradients", "optimizer state", "peak reached at"], snapshots)
    if tries:
        lines += ["", "Largest-batch tries (a batch beyond the curve's):", ""]
        lines += table(["file", "method", "batch", "outcome", "peak GiB", "step ms", "MFU %",
                        "graphs compiled in the try"], tries)
    return "\n".join(lines)


LARGEST_BATCH_E2E = ["e2e-medium-fill0.5-20261202-132411.json", "e2e-medium-fill0.5-20261202-132710.json",
                     "e2e-medium-fill0.5-20261202-132000.json", "e2e-medium-fill0.5-20261202-132935.json"]
"""``gemcompile bench e2e --size medium --batch-size B --methods M --steps 3 --warmup 2``, one command per
batch, on one lease (2026-12-02): the batches that bracket each method's largest fitting batch."""


@block("activation-memory-largest-batch")
def activation_memory_largest_batch() -> str:
    loaded = [load(name) for name in LARGEST_BATCH_E2E]
    rows, fits, fails = [], {}, {}
    for path, payload in loaded:
        batch = payload["config"]["batch_size"]
        for r in payload["results"]:
            error = r.get("error")
            oom = bool(error) and "out of memory" in error.lower()
            outcome = "fits" if not error else ("CUDA out of memory" if oom else "error: " + error[:60])
            if not error:
                fits[r["method"]] = max(fits.get(r["method"], 0), batch)
            elif oom:
                fails[r["method"]] = min(fails.get(r["method"], batch), batch)
            rows.append([cite(path), _code(payload), r["method"], str(batch), outcome,
                         f(r.get("peak_memory_gib")), f(r.get("samples_per_s"), ".0f"), pct(r.get("mfu")),
                         f(r.get("compile_s"), ".0f")])
    lines = ["Sources: " + source_line(*loaded), "",
             "GEM-ref medium, fill 0.5, one H200, bf16 autocast, static shapes, 2 warm-up and 3 measured "
             "steps per command; peak: CUDA max allocated.", ""]
    lines += table(["file", "code (commit / sources)", "method", "batch", "outcome", "peak GiB", "samples/s",
                    "MFU %", "compile s"], rows)
    gem_fail = fails.get("gem")
    for method, batch in fits.items():
        if method != "gem" and gem_fail:
            lines += ["", f"`{method}` trains at batch {batch}; gem does not fit at batch {gem_fail} (its largest batch "
                          f"is at least {fits.get('gem', '-')} and below {gem_fail}). Neither bracket was narrowed "
                          "further."]
    return "\n".join(lines)


ACTIVATION_MEMORY_QUALITY = "mxfp8_quality-20261202-131258.json"


@block("activation-memory-quality")
def activation_memory_quality() -> str:
    path, payload = load(ACTIVATION_MEMORY_QUALITY)
    lines = [_quality_block([ACTIVATION_MEMORY_QUALITY],
                            "GEM-ref small, batch 256, 300 steps, bf16 autocast, warm-up 30 steps then cosine decay; "
                            "bf16 seeds 1 and 2 differ from the baseline (bf16 seed 0) only in initialization, "
                            "gem+fp8-saved has seed 0's initialization."), ""]
    floor = payload.get("noise_floor")
    for name, v in payload.get("verdict", {}).items():
        lines.append(f"`{name}`: {v.get('saved_in_fp8')} tensors reached the backward in FP8; held-out NE gap to the "
                     f"baseline {pct(v['rel_ne'][0], '.3f', sign=True)}% (CTR) and {pct(v['rel_ne'][1], '.3f', sign=True)}% (CVR) "
                     f"against a seed-to-seed noise floor of {pct(floor, '.3f')}%: within the noise floor: "
                     f"{'yes' if v.get('within_noise_floor') else 'no'}; diverged: {'yes' if v.get('diverged') else 'no'}.")
    return "\n".join(lines)


# --- GPU test logs ------------------------------------------------------------------------------------

def gpu_test_logs() -> list[Path]:
    return sorted((RESULTS / "gpu-tests").glob("*.json"))


@block("gpu-tests")
def gpu_tests() -> str:
    logs = gpu_test_logs()
    if not logs:
        return ("No GPU test log is committed yet, so no GPU test outcome is claimed here. `python "
                "benchmarks/gpu_tests.py` runs `tests/gpu` with `pytest --junitxml` and writes the XML and a summary "
                "into `benchmarks/results/gpu-tests/`; this block then renders the counts from it.")
    lines = []
    for path in logs:
        payload = json.loads(path.read_text())
        xml = path.with_suffix(".xml")
        rows = [[file, str(c["tests"]), str(c["passed"]), str(c["failed"]), str(c["errors"]), str(c["skipped"])]
                for file, c in payload["by_file"].items()]
        cut = (" Cut by its time limit: the tests that had not finished are in no count."
               if payload.get("complete") is False else "")
        lines += [f"Source: {cite(path)} and {cite(xml)} ({env_line(path, payload)}).{cut}", ""]
        lines += table(["file", "tests", "passed", "failed", "errors", "skipped"], rows) + [""]
    return "\n".join(lines).rstrip()


# --- attention dropout -------------------------------------------------------------------------------

DROPOUT_METHODS = ["gemcompile", "gemcompile_dropout", "sdpa_padded_dropout", "njt_sdpa_dropout"]
# profiled before the methods had run once (fixed since: rows say kernels_warmed_up); their ms are timed warm
DROPOUT_KERNELS_UNWARMED = {"attention_dropout-cudagraph-20261205-150839.json",
                            "attention_dropout-cudagraph-20261205-150917.json"}


@block("attention-dropout")
def attention_dropout() -> str:
    """Every attention_dropout*.json: fwd+bwd ms per method, dropout's cost, the peers' time over ours, and the
    three largest kernels of ours with and without dropout."""
    paths = sorted(RESULTS.glob("attention_dropout*.json"))
    if not paths:
        return "No attention dropout timing is committed yet."
    lines = []
    for path in paths:
        payload = json.loads(path.read_text())
        rows = []
        for r in payload.get("rows", []):
            ms = r.get("ms", {})
            eager = set(r.get("eager", []))
            rows.append([f"B{r['B']} L{r['L']} H{r['H']} D{r['D']} fill {r.get('realised_fill')} p {r.get('p')}"]
                        + [f(ms.get(m), ".2f") + (" (eager)" if m in eager else "") for m in DROPOUT_METHODS]
                        + [f(r.get("dropout_cost"))]
                        + [f((r.get("speedup") or {}).get(m)) for m in DROPOUT_METHODS[2:]])
        graph = "CUDA graph replay" if payload.get("cuda_graph") else "eager calls"
        lines += [f"Forward+backward, bf16, {graph}; source: {source_line((path, payload))}", ""]
        lines += table(["shape"] + [f"{m} ms" for m in DROPOUT_METHODS] + ["dropout cost"]
                       + [f"{m} / ours" for m in DROPOUT_METHODS[2:]], rows) + [""]
        kernel_lines = []
        for r in payload.get("rows", []):
            if path.name in DROPOUT_KERNELS_UNWARMED:
                kernel_lines.append(f"- B{r['B']} L{r['L']} D{r['D']}: kernel times not shown (profiled before any "
                                    "warm-up call: they include the autotuner's runs)")
                continue
            for name, kernels in (r.get("kernels_us") or {}).items():
                top = ", ".join(f"`{k['kernel'][:40]}` {f(k['us'], '.0f')} us" for k in kernels[:3])
                kernel_lines.append(f"- B{r['B']} L{r['L']} D{r['D']} {name}: {top}")
        lines += kernel_lines + ([""] if kernel_lines else [])
    return "\n".join(lines).rstrip()


# --- the index of every results file ------------------------------------------------------------------

@block("results-index")
def results_index() -> str:
    rows = []
    for path in sorted(RESULTS.glob("*.json")):
        payload = json.loads(path.read_text())
        env = payload.get("environment") if isinstance(payload.get("environment"), dict) else {}
        gaps = _env_gaps(payload)
        if path.name in HAND_MADE:
            status = "**hand-made, not a measurement**: not rendered"
        elif path.name in HAND_ANNOTATED:
            fields, said = HAND_ANNOTATED[path.name]
            status = f"script-written; {', '.join(fields)} added by hand" + ("" if said else " (unsaid)")
        else:
            status = "script-written"
        gpu = env.get("gpu") or payload.get("gpu")
        rows.append([f"`{path.name}`", str(payload.get("benchmark", "-")), f"`{gpu}`" if gpu else "-",
                     "writer" if "writer" in env else ("missing: " + ", ".join(gaps) if gaps else "complete"),
                     status])
    lines = ["Every results file: what its environment block holds (the writer's fields: "
             + ", ".join(ENV_REQUIRED) + ") and how it was made.", ""]
    lines += table(["file", "benchmark", "GPU", "environment", "provenance"], rows)
    return "\n".join(lines)


# --- README.md headlines ------------------------------------------------------------------------------

@block("readme-kernels")
def readme_kernels() -> str:
    apath, anchors = load("jagged_attention-anchors-20261130.json")
    gpath, grid = load("jagged_attention-grid-20261130.json")
    a0, a2 = anchors["shapes"][0], anchors["shapes"][2]
    big = [s for s in grid["shapes"] if s["L"] >= 1024 and s.get("results")]
    short = [s for s in grid["shapes"] if s["L"] == 256 and s.get("results")]
    tf = [_res(s, "gemcompile", "fwdbwd_tflops") for s in big]
    sd = [_speed(s, "sdpa_padded_mask", "fwdbwd") for s in big]
    sd_short = [_speed(s, "sdpa_padded_mask", "fwdbwd") for s in short]
    return (f"Kernel results on one H200 are in [benchmarks/README.md](benchmarks/README.md). Jagged attention, "
            f"{a0['label']}, eager calls, every method in one run ({cite(apath)}): forward+backward "
            f"{f(_res(a0, 'gemcompile', 'fwdbwd_ms'), '.3f')} ms, {f(_speed(a0, 'sdpa_padded_mask', 'fwdbwd'))}x padded "
            f"SDPA and {f(_speed(a0, 'flex_document_mask', 'fwdbwd'))}x FlexAttention (that run compiled the "
            f"FlexAttention and torch.compile peers once for all shapes; the per-shape re-run is pending); forward on "
            f"{a2['label']}: {f(_res(a2, 'gemcompile', 'fwd_tflops'), '.0f')} useful TFLOP/s. On GEM-scale shapes "
            f"(L 1024-4096, D 128; {cite(gpath)}, measured before the eager fast path): "
            f"{f(min(tf), '.0f')}-{f(max(tf), '.0f')} useful TFLOP/s forward+backward and "
            f"{f(min(sd))}-{f(max(sd))}x padded SDPA; at L 256 padded SDPA was faster in that run "
            f"({f(min(sd_short))}-{f(max(sd_short))}x).")


@block("readme-activation-memory")
def readme_activation_memory() -> str:
    gem_path, gem = load(LARGEST_BATCH_E2E[0])
    oom_path, oom = load(LARGEST_BATCH_E2E[1])
    best_path, best = load(LARGEST_BATCH_E2E[3])
    curve_path, curve = load(CURVE_FILES[0])
    quality_path, quality = load(ACTIVATION_MEMORY_QUALITY)
    g, b = gem["results"][0], best["results"][0]
    rows = {r["method"]: r for r in curve["curve"]["results"]}
    verdict = quality["verdict"]["gem+fp8-saved"]
    curve_rows, curve_cites, before = [], [], None
    for path, payload in (load(name) for name in CURVE_FILES):
        curve_cites.append(cite(path))
        ratios = {row["method"]: row for row in payload["curve"]["rows"]}
        for r in payload["curve"]["results"]:
            snap = (r.get("memory_snapshot") or {}).get("at_peak") or {}
            before = before or snap.get("before_step_gib")
            if r["method"] != "gem" and r.get("outcome") == "fits":
                ratio = ratios[r["method"]]
                curve_rows.append(f"`{r['method']}` {f(r['peak_memory_gib'])} GiB "
                                  f"({f(ratio['peak_memory_ratio_vs_gem'], '.3f')}x gem's peak, "
                                  f"{f(ratio['step_time_ratio_vs_gem'], '.3f')}x its step time)")
    return (f"Measured on one H200 (GEM-ref medium, fill 0.5): `{b['method']}` trains at batch "
            f"{best['config']['batch_size']} ({f(b['peak_memory_gib'])} GiB peak, MFU {pct(b['mfu'])}%; "
            f"{cite(best_path)}), where gem_compile's default fits at batch {gem['config']['batch_size']} "
            f"({f(g['peak_memory_gib'])} GiB, MFU {pct(g['mfu'])}%; {cite(gem_path)}) and runs out of memory at "
            f"batch {oom['config']['batch_size']} ({cite(oom_path)}). The cost curve at batch {rows['gem']['batch_size']} "
            f"(gem {f(rows['gem']['peak_memory_gib'])} GiB; {', '.join(curve_cites)}): "
            f"{'; '.join(curve_rows)}. Of each peak, {f(before)} GiB are the parameters, gradients and "
            f"optimizer state held before the step (CUDA memory snapshot), which no activation setting "
            f"changes. FP8 saved activations on GEM-ref "
            f"small ({verdict['saved_in_fp8']} tensors in FP8, 300 steps) ended with a held-out NE within the "
            f"bf16 seed-to-seed noise floor ({pct(quality['noise_floor'], '.3f')}%; {cite(quality_path)}); loss "
            f"curves: [docs/activation_memory_quality.png](docs/activation_memory_quality.png).")


@block("readme-data-masks")
def readme_data_masks() -> str:
    small_path, small = _data_masks("data_masks-20261202-023253.json")
    large_path, large = _data_masks("data_masks-20261202-025640.json")
    kernel_path, kernel = _data_masks("data_masks-20261202-005728.json")
    graph = [k[f"mask_{side}_vs_lengths_graph"] for k in kernel["kernel"] for side in ("right", "left")]
    eager = [k[f"mask_{side}_vs_lengths"] for k in kernel["kernel"] for side in ("right", "left")]
    m0, l0, k0 = small["models"][0], large["models"][0], kernel["kernel"][0]

    def span(xs):
        return f"{f(min(xs))}-{f(max(xs))}x"

    def gpu(payload, model):  # the right-padded row's GPU ms per step, torch.compile against gem_compile
        m = next(r for r in payload["models"] if r["model"] == model and r["padding"] == "right")
        return f"{f(m['gem_kernel_ms'])} against {f(m['inductor_kernel_ms'])} ms"

    def steps(payload, model, key="speedup_gem_vs_inductor"):
        return span([m[key] for m in payload["models"] if m["model"] == model])

    graphs = "speedup_gem-cudagraphs_vs_inductor-cudagraphs"
    return (f"Masks read from data (one H200): SASRec- and BERT-style stacks, right or left padded, about half the "
            f"tokens padding, are rewritten and train without recompiles. At B{l0['batch']} L{l0['length']} "
            f"H{l0['heads']}x{l0['head_dim']}, {l0['layers']} layers ({cite(large_path)}) gem_compile trains "
            f"{steps(large, 'sasrec')} torch.compile's step rate (SASRec, right and left padding) and "
            f"{steps(large, 'bert')} (BERT); with both compiled for CUDA graphs (mode=\"reduce-overhead\") "
            f"{steps(large, 'sasrec', graphs)} and {steps(large, 'bert', graphs)}; GPU ms per step (right padding): "
            f"SASRec {gpu(large, 'sasrec')}, BERT {gpu(large, 'bert')}. At B{m0['batch']} ({cite(small_path)}, measured "
            f"before the op host-time cuts) the steps are host-bound: gem_compile {steps(small, 'sasrec')} (SASRec) and "
            f"{steps(small, 'bert')} (BERT) torch.compile's step rate although its GPU time is lower (SASRec "
            f"{gpu(small, 'sasrec')}; its unpad region reads the token count on the host every step), and "
            f"{steps(small, 'sasrec', graphs)} / {steps(small, 'bert', graphs)} under CUDA graphs, where both sit at "
            f"the same host floor. Host time per attention call is in benchmarks/README.md (op-host-time). The "
            f"kv_mask kernel path costs {span(graph)} the length path on the same batch under CUDA-graph replay "
            f"(B{k0['B']} L{k0['L']}, {cite(kernel_path)}) and {span(eager)} per eager call (host time).")


@block("readme-e2e")
def readme_e2e() -> str:
    spath, small = load("e2e-small-b1024-fill0.5-20261130-123647.json")
    mpath, medium = load("e2e-medium-fill0.5-20261130-143850.json")
    qpath, ne = load("ne_vs_eager-gpu-small-300steps-warmup-cosine-20261130-171806.json")
    s = {r["method"]: r for r in small["results"]}
    m = {r["method"]: r for r in medium["results"]}
    g = next(r for r in ne["runs"] if r["name"] == "gem_compile")
    return (f"End to end, fill {small['config']['fill']} (these e2e files record no GPU, torch, triton or date: they "
            f"predate the environment block in `gemcompile bench e2e`; their MFU is against a peak of "
            f"{f(small['peak_bf16_dense_tflops'], '.0f')} bf16 TFLOP/s): GEM-ref small at batch "
            f"{small['config']['batch_size']} ({cite(spath)}), "
            f"gem_compile trains {f(s['gem']['speedup_vs_inductor'])}x torch.compile's samples/s "
            f"({f(s['gem']['samples_per_s'], '.0f')} against {f(s['inductor']['samples_per_s'], '.0f')}; kernel time "
            f"{f(s['gem']['kernel_ms_per_step'], '.1f')} against {f(s['inductor']['kernel_ms_per_step'], '.1f')} ms a "
            f"step) at {pct(s['gem']['mfu'])}% MFU; GEM-ref medium at batch {medium['config']['batch_size']} "
            f"({cite(mpath)}), {f(m['gem']['speedup_vs_inductor'])}x at {pct(m['gem']['mfu'])}% MFU. Held-out NE after "
            f"300 steps (small, bf16, {cite(qpath)}): gem_compile {pct(g['rel_eval_ne'][0], '.3f', sign=True)}% (CTR) / "
            f"{pct(g['rel_eval_ne'][1], '.3f', sign=True)}% (CVR) from eager, one run each; the spread of identical "
            f"runs is in benchmarks/README.md. " + readme_ne_sparse_rows())


def readme_ne_sparse_rows() -> str:
    path, payload = load(NE_SPARSE_ROWS[0])
    gap = payload["verdict"]["gem_compile"]["rel_ne"]
    return (f"With the tables trained sparsely (gem_compile's default since, {cite(path)}): "
            f"{pct(gap[0], '.3f', sign=True)}% (CTR) / {pct(gap[1], '.3f', sign=True)}% (CVR) from eager, within "
            f"the seed-to-seed spread of eager measured in a second run the same day and of the same order as "
            f"two identical gem_compile runs' spread (benchmarks/README.md, `ne-vs-eager-sparse-rows`), not "
            f"within `0.1%`.")


@block("readme-e2e-sparse-tables")
def readme_e2e_sparse_tables() -> str:
    mpath, medium = load("e2e-medium-fill0.5-20261202-224724.json")
    tpath, tables = load("sparse_tables-medium-b256-20261202-225739.json")
    m = {r["method"]: r for r in medium["results"]}
    t = {r["method"]: r for r in tables["results"]}
    env, tenv = medium["environment"], tables["environment"]
    g, i, nb = m["gem"], m["inductor"], m["gem-no-table_batching"]
    kp = lambda r, key: r["kernel_profile"][key]  # noqa: E731
    return (f"GEM-ref medium at batch {medium['config']['batch_size']}, fill {medium['config']['fill']}, with the "
            f"embedding tables trained sparsely (row gradients and SparseAdagrad, gem_compile's default; the "
            f"torch.compile peer keeps dense tables and torch's Adagrad) and their lookups in one call "
            f"(`table_batching`) ({cite(mpath)}, {env['gpu']}, torch {env['torch']}, triton {env['triton']}, "
            f"{env['date_utc'][:10]}, code `{env['git_commit'][:7]}`): gem_compile trains "
            f"{f(g['speedup_vs_inductor'])}x torch.compile's samples/s ({f(g['samples_per_s'], '.0f')} against "
            f"{f(i['samples_per_s'], '.0f')}) at {pct(g['mfu'])}% MFU; kernel time {f(g['kernel_ms_per_step'], '.1f')} "
            f"of a {f(g['step_ms_median'], '.1f')} ms step against {f(i['kernel_ms_per_step'], '.1f')} of "
            f"{f(i['step_ms_median'], '.1f')} ms, {f(kp(g, 'kernels_per_step'), '.0f')} against "
            f"{f(kp(i, 'kernels_per_step'), '.0f')} kernels a step, peak memory {f(g['peak_memory_gib'], '.1f')} against "
            f"{f(i['peak_memory_gib'], '.1f')} GiB, compile {f(g['compile_s'], '.0f')} against {f(i['compile_s'], '.0f')} s "
            f"({f(g['compile_time_vs_inductor'])}x). In the same run without table batching: "
            f"{f(nb['speedup_vs_inductor'])}x, {f(kp(nb, 'kernels_per_step'), '.0f')} kernels and the same kernel time "
            f"({f(nb['kernel_ms_per_step'], '.1f')} ms) in a {f(nb['step_ms_median'], '.1f')} ms step: the batching "
            f"removes host time, not GPU time. The tables alone, eager, one step of lookups, backward and optimizer "
            f"({cite(tpath)}, code `{tenv['git_commit'][:7]}`): dense {f(t['dense']['step_ms'], '.1f')} ms (optimizer "
            f"{f(t['dense']['optimizer_ms'], '.1f')} ms), SparseAdagrad with per-table lookups "
            f"{f(t['sparse-rows']['step_ms'], '.1f')} ms (optimizer {f(t['sparse-rows']['optimizer_ms'], '.1f')} ms), "
            f"with the lookups in one call {f(t['sparse-rows-batched']['step_ms'], '.1f')} ms (optimizer "
            f"{f(t['sparse-rows-batched']['optimizer_ms'], '.1f')} ms, "
            f"{pct(t['sparse-rows-batched']['optimizer_share_of_dense'])}% of dense Adagrad's). "
            + sparse_optimizer_kernels())


SPARSE_OPTIMIZER_AB = ("sparse_tables-medium-b256-20261203-120041.json", "sparse_tables-medium-b256-20261203-121400.json")
"""The tables alone before and after the optimizer read the filed rows in place (runs with --kernel-profile)."""


def _kernel_us(row: dict, name: str) -> float:
    """The largest profile entry whose kernel name holds ``name`` (us per step)."""
    return max((k["us"] for k in row.get("step_kernels", []) if name in k["kernel"]), default=float("nan"))


def sparse_optimizer_kernels() -> str:
    (bpath, before), (apath, after) = (load(n) for n in SPARSE_OPTIMIZER_AB)
    b = next(r for r in before["results"] if r["method"] == "sparse-rows-batched")
    a = next(r for r in after["results"] if r["method"] == "sparse-rows-batched")
    code = lambda p: f"`{p['environment']['git_commit'][:7]}`"  # noqa: E731
    return (f"Later ({cite(bpath)}, code {code(before)}, then {cite(apath)}, code {code(after)}, kernel profiles of "
            f"the whole step): the update kernel took {f(_kernel_us(b, '_adagrad_table_slots_kernel'), '.0f')} then "
            f"{f(_kernel_us(a, '_adagrad_table_slots_kernel'), '.0f')} us, the slot sums "
            f"{f(_kernel_us(b, '_slot_sums_kernel'), '.0f')} then {f(_kernel_us(a, '_slot_sums_kernel'), '.0f')} us, "
            f"the largest concatenation {f(_kernel_us(b, 'CatArrayBatchedCopy'), '.0f')} then "
            f"{f(_kernel_us(a, 'CatArrayBatchedCopy'), '.0f')} us; the optimizer's span between CUDA events, "
            f"{f(a['optimizer_ms'], '.2f')} ms ({pct(a['optimizer_share_of_dense'])}% of dense Adagrad's "
            f"{f(next(r for r in after['results'] if r['method'] == 'dense')['optimizer_ms'], '.1f')} ms), is "
            f"several times the GPU time of those kernels: the GPU waits for the host's Python over "
            f"{after['config']['n_tables'] + 1} tables. " + sparse_optimizer_host_now())


def sparse_optimizer_host_now() -> str:
    """The last run of SPARSE_OPTIMIZER_HOST, in a sentence (the whole series: benchmarks/README.md)."""
    path, payload = load(SPARSE_OPTIMIZER_HOST[-1][1])
    a = next(r for r in payload["results"] if r["method"] == "sparse-rows-batched")
    return (f"With the host's time inside `step()` measured and cut ({cite(path)}, code "
            f"`{payload['environment']['git_commit'][:7]}`): span {f(a['optimizer_ms'], '.2f')} ms, host "
            f"{f(a['optimizer_host_ms'], '.2f')} ms, {pct(a['optimizer_share_of_dense'])}% of dense Adagrad's "
            f"(target `10%`).")


SPARSE_OPTIMIZER_HOST = [("addresses tested per table (ee30311)", "sparse_tables-medium-b256-20261203-132833.json"),
                         ("shares of one filing (dd79410)", "sparse_tables-medium-b256-20261203-134011.json"),
                         ("layouts read in the loop, a filing checked once (e3b334f)",
                          "sparse_tables-medium-b256-20261203-135029.json"),
                         ("a plan per group kept across steps, step counts in one buffer (999fa8d)",
                          "sparse_tables-medium-b256-20261203-160219.json")]
"""The tables alone with the host's time in SparseAdagrad.step() measured (--host-profile), after each cut."""


@block("sparse-optimizer-host")
def sparse_optimizer_host() -> str:
    rows, last = [], None
    for label, name in SPARSE_OPTIMIZER_HOST:
        path, payload = load(name)
        by = {r["method"]: r for r in payload["results"]}
        a, d = by["sparse-rows-batched"], by["dense"]
        rows.append([label, cite(path), f(a["step_ms"], ".2f"), f(a["optimizer_ms"], ".2f"),
                     f(a["optimizer_host_ms"], ".2f"), f(d["optimizer_ms"], ".2f"),
                     f"{pct(a['optimizer_share_of_dense'])}%", f(a["step_speedup_vs_dense"])])
        last = (path, payload, a)
    lines = ["GEM-ref medium's tables alone (64 bag tables in one lookup call and the item table), batch 256, one "
             "eager step of lookups, backward and optimizer, one H200 (`python benchmarks/sparse_tables.py --size "
             "medium --batch-size 256 --methods dense,sparse-rows-batched --host-profile`, the runs before the last one "
             "also with `--kernel-profile`). The "
             "optimizer's span is between CUDA events around `step()`; its host time is the wall time inside "
             "`step()`. The span follows the host time: the GPU waits for the host's Python over the tables. "
             "Target (`issue 24`): the optimizer at `<= 10%` of dense Adagrad's time.", ""]
    lines += table(["after", "file", "step ms", "optimizer span ms", "optimizer host ms", "dense Adagrad ms",
                    "share of dense", "step x dense"], rows)
    path, payload, a = last
    profile = a["optimizer_host_profile"]
    in_ms = isinstance(profile, dict)  # profile_summary's layout, in ms (written as the file holds them)
    top = [[f"`{fn}`", f(calls, ".0f"), f(own / 1e3, ".3f") if in_ms else f(own, ".0f"),
            f(cum / 1e3, ".3f") if in_ms else f(cum, ".0f")] for fn, calls, own, cum in _host_rows_us(profile)[:10]]
    lines += ["", f"Where the host's time in `step()` goes in the last run (cProfile over 10 steps, which slows the "
              f"Python it measures; per step). Source: {source_line((path, payload))}", ""]
    lines += table(["function", "calls", "own ms" if in_ms else "own us",
                    "cumulative ms" if in_ms else "cumulative us"], top)
    return "\n".join(lines)


def _host_rows_us(profile) -> list[tuple]:
    """(function, calls, own us, cumulative us) per step, by own time: the first files hold a list in us,
    later ones host_profile.profile_summary's dict in ms."""
    if isinstance(profile, list):
        return [(r["function"], r["calls_per_step"], r["own_us_per_step"], r["cum_us_per_step"]) for r in profile]
    return [(r["function"], r["calls_per_step"], 1e3 * r["own_ms_per_step"], 1e3 * r["cumulative_ms_per_step"])
            for r in profile["by_own_time"]]


NE_SPARSE_ROWS = ["ne_vs_eager-gpu-small-sparse-rows-20261203-134026.json",
                  "ne_vs_eager-gpu-small-sparse-rows-20261203-132846.json"]
"""gem_compile with sparse tables (row gradients, SparseAdagrad) against eager with dense tables, GEM-ref small
300 steps; the first file is the comparison (same initialization), the second holds the other seed and a
second gem_compile run."""


@block("ne-vs-eager-sparse-rows")
def ne_vs_eager_sparse_rows() -> str:
    loaded = [load(n) for n in NE_SPARSE_ROWS]
    rows = []
    for path, payload in loaded:
        has_base = any(r["recipe"] is None and r["init_seed"] == payload["config"]["seed"] for r in payload["runs"])
        for r in payload["runs"]:
            ne = r["checkpoints"][-1]["eval_ne"]
            # the gap the file itself computed, against the eager run of the same initialization (if it has one)
            gap = (payload["verdict"].get(r["name"]) or {}).get("rel_ne") if has_base else None
            rows.append([cite(path), r["name"], f"seed {r['init_seed']}", ", ".join(r["optimizers"]),
                         str(r["checkpoints"][-1]["step"])]
                        + [f(v, ".5f") + (f" ({pct(g, '.3f', sign=True)}%)" if gap else "")
                           for v, g in zip(ne, gap or [None] * len(ne))])
        for name in payload.get("missing_runs") or []:
            rows.append([cite(path), name, "-", "-", "-", "out of GPU memory (three processes on one GPU)", "-"])
    lines = ["GEM-ref small, batch 256, bf16 autocast, 300 steps, warm-up and cosine decay; held-out NE (40 batches) "
             "at the last step, with (in the first file) the file's gap to its eager run of the same "
             "initialization. "
             "gem_compile trains its tables as `gemcompile bench e2e`'s gem does (row gradients, SparseAdagrad: "
             "`--tables sparse-rows`), eager with dense gradients and torch's Adagrad. The eager seed-0 run of the "
             "second file died out of GPU memory (three training processes on one H200), so that file holds the "
             "other seed and a second gem_compile run of the same code path. Sources: "
             + source_line(*loaded), ""]
    lines += table(["file", "run", "initialization", "optimizers", "step", "held-out NE CTR", "held-out NE CVR"],
                   rows)
    return "\n".join(lines)


COMMIT_BY_DIGEST = {"e3f30917d855e051538bd2f3617de4c5f1f2624d915955b7eb5fb70934fb5abb": "ec6c110",
                    "7d47b6a9d257b45311f95d547fb36c22ba27db9207e1ba9f983b5cf669ffd76f": "9c2273e",
                    "b59d672b97c2bfba61f11876f935d60d42a9e4d914af56312d1646ae15646261": "d95dc0a"}
"""Results files whose git_commit is wrong, told by their source_digest: the GPU machine's copied .git kept
a stale HEAD, and a run that took its commit from ``git rev-parse`` there recorded it; or the commit was
set by hand while the working tree copied to the machine already held the next commit's code (9c2273e's,
in e2e-medium-fill0.5-20261204-031049.json). Each digest here was recomputed with results.source_digest on
a checkout of the commit it names."""


def code_of(env: dict) -> str:
    """The commit a file's code was, in backticks: its git_commit, or the commit its source_digest names
    (COMMIT_BY_DIGEST) with the file's own value beside it."""
    known = COMMIT_BY_DIGEST.get(env.get("source_digest") or "")
    commit = (env.get("git_commit") or "")[:7]
    if known and known != commit:
        return f"`{known}` (by source digest; the file says `{commit}`)"
    return f"`{commit}`"


E2E_SMALL_STEPS = ["e2e-small-fill0.5-20261203-062918.json", "e2e-small-fill0.5-20261203-064326.json",
                   "e2e-small-fill0.5-20261203-083412.json", "e2e-small-fill0.5-20261203-091209.json",
                   "e2e-small-fill0.5-20261203-091716.json", "e2e-small-fill0.5-20261203-111954.json",
                   "e2e-small-fill0.5-20261203-120052.json", "e2e-small-fill0.5-20261203-163128.json",
                   "e2e-small-fill0.5-20261203-191832.json", "e2e-small-fill0.5-20261203-193054.json",
                   "e2e-small-fill0.5-20261203-193604.json", "e2e-small-fill0.5-20261203-192545.json",
                   "e2e-small-fill0.5-20261203-210112.json", "e2e-small-fill0.5-20261203-222529.json",
                   "e2e-small-fill0.5-20261203-224137.json", "e2e-small-fill0.5-20261204-025213.json",
                   "e2e-small-fill0.5-20261204-030111.json"]
"""GEM-ref small, B 1024, after issue 24's steps: every step's time is in the later files only."""


@block("readme-e2e-now")
def readme_e2e_now() -> str:
    gpath, graphs = load("e2e-medium-fill0.5-20261204-181910.json")  # CUDA graphs, with kernel profiles
    mpath, medium = load("e2e-medium-fill0.5-20261203-160229.json")  # default mode
    spath, small = load("e2e-small-fill0.5-20261204-025213.json")
    bpath, b256 = load("e2e-small-fill0.5-20261204-030111.json")  # warm-up 20: every capacity pair recorded
    mg = {r["method"]: r for r in graphs["results"]}
    m = {r["method"]: r for r in medium["results"]}
    s = {r["method"]: r for r in small["results"]}
    b = {r["method"]: r for r in b256["results"]}
    env, g, i = graphs["environment"], mg["gem@reduce-overhead"], mg["inductor"]
    sg, bg = s["gem@reduce-overhead"], b["gem@reduce-overhead"]

    def kernels(r: dict) -> str:
        return f"{f(r['kernel_ms_per_step'], '.1f')} ms of kernels in a {f(r['step_ms_mean'], '.1f')} ms step"

    return (f"Now ({cite(gpath)}, {env['gpu']}, torch {env['torch']}, triton {env['triton']}, "
            f"{env['date_utc'][:10]}, code {code_of(env)}): GEM-ref medium at batch "
            f"{graphs['config']['batch_size']}, fill {graphs['config']['fill']}, gem_compile under CUDA graphs "
            f"(mode=\"reduce-overhead\") trains {f(g['speedup_vs_inductor'])}x torch.compile's samples/s "
            f"({f(g['samples_per_s'], '.0f')} against {f(i['samples_per_s'], '.0f')}) at {pct(g['mfu'])}% MFU "
            f"(target `25%`: {'met' if g['mfu'] >= 0.25 else 'missed'}); {kernels(g)} against {kernels(i)}, "
            f"{f(g['kernel_profile']['kernels_per_step'], '.0f')} against "
            f"{f(i['kernel_profile']['kernels_per_step'], '.0f')} kernels a step, peak memory "
            f"{f(g['peak_memory_gib'], '.1f')} against {f(i['peak_memory_gib'], '.1f')} GiB, compile "
            f"{f(g['compile_s'], '.0f')} against {f(i['compile_s'], '.0f')} s ({f(g['compile_time_vs_inductor'])}x, "
            f"target `1.5x`: {'met' if g['compile_time_vs_inductor'] <= 1.5 else 'missed'}), "
            f"{g['recompiles_after_warmup']} recompiles over {graphs['config']['steps']} batches. "
            f"Without CUDA graphs ({cite(mpath)}, code {code_of(medium['environment'])}): "
            f"{f(m['gem']['speedup_vs_inductor'])}x at {pct(m['gem']['mfu'])}% MFU, compile "
            f"{f(m['gem']['compile_time_vs_inductor'])}x. GEM-ref small at batch {small['config']['batch_size']} "
            f"under CUDA graphs ({cite(spath)}, code {code_of(small['environment'])}): "
            f"{f(sg['speedup_vs_inductor'])}x ({f(sg['samples_per_s'], '.0f')} against "
            f"{f(s['inductor']['samples_per_s'], '.0f')} samples/s, target `2.0x`), {kernels(sg)}, compile "
            f"{f(sg['compile_time_vs_inductor'])}x; at batch {b256['config']['batch_size']} ({cite(bpath)}): "
            f"{f(bg['speedup_vs_inductor'])}x torch.compile (target `1.8x`) and "
            f"{f(bg['speedup_vs_inductor@reduce-overhead'])}x torch.compile under CUDA graphs by samples/s, "
            f"median step {f(bg['step_ms_median'], '.1f')} ms against {f(b['inductor']['step_ms_median'], '.1f')} "
            f"and {f(b['inductor@reduce-overhead']['step_ms_median'], '.1f')}, compile "
            f"{f(bg['compile_time_vs_inductor'])}x, after a warm-up of {b256['config']['warmup']} steps (no graph "
            f"captured inside a measured step). benchmarks/README.md has every run.")


@block("readme-scaling")
def readme_scaling() -> str:
    path, payload = load("parallel_scaling-20261130-081802.json")
    by = {r["world"]: r for r in payload["runs"]}
    return (f"On two H200s (NCCL, {cite(path)}): the plan's collectives are as planned and the scaling ratio is "
            f"{f(payload['scaling_ratio'], '.3f')} (target {payload.get('target')}), one run: samples/s per GPU at "
            f"world 2 over world 1, {f(by[2]['samples_per_s_per_gpu'], '.0f')} / {f(by[1]['samples_per_s_per_gpu'], '.0f')}, "
            f"GEM-ref small, eager, bf16 autocast, {by[1]['batch_per_gpu']} samples per GPU.")


@block("readme-measured")
def readme_measured() -> str:
    hpath, hstu = load(GDPA_HISTORY[-1][1])
    s = hstu["shapes"][0]
    corr = s.get("correctness", {})
    upath, unpad = load("unpad-b1024-20261130-123137.json")
    ur = unpad["ratios"]
    u1 = load("unpad-b1024-20261130-104556.json")
    u2 = load("unpad-b1024-pad-reductions-20261130-105705.json")
    k1 = next(r for r in u1[1]["results"] if r["method"] == "gem" and r["fill"] == 0.5)
    k2 = next(r for r in u2[1]["results"] if r["method"] == "gem-unpad-pad-reductions")
    mpath, mx = load("mxfp8_linear-20261130-043316.json")
    big = [x for x in mx["shapes"] if min(x["K"], x["N"]) >= 4096]
    fwd = [x["speedup"]["fp8_op_fwd"] for x in big] + [x["speedup"]["fp8_fwd"] for x in big]
    bwd = [x["speedup"]["fp8_op_bwd"] for x in big] + [x["speedup"]["fp8_bwd"] for x in big]
    bpath, bw = load(QUALITY_GPU[0])
    xpath, mx8 = load(QUALITY_GPU[1])
    rb = next(r for r in bw["runs"] if r["name"] == "blockwise")["rel_eval_ne"]
    rm = next(r for r in mx8["runs"] if r["recipe"] and "mxfp8" in r["recipe"])["rel_eval_ne"]
    lines = [
        f"- `relative_bias`, `gdpa`, `gdpa_relative_table` ({s['label']}, CUDA-graph replay, {cite(hpath)}): "
        f"the op forward+backward {f(_res(s, 'gemcompile', 'fwdbwd_ms'), '.3f')} ms with the table read in place, "
        f"{f(_res(s, 'gdpa_dense_bias', 'fwdbwd_ms'), '.3f')} ms with a dense bias; gem_compile "
        f"{f(_res(s, 'gem_compile', 'fwdbwd_ms'), '.3f')} ms; the op is {f(_speed(s, 'compiled_padded', 'fwdbwd'))}x "
        f"torch.compile of the padded code in the same run. Table gradient against float64: gem_compile "
        f"{pct(corr['gem_compile']['dbias'], '.2f')}%, torch.compile {pct(corr['compiled_padded']['dbias'], '.1f')}%. "
        f"ARCHITECTURE.md's HSTU anchor (useful TFLOP/s in its own convention) was timed with eager calls in another "
        f"run: it is an anchor, not a same-run peer, so no target is called met from it.",
        f"- `unpad` (the sequence part of GEM-ref small, B {unpad['config']['batch_size']}, CUDA events, {cite(upath)}): "
        + ", ".join(f"fill {fill}: {f(r['gem_vs_inductor'])}x torch.compile and {f(r['gem_vs_gem_no_unpad'])}x unpad off"
                    for fill, r in ur.items()) + ".",
        f"- `unpad_reductions` (B 1024, fill 0.5, kernel ms a step, two runs): sums unpadded "
        f"{f(k1['kernel_ms_per_step'], '.1f')} ({cite(u1[0])}), padded {f(k2['kernel_ms_per_step'], '.1f')} "
        f"({cite(u2[0])}, host shared).",
        f"- `mxfp8`, one Linear with K, N of at least 4096 ({cite(mpath)}): blockwise FP8 {f(min(fwd))}-{f(max(fwd))}x "
        f"bf16 forward and {f(min(bwd))}-{f(max(bwd))}x backward (fused pipeline or op, quantization included). "
        f"GEM-ref small, 300 steps, held-out NE against the same-seed bf16 run: blockwise "
        f"{pct(rb[0], '.3f', sign=True)}% / {pct(rb[1], '.3f', sign=True)}% ({cite(bpath)}), mxfp8 emulated "
        f"{pct(rm[0], '.3f', sign=True)}% / {pct(rm[1], '.3f', sign=True)}% ({cite(xpath)}), CTR / CVR.",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------
# Writing and checking the READMEs

MARK = re.compile(r"<!-- render:(?P<name>[\w.-]+) -->\n(?P<body>.*?)<!-- /render:(?P=name) -->", re.S)


def render(name: str) -> str:
    return BLOCKS[name]().rstrip() + "\n"


def rewrite(text: str) -> str:
    return MARK.sub(lambda m: f"<!-- render:{m['name']} -->\n{render(m['name'])}<!-- /render:{m['name']} -->", text)


def write_docs(docs: Iterable[Path] = DOCS) -> None:
    for doc in docs:
        text = doc.read_text()
        new = rewrite(text)
        if new != text:
            doc.write_text(new)
            print(f"updated {rel(doc)}")


# --- the numbers check ----------------------------------------------------------------------------------

NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)?")
"""A number as a reader sees one: not the digits of an identifier (B32, int32, sm_90a, fill0.48)."""
INLINE_CODE = re.compile(r"`[^`\n]*`")
CITED = re.compile(r"`(benchmarks/results/[^`\s]+\.(?:json|xml))`")


def _numbers_in(value: Any, out_numbers: list[float], out_strings: set[str]) -> None:
    if isinstance(value, bool) or value is None:
        return
    if isinstance(value, (int, float)):
        if math.isfinite(value):
            out_numbers.append(value)
    elif isinstance(value, str):
        out_strings.update(NUMBER.findall(value))
    elif isinstance(value, dict):
        for k, v in value.items():
            out_strings.update(NUMBER.findall(str(k)))
            _numbers_in(v, out_numbers, out_strings)
    elif isinstance(value, list):
        for v in value:
            _numbers_in(v, out_numbers, out_strings)


class NumberIndex:
    """The numbers of some results files, to look a printed number up in."""

    def __init__(self) -> None:
        self.numbers: list[float] = []
        self.strings: set[str] = set()
        self._by_decimals: dict[int, set[str]] = {}

    def add_file(self, path: Path) -> None:
        if path.suffix == ".xml":
            for el in ET.parse(path).iter():
                for v in el.attrib.values():
                    try:
                        self.numbers.append(float(v))
                    except ValueError:
                        self.strings.update(NUMBER.findall(v))
        else:
            _numbers_in(json.loads(path.read_text()), self.numbers, self.strings)
        self.strings.update(NUMBER.findall(path.name))
        self._by_decimals.clear()

    def has(self, token: str) -> bool:
        if token in self.strings:
            return True
        decimals = len(token.split(".")[1]) if "." in token else 0
        if decimals not in self._by_decimals:
            spec = f".{decimals}f"
            self._by_decimals[decimals] = {format(abs(s * v), spec) for v in self.numbers for s in (1, 100)}
        return token in self._by_decimals[decimals]


PERF = [
    ("ratio", re.compile(r"(?<![\w.])\d+(?:\.\d+)?x(?![\w])")),
    ("time", re.compile(r"(?<![\w.])\d+(?:\.\d+)?\s?(?:ms|us|µs|ns)\b")),
    ("rate", re.compile(r"(?<![\w.])\d+(?:\.\d+)?\s?(?:useful\s+|anchor-)?(?:TFLOP/s|GFLOP/s|GB/s|TB/s|samples/s|"
                        r"tokens/s)")),
    ("MFU", re.compile(r"MFU[^.\n|]{0,20}?\d+(?:\.\d+)?%|\d+(?:\.\d+)?%\s*(?:local\s+)?MFU")),
    ("scaling ratio", re.compile(r"scaling ratio\s+(?:is\s+|of\s+)?\d+(?:\.\d+)?")),
    ("duration", re.compile(r"(?<![\w.])\d+(?:\.\d+)?\s?(?:seconds|minutes|hours)\b")),
]
"""What counts as a performance number in a README's prose (outside the rendered blocks)."""

ALLOWED: list[tuple[str, str, str]] = [
    # (file or "*", regex of an allowed phrase, why it is not a measurement); a performance match is allowed when
    # each number in it lies inside such a phrase
    ("*", r"(?:at least|at most|>=|<=|target(?:ed)?:?|targets:?)\s*\d+(?:\.\d+)?\s?(?:x|%|(?:useful\s+)?TFLOP/s)",
     "a target or threshold from an issue, not a measurement"),
    ("*", r"(?:forward\+backward|fwd\+bwd)(?: =| is)? 3\.5x", "the FLOP convention (forward+backward = 3.5x forward)"),
]
"""Numbers that look like performance claims but are not measurements, with the reason."""


def _allowed_spans(doc_name: str, text: str) -> list[tuple[int, int]]:
    spans = []
    for file, pattern, _why in ALLOWED:
        if file in ("*", doc_name):
            spans += [m.span() for m in re.finditer(pattern, text)]
    return spans


def check_doc(doc: Path) -> list[str]:
    problems = []
    text = doc.read_text()
    name = rel(doc)
    seen = set()
    for m in MARK.finditer(text):
        block_name, body = m["name"], m["body"]
        line = text[: m.start()].count("\n") + 1
        where = f"{name}:{line} render:{block_name}"
        if block_name in seen:
            problems.append(f"{where}: the block appears twice")
        seen.add(block_name)
        if block_name not in BLOCKS:
            problems.append(f"{where}: no renderer of that name in benchmarks/render_report.py")
            continue
        try:
            fresh = render(block_name)
        except HandMadeResult as e:
            problems.append(f"{where}: {e}")
            continue
        if fresh != body:
            problems.append(f"{where}: stale (re-rendering changes it): run python benchmarks/render_report.py --write")
        cited = [REPO / c for c in CITED.findall(body)]
        index = NumberIndex()
        for path in cited:
            if not path.exists():
                problems.append(f"{where}: cites {rel(path)}, which does not exist")
            elif path.name in HAND_MADE:
                problems.append(f"{where}: cites the hand-made {path.name}")
            else:
                index.add_file(path)
        tokens = NUMBER.findall(INLINE_CODE.sub(" ", body))
        if tokens and not cited:
            problems.append(f"{where}: prints numbers but cites no results file")
        missing = sorted({t for t in tokens if not index.has(t)}, key=lambda t: (len(t), t))
        if missing and cited:
            problems.append(f"{where}: not found in its cited files: {', '.join(missing[:12])}")
    outside = MARK.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    spans = _allowed_spans(name, outside)
    for kind, pattern in PERF:
        for m in pattern.finditer(outside):
            numbers = [(m.start() + n.start(), m.start() + n.end()) for n in NUMBER.finditer(m.group(0))]
            if numbers and all(any(a <= lo and hi <= b for a, b in spans) for lo, hi in numbers):
                continue
            line = outside[: m.start()].count("\n") + 1
            problems.append(f"{name}:{line}: a performance number outside a rendered block ({kind}): "
                            f"{m.group(0)!r}: render it from a results file, or remove it")
    return problems


def check_results() -> list[str]:
    """Every results file has the writer's environment block, or is a listed file from before the writer."""
    problems = []
    for path in sorted(RESULTS.glob("*.json")):
        payload = json.loads(path.read_text())
        env = payload.get("environment") if isinstance(payload.get("environment"), dict) else {}
        if "writer" in env:
            gaps = [k for k in ENV_REQUIRED if k not in env]
            if gaps:
                problems.append(f"{rel(path)}: its environment block lacks {', '.join(gaps)}")
            continue
        if path.name not in LEGACY:
            problems.append(f"{rel(path)}: written without the one writer (gemcompile/runtime/training/results.py): "
                            f"no environment block from it")
    for name in [*HAND_MADE, *HAND_ANNOTATED]:
        if not (RESULTS / name).exists():
            problems.append(f"render_report.py lists {name}, which is not in benchmarks/results/")
    return problems


def check_history() -> list[str]:
    """A file written by the one writer is committed once and never edited (where git can tell)."""
    problems = []
    try:
        for path in sorted(RESULTS.glob("*.json")):
            payload = json.loads(path.read_text())
            if "writer" not in (payload.get("environment") or {}):
                continue
            # commits that modified the file in place (a results file is added once, by the run's commit)
            out = subprocess.run(["git", "log", "--format=%H", "--diff-filter=M", "--", rel(path)], cwd=REPO,
                                 capture_output=True, text=True, timeout=20)
            if out.returncode == 0 and out.stdout.split():
                problems.append(f"{rel(path)}: changed after it was first committed (results files are never edited)")
    except (OSError, subprocess.SubprocessError):
        pass
    return problems


def check(docs: Iterable[Path] = DOCS) -> list[str]:
    problems = []
    for doc in docs:
        problems += check_doc(doc)
    return problems + check_results() + check_history()


# --- the plot -------------------------------------------------------------------------------------------

def render_plot(path: Path = PLOT) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return None
    bars: list[tuple[str, str, float]] = []
    for name in ("jagged_attention-anchors-20261130.json", "jagged_attention-grid-20261130.json"):
        _, payload = load(name)
        for s in payload["shapes"]:
            for peer, sp in (s.get("speedup") or {}).items():
                if isinstance(sp, dict) and sp.get("fwdbwd"):
                    bars.append((s["label"], peer, sp["fwdbwd"]))
    fig, ax = plt.subplots(figsize=(8, max(4, 0.18 * len(bars) + 1)))
    peers = sorted({p for _, p, _ in bars})
    labels = sorted({lbl for lbl, _, _ in bars})
    height = 0.8 / max(1, len(peers))
    for j, peer in enumerate(peers):
        ys = [labels.index(lbl) + j * height for lbl, p, _ in bars if p == peer]
        ax.barh(ys, [r for _, p, r in bars if p == peer], height=height, label=peer)
    ax.set_yticks([i + 0.4 - height / 2 for i in range(len(labels))], labels, fontsize=6)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("peer time / gemcompile time, jagged attention forward+backward (>1: gemcompile faster)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    render_kernel_class_plot(plt)
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="rewrite the rendered blocks of both READMEs")
    parser.add_argument("--plot", action="store_true", help="also draw docs/benchmarks.png and docs/e2e_kernel_classes.png (needs matplotlib)")
    parser.add_argument("--check", action="store_true", help="exit 1 on a stale block or an unbacked number")
    parser.add_argument("--block", default=None, help="print one block")
    args = parser.parse_args(argv)
    if args.write:
        write_docs()
        if args.plot:
            print(f"plot: {render_plot()}")
    if args.check:
        problems = check()
        for p in problems:
            print(p)
        print(f"{len(problems)} problem(s)")
        return 1 if problems else 0
    if not args.write:
        for name in [args.block] if args.block else BLOCKS:
            print(f"<!-- render:{name} -->\n{render(name)}<!-- /render:{name} -->\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
