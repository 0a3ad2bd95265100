"""The MXFP8 cast-insertion pass (post-grad, forward and backward graphs).

A model compiled with the pass must equal, bit for bit, an eager copy in which every qualifying Linear runs
its three GEMMs (forward, dgrad, wgrad) on operands quantized along each GEMM's reduction dim; layers the
config keeps in high precision (excluded by name, too small, a wgrad kept bf16) must stay plain GEMMs.
Near misses (attention scores, a GEMM next to a softmax, an embedding's GEMM, a function with no module)
are left alone with a reason that explain shows.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

from gemcompile import GemConfig, explain, gem_compile
from gemcompile.config import ConfigError
from gemcompile.lowering.fp8 import scaled_mm
from gemcompile.lowering.fp8.numerics import fake_quantize
from gemcompile.passes.mxfp8 import Mxfp8Pass, decisions, module_path

ALL_SIZES = {"min_m": 1, "min_k": 1, "min_n": 1}


@pytest.fixture(autouse=True)
def _no_compile_caches():
    """The counters asserted below count what the pass did while compiling: a graph served from Inductor's
    FX graph cache or AOTAutograd's cache (kept on disk between runs) is not compiled, so the pass does
    not run and counts nothing."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        yield


def _fake_quantize_padded(x, dim, rule):
    """MX quantize-dequantize along dim, K zero-padded to a multiple of 32 (a zero block changes nothing)."""
    k = x.shape[dim]
    if k % 32:
        shape = list(x.shape)
        shape[dim] = -k % 32
        return fake_quantize(torch.cat([x, x.new_zeros(shape)], dim), dim, rule).narrow(dim, 0, k)
    return fake_quantize(x, dim, rule)


def reference_fp8_mm(a, b, recipe, a_is_weight, b_is_weight, rule):
    """What one quantized GEMM computes: both operands quantized along K, then a plain matmul."""
    if recipe == "mxfp8_emulated":  # the contract, written out: fake_quantize along K on each side
        return _fake_quantize_padded(a, -1, rule) @ _fake_quantize_padded(b, 0, rule)
    return scaled_mm.emulated_fp8_mm(a, b, recipe, a_is_weight, b_is_weight, rule)


class _Fp8Linear(torch.autograd.Function):
    """y = x W^T (+ b) with each of the three GEMMs quantized: forward (X, W along K), dgrad (dY, W along
    N), wgrad (dY^T, X along the tokens); ``quantize_wgrad=False`` keeps dW a plain GEMM."""

    @staticmethod
    def forward(ctx, x, weight, bias, recipe, rule, quantize_wgrad):
        ctx.save_for_backward(x, weight)
        ctx.options = (recipe, rule, quantize_wgrad, bias is not None)
        x2 = x.reshape(-1, x.shape[-1])
        y = reference_fp8_mm(x2, weight.t(), recipe, False, True, rule)
        if bias is not None:
            y = y + bias
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        recipe, rule, quantize_wgrad, has_bias = ctx.options
        x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
        dx = reference_fp8_mm(dy2, weight, recipe, False, True, rule).reshape(x.shape)
        dw = reference_fp8_mm(dy2.t(), x2, recipe, False, False, rule) if quantize_wgrad else dy2.t() @ x2
        db = dy2.sum(0) if has_bias else None
        return dx, dw, db, None, None, None


class Fp8LinearRef(nn.Module):
    """The eager reference of a Linear the pass quantizes (shares the original's parameters)."""

    def __init__(self, linear: nn.Linear, recipe: str, rule: str, quantize_wgrad: bool = True):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.options = (recipe, rule, quantize_wgrad)

    def forward(self, x):
        return _Fp8Linear.apply(x, self.weight, self.bias, *self.options)


