"""MXFP8 reference numerics against the OCP MX v1.0 rules, on hand-made blocks."""


import pytest
import torch

from gemcompile.lowering.fp8.numerics import (
    E8M0_NAN,
    block_dequantize,
    block_quantize,
    fake_quantize,
    mx_dequantize,
    mx_quantize,
)

E4M3_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
E4M3_FINITE = E4M3_VALUES[torch.isfinite(E4M3_VALUES)].unique()


def block(*values, fill=0.0):
    """One 32-element block: the given values, then `fill`."""
    x = torch.full((1, 32), fill)
    x[0, : len(values)] = torch.tensor(values)
    return x


def quantize(x, rule="floor"):
    elements, codes = block_quantize(x, (1, 32), rule)
    return elements.float(), int(codes[0, 0])


@pytest.mark.parametrize("rule", ["floor", "rceil"])
def test_exact_powers_of_two_round_trip(rule):
    x = block(1.0, -0.5, 2.0**-6, 0.25)
    elements, code = quantize(x, rule)
    assert torch.equal(block_dequantize(elements.to(torch.float8_e4m3fn), torch.tensor([[code]], dtype=torch.uint8)),
                       x)


def test_floor_scale_is_the_spec_rule_and_saturates():
    # amax 500: floor(log2 500) = 8, X = 2^(8 - 8) = 1, 500 / 1 > 448 -> clamped to 448 (the spec's clipping)
    elements, code = quantize(block(500.0, 3.0))
    assert code == 127 + 0
    assert elements[0, 0] == 448.0 and elements[0, 1] == 3.0
    # amax 1: X = 2^-8, P = 256 (exactly representable)
    elements, code = quantize(block(1.0))
    assert code == 127 - 8 and elements[0, 0] == 256.0


def test_rceil_rounds_the_fp32_descale_up_and_never_clips():
    # 500 / 448 = 1.116 -> X = 2; P = 250 rounds (nearest even) to 256 in E4M3 (neighbours 240 and 256)
    elements, code = quantize(block(500.0, 3.0), "rceil")
    assert code == 127 + 1
    assert elements[0, 0] == 256.0 and elements[0, 1] == 1.5
    # an exact power of two times 448 keeps its exponent: 448 / 448 = 1 -> X = 1
    _, code = quantize(block(448.0), "rceil")
    assert code == 127


def test_elements_round_to_nearest_even_in_e4m3():
    # amax 256 -> X = 1 (floor): 17 sits between 16 and 18 (step 2 in [16, 32)): 17 -> 16 (even mantissa)
    elements, _ = quantize(block(256.0, 17.0, 19.0, -17.0))
    assert elements[0, 1:4].tolist() == [16.0, 20.0, -16.0]
    for value in elements.flatten():
        assert value in E4M3_FINITE


def test_subnormal_elements_and_flush_to_zero():
    # amax 1 -> X = 2^-8: 2^-17 -> P = 2^-9 (the smallest E4M3 subnormal); 2^-18 -> 2^-10: a tie -> 0
    elements, _ = quantize(block(1.0, 2.0**-17, 2.0**-18, 3 * 2.0**-18))
    assert elements[0, 1] == 2.0**-9 and elements[0, 2] == 0.0 and elements[0, 3] == 2 * 2.0**-9


def test_zero_block_gets_the_smallest_scale_and_zero_elements():
    elements, code = quantize(torch.zeros(1, 32))
    assert code == 0 and (elements == 0).all()
    assert (block_dequantize(elements.to(torch.float8_e4m3fn), torch.tensor([[code]], dtype=torch.uint8)) == 0).all()


def test_tiny_block_clamps_the_exponent_to_e8m0_range():
    # amax 2^-140 (an fp32 subnormal): floor gives 2^-148 < 2^-127 -> X = 2^-127, P = 2^-13 -> flushes to 0
    elements, code = quantize(block(2.0**-140))
    assert code == 0 and elements[0, 0] == 0.0
    # amax 2^-120: X = 2^-128 would be needed; clamped to 2^-127, P = 2^7 = 128
    elements, code = quantize(block(2.0**-120))
    assert code == 0 and elements[0, 0] == 128.0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("rule", ["floor", "rceil"])
def test_non_finite_inputs_give_a_nan_scale_and_nan_values(bad, rule):
    x = torch.cat([block(1.0, bad, 2.0), block(1.0, 2.0)], dim=1)  # two blocks: only the first is poisoned
    elements, codes = block_quantize(x, (1, 32), rule)
    assert int(codes[0, 0]) == E8M0_NAN and int(codes[0, 1]) != E8M0_NAN
    decoded = block_dequantize(elements, codes)
    assert decoded[0, :32].isnan().all() and torch.equal(decoded[0, 32:], x[0, 32:])


@pytest.mark.parametrize("rule", ["floor", "rceil"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_blocks_error_bound_and_scale_choice(rule, dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 256, generator=g) * torch.logspace(-20, 20, 64)[:, None]).to(dtype)
    elements, codes = block_quantize(x, (1, 32), rule)
    decoded = block_dequantize(elements, codes)
    blocks = x.float().reshape(64, 8, 32)
    amax = blocks.abs().amax(-1)
    scale = torch.ldexp(torch.ones(codes.shape), codes.to(torch.int32) - 127)
    if rule == "rceil":  # the smallest power of two with amax / X <= 448
        assert (amax / scale <= 448).all() and (amax / (scale / 2) > 448).all()
    else:  # X = 2^(floor(log2 amax) - 8): amax / X in [256, 512)
        assert ((amax / scale >= 256) & (amax / scale < 512)).all()
    # every element within half an E4M3 step (3 mantissa bits: 2^-4 relative) of the unclipped value
    err = (decoded.reshape(64, 8, 32) - blocks).abs()
    clipped = blocks.abs() > 448 * scale[..., None]
    assert (err[~clipped] <= blocks.abs()[~clipped] * 2.0**-4 + scale[..., None].expand_as(err)[~clipped] * 2.0**-10).all()


def test_2d_blocks_are_transpose_invariant():
    """128x128 weight blocks: the transposed tensor quantizes to the transposed elements and scales."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(256, 384, generator=g)
    e, s = block_quantize(w, (128, 128))
    et, st = block_quantize(w.t().contiguous(), (128, 128))
    assert torch.equal(e.float().t(), et.float()) and torch.equal(s.t(), st)


def test_mx_along_any_dim_and_fake_quantize():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 64, 96, generator=g)
    for dim in (1, -1):
        elements, codes = mx_quantize(x, dim)
        assert elements.shape == x.shape and codes.shape[dim] == x.shape[dim] // 32
        decoded = mx_dequantize(elements, codes, dim)
        torch.testing.assert_close(decoded, fake_quantize(x, dim))
        assert (decoded - x).abs().max() <= x.abs().max() * 2.0**-3
    # along dim 1 the 32 elements of a block are x[b, 32 k: 32 k + 32, c]: one scale for them
    elements, codes = mx_quantize(x, 1)
    column = x[0, :32, 5]
    _, code = quantize(column[None])
    assert int(codes[0, 0, 5]) == code


def test_bad_input_errors():
    with pytest.raises(ValueError, match="does not split into 1x32 blocks"):
        block_quantize(torch.randn(2, 33))
    with pytest.raises(ValueError, match="unknown scale rule 'even'"):
        block_quantize(torch.randn(2, 32), rule="even")
    with pytest.raises(TypeError, match="floating-point"):
        block_quantize(torch.ones(2, 32, dtype=torch.int32))
