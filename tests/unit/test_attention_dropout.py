"""Dropout on the attention probabilities of ``gemcompile::jagged_attention``.

The keep mask is drawn from a seed by Philox: the host copy (common/dropout.py) must equal Triton's
``tl.rand`` bit for bit, the reference op must equal eager ``dropout(softmax(s)) @ v`` under that mask
(float64, outputs and gradients, gradcheck), the Triton kernels (interpreter) must equal the reference for
the same seed in every layout (padded, kv_mask with holes, packed keys, packed self-attention, causal,
bias with a gradient), and the draws must drop a fraction p of pairs, independently across heads and
seeds. Bad arguments get errors that name them.
"""

import os

import pytest
import torch

import gemcompile.lowering  # noqa: F401  (registers the ops)
from gemcompile.lowering.common.attention_triton import dropout_args, dropout_factor
from gemcompile.lowering.common.dropout import (check_dropout, drop_threshold, keep_mask, keep_scale, new_seed,
                                                philox_words)
from gemcompile.lowering.common.packed import pack_padded
from gemcompile.lowering.jagged_attention.packed import packed_reference_backward, packed_reference_forward

ops = torch.ops.gemcompile
INTERPRETER = not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(not INTERPRETER, reason="Triton interpreter on a machine without CUDA")


def _eager(q, k, v, lengths, causal, scale, p, seed, bias=None, kv_mask=None):
    """dropout(softmax(s)) @ v written densely, the keep mask from ``seed``; rows past a length are 0."""
    B, H, L, _ = k.shape
    valid = torch.arange(L)[None, :] < lengths[:, None]
    keys = valid if kv_mask is None else valid & kv_mask
    m = keys[:, None, None, :] & valid[:, None, :, None]
    if causal:
        m = m & torch.ones(L, L, dtype=torch.bool).tril()
    s = q @ k.transpose(-1, -2) * scale + (0 if bias is None else bias)
    weights = torch.softmax(s.masked_fill(~m, float("-inf")), -1).nan_to_num(0.0)
    keep = keep_mask(seed, p, B, H, q.shape[2], L, q.device)
    return ((weights * keep * keep_scale(p)) @ v) * valid[:, None, :, None]


@needs_interpreter
def test_host_draws_equal_triton_randint_bit_for_bit():
    import triton
    import triton.language as tl

    @triton.jit
    def draw(Out, Seed, key_add, N: tl.constexpr):
        offs = tl.arange(0, N)
        w0, w1, w2, w3 = tl.randint4x(tl.load(Seed) + key_add, offs)
        tl.store(Out + offs * 4, w0.to(tl.int64) & 0xFFFFFFFF)
        tl.store(Out + offs * 4 + 1, w1.to(tl.int64) & 0xFFFFFFFF)
        tl.store(Out + offs * 4 + 2, w2.to(tl.int64) & 0xFFFFFFFF)
        tl.store(Out + offs * 4 + 3, w3.to(tl.int64) & 0xFFFFFFFF)
        tl.store(Out + 4 * N + offs, tl.randint(tl.load(Seed) + key_add, offs).to(tl.int64) & 0xFFFFFFFF)

    for seed in (0, 1, 2**33 + 5, 2**62 - 7):
        out = torch.empty(5 * 512, dtype=torch.int64)
        draw[(1,)](out, torch.tensor([seed]), 11, N=512)
        host = philox_words(torch.tensor(seed + 11), torch.arange(512))
        assert torch.equal(out[:2048].view(512, 4), host)
        assert torch.equal(out[2048:], host[:, 0])  # word 0 is tl.randint's


