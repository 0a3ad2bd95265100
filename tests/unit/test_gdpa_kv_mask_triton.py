"""GDPA's kv_mask in the Triton kernels, run by the Triton interpreter on CPU (TRITON_INTERPRET=1, set by
conftest), against the float64 reference: masks with holes, left padding (a valid suffix), right padding,
an all-False row, all-True and a (1, Lk) mask expanded to (B, Lk) (read in place), combined with causal,
window, query/key lengths, shared queries, biases (the in-kernel bias gradient and the dQ kernel's
buffer), a relative table; other tile shapes (the mask's span skips whole tiles); exact zeros for
masked-out keys; garbage at masked-out keys. fp32 and fp16 (never bf16 here: the interpreter's tl.dot on
bf16 is wrong)."""

import os

import pytest
import torch

if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("interpreter tests: run on a machine without CUDA (conftest sets TRITON_INTERPRET=1)",
                allow_module_level=True)
triton = pytest.importorskip("triton")

from gemcompile.lowering.gdpa import triton as kernels  # noqa: E402
from gemcompile.lowering.gdpa.reference import reference_gdpa_backward, reference_gdpa_forward  # noqa: E402
from gemcompile.lowering.gdpa.spec import GDPA_ACTIVATIONS, GdpaSpec  # noqa: E402
from gemcompile.lowering.gdpa.triton import gdpa_backward_triton, gdpa_forward_triton  # noqa: E402

