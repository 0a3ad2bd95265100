"""gemcompile::fp8_mm on CPU: exactly the eager reference (emulated_fp8_mm), opcheck, compile, errors, the
fallback warnings (capability checks monkeypatched), and the blockwise GEMM call's scale layouts checked
against torch's own meta checks on fake CUDA tensors (no GPU needed)."""

import os
import warnings

import pytest
import torch
import torch.nn.functional as F

import gemcompile.lowering  # noqa: F401  registers the ops
from gemcompile.lowering.fp8 import scaled_mm as sm
from gemcompile.lowering.fp8.numerics import block_dequantize, block_quantize, fake_quantize

ops = torch.ops.gemcompile
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1" and not torch.cuda.is_available()


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    sm.reset_fallback_warnings()
    monkeypatch.setitem(sm._BLOCKWISE_STATE, "api", None)
    monkeypatch.setitem(sm._BLOCKWISE_STATE, "error", None)
    monkeypatch.setitem(sm._BLOCKWISE_STATE, "choice", {})
    yield
    sm.reset_fallback_warnings()


def operands(M, K, N, dtype, batch=None, seed=0, weight_b=True):
    g = torch.Generator().manual_seed(seed)
    lead = () if batch is None else (batch,)
    a = (torch.randn(*lead, M, K, generator=g) * 3).to(dtype)
    if weight_b and batch is None:
        b = torch.randn(N, K, generator=g).to(dtype).t()  # a transposed weight view, as the pass emits it
    else:
        b = torch.randn(*lead, K, N, generator=g).to(dtype)
    return a, b


