"""What is alive at the GPU's peak: one training step under torch's CUDA memory history, reduced to a few KB.

``snapshot_step(step, device)`` turns on ``torch.cuda.memory._record_memory_history`` (Python stacks only: C++
stacks are slow), runs ``step()`` once, takes ``torch.cuda.memory._snapshot()``, turns the history off and
returns ``summarize_snapshot`` of it (None off CUDA, where the step is not run). ``summarize_snapshot`` replays
the snapshot's trace of the step (the allocator's ``alloc`` / ``free_requested`` / ``free_completed`` /
``segment_*`` events, torch/cuda/_memory_viz.py's format) to find:

- the peak allocated bytes during the step and the event (index, time) where it was reached; the
  allocated bytes count as ``torch.cuda.memory_allocated`` does (a block stops counting at its
  ``free_requested``), so the replayed peak matches ``max_memory_allocated`` over the step;
- what was alive before the step began (weights, optimizer state, last step's gradients: allocations
  older than the history, so without stacks): bytes and count, and how much of it the step freed;
- at the peak, the live blocks the step allocated, grouped by their allocation's top user-level frame:
  the innermost frame in Inductor's generated code (``/tmp/torchinductor_*/``: "inductor kernel buffer
  <file>:<line>", the wrapper line that allocates the buffer) or else in gemcompile, the model, the benchmark
  (torch, site-packages and the standard library are skipped); ``via`` is the next user-level frame outward
  (the train step's forward line for a forward graph's buffer; none for a backward graph's, which the
  autograd engine calls; the one holding most of the group's bytes). Blocks with no Python frame at all
  (eager backward formulas run by the autograd engine in C++) are one group;
- a coarse timeline of the allocated bytes over the step, and the largest blocks at the peak.
"""

from __future__ import annotations

import inspect
import os
import re
import sysconfig
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["DEFAULT_MAX_ENTRIES", "frame_label", "model_state", "record_history_kwargs", "run_snapshot",
           "snapshot_lines", "snapshot_step",
           "summarize_snapshot"]

DEFAULT_MAX_ENTRIES = 1_000_000
"""Trace entries the allocator keeps (a ring buffer: a longer step keeps its last ones; ``truncated`` says so).
A GEM-ref step has a few 10k allocations and frees."""

_SEGMENT_GROWS = ("segment_alloc", "segment_map")  # cudaMalloc; expandable segments map pages instead
_SEGMENT_SHRINKS = ("segment_free", "segment_unmap")

NO_PYTHON_FRAMES = "(no Python frame: C++ / autograd engine)"

_INDUCTOR_GENERATED = re.compile(r"[/\\]torchinductor_[^/\\]*[/\\]")
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_STDLIB_DIRS = tuple(sorted({p + os.sep for key in ("stdlib", "platstdlib")
                             if (p := sysconfig.get_paths().get(key))}))


def _is_inductor_generated(filename: str) -> bool:
    if _INDUCTOR_GENERATED.search(filename):
        return True
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    return bool(cache) and filename.startswith(os.path.abspath(cache) + os.sep)


def _is_internal(filename: str) -> bool:
    """torch, third-party packages, the standard library, and code without a file (<frozen ...>, FX's
    <eval_with_key>); gemcompile installed into site-packages is not internal."""
    if not filename or filename.startswith("<"):
        return True
    for marker in ("/site-packages/", "/dist-packages/"):
        i = filename.rfind(marker)
        if i >= 0:
            return not filename[i + len(marker):].startswith("gemcompile/")
    return filename.startswith(_TORCH_DIR) or filename.startswith(_STDLIB_DIRS)


def _is_user(filename: str) -> bool:
    return not _is_internal(filename) and not _is_inductor_generated(filename)


def _short_path(filename: str) -> str:
    for marker in ("/gemcompile/", "/benchmarks/", "/tests/", "/torch/"):
        i = filename.rfind(marker)
        if i >= 0:
            return filename[i + 1:]
    parts = filename.replace("\\", "/").split("/")
    return "/".join(parts[-2:])


def _fmt(frame: dict) -> str:
    return f"{_short_path(frame.get('filename', '?'))}:{frame.get('line', '?')} {frame.get('name', '?')}"


def frame_label(frames: list[dict] | None) -> tuple[str, str | None]:
    """(the group of an allocation, via) from its frames (innermost first, as the snapshot stores them): see
    the module docstring."""
    frames = frames or []
    chosen = None
    for i, f in enumerate(frames):
        filename = f.get("filename", "")
        if _is_inductor_generated(filename):
            chosen, label = i, f"inductor kernel buffer {os.path.basename(filename)}:{f.get('line', '?')}"
            break
        if not _is_internal(filename):
            chosen, label = i, _fmt(f)
            break
    if chosen is None:
        if not frames:
            return NO_PYTHON_FRAMES, None
        return f"torch internals only, innermost {_fmt(frames[0])}", None
    via = next((_fmt(f) for f in frames[chosen + 1:] if _is_user(f.get("filename", ""))), None)
    return label, via


