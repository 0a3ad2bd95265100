"""Sparse embedding-bag lookups of many tables -> one gemcompile::sparse_embedding_bags call (pre-grad).

A ranking model pools one nn.EmbeddingBag per sparse feature, each looked up alone: tens to hundreds of
small forward and backward launches and Python op calls a step, so the GPU idles while the host issues
them. Lookups that can share one call do (lowering/sparse_embedding/bags.py: one launch forward, one op
backward that files every table's rows): gemcompile::sparse_embedding calls (tables trained with sparse
row gradients, runtime/tables/sparse_tables.py) with

- a bag mode (sum or mean) and 2-D ids (bags, hot): no offsets;
- the same mode, padding id, weight dim, weight dtype and device, ids dtype and ids shape;
- plain tensor weights (a sharded table's DTensor keeps its own lookup);
- and an order that allows one call: every lookup's ids exist before the first use of any member's
  output (a lookup whose ids come from another member's output starts a group of its own).

The call stacks the ids (tables, bags, hot) and each member's output is a select of its table's slice.
Outputs are the module's own (same summation order on CUDA, the module's kernel on the CPU); the table's
optimizer sees the same (ids, rows) it saw per table.
"""

from __future__ import annotations

import torch
from torch import fx

from gemcompile.lowering.sparse_embedding.bags import sparse_embedding_bags  # noqa: F401 (registers the op)
from gemcompile.lowering.sparse_embedding.op import MODE_MEAN, MODE_SUM
from gemcompile.passes.base import GemPass
from gemcompile.passes.graph import Emitter, copy_source_meta, example_value, schema_arguments

_BAG_MODES = (MODE_SUM, MODE_MEAN)


def _group_key(node: fx.Node) -> tuple | None:
    """What a lookup must share with the others of its call, or None when it cannot join one."""
    call = schema_arguments(node)
    ids, weight = example_value(call["ids"]), example_value(call["weight"])
    if call["offsets"] is not None or call["mode"] not in _BAG_MODES:
        return None
    if not isinstance(ids, torch.Tensor) or not isinstance(weight, torch.Tensor) or ids.dim() != 2:
        return None
    if type(weight) is not torch._subclasses.fake_tensor.FakeTensor or weight.dim() != 2:
        return None  # a DTensor (sharded table) or another subclass keeps its own lookup
    return (call["mode"], call["padding_idx"], weight.shape[1], weight.dtype, str(weight.device), ids.dtype,
            str(tuple(ids.shape)))


def _positions(graph: fx.Graph) -> dict[fx.Node, int]:
    return {node: i for i, node in enumerate(graph.nodes)}


def _groups(members: list[fx.Node], position: dict[fx.Node, int]) -> list[list[fx.Node]]:
    """Split lookups of one key (in graph order) into runs that one call can replace: each run's inputs all
    come before the first use of any of its outputs."""
    groups, run, first_use, last_input = [], [], None, -1
    for node in members:
        inputs = max(position[n] for n in node.all_input_nodes)
        uses = min((position[u] for u in node.users), default=len(position))
        if run and (inputs >= first_use or uses <= last_input):
            groups.append(run)
            run, first_use, last_input = [], None, -1
        run.append(node)
        first_use = uses if first_use is None else min(first_use, uses)
        last_input = max(last_input, inputs)
    groups.append(run)
    return [g for g in groups if len(g) > 1]


class TableBatchingPass(GemPass):
    """sparse_embedding(ids_t, weight_t, ...) for t in a group -> sparse_embedding_bags(stack(ids), weights)."""

    name = "table_batching"
    stage = "pre_grad"
    config_section = "table_batching"

    def run(self, graph: fx.Graph) -> None:
        lookup = torch.ops.gemcompile.sparse_embedding.default
        by_key: dict[tuple, list[fx.Node]] = {}
        for node in graph.nodes:
            if node.op == "call_function" and node.target is lookup:
                key = _group_key(node)
                if key is not None:
                    by_key.setdefault(key, []).append(node)
        for members in by_key.values():
            for group in _groups(members, _positions(graph)):
                if len(group) >= self.options.min_tables:
                    self._rewrite(graph, group, _positions(graph))

    def _rewrite(self, graph: fx.Graph, group: list[fx.Node], position: dict[fx.Node, int]) -> None:
        calls = [schema_arguments(n) for n in group]
        users = [u for n in group for u in n.users]
        first_use = min(users, key=lambda u: position[u]) if users else next(n for n in graph.nodes
                                                                            if n.op == "output")
        emit = Emitter(graph)
        with graph.inserting_before(first_use):
            ids = emit.call(torch.stack, ([c["ids"] for c in calls], 0))
            pooled = emit.call(torch.ops.gemcompile.sparse_embedding_bags.default, (
                ids, [c["weight"] for c in calls], calls[0]["token"], calls[0]["mode"], calls[0]["padding_idx"],
                [c["table"] for c in calls]))
            outs = [emit.call(torch.select, (pooled, 0, t)) for t in range(len(group))]
        for node, out in zip(group, outs):
            copy_source_meta(node, out)
            node.replace_all_uses_with(out)
        copy_source_meta(group[0], pooled)
        before = [f"{n.name} = sparse_embedding({c['ids'].name}, {c['weight'].name}, ...)" for n, c in
                  zip(group, calls)]
        for node in group:
            graph.erase_node(node)
        weight = example_value(calls[0]["weight"])
        mode = "mean" if calls[0]["mode"] == MODE_MEAN else "sum"
        self.rewrote(pooled, "\n".join(before), [ids, pooled], detail=(
            f"{len(group)} {mode} lookups of {tuple(example_value(calls[0]['ids']).shape)} ids into dim "
            f"{weight.shape[1]} {weight.dtype} tables in one call: one launch forward, one op backward that "
            f"files every table's rows"), metrics={"tables": len(group)})
