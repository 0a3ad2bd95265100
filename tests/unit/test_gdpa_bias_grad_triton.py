"""GDPA's in-kernel bias gradient (lowering/gdpa/bias_grad_triton.py) under the Triton interpreter, against
the float64 reference: every way a full (Lq, Lk) bias can be shared (batch, heads, both, neither), the
pair loop split into parts, every mask family (each pair of the three: tests/grids.py), zero-length and
full-length sequences; and which path a
bias takes (full dims: the kernel; broadcast rows or columns: the dQ kernel's buffer)."""

import os

import pytest
import torch

if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("interpreter tests: run on a machine without CUDA (conftest sets TRITON_INTERPRET=1)",
                allow_module_level=True)
pytest.importorskip("triton")

from gemcompile.lowering.gdpa import triton as gdpa_triton
from gemcompile.lowering.gdpa.reference import reference_gdpa_backward
from gemcompile.lowering.gdpa.triton import gdpa_backward_triton
from gemcompile.lowering.gdpa.spec import GdpaSpec
from tests.grids import pairwise

B, H, L, D = 3, 2, 37, 16
KV_LENGTHS = torch.tensor([L, 0, 20])  # full, empty, partial
Q_LENGTHS = torch.tensor([30, 5, L])


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def inputs(bias_shape, shared_q=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1 if shared_q else B, H, L, D, generator=g)
    k, v = torch.randn(B, H, L, D, generator=g), torch.randn(B, H, L, D, generator=g)
    bias = 0.5 * torch.randn(bias_shape, generator=g)
    grad_out = torch.randn(B, H, L, D, generator=g)
    return q, k, v, bias, grad_out


def dbias_of(q, k, v, bias, grad_out, ql, kl, args, hstu=(None, 0), splits=None):
    return gdpa_backward_triton(grad_out, q, k, v, ql, kl, bias,
                                *GdpaSpec.from_bwd_schema(*args, True, *hstu), bias_grad_splits=splits)[3]


def reference_dbias(q, k, v, bias, grad_out, ql, kl, args, hstu=(None, 0)):
    d64 = [x.double() for x in (grad_out, q, k, v)]
    return reference_gdpa_backward(*d64, ql, kl, bias.double(),
                                   *GdpaSpec.from_bwd_schema(*args, True, *hstu))[3]


SHAPES = {"shared_by_all": (1, 1, L, L), "per_batch": (B, 1, L, L), "per_head": (1, H, L, L),
          "per_pair": (B, H, L, L)}
# (activation, scale, out_scale, divide_by_kv_length, causal, window)
MASKS = {"causal_silu_divide": ("silu", 0.3, 1.0, True, True, 0),
         "window_gelu": ("gelu", 0.25, 1.5, False, False, 5),
         "causal_window_relu_squared": ("relu_squared", 0.2, 1.0, False, True, 7),
         "none_sigmoid": ("sigmoid", 0.25, 1.0, False, False, 0)}


@pytest.mark.parametrize("shape,mask,splits", pairwise(list(SHAPES), list(MASKS), [1, 2, 5]))
def test_matches_the_reference(shape, mask, splits):
    q, k, v, bias, grad_out = inputs(SHAPES[shape], seed=len(shape) + len(mask))
    args = MASKS[mask]
    got = dbias_of(q, k, v, bias, grad_out, Q_LENGTHS, KV_LENGTHS, args, splits=splits)
    want = reference_dbias(q, k, v, bias, grad_out, Q_LENGTHS, KV_LENGTHS, args)
    assert got.shape == bias.shape and got.dtype == bias.dtype
    assert rel(got, want) < 5e-5, rel(got, want)


@pytest.mark.parametrize("targets,contextual_len", [([5, 0, 20], 0), (None, 4), ([3, 0, 2], 9)],
                         ids=["targets", "contextual", "both"])
def test_hstu_targets_and_contextual_prefix(targets, contextual_len):
    """HSTU's masks; with a contextual prefix the kernel visits tiles above the diagonal too."""
    q, k, v, bias, grad_out = inputs((1, 1, L, L), seed=contextual_len)
    args = ("silu", 0.3, 1.0 / L, False, True, 0)
    hstu = (None if targets is None else torch.tensor(targets), contextual_len)
    want = reference_dbias(q, k, v, bias, grad_out, None, KV_LENGTHS, args, hstu)
    for splits in (1, 4):
        got = dbias_of(q, k, v, bias, grad_out, None, KV_LENGTHS, args, hstu, splits)
        assert rel(got, want) < 5e-5, (splits, rel(got, want))


def test_shared_queries_and_fp16():
    """PMA-style queries shared by the batch (batch stride 0), in float16."""
    q, k, v, bias, grad_out = (t.half() for t in inputs((1, H, L, L), shared_q=True, seed=7))
    args = ("gelu_tanh", 0.25, 1.0, True, False, 0)
    got = dbias_of(q, k, v, bias, grad_out, None, KV_LENGTHS, args, splits=2)
    want = reference_dbias(q, k, v, bias, grad_out, None, KV_LENGTHS, args)
    assert got.dtype == torch.float16 and rel(got, want) < 8e-3, rel(got, want)


def test_no_valid_pair_gives_zeros():
    q, k, v, bias, grad_out = inputs((1, 1, L, L))
    args = MASKS["causal_silu_divide"]
    got = dbias_of(q, k, v, bias, grad_out, Q_LENGTHS, torch.zeros(B, dtype=torch.long), args, splits=3)
    assert torch.equal(got, torch.zeros_like(bias))
    empty_k = k[:, :, :0]
    got = gdpa_backward_triton(grad_out, q, empty_k, empty_k, None, None, bias[..., :0],
                               *GdpaSpec.from_bwd_schema(*args, True))[3]
    assert got.shape == (1, 1, L, 0)


@pytest.mark.parametrize("shape,in_kernel", [((1, 1, L, L), True), ((B, H, L, L), True), ((1, 1, 1, L), False),
                                             ((B, 1, L, 1), False)], ids=["full_shared", "full", "keys", "rows"])
def test_which_path_a_bias_takes(monkeypatch, shape, in_kernel):
    """Full (Lq, Lk) biases never build the (B, H, Lq, Lk) buffer; broadcast rows or columns do, and still
    match the reference."""
    calls = []
    real = gdpa_triton.reduce_bias_grad

    def spy(ds, bias):
        calls.append(tuple(ds.shape))
        return real(ds, bias)

    monkeypatch.setattr(gdpa_triton, "reduce_bias_grad", spy)
    q, k, v, bias, grad_out = inputs(shape, seed=3)
    args = MASKS["window_gelu"]
    got = dbias_of(q, k, v, bias, grad_out, Q_LENGTHS, KV_LENGTHS, args)
    assert rel(got, reference_dbias(q, k, v, bias, grad_out, Q_LENGTHS, KV_LENGTHS, args)) < 5e-5
    assert calls == ([] if in_kernel else [(B, H, L, L)])
