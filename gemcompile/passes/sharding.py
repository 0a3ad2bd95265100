"""Sharding annotations (pre-grad, first in the pipeline): each parameter's mesh and DTensor placements.

The pass reads the parameters off the Dynamo graph (placeholders lifted from ``L['self']...`` and
get_attr nodes), classifies each by the op that uses it (runtime/distributed/plan.py: the weight of an
``embedding`` / ``embedding_bag`` is a table, a parameter used inside an ``expert_modules`` module is an
expert, the rest dense), builds the plan for the world size, and stores each parameter's placement in
``node.meta["custom"]["gemcompile_sharding"]`` on the parameter's node and on each node that uses it
(``{parameter name: annotation}``). ``custom`` metadata is what AOTAutograd carries from a node into
the joint, forward and backward nodes traced from it, so later passes see which mesh a GEM's operands
live on. The plan itself lands in ``GraphModule.meta["gemcompile_parallel_plan"]``; explain prints it
as a table with the collectives one step issues.

Nothing is rewritten: the placements are applied by the runtime (runtime/distributed/apply.py), eagerly. A
model that cannot be placed (an expert count not divisible by ep, a table with fewer rows than its
shards) is left unannotated, with the reason in explain.

World size: torch.distributed's when initialized, else $WORLD_SIZE, else the product of the dense axes
when both are given, else 1. Under the parallel runtime each compiled unit gets a subclass bound to the
runtime's plan and the unit's path (``bound``), so the annotations are the ones the runtime applied.
"""

from __future__ import annotations

import os
import re
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import fx, nn

from gemcompile.passes.base import GemPass
from gemcompile.runtime.distributed.plan import (
    ParallelPlan,
    ParallelPlanError,
    ParamInfo,
    build_plan,
    classify_param,
    dense_units_from_names,
    expert_scope,
)

__all__ = ["META_KEY", "PLAN_KEY", "ShardingPass", "graph_parameters", "plan_of"]

META_KEY = "gemcompile_sharding"
"""Key inside node.meta["custom"]."""
PLAN_KEY = "gemcompile_parallel_plan"
"""Key in GraphModule.meta holding the ParallelPlan."""

_EMBEDDING_OPS: dict[Any, tuple[str, int]] = {
    F.embedding: ("aten.embedding", 1),
    F.embedding_bag: ("aten.embedding_bag", 1),
    torch.embedding: ("aten.embedding", 0),
    torch.embedding_bag: ("aten.embedding_bag", 0),
    torch.ops.aten.embedding.default: ("aten.embedding", 0),
    torch.ops.aten._embedding_bag.default: ("aten.embedding_bag", 0),
    torch.ops.aten._embedding_bag_forward_only.default: ("aten.embedding_bag", 0),
}
"""Lookup ops -> (name, position of the weight argument)."""

_SOURCE_KEY = re.compile(r"\['([^']+)'\]|\.(\w+)")


_ROOT = re.compile(r"^L\['[^']+'\]")
"""The module's own local in Dynamo sources: ``L['self']`` (or whatever forward names its first argument)."""


def _fqn_from_source(source: str) -> str | None:
    """``L['self']._modules['a']._modules['0']._parameters['weight']`` -> ``a.0.weight``."""
    root = _ROOT.match(source)
    if root is None:
        return None
    parts = [a or b for a, b in _SOURCE_KEY.findall(source[root.end():])]
    return ".".join(p for p in parts if p not in ("_modules", "_parameters", "_buffers"))


def _module_path(path: str) -> str:
    """``L['self'].layers.0`` -> ``layers.0`` (nn_module_stack paths)."""
    root = _ROOT.match(path)
    return path[root.end():].lstrip(".") if root is not None else path


