"""gemcompile::fp8_mm, block-scaled FP8 GEMMs: the op (scaled_mm.py), the reference quantization
(numerics.py) and its bit-exact Triton kernels (quantize_triton.py)."""
