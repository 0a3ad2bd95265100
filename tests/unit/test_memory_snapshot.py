"""runtime/training/memory_snapshot.py on the CPU: the replay of a hand-built snapshot (a known peak, known
live groups), the frame rules, the history's arguments for the installed torch, and the no-CUDA path."""

import inspect
from types import SimpleNamespace

import pytest
import torch

from gemcompile.runtime.training import e2e_bench, memory_snapshot
from gemcompile.runtime.training.memory_snapshot import (NO_PYTHON_FRAMES, frame_label, record_history_kwargs,
                                                         snapshot_lines, snapshot_step, summarize_snapshot)

SITE = "/work/main/.venv/lib/python3.11/site-packages"
REPO = "/work/wt/gemcompile"  # a checkout named like the package, with its venv inside


def _frame(filename, line, name):
    return {"filename": filename, "line": line, "name": name}


TORCH_LINEAR = _frame(f"{SITE}/torch/nn/functional.py", 2100, "linear")
TORCH_MODULE = _frame(f"{REPO}/.venv/lib/python3.11/site-packages/torch/nn/modules/module.py", 1750, "_call_impl")
GEM_FORWARD = _frame(f"{REPO}/gemcompile/models/gem.py", 120, "forward")
TRAIN_STEP = _frame(f"{REPO}/gemcompile/runtime/training/e2e_bench.py", 500, "train_step")
OPT_STEP = _frame(f"{REPO}/gemcompile/runtime/training/e2e_bench.py", 510, "train_step")
KERNEL = _frame("/tmp/torchinductor_x/ab/cxyz.py", 42, "call")
INDUCTOR_RUNTIME = _frame(f"{SITE}/torch/_inductor/output_code.py", 600, "__call__")
STDLIB = _frame("<frozen runpy>", 88, "_run_code")


def _event(action, addr, size, frames=(), time_us=None):
    e = {"action": action, "addr": addr, "size": size, "stream": 0, "frames": list(frames)}
    if time_us is not None:
        e["time_us"] = time_us
    return e


def _snapshot():
    """Before the step: a weight W (400 B, alive throughout) and last step's gradient G (100 B, freed in the
    step); the step allocates A (gemcompile forward, 200), B and D (one Inductor wrapper line, 300 + 150), C
    (no Python frame, 250) and E (50, alive at the end). Allocated: 500 -> 700 -> 1000 -> 900 -> 1150 ->
    1300 (the peak, event 6) -> 1000 -> 1050 -> ... -> 450."""
    trace = [
        _event("segment_alloc", 10_000, 1000, time_us=1_000),
        _event("alloc", 3000, 200, [TORCH_LINEAR, TORCH_MODULE, GEM_FORWARD, TORCH_MODULE, TRAIN_STEP, STDLIB],
               time_us=1_010),
        _event("alloc", 4000, 300, [KERNEL, INDUCTOR_RUNTIME, TORCH_MODULE, TRAIN_STEP], time_us=1_020),
        _event("free_requested", 2000, 100, [OPT_STEP], time_us=1_030),
        _event("free_completed", 2000, 100, [OPT_STEP], time_us=1_030),
        _event("alloc", 6000, 250, [], time_us=1_040),
        _event("alloc", 7000, 150, [KERNEL, INDUCTOR_RUNTIME], time_us=1_050),
        _event("free_requested", 4000, 300, time_us=1_060),
        _event("free_completed", 4000, 300, time_us=1_060),
        _event("alloc", 5000, 50, [TORCH_LINEAR, OPT_STEP], time_us=1_070),
        _event("free_requested", 3000, 200, time_us=1_080),
        _event("free_completed", 3000, 200, time_us=1_080),
        _event("free_requested", 6000, 250, time_us=1_090),
        _event("free_completed", 6000, 250, time_us=1_090),
        _event("free_requested", 7000, 150, time_us=1_100),
        _event("free_completed", 7000, 150, time_us=1_100),
    ]
    segments = [
        {"device": 0, "address": 1000, "total_size": 2000, "blocks": [
            {"address": 1000, "size": 400, "requested_size": 400, "state": "active_allocated", "frames": []},
            {"address": 2000, "size": 100, "requested_size": 100, "state": "inactive", "frames": []},
            {"address": 5000, "size": 50, "requested_size": 50, "state": "active_allocated", "frames": []},
            {"address": 5050, "size": 1450, "requested_size": 1450, "state": "inactive", "frames": []}]},
        {"device": 0, "address": 10_000, "total_size": 1000, "blocks": [
            {"address": 10_000, "size": 1000, "requested_size": 1000, "state": "inactive", "frames": []}]},
        {"device": 1, "address": 90_000, "total_size": 5000, "blocks": [  # another GPU's: not counted
            {"address": 90_000, "size": 5000, "requested_size": 5000, "state": "active_allocated", "frames": []}]},
    ]
    return {"segments": segments, "device_traces": [trace, []]}


