"""gemcompile::gdpa with packed queries (token_offsets, packed_len) on CPU (the reference path): the packed op
equals the padded op on padded queries at the valid rows, outputs and every gradient (GEM-ref's
cross-attention: gelu, out_scale 1/N, no mask; and causal, window, kv lengths, kv_mask, dense and relative
biases); opcheck of the new signatures; FLOP counts; the errors."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import gemcompile.lowering  # noqa: F401  (registers the ops)
from gemcompile.lowering.common.jagged import lengths_to_offsets
from gemcompile.lowering.gdpa.op import gdpa

ops = torch.ops.gemcompile
B, H, N, D, S = 5, 2, 19, 16, 6  # S: short keys (GEM-ref's n_sum)
LENGTHS = [0, N, 7, 1, 12]
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3)}


def pad(x, lengths, offsets):
    out = x.new_zeros(B, N, *x.shape[1:])
    for b in range(B):
        out[b, : lengths[b]] = x[offsets[b]: offsets[b + 1]]
    return out.transpose(1, 2)


def leaf(x):
    return None if x is None else x.detach().clone().requires_grad_(True)


def case(dtype, seed, extra_rows=2):
    """lengths, offsets, packed q (a view into a wider Linear-like output), k, v (B, H, S, D), T, generator."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(LENGTHS)
    offsets = lengths_to_offsets(lengths)
    T = int(offsets[-1]) + extra_rows  # rows outside every sequence: a bucketed index's sentinel rows
    q = torch.randn(T, 3 * H * D, generator=g).to(dtype)[:, H * D: 2 * H * D].view(T, H, D)
    k = torch.randn(B, H, S, D, generator=g).to(dtype)
    v = torch.randn(B, H, S, D, generator=g).to(dtype)
    return lengths, offsets, q, k, v, T, g


CONFIGS = {  # name -> gdpa keywords besides q, k, v (bias filled in by the test)
    "gem_cross": dict(activation="gelu", scale=1.0, out_scale=1.0 / N),
    "silu_causal_window": dict(activation="silu", scale=0.3, causal=True, window=4),
    "kv_lengths_divide": dict(activation="relu_squared", scale=0.3, divide_by_kv_length=True),
    "kv_mask": dict(activation="sigmoid", scale=0.3),
    "dense_bias": dict(activation="gelu_tanh", scale=0.3),
    "row_bias": dict(activation="silu", scale=0.3),
    "relative_table": dict(activation="silu", scale=0.3, causal=True, relative_offset=N - 1),
}


def _extras(name, g, dtype):
    if name == "kv_lengths_divide":
        return dict(kv_lengths=torch.tensor([3, S, 0, 1, 5]))
    if name == "kv_mask":
        return dict(kv_mask=torch.rand(B, S, generator=g) > 0.3)
    if name == "dense_bias":
        return dict(bias=(0.3 * torch.randn(1, H, N, S, generator=g)).to(dtype))
    if name == "row_bias":  # broadcast along rows: the dQ kernel's gradient buffer
        return dict(bias=(0.3 * torch.randn(B, 1, 1, S, generator=g)).to(dtype))
    if name == "relative_table":
        return dict(bias=(0.3 * torch.randn(N + S - 1, H, generator=g)).to(dtype))
    return {}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_packed_queries_equal_padded(dtype, name):
    lengths, offsets, q, k, v, T, g = case(dtype, seed=len(name))
    kw = dict(CONFIGS[name], **_extras(name, g, dtype))
    bias = kw.pop("bias", None)
    packed_in = [leaf(q), leaf(k), leaf(v), leaf(bias)]
    padded_in = [leaf(pad(q, lengths, offsets)), leaf(k), leaf(v), leaf(bias)]
    out = gdpa(*packed_in[:3], bias=packed_in[3], token_offsets=offsets, packed_len=N, **kw)
    want = gdpa(*padded_in[:3], q_lengths=lengths, bias=padded_in[3], **kw)
    assert out.shape == (T, H, D) and (out[-2:] == 0).all()
    torch.testing.assert_close(pad(out, lengths, offsets), want, **TOL[dtype])
    grad = torch.randn(out.shape, generator=g).to(dtype)
    out.backward(grad)
    want.backward(pad(grad, lengths, offsets))
    assert packed_in[0].grad.shape == (T, H, D) and (packed_in[0].grad[-2:] == 0).all()
    torch.testing.assert_close(pad(packed_in[0].grad, lengths, offsets), padded_in[0].grad, **TOL[dtype])
    for i in (1, 2, 3):
        if packed_in[i] is not None:
            torch.testing.assert_close(packed_in[i].grad, padded_in[i].grad, **TOL[dtype])


