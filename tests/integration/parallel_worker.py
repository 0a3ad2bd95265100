"""Helper of test_parallel_training.py, run under torchrun (gloo, one process per rank).

    torchrun --standalone --nproc_per_node N tests/integration/parallel_worker.py OUT.json '{"steps": 5, ...}'

Trains GEM-ref tiny with runtime.training.train.train(TrainConfig(..., parallel=ParallelConfig(...)))
and, with "count": true, then runs one more step of a fresh model under CollectiveCounter. Rank 0 writes
OUT.json: {"losses", "start_step", "checkpoints", "observed", "expected", "axes"}.
"""

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from gemcompile.config import ParallelConfig
from gemcompile.runtime.training.config import TrainConfig
from gemcompile.runtime.training.train import train


def count_one_step(parallel: ParallelConfig, batch_size: int) -> tuple[dict, dict]:
    from gemcompile.models.data import SyntheticData
    from gemcompile.models.gem import GemRef, gem_ref_config
    from gemcompile.runtime.distributed.apply import ParallelRuntime
    from gemcompile.runtime.distributed.plan import plan_for_model

    cfg = gem_ref_config("tiny")
    torch.manual_seed(0)
    model = GemRef(cfg)
    runtime = ParallelRuntime.setup(model, plan_for_model(model, parallel, dist.get_world_size()), "cpu")
    batch = runtime.local_batch(SyntheticData(cfg.data_config(batch_size, seed=0)).batch(0))
    counter = runtime.meshes.counter()
    with counter:
        loss = runtime.loss(model(**batch.features()), batch.labels, batch.label_mask)
        loss.backward()
        runtime.finish_gradients()
        runtime.clip_grad_norm_(1.0)
    key = lambda d: {f"{op}@{axis}": n for (op, axis), n in sorted(d.items())}
    return key(counter.as_dict()), key(runtime.expected_collectives())


@record  # a failing rank's own traceback in torchrun's summary, the end of the output the tests quote
def main() -> None:
    out, spec = sys.argv[1], json.loads(sys.argv[2])
    torch.set_num_threads(1)
    parallel = ParallelConfig(enabled=True, **spec.get("parallel", {}))
    result = train(TrainConfig(size="tiny", steps=spec["steps"], batch_size=spec["batch_size"], quiet=True,
                               checkpoint_dir=spec.get("checkpoint_dir"), save_every=spec.get("save_every"),
                               resume=spec.get("resume", False), grad_clip=spec.get("grad_clip"),
                               compile=spec.get("compile", "eager"), parallel=parallel))
    payload = {"losses": result.losses, "start_step": result.start_step, "checkpoints": result.checkpoints}
    if spec.get("compile", "eager") != "eager":
        from torch._dynamo.utils import counters

        payload["pass_counts"] = dict(counters["gemcompile"])
    if spec.get("count"):
        payload["observed"], payload["expected"] = count_one_step(parallel, spec["batch_size"])
    if dist.get_rank() == 0:
        with open(out, "w") as fh:
            json.dump(payload, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