def graph_parameters(graph: fx.Graph) -> list[tuple[fx.Node, str, torch.Tensor | None]]:
    """(node, fully qualified name, example) of every parameter the graph reads."""
    out = []
    owner = graph.owning_module
    for node in graph.nodes:
        if node.op == "placeholder":
            grapharg = node.meta.get("grapharg")
            example = getattr(grapharg, "example", None)
            if not isinstance(example, nn.Parameter):
                continue
            source = getattr(grapharg, "source", None)
            name = source.name() if callable(getattr(source, "name", None)) else getattr(source, "name", None)
            fqn = _fqn_from_source(name) if isinstance(name, str) else None
            out.append((node, fqn or node.name, example))
        elif node.op == "get_attr" and owner is not None:
            try:
                value = owner.get_parameter(node.target)
            except AttributeError:
                continue
            out.append((node, str(node.target), value))
    return out


def _lookup_use(node: fx.Node) -> tuple[str, int | None] | None:
    """(op name, padding_idx) if `node` is used as the weight of an embedding lookup."""
    for user in node.users:
        spec = _EMBEDDING_OPS.get(user.target) if user.op == "call_function" else None
        if spec is None:
            continue
        name, position = spec
        weight = user.args[position] if len(user.args) > position else user.kwargs.get("weight")
        if weight is node:
            padding = user.kwargs.get("padding_idx")
            if padding is None and name == "aten.embedding" and position == 1 and len(user.args) > 2:
                padding = user.args[2]
            return name, padding if isinstance(padding, int) else None
    return None


def _module_stack(node: fx.Node) -> list[tuple[str, str]]:
    """(module path, class name) of the modules a parameter is used in, outermost first (union over its
    users: the innermost user decides nothing on its own)."""
    stack: dict[str, str] = {}
    for user in node.users:
        for path, cls in (user.meta.get("nn_module_stack") or {}).values():
            name = cls.__name__ if isinstance(cls, type) else str(cls).rsplit(".", 1)[-1].rstrip("'>")
            stack.setdefault(_module_path(path), name)
    return sorted(stack.items(), key=lambda item: item[0].count(".") if item[0] else -1)


def plan_of(gm: fx.GraphModule) -> ParallelPlan | None:
    """The plan the sharding pass computed for this graph (None when it did not run or refused)."""
    return getattr(gm, "meta", {}).get(PLAN_KEY)


def _world_size(config) -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    env = os.environ.get("WORLD_SIZE", "")
    if env.isdigit() and int(env) >= 1:
        return int(env)
    if config.dp_replicate is not None and config.dp_shard is not None:
        return config.dp_replicate * config.dp_shard
    if config.emb_outer is not None and config.emb_inner is not None:
        return config.emb_outer * config.emb_inner
    return 1


