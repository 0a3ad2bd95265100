"""FP8 quantize kernels and gemcompile::fp8_mm on CUDA.

Run on the GPU machine:  python -m pytest -q tests/gpu/test_mx_quantize_gpu.py
* the Triton kernels, both element paths (the hardware e4m3 conversion and the integer path), bit for
  bit against the reference (mx_numerics) run on the CPU, and against the same reference run on CUDA;
* fp8_mm "blockwise" on cuBLAS (sm_90) against its emulation and against a plain bf16 matmul;
* "mxfp8" falls back to "mxfp8_emulated" with a warning on a GPU without native MX (Hopper);
* "mxfp8_emulated" quantizes on the GPU exactly as the reference does.
"""

import os
import warnings

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import gemcompile.lowering  # noqa: F401
from gemcompile.lowering.fp8 import quantize_triton as k
from gemcompile.lowering.fp8 import scaled_mm as sm
from gemcompile.lowering.fp8.numerics import block_quantize, fake_quantize, mx_quantize

ops = torch.ops.gemcompile
DEV = "cuda"
RULES = ["floor", "rceil"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
RANGES = {torch.float32: (-140, 127), torch.bfloat16: (-133, 127), torch.float16: (-24, 15)}
HOPPER = torch.cuda.get_device_capability()[0] == 9


@pytest.fixture(autouse=True, scope="module")
def _cpu_threads():
    """The CPU reference runs on large tensors here: use the GPU host's cores (conftest pins one thread)."""
    before = torch.get_num_threads()
    torch.set_num_threads(min(16, os.cpu_count() or 1))
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _one_config(request, monkeypatch):
    """One launch config per kernel (fewer compiles); the benchmark autotunes, and so does the one test
    named *_autotuned."""
    if request.node.name.endswith("_autotuned"):
        return
    import triton

    monkeypatch.setattr(k._mx_kernel, "configs", [triton.Config({"BLOCK_R": 32}, num_warps=8)])
    monkeypatch.setattr(k._block_kernel, "configs", [triton.Config({"CHUNK": 16}, num_warps=8)])


def u8(t):
    return t.view(torch.uint8)


def assert_bytes_equal(ours, ref, what=""):
    """E4M3 bytes equal; NaN bytes (0x7F / 0xFF) only need to be NaN on both sides (CUDA arithmetic makes
    NaNs canonical, so the reference's NaN sign differs between CPU and CUDA)."""
    a, b = u8(ours).cpu(), u8(ref).cpu()
    nan_a, nan_b = (a & 0x7F) == 0x7F, (b & 0x7F) == 0x7F
    assert torch.equal(nan_a, nan_b), what
    diff = ((a != b) & ~nan_a).nonzero()
    assert diff.numel() == 0, (what, diff[:5].tolist(), a[tuple(diff[0])].item(), b[tuple(diff[0])].item())


def assert_scales_equal(ours, ref_codes, what=""):
    want = k.codes_to_descale(ref_codes.cpu())
    got = ours.float().cpu()
    assert torch.equal(torch.isnan(got), torch.isnan(want)), what
    assert torch.equal(got.nan_to_num(0).contiguous().view(torch.int32), want.nan_to_num(0).view(torch.int32)), what


def structured(rows, cols, dtype, seed, lo, hi, block=32):
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


def inputs(dtype, seed, block=32, rows=1024, cols=4096):
    """Three inputs: the full exponent range (subnormal tiles take the integer path), a range without
    subnormals (hardware conversion path), Gaussian data with a NaN, an Inf and an all-zero block."""
    lo, hi = RANGES[dtype]
    wide = structured(rows, cols, dtype, seed, lo, hi, block)
    normal_lo = -10 if dtype == torch.float16 else -95  # elements reach 30 binades lower: still normal fp32
    normal = structured(rows, cols, dtype, seed + 1, normal_lo, hi, block)
    gauss = (torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed + 2)) * 5).to(dtype)
    gauss[7, 3] = float("nan")
    gauss[rows - 1, cols // 2] = float("inf")
    gauss[rows // 2, :128] = 0
    return {"wide": wide, "normal": normal, "gauss": gauss}


@pytest.mark.parametrize("use_hw", [True, False])
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_mx_kernel_bit_exact(dtype, rule, use_hw):
    for name, x in inputs(dtype, seed=3).items():
        e, c = k.mx_quantize_triton(x.to(DEV), rule, use_hw=use_hw)
        re, rc = mx_quantize(x, -1, rule)  # the reference on the CPU
        assert_bytes_equal(e, re, f"{name} elements")
        assert torch.equal(c.cpu(), rc), name


@pytest.mark.parametrize("rule", RULES)
def test_reference_on_cuda_agrees_with_the_kernel(rule):
    """The reference run on CUDA (plain PyTorch) against the kernel; a failure here with the CPU test
    passing means the reference's CUDA arithmetic (frexp, ldexp, division) differs from its CPU one."""
    for dtype in DTYPES:
        for name, x in inputs(dtype, seed=5, rows=512).items():
            xd = x.to(DEV)
            e, c = k.mx_quantize_triton(xd, rule)
            re, rc = mx_quantize(xd, -1, rule)
            assert_bytes_equal(e, re, f"{dtype} {name}")
            assert torch.equal(c, rc), (dtype, name)


TINY = 2.0**-149


def block(values, fill=0.0, n=32):
    x = torch.full((1, n), fill)
    x[0, : len(values)] = torch.tensor(values, dtype=torch.float32)
    return x


# the same blocks as tests/unit/test_mx_quantize_triton.py
HAND_MADE = [
    block([]),
    block([-0.0, -0.0, 0.0]),
    block([448.0, -448.0, 447.0, 449.0, 464.0, 465.0, 480.0, 1.0]),
    block([500.0, 511.0, -510.0, 3.0, 17.0, 19.0]),
    block([256.0, 15.5, 15.9, 31.0, 0.9999, 1.9999, 240.0, 248.0, 249.0]),
    block([448.0 * 2**-20, 448.0 * 2**-20 * 1.0000001, 1.0]),
    block([1.0, 2.0**-17, 2.0**-18, 3 * 2.0**-18, 2.0**-16, 5 * 2.0**-18, 7 * 2.0**-19]),
    block([1e6, 1e-3, 1e-30, -1e-38, 1e-45]),
    block([2.0**-130, -(2.0**-131), 3 * 2.0**-140, TINY, 2.0**-128]),
    block([(1.75 + 2**-23) * 2.0**-119, 2.0**-125]),
    block([(1.75 + 2 * 2**-23) * 2.0**-119]),
    block([1.75 * 2.0**-119, -(2.0**-120)]),
    block([1.0, float("nan"), 3.0, -2.0]),
    block([1.0, -float("nan"), 0.25]),
    block([float("inf"), 1.0, -float("inf"), 300.0]),
    block([], fill=float("nan")),
    block([-1.0, 1.0, -0.5, 0.5, -3.0, 2.5, -448.0, 7.0]),
    block([3e38, -1e38, 1e30, 1.0]),
    block([3.4028234663852886e38, 1.0]),
]


@pytest.mark.parametrize("rule", RULES)
def test_hand_made_blocks(rule):
    for dtype in DTYPES:
        rows = HAND_MADE
        no_sub = [v for v in rows if ((v.abs() >= 2.0**-126) | (v == 0) | ~torch.isfinite(v)).all()]
        for group in (torch.cat(rows), torch.cat(no_sub)):  # the second takes the hardware path
            x = group.to(dtype)
            for use_hw in (True, False):
                e, c = k.mx_quantize_triton(x.to(DEV), rule, use_hw=use_hw)
                re, rc = mx_quantize(x, -1, rule)
                assert_bytes_equal(e, re, f"{dtype} hw={use_hw}")
                # the documented reference underflow (rceil, amax < 448 * 2^-150) aside, codes agree
                bad = (c.cpu() != rc) & ~((rc == 127) & (c.cpu() == 0) & (rule == "rceil"))
                assert not bad.any(), (dtype, use_hw)


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_1x128_dual_and_128x128_bit_exact(dtype, rule):
    for name, x in inputs(dtype, seed=9, block=128, rows=1024, cols=2048).items():
        x = x[:1000, :1960]  # tails on both dims
        xd = x.to(DEV)
        pad = torch.nn.functional.pad(x, (0, -x.shape[1] % 128, 0, -x.shape[0] % 128))
        R, C = x.shape
        x8, s, xt8, st = k.quantize_1x128(xd, rule)
        re, rc = block_quantize(pad, (1, 128), rule)
        assert_bytes_equal(x8, re[:R, :C], f"{name} 1x128 rows")
        assert_scales_equal(s, rc[:R], f"{name} 1x128 row scales")
        re, rc = block_quantize(pad.t().contiguous(), (1, 128), rule)
        assert_bytes_equal(xt8, re[:C, :R], f"{name} 1x128 transposed copy")
        assert_scales_equal(st, rc[:C], f"{name} 1x128 col scales")
        w8, ws, wt8, wst = k.quantize_128x128(xd, rule)
        re, rc = block_quantize(pad, (128, 128), rule)
        assert_bytes_equal(w8, re[:R, :C], f"{name} 128x128")
        assert_scales_equal(ws, rc, f"{name} 128x128 scales")
        assert torch.equal(u8(wt8), u8(w8).t()) and torch.equal(wst.view(torch.int32), ws.t().view(torch.int32))


def test_integer_and_hardware_paths_agree_on_large_gaussian_autotuned():
    x = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16) * 3
    for rule in RULES:
        a = k.quantize_1x128(x, rule, use_hw=True)
        b = k.quantize_1x128(x, rule, use_hw=False)
        assert torch.equal(u8(a[0]), u8(b[0])) and torch.equal(u8(a[2]), u8(b[2]))
        assert torch.equal(a[1].view(torch.int32), b[1].view(torch.int32))
        assert torch.equal(a[3].view(torch.int32), b[3].view(torch.int32))


# ---------------------------------------------------------------------------------------------------
# fp8_mm


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


needs_hopper = pytest.mark.skipif(not HOPPER, reason="cuBLAS blockwise scaled GEMMs need sm_90")


@needs_hopper
@pytest.mark.parametrize("shape", [(4096, 4096, 4096), (8192, 1024, 2048), (1000, 1000, 600), (256, 128, 384)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_blockwise_native_against_emulation_and_bf16(shape, dtype):
    M, K, N = shape
    g = torch.Generator(device=DEV).manual_seed(0)
    x = torch.randn(M, K, device=DEV, generator=g).to(dtype)
    w = torch.randn(N, K, device=DEV, generator=g).to(dtype)
    dy = torch.randn(M, N, device=DEV, generator=g).to(dtype)
    sm.reset_fallback_warnings()
    with warnings.catch_warnings():
        warnings.simplefilter("error", sm.Fp8FallbackWarning)
        for a, b, a_w, b_w in ((x, w.t(), False, True), (dy, w, False, True), (dy.t(), x, False, False)):
            out = ops.fp8_mm(a, b, "blockwise", a_w, b_w, "rceil")
            assert out.dtype == dtype and out.shape == (a.shape[0], b.shape[1]) and out.is_contiguous()
            emu = sm.emulated_fp8_mm(a, b, "blockwise", a_w, b_w, "rceil")
            assert rel(out, emu) < 1e-2, rel(out, emu)  # same quantized values; accumulation / output rounding
            assert rel(out, a.float() @ b.float()) < 0.08  # fp8 quantization error (~4% on Gaussian data)
    assert sm.blockwise_api() in ("F.scaled_mm", "torch._scaled_mm")


@needs_hopper
def test_blockwise_weight_on_the_left_batched_and_nonfinite():
    x = torch.randn(2, 384, 512, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(2, 512, 256, device=DEV, dtype=torch.bfloat16)
    out = ops.fp8_mm(x, w, "blockwise", True, False, "floor")
    assert rel(out, sm.emulated_fp8_mm(x, w, "blockwise", True, False, "floor")) < 1e-2
    a = torch.randn(256, 512, device=DEV, dtype=torch.bfloat16)
    a[3, 7] = float("nan")
    a[9, 300] = float("inf")
    out = ops.fp8_mm(a, w[0], "blockwise", False, True, "floor")
    assert torch.isnan(out[3]).all() and torch.isnan(out[9]).all()
    assert torch.isfinite(out[torch.arange(256, device=DEV) % 3 == 1]).all()


@needs_hopper
def test_prequantized_pipeline_equals_the_op():
    """What benchmarks/mxfp8_linear.py times: dual-quantized copies reused across forward, dgrad, wgrad."""
    M, K, N = 2048, 1024, 768
    x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(N, K, device=DEV, dtype=torch.bfloat16)
    dy = torch.randn(M, N, device=DEV, dtype=torch.bfloat16)
    want = (
        ops.fp8_mm(x, w.t(), "blockwise", False, True, "rceil"),
        ops.fp8_mm(dy, w, "blockwise", False, True, "rceil"),
        ops.fp8_mm(dy.t(), x, "blockwise", False, False, "rceil"),
    )
    api = sm.blockwise_api()  # the API the op found working
    x8, sx, xt8, sxt = k.quantize_1x128(x, "rceil")
    w8, sw, wt8, swt = k.quantize_128x128(w, "rceil")
    dy8, sdy, dyt8, sdyt = k.quantize_1x128(dy, "rceil")
    y = sm.scaled_mm_blockwise(x8, sx, False, w8, sw, True, torch.bfloat16, api)
    dx = sm.scaled_mm_blockwise(dy8, sdy, False, wt8, swt, True, torch.bfloat16, api)
    dw = sm.scaled_mm_blockwise(dyt8, sdyt, False, xt8, sxt, False, torch.bfloat16, api)
    for got, ref in zip((y, dx, dw), want):
        torch.testing.assert_close(got, ref, rtol=0, atol=0)


@pytest.mark.skipif(sm.native_mx_supported(torch.device(DEV)), reason="this GPU has native MX")
def test_mxfp8_falls_back_with_a_warning_naming_both_recipes():
    sm.reset_fallback_warnings()
    a = torch.randn(512, 256, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(256, 384, device=DEV, dtype=torch.bfloat16)
    with pytest.warns(sm.Fp8FallbackWarning, match=r"'mxfp8' asks for native MX.*which .*\(sm_\d+\) does not have; running 'mxfp8_emulated'"):
        out = ops.fp8_mm(a, b, "mxfp8", False, True, "rceil")
    assert torch.equal(out, ops.fp8_mm(a, b, "mxfp8_emulated", False, True, "rceil"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", sm.Fp8FallbackWarning)
        ops.fp8_mm(a, b, "mxfp8", False, True, "rceil")


@pytest.mark.parametrize("dtype", DTYPES)
def test_mxfp8_emulated_on_cuda_quantizes_like_the_reference(dtype):
    a = (torch.randn(1024, 2048) * 4).to(dtype)
    b = torch.randn(2048, 512).to(dtype)
    for rule in RULES:
        fa = sm._fake_quantize_mx_cuda(a.to(DEV), -1, rule)
        fb = sm._fake_quantize_mx_cuda(b.to(DEV), -2, rule)
        assert torch.equal(fa.cpu(), fake_quantize(a, -1, rule))
        assert torch.equal(fb.cpu(), fake_quantize(b, 0, rule))
        out = ops.fp8_mm(a.to(DEV), b.to(DEV), "mxfp8_emulated", False, True, rule)
        assert rel(out.cpu(), sm.emulated_fp8_mm(a, b, "mxfp8_emulated", False, True, rule)) < 5e-3


def test_mxfp8_emulated_compiled_matches_eager_on_cuda():
    a = torch.randn(512, 256, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(384, 256, device=DEV, dtype=torch.bfloat16).t()

    def f(x, w):
        return ops.fp8_mm(x, w, "mxfp8_emulated", False, True, "rceil")

    torch.testing.assert_close(torch.compile(f, fullgraph=True)(a, b), f(a, b), rtol=0, atol=0)


@pytest.mark.parametrize("rule", RULES)
def test_mx_kernel_on_a_transposed_view(rule):
    """A column-major operand (b of a @ b quantized along K): the same bytes as its contiguous copy."""
    b = torch.randn(2048, 512, device=DEV, dtype=torch.bfloat16)
    e, c = k.mx_quantize_triton(b.t(), rule)
    e2, c2 = k.mx_quantize_triton(b.t().contiguous(), rule)
    assert torch.equal(e.view(torch.uint8), e2.view(torch.uint8)) and torch.equal(c, c2)


def _mismatch(ours, ref) -> str:
    """Where two uint8/int32 views differ: count and the first few (row, col) positions."""
    diff = (ours != ref).nonzero()
    return f"{diff.shape[0]} of {ours.numel()} differ, first at {diff[:4].tolist()}"


@pytest.mark.parametrize("shape", [(65536, 4096), (8192, 2048), (1000, 1960)])
def test_transposed_only_copy_against_the_reference_autotuned(shape):
    """The transposed-only 1x128 copy (row=False: the wgrad operand), autotuned, against the reference
    quantization of x.T run on CUDA, and against the dual call."""
    g = torch.Generator(device=DEV).manual_seed(0)
    x = torch.randn(*shape, device=DEV, generator=g).to(torch.bfloat16)
    R, C = shape
    _, _, xt8, st = k.quantize_1x128(x, "rceil", row=False)
    _, _, dual_t8, dual_st = k.quantize_1x128(x, "rceil")
    pad = torch.nn.functional.pad(x, (0, -C % 128, 0, -R % 128))
    re, rc = block_quantize(pad.t().contiguous(), (1, 128), "rceil")
    want8, want_s = u8(re[:C, :R]), k.codes_to_descale(rc[:C]).view(torch.int32)
    got8, got_s = u8(xt8), st.float().contiguous().view(torch.int32)
    problems = []
    if not torch.equal(got8, want8):
        problems.append(f"row=False bytes vs reference: {_mismatch(got8, want8)}")
    if not torch.equal(got_s, want_s):
        problems.append(f"row=False scales vs reference: {_mismatch(got_s, want_s)}")
    if not torch.equal(u8(dual_t8), want8):
        problems.append(f"dual bytes vs reference: {_mismatch(u8(dual_t8), want8)}")
    if not torch.equal(dual_st.float().contiguous().view(torch.int32), want_s):
        problems.append("dual scales vs reference")
    assert not problems, "; ".join(problems)


@pytest.mark.parametrize("tile", [False, True])
def test_padded_outputs_equal_quantizing_the_padded_input_on_cuda(tile):
    # blockwise GEMM operands are padded inside the kernel (pad_to), not by an F.pad copy: same bytes
    x = (torch.randn(1000, 600, device=DEV) * 30).to(torch.bfloat16)
    fn = k.quantize_128x128 if tile else k.quantize_1x128
    want = fn(torch.nn.functional.pad(x, (0, 40, 0, 8)), "rceil")
    for source in (x, x.t().contiguous().t()):
        got = fn(source, "rceil", pad_to=(1008, 640))
        for name, a, b in zip(("x8", "s", "xt8", "st"), got, want):
            assert a.shape == b.shape, name
            assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a.view(torch.int32),
                               b.view(torch.uint8) if b.element_size() == 1 else b.view(torch.int32)), name


@pytest.mark.parametrize("warps", [4, 8])
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_transposed_codes_path_against_the_reference(dtype, rule, warps, monkeypatch):
    """The default transposed copy (int32 codes transposed before the byte cast), at CHUNK 32 and
    the listed 4 warps plus 8, dual and column-only, inputs with tails, padding and a row stride that is not
    a multiple of 16, against the CPU reference (not against the other kernel). A scratch copy of this path
    was exact at 4 and 8 warps on an H100 and wrong at 16 (2026-12-06); this test passing on an H100 (2026-12-06)
    is what turned it on."""
    import triton

    monkeypatch.setattr(k, "TRANSPOSE_CODES", True)
    monkeypatch.setattr(k._block_kernel, "configs", [triton.Config({"CHUNK": 32}, num_warps=warps)])
    for name, x in inputs(dtype, seed=29, block=128, rows=1024, cols=2048).items():
        for shape, pad_to in (((1000, 1960), None), ((600, 600), (608, 608)), ((4096 // 4, 600), None)):
            src = x[: shape[0], : shape[1]]  # row stride 2048: every case reads a strided view
            R_out, C_out = pad_to or shape
            pad = torch.nn.functional.pad(src, (0, C_out - shape[1], 0, R_out - shape[0]))
            pad = torch.nn.functional.pad(pad, (0, -C_out % 128, 0, -R_out % 128))
            want_t, want_ts = block_quantize(pad.t().contiguous(), (1, 128), rule)
            want_r, want_rs = block_quantize(pad, (1, 128), rule)
            for row in (True, False):
                x8, s, xt8, st = k.quantize_1x128(src.to(DEV), rule, row=row, col=True, pad_to=pad_to)
                assert_bytes_equal(xt8, want_t[:C_out, :R_out], f"{name} {shape} transposed copy, row={row}")
                assert_scales_equal(st, want_ts[:C_out], f"{name} {shape} transposed scales, row={row}")
                if row:
                    assert_bytes_equal(x8, want_r[:R_out, :C_out], f"{name} {shape} row copy")
                    assert_scales_equal(s, want_rs[:R_out], f"{name} {shape} row scales")
                # the 128x128 weight copy's transposed bytes take the same path
                w8, ws, wt8, wst = k.quantize_128x128(src.to(DEV), rule, row=row, col=True, pad_to=pad_to)
                want_w, want_ws = block_quantize(pad.t().contiguous(), (128, 128), rule)
                assert_bytes_equal(wt8, want_w[:C_out, :R_out], f"{name} {shape} 128x128 transposed, row={row}")
                assert_scales_equal(wst, want_ws, f"{name} {shape} 128x128 transposed scales, row={row}")
