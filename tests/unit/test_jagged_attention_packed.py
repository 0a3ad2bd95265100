"""gemcompile::jagged_attention with packed keys/values (token_offsets, packed_len) on CPU (the reference
path): the packed op equals the padded op on the padded tensors at the valid rows, outputs and every
gradient; packed self-attention; opcheck of the new signatures; FLOP counts; the errors."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import gemcompile.lowering  # noqa: F401  (registers the ops)
from gemcompile.lowering.common.jagged import lengths_to_offsets
from gemcompile.lowering.jagged_attention.op import jagged_attention

ops = torch.ops.gemcompile
B, H, N, D, Q = 5, 2, 19, 16, 3
LENGTHS = [0, N, 7, 1, 12]  # an empty sequence, a full one, odd ones
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3)}


def packed_case(dtype, seed=0, extra_rows=0):
    """(lengths, offsets, packed k and v as in-place views of one (T, 2 H D) Linear-like output, T)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(LENGTHS)
    offsets = lengths_to_offsets(lengths)
    T = int(offsets[-1]) + extra_rows  # extra rows: a bucketed index's sentinel rows (no sequence)
    kv = torch.randn(T, 2 * H * D, generator=g).to(dtype)
    return lengths, offsets, kv[:, : H * D].view(T, H, D), kv[:, H * D:].view(T, H, D), T


def pad(x, lengths, offsets):
    """(T, H, D) packed -> (B, H, N, D), written out row by row (the tests' own scatter)."""
    out = x.new_zeros(B, N, *x.shape[1:])
    for b in range(B):
        out[b, : lengths[b]] = x[offsets[b]: offsets[b + 1]]
    return out.transpose(1, 2)