class ShardingPass(GemPass):
    """Annotates every parameter node with its mesh and placements (no rewrite)."""

    name = "sharding"
    stage = "pre_grad"
    config_section = "parallel"

    plan: ClassVar[ParallelPlan | None] = None
    """Set by ``bound``: the runtime's plan (parameter names are the model's)."""
    prefix: ClassVar[str] = ""
    """Set by ``bound``: the path of the compiled unit inside the model (``layers.0.``)."""

    @classmethod
    def bound(cls, plan: ParallelPlan, prefix: str) -> type[ShardingPass]:
        """A ShardingPass that annotates with `plan` the graph of the module at `prefix`."""
        return type(cls.__name__, (cls,), {"plan": plan, "prefix": f"{prefix}." if prefix else "",
                                           "__module__": cls.__module__, "__qualname__": cls.__qualname__})

    def run(self, graph: fx.Graph) -> None:
        params = graph_parameters(graph)
        if not params:
            return
        plan = self.plan
        if plan is None:
            try:
                plan = self._plan_from_graph(params)
            except ParallelPlanError as e:
                self.refused(params[0][0], f"no parallel plan for this graph: {e}")
                return
        owner = graph.owning_module
        if owner is not None and self.plan is None:
            owner.meta[PLAN_KEY] = plan
        for node, fqn, _ in params:
            full = self.prefix + fqn
            try:
                entry = plan[full]
            except KeyError:
                self.refused(node, f"parameter {full} is not in the parallel plan")
                continue
            annotation = {"param": full, **entry.annotation()}
            node.meta.setdefault("custom", {})[META_KEY] = annotation
            for user in node.users:
                user.meta.setdefault("custom", {}).setdefault(META_KEY, {})
                if "param" not in user.meta["custom"][META_KEY]:  # a user of several parameters
                    user.meta["custom"][META_KEY][full] = annotation
            self.rewrote(node, f"{node.name} = <parameter {full}>",
                         f"{node.name} = <parameter {full}>  # {entry.mesh} mesh "
                         f"({', '.join(entry.mesh_axes)}): {', '.join(entry.placements)}",
                         detail=f"{entry.kind}: {', '.join(entry.placements)} on {entry.mesh} mesh")

    def _plan_from_graph(self, params) -> ParallelPlan:
        config = self.options
        infos: list[ParamInfo] = []
        stacks = {}
        for node, fqn, example in params:
            stacks[fqn] = _module_stack(node)
        # experts: the expert count of a group is the number of siblings the graph uses
        groups: dict[str, set[int]] = {}
        for fqn, stack in stacks.items():
            scope = expert_scope(config, stack)
            if scope is not None:
                groups.setdefault(scope[0], set()).add(scope[1])
        for node, fqn, example in params:
            shape = tuple(example.shape) if example is not None else tuple(node.meta["example_value"].shape)
            itemsize = example.element_size() if example is not None else 4
            use = _lookup_use(node)
            stack = stacks[fqn]
            scope = expert_scope(config, stack) if use is None else None
            count = len(groups[scope[0]]) if scope is not None else None
            infos.append(classify_param(fqn, shape, itemsize, config, stack, None,
                                       op=use[0] if use else None, padding_idx=use[1] if use else None,
                                       expert_count=count))
        return build_plan(infos, config, _world_size(config),
                          dense_units=dense_units_from_names(i.name for i in infos if i.kind == "dense"))


# ---------------------------------------------------------------------------------------------------
# Rendering (explain)
# ---------------------------------------------------------------------------------------------------


def plan_tables(plan: ParallelPlan, title: str = "parallel plan") -> list[Any]:
    """rich renderables: the axes, one row per parameter, and the collectives per step."""
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    from gemcompile.runtime.distributed.plan import bytes_text

    a = plan.axes
    head = Text(
        f"{title}: world {a.world_size} ({a.gpus_per_node} per node): dense (dp_replicate={a.dp_replicate}, "
        f"dp_shard={a.dp_shard}), experts (ep={a.ep}, efsdp={a.efsdp}), embeddings "
        f"{plan.config.embedding_sharding} (emb_outer={a.emb_outer}, emb_inner={a.emb_inner}); "
        f"parameters {bytes_text(plan.total_bytes())}, on the most loaded rank {bytes_text(plan.bytes_per_rank())}",
        style="bold")
    table = Table(title="placements", title_justify="left")
    for col, justify in (("parameter", "left"), ("kind", "left"), ("shape", "right"), ("mesh axes", "left"),
                         ("placements", "left"), ("local shape", "right"), ("bytes / rank", "right")):
        table.add_column(col, justify=justify)
    for row in plan.rows():
        table.add_row(*(escape(c) for c in row))
    coll = Table(title="collectives per training step (forward + backward)", title_justify="left")
    for col, justify in (("op", "left"), ("axis", "left"), ("count", "right"), ("why", "left")):
        coll.add_column(col, justify=justify)
    for c in plan.collectives():
        coll.add_row(c.op, c.axis, str(c.count), escape(c.why))
    if not plan.collectives():
        coll.add_row("(none: one rank)", "", "", "")
    return [head, table, coll]
