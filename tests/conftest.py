"""Shared test setup.

Triton kernels run on the CPU under the interpreter when no GPU is present: TRITON_INTERPRET must be
set before triton is imported, so it is set here, at collection time.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# The CPU tests' tensors are tiny, and OpenMP threads that spin stall badly on an oversubscribed 2-core
# machine: one intra-op thread for the whole session (fixtures of every scope included, so that runs
# compared bit for bit use the same reduction order).
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
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
