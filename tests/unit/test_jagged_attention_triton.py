"""The Triton kernels of jagged attention, run by the Triton interpreter on CPU (TRITON_INTERPRET=1, set by
conftest), against the float64 reference. The launchers are called directly with CPU tensors.

The interpreter runs one small config per kernel (BLOCK_M != BLOCK_N), so these small shapes cover
several tiles, partial tiles, skipped tiles and the causal diagonal. bfloat16 is not tested here: the
triton 3.9 interpreter computes tl.dot on bfloat16 wrongly; the GPU tests cover it.
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

from gemcompile.lowering.jagged_attention.reference import (  # noqa: E402
    reference_backward,
    reference_forward,
)
from gemcompile.lowering.common.attention_triton import length_bucket  # noqa: E402
from gemcompile.lowering.jagged_attention.triton import (  # noqa: E402
    jagged_attention_backward_triton,
    jagged_attention_forward_triton,
)
from tests.grids import pairwise  # noqa: E402

TOL = {torch.float32: (2e-5, 5e-5), torch.float16: (3e-3, 8e-3)}  # (forward, backward) relative-norm error


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def jagged_lengths(B, L, g, specials):
    """Lengths that include 0, 1, an odd length and L, then random."""
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
    bias = None if bias_shape is None else torch.randn(bias_shape, generator=g).to(dtype)
    return q, k, v, ql, kl, bias


def check_against_reference(q, k, v, ql, kl, bias, causal, scale, bias_grad=True, seed=1):
    dtype = q.dtype
    out, lse = jagged_attention_forward_triton(q, k, v, ql, kl, bias, causal, scale)
    d64 = [None if x is None else x.double() for x in (q, k, v, bias)]
    ref_out, ref_lse = reference_forward(*d64[:3], ql, kl, d64[3], causal, scale)
    fwd_tol, bwd_tol = TOL[dtype]
    assert out.dtype == dtype and out.is_contiguous() and out.shape == ref_out.shape
    assert not out.isnan().any()
    assert rel(out, ref_out) < fwd_tol, rel(out, ref_out)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isposinf(lse), torch.isposinf(ref_lse))
    torch.testing.assert_close(lse[finite].double(), ref_lse[finite], rtol=1e-4, atol=1e-4)

    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    want_bias_grad = bias is not None and bias_grad
    dq, dk, dv, dbias = jagged_attention_backward_triton(
        grad_out, q, k, v, out, lse, ql, kl, bias, causal, scale, want_bias_grad
    )
    ref = reference_backward(
        grad_out.double(), *d64[:3], ref_out, ref_lse, ql, kl, d64[3], causal, scale, want_bias_grad
    )
    for name, got, want, like in (("dq", dq, ref[0], q), ("dk", dk, ref[1], k), ("dv", dv, ref[2], v)):
        assert got.shape == like.shape and got.dtype == like.dtype, name
        assert not got.isnan().any(), name
        assert rel(got, want) < bwd_tol, (name, rel(got, want))
    if want_bias_grad:
        assert dbias.shape == bias.shape and dbias.dtype == bias.dtype
        assert rel(dbias, ref[3]) < bwd_tol, ("dbias", rel(dbias, ref[3]))
    else:
        assert dbias.numel() == 0
    return out, lse, (dq, dk, dv, dbias)


BIAS = {"none": None, "full": "full", "heads_keys": "heads_keys"}


@pytest.mark.parametrize("dtype,causal,bias_kind,shared_q", pairwise(
    {"fp32": torch.float32, "fp16": torch.float16}, {"full": False, "causal": True}, {b: b for b in BIAS},
    {"q_per_batch": False, "q_shared": True}))
def test_kernels_match_reference(dtype, causal, bias_kind, shared_q):
    B, H, L, D = 3, 2, 40, 32
    bias_shape = {"none": None, "full": (B, H, L, L), "heads_keys": (1, H, 1, L)}[bias_kind]
    q, k, v, ql, kl, bias = make_inputs(B, H, L, L, D, dtype, shared_q, bias_shape, seed=hash((causal,)) % 97)
    check_against_reference(q, k, v, ql, kl, bias, causal, D**-0.5)


@pytest.mark.parametrize(
    "B,H,Lq,Lk,D,causal,with_q_lengths",
    [
        (2, 1, 7, 40, 16, False, True),  # few queries, many keys (PMA-like)
        (3, 2, 40, 9, 24, True, True),  # head dim not a power of two (BLOCK_D 32, masked)
        (2, 2, 33, 33, 16, True, False),  # no q_lengths: every query row valid
        (1, 1, 1, 17, 16, False, False),  # a single query row
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_shapes(B, H, Lq, Lk, D, causal, with_q_lengths, dtype):
    q, k, v, ql, kl, _ = make_inputs(B, H, Lq, Lk, D, dtype, seed=Lq + Lk)
    check_against_reference(q, k, v, ql if with_q_lengths else None, kl, None, causal, 0.3)


@pytest.mark.parametrize(
    "fwd_tile,dkdv_tile",
    [((16, 32), (32, 16)), ((16, 16), (16, 16)), ((64, 16), (16, 64))],
    ids=["wide_keys", "square", "tall_queries"],
)
def test_other_tile_shapes(monkeypatch, fwd_tile, dkdv_tile):
    """The loop bounds (skipped tiles, unmasked/masked split, causal diagonal) for other tile shapes."""
    from gemcompile.lowering.jagged_attention import triton as kernels

    def config(m, n):
        return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=4, num_stages=1)]

    monkeypatch.setattr(kernels._fwd_kernel, "configs", config(*fwd_tile))
    monkeypatch.setattr(kernels._bwd_dq_kernel, "configs", config(*fwd_tile))
    monkeypatch.setattr(kernels._bwd_dkdv_kernel, "configs", config(*dkdv_tile))
    B, H, L, D = 3, 1, 40, 16
    q, k, v, ql, kl, bias = make_inputs(B, H, L, L, D, torch.float32, bias_shape=(1, H, L, L), seed=31)
    for causal in (False, True):
        check_against_reference(q, k, v, ql, kl, bias, causal, 0.25)


def test_bias_without_grad_and_per_batch_key_bias():
    B, H, L, D = 3, 2, 24, 16
    q, k, v, ql, kl, bias = make_inputs(B, H, L, L, D, torch.float32, bias_shape=(B, 1, 1, L), seed=4)
    check_against_reference(q, k, v, ql, kl, bias, False, 0.25, bias_grad=False)
    check_against_reference(q, k, v, ql, kl, bias, True, 0.25, bias_grad=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_permuted_blhd_views(dtype):
    """q, k, v as permuted views of (B, L, H, D) projections, read through their strides."""
    B, L, H, D = 3, 37, 2, 32
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(B, L, 3, H, D, generator=g).to(dtype)
    q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))
    assert not q.is_contiguous()
    ql = kl = torch.tensor([37, 5, 0])
    out, _, grads = check_against_reference(q, k, v, ql, kl, None, True, D**-0.5)
    out_c, _ = jagged_attention_forward_triton(
        q.contiguous(), k.contiguous(), v.contiguous(), ql, kl, None, True, D**-0.5
    )
    torch.testing.assert_close(out, out_c, rtol=0, atol=0)


def test_padding_garbage_never_leaks():
    B, H, L, D = 3, 2, 35, 16
    q, k, v, _, _, bias = make_inputs(B, H, L, L, D, torch.float32, bias_shape=(B, H, L, L), seed=5)
    ql, kl = torch.tensor([35, 3, 0]), torch.tensor([17, 35, 4])
    clean_out, clean_lse = jagged_attention_forward_triton(q, k, v, ql, kl, bias, False, 0.25)
    pos = torch.arange(L)
    q_pad = (pos[None, :] >= ql[:, None])[:, None, :, None]
    k_pad = (pos[None, :] >= kl[:, None])[:, None, :, None]
    dirty = (
        q.masked_fill(q_pad, float("nan")),
        k.masked_fill(k_pad, float("nan")),
        v.masked_fill(k_pad, float("inf")),
        bias.masked_fill(q_pad | k_pad.transpose(2, 3), float("nan")),
    )
    out, lse = jagged_attention_forward_triton(*dirty[:3], ql, kl, dirty[3], False, 0.25)
    torch.testing.assert_close(out, clean_out, rtol=0, atol=0)
    assert (out.masked_select(q_pad.expand_as(out)) == 0).all()
    g = torch.randn_like(out).masked_fill(q_pad, float("nan"))
    grads = jagged_attention_backward_triton(g, *dirty[:3], out, lse, ql, kl, dirty[3], False, 0.25, True)
    clean = jagged_attention_backward_triton(
        torch.nan_to_num(g), q, k, v, clean_out, clean_lse, ql, kl, bias, False, 0.25, True
    )
    for a, b in zip(grads, clean):
        assert not a.isnan().any()
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_zero_lengths_everywhere_and_empty_keys():
    B, H, L, D = 2, 2, 20, 16
    q, k, v, _, _, _ = make_inputs(B, H, L, L, D, torch.float32)
    zeros = torch.zeros(B, dtype=torch.long)
    out, lse = jagged_attention_forward_triton(q, k, v, None, zeros, None, True, 0.3)
    assert (out == 0).all() and torch.isposinf(lse).all()
    grads = jagged_attention_backward_triton(
        torch.randn_like(out), q, k, v, out, lse, None, zeros, None, True, 0.3, False
    )
    assert all((g == 0).all() for g in grads[:3])
    # no keys at all (Lk = 0)
    k0, v0 = k[:, :, :0], v[:, :, :0]
    out, lse = jagged_attention_forward_triton(q, k0, v0, None, zeros, None, False, 0.3)
    assert out.shape == (B, H, L, D) and (out == 0).all()
    dq, dk, dv, _ = jagged_attention_backward_triton(
        torch.randn_like(out), q, k0, v0, out, lse, None, zeros, None, False, 0.3, False
    )
    assert (dq == 0).all() and dk.shape == k0.shape


def test_lengths_outside_range_are_clamped():
    """The kernels clamp lengths into [0, L] (the CUDA path checks values only in strict mode)."""
    B, H, L, D = 3, 1, 20, 16
    q, k, v, _, _, _ = make_inputs(B, H, L, L, D, torch.float32, seed=9)
    wild_q, wild_k = torch.tensor([-5, 99, 7]), torch.tensor([1000, -1, 20])
    out, lse = jagged_attention_forward_triton(q, k, v, wild_q, wild_k, None, False, 0.3)
    want, _ = jagged_attention_forward_triton(
        q, k, v, wild_q.clamp(0, L), wild_k.clamp(0, L), None, False, 0.3
    )
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    grads = jagged_attention_backward_triton(
        torch.ones_like(out), q, k, v, out, lse, wild_q, wild_k, None, False, 0.3, False
    )
    assert all(not g.isnan().any() for g in grads[:3])


def test_backward_is_deterministic():
    B, H, L, D = 3, 2, 40, 32
    q, k, v, ql, kl, bias = make_inputs(
        B, H, L, L, D, torch.float16, shared_q=True, bias_shape=(1, H, L, L), seed=8
    )
    out, lse = jagged_attention_forward_triton(q, k, v, ql, kl, bias, True, 0.2)
    g = torch.randn_like(out)
    first = jagged_attention_backward_triton(g, q, k, v, out, lse, ql, kl, bias, True, 0.2, True)
    second = jagged_attention_backward_triton(g, q, k, v, out, lse, ql, kl, bias, True, 0.2, True)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_expanded_grad_out():
    """grad_out of ``out.sum()`` is an expanded scalar (all strides 0)."""
    B, H, L, D = 2, 2, 20, 16
    q, k, v, ql, kl, _ = make_inputs(B, H, L, L, D, torch.float32, seed=2)
    out, lse = jagged_attention_forward_triton(q, k, v, ql, kl, None, False, 0.3)
    g = torch.ones((), dtype=out.dtype).expand_as(out)
    got = jagged_attention_backward_triton(g, q, k, v, out, lse, ql, kl, None, False, 0.3, False)
    want = jagged_attention_backward_triton(
        g.contiguous(), q, k, v, out, lse, ql, kl, None, False, 0.3, False
    )
    for a, b in zip(got[:3], want[:3]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("grad_lse", ["none", "given", "expanded"])
def test_delta_in_the_dq_kernel_equals_the_delta_kernel(monkeypatch, grad_lse):
    """The dQ kernel computes delta (rowsum(dO * O) - dlse) for the dK/dV kernel launched after it; the
    same gradients as with the separate delta kernel (GEMCOMPILE_DELTA_IN_DQ=0), which it then never
    launches. Causal, a shared q and a bias gradient: every kernel variant that reads delta."""
    from gemcompile.lowering.jagged_attention import triton as kernels

    B, H, L, D = 4, 2, 40, 16
    q, k, v, ql, kl, bias = make_inputs(B, H, L, L, D, torch.float32, shared_q=True,
                                        bias_shape=(1, H, L, L), seed=11)
    out, lse = jagged_attention_forward_triton(q, k, v, ql, kl, bias, True, 0.3)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(12))
    dlse = {"none": None, "given": torch.randn(lse.shape, generator=torch.Generator().manual_seed(13)),
            "expanded": torch.full((), 0.7).expand(lse.shape)}[grad_lse]

    def backward():
        return jagged_attention_backward_triton(g, q, k, v, out, lse, ql, kl, bias, True, 0.3, True,
                                                grad_lse=dlse)

    monkeypatch.setattr(kernels, "DELTA_IN_DQ", False)
    want = backward()
    monkeypatch.setattr(kernels, "DELTA_IN_DQ", True)
    monkeypatch.setattr(kernels, "bwd_delta_kernel", None)  # launching it would fail
    got = backward()
    for name, a, b in zip(("dq", "dk", "dv", "dbias"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    if dlse is not None:  # dlse reaches dK (and dQ) only through delta: a path that dropped it would differ
        plain = jagged_attention_backward_triton(g, q, k, v, out, lse, ql, kl, bias, True, 0.3, True)
        assert not torch.allclose(plain[1], got[1], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_q_in_registers_changes_no_value(monkeypatch, causal):
    """The forward's q fed to the dots as a computed tile (common/attention_triton.in_registers: rows past the
    sequence set to 0 again) gives bitwise the outputs of q as loaded, padded rows and empty sequences included."""
    from gemcompile.lowering.common import attention_triton

    q, k, v, ql, kl, _ = make_inputs(4, 2, 37, 29, 32, torch.float32, seed=21)
    monkeypatch.setattr(attention_triton, "WGMMA_A_REGISTERS", False)
    want = jagged_attention_forward_triton(q, k, v, ql, kl, None, causal, 0.3)
    monkeypatch.setattr(attention_triton, "WGMMA_A_REGISTERS", True)
    got = jagged_attention_forward_triton(q, k, v, ql, kl, None, causal, 0.3)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_length_bucket():
    assert [length_bucket(n) for n in (0, 1, 16, 17, 1000, 1024, 1025)] == [16, 16, 16, 32, 1024, 1024, 2048]


def test_tuned_launch_skips_the_autotuner_after_the_first_call(monkeypatch):
    """The second launch for a tuning key goes straight to the tuned kernel, with the same result; a
    new key (another length bucket) or a pinned config list goes through the autotuner again."""
    from gemcompile.lowering.common import tuned_launch
    from gemcompile.lowering.jagged_attention import triton as kernels

    B, H, L, D = 3, 2, 24, 16
    q, k, v, ql, kl, _ = make_inputs(B, H, L, L, D, torch.float32, seed=12)
    tuned_launch._BEST_CONFIG.clear()
    first, _ = jagged_attention_forward_triton(q, k, v, ql, kl, None, False, 0.25)
    tuned = [key for key in tuned_launch._BEST_CONFIG if key[0] is kernels._fwd_kernel]
    assert len(tuned) == 1

    def autotuner_called(*args, **kwargs):
        raise AssertionError("the autotuner ran again for a tuned key")

    monkeypatch.setattr(kernels._fwd_kernel, "run", autotuner_called)
    second, _ = jagged_attention_forward_triton(q, k, v, ql, kl, None, False, 0.25)
    assert torch.equal(first, second)
    with pytest.raises(AssertionError, match="autotuner ran again"):  # L = 40 is another length bucket
        jagged_attention_forward_triton(*make_inputs(B, H, 40, 40, D, torch.float32)[:5], None, False, 0.25)
    monkeypatch.setattr(kernels._fwd_kernel, "configs", list(kernels._fwd_kernel.configs))
    with pytest.raises(AssertionError, match="autotuner ran again"):  # pinned configs: tuned again
        jagged_attention_forward_triton(q, k, v, ql, kl, None, False, 0.25)
