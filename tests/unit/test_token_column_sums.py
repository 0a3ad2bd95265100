"""gemcompile::token_column_sum against float64 sums (its autograd and schema), and TokenColumnSumPass on
post-grad graphs of fake CUDA tensors: a sum over the symbolic token rows of a GEMM's output becomes the
op; near-misses stay."""

import pytest
import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

import gemcompile.lowering  # noqa: F401  registers the op
from gemcompile import GemConfig
from gemcompile.config import ConfigError, TokenColumnSumsConfig
from gemcompile.passes.token_column_sums import TokenColumnSumPass

aten = torch.ops.aten


@pytest.mark.parametrize("T,N,dtype", [(1, 5, torch.float32), (37, 300, torch.float16),
                                       (2049, 64, torch.bfloat16), (0, 3, torch.float32)])
def test_op_matches_float64(T, N, dtype):
    x = torch.randn(T, N, generator=torch.Generator().manual_seed(T)).to(dtype)
    got = torch.ops.gemcompile.token_column_sum(x)
    assert got.dtype == dtype and got.shape == (N,)
    torch.testing.assert_close(got.double(), x.double().sum(0).to(dtype).double(),
                               rtol=2 ** -7 if dtype != torch.float32 else 1e-6, atol=1e-5)


def test_op_schema_autograd_and_bad_input():
    x = torch.randn(50, 20, requires_grad=True)
    torch.library.opcheck(torch.ops.gemcompile.token_column_sum, (x,))
    half = torch.randn(40, 8, dtype=torch.bfloat16, requires_grad=True)
    torch.library.opcheck(torch.ops.gemcompile.token_column_sum, (half,), {"dtype": torch.float32})
    wide = torch.ops.gemcompile.token_column_sum(half, dtype=torch.float32)
    assert wide.dtype == torch.float32
    torch.testing.assert_close(wide, half.float().sum(0))
    wide.sum().backward()
    assert half.grad.dtype == torch.bfloat16 and (half.grad == 1).all()
    with pytest.raises(ValueError, match="floating"):
        torch.ops.gemcompile.token_column_sum(half, dtype=torch.int32)
    g = torch.randn(20)
    (torch.ops.gemcompile.token_column_sum(x) * g).sum().backward()
    assert torch.equal(x.grad, g.expand(50, 20))
    assert torch.ops.gemcompile.token_column_sum(torch.empty(0, 3)).tolist() == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="2-D"):
        torch.ops.gemcompile.token_column_sum(torch.randn(2, 3, 4))
    with pytest.raises(ValueError, match="float"):
        torch.ops.gemcompile.token_column_sum(torch.ones(2, 3, dtype=torch.int64))


def test_config_refuses_zero_columns_and_is_off_by_default():
    with pytest.raises(ConfigError, match="min_columns"):
        TokenColumnSumsConfig(min_columns=0)
    assert TokenColumnSumsConfig().enabled is False  # not measured on the step yet (the config's doc)
    graph, _ = _graph()
    TokenColumnSumPass(GemConfig())(graph)
    assert aten.sum.dim_IntList in [n.target for n in graph.nodes]


def _graph(device="cuda", symbolic=True, producer="mm", dims=(0,), keepdim=True, cols=64,
           dtype=torch.bfloat16, sum_dtype=None):
    """a (T, K), w (K, cols) -> y = producer(a, w); s = sum(y, dims, keepdim); output (s, ...)."""
    mode = FakeTensorMode(shape_env=ShapeEnv())
    graph = fx.Graph()
    with mode:
        T = mode.shape_env.create_unbacked_symint() if symbolic else 512
        if symbolic:
            torch._check(T >= 2)
        a = torch.empty(T, 32, dtype=dtype, device=device)
        w = torch.empty(32, cols, dtype=dtype, device=device)
    na, nw = graph.placeholder("a"), graph.placeholder("w")
    na.meta["val"], nw.meta["val"] = a, w
    target = {"mm": aten.mm.default, "relu": aten.relu.default}[producer]
    y = graph.call_function(target, (na, nw) if producer == "mm" else (na,))
    kwargs = {"dtype": sum_dtype} if sum_dtype else {}
    s = graph.call_function(aten.sum.dim_IntList, (y, list(dims), keepdim), kwargs)
    with mode:
        y.meta["val"] = a @ w if producer == "mm" else torch.relu(a)
        s.meta["val"] = y.meta["val"].sum(list(dims), keepdim=keepdim, **kwargs)
    graph.output((s,))
    return graph, s.meta["val"]


def _run(graph, **config):
    TokenColumnSumPass(GemConfig(token_column_sums={"enabled": True, **config}))(graph)
    return [n.target for n in graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("keepdim", [True, False])
@pytest.mark.parametrize("dims", [(0,), (-2,)])
def test_a_sum_over_token_rows_of_a_gemm_output_becomes_the_op(keepdim, dims):
    graph, want = _graph(dims=dims, keepdim=keepdim)
    targets = _run(graph)
    assert targets[:2] == [aten.mm.default, torch.ops.gemcompile.token_column_sum.default]
    assert (aten.view.default in targets) is keepdim and aten.sum.dim_IntList not in targets
    (out,) = [n for n in graph.nodes if n.op == "output"][0].args[0]
    assert tuple(out.meta["val"].shape) == tuple(want.shape) and out.meta["val"].dtype == want.dtype


def test_a_half_sum_into_float32_keeps_its_dtype():
    """torch 2.11's form of a bf16 bias gradient: sum(x, [0], True, dtype=float32)."""
    graph, want = _graph(sum_dtype=torch.float32)
    assert torch.ops.gemcompile.token_column_sum.default in _run(graph)
    op = next(n for n in graph.nodes if n.target is torch.ops.gemcompile.token_column_sum.default)
    assert op.kwargs == {"dtype": torch.float32} and op.meta["val"].dtype == torch.float32
    (out,) = [n for n in graph.nodes if n.op == "output"][0].args[0]
    assert out.meta["val"].dtype == torch.float32 and tuple(out.meta["val"].shape) == tuple(want.shape)


def test_a_pointwise_producer_read_by_a_gemm_counts_as_materialized():
    graph, _ = _graph(producer="relu")
    relu = next(n for n in graph.nodes if n.target is aten.relu.default)
    w = next(n for n in graph.nodes if n.name == "w")
    with graph.inserting_after(relu):
        mm = graph.call_function(aten.mm.default, (relu, w))
    output = next(n for n in graph.nodes if n.op == "output")
    output.args = ((*output.args[0], mm),)
    assert torch.ops.gemcompile.token_column_sum.default in _run(graph)


@pytest.mark.parametrize("kwargs", [
    {"device": "cpu"},  # CUDA only
    {"symbolic": False},  # a static T: Inductor splits it
    {"producer": "relu"},  # read by pointwise ops only: Inductor fuses the sum into its producer
    {"dims": (1,)},  # a sum over the columns
    {"dims": (0, 1)},  # over everything
    {"cols": 8},  # fewer columns than min_columns
    {"sum_dtype": torch.int64},  # a sum into an integer dtype
])
def test_near_misses_stay(kwargs):
    graph, _ = _graph(**kwargs)
    assert aten.sum.dim_IntList in _run(graph)


def test_switched_off_or_narrow_columns_stay():
    graph, _ = _graph()
    assert aten.sum.dim_IntList in _run(graph, enabled=False)
    graph, _ = _graph(cols=64)
    assert aten.sum.dim_IntList in _run(graph, min_columns=128)
