"""A ParallelPlan applied to GEM-ref under torch.distributed, and the pieces of its training step.

    plan = plan_for_model(model, config.parallel, world_size)        # pure; errors before any collective
    runtime = ParallelRuntime.setup(model, plan, device)              # meshes, sharding, FSDP
    batch = runtime.local_batch(global_batch)                         # this rank's samples
    loss, reported = runtime.loss(logits, labels, label_mask)         # normalized over the global batch
    loss.backward(); runtime.finish_gradients(); runtime.clip_grad_norm_(max_norm)

With ``build_optimizers(..., sparse_tables=True)`` the sharded tables train sparsely: each local
lookup files the row gradients of its shard and SparseAdagrad updates only those rows of the shard
(embedding.py; no dense table gradient, so the gradient norm cannot include them: clipping needs
dense tables). finish_gradients then all-gathers the replicated groups' row gradients instead of
all-reducing dense ones.

What it does to the model (in place; parameter names never change, so checkpoints move between
world sizes and between parallel and single-process runs):
- embedding tables -> ShardedTable modules with DTensor weights on the embedding mesh, looked up by
  the all-to-all exchange of embedding.py (one fused exchange per owning module);
- each expert group (Interaction) -> ExpertParallelMixture holding E / ep experts, whose FSDP unit
  lives on the (dp_replicate, efsdp) mesh (experts.py);
- dense weights -> ``fully_shard`` (FSDP2) per unit on the (dp_replicate, dp_shard) mesh = HSDP,
  the tables and local experts ignored / managed by their own units.

Gradient scale: each rank's share of the global masked mean is its masked sum over the global label
count; each rank backpropagates world_size x its share, FSDP averages over its mesh, experts and
table rows rescale their own gradients (see their modules), so every gradient equals the
single-process gradient of the global batch (up to summation order).

The training loop's side (torchrun, compile per unit, `gemcompile train --parallel`) is
runtime/training/parallel.py.
"""

from __future__ import annotations

import datetime
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from gemcompile.runtime.distributed.collectives import CollectiveCounter, all_gather_single
from gemcompile.runtime.distributed.embedding import (
    EmbeddingGroups,
    ShardedCollection,
    ShardedTable,
    install_prefetch,
    reduce_replicated_rows,
    shard_table_weight,
)
from gemcompile.runtime.distributed.experts import ExpertParallelMixture
from gemcompile.runtime.distributed.plan import (
    SPARSE_ROW_SHARDINGS,
    ParallelPlan,
    ParallelPlanError,
    collection_of,
)
from gemcompile.runtime.tables.sparse_adagrad import SparseAdagrad

__all__ = ["ParallelMeshes", "ParallelRuntime", "build_meshes", "grad_norm_", "init_distributed"]


def init_distributed(device: str = "cpu", timeout_s: float | None = None) -> tuple[int, int]:
    """init_process_group from torchrun's environment (gloo on CPUs, NCCL on GPUs); (rank, world).
    ``timeout_s``: how long a collective waits for the other ranks (None: torch's default)."""
    if not dist.is_initialized():
        backend = "nccl" if device == "cuda" else "gloo"
        kwargs = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
        if device == "cuda":
            local = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local)
            kwargs["device_id"] = torch.device("cuda", local)
        dist.init_process_group(backend, **kwargs)
    return dist.get_rank(), dist.get_world_size()


@dataclass
class ParallelMeshes:
    """The three meshes of the plan over one world (all ranks node-major)."""

    dense: object
    """DeviceMesh (dp_replicate, dp_shard)."""
    expert: object
    """DeviceMesh (dp_replicate, efsdp, ep)."""
    embedding: object
    """DeviceMesh (emb_outer, emb_inner)."""
    world_group: object = None
    """A group of all ranks of its own (loss normalization, gradient norm, metrics), so that the
    counter tells it from a mesh axis that spans the world."""
    axis_of_group: dict[str, str] = field(default_factory=dict)
    """Process group name -> mesh axis (for CollectiveCounter)."""
    single_rank_groups: set[str] = field(default_factory=set)

    def counter(self) -> CollectiveCounter:
        return CollectiveCounter(self.axis_of_group, self.single_rank_groups)


