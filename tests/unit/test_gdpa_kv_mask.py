"""gemcompile::gdpa's kv_mask on CPU (the plain-PyTorch reference path): against a direct float64
computation that gathers each sample's valid keys by index (absolute positions), for masks with holes,
left and right padding, an all-False row, all-True and a (1, Lk) mask expanded to (B, Lk), with causal,
window, lengths, shared queries and a bias; gradients, padding hygiene, opcheck, input errors, FLOP
counting, the eager autograd.Function and torch.compile."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import gemcompile.lowering  # noqa: F401  (registers the ops)
from gemcompile.lowering.gdpa.op import EagerGDPA, gdpa
from gemcompile.lowering.gdpa.reference import reference_gdpa_backward, reference_gdpa_forward
from gemcompile.lowering.gdpa.spec import GDPA_ACTIVATIONS, GdpaSpec

ops = torch.ops.gemcompile

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


def direct_gdpa(q, k, v, ql, kl, bias, mask, activation, scale, out_scale, divide, causal, window):
    """Differentiable float64 oracle: per sample, the valid keys J (j < kv_len and mask[b, j]) gathered by
    index, the pair rule on absolute positions i, J[t]; the output divided by the clamped kv_len."""
    B, H, Lk, D = k.shape
    Lq = q.shape[2]
    full_bias = None if bias is None else bias.expand(B, H, Lq, Lk)
    outs = []
    for b in range(B):
        n_q, n_k = clamp_len(ql, b, Lq), clamp_len(kl, b, Lk)
        J = [j for j in range(n_k) if mask is None or bool(mask[b, j])]
        if n_q == 0 or not J:
            outs.append(q.new_zeros(H, Lq, D))
            continue
        idx = torch.tensor(J)
        qb = q[b if q.shape[0] > 1 else 0, :, :n_q]
        s = scale * qb @ k[b][:, idx].transpose(-1, -2)
        if full_bias is not None:
            s = s + full_bias[b, :, :n_q][:, :, idx]
        keep = torch.tensor([[keeps(i, j, causal, window) for j in J] for i in range(n_q)], dtype=q.dtype)
        c = out_scale / max(n_k, 1) if divide else out_scale
        o = c * (ACTS[activation](s) * keep) @ v[b][:, idx]
        outs.append(F.pad(o, (0, 0, 0, Lq - n_q)))
    return torch.stack(outs)


def make_mask(kind, B, Lk, seed=0):
    """(B, Lk) bool: 'holes' (random), 'left_pad' (a valid suffix), 'right_pad' (a valid prefix),
    'empty_row' (holes, sample 1 all False), 'all_true', 'expanded' (one random row expanded, stride 0)."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.tensor([0, Lk // 2, Lk - 1, 1, Lk, 3][:B])
    pos = torch.arange(Lk)[None, :]
    if kind == "holes":
        return torch.rand(B, Lk, generator=g) < 0.6
    if kind == "left_pad":
        return pos >= starts[:, None]
    if kind == "right_pad":
        return pos < (Lk - starts)[:, None]
    if kind == "empty_row":
        m = torch.rand(B, Lk, generator=g) < 0.6
        m[1] = False
        return m
    if kind == "all_true":
        return torch.ones(B, Lk, dtype=torch.bool)
    if kind == "expanded":
        m = (torch.rand(1, Lk, generator=g) < 0.6).expand(B, Lk)
        assert m.stride(0) == 0
        return m
    raise ValueError(kind)


MASK_KINDS = ["holes", "left_pad", "right_pad", "empty_row", "all_true", "expanded"]
PAIR_RULES = {"full": (False, 0), "causal": (True, 0), "window": (False, 2), "causal_window": (True, 3)}


def make_inputs(B, H, Lq, Lk, D, Bq=None, bias_shape=None, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B if Bq is None else Bq, H, Lq, D, generator=g).to(dtype)
    k = torch.randn(B, H, Lk, D, generator=g).to(dtype)
    v = torch.randn(B, H, Lk, D, generator=g).to(dtype)
    bias = None if bias_shape is None else torch.randn(bias_shape, generator=g).to(dtype)
    return q, k, v, bias


def grads_of(fn, inputs, grad_out):
    leaves = [x.detach().requires_grad_(True) if x is not None else None for x in inputs]
    out = fn(*leaves)
    out.backward(grad_out)
    return out.detach(), [None if x is None else x.grad for x in leaves]


