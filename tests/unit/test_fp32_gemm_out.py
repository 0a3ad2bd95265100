"""Fp32GemmOutPass on post-grad graphs of fake CUDA tensors: a bf16 / fp16 mm whose one user casts it to
float32 becomes mm.dtype(..., float32); near-misses stay (tests/gpu/test_fp32_gemm_out_gpu.py runs it)."""

import pytest
import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode

from gemcompile import GemConfig
from gemcompile.passes import fp32_gemm_out
from gemcompile.passes.fp32_gemm_out import Fp32GemmOutPass

aten, prims = torch.ops.aten, torch.ops.prims


def _graph(dtype=torch.bfloat16, device="cuda", cast_to=torch.float32, extra_user=False, op=aten.mm.default):
    """a, b [, bias] -> cast(op(...), cast_to) [+ the GEMM returned too], each node with its fake value."""
    mode = FakeTensorMode()
    graph = fx.Graph()
    with mode:
        values = {"a": torch.empty(16, 8, dtype=dtype, device=device),
                  "b": torch.empty(8, 4, dtype=dtype, device=device),
                  "bias": torch.empty(4, dtype=dtype, device=device)}
    nodes = {}
    for name, value in values.items():
        nodes[name] = graph.placeholder(name)
        nodes[name].meta["val"] = value
    args = (nodes["a"], nodes["b"]) if op is aten.mm.default else (nodes["bias"], nodes["a"], nodes["b"])
    gemm = graph.call_function(op, args)
    cast = graph.call_function(prims.convert_element_type.default, (gemm, cast_to))
    with mode:
        gemm.meta["val"] = op(*(n.meta["val"] for n in args))
        cast.meta["val"] = gemm.meta["val"].to(cast_to)
    graph.output((cast, gemm) if extra_user else (cast,))
    return graph


def _run(graph):
    Fp32GemmOutPass(GemConfig()).run(graph)
    return [n.target for n in graph.nodes if n.op == "call_function"]


@pytest.fixture
def supported(monkeypatch):
    monkeypatch.setattr(fp32_gemm_out, "mm_dtype_supported", lambda: True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_gemm_cast_to_float32_writes_float32(supported, dtype):
    graph = _graph(dtype)
    assert _run(graph) == [aten.mm.dtype]
    (out,) = [n for n in graph.nodes if n.op == "call_function"]
    assert out.args[2] == torch.float32 and out.meta["val"].dtype == torch.float32
    assert tuple(out.meta["val"].shape) == (16, 4)


@pytest.mark.parametrize("kwargs", [
    {"dtype": torch.float32},  # already float32
    {"device": "cpu"},  # no CPU kernel for mm.dtype
    {"cast_to": torch.float16},  # not a cast to float32
    {"extra_user": True},  # the bf16 result is read too
    {"op": aten.addmm.default},  # addmm has no dtype overload
])
def test_near_misses_stay(supported, kwargs):
    graph = _graph(**kwargs)
    before = [n.target for n in graph.nodes if n.op == "call_function"]
    assert _run(graph) == before


def test_a_torch_without_the_kernel_rewrites_nothing(monkeypatch):
    monkeypatch.setattr(fp32_gemm_out, "mm_dtype_supported", lambda: False)
    graph = _graph()
    assert _run(graph) == [aten.mm.default, prims.convert_element_type.default]


@pytest.mark.skipif(torch.backends.cuda.is_built(), reason="a CUDA build has the kernel")
def test_a_cpu_build_has_no_kernel_for_it():
    assert fp32_gemm_out.mm_dtype_supported() is False