def build_meshes(plan: ParallelPlan, device_type: str) -> ParallelMeshes:
    """Create the meshes (collective: every rank calls this, in the same order)."""
    from torch.distributed.device_mesh import DeviceMesh

    a = plan.axes
    world = dist.get_world_size()
    if world != a.world_size:
        raise ParallelPlanError(f"the plan is for world size {a.world_size}, torch.distributed runs {world}")
    ranks = torch.arange(world)
    dense = DeviceMesh(device_type, ranks.view(a.dp_replicate, a.dp_shard),
                       mesh_dim_names=("dp_replicate", "dp_shard"))
    expert = DeviceMesh(device_type, ranks.view(a.dp_replicate, a.efsdp, a.ep),
                        mesh_dim_names=("dp_replicate", "efsdp", "ep"))
    embedding = DeviceMesh(device_type, ranks.view(a.emb_outer, a.emb_inner),
                           mesh_dim_names=("emb_outer", "emb_inner"))
    meshes = ParallelMeshes(dense, expert, embedding, world_group=dist.new_group(list(range(world))))
    for mesh in (dense, expert, embedding):
        for axis in mesh.mesh_dim_names:
            group = mesh.get_group(axis)
            name = group.group_name
            meshes.axis_of_group.setdefault(name, axis)
            if mesh.size(mesh.mesh_dim_names.index(axis)) == 1:
                meshes.single_rank_groups.add(name)
    meshes.axis_of_group[meshes.world_group.group_name] = "world"
    return meshes


def _set_submodule(root: nn.Module, path: str, module: nn.Module) -> None:
    parent_path, _, name = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    setattr(parent, name, module) if not name.isdigit() else parent.__setitem__(int(name), module)


def _replication(grad: Tensor) -> int:
    """Ranks holding an identical copy of this gradient shard (product of the Replicate mesh dims)."""
    placements = getattr(grad, "placements", None)
    if placements is None:
        return 1
    mesh = grad.device_mesh
    return math.prod(mesh.size(i) for i, p in enumerate(placements) if p.is_replicate())


def grad_norm_(params: Iterable[nn.Parameter], max_norm: float | None = None, group=None) -> Tensor:
    """Total 2-norm of the gradients of parameters that live on different meshes (dense, expert,
    embedding DTensors and plain tensors), with one scalar all-reduce over the world; scales the
    gradients in place by min(1, max_norm / norm) when max_norm is given (clip_grad_norm_ semantics)."""
    grads = [p.grad for p in params if p.grad is not None]
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    device = local[0].device if local else torch.device("cpu")
    # One fused norm per (device, dtype, replication) group, not a few small kernels per parameter: with
    # the per-parameter loop, this phase took 37 ms of a GEM-ref small step at world 2 on the H200 (now 14).
    groups: dict[tuple, list[int]] = {}  # (device, dtype, replication) -> indices
    for i, t in enumerate(local):
        if t.numel():
            groups.setdefault((t.device, t.dtype, _replication(grads[i])), []).append(i)
    total = torch.zeros((), dtype=torch.float32, device=device)
    for (_, _, replication), indices in groups.items():
        norms = torch._foreach_norm([local[i].detach() for i in indices], 2)
        squares = torch.stack([n.float() for n in norms]).pow(2).sum()
        total = total + (squares / replication).to(device)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    norm = total.sqrt()
    if max_norm is not None:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for indices in groups.values():
            tensors = [local[i] for i in indices]
            torch._foreach_mul_(tensors, coef.to(device=tensors[0].device, dtype=tensors[0].dtype))
    return norm


