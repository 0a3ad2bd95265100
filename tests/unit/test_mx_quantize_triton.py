"""The FP8 quantize kernels (lowering/fp8/quantize_triton.py) under the Triton interpreter (TRITON_INTERPRET=1, set by
conftest) against the exact reference (fp8/numerics.py), byte for byte: E4M3 elements viewed as uint8,
E8M0 codes, and the fp32 descales of the 1x128 / 128x128 kernels compared as bits.

The interpreter runs the integer element path (the one subnormal tiles take on the GPU too). The GPU's
"hardware conversion" path (x * 2^-e, then the e4m3 cvt) cannot be checked here: the interpreter's own
fp32 -> e4m3 emulation does not round to nearest even, so tests/gpu/test_mx_quantize_gpu.py checks it.
"""

import os

import pytest
import torch

if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip(
        "interpreter tests: run on a machine without CUDA (conftest sets TRITON_INTERPRET=1)",
        allow_module_level=True,
    )
pytest.importorskip("triton")

from gemcompile.lowering.fp8 import quantize_triton as mqt
from gemcompile.lowering.fp8.numerics import block_quantize, mx_quantize
from gemcompile.lowering.fp8.quantize_triton import (
    codes_to_descale,
    mx_quantize_triton,
    quantize_1x128,
    quantize_128x128,
    scale_storage,
)

