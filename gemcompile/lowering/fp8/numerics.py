"""Block-scaled FP8 numerics: the exact reference quantize / dequantize (any device, plain PyTorch).

MXFP8 (OCP Microscaling v1.0): blocks of 32 consecutive elements along one dim share a power-of-two
scale X stored as E8M0 (an 8-bit biased exponent, 2^-127 .. 2^127, 0xFF = NaN, no zero, no inf); the
elements are FP8 E4M3 (max normal 448, no inf) and decode as X * P. The same code serves the Hopper
recipe's 2-D blocks (1x128 activations, 128x128 weights) with power-of-two scales.

Scale rules, with amax the block's largest magnitude and emax = 8 (the largest E4M3 exponent):
  floor  X = 2^(floor(log2(amax)) - emax)   (the spec's rule; amax / X may reach ~511: clipped to 448)
  rceil  X = 2^ceil(log2(fp32(amax) / 448)) (NVIDIA's rule: the fp32 descale rounded up to a power of
         two; never clips)
Then P = saturate(round_to_nearest_even_e4m3(V / X)) (V / X is exact: X is a power of two). Exponents are
clamped into E8M0's range: below 2^-127 a block uses 2^-127 (its tiny values flush toward zero), and an
all-zero block gets 2^-127 and zero elements. A block holding NaN or +-Inf gets the NaN scale (0xFF), so
every value it decodes to is NaN: non-finite inputs are never hidden. (With float32 or bfloat16 inputs
the exponent cannot exceed 127 - 8, so the spec's overflow-to-NaN case only arises from non-finite
values.)
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["E4M3_MAX", "E8M0_NAN", "SCALE_RULES", "block_quantize", "block_dequantize", "fake_quantize",
           "mx_quantize", "mx_dequantize"]

E4M3_MAX = 448.0
E4M3_EMAX = 8
E8M0_BIAS = 127
E8M0_NAN = 0xFF
SCALE_RULES = ("floor", "rceil")


def _blocks(x: Tensor, block: tuple[int, int]) -> Tensor:
    """(R, C) -> (R / br, C / bc, br * bc): the elements of each block on the last dim."""
    rows, cols = x.shape
    br, bc = block
    if rows % br or cols % bc:
        raise ValueError(f"a ({rows}, {cols}) tensor does not split into {br}x{bc} blocks; pad it to a multiple "
                         "of the block first")
    return x.reshape(rows // br, br, cols // bc, bc).permute(0, 2, 1, 3).reshape(rows // br, cols // bc, br * bc)


def _unblocks(b: Tensor, shape: tuple[int, int], block: tuple[int, int]) -> Tensor:
    rows, cols = shape
    br, bc = block
    return b.reshape(rows // br, cols // bc, br, bc).permute(0, 2, 1, 3).reshape(rows, cols)


def _scale_exponent(amax: Tensor, rule: str) -> Tensor:
    """Unbiased power-of-two exponent of each block's scale (int32), before clamping; amax is fp32 > 0."""
    if rule == "floor":
        _, e = torch.frexp(amax)  # amax = m * 2^e with m in [0.5, 1): floor(log2(amax)) = e - 1
        return (e - 1 - E4M3_EMAX).to(torch.int32)
    descale = amax / E4M3_MAX  # the fp32 division NVIDIA's rule starts from
    m, e = torch.frexp(descale)
    e = torch.where(m == 0.5, e - 1, e)  # ceil(log2): exact powers of two stay
    # amax < 448 * 2^-150 underflows the division to 0 (frexp gives e = 0): the scale is E8M0's smallest
    return torch.where(m == 0, -E8M0_BIAS, e).to(torch.int32)


def block_quantize(x: Tensor, block: tuple[int, int] = (1, 32), rule: str = "floor") -> tuple[Tensor, Tensor]:
    """x (R, C) float -> (elements (R, C) float8_e4m3fn, scales (R / br, C / bc) uint8 E8M0 codes)."""
    if rule not in SCALE_RULES:
        raise ValueError(f"unknown scale rule {rule!r}; valid: {', '.join(SCALE_RULES)}")
    if x.dim() != 2:
        raise ValueError(f"block_quantize expects a 2-D tensor, got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"block_quantize expects a floating-point tensor, got {x.dtype}")
    blocks = _blocks(x.float(), block)
    finite = torch.isfinite(blocks).all(dim=-1)
    amax = blocks.abs().nan_to_num(0.0, 0.0, 0.0).amax(dim=-1)
    exponent = _scale_exponent(torch.where(amax > 0, amax, 1.0), rule)
    exponent = torch.where(amax > 0, exponent, -E8M0_BIAS).clamp(-E8M0_BIAS, E8M0_BIAS)
    codes = torch.where(finite, exponent + E8M0_BIAS, E8M0_NAN).to(torch.uint8)
    scale = torch.ldexp(torch.ones_like(amax), exponent)  # 2^exponent: exact in fp32 down to 2^-127 (subnormal)
    scaled = blocks / scale[..., None]
    # saturate, then round to nearest even in E4M3. torch's cast rounds to nearest even and (on torch 2.13)
    # also saturates; the explicit clamp states the spec's rule instead of relying on the cast's overflow
    scaled = torch.where(torch.isnan(scaled), scaled, scaled.clamp(-E4M3_MAX, E4M3_MAX))
    elements = _unblocks(scaled, tuple(x.shape), block).to(torch.float8_e4m3fn)
    return elements, codes


def block_dequantize(elements: Tensor, codes: Tensor, block: tuple[int, int] = (1, 32),
                     dtype: torch.dtype = torch.float32) -> Tensor:
    """X * P per block; the NaN scale decodes every element of its block to NaN."""
    exponent = codes.to(torch.int32) - E8M0_BIAS
    scale = torch.ldexp(torch.ones(codes.shape, device=codes.device), exponent)
    scale = torch.where(codes == E8M0_NAN, torch.nan, scale)
    values = _blocks(elements.float(), block) * scale[..., None]
    return _unblocks(values, tuple(elements.shape), block).to(dtype)


def mx_quantize(x: Tensor, dim: int = -1, rule: str = "floor") -> tuple[Tensor, Tensor]:
    """MXFP8 along ``dim`` (blocks of 32 consecutive elements of that dim), any rank. Returns the elements in
    x's layout and the scales with ``dim`` divided by 32."""
    moved = x.movedim(dim, -1)
    flat = moved.reshape(-1, moved.shape[-1])
    elements, codes = block_quantize(flat, (1, 32), rule)
    elements = elements.reshape(moved.shape).movedim(-1, dim)
    codes = codes.reshape(*moved.shape[:-1], moved.shape[-1] // 32).movedim(-1, dim)
    return elements, codes


def mx_dequantize(elements: Tensor, codes: Tensor, dim: int = -1, dtype: torch.dtype = torch.float32) -> Tensor:
    moved = elements.movedim(dim, -1)
    flat = moved.reshape(-1, moved.shape[-1])
    values = block_dequantize(flat, codes.movedim(dim, -1).reshape(flat.shape[0], -1), (1, 32), dtype)
    return values.reshape(moved.shape).movedim(-1, dim)


def fake_quantize(x: Tensor, dim: int = -1, rule: str = "floor") -> Tensor:
    """Quantize-dequantize along ``dim`` in x's dtype: what an emulated MXFP8 GEMM operand computes with."""
    elements, codes = mx_quantize(x, dim, rule)
    return mx_dequantize(elements, codes, dim, x.dtype)