def _kind(label: str) -> str:
    if label.startswith("inductor kernel buffer"):
        return "inductor_buffers"
    if label == NO_PYTHON_FRAMES:
        return "no_python_frames"
    if label.startswith("torch internals only"):
        return "torch_internals"
    return "user_code"


def _device_trace(snapshot: dict, device: int | None) -> tuple[int, list[dict]]:
    traces = snapshot.get("device_traces") or []
    if device is None or device >= len(traces):
        device = max(range(len(traces)), key=lambda d: len(traces[d]), default=0)
    return device, (traces[device] if device < len(traces) else [])


def _older_blocks(trace: list[dict], segments: list[dict]) -> tuple[list[int], list[int], int]:
    """Pass 1 over the trace: sizes of the blocks allocated before it and still alive, and of those it freed;
    the net bytes its segment events added to the reserved memory."""
    live: dict[int, int] = {}  # addr -> index of its alloc event
    requested: set[int] = set()  # free requested, completion pending (already out of the allocated bytes)
    older_freed: list[int] = []  # sizes of blocks allocated before the trace, freed in it
    segment_delta = 0
    for i, e in enumerate(trace):
        action, addr = e.get("action"), e.get("addr")
        if action == "alloc":
            live[addr] = i
        elif action == "free_requested":
            if live.pop(addr, None) is None:
                older_freed.append(int(e.get("size", 0)))
            requested.add(addr)
        elif action == "free_completed":
            if addr in requested:
                requested.discard(addr)
            else:
                live.pop(addr, None)  # a completion without its request (a cut trace)
        elif action in _SEGMENT_GROWS:
            segment_delta += int(e.get("size", 0))
        elif action in _SEGMENT_SHRINKS:
            segment_delta -= int(e.get("size", 0))
    older_alive = [int(b.get("size", 0)) for s in segments for b in s.get("blocks") or []
                   if b.get("state") == "active_allocated" and b.get("address") not in live]
    return older_alive, older_freed, segment_delta


def _allocated_over_trace(trace: list[dict], before_bytes: int, reserved: int) -> dict[str, Any]:
    """Pass 2: allocated bytes after every event, the peak (the first time it is reached) and the reserved
    memory there and at most; ``reserved`` is what was reserved before the trace."""
    allocated, peak, peak_index = before_bytes, before_bytes, -1
    reserved_at_peak, reserved_max = reserved, reserved
    series: list[int] = []
    alive: dict[int, int] = {}
    pending: set[int] = set()
    ooms = 0
    for i, e in enumerate(trace):
        action, addr, size = e.get("action"), e.get("addr"), int(e.get("size", 0))
        if action == "alloc":
            alive[addr] = size
            allocated += size
        elif action == "free_requested":
            allocated -= alive.pop(addr, size)  # an older block: counted in before_bytes
            pending.add(addr)
        elif action == "free_completed":
            if addr in pending:
                pending.discard(addr)
            elif addr in alive:
                allocated -= alive.pop(addr)
        elif action in _SEGMENT_GROWS:
            reserved += size
        elif action in _SEGMENT_SHRINKS:
            reserved -= size
        elif action == "oom":
            ooms += 1
        reserved_max = max(reserved_max, reserved)
        if allocated > peak:
            peak, peak_index, reserved_at_peak = allocated, i, reserved
        series.append(allocated)
    return {"peak": peak, "peak_index": peak_index, "reserved_at_peak": reserved_at_peak,
            "reserved_max": reserved_max, "series": series, "ooms": ooms}


def _alive_at(trace: list[dict], peak_index: int) -> tuple[dict[int, dict], int]:
    """Pass 3: the alloc events of the blocks alive at the peak, and the bytes of older blocks freed by then."""
    at_peak: dict[int, dict] = {}
    older_freed_by_peak = 0
    pending: set[int] = set()
    for e in trace[:peak_index + 1]:
        action, addr = e.get("action"), e.get("addr")
        if action == "alloc":
            at_peak[addr] = e
        elif action == "free_requested":
            if at_peak.pop(addr, None) is None:
                older_freed_by_peak += int(e.get("size", 0))
            pending.add(addr)
        elif action == "free_completed":
            if addr in pending:
                pending.discard(addr)
            else:
                at_peak.pop(addr, None)
    return at_peak, older_freed_by_peak


