"""2D-sharded embedding tables and their lookup by all-to-all of ids and outputs.

Layout on the embedding mesh (emb_outer, emb_inner), rank (c, i):
- "grid": columns [c * D/O, (c+1) * D/O) of rows [i * ceil(R/I), (i+1) * ceil(R/I)) of every sharded
  table: placements (Shard(1), Shard(0)), every parameter byte on exactly one rank;
- "replicated_groups": all columns of row range i, replicated over emb_outer ((Replicate(), Shard(0)),
  TorchRec's 2D / DMPCollection layout); gradients are all-reduced over emb_outer after backward
  (dense tables) or their row gradients all-gathered (sparse tables, below).

The weights are DTensors with these placements (global shapes, so DCP reshards a checkpoint to another
world size); the lookup works on the local shards. One fused exchange serves every lookup of a
*collection* (the tables of one module, e.g. all sparse tables of NonSeqEmbedding, or the item table
called once per sequence type). For rank (c, i) with its B samples and F lookups ("features"):

1. ids all-gather over emb_outer (grid only): every column group needs every sample's ids; rank (c, i)
   now serves the samples of ranks (*, i);
2. padding ids dropped; each id goes to the row owner (i' = id // ceil(R/I)) of the inner group:
   all-to-all of the counts, then of (position, local row, table) triples (row-wise bucketization);
3. the owner looks its rows up in its local shard;
4. outputs back over emb_inner by all-to-all: pooled partial sums per (sample, feature) for bags
   (EmbeddingBag, mode "sum": fixed size), one row per id for sequences (nn.Embedding);
5. outputs back over emb_outer by all-to-all (grid only): rank (c, i) returns columns c of the samples
   of rank (c', i) to it; each rank concatenates the column groups.
Backward runs 5 and 4 transposed (all-to-all); 1-3 move ids, which have no gradient. Row gradients are
local to each shard: no gradient collective at all for "grid". Each rank backpropagates world_size x
its share of the loss (so that FSDP's average is the global gradient, apply.py), and the
rows a shard serves carry the whole world's samples, so looked-up rows scale their gradient by
1 / world_size.

Sparse tables (``ShardedTable.use_sparse_row_gradients``, chosen by ParallelRuntime.build_optimizers):
step 3 looks the rows up with gemcompile::sparse_embedding (lowering/sparse_embedding/op.py), whose
backward files (local row ids, gradient rows) of the shard instead of a dense ``.grad`` of the shard
(the rows are the 1 / world_size-scaled ones: the scaling sits above the local lookup), and SparseAdagrad
(runtime/tables/sparse_adagrad.py) updates only those rows of ``weight.to_local()`` and of its
Adagrad sum's local shard. "grid": nothing else, the rows are local. "replicated_groups": the replicas
of a row shard serve different samples, so after backward ``reduce_replicated_rows`` sums each
replica's rows per id and all-gathers the sums over emb_outer (counts first, padded to the largest),
in one exchange for every sparse table of the runtime; every replica then files the same rows in
the same (replica) order and sums them in a fixed order at the update, so the replicas stay
identical, bit for bit.

A table's module is replaced by a ShardedTable that holds the DTensor weight under the original name
(``tables.3.weight``) and returns the output its collection prefetched in a forward pre-hook of the
owning module. Modules without a known prefetch (``PREFETCH``) look each call up on its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from gemcompile.lowering.sparse_embedding.op import MODE_LOOKUP, sparse_embedding
from gemcompile.lowering.sparse_embedding.pending import file_rows, new_table_key, take_rows
from gemcompile.runtime.distributed.collectives import all_gather, all_to_all, scale_grad

__all__ = ["PREFETCH", "EmbeddingGroups", "ShardedCollection", "ShardedTable", "reduce_replicated_rows",
           "shard_table_weight"]


@dataclass(frozen=True)
class EmbeddingGroups:
    """The process groups and coordinates of this rank on the embedding mesh."""

    outer_group: object
    inner_group: object
    outer_size: int
    inner_size: int
    outer_rank: int
    inner_rank: int
    grid: bool
    """True: columns sharded over emb_outer; False: replicated groups."""
    world_size: int = 1
    """Ranks in the world: the gradient of looked-up rows is scaled by 1 / world_size."""


def row_chunk(rows: int, shards: int) -> int:
    """Rows per shard (torch.chunk / DTensor Shard semantics: ceil, the last shards may be short)."""
    return -(-rows // shards)


def shard_table_weight(weight: Tensor, groups: EmbeddingGroups, mesh) -> nn.Parameter:
    """This rank's shard of a full table weight, as a DTensor parameter with the plan's placements."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    rows, dim = weight.shape
    chunk = row_chunk(rows, groups.inner_size)
    start = min(rows, groups.inner_rank * chunk)
    stop = min(rows, start + chunk)
    local = weight.detach()[start:stop]
    if groups.grid:
        cols = dim // groups.outer_size
        local = local[:, groups.outer_rank * cols:(groups.outer_rank + 1) * cols]
        placements = (Shard(1), Shard(0))
    else:
        placements = (Replicate(), Shard(0))
    local = local.contiguous().clone()
    dt = DTensor.from_local(local, mesh, placements, run_check=False, shape=weight.shape,
                            stride=weight.stride())
    return nn.Parameter(dt, requires_grad=weight.requires_grad)