def test_the_replay_finds_the_peak_and_what_is_alive_there():
    s = summarize_snapshot(_snapshot(), top=2)
    assert s["device"] == 0 and s["trace_entries"] == 16 and not s["truncated"] and s["ooms"] == 0
    assert s["peak_allocated_bytes"] == 1300 and s["peak_event_index"] == 6
    assert s["peak_time_us"] == 50 and s["step_time_us"] == 100
    assert s["peak_event"]["where"] == "inductor kernel buffer cxyz.py:42" and s["peak_event"]["size"] == 150
    assert s["before_step"]["bytes"] == 500 and s["before_step"]["count"] == 2  # W and last step's G
    assert s["before_step"]["freed_in_step_gib"] == pytest.approx(100 / 2**30, abs=1e-4)
    at = s["at_peak"]
    assert at["step_count"] == 4  # A, B, C, D; E comes after the peak
    groups = [(g["where"], g["via"], g["bytes"], g["count"]) for g in at["groups"]]
    assert groups == [("inductor kernel buffer cxyz.py:42", "gemcompile/runtime/training/e2e_bench.py:500 train_step",
                       450, 2),
                      (NO_PYTHON_FRAMES, None, 250, 1)]
    # one group per allocating frame; its via is the caller of most of its bytes (B's train step, not D's none)
    assert at["other_groups"] == {"groups": 1, "gib": pytest.approx(200 / 2**30, abs=1e-4), "count": 1}
    # reserved: 2000 before the step's cudaMalloc, 3000 after it (device 1's segment left out)
    assert s["reserved_at_peak_gib"] == pytest.approx(3000 / 2**30, abs=1e-4)
    assert set(at["by_kind_gib"]) == {"inductor_buffers", "no_python_frames", "user_code"}
    assert [b["size"] for b in at["largest_blocks"]] == [300, 250, 200, 150]
    assert len(s["timeline_gib"]) <= 40


def test_every_block_alive_at_the_peak_is_in_one_group():
    s = summarize_snapshot(_snapshot(), top=10)
    by = {g["where"]: g for g in s["at_peak"]["groups"]}
    assert by["gemcompile/models/gem.py:120 forward"]["via"] == \
        "gemcompile/runtime/training/e2e_bench.py:500 train_step"
    assert s["at_peak"]["other_groups"] == {"groups": 0, "gib": 0.0, "count": 0}
    assert sum(g["bytes"] for g in s["at_peak"]["groups"]) == 900


def test_a_cut_trace_and_an_oom_are_said():
    snap = _snapshot()
    snap["device_traces"][0].append({"action": "oom", "size": 10**9, "device_free": 10, "frames": []})
    s = summarize_snapshot(snap, max_entries=17)
    assert s["truncated"] and s["ooms"] == 1 and s["peak_allocated_bytes"] == 1300


def test_no_time_fields_and_an_empty_trace_are_handled():
    snap = _snapshot()
    for e in snap["device_traces"][0]:
        e.pop("time_us")
        e.pop("frames")
    s = summarize_snapshot(snap)
    assert s["peak_time_us"] is None and s["peak_allocated_bytes"] == 1300
    assert s["at_peak"]["groups"][0]["where"] == NO_PYTHON_FRAMES
    empty = summarize_snapshot({"segments": [], "device_traces": [[]]})
    assert empty["peak_allocated_bytes"] == 0 and empty["peak_event"] is None and empty["timeline_gib"] == []


def test_frame_rules():
    assert frame_label([KERNEL, INDUCTOR_RUNTIME, TRAIN_STEP]) == (
        "inductor kernel buffer cxyz.py:42", "gemcompile/runtime/training/e2e_bench.py:500 train_step")
    assert frame_label([TORCH_LINEAR, TORCH_MODULE, GEM_FORWARD]) == ("gemcompile/models/gem.py:120 forward", None)
    assert frame_label([]) == (NO_PYTHON_FRAMES, None)
    where, via = frame_label([TORCH_LINEAR, STDLIB])
    assert where == "torch internals only, innermost torch/nn/functional.py:2100 linear" and via is None
    installed = _frame(f"{SITE}/gemcompile/passes/unpad.py", 7, "f")  # gemcompile installed as a package
    assert frame_label([TORCH_LINEAR, installed])[0] == "gemcompile/passes/unpad.py:7 f"
    bench = _frame("/work/main/benchmarks/activation_memory.py", 300, "main")
    assert frame_label([bench])[0] == "benchmarks/activation_memory.py:300 main"
    lines = snapshot_lines(summarize_snapshot(_snapshot()), top=2)
    assert "peak 0.00 GiB" in lines[0] and "cxyz.py:42" in lines[1] and len(lines) == 3


