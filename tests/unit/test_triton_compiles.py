"""runtime/training/triton_compiles: every JIT compile inside the block is recorded, a hook installed before
keeps being called, and the hook is put back after the block."""

import pytest

triton = pytest.importorskip("triton")
knobs = pytest.importorskip("triton.knobs")

from gemcompile.runtime.training.triton_compiles import recording_triton_compiles  # noqa: E402


class _Info:
    name = "_rank_kernel"


def test_compiles_are_recorded_and_the_previous_hook_kept(monkeypatch):
    seen = []
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook",
                        lambda **kwargs: seen.append(kwargs["fn"].name))
    previous = knobs.runtime.jit_post_compile_hook
    log = []
    with recording_triton_compiles(log):
        knobs.runtime.jit_post_compile_hook(key=None, repr="r", fn=_Info(), compile={},
                                            is_manual_warmup=False, already_compiled=False)
    assert log == ["_rank_kernel"] and seen == ["_rank_kernel"]
    assert knobs.runtime.jit_post_compile_hook is previous


def test_nothing_recorded_outside_and_the_hook_restored_on_error(monkeypatch):
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    log = []
    with pytest.raises(RuntimeError), recording_triton_compiles(log):
        raise RuntimeError("a failing step")
    assert knobs.runtime.jit_post_compile_hook is None and log == []


def test_the_timed_steps_record_a_compile_inside_a_measured_step_with_its_index(monkeypatch,
                                                                                 timed_stand_in_run):
    """step_timing.timed_steps: a JIT compile during the warm-up is not counted; one inside measured step 1
    is recorded as (1, kernel)."""
    import torch

    calls = []

    def train_step(batch):
        calls.append(len(calls))
        if len(calls) in (1, 4):  # warm-up step 0 and measured step 1 (warmup=2)
            knobs.runtime.jit_post_compile_hook(key=None, repr="r", fn=_Info(), compile={},
                                                is_manual_warmup=False, already_compiled=False)
        return torch.zeros(1), 0.5

    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    timings = timed_stand_in_run(train_step, warmup=2, steps=3)
    assert len(timings.step_ms) == 3 and timings.triton_compiles == [(1, "_rank_kernel")]
    assert knobs.runtime.jit_post_compile_hook is None