class ParallelRuntime:
    """A GEM-ref model with the plan applied, and the pieces of a parallel training step."""

    def __init__(self, model: nn.Module, plan: ParallelPlan, meshes: ParallelMeshes, device: torch.device):
        self.model = model
        self.plan = plan
        self.meshes = meshes
        self.device = device
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.collections: list[ShardedCollection] = []
        self.fsdp_modules: list[nn.Module] = []
        self.table_params: list[nn.Parameter] = []
        self.expert_params: list[nn.Parameter] = []
        self.sparse_tables = False
        """Whether the sharded tables train sparsely (set by build_optimizers)."""

    # -- setup --------------------------------------------------------------------------------------
    @classmethod
    def setup(cls, model: nn.Module, plan: ParallelPlan, device: torch.device | str,
              mp_policy=None) -> ParallelRuntime:
        """Build the meshes and apply the plan to `model` (already on `device`, identically initialized
        on every rank)."""
        device = torch.device(device)
        meshes = build_meshes(plan, device.type)
        runtime = cls(model, plan, meshes, device)
        runtime._shard_embeddings()
        runtime._parallelize_experts(mp_policy)
        runtime._shard_dense(mp_policy)
        return runtime

    def _embedding_groups(self) -> EmbeddingGroups:
        mesh = self.meshes.embedding
        return EmbeddingGroups(
            outer_group=mesh.get_group("emb_outer"), inner_group=mesh.get_group("emb_inner"),
            outer_size=mesh.size(0), inner_size=mesh.size(1),
            outer_rank=mesh.get_local_rank("emb_outer"), inner_rank=mesh.get_local_rank("emb_inner"),
            grid=self.plan.config.embedding_sharding == "grid", world_size=self.world)

    def _shard_embeddings(self) -> None:
        groups = self._embedding_groups()
        for name in self.plan.embedding_collections:
            owner = self.model.get_submodule(name) if name else self.model
            tables = []
            for p in self.plan.by_kind("embedding"):
                if collection_of(p.name) != name:
                    continue
                path = p.name.rpartition(".")[0]
                source = self.model.get_submodule(path)
                weight = shard_table_weight(source.weight, groups, self.meshes.embedding)
                if isinstance(source, nn.EmbeddingBag) and source.mode != "sum":
                    raise ParallelPlanError(f"{path}: only sum-pooled EmbeddingBags can be sharded, got "
                                            f"mode={source.mode!r}")
                table = ShardedTable(source, weight, pooled=isinstance(source, nn.EmbeddingBag))
                _set_submodule(self.model, path, table)
                tables.append(table)
                self.table_params.append(weight)
            collection = ShardedCollection(name, tables, groups)
            collection.fused = install_prefetch(owner, collection)
            self.collections.append(collection)

    def _parallelize_experts(self, mp_policy) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.meshes.expert
        ep_rank, ep_size = mesh.get_local_rank("ep"), mesh.size(2)
        dp_mesh = mesh["dp_replicate", "efsdp"]
        for group_path in self.plan.expert_groups:
            parent_path, _, attr = group_path.rpartition(".")
            parent = self.model.get_submodule(parent_path)
            if attr != "experts" or not hasattr(parent, "gate"):
                raise ParallelPlanError(f"expert group {group_path}: expert parallelism needs a module with "
                                        "`experts` (ModuleList) and a per-sample `gate` (GEM-ref Interaction)")
            mixture = ExpertParallelMixture(parent, ep_rank, ep_size, mesh.get_group("ep"))
            _set_submodule(self.model, parent_path, mixture)
            local = list(mixture.experts.values())
            if dp_mesh.size() > 1:
                kwargs = {} if mp_policy is None else {"mp_policy": mp_policy}
                self.fsdp_modules.append(fully_shard(local, mesh=dp_mesh, **kwargs))
            # after fully_shard: FSDP replaces the parameters by sharded DTensor parameters
            self.expert_params.extend(p for m in local for p in m.parameters())

    def _shard_dense(self, mp_policy) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.meshes.dense
        if mesh.size() == 1:
            return
        ignored = set(self.table_params)
        if not any(isinstance(p, torch.distributed.tensor.DTensor) for p in self.expert_params):
            ignored |= set(self.expert_params)  # experts not data parallel: each held by one rank
        kwargs = {} if mp_policy is None else {"mp_policy": mp_policy}
        for unit in self.plan.dense_units:
            module = self.model.get_submodule(unit) if unit else self.model
            fully_shard(module, mesh=mesh, ignored_params=ignored, **kwargs)
            self.fsdp_modules.append(module)

    # -- the step -------------------------------------------------------------------------------------
    def local_batch(self, batch):
        """This rank's contiguous slice of a global GemBatch (rank r: samples [r b, (r+1) b))."""
        size = batch.batch_size
        if size % self.world:
            raise ValueError(f"batch size {size} is not divisible by the world size {self.world}: every rank "
                             "needs the same number of samples")
        b = size // self.world
        return batch.select(torch.arange(self.rank * b, (self.rank + 1) * b, device=batch.dense.device))

    def loss(self, logits: Tensor, labels: Tensor, label_mask: Tensor) -> Tensor:
        """The loss this rank backpropagates: world_size x its share of the global masked BCE mean (the
        shares sum to masked_bce_loss of the global batch); one all-reduce of the label count."""
        per_element = F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype), reduction="none")
        mask = label_mask.to(logits.dtype)
        count = mask.sum().detach().clone()
        dist.all_reduce(count, op=dist.ReduceOp.SUM, group=self.meshes.world_group)
        return (per_element * mask).sum() * (self.world / count.clamp(min=1.0))

    def global_loss(self, loss: Tensor) -> float:
        """The global batch's loss from the ranks' `loss()` values (bookkeeping, outside the counted
        step)."""
        total = loss.detach().clone() / self.world
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.meshes.world_group)
        return total.item()

    def gather(self, *tensors: Tensor) -> list[Tensor]:
        """Every rank's tensors concatenated in rank order (= global batch order), for metrics."""
        out = []
        for t in tensors:
            buffer = t.new_empty((self.world * t.shape[0], *t.shape[1:]))
            all_gather_single(buffer, t.contiguous(), group=self.meshes.world_group)
            out.append(buffer)
        return out

    @property
    def sharded_tables(self) -> list[ShardedTable]:
        return [t for c in self.collections for t in c.tables]

    @property
    def supports_sparse_tables(self) -> bool:
        """Whether the plan's embedding sharding can train its tables sparsely (SPARSE_ROW_SHARDINGS)."""
        return self.plan.config.embedding_sharding in SPARSE_ROW_SHARDINGS

    def finish_gradients(self) -> None:
        """After backward: the replicated-groups table gradients summed over emb_outer (dense tables), or
        their row gradients all-gathered over emb_outer (sparse tables)."""
        if self.sparse_tables:
            reduce_replicated_rows(self.sharded_tables, self._embedding_groups())
        for collection in self.collections:
            collection.all_reduce_replicated_grads()

    def clip_grad_norm_(self, max_norm: float | None) -> Tensor:
        """Gradient norm over all meshes (one scalar all-reduce); clips when max_norm is given. Sparse
        tables have no gradient to count or clip: clipping them is refused."""
        if max_norm is not None and self.sparse_tables:
            raise ValueError("clip_grad_norm_: the sharded tables train sparsely (no gradient tensors to "
                             "clip); build the optimizers with sparse_tables=False to clip")
        return grad_norm_(self.model.parameters(), max_norm, group=self.meshes.world_group)

    def build_optimizers(self, lr: float, embedding_lr: float,
                         sparse_tables: bool = False) -> list[torch.optim.Optimizer]:
        """runtime/training/optimizers.py's split (Adam on dense weights, Adagrad on every embedding table, small
        tables included), with one optimizer per mesh: a foreach step must not mix DTensors of different
        meshes. Order: dense Adam, expert Adam, table-shard Adagrad, small-table Adagrad (empty ones
        left out; the same list at every world size, so checkpoints load across world sizes).

        `sparse_tables`: the sharded tables file row gradients of their shards and the table-shard
        optimizer is SparseAdagrad (the same state as Adagrad's, so checkpoints load either way); the
        small tables (FSDP-managed dense weights) keep Adagrad. Call it before the first forward."""
        if sparse_tables:
            if not self.supports_sparse_tables:
                raise ValueError(f"embedding_sharding={self.plan.config.embedding_sharding!r} cannot train "
                                 f"its tables sparsely (supported: {', '.join(SPARSE_ROW_SHARDINGS)})")
            replicated = self.meshes.embedding.size(0) > 1 and self.plan.config.embedding_sharding != "grid"
            for table in self.sharded_tables:
                table.use_sparse_row_gradients(identical_replicas=replicated)
            self.sparse_tables = True
        tables = {id(p) for p in self.table_params}
        experts = {id(p) for p in self.expert_params}
        small = {id(m.weight) for m in self.model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))}
        dense = [p for p in self.model.parameters() if id(p) not in tables | experts | small]
        small_params = [p for p in self.model.parameters() if id(p) in small]
        optimizers: list[torch.optim.Optimizer | None] = [
            torch.optim.Adam(dense, lr=lr) if dense else None,
            torch.optim.Adam(list(self.expert_params), lr=lr) if self.expert_params else None,
            None,
            torch.optim.Adagrad(small_params, lr=embedding_lr) if small_params else None,
        ]
        if self.table_params:
            optimizers[2] = (SparseAdagrad(self.sharded_tables, lr=embedding_lr) if self.sparse_tables
                             else torch.optim.Adagrad(list(self.table_params), lr=embedding_lr))
        return [o for o in optimizers if o is not None]

    def expected_collectives(self) -> dict[tuple[str, str], int]:
        """The plan's collectives per step, keyed the way CollectiveCounter reports them: axes whose
        process groups coincide (the same ranks, e.g. dp_shard, ep and emb_inner on one node of 2)
        count under the name the counter gives their common group."""
        m = self.meshes
        mesh_of = {"dp_replicate": m.dense, "dp_shard": m.dense, "efsdp": m.expert, "ep": m.expert,
                   "emb_outer": m.embedding, "emb_inner": m.embedding}
        out: dict[tuple[str, str], int] = {}
        for (op, axis), n in self.plan.collective_counts(self.sparse_tables).items():
            label = "world" if axis == "world" else m.axis_of_group[mesh_of[axis].get_group(axis).group_name]
            out[(op, label)] = out.get((op, label), 0) + n
        return out

    def describe(self) -> str:
        a = self.plan.axes
        return (f"world {a.world_size}: dense (dp_replicate={a.dp_replicate}, dp_shard={a.dp_shard}), experts "
                f"(ep={a.ep}, efsdp={a.efsdp}), embeddings {self.plan.config.embedding_sharding} "
                f"(emb_outer={a.emb_outer}, emb_inner={a.emb_inner})")
