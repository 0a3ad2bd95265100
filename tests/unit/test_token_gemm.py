"""gemcompile::token_mm (lowering/token_gemm.py): a GEMM over a token dim, run as GEMMs of bucketed sizes.
Against a plain fp64 matmul over a grid of token counts (zero, under the split size, at a bucket size, just
past one), both split dims, with and without a bias, strided operands; the bucket sizes themselves (few per
octave, the window never larger than the dim); bad arguments are errors."""

import pytest
import torch

from gemcompile.lowering.token_gemm import bucket_quantum, token_mm_impl

ops = torch.ops.gemcompile


def _want(a, b, bias):
    out = a.double() @ b.double()
    return out if bias is None else out + bias.double().reshape(1, -1)


@pytest.mark.parametrize("n", [0, 1, 31, 32, 33, 64, 95, 100, 128, 129, 200, 511])
@pytest.mark.parametrize("split_dim", [0, 1])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_one_gemm(n, split_dim, with_bias):
    g = torch.Generator().manual_seed(n * 4 + split_dim * 2 + with_bias)
    k, m_other, n_out = 24, 12, 20
    if split_dim == 0:  # a (tokens, K): a Linear's forward
        a = torch.randn(n, k, generator=g)
        b = torch.randn(n_out, k, generator=g).t()  # a weight's transposed view, as Linear passes it
    else:  # a (features, tokens) @ b (tokens, N): a weight gradient summed over tokens
        a = torch.randn(n, m_other, generator=g).t()
        b = torch.randn(n, n_out, generator=g)
    bias = torch.randn(n_out, generator=g) if with_bias else None
    got = ops.token_mm(a, b, bias, split_dim, 4, 16)
    assert got.shape == (a.shape[0], n_out) and got.is_contiguous() and got.dtype == a.dtype
    torch.testing.assert_close(got.double(), _want(a, b, bias), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("split_dim", [0, 1])
def test_half_precision_within_one_rounding(split_dim):
    g = torch.Generator().manual_seed(7)
    a = torch.randn(300, 64, generator=g).half() if split_dim == 0 else torch.randn(300, 32, generator=g).half().t()
    b = torch.randn(64 if split_dim == 0 else 300, 48, generator=g).half()
    got = token_mm_impl(a, b, None, split_dim, 8, 16)
    want = _want(a, b, None)
    # one fp16 rounding of the result (and one more for the reduction split's added window)
    torch.testing.assert_close(got.double(), want, rtol=2e-3, atol=2e-2)


def test_bias_as_a_row():
    a, b, bias = torch.randn(100, 8), torch.randn(8, 6), torch.randn(1, 6)
    torch.testing.assert_close(ops.token_mm(a, b, bias, 0, 4, 16).double(), _want(a, b, bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", [2, 100, 1000, 4096, 5000, 262143, 262144, 300000])
def test_bucket_sizes(n):
    q = bucket_quantum(n, 16, 1)
    assert q & (q - 1) == 0 and 1 <= q <= n  # a power of two, never wider than the dim
    if n >= 16:  # 1/16 of n's power of two; the head takes one of 16 values per octave
        assert q * 16 <= n < q * 32
        assert 16 * q <= n // q * q <= n


def test_few_shapes_over_many_token_counts():
    """Over a range of token counts, the GEMM sizes asked of cuBLAS come from a small set."""
    sizes = set()
    for n in range(240_000, 290_000, 97):
        q = bucket_quantum(n, 16, 256)
        sizes.update({n // q * q, q})
    assert len(sizes) <= 10


@pytest.mark.parametrize("bad", ["shapes", "dtype", "bias", "split"])
def test_bad_arguments(bad):
    a, b, bias, split = torch.randn(40, 8), torch.randn(8, 6), None, 0
    if bad == "shapes":
        b = torch.randn(7, 6)
    elif bad == "dtype":
        b = b.double()
    elif bad == "bias":
        bias = torch.randn(5)
    else:
        split = 2
    with pytest.raises(ValueError, match="token_mm"):
        ops.token_mm(a, b, bias, split, 4, 16)



@pytest.mark.parametrize("q", [256, 1024])
def test_window_row_mask_is_a_view_of_one_cached_tensor(q):
    from gemcompile.lowering import token_gemm

    cpu = torch.device("cpu")
    for first in (0, 1, q // 3, q - 1):
        got = token_gemm._rows_from(q, first, cpu)
        assert torch.equal(got, torch.arange(q) >= first)
        steps = token_gemm._ROW_STEPS[(q, cpu)]
        assert got.untyped_storage().data_ptr() == steps.untyped_storage().data_ptr()  # no new tensor per call


def test_reduction_split_keeps_infinities_of_the_head_only():
    """The window's zeroed rows are zeros, not a product with 0: an inf among the tokens the head summed is
    counted once (inf), not turned into NaN by the window."""
    from gemcompile.lowering.token_gemm import bucket_quantum, token_mm_impl

    n, q = 700, bucket_quantum(700, 16, 32)
    a = torch.ones(3, n, dtype=torch.float64)
    b = torch.ones(n, 2, dtype=torch.float64)
    b[n // q * q - 1, 0] = float("inf")  # a head token that the window overlaps
    got = token_mm_impl(a, b, None, 1, 16, 32)
    assert torch.equal(got, a @ b)
