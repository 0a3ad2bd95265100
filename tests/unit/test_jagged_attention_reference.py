"""gemcompile::jagged_attention on CPU (the plain-PyTorch reference path): semantics against a direct float64
computation, gradients, padding hygiene, opcheck, input errors, FLOP counting and torch.compile."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import gemcompile.lowering  # noqa: F401  (registers the ops)
from gemcompile.lowering.common.checks import strict_length_checks, strict_length_checks_enabled
from gemcompile.lowering.jagged_attention.reference import reference_forward

ops = torch.ops.gemcompile


# ---------------------------------------------------------------------------------------------------
# A direct float64 computation: per batch, slice the valid block and run a plain softmax.


def direct_attention(q, k, v, q_lengths, kv_lengths, bias, causal, scale):
    """Differentiable float64 oracle, written independently of the reference (slicing, not masking)."""
    B, H, Lk, D = k.shape
    Lq = q.shape[2]
    full_bias = None if bias is None else bias.expand(B, H, Lq, Lk)
    rows = []
    for b in range(B):
        qb = q[b if q.shape[0] > 1 else 0]
        ql = Lq if q_lengths is None else min(max(int(q_lengths[b]), 0), Lq)
        kl = min(max(int(kv_lengths[b]), 0), Lk)
        if ql == 0 or kl == 0:
            rows.append(q.new_zeros(H, Lq, D))
            continue
        s = scale * qb[:, :ql] @ k[b, :, :kl].transpose(-1, -2)
        if full_bias is not None:
            s = s + full_bias[b, :, :ql, :kl]
        if causal:
            s = s.masked_fill(torch.ones(ql, kl, dtype=torch.bool).triu(1), float("-inf"))
        o = torch.softmax(s, dim=-1) @ v[b, :, :kl]
        rows.append(F.pad(o, (0, 0, 0, Lq - ql)))
    return torch.stack(rows)


def make_case(
    B, H, Lq, Lk, D, dtype=torch.float64, Bq=None, bias_shape=None, q_lengths=True, seed=0, lengths=None
):
    g = torch.Generator().manual_seed(seed)
    Bq = B if Bq is None else Bq
    q = torch.randn(Bq, H, Lq, D, generator=g).to(dtype)
    k = torch.randn(B, H, Lk, D, generator=g).to(dtype)
    v = torch.randn(B, H, Lk, D, generator=g).to(dtype)
    if lengths is None:
        special_q, special_k = [0, 1, Lq, max(1, Lq // 2) | 1], [Lk, 0, 1, max(1, Lk // 3) | 1]
        ql = torch.tensor(
            [
                special_q[i % 4] if i < 4 else int(torch.randint(0, Lq + 1, (1,), generator=g))
                for i in range(B)
            ]
        )
        kl = torch.tensor(
            [
                special_k[i % 4] if i < 4 else int(torch.randint(0, Lk + 1, (1,), generator=g))
                for i in range(B)
            ]
        )
    else:
        ql, kl = (torch.tensor(x) for x in lengths)
    bias = None if bias_shape is None else torch.randn(bias_shape, generator=g).to(dtype)
    return q, k, v, (ql if q_lengths else None), kl, bias


def grads_of(fn, inputs, grad_out):
    leaves = [x.detach().requires_grad_(True) if x is not None else None for x in inputs]
    out = fn(*leaves)
    out.backward(grad_out)
    return out.detach(), [None if x is None else x.grad for x in leaves]


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


BIAS_SHAPES = {
    "none": lambda B, H, Lq, Lk: None,
    "full": lambda B, H, Lq, Lk: (B, H, Lq, Lk),
    "heads_keys": lambda B, H, Lq, Lk: (1, H, 1, Lk),
    "batch_rows": lambda B, H, Lq, Lk: (B, 1, Lq, 1),
    "scalar": lambda B, H, Lq, Lk: (1, 1, 1, 1),
}
SHAPES = [  # B, H, Lq, Lk, D
    (4, 2, 9, 9, 16),
    (5, 3, 7, 13, 24),
    (3, 1, 16, 5, 32),
    (6, 2, 1, 11, 16),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("bias_kind", list(BIAS_SHAPES))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shared_q", [False, True])
def test_forward_backward_match_direct_float64(shape, bias_kind, causal, shared_q):
    B, H, Lq, Lk, D = shape
    q, k, v, ql, kl, bias = make_case(
        B,
        H,
        Lq,
        Lk,
        D,
        Bq=1 if shared_q else B,
        bias_shape=BIAS_SHAPES[bias_kind](B, H, Lq, Lk),
        seed=B * Lq + Lk,
    )
    scale = 1 / math.sqrt(D)
    grad_out = torch.randn(B, H, Lq, D, dtype=torch.float64)

    def ours(q, k, v, bias):
        return ops.jagged_attention(q, k, v, ql, kl, bias, causal, scale)

    def oracle(q, k, v, bias):
        return direct_attention(q, k, v, ql, kl, bias, causal, scale)

    out, grads = grads_of(ours, (q, k, v, bias), grad_out)
    ref_out, ref_grads = grads_of(oracle, (q, k, v, bias), grad_out)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-10)
    for name, g, r in zip("q k v bias".split(), grads, ref_grads):
        if r is None:
            assert g is None
            continue
        assert g.shape == r.shape, name
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-9, msg=f"grad of {name}")


@pytest.mark.parametrize("q_lengths", [False, True])
def test_without_q_lengths_and_cross_lengths(q_lengths):
    q, k, v, ql, kl, bias = make_case(5, 2, 6, 10, 16, q_lengths=q_lengths, seed=3)
    out = ops.jagged_attention(q, k, v, ql, kl, bias, False, 0.3)
    torch.testing.assert_close(out, direct_attention(q, k, v, ql, kl, bias, False, 0.3))


@pytest.mark.parametrize(
    "dtype,tol", [(torch.float32, 2e-6), (torch.float16, 2e-3), (torch.bfloat16, 1.5e-2)]
)
@pytest.mark.parametrize("causal", [False, True])
def test_low_precision_dtypes(dtype, tol, causal):
    q, k, v, ql, kl, bias = make_case(6, 2, 17, 17, 32, dtype=dtype, bias_shape=(1, 2, 17, 17), seed=7)
    grad_out = torch.randn(6, 2, 17, 32).to(dtype)
    out, grads = grads_of(
        lambda q, k, v, b: ops.jagged_attention(q, k, v, ql, kl, b, causal, 0.2), (q, k, v, bias), grad_out
    )
    ref, ref_grads = grads_of(
        lambda q, k, v, b: direct_attention(q, k, v, ql, kl, b, causal, 0.2),
        [x.double() for x in (q, k, v, bias)],
        grad_out.double(),
    )
    assert out.dtype == dtype and out.is_contiguous()
    assert rel(out, ref) < tol
    for g, r in zip(grads, ref_grads):
        assert g.dtype == dtype
        assert rel(g, r) < 3 * tol


def test_large_scores_keep_float32_precision():
    """Scores of ~1e3 (nearly saturated rows): the float32 path stays within float32 rounding of the float64
    answer. Normalizing the forward as exp(s - lse) lost the low bits of s, and the backward's
    delta = dO . out took that error into dq and dk (~50x the error of torch's own fused CPU attention)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 8, 16, generator=g) * 15 for _ in range(3))
    lengths = torch.full((2,), 8)
    grad_out = torch.randn(2, 2, 8, 16, generator=g)
    out, grads = grads_of(lambda q, k, v: ops.jagged_attention(q, k, v, lengths, lengths, None, False, 0.25),
                          (q, k, v), grad_out)
    ref, ref_grads = grads_of(lambda q, k, v: direct_attention(q, k, v, lengths, lengths, None, False, 0.25),
                              [x.double() for x in (q, k, v)], grad_out.double())
    assert float((q @ k.transpose(-1, -2)).abs().max()) * 0.25 > 500
    assert rel(out, ref) < 1e-5
    for g_, r in zip(grads, ref_grads):
        assert rel(g_, r) < 1e-4, rel(g_, r)


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
    for causal in (False, True):
        out, grads = grads_of(
            lambda q, k, v, b: ops.jagged_attention(q, k, v, ql, kl, b, causal, 0.25),
            (q, k, v, bias),
            grad_out,
        )
        ref, _ = grads_of(
            lambda q, k, v, b: ops.jagged_attention(q, k, v, ql, kl, b, causal, 0.25),
            clean,
            torch.nan_to_num(grad_out),
        )
        assert not out.isnan().any() and all(not g.isnan().any() for g in grads)
        torch.testing.assert_close(out, ref)
        invalid_rows = q_pad | (kl == 0)[:, None]
        assert (
            out[invalid_rows.nonzero(as_tuple=True)[0], :, invalid_rows.nonzero(as_tuple=True)[1]] == 0
        ).all()
        assert (grads[0].transpose(1, 2)[q_pad] == 0).all()  # dq at padded query rows
        assert (grads[1].transpose(1, 2)[k_pad] == 0).all()  # dk at padded keys
        assert (grads[2].transpose(1, 2)[k_pad] == 0).all()  # dv at padded keys
        assert (
            grads[3][~(~q_pad[:, None, :, None] & ~k_pad[:, None, None, :]).expand_as(grads[3])] == 0
        ).all()


def test_lse_is_logsumexp_of_valid_scores_and_inf_on_empty_rows():
    q, k, v, ql, kl, bias = make_case(4, 2, 6, 6, 16, seed=5, lengths=([6, 6, 2, 6], [6, 0, 3, 1]))
    _, lse = ops.jagged_attention_fwd(q, k, v, ql, kl, None, True, 0.5)
    assert lse.dtype == torch.float64 and lse.shape == (4, 2, 6)
    s = 0.5 * q[0] @ k[0].transpose(-1, -2)
    s = s.masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(lse[0], torch.logsumexp(s, -1))
    assert torch.isposinf(lse[1]).all()  # no keys
    assert torch.isposinf(lse[2, :, 2:]).all() and torch.isfinite(lse[2, :, :2]).all()  # padded query rows
    _, lse32 = ops.jagged_attention_fwd(q.float(), k.float(), v.float(), ql, kl, None, True, 0.5)
    assert lse32.dtype == torch.float32


def test_strided_and_expanded_views_are_read_in_place():
    B, L, H, D = 3, 10, 2, 16
    x = torch.randn(B, L, 3, H, D, dtype=torch.float64)
    q, k, v = (t.transpose(1, 2) for t in x.unbind(2))  # permuted (B, L, H, D) views
    shared = torch.randn(1, H, 4, D, dtype=torch.float64).expand(B, H, 4, D)  # expanded learned queries
    kl = torch.tensor([10, 3, 0])
    for qq in (q, shared):
        out = ops.jagged_attention(qq, k, v, None, kl, None, False, 0.25)
        torch.testing.assert_close(
            out,
            direct_attention(qq.contiguous(), k.contiguous(), v.contiguous(), None, kl, None, False, 0.25),
        )
        assert out.is_contiguous()


def test_grad_through_expanded_shared_queries():
    B, H, L, D = 3, 2, 7, 16
    base = torch.randn(1, H, 4, D, dtype=torch.float64, requires_grad=True)
    k, v = torch.randn(2, B, H, L, D, dtype=torch.float64)
    kl = torch.tensor([7, 1, 4])
    out = ops.jagged_attention(base.expand(B, H, 4, D), k, v, None, kl, None, False, 0.3)
    out.square().sum().backward()
    ref_base = base.detach().clone().requires_grad_(True)
    direct_attention(ref_base, k, v, None, kl, None, False, 0.3).square().sum().backward()
    torch.testing.assert_close(base.grad, ref_base.grad)


def test_lengths_int32_and_int64_agree():
    q, k, v, ql, kl, _ = make_case(4, 2, 8, 8, 16, seed=2)
    a = ops.jagged_attention(q, k, v, ql, kl, None, True, 0.2)
    b = ops.jagged_attention(q, k, v, ql.int(), kl.int(), None, True, 0.2)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_python_wrapper_default_scale():
    from gemcompile.lowering.jagged_attention.op import jagged_attention

    q, k, v, ql, kl, _ = make_case(2, 2, 5, 5, 16, seed=9)
    torch.testing.assert_close(
        jagged_attention(q, k, v, ql, kl), ops.jagged_attention(q, k, v, ql, kl, None, False, 0.25)
    )


# ---------------------------------------------------------------------------------------------------
# opcheck for every op


def _opcheck_cases():
    q, k, v, ql, kl, bias = make_case(3, 2, 6, 7, 16, bias_shape=(1, 2, 6, 7), seed=4)
    bias.requires_grad_(True)
    qr, kr, vr = (x.clone().requires_grad_(True) for x in (q, k, v))
    out, lse = ops.jagged_attention_fwd(q, k, v, ql, kl, bias.detach(), True, 0.3)
    g = torch.randn_like(out)
    return [
        ("fwd", ops.jagged_attention_fwd.default, (qr, kr, vr, ql, kl, bias, True, 0.3)),
        ("fwd_shared_q", ops.jagged_attention_fwd.default, (qr[:1], kr, vr, None, kl, None, False, 0.3)),
        (
            "bwd",
            ops.jagged_attention_bwd.default,
            (g, q, k, v, out, lse, ql, kl, bias.detach(), True, 0.3, True),
        ),
        (
            "bwd_no_bias",
            ops.jagged_attention_bwd.default,
            (g, q, k, v, out, lse, ql, kl, None, True, 0.3, False),
        ),
        ("public", ops.jagged_attention.default, (qr, kr, vr, ql, kl, bias, False, 0.3)),
    ]


@pytest.mark.parametrize("case", _opcheck_cases(), ids=lambda c: c[0])
def test_opcheck(case):
    _, op, args = case
    result = torch.library.opcheck(op, args)
    assert all(v == "SUCCESS" for v in result.values()), result


def test_gradcheck_float64():
    q, k, v, ql, kl, bias = make_case(3, 1, 5, 6, 16, bias_shape=(3, 1, 1, 6), seed=8)
    inputs = [x.requires_grad_(True) for x in (q, k, v, bias)]
    assert torch.autograd.gradcheck(
        lambda q, k, v, b: ops.jagged_attention(q, k, v, ql, kl, b, True, 0.4), inputs, fast_mode=True
    )


def test_eager_function_matches_the_ops_and_gradchecks():
    """The eager fast path (one autograd.Function, taken for plain CUDA tensors) computes what the custom
    ops compute; run here on CPU, where it uses the reference."""
    from gemcompile.lowering.common.opkit import takes_eager_path
    from gemcompile.lowering.jagged_attention.op import EagerJaggedAttention

    assert not takes_eager_path(torch.zeros(1))  # CPU tensors go through the ops
    q, k, v, ql, kl, bias = make_case(4, 2, 7, 9, 16, bias_shape=(1, 2, 7, 9), seed=21)
    g = torch.randn(4, 2, 7, 16, dtype=torch.float64)
    out_fn, grads_fn = grads_of(
        lambda q, k, v, b: EagerJaggedAttention.apply(q, k, v, ql, kl, b, True, 0.3), (q, k, v, bias), g
    )
    out_op, grads_op = grads_of(
        lambda q, k, v, b: ops.jagged_attention_fwd(q, k, v, ql, kl, b, True, 0.3)[0], (q, k, v, bias), g
    )
    torch.testing.assert_close(out_fn, out_op, rtol=0, atol=0)
    for a, b in zip(grads_fn, grads_op):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    inputs = [x.detach().requires_grad_(True) for x in (q, k, v, bias)]
    assert torch.autograd.gradcheck(
        lambda q, k, v, b: EagerJaggedAttention.apply(q, k, v, ql, kl, b, False, 0.3), inputs, fast_mode=True
    )


# ---------------------------------------------------------------------------------------------------
# Input checks


def _good():
    q, k, v, ql, kl, bias = make_case(3, 2, 5, 6, 16, dtype=torch.float32, bias_shape=(1, 2, 5, 6), seed=1)
    return dict(q=q, k=k, v=v, q_lengths=ql, kv_lengths=kl, bias=bias, causal=False, scale=0.25)


def _call(**kw):
    return ops.jagged_attention(
        kw["q"], kw["k"], kw["v"], kw["q_lengths"], kw["kv_lengths"], kw["bias"], kw["causal"], kw["scale"]
    )


BAD_INPUTS = [
    ("k dtype", lambda a: a.update(k=a["k"].half()), TypeError, "one dtype"),
    (
        "integer q",
        lambda a: a.update(q=a["q"].long(), k=a["k"].long(), v=a["v"].long()),
        TypeError,
        "q must be",
    ),
    ("q rank", lambda a: a.update(q=a["q"][0]), ValueError, "q must be 4-D"),
    ("v rank", lambda a: a.update(v=a["v"][..., None]), ValueError, "v must be 4-D"),
    ("batch", lambda a: a.update(q=a["q"][:2]), ValueError, "batch size"),
    ("heads", lambda a: a.update(q=a["q"][:, :1]), ValueError, "heads"),
    ("k v shape", lambda a: a.update(v=a["v"][:, :, :3]), ValueError, "k and v"),
    ("head dim small", lambda a: a.update(**{n: a[n][..., :8] for n in "qkv"}), ValueError, "head dim 8"),
    (
        "head dim big",
        lambda a: a.update(**{n: a[n].repeat(1, 1, 1, 9) for n in "qkv"}),
        ValueError,
        "head dim 144",
    ),
    ("head dim mismatch", lambda a: a.update(q=a["q"][..., :15]), ValueError, "head dim"),
    ("bias shape", lambda a: a.update(bias=torch.zeros(1, 2, 5, 4)), ValueError, "bias must be 4-D"),
    ("bias rank", lambda a: a.update(bias=torch.zeros(5, 6)), ValueError, "bias"),
    ("bias dtype", lambda a: a.update(bias=torch.zeros(1, 2, 5, 6, dtype=torch.long)), TypeError, "bias"),
    ("kv_lengths float", lambda a: a.update(kv_lengths=a["kv_lengths"].float()), TypeError, "kv_lengths"),
    ("kv_lengths size", lambda a: a.update(kv_lengths=a["kv_lengths"][:2]), ValueError, "kv_lengths"),
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
    ("device", lambda a: a.update(kv_lengths=a["kv_lengths"].to("meta")), ValueError, "device"),
    ("k device", lambda a: a.update(k=a["k"].to("meta")), ValueError, "one device"),
    ("bias device", lambda a: a.update(bias=a["bias"].to("meta")), ValueError, "bias is on meta"),
]


@pytest.mark.parametrize("case", BAD_INPUTS, ids=lambda c: c[0])
def test_bad_inputs_raise_clear_errors(case):
    _, mutate, exc, match = case
    args = _good()
    _call(**args)  # the good call works
    mutate(args)
    with pytest.raises(exc, match=match):
        _call(**args)


def test_strict_length_checks_switch():
    assert strict_length_checks_enabled() is False
    with strict_length_checks(True):
        assert strict_length_checks_enabled() is True
        with strict_length_checks(False):
            assert strict_length_checks_enabled() is False
        assert strict_length_checks_enabled() is True
    assert strict_length_checks_enabled() is False
    strict_length_checks(True)
    try:
        assert strict_length_checks_enabled() is True
    finally:
        strict_length_checks(False)
    with pytest.raises(TypeError):
        strict_length_checks("yes")


def test_fake_tensors_skip_value_checks_and_give_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k, v = torch.randn(1, 2, 4, 16), torch.randn(3, 2, 6, 16), torch.randn(3, 2, 6, 16)
        kl = torch.full((3,), 99)  # a fake tensor has no values: nothing to check
        out, lse = ops.jagged_attention_fwd(q, k, v, None, kl, None, False, 0.1)
    assert out.shape == (3, 2, 4, 16) and lse.shape == (3, 2, 4) and lse.dtype == torch.float32


# ---------------------------------------------------------------------------------------------------
# FLOPs and torch.compile


@pytest.mark.parametrize("causal", [False, True])
def test_flop_counter_counts_useful_pairs(causal):
    B, H, L, D = 3, 2, 8, 16
    q, k, v, _, _, _ = make_case(B, H, L, L, D, seed=6)
    ql, kl = torch.tensor([8, 3, 0]), torch.tensor([5, 8, 4])
    if causal:  # rows i < a see min(i + 1, c) keys
        pairs = sum(sum(min(i + 1, c) for i in range(a)) for a, c in zip(ql.tolist(), kl.tolist()))
    else:
        pairs = int((ql * kl).sum())
    q.requires_grad_(True)
    with FlopCounterMode(display=False) as counter:
        ops.jagged_attention(q, k, v, ql, kl, None, causal, 0.25).sum().backward()
    counts = {str(k_): v_ for k_, v_ in counter.get_flop_counts()["Global"].items()}
    assert counts["gemcompile.jagged_attention_fwd"] == 4 * H * D * pairs
    assert counts["gemcompile.jagged_attention_bwd"] == 10 * H * D * pairs


def test_flop_counter_falls_back_to_padded_count_on_fake_lengths():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k, v = (torch.randn(2, 2, 8, 16) for _ in range(3))
        kl = torch.zeros(2, dtype=torch.long)
        with FlopCounterMode(display=False) as counter:
            ops.jagged_attention(q, k, v, None, kl, None, False, 0.25)
    assert counter.get_total_flops() == 4 * 2 * 16 * (2 * 8 * 8)


def test_compile_fullgraph_no_recompile_over_lengths():
    B, H, L, D = 3, 2, 8, 16
    q, k, v, _, _, bias = make_case(B, H, L, L, D, dtype=torch.float32, bias_shape=(1, H, L, L), seed=10)
    leaves = [x.requires_grad_(True) for x in (q, k, v, bias)]

    def f(q, k, v, bias, ql, kl):
        return ops.jagged_attention(q, k, v, ql, kl, bias, True, 0.25).square().sum()

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed in range(3):
            g = torch.Generator().manual_seed(seed)
            ql, kl = torch.randint(0, L + 1, (B,), generator=g), torch.randint(0, L + 1, (B,), generator=g)
            got = torch.autograd.grad(compiled(*leaves, ql, kl), leaves)
            want = torch.autograd.grad(f(*leaves, ql, kl), leaves)
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b)


def test_reference_forward_is_exposed_for_peers():
    q, k, v, ql, kl, _ = make_case(2, 1, 4, 4, 16, seed=0)
    out, lse = reference_forward(q, k, v, ql, kl, None, False, 0.5)
    torch.testing.assert_close(out, direct_attention(q, k, v, ql, kl, None, False, 0.5))


@pytest.mark.parametrize("trailing", [0, 2, 5])
def test_cuda_backward_registration_takes_partial_argument_lists(trailing):
    """The CUDA kernel of jagged_attention_bwd is called with the trailing optional arguments left out
    (autograd, FlopCounterMode): it must bind them by name, as the op's schema does (run here on CPU
    tensors, which its launcher choice sends to the reference)."""
    from gemcompile.lowering.jagged_attention.op import _jagged_attention_bwd_cuda

    _, _, args = _opcheck_cases()[2]
    g, q, k, v, out, lse, ql, kl, bias, causal, scale, bias_grad = args
    extra = (None, None, None, None, None)[:trailing]
    got = _jagged_attention_bwd_cuda(*args, *extra)
    want = ops.jagged_attention_bwd(*args)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