TOL = {torch.float32: (2e-5, 5e-5), torch.float16: (3e-3, 8e-3)}  # (forward, backward) relative-norm error


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def make_mask(kind, B, Lk, seed=0):
    """(B, Lk) bool. The interpreter's tiles are 16 or 32 keys: starts/ends fall inside and across tiles,
    'tile_hole' empties whole key tiles in the middle."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.arange(Lk)[None, :]
    cut = torch.tensor([0, Lk // 2 + 1, Lk - 1, 33, Lk, 17])[:B].clamp(max=Lk)
    if kind == "holes":
        return torch.rand(B, Lk, generator=g) < 0.6
    if kind == "left_pad":
        return pos >= cut[:, None]
    if kind == "right_pad":
        return pos < (Lk - cut)[:, None]
    if kind == "empty_row":
        m = torch.rand(B, Lk, generator=g) < 0.5
        m[1] = False
        return m
    if kind == "all_true":
        return torch.ones(B, Lk, dtype=torch.bool)
    if kind == "expanded":
        m = (torch.rand(1, Lk, generator=g) < 0.6).expand(B, Lk)
        assert m.stride(0) == 0
        return m
    if kind == "tile_hole":
        m = torch.rand(B, Lk, generator=g) < 0.7
        m[:, 8:40] = False
        return m
    raise ValueError(kind)


def make_inputs(B, H, Lq, Lk, D, dtype, shared_q=False, bias_shape=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1 if shared_q else B, H, Lq, D, generator=g).to(dtype)
    k = torch.randn(B, H, Lk, D, generator=g).to(dtype)
    v = torch.randn(B, H, Lk, D, generator=g).to(dtype)
    bias = None if bias_shape is None else (0.5 * torch.randn(bias_shape, generator=g)).to(dtype)
    return q, k, v, bias


def check(q, k, v, ql, kl, bias, mask, activation, scale=0.25, out_scale=1.0, divide=False, causal=False,
          window=0, bias_grad=True, relative_offset=None, seed=1):
    """Forward and backward against the float64 reference; masked-out keys get exactly zero dk, dv."""
    dtype = q.dtype
    args = (activation, scale, out_scale, divide, causal, window)
    tail = (None, 0, relative_offset, mask)
    out = gdpa_forward_triton(q, k, v, ql, kl, bias, *GdpaSpec.from_schema(*args, *tail))
    d64 = [None if x is None else x.double() for x in (q, k, v, bias)]
    ref_out = reference_gdpa_forward(*d64[:3], ql, kl, d64[3], *GdpaSpec.from_schema(*args, *tail))
    fwd_tol, bwd_tol = TOL[dtype]
    assert out.dtype == dtype and out.is_contiguous() and out.shape == ref_out.shape
    assert not out.isnan().any()
    assert rel(out, ref_out) < fwd_tol, rel(out, ref_out)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    want_bias_grad = bias is not None and bias_grad
    grads = gdpa_backward_triton(grad_out, q, k, v, ql, kl, bias,
                                 *GdpaSpec.from_bwd_schema(*args, want_bias_grad, *tail))
    ref = reference_gdpa_backward(grad_out.double(), *d64[:3], ql, kl, d64[3],
                                  *GdpaSpec.from_bwd_schema(*args, want_bias_grad, *tail))
    for name, got, want in zip(("dq", "dk", "dv", "dbias"), grads, ref):
        if name == "dbias" and not want_bias_grad:
            assert got.numel() == 0
            continue
        assert got.shape == want.shape, name
        assert not got.isnan().any(), name
        assert rel(got, want) < bwd_tol, (name, rel(got, want))
    dead = ~mask[:, None, :, None].expand_as(grads[1])
    assert (grads[1][dead] == 0).all() and (grads[2][dead] == 0).all()
    return out, grads


LENGTHS = (torch.tensor([40, 29, 1, 0]), torch.tensor([40, 37, 40, 13]))  # (q, kv)
RULES = {"full": (False, 0), "causal": (True, 0), "window": (False, 5), "causal_window": (True, 7)}
KINDS = ["holes", "left_pad", "right_pad", "empty_row", "all_true", "expanded", "tile_hole"]


# each mask kind under two of the rules, the rules taking turns (the full grid costs minutes under the
# interpreter; the GPU tests run every kind under every rule)
MASK_GRID = [(kind, list(RULES)[(i + j) % len(RULES)]) for i, kind in enumerate(KINDS) for j in (0, 2)]


@pytest.mark.parametrize("kind,rule", MASK_GRID, ids=[f"{k}-{r}" for k, r in MASK_GRID])
def test_masks_fp32(kind, rule):
    causal, window = RULES[rule]
    B, H, L, D = 4, 1, 40, 16
    q, k, v, bias = make_inputs(B, H, L, L, D, torch.float32, bias_shape=(1, H, L, L), seed=len(kind))
    act = GDPA_ACTIVATIONS[(len(kind) + len(rule)) % len(GDPA_ACTIVATIONS)]
    check(q, k, v, *LENGTHS, bias, make_mask(kind, B, L, len(rule)), act, 0.3, 1.5, True, causal, window)


@pytest.mark.parametrize("kind,rule", [("holes", "full"), ("left_pad", "causal_window"), ("expanded", "full")])
def test_masks_fp16_shared_queries(kind, rule):
    causal, window = RULES[rule]
    B, H, L, D = 4, 2, 40, 32
    q, k, v, bias = make_inputs(B, H, L, L, D, torch.float16, shared_q=True, bias_shape=(1, H, L, L), seed=5)
    check(q, k, v, None, LENGTHS[1], bias, make_mask(kind, B, L, 3), "silu", 0.3, 1.0, False, causal, window)


@pytest.mark.parametrize("bias_shape", ["B,H,L,L", "1,H,1,L", None])
def test_bias_paths_and_no_lengths(bias_shape):
    """Full-dims biases take the bias-gradient kernel; broadcast rows take the dQ kernel's buffer."""
    B, H, L, D = 3, 2, 37, 16
    shape = None if bias_shape is None else tuple({"B": B, "H": H, "L": L}.get(d, 1) for d in bias_shape.split(","))
    q, k, v, bias = make_inputs(B, H, L, L, D, torch.float32, bias_shape=shape, seed=9)
    check(q, k, v, None, None, bias, make_mask("left_pad", B, L, 2), "gelu", causal=True)
    check(q, k, v, torch.tensor([37, 20, 5]), None, bias, make_mask("holes", B, L, 4), "sigmoid", window=4)


