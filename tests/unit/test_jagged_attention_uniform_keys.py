"""gemcompile::jagged_attention with uniform_keys on CPU (the reference path): every score of a flagged
sequence (bias included) is taken as 0, so rows are uniform over their valid keys, while the backward still
uses the usual formulas with the real q and k. Checked against an independent float64 autograd oracle
(value 0, derivative 1 with respect to the scores), against the eager "huge finite fill" computation the
pass replaces, opcheck, schemas and input errors."""

import pytest
import torch

import gemcompile.lowering  # noqa: F401  (registers the ops)
from gemcompile.lowering.jagged_attention.op import EagerJaggedAttention, jagged_attention
from test_jagged_attention_kv_mask import grads_of, make_case, make_kv_mask

ops = torch.ops.gemcompile


def oracle(q, k, v, q_lengths, kv_lengths, kv_mask, bias, causal, scale, uniform):
    """Plain float64 autograd: s_used = s - s.detach() (value 0, gradient 1) where uniform; softmax over the
    valid (i, j); rows without a valid key are 0."""
    B, H, Lk, _ = k.shape
    Lq = q.shape[2]
    s = scale * q.expand(B, H, Lq, -1) @ k.transpose(-1, -2)
    if bias is not None:
        s = s + bias
    s = torch.where(uniform[:, None, None, None], s - s.detach(), s)
    rows, cols = torch.arange(Lq), torch.arange(Lk)
    ql = torch.full((B,), Lq) if q_lengths is None else q_lengths
    kl = torch.full((B,), Lk) if kv_lengths is None else kv_lengths
    keys = cols[None, :] < kl[:, None]
    if kv_mask is not None:
        keys = keys & kv_mask
    ok = (rows[None, :] < ql[:, None])[:, None, :, None] & keys[:, None, None, :]
    if causal:
        ok = ok & (cols[None, :] <= rows[:, None])
    any_ok = ok.any(dim=-1, keepdim=True)
    s = torch.where(any_ok, s.masked_fill(~ok, float("-inf")), torch.zeros_like(s))
    return (torch.softmax(s, dim=-1) * any_ok) @ v


FEATURES = {  # q_lengths, kv_lengths, bias shape, shared q
    "plain": (False, False, None, False),
    "lengths_bias": (True, True, "full", False),
    "sharedq_keybias": (True, False, "heads_keys", True),
}


@pytest.mark.parametrize("features", list(FEATURES))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("kind", [None, "holes", "left_pad", "empty_row"])
def test_matches_float64_oracle(kind, causal, features):
    B, H, Lq, Lk, D = 4, 2, 9, 11, 16
    with_ql, with_kl, bias_kind, shared_q = FEATURES[features]
    bias_shape = {None: None, "full": (B, H, Lq, Lk), "heads_keys": (1, H, 1, Lk)}[bias_kind]
    q, k, v, ql, kl, mask, bias = make_case(B, H, Lq, Lk, D, kind or "all_true", q_lengths=with_ql,
                                            kv_lengths=with_kl, bias_shape=bias_shape,
                                            Bq=1 if shared_q else None, seed=3)
    mask = mask if kind else None
    uniform = torch.tensor([True, False, True, True])
    grad_out = torch.randn(B, H, Lq, D, dtype=torch.float64)
    out, grads = grads_of(
        lambda q, k, v, b: ops.jagged_attention(q, k, v, ql, kl, b, causal, 0.3, mask, uniform), (q, k, v, bias),
        grad_out)
    ref, ref_grads = grads_of(lambda q, k, v, b: oracle(q, k, v, ql, kl, mask, b, causal, 0.3, uniform),
                              (q, k, v, bias), grad_out)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    for name, g, r in zip("q k v bias".split(), grads, ref_grads):
        if r is None:
            assert g is None
            continue
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-9, msg=f"grad of {name}")
    # a flagged sequence's real scores still move dq and dk (derivative 1 through the dropped scores)
    assert grads[0].abs().sum() > 0 and grads[1][0].abs().sum() > 0