def check_against_direct(q, k, v, ql, kl, bias, mask, activation, scale=0.3, out_scale=1.0, divide=False,
                         causal=False, window=0):
    args = (activation, scale, out_scale, divide, causal, window)
    grad_out = torch.randn(k.shape[0], *q.shape[1:], dtype=q.dtype)
    out, grads = grads_of(lambda q, k, v, b: ops.gdpa(q, k, v, ql, kl, b, *args, kv_mask=mask),
                          (q, k, v, bias), grad_out)
    ref, ref_grads = grads_of(lambda q, k, v, b: direct_gdpa(q, k, v, ql, kl, b, mask, *args),
                              (q, k, v, bias), grad_out)
    assert out.shape == ref.shape and out.is_contiguous() and out.dtype == q.dtype
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    for name, got, want in zip("q k v bias".split(), grads, ref_grads):
        if want is None:
            assert got is None
            continue
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9, msg=f"grad of {name}")
    return out, grads


@pytest.mark.parametrize("rule", list(PAIR_RULES))
@pytest.mark.parametrize("kind", MASK_KINDS)
def test_masks_match_direct_float64(kind, rule):
    causal, window = PAIR_RULES[rule]
    B, H, L, D = 4, 2, 9, 16
    q, k, v, bias = make_inputs(B, H, L, L, D, bias_shape=(1, H, L, L), seed=len(kind) + len(rule))
    mask = make_mask(kind, B, L, seed=len(kind))
    ql, kl = torch.tensor([9, 7, 0, 4]), torch.tensor([9, 6, 3, 9])
    act = GDPA_ACTIVATIONS[(len(kind) + len(rule)) % len(GDPA_ACTIVATIONS)]
    check_against_direct(q, k, v, ql, kl, bias, mask, act, divide=True, causal=causal, window=window)


@pytest.mark.parametrize("activation", GDPA_ACTIVATIONS)
def test_every_activation_with_holes(activation):
    B, H, Lq, Lk, D = 3, 1, 6, 11, 16
    q, k, v, bias = make_inputs(B, H, Lq, Lk, D, bias_shape=(B, 1, 1, Lk), seed=3)
    check_against_direct(q, k, v, None, torch.tensor([11, 5, 8]), bias, make_mask("holes", B, Lk, 7),
                         activation, out_scale=1.5)


@pytest.mark.parametrize("kind", ["holes", "left_pad", "expanded"])
def test_shared_queries_mask_by_k_batch(kind):
    """Bq = 1 (learned queries shared by the batch): the mask is (B, Lk), by k's batch."""
    B, H, Lq, Lk, D = 4, 2, 5, 12, 16
    q, k, v, bias = make_inputs(B, H, Lq, Lk, D, Bq=1, bias_shape=(1, H, Lq, Lk), seed=11)
    check_against_direct(q, k, v, None, torch.tensor([12, 7, 0, 10]), bias, make_mask(kind, B, Lk, 2),
                         "gelu", divide=True)


def test_no_lengths_only_the_mask():
    B, H, L, D = 3, 2, 8, 16
    q, k, v, _ = make_inputs(B, H, L, L, D, seed=5)
    for kind in ("holes", "left_pad", "empty_row"):
        check_against_direct(q, k, v, None, None, None, make_mask(kind, B, L, 4), "sigmoid", causal=True)


def test_right_padding_mask_equals_kv_lengths():
    """A mask of the first n_b keys is kv_lengths = n_b (the output scale aside: it keeps kv_lengths)."""
    B, H, L, D = 3, 2, 10, 16
    q, k, v, bias = make_inputs(B, H, L, L, D, bias_shape=(B, H, L, L), seed=6)
    n = torch.tensor([10, 4, 0])
    mask = torch.arange(L)[None, :] < n[:, None]
    for causal, window in ((False, 0), (True, 2)):
        args = ("silu", 0.3, 1.0, False, causal, window)
        torch.testing.assert_close(ops.gdpa(q, k, v, None, None, bias, *args, kv_mask=mask),
                                   ops.gdpa(q, k, v, None, n, bias, *args), rtol=0, atol=0)


def test_all_false_rows_give_zeros_and_zero_grads():
    """sigmoid(0) = 0.5 would show any scored pair; an empty sample: 0 output, 0 grads, no NaN."""
    B, H, L, D = 3, 2, 7, 16
    q, k, v, bias = make_inputs(B, H, L, L, D, bias_shape=(B, H, L, L), seed=8)
    mask = make_mask("holes", B, L, 1)
    mask[0] = False
    out, (dq, dk, dv, db) = check_against_direct(q, k, v, None, torch.tensor([7, 7, 3]), bias, mask,
                                                 "sigmoid", divide=True)
    assert (out[0] == 0).all() and (dq[0] == 0).all() and (dk[0] == 0).all() and (dv[0] == 0).all()
    assert (db[0] == 0).all()
    # masked-out keys get exactly zero dk, dv (and no dbias column)
    dead = ~mask[:, None, :, None].expand_as(dk)
    assert (dk[dead] == 0).all() and (dv[dead] == 0).all()


