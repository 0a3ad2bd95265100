"""runtime/training/graph_captures: every CUDA-graph capture that begins inside the block is counted and
passed on, the method is put back after the block (an error included), and step_timing files them per
measured step. No GPU here: capture_begin is a stand-in that records its calls."""

import pytest
import torch

from gemcompile.runtime.training.graph_captures import recording_graph_captures


@pytest.fixture
def stand_in(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin",
                        lambda self, *args, **kwargs: calls.append((args, kwargs)))
    return calls


def test_captures_are_counted_and_passed_on(stand_in):
    original = torch.cuda.CUDAGraph.capture_begin
    log = []
    with recording_graph_captures(log):
        torch.cuda.CUDAGraph.capture_begin(object(), capture_error_mode="thread_local")
        torch.cuda.CUDAGraph.capture_begin(object())
    torch.cuda.CUDAGraph.capture_begin(object())  # outside: not counted
    assert log == [1, 1] and len(stand_in) == 3
    assert stand_in[0] == ((), {"capture_error_mode": "thread_local"})
    assert torch.cuda.CUDAGraph.capture_begin is original


def test_the_method_is_restored_on_error(stand_in):
    original = torch.cuda.CUDAGraph.capture_begin
    with pytest.raises(RuntimeError), recording_graph_captures([]):
        raise RuntimeError("a failing step")
    assert torch.cuda.CUDAGraph.capture_begin is original


def test_the_timed_steps_file_captures_per_measured_step(stand_in, timed_stand_in_run):
    """Captures in the warm-up are not counted; two in measured step 2 are filed as (2, 2)."""
    calls = []

    def train_step(batch):
        calls.append(len(calls))
        captures = {1: 3, 6: 2}.get(len(calls), 0)  # warm-up step 0, measured step 2 (warmup=3)
        for _ in range(captures):
            torch.cuda.CUDAGraph.capture_begin(object())
        return torch.zeros(1), 0.5

    timings = timed_stand_in_run(train_step, warmup=3, steps=3)
    assert len(timings.step_ms) == 3 and timings.graph_captures == [(2, 2)] and len(stand_in) == 5
