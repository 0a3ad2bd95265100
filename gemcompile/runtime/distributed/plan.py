"""The 5D parallel plan as pure functions: mesh axes, parameter classes, placements, bytes, collectives.

Nothing here talks to torch.distributed: a plan is computed from a ParallelConfig, a world size and
the parameters of a model (a module, which may live on the meta device, or the parameter list the
sharding pass reads off the Dynamo graph). runtime/distributed/apply.py applies it; the sharding
pass (passes/sharding.py) annotates the graph with it; explain prints it.

The five axes are views of one world of W = nodes x gpus_per_node ranks, numbered node-major (as
torchrun does), never a 5-D product:

    dense     mesh (dp_replicate, dp_shard)             params (Replicate(), Shard(0))   = HSDP
    expert    mesh (dp_replicate, efsdp, ep)            expert e on ep rank e // (E / ep),
              efsdp = dp_shard / ep                     HSDP over (dp_replicate, efsdp)
    embedding mesh (emb_outer, emb_inner)               grid: (Shard(1), Shard(0)); replicated
                                                        groups: (Replicate(), Shard(0))

Within a mesh the last axis varies fastest, so dp_shard, ep and emb_inner stay inside a node when
they are at most gpus_per_node (the defaults), and the axes across nodes carry the once-per-step
traffic (gradient all-reduce) or small messages (ids).

Parameter classes (by the op that uses a parameter): the weight of an embedding lookup
(``aten.embedding`` / ``aten.embedding_bag``, i.e. nn.Embedding / nn.EmbeddingBag) with more than
``dense_table_max_rows`` rows is an embedding table; a parameter of a module named in
``expert_modules`` is an expert; everything else is dense.
"""

from __future__ import annotations

import fnmatch
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from torch import nn

from gemcompile.config import PARALLEL_AXES, ParallelConfig

__all__ = [
    "SPARSE_ROW_SHARDINGS",
    "CollectiveCount",
    "MeshAxes",
    "ParallelPlan",
    "ParallelPlanError",
    "ParamInfo",
    "ParamPlan",
    "build_plan",
    "bytes_text",
    "classify_module",
    "classify_param",
    "collection_of",
    "dense_units_from_names",
    "dense_units_of",
    "expert_scope",
    "plan_for_model",
    "resolve_axes",
]

ParamKind = Literal["embedding", "expert", "dense"]

SPARSE_ROW_SHARDINGS = ("grid", "replicated_groups")
"""ParallelConfig.embedding_sharding values whose sharded tables can train sparsely (row gradients of the
local shard and SparseAdagrad: runtime/distributed/embedding.py); tables of any other sharding stay
dense."""

MESH_AXES: dict[str, tuple[str, ...]] = {
    "dense": ("dp_replicate", "dp_shard"),
    "expert": ("dp_replicate", "efsdp", "ep"),
    "embedding": ("emb_outer", "emb_inner"),
}
"""Axis names of each mesh, outermost first."""


class ParallelPlanError(ValueError):
    """The world size, the axes and the model do not fit together (raised before any collective)."""

    same_on_every_rank = True
    """Every rank derives the plan from the same flags and world: under torchrun rank 0 alone says it."""


# ---------------------------------------------------------------------------------------------------
# Axes
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MeshAxes:
    """Resolved sizes of the five axes for one world size."""

    world_size: int
    gpus_per_node: int
    dp_replicate: int
    dp_shard: int
    ep: int
    emb_outer: int
    emb_inner: int

    @property
    def efsdp(self) -> int:
        """Shards of each expert inside its ep position: dp_shard / ep."""
        return self.dp_shard // self.ep

    def sizes(self, mesh: str) -> tuple[int, ...]:
        """Shape of a mesh ("dense", "expert" or "embedding")."""
        return tuple(getattr(self, axis) for axis in MESH_AXES[mesh])

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in ("world_size", "gpus_per_node", *PARALLEL_AXES, "efsdp")}


def _default_gpus_per_node(config: ParallelConfig, world_size: int, gpus_per_node: int | None) -> int:
    if config.gpus_per_node is not None:
        return config.gpus_per_node
    if gpus_per_node is not None:
        return gpus_per_node
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local and local.isdigit() and int(local) >= 1:
        return int(local)
    return world_size


