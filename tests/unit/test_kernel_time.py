"""runtime/training/kernel_time.py without a GPU: nothing runs on a device, so there is no kernel time."""

import pytest
import torch

from gemcompile.runtime.training.kernel_time import kernel_ms_per_step


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only answer")
def test_no_device_no_kernel_time():
    calls = []
    assert kernel_ms_per_step(calls.append, [1], 3) is None
    assert calls == []  # the step is not run for nothing


class _Event:  # the fields of a torch.profiler key average that summarize_kernels reads
    def __init__(self, key, device_us, count):
        self.key, self.self_device_time_total, self.count = key, device_us, count


@pytest.mark.parametrize("name, label", [
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopB_TNT", "gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
    ("triton_tem_fused_mm_0", "gemm"),
    ("triton_red_fused_native_layer_norm_backward_3", "inductor"),
    ("triton_poi_fused_add_mul_7", "inductor"),
    ("_jagged_fwd_kernel", "gemcompile"),
    ("Memcpy HtoD (Pageable -> Device)", "copy"),
    ("void at::native::vectorized_elementwise_kernel<4, ...>", "other"),
])
def test_kernel_class(name, label):
    from gemcompile.runtime.training.kernel_time import kernel_class

    assert kernel_class(name) == label


def test_summarize_kernels_per_step_totals_and_order():
    from gemcompile.runtime.training.kernel_time import summarize_kernels

    events = [_Event("triton_poi_fused_add_0", 300.0, 6), _Event("nvjet_gemm_a", 1200.0, 3),
              _Event("cudaLaunchKernel", 0.0, 40),  # host-side: no device time, left out
              _Event("_gdpa_fwd_kernel", 600.0, 3), _Event("Memcpy HtoD", 900.0, 3)]
    prof = summarize_kernels(events, steps=3, top=2)
    assert prof.ms_per_step == pytest.approx(3000.0 / 1e3 / 3)
    assert prof.kernels_per_step == pytest.approx(15 / 3)
    assert prof.by_class == pytest.approx({"gemm": 0.4, "copy": 0.3, "gemcompile": 0.2, "inductor": 0.1})
    assert list(prof.by_class) == ["gemm", "copy", "gemcompile", "inductor"]  # largest first
    assert [k["name"] for k in prof.top] == ["nvjet_gemm_a", "Memcpy HtoD"]
    assert prof.top[0]["share"] == pytest.approx(0.4) and prof.top[0]["calls_per_step"] == 1.0
    assert prof.as_json()["by_class_ms"] is prof.by_class
    with pytest.raises(ValueError, match="steps"):
        summarize_kernels(events, steps=0)


def test_idle_gaps_sum_the_waits_and_rank_the_kernels_launched_late():
    from gemcompile.runtime.training.kernel_time import idle_gaps

    # two steps: a 100 us wait before "late" each step, 10 us (below min_us) before "b", overlap is not idle
    spans = []
    for t0 in (0.0, 1000.0):
        spans += [(t0, t0 + 50, "a"), (t0 + 60, t0 + 100, "b"), (t0 + 90, t0 + 120, "c"),
                  (t0 + 220, t0 + 300, "late")]
    idle = idle_gaps(spans, steps=2, min_us=20.0)
    # per step: 10 (a -> b) + 100 (c -> late); between the steps 700 (late -> a) once
    assert idle["idle_ms_per_step"] == pytest.approx((2 * 110 + 700) / 1e3 / 2)
    assert idle["long_gaps_ms_per_step"] == pytest.approx((2 * 100 + 700) / 1e3 / 2)
    first, second = idle["waits"]
    assert (first["waited_for"], first["after"]) == ("a", "late") and first["gaps_per_step"] == 0.5
    assert (second["waited_for"], second["after"]) == ("late", "c")
    assert second["ms_per_step"] == pytest.approx(0.1) and second["gaps_per_step"] == 1
    assert idle_gaps([], steps=1) is None
    with pytest.raises(ValueError, match="steps"):
        idle_gaps(spans, steps=0)
