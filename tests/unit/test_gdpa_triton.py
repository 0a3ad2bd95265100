"""The Triton kernels of GDPA, run by the Triton interpreter on CPU (TRITON_INTERPRET=1, set by conftest),
against the float64 reference. The launchers are called directly with CPU tensors.

The interpreter runs one small config per kernel (BLOCK_M != BLOCK_N), so these small shapes cover
several tiles, partial tiles, skipped tiles, the causal diagonal and both window edges. bfloat16 is not
tested here: the triton 3.9 interpreter computes tl.dot on bfloat16 wrongly; the GPU tests cover it.
"""

import os

import pytest
import torch

if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip(
        "interpreter tests: run on a machine without CUDA (conftest sets TRITON_INTERPRET=1)",
        allow_module_level=True,
    )
triton = pytest.importorskip("triton")

from gemcompile.lowering.gdpa.reference import (  # noqa: E402
    GDPA_ACTIVATIONS,
    reference_gdpa_backward,
    reference_gdpa_forward,
)
from gemcompile.lowering.gdpa.triton import gdpa_backward_triton, gdpa_forward_triton  # noqa: E402
from gemcompile.lowering.gdpa.spec import GdpaSpec  # noqa: E402
from tests.grids import pairwise  # noqa: E402

TOL = {torch.float32: (2e-5, 5e-5), torch.float16: (3e-3, 8e-3)}  # (forward, backward) relative-norm error


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def jagged_lengths(B, L, g, specials):
    return torch.tensor(
        [
            specials[i] if i < len(specials) else int(torch.randint(0, L + 1, (1,), generator=g))
            for i in range(B)
        ]
    )