def test_cross_lengths_few_queries_many_keys():
    B, H, Lq, Lk, D = 3, 1, 7, 70, 16
    q, k, v, bias = make_inputs(B, H, Lq, Lk, D, torch.float32, bias_shape=(B, H, Lq, Lk), seed=12)
    for kind in ("left_pad", "tile_hole", "right_pad"):
        check(q, k, v, torch.tensor([7, 3, 7]), torch.tensor([70, 50, 69]), bias, make_mask(kind, B, Lk, 1),
              "relu_squared", divide=True)


@pytest.mark.parametrize(
    "fwd_tile,dkdv_tile",
    [((16, 32), (32, 16)), ((64, 16), (16, 64))],  # (16, 16) tiles: the slowest under the interpreter (CI time)
    ids=["wide_keys", "tall_queries"],
)
def test_other_tile_shapes(monkeypatch, fwd_tile, dkdv_tile):
    """The span [kv_lo, kv_hi) cut into the loop bounds (unmasked tiles stay whole) for other tiles."""

    def config(m, n):
        return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=4, num_stages=1)]

    monkeypatch.setattr(kernels._gdpa_fwd_kernel, "configs", config(*fwd_tile))
    monkeypatch.setattr(kernels._gdpa_bwd_dq_kernel, "configs", config(*fwd_tile))
    monkeypatch.setattr(kernels._gdpa_bwd_dkdv_kernel, "configs", config(*dkdv_tile))
    B, H, L, D = 4, 1, 70, 16
    q, k, v, bias = make_inputs(B, H, L, L, D, torch.float32, bias_shape=(1, H, L, L), seed=31)
    ql, kl = torch.tensor([70, 60, 33, 0]), torch.tensor([70, 66, 70, 40])
    for kind, (causal, window) in (("left_pad", (False, 0)), ("right_pad", (True, 0)), ("tile_hole", (False, 6)),
                                   ("left_pad", (True, 18))):
        check(q, k, v, ql, kl, bias, make_mask(kind, B, L, 7), "gelu", 0.25, 1.0, True, causal, window)


def test_relative_table_with_mask():
    B, H, L, D = 3, 2, 37, 16
    q, k, v, _ = make_inputs(B, H, L, L, D, torch.float32, seed=14)
    table = 0.5 * torch.randn(2 * L - 1, H, generator=torch.Generator().manual_seed(2))
    check(q, k, v, None, torch.tensor([37, 20, 30]), table, make_mask("holes", B, L, 5), "silu", causal=True,
          relative_offset=L - 1)


@pytest.mark.parametrize("splits", [1, 3])
def test_bias_grad_splits_with_mask(splits):
    B, H, L, D = 3, 2, 37, 16
    q, k, v, bias = make_inputs(B, H, L, L, D, torch.float32, bias_shape=(1, 1, L, L), seed=15)
    mask = make_mask("empty_row", B, L, 6)
    args = GdpaSpec.from_bwd_schema("silu", 0.3, 1.0, True, True, 0, True, None, 0, None, mask)
    g = torch.randn(B, H, L, D, generator=torch.Generator().manual_seed(3))
    got = gdpa_backward_triton(g, q, k, v, None, None, bias, *args, bias_grad_splits=splits)[3]
    want = reference_gdpa_backward(g.double(), q.double(), k.double(), v.double(), None, None, bias.double(),
                                   *args)[3]
    assert rel(got, want) < 5e-5