class Mlp(nn.Module):
    """Four Linears: up and mid qualify, keep_wgrad keeps its wgrad in bf16, head is excluded by name."""

    def __init__(self, d: int, bias: bool):
        super().__init__()
        self.up = nn.Linear(d, 2 * d, bias=bias)
        self.mid = nn.Linear(2 * d, 2 * d, bias=bias)
        self.keep_wgrad = nn.Linear(2 * d, d, bias=bias)
        self.head = nn.Linear(d, d, bias=bias)

    def forward(self, x):
        # ReLU only: Inductor's GELU rounds differently from eager's, which would hide what is tested here
        h = torch.relu(self.up(x))
        h = torch.relu(self.mid(h))
        return self.head(torch.relu(self.keep_wgrad(h)))


def _config(recipe, rule="rceil", **extra):
    return GemConfig(mxfp8=dict(enabled=True, recipe=recipe, scale_rule=rule, **ALL_SIZES,
                                bf16_weight_grad=("keep_wgrad",), **extra))


def _reference(model: Mlp, recipe: str, rule: str) -> Mlp:
    ref = copy.deepcopy(model)
    ref.up = Fp8LinearRef(ref.up, recipe, rule)
    ref.mid = Fp8LinearRef(ref.mid, recipe, rule)
    ref.keep_wgrad = Fp8LinearRef(ref.keep_wgrad, recipe, rule, quantize_wgrad=False)
    return ref  # head: excluded by the default pattern '*head', a plain Linear


