"""Helper of test_parallel_training.py, run under torchrun (gloo, one process per rank).

    torchrun --standalone --nproc_per_node N tests/integration/parallel_worker.py OUT.json '{"steps": 5, ...}'

Trains GEM-ref tiny with runtime.training.train.train(TrainConfig(..., parallel=ParallelConfig(...)))
and, with "count": true, then runs one more step of a fresh model under CollectiveCounter (with sparse
tables unless the run's TrainConfig resolves them dense). Rank 0 writes OUT.json: {"losses",
"start_step", "checkpoints", "observed", "expected", "axes", "sparse_tables"}; a compiled run (spec
"compile", and optionally "memory_budget" / "fp8_saved", TrainConfig's fields) adds "pass_counts", "memory"
(one record per compiled joint graph: budget, kept, saved_bytes, fp8_bytes, recomputed_ops) and
"fp8_saved_modules". With "compare":
[{"parallel": {...}, "checkpoint_dir": optional}, ...], each plan trains "compare_steps" steps of a fresh
model with sparse and with dense tables through ParallelRuntime directly and, given a checkpoint_dir,
each again resumed from the other's checkpoint of step 1: payload "compare", one compare_sparse_dense()
result per plan (no "steps": the compare only).
"""

import contextlib
import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from gemcompile.config import ParallelConfig
from gemcompile.runtime.distributed.apply import init_distributed
from gemcompile.runtime.training.config import TrainConfig
from gemcompile.runtime.training.train import train


def _runtime(parallel: ParallelConfig):
    from gemcompile.models.gem import GemRef, gem_ref_config
    from gemcompile.runtime.distributed.apply import ParallelRuntime
    from gemcompile.runtime.distributed.plan import plan_for_model

    cfg = gem_ref_config("tiny")
    torch.manual_seed(0)
    model = GemRef(cfg)
    plan = plan_for_model(model, parallel, dist.get_world_size())
    return cfg, model, ParallelRuntime.setup(model, plan, "cpu")


def count_one_step(parallel: ParallelConfig, batch_size: int, sparse_tables: bool) -> tuple[dict, dict]:
    from gemcompile.models.data import SyntheticData

    cfg, model, runtime = _runtime(parallel)
    runtime.build_optimizers(1e-3, 0.01, sparse_tables=sparse_tables)
    batch = runtime.local_batch(SyntheticData(cfg.data_config(batch_size, seed=0)).batch(0))
    counter = runtime.meshes.counter()
    with counter:
        loss = runtime.loss(model(**batch.features()), batch.labels, batch.label_mask)
        loss.backward()
        runtime.finish_gradients()
        runtime.clip_grad_norm_(None if sparse_tables else 1.0)  # the norm's all-reduce either way
    key = lambda d: {f"{op}@{axis}": n for (op, axis), n in sorted(d.items())}
    return key(counter.as_dict()), key(runtime.expected_collectives())


@torch.no_grad()
def _full(t):
    """A copy of the whole of a DTensor (full_tensor() may return the local tensor itself)."""
    return t.full_tensor().clone()


def _train_directly(parallel: ParallelConfig, sparse: bool, steps: int, batch_size: int,
                    save: str | None = None, resume: str | None = None):
    """Train through ParallelRuntime; `save`: a checkpoint directory the first step is saved to; `resume`: a
    checkpoint (saved by another run) to resume from. {"losses": global losses of the steps trained,
    "initial" / "weights": full table weights before / after, "sums": full Adagrad sums, "shards": this
    rank's table shards, "outer": the emb_outer group}."""
    from gemcompile.models.data import SyntheticData
    from gemcompile.runtime.training.checkpoint import load_checkpoint, save_checkpoint

    cfg, model, runtime = _runtime(parallel)
    optimizers = runtime.build_optimizers(1e-3, 0.05, sparse_tables=sparse)
    names = {id(p): n for n, p in model.named_parameters()}
    initial = {names[id(p)]: _full(p) for p in runtime.table_params}
    data = SyntheticData(cfg.data_config(batch_size, fill=0.5, seed=0))
    tables = {id(p) for p in runtime.table_params}
    losses = []
    start = 0 if resume is None else load_checkpoint(resume, model, optimizers, flatten_optimizer=True).step
    for step in range(start, steps):
        batch = runtime.local_batch(data.batch(step))
        loss = runtime.loss(model(**batch.features()), batch.labels, batch.label_mask)
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
        loss.backward()
        runtime.finish_gradients()
        if sparse:
            assert all(p.grad is None for p in runtime.table_params), "a sparse table got a dense gradient"
        for optimizer in optimizers:
            optimizer.step()
        losses.append(runtime.global_loss(loss))
        if save is not None and step == 0:
            save_checkpoint(save, 1, model, optimizers, flatten_optimizer=True)
    return {"losses": losses, "initial": initial,
            "weights": {names[id(p)]: _full(p) for p in runtime.table_params},
            "sums": {names[id(p)]: _full(o.state[p]["sum"]) for o in optimizers for p in o.state
                     if id(p) in tables},
            "shards": {names[id(p)]: p.to_local().detach().clone() for p in runtime.table_params},
            "outer": runtime.meshes.embedding.get_group("emb_outer")}