def test_the_history_arguments_fit_the_installed_torch():
    kwargs = record_history_kwargs(1000)
    assert kwargs["max_entries"] == 1000
    params = inspect.signature(torch.cuda.memory._record_memory_history).parameters
    assert set(kwargs) <= set(params)
    if "stacks" in params:
        assert kwargs["stacks"] == "python"  # C++ stacks are slow

    def older(enabled="all", context="all", stacks="all", max_entries=1, device=None):
        pass

    assert record_history_kwargs(5, older) == {"context": "all", "stacks": "python", "max_entries": 5}

    def forwarding(enabled="all", *args, **kwargs):
        pass

    assert record_history_kwargs(5, forwarding)["clear_history"] is True


def test_off_cuda_the_step_is_not_run():
    calls = []
    assert snapshot_step(lambda: calls.append(1), "cpu") is None
    assert calls == []


def test_the_e2e_snapshot_step_runs_one_train_step_on_the_next_batch(monkeypatch):
    """memory_snapshot.run_snapshot on a stand-in CUDA run: one train step on batch `index`, inside
    snapshot_step; the model state before it beside the summary."""
    seen, stepped = {}, []

    def fake_snapshot_step(step, device):
        seen["device"] = device
        step()
        return summarize_snapshot(_snapshot())

    class Data:
        def batch(self, i):
            return SimpleNamespace(to=lambda device: f"batch {i}")

    model = torch.nn.Linear(2, 2)
    run = SimpleNamespace(device=torch.device("cuda"), data=Data(), model=model, optimizers=[],
                          train_step=lambda batch: stepped.append(batch))
    monkeypatch.setattr(memory_snapshot, "snapshot_step", fake_snapshot_step)
    summary = memory_snapshot.run_snapshot(run, 7)
    assert stepped == ["batch 7"] and seen["device"].type == "cuda"
    assert summary["model_state"] == {"parameters_gib": 0.0, "gradients_gib": 0.0, "optimizer_state_gib": 0.0}
    assert summary["peak_allocated_bytes"] == 1300
    assert any("parameters 0.00" in line for line in snapshot_lines(summary))


def test_the_model_state_counts_each_storage_once():
    model = torch.nn.Linear(256, 256)
    model.weight.grad = torch.zeros_like(model.weight)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 256)).sum().backward()
    opt.step()
    run = SimpleNamespace(device=torch.device("cpu"), model=model, optimizers=[opt, opt])
    state = memory_snapshot.model_state(run)
    params = (256 * 256 + 256) * 4 / 2**30
    assert state["parameters_gib"] == pytest.approx(params, abs=1e-4)
    assert state["gradients_gib"] == pytest.approx(params, abs=1e-4)
    assert state["optimizer_state_gib"] == pytest.approx(2 * params, abs=1e-4)  # exp_avg, exp_avg_sq (+ steps)


def test_the_module_is_exported():
    assert set(memory_snapshot.__all__) >= {"snapshot_step", "summarize_snapshot", "snapshot_lines"}


def test_on_cuda_the_history_is_on_for_one_step_and_off_after_an_error(monkeypatch):
    """snapshot_step against a stand-in torch.cuda: the history on with Python stacks before the step, the
    snapshot after it, off again; a step that raises (an OOM) still gives its snapshot, with the error."""
    calls = []
    cuda = torch.cuda
    monkeypatch.setattr(cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda, "current_device", lambda: 0)
    monkeypatch.setattr(cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(cuda, "memory_allocated", lambda *a: 500)
    monkeypatch.setattr(cuda, "max_memory_allocated", lambda *a: 1300)
    monkeypatch.setattr(cuda, "reset_peak_memory_stats", lambda *a: calls.append("reset"))

    def record(enabled="all", context="all", stacks="all", max_entries=1, device=None, clear_history=False):
        calls.append(("history", enabled, stacks, max_entries))

    monkeypatch.setattr(cuda.memory, "_record_memory_history", record)
    monkeypatch.setattr(cuda.memory, "_snapshot", lambda *a, **k: calls.append("snapshot") or _snapshot())

    def step():
        calls.append("step")

    s = snapshot_step(step, "cuda", max_entries=99)
    assert calls == ["reset", ("history", "all", "python", 99), "step", "snapshot", ("history", None, "all", 1)]
    assert s["peak_allocated_bytes"] == 1300 and s["step_error"] is None
    assert s["max_memory_allocated_gib"] == pytest.approx(1300 / 2**30, abs=1e-4)
    calls.clear()

    def oom():
        calls.append("step")
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    s = snapshot_step(oom, "cuda")
    assert calls[-3:] == ["step", "snapshot", ("history", None, "all", 1)]
    assert s["step_error"].startswith("OutOfMemoryError")
