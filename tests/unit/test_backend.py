"""GemBackend: stages, slot chaining, pass uuids and the FX graph cache."""

import pytest
import torch
import torch._inductor.config as inductor_config
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomGraphPass

from gemcompile import GemConfig
from gemcompile.backend import GemBackend
from gemcompile.passes.base import PassManager

from tests.toy_passes import TOY_PIPELINE, CountMatmulsJoint, CountNodesPostGrad, MulByTwoToAdd

try:
    from torch._inductor.utils import fresh_cache
except ImportError:  # torch < 2.8 names it fresh_inductor_cache
    from torch._inductor.utils import fresh_inductor_cache as fresh_cache


def f(x, w):
    return torch.relu((x @ w) * 2).sum()


def _inputs():
    return torch.randn(4, 6), torch.randn(6, 3, requires_grad=True)


def test_every_stage_runs_and_the_result_equals_eager():
    CountMatmulsJoint.seen.clear()
    CountNodesPostGrad.seen.clear()
    x, w = _inputs()
    compiled = torch.compile(f, backend=GemBackend(passes=TOY_PIPELINE))
    with fresh_cache():  # a cache hit would skip the joint and post-grad passes
        out = compiled(x, w)
        (grad,) = torch.autograd.grad(out, w)
    (grad_eager,) = torch.autograd.grad(f(x, w), w)
    torch.testing.assert_close(out, f(x, w))
    torch.testing.assert_close(grad, grad_eager)
    assert counters["gemcompile"]["mul_by_two_to_add"] >= 1
    # the joint graph holds the forward mm and the backward mm for w's gradient
    assert CountMatmulsJoint.seen and CountMatmulsJoint.seen[0] >= 2
    # post-grad runs on the forward and on the backward graph
    assert len(CountNodesPostGrad.seen) == 2


def _toy_pass(modules: tuple[str, ...]) -> type:
    class Toy(MulByTwoToAdd):  # one qualname, one module: only source_modules tells two of them apart
        source_modules = modules

    return Toy


def test_the_uuid_covers_the_source_modules_a_pass_names():
    plain = _toy_pass(())(GemConfig()).uuid()
    assert plain == _toy_pass(())(GemConfig()).uuid()
    assert plain != _toy_pass(("gemcompile.passes.masks.evaluator",))(GemConfig()).uuid()


def test_the_attention_pass_uuid_covers_each_family_section():
    from gemcompile.passes.attention.rewrite import AttentionRewritePass

    base = AttentionRewritePass(GemConfig()).uuid()
    assert base == AttentionRewritePass(GemConfig()).uuid()
    for section in ({"block_attention": {"enabled": False}}, {"jagged_attention": {"min_kv_len": 3}},
                    {"gdpa": {"read_relative_table": False}}):
        assert AttentionRewritePass(GemConfig(**section)).uuid() != base, section


def test_a_disabled_section_turns_its_pass_off():
    counters.clear()
    x, w = _inputs()
    config = GemConfig(jagged_attention={"enabled": False})  # MulByTwoToAdd reads this section
    torch.compile(f, backend=GemBackend(config, passes=[MulByTwoToAdd]))(x, w)
    assert counters["gemcompile"]["mul_by_two_to_add"] == 0


def test_changing_a_knob_changes_the_uuid():
    base = MulByTwoToAdd(GemConfig()).uuid()
    assert base == MulByTwoToAdd(GemConfig()).uuid()
    assert base != MulByTwoToAdd(GemConfig(jagged_attention={"min_kv_len": 3})).uuid()
    manager = lambda config: PassManager("pre_grad", [MulByTwoToAdd(config)]).uuid()  # noqa: E731
    assert manager(GemConfig()) != manager(GemConfig(jagged_attention={"enabled": False}))


class _UserPass(CustomGraphPass):
    calls = 0

    def __call__(self, graph):
        _UserPass.calls += 1

    def uuid(self):
        return "user-pass-v1"


def test_a_pass_already_in_the_slot_is_chained_not_dropped():
    _UserPass.calls = 0
    x, w = _inputs()
    with inductor_config.patch(joint_custom_pre_pass=_UserPass()), fresh_cache():
        backend = GemBackend(passes=[CountMatmulsJoint])
        torch.compile(f, backend=backend)(x, w)
    assert _UserPass.calls == 1
    # the uuid covers the chained pass: a different user pass must change it
    with_user = PassManager("joint", [CountMatmulsJoint(GemConfig())], chained=_UserPass()).uuid()
    without = PassManager("joint", [CountMatmulsJoint(GemConfig())]).uuid()
    assert with_user != without


