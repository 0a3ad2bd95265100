"""GemConfig.memory.fp8_saved: the input of a Linear's weight gradient saved for the backward in FP8.

The eager meaning (``FakeQuantizedLinear``): dW = dy^T fake_quantize(x); the output and every other gradient
exact. The compiled graphs must equal it bit for bit (float32 and bfloat16), the backward graph must really
receive an FP8 tensor (also where the partitioned graphs are edited to settle min-cut's tie), and nothing may
change where the option is off or matches nothing. Cheap: the graphs run as plain ATen through explain's
backend (the partitioner Inductor is given, without code generation); one test compiles with Inductor."""

import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from gemcompile import GemConfig, explain
from gemcompile.backend import GemBackend
from gemcompile.config import ConfigError
from gemcompile.explain import _ExplainBackend
from gemcompile.lowering.fp8.numerics import block_dequantize, block_quantize
from gemcompile.passes import fp8_saved
from gemcompile.passes.activation_memory import has_partitioner_slot
from gemcompile.passes.records import PassLog, recording

D = 256
SHAPE = (2, 128, D)  # 256 tokens x 256 features = fp8_saved.MIN_ELEMENTS: the smallest x quantized


class FakeQuantizedLinear(torch.autograd.Function):
    """F.linear whose weight gradient reads fake_quantize(x) (what fp8_saved means); the rest exact."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
        bias_grad = dy2.sum(0) if ctx.needs_input_grad[2] else None
        return dy @ weight, dy2.t() @ fp8_saved.fake_quantize(x2), bias_grad


class MLP(nn.Module):
    """Linear, ReLU, Linear, ...: the inputs of mlp.2 and mlp.4 are activations; mlp.0 reads the graph's
    input (never quantized). ``reference`` names the layers the eager forward runs as FakeQuantizedLinear."""

    def __init__(self, widths=(D, D, D, 128), bias=True):
        super().__init__()
        layers = [m for a, b in zip(widths, widths[1:]) for m in (nn.Linear(a, b, bias=bias), nn.ReLU())]
        self.mlp = nn.Sequential(*layers[:-1])
        self.reference: set[str] = set()

    def forward(self, x):
        for name, layer in self.mlp.named_children():
            if f"mlp.{name}" in self.reference:
                x = FakeQuantizedLinear.apply(x, layer.weight, layer.bias)
            else:
                x = layer(x)
        return x.square().sum()


def _compile_and_grad(model, x, backend):
    log = PassLog()
    with recording(log):
        out = torch.compile(model, backend=backend)(x)
    torch._dynamo.reset()
    return out, torch.autograd.grad(out, [x, *model.parameters()]), log


def _eager(model, x, reference):
    model.reference = set(reference)
    out = model(x)
    model.reference = set()
    return out, torch.autograd.grad(out, [x, *model.parameters()])


def test_the_fp8_copy_is_the_blockwise_recipes_activation_quantization():
    torch.manual_seed(0)
    x = torch.randn(64, 256) * torch.logspace(-38, 30, 64)[:, None]  # every binade, subnormal scales too
    x[3] = 0.0
    x[4, :128] = 448 * 2.0 ** -3  # amax / 448 exactly a power of two, then one ulp above it
    x[4, 128:] = torch.nextafter(torch.tensor(448 * 2.0 ** -3), torch.tensor(1.0))
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        want = block_dequantize(*block_quantize(xd, (1, 128), "rceil"), (1, 128), dtype)
        assert torch.equal(fp8_saved.fake_quantize(xd), want)
    elements, scale = fp8_saved.quantize(x)
    assert elements.dtype == torch.float8_e4m3fn
    assert elements.shape == (64, 2, 128) and scale.shape == (64, 2, 1)
    assert torch.equal(scale, torch.exp2(torch.log2(scale).round()))  # powers of two
    normal = x[5:60]
    assert ((fp8_saved.fake_quantize(normal) - normal).abs() <= normal.abs() / 16 + 1e-30).all()
    rows = torch.randn(16, 200)  # 200 is no multiple of 128: one scale per row
    want = block_dequantize(*block_quantize(rows, (1, 200), "rceil"), (1, 200))
    assert torch.equal(fp8_saved.fake_quantize(rows), want)
    bad = torch.randn(2, 256)
    bad[0, 5], bad[1, 200] = float("inf"), float("nan")  # a non-finite block decodes to NaN, never hidden
    got = fp8_saved.fake_quantize(bad)
    assert got[0, :128].isnan().all() and got[1, 128:].isnan().all()
    assert not got[0, 128:].isnan().any() and not got[1, :128].isnan().any()


@pytest.mark.parametrize("setting, quantized", [(True, ("mlp.2", "mlp.4")), (("re:^mlp\\.4$",), ("mlp.4",))])
def test_compiled_equals_eager_with_the_fake_quantized_weight_gradient(setting, quantized):
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(SHAPE, requires_grad=True)
    backend = _ExplainBackend(GemConfig(memory={"fp8_saved": setting}))
    out, grads, log = _compile_and_grad(model, x, backend)
    want, want_grads = _eager(model, x, quantized)
    assert torch.equal(out, want)
    for got, expected in zip(grads, want_grads):
        assert torch.equal(got, expected)  # bit for bit: the quantization is exact integer and 2^k arithmetic
    _, plain_grads = _eager(model, x, ())
    names = ["x", *(n for n, _ in model.named_parameters())]
    changed = {n.removesuffix(".weight") for n, g, p in zip(names, grads, plain_grads)
               if not torch.equal(g, p)}
    assert changed == set(quantized)  # only the weight gradients of the quantized layers read FP8 values
    modules = [m for r in log.rewrites if r.pass_name == "fp8_saved" for m in r.metrics["modules"]]
    assert sorted(modules) == sorted(quantized)
    (record,) = log.memory
    assert len([t for t in record.tensors if t.dtype_before == "float32"]) == len(quantized)
    assert len([t for t in record.tensors if t.op == "aten.view of aten.relu"]) == 2 - len(quantized)
    # the memory saving is real: the backward graph receives FP8 tensors, the forward hands them over
    forward = next(gm for kind, gm in backend.aot_graphs if kind == "forward")
    fp8_inputs = _fp8_inputs(backend)
    assert len(fp8_inputs) == len(quantized)
    outputs = next(n for n in forward.graph.nodes if n.op == "output").args[0]
    assert {n.name for n in fp8_inputs} <= {o.name for o in outputs if o is not None}


def test_explain_shows_the_dtype_change_bytes_and_totals():
    config = GemConfig(memory={"fp8_saved": True})
    report = explain(MLP(), torch.randn(SHAPE, requires_grad=True), config=config)
    (record,) = report.memory
    data = [t for t in record.tensors if t.dtype_before]
    scales = [t for t in record.tensors if t.fp8_of and not t.dtype_before]
    assert len(data) == 2 and len(scales) == 2
    for t in data:
        assert (t.dtype, t.dtype_before, t.nbytes, t.nbytes_before) == ("float8_e4m3fn", "float32", 256 * D,
                                                                        4 * 256 * D)
        assert t.op.startswith("fp8 of ")
    assert all(t.dtype == "float32" and t.nbytes == 256 * 2 * 4 for t in scales)  # a scale per 1x128 block
    assert record.fp8_bytes == 2 * (256 * D + 256 * 2 * 4) and record.fp8_bytes_before == 2 * 4 * 256 * D
    assert report.counts["fp8_saved"] == 2
    (refusal,) = [r for r in report.refusals if r.pass_name == "fp8_saved"]
    assert "(mlp.0): a copy of a graph input" in refusal.reason
    text = report.render(width=220)
    assert "float32 -> float8_e4m3fn" in text and "in fp8" in text and "instead of 512.0 KiB" in text


def test_off_by_default_and_patterns_that_match_nothing_change_nothing():
    x = torch.randn(SHAPE, requires_grad=True)
    assert GemConfig().memory.fp8_saved is False
    torch.manual_seed(0)
    default = explain(MLP(), x)
    torch.manual_seed(0)
    nothing = explain(MLP(), x, config=GemConfig(memory={"fp8_saved": ("attention.*", "Conv2d")}))
    assert [gm.code for _, gm in nothing.aot_graphs] == [gm.code for _, gm in default.aot_graphs]
    assert not any(t.fp8_of for record in nothing.memory for t in record.tensors)
    reasons = [r.reason for r in nothing.refusals if r.pass_name == "fp8_saved"]
    assert len(reasons) == 3 and all("matches no fp8_saved pattern" in r for r in reasons)
    if has_partitioner_slot():  # the default compile keeps Inductor's own partitioner
        assert GemBackend(GemConfig()).partitioner({}) == {}
        assert "custom_partitioner_fn" in GemBackend(GemConfig(memory={"fp8_saved": True})).partitioner({})


B, L, H = 8, 32, 2


class Block(nn.Module):
    """Attention over a key-length mask (rewritten into gemcompile::jagged_attention), q/k/v reading one
    input, an output projection reading the attention's output, and a GELU FFN."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.out = (nn.Linear(D, D) for _ in range(4))
        self.ffn = nn.Sequential(nn.Linear(D, D), nn.GELU(), nn.Linear(D, D))

    def forward(self, x, lengths):
        h = torch.relu(x)
        q, k, v = (proj(h).view(B, L, H, D // H).transpose(1, 2) for proj in (self.q, self.k, self.v))
        keep = (torch.arange(L)[None, :] < lengths[:, None])[:, None, None, :]
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=keep).transpose(1, 2).reshape(B, L, D)
        x = x + self.out(a)
        return (x + self.ffn(x)).sum()


def _fp8_report(setting):
    x, lengths = torch.randn(B, L, D, requires_grad=True), torch.tensor([32, 1, 17, 5, 32, 9, 24, 12])
    # unpad off: its packed token count would be data-dependent
    config = GemConfig(memory={"fp8_saved": setting}, unpad={"enabled": False})
    report = explain(Block(), x, lengths, config=config)
    rewrites = {m: r for r in report.rewrites if r.pass_name == "fp8_saved" for m in r.metrics["modules"]}
    refusals = {re.match(r"\S+ \(([^)]*)\)", r.reason)[1]: r.reason for r in report.refusals
                if r.pass_name == "fp8_saved"}
    return report, rewrites, refusals


def test_attention_outputs_are_never_quantized_and_shared_inputs_are_quantized_once():
    report, rewrites, refusals = _fp8_report(True)
    assert report.counts["jagged_attention"] == 1
    assert "an output of gemcompile::jagged_attention_fwd" in refusals["out"]
    (record,) = report.memory
    attention = [t for t in record.tensors if "gemcompile" in t.op]
    assert attention and all(t.dtype in ("float32", "int64") and not t.fp8_of for t in attention)
    # q, k and v read one input: one FP8 copy serves their three weight gradients
    assert rewrites["q"] is rewrites["k"] is rewrites["v"]
    assert rewrites["q"].metrics["modules"] == ["q", "k", "v"]
    assert "ffn.0" in rewrites  # the residual stream's FP8 copy
    # GELU's backward reads its input at full precision, from which the FFN's second input is recomputed:
    # an FP8 copy would save nothing, so none is made (dW stays exact)
    assert "left at full precision" in refusals["ffn.2"]
    assert sum(1 for t in record.tensors if t.dtype_before) == 2

    _, rewrites, refusals = _fp8_report(("q",))  # k and v still read q's input exactly: nothing to save
    assert not rewrites and "the backward also reads it at full precision (aten.mm of k, v)" in refusals["q"]


class Residual(nn.Module):
    """b reads x + a(x): its input is read by its dW alone in the backward."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, 128)
        self.reference = False

    def forward(self, x):
        r = x + self.a(x)
        y = FakeQuantizedLinear.apply(r, self.b.weight, self.b.bias) if self.reference else self.b(r)
        return y.square().sum()


def _fp8_inputs(backend) -> list:
    backward = next(gm for kind, gm in backend.aot_graphs if kind == "backward")
    return [n for n in backward.graph.nodes
            if n.op == "placeholder" and n.meta["val"].dtype == torch.float8_e4m3fn]


def test_bfloat16_the_partitions_choice_is_moved_to_the_fp8_copy():
    """In bfloat16, min-cut weighs the FP8 copy (read by fusible ops only: counted twice) like the bfloat16
    value and hands over the dequantized copy instead; settle moves the dequantize into the backward."""
    torch.manual_seed(0)
    model, x = Residual().to(torch.bfloat16), torch.randn(SHAPE, dtype=torch.bfloat16, requires_grad=True)
    backend = _ExplainBackend(GemConfig(memory={"fp8_saved": True}))
    out, grads, log = _compile_and_grad(model, x, backend)
    model.reference = True
    want = model(x)
    assert torch.equal(out, want)
    for got, expected in zip(grads, torch.autograd.grad(want, [x, *model.parameters()])):
        assert torch.equal(got, expected)
    (rewrite,) = [r for r in log.rewrites if r.pass_name == "fp8_saved"]
    assert "dequantize moved across the partition" in rewrite.detail
    assert len(_fp8_inputs(backend)) == 1
    (record,) = log.memory
    (data,) = [t for t in record.tensors if t.dtype_before]
    assert (data.dtype_before, data.nbytes, data.nbytes_before) == ("bfloat16", 256 * D, 2 * 256 * D)


def test_an_edit_that_fails_falls_back_to_the_exact_partition(monkeypatch):
    def broken(plan, fw, bw):
        raise RuntimeError("unexpected layout")

    monkeypatch.setattr(fp8_saved, "move", broken)
    torch.manual_seed(0)
    model, x = Residual().to(torch.bfloat16), torch.randn(SHAPE, dtype=torch.bfloat16, requires_grad=True)
    with pytest.warns(UserWarning, match="could not edit the partitioned graphs"):
        out, grads, log = _compile_and_grad(model, x, _ExplainBackend(GemConfig(memory={"fp8_saved": True})))
    want = model(x)  # no FP8 copy left: the model's own numerics
    assert torch.equal(out, want)
    assert all(torch.equal(g, w) for g, w in zip(grads, torch.autograd.grad(want, [x, *model.parameters()])))
    assert any("editing the partitioned graphs failed" in r.reason for r in log.refusals)
    assert not any(t.fp8_of for t in log.memory[0].tensors)


def _quantize_in_backward(gm, joint_inputs, **kwargs):
    """min-cut with every node of the FP8 quantize forced into the backward: the partition saves x."""
    from functorch.compile import min_cut_rematerialization_partition
    from torch.utils.checkpoint import CheckpointPolicy

    marked: set = set()
    for node in reversed(gm.graph.nodes):
        only_feeds_marked = node.op == "call_function" and node.users and node.users.keys() <= marked
        if fp8_saved.TAG in node.meta or only_feeds_marked:
            marked.add(node)
    for node in marked:
        node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
    return min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)


def test_a_partition_that_quantizes_in_the_backward_is_moved_to_the_fp8_copy():
    from gemcompile.passes.activation_memory import ActivationMemoryPartitioner

    torch.manual_seed(0)
    model, x = MLP(), torch.randn(SHAPE, requires_grad=True)
    model.mlp[3] = nn.Identity()  # mlp.4 reads mlp.2's output, read by nothing else in the backward
    config = GemConfig(memory={"fp8_saved": True})
    backend = _ExplainBackend(config)
    backend.partitioner = ActivationMemoryPartitioner(config, chained=_quantize_in_backward)
    out, grads, log = _compile_and_grad(model, x, backend)
    want, want_grads = _eager(model, x, ("mlp.4",))
    assert torch.equal(out, want) and all(torch.equal(g, w) for g, w in zip(grads, want_grads))
    (rewrite,) = [r for r in log.rewrites if r.pass_name == "fp8_saved"]
    assert rewrite.metrics["modules"] == ["mlp.4"] and "quantize moved across the partition" in rewrite.detail
    assert len(_fp8_inputs(backend)) == 1
    # mlp.2's input is kept for ReLU's mask: its FP8 copy is undone, so its dW reads exact values
    assert any("(mlp.2): left at full precision" in r.reason and "aten.le" in r.reason for r in log.refusals)


def test_inductor_compiles_the_moved_graphs_bit_for_bit():
    """Inductor's own partition path (custom_partitioner_fn), the quantize and dequantize lowered to its C++
    kernels, and the bfloat16 move: outputs and every gradient equal the eager reference bit for bit."""
    import torch._inductor.config as inductor_config

    try:
        from torch._inductor.utils import fresh_cache
    except ImportError:  # torch < 2.8
        from torch._inductor.utils import fresh_inductor_cache as fresh_cache
    if not has_partitioner_slot():
        pytest.skip("this torch's Inductor has no custom_partitioner_fn")
    torch.manual_seed(0)
    model, x = Residual().to(torch.bfloat16), torch.randn(SHAPE, dtype=torch.bfloat16, requires_grad=True)
    backend = GemBackend(GemConfig(memory={"fp8_saved": ("b",)}))
    # a cache hit would skip the partition; no compile workers keep the cold compile short. (Not
    # cpp.vec_isa_ok=False: the scalar choice outlived the patch in Inductor's precompiled header, and later
    # vectorized kernels of the same process failed to compile against it.)
    with fresh_cache(), inductor_config.patch({"compile_threads": 1}):
        out, grads, _ = _compile_and_grad(model, x, backend)
    (record,) = backend.last_log.memory
    (data,) = [t for t in record.tensors if t.dtype_before]
    assert (data.dtype, data.dtype_before, data.nbytes) == ("float8_e4m3fn", "bfloat16", 256 * D)
    (rewrite,) = [r for r in backend.last_log.rewrites if r.pass_name == "fp8_saved"]
    assert rewrite.metrics["modules"] == ["b"] and "moved across the partition" in rewrite.detail
    model.reference = True
    want = model(x)  # bit for bit in bfloat16: the quantize reads x's own bfloat16 rounding, not the
    assert torch.equal(out, want)  # float32 value Inductor keeps inside the fused producer
    for got, expected in zip(grads, torch.autograd.grad(want, [x, *model.parameters()])):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("value, message", [
    ("mlp.*", "expected True, False or a tuple of module-name patterns, e.g. ('mlp.*',)"),
    (("mlp.*", ""), "empty pattern"),
    (("re:mlp.(",), "does not compile"),
    (1, "expected bool or a tuple of str"),
    ((1,), "expected bool or a tuple of str"),
])
def test_bad_values_raise_clear_errors(value, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        GemConfig(memory={"fp8_saved": value})
    assert GemConfig(memory={"fp8_saved": ["mlp.*"]}).memory.fp8_saved == ("mlp.*",)
    with pytest.raises(TypeError, match="did you mean 'fp8_saved'"):
        GemConfig(memory={"fp8_save": True})
