"""The jagged backward with dQ added atomically by the dK/dV kernel (lowering/jagged_attention/atomic_dq.py),
under the Triton interpreter, against the float64 reference: the padded layout (shared queries, a bias
without gradient, causal), data key masks, the packed layouts with dropout; which kernels run; and the
cases that must keep the deterministic dQ kernel (a bias gradient, deterministic algorithms, the switch off).
"""

import os

import pytest
import torch

if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("interpreter tests: run on a machine without CUDA (conftest sets TRITON_INTERPRET=1)",
                allow_module_level=True)
triton = pytest.importorskip("triton")

from test_attention_dropout import test_triton_kernels_equal_the_reference_for_one_seed as dropout_case
from test_jagged_attention_kv_mask_triton import check_against_reference as check_with_mask
from test_jagged_attention_kv_mask_triton import make_inputs as make_mask_inputs
from test_jagged_attention_triton import check_against_reference, make_inputs

from gemcompile.lowering.jagged_attention import triton as kernels
from gemcompile.lowering.jagged_attention.atomic_dq import atomic_dq_enabled


@pytest.fixture
def launched(monkeypatch):
    """The names of the autotuned kernels the jagged launchers start, in order."""
    names = []
    real = kernels.launch

    def spy(kernel, *args, **kwargs):
        names.append(kernel.base_fn.__name__)
        return real(kernel, *args, **kwargs)

    monkeypatch.setattr(kernels, "launch", spy)
    return names


@pytest.fixture
def atomic(monkeypatch):
    monkeypatch.setenv("GEMCOMPILE_ATOMIC_DQ", "1")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shared_q,bias", [(False, None), (True, None), (False, (1, 2, 40, 40))],
                         ids=["q_per_batch", "q_shared", "bias_without_grad"])
def test_matches_the_reference(atomic, launched, dtype, causal, shared_q, bias):
    B, H, L, D = 4, 2, 40, 32
    q, k, v, ql, kl, bias = make_inputs(B, H, L, L, D, dtype, shared_q=shared_q, bias_shape=bias, seed=3)
    _, _, (dq, *_) = check_against_reference(q, k, v, ql, kl, bias, causal, D**-0.5, bias_grad=False)
    assert "_bwd_dq_kernel" not in launched and launched.count("_bwd_dkdv_kernel") >= 1
    if not shared_q:  # padded query rows (batch 3 has no valid one) get exactly zero
        assert (dq.transpose(1, 2)[torch.arange(L)[None, :] >= ql[:, None]] == 0).all()


@pytest.mark.parametrize("kind", ["left_pad", "holes"])
def test_data_key_masks(atomic, launched, kind):
    B, H, L, D = 4, 2, 40, 16
    q, k, v, ql, kl, mask, _ = make_mask_inputs(B, H, L, L, D, torch.float32, kind, seed=5)
    check_with_mask(q, k, v, ql, kl, mask, None, True, 0.3, bias_grad=False)
    assert "_bwd_dq_kernel" not in launched


@pytest.mark.parametrize("layout,causal", [("packed_self", True), ("packed_keys", False), ("kv_mask", False)])
def test_packed_layouts_with_dropout(atomic, launched, layout, causal):
    dropout_case(layout, causal)
    assert "_bwd_dq_kernel" not in launched


@pytest.mark.parametrize("scratch", [True, False], ids=["scratch", "near_miss_no_scratch"])
def test_first_call_tunes_on_a_scratch_accumulator(atomic, monkeypatch, scratch):
    """The autotuner runs a new key's kernel once per config (the interpreter cannot time configs, so a stand-in
    runs the first dK/dV launch twice): the adds of the tuning runs must not reach dQ. The near miss skips the
    scratch launch, and dQ comes out doubled."""
    real = kernels.launch
    seen = set()

    def autotuner_like(kernel, grid, args, consts, buckets):
        if kernel is kernels._bwd_dkdv_kernel and kernel not in seen:
            seen.add(kernel)
            real(kernel, grid, args, consts, buckets)  # a second config's run
        return real(kernel, grid, args, consts, buckets)

    monkeypatch.setattr(kernels, "launch", autotuner_like)
    monkeypatch.setattr(kernels, "is_tuned", lambda kernel, *rest: kernel in seen or not scratch)
    q, k, v, ql, kl, _ = make_inputs(4, 1, 40, 40, 16, torch.float32, seed=7)
    if scratch:
        check_against_reference(q, k, v, ql, kl, None, False, 0.25)
    else:
        with pytest.raises(AssertionError, match="dq"):
            check_against_reference(q, k, v, ql, kl, None, False, 0.25)


def test_bias_gradient_keeps_the_dq_kernel(atomic, launched):
    """dS for the bias comes from the dQ kernel, so that kernel runs (and computes dQ)."""
    q, k, v, ql, kl, bias = make_inputs(4, 2, 24, 24, 16, torch.float32, bias_shape=(1, 2, 24, 24), seed=9)
    check_against_reference(q, k, v, ql, kl, bias, True, 0.25, bias_grad=True)
    assert "_bwd_dq_kernel" in launched


def test_deterministic_algorithms_and_the_switch(monkeypatch):
    device = torch.device("cuda")  # the default applies to CUDA only; the device is not touched
    monkeypatch.setenv("GEMCOMPILE_ATOMIC_DQ", "1")
    assert atomic_dq_enabled(device)
    previous = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        assert not atomic_dq_enabled(device)
    finally:
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])
    monkeypatch.setenv("GEMCOMPILE_ATOMIC_DQ", "0")
    assert not atomic_dq_enabled(device)
    monkeypatch.delenv("GEMCOMPILE_ATOMIC_DQ")
    assert not atomic_dq_enabled(torch.device("cpu"))


def test_deterministic_algorithms_run_the_dq_kernel(atomic, launched):
    q, k, v, ql, kl, _ = make_inputs(4, 1, 24, 24, 16, torch.float32, seed=11)
    previous = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        check_against_reference(q, k, v, ql, kl, None, False, 0.25)
    finally:
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])
    assert "_bwd_dq_kernel" in launched
