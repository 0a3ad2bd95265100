"""A sharded table's lookup refuses ids outside its rows (a one-rank gloo group: the same lookup code as a world
of many, with one shard): an id past the rows read another shard's row or zeros, a negative one wrapped around,
both silently."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from gemcompile.runtime.distributed.embedding import (EmbeddingGroups, ShardedCollection, ShardedTable,
                                                      shard_table_weight)


@pytest.fixture
def one_rank_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("emb_outer", "emb_inner"))
        yield mesh, EmbeddingGroups(mesh.get_group("emb_outer"), mesh.get_group("emb_inner"), 1, 1, 0, 0, grid=False)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("padding_idx", [None, 0])
@pytest.mark.parametrize("bad", [-1, -5, 10, 1 << 40])
def test_a_sharded_lookup_refuses_an_id_outside_its_table(one_rank_mesh, bad, padding_idx):
    mesh, groups = one_rank_mesh
    source = nn.Embedding(10, 4, padding_idx=padding_idx)
    table = ShardedTable(source, shard_table_weight(source.weight, groups, mesh), pooled=False)
    collection = ShardedCollection("items", [table], groups)
    ids = torch.tensor([[1, 2, 9], [0, 3, 4]])
    (rows,) = collection.lookup([(table, ids)])
    torch.testing.assert_close(rows, source(ids))  # (valid ids: the table's rows)
    ids[1, 2] = bad
    with pytest.raises(RuntimeError, match="an id lies outside its table's 10 rows"):
        collection.lookup([(table, ids)])