class ShardedTable(nn.Module):
    """Stands in for an nn.Embedding / nn.EmbeddingBag whose weight is sharded (see module docstring)."""

    def __init__(self, source: nn.Module, weight: nn.Parameter, pooled: bool) -> None:
        super().__init__()
        self.weight = weight
        self.num_embeddings, self.embedding_dim = source.weight.shape
        self.padding_idx = source.padding_idx
        self.pooled = pooled
        self.collection: ShardedCollection | None = None
        self._pending: list[Tensor] = []
        self.table_key: int | None = None
        """Set by use_sparse_row_gradients: the key its lookups file row gradients under."""
        self.identical_replicas = False
        """Sparse and replicated over emb_outer: the row update must sum in a fixed order."""

    def __setstate__(self, state):
        super().__setstate__(state)
        if getattr(self, "table_key", None) is not None:  # a copy files under a key of its own, as in
            self.table_key = new_table_key()  # sparse_tables.py

    @property
    def files_row_gradients(self) -> bool:
        """True once use_sparse_row_gradients was called: no dense gradient, SparseAdagrad updates it."""
        return self.table_key is not None

    def use_sparse_row_gradients(self, identical_replicas: bool = False) -> None:
        """From now on the local lookup files (local row ids, gradient rows) instead of giving the weight
        a gradient (see the module docstring); call it before the first forward."""
        if self.table_key is None:
            self.table_key = new_table_key()
            # the counter the filing op bumps (lowering/sparse_embedding/op.py); not part of checkpoints
            token = torch.zeros(1, dtype=torch.int64, device=self.weight.device)
            self.register_buffer("row_grad_token", token, persistent=False)
        self.identical_replicas = identical_replicas

    def local_lookup(self, rows: Tensor, weight: Tensor) -> Tensor:
        """Rows `rows` (local row ids, no padding) of this rank's shard `weight` (= weight.to_local())."""
        if self.table_key is None:
            return F.embedding(rows, weight)
        return sparse_embedding(rows, weight, None, self.row_grad_token, MODE_LOOKUP, None, self.table_key)

    def forward(self, ids: Tensor, *args, **kwargs) -> Tensor:
        if args or kwargs:
            raise NotImplementedError("a sharded embedding takes padded ids only (no offsets / per-sample "
                                      "weights)")
        if self._pending:
            out = self._pending.pop(0)
            expected = (*ids.shape[:1], self.embedding_dim) if self.pooled else (*ids.shape, self.embedding_dim)
            if tuple(out.shape) != expected:
                raise RuntimeError(f"prefetched lookup of shape {tuple(out.shape)} does not fit ids of shape "
                                   f"{tuple(ids.shape)}: the prefetch read the wrong input")
            return out
        assert self.collection is not None
        return self.collection.lookup([(self, ids)])[0]

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, {'pooled sum' if self.pooled else 'rows'}, "
                f"padding_idx={self.padding_idx}")