def _pair(world: int, outer: int | None, inner: int | None, per_node: int, names: tuple[str, str]) -> tuple[int, int]:
    """Resolve (outer, inner) with outer * inner = world: inner defaults to the ranks of a node."""
    outer_name, inner_name = names
    if outer is None and inner is None:
        inner = per_node if world % per_node == 0 else world
    if inner is None:
        if world % outer:
            raise ParallelPlanError(f"world size {world} does not factor into {outer_name}={outer} x "
                                    f"{inner_name}: {outer} does not divide {world}")
        inner = world // outer
    if outer is None:
        if world % inner:
            raise ParallelPlanError(f"world size {world} does not factor into {outer_name} x "
                                    f"{inner_name}={inner}: {inner} does not divide {world}")
        outer = world // inner
    if outer * inner != world:
        raise ParallelPlanError(f"world size {world} does not factor into {outer_name}={outer} x "
                                f"{inner_name}={inner} = {outer * inner}")
    return outer, inner


def resolve_axes(config: ParallelConfig, world_size: int, *, gpus_per_node: int | None = None,
                 expert_counts: Iterable[int] = ()) -> MeshAxes:
    """The sizes of the five axes for `world_size` ranks; None fields of `config` are derived.

    Raises ParallelPlanError when the world does not factor into the axes, ep does not divide dp_shard,
    or an expert count is not divisible by ep.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ParallelPlanError(f"world size must be an int >= 1, got {world_size!r}")
    per_node = _default_gpus_per_node(config, world_size, gpus_per_node)
    if per_node < world_size and world_size % per_node:
        # Nodes of unequal size: the intra-node axes would silently span nodes.
        raise ParallelPlanError(f"world size {world_size} is not a whole number of nodes of gpus_per_node="
                                f"{per_node} ranks")
    per_node = min(per_node, world_size)  # one node, partly used
    dp_replicate, dp_shard = _pair(world_size, config.dp_replicate, config.dp_shard, per_node,
                                   ("dp_replicate", "dp_shard"))
    emb_outer, emb_inner = _pair(world_size, config.emb_outer, config.emb_inner, per_node,
                                 ("emb_outer", "emb_inner"))
    counts = sorted(set(expert_counts))
    if config.ep is None:
        ep = dp_shard
        for count in counts:
            ep = math.gcd(ep, count)
    else:
        ep = config.ep
    if dp_shard % ep:
        raise ParallelPlanError(f"ep={ep} does not divide dp_shard={dp_shard}: expert-parallel ranks are "
                                "taken from the dense shard group")
    for count in counts:
        if count % ep:
            raise ParallelPlanError(f"expert count {count} is not divisible by ep={ep}: every ep rank must "
                                    f"hold the same number of experts (choose ep among the divisors of {count})")
    return MeshAxes(world_size, per_node, dp_replicate, dp_shard, ep, emb_outer, emb_inner)


# ---------------------------------------------------------------------------------------------------
# Parameters
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParamInfo:
    """What the plan needs to know about one parameter."""

    name: str
    """Fully qualified name in the model (``layers.0.interaction.experts.1.fm_y``)."""
    shape: tuple[int, ...]
    itemsize: int
    """Bytes per element."""
    kind: ParamKind
    reason: str
    """Why it has this class (the op or module that decided it)."""
    expert_group: str | None = None
    """Experts: path of the ModuleList of sibling experts (``layers.0.interaction.experts``)."""
    expert_index: int | None = None
    """Experts: position in that list."""
    expert_count: int | None = None
    """Experts: length of that list."""
    padding_idx: int | None = None
    """Embedding tables: the padding row (never looked up)."""


def _matches(patterns: Iterable[str], path: str, cls: str) -> bool:
    return any(cls == p or fnmatch.fnmatchcase(path, p) for p in patterns)


def expert_scope(config: ParallelConfig, module_path: Iterable[tuple[str, str]]) -> tuple[str, int] | None:
    """(expert ModuleList path, index) of the outermost module on `module_path` (a list of (path, class
    name), outermost first) that `expert_modules` names, or None."""
    for path, cls in module_path:
        if path and _matches(config.expert_modules, path, cls):
            parent, _, index = path.rpartition(".")
            if not index.isdigit():
                raise ParallelPlanError(f"expert module {path} ({cls}) is not an element of a ModuleList of "
                                        "sibling experts; expert parallelism needs experts[i]")
            return parent, int(index)
    return None


def classify_module(model: nn.Module, config: ParallelConfig) -> list[ParamInfo]:
    """Classify every parameter of `model` (which may be on the meta device) from its module tree:
    weights of nn.Embedding / nn.EmbeddingBag (the modules calling aten.embedding / embedding_bag)
    above dense_table_max_rows rows are embedding tables, parameters of expert_modules are experts,
    the rest dense."""
    modules = dict(model.named_modules())
    embedding_weights: dict[int, nn.Module] = {
        id(m.weight): m for m in modules.values() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))
    }
    out: list[ParamInfo] = []
    for name, param in model.named_parameters():
        parts = name.split(".")[:-1]
        stack = [(".".join(parts[:i]), type(modules[".".join(parts[:i])]).__name__) for i in range(1, len(parts) + 1)]
        out.append(classify_param(name, tuple(param.shape), param.element_size(), config, stack,
                             embedding_weights.get(id(param)), modules))
    return out


def classify_param(name: str, shape: tuple[int, ...], itemsize: int, config: ParallelConfig,
              stack: list[tuple[str, str]], embedding: nn.Module | None,
              modules: Mapping[str, nn.Module] | None = None, *, op: str | None = None,
              padding_idx: int | None = None, expert_count: int | None = None) -> ParamInfo:
    """Shared by classify_module and the sharding pass (which passes `op`, the lookup it saw)."""
    if embedding is not None:
        op = "aten.embedding_bag" if isinstance(embedding, nn.EmbeddingBag) else "aten.embedding"
        padding_idx = embedding.padding_idx
    if op is not None:
        rows = shape[0]
        if rows <= config.dense_table_max_rows:
            return ParamInfo(name, shape, itemsize, "dense",
                             f"{op} weight with {rows} rows <= dense_table_max_rows={config.dense_table_max_rows}")
        return ParamInfo(name, shape, itemsize, "embedding", f"weight of {op}", padding_idx=padding_idx)
    scope = expert_scope(config, stack)
    if scope is not None:
        group, index = scope
        count = expert_count
        if count is None and modules is not None:
            count = len(modules[group])
        cls = dict(stack).get(f"{group}.{index}", "?")
        return ParamInfo(name, shape, itemsize, "expert", f"in expert module {cls}", expert_group=group,
                         expert_index=index, expert_count=count)
    return ParamInfo(name, shape, itemsize, "dense", "dense weight")


# ---------------------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------------------


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _placement_text(placements: tuple[tuple[str, int | None], ...]) -> tuple[str, ...]:
    return tuple(f"Shard({d})" if kind == "S" else "Replicate()" for kind, d in placements)


@dataclass(frozen=True)
class ParamPlan:
    """Where one parameter lives."""

    info: ParamInfo
    mesh: Literal["dense", "expert", "embedding"]
    """Which mesh (see MESH_AXES)."""
    mesh_axes: tuple[str, ...]
    """The axes its placements refer to (experts: (dp_replicate, efsdp); the ep axis picks the holder)."""
    mesh_shape: tuple[int, ...]
    placements: tuple[str, ...]
    """DTensor placements over mesh_axes, as text ("Replicate()", "Shard(0)")."""
    local_shape: tuple[int, ...]
    """The largest local shard."""
    bytes_per_rank: int
    """Bytes of the largest local shard on a rank that holds the parameter."""
    ep_rank: int | None = None
    """Experts: the coordinate of the ep axis whose ranks hold it."""

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def kind(self) -> ParamKind:
        return self.info.kind

    def dtensor_placements(self) -> tuple:
        """The placements as torch.distributed.tensor Placement objects."""
        from torch.distributed.tensor import Replicate, Shard

        return tuple(Replicate() if p == "Replicate()" else Shard(int(p[6:-1])) for p in self.placements)

    def annotation(self) -> dict[str, object]:
        """What the sharding pass stores in node.meta["custom"] (plain, printable values)."""
        out: dict[str, object] = {
            "kind": self.kind,
            "mesh": self.mesh,
            "mesh_axes": list(self.mesh_axes),
            "mesh_shape": list(self.mesh_shape),
            "placements": list(self.placements),
            "local_shape": list(self.local_shape),
            "bytes_per_rank": self.bytes_per_rank,
        }
        if self.ep_rank is not None:
            out["ep_rank"] = self.ep_rank
        return out


@dataclass(frozen=True)
class CollectiveCount:
    """Collectives of one kind on one axis per training step (forward + backward)."""

    op: Literal["all_gather", "reduce_scatter", "all_reduce", "all_to_all"]
    axis: str
    """Mesh axis (or "world" for the one global scalar reduction)."""
    count: int
    why: str


@dataclass(frozen=True)
class ParallelPlan:
    """The plan for one model at one world size."""

    axes: MeshAxes
    config: ParallelConfig
    params: tuple[ParamPlan, ...]
    dense_units: tuple[str, ...] = ()
    """FSDP units of the dense weights (module paths; "" = the root), innermost first."""
    expert_groups: tuple[str, ...] = ()
    """ModuleLists of experts; each is one FSDP unit per ep rank and one expert-parallel exchange."""
    embedding_collections: tuple[str, ...] = ()
    """Modules owning sharded tables; each collection is looked up in one fused exchange per step."""
    notes: tuple[str, ...] = field(default_factory=tuple)

    def __getitem__(self, name: str) -> ParamPlan:
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(name)

    def by_kind(self, kind: ParamKind) -> list[ParamPlan]:
        return [p for p in self.params if p.kind == kind]

    def bytes_per_rank(self) -> int:
        """Parameter bytes on the most loaded rank: every dense and embedding shard, plus the experts of
        the most loaded ep position."""
        total = sum(p.bytes_per_rank for p in self.params if p.kind != "expert")
        per_ep: dict[int, int] = {}
        for p in self.by_kind("expert"):
            per_ep[p.ep_rank] = per_ep.get(p.ep_rank, 0) + p.bytes_per_rank
        return total + max(per_ep.values(), default=0)

    def total_bytes(self) -> int:
        """Parameter bytes of the unsharded model."""
        return sum(math.prod(p.info.shape) * p.info.itemsize for p in self.params)

    def collectives(self, sparse_tables: bool = False) -> list[CollectiveCount]:
        """The collectives one training step issues (forward and backward), per op and axis;
        `sparse_tables`: the sharded tables train sparsely (row gradients, SparseAdagrad).

        Counted the way the runtime issues them (degenerate axes of size 1 issue nothing):
        - each dense FSDP unit with parameters: all-gather on dp_shard in forward and again in backward
          (resharded after forward; not the root), reduce-scatter on dp_shard and all-reduce of the
          shard on dp_replicate in backward (HSDP);
        - each expert group: the same on (dp_replicate, efsdp) for the local experts (one FSDP unit),
          plus on ep: all-gather of the activations and reduce-scatter of the outputs in forward, and
          the transposes (all-gather of output grads, reduce-scatter of input grads) in backward;
        - each embedding collection: ids all-gather on emb_outer, counts + ids + outputs all-to-all on
          emb_inner, outputs all-to-all on emb_outer in forward; the two output all-to-alls reversed in
          backward (replicated groups: no emb_outer traffic in the lookup; one gradient all-reduce per
          table on emb_outer, or with sparse tables three all-gathers on emb_outer for all tables
          together: counts, ids, rows);
        - over the world: one scalar all-reduce of the global label count (the loss is the global masked
          mean) and one of the squared gradient norm (clipping).
        """
        a = self.axes
        counts: dict[tuple[str, str], list] = {}

        def add(op: str, axis: str, n: int, why: str, size: int) -> None:
            if n and size > 1:
                entry = counts.setdefault((op, axis), [0, []])
                entry[0] += n
                entry[1].append(why)

        units = [u for u in self.dense_units if self._unit_has_params(u)]
        non_root = [u for u in units if u != ""]
        add("all_gather", "dp_shard", len(units) + len(non_root), f"{len(units)} dense FSDP units: forward, "
            f"and backward for {len(non_root)} resharded units", a.dp_shard)
        add("reduce_scatter", "dp_shard", len(units), "dense gradients", a.dp_shard)
        add("all_reduce", "dp_replicate", len(units), "dense gradient shards (HSDP)", a.dp_replicate)
        groups = len(self.expert_groups)
        add("all_gather", "efsdp", 2 * groups, "expert FSDP units: forward and backward", a.efsdp)
        add("reduce_scatter", "efsdp", groups, "expert gradients", a.efsdp)
        add("all_reduce", "dp_replicate", groups, "expert gradient shards (HSDP)", a.dp_replicate)
        add("all_gather", "ep", 2 * groups, "activations (forward) and output grads (backward)", a.ep)
        add("reduce_scatter", "ep", 2 * groups, "outputs (forward) and input grads (backward)", a.ep)
        cols = len(self.embedding_collections)
        grid = self.config.embedding_sharding == "grid"
        if grid:
            add("all_gather", "emb_outer", cols, "ids to every column group", a.emb_outer)
            add("all_to_all", "emb_outer", 2 * cols, "pooled outputs back to the samples' ranks, and grads",
                a.emb_outer)
        elif sparse_tables:
            tables = 3 if self.by_kind("embedding") else 0
            add("all_gather", "emb_outer", tables, "row gradients across replica groups (counts, ids, rows)",
                a.emb_outer)
        else:
            tables = len(self.by_kind("embedding"))
            add("all_reduce", "emb_outer", tables, "table gradients across replica groups", a.emb_outer)
        add("all_to_all", "emb_inner", 4 * cols, "id counts, ids, outputs (forward) and output grads "
            "(backward)", a.emb_inner)
        add("all_reduce", "world", 2, "label count of the global batch (loss normalization), gradient norm "
            "(clipping)", a.world_size)
        return [CollectiveCount(op, axis, n, "; ".join(why)) for (op, axis), (n, why) in counts.items()]

    def collective_counts(self, sparse_tables: bool = False) -> dict[tuple[str, str], int]:
        """{(op, axis): count per step}."""
        return {(c.op, c.axis): c.count for c in self.collectives(sparse_tables)}

    def _unit_has_params(self, unit: str) -> bool:
        return any(_unit_of(p.name, self.dense_units) == unit for p in self.by_kind("dense"))

    def rows(self) -> list[tuple[str, str, str, str, str, str, str]]:
        """(parameter, kind, shape, mesh axes, placements, local shape, bytes per rank) per parameter."""
        out = []
        for p in self.params:
            axes = ", ".join(f"{n}={s}" for n, s in zip(p.mesh_axes, p.mesh_shape))
            if p.ep_rank is not None:
                axes += f" | ep={self.axes.ep} @ {p.ep_rank}"
            out.append((p.name, p.kind, "x".join(map(str, p.info.shape)), axes, ", ".join(p.placements),
                        "x".join(map(str, p.local_shape)), bytes_text(p.bytes_per_rank)))
        return out


def bytes_text(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _unit_of(name: str, units: tuple[str, ...]) -> str:
    """The innermost FSDP unit whose path prefixes a parameter name."""
    best = ""
    for u in units:
        if u and (name.startswith(u + ".")) and len(u) > len(best):
            best = u
    return best


def _local_shape(shape: tuple[int, ...], placements: tuple[tuple[str, int | None], ...],
                 sizes: tuple[int, ...]) -> tuple[int, ...]:
    local = list(shape)
    for (kind, dim), size in zip(placements, sizes):
        if kind == "S":
            local[dim] = _ceil_div(local[dim], size)
    return tuple(local)


def build_plan(params: Iterable[ParamInfo], config: ParallelConfig, world_size: int, *,
               gpus_per_node: int | None = None, dense_units: Iterable[str] = ("",),
               embedding_collections: Iterable[str] | None = None) -> ParallelPlan:
    """Resolve the axes and place every parameter. Raises ParallelPlanError on a model that cannot be
    placed (expert count not divisible by ep, a table with fewer rows than row shards, ...)."""
    params = list(params)
    expert_counts = {p.expert_count for p in params if p.kind == "expert" and p.expert_count}
    axes = resolve_axes(config, world_size, gpus_per_node=gpus_per_node, expert_counts=expert_counts)
    grid = config.embedding_sharding == "grid"
    plans: list[ParamPlan] = []
    groups: list[str] = []
    for info in params:
        if info.kind == "embedding":
            rows, dim = info.shape[0], info.shape[1]
            if rows < axes.emb_inner:
                raise ParallelPlanError(
                    f"embedding table {info.name} has {rows} rows, fewer than its {axes.emb_inner} row shards "
                    f"(emb_inner={axes.emb_inner}); lower emb_inner or raise dense_table_max_rows (now "
                    f"{config.dense_table_max_rows}) to train it as a dense weight")
            if grid and dim % axes.emb_outer:
                raise ParallelPlanError(
                    f"embedding table {info.name} has dim {dim}, not divisible into emb_outer={axes.emb_outer} "
                    "column groups; choose emb_outer among the divisors of the dim, or "
                    "embedding_sharding='replicated_groups'")
            place = (("S", 1), ("S", 0)) if grid else (("R", None), ("S", 0))
            sizes = axes.sizes("embedding")
            local = _local_shape(info.shape, place, sizes)
            plans.append(ParamPlan(info, "embedding", MESH_AXES["embedding"], sizes, _placement_text(place),
                                   local, math.prod(local) * info.itemsize))
        elif info.kind == "expert":
            if info.expert_count is None or info.expert_index is None:
                raise ParallelPlanError(f"expert parameter {info.name} has no expert index / count")
            if info.expert_group not in groups:
                groups.append(info.expert_group)
            per_rank = info.expert_count // axes.ep
            place = (("R", None), ("S", 0))
            sizes = (axes.dp_replicate, axes.efsdp)
            local = _local_shape(info.shape, place, sizes) if info.shape else ()
            plans.append(ParamPlan(info, "expert", ("dp_replicate", "efsdp"), sizes, _placement_text(place),
                                   local, math.prod(local) * info.itemsize, ep_rank=info.expert_index // per_rank))
        else:
            place = (("R", None), ("S", 0)) if info.shape else (("R", None), ("R", None))
            sizes = axes.sizes("dense")
            local = _local_shape(info.shape, place, sizes)
            plans.append(ParamPlan(info, "dense", MESH_AXES["dense"], sizes, _placement_text(place), local,
                                   math.prod(local) * info.itemsize))
    if embedding_collections is None:
        embedding_collections = sorted({collection_of(p.name) for p in plans if p.kind == "embedding"})
    return ParallelPlan(axes, config, tuple(plans), tuple(dense_units), tuple(groups),
                        tuple(embedding_collections))


def collection_of(name: str) -> str:
    """The module owning a table: ``a.tables.3.weight`` -> ``a``; ``a.item.weight`` -> ``a``."""
    parts = name.split(".")[:-1]  # drop "weight": the table module's path
    if not parts:
        return ""
    parts = parts[:-2] if parts[-1].isdigit() else parts[:-1]  # drop "tables.3", or "item"
    return ".".join(parts)


def dense_units_of(model: nn.Module, params: Iterable[ParamInfo]) -> tuple[str, ...]:
    """FSDP units of the dense weights: each child of the root holding dense weights (a ModuleList's
    elements each), then the root (""). Innermost first, the order fully_shard is applied in."""
    dense = [p.name for p in params if p.kind == "dense"]
    units: list[str] = []
    for child_name, child in model.named_children():
        if isinstance(child, nn.ModuleList):
            for index, _ in enumerate(child):
                path = f"{child_name}.{index}"
                if any(n.startswith(path + ".") for n in dense):
                    units.append(path)
        elif any(n.startswith(child_name + ".") for n in dense):
            units.append(child_name)
    return (*units, "")


def dense_units_from_names(names: Iterable[str]) -> tuple[str, ...]:
    """dense_units_of from parameter names alone (the sharding pass has no module tree): a top-level
    child, or a numbered element of one (``layers.0``), per dense parameter; the root last."""
    units: list[str] = []
    for name in names:
        parts = name.split(".")
        if len(parts) < 2:
            continue
        unit = ".".join(parts[:2]) if len(parts) > 2 and parts[1].isdigit() else parts[0]
        if unit not in units:
            units.append(unit)
    return (*units, "")


def plan_for_model(model: nn.Module, config: ParallelConfig, world_size: int, *,
                   gpus_per_node: int | None = None) -> ParallelPlan:
    """The plan for a module (meta-device modules work: only shapes are read)."""
    params = classify_module(model, config)
    return build_plan(params, config, world_size, gpus_per_node=gpus_per_node,
                      dense_units=dense_units_of(model, params))