def test_garbage_at_masked_keys_never_leaks():
    B, H, L, D = 3, 2, 9, 16
    q, k, v, bias = make_inputs(B, H, L, L, D, bias_shape=(B, H, L, L), seed=9)
    mask = make_mask("holes", B, L, 3)
    kl = torch.tensor([9, 5, 8])
    args = ("gelu", 0.3, 1.0, True, False, 3)
    dead = ~mask[:, None, :, None]
    dirty_k, dirty_v = k.masked_fill(dead, float("nan")), v.masked_fill(dead, float("inf"))
    dirty_bias = bias.masked_fill(dead.transpose(2, 3), float("nan"))
    g = torch.randn(B, H, L, D, dtype=torch.float64)
    clean = grads_of(lambda q, k, v, b: ops.gdpa(q, k, v, None, kl, b, *args, kv_mask=mask), (q, k, v, bias), g)
    dirty = grads_of(lambda q, k, v, b: ops.gdpa(q, k, v, None, kl, b, *args, kv_mask=mask),
                     (q, dirty_k, dirty_v, dirty_bias), g)
    torch.testing.assert_close(dirty[0], clean[0], rtol=0, atol=0)
    for a, b in zip(dirty[1], clean[1]):
        assert not a.isnan().any()
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_expanded_mask_is_read_in_place_and_matches_contiguous():
    B, H, L, D = 4, 2, 8, 16
    q, k, v, _ = make_inputs(B, H, L, L, D, seed=10)
    mask = make_mask("expanded", B, L, 5)
    args = ("relu_squared", 0.3, 1.0, False, True, 0)
    torch.testing.assert_close(ops.gdpa(q, k, v, None, None, None, *args, kv_mask=mask),
                               ops.gdpa(q, k, v, None, None, None, *args, kv_mask=mask.contiguous()),
                               rtol=0, atol=0)


def test_python_wrapper_and_reference_functions():
    B, H, L, D = 2, 1, 6, 16
    q, k, v, _ = make_inputs(B, H, L, L, D, seed=12)
    mask = make_mask("holes", B, L, 6)
    out = gdpa(q, k, v, activation="silu", scale=0.3, kv_mask=mask)
    torch.testing.assert_close(out, direct_gdpa(q, k, v, None, None, None, mask, "silu", 0.3, 1.0, False,
                                                False, 0))
    spec = GdpaSpec("silu", 0.3)
    torch.testing.assert_close(reference_gdpa_forward(q, k, v, None, None, None, spec, None, mask), out)
    grads = reference_gdpa_backward(torch.ones_like(out), q, k, v, None, None, None, spec, None, False, mask)
    assert grads[3].numel() == 0 and (grads[1][~mask[:, None, :, None].expand_as(k)] == 0).all()
    assert gdpa(q, k, v, kv_mask=None).shape == out.shape  # None: today's op


# ---------------------------------------------------------------------------------------------------
# opcheck, gradcheck, eager Function


def _opcheck_cases():
    B, H, Lq, Lk, D = 3, 2, 6, 7, 16
    q, k, v, bias = make_inputs(B, H, Lq, Lk, D, bias_shape=(1, H, Lq, Lk), seed=4)
    bias.requires_grad_(True)
    qr, kr, vr = (x.clone().requires_grad_(True) for x in (q, k, v))
    mask, kl = make_mask("holes", B, Lk, 9), torch.tensor([7, 3, 5])
    args = ("silu", 0.3, 1.0, True, True, 2)
    g = torch.randn(B, H, Lq, D, dtype=torch.float64)
    return [
        ("public", ops.gdpa.default, (qr, kr, vr, None, kl, bias, *args, None, 0, None, mask)),
        ("public_expanded", ops.gdpa.default,
         (qr, kr, vr, None, None, None, "gelu", 0.3, 1.0, False, False, 0, None, 0, None,
          make_mask("expanded", B, Lk, 1))),
        ("fwd", ops.gdpa_fwd.default, (qr, kr, vr, None, kl, bias, *args, None, 0, None, mask)),
        ("fwd_shared_q", ops.gdpa_fwd.default,
         (qr[:1], kr, vr, None, kl, None, "sigmoid", 0.3, 2.0, False, False, 0, None, 0, None, mask)),
        ("bwd", ops.gdpa_bwd.default, (g, q, k, v, None, kl, bias.detach(), *args, True, None, 0, None, mask)),
    ]


