"""A bf16 / fp16 GEMM whose result is only cast to float32 writes float32 itself (post-grad).

Under autocast a float32 parameter's weight gradient is a bf16 GEMM followed by a cast to the
parameter's dtype, ``convert_element_type(mm(dY^T, X), float32)``. The cast is a kernel of its own that
reads 2 bytes and writes 4 per element: over GEM-ref medium's 1.05 B dense parameters about 6 GB a
step, beside the GEMM that wrote the bf16 copy. cuBLAS writes a float32 result from bf16 operands
directly (``aten.mm.dtype``, torch.mm's ``out_dtype``), so the cast and the bf16 copy go.

The float32 result is cuBLAS's float32 accumulator itself, where eager rounds it to bf16 and back: as
accurate or more, not bit-equal to eager.

Matches ``mm`` (not addmm, not the token GEMMs of passes/token_gemm.py, which run before this pass) of two
bf16 or two fp16 CUDA operands whose one user is a cast to float32. Does nothing on a torch whose
``mm.dtype`` has no CUDA kernel or no Inductor lowering.
"""

from __future__ import annotations

import functools

import torch
from torch import fx

from gemcompile.passes.base import GemPass
from gemcompile.passes.graph import copy_source_meta

aten, prims = torch.ops.aten, torch.ops.prims
HALF = (torch.bfloat16, torch.float16)


@functools.cache
def mm_dtype_supported() -> bool:
    """Whether this torch has ``aten.mm.dtype`` for CUDA and Inductor lowers it."""
    overload = getattr(aten.mm, "dtype", None)
    if overload is None or not torch._C._dispatch_has_kernel_for_dispatch_key("aten::mm.dtype", "CUDA"):
        return False
    from torch._inductor.lowering import lowerings

    return overload in lowerings


def _float32_cast_of(mm: fx.Node) -> fx.Node | None:
    """The one user of ``mm`` when it casts mm's bf16 / fp16 CUDA result to float32."""
    if len(mm.users) != 1:
        return None
    (cast,) = mm.users
    if cast.target is not prims.convert_element_type.default or cast.args[1] != torch.float32:
        return None
    a, b = mm.args[:2]
    values = [x.meta.get("val") if isinstance(x, fx.Node) else None for x in (a, b)]
    if not all(isinstance(v, torch.Tensor) and v.device.type == "cuda" for v in values):
        return None
    return cast if values[0].dtype in HALF and values[1].dtype == values[0].dtype else None


class Fp32GemmOutPass(GemPass):
    """convert_element_type(mm(a, b), float32) -> mm.dtype(a, b, float32) (see the module doc)."""

    name = "fp32_gemm_out"
    stage = "post_grad"
    config_section = "fp32_gemm_out"

    def run(self, graph: fx.Graph) -> None:
        if not mm_dtype_supported():
            return
        rewritten = []
        for mm in list(graph.nodes):
            if mm.op != "call_function" or mm.target is not aten.mm.default or mm.kwargs:
                continue
            cast = _float32_cast_of(mm)
            if cast is None:
                continue
            with graph.inserting_before(cast):
                out = graph.call_function(aten.mm.dtype, (mm.args[0], mm.args[1], torch.float32))
            out.meta["val"] = cast.meta["val"]
            copy_source_meta(mm, out)
            cast.replace_all_uses_with(out)
            graph.erase_node(cast)
            graph.erase_node(mm)
            rewritten.append(out)
        if rewritten:
            elements = sum(n.meta["val"].numel() for n in rewritten)
            self.rewrote(rewritten[0], f"{len(rewritten)} x convert_element_type(mm(a, b), torch.float32)",
                         f"{len(rewritten)} x mm.dtype(a, b, torch.float32)",
                         detail=f"{len(rewritten)} bf16 / fp16 GEMMs whose result was only cast to float32 "
                                f"(weight gradients under autocast) write float32 themselves: {elements} "
                                "elements no longer cast by a kernel of their own",
                         metrics={"gemms": len(rewritten), "elements": elements})
