"""runtime/training/kernel_time.py on a GPU: the profiler's kernel time of a step against CUDA-event time."""

import pytest
import torch

from gemcompile.runtime.training.kernel_time import kernel_ms_per_step

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


def test_kernel_time_of_a_gpu_bound_step_matches_event_time():
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)

    def step(x):
        for _ in range(8):
            x = x @ a
        return x

    step(a)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        step(a)
    end.record()
    end.synchronize()
    event_ms = start.elapsed_time(end) / 5
    kernel_ms = kernel_ms_per_step(step, [a], 5)
    # back-to-back large GEMMs: the GPU never waits for the host, so both clocks see the same work
    assert kernel_ms == pytest.approx(event_ms, rel=0.15)


def test_host_gaps_are_not_kernel_time():
    import time

    x = torch.randn(256, device="cuda")

    def step(v):
        time.sleep(0.005)  # host work the GPU waits through
        return v * 2

    kernel_ms = kernel_ms_per_step(step, [x], 4)
    assert 0 < kernel_ms < 1.0


def test_profile_of_gemms_names_them_and_counts_launches():
    from gemcompile.runtime.training.kernel_time import kernel_profile

    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)

    def step(x):
        for _ in range(4):
            x = x @ a
        return x.relu()

    step(a)
    prof = kernel_profile(step, [a], 3)
    # 4 cuBLAS GEMMs and one elementwise kernel a step, plus what cuBLAS adds around them (on the H200,
    # torch 2.11: a workspace memset per GEMM, classed as a copy); the GEMMs hold nearly all the time
    calls = {}
    for row in prof.top:
        calls[row["class"]] = calls.get(row["class"], 0) + row["calls_per_step"]
    assert calls["gemm"] == pytest.approx(4) and calls["other"] == pytest.approx(1), prof.top
    assert prof.kernels_per_step == pytest.approx(sum(calls.values())), prof.top
    assert next(iter(prof.by_class)) == "gemm" and prof.by_class["gemm"] > 0.9 * prof.ms_per_step
    assert prof.top[0]["class"] == "gemm" and prof.top[0]["calls_per_step"] == pytest.approx(4)


def test_idle_gaps_name_the_kernel_the_host_was_late_for():
    import time

    from gemcompile.runtime.training.kernel_time import kernel_profile

    a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)

    def step(x):
        y = x @ a
        torch.cuda.synchronize()
        time.sleep(0.004)  # the host is late for the relu
        return y.relu()

    step(a)
    prof = kernel_profile(step, [a], 3)
    idle = prof.idle
    assert idle["idle_ms_per_step"] >= 3.5 and idle["long_gaps_ms_per_step"] >= 3.5, idle
    top = idle["waits"][0]
    assert "relu" in top["waited_for"].lower() or "elementwise" in top["waited_for"], idle
    assert top["ms_per_step"] >= 3.5 and top["gaps_per_step"] == pytest.approx(1), idle