@needs_interpreter
@pytest.mark.parametrize("p", [0.1, 0.5, 0.97])
def test_the_kernel_tile_of_draws_is_keep_mask_times_keep_scale(p):
    """attention_triton.dropout_factor on a (rows, BLOCK_N) tile at an offset == the host's keep_mask."""
    import triton
    import triton.language as tl

    @triton.jit
    def tile(Out, Seed, row0, col0, row_counters, drop_below, scale, M: tl.constexpr, N: tl.constexpr):
        rows = row0 + tl.arange(0, M)
        f = dropout_factor(tl.load(Seed) + 3, rows, col0, row_counters, drop_below, scale, N)
        tl.store(Out + tl.arange(0, M)[:, None] * N + tl.arange(0, N)[None, :], f)

    seed = torch.tensor([123456789])
    Lq, Lk = 40, 45
    _, below, scale = dropout_args(p, seed, None)
    keep = keep_mask(seed[0], p, 1, 4, Lq, Lk, "cpu")[0, 3]  # (batch, head) 3's Philox key: seed + 3
    for row0, col0 in ((0, 0), (16, 16), (24, 32)):
        out = torch.empty(16, 16)
        tile[(1,)](out, seed, row0, col0, (Lk + 7) // 8, below, scale, M=16, N=16)
        cols = min(16, Lk - col0)
        want = keep[row0:row0 + 16, col0:col0 + cols] * keep_scale(p)
        assert torch.equal(out[:, :cols], want.float())


def test_p_is_drawn_to_16_bits_and_kept_pairs_are_scaled_by_one_over_the_rate_kept():
    assert drop_threshold(0.1) == 6554 and drop_threshold(0.5) == 32768 and drop_threshold(1e-9) == 0
    assert drop_threshold(0.9999999) == 2**16 - 1  # p < 1 keeps some pairs
    for p in (1e-9, 0.1, 0.25, 0.5, 0.9, 0.9999999):
        if p < 1 - 2**-17:
            assert abs(drop_threshold(p) / 2**16 - p) <= 2**-17 + 1e-12
        assert keep_scale(p) * (1 - drop_threshold(p) / 2**16) == pytest.approx(1.0, abs=1e-15)


@pytest.mark.parametrize("causal", [False, True])
def test_reference_equals_eager_dropout_outputs_and_gradients(causal):
    g = torch.Generator().manual_seed(0)
    B, H, L, D = 4, 2, 23, 16
    q, k, v = (torch.randn(B, H, L, D, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    bias = torch.randn(1, H, L, L, generator=g, dtype=torch.float64, requires_grad=True)
    lengths = torch.tensor([0, L, 1, 13])
    seed = torch.tensor(987654321)
    out = ops.jagged_attention(q, k, v, lengths, lengths, bias, causal, 0.3, dropout_p=0.25, dropout_seed=seed)
    ref = _eager(q, k, v, lengths, causal, 0.3, 0.25, seed, bias)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
    w = torch.randn(out.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad((out * w).sum(), (q, k, v, bias))
    want = torch.autograd.grad((ref * w).sum(), (q, k, v, bias))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)
    small = [t.detach()[:2, :1, :6].requires_grad_() for t in (q, k, v)]
    assert torch.autograd.gradcheck(
        lambda q, k, v: ops.jagged_attention(q, k, v, torch.tensor([6, 4]), torch.tensor([6, 4]), None, causal,
                                             0.3, dropout_p=0.25, dropout_seed=seed), small)


def test_the_seed_decides_the_output_and_p_zero_is_no_dropout():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 2, 16, 16, generator=g) for _ in range(3))
    lengths = torch.tensor([16, 9])
    a = ops.jagged_attention(q, k, v, lengths, lengths, None, False, 0.3, dropout_p=0.5,
                             dropout_seed=torch.tensor(1))
    b = ops.jagged_attention(q, k, v, lengths, lengths, None, False, 0.3, dropout_p=0.5,
                             dropout_seed=torch.tensor(1))
    c = ops.jagged_attention(q, k, v, lengths, lengths, None, False, 0.3, dropout_p=0.5,
                             dropout_seed=torch.tensor(2))
    assert torch.equal(a, b) and not torch.allclose(a, c)
    plain = ops.jagged_attention(q, k, v, lengths, lengths, None, False, 0.3)
    assert torch.equal(ops.jagged_attention(q, k, v, lengths, lengths, None, False, 0.3, dropout_p=0.0), plain)


def test_draws_drop_a_fraction_p_independently_across_heads_and_seeds():
    for p in (0.1, 0.5, 0.9):
        keep = keep_mask(torch.tensor(42), p, 4, 4, 64, 64, "cpu")
        n = keep.numel()
        assert abs(keep.float().mean().item() - (1 - p)) < 4 * (p * (1 - p) / n) ** 0.5
    keep = keep_mask(torch.tensor(7), 0.5, 2, 2, 64, 64, "cpu").flatten(2).float()
    other = keep_mask(torch.tensor(8), 0.5, 2, 2, 64, 64, "cpu").flatten(2).float()
    # agreement of two independent fair masks is 1/2 (4 sigma over 4096 pairs: 0.031)
    assert abs((keep[0, 0] == keep[0, 1]).float().mean().item() - 0.5) < 0.035  # heads
    assert abs((keep[0, 0] == keep[1, 0]).float().mean().item() - 0.5) < 0.035  # batches
    assert abs((keep == other).float().mean().item() - 0.5) < 0.01  # seeds
    rows = keep_mask(torch.tensor(7), 0.5, 1, 1, 256, 64, "cpu")[0, 0].float()
    # the two halves of one Philox word (keys 2k, 2k + 1) and two words of one counter (keys 8c, 8c + 2)
    assert abs((rows[:, 0::2] == rows[:, 1::2]).float().mean().item() - 0.5) < 0.035
    assert abs((rows[:, 0::8] == rows[:, 2::8]).float().mean().item() - 0.5) < 0.07


def test_expected_output_is_the_undropped_output():
    """Dropout is unbiased: the mean over many seeds approaches the output without dropout."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 1, 8, 16, generator=g, dtype=torch.float64) for _ in range(3))
    lengths = torch.tensor([8])
    plain = ops.jagged_attention(q, k, v, lengths, lengths, None, False, 0.5)
    mean = sum(ops.jagged_attention(q, k, v, lengths, lengths, None, False, 0.5, dropout_p=0.3,
                                    dropout_seed=torch.tensor(s)) for s in range(2000)) / 2000
    assert (mean - plain).abs().max().item() < 0.08


@pytest.mark.parametrize("bad, error, text", [
    (dict(dropout_p=1.0, dropout_seed=torch.tensor(1)), ValueError, "in \\[0, 1\\)"),
    (dict(dropout_p=-0.1, dropout_seed=torch.tensor(1)), ValueError, "in \\[0, 1\\)"),
    (dict(dropout_p=0.1), TypeError, "needs dropout_seed"),
    (dict(dropout_p=0.1, dropout_seed=torch.tensor([1, 2])), ValueError, "one int64 element"),
    (dict(dropout_p=0.1, dropout_seed=torch.tensor(1.0)), ValueError, "one int64 element"),
])
def test_bad_dropout_arguments_are_refused_by_name(bad, error, text):
    q = torch.randn(1, 1, 4, 16)
    with pytest.raises(error, match=text):
        ops.jagged_attention_fwd(q, q, q, None, None, None, False, 1.0, **bad)


def test_too_many_pairs_for_the_int32_counter_is_refused():
    with pytest.raises(ValueError, match="2\\*\\*31"):
        check_dropout(0.1, torch.tensor(1), 2**16, 2**18, "cpu")
    check_dropout(0.1, torch.tensor(1), 2**16, 2**18 - 8, "cpu")
    assert new_seed("cpu").dtype == torch.int64


# ---------------------------------------------------------------------------------------------------
# The Triton kernels (interpreter) against the reference, one seed


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _layout_case(layout, causal, g):
    B, H, L, D = 3, 2, 24, 16
    lengths = torch.tensor([L, 0, 17])
    q, k, v = (torch.randn(B, H, L, D, generator=g) for _ in range(3))
    kw = dict(q_lengths=lengths, kv_lengths=lengths)
    bias = None
    if layout == "kv_mask":
        kw["kv_mask"] = torch.rand(B, L, generator=g) > 0.3
    if layout == "bias":
        bias = torch.randn(B, 1, L, L, generator=g)
    if layout in ("packed_keys", "packed_self"):
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        T = int(offsets[-1])
        k, v = (pack_padded(t, offsets, T) for t in (k, v))  # (T, H, D)
        kw = dict(q_lengths=lengths, kv_lengths=None, token_offsets=offsets, packed_len=L)
        if layout == "packed_self":
            q = pack_padded(q, offsets, T)
            kw["q_lengths"] = None
    return q, k, v, bias, kw


@needs_interpreter
@pytest.mark.parametrize("layout, causal", [(layout, causal) for layout in ("padded", "kv_mask", "bias", "packed_self")
                                            for causal in (False, True)] + [("packed_keys", False)])
def test_triton_kernels_equal_the_reference_for_one_seed(layout, causal):
    from gemcompile.lowering.jagged_attention import packed_triton

    g = torch.Generator().manual_seed(5)
    q, k, v, bias, kw = _layout_case(layout, causal, g)
    q_lengths, kv_lengths = kw.pop("q_lengths"), kw.pop("kv_lengths")
    seed = torch.tensor(2**40 + 123)
    args = (q_lengths, kv_lengths, bias, causal, 0.25, kw.get("kv_mask"), None, 0.4, seed)
    packed = {n: kw[n] for n in ("token_offsets", "packed_len") if n in kw}
    out, lse = packed_triton.jagged_attention_forward_triton(q, k, v, *args, **packed)
    ref_out, ref_lse = packed_reference_forward(q.double(), k.double(), v.double(), q_lengths, kv_lengths,
                                                None if bias is None else bias.double(), *args[3:], **packed)
    assert _rel(out, ref_out) < 2e-5
    grad = torch.randn(out.shape, generator=g)
    got = packed_triton.jagged_attention_backward_triton(grad, q, k, v, out, lse, q_lengths, kv_lengths, bias,
                                                         causal, 0.25, bias is not None, kw.get("kv_mask"), None,
                                                         0.4, seed, **packed)
    want = packed_reference_backward(grad.double(), q.double(), k.double(), v.double(), ref_out, ref_lse,
                                     q_lengths, kv_lengths, None if bias is None else bias.double(), causal, 0.25,
                                     bias is not None, kw.get("kv_mask"), None, 0.4, seed, **packed)
    for name, a, b in zip(("dq", "dk", "dv", "dbias"), got, want):
        if b.numel():
            assert _rel(a, b) < 5e-5, (name, _rel(a, b))