class ShardedCollection:
    """The sharded tables of one module, looked up together in one exchange per call."""

    def __init__(self, name: str, tables: Sequence[ShardedTable], groups: EmbeddingGroups) -> None:
        self.name = name
        self.tables = list(tables)
        self.groups = groups
        for t in self.tables:
            t.collection = self
        self.exchanges = 0
        self.fused = False
        """True when the owner's forward pre-hook prefetches all lookups in one exchange."""

    def prefetch(self, features: Sequence[tuple[ShardedTable, Tensor]]) -> None:
        """Look every (table, ids) up now; each table returns its outputs in call order."""
        for table in self.tables:
            table._pending.clear()
        for pooled in (True, False):
            group = [(t, ids) for t, ids in features if t.pooled == pooled]
            if group:
                for (table, _), out in zip(group, self.lookup(group)):
                    table._pending.append(out)

    def lookup(self, features: Sequence[tuple[ShardedTable, Tensor]]) -> list[Tensor]:
        """Outputs of the lookups: (B, D) per pooled feature, (B, L, D) per sequence feature."""
        g = self.groups
        pooled = features[0][0].pooled
        if any(t.pooled != pooled for t, _ in features):
            raise ValueError("one exchange serves pooled or sequence lookups, not both")
        tables = list(dict.fromkeys(t for t, _ in features))
        dims = {t.embedding_dim for t in tables}
        if len(dims) != 1:
            raise ValueError(f"collection {self.name}: tables of one exchange need one dim, got {sorted(dims)}")
        self.exchanges += 1
        for table, ids in features:  # (else an id past the rows reads another shard's row, a negative one wraps)
            torch._assert_async(((ids >= 0) & (ids < table.num_embeddings)).all(),
                                f"collection {self.name}: an id lies outside its table's {table.num_embeddings} rows")
        ids_list = [ids.reshape(ids.shape[0], -1) for _, ids in features]
        b = ids_list[0].shape[0]
        device = ids_list[0].device
        widths = [x.shape[1] for x in ids_list]
        total = sum(widths)
        n_feat = len(features)
        col_table = torch.cat([torch.full((w,), tables.index(t), dtype=torch.long, device=device)
                               for (t, _), w in zip(features, widths)])
        col_feature = torch.cat([torch.full((w,), f, dtype=torch.long, device=device)
                                 for f, w in enumerate(widths)])
        chunks = torch.tensor([row_chunk(t.num_embeddings, g.inner_size) for t in tables], device=device)
        pads = torch.tensor([-1 if t.padding_idx is None else t.padding_idx for t in tables], device=device)

        packed = torch.cat(ids_list, dim=1)  # (B, total)
        if g.grid and g.outer_size > 1:
            packed = all_gather(packed, g.outer_group)  # (O * B, total), block c' = rank (c', i)'s samples
        s = packed.shape[0]
        flat = packed.reshape(-1)
        position = torch.arange(flat.numel(), device=device)
        table_of = col_table.repeat(s)
        keep = flat != pads[table_of]
        position, ids, table_of = position[keep], flat[keep], table_of[keep]
        owner = torch.div(ids, chunks[table_of], rounding_mode="floor")
        local_row = ids - owner * chunks[table_of]

        # 2. bucketize by row owner and exchange (position, local row, table)
        if g.inner_size > 1:
            order = torch.argsort(owner, stable=True)
            send = torch.stack([position, local_row, table_of], dim=1)[order]
            position_sent = position[order]
            send_counts = torch.bincount(owner, minlength=g.inner_size)
            recv_counts = all_to_all(send_counts, g.inner_group)
            send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()
            recv = all_to_all(send, g.inner_group, recv_splits, send_splits)
        else:
            position_sent = position
            send_splits = recv_splits = [position.numel()]
            recv = torch.stack([position, local_row, table_of], dim=1)
        r_position, r_row, r_table = recv.unbind(1)

        # 3. local lookup, grouped by table
        rows = scale_grad(self._local_rows(tables, r_row, r_table), 1.0 / g.world_size)  # (n_recv, Dc)
        dc = rows.shape[1]

        # 4. back to the inner-group source ranks
        if pooled:
            source = torch.repeat_interleave(torch.arange(len(recv_splits), device=device),
                                             torch.tensor(recv_splits, device=device))
            bag = (source * s + torch.div(r_position, total, rounding_mode="floor")) * n_feat \
                + col_feature[r_position % total]
            partial = rows.new_zeros((len(recv_splits) * s * n_feat, dc)).index_add(0, bag, rows)
            back = all_to_all(partial, g.inner_group) if g.inner_size > 1 else partial
            out = back.view(-1, s, n_feat, dc).sum(0)  # (S, F, Dc): summed over the row owners
        else:
            back = all_to_all(rows, g.inner_group, send_splits, recv_splits) if g.inner_size > 1 else rows
            out = rows.new_zeros((s * total, dc)).index_add(0, position_sent, back).view(s, total, dc)

        # 5. columns back to the samples' ranks (grid)
        if g.grid and g.outer_size > 1:
            out = all_to_all(out.reshape(g.outer_size * b, -1), g.outer_group)  # block c'' = column group c''
            out = out.view(g.outer_size, b, -1, dc).permute(1, 2, 0, 3).reshape(b, -1, g.outer_size * dc)
        if pooled:
            return [out[:, f] for f in range(n_feat)]
        return [piece.view(*ids.shape, -1) for piece, (_, ids) in zip(out.split(widths, dim=1), features)]

    @staticmethod
    def _local_rows(tables: Sequence[ShardedTable], r_row: Tensor, r_table: Tensor) -> Tensor:
        weights = [t.weight.to_local() for t in tables]
        if len(tables) == 1:
            return tables[0].local_lookup(r_row, weights[0])
        order = torch.argsort(r_table, stable=True)
        counts = torch.bincount(r_table, minlength=len(tables)).tolist()
        parts = [t.local_lookup(rows, w) for t, rows, w in zip(tables, r_row[order].split(counts), weights)]
        sorted_rows = torch.cat(parts)
        return sorted_rows.new_zeros(sorted_rows.shape).index_add(0, order, sorted_rows)

    def all_reduce_replicated_grads(self) -> None:
        """Replicated groups: sum the dense gradients of the row shards over emb_outer (the replicas);
        sparse tables have none (reduce_replicated_rows)."""
        g = self.groups
        if g.grid or g.outer_size == 1:
            return
        for t in self.tables:
            grad = t.weight.grad
            if grad is not None:
                local = grad.to_local() if hasattr(grad, "to_local") else grad
                dist.all_reduce(local, op=dist.ReduceOp.SUM, group=g.outer_group)