def summarize_snapshot(snapshot: dict, device: int | None = None, top: int = 20, timeline_points: int = 40,
                       max_entries: int | None = None) -> dict[str, Any]:
    """The JSON-sized summary of a ``torch.cuda.memory._snapshot()`` taken right after one step recorded
    with the history on (see the module docstring). ``device``: the index into ``device_traces`` (None: the
    longest trace); ``top``: groups kept (the rest summed); ``max_entries``: the history's limit, to say
    whether the trace was cut."""
    device, trace = _device_trace(snapshot, device)
    segments = [s for s in snapshot.get("segments") or [] if s.get("device", device) == device]

    older_alive, older_freed, segment_delta = _older_blocks(trace, segments)
    before_bytes = sum(older_alive) + sum(older_freed)
    reserved_end = sum(int(s.get("total_size", 0)) for s in segments)
    over = _allocated_over_trace(trace, before_bytes, reserved_end - segment_delta)
    peak, peak_index, series, ooms = over["peak"], over["peak_index"], over["series"], over["ooms"]
    reserved_at_peak, reserved_max = over["reserved_at_peak"], over["reserved_max"]
    at_peak, older_freed_by_peak = _alive_at(trace, peak_index)
    groups: dict[str, list] = {}  # where -> [bytes, count, {via: bytes}]
    by_kind: dict[str, int] = {}
    for e in at_peak.values():
        where, via = frame_label(e.get("frames"))
        size = int(e.get("size", 0))
        group = groups.setdefault(where, [0, 0, {}])
        group[0] += size
        group[1] += 1
        group[2][via] = group[2].get(via, 0) + size
        by_kind[_kind(where)] = by_kind.get(_kind(where), 0) + size
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])
    rest = ranked[top:]
    step_bytes = sum(int(e.get("size", 0)) for e in at_peak.values())
    largest = sorted(at_peak.values(), key=lambda e: -int(e.get("size", 0)))[:8]
    peak_event = trace[peak_index] if peak_index >= 0 else None
    t0 = trace[0].get("time_us") if trace else None

    def gib(n: int) -> float:
        return round(n / 2**30, 4)

    timeline = []
    if series and timeline_points > 0:
        width = max(1, -(-len(series) // timeline_points))
        timeline = [gib(max(series[j:j + width])) for j in range(0, len(series), width)]
    return {
        "device": device,
        "trace_entries": len(trace),
        "truncated": bool(max_entries) and len(trace) >= max_entries,
        "ooms": ooms,
        "peak_allocated_bytes": peak,
        "peak_allocated_gib": gib(peak),
        # -1: nothing the step did rose above what it started with
        "peak_event_index": peak_index,
        "peak_time_us": (peak_event.get("time_us") - t0 if peak_event is not None and t0 is not None
                         and peak_event.get("time_us") is not None else None),
        "step_time_us": (trace[-1].get("time_us") - t0
                         if t0 is not None and trace[-1].get("time_us") is not None else None),
        # the allocation that reached the peak: its group and its frames outside torch (innermost first)
        "peak_event": ({"where": frame_label(peak_event.get("frames"))[0],
                        "size": int(peak_event.get("size", 0)),
                        "frames": [_fmt(f) for f in (peak_event.get("frames") or [])
                                   if not _is_internal(f.get("filename", ""))][:6]}
                       if peak_event is not None else None),
        "reserved_at_peak_gib": gib(reserved_at_peak),
        "reserved_max_gib": gib(reserved_max),
        "before_step": {"bytes": before_bytes, "gib": gib(before_bytes),
                        "count": len(older_alive) + len(older_freed),
                        "freed_by_peak_gib": gib(older_freed_by_peak),
                        "freed_in_step_gib": gib(sum(older_freed))},
        "at_peak": {
            "before_step_gib": gib(before_bytes - older_freed_by_peak),
            "step_gib": gib(step_bytes),
            "step_count": len(at_peak),
            "by_kind_gib": {k: gib(v) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
            # via: the caller outward of `where` holding most of the group's bytes
            "groups": [{"where": where, "via": max(vias, key=vias.get), "gib": gib(b), "bytes": b, "count": n}
                       for where, (b, n, vias) in ranked[:top]],
            "other_groups": {"groups": len(rest), "gib": gib(sum(g[0] for _, g in rest)),
                             "count": sum(g[1] for _, g in rest)},
            "largest_blocks": [{"where": frame_label(e.get("frames"))[0], "size": int(e.get("size", 0))}
                               for e in largest],
        },
        # allocated GiB over the step: the maximum within each of ~timeline_points equal runs of events
        "timeline_gib": timeline,
    }


def record_history_kwargs(max_entries: int, fn: Callable | None = None) -> dict[str, Any]:
    """The keyword arguments of ``_record_memory_history`` that turn on alloc/free history with Python
    stacks, for the installed torch's signature (only the parameters it has)."""
    fn = fn or torch.cuda.memory._record_memory_history
    wanted = {"context": "all", "stacks": "python", "max_entries": max_entries, "clear_history": True}
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no signature to read: the arguments torch has had since 2.1
        return wanted
    if "max_entries" not in params and any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return wanted  # a wrapper that forwards its keywords
    return {k: v for k, v in wanted.items() if k in params}


def snapshot_step(step: Callable[[], Any], device: torch.device | str, *,
                  max_entries: int = DEFAULT_MAX_ENTRIES, top: int = 20) -> dict[str, Any] | None:
    """``step()`` once under the CUDA memory history; the summary of what it allocated (summarize_snapshot),
    with ``torch.cuda.memory_allocated`` before the step and ``max_memory_allocated`` over it (the peak
    statistics are reset first) to check the replay against. None, without running the step, off CUDA.
    An error in the step (an out-of-memory) is recorded in ``step_error`` beside the snapshot taken after
    it; the history is always turned off again."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    record = torch.cuda.memory._record_memory_history
    index = device.index if device.index is not None else torch.cuda.current_device()
    torch.cuda.synchronize(device)
    allocated_before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step_error = None
    record("all", **record_history_kwargs(max_entries))
    try:
        try:
            step()
            torch.cuda.synchronize(device)
        except Exception as e:  # noqa: BLE001 - the snapshot of a failed step is the point of it
            step_error = f"{type(e).__name__}: {str(e)[:300]}"
        snapshot = torch.cuda.memory._snapshot()
    finally:
        record(None)
    summary = summarize_snapshot(snapshot, device=index, top=top, max_entries=max_entries)
    del snapshot
    summary["allocated_before_step_gib"] = round(allocated_before / 2**30, 4)
    summary["max_memory_allocated_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 4)
    summary["step_error"] = step_error
    return summary


def snapshot_lines(summary: dict[str, Any] | None, top: int = 8) -> list[str]:
    """A few console lines of a summary: the peak, what the step began with, and its largest groups."""
    if not summary:
        return []
    at = summary["at_peak"]
    lines = [f"memory snapshot: peak {summary['peak_allocated_gib']:.2f} GiB (max_memory_allocated "
             f"{summary.get('max_memory_allocated_gib', float('nan')):.2f}) = before the step "
             f"{at['before_step_gib']:.2f} + the step's {at['step_gib']:.2f} GiB in {at['step_count']} blocks; "
             + ", ".join(f"{k} {v:.2f}" for k, v in at["by_kind_gib"].items())
             + (f"; step error: {summary['step_error']}" if summary.get("step_error") else "")
             + ("; trace truncated" if summary.get("truncated") else "")]
    state = summary.get("model_state")
    if state:
        lines.append("  before the step: "
                     + ", ".join(f"{k.removesuffix('_gib')} {v:.2f}" for k, v in state.items()) + f" GiB (all older blocks {summary['before_step']['gib']:.2f} GiB)")
    for g in at["groups"][:top]:
        lines.append(f"  {g['gib']:7.3f} GiB {g['count']:5d} x  {g['where']}"
                     + (f"  via {g['via']}" if g["via"] else ""))
    return lines


def run_snapshot(run, batch_index: int) -> dict[str, Any] | None:
    """One more train step of an e2e method run (e2e_bench's ``_MethodRun``: its train_step, data, device,
    model and optimizers) on batch ``batch_index`` under the CUDA memory history: snapshot_step's summary
    with ``model_state`` (the parameters, gradients and optimizer state alive before it). After the measured
    steps and their peak readings; None, with no step run, off CUDA."""
    if run.device.type != "cuda":
        return None
    batch = run.data.batch(batch_index).to(run.device)  # on the device before the history starts
    state = model_state(run)
    summary = snapshot_step(lambda: run.train_step(batch), run.device)
    if summary is not None:
        summary["model_state"] = state
    return summary


def model_state(run) -> dict[str, float]:
    """GiB of the device storages of the parameters, their gradients (the last step's, where not set to
    None) and the optimizers' state, each storage counted once."""
    seen: set[int] = set()

    def gib(tensors) -> float:
        total = 0
        for t in tensors:
            if not isinstance(t, torch.Tensor) or t.device.type != run.device.type or t.is_sparse:
                continue
            storage = t.untyped_storage()
            if storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            total += storage.nbytes()
        return round(total / 2**30, 4)

    params = list(run.model.parameters())
    return {"parameters_gib": gib(params),
            "gradients_gib": gib(p.grad for p in params if p.grad is not None),
            "optimizer_state_gib": gib(v for opt in run.optimizers for state in opt.state.values()
                                       for v in (state.values() if isinstance(state, dict) else ()))}