@pytest.mark.parametrize("rule", ["floor", "rceil"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_mxfp8_emulated_is_fake_quantize_then_matmul(dtype, rule):
    a, b = operands(48, 96, 40, dtype)
    out = ops.fp8_mm(a, b, "mxfp8_emulated", False, True, rule)
    want = fake_quantize(a, -1, rule) @ fake_quantize(b, 0, rule)
    assert out.dtype == dtype and out.shape == (48, 40) and out.is_contiguous()
    assert torch.equal(out, want)
    assert torch.equal(out, sm.emulated_fp8_mm(a, b, "mxfp8_emulated", False, True, rule))
    # quantization matters: not the plain product
    assert not torch.equal(out, a @ b)


@pytest.mark.parametrize("recipe", ["mxfp8_emulated", "blockwise"])
@pytest.mark.parametrize("shape", [(40, 200, 24), (130, 64, 129), (5, 32, 1)])
def test_op_equals_the_eager_reference_exactly(recipe, shape):
    for dtype in DTYPES:
        for a_w, b_w in ((False, True), (False, False), (True, False)):
            a, b = operands(*shape, dtype, seed=shape[0])
            out = ops.fp8_mm(a, b, recipe, a_w, b_w, "rceil")
            assert torch.equal(out, sm.emulated_fp8_mm(a, b, recipe, a_w, b_w, "rceil"))


def test_batched_operands():
    a, b = operands(20, 64, 12, torch.bfloat16, batch=3)
    for recipe in ("mxfp8_emulated", "blockwise"):
        out = ops.fp8_mm(a, b, recipe, False, True, "floor")
        assert out.shape == (3, 20, 12)
        assert torch.equal(out, sm.emulated_fp8_mm(a, b, recipe, False, True, "floor"))
        for i in range(3):  # each batch entry is quantized on its own
            assert torch.equal(out[i], sm.emulated_fp8_mm(a[i], b[i], recipe, False, True, "floor"))


def test_blockwise_reference_blocks():
    """1x128 along K for activations, 128x128 for the weight operand, zero padding to the block."""
    a, b = operands(70, 200, 150, torch.float32)
    pa = F.pad(a, (0, 56))
    want_a = block_dequantize(*block_quantize(pa, (1, 128), "floor"), (1, 128))[:, :200]
    pw = F.pad(b.t(), (0, 56, 0, 106))
    want_w = block_dequantize(*block_quantize(pw, (128, 128), "floor"), (128, 128))[:150, :200]
    assert torch.equal(sm.emulated_fp8_mm(a, b, "blockwise", False, True, "floor"), want_a @ want_w.t())
    # the weight flag changes the blocks, hence the result
    assert not torch.equal(
        sm.emulated_fp8_mm(a, b, "blockwise", False, True, "floor"),
        sm.emulated_fp8_mm(a, b, "blockwise", False, False, "floor"),
    )


def test_k_not_a_multiple_of_32_is_zero_padded():
    a, b = operands(8, 40, 8, torch.float32)
    out = ops.fp8_mm(a, b, "mxfp8_emulated", False, False, "floor")
    pa, pb = F.pad(a, (0, 24)), F.pad(b, (0, 0, 0, 24))
    want = fake_quantize(pa, -1)[:, :40] @ fake_quantize(pb, 0)[:40]
    assert torch.equal(out, want)


def test_nonfinite_inputs_propagate_as_nan():
    for recipe in ("mxfp8_emulated", "blockwise"):
        a, b = operands(8, 256, 8, torch.bfloat16)
        a = a.clone()
        a[2, 5] = float("nan")
        a[4, 200] = float("inf")
        out = ops.fp8_mm(a, b, recipe, False, True, "floor")
        assert torch.isnan(out[2]).all() and torch.isnan(out[4]).all()
        assert torch.isfinite(out[[0, 1, 3, 5, 6, 7]]).all()


def test_empty_and_zero_k():
    a, b = torch.zeros(0, 64), torch.zeros(64, 8)
    assert ops.fp8_mm(a, b, "blockwise", False, True, "floor").shape == (0, 8)
    out = ops.fp8_mm(torch.zeros(4, 0), torch.zeros(0, 8), "mxfp8_emulated", False, True, "floor")
    assert out.shape == (4, 8) and (out == 0).all()


def test_opcheck():
    for recipe in ("mxfp8_emulated", "blockwise"):
        a, b = operands(16, 128, 32, torch.float32)
        torch.library.opcheck(ops.fp8_mm.default, (a, b, recipe, False, True, "floor"))
    a, b = operands(4, 64, 8, torch.bfloat16, batch=2)
    torch.library.opcheck(ops.fp8_mm.default, (a, b, "mxfp8_emulated", False, False, "rceil"))


def test_compiled_matches_eager_bit_for_bit():
    a, b = operands(64, 128, 48, torch.bfloat16)

    def f(x, w):
        return ops.fp8_mm(x, w, "mxfp8_emulated", False, True, "rceil") * 2

    eager = sm.emulated_fp8_mm(a, b, "mxfp8_emulated", False, True, "rceil") * 2
    compiled = torch.compile(f, fullgraph=True, backend="inductor")(a, b)
    assert torch.equal(compiled, eager)


def test_fake_impl_shapes_and_flops():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    with FakeTensorMode():
        out = ops.fp8_mm(torch.empty(3, 16, 64), torch.empty(3, 64, 8), "blockwise", False, True, "floor")
        assert out.shape == (3, 16, 8)
    a, b = operands(16, 64, 8, torch.float32)
    with FlopCounterMode(display=False) as counter:
        ops.fp8_mm(a, b, "mxfp8_emulated", False, True, "floor")
    assert counter.get_total_flops() == 2 * 16 * 64 * 8


def test_errors():
    a, b = operands(8, 64, 8, torch.float32)
    with pytest.raises(ValueError, match="unknown recipe 'fp8'.*mxfp8_emulated, mxfp8, blockwise"):
        ops.fp8_mm(a, b, "fp8", False, True, "floor")
    with pytest.raises(ValueError, match="unknown scale_rule 'ceil'"):
        ops.fp8_mm(a, b, "mxfp8", False, True, "ceil")
    with pytest.raises(TypeError, match="share one dtype"):
        ops.fp8_mm(a, b.bfloat16(), "blockwise", False, True, "floor")
    with pytest.raises(TypeError, match="share one dtype"):
        ops.fp8_mm(a.double(), b.double(), "blockwise", False, True, "floor")
    with pytest.raises(ValueError, match="cannot be multiplied"):
        ops.fp8_mm(a, b[:32], "blockwise", False, True, "floor")
    with pytest.raises(ValueError, match=r"\(M, K\) @ \(K, N\)"):
        ops.fp8_mm(a[0], b, "blockwise", False, True, "floor")
    with pytest.raises(ValueError, match="cannot be multiplied"):
        ops.fp8_mm(a.expand(2, 8, 64), b.expand(3, 64, 8), "blockwise", False, True, "floor")
    with pytest.raises(RuntimeError, match="no autograd formula"):
        ops.fp8_mm(a.requires_grad_(), b, "blockwise", False, True, "floor")
    with torch.no_grad():
        ops.fp8_mm(a, b, "blockwise", False, True, "floor")


# ---------------------------------------------------------------------------------------------------
# Fallbacks and their warnings


def test_mxfp8_on_cpu_warns_once_and_emulates():
    a, b = operands(8, 64, 8, torch.float32)
    with pytest.warns(sm.Fp8FallbackWarning, match="'mxfp8'.*cpu.*running 'mxfp8_emulated'"):
        out = ops.fp8_mm(a, b, "mxfp8", False, True, "floor")
    assert torch.equal(out, sm.emulated_fp8_mm(a, b, "mxfp8_emulated", False, True, "floor"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ops.fp8_mm(a, b, "mxfp8", False, True, "floor")  # once only
        ops.fp8_mm(a, b, "blockwise", False, True, "floor")  # CPU emulation of blockwise is documented: silent


needs_interpreter = pytest.mark.skipif(not INTERPRETER, reason="runs the CUDA dispatch path's Triton kernels "
                                       "on CPU tensors under the interpreter")


@needs_interpreter
def test_cuda_path_mxfp8_without_native_mx_warns_and_runs_the_emulation(monkeypatch):
    """The CUDA kernel's logic on CPU tensors: native MX reported missing (an H200) -> one warning, then the
    Triton-quantized emulation, which equals the eager reference."""
    monkeypatch.setattr(sm, "native_mx_supported", lambda device: False)
    a, b = operands(16, 64, 24, torch.bfloat16)
    with pytest.warns(sm.Fp8FallbackWarning, match="'mxfp8' asks for native MX.*running 'mxfp8_emulated'"):
        out = sm._fp8_mm_cuda(a, b, "mxfp8", False, True, "rceil")
    assert torch.equal(out, sm.emulated_fp8_mm(a, b, "mxfp8_emulated", False, True, "rceil"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sm._fp8_mm_cuda(a, b, "mxfp8", False, True, "rceil")
    # K not a multiple of 32, batched
    a, b = operands(6, 40, 5, torch.float32, batch=2)
    out = sm._fp8_mm_cuda(a, b, "mxfp8_emulated", False, False, "floor")
    assert torch.equal(out, sm.emulated_fp8_mm(a, b, "mxfp8_emulated", False, False, "floor"))


@needs_interpreter
def test_cuda_path_native_mx_refused_warns_with_the_error(monkeypatch):
    monkeypatch.setattr(sm, "native_mx_supported", lambda device: True)
    a, b = operands(16, 64, 16, torch.bfloat16)
    with pytest.warns(sm.Fp8FallbackWarning, match="'mxfp8'.*refused by torch"):
        out = sm._fp8_mm_cuda(a, b, "mxfp8", False, True, "floor")  # CPU _scaled_mm has no MX path
    assert torch.equal(out, sm.emulated_fp8_mm(a, b, "mxfp8_emulated", False, True, "floor"))


@needs_interpreter
def test_cuda_path_blockwise_unsupported_gpu_warns_and_emulates(monkeypatch):
    monkeypatch.setattr(sm, "native_blockwise_supported", lambda device: False)
    monkeypatch.setattr(sm, "_device_name", lambda device: "FakeGPU (sm_80)")
    a, b = operands(16, 128, 16, torch.bfloat16)
    with pytest.warns(sm.Fp8FallbackWarning, match="'blockwise'.*FakeGPU \\(sm_80\\).*emulated"):
        out = sm._fp8_mm_cuda(a, b, "blockwise", False, True, "floor")
    assert torch.equal(out, sm.emulated_fp8_mm(a, b, "blockwise", False, True, "floor"))


def _scaled_mm_by_the_book(qa, qb, scale_a, scale_recipe_a, scale_b, scale_recipe_b, output_dtype=torch.bfloat16,
                           **kw):
    """A CPU stand-in for F.scaled_mm that reads the scales as torch documents the layouts (v2):
    1x128 a: [m, kb] of (M, K/128); 1x128 b: [n, kb] of (N, K/128); 128x128 a: [kb, mb] of (L4, M/128);
    128x128 b: [kb, nb] of (L4, N/128)."""
    ST = F.ScalingType
    M, K = qa.shape
    N = qb.shape[1]
    kb = K // 128

    def expand(scale, rec, rows):
        if rec == ST.BlockWise1x128:
            assert scale.shape == (rows, kb) and scale.stride() == (1, rows)
            full = scale
        else:
            assert scale.shape[0] % 4 == 0 and scale.stride() == (1, scale.shape[0])
            full = scale[:kb].t().repeat_interleave(128, 0)[:rows]
        return full.repeat_interleave(128, 1)

    da = qa.float() * expand(scale_a, scale_recipe_a, M)
    db = qb.t().float() * expand(scale_b, scale_recipe_b, N)
    return (da @ db.t()).to(output_dtype)


@needs_interpreter
@pytest.mark.parametrize("a_w,b_w", [(False, True), (True, False), (False, False)])
def test_cuda_path_blockwise_gemm_reads_the_scales_it_is_given(monkeypatch, a_w, b_w):
    """The native blockwise path with F.scaled_mm replaced by a by-the-book CPU GEMM: the Triton-quantized
    operands and scales, laid out for cuBLAS, give the emulated reference up to fp32 summation order."""
    monkeypatch.setattr(sm, "native_blockwise_supported", lambda device: True)
    monkeypatch.setattr(sm, "_has_v2", lambda: True)
    monkeypatch.setattr(F, "scaled_mm", _scaled_mm_by_the_book)
    a, b = operands(200, 640, 136, torch.float32, seed=3)  # K/128 = 5: the L4 padding is used
    out = sm._fp8_mm_cuda(a, b, "blockwise", a_w, b_w, "rceil")
    want = sm.emulated_fp8_mm(a, b, "blockwise", a_w, b_w, "rceil")
    assert sm.blockwise_api() == "F.scaled_mm"
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-4)


@needs_interpreter
def test_cuda_path_blockwise_refused_output_dtype_asks_for_a_wider_one(monkeypatch):
    monkeypatch.setattr(sm, "native_blockwise_supported", lambda device: True)
    monkeypatch.setattr(sm, "_has_v2", lambda: True)

    def no_fp16_out(*args, output_dtype=torch.bfloat16, **kw):
        if output_dtype == torch.float16:
            raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED")
        return _scaled_mm_by_the_book(*args, output_dtype=output_dtype, **kw)

    monkeypatch.setattr(F, "scaled_mm", no_fp16_out)
    a, b = operands(128, 256, 128, torch.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = sm._fp8_mm_cuda(a, b, "blockwise", False, True, "floor")
    assert out.dtype == torch.float16 and out.is_contiguous()
    assert sm._BLOCKWISE_STATE["choice"][torch.float16] == ("F.scaled_mm", torch.float32)
    torch.testing.assert_close(out, sm.emulated_fp8_mm(a, b, "blockwise", False, True, "floor"), rtol=2e-3, atol=2e-3)


@needs_interpreter
def test_cuda_path_blockwise_refused_by_torch_warns_once(monkeypatch):
    monkeypatch.setattr(sm, "native_blockwise_supported", lambda device: True)
    a, b = operands(16, 128, 16, torch.bfloat16)
    with pytest.warns(sm.Fp8FallbackWarning, match="'blockwise'.*torch refused"):
        out = sm._fp8_mm_cuda(a, b, "blockwise", False, True, "floor")  # CPU tensors: no cuBLAS
    assert sm.blockwise_api() == "emulated" and sm._BLOCKWISE_STATE["error"]
    assert torch.equal(out, sm.emulated_fp8_mm(a, b, "blockwise", False, True, "floor"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sm._fp8_mm_cuda(a, b, "blockwise", False, True, "floor")


def test_blockwise_two_weights_warn_and_emulate(monkeypatch):
    monkeypatch.setattr(sm, "native_blockwise_supported", lambda device: True)
    a, b = operands(128, 128, 128, torch.float32)
    with pytest.warns(sm.Fp8FallbackWarning, match="both operands flagged as weights"):
        out = sm._fp8_mm_cuda(a, b, "blockwise", True, True, "floor")
    assert torch.equal(out, sm.emulated_fp8_mm(a, b, "blockwise", True, True, "floor"))


# ---------------------------------------------------------------------------------------------------
# The scale layouts against torch's meta checks (fake CUDA tensors: no GPU needed)


@pytest.mark.skipif(not sm._has_v2(), reason="this torch has no F.scaled_mm")
@pytest.mark.parametrize("K", [128, 512, 640, 1024, 1152])
@pytest.mark.parametrize("a_w,b_w", [(False, True), (True, False), (False, False)])
def test_scale_layouts_pass_torch_meta_checks_v2(K, a_w, b_w):
    from torch._subclasses.fake_tensor import FakeTensorMode

    from gemcompile.lowering.fp8.quantize_triton import alloc_outputs

    M, N = 256, 384
    with FakeTensorMode():
        qa, sa, _, _ = alloc_outputs(M, K, "cuda", tile=a_w, col=False)
        qb, sb, _, _ = alloc_outputs(N, K, "cuda", tile=b_w, col=False)
        out = sm.scaled_mm_blockwise(qa, sa, a_w, qb, sb, b_w, torch.bfloat16, "F.scaled_mm")
        assert out.shape == (M, N) and out.dtype == torch.bfloat16
        # the transposed copies (what a dual kernel writes for dgrad / wgrad) fit as well
        _, _, qat, sat = alloc_outputs(K, M, "cuda", tile=a_w, row=False)
        out = sm.scaled_mm_blockwise(qat, sat, a_w, qb, sb, b_w, torch.bfloat16, "F.scaled_mm")
        assert out.shape == (M, N)


@pytest.mark.parametrize("a_w,b_w", [(False, True), (True, False), (False, False)])
def test_scale_layouts_pass_torch_meta_checks_v1(a_w, b_w):
    from torch._subclasses.fake_tensor import FakeTensorMode

    from gemcompile.lowering.fp8.quantize_triton import alloc_outputs

    M, K, N = 256, 1024, 384  # v1 has no row padding: K/128 a multiple of 4
    with FakeTensorMode():
        qa, sa, _, _ = alloc_outputs(M, K, "cuda", tile=a_w, col=False)
        qb, sb, _, _ = alloc_outputs(N, K, "cuda", tile=b_w, col=False)
        out = sm.scaled_mm_blockwise(qa, sa, a_w, qb, sb, b_w, torch.float32, "torch._scaled_mm")
        assert out.shape == (M, N) and out.dtype == torch.float32


def test_mx_scale_swizzle_is_cublas_128x4_layout():
    """cuBLAS's block-scaling factor layout: 128x4 tiles, tile-row-major; inside a tile, (r, c) sits at
    (r % 32) * 16 + (r // 32) * 4 + c; rows padded to 128 and columns to 4."""
    rows, cols = 200, 6
    codes = torch.arange(rows * cols, dtype=torch.int32).reshape(rows, cols)
    flat = sm._to_blocked(codes)
    assert flat.numel() == 256 * 8
    ncb = 2
    for r, c in ((0, 0), (1, 0), (31, 3), (32, 0), (127, 3), (128, 5), (199, 5), (64, 4)):
        tile = (r // 128) * ncb + c // 4
        rr, cc = r % 128, c % 4
        assert flat[tile * 512 + (rr % 32) * 16 + (rr // 32) * 4 + cc] == codes[r, c]


@pytest.mark.parametrize("weight", [False, True])
@pytest.mark.parametrize("k_major", [False, True])
def test_blockwise_operands_are_quantized_padded_without_a_padded_copy(weight, k_major):
    # _blockwise_2d pads M/N to 16 and K to 128 (cuBLAS) inside the quantize kernel; the operand must be
    # the quantized F.pad(x) whether x is row-major or K-major in memory (a weight gradient's dY^T, X^T)
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(200, 150, generator=g) * 8).to(torch.bfloat16)
    if k_major:
        x = x.t().contiguous().t()
    padded = (208, 256)
    q, s = sm._quantize_operand(x, weight, "floor", padded)
    k = sm._triton_kernels()
    fn = k.quantize_128x128 if weight else k.quantize_1x128
    want_q, want_s, _, _ = fn(sm._pad2(x.contiguous(), *padded), "floor", row=True, col=False)
    assert q.shape == padded and q.stride() == want_q.stride()
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert s.shape == want_s.shape and torch.equal(s.view(torch.int32), want_s.view(torch.int32))