def leaf(x):
    return x.detach().clone().requires_grad_(True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("extra", ["plain", "kv_mask", "bias", "shared_q", "uniform_keys"])
def test_packed_keys_equal_padded(dtype, causal, extra):
    lengths, offsets, k, v, T = packed_case(dtype, seed=len(extra) + causal)
    g = torch.Generator().manual_seed(7)
    q = torch.randn(1 if extra == "shared_q" else B, H, Q, D, generator=g).to(dtype)
    kv_mask = torch.rand(B, N, generator=g) > 0.3 if extra == "kv_mask" else None
    bias = (0.5 * torch.randn(B, 1, Q, N, generator=g)).to(dtype) if extra == "bias" else None
    uniform = torch.tensor([False, True, True, False, False]) if extra == "uniform_keys" else None
    scale = 0.3
    kp, vp = pad(k, lengths, offsets), pad(v, lengths, offsets)
    inputs = [leaf(t) for t in (q, k, v)] + ([leaf(bias)] if bias is not None else [])
    padded_in = [leaf(t) for t in (q, kp, vp)] + ([leaf(bias)] if bias is not None else [])
    out = jagged_attention(*inputs[:3], None, lengths, inputs[3] if bias is not None else None, causal, scale,
                           kv_mask=kv_mask, uniform_keys=uniform, token_offsets=offsets, packed_len=N)
    want = jagged_attention(*padded_in[:3], None, lengths, padded_in[3] if bias is not None else None, causal, scale,
                            kv_mask=kv_mask, uniform_keys=uniform)
    assert out.shape == want.shape == (B, H, Q, D)
    torch.testing.assert_close(out, want, **TOL[dtype])
    grad = torch.randn(out.shape, generator=g).to(dtype)
    out.backward(grad)
    want.backward(grad)
    assert inputs[1].grad.shape == k.shape and inputs[2].grad.shape == v.shape  # packed gradients
    torch.testing.assert_close(inputs[0].grad, padded_in[0].grad, **TOL[dtype])
    torch.testing.assert_close(pad(inputs[1].grad, lengths, offsets), padded_in[1].grad, **TOL[dtype])
    torch.testing.assert_close(pad(inputs[2].grad, lengths, offsets), padded_in[2].grad, **TOL[dtype])
    if bias is not None:
        torch.testing.assert_close(inputs[3].grad, padded_in[3].grad, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_packed_self_attention_equals_padded(dtype, causal):
    lengths, offsets, k, v, T = packed_case(dtype, seed=3 + causal, extra_rows=2)
    q = torch.randn(T, H, D, generator=torch.Generator().manual_seed(5)).to(dtype)
    qs, ks, vs = leaf(q), leaf(k), leaf(v)
    qp, kp, vp = (leaf(pad(t, lengths, offsets)) for t in (q, k, v))
    out = jagged_attention(qs, ks, vs, lengths, lengths, None, causal, 0.25, token_offsets=offsets, packed_len=N)
    want = jagged_attention(qp, kp, vp, lengths, lengths, None, causal, 0.25)
    assert out.shape == (T, H, D)
    torch.testing.assert_close(pad(out, lengths, offsets), want, **TOL[dtype])
    assert (out[-2:] == 0).all()  # rows outside every sequence
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(6)).to(dtype)
    out.backward(grad)
    want.backward(pad(grad, lengths, offsets))
    for got, ref in ((qs, qp), (ks, kp), (vs, vp)):
        assert got.grad.shape == (T, H, D) and (got.grad[-2:] == 0).all()
        torch.testing.assert_close(pad(got.grad, lengths, offsets), ref.grad, **TOL[dtype])


def test_int32_offsets_and_lengths_none():
    lengths, offsets, k, v, _ = packed_case(torch.float32, seed=9)
    q = torch.randn(B, H, Q, D)
    a = jagged_attention(q, k, v, None, None, token_offsets=offsets.to(torch.int32), packed_len=N)
    b = jagged_attention(q, pad(k, lengths, offsets), pad(v, lengths, offsets), None, lengths)
    torch.testing.assert_close(a, b)


def _opcheck_cases():
    lengths, offsets, k, v, T = packed_case(torch.float32, seed=11)
    q = torch.randn(B, H, Q, D)
    qs = torch.randn(T, H, D)
    mask = torch.rand(B, N, generator=torch.Generator().manual_seed(1)) > 0.2
    out, lse = ops.jagged_attention_fwd(q, k, v, None, lengths, None, False, 0.3, token_offsets=offsets, packed_len=N)
    outs, lses = ops.jagged_attention_fwd(qs, k, v, None, None, None, True, 0.3, token_offsets=offsets,
                                          packed_len=N)
    kr, vr = leaf(k), leaf(v)
    return [
        ("fwd_kv", ops.jagged_attention_fwd.default, (leaf(q), kr, vr, None, lengths, None, False, 0.3),
         dict(kv_mask=mask, token_offsets=offsets, packed_len=N)),
        ("fwd_self", ops.jagged_attention_fwd.default, (leaf(qs), kr, vr, None, None, None, True, 0.3),
         dict(token_offsets=offsets, packed_len=N)),
        ("bwd_kv", ops.jagged_attention_bwd.default,
         (torch.randn_like(out), q, k, v, out, lse, None, lengths, None, False, 0.3, False),
         dict(token_offsets=offsets, packed_len=N)),
        ("bwd_self", ops.jagged_attention_bwd.default,
         (torch.randn_like(outs), qs, k, v, outs, lses, None, None, None, True, 0.3, False),
         dict(token_offsets=offsets, packed_len=N)),
        ("public", ops.jagged_attention.default, (leaf(q), kr, vr, None, None, None, False, 0.3),
         dict(token_offsets=offsets, packed_len=N)),
    ]


@pytest.mark.parametrize("case", _opcheck_cases(), ids=lambda c: c[0])
def test_opcheck(case):
    _, op, args, kwargs = case
    result = torch.library.opcheck(op, args, kwargs)
    assert all(v == "SUCCESS" for v in result.values()), result


def test_flops_count_the_valid_pairs():
    lengths, offsets, k, v, T = packed_case(torch.float32, seed=12)
    q = torch.randn(B, H, Q, D)
    with FlopCounterMode(display=False) as counter:
        ops.jagged_attention_fwd(q, k, v, None, None, None, False, 0.3, token_offsets=offsets, packed_len=N)
    assert counter.get_total_flops() == 4 * H * D * Q * sum(LENGTHS)
    qs = torch.randn(T, H, D)
    with FlopCounterMode(display=False) as counter:
        ops.jagged_attention_fwd(qs, k, v, None, None, None, False, 0.3, token_offsets=offsets, packed_len=N)
    assert counter.get_total_flops() == 4 * H * D * sum(n * n for n in LENGTHS)


def _errors():
    lengths, offsets, k, v, T = packed_case(torch.float32)
    q = torch.randn(B, H, Q, D)
    bad_offsets = offsets.clone()
    bad_offsets[2] = bad_offsets[1] - 1
    return [
        ("2-D offsets", dict(token_offsets=offsets[None], packed_len=N), "token_offsets"),
        ("float offsets", dict(token_offsets=offsets.float(), packed_len=N), "token_offsets"),
        ("offsets of another batch", dict(token_offsets=offsets[:-1], packed_len=N), "token_offsets"),
        ("decreasing offsets", dict(token_offsets=bad_offsets, packed_len=N), "token_offsets"),
        ("a sequence past packed_len", dict(token_offsets=offsets, packed_len=N - 1), "packed_len"),
        ("offsets past T", dict(token_offsets=offsets + 1, packed_len=N), "token_offsets"),
        ("negative packed_len", dict(token_offsets=offsets, packed_len=-1), "packed_len"),
        ("packed_len alone", dict(packed_len=N, k=torch.randn(B, H, N, D), v=torch.randn(B, H, N, D)),
         "packed_len"),
        ("kv_lengths disagree", dict(token_offsets=offsets, packed_len=N, kv_lengths=lengths + 1), "kv_lengths"),
        ("k and v rows differ", dict(token_offsets=offsets, packed_len=N, v=v[:-1]), "k and v"),
        ("packed q over other rows", dict(token_offsets=offsets, packed_len=N, q=torch.randn(T + 1, H, D)),
         "packed q"),
        ("offsets on another device", dict(token_offsets=offsets.to("meta"), packed_len=N), "token_offsets"),
        ("kv_mask of the packed rows", dict(token_offsets=offsets, packed_len=N, kv_mask=torch.ones(B, T, dtype=torch.bool)),
         "kv_mask"),
    ], q, k, v, lengths


@pytest.mark.parametrize("index", range(13))
def test_inconsistent_arguments_are_refused(index):
    cases, q, k, v, lengths = _errors()
    name, kwargs, match = cases[index]
    args = dict(q=q, k=k, v=v, kv_lengths=lengths)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        jagged_attention(args.pop("q"), args.pop("k"), args.pop("v"), None, **args)


def test_packed_q_needs_packed_keys():
    lengths, offsets, k, v, T = packed_case(torch.float32)
    with pytest.raises(ValueError, match="k must be 3-D"):
        jagged_attention(torch.randn(T, H, D), pad(k, lengths, offsets), pad(v, lengths, offsets), None,
                         token_offsets=offsets, packed_len=N)


def test_compile_packed_keys_fullgraph():
    lengths, offsets, k, v, _ = packed_case(torch.float32, seed=13)
    q = torch.randn(B, H, Q, D)

    def f(q, k, v, offsets):
        return ops.jagged_attention(q, k, v, None, None, None, False, 0.3, token_offsets=offsets, packed_len=N)

    got = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v, offsets)
    torch.testing.assert_close(got, f(q, k, v, offsets))


