"""The jagged attention Triton kernels with uniform_keys, run by the Triton interpreter on CPU
(TRITON_INTERPRET=1, set by conftest), against the float64 reference (itself checked against an independent
oracle in test_jagged_attention_uniform_keys.py). float32 and float16 only (the interpreter's tl.dot on
bfloat16 is wrong)."""

import os

import pytest
import torch

if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip(
        "interpreter tests: run on a machine without CUDA (conftest sets TRITON_INTERPRET=1)",
        allow_module_level=True,
    )
triton = pytest.importorskip("triton")

from test_jagged_attention_kv_mask_triton import check_against_reference, make_inputs  # noqa: E402
from tests.grids import pairwise  # noqa: E402

UNIFORM = torch.tensor([True, False, True, False])


@pytest.mark.parametrize("dtype,causal,kind", pairwise(
    {"fp32": torch.float32, "fp16": torch.float16}, {"full": False, "causal": True},
    {"no_mask": None, "holes": "holes", "left_pad": "left_pad"}))
def test_kernels_match_reference(kind, causal, dtype):
    B, H, L, D = 4, 2, 40, 32
    q, k, v, ql, kl, mask, bias = make_inputs(B, H, L, L, D, dtype, kind or "all_true", bias_shape=(B, H, L, L),
                                              seed=11)
    check_against_reference(q, k, v, ql, kl, mask if kind else None, bias, causal, D**-0.5, uniform=UNIFORM)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_shared_queries_no_lengths(causal):
    B, H, Lq, Lk, D = 4, 1, 24, 40, 16
    q, k, v, ql, _, _, bias = make_inputs(B, H, Lq, Lk, D, torch.float32, "all_true", shared_q=True,
                                          bias_shape=(1, H, 1, Lk), seed=12)
    check_against_reference(q, k, v, None, None, None, bias, causal, 0.3, uniform=UNIFORM)
    check_against_reference(q, k, v, ql, None, None, None, causal, 0.3, uniform=torch.ones(B, dtype=torch.bool))


def test_non_contiguous_flags_and_all_false():
    B, H, L, D = 4, 1, 24, 16
    q, k, v, ql, kl, mask, _ = make_inputs(B, H, L, L, D, torch.float32, "holes", seed=13)
    strided = torch.tensor([[True, False]] * B)[:, 0]  # stride 2
    strided[1] = False
    check_against_reference(q, k, v, ql, kl, mask, None, False, 0.3, uniform=strided)
    from gemcompile.lowering.jagged_attention.triton import jagged_attention_forward_triton

    off = torch.zeros(B, dtype=torch.bool)
    a, _ = jagged_attention_forward_triton(q, k, v, ql, kl, None, True, 0.3, mask, off)
    b, _ = jagged_attention_forward_triton(q, k, v, ql, kl, None, True, 0.3, mask)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