def test_q_lengths_may_be_given_and_int32_offsets():
    lengths, offsets, q, k, v, T, _ = case(torch.float32, seed=3)
    a = gdpa(q, k, v, q_lengths=lengths, token_offsets=offsets.to(torch.int32), packed_len=N, activation="gelu")
    b = gdpa(q, k, v, token_offsets=offsets, packed_len=N, activation="gelu")
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def _opcheck_cases():
    lengths, offsets, q, k, v, T, g = case(torch.float32, seed=21)
    bias = 0.3 * torch.randn(1, H, N, S, generator=g)
    flags = ("gelu", 1.0, 1.0 / N, False, False, 0)
    packed = dict(token_offsets=offsets, packed_len=N)
    out = ops.gdpa_fwd(q, k, v, None, None, bias, *flags, **packed)
    grad = torch.randn(out.shape, generator=g)
    return [
        ("fwd", ops.gdpa_fwd.default, (leaf(q), leaf(k), leaf(v), None, None, leaf(bias), *flags), packed),
        ("bwd", ops.gdpa_bwd.default, (grad, q, k, v, None, None, bias, *flags, True), packed),
        ("public", ops.gdpa.default, (leaf(q), leaf(k), leaf(v), lengths, None, None, *flags), packed),
    ]


@pytest.mark.parametrize("case_", _opcheck_cases(), ids=lambda c: c[0])
def test_opcheck(case_):
    _, op, args, kwargs = case_
    result = torch.library.opcheck(op, args, kwargs)
    assert all(v == "SUCCESS" for v in result.values()), result


def test_flops_count_the_valid_query_rows():
    lengths, offsets, q, k, v, T, _ = case(torch.float32, seed=4)
    with FlopCounterMode(display=False) as counter:
        ops.gdpa_fwd(q, k, v, None, None, None, "gelu", 1.0, 1.0, False, False, 0, token_offsets=offsets,
                     packed_len=N)
    assert counter.get_total_flops() == 4 * H * D * S * sum(LENGTHS)


@pytest.mark.parametrize("name", ["2-D offsets", "float offsets", "offsets of another batch", "decreasing",
                                  "past packed_len", "past T", "packed_len alone", "q_lengths disagree",
                                  "num_targets", "contextual_len", "dense q", "offsets on another device"])
