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
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", lambda **kwargs: seen.append(kwargs["fn"].name))
    previous = knobs.runtime.jit_post_compile_hook
    log = []
    with recording_triton_compiles(log):
        knobs.runtime.jit_post_compile_hook(key=None, repr="r", fn=_Info(), compile={}, is_manual_warmup=False,
                                            already_compiled=False)
    assert log == ["_rank_kernel"] and seen == ["_rank_kernel"]
    assert knobs.runtime.jit_post_compile_hook is previous


def test_nothing_recorded_outside_and_the_hook_restored_on_error(monkeypatch):
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    log = []
    with pytest.raises(RuntimeError), recording_triton_compiles(log):
        raise RuntimeError("a failing step")
    assert knobs.runtime.jit_post_compile_hook is None and log == []