def compare_sparse_dense(parallel: ParallelConfig, steps: int, batch_size: int,
                         directory: str | None) -> dict:
    """Sparse against dense tables under one plan and, with a `directory`, each resumed after one step
    from the other's checkpoint (a DCP checkpoint of each run's first step); with replicated groups,
    whether every replica of a row shard holds the same bytes after the sparse run. {"losses": {run:
    losses}, "max_diff": {run: {"loss", "weight", "sum"} against the dense run}, "moved": the smallest
    largest change of a table, "replicas_identical"}."""
    from gemcompile.runtime.training.checkpoint import checkpoint_path

    saved = {mode: None if directory is None else f"{directory}/{mode}" for mode in ("sparse", "dense")}
    runs = {"sparse": _train_directly(parallel, True, steps, batch_size, save=saved["sparse"]),
            "dense": _train_directly(parallel, False, steps, batch_size, save=saved["dense"])}
    if directory is not None:
        runs["sparse<-dense"] = _train_directly(parallel, True, steps, batch_size,
                                                resume=str(checkpoint_path(saved["dense"], 1)))
        runs["dense<-sparse"] = _train_directly(parallel, False, steps, batch_size,
                                                resume=str(checkpoint_path(saved["sparse"], 1)))
    dense = runs["dense"]
    assert set(dense["sums"]) == set(dense["weights"]) and len(dense["weights"]) > 0, set(dense["sums"])

    def diff(run: dict, key: str) -> float:
        assert set(run[key]) == set(dense[key]), (set(run[key]), set(dense[key]))
        return max(float((run[key][k] - dense[key][k]).abs().max()) for k in dense[key])

    def loss_diff(run: dict) -> float:  # a resumed run's losses are the last steps' losses
        return max(abs(a - b) for a, b in zip(run["losses"][::-1], dense["losses"][::-1]))

    out = {"losses": {name: run["losses"] for name, run in runs.items()},
           "max_diff": {name: {"loss": loss_diff(run), "weight": diff(run, "weights"),
                               "sum": diff(run, "sums")} for name, run in runs.items() if name != "dense"},
           "moved": min(float((dense["weights"][k] - w).abs().max()) for k, w in dense["initial"].items())}
    if parallel.embedding_sharding == "replicated_groups":
        group, same = runs["sparse"]["outer"], True
        for shard in runs["sparse"]["shards"].values():
            copies = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
            dist.all_gather(copies, shard, group=group)
            same &= all(torch.equal(c, shard) for c in copies)
        out["replicas_identical"] = same
    return out


def _train(spec: dict) -> dict:
    parallel = ParallelConfig(enabled=True, **spec.get("parallel", {}))
    cfg = TrainConfig(size="tiny", steps=spec["steps"], batch_size=spec["batch_size"], quiet=True,
                      checkpoint_dir=spec.get("checkpoint_dir"), save_every=spec.get("save_every"),
                      resume=spec.get("resume", False), grad_clip=spec.get("grad_clip"),
                      compile=spec.get("compile", "eager"), sparse_tables=spec.get("sparse_tables"),
                      memory_budget=spec.get("memory_budget"), fp8_saved=spec.get("fp8_saved", False),
                      parallel=parallel)
    # the passes' records only where a run compiles: importing them loads the compiler stack (~3 s a rank)
    compiled = spec.get("compile", "eager") != "eager"
    reporting = contextlib.nullcontext()
    if compiled:
        from gemcompile.passes.records import PassLog, recording

        from tests.inductor_cpp import compile_cpp_without_simd

        compile_cpp_without_simd()  # as in the pytest process

        log = PassLog()
        reporting = recording(log)  # every unit's GemBackend reports into it (compile="gem")
    with reporting:
        result = train(cfg)
    payload = {"losses": result.losses, "start_step": result.start_step, "checkpoints": result.checkpoints,
               "sparse_tables": cfg.trains_tables_sparsely}
    if compiled:
        from torch._dynamo.utils import counters

        payload["pass_counts"] = dict(counters["gemcompile"])
        payload["memory"] = [{"budget": m.budget, "kept": m.kept, "saved_bytes": m.saved_bytes,
                              "fp8_bytes": m.fp8_bytes, "recomputed_ops": list(m.recomputed_ops)}
                             for m in log.memory]
        payload["fp8_saved_modules"] = [mod for r in log.rewrites if r.pass_name == "fp8_saved"
                                        for mod in r.metrics["modules"]]
    if spec.get("count"):
        payload["observed"], payload["expected"] = count_one_step(parallel, spec["batch_size"],
                                                                  cfg.trains_tables_sparsely)
    return payload


@record  # a failing rank's own traceback in torchrun's summary, the end of the output the tests quote
def main() -> None:
    out, spec = sys.argv[1], json.loads(sys.argv[2])
    torch.set_num_threads(1)
    payload = _train(spec) if "steps" in spec else {}
    if spec.get("compare"):
        init_distributed("cpu")  # (done by train() when it ran)
        payload["compare"] = [
            compare_sparse_dense(ParallelConfig(enabled=True, **c["parallel"]), spec["compare_steps"],
                                 spec["batch_size"], c.get("checkpoint_dir"))
            for c in spec["compare"]]
    if dist.get_rank() == 0:
        with open(out, "w") as fh:
            json.dump(payload, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
