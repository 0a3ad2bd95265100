"""Shared test setup.

Triton kernels run on the CPU under the interpreter when no GPU is present: TRITON_INTERPRET must be
set before triton is imported, so it is set here, at collection time.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    from tests.triton_interpreter_speedup import skip_repatching_inside_a_launch

    skip_repatching_inside_a_launch()
os.environ.setdefault("GEMCOMPILE_STRICT", "1")  # an internal error of a pass fails the test, not a refusal

import pytest  # noqa: E402

# The CPU tests' tensors are tiny, and OpenMP threads that spin stall badly on an oversubscribed 2-core
# machine: one intra-op thread for the whole session (fixtures of every scope included, so that runs
# compared bit for bit use the same reduction order).
torch.set_num_threads(1)

from tests.inductor_cpp import compile_cpp_without_simd  # noqa: E402

compile_cpp_without_simd()


def pytest_collection_modifyitems(config, items):
    from tests.slow_tier import select

    select(items, pytest)  # the fast tier unless GEMCOMPILE_SLOW_TESTS asks for more (tests/slow_tier.py)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _fresh_state():
    """Each test starts with a fresh Dynamo cache and a fixed seed."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    yield
    torch._dynamo.reset()


@pytest.fixture
def timed_stand_in_run():
    """step_timing.timed_steps over a stand-in run: ``timed_stand_in_run(train_step, warmup, steps)``
    trains with ``train_step(batch) -> (logits, loss)`` on CPU batches that carry nothing, and returns the
    Timings."""
    import types

    from gemcompile.runtime.training.step_timing import timed_steps

    class _Batch:
        seq_lengths = torch.ones(2)
        labels = label_mask = None

        def to(self, device):
            return self

    def run(train_step, warmup: int, steps: int):
        return timed_steps(types.SimpleNamespace(
            cfg=types.SimpleNamespace(warmup=warmup, steps=steps), device=torch.device("cpu"),
            data=types.SimpleNamespace(batch=lambda step: _Batch()), train_step=train_step,
            formula=types.SimpleNamespace(train_flops=lambda lengths, b: 1.0),
            window=types.SimpleNamespace(update=lambda *a: None), batch_size=2))

    return run


@pytest.fixture
def nan_empty():
    """torch.empty and friends give NaN (ints: their maximum) instead of whatever memory held: a test of
    outputs allocated empty then fills every row it claims to, instead of passing on fresh zero pages."""
    was = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    filled = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.utils.deterministic.fill_uninitialized_memory = filled
    torch.use_deterministic_algorithms(was[0], warn_only=was[1])
