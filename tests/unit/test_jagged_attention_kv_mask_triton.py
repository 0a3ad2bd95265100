"""The jagged attention Triton kernels with a kv_mask (and kv_lengths None), run by the Triton interpreter
on CPU (TRITON_INTERPRET=1, set by conftest), against the float64 reference. The launchers are called directly
with CPU tensors. float32 and float16 only (the interpreter's tl.dot on bfloat16 is wrong)."""

import os

import pytest
import torch

if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip(
        "interpreter tests: run on a machine without CUDA (conftest sets TRITON_INTERPRET=1)",
        allow_module_level=True,
    )
triton = pytest.importorskip("triton")

from test_jagged_attention_kv_mask import MASK_KINDS, make_kv_mask  # noqa: E402

from gemcompile.lowering.common.attention_triton import kv_mask_bounds  # noqa: E402
from gemcompile.lowering.jagged_attention.reference import (  # noqa: E402
    key_mask,
    reference_backward,
    reference_forward,
)
from gemcompile.lowering.jagged_attention.triton import (  # noqa: E402
    jagged_attention_backward_triton,
    jagged_attention_forward_triton,
)
from tests.grids import pairwise  # noqa: E402

TOL = {torch.float32: (2e-5, 5e-5), torch.float16: (3e-3, 8e-3)}  # (forward, backward) relative-norm error


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def make_inputs(B, H, Lq, Lk, D, dtype, kind, *, q_lengths=True, kv_lengths=True, shared_q=False,
                bias_shape=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1 if shared_q else B, H, Lq, D, generator=g).to(dtype)
    k = torch.randn(B, H, Lk, D, generator=g).to(dtype)
    v = torch.randn(B, H, Lk, D, generator=g).to(dtype)
    ql = torch.tensor([Lq, (Lq // 2) | 1, 1, Lq][:B]) if q_lengths else None
    kl = torch.tensor([Lk, Lk - 7, (Lk // 3) | 1, Lk][:B]) if kv_lengths else None
    bias = None if bias_shape is None else torch.randn(bias_shape, generator=g).to(dtype)
    return q, k, v, ql, kl, make_kv_mask(kind, B, Lk, seed + 1), bias


def check_against_reference(q, k, v, ql, kl, mask, bias, causal, scale, bias_grad=True, seed=1, uniform=None):
    dtype = q.dtype
    out, lse = jagged_attention_forward_triton(q, k, v, ql, kl, bias, causal, scale, mask, uniform)
    d64 = [None if x is None else x.double() for x in (q, k, v, bias)]
    ref_out, ref_lse = reference_forward(*d64[:3], ql, kl, d64[3], causal, scale, mask, uniform)
    fwd_tol, bwd_tol = TOL[dtype]
    assert out.dtype == dtype and out.is_contiguous() and not out.isnan().any()
    assert rel(out, ref_out) < fwd_tol, rel(out, ref_out)
    assert torch.equal(torch.isposinf(lse), torch.isposinf(ref_lse))
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite].double(), ref_lse[finite], rtol=1e-4, atol=1e-4)

    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    want_bias_grad = bias is not None and bias_grad
    dq, dk, dv, dbias = jagged_attention_backward_triton(
        grad_out, q, k, v, out, lse, ql, kl, bias, causal, scale, want_bias_grad, mask, uniform)
    ref = reference_backward(grad_out.double(), *d64[:3], ref_out, ref_lse, ql, kl, d64[3], causal, scale,
                             want_bias_grad, mask, uniform)
    for name, got, want, like in (("dq", dq, ref[0], q), ("dk", dk, ref[1], k), ("dv", dv, ref[2], v)):
        assert got.shape == like.shape and got.dtype == like.dtype, name
        assert not got.isnan().any(), name
        assert rel(got, want) < bwd_tol, (name, rel(got, want))
    if want_bias_grad:
        assert rel(dbias, ref[3]) < bwd_tol, ("dbias", rel(dbias, ref[3]))
    # keys that are not valid get exactly zero dK and dV
    bad = ~key_mask(kl, mask, k.shape[0], k.shape[2], "cpu")
    assert (dk.transpose(1, 2)[bad] == 0).all() and (dv.transpose(1, 2)[bad] == 0).all()
    return out, lse, (dq, dk, dv, dbias)


# Every mask kind under both rules; the dtype alternates (a full grid costs minutes under the interpreter,
# and the GPU tests cover every combination in bf16 and fp32).
KERNEL_GRID = [(kind, causal, (torch.float32, torch.float16)[(i + causal) % 2])
               for i, kind in enumerate(MASK_KINDS) for causal in (False, True)]


@pytest.mark.parametrize("kind,causal,dtype", KERNEL_GRID,
                         ids=[f"{k}-{'causal' if c else 'full'}-{str(d)[6:]}" for k, c, d in KERNEL_GRID])
def test_kernels_match_reference(kind, causal, dtype):
    B, H, L, D = 4, 2, 40, 32
    q, k, v, ql, kl, mask, _ = make_inputs(B, H, L, L, D, dtype, kind, seed=len(kind))
    check_against_reference(q, k, v, ql, kl, mask, None, causal, D**-0.5)


@pytest.mark.parametrize("kind,causal", [(kind, i % 2 == 1) for i, kind in enumerate(MASK_KINDS)],
                         ids=[f"{kind}-{'causal' if i % 2 else 'full'}" for i, kind in enumerate(MASK_KINDS)])
def test_without_kv_lengths(kind, causal):
    B, H, Lq, Lk, D = 4, 1, 24, 40, 16
    q, k, v, ql, kl, mask, _ = make_inputs(B, H, Lq, Lk, D, torch.float32, kind, kv_lengths=False, seed=3)
    check_against_reference(q, k, v, ql, None, mask, None, causal, 0.3)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_no_mask_no_kv_lengths(causal):
    B, H, L, D = 3, 2, 33, 16
    q, k, v, ql, _, _, bias = make_inputs(B, H, L, L, D, torch.float32, "all_true", bias_shape=(1, H, L, L))
    check_against_reference(q, k, v, ql, None, None, bias, causal, 0.3)
    check_against_reference(q, k, v, None, None, None, None, causal, 0.3)


@pytest.mark.parametrize("kind,bias_kind", [("holes", "full"), ("left_pad", "batch_keys"), ("expanded", "full")])
def test_with_bias_and_shared_queries(kind, bias_kind):
    B, H, L, D = 3, 2, 40, 16
    shape = {"full": (B, H, L, L), "batch_keys": (B, 1, 1, L)}[bias_kind]
    for causal, shared_q in ((False, True), (True, False)):
        q, k, v, ql, kl, mask, bias = make_inputs(B, H, L, L, D, torch.float32, kind, shared_q=shared_q,
                                                  bias_shape=shape, seed=5)
        check_against_reference(q, k, v, ql, kl, mask, bias, causal, 0.25)


@pytest.mark.parametrize(
    "fwd_tile,dkdv_tile",
    [((16, 32), (32, 16)), ((64, 16), (16, 64))],  # (16, 16) tiles: the slowest under the interpreter (CI time)
    ids=["wide_keys", "tall_queries"],
)
def test_other_tile_shapes(monkeypatch, fwd_tile, dkdv_tile):
    """Tile skipping from the left and the right, the unmasked/masked split and the diagonal with a mask."""
    from gemcompile.lowering.jagged_attention import triton as kernels

    def config(m, n):
        return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=4, num_stages=1)]

    monkeypatch.setattr(kernels._fwd_kernel, "configs", config(*fwd_tile))
    monkeypatch.setattr(kernels._bwd_dq_kernel, "configs", config(*fwd_tile))
    monkeypatch.setattr(kernels._bwd_dkdv_kernel, "configs", config(*dkdv_tile))
    B, H, L, D = 4, 1, 72, 16
    for kind in ("left_pad", "right_pad", "holes"):
        q, k, v, ql, kl, mask, bias = make_inputs(B, H, L, L, D, torch.float32, kind, bias_shape=(1, H, L, L),
                                                  seed=31)
        for causal in (False, True):
            check_against_reference(q, k, v, ql, kl, mask, bias, causal, 0.25)


def _runs(L, tile):
    """(B, L) masks: contiguous runs with ends around tile edges, then the same runs with one hole each."""
    pos = torch.arange(L)
    spans = [(0, L), (1, L - 1), (tile - 1, tile + 1), (tile, 2 * tile), (tile + 3, tile + 5), (5, 6),
             (L - 1, L), (2, 3 * tile - 1)]
    runs = torch.stack([(pos >= a) & (pos < b) for a, b in spans])
    holed = runs.clone()
    for i, (a, b) in enumerate(spans):
        if b - a >= 3:
            holed[i, (a + b) // 2] = False
    return runs, holed


@pytest.mark.parametrize("holes,causal,cut", pairwise({"runs": False, "holed": True}, {"full": False, "causal": True},
                                                     {"no_kv_lengths": False, "kv_lengths": True}))
def test_contiguous_runs_and_single_holes(monkeypatch, holes, causal, cut):
    """No holes: the bounds mask the first and last tiles and inner tiles are unmasked; one hole (the
    mask vector in every tile) must stay exact; kv_lengths that cut a run turn it into a shorter run.
    Tiles of 16 keys: the smaller tile puts more runs across tile edges."""
    tile = 16
    from gemcompile.lowering.jagged_attention import triton as kernels

    other = 48 - tile
    config = [triton.Config({"BLOCK_M": other, "BLOCK_N": tile}, num_warps=4, num_stages=1)]
    monkeypatch.setattr(kernels._fwd_kernel, "configs", config)
    monkeypatch.setattr(kernels._bwd_dq_kernel, "configs", config)
    monkeypatch.setattr(kernels._bwd_dkdv_kernel, "configs",
                        [triton.Config({"BLOCK_M": other, "BLOCK_N": tile}, num_warps=4, num_stages=1)])
    B, H, L, D = 8, 1, 80, 16
    runs, holed = _runs(L, tile)
    g = torch.Generator().manual_seed(tile)
    q, k, v = (torch.randn(B, H, L, D, generator=g) for _ in range(3))
    bias = torch.randn(1, H, L, L, generator=g)
    ql = torch.tensor([L, L, 40, L, 17, L, L, 50])
    kl = torch.tensor([L, 60, L, 2 * tile - 3, L, L, L, 30])
    mask, flags = (holed, [1, 1, 0, 1, 0, 0, 0, 1]) if holes else (runs, [0] * B)
    assert kv_mask_bounds(mask, None, L)[2].tolist() == flags
    check_against_reference(q, k, v, ql, kl if cut else None, mask, bias, causal, 0.25)


def test_mask_garbage_never_leaks():
    B, H, L, D = 3, 2, 40, 16
    q, k, v, ql, kl, mask, bias = make_inputs(B, H, L, L, D, torch.float32, "holes", bias_shape=(B, H, L, L),
                                              seed=7)
    bad = ~mask[:, None, :, None]
    dirty = (k.masked_fill(bad, float("nan")), v.masked_fill(bad, float("inf")),
             bias.masked_fill(bad.transpose(2, 3), float("nan")))
    for causal in (False, True):
        clean_out, clean_lse = jagged_attention_forward_triton(q, k, v, ql, kl, bias, causal, 0.25, mask)
        out, lse = jagged_attention_forward_triton(q, *dirty[:2], ql, kl, dirty[2], causal, 0.25, mask)
        torch.testing.assert_close(out, clean_out, rtol=0, atol=0)
        g = torch.randn_like(out)
        got = jagged_attention_backward_triton(g, q, *dirty[:2], out, lse, ql, kl, dirty[2], causal, 0.25,
                                               True, mask)
        want = jagged_attention_backward_triton(g, q, k, v, clean_out, clean_lse, ql, kl, bias, causal, 0.25,
                                                True, mask)
        for a, b in zip(got, want):
            assert not a.isnan().any()
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_all_true_mask_matches_the_length_path():
    B, H, L, D = 3, 2, 40, 16
    q, k, v, ql, kl, mask, _ = make_inputs(B, H, L, L, D, torch.float32, "all_true", seed=2)
    for causal in (False, True):
        a, _ = jagged_attention_forward_triton(q, k, v, ql, kl, None, causal, 0.3, mask)
        b, _ = jagged_attention_forward_triton(q, k, v, ql, kl, None, causal, 0.3)
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_kv_mask_bounds():
    mask = torch.tensor([[0, 1, 1, 0, 1, 0], [0] * 6, [1] * 6, [1, 1, 0, 0, 0, 1]], dtype=torch.bool)
    lo, hi, holes = kv_mask_bounds(mask, None, 6)
    assert lo.tolist() == [1, 6, 0, 0] and hi.tolist() == [5, 0, 6, 6] and lo.dtype == torch.int32
    assert holes.tolist() == [1, 0, 0, 1]
    lo, hi, holes = kv_mask_bounds(mask, torch.tensor([4, 6, -1, 3]), 6)
    assert lo.tolist() == [1, 6, 6, 0] and hi.tolist() == [3, 0, 0, 2] and holes.tolist() == [0, 0, 0, 0]
    lo, hi, holes = kv_mask_bounds(mask[:1].expand(3, 6), torch.tensor([99, 2, 5]), 6)
    assert lo.tolist() == [1, 1, 1] and hi.tolist() == [5, 2, 5] and holes.tolist() == [1, 0, 1]


def test_right_padding_mask_takes_the_length_split():
    """Without holes the key loop is the lengths path's (same tiles, unmasked inside): same forward bits."""
    B, H, L, D = 4, 1, 72, 16
    q, k, v, ql, kl, _, bias = make_inputs(B, H, L, L, D, torch.float32, "all_true", bias_shape=(1, H, L, L))
    mask = torch.arange(L)[None, :] < kl[:, None]
    for causal in (False, True):
        a, la = jagged_attention_forward_triton(q, k, v, ql, None, bias, causal, 0.3, mask)
        b, lb = jagged_attention_forward_triton(q, k, v, ql, kl, bias, causal, 0.3)
        assert torch.equal(a, b) and torch.equal(la, lb)
