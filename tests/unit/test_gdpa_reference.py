"""gemcompile::gdpa on CPU (the plain-PyTorch reference path): semantics against a direct float64
computation (every activation, causal, window, lengths, shared queries, bias, output scaling), gradients,
padding hygiene, opcheck, input errors, FLOP counting, the eager autograd.Function and torch.compile."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import gemcompile.lowering  # noqa: F401  (registers the ops)
from gemcompile.lowering.gdpa.op import EagerGDPA, gdpa
from gemcompile.lowering.gdpa.reference import (
    activation_fn,
    activation_grad_fn,
    reference_gdpa_backward,
    reference_gdpa_forward,
    valid_pair_mask,
)
from gemcompile.lowering.gdpa.spec import GDPA_ACTIVATIONS, GdpaSpec

ops = torch.ops.gemcompile


# ---------------------------------------------------------------------------------------------------
# A direct float64 computation: per batch, slice the valid block, build the pair mask with Python loops,
# apply torch's own activations; gradients come from autograd.

ACTS = {
    "identity": lambda x: x,
    "relu": F.relu,
    "relu_squared": lambda x: F.relu(x) ** 2,
    "silu": F.silu,
    "sigmoid": torch.sigmoid,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def keeps(i, j, causal, window):
    if causal and j > i:
        return False
    if window > 0:
        return (i - j <= window) if causal else (abs(i - j) <= window)
    return True


def clamp_len(lengths, b, L):
    return L if lengths is None else min(max(int(lengths[b]), 0), L)


def direct_gdpa(q, k, v, q_lengths, kv_lengths, bias, activation, scale, out_scale, divide, causal, window):
    """Differentiable float64 oracle, written independently of the reference (slicing and loops)."""
    B, H, Lk, D = k.shape
    Lq = q.shape[2]
    full_bias = None if bias is None else bias.expand(B, H, Lq, Lk)
    outs = []
    for b in range(B):
        ql, kl = clamp_len(q_lengths, b, Lq), clamp_len(kv_lengths, b, Lk)
        if ql == 0 or kl == 0:
            outs.append(q.new_zeros(H, Lq, D))
            continue
        s = scale * q[b if q.shape[0] > 1 else 0, :, :ql] @ k[b, :, :kl].transpose(-1, -2)
        if full_bias is not None:
            s = s + full_bias[b, :, :ql, :kl]
        keep = torch.tensor(
            [[keeps(i, j, causal, window) for j in range(kl)] for i in range(ql)], dtype=q.dtype
        )
        c = out_scale / kl if divide else out_scale
        o = c * (ACTS[activation](s) * keep) @ v[b, :, :kl]
        outs.append(F.pad(o, (0, 0, 0, Lq - ql)))
    return torch.stack(outs)


def make_case(
    B,
    H,
    Lq,
    Lk,
    D,
    dtype=torch.float64,
    Bq=None,
    bias_shape=None,
    q_lengths=True,
    kv_lengths=True,
    seed=0,
    lengths=None,
):
    g = torch.Generator().manual_seed(seed)
    Bq = B if Bq is None else Bq
    q = torch.randn(Bq, H, Lq, D, generator=g).to(dtype)
    k = torch.randn(B, H, Lk, D, generator=g).to(dtype)
    v = torch.randn(B, H, Lk, D, generator=g).to(dtype)
    if lengths is None:  # 0, 1, odd and full in every case, then random
        special_q, special_k = [0, 1, Lq, max(1, Lq // 2) | 1], [Lk, 0, 1, max(1, Lk // 3) | 1]
        ql = torch.tensor(
            [special_q[i] if i < 4 else int(torch.randint(0, Lq + 1, (1,), generator=g)) for i in range(B)]
        )
        kl = torch.tensor(
            [special_k[i] if i < 4 else int(torch.randint(0, Lk + 1, (1,), generator=g)) for i in range(B)]
        )
    else:
        ql, kl = (torch.tensor(x) for x in lengths)
    bias = None if bias_shape is None else torch.randn(bias_shape, generator=g).to(dtype)
    return q, k, v, (ql if q_lengths else None), (kl if kv_lengths else None), bias


def grads_of(fn, inputs, grad_out):
    leaves = [x.detach().requires_grad_(True) if x is not None else None for x in inputs]
    out = fn(*leaves)
    out.backward(grad_out)
    return out.detach(), [None if x is None else x.grad for x in leaves]


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def check_op_against_direct(q, k, v, ql, kl, bias, activation, scale, out_scale, divide, causal, window):
    args = (activation, scale, out_scale, divide, causal, window)
    grad_out = torch.randn(k.shape[0], *q.shape[1:], dtype=torch.float64)
    out, grads = grads_of(lambda q, k, v, b: ops.gdpa(q, k, v, ql, kl, b, *args), (q, k, v, bias), grad_out)
    ref, ref_grads = grads_of(
        lambda q, k, v, b: direct_gdpa(q, k, v, ql, kl, b, *args), (q, k, v, bias), grad_out
    )
    assert out.shape == ref.shape and out.is_contiguous() and out.dtype == q.dtype
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    for name, got, want in zip("q k v bias".split(), grads, ref_grads):
        if want is None:
            assert got is None
            continue
        assert got.shape == want.shape, name
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9, msg=f"grad of {name}")
    return out, grads


MASKS = {"full": (False, 0), "causal": (True, 0), "window": (False, 2), "causal_window": (True, 3)}


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("activation", GDPA_ACTIVATIONS)
def test_every_activation_and_mask_matches_direct_float64(activation, mask):
    causal, window = MASKS[mask]
    B, H, Lq, Lk, D = 5, 2, 9, 11, 16
    q, k, v, ql, kl, bias = make_case(B, H, Lq, Lk, D, bias_shape=(B, H, Lq, Lk), seed=len(activation))
    check_op_against_direct(q, k, v, ql, kl, bias, activation, D**-0.5, 1.0, False, causal, window)


# name: (shared_q, q_lengths, kv_lengths, bias shape kind, divide, out_scale, causal, window, activation)
OPTION_CASES = [
    ("shared_q", (True, True, True, "heads_keys", False, 1.0, False, 0, "silu")),
    ("shared_q_causal_window", (True, False, True, "full", True, 0.5, True, 2, "gelu")),
    ("no_q_lengths", (False, False, True, "batch_rows", False, 2.0, True, 0, "relu_squared")),
    ("no_kv_lengths", (False, True, False, "scalar", True, 1.0, False, 3, "sigmoid")),
    ("no_lengths", (False, False, False, None, True, 3.0, True, 1, "gelu_tanh")),
    ("no_lengths_shared_q", (True, False, False, "heads_keys", False, 1.0, False, 0, "relu")),
    ("divide", (False, True, True, "full", True, 1.0, False, 0, "identity")),
    ("divide_out_scale_window", (False, True, True, None, True, 0.25, False, 4, "silu")),
    ("out_scale_negative", (False, True, True, "full", False, -1.5, True, 0, "gelu")),
    ("window_wider_than_lengths", (False, True, True, "full", False, 1.0, True, 50, "silu")),
]
BIAS_SHAPES = {
    None: lambda B, H, Lq, Lk: None,
    "full": lambda B, H, Lq, Lk: (B, H, Lq, Lk),
    "heads_keys": lambda B, H, Lq, Lk: (1, H, 1, Lk),
    "batch_rows": lambda B, H, Lq, Lk: (B, 1, Lq, 1),
    "scalar": lambda B, H, Lq, Lk: (1, 1, 1, 1),
}


@pytest.mark.parametrize("case", OPTION_CASES, ids=lambda c: c[0])
def test_options_match_direct_float64(case):
    shared_q, with_ql, with_kl, bias_kind, divide, out_scale, causal, window, act = case[1]
    B, H, Lq, Lk, D = 6, 2, 8, 10, 24
    q, k, v, ql, kl, bias = make_case(
        B,
        H,
        Lq,
        Lk,
        D,
        Bq=1 if shared_q else B,
        bias_shape=BIAS_SHAPES[bias_kind](B, H, Lq, Lk),
        q_lengths=with_ql,
        kv_lengths=with_kl,
        seed=7,
    )
    check_op_against_direct(q, k, v, ql, kl, bias, act, 0.3, out_scale, divide, causal, window)


@pytest.mark.parametrize("shape", [(3, 1, 1, 12, 16), (4, 2, 12, 3, 32), (5, 1, 7, 7, 16)], ids=str)
def test_cross_shapes(shape):
    B, H, Lq, Lk, D = shape
    q, k, v, ql, kl, bias = make_case(B, H, Lq, Lk, D, bias_shape=(1, H, Lq, Lk), seed=Lq * Lk)
    for causal, window in ((False, 0), (True, 2)):
        check_op_against_direct(q, k, v, ql, kl, bias, "silu", 0.4, 1.0, True, causal, window)


@pytest.mark.parametrize(
    "dtype,tol", [(torch.float32, 2e-6), (torch.float16, 2e-3), (torch.bfloat16, 1.5e-2)]
)
def test_low_precision_dtypes(dtype, tol):
    q, k, v, ql, kl, bias = make_case(6, 2, 13, 13, 32, dtype=dtype, bias_shape=(1, 2, 13, 13), seed=3)
    args = ("gelu", 0.2, 1.0, True, True, 4)
    grad_out = torch.randn(6, 2, 13, 32).to(dtype)
    out, grads = grads_of(lambda q, k, v, b: ops.gdpa(q, k, v, ql, kl, b, *args), (q, k, v, bias), grad_out)
    ref, ref_grads = grads_of(
        lambda q, k, v, b: direct_gdpa(q, k, v, ql, kl, b, *args),
        [x.double() for x in (q, k, v, bias)],
        grad_out.double(),
    )
    assert out.dtype == dtype and out.is_contiguous()
    assert rel(out, ref) < tol
    for g, r in zip(grads, ref_grads):
        assert g.dtype == dtype
        assert rel(g, r) < 3 * tol


# ---------------------------------------------------------------------------------------------------
# Activations, masks and zeros


def test_activations_match_torch_and_their_derivatives():
    x = torch.linspace(-6, 6, 1001, dtype=torch.float64)
    for name in GDPA_ACTIVATIONS:
        torch.testing.assert_close(activation_fn(name)(x), ACTS[name](x), rtol=1e-12, atol=1e-12)
        xr = x.clone().requires_grad_(True)
        (want,) = torch.autograd.grad(ACTS[name](xr).sum(), xr)
        torch.testing.assert_close(activation_grad_fn(name)(x), want, rtol=1e-10, atol=1e-12, msg=name)
    with pytest.raises(ValueError, match="activation must be one of identity, relu"):
        activation_fn("softmax")


def test_valid_pair_mask():
    ql, kl = torch.tensor([5, 2]), torch.tensor([4, 6])
    for causal in (False, True):
        for window in (0, 1, 2):
            mask = valid_pair_mask(ql, kl, 2, 5, 6, causal, window, "cpu")
            assert mask.shape == (2, 1, 5, 6)
            for b in range(2):
                for i in range(5):
                    for j in range(6):
                        want = i < int(ql[b]) and j < int(kl[b]) and keeps(i, j, causal, window)
                        assert bool(mask[b, 0, i, j]) == want


@pytest.mark.parametrize("activation", ["sigmoid", "gelu"])
def test_zero_lengths_give_exact_zeros_and_no_nan(activation):
    """sigmoid(0) = 0.5: invalid pairs must be dropped, not scored 0; divide by kv_len 0 gives 0."""
    B, H, L, D = 3, 2, 6, 16
    q, k, v, _, _, bias = make_case(B, H, L, L, D, bias_shape=(B, H, L, L), seed=2)
    grad_out = torch.randn(B, H, L, D, dtype=torch.float64)
    zeros = torch.zeros(B, dtype=torch.long)
    cases = [  # (q_lengths, kv_lengths, batches without any valid pair)
        (None, zeros, [True, True, True]),
        (zeros, None, [True, True, True]),
        (zeros, zeros, [True, True, True]),
        (torch.tensor([0, 6, 3]), torch.tensor([6, 0, 4]), [True, True, False]),
    ]
    for ql, kl, empty in cases:
        empty = torch.tensor(empty)
        for divide in (False, True):
            out, grads = grads_of(
                lambda q, k, v, b: ops.gdpa(q, k, v, ql, kl, b, activation, 0.3, 1.0, divide, True, 0),
                (q, k, v, bias),
                grad_out,
            )
            assert not out.isnan().any() and all(not g.isnan().any() for g in grads)
            assert (out[empty] == 0).all() and (out[~empty] != 0).any() == bool((~empty).any())
            for g in grads[1:4]:  # dk, dv, dbias of batches without pairs
                assert (g[empty] == 0).all()
            if bool(empty.all()):
                assert (grads[0] == 0).all()
    # no keys at all
    out = ops.gdpa(q, k[:, :, :0], v[:, :, :0], None, None, None, "sigmoid", 0.3, 1.0, True, False, 0)
    assert out.shape == (B, H, L, D) and (out == 0).all()


def test_padding_is_zero_and_never_nan():
    """Garbage (NaN/inf) at padded positions of q, k, v, bias and grad_out must not leak anywhere."""
    B, H, L, D = 4, 2, 8, 16
    q, k, v, ql, kl, bias = make_case(
        B, H, L, L, D, bias_shape=(B, H, L, L), seed=11, lengths=([0, 3, 8, 5], [2, 0, 8, 5])
    )
    clean = [x.clone() for x in (q, k, v, bias)]
    rows = torch.arange(L)
    q_pad = rows[None, :] >= ql[:, None]
    k_pad = rows[None, :] >= kl[:, None]
    q = q.masked_fill(q_pad[:, None, :, None], float("nan"))
    k = k.masked_fill(k_pad[:, None, :, None], float("inf"))
    v = v.masked_fill(k_pad[:, None, :, None], float("nan"))
    bias = bias.masked_fill(q_pad[:, None, :, None] | k_pad[:, None, None, :], float("nan"))
    grad_out = torch.randn(B, H, L, D, dtype=torch.float64).masked_fill(q_pad[:, None, :, None], float("nan"))
    for causal, window, act in ((False, 0, "sigmoid"), (True, 2, "silu")):
        args = (act, 0.25, 1.0, True, causal, window)
        out, grads = grads_of(
            lambda q, k, v, b: ops.gdpa(q, k, v, ql, kl, b, *args), (q, k, v, bias), grad_out
        )
        ref, ref_grads = grads_of(
            lambda q, k, v, b: ops.gdpa(q, k, v, ql, kl, b, *args), clean, torch.nan_to_num(grad_out)
        )
        assert not out.isnan().any() and all(not g.isnan().any() for g in grads)
        torch.testing.assert_close(out, ref)
        for g, r in zip(grads, ref_grads):
            torch.testing.assert_close(g, r)
        assert (out.transpose(1, 2)[q_pad] == 0).all()
        assert (grads[0].transpose(1, 2)[q_pad] == 0).all()  # dq at padded query rows
        assert (grads[1].transpose(1, 2)[k_pad] == 0).all()  # dk at padded keys
        assert (grads[2].transpose(1, 2)[k_pad] == 0).all()  # dv at padded keys
        assert (grads[3][(q_pad[:, None, :, None] | k_pad[:, None, None, :]).expand_as(grads[3])] == 0).all()


def test_strided_and_expanded_views_are_read_in_place():
    B, L, H, D = 3, 10, 2, 16
    x = torch.randn(B, L, 3, H, D, dtype=torch.float64)
    q, k, v = (t.transpose(1, 2) for t in x.unbind(2))  # permuted (B, L, H, D) views
    shared = torch.randn(1, H, 4, D, dtype=torch.float64).expand(B, H, 4, D)  # expanded learned queries
    kl = torch.tensor([10, 3, 0])
    args = ("silu", 0.25, 1.0, True, False, 0)
    for qq in (q, shared):
        out = ops.gdpa(qq, k, v, None, kl, None, *args)
        want = direct_gdpa(qq.contiguous(), k.contiguous(), v.contiguous(), None, kl, None, *args)
        torch.testing.assert_close(out, want)
        assert out.is_contiguous()


def test_lengths_int32_and_int64_agree():
    q, k, v, ql, kl, _ = make_case(4, 2, 8, 8, 16, seed=2)
    args = ("gelu", 0.2, 1.0, True, True, 2)
    a = ops.gdpa(q, k, v, ql, kl, None, *args)
    b = ops.gdpa(q, k, v, ql.int(), kl.int(), None, *args)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_python_wrapper_defaults():
    q, k, v, ql, kl, _ = make_case(2, 2, 5, 5, 16, seed=9)
    torch.testing.assert_close(
        gdpa(q, k, v), ops.gdpa(q, k, v, None, None, None, "silu", 0.25, 1.0, False, False, 0)
    )
    torch.testing.assert_close(
        gdpa(
            q,
            k,
            v,
            ql,
            kl,
            activation="relu",
            scale=0.5,
            out_scale=2.0,
            divide_by_kv_length=True,
            causal=True,
            window=1,
        ),
        ops.gdpa(q, k, v, ql, kl, None, "relu", 0.5, 2.0, True, True, 1),
    )


def test_reference_functions_direct():
    q, k, v, ql, kl, bias = make_case(3, 2, 6, 7, 16, bias_shape=(3, 1, 6, 7), seed=13)
    args = ("gelu_tanh", 0.3, 0.7, True, True, 2)
    out = reference_gdpa_forward(q, k, v, ql, kl, bias, *GdpaSpec.from_schema(*args))
    torch.testing.assert_close(out, direct_gdpa(q, k, v, ql, kl, bias, *args))
    g = torch.randn_like(out)
    dq, dk, dv, dbias = reference_gdpa_backward(g, q, k, v, ql, kl, bias,
                                                *GdpaSpec.from_bwd_schema(*args, False))
    assert dbias.numel() == 0 and dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


# ---------------------------------------------------------------------------------------------------
# opcheck, gradcheck, eager Function


def _opcheck_cases():
    q, k, v, ql, kl, bias = make_case(3, 2, 6, 7, 16, bias_shape=(1, 2, 6, 7), seed=4)
    bias.requires_grad_(True)
    qr, kr, vr = (x.clone().requires_grad_(True) for x in (q, k, v))
    args = ("silu", 0.3, 1.0, True, True, 2)
    g = torch.randn(3, 2, 6, 16, dtype=torch.float64)
    return [
        ("fwd", ops.gdpa_fwd.default, (qr, kr, vr, ql, kl, bias, *args)),
        (
            "fwd_shared_q",
            ops.gdpa_fwd.default,
            (qr[:1], kr, vr, None, kl, None, "gelu", 0.3, 2.0, False, False, 0),
        ),
        (
            "fwd_no_lengths",
            ops.gdpa_fwd.default,
            (qr, kr, vr, None, None, bias, "sigmoid", 0.3, 1.0, True, False, 3),
        ),
        ("bwd", ops.gdpa_bwd.default, (g, q, k, v, ql, kl, bias.detach(), *args, True)),
        ("bwd_no_bias", ops.gdpa_bwd.default, (g, q[:1], k, v, None, kl, None, *args, False)),
        ("public", ops.gdpa.default, (qr, kr, vr, ql, kl, bias, "gelu_tanh", 0.3, 1.0, False, False, 1)),
    ]


@pytest.mark.parametrize("case", _opcheck_cases(), ids=lambda c: c[0])
def test_opcheck(case):
    _, op, args = case
    result = torch.library.opcheck(op, args)
    assert all(v == "SUCCESS" for v in result.values()), result


@pytest.mark.parametrize("activation", GDPA_ACTIVATIONS)
def test_gradcheck_float64(activation):
    q, k, v, ql, kl, bias = make_case(3, 1, 5, 6, 16, bias_shape=(3, 1, 1, 6), seed=8)
    inputs = [x.requires_grad_(True) for x in (q, k, v, bias)]
    causal, window = (True, 2) if len(activation) % 2 else (False, 1)
    assert torch.autograd.gradcheck(
        lambda q, k, v, b: ops.gdpa(q, k, v, ql, kl, b, activation, 0.4, 1.3, True, causal, window),
        inputs,
        fast_mode=True,
    )


def test_eager_function_matches_the_op_path():
    """The eager fast path (one autograd.Function, taken for plain CUDA tensors) computes what the custom
    ops compute; run here on CPU, where it uses the reference."""
    from gemcompile.lowering.common.opkit import takes_eager_path

    assert not takes_eager_path(torch.zeros(1))  # CPU tensors go through the ops
    q, k, v, ql, kl, bias = make_case(4, 2, 7, 9, 16, Bq=1, bias_shape=(1, 2, 7, 9), seed=21)
    args = ("gelu", 0.3, 1.5, True, True, 3)
    g = torch.randn(4, 2, 7, 16, dtype=torch.float64)
    out_fn, grads_fn = grads_of(
        lambda q, k, v, b: EagerGDPA.apply(q, k, v, ql, kl, b,
                                           *GdpaSpec.from_schema(*args)), (q, k, v, bias), g
    )
    out_op, grads_op = grads_of(
        lambda q, k, v, b: ops.gdpa_fwd(q, k, v, ql, kl, b, *args), (q, k, v, bias), g
    )
    torch.testing.assert_close(out_fn, out_op, rtol=0, atol=0)
    for a, b in zip(grads_fn, grads_op):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    inputs = [x.detach().requires_grad_(True) for x in (q, k, v, bias)]
    assert torch.autograd.gradcheck(
        lambda q, k, v, b: EagerGDPA.apply(q, k, v, ql, kl, b,
                                           *GdpaSpec.from_schema("silu", 0.3, 1.0, False, False, 0)),
        inputs,
        fast_mode=True,
    )


def test_bias_without_grad_gives_no_bias_grad():
    q, k, v, ql, kl, bias = make_case(3, 2, 5, 5, 16, bias_shape=(1, 2, 5, 5), seed=5)
    qr = q.requires_grad_(True)
    ops.gdpa(qr, k, v, ql, kl, bias, "silu", 0.3, 1.0, False, False, 0).sum().backward()
    assert bias.grad is None and qr.grad is not None


# ---------------------------------------------------------------------------------------------------
# Input checks


def _good():
    q, k, v, ql, kl, bias = make_case(3, 2, 5, 6, 16, dtype=torch.float32, bias_shape=(1, 2, 5, 6), seed=1)
    return dict(
        q=q,
        k=k,
        v=v,
        q_lengths=ql,
        kv_lengths=kl,
        bias=bias,
        activation="silu",
        scale=0.25,
        out_scale=1.0,
        divide_by_kv_length=False,
        causal=False,
        window=0,
    )


def _call(**kw):
    return gdpa(**kw)


BAD_INPUTS = [
    ("k dtype", lambda a: a.update(k=a["k"].half()), TypeError, "one dtype"),
    (
        "integer q",
        lambda a: a.update(q=a["q"].long(), k=a["k"].long(), v=a["v"].long()),
        TypeError,
        "q must be",
    ),
    ("q not a tensor", lambda a: a.update(q=1.0), TypeError, "q must be a torch.Tensor"),
    ("q rank", lambda a: a.update(q=a["q"][0]), ValueError, "q must be 4-D"),
    ("v rank", lambda a: a.update(v=a["v"][..., None]), ValueError, "v must be 4-D"),
    ("batch", lambda a: a.update(q=a["q"][:2]), ValueError, "batch size"),
    ("heads", lambda a: a.update(q=a["q"][:, :1]), ValueError, "heads"),
    ("k v shape", lambda a: a.update(v=a["v"][:, :, :3]), ValueError, "k and v"),
    (
        "head dim small",
        lambda a: a.update(**{n: a[n][..., :8] for n in "qkv"}),
        ValueError,
        "head dim 8 .*gdpa",
    ),
    (
        "head dim big",
        lambda a: a.update(**{n: a[n].repeat(1, 1, 1, 9) for n in "qkv"}),
        ValueError,
        "head dim 144",
    ),
    ("head dim mismatch", lambda a: a.update(q=a["q"][..., :15]), ValueError, "head dim"),
    ("bias shape", lambda a: a.update(bias=torch.zeros(1, 2, 5, 4)), ValueError, "bias must be 4-D"),
    ("bias rank", lambda a: a.update(bias=torch.zeros(5, 6)), ValueError, "bias must be 4-D"),
    (
        "bias dtype",
        lambda a: a.update(bias=torch.zeros(1, 2, 5, 6, dtype=torch.long)),
        TypeError,
        "bias must be a floa",
    ),
    ("bias device", lambda a: a.update(bias=a["bias"].to("meta")), ValueError, "bias is on meta"),
    (
        "kv_lengths float",
        lambda a: a.update(kv_lengths=a["kv_lengths"].float()),
        TypeError,
        "kv_lengths must be an int",
    ),
    (
        "kv_lengths size",
        lambda a: a.update(kv_lengths=a["kv_lengths"][:2]),
        ValueError,
        "kv_lengths must be 1-D",
    ),
    (
        "q_lengths size",
        lambda a: a.update(q_lengths=torch.tensor([1, 2, 3, 4])),
        ValueError,
        "q_lengths must be 1-D",
    ),
    ("q_lengths 2-D", lambda a: a.update(q_lengths=a["q_lengths"][None]), ValueError, "q_lengths"),
    (
        "kv_lengths negative",
        lambda a: a.update(kv_lengths=torch.tensor([1, -1, 2])),
        ValueError,
        "kv_lengths\\[1\\]",
    ),
    (
        "kv_lengths too long",
        lambda a: a.update(kv_lengths=torch.tensor([1, 7, 2])),
        ValueError,
        "outside \\[0, 6\\]",
    ),
    (
        "q_lengths too long",
        lambda a: a.update(q_lengths=torch.tensor([6, 1, 2])),
        ValueError,
        "q_lengths\\[0\\]",
    ),
    (
        "lengths device",
        lambda a: a.update(kv_lengths=a["kv_lengths"].to("meta")),
        ValueError,
        "kv_lengths is on meta",
    ),
    ("k device", lambda a: a.update(k=a["k"].to("meta")), ValueError, "one device"),
    (
        "activation",
        lambda a: a.update(activation="softmax"),
        ValueError,
        "activation must be one of identity, relu, relu_squared, silu, sigmoid, gelu, gelu_tanh; "
        "got 'softmax'",
    ),
    ("activation type", lambda a: a.update(activation=None), ValueError, "activation must be one of"),
    ("negative window", lambda a: a.update(window=-1), ValueError, "window must be >= 0"),
    ("window type", lambda a: a.update(window=1.5), TypeError, "window must be an int"),
    ("causal type", lambda a: a.update(causal=1), TypeError, "causal must be a bool"),
    (
        "divide type",
        lambda a: a.update(divide_by_kv_length=None),
        TypeError,
        "divide_by_kv_length must be a bool",
    ),
    ("scale type", lambda a: a.update(scale="0.5"), TypeError, "scale must be a float"),
    ("out_scale type", lambda a: a.update(out_scale=True), TypeError, "out_scale must be a float"),
]


@pytest.mark.parametrize("case", BAD_INPUTS, ids=lambda c: c[0])
def test_bad_inputs_raise_clear_errors(case):
    _, mutate, exc, match = case
    args = _good()
    _call(**args)  # the good call works
    mutate(args)
    with pytest.raises(exc, match=match):
        _call(**args)


def test_the_ops_check_too():
    a = _good()
    with pytest.raises(ValueError, match="activation must be one of"):
        ops.gdpa(a["q"], a["k"], a["v"], None, None, None, "tanh", 0.3, 1.0, False, False, 0)
    with pytest.raises(ValueError, match="window must be >= 0"):
        ops.gdpa_fwd(a["q"], a["k"], a["v"], None, None, None, "relu", 0.3, 1.0, False, False, -2)


def test_fake_tensors_skip_value_checks_and_give_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k, v = torch.randn(1, 2, 4, 16), torch.randn(3, 2, 6, 16), torch.randn(3, 2, 6, 16)
        kl = torch.full((3,), 99)  # a fake tensor has no values: nothing to check
        out = ops.gdpa_fwd(q, k, v, None, kl, None, "silu", 0.1, 1.0, True, False, 0)
        dq, dk, _, db = ops.gdpa_bwd(out, q, k, v, None, kl, None, "silu", 0.1, 1.0, True, False, 0, False)
    assert (
        out.shape == (3, 2, 4, 16) and dq.shape == (1, 2, 4, 16) and dk.shape == k.shape and db.numel() == 0
    )


# ---------------------------------------------------------------------------------------------------
# FLOPs and torch.compile


def expected_pairs(ql, kl, B, Lq, Lk, causal, window):
    total = 0
    for b in range(B):
        a, c = clamp_len(ql, b, Lq), clamp_len(kl, b, Lk)
        total += sum(keeps(i, j, causal, window) for i in range(a) for j in range(c))
    return total


@pytest.mark.parametrize("causal,window", [(False, 0), (True, 0), (False, 2), (True, 3)])
def test_flop_counter_counts_valid_pairs(causal, window):
    B, H, Lq, Lk, D = 3, 2, 8, 9, 16
    q, k, v, _, _, _ = make_case(B, H, Lq, Lk, D, seed=6)
    for ql, kl in (
        (torch.tensor([8, 3, 0]), torch.tensor([5, 9, 4])),
        (None, torch.tensor([2, 9, 7])),
        (torch.tensor([1, 8, 5]), None),
        (None, None),
    ):
        pairs = expected_pairs(ql, kl, B, Lq, Lk, causal, window)
        qr = q.detach().requires_grad_(True)
        with FlopCounterMode(display=False) as counter:
            ops.gdpa(qr, k, v, ql, kl, None, "silu", 0.25, 1.0, True, causal, window).sum().backward()
        counts = {str(k_): v_ for k_, v_ in counter.get_flop_counts()["Global"].items()}
        assert counts["gemcompile.gdpa_fwd"] == 4 * H * D * pairs
        assert counts["gemcompile.gdpa_bwd"] == 10 * H * D * pairs


def test_flop_counter_falls_back_to_padded_count_on_fake_lengths():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k, v = (torch.randn(2, 2, 8, 16) for _ in range(3))
        kl = torch.zeros(2, dtype=torch.long)
        with FlopCounterMode(display=False) as counter:
            ops.gdpa(q, k, v, None, kl, None, "relu", 0.25, 1.0, False, True, 2)
    assert counter.get_total_flops() == 4 * 2 * 16 * expected_pairs(None, None, 2, 8, 8, True, 2)


def test_compile_fullgraph_no_recompile_over_lengths():
    B, H, L, D = 3, 2, 8, 16
    q, k, v, _, _, bias = make_case(B, H, L, L, D, dtype=torch.float32, bias_shape=(1, H, L, L), seed=10)
    leaves = [x.requires_grad_(True) for x in (q, k, v, bias)]

    def f(q, k, v, bias, ql, kl):
        return ops.gdpa(q, k, v, ql, kl, bias, "gelu", 0.25, 1.0, True, True, 3).square().sum()

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed in range(3):
            g = torch.Generator().manual_seed(seed)
            ql, kl = torch.randint(0, L + 1, (B,), generator=g), torch.randint(0, L + 1, (B,), generator=g)
            got = torch.autograd.grad(compiled(*leaves, ql, kl), leaves)
            want = torch.autograd.grad(f(*leaves, ql, kl), leaves)
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b)


def test_scale_default_matches_math():
    q, k, v, _, _, _ = make_case(2, 1, 4, 4, 16, seed=0)
    torch.testing.assert_close(
        gdpa(q, k, v, activation="identity"),
        ops.gdpa(q, k, v, None, None, None, "identity", 1 / math.sqrt(16), 1.0, False, False, 0),
    )


# ---------------------------------------------------------------------------------------------------
# HSTU's target mask (num_targets) and contextual prefix (contextual_len)


def hstu_keeps(i, j, n, t, c, window):
    """The clamped-id rule of lowering/gdpa/op.py for one pair (i < q_len and j < n are checked by the caller);
    t is None without num_targets."""
    ii, jj, m = i, j, n
    if c > 0:
        ii, jj, m = max(i - c + 1, 0), max(j - c + 1, 0), n - c + 1
    if t is not None:
        m = m - t
        ii, jj = min(ii, m), min(jj, m)
    d = ii - jj
    visible = i == j or d > 0
    if window > 0:
        visible = visible and d <= window
    if c > 0:
        visible = visible or (ii == 0 and jj < m)
    return visible


def direct_hstu_gdpa(
    q, k, v, q_lengths, kv_lengths, bias, activation, scale, out_scale, divide, window, num_targets, c
):
    """Differentiable float64 oracle (causal), independent of the reference: a loop over (b, i, j)."""
    B, H, Lk, D = k.shape
    Lq = q.shape[2]
    full_bias = None if bias is None else bias.expand(B, H, Lq, Lk)
    outs = []
    for b in range(B):
        ql, n = clamp_len(q_lengths, b, Lq), clamp_len(kv_lengths, b, Lk)
        t = None if num_targets is None else int(num_targets[b])
        keep = torch.zeros(Lq, Lk, dtype=q.dtype)
        for i in range(ql):
            for j in range(n):
                keep[i, j] = float(hstu_keeps(i, j, n, t, c, window))
        s = scale * q[b] @ k[b].transpose(-1, -2)
        if full_bias is not None:
            s = s + full_bias[b]
        a = torch.where(keep.bool(), ACTS[activation](torch.where(keep.bool(), s, 0.0)), 0.0)
        cb = out_scale / max(n, 1) if divide else out_scale
        outs.append(cb * a @ v[b])
    return torch.stack(outs)


HSTU_LENGTHS = {"kv": [9, 7, 0, 1, 5, 9], "q": [9, 5, 0, 1, 5, 4]}
HSTU_TARGETS = {
    None: None,
    "zero": [0, 0, 0, 0, 0, 0],
    "one": [1, 1, 0, 1, 1, 1],
    "several": [3, 7, 0, 1, 2, 9],  # t == n for batches 1, 3 and 5
}


def hstu_case(targets, with_q_lengths, seed, bias_shape=(6, 2, 9, 9), dtype=torch.float64):
    q, k, v, ql, kl, bias = make_case(
        6,
        2,
        9,
        9,
        16,
        dtype=dtype,
        bias_shape=bias_shape,
        seed=seed,
        lengths=(HSTU_LENGTHS["q"], HSTU_LENGTHS["kv"]),
    )
    nt = None if HSTU_TARGETS[targets] is None else torch.tensor(HSTU_TARGETS[targets])
    return q, k, v, (ql if with_q_lengths else None), kl, bias, nt


def check_hstu_against_direct(q, k, v, ql, kl, bias, nt, c, activation, window, divide=False, out_scale=1.0):
    args = (activation, 0.3, out_scale, divide, True, window)
    grad_out = torch.randn(q.shape, dtype=torch.float64)
    out, grads = grads_of(
        lambda q, k, v, b: ops.gdpa(q, k, v, ql, kl, b, *args, nt, c), (q, k, v, bias), grad_out
    )
    ref, ref_grads = grads_of(
        lambda q, k, v, b: direct_hstu_gdpa(
            q, k, v, ql, kl, b, activation, 0.3, out_scale, divide, window, nt, c
        ),
        (q, k, v, bias),
        grad_out,
    )
    assert out.shape == ref.shape and out.is_contiguous()
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    for name, got, want in zip("q k v bias".split(), grads, ref_grads):
        if want is None:
            assert got is None
            continue
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9, msg=f"grad of {name}")
    return out


HSTU_CASES = [  # (targets, contextual_len): every combination but plain causal (covered above)
    (t, c) for t in HSTU_TARGETS for c in (0, 1, 3) if not (t is None and c == 0)
]


@pytest.mark.parametrize("with_q_lengths", [False, True], ids=["no_q_lengths", "q_lengths"])
@pytest.mark.parametrize("window", [0, 2], ids=["no_window", "window2"])
@pytest.mark.parametrize("targets,contextual_len", HSTU_CASES, ids=lambda x: str(x))
def test_targets_and_contextual_match_direct_float64(targets, contextual_len, window, with_q_lengths):
    index = list(HSTU_TARGETS).index(targets) * 12 + contextual_len * 4 + window + with_q_lengths
    activation = GDPA_ACTIVATIONS[index % len(GDPA_ACTIVATIONS)]
    q, k, v, ql, kl, bias, nt = hstu_case(targets, with_q_lengths, seed=index)
    bias.requires_grad_(True)
    check_hstu_against_direct(
        q, k, v, ql, kl, bias, nt, contextual_len, activation, window, divide=bool(index % 2), out_scale=1.5
    )


@pytest.mark.parametrize("activation", GDPA_ACTIVATIONS)
def test_targets_and_contextual_every_activation(activation):
    q, k, v, ql, kl, bias, nt = hstu_case("several", True, seed=len(activation), bias_shape=(1, 2, 9, 9))
    check_hstu_against_direct(q, k, v, ql, kl, bias, nt, 2, activation, 3, divide=True)


def test_contextual_longer_than_sequences_and_int32_targets():
    """c > n (m <= 0: only the diagonal), int32 num_targets, targets covering the whole sequence."""
    q, k, v, ql, kl, bias, _ = hstu_case(None, False, seed=3)
    nt = torch.tensor([9, 0, 0, 1, 5, 2], dtype=torch.int32)
    for c in (6, 9, 12):
        out = check_hstu_against_direct(q, k, v, ql, kl, bias, nt, c, "sigmoid", 0)
        assert not out.isnan().any()


def test_valid_pair_mask_targets_and_contextual():
    g = torch.Generator().manual_seed(0)
    B, L = 4, 8
    for trial in range(12):
        kl = torch.randint(0, L + 1, (B,), generator=g)
        ql = torch.randint(0, L + 1, (B,), generator=g) if trial % 2 else None
        nt = (
            torch.stack([torch.randint(0, int(n) + 1, (1,), generator=g)[0] for n in kl])
            if trial % 3
            else None
        )
        c, window = trial % 4, (0, 1, 3)[trial % 3]
        mask = valid_pair_mask(ql, kl, B, L, L, True, window, "cpu", nt, c)
        assert mask.shape == (B, 1, L, L)
        for b in range(B):
            n, qn = int(kl[b]), clamp_len(ql, b, L)
            t = None if nt is None else int(nt[b])
            want = [
                [i < qn and j < n and hstu_keeps(i, j, n, t, c, window) for j in range(L)] for i in range(L)
            ]
            assert mask[b, 0].tolist() == want, (trial, b)


def test_zero_targets_without_prefix_is_plain_causal():
    q, k, v, ql, kl, bias, nt = hstu_case("zero", True, seed=12)
    ql = kl  # (rows past kv_len would clamp under a window)
    for window in (0, 2):
        args = ("gelu", 0.3, 1.0, False, True, window)
        torch.testing.assert_close(
            ops.gdpa(q, k, v, ql, kl, bias, *args, nt, 0),
            ops.gdpa(q, k, v, ql, kl, bias, *args),
            rtol=0,
            atol=0,
        )
    args = ("gelu", 0.3, 1.0, False, True, 0)  # the defaults
    torch.testing.assert_close(
        ops.gdpa(q, k, v, ql, kl, bias, *args, None, 0),
        ops.gdpa(q, k, v, ql, kl, bias, *args),
        rtol=0,
        atol=0,
    )
    torch.testing.assert_close(
        gdpa(q, k, v, ql, kl, bias, "gelu", 0.3, causal=True, num_targets=nt, contextual_len=0),
        ops.gdpa(q, k, v, ql, kl, bias, *args),
    )


def test_targets_only_see_history_and_themselves():
    """Changing a target's k/v changes no other row's output; the contextual rows see the whole history."""
    q, k, v, _, kl, _, nt = hstu_case("several", False, seed=5)
    args = ("silu", 0.3, 1.0, False, True, 0)
    out = ops.gdpa(q, k, v, kl, kl, None, *args, nt, 2)
    b, n, t = 0, int(kl[0]), int(nt[0])  # targets of batch 0: positions 6, 7, 8
    k2, v2 = k.clone(), v.clone()
    k2[b, :, n - 1], v2[b, :, n - 1] = 5.0, -3.0
    out2 = ops.gdpa(q, k2, v2, kl, kl, None, *args, nt, 2)
    changed = (out2 - out).abs().amax(dim=(1, 3))[b] > 0
    assert changed.tolist() == [i == n - 1 for i in range(9)]
    k3 = k.clone()
    k3[b, :, n - t - 1] = 5.0  # the last history key: seen by the contextual rows 0, 1 and every later row
    out3 = ops.gdpa(q, k3, v, kl, kl, None, *args, nt, 2)
    changed = (out3 - out).abs().amax(dim=(1, 3))[b] > 0
    assert changed.tolist() == [i in (0, 1) or i >= n - t - 1 for i in range(9)]


def test_gradcheck_float64_targets_and_contextual():
    q, k, v, ql, kl, bias, nt = hstu_case("several", True, seed=8, bias_shape=(6, 1, 1, 9))
    inputs = [x.requires_grad_(True) for x in (q[:4, :1], k[:4, :1], v[:4, :1], bias[:4])]
    for window, act in ((0, "gelu_tanh"), (2, "silu")):
        assert torch.autograd.gradcheck(
            lambda q, k, v, b: ops.gdpa(
                q, k, v, ql[:4], kl[:4], b, act, 0.4, 1.3, True, True, window, nt[:4], 2
            ),
            inputs,
            fast_mode=True,
        )


def _hstu_opcheck_cases():
    q, k, v, ql, kl, bias, nt = hstu_case("several", True, seed=4, bias_shape=(1, 2, 9, 9))
    bias.requires_grad_(True)
    qr, kr, vr = (x.clone().requires_grad_(True) for x in (q, k, v))
    args = ("silu", 0.3, 1.0, True, True, 2)
    g = torch.randn(6, 2, 9, 16, dtype=torch.float64)
    return [
        ("fwd_targets_ctx", ops.gdpa_fwd.default, (qr, kr, vr, ql, kl, bias, *args, nt, 3)),
        ("fwd_targets_int32", ops.gdpa_fwd.default, (qr, kr, vr, None, kl, None, *args, nt.int(), 0)),
        ("fwd_ctx", ops.gdpa_fwd.default, (qr, kr, vr, ql, kl, bias, *args, None, 2)),
        ("bwd_targets_ctx", ops.gdpa_bwd.default, (g, q, k, v, ql, kl, bias.detach(), *args, True, nt, 1)),
        (
            "public_targets",
            ops.gdpa.default,
            (qr, kr, vr, ql, kl, bias, "gelu", 0.3, 1.0, False, True, 0, nt, 2),
        ),
    ]


@pytest.mark.parametrize("case", _hstu_opcheck_cases(), ids=lambda c: c[0])
def test_opcheck_targets_and_contextual(case):
    _, op, args = case
    result = torch.library.opcheck(op, args)
    assert all(v == "SUCCESS" for v in result.values()), result


def test_eager_function_and_reference_with_targets():
    q, k, v, ql, kl, bias, nt = hstu_case("several", True, seed=21)
    args = ("gelu", 0.3, 1.5, True, True, 3)
    g = torch.randn(q.shape, dtype=torch.float64)
    out_fn, grads_fn = grads_of(
        lambda q, k, v, b: EagerGDPA.apply(q, k, v, ql, kl, b,
                                           *GdpaSpec.from_schema(*args, nt, 2)), (q, k, v, bias), g
    )
    out_op, grads_op = grads_of(
        lambda q, k, v, b: ops.gdpa_fwd(q, k, v, ql, kl, b, *args, nt, 2), (q, k, v, bias), g
    )
    torch.testing.assert_close(out_fn, out_op, rtol=0, atol=0)
    for a, b in zip(grads_fn, grads_op):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(
        reference_gdpa_forward(q, k, v, ql, kl, bias,
                               *GdpaSpec.from_schema(*args, num_targets=nt, contextual_len=2)), out_op
    )
    dq, dk, dv, dbias = reference_gdpa_backward(g, q, k, v, ql, kl, bias,
                                                *GdpaSpec.from_bwd_schema(*args, True, nt, 2))
    for a, b in zip((dq, dk, dv, dbias), grads_op):
        torch.testing.assert_close(a, b)


def _good_hstu():
    args = _good()
    L = 6
    q, k, v, ql, kl, bias = make_case(3, 2, L, L, 16, dtype=torch.float32, bias_shape=(1, 2, L, L), seed=1)
    args.update(q=q, k=k, v=v, q_lengths=ql, kv_lengths=kl, bias=bias, causal=True, window=2)
    args.update(num_targets=torch.minimum(torch.tensor([2, 0, 1]), kl), contextual_len=1)
    return args


BAD_HSTU_INPUTS = [
    (
        "targets not causal",
        lambda a: a.update(causal=False),
        ValueError,
        "num_targets and contextual_len > 0 require causal=True",
    ),
    (
        "contextual not causal",
        lambda a: a.update(causal=False, num_targets=None),
        ValueError,
        "^contextual_len > 0 requires causal=True",
    ),
    (
        "targets without kv_lengths",
        lambda a: a.update(kv_lengths=None, num_targets=torch.zeros(3, dtype=torch.long)),
        ValueError,
        "require kv_lengths",
    ),
    (
        "targets size",
        lambda a: a.update(num_targets=torch.zeros(2, dtype=torch.long)),
        ValueError,
        "num_targets must be 1-D of size B = 3",
    ),
    (
        "targets 2-D",
        lambda a: a.update(num_targets=torch.zeros(3, 1, dtype=torch.long)),
        ValueError,
        "num_targets must be 1-D",
    ),
    (
        "targets dtype",
        lambda a: a.update(num_targets=torch.zeros(3)),
        TypeError,
        "num_targets must be an int32 or int64",
    ),
    (
        "targets not a tensor",
        lambda a: a.update(num_targets=[0, 0, 0]),
        TypeError,
        "num_targets must be a torch.Tensor",
    ),
    (
        "targets device",
        lambda a: a.update(num_targets=torch.zeros(3, dtype=torch.long, device="meta")),
        ValueError,
        "num_targets is on meta",
    ),
    (
        "targets > kv length",
        lambda a: a.update(num_targets=a["kv_lengths"] + torch.tensor([0, 1, 0])),
        ValueError,
        r"num_targets\[1\] = .* is outside \[0, ",
    ),
    (
        "targets negative",
        lambda a: a.update(num_targets=torch.tensor([0, 0, -1])),
        ValueError,
        r"num_targets\[2\] = -1",
    ),
    (
        "negative contextual_len",
        lambda a: a.update(contextual_len=-1),
        ValueError,
        "contextual_len must be >= 0",
    ),
    (
        "contextual_len float",
        lambda a: a.update(contextual_len=1.0),
        TypeError,
        "contextual_len must be an int",
    ),
    (
        "contextual_len bool",
        lambda a: a.update(contextual_len=True),
        TypeError,
        "contextual_len must be an int",
    ),
    (
        "contextual_len None",
        lambda a: a.update(contextual_len=None),
        TypeError,
        "contextual_len must be an int",
    ),
    ("shared queries", lambda a: a.update(q=a["q"][:1], q_lengths=None), ValueError, "no shared queries"),
    (
        "cross attention",
        lambda a: a.update(q=a["q"][:, :, :4], q_lengths=None, bias=None),
        ValueError,
        "Lq == Lk",
    ),
]


@pytest.mark.parametrize("case", BAD_HSTU_INPUTS, ids=lambda c: c[0])
def test_bad_targets_and_contextual_raise_clear_errors(case):
    _, mutate, exc, match = case
    args = _good_hstu()
    _call(**args)  # the good call works
    mutate(args)
    with pytest.raises(exc, match=match):
        _call(**args)


def test_the_ops_check_targets_too():
    a = _good_hstu()
    base = (a["q"], a["k"], a["v"], a["q_lengths"], a["kv_lengths"], None, "silu", 0.3, 1.0, False)
    with pytest.raises(ValueError, match="num_targets requires causal=True"):
        ops.gdpa(*base, False, 0, a["num_targets"], 0)
    with pytest.raises(ValueError, match="outside"):
        ops.gdpa_fwd(*base, True, 0, a["num_targets"] + 10, 0)
    with pytest.raises(ValueError, match="contextual_len must be >= 0"):
        ops.gdpa_fwd(*base, True, 0, None, -3)


def expected_hstu_pairs(ql, kl, B, L, window, nt, c):
    total = 0
    for b in range(B):
        qn, n = clamp_len(ql, b, L), clamp_len(kl, b, L)
        t = None if nt is None else int(nt[b])
        total += sum(hstu_keeps(i, j, n, t, c, window) for i in range(qn) for j in range(n))
    return total


@pytest.mark.parametrize("window", [0, 2])
def test_flop_counter_counts_targets_and_contextual(window):
    from gemcompile.lowering.gdpa.flops import gdpa_pairs

    B, H, L, D = 6, 2, 9, 16
    q, k, v, ql, kl, _, nt = hstu_case("several", True, seed=6)
    for qls, nts, c in ((ql, nt, 0), (None, nt, 3), (ql, None, 2), (None, nt.int(), 12)):
        pairs = expected_hstu_pairs(qls, kl, B, L, window, nts, c)
        assert gdpa_pairs(qls, kl, B, L, L, True, window, nts, c) == pairs
        qr = q.detach().requires_grad_(True)
        with FlopCounterMode(display=False) as counter:
            ops.gdpa(qr, k, v, qls, kl, None, "silu", 0.25, 1.0, True, True, window, nts, c).sum().backward()
        counts = {str(k_): v_ for k_, v_ in counter.get_flop_counts()["Global"].items()}
        assert counts["gemcompile.gdpa_fwd"] == 4 * H * D * pairs
        assert counts["gemcompile.gdpa_bwd"] == 10 * H * D * pairs
    # the closed-form count against the brute force on random lengths (targets used as given: t > n too)
    g = torch.Generator().manual_seed(window)
    for _ in range(20):
        kl_r = torch.randint(0, L + 1, (B,), generator=g)
        ql_r = torch.randint(0, L + 1, (B,), generator=g)
        nt_r = torch.randint(-1, L + 2, (B,), generator=g)
        c = int(torch.randint(0, 6, (1,), generator=g))
        for nts in (nt_r, None):
            if nts is None and c == 0:
                continue
            want = expected_hstu_pairs(ql_r, kl_r, B, L, window, nts, c)
            assert gdpa_pairs(ql_r, kl_r, B, L, L, True, window, nts, c) == want


def test_fake_targets_give_padded_count_and_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k, v = (torch.randn(2, 2, 8, 16) for _ in range(3))
        kl = torch.full((2,), 8, dtype=torch.long)
        nt = torch.ones(2, dtype=torch.long)
        with FlopCounterMode(display=False) as counter:
            out = ops.gdpa(q, k, v, None, kl, None, "relu", 0.25, 1.0, False, True, 2, nt, 3)
        dq, dk, _, db = ops.gdpa_bwd(
            out, q, k, v, None, kl, None, "relu", 0.1, 1.0, True, True, 0, False, nt, 3
        )
    assert out.shape == (2, 2, 8, 16) and dq.shape == q.shape and dk.shape == k.shape and db.numel() == 0
    assert counter.get_total_flops() == 4 * 2 * 16 * expected_pairs(None, None, 2, 8, 8, True, 2)


def test_compile_fullgraph_no_recompile_over_targets():
    B, H, L, D = 3, 2, 8, 16
    q, k, v, _, _, bias = make_case(B, H, L, L, D, dtype=torch.float32, bias_shape=(1, H, L, L), seed=10)
    leaves = [x.requires_grad_(True) for x in (q, k, v, bias)]

    def f(q, k, v, bias, kl, nt):
        return ops.gdpa(q, k, v, kl, kl, bias, "gelu", 0.25, 1.0, True, True, 3, nt, 2).square().sum()

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed in range(3):
            g = torch.Generator().manual_seed(seed)
            kl = torch.randint(0, L + 1, (B,), generator=g)
            nt = (torch.rand(B, generator=g) * (kl + 1)).long()
            got = torch.autograd.grad(compiled(*leaves, kl, nt), leaves)
            want = torch.autograd.grad(f(*leaves, kl, nt), leaves)
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b)
