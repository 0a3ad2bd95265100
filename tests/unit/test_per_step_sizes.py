"""Kernels taking per-batch sizes (packed token counts, a packed lse's head stride) do not specialize on
them (common/attention_triton.PER_STEP_SIZES): else the first batch whose T is a multiple of 16 compiles
every such kernel again inside a training step. And the direct launcher's specialization key follows the
kernels' do_not_specialize, so such a batch still takes the direct path."""

import importlib

import pytest
import torch

from gemcompile.lowering.common import tuned_launch
from gemcompile.lowering.common.attention_triton import PER_STEP_SIZES

MODULES = ["gemcompile.lowering.jagged_attention.triton", "gemcompile.lowering.block_attention.triton",
           "gemcompile.lowering.gdpa.triton", "gemcompile.lowering.gdpa.bias_grad_triton",
           "gemcompile.lowering.common.attention_triton"]


def _launched_kernels():
    """(module, name, the JIT function) of every kernel the modules launch (autotuned or plain)."""
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        for name, value in vars(module).items():
            fn = getattr(value, "fn", value)  # an Autotuner wraps the JIT function
            if name.endswith("_kernel") and hasattr(fn, "arg_names"):
                yield module_name, name, fn


def test_every_kernel_with_a_per_step_size_leaves_it_unspecialized():
    found = 0
    for module_name, name, fn in _launched_kernels():
        per_step = set(fn.arg_names) & set(PER_STEP_SIZES)
        if per_step:
            found += 1
            # a JITFunction keeps the list; the interpreter's function (TRITON_INTERPRET=1) its jit kwargs
            fixed = getattr(fn, "do_not_specialize", None) or getattr(fn, "kwargs", {}).get(
                "do_not_specialize")
            assert per_step <= set(fixed or ()), f"{module_name}.{name} specializes on {per_step}"
    assert found >= 10  # jagged 3, block 5, GDPA 4, the delta kernel


def test_the_direct_launch_key_ignores_divisibility_of_unspecialized_ints():
    class Param:
        def __init__(self, fixed):
            self.do_not_specialize = fixed

    params = (Param(False), Param(True), Param(False))
    t = torch.empty(4)
    key = tuned_launch._specialization
    # a per-step size (second argument) changes its divisibility by 16: the same key
    assert key((t, 4096, 7), params) == key((t, 4097, 7), params)
    # a specialized int still tells 16 from 17, and width still counts for an unspecialized one
    assert key((t, 4096, 16), params) != key((t, 4096, 17), params)
    assert key((t, 4096, 7), params) != key((t, 2 ** 40, 7), params)
    # without params (another kernel object), every int counts as before
    assert key((t, 4096, 7)) != key((t, 4097, 7))


@pytest.mark.parametrize("value", [1, 16, 17])
def test_key_of_a_specialized_int(value):
    assert tuned_launch._specialization((value,)) == ((value == 1, value % 16 == 0, True, False),)