RULES = ["floor", "rceil"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TINY = 2.0**-149


def u8(t):
    return t.view(torch.uint8)


def bits(t):
    return t.contiguous().view(torch.int32)


def assert_mx_equal(x, rule):
    e, c = mx_quantize_triton(x, rule, use_hw=False)
    re, rc = mx_quantize(x, -1, rule)
    assert e.dtype == torch.float8_e4m3fn and e.shape == x.shape and c.shape == rc.shape
    diff = (u8(e) != u8(re)).nonzero()
    assert diff.numel() == 0, [(x[tuple(i)].item(), u8(e)[tuple(i)].item(), u8(re)[tuple(i)].item())
                               for i in diff[:5].tolist()]
    assert torch.equal(c, rc), (c[c != rc][:5], rc[c != rc][:5])


def structured(rows, cols, dtype, seed, lo=-126, hi=127, block=32):
    """Blocks whose largest exponent is drawn in [lo, hi]; elements 0..30 binades below it with random
    24-bit mantissas and signs, some exact zeros; rounded to ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    nb = cols // block
    top = torch.randint(lo, hi + 1, (rows, nb, 1), generator=g)
    drop = torch.randint(0, 31, (rows, nb, block), generator=g)
    drop[..., 0] = 0
    mant = torch.rand((rows, nb, block), generator=g, dtype=torch.float64) + 1.0
    x = (mant * torch.pow(2.0, (top - drop).double())).float()
    x = torch.where(torch.rand(x.shape, generator=g) < 0.5, -x, x)
    x = torch.where(torch.rand(x.shape, generator=g) < 0.03, torch.zeros_like(x), x)
    return x.reshape(rows, cols).to(dtype)


RANGES = {torch.float32: (-140, 127), torch.bfloat16: (-133, 127), torch.float16: (-24, 15)}


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_mx_random_all_ranges(dtype, rule):
    lo, hi = RANGES[dtype]
    assert_mx_equal(structured(24, 512, dtype, seed=DTYPES.index(dtype) * 2 + RULES.index(rule), lo=lo, hi=hi), rule)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mx_gaussian_and_3d_input(dtype):
    x = (torch.randn(3, 5, 96) * 4).to(dtype)
    for rule in RULES:
        assert_mx_equal(x, rule)
    # non-contiguous 2-D input: the kernel reads the strides
    y = torch.randn(64, 40).to(dtype).t()
    for rule in RULES:
        assert_mx_equal(y[:, :32], rule)


def block(values, fill=0.0, n=32):
    x = torch.full((1, n), fill)
    x[0, : len(values)] = torch.tensor(values, dtype=torch.float32)
    return x


HAND_MADE = {
    "zeros": block([]),
    "negative_zero": block([-0.0, -0.0, 0.0]),
    "max_448": block([448.0, -448.0, 447.0, 449.0, 464.0, 465.0, 480.0, 1.0]),
    "clip_above_448_floor": block([500.0, 511.0, -510.0, 3.0, 17.0, 19.0]),
    "round_up_to_next_binade": block([256.0, 15.5, 15.9, 31.0, 0.9999, 1.9999, 240.0, 248.0, 249.0]),
    "rceil_exact_power": block([448.0 * 2**-20, 448.0 * 2**-20 * 1.0000001, 1.0]),
    "subnormal_elements": block([1.0, 2.0**-17, 2.0**-18, 3 * 2.0**-18, 2.0**-16, 5 * 2.0**-18, 7 * 2.0**-19]),
    "tiny_values_flush": block([1e6, 1e-3, 1e-30, -1e-38, 1e-45]),
    "fp32_subnormal_block": block([2.0**-130, -(2.0**-131), 3 * 2.0**-140, TINY, 2.0**-128]),
    "rceil_subnormal_boundary": block([(1.75 + 2**-23) * 2.0**-119, 2.0**-125]),
    "rceil_subnormal_boundary_up": block([(1.75 + 2 * 2**-23) * 2.0**-119]),
    "rceil_boundary_down": block([1.75 * 2.0**-119, -(2.0**-120)]),
    "nan_block": block([1.0, float("nan"), 3.0, -2.0]),
    "negative_nan_block": block([1.0, -float("nan"), 0.25]),
    "inf_block": block([float("inf"), 1.0, -float("inf"), 300.0]),
    "all_nan": block([], fill=float("nan")),
    "mixed_signs": block([-1.0, 1.0, -0.5, 0.5, -3.0, 2.5, -448.0, 7.0]),
    "huge": block([3e38, -1e38, 1e30, 1.0]),
    "fp32_max": block([3.4028234663852886e38, 1.0]),
}


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_mx_hand_made_blocks(dtype, rule):
    x = torch.cat(list(HAND_MADE.values())).to(dtype)
    assert_mx_equal(x, rule)


def test_nonfinite_blocks_get_nan_scale_and_nan_elements():
    x = torch.cat([HAND_MADE["nan_block"], HAND_MADE["negative_nan_block"], HAND_MADE["inf_block"]])
    e, c = mx_quantize_triton(x, "floor")
    assert (c == 0xFF).all()
    assert u8(e)[0, 1] == 0x7F and u8(e)[1, 1] == 0xFF  # NaN keeps its sign
    assert u8(e)[2, 0] == 0x7E and u8(e)[2, 2] == 0xFE  # +-Inf saturate, the block scale is NaN
    assert e[2].float()[1] == 1.0  # finite values of the block are still quantized with the finite amax


def test_rceil_tiny_amax_clamps_to_the_smallest_scale():
    """amax < 448 * 2^-150 (the fp32 division amax / 448 underflows to 0): the scale is E8M0's smallest
    (code 0) in the kernels and in the reference, and the elements flush to zero."""
    x = block([2.0**-142, -(2.0**-145), TINY])
    e, c = mx_quantize_triton(x, "rceil")
    re, rc = mx_quantize(x, -1, "rceil")
    assert int(c) == 0 and int(rc) == 0
    assert torch.equal(u8(e), u8(re)) and (e.float() == 0).all()


def test_mx_refuses_bad_shapes_and_dtypes():
    with pytest.raises(ValueError, match="multiple of 32"):
        mx_quantize_triton(torch.zeros(2, 40))
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        mx_quantize_triton(torch.zeros(2, 32, dtype=torch.float64))
    with pytest.raises(ValueError, match="scale rule"):
        mx_quantize_triton(torch.zeros(2, 32), "ceil")


# ---------------------------------------------------------------------------------------------------
# 1x128 (one pass, both copies) and 128x128


def padded(x, br, bc):
    R, C = x.shape
    return torch.nn.functional.pad(x, (0, -C % bc, 0, -R % br))  # in x's dtype: a round trip rewrites NaN bits


def assert_blockwise(x8, s, x, block, rule):
    R, C = x.shape
    re, rc = block_quantize(padded(x, *block), block, rule)
    diff = (u8(x8) != u8(re[:R, :C])).nonzero()
    assert diff.numel() == 0, [(x[tuple(i)].item(), u8(x8)[tuple(i)].item(), u8(re)[tuple(i)].item())
                               for i in diff[:5].tolist()]
    want = codes_to_descale(rc[: s.shape[0]] if block[0] == 1 else rc)
    assert torch.equal(bits(s), bits(want))


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_1x128_dual_pass_matches_reference_on_x_and_its_transpose(dtype, rule):
    lo, hi = RANGES[dtype]
    x = structured(256, 384, dtype, seed=7, lo=lo, hi=hi, block=128)
    x[3, :8] = torch.tensor([float("nan"), 1, 2, 3, 4, 5, 6, 7], dtype=dtype)  # a NaN row block and column block
    x[200, 300] = float("inf")
    x8, s, xt8, st = quantize_1x128(x, rule)
    # layouts torch's blockwise scaled GEMM wants: row-major fp8, outer-dim-major scales
    assert x8.shape == (256, 384) and x8.is_contiguous() and xt8.shape == (384, 256) and xt8.is_contiguous()
    assert s.shape == (256, 3) and s.stride() == (1, 256) and st.shape == (384, 2) and st.stride() == (1, 384)
    assert_blockwise(x8, s, x, (1, 128), rule)
    assert_blockwise(xt8, st, x.t(), (1, 128), rule)
    assert torch.isnan(s[3, 0]) and torch.isnan(st[0, 0]) and torch.isnan(s[200, 2]) and torch.isnan(st[300, 1])


@pytest.mark.parametrize("rule", RULES)
def test_1x128_single_copies_tails_and_strided_input(rule):
    x = (torch.randn(150, 200) * 10).to(torch.bfloat16)  # neither dim a multiple of 128: zero-padding semantics
    x8, s, xt8, st = quantize_1x128(x, rule, row=True, col=False)
    assert xt8 is None and st is None and s.shape == (150, 2)
    assert_blockwise(x8, s, x, (1, 128), rule)
    x8, s, xt8, st = quantize_1x128(x, rule, row=False, col=True)
    assert x8 is None and s is None and st.shape == (200, 2)
    assert_blockwise(xt8, st, x.t(), (1, 128), rule)
    # a transposed view as input: quantizing x.t() along its last dim
    y8, ys, _, _ = quantize_1x128(x.t(), rule, row=True, col=False)
    assert torch.equal(u8(y8), u8(xt8)) and torch.equal(bits(ys), bits(st))


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_128x128_weight_tiles(dtype, rule):
    lo, hi = RANGES[dtype]
    w = structured(256, 640, dtype, seed=11, lo=lo, hi=hi, block=128)
    w[130, 5] = float("nan")
    w8, s, wt8, st = quantize_128x128(w, rule)
    assert s.shape == (2, 5) and st.shape == (5, 2)
    assert scale_storage(s).shape == (2, 8) and scale_storage(st).shape == (5, 4)  # rows padded to x4
    assert_blockwise(w8, s, w, (128, 128), rule)
    # the transposed copy is the transposed bytes with the transposed scales (2-D blocks)
    assert torch.equal(u8(wt8), u8(w8).t()) and torch.equal(bits(st), bits(s.t()))
    assert torch.isnan(s[1, 0]) and not torch.isnan(s[0, 0])
    assert (scale_storage(s)[:, 5:] == 1.0).all()


def test_128x128_partial_tiles_and_hand_made_values():
    hand = torch.cat(list(HAND_MADE.values()))  # (19, 32): one partial tile
    for rule in RULES:
        w8, s, _, _ = quantize_128x128(hand, rule)
        assert_blockwise(w8, s, hand, (128, 128), rule)
        # per row: the 1x128 path on the same hand-made rows
        x8, xs, _, _ = quantize_1x128(hand, rule, col=False)
        assert_blockwise(x8, xs, hand, (1, 128), rule)


def test_blockwise_refuse():
    with pytest.raises(ValueError, match="2-D"):
        quantize_1x128(torch.zeros(2, 3, 128))
    with pytest.raises(ValueError, match="row copy, the column copy"):
        quantize_128x128(torch.zeros(128, 128), row=False, col=False)


def test_varying_token_counts_share_one_tuning():
    """The column count of a transposed copy is the token count, which unpad changes every batch: the
    autotuners key on its bucket, never the exact count (a new count must not re-benchmark every config),
    and later launches skip the autotuner (gemcompile.lowering.common.tuned_launch.launch)."""
    from gemcompile.lowering.common import tuned_launch as shared

    for kernel in (mqt._mx_kernel, mqt._block_kernel):
        assert "C" not in kernel.keys and "C_BUCKET" in kernel.keys, kernel.keys
    shared._BEST_CONFIG.clear()
    for tokens in (300, 333, 410):  # one bucket (512); the transposed copy's C is the token count
        x = torch.randn(256, tokens, dtype=torch.float32)
        quantize_1x128(x, row=False)
    tuned = [key for key in shared._BEST_CONFIG if key[0] is mqt._block_kernel]
    assert len(tuned) == 1 and tuned[0][1] == 512


@pytest.mark.parametrize("tile", [False, True])
@pytest.mark.parametrize("shape,pad_to", [((150, 200), (160, 256)), ((0, 128), (16, 128)), ((130, 5), (144, 128)),
                                          ((256, 384), (256, 384))])
def test_padded_outputs_equal_quantizing_the_zero_padded_input(shape, pad_to, tile):
    # GEMM alignment without a padded copy of x: the bytes and scales of quantizing F.pad(x), for every copy
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * 30).to(torch.bfloat16)
    if x.numel():
        x[0, 0] = float("nan")  # a non-finite block next to the padding keeps its NaN scale
    fn = quantize_128x128 if tile else quantize_1x128
    want = fn(torch.nn.functional.pad(x, (0, pad_to[1] - shape[1], 0, pad_to[0] - shape[0])), "floor")
    for source in (x, x.t().contiguous().t()):  # contiguous and transposed-view inputs
        got = fn(source, "floor", pad_to=pad_to)
        for name, a, b in zip(("x8", "s", "xt8", "st"), got, want):
            assert a.shape == b.shape and a.stride() == b.stride(), name
            assert torch.equal(bits(a) if a.dtype == torch.float32 else u8(a),
                               bits(b) if b.dtype == torch.float32 else u8(b)), name


def test_pad_to_smaller_than_the_input_is_refused():
    with pytest.raises(ValueError, match="smaller than the input"):
        quantize_1x128(torch.zeros(32, 128), pad_to=(16, 128))


@pytest.mark.parametrize("transpose_codes", [True, False], ids=["codes", "bytes"])
@pytest.mark.parametrize("dtype,rule", [(torch.bfloat16, "floor"), (torch.float32, "rceil"), (torch.float16, "rceil")])
def test_transposed_codes_path_writes_the_reference_bytes(dtype, rule, transpose_codes, monkeypatch):
    """Both transposed copies, the default (int32 codes transposed before the byte cast) and
    GEMCOMPILE_FP8_TRANSPOSE_CODES=0's (bytes transposed): the same bytes and scales as the reference for the
    dual and the column-only copies, tails, padding and a strided input."""
    monkeypatch.setattr(mqt, "TRANSPOSE_CODES", transpose_codes)
    lo, hi = RANGES[dtype]
    x = structured(160, 256, dtype, seed=21, lo=lo, hi=hi, block=128)
    x[3, :8] = torch.tensor([float("nan"), 1, 2, 3, 4, 5, 6, 7], dtype=dtype)
    x[150, 130] = float("inf")
    source = x[:, :200]  # a row stride that is not the width; a tail in the column dim
    for row in (True, False):
        x8, s, xt8, st = quantize_1x128(source, rule, row=row, col=True)
        assert_blockwise(xt8, st, source.t(), (1, 128), rule)
        if row:
            assert_blockwise(x8, s, source, (1, 128), rule)
        w8, ws, wt8, wst = quantize_128x128(source, rule, row=row, col=True)  # the weight copy takes it too
        want8, wants = block_quantize(padded(source.t(), 128, 128), (128, 128), rule)
        assert torch.equal(u8(wt8), u8(want8[:200, :160])) and torch.equal(bits(wst), bits(codes_to_descale(wants)))
        if row:
            assert torch.equal(u8(w8).t(), u8(wt8)) and torch.equal(bits(ws).t(), bits(wst))
    got = quantize_1x128(x[:150, :200], rule, pad_to=(160, 256))  # tails in both dims, padded outputs
    want = quantize_1x128(torch.nn.functional.pad(x[:150, :200], (0, 56, 0, 10)), rule)
    for a, b in zip(got, want):
        assert torch.equal(bits(a) if a.dtype == torch.float32 else u8(a),
                           bits(b) if b.dtype == torch.float32 else u8(b))


def test_transposed_codes_path_has_its_own_configs():
    """The codes path (1x128 and 128x128 transposed copies) is tuned over its own list (the one config seen
    exact and fast on the GPU), the byte path and launches without a transposed copy over theirs."""
    configs = [type("C", (), {"kwargs": {"CHUNK": c}, "num_warps": w})() for c, w in ((16, 4), (16, 8), (32, 8),
                                                                                    (32, 4))]
    shapes = lambda kept: [(c.kwargs["CHUNK"], c.num_warps) for c in kept]
    assert shapes(mqt._block_prune(configs, {}, TRANSPOSE_CODES=True, WRITE_COL=True, TILE=False)) == [(32, 4)]
    assert shapes(mqt._block_prune(configs, {}, TRANSPOSE_CODES=False, WRITE_COL=True, TILE=False)) == [
        (16, 4), (16, 8), (32, 8)]
    assert shapes(mqt._block_prune(configs, {}, TRANSPOSE_CODES=True, WRITE_COL=True, TILE=True)) == [(32, 4)]
    assert shapes(mqt._block_prune(configs, {}, TRANSPOSE_CODES=True, WRITE_COL=False, TILE=True)) == [
        (16, 4), (16, 8), (32, 8)]