def _run(model, x, upstream):
    x = x.clone().requires_grad_(True)
    out = model(x)
    out.backward(upstream)
    return out.detach(), x.grad, {n.removeprefix("_orig_mod."): p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("recipe, rule, d, tokens", [
    ("mxfp8_emulated", "rceil", 64, (4, 16)),
    ("mxfp8_emulated", "floor", 64, (4, 16)),
    ("blockwise", "rceil", 128, (2, 64)),
])
def test_compiled_mlp_equals_eager_fake_quantized_mlp_exactly(recipe, rule, d, tokens):
    torch.manual_seed(0)
    model = Mlp(d, bias=False)
    ref = _reference(model, recipe, rule)
    x = torch.randn(*tokens, d) * 4
    upstream = torch.randn(*tokens, d)
    counters.clear()
    out, dx, grads = _run(gem_compile(model, config=_config(recipe, rule)), x, upstream)
    ref_out, ref_dx, ref_grads = _run(ref, x, upstream)
    assert torch.equal(out, ref_out)
    assert torch.equal(dx, ref_dx)
    for name, grad in grads.items():
        assert torch.equal(grad, ref_grads[name]), name
    found = counters["gemcompile"]
    # up, mid: fwd + dgrad + wgrad; keep_wgrad: fwd + dgrad (its wgrad stays a plain GEMM); head: excluded
    assert (found["mxfp8_fp8_fwd"], found["mxfp8_fp8_dgrad"], found["mxfp8_fp8_wgrad"]) == (3, 3, 2)
    assert found["mxfp8_bf16_weight_grad"] == 1 and found["mxfp8_excluded"] == 3
    # and the quantization is not a no-op here: the plain model differs
    plain_out = Mlp.forward(model, x)
    assert not torch.equal(plain_out, out)


def test_dynamic_token_count_compiles_once_and_stays_exact():
    """Symbolic tokens: sizes are judged by their hint, and a token count that is no block multiple (72)
    reaches the wgrad's K, which the op zero-pads exactly."""
    torch.manual_seed(0)
    model = Mlp(64, bias=False)
    ref = _reference(model, "mxfp8_emulated", "rceil")
    compiled = gem_compile(model, config=_config("mxfp8_emulated"), dynamic=True)
    counters.clear()
    for batch in (4, 3):
        x, upstream = torch.randn(batch, 24, 64), torch.randn(batch, 24, 64)
        out, dx, grads = _run(compiled, x, upstream)
        ref_out, ref_dx, ref_grads = _run(ref, x, upstream)
        assert torch.equal(out, ref_out) and torch.equal(dx, ref_dx)
        assert all(torch.equal(grad, ref_grads[name]) for name, grad in grads.items())
    assert counters["stats"]["unique_graphs"] == 1
    assert counters["gemcompile"]["mxfp8_fp8_wgrad"] == 2


def test_with_bias_everything_but_the_bias_gradients_is_exact():
    """addmm -> fp8_mm + bias. Outputs, input and weight gradients are bit-exact; a bias gradient is a sum
    over the tokens, which Inductor reduces in another order than eager's torch.sum: the same difference
    shows with the pass off, so the last layer's bias gradient (which only sees the upstream gradient)
    equals the one of a compile without the pass bit for bit, and the others match eager closely."""
    torch.manual_seed(0)
    model = Mlp(64, bias=True)
    ref = _reference(model, "mxfp8_emulated", "rceil")
    x, upstream = torch.randn(4, 16, 64) * 4, torch.randn(4, 16, 64)
    out, dx, grads = _run(gem_compile(model, config=_config("mxfp8_emulated")), x, upstream)
    ref_out, ref_dx, ref_grads = _run(ref, x, upstream)
    assert torch.equal(out, ref_out) and torch.equal(dx, ref_dx)
    for name, grad in grads.items():
        if name.endswith("weight"):
            assert torch.equal(grad, ref_grads[name]), name
        else:
            torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()
    _, _, plain_grads = _run(gem_compile(model, config=GemConfig()), x, upstream)
    assert torch.equal(grads["head.bias"], plain_grads["head.bias"])


# -- decisions, through explain (no Inductor code generation: fast) ------------------------------------------

def _explain(model, *inputs, **mx):
    return explain(model, *inputs, config=GemConfig(mxfp8=dict(enabled=True, recipe="mxfp8_emulated", **mx)))


def test_explain_lists_every_gemm_with_role_module_shape_and_decision():
    model = Mlp(64, bias=True)
    report = _explain(model, torch.randn(4, 16, 64, requires_grad=True), **ALL_SIZES,
                      bf16_weight_grad=("keep_wgrad",))
    table = {(d.role, d.module): d for d in decisions(report)}
    assert len(table) == 12  # 4 layers x (fwd, dgrad, wgrad)
    assert table[("fwd", "up")].quantized and (table["fwd", "up"].m, table["fwd", "up"].k) == ("64", "64")
    assert table[("wgrad", "mid")].quantized and table["wgrad", "mid"].k == "64"  # K of a wgrad = the tokens
    assert not table[("wgrad", "keep_wgrad")].quantized
    assert "bf16_weight_grad" in table[("wgrad", "keep_wgrad")].reason
    assert table[("dgrad", "keep_wgrad")].quantized
    assert all(not table[(role, "head")].quantized for role in ("fwd", "dgrad", "wgrad"))
    assert "'*head'" in table[("fwd", "head")].reason
    assert report.counts["mxfp8"] == 8
    text = report.render(width=200)
    assert "mxfp8" in text and "wgrad keep_wgrad (Linear)" in text
    # the graphs hold the op: forward 3 (up, mid, keep_wgrad), backward 5
    ops = {kind: sum(n.target is torch.ops.gemcompile.fp8_mm.default for n in gm.graph.nodes)
           for kind, gm in report.aot_graphs}
    assert ops == {"forward": 3, "backward": 5}


def test_same_decisions_under_bf16_autocast():
    """Under autocast the backward sees a saved bf16 copy of each weight, not the parameter: the dgrad is
    found by pairing it with the wgrad of the same forward op."""
    model = Mlp(64, bias=True)
    x = torch.randn(4, 16, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        report = _explain(model, x, **ALL_SIZES, bf16_weight_grad=("keep_wgrad",))
    got = sorted((d.role, d.module, d.quantized) for d in decisions(report))
    assert got == sorted((role, module, module != "head" and (role, module) != ("wgrad", "keep_wgrad"))
                         for role in ("fwd", "dgrad", "wgrad") for module in ("up", "mid", "keep_wgrad", "head"))


def test_inference_graph_quantizes_the_forward_gemms():
    with torch.no_grad():
        report = _explain(Mlp(64, bias=True), torch.randn(4, 16, 64), **ALL_SIZES)
    assert [kind for kind, _ in report.aot_graphs] == ["inference"]
    assert sorted((d.role, d.module, d.quantized) for d in decisions(report)) == [
        ("fwd", "head", False), ("fwd", "keep_wgrad", True), ("fwd", "mid", True), ("fwd", "up", True)]


def test_default_sizes_keep_narrow_layers_in_high_precision():
    report = _explain(Mlp(64, bias=False), torch.randn(4, 16, 64))  # inference: forward GEMMs only
    found = decisions(report)
    assert found and not any(d.quantized for d in found)
    assert any("min_m = 16384" in d.reason and "min_k = 2048" in d.reason for d in found)


def test_size_gate_is_one_decision_per_layer():
    """min_k applies to the layer's in_features in all three GEMMs (dgrad and wgrad have other Ks)."""
    report = _explain(Mlp(64, bias=False), torch.randn(4, 16, 64, requires_grad=True),
                      min_m=1, min_k=100, min_n=1)
    by_module: dict[str, set] = {}
    for d in decisions(report):
        by_module.setdefault(d.module, set()).add(d.quantized)
    assert by_module == {"up": {False}, "mid": {True}, "keep_wgrad": {True}, "head": {False}}


class OneHotEmbedding(nn.Module):
    """An embedding written as a GEMM (one-hot ids @ table): a weight operand, excluded by name."""

    def __init__(self, vocab, d):
        super().__init__()
        self.table = nn.Parameter(torch.randn(vocab, d))

    def forward(self, ids):
        return torch.nn.functional.one_hot(ids, self.table.shape[0]).float() @ self.table


class Attention(nn.Module):
    """Projections (Linear) around a hand-written softmax attention, a router feeding a softmax, and an
    embedding GEMM."""

    def __init__(self, d=64, vocab=32):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.out_proj = nn.Linear(d, d)
        self.mixer = nn.Linear(d, 32)
        self.item_embedding = OneHotEmbedding(vocab, d)

    def forward(self, ids, x):
        x = x + self.item_embedding(ids)
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        p = torch.softmax(q @ k.transpose(-2, -1) / 8.0, dim=-1)
        mix = torch.softmax(self.mixer(x), dim=-1)
        return self.out_proj(p @ v) + mix.sum(-1, keepdim=True)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = Attention()

    def forward(self, ids, x):
        return self.attn(ids, x)


def test_near_misses_are_left_alone_with_a_reason():
    ids = torch.randint(0, 32, (2, 32))
    report = _explain(Block(), ids, torch.randn(2, 32, 64, requires_grad=True), **ALL_SIZES)
    found = decisions(report)
    quantized = {(d.role, d.module) for d in found if d.quantized}
    assert quantized == {(r, f"attn.{m}") for r in ("fwd", "dgrad", "wgrad")
                         for m in ("q_proj", "k_proj", "v_proj", "out_proj")}
    kept = [d for d in found if not d.quantized]
    # q @ k^T and p @ v, forward and backward: two activations, no weight
    scores = [d for d in kept if d.role == "gemm"]
    assert len(scores) == 6 and all(d.module == "attn" and "no weight operand" in d.reason for d in scores)
    mixer = [d for d in kept if d.module == "attn.mixer"]
    assert len(mixer) == 3 and all("softmax" in d.reason for d in mixer)
    embedding = [d for d in kept if d.module == "attn.item_embedding"]
    assert {d.role for d in embedding} == {"fwd", "wgrad"}  # no dgrad: one-hot ids need no gradient
    assert all("'*embed*'" in d.reason for d in embedding)


class LearnedQueries(nn.Module):
    """A Linear applied to a parameter (PMA's learned queries): both backward GEMMs have a parameter
    operand and feed a parameter gradient; the one on dY^T is the wgrad."""

    def __init__(self):
        super().__init__()
        self.queries = nn.Parameter(torch.randn(32, 64))
        self.proj = nn.Linear(64, 64)

    def forward(self, x):
        return x + self.proj(self.queries)


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16_autocast"])
def test_a_linear_on_a_parameter_gets_one_gemm_per_role(autocast):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        report = _explain(LearnedQueries(), torch.randn(2, 32, 64), **ALL_SIZES)
    assert sorted(d.role for d in decisions(report) if d.module == "proj" and d.quantized) == ["dgrad", "fwd", "wgrad"]


class RootGemm(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(64, 64))

    def forward(self, x):
        return x @ self.weight


def test_gemms_without_a_module_are_left_alone():
    """A function, or the compiled module's own forward: no nn_module_stack, so no name to judge by."""
    def f(x, w):
        return torch.relu(x @ w)

    for model, inputs in ((f, (torch.randn(64, 64), torch.randn(64, 64))), (RootGemm(), (torch.randn(64, 64),))):
        found = decisions(_explain(model, *inputs, **ALL_SIZES))
        assert found and all(not d.quantized and "source module unknown" in d.reason for d in found)


def test_module_paths_are_normalized():
    assert module_path("L['self'].layers.0.ffn") == "layers.0.ffn"
    assert module_path("L['self'].layers[0].ffn['up']") == "layers.0.ffn.up"
    assert module_path("getattr(L['self'].layers, '0').up") == "layers.0.up"
    assert module_path("L['self']._modules['layers']._modules['0']") == "layers.0"
    assert module_path("L['self']") == ""


# -- config --------------------------------------------------------------------------------------------------

def test_defaults():
    mx = GemConfig().mxfp8
    assert not mx.enabled and mx.recipe == "blockwise" and mx.scale_rule == "rceil" and mx.include == ("*",)
    assert "*embed*" in mx.exclude and "*tower*" in mx.exclude and mx.bf16_weight_grad == ()
    assert GemConfig(mxfp8={"include": ["a", "b"]}).mxfp8.include == ("a", "b")


@pytest.mark.parametrize("mx, words", [
    ({"recipe": "fp8"}, ["recipe", "'blockwise', 'mxfp8', 'mxfp8_emulated'"]),
    ({"scale_rule": "ceil"}, ["scale_rule", "'floor', 'rceil'"]),
    ({"min_k": 0}, ["min_k", ">= 1"]),
    ({"min_m": 2.5}, ["min_m", "expected int"]),
    ({"include": "*ffn*"}, ["include", "a tuple of patterns"]),
    ({"exclude": ("re:[",)}, ["exclude", "re:[", "does not compile"]),
    ({"bf16_weight_grad": ("",)}, ["bf16_weight_grad", "empty pattern"]),
])
def test_config_errors_name_the_field(mx, words):
    with pytest.raises(ConfigError) as info:
        GemConfig(mxfp8=mx)
    for word in words:
        assert word in str(info.value)


def test_unknown_field_is_named():
    with pytest.raises(TypeError, match="did you mean 'min_k'"):
        GemConfig(mxfp8={"mink": 3})


def test_uuid_covers_the_config():
    def uuid(**mx):
        return Mxfp8Pass(GemConfig(mxfp8=dict(enabled=True, **mx))).uuid()

    assert uuid() == uuid()
    assert len({uuid(), uuid(recipe="mxfp8"), uuid(min_k=8), uuid(exclude=()), uuid(bf16_weight_grad=("x",)),
                uuid(scale_rule="floor")}) == 6


def test_train_takes_a_recipe():
    from gemcompile.cli import build_parser
    from gemcompile.runtime.training.config import TrainConfig, gem_config
    from gemcompile.runtime.training.flags import config_from_args

    args = build_parser().parse_args(["train", "--compile", "gem", "--mxfp8", "mxfp8_emulated", "--mxfp8-min-dim", "32"])
    cfg = config_from_args(args)
    mx = gem_config(cfg).mxfp8
    assert mx.enabled and mx.recipe == "mxfp8_emulated" and (mx.min_m, mx.min_k, mx.min_n) == (32, 32, 32)
    assert not gem_config(TrainConfig(compile="gem")).mxfp8.enabled
    with pytest.raises(ValueError, match="needs compile='gem'"):
        TrainConfig(mxfp8="blockwise")
    with pytest.raises(ValueError, match="mxfp8"):
        TrainConfig(compile="gem", mxfp8="fp4")
