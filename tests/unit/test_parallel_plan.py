"""The 5D plan as pure functions (axes, classes, placements, bytes, collectives), the config checks, the
sharding pass's annotations, and the plan applied under the fake process group at world 64 and 256."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from gemcompile import GemConfig
from gemcompile.config import ConfigError, ParallelConfig
from gemcompile.models.gem import GemRef, gem_ref_config
from gemcompile.runtime.distributed.plan import (
    ParallelPlanError,
    build_plan,
    classify_module,
    plan_for_model,
    resolve_axes,
)

ROOT = Path(__file__).resolve().parents[2]
ON = ParallelConfig(enabled=True)


def _meta_gem(size: str) -> GemRef:
    with torch.device("meta"):
        return GemRef(gem_ref_config(size))


# -- config ------------------------------------------------------------------------------------------


def test_config_fields_are_checked_with_their_names():
    with pytest.raises(ConfigError, match=r"ParallelConfig.ep = 0 .*>= 1"):
        ParallelConfig(ep=0)
    with pytest.raises(ConfigError, match=r"ParallelConfig.dp_shard = 'x' .*int or None"):
        ParallelConfig(dp_shard="x")
    with pytest.raises(ConfigError, match=r"ParallelConfig.ep = 3 .*divide dp_shard = 4"):
        ParallelConfig(dp_shard=4, ep=3)
    with pytest.raises(ConfigError, match="embedding_sharding"):
        ParallelConfig(embedding_sharding="rows")
    for bad in (0, -1.0, 1e-4, 1e10, float("inf"), float("nan")):  # gloo: ms in a C int (1e10 s overflowed)
        with pytest.raises(ConfigError, match=r"ParallelConfig.collective_timeout_s = .* seconds in \[1, "):
            ParallelConfig(collective_timeout_s=bad)
    assert ParallelConfig(collective_timeout_s=5).collective_timeout_s == 5
    with pytest.raises(ConfigError, match="expert_modules"):
        ParallelConfig(expert_modules="WukongExpert")
    with pytest.raises(TypeError, match="did you mean 'dp_shard'"):
        ParallelConfig(dp_shards=2)
    config = GemConfig(parallel={"enabled": True, "ep": 2, "expert_modules": ["WukongExpert"]})
    assert config.parallel.ep == 2 and config.parallel.expert_modules == ("WukongExpert",)


# -- axes --------------------------------------------------------------------------------------------


def test_defaults_derive_from_world_and_gpus_per_node():
    a = resolve_axes(ON, 16, gpus_per_node=8, expert_counts=[4])
    assert (a.dp_replicate, a.dp_shard, a.ep, a.efsdp, a.emb_outer, a.emb_inner) == (2, 8, 4, 2, 2, 8)
    a = resolve_axes(ON, 256, gpus_per_node=8, expert_counts=[2])
    assert (a.dp_replicate, a.dp_shard, a.ep, a.efsdp, a.emb_outer, a.emb_inner) == (32, 8, 2, 4, 32, 8)
    one = resolve_axes(ON, 1, expert_counts=[2])
    assert (one.dp_replicate, one.dp_shard, one.ep, one.emb_outer, one.emb_inner) == (1, 1, 1, 1, 1)
    # one node of 4 (torchrun's LOCAL_WORLD_SIZE when gpus_per_node is not given)
    a = resolve_axes(ON, 4, gpus_per_node=4)
    assert (a.dp_replicate, a.dp_shard, a.emb_outer, a.emb_inner) == (1, 4, 1, 4)
    # an explicit axis fixes its partner
    a = resolve_axes(ParallelConfig(dp_replicate=4, emb_outer=8), 64, gpus_per_node=8)
    assert (a.dp_shard, a.emb_inner) == (16, 8)


@pytest.mark.parametrize(
    ("config", "world", "message"),
    [
        (ParallelConfig(dp_replicate=4, dp_shard=4), 8, r"world size 8 does not factor into dp_replicate=4 x dp_shard=4"),
        (ParallelConfig(dp_shard=3), 8, r"world size 8 does not factor .*3 does not divide 8"),
        (ParallelConfig(emb_outer=3), 8, r"world size 8 does not factor into emb_outer=3"),
        (ParallelConfig(ep=4), 8, r"ep=4 does not divide dp_shard=2"),
    ],
)
def test_bad_factorization_is_a_clear_error(config, world, message):
    with pytest.raises(ParallelPlanError, match=message):
        resolve_axes(config, world, gpus_per_node=2)


@pytest.mark.parametrize("per_node, world", [(3, 4), (4, 6)])
def test_nodes_that_do_not_tile_the_world_are_a_clear_error(per_node, world):
    # 4 ranks on "nodes of 3": the intra-node axes would have spanned nodes without a word.
    with pytest.raises(ParallelPlanError, match=r"gpus_per_node"):
        resolve_axes(ParallelConfig(gpus_per_node=per_node), world)


def test_one_node_partly_used_is_allowed():
    assert resolve_axes(ParallelConfig(gpus_per_node=8), 4).gpus_per_node == 4


def test_expert_count_not_divisible_by_ep():
    with pytest.raises(ParallelPlanError, match=r"expert count 3 is not divisible by ep=2"):
        resolve_axes(ParallelConfig(ep=2), 4, gpus_per_node=4, expert_counts=[3])
    model = _meta_gem("tiny")  # 2 experts per interaction
    with pytest.raises(ParallelPlanError, match=r"expert count 2 is not divisible by ep=4"):
        plan_for_model(model, ParallelConfig(ep=4), 8, gpus_per_node=8)


def test_table_smaller_than_its_shard_count():
    model = _meta_gem("tiny")
    # action tables have 3 rows: with dense_table_max_rows=0 they are sharded over 4 row shards
    with pytest.raises(ParallelPlanError, match=r"seq_embedding.action.0.weight has 3 rows, fewer than its 4 row shards"):
        plan_for_model(model, ParallelConfig(dense_table_max_rows=0), 4, gpus_per_node=4)
    # tiny tables are 16 wide: 32 column groups do not divide them
    with pytest.raises(ParallelPlanError, match=r"has dim 16, not divisible into emb_outer=32"):
        plan_for_model(model, ParallelConfig(emb_outer=32), 64, gpus_per_node=2)
    plan_for_model(model, ParallelConfig(emb_outer=32, embedding_sharding="replicated_groups"), 64, gpus_per_node=2)


# -- classes, placements, bytes -------------------------------------------------------------------------


def test_classification_of_gem_ref():
    model = _meta_gem("tiny")
    infos = {i.name: i for i in classify_module(model, ON)}
    tables = {n for n, i in infos.items() if i.kind == "embedding"}
    assert tables == {f"nonseq_embedding.tables.{t}.weight" for t in range(4)} | {"seq_embedding.item.weight"}
    assert sum(math.prod(infos[n].shape) for n in tables) == model.parameter_counts()["sparse"]
    assert infos["seq_embedding.action.0.weight"].kind == "dense"  # 3 rows <= dense_table_max_rows
    assert "rows <= dense_table_max_rows" in infos["seq_embedding.time.1.weight"].reason
    experts = [i for i in infos.values() if i.kind == "expert"]
    assert {i.expert_group for i in experts} == {"layers.0.interaction.experts", "layers.1.interaction.experts"}
    assert all(".interaction.experts." in i.name and i.expert_count == 2 for i in experts)
    assert infos["layers.0.interaction.gate.weight"].kind == "dense"  # the gate is not an expert
    # patterns on module paths work as well as class names
    by_path = classify_module(model, ParallelConfig(expert_modules=("layers.1.interaction.experts.*",)))
    assert {i.expert_group for i in by_path if i.kind == "expert"} == {"layers.1.interaction.experts"}


@pytest.mark.parametrize("world", [64, 256])
def test_placements_and_bytes_of_gem_ref_small(world):
    plan = plan_for_model(_meta_gem("small"), ON, world, gpus_per_node=8)
    a = plan.axes
    assert (a.dp_shard, a.ep, a.efsdp, a.emb_inner) == (8, 2, 4, 8) and a.dp_replicate == a.emb_outer == world // 8
    table = plan["nonseq_embedding.tables.5.weight"]  # 65536 x 256 float32
    assert table.mesh_axes == ("emb_outer", "emb_inner") and table.placements == ("Shard(1)", "Shard(0)")
    assert table.local_shape == (65536 // 8, 256 // a.emb_outer)
    assert table.bytes_per_rank == 65536 // 8 * 256 // a.emb_outer * 4
    item = plan["seq_embedding.item.weight"]  # 2^20 x 256
    assert item.bytes_per_rank == (1 << 20) // 8 * 256 // a.emb_outer * 4
    dense = plan["heads.top.0.weight"]  # (1024, (n_F + n_L + n_seq * (n_pma + n_recent)) * d)
    assert dense.placements == ("Replicate()", "Shard(0)") and dense.local_shape == (1024 // 8, (32 + 2 * 16) * 256)
    expert = plan["layers.2.interaction.experts.1.fm_mlp.0.weight"]
    assert expert.mesh_axes == ("dp_replicate", "efsdp") and expert.ep_rank == 1
    assert expert.local_shape[0] == math.ceil(1024 / a.efsdp)
    # bytes on the most loaded rank: every dense and table shard, the experts of one ep position
    expected = sum(p.bytes_per_rank for p in plan.params if p.kind != "expert")
    expected += sum(p.bytes_per_rank for p in plan.params if p.kind == "expert" and p.ep_rank == 0)
    assert plan.bytes_per_rank() == expected
    assert plan.bytes_per_rank() < plan.total_bytes() / (world / 16)


def test_collectives_per_step_follow_the_axes():
    model = _meta_gem("small")  # 4 layers, 9 dense units (8 with parameters), 4 expert groups, 2 collections
    counts = plan_for_model(model, ON, 64, gpus_per_node=8).collective_counts()
    assert counts == {
        ("all_gather", "dp_shard"): 16, ("reduce_scatter", "dp_shard"): 8, ("all_reduce", "dp_replicate"): 12,
        ("all_gather", "efsdp"): 8, ("reduce_scatter", "efsdp"): 4,
        ("all_gather", "ep"): 8, ("reduce_scatter", "ep"): 8,
        ("all_gather", "emb_outer"): 2, ("all_to_all", "emb_outer"): 4, ("all_to_all", "emb_inner"): 8,
        ("all_reduce", "world"): 2,
    }
    # one node of 2 GPUs: only the intra-node axes talk, and ep = dp_shard leaves no expert FSDP
    counts = plan_for_model(model, ON, 2, gpus_per_node=2).collective_counts()
    assert set(counts) == {("all_gather", "dp_shard"), ("reduce_scatter", "dp_shard"), ("all_gather", "ep"),
                           ("reduce_scatter", "ep"), ("all_to_all", "emb_inner"), ("all_reduce", "world")}
    replicated = plan_for_model(model, ParallelConfig(embedding_sharding="replicated_groups"), 16,
                                gpus_per_node=8).collective_counts()
    assert replicated[("all_reduce", "emb_outer")] == 33  # one gradient all-reduce per table
    assert ("all_to_all", "emb_outer") not in replicated
    assert plan_for_model(model, ON, 1).collectives() == []


def test_build_plan_from_parameter_list():
    from gemcompile.runtime.distributed.plan import ParamInfo

    params = [ParamInfo("emb.weight", (10, 4), 4, "embedding", "weight of aten.embedding"),
              ParamInfo("w", (6, 3), 2, "dense", "dense weight")]
    plan = build_plan(params, ParallelConfig(embedding_sharding="replicated_groups"), 4, gpus_per_node=2)
    assert plan["emb.weight"].placements == ("Replicate()", "Shard(0)")
    assert plan["emb.weight"].local_shape == (5, 4) and plan["w"].bytes_per_rank == 3 * 3 * 2
    assert plan.embedding_collections == ("",)


# -- the sharding pass ---------------------------------------------------------------------------------


class _Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x)


class _Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = nn.EmbeddingBag(100, 8, mode="sum", padding_idx=0)
        self.small = nn.Embedding(3, 8)
        self.experts = nn.ModuleList(_Expert() for _ in range(4))
        self.head = nn.Linear(8, 1)

    def forward(self, ids, a):
        x = self.table(ids) + self.small(a)
        x = sum(e(x) for e in self.experts)
        return self.head(x).sum()


def _explain_toy(parallel):
    from gemcompile.explain import explain_with_passes
    from gemcompile.passes.sharding import ShardingPass

    config = GemConfig(parallel={"enabled": True, "expert_modules": ("_Expert",), **parallel})
    return explain_with_passes((ShardingPass,), _Toy(), torch.randint(0, 100, (4, 3)), torch.randint(0, 3, (4,)),
                               config=config)


def test_sharding_pass_annotates_parameters_and_their_uses():
    report = _explain_toy({"dp_replicate": 2, "dp_shard": 4})
    plan = report.parallel_plan
    assert plan.axes.world_size == 8 and plan.axes.ep == 4
    assert report.counts["sharding"] == 12  # every parameter annotated
    kinds = {p.name: p.kind for p in plan.params}
    assert kinds["table.weight"] == "embedding" and kinds["small.weight"] == "dense"
    assert kinds["experts.3.lin.bias"] == "expert" and kinds["head.weight"] == "dense"
    annotated = {}
    for node in report.graph_after.graph.nodes:
        entry = node.meta.get("custom", {}).get("gemcompile_sharding")
        if entry and "param" in entry:
            annotated[entry["param"]] = entry
            for user in node.users:  # each use carries its operands' placements
                assert user.meta["custom"]["gemcompile_sharding"][entry["param"]] == entry
    assert annotated["table.weight"]["placements"] == ["Shard(1)", "Shard(0)"]
    assert annotated["experts.2.lin.weight"]["ep_rank"] == 2
    # custom metadata reaches the forward and backward graphs through AOTAutograd
    for kind, gm in report.aot_graphs:
        marked = [n for n in gm.graph.nodes if "gemcompile_sharding" in n.meta.get("custom", {})]
        assert marked, kind
    text = report.render(width=160)
    assert "parallel plan: world 8" in text and "Shard(1), Shard(0)" in text
    assert "collectives per training step" in text and "emb_inner" in text


def test_sharding_pass_refuses_an_impossible_plan():
    report = _explain_toy({"dp_replicate": 1, "dp_shard": 8, "ep": 8})  # 4 experts
    assert report.parallel_plan is None and report.counts["sharding"] == 0
    (refusal,) = report.refusals
    assert "expert count 4 is not divisible by ep=8" in refusal.reason


def test_sharding_pass_off_by_default():
    from gemcompile.explain import explain_with_passes
    from gemcompile.passes.sharding import ShardingPass

    report = explain_with_passes((ShardingPass,), _Toy(), torch.randint(0, 100, (4, 3)), torch.randint(0, 3, (4,)))
    assert report.parallel_plan is None and report.counts == {"sharding": 0}


# -- the fake process group: world 64 and 256 ----------------------------------------------------------


@pytest.mark.parametrize(("world", "rank", "extra"), [(64, 0, "embedding_sharding=replicated_groups"),
                                                      (256, 37, "emb_outer=16, emb_inner=16")])
def test_fake_process_group_placements_bytes_and_collectives(world, rank, extra):
    """One process simulates `rank` of `world` (collectives are no-ops): the meshes are built, the plan is
    applied to GEM-ref small on the meta device (placements and bytes per rank) and tiny on the CPU (one
    training step with dense and one with sparse tables, their collectives counted per axis)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.pop("WORLD_SIZE", None)
    env.pop("LOCAL_WORLD_SIZE", None)
    script = ROOT / "tests" / "unit" / "parallel_fake_pg.py"
    out = subprocess.run([sys.executable, str(script), str(world), str(rank), extra], check=False,
                         capture_output=True,
                         text=True, env=env, timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "OK" in out.stdout
