"""runtime/training/host_profile: the profiled steps' Python functions ranked by own and cumulative time, per
step."""

import time

import pytest

from gemcompile.runtime.training.host_profile import host_profile


def _busy_wait(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:  # the clock read rarely: on a loaded machine its own time ranked first
        for _ in range(2000):
            pass


def _quick(x):
    return x + 1


def _step(x):
    _busy_wait(0.01)
    for _ in range(5):
        _quick(x)


def test_the_busiest_function_ranks_first_and_counts_are_per_step():
    result = host_profile(_step, [1, 2], steps=4)
    assert result["steps"] == 4 and result["wall_ms_per_step"] >= 10.0
    first = result["by_own_time"][0]
    assert "_busy_wait" in first["function"] and first["calls_per_step"] == 1.0
    assert first["own_ms_per_step"] >= 5.0
    quick = next(r for r in result["by_own_time"] if "_quick" in r["function"])
    assert quick["calls_per_step"] == 5.0
    top = result["by_cumulative_time"][0]
    assert top["cumulative_ms_per_step"] >= first["own_ms_per_step"]
    assert "test_host_profile.py" in first["function"]


def test_no_steps_is_an_error():
    with pytest.raises(ValueError, match="steps = 0"):
        host_profile(_step, [1], steps=0)
