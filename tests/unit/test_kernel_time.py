"""runtime/kernel_time.py without a GPU: nothing runs on a device, so there is no kernel time."""

import pytest
import torch

from gemcompile.runtime.kernel_time import kernel_ms_per_step


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only answer")
def test_no_device_no_kernel_time():
    calls = []
    assert kernel_ms_per_step(calls.append, [1], 3) is None
    assert calls == []  # the step is not run for nothing
