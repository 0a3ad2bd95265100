"""``gemcompile::fp8_mm``: a GEMM whose operands are quantized to block-scaled FP8 along the reduction dim.

Public op (what the MXFP8 graph pass emits; the schema is fixed)::

    torch.ops.gemcompile.fp8_mm(Tensor a, Tensor b, str recipe, bool a_is_weight, bool b_is_weight,
                                str scale_rule) -> Tensor

``out = a @ b`` in a's dtype: a (M, K), b (K, N), any strides (b is typically a transposed weight view),
or batched (Bt, M, K) @ (Bt, K, N). Both operands are quantized along K, the reduction dim, which serves
forward (X, W along K), dgrad (dY along N, W) and wgrad (dY^T and X along tokens) alike. a and b share
one dtype: bfloat16, float16 or float32. scale_rule: "floor" (OCP MX spec) or "rceil" (NVIDIA, never
clips). Output: a new contiguous tensor.

Recipes
-------
``mxfp8_emulated``
    OCP MXFP8: E4M3 elements, E8M0 scales over 1x32 blocks along K, exact quantize-dequantize
    (numerics.py), then a plain matmul in a's dtype. On every device it equals, bit for bit on CPU,
    ``emulated_fp8_mm`` (= ``fake_quantize(a, -1) @ fake_quantize(b, -2)``, K zero-padded to a multiple
    of 32 for the quantization), so a compiled model matches an eager model applying the same
    quantize-dequantize. On CUDA the quantization runs in the Triton kernel (bit-exact with the
    reference), the dequantization and the matmul in PyTorch.
``mxfp8``
    The same numerics on hardware MX block scaling: ``torch._scaled_mm`` with float8_e8m0fnu scales in
    the swizzled 128x4 layout, on GPUs that have it (CUDA sm_100+). Everywhere else (Hopper, CPU) it runs
    ``mxfp8_emulated`` and warns once (:class:`Fp8FallbackWarning`) naming what was asked and what runs.
    (The native path could not be run on hardware here: it is written from torch's ScaledBlas.cpp checks
    and falls back, with a warning carrying the error, if torch refuses it.)
``blockwise``
    The Hopper speed recipe (DeepSeek-V3 / TE Float8BlockScaling): E4M3 with power-of-two scales (the
    same floor / rceil rules), 1x128 blocks along K for activations and gradients, 128x128 blocks for
    the operand flagged ``*_is_weight`` (transpose invariant: one quantization serves forward and
    dgrad). On CUDA sm_90 with cuBLASLt >= 12.9 the GEMM is cuBLAS's blockwise scaled GEMM, fed by the
    Triton quantize kernels of quantize_triton.py; the API is feature-detected (see
    :func:`blockwise_api`). On CPU the same blocks are emulated (block_quantize / block_dequantize, then
    a matmul in a's dtype): that is the documented CPU behaviour, no warning. On other GPUs (or when
    torch refuses the call, or both operands are weights: cuBLAS has no 128x128 x 128x128) it emulates
    and warns once.

Which torch API runs the blockwise GEMM (from aten/src/ATen/native/cuda/ScaledBlas.cpp, current and an
older revision, and torch 2.13's _meta_registrations.py, whose checks tests/unit/test_scaled_mm.py runs on
fake CUDA tensors; torch 2.11's own build is not checked here, hence the runtime detection below):
* ``torch.nn.functional.scaled_mm(a8, b8, scale_a=, scale_recipe_a=ScalingType.BlockWise1x128 |
  BlockWise128x128, scale_b=, scale_recipe_b=, output_dtype=)`` (``aten::_scaled_mm_v2``, torch >= 2.10,
  so on 2.11 and 2.13; torchao's Float8BlockwiseLinear uses it). 1x128 scales (rows, K/128) with strides
  (1, rows) for a and b alike; 128x128 scales (round_up(K/128, 4), rows/128) with strides (1, L4).
  Preferred.
* ``torch._scaled_mm(a8, b8, scale_a, scale_b, out_dtype=)`` (v1) infers the recipe from the scale
  shapes/strides (``get_joint_scaling``): scale_b is checked transposed, and a 128x128 scale has no L4
  padding (so K is padded to a multiple of 512 there). Fallback.
Both need sm_90 exactly and cuBLASLt >= 12.9 (``_check_deepseek_support``) and a row-major a8 with a
column-major b8. The first call per output dtype tries them in that order (and, if cuBLAS refuses the
output dtype, asks for fp32 / bf16 and casts) and remembers what worked (:func:`blockwise_api`).

Weights: one 128x128 quantization serves forward and dgrad, but the op itself quantizes both operands on
every call (a cache inside the op would go stale under CUDA-graph replay). Reusing W8 / W8^T (and x8^T,
dY8^T) across the three GEMMs of a Linear takes the pre-quantized API: ``quantize_triton.quantize_1x128``
/ ``quantize_128x128`` (one pass writes both layouts) and :func:`scaled_mm_blockwise`, as
benchmarks/mxfp8_linear.py does.

Shapes that are not block multiples: K (and the weight's rows) are zero-padded to the block multiple,
which is exact for a GEMM (a zero-padded block has the amax of its real elements, padded products are
0); the native GEMMs also pad M, N to multiples of 16 (cuBLAS) and slice the result.

Non-finite inputs are never hidden: a block holding NaN or Inf gets a NaN scale, so every output that
reads it is NaN (emulated and native alike).

No autograd: the op belongs in post-grad graphs (the pass emits forward, dgrad and wgrad separately).
Called under autograd with inputs that require grad, it raises a RuntimeError that says so.

FLOPs: 2 * Bt * M * N * K (torch.utils.flop_counter).
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from ..common.opkit import cuda_kernel
from .numerics import SCALE_RULES, block_dequantize, block_quantize, fake_quantize

__all__ = [
    "RECIPES",
    "Fp8FallbackWarning",
    "blockwise_api",
    "emulated_fp8_mm",
    "fp8_mm",
    "native_blockwise_supported",
    "native_mx_supported",
    "reset_fallback_warnings",
]

RECIPES = ("mxfp8_emulated", "mxfp8", "blockwise")
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class Fp8FallbackWarning(UserWarning):
    """A requested FP8 recipe cannot run natively here; an emulation of the same numerics runs instead."""


_WARNED: set = set()


def reset_fallback_warnings() -> None:
    """Forget which fallbacks were reported (each is reported once per process)."""
    _WARNED.clear()


def _warn_once(key, message: str) -> None:
    if key in _WARNED:
        return
    _WARNED.add(key)
    warnings.warn(message, Fp8FallbackWarning, stacklevel=3)


# ---------------------------------------------------------------------------------------------------
# Argument checks (shared by the real and fake impls)


def _check_args(a: Tensor, b: Tensor, recipe: str, a_is_weight: bool, b_is_weight: bool, scale_rule: str) -> None:
    if recipe not in RECIPES:
        raise ValueError(f"fp8_mm: unknown recipe {recipe!r}; valid: {', '.join(RECIPES)}")
    if scale_rule not in SCALE_RULES:
        raise ValueError(f"fp8_mm: unknown scale_rule {scale_rule!r}; valid: {', '.join(SCALE_RULES)}")
    if not isinstance(a, Tensor) or not isinstance(b, Tensor):
        raise TypeError("fp8_mm: a and b must be tensors")
    if a.dtype not in _DTYPES or b.dtype != a.dtype:
        raise TypeError(
            f"fp8_mm: a and b must share one dtype among bfloat16, float16, float32; got {a.dtype} and {b.dtype}"
        )
    if a.dim() not in (2, 3) or b.dim() != a.dim():
        raise ValueError(
            f"fp8_mm: expects (M, K) @ (K, N) or (Bt, M, K) @ (Bt, K, N); got shapes {tuple(a.shape)} and "
            f"{tuple(b.shape)}"
        )
    if a.shape[-1] != b.shape[-2] or a.shape[:-2] != b.shape[:-2]:
        raise ValueError(f"fp8_mm: shapes {tuple(a.shape)} and {tuple(b.shape)} cannot be multiplied")
    if a.device != b.device:
        raise ValueError(f"fp8_mm: a is on {a.device} and b on {b.device}")


def _out_shape(a: Tensor, b: Tensor) -> tuple:
    return (*a.shape[:-1], b.shape[-1])


# ---------------------------------------------------------------------------------------------------
# The eager reference (plain PyTorch, any device)


def _fake_quantize_mx(x: Tensor, dim: int, rule: str) -> Tensor:
    """numerics.fake_quantize along ``dim``; a K that is not a multiple of 32 is zero-padded first."""
    k = x.shape[dim]
    if k % 32 == 0:
        return fake_quantize(x, dim, rule)
    pad_shape = list(x.shape)
    pad_shape[dim] = -k % 32
    padded = torch.cat([x, x.new_zeros(pad_shape)], dim)
    return fake_quantize(padded, dim, rule).narrow(dim, 0, k)


def _fake_quantize_blocks(x: Tensor, block: tuple[int, int], rule: str) -> Tensor:
    """Quantize-dequantize a 2-D x (rows, K) over ``block`` (blocks along K), zero-padded to the block."""
    rows, k = x.shape
    br, bc = block
    padded = F.pad(x, (0, -k % bc, 0, -rows % br))
    elements, codes = block_quantize(padded, block, rule)
    return block_dequantize(elements, codes, block, x.dtype)[:rows, :k]


def _blockwise_fq(x: Tensor, is_weight: bool, rule: str) -> Tensor:
    """x (.., rows, K): each matrix quantized along K, 128x128 if a weight else 1x128."""
    block = (128, 128) if is_weight else (1, 128)
    if x.dim() == 2:
        return _fake_quantize_blocks(x, block, rule)
    return torch.stack([_fake_quantize_blocks(m, block, rule) for m in x.unbind(0)])


def emulated_fp8_mm(
    a: Tensor,
    b: Tensor,
    recipe: str = "mxfp8_emulated",
    a_is_weight: bool = False,
    b_is_weight: bool = False,
    scale_rule: str = "floor",
) -> Tensor:
    """The eager reference of ``fp8_mm`` (any device): both operands quantized-dequantized along K, then
    ``torch.matmul`` in a's dtype. "mxfp8_emulated" and "mxfp8" use 1x32 E8M0 blocks (the *_is_weight
    flags do not matter); "blockwise" uses 1x128 blocks, 128x128 for a weight operand. What the op
    computes on CPU, exactly."""
    _check_args(a, b, recipe, a_is_weight, b_is_weight, scale_rule)
    if recipe == "blockwise":
        qa = _blockwise_fq(a, a_is_weight, scale_rule)
        qb = _blockwise_fq(b.transpose(-2, -1), b_is_weight, scale_rule).transpose(-2, -1)
    else:
        qa = _fake_quantize_mx(a, -1, scale_rule)
        qb = _fake_quantize_mx(b, -2, scale_rule)
    return torch.matmul(qa, qb)


# ---------------------------------------------------------------------------------------------------
# What the device can run (monkeypatched by tests)


def native_mx_supported(device: torch.device) -> bool:
    """Hardware MX block scaling through torch._scaled_mm: CUDA sm_100+ with float8_e8m0fnu in torch."""
    if device.type != "cuda" or not hasattr(torch, "float8_e8m0fnu") or torch.version.hip:
        return False
    return torch.cuda.get_device_capability(device)[0] >= 10


def native_blockwise_supported(device: torch.device) -> bool:
    """cuBLAS 1x128 / 128x128 scaled GEMMs: CUDA sm_90 exactly (torch's _check_deepseek_support)."""
    if device.type != "cuda" or torch.version.hip:
        return False
    return torch.cuda.get_device_capability(device)[0] == 9 and blockwise_api() is not None


def blockwise_api() -> str | None:
    """Which torch API serves blockwise GEMMs: "F.scaled_mm" (torch.nn.functional.scaled_mm with
    ScalingType.BlockWise1x128 / BlockWise128x128, i.e. aten::_scaled_mm_v2; torch 2.10+, so both 2.11 and
    2.13), else "torch._scaled_mm" (v1, recipe inferred from the scale shapes), else None. Once a call
    has run, the one that worked (or "emulated" if torch refused every call tried)."""
    if _BLOCKWISE_STATE["api"] is not None:
        return _BLOCKWISE_STATE["api"]
    if _BLOCKWISE_STATE["choice"]:  # tried, and nothing worked
        return "emulated"
    if _has_v2():
        return "F.scaled_mm"
    return "torch._scaled_mm" if hasattr(torch, "_scaled_mm") else None


def _has_v2() -> bool:
    st = getattr(F, "ScalingType", None)
    return hasattr(F, "scaled_mm") and st is not None and hasattr(st, "BlockWise128x128")


# api: the first API that worked; choice: output dtype -> (api, dtype requested from cuBLAS) or None (refused)
_BLOCKWISE_STATE: dict = {"api": None, "error": None, "choice": {}}


# ---------------------------------------------------------------------------------------------------
# CUDA paths


def _triton_kernels():
    from . import quantize_triton

    return quantize_triton


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def _pad2(x: Tensor, rows: int, cols: int) -> Tensor:
    r, c = x.shape
    return x if (r, c) == (rows, cols) else F.pad(x, (0, cols - c, 0, rows - r))


def _quantize_operand(x: Tensor, weight: bool, rule: str, padded: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """x (rows, K), any strides -> (fp8 (rows', K') row-major, fp32 scales) quantized along K, x zero-padded
    to padded = (rows', K') inside the kernel. F.pad made a fill and a copy per padded operand: with every
    GEM-ref small GEMM in FP8, fills and copies (by their counts, mostly these pads) took 28 of the 127 ms
    of GPU time a step (H200). A K-major-in-memory x (x.t() contiguous, as a weight gradient's dY^T and X^T)
    takes the kernel's transposed write, so the input is read coalesced."""
    k = _triton_kernels()
    fn = k.quantize_128x128 if weight else k.quantize_1x128
    if x.stride(1) != 1 and x.stride(0) == 1:
        _, _, q, s = fn(x.t(), rule, row=False, col=True, pad_to=(padded[1], padded[0]))
    else:
        q, s, _, _ = fn(x, rule, row=True, col=False, pad_to=padded)
    return q, s


def scaled_mm_blockwise(qa, sa, a_weight: bool, qb, sb, b_weight: bool, out_dtype, api: str) -> Tensor:
    """cuBLAS blockwise GEMM of pre-quantized operands: qa (M, K) and qb (N, K) row-major fp8 with the
    scales of quantize_triton.py (1x128: (rows, K/128) strides (1, rows); 128x128: the padded row-major
    tile grid), out = (qa * sa) @ (qb * sb)^T in out_dtype. ``api``: "F.scaled_mm" or "torch._scaled_mm".
    Scale layouts per torch's checks (ScaledBlas.cpp):
      F.scaled_mm / _scaled_mm_v2  1x128: (rows, K/128) strides (1, rows) for a and b alike;
                                   128x128: (L4, rows/128) strides (1, L4), L4 = round_up(K/128, 4)
      torch._scaled_mm (v1)        a 1x128 as above; a 128x128 (M/128, K/128) strides (K/128, 1);
                                   b: scale_b.t() must be b.t()'s scale in those layouts (no L4 padding,
                                   so the caller pads K to a multiple of 512 when a 128x128 operand is used)
    """
    k = _triton_kernels()
    if api == "F.scaled_mm":
        st = F.ScalingType
        sa_arg = k.scale_storage(sa).t() if a_weight else sa
        sb_arg = k.scale_storage(sb).t() if b_weight else sb
        return F.scaled_mm(
            qa,
            qb.t(),
            scale_a=sa_arg,
            scale_recipe_a=st.BlockWise128x128 if a_weight else st.BlockWise1x128,
            scale_b=sb_arg,
            scale_recipe_b=st.BlockWise128x128 if b_weight else st.BlockWise1x128,
            output_dtype=out_dtype,
        )
    return torch._scaled_mm(qa, qb.t(), sa, sb.t(), out_dtype=out_dtype)


def _blockwise_2d(a: Tensor, b: Tensor, a_w: bool, b_w: bool, rule: str, api: str, request) -> Tensor:
    M, K = a.shape
    N = b.shape[1]
    kmult = 512 if (api == "torch._scaled_mm" and (a_w or b_w)) else 128
    Mp, Kp, Np = _round_up(M, 16), _round_up(K, kmult), _round_up(N, 16)
    qa, sa = _quantize_operand(a, a_w, rule, (Mp, Kp))
    qb, sb = _quantize_operand(b.t(), b_w, rule, (Np, Kp))
    out = scaled_mm_blockwise(qa, sa, a_w, qb, sb, b_w, request, api)
    out = out if (Mp, Np) == (M, N) else out[:M, :N]
    return out.to(a.dtype).contiguous()


def _blockwise_run(a, b, a_w, b_w, rule, api, request) -> Tensor:
    if a.dim() == 2:
        return _blockwise_2d(a, b, a_w, b_w, rule, api, request)
    return torch.stack([_blockwise_2d(x, y, a_w, b_w, rule, api, request) for x, y in zip(a.unbind(0), b.unbind(0))])


def _request_dtypes(dtype: torch.dtype) -> list:
    """Output dtypes to ask cuBLAS for, best first (a refused one is replaced by a wider one, then cast)."""
    wider = {torch.float16: [torch.float32, torch.bfloat16], torch.float32: [torch.bfloat16]}
    return [dtype, *wider.get(dtype, [])]


def _blockwise_cuda(a, b, a_w, b_w, rule) -> Tensor | None:
    """The native path, or None when it cannot run (the caller emulates; this warns when torch refuses).
    The first call per output dtype tries the APIs (and output dtypes) until one works and remembers it;
    later calls use it, and their errors propagate."""
    if a_w and b_w:
        _warn_once(
            ("blockwise", "two-weights"),
            "fp8_mm: recipe 'blockwise' with both operands flagged as weights asks for a 128x128 x 128x128 "
            "GEMM, which cuBLAS does not offer; running the same blocks emulated (quantize-dequantize + "
            f"matmul in {a.dtype}) instead",
        )
        return None
    if not native_blockwise_supported(a.device):
        return None
    choice = _BLOCKWISE_STATE["choice"]
    if a.dtype in choice:
        return None if choice[a.dtype] is None else _blockwise_run(a, b, a_w, b_w, rule, *choice[a.dtype])
    apis = [_BLOCKWISE_STATE["api"]] if _BLOCKWISE_STATE["api"] else (
        ["F.scaled_mm"] if _has_v2() else []) + ["torch._scaled_mm"]
    errors = []
    for request in _request_dtypes(a.dtype):
        for api in apis:
            try:
                out = _blockwise_run(a, b, a_w, b_w, rule, api, request)
            except (RuntimeError, ValueError, TypeError, NotImplementedError) as e:  # torch refused this call
                errors.append(f"{api} -> {request}: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
                continue
            choice[a.dtype] = (api, request)
            _BLOCKWISE_STATE["api"] = _BLOCKWISE_STATE["api"] or api
            return out
    choice[a.dtype] = None
    _BLOCKWISE_STATE["error"] = "; ".join(errors)
    _warn_once(
        ("blockwise", "refused", a.dtype),
        f"fp8_mm: recipe 'blockwise' asked for cuBLAS blockwise scaled GEMMs ({a.dtype} output), which torch "
        f"refused here ({_BLOCKWISE_STATE['error']}); running the same blocks emulated (quantize-dequantize + "
        f"matmul in {a.dtype}) instead",
    )
    return None


def _to_blocked(codes: Tensor) -> Tensor:
    """(rows, K/32) E8M0 codes -> cuBLAS's swizzled layout: 128x4 tiles, rows interleaved 0, 32, 64, 96, 1,
    33, ... (as torchao's to_blocked), flattened; rows padded to 128 and columns to 4."""
    rows, cols = codes.shape
    nr, nc = -(-rows // 128), -(-cols // 4)
    padded = codes.new_zeros((nr * 128, nc * 4))
    padded[:rows, :cols] = codes
    blocks = padded.view(nr, 128, nc, 4).permute(0, 2, 1, 3)
    return blocks.reshape(-1, 4, 32, 4).transpose(1, 2).reshape(-1, 32, 16).flatten()


def _mx_native_2d(a: Tensor, b: Tensor, rule: str) -> Tensor:
    k = _triton_kernels()
    M, K = a.shape
    N = b.shape[1]
    Mp, Kp, Np = _round_up(M, 16), _round_up(K, 32), _round_up(N, 16)
    ea, ca = k.mx_quantize_triton(_pad2(a, Mp, Kp), rule)
    eb, cb = k.mx_quantize_triton(_pad2(b.t(), Np, Kp), rule)
    e8m0 = torch.float8_e8m0fnu
    out = torch._scaled_mm(ea, eb.t(), _to_blocked(ca).view(e8m0), _to_blocked(cb).view(e8m0), out_dtype=a.dtype)
    return out if (Mp, Np) == (M, N) else out[:M, :N].contiguous()


def _mx_native_cuda(a, b, rule) -> Tensor | None:
    try:
        if a.dim() == 2:
            return _mx_native_2d(a, b, rule)
        return torch.stack([_mx_native_2d(x, y, rule) for x, y in zip(a.unbind(0), b.unbind(0))])
    except (RuntimeError, ValueError, TypeError, NotImplementedError) as e:
        _warn_once(
            ("mxfp8", "refused"),
            f"fp8_mm: recipe 'mxfp8' (native MX block scaling through torch._scaled_mm) was refused by torch "
            f"here ({str(e).splitlines()[0] if str(e) else type(e).__name__}); running 'mxfp8_emulated' "
            "(exact quantize-dequantize + matmul) instead",
        )
        return None


def _fake_quantize_mx_cuda(x: Tensor, dim: int, rule: str) -> Tensor:
    """fake_quantize along ``dim`` with the Triton MX kernel (bit-exact) and an exact dequantization; the
    same values as numerics.fake_quantize."""
    k = _triton_kernels()
    # contiguous: on the H200 (triton 3.6) the kernel's strided read of a transposed view gave wrong
    # blocks (the interpreter reads it right); one copy of the operand is the emulated recipe's price
    moved = x.movedim(dim, -1).contiguous()
    K = moved.shape[-1]
    if K % 32:
        moved = F.pad(moved, (0, -K % 32))
    elements, codes = k.mx_quantize_triton(moved, rule)
    Kp = moved.shape[-1]
    values = elements.float().view(*codes.shape, 32) * k.codes_to_descale(codes)[..., None]
    values = values.view(*codes.shape[:-1], Kp).to(x.dtype)
    if Kp != K:
        values = values[..., :K]
    return values.movedim(-1, dim)


def _mx_emulated_cuda(a, b, rule) -> Tensor:
    return torch.matmul(_fake_quantize_mx_cuda(a, -1, rule), _fake_quantize_mx_cuda(b, -2, rule))


def _device_name(device: torch.device) -> str:
    if device.type != "cuda":
        return device.type
    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)} (sm_{major}{minor})"


def _warn_mx_fallback(device: torch.device) -> None:
    _warn_once(
        ("mxfp8", str(device.type)),
        f"fp8_mm: recipe 'mxfp8' asks for native MX block scaling (E8M0 scales over 1x32 blocks in the "
        f"tensor cores, CUDA sm_100+), which {_device_name(device)} does not have; running 'mxfp8_emulated' "
        "(exact quantize-dequantize + matmul in the input dtype, the same numerics) instead",
    )


# ---------------------------------------------------------------------------------------------------
# The op


def _zeros_if_empty(a: Tensor, b: Tensor) -> Tensor | None:
    if a.numel() == 0 or b.numel() == 0:
        return a.new_zeros(_out_shape(a, b))
    return None


@torch.library.custom_op("gemcompile::fp8_mm", mutates_args=())
def fp8_mm(a: Tensor, b: Tensor, recipe: str, a_is_weight: bool, b_is_weight: bool, scale_rule: str) -> Tensor:
    """Every device but CUDA: the eager reference (emulated_fp8_mm); "mxfp8" warns once that it emulates."""
    _check_args(a, b, recipe, a_is_weight, b_is_weight, scale_rule)
    empty = _zeros_if_empty(a, b)
    if empty is not None:
        return empty
    if recipe == "mxfp8":
        _warn_mx_fallback(a.device)
    return emulated_fp8_mm(a, b, recipe, a_is_weight, b_is_weight, scale_rule)


@cuda_kernel(fp8_mm)
def _fp8_mm_cuda(a, b, recipe, a_is_weight, b_is_weight, scale_rule):
    _check_args(a, b, recipe, a_is_weight, b_is_weight, scale_rule)
    empty = _zeros_if_empty(a, b)
    if empty is not None:
        return empty
    if recipe == "blockwise":
        out = _blockwise_cuda(a, b, a_is_weight, b_is_weight, scale_rule)
        if out is not None:
            return out
        if not native_blockwise_supported(a.device):
            _warn_once(
                ("blockwise", "device"),
                f"fp8_mm: recipe 'blockwise' asks for cuBLAS 1x128/128x128 blockwise scaled GEMMs (CUDA "
                f"sm_90, cuBLASLt >= 12.9), which {_device_name(a.device)} with torch {torch.__version__} "
                f"does not offer; running the same blocks emulated (quantize-dequantize + matmul in {a.dtype}) "
                "instead",
            )
        return emulated_fp8_mm(a, b, recipe, a_is_weight, b_is_weight, scale_rule)
    if recipe == "mxfp8":
        if native_mx_supported(a.device):
            out = _mx_native_cuda(a, b, scale_rule)
            if out is not None:
                return out
        else:
            _warn_mx_fallback(a.device)
    return _mx_emulated_cuda(a, b, scale_rule)


@fp8_mm.register_fake
def _fp8_mm_fake(a, b, recipe, a_is_weight, b_is_weight, scale_rule):
    _check_args(a, b, recipe, a_is_weight, b_is_weight, scale_rule)
    return a.new_empty(_out_shape(a, b))


_NO_AUTOGRAD = (
    "gemcompile::fp8_mm has no autograd formula: it is a post-grad op (the MXFP8 pass emits the forward, "
    "dgrad and wgrad GEMMs separately). Call it on tensors that do not require grad (or under "
    "torch.no_grad()), or differentiate the model before the pass runs."
)


def _no_autograd_setup(ctx, inputs, output):
    raise RuntimeError(_NO_AUTOGRAD)


def _no_autograd_backward(ctx, grad):
    raise RuntimeError(_NO_AUTOGRAD)


fp8_mm.register_autograd(_no_autograd_backward, setup_context=_no_autograd_setup)


@register_flop_formula(torch.ops.gemcompile.fp8_mm)
def _fp8_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    return 2 * math.prod(a_shape[:-2]) * a_shape[-2] * a_shape[-1] * b_shape[-1]
