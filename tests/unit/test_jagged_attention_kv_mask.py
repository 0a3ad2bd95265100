"""gemcompile::jagged_attention with a kv_mask (and kv_lengths None) on CPU, the reference path: forward and
backward against a direct float64 computation (index selection of the valid keys, not masking), opcheck,
input errors, FLOP counting and torch.compile."""

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import gemcompile.lowering  # noqa: F401  (registers the ops)
from gemcompile.lowering.jagged_attention.reference import valid_mask

ops = torch.ops.gemcompile

MASK_KINDS = ["holes", "left_pad", "right_pad", "window", "empty_row", "all_true", "expanded"]


def make_kv_mask(kind, B, Lk, seed=0):
    """(B, Lk) bool; "left_pad": a valid suffix per row, "right_pad": a valid prefix, "window": one
    contiguous run per row (no holes; unaligned ends), "expanded": one (1, Lk) row expanded to (B, Lk)
    (batch stride 0)."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.arange(Lk)
    if kind == "holes":
        return torch.rand(B, Lk, generator=g) < 0.6
    if kind == "empty_row":
        m = torch.rand(B, Lk, generator=g) < 0.6
        m[1] = False
        return m
    if kind == "all_true":
        return torch.ones(B, Lk, dtype=torch.bool)
    if kind == "expanded":
        return (torch.rand(1, Lk, generator=g) < 0.6).expand(B, Lk)
    if kind == "window":
        starts = torch.randint(0, Lk, (B,), generator=g)
        ends = starts + 1 + torch.randint(0, Lk, (B,), generator=g)
        starts[: min(B, 3)] = torch.tensor([1, Lk // 3, Lk - 1])[: min(B, 3)]
        ends[: min(B, 3)] = torch.tensor([Lk - 2, Lk // 3 + 1, Lk])[: min(B, 3)]
        return (pos[None, :] >= starts[:, None]) & (pos[None, :] < ends[:, None])
    edges = torch.randint(0, Lk + 1, (B,), generator=g)
    edges[: min(B, 3)] = torch.tensor([0, Lk // 2, Lk - 1])[: min(B, 3)]
    if kind == "left_pad":
        return pos[None, :] >= edges[:, None]
    assert kind == "right_pad"
    return pos[None, :] < edges[:, None]


def direct_masked_attention(q, k, v, q_lengths, kv_lengths, kv_mask, bias, causal, scale):
    """Differentiable float64 oracle: per batch, gather the valid keys (absolute positions kept for causal)
    and run a plain softmax; rows without a valid key are 0."""
    B, H, Lk, D = k.shape
    Lq = q.shape[2]
    full_bias = None if bias is None else bias.expand(B, H, Lq, Lk)
    outs = []
    for b in range(B):
        qb = q[b if q.shape[0] > 1 else 0]
        ql = Lq if q_lengths is None else min(max(int(q_lengths[b]), 0), Lq)
        kl = Lk if kv_lengths is None else min(max(int(kv_lengths[b]), 0), Lk)
        keys = [j for j in range(kl) if kv_mask is None or bool(kv_mask[b, j])]
        if ql == 0 or not keys:
            outs.append(q.new_zeros(H, Lq, D))
            continue
        idx = torch.tensor(keys)
        s = scale * qb[:, :ql] @ k[b][:, idx].transpose(-1, -2)
        if full_bias is not None:
            s = s + full_bias[b][:, :ql][:, :, idx]
        ok = torch.ones(ql, len(keys), dtype=torch.bool)
        if causal:
            ok = idx[None, :] <= torch.arange(ql)[:, None]
        any_ok = ok.any(dim=1, keepdim=True)
        s = torch.where(any_ok, s.masked_fill(~ok, float("-inf")), torch.zeros_like(s))
        p = torch.softmax(s, dim=-1) * any_ok
        o = p @ v[b][:, idx]
        outs.append(torch.cat([o, o.new_zeros(H, Lq - ql, D)], dim=1))
    return torch.stack(outs)


def make_case(B, H, Lq, Lk, D, kind, *, q_lengths=True, kv_lengths=True, bias_shape=None, Bq=None, seed=0,
              dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B if Bq is None else Bq, H, Lq, D, generator=g).to(dtype)
    k = torch.randn(B, H, Lk, D, generator=g).to(dtype)
    v = torch.randn(B, H, Lk, D, generator=g).to(dtype)
    ql = torch.randint(0, Lq + 1, (B,), generator=g) if q_lengths else None
    if ql is not None:
        ql[0] = Lq
    kl = torch.randint(Lk // 2, Lk + 1, (B,), generator=g) if kv_lengths else None
    bias = None if bias_shape is None else torch.randn(bias_shape, generator=g).to(dtype)
    return q, k, v, ql, kl, make_kv_mask(kind, B, Lk, seed + 1), bias


def grads_of(fn, inputs, grad_out):
    leaves = [x.detach().requires_grad_(True) if x is not None else None for x in inputs]
    out = fn(*leaves)
    out.backward(grad_out)
    return out.detach(), [None if x is None else x.grad for x in leaves]


FEATURES = {  # q_lengths, bias shape, shared q
    "plain": (False, None, False),
    "qlen_bias": (True, "full", False),
    "sharedq_keybias": (True, "heads_keys", True),
}


@pytest.mark.parametrize("features", list(FEATURES))
@pytest.mark.parametrize("with_kv_lengths", [True, False], ids=["kv_lengths", "no_kv_lengths"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("kind", MASK_KINDS)
def test_forward_backward_match_direct_float64(kind, causal, with_kv_lengths, features):
    B, H, Lq, Lk, D = 4, 2, 9, 11, 16
    with_ql, bias_kind, shared_q = FEATURES[features]
    bias_shape = {None: None, "full": (B, H, Lq, Lk), "heads_keys": (1, H, 1, Lk)}[bias_kind]
    q, k, v, ql, kl, mask, bias = make_case(B, H, Lq, Lk, D, kind, q_lengths=with_ql,
                                            kv_lengths=with_kv_lengths, bias_shape=bias_shape,
                                            Bq=1 if shared_q else None, seed=len(kind))
    scale = 1 / math.sqrt(D)
    grad_out = torch.randn(B, H, Lq, D, dtype=torch.float64)
    out, grads = grads_of(lambda q, k, v, b: ops.jagged_attention(q, k, v, ql, kl, b, causal, scale, mask),
                          (q, k, v, bias), grad_out)
    ref, ref_grads = grads_of(
        lambda q, k, v, b: direct_masked_attention(q, k, v, ql, kl, mask, b, causal, scale), (q, k, v, bias),
        grad_out)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    for name, g, r in zip("q k v bias".split(), grads, ref_grads):
        if r is None:
            assert g is None
            continue
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-9, msg=f"grad of {name}")
    # keys that are not valid get exactly zero dK and dV
    kl_eff = torch.full((B,), Lk) if kl is None else kl
    bad_keys = ~(mask & (torch.arange(Lk)[None, :] < kl_eff[:, None]))
    assert (grads[1].transpose(1, 2)[bad_keys] == 0).all()
    assert (grads[2].transpose(1, 2)[bad_keys] == 0).all()


def test_empty_row_and_all_false_mask_give_zeros():
    q, k, v, ql, kl, mask, _ = make_case(3, 2, 6, 8, 16, "empty_row", q_lengths=False)
    out, lse = ops.jagged_attention_fwd(q, k, v, None, kl, None, True, 0.3, mask)
    assert (out[1] == 0).all() and torch.isposinf(lse[1]).all()
    none = torch.zeros(3, 8, dtype=torch.bool)
    out, grads = grads_of(lambda q, k, v: ops.jagged_attention(q, k, v, None, None, None, False, 0.3, none),
                          (q, k, v), torch.randn(3, 2, 6, 16, dtype=torch.float64))
    assert (out == 0).all() and all((g == 0).all() for g in grads)


def test_causal_left_padding_keeps_absolute_positions():
    """With a valid suffix starting at s, causal rows i < s see no key (positions are not shifted)."""
    B, H, L, D = 2, 1, 8, 16
    q, k, v, _, _, _, _ = make_case(B, H, L, L, D, "all_true")
    mask = torch.arange(L)[None, :] >= torch.tensor([3, 0])[:, None]
    out = ops.jagged_attention(q, k, v, None, None, None, True, 0.25, mask)
    assert (out[0, :, :3] == 0).all() and (out[0, :, 3:] != 0).any()
    torch.testing.assert_close(out, direct_masked_attention(q, k, v, None, None, mask, None, True, 0.25))


def test_mask_garbage_never_leaks():
    """NaN/inf in k, v and bias at masked keys must not reach outputs or gradients."""
    B, H, L, D = 3, 2, 10, 16
    q, k, v, ql, kl, mask, bias = make_case(B, H, L, L, D, "holes", bias_shape=(B, H, L, L), seed=4)
    bad = ~mask[:, None, :, None]
    dirty = (q, k.masked_fill(bad, float("inf")), v.masked_fill(bad, float("nan")),
             bias.masked_fill(bad.transpose(2, 3), float("nan")))
    g = torch.randn(B, H, L, D, dtype=torch.float64)
    for causal in (False, True):
        def f(q, k, v, b):
            return ops.jagged_attention(q, k, v, ql, kl, b, causal, 0.25, mask)

        out, grads = grads_of(f, dirty, g)
        ref, ref_grads = grads_of(f, (q, k, v, bias), g)
        torch.testing.assert_close(out, ref)
        for a, b in zip(grads, ref_grads):
            assert not a.isnan().any()
            torch.testing.assert_close(a, b)


def test_kv_lengths_none_means_every_key():
    q, k, v, ql, _, _, bias = make_case(3, 2, 7, 9, 16, "all_true", bias_shape=(1, 2, 7, 9))
    full = torch.full((3,), 9)
    for causal in (False, True):
        torch.testing.assert_close(ops.jagged_attention(q, k, v, ql, None, bias, causal, 0.3),
                                   ops.jagged_attention(q, k, v, ql, full, bias, causal, 0.3), rtol=0, atol=0)


def test_all_true_mask_equals_no_mask():
    q, k, v, ql, kl, mask, _ = make_case(3, 2, 7, 9, 16, "all_true")
    torch.testing.assert_close(ops.jagged_attention(q, k, v, ql, kl, None, True, 0.3, mask),
                               ops.jagged_attention(q, k, v, ql, kl, None, True, 0.3), rtol=0, atol=0)


def test_python_wrapper_and_eager_function_take_kv_mask():
    from gemcompile.lowering.jagged_attention.op import EagerJaggedAttention, jagged_attention

    q, k, v, ql, kl, mask, bias = make_case(3, 2, 5, 7, 16, "holes", bias_shape=(1, 2, 5, 7), seed=2)
    want = ops.jagged_attention(q, k, v, ql, None, None, False, 0.25, mask)
    torch.testing.assert_close(jagged_attention(q, k, v, ql, kv_mask=mask), want, rtol=0, atol=0)
    g = torch.randn(3, 2, 5, 16, dtype=torch.float64)
    out_fn, grads_fn = grads_of(
        lambda q, k, v, b: EagerJaggedAttention.apply(q, k, v, ql, kl, b, True, 0.3, mask), (q, k, v, bias),
        g)
    out_op, grads_op = grads_of(
        lambda q, k, v, b: ops.jagged_attention_fwd(q, k, v, ql, kl, b, True, 0.3, mask)[0],
        (q, k, v, bias), g)
    torch.testing.assert_close(out_fn, out_op, rtol=0, atol=0)
    for a, b in zip(grads_fn, grads_op):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_gradcheck_with_kv_mask():
    q, k, v, ql, kl, mask, bias = make_case(3, 1, 5, 6, 16, "left_pad", bias_shape=(3, 1, 1, 6), seed=8)
    inputs = [x.requires_grad_(True) for x in (q, k, v, bias)]
    assert torch.autograd.gradcheck(
        lambda q, k, v, b: ops.jagged_attention(q, k, v, ql, None, b, True, 0.4, mask), inputs,
        fast_mode=True)


# ---------------------------------------------------------------------------------------------------
# opcheck


def _opcheck_cases():
    q, k, v, ql, kl, mask, bias = make_case(3, 2, 6, 7, 16, "holes", bias_shape=(1, 2, 6, 7), seed=4)
    bias.requires_grad_(True)
    qr, kr, vr = (x.clone().requires_grad_(True) for x in (q, k, v))
    out, lse = ops.jagged_attention_fwd(q, k, v, ql, kl, bias.detach(), True, 0.3, mask)
    g = torch.randn_like(out)
    expanded = make_kv_mask("expanded", 3, 7)
    fwd, bwd = ops.jagged_attention_fwd.default, ops.jagged_attention_bwd.default
    public = ops.jagged_attention.default
    return [
        ("fwd", fwd, (qr, kr, vr, ql, kl, bias, True, 0.3, mask)),
        ("fwd_no_kv_lengths", fwd, (qr, kr, vr, None, None, None, False, 0.3, mask)),
        ("fwd_expanded", fwd, (qr[:1], kr, vr, None, kl, None, True, 0.3, expanded)),
        ("bwd", bwd, (g, q, k, v, out, lse, ql, kl, bias.detach(), True, 0.3, True, mask)),
        ("public", public, (qr, kr, vr, ql, kl, bias, False, 0.3, mask)),
        ("public_no_kv_lengths", public, (qr, kr, vr, ql, None, None, True, 0.3, mask)),
        ("public_no_mask_no_lengths", public, (qr, kr, vr, None, None, None, True, 0.3)),
    ]


@pytest.mark.parametrize("case", _opcheck_cases(), ids=lambda c: c[0])
def test_opcheck(case):
    _, op, args = case
    result = torch.library.opcheck(op, args)
    assert all(v == "SUCCESS" for v in result.values()), result


def test_schemas():
    assert "Tensor? kv_lengths" in str(ops.jagged_attention.default._schema)
    for op in (ops.jagged_attention, ops.jagged_attention_fwd, ops.jagged_attention_bwd):
        schema = str(op.default._schema)
        tail = ("Tensor? kv_mask=None, Tensor? uniform_keys=None, Tensor? q_order=None, Tensor? kv_order=None, "
                "Tensor? kv_bounds=None, Tensor? token_offsets=None, SymInt packed_len=0, float dropout_p=0., "
                "Tensor? dropout_seed=None")
        assert "Tensor? kv_lengths" in schema and tail in schema, schema


# ---------------------------------------------------------------------------------------------------
# Input checks (metadata only: they run on fake tensors too)


BAD_MASKS = [
    ("dtype", lambda B, L: torch.ones(B, L, dtype=torch.uint8), "torch.bool"),
    ("shape", lambda B, L: torch.ones(B, L + 1, dtype=torch.bool), "shape"),
    ("unexpanded", lambda B, L: torch.ones(1, L, dtype=torch.bool), "shape"),
    ("rank", lambda B, L: torch.ones(B, 1, L, dtype=torch.bool), "shape"),
    ("device", lambda B, L: torch.ones(B, L, dtype=torch.bool, device="meta"), "meta"),
]


@pytest.mark.parametrize("case", BAD_MASKS, ids=lambda c: c[0])
def test_bad_kv_mask_raises_value_error(case):
    _, make, match = case
    q, k, v, ql, kl, _, _ = make_case(3, 2, 5, 6, 16, "all_true", dtype=torch.float32)
    with pytest.raises(ValueError, match=f"kv_mask.*{match}"):
        ops.jagged_attention(q, k, v, ql, kl, None, False, 0.25, make(3, 6))


def test_fake_tensors_with_kv_mask():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k, v = torch.randn(1, 2, 4, 16), torch.randn(3, 2, 6, 16), torch.randn(3, 2, 6, 16)
        out, lse = ops.jagged_attention_fwd(q, k, v, None, None, None, False, 0.1, torch.ones(3, 6).bool())
        assert out.shape == (3, 2, 4, 16) and lse.shape == (3, 2, 4)
        with pytest.raises(ValueError, match="kv_mask"):
            ops.jagged_attention_fwd(q, k, v, None, None, None, False, 0.1, torch.ones(3, 5).bool())


# ---------------------------------------------------------------------------------------------------
# FLOPs and torch.compile


@pytest.mark.parametrize("with_kv_lengths", [True, False], ids=["kv_lengths", "no_kv_lengths"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kind", ["holes", "left_pad", "empty_row"])
def test_flop_counter_counts_masked_pairs(kind, causal, with_kv_lengths):
    B, H, L, D = 4, 2, 8, 16
    q, k, v, ql, kl, mask, _ = make_case(B, H, L, L, D, kind, kv_lengths=with_kv_lengths, seed=6)
    pairs = int(valid_mask(ql, kl, B, L, L, causal, "cpu", mask).sum())
    q.requires_grad_(True)
    with FlopCounterMode(display=False) as counter:
        ops.jagged_attention(q, k, v, ql, kl, None, causal, 0.25, mask).sum().backward()
    counts = {str(k_): v_ for k_, v_ in counter.get_flop_counts()["Global"].items()}
    assert counts["gemcompile.jagged_attention_fwd"] == 4 * H * D * pairs
    assert counts["gemcompile.jagged_attention_bwd"] == 10 * H * D * pairs


def test_flop_counter_padded_count_on_fake_mask():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k, v = (torch.randn(2, 2, 8, 16) for _ in range(3))
        mask = torch.zeros(2, 8, dtype=torch.bool)
        with FlopCounterMode(display=False) as counter:
            ops.jagged_attention(q, k, v, None, None, None, False, 0.25, mask)
    assert counter.get_total_flops() == 4 * 2 * 16 * (2 * 8 * 8)


def test_compile_fullgraph_no_recompile_over_masks():
    B, H, L, D = 3, 2, 8, 16
    q, k, v, _, _, _, bias = make_case(B, H, L, L, D, "all_true", dtype=torch.float32,
                                       bias_shape=(1, H, L, L))
    leaves = [x.requires_grad_(True) for x in (q, k, v, bias)]

    def f(q, k, v, bias, mask):
        return ops.jagged_attention(q, k, v, None, None, bias, True, 0.25, mask).square().sum()

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed, kind in enumerate(["holes", "left_pad", "empty_row"]):
            mask = make_kv_mask(kind, B, L, seed)
            got = torch.autograd.grad(compiled(*leaves, mask), leaves)
            want = torch.autograd.grad(f(*leaves, mask), leaves)
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b)