@pytest.mark.parametrize("packed_q", [False, True], ids=["kv", "self"])
def test_eager_function_matches_the_op(packed_q):
    """EagerJaggedAttention (the plain-eager CUDA path; here on CPU, where it runs the reference)."""
    from gemcompile.lowering.jagged_attention.op import EagerJaggedAttention

    lengths, offsets, k, v, T = packed_case(torch.float32, seed=14)
    q = torch.randn(T, H, D) if packed_q else torch.randn(B, H, Q, D)
    a = [leaf(q), leaf(k), leaf(v)]
    b = [leaf(q), leaf(k), leaf(v)]
    out = EagerJaggedAttention.apply(*a, None, lengths, None, True, 0.3, None, None, None, None, None, offsets, N)
    want = jagged_attention(*b, None, lengths, None, True, 0.3, token_offsets=offsets, packed_len=N)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    grad = torch.randn(out.shape)
    out.backward(grad)
    want.backward(grad)
    for x, y in zip(a, b):
        torch.testing.assert_close(x.grad, y.grad, rtol=0, atol=0)


def test_compile_with_a_data_dependent_token_count():
    """Packed k, v as the unpad pass makes them: rows gathered by valid_token_index (T an unbacked size under
    torch.compile); forward and gradients equal eager."""

    def f(x, lengths, q):
        index = ops.valid_token_index(lengths, N)
        packed = x.flatten(0, 1)[index]  # (T, 2 H D)
        offsets = torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0))
        k, v = packed[:, : H * D].unflatten(1, (H, D)), packed[:, H * D:].unflatten(1, (H, D))
        pma = ops.jagged_attention(q, k, v, None, lengths, None, False, 0.25, token_offsets=offsets, packed_len=N)
        self_ = ops.jagged_attention(k, k, v, None, None, None, True, 0.25, token_offsets=offsets, packed_len=N)
        return pma.square().sum() + self_.square().sum()

    lengths = torch.tensor(LENGTHS)
    x, q = torch.randn(B, N, 2 * H * D), torch.randn(1, H, Q, D)
    eager_in, compiled_in = [leaf(x), leaf(q)], [leaf(x), leaf(q)]
    want = f(eager_in[0], lengths, eager_in[1])
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(compiled_in[0], lengths, compiled_in[1])
    torch.testing.assert_close(got, want)
    want.backward()
    got.backward()
    for a, b in zip(compiled_in, eager_in):
        torch.testing.assert_close(a.grad, b.grad)