def make_inputs(B, H, Lq, Lk, D, dtype, shared_q=False, bias_shape=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1 if shared_q else B, H, Lq, D, generator=g).to(dtype)
    k = torch.randn(B, H, Lk, D, generator=g).to(dtype)
    v = torch.randn(B, H, Lk, D, generator=g).to(dtype)
    # batch 0: all queries, odd kv length; 1: odd q, full kv; 2: one query, no keys; 3: no queries
    ql = jagged_lengths(B, Lq, g, [Lq, (Lq // 2) | 1, 1, 0])
    kl = jagged_lengths(B, Lk, g, [(Lk // 3) | 1, Lk, 0, 1])
    bias = None if bias_shape is None else (0.5 * torch.randn(bias_shape, generator=g)).to(dtype)
    return q, k, v, ql, kl, bias


def check_against_reference(
    q,
    k,
    v,
    ql,
    kl,
    bias,
    activation,
    scale=0.25,
    out_scale=1.0,
    divide=False,
    causal=False,
    window=0,
    bias_grad=True,
    seed=1,
    num_targets=None,
    contextual_len=0,
):
    dtype = q.dtype
    args = (activation, scale, out_scale, divide, causal, window)
    hstu = (num_targets, contextual_len)
    out = gdpa_forward_triton(q, k, v, ql, kl, bias, *GdpaSpec.from_schema(*args, *hstu))
    d64 = [None if x is None else x.double() for x in (q, k, v, bias)]
    ref_out = reference_gdpa_forward(*d64[:3], ql, kl, d64[3], *GdpaSpec.from_schema(*args, *hstu))
    fwd_tol, bwd_tol = TOL[dtype]
    assert out.dtype == dtype and out.is_contiguous() and out.shape == ref_out.shape
    assert not out.isnan().any()
    assert rel(out, ref_out) < fwd_tol, rel(out, ref_out)
    if ql is not None:  # padded query rows are exactly zero
        pad = torch.arange(q.shape[2])[None, :] >= ql[:, None]
        assert (out.transpose(1, 2)[pad] == 0).all()

    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    want_bias_grad = bias is not None and bias_grad
    dq, dk, dv, dbias = gdpa_backward_triton(grad_out, q, k, v, ql, kl, bias,
                                             *GdpaSpec.from_bwd_schema(*args, want_bias_grad, *hstu))
    ref = reference_gdpa_backward(grad_out.double(), *d64[:3], ql, kl, d64[3],
                                  *GdpaSpec.from_bwd_schema(*args, want_bias_grad, *hstu))
    for name, got, want, like in (("dq", dq, ref[0], q), ("dk", dk, ref[1], k), ("dv", dv, ref[2], v)):
        assert got.shape == like.shape and got.dtype == like.dtype, name
        assert not got.isnan().any(), name
        assert rel(got, want) < bwd_tol, (name, rel(got, want))
    if want_bias_grad:
        assert dbias.shape == bias.shape and dbias.dtype == bias.dtype
        assert rel(dbias, ref[3]) < bwd_tol, ("dbias", rel(dbias, ref[3]))
    else:
        assert dbias.numel() == 0
    return out, (dq, dk, dv, dbias)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("activation", GDPA_ACTIVATIONS)
def test_every_activation(activation, dtype):
    B, H, L, D = 3, 2, 40, 32
    q, k, v, ql, kl, bias = make_inputs(B, H, L, L, D, dtype, bias_shape=(B, H, L, L), seed=len(activation))
    check_against_reference(q, k, v, ql, kl, bias, activation, divide=True)


MASKS = {"causal": (True, 0), "window": (False, 5), "causal_window": (True, 7), "window_1": (False, 1)}


@pytest.mark.parametrize("dtype,mask,shared_q", pairwise(
    {"fp32": torch.float32, "fp16": torch.float16}, {m: m for m in MASKS}, {"q_per_batch": False, "q_shared": True}))
def test_causal_and_window(dtype, mask, shared_q):
    causal, window = MASKS[mask]
    B, H, L, D = 3, 2, 40, 16
    act = GDPA_ACTIVATIONS[(len(mask) + shared_q) % len(GDPA_ACTIVATIONS)]
    q, k, v, ql, kl, bias = make_inputs(B, H, L, L, D, dtype, shared_q, (1, H, L, L), seed=len(mask))
    check_against_reference(q, k, v, ql, kl, bias, act, 0.3, 1.5, False, causal, window)


@pytest.mark.parametrize(
    "B,H,Lq,Lk,D,causal,window,q_lengths,kv_lengths,divide",
    [
        (2, 1, 7, 40, 16, False, 0, True, True, True),  # few queries, many keys (PMA-like)
        (3, 2, 40, 9, 24, True, 0, True, True, False),  # head dim not a power of two (BLOCK_D 32, masked)
        (2, 2, 33, 33, 16, True, 3, False, True, True),  # no q_lengths: every query row valid
        (3, 1, 21, 37, 16, False, 9, True, False, True),  # no kv_lengths: every key valid
        (2, 1, 35, 18, 32, False, 0, False, False, True),  # no lengths at all
        (1, 1, 1, 17, 16, False, 0, False, True, False),  # a single query row
    ],
)
def test_shapes_and_optional_lengths(B, H, Lq, Lk, D, causal, window, q_lengths, kv_lengths, divide):
    q, k, v, ql, kl, _ = make_inputs(B, H, Lq, Lk, D, torch.float32, seed=Lq + Lk)
    check_against_reference(
        q,
        k,
        v,
        ql if q_lengths else None,
        kl if kv_lengths else None,
        None,
        "silu",
        0.3,
        0.8,
        divide,
        causal,
        window,
    )


@pytest.mark.parametrize(
    "fwd_tile,dkdv_tile",
    [((16, 32), (32, 16)), ((16, 16), (16, 16)), ((64, 16), (16, 64))],
    ids=["wide_keys", "square", "tall_queries"],
)
def test_other_tile_shapes(monkeypatch, fwd_tile, dkdv_tile):
    """The loop bounds (skipped tiles, unmasked/masked split, diagonal, window edges) for other tiles."""
    from gemcompile.lowering.gdpa import triton as kernels

    def config(m, n):
        return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=4, num_stages=1)]

    monkeypatch.setattr(kernels._gdpa_fwd_kernel, "configs", config(*fwd_tile))
    monkeypatch.setattr(kernels._gdpa_bwd_dq_kernel, "configs", config(*fwd_tile))
    monkeypatch.setattr(kernels._gdpa_bwd_dkdv_kernel, "configs", config(*dkdv_tile))
    B, H, L, D = 3, 1, 40, 16
    q, k, v, ql, kl, bias = make_inputs(B, H, L, L, D, torch.float32, bias_shape=(1, H, L, L), seed=31)
    for causal, window in ((False, 0), (True, 0), (False, 6), (True, 18)):
        check_against_reference(q, k, v, ql, kl, bias, "gelu", 0.25, 1.0, True, causal, window)


def test_bias_without_grad_and_per_batch_key_bias():
    B, H, L, D = 3, 2, 24, 16
    q, k, v, ql, kl, bias = make_inputs(B, H, L, L, D, torch.float32, bias_shape=(B, 1, 1, L), seed=4)
    check_against_reference(q, k, v, ql, kl, bias, "relu_squared", bias_grad=False)
    check_against_reference(q, k, v, ql, kl, bias, "sigmoid", causal=True, window=4, bias_grad=True)


@pytest.mark.parametrize("bias_shape", ["1,1,L,L", "B,1,L,L", "1,1,1,L"])
@pytest.mark.parametrize("causal,window", [(True, 0), (False, 6)], ids=["causal", "window"])
def test_head_shared_bias_grad_summed_in_program(bias_shape, causal, window):
    """A bias shared by the heads (HSTU's relative bias): its gradient is dS reduced over the broadcast dims,
    equal to the float64 reference's. (Summing the heads inside the dQ programs was tried and measured
    on the H200: the dQ kernel went from 104 to 336 us for 71 us saved on the fp32 buffer; reverted.)"""
    B, H, L, D = 3, 3, 37, 16
    shape = tuple(B if d == "B" else L if d == "L" else int(d) for d in bias_shape.split(","))
    q, k, v, ql, kl, bias = make_inputs(B, H, L, L, D, torch.float32, bias_shape=shape, seed=len(bias_shape))
    check_against_reference(q, k, v, ql, kl, bias, "silu", 0.3, 1.0 / L, False, causal, window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_permuted_blhd_views(dtype):
    """q, k, v as permuted views of (B, L, H, D) projections, read through their strides."""
    B, L, H, D = 3, 37, 2, 32
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(B, L, 3, H, D, generator=g).to(dtype)
    q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))
    assert not q.is_contiguous()
    ql = kl = torch.tensor([37, 5, 0])
    out, _ = check_against_reference(q, k, v, ql, kl, None, "silu", causal=True)
    out_c = gdpa_forward_triton(q.contiguous(), k.contiguous(), v.contiguous(), ql, kl, None,
                                *GdpaSpec.from_schema("silu", 0.25, 1.0, False, True, 0))
    torch.testing.assert_close(out, out_c, rtol=0, atol=0)


def test_padding_garbage_never_leaks():
    B, H, L, D = 3, 2, 35, 16
    q, k, v, _, _, bias = make_inputs(B, H, L, L, D, torch.float32, bias_shape=(B, H, L, L), seed=5)
    ql, kl = torch.tensor([35, 3, 0]), torch.tensor([17, 35, 4])
    args = ("sigmoid", 0.25, 1.0, True, False, 6)
    clean_out = gdpa_forward_triton(q, k, v, ql, kl, bias, *GdpaSpec.from_schema(*args))
    pos = torch.arange(L)
    q_pad = (pos[None, :] >= ql[:, None])[:, None, :, None]
    k_pad = (pos[None, :] >= kl[:, None])[:, None, :, None]
    dirty = (
        q.masked_fill(q_pad, float("nan")),
        k.masked_fill(k_pad, float("nan")),
        v.masked_fill(k_pad, float("inf")),
        bias.masked_fill(q_pad | k_pad.transpose(2, 3), float("nan")),
    )
    out = gdpa_forward_triton(*dirty[:3], ql, kl, dirty[3], *GdpaSpec.from_schema(*args))
    torch.testing.assert_close(out, clean_out, rtol=0, atol=0)
    assert (out.masked_select(q_pad.expand_as(out)) == 0).all()
    g = torch.randn_like(out).masked_fill(q_pad, float("nan"))
    grads = gdpa_backward_triton(g, *dirty[:3], ql, kl, dirty[3], *GdpaSpec.from_bwd_schema(*args, True))
    clean = gdpa_backward_triton(torch.nan_to_num(g), q, k, v, ql, kl, bias,
                                 *GdpaSpec.from_bwd_schema(*args, True))
    for a, b in zip(grads, clean):
        assert not a.isnan().any()
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_zero_lengths_everywhere_and_empty_keys():
    """sigmoid(0) = 0.5 would show any pair that is scored instead of dropped; divide by 0 gives 0."""
    B, H, L, D = 2, 2, 20, 16
    q, k, v, _, _, _ = make_inputs(B, H, L, L, D, torch.float32)
    zeros = torch.zeros(B, dtype=torch.long)
    for ql, kl in ((None, zeros), (zeros, None)):
        args = ("sigmoid", 0.3, 1.0, True, True, 0)
        out = gdpa_forward_triton(q, k, v, ql, kl, None, *GdpaSpec.from_schema(*args))
        assert (out == 0).all()
        grads = gdpa_backward_triton(torch.randn_like(out), q, k, v, ql, kl, None,
                                     *GdpaSpec.from_bwd_schema(*args, False))
        assert all((g == 0).all() for g in grads[:3])
    # no keys at all (Lk = 0)
    k0, v0 = k[:, :, :0], v[:, :, :0]
    out = gdpa_forward_triton(q, k0, v0, None, None, None,
                              *GdpaSpec.from_schema("sigmoid", 0.3, 1.0, True, False, 0))
    assert out.shape == (B, H, L, D) and (out == 0).all()
    dq, dk, dv, _ = gdpa_backward_triton(torch.randn_like(out), q, k0, v0, None, None, None,
                                         *GdpaSpec.from_bwd_schema("sigmoid", 0.3, 1.0, True, False, 0, False))
    assert (dq == 0).all() and dk.shape == k0.shape and dv.shape == v0.shape


def test_lengths_outside_range_are_clamped():
    """The kernels clamp lengths into [0, L] (the CUDA path checks values only in strict mode)."""
    B, H, L, D = 3, 1, 20, 16
    q, k, v, _, _, _ = make_inputs(B, H, L, L, D, torch.float32, seed=9)
    wild_q, wild_k = torch.tensor([-5, 99, 7]), torch.tensor([1000, -1, 20])
    args = ("gelu", 0.3, 1.0, True, False, 0)
    out = gdpa_forward_triton(q, k, v, wild_q, wild_k, None, *GdpaSpec.from_schema(*args))
    want = gdpa_forward_triton(q, k, v, wild_q.clamp(0, L), wild_k.clamp(0, L), None,
                               *GdpaSpec.from_schema(*args))
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    grads = gdpa_backward_triton(torch.ones_like(out), q, k, v, wild_q, wild_k, None,
                                 *GdpaSpec.from_bwd_schema(*args, False))
    assert all(not g.isnan().any() for g in grads[:3])


def test_backward_is_deterministic():
    B, H, L, D = 3, 2, 40, 32
    q, k, v, ql, kl, bias = make_inputs(
        B, H, L, L, D, torch.float16, shared_q=True, bias_shape=(1, H, L, L), seed=8
    )
    args = ("silu", 0.2, 1.0, True, True, 9)
    out = gdpa_forward_triton(q, k, v, ql, kl, bias, *GdpaSpec.from_schema(*args))
    g = torch.randn_like(out)
    first = gdpa_backward_triton(g, q, k, v, ql, kl, bias, *GdpaSpec.from_bwd_schema(*args, True))
    second = gdpa_backward_triton(g, q, k, v, ql, kl, bias, *GdpaSpec.from_bwd_schema(*args, True))
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_expanded_grad_out():
    """grad_out of ``out.sum()`` is an expanded scalar (all strides 0)."""
    B, H, L, D = 2, 2, 20, 16
    q, k, v, ql, kl, _ = make_inputs(B, H, L, L, D, torch.float32, seed=2)
    args = ("relu", 0.3, 1.0, False, False, 0)
    out = gdpa_forward_triton(q, k, v, ql, kl, None, *GdpaSpec.from_schema(*args))
    g = torch.ones((), dtype=out.dtype).expand_as(out)
    got = gdpa_backward_triton(g, q, k, v, ql, kl, None, *GdpaSpec.from_bwd_schema(*args, False))
    want = gdpa_backward_triton(g.contiguous(), q, k, v, ql, kl, None,
                                *GdpaSpec.from_bwd_schema(*args, False))
    for a, b in zip(got[:3], want[:3]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_tuned_launch_skips_the_autotuner_after_the_first_call(monkeypatch):
    from gemcompile.lowering.gdpa import triton as kernels
    from gemcompile.lowering.common import tuned_launch as shared

    B, H, L, D = 3, 2, 24, 16
    q, k, v, ql, kl, _ = make_inputs(B, H, L, L, D, torch.float32, seed=12)
    args = ("gelu_tanh", 0.25, 1.0, False, False, 0)
    shared._BEST_CONFIG.clear()
    first = gdpa_forward_triton(q, k, v, ql, kl, None, *GdpaSpec.from_schema(*args))
    assert len([key for key in shared._BEST_CONFIG if key[0] is kernels._gdpa_fwd_kernel]) == 1

    def autotuner_called(*a, **kw):
        raise AssertionError("the autotuner ran again for a tuned key")

    monkeypatch.setattr(kernels._gdpa_fwd_kernel, "run", autotuner_called)
    second = gdpa_forward_triton(q, k, v, ql, kl, None, *GdpaSpec.from_schema(*args))
    assert torch.equal(first, second)
    with pytest.raises(AssertionError, match="autotuner ran again"):  # another activation: tuned again
        gdpa_forward_triton(q, k, v, ql, kl, None, *GdpaSpec.from_schema("relu", 0.25, 1.0, False, False, 0))


# ---------------------------------------------------------------------------------------------------
# HSTU's target mask (num_targets) and contextual prefix (contextual_len): causal, self-attention

HSTU_KV = [40, 33, 0, 17]
HSTU_TARGETS = {
    "several": [5, 33, 0, 1],  # t == n for batch 1 (only targets), n = 0 for batch 2
    "all": HSTU_KV,
    "zero": [0, 0, 0, 0],
}


def hstu_inputs(dtype, targets, with_q_lengths, seed, L=40):
    q, k, v, _, _, bias = make_inputs(4, 1, L, L, 16, dtype, bias_shape=(4, 1, L, L), seed=seed)
    kl = torch.tensor(HSTU_KV)
    ql = torch.tensor([37, 33, 0, 9]) if with_q_lengths else None
    nt = None if targets is None else torch.tensor(HSTU_TARGETS[targets])
    return q, k, v, ql, kl, bias, nt


# name: (dtype, targets, contextual_len, window, q_lengths, activation)
HSTU_CASES = {
    "targets": (torch.float32, "several", 0, 0, True, "silu"),
    "contextual": (torch.float32, None, 3, 0, False, "gelu"),
    "contextual_over_tiles": (torch.float32, None, 20, 0, True, "sigmoid"),  # c spans query/key tiles
    "contextual_window_over_tiles": (torch.float32, None, 36, 2, False, "gelu"),  # keys j < i - window seen
    "prefix_over_history": (torch.float32, "several", 36, 0, False, "silu"),  # n - t < c: diagonal only
    "both": (torch.float16, "several", 3, 0, True, "relu_squared"),
    "targets_window": (torch.float32, "several", 0, 5, False, "gelu_tanh"),
    "both_window": (torch.float32, "several", 2, 4, True, "silu"),
    "all_targets_window_fp16": (torch.float16, "all", 1, 7, False, "identity"),
    "zero_targets_contextual_window": (torch.float32, "zero", 18, 3, True, "relu"),
}


@pytest.mark.parametrize("case", list(HSTU_CASES))
def test_targets_and_contextual(case):
    dtype, targets, c, window, with_ql, act = HSTU_CASES[case]
    q, k, v, ql, kl, bias, nt = hstu_inputs(dtype, targets, with_ql, seed=len(case))
    check_against_reference(
        q, k, v, ql, kl, bias, act, 0.3, 1.5, bool(c % 2), True, window, num_targets=nt, contextual_len=c
    )


@pytest.mark.parametrize(
    "fwd_tile,dkdv_tile",
    [((16, 32), (32, 16)), ((16, 16), (16, 16)), ((64, 16), (16, 64))],
    ids=["wide_keys", "square", "tall_queries"],
)
def test_targets_and_contextual_other_tile_shapes(monkeypatch, fwd_tile, dkdv_tile):
    """The HSTU loop bounds: contextual query tiles up to the history end, the dK/dV kernel's contextual
    rows before the causal start, no unmasked tile over target keys."""
    from gemcompile.lowering.gdpa import triton as kernels

    def config(m, n):
        return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=4, num_stages=1)]

    monkeypatch.setattr(kernels._gdpa_fwd_kernel, "configs", config(*fwd_tile))
    monkeypatch.setattr(kernels._gdpa_bwd_dq_kernel, "configs", config(*fwd_tile))
    monkeypatch.setattr(kernels._gdpa_bwd_dkdv_kernel, "configs", config(*dkdv_tile))
    # (targets, contextual_len, window); square tiles: unmasked dK/dV tiles exist below the history end
    configs = {
        (16, 32): [("several", 17, 6)],
        (16, 16): [("several", 3, 0), (None, 36, 2)],
        (64, 16): [("several", 5, 0)],
    }
    for targets, c, window in configs[fwd_tile]:
        q, k, v, ql, kl, bias, nt = hstu_inputs(torch.float32, targets, True, seed=31)
        check_against_reference(
            q, k, v, ql, kl, bias, "gelu", 0.25, 1.0, True, True, window, num_targets=nt, contextual_len=c
        )


def test_targets_used_as_given_and_launcher_checks():
    """On CUDA num_targets is not checked (no host sync): out-of-range values shape the mask as the
    formula says, never memory accesses. Kernels and reference agree on them."""
    q, k, v, _, kl, bias, _ = hstu_inputs(torch.float32, None, False, seed=4, L=24)
    kl = torch.tensor([24, 10, 3, 0])
    wild = torch.tensor([30, -4, 3, 7])
    check_against_reference(
        q, k, v, None, kl, bias, "silu", causal=True, window=3, num_targets=wild, contextual_len=2
    )
    with pytest.raises(ValueError, match="causal"):
        gdpa_forward_triton(q, k, v, None, kl, None,
                            *GdpaSpec.from_schema("silu", 0.3, 1.0, False, False, 0, wild, 0))
    with pytest.raises(ValueError, match="contextual_len"):
        gdpa_backward_triton(q, q, k, v, None, kl, None,
                             *GdpaSpec.from_bwd_schema("silu", 0.3, 1.0, False, True, 0, False, None, -1))