@pytest.mark.parametrize("case", _opcheck_cases(), ids=lambda c: c[0])
def test_opcheck_with_kv_mask(case):
    _, op, args = case
    result = torch.library.opcheck(op, args)
    assert all(v == "SUCCESS" for v in result.values()), result


def test_gradcheck_float64_with_mask():
    B, H, L, D = 3, 1, 5, 16
    q, k, v, bias = make_inputs(B, H, L, L, D, bias_shape=(B, 1, 1, L), seed=8)
    mask = make_mask("holes", B, L, 2)
    inputs = [x.requires_grad_(True) for x in (q, k, v, bias)]
    assert torch.autograd.gradcheck(
        lambda q, k, v, b: ops.gdpa(q, k, v, None, None, b, "gelu", 0.4, 1.3, True, True, 2, kv_mask=mask),
        inputs, fast_mode=True)


def test_eager_function_matches_the_op_path():
    B, H, Lq, Lk, D = 4, 2, 7, 9, 16
    q, k, v, bias = make_inputs(B, H, Lq, Lk, D, Bq=1, bias_shape=(1, H, Lq, Lk), seed=21)
    mask, kl = make_mask("left_pad", B, Lk, 0), torch.tensor([9, 8, 2, 9])
    args = ("gelu", 0.3, 1.5, True, True, 3)
    g = torch.randn(B, H, Lq, D, dtype=torch.float64)
    out_fn, grads_fn = grads_of(
        lambda q, k, v, b: EagerGDPA.apply(q, k, v, None, kl, b, *GdpaSpec.from_schema(*args, None, 0, None, mask)),
        (q, k, v, bias), g)
    out_op, grads_op = grads_of(lambda q, k, v, b: ops.gdpa_fwd(q, k, v, None, kl, b, *args, kv_mask=mask),
                                (q, k, v, bias), g)
    torch.testing.assert_close(out_fn, out_op, rtol=0, atol=0)
    for a, b in zip(grads_fn, grads_op):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------------
# Input checks


def _good():
    B, H, L, D = 3, 2, 6, 16
    q, k, v, _ = make_inputs(B, H, L, L, D, seed=1, dtype=torch.float32)
    return dict(q=q, k=k, v=v, kv_lengths=torch.tensor([6, 3, 0]), causal=True, kv_mask=make_mask("holes", B, L))


BAD_MASKS = [
    ("dtype", lambda a: a.update(kv_mask=a["kv_mask"].to(torch.uint8)), ValueError, "kv_mask must be a torch.bool"),
    ("float", lambda a: a.update(kv_mask=a["kv_mask"].float()), ValueError, "kv_mask must be a torch.bool"),
    ("rank", lambda a: a.update(kv_mask=a["kv_mask"][0]), ValueError, "kv_mask must have shape \\(B, Lk\\)"),
    ("batch", lambda a: a.update(kv_mask=a["kv_mask"][:1]), ValueError, "kv_mask must have shape"),
    ("length", lambda a: a.update(kv_mask=a["kv_mask"][:, :5]), ValueError, "kv_mask must have shape"),
    ("q batch", lambda a: a.update(kv_mask=torch.ones(1, 6, dtype=torch.bool)), ValueError, "kv_mask must have"),
    ("device", lambda a: a.update(kv_mask=a["kv_mask"].to("meta")), ValueError, "kv_mask is on meta"),
    ("not a tensor", lambda a: a.update(kv_mask=[[True] * 6] * 3), TypeError, "kv_mask must be a torch.Tensor"),
    ("num_targets", lambda a: a.update(num_targets=torch.zeros(3, dtype=torch.long)), ValueError,
     "kv_mask is not served together with num_targets"),
    ("contextual_len", lambda a: a.update(contextual_len=2), ValueError,
     "kv_mask is not served together with num_targets or contextual_len"),
]


@pytest.mark.parametrize("case", BAD_MASKS, ids=lambda c: c[0])
def test_bad_masks_raise_clear_errors(case):
    _, mutate, exc, match = case
    args = _good()
    gdpa(**args)  # the good call works
    mutate(args)
    with pytest.raises(exc, match=match):
        gdpa(**args)


