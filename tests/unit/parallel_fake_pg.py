"""Helper of test_parallel_plan.py (run in a subprocess: the process group is global state).

    python tests/unit/parallel_fake_pg.py WORLD RANK ["axis=size, ..."]

One process plays RANK of a WORLD-rank job on the fake process group (collectives do nothing):
1. GEM-ref small on the meta device, with the plan applied: every parameter's mesh axes, placements and
   local shape are the plan's, the rank holds exactly its ep position's experts, and its parameter bytes
   are the plan's bytes per rank (rank 0 holds the largest shards; others hold at most as much);
2. GEM-ref tiny on the CPU, one training step under CollectiveCounter, with dense and with sparse
   tables: the collectives per (op, axis) are the plan's. Prints OK.
"""

import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from gemcompile.config import ParallelConfig
from gemcompile.models.data import SyntheticData
from gemcompile.models.gem import GemRef, gem_ref_config
from gemcompile.runtime.distributed.apply import ParallelRuntime
from gemcompile.runtime.distributed.plan import plan_for_model


def _expected_local(shape, placements, mesh) -> tuple[int, ...]:
    local = list(shape)
    coords = mesh.get_coordinate()
    for axis, placement in enumerate(placements):
        if placement.is_shard():
            d, n = placement.dim, mesh.size(axis)
            chunk = -(-local[d] // n)
            local[d] = max(0, min(chunk, local[d] - coords[axis] * chunk))
    return tuple(local)


def main() -> None:
    world, rank = int(sys.argv[1]), int(sys.argv[2])
    extra = dict(item.split("=") for item in sys.argv[3].replace(" ", "").split(",") if item) if len(sys.argv) > 3 else {}
    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    fields = {k: int(v) if v.isdigit() else v for k, v in extra.items()}
    config = ParallelConfig(enabled=True, gpus_per_node=8, **fields)

    # 1. placements and bytes, GEM-ref small on the meta device
    with torch.device("meta"):
        model = GemRef(gem_ref_config("small"))
    plan = plan_for_model(model, config, world)
    runtime = ParallelRuntime.setup(model, plan, "cpu")
    ep_rank = runtime.meshes.expert.get_local_rank("ep")
    held = 0
    names = set()
    for name, param in model.named_parameters():
        entry = plan[name]
        names.add(name)
        assert isinstance(param, DTensor), f"{name} is not a DTensor"
        text = tuple(f"Shard({p.dim})" if p.is_shard() else "Replicate()" for p in param.placements)
        assert text == entry.placements, (name, text, entry.placements)
        assert param.device_mesh.mesh_dim_names == entry.mesh_axes, (name, param.device_mesh.mesh_dim_names)
        assert tuple(param.device_mesh.shape) == entry.mesh_shape, name
        local = tuple(param.to_local().shape)
        assert local == _expected_local(entry.info.shape, param.placements, param.device_mesh), (name, local)
        assert all(a <= b for a, b in zip(local, entry.local_shape)), (name, local, entry.local_shape)
        held += param.to_local().numel() * param.element_size()
    experts = {p.name for p in plan.by_kind("expert") if p.ep_rank == ep_rank}
    assert {n for n in names if ".experts." in n} == experts
    assert names == {p.name for p in plan.params if p.kind != "expert"} | experts
    if rank == 0:
        assert held == plan.bytes_per_rank(), (held, plan.bytes_per_rank())
    else:
        assert held <= plan.bytes_per_rank()
    print(f"small: {len(names)} parameters placed as planned, {held} bytes on rank {rank} "
          f"(plan: {plan.bytes_per_rank()} on the most loaded rank)")

    # 2. collectives of one training step, GEM-ref tiny on the CPU, dense and sparse tables
    for sparse in (False, True):
        cfg = gem_ref_config("tiny")
        torch.manual_seed(0)
        model = GemRef(cfg)
        plan = plan_for_model(model, config, world)
        runtime = ParallelRuntime.setup(model, plan, "cpu")
        optimizers = runtime.build_optimizers(1e-3, 0.01, sparse_tables=sparse)
        batch = runtime.local_batch(SyntheticData(cfg.data_config(world, seed=0)).batch(0))
        counter = runtime.meshes.counter()
        with counter:
            loss = runtime.loss(model(**batch.features()), batch.labels, batch.label_mask)
            loss.backward()
            runtime.finish_gradients()
            runtime.clip_grad_norm_(None if sparse else 1.0)
        for optimizer in optimizers:
            optimizer.step()
        observed, planned = counter.as_dict(), runtime.expected_collectives()
        assert observed == planned, (sparse, observed, planned)
        print(f"tiny, {'sparse' if sparse else 'dense'} tables: one step issued {sum(observed.values())} "
              f"collectives, as planned: {sorted(observed.items())}")
    dist.destroy_process_group()
    print("OK")


if __name__ == "__main__":
    main()