def _coalesce(filed: list[tuple[Tensor, Tensor]], dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """A table's filed (ids, rows) since its last step -> (distinct ids, their summed rows), ids < 0 out."""
    ids = torch.cat([i for i, _ in filed])
    rows = torch.cat([r for _, r in filed]).to(dtype)
    keep = ids >= 0
    ids, rows = ids[keep], rows[keep]
    distinct, inverse = torch.unique(ids, sorted=True, return_inverse=True)
    return distinct, rows.new_zeros((distinct.numel(), rows.shape[1])).index_add_(0, inverse, rows)


@torch.no_grad()
def reduce_replicated_rows(tables: Sequence[ShardedTable], groups: EmbeddingGroups) -> None:
    """Replicated groups with sparse tables, after backward: every replica (emb_outer) of a row shard ends
    up with the row gradients of all replicas filed, in replica order, identically.

    Each replica sums its filed rows per id (a row appears at most once per replica), then three
    all-gathers over emb_outer, for all `tables` at once: the counts (ids per table, and which tables
    filed anything: the one host sync), the ids and the rows (flat, in the promoted dtype of the tables),
    each padded to the largest replica's count. Every rank must call it with the same tables in the same
    order."""
    if groups.grid or groups.outer_size == 1 or not tables:
        return
    n_tables = len(tables)
    device = tables[0].weight.device
    dtype = tables[0].weight.dtype
    for t in tables[1:]:
        dtype = torch.promote_types(dtype, t.weight.dtype)
    dims = [t.weight.to_local().shape[1] for t in tables]
    ids_parts, row_parts = [], []
    local = [0] * (2 * n_tables)  # ids per table, then 1 for each table that filed anything
    for k, table in enumerate(tables):
        if not table.files_row_gradients:
            raise ValueError(f"reduce_replicated_rows: table {k} has dense gradients")
        filed = take_rows(table.table_key)
        if not filed:
            continue
        ids, rows = _coalesce(filed, dtype)
        ids_parts.append(ids)
        row_parts.append(rows.reshape(-1))
        local[k], local[n_tables + k] = ids.numel(), 1
    counts = all_gather(torch.tensor(local, device=device)[None], groups.outer_group).cpu()  # (O, 2 * tables)
    ids_per = counts[:, :n_tables]
    n_of = ids_per.sum(1).tolist()
    e_of = (ids_per * torch.tensor(dims)).sum(1).tolist()
    n_max, e_max = max(1, max(n_of)), max(1, max(e_of))
    n_self, e_self = sum(local[:n_tables]), sum(c * d for c, d in zip(local, dims))
    ids = torch.cat([*ids_parts, torch.full((n_max - n_self,), -1, dtype=torch.int64, device=device)])
    flat = torch.cat([*row_parts, torch.zeros(e_max - e_self, dtype=dtype, device=device)])
    ids_all = all_gather(ids, groups.outer_group).view(groups.outer_size, n_max)
    flat_all = all_gather(flat, groups.outer_group).view(groups.outer_size, e_max)
    per_table: list[list[tuple[Tensor, Tensor]]] = [[] for _ in tables]
    for replica in range(groups.outer_size):
        per = ids_per[replica].tolist()
        table_ids = ids_all[replica, :n_of[replica]].split(per)
        table_rows = flat_all[replica, :e_of[replica]].split([c * d for c, d in zip(per, dims)])
        for k in range(n_tables):
            if per[k]:
                per_table[k].append((table_ids[k], table_rows[k].view(per[k], dims[k])))
    for k, table in enumerate(tables):
        if not bool(counts[:, n_tables + k].any()):
            continue  # looked up by no replica this step: no gradient, no step (as dense Adagrad)
        entries = per_table[k]
        if entries:
            ids, rows = torch.cat([i for i, _ in entries]), torch.cat([r for _, r in entries])
            file_rows(table.table_key, ids, rows)
        else:
            file_rows(table.table_key, flat.new_zeros(0, dtype=torch.int64), flat.new_zeros((0, dims[k])))


# ---------------------------------------------------------------------------------------------------
# Fused lookups per owning module: which of its forward inputs feed which table
# ---------------------------------------------------------------------------------------------------


def _nonseq_features(module: nn.Module, args: tuple, kwargs: dict) -> list[tuple[ShardedTable, Tensor]]:
    sparse_ids = kwargs["sparse_ids"] if "sparse_ids" in kwargs else args[0]  # (B, n_tables, max_hot)
    return [(table, sparse_ids[:, t]) for t, table in enumerate(module.tables) if isinstance(table, ShardedTable)]


def _seq_features(module: nn.Module, args: tuple, kwargs: dict) -> list[tuple[ShardedTable, Tensor]]:
    seq_items = kwargs["seq_items"] if "seq_items" in kwargs else args[0]  # [(B, N_k)]
    if not isinstance(module.item, ShardedTable):
        return []
    return [(module.item, items) for items in seq_items]


PREFETCH: dict[str, Callable[[nn.Module, tuple, dict], list[tuple[ShardedTable, Tensor]]]] = {
    "NonSeqEmbedding": _nonseq_features,
    "SeqEmbedding": _seq_features,
}
"""Class name of a module owning sharded tables -> the (table, ids) lookups of one forward, in call
order (GEM-ref's two embedding modules). Other owners fall back to one exchange per table call."""


def install_prefetch(owner: nn.Module, collection: ShardedCollection) -> bool:
    """Register the fused lookup as a forward pre-hook of `owner`; False if its class is unknown."""
    features_of = PREFETCH.get(type(owner).__name__)
    if features_of is None:
        for cls in type(owner).__mro__:  # FSDP wraps the class in a subclass
            features_of = PREFETCH.get(cls.__name__)
            if features_of is not None:
                break
    if features_of is None:
        return False

    def hook(module, args, kwargs):
        collection.prefetch(features_of(module, args, kwargs))

    owner.register_forward_pre_hook(hook, with_kwargs=True)
    return True