def test_inconsistent_arguments_are_refused(name):
    lengths, offsets, q, k, v, T, _ = case(torch.float32, seed=5)
    bad = offsets.clone()
    bad[3] = bad[2] - 1
    kw = {
        "2-D offsets": dict(token_offsets=offsets[None], packed_len=N),
        "float offsets": dict(token_offsets=offsets.double(), packed_len=N),
        "offsets of another batch": dict(token_offsets=offsets[:-1], packed_len=N),
        "decreasing": dict(token_offsets=bad, packed_len=N),
        "past packed_len": dict(token_offsets=offsets, packed_len=N - 1),
        "past T": dict(token_offsets=offsets + 3, packed_len=N),
        "packed_len alone": dict(packed_len=N, q=pad(q, lengths, offsets)),
        "q_lengths disagree": dict(token_offsets=offsets, packed_len=N, q_lengths=lengths.flip(0)),
        "num_targets": dict(token_offsets=offsets, packed_len=N, causal=True, kv_lengths=torch.full((B,), S),
                            num_targets=torch.ones(B, dtype=torch.int64)),
        "contextual_len": dict(token_offsets=offsets, packed_len=N, causal=True, kv_lengths=torch.full((B,), S),
                               contextual_len=2),
        "dense q": dict(token_offsets=offsets, packed_len=N, q=pad(q, lengths, offsets)),
        "offsets on another device": dict(token_offsets=offsets.to("meta"), packed_len=N),
    }[name]
    match = {"past packed_len": "packed_len", "packed_len alone": "packed_len", "q_lengths disagree": "q_lengths",
             "num_targets": "num_targets", "contextual_len": "contextual_len", "dense q": "q must be 3-D"}
    q_arg = kw.pop("q", q)
    with pytest.raises(ValueError, match=match.get(name, "token_offsets")):
        gdpa(q_arg, k, v, activation="gelu", **kw)


def test_compile_packed_queries_fullgraph():
    lengths, offsets, q, k, v, T, _ = case(torch.float32, seed=6)

    def f(q, k, v, offsets):
        return ops.gdpa(q, k, v, None, None, None, "gelu", 1.0, 1.0 / N, False, False, 0, token_offsets=offsets,
                        packed_len=N)

    got = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v, offsets)
    torch.testing.assert_close(got, f(q, k, v, offsets))


def test_eager_function_matches_the_op():
    """EagerGDPA (the plain-eager CUDA path; here on CPU, where it runs the reference) with packed queries."""
    from gemcompile.lowering.gdpa.op import EagerGDPA
    from gemcompile.lowering.gdpa.spec import GdpaSpec

    lengths, offsets, q, k, v, T, g = case(torch.float32, seed=8)
    spec = GdpaSpec("gelu", 1.0, 1.0 / N)
    a = [leaf(q), leaf(k), leaf(v)]
    b = [leaf(q), leaf(k), leaf(v)]
    out = EagerGDPA.apply(*a, None, None, None, spec, None, None, None, None, None, offsets, N)
    want = gdpa(*b, activation="gelu", scale=1.0, out_scale=1.0 / N, token_offsets=offsets, packed_len=N)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    grad = torch.randn(out.shape, generator=g)
    out.backward(grad)
    want.backward(grad)
    for x, y in zip(a, b):
        torch.testing.assert_close(x.grad, y.grad, rtol=0, atol=0)


def test_compile_with_a_data_dependent_token_count():
    """Packed q as the unpad pass makes it: rows gathered by valid_token_index (T an unbacked size under
    torch.compile); forward and gradients equal eager."""

    def f(x, lengths, k, v):
        index = ops.valid_token_index(lengths, N)
        q = x.flatten(0, 1)[index].unflatten(1, (H, D))  # (T, H, D)
        offsets = torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0))
        out = ops.gdpa(q, k, v, None, None, None, "gelu", 1.0, 1.0 / N, False, False, 0, token_offsets=offsets,
                       packed_len=N)
        return out.square().sum()

    lengths, _, _, k, v, _, g = case(torch.float32, seed=7)
    x = torch.randn(B, N, H * D, generator=g)
    eager_in, compiled_in = [leaf(x), leaf(k), leaf(v)], [leaf(x), leaf(k), leaf(v)]
    want = f(eager_in[0], lengths, *eager_in[1:])
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(compiled_in[0], lengths, *compiled_in[1:])
    torch.testing.assert_close(got, want)
    want.backward()
    got.backward()
    for a, b in zip(compiled_in, eager_in):
        torch.testing.assert_close(a.grad, b.grad)


def test_schemas_end_with_the_packed_arguments():
    for op in (ops.gdpa, ops.gdpa_fwd, ops.gdpa_bwd):
        schema = str(op.default._schema)
        assert "Tensor? kv_bounds=None, Tensor? token_offsets=None, SymInt packed_len=0) ->" in schema, schema