def test_matches_eager_huge_finite_fill():
    """What the pass replaces: softmax(s + F) with F = -1e30 on padding keys, a sequence of all padding
    keys becomes uniform over every key with gradients through s; its keys are then all valid here."""
    B, H, L, D = 3, 2, 8, 16
    q, k, v, _, _, _, bias = make_case(B, H, L, L, D, "all_true", q_lengths=False, kv_lengths=False,
                                       bias_shape=(B, H, L, L), seed=9)
    pad = ~make_kv_mask("right_pad", B, L, 2)
    pad[1] = True  # all padding
    fill = torch.where(pad, -1e30, 0.0).double()[:, None, None, :]

    def eager(q, k, v, b):
        return torch.softmax(0.25 * q @ k.transpose(-1, -2) + b + fill, dim=-1) @ v

    uniform = pad.all(dim=1)
    mask = ~pad | uniform[:, None]
    g = torch.randn(B, H, L, D, dtype=torch.float64)
    out, grads = grads_of(
        lambda q, k, v, b: ops.jagged_attention(q, k, v, None, None, b, False, 0.25, mask, uniform),
        (q, k, v, bias), g)
    ref, ref_grads = grads_of(eager, (q, k, v, bias), g)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_all_false_equals_none_and_wrappers():
    q, k, v, ql, kl, mask, bias = make_case(3, 2, 5, 7, 16, "holes", bias_shape=(1, 2, 5, 7), seed=2)
    off = torch.zeros(3, dtype=torch.bool)
    torch.testing.assert_close(ops.jagged_attention(q, k, v, ql, kl, bias, True, 0.3, mask, off),
                               ops.jagged_attention(q, k, v, ql, kl, bias, True, 0.3, mask), rtol=0, atol=0)
    uniform = torch.tensor([True, False, True])
    want = ops.jagged_attention(q, k, v, ql, None, None, False, 0.25, None, uniform)
    torch.testing.assert_close(jagged_attention(q, k, v, ql, uniform_keys=uniform), want, rtol=0, atol=0)
    g = torch.randn(3, 2, 5, 16, dtype=torch.float64)
    out_fn, grads_fn = grads_of(
        lambda q, k, v, b: EagerJaggedAttention.apply(q, k, v, ql, kl, b, True, 0.3, mask, uniform),
        (q, k, v, bias), g)
    out_op, grads_op = grads_of(
        lambda q, k, v, b: ops.jagged_attention_fwd(q, k, v, ql, kl, b, True, 0.3, mask, uniform)[0],
        (q, k, v, bias), g)
    torch.testing.assert_close(out_fn, out_op, rtol=0, atol=0)
    for a, b in zip(grads_fn, grads_op):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _opcheck_cases():
    q, k, v, ql, kl, mask, bias = make_case(3, 2, 6, 7, 16, "holes", bias_shape=(1, 2, 6, 7), seed=4)
    bias.requires_grad_(True)
    qr, kr, vr = (x.clone().requires_grad_(True) for x in (q, k, v))
    uniform = torch.tensor([True, False, True])
    out, lse = ops.jagged_attention_fwd(q, k, v, ql, kl, bias.detach(), True, 0.3, mask, uniform)
    g = torch.randn_like(out)
    fwd, bwd, public = ops.jagged_attention_fwd.default, ops.jagged_attention_bwd.default, ops.jagged_attention.default
    return [
        ("fwd", fwd, (qr, kr, vr, ql, kl, bias, True, 0.3, mask, uniform)),
        ("fwd_no_mask", fwd, (qr, kr, vr, None, None, None, False, 0.3, None, uniform)),
        ("bwd", bwd, (g, q, k, v, out, lse, ql, kl, bias.detach(), True, 0.3, True, mask, uniform)),
        ("public", public, (qr, kr, vr, ql, kl, bias, False, 0.3, mask, uniform)),
    ]


@pytest.mark.parametrize("case", _opcheck_cases(), ids=lambda c: c[0])
def test_opcheck(case):
    _, op, args = case
    result = torch.library.opcheck(op, args)
    assert all(v == "SUCCESS" for v in result.values()), result


def test_schemas():
    for op in (ops.jagged_attention, ops.jagged_attention_fwd, ops.jagged_attention_bwd):
        assert "Tensor? kv_mask=None, Tensor? uniform_keys=None, Tensor? q_order=None" in str(op.default._schema)


BAD = [
    ("dtype", lambda B: torch.ones(B, dtype=torch.uint8), "torch.bool"),
    ("shape", lambda B: torch.ones(B + 1, dtype=torch.bool), "shape"),
    ("rank", lambda B: torch.ones(B, 1, dtype=torch.bool), "shape"),
    ("device", lambda B: torch.ones(B, dtype=torch.bool, device="meta"), "meta"),
]


@pytest.mark.parametrize("case", BAD, ids=lambda c: c[0])
def test_bad_uniform_keys_raise_value_error(case):
    _, make, match = case
    q, k, v, ql, kl, _, _ = make_case(3, 2, 5, 6, 16, "all_true", dtype=torch.float32)
    with pytest.raises(ValueError, match=f"uniform_keys.*{match}"):
        ops.jagged_attention(q, k, v, ql, kl, None, False, 0.25, None, make(3))
    with pytest.raises(ValueError, match="uniform_keys"):
        jagged_attention(q, k, v, ql, uniform_keys=make(3))


def test_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k, v = torch.randn(1, 2, 4, 16), torch.randn(3, 2, 6, 16), torch.randn(3, 2, 6, 16)
        out, _ = ops.jagged_attention_fwd(q, k, v, None, None, None, False, 0.1, None, torch.ones(3).bool())
        assert out.shape == (3, 2, 4, 16)
        with pytest.raises(ValueError, match="uniform_keys"):
            ops.jagged_attention_fwd(q, k, v, None, None, None, False, 0.1, None, torch.ones(2).bool())