def test_all_false_and_empty_everywhere():
    """sigmoid(0) = 0.5 would show any pair that is scored instead of dropped."""
    B, H, L, D = 3, 2, 20, 16
    q, k, v, _ = make_inputs(B, H, L, L, D, torch.float32, seed=2)
    mask = torch.zeros(B, L, dtype=torch.bool)
    for kl in (None, torch.tensor([20, 5, 0])):
        args = ("sigmoid", 0.3, 1.0, True, False, 0)
        out = gdpa_forward_triton(q, k, v, None, kl, None, *GdpaSpec.from_schema(*args, None, 0, None, mask))
        assert (out == 0).all()
        grads = gdpa_backward_triton(torch.randn_like(out), q, k, v, None, kl, None,
                                     *GdpaSpec.from_bwd_schema(*args, False, None, 0, None, mask))
        assert all((g == 0).all() for g in grads[:3])


def test_garbage_at_masked_keys_never_leaks():
    B, H, L, D = 3, 2, 35, 16
    q, k, v, bias = make_inputs(B, H, L, L, D, torch.float32, bias_shape=(B, H, L, L), seed=5)
    kl, mask = torch.tensor([35, 20, 30]), make_mask("tile_hole", B, L, 1)
    dead = ~mask[:, None, :, None]
    dirty = (k.masked_fill(dead, float("nan")), v.masked_fill(dead, float("inf")),
             bias.masked_fill(dead.transpose(2, 3), float("nan")))
    for causal, window in ((False, 0), (True, 6)):
        args = ("gelu_tanh", 0.25, 1.0, True, causal, window)
        spec = GdpaSpec.from_schema(*args, None, 0, None, mask)
        clean_out = gdpa_forward_triton(q, k, v, None, kl, bias, *spec)
        out = gdpa_forward_triton(q, dirty[0], dirty[1], None, kl, dirty[2], *spec)
        torch.testing.assert_close(out, clean_out, rtol=0, atol=0)
        g = torch.randn_like(out)
        bwd = GdpaSpec.from_bwd_schema(*args, True, None, 0, None, mask)
        grads = gdpa_backward_triton(g, q, dirty[0], dirty[1], None, kl, dirty[2], *bwd)
        clean = gdpa_backward_triton(g, q, k, v, None, kl, bias, *bwd)
        for a, b in zip(grads[:3], clean[:3]):
            assert not a.isnan().any()
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        # the bias gradient at masked-out keys is 0 (not NaN); elsewhere it matches
        assert not grads[3].isnan().any()
        torch.testing.assert_close(grads[3], clean[3], rtol=0, atol=0)


def test_all_true_mask_equals_no_mask_and_right_padding_equals_lengths():
    B, H, L, D = 3, 2, 37, 16
    q, k, v, bias = make_inputs(B, H, L, L, D, torch.float32, bias_shape=(1, H, L, L), seed=6)
    kl = torch.tensor([37, 17, 0])
    args = ("silu", 0.3, 1.0, False, True, 5)
    plain = gdpa_forward_triton(q, k, v, None, kl, bias, *GdpaSpec.from_schema(*args))
    ones = torch.ones(B, L, dtype=torch.bool)
    torch.testing.assert_close(
        gdpa_forward_triton(q, k, v, None, kl, bias, *GdpaSpec.from_schema(*args, None, 0, None, ones)), plain,
        rtol=1e-6, atol=1e-6)
    prefix = torch.arange(L)[None, :] < kl[:, None]
    torch.testing.assert_close(
        gdpa_forward_triton(q, k, v, None, None, bias, *GdpaSpec.from_schema(*args, None, 0, None, prefix)), plain,
        rtol=1e-6, atol=1e-6)


def test_launcher_refuses_mask_with_targets():
    B, H, L, D = 2, 1, 16, 16
    q, k, v, _ = make_inputs(B, H, L, L, D, torch.float32)
    mask = torch.ones(B, L, dtype=torch.bool)
    with pytest.raises(ValueError, match="kv_mask is not served"):
        gdpa_forward_triton(q, k, v, None, torch.tensor([16, 8]), None,
                            *GdpaSpec.from_schema("silu", 0.3, 1.0, False, True, 0, torch.tensor([1, 1]), 0, None,
                                                  mask))