def test_a_chained_pass_without_uuid_makes_the_slot_uncacheable():
    manager = PassManager("joint", [CountMatmulsJoint(GemConfig())], chained=lambda graph: None)
    assert manager.uuid() is None


def test_chain_existing_passes_false_drops_the_user_pass_with_a_warning():
    _UserPass.calls = 0
    x, w = _inputs()
    with inductor_config.patch(joint_custom_pre_pass=_UserPass()), fresh_cache():
        backend = GemBackend(GemConfig(chain_existing_passes=False), passes=[CountMatmulsJoint])
        with pytest.warns(UserWarning, match="joint_custom_pre_pass"):
            torch.compile(f, backend=backend)(x, w)
    assert _UserPass.calls == 0


def _compile_and_count(config):
    torch._dynamo.reset()
    counters.clear()
    x, w = _inputs()
    torch.compile(f, backend=GemBackend(config, passes=TOY_PIPELINE))(x, w).backward()
    return counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]


def test_same_config_hits_the_fx_graph_cache_and_a_new_knob_misses():
    with fresh_cache():
        hits, misses = _compile_and_count(GemConfig())
        assert hits == 0 and misses >= 1
        hits, misses = _compile_and_count(GemConfig())
        assert hits >= 1 and misses == 0
        hits, misses = _compile_and_count(GemConfig(jagged_attention={"min_kv_len": 7}))
        assert hits == 0 and misses >= 1


def test_the_partitioner_uuid_covers_the_memory_section_and_a_chained_partitioner():
    from gemcompile.passes.activation_memory import ActivationMemoryPartitioner

    uuid = lambda config, **kw: ActivationMemoryPartitioner(config, **kw).uuid()  # noqa: E731
    base = uuid(GemConfig())
    assert base == uuid(GemConfig()) and base == uuid(GemConfig(jagged_attention={"min_kv_len": 3}))
    assert base != uuid(GemConfig(memory={"budget": 0.5})) != uuid(GemConfig(memory={"budget": 0.25}))
    assert base != uuid(GemConfig(memory={"recompute_attention": True}))
    assert uuid(GemConfig(), chained=lambda gm, inputs, **kw: None) is None  # no uuid: uncacheable


def test_a_partitioner_already_in_the_slot_is_chained_under_the_budget():
    from gemcompile.passes.activation_memory import has_partitioner_slot

    if not has_partitioner_slot():
        pytest.skip("this torch's Inductor has no custom_partitioner_fn")
    import torch._functorch.config as functorch_config
    from functorch.compile import min_cut_rematerialization_partition
    from torch._inductor.custom_graph_pass import CustomPartitionerFn

    class UserPartitioner(CustomPartitionerFn):
        budgets = []

        def __call__(self, gm, joint_inputs, **kwargs):
            UserPartitioner.budgets.append(functorch_config.activation_memory_budget)
            return min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)

        def uuid(self):
            return "user-partitioner-v1"

    x = torch.randn(16, 4)
    w1, w2 = torch.randn(4, 16, requires_grad=True), torch.randn(16, 2, requires_grad=True)
    with inductor_config.patch(custom_partitioner_fn=UserPartitioner()), fresh_cache():
        backend = GemBackend(GemConfig(memory={"budget": 0.5}))
        torch.compile(lambda x, a, b: (x @ a) @ b, backend=backend)(x, w1, w2)  # GEMMs only: no C++ to build
    assert UserPartitioner.budgets == [0.5]
    assert len(backend.last_log.memory) == 1


def test_the_uuids_cover_the_ops_compiled_code_calls(monkeypatch):
    """Code cached against another version of gemcompile's ops (a schema with fewer arguments, another fake
    impl) must not come back: every pass's uuid and the partitioner's cover lowering/'s sources and schemas."""
    from gemcompile.passes import activation_memory, base
    from gemcompile.passes.activation_memory import ActivationMemoryPartitioner

    fingerprint = base.lowering_fingerprint()
    assert len(fingerprint) == 64 and fingerprint == base.lowering_fingerprint()
    config = GemConfig(memory={"budget": 0.5})
    before = (_toy_pass(())(GemConfig()).uuid(), ActivationMemoryPartitioner(config).uuid())
    monkeypatch.setattr(base, "lowering_fingerprint", lambda: "another version of the ops")
    monkeypatch.setattr(activation_memory, "lowering_fingerprint", lambda: "another version of the ops")
    after = (_toy_pass(())(GemConfig()).uuid(), ActivationMemoryPartitioner(config).uuid())
    assert before[0] != after[0] and before[1] != after[1]