def test_the_ops_check_the_mask_too():
    a = _good()
    base = (a["q"], a["k"], a["v"], None, a["kv_lengths"], None, "silu", 0.3, 1.0, False, True, 0)
    with pytest.raises(ValueError, match="kv_mask must be a torch.bool"):
        ops.gdpa(*base, kv_mask=a["kv_mask"].int())
    with pytest.raises(ValueError, match="kv_mask must have shape"):
        ops.gdpa_fwd(*base, kv_mask=a["kv_mask"].T)
    with pytest.raises(ValueError, match="not served"):
        ops.gdpa_fwd(*base, torch.zeros(3, dtype=torch.long), 0, None, a["kv_mask"])


def test_fake_tensors_check_the_mask_and_give_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k, v = torch.randn(1, 2, 4, 16), torch.randn(3, 2, 6, 16), torch.randn(3, 2, 6, 16)
        mask = torch.ones(3, 6, dtype=torch.bool)
        out = ops.gdpa_fwd(q, k, v, None, None, None, "silu", 0.1, 1.0, True, False, 0, kv_mask=mask)
        dq, dk, _, db = ops.gdpa_bwd(out, q, k, v, None, None, None, "silu", 0.1, 1.0, True, False, 0, False,
                                     kv_mask=mask)
        with pytest.raises(ValueError, match="kv_mask must have shape"):
            ops.gdpa_fwd(q, k, v, None, None, None, "silu", 0.1, 1.0, True, False, 0, kv_mask=mask[:, :5])
    assert out.shape == (3, 2, 4, 16) and dq.shape == (1, 2, 4, 16) and dk.shape == k.shape and db.numel() == 0


# ---------------------------------------------------------------------------------------------------
# FLOPs and torch.compile


def expected_pairs(ql, kl, mask, B, Lq, Lk, causal, window):
    total = 0
    for b in range(B):
        a, c = clamp_len(ql, b, Lq), clamp_len(kl, b, Lk)
        total += sum(keeps(i, j, causal, window) for i in range(a) for j in range(c) if bool(mask[b, j]))
    return total


@pytest.mark.parametrize("causal,window", [(False, 0), (True, 0), (False, 2), (True, 3)])
@pytest.mark.parametrize("kind", ["holes", "left_pad", "expanded"])
def test_flop_counter_counts_masked_pairs(kind, causal, window):
    B, H, Lq, Lk, D = 3, 2, 8, 11, 16
    q, k, v, _ = make_inputs(B, H, Lq, Lk, D, seed=6)
    mask = make_mask(kind, B, Lk, 3)
    for ql, kl in ((torch.tensor([8, 3, 0]), torch.tensor([5, 11, 4])), (None, torch.tensor([0, 11, 7])),
                   (None, None)):
        pairs = expected_pairs(ql, kl, mask, B, Lq, Lk, causal, window)
        qr = q.detach().requires_grad_(True)
        with FlopCounterMode(display=False) as counter:
            ops.gdpa(qr, k, v, ql, kl, None, "silu", 0.25, 1.0, True, causal, window,
                     kv_mask=mask).sum().backward()
        counts = {str(k_): v_ for k_, v_ in counter.get_flop_counts()["Global"].items()}
        assert counts["gemcompile.gdpa_fwd"] == 4 * H * D * pairs
        assert counts["gemcompile.gdpa_bwd"] == 10 * H * D * pairs


def test_flop_counter_padded_count_on_a_fake_mask():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k, v = (torch.randn(2, 2, 8, 16) for _ in range(3))
        mask = torch.zeros(2, 8, dtype=torch.bool)
        with FlopCounterMode(display=False) as counter:
            ops.gdpa(q, k, v, None, None, None, "relu", 0.25, 1.0, False, True, 2, kv_mask=mask)
    full = torch.ones(2, 8, dtype=torch.bool)
    assert counter.get_total_flops() == 4 * 2 * 16 * expected_pairs(None, None, full, 2, 8, 8, True, 2)


def test_compile_fullgraph_no_recompile_over_masks():
    B, H, L, D = 3, 2, 8, 16
    q, k, v, bias = make_inputs(B, H, L, L, D, bias_shape=(1, H, L, L), seed=10, dtype=torch.float32)
    leaves = [x.requires_grad_(True) for x in (q, k, v, bias)]

    def f(q, k, v, bias, kl, mask):
        return ops.gdpa(q, k, v, None, kl, bias, "gelu", 0.25, 1.0, True, True, 3, kv_mask=mask).square().sum()

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed in range(3):
            g = torch.Generator().manual_seed(seed)
            kl = torch.randint(0, L + 1, (B,), generator=g)
            mask = torch.rand(B, L, generator=g) < 0.5
            got = torch.autograd.grad(compiled(*leaves, kl, mask), leaves)
            want = torch.autograd.grad(f(*leaves, kl, mask), leaves)
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b)
