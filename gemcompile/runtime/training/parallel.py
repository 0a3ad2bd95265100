"""`gemcompile train --parallel`: the training loop's side of the 5D plan under torchrun.

ParallelTraining checks the plan against GEM-ref on the meta device for torchrun's WORLD_SIZE (errors
before any collective), joins the process group, applies the plan (runtime/distributed/apply.py) and
hands the loop (runtime/training/train.py) the pieces of a parallel step; compile_units compiles the
sharded model unit by unit, with the sharding pass bound to the plan the runtime applied.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gemcompile.config import GemConfig
from gemcompile.models.gem import GemRef, gem_ref_config
from gemcompile.runtime.distributed.apply import ParallelRuntime, init_distributed
from gemcompile.runtime.distributed.plan import ParallelPlan, plan_for_model
from gemcompile.runtime.training.flops import PaddedFlopCounter
from gemcompile.runtime.training.rank_agreement import check_ranks_agree, configuration_fingerprint

__all__ = ["ParallelTraining", "compile_units"]


def compile_units(runtime: ParallelRuntime, mode: str, gem_config=None, parallel=None) -> nn.Module:
    """"eager": the model. "inductor" / "gem": each dense FSDP unit that looks no table up (the GEM layers,
    the final summary, the heads) compiled in place (per-block compile, as torchtitan does); the embedding
    exchanges (data-dependent all-to-all splits) and FSDP's hooks stay eager. Under "gem" each unit's
    sharding pass annotates with the plan the runtime applied.

    Each GEM layer and the final summary build their masks from the lengths they are given, so the
    attention passes prove them inside a unit as they do in the whole model."""
    model = runtime.model
    if mode == "eager":
        return model
    owners = set(runtime.plan.embedding_collections)
    for unit in runtime.plan.dense_units:
        if not unit or unit in owners:
            continue
        if mode == "inductor":
            backend = "inductor"
        else:  # the compiler stack imported here: an eager run does not load it
            from gemcompile.backend import GemBackend
            from gemcompile.passes import PIPELINE
            from gemcompile.passes.sharding import ShardingPass

            config = gem_config if gem_config is not None else GemConfig()
            if parallel is not None:
                config = dataclasses.replace(config, parallel=parallel)
            passes = tuple(ShardingPass.bound(runtime.plan, unit) if p is ShardingPass else p for p in PIPELINE)
            backend = GemBackend(config, passes=passes)
        model.get_submodule(unit).compile(backend=backend)
    return model


class _MetaPaddedFlops:
    """PaddedFlopCounter on a meta-device copy of the unsharded model (the sharded one would run
    collectives inside FlopCounterMode)."""

    def __init__(self, model_cfg) -> None:
        with torch.device("meta"):
            self.counter = PaddedFlopCounter(GemRef(model_cfg))

    def train_flops(self, inputs) -> int:
        def meta(v):
            return [t.to("meta") for t in v] if isinstance(v, list) else v.to("meta")

        return self.counter.train_flops({k: meta(v) for k, v in inputs.items()})


def _env_int(name: str) -> int | None:
    """torchrun's integer environment variable ``name``, None when unset or empty."""
    text = os.environ.get(name, "").strip()
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name} = {text!r} is invalid: expected an integer (torchrun sets it)") from None


class ParallelTraining:
    """The parallel side of `gemcompile train --parallel`: process group, plan, sharded model, step."""

    def __init__(self, cfg, plan_template: ParallelPlan) -> None:
        self.cfg = cfg
        self.template = plan_template
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if cfg.device == "cuda":
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        self.runtime: ParallelRuntime | None = None

    @classmethod
    def start(cls, cfg) -> ParallelTraining:
        """Check the plan against GEM-ref (on the meta device) for torchrun's WORLD_SIZE, then join the
        process group and check that every rank runs the same configuration. Errors in the plan or the
        batch size are raised before any collective."""
        world = _env_int("WORLD_SIZE") or (dist.get_world_size() if dist.is_initialized() else 0)  # (0: unset)
        rank = _env_int("RANK")
        if world < 0:
            raise ValueError(f"WORLD_SIZE = {world} is invalid: expected the number of processes (>= 1)")
        if world >= 1 and not dist.is_initialized() and rank is not None and not 0 <= rank < world:
            raise ValueError(f"RANK = {rank} is invalid for WORLD_SIZE = {world}: expected 0 <= RANK < "
                             "WORLD_SIZE (the rendezvous would wait for ranks that never come)")
        port = None if dist.is_initialized() else _env_int("MASTER_PORT")
        if port is not None and not 1 <= port <= 65535:
            raise ValueError(f"MASTER_PORT = {port} is invalid: expected a TCP port in [1, 65535]")
        if world < 1:
            raise ValueError("TrainConfig.parallel is enabled but this process was not started by torchrun "
                             "(no WORLD_SIZE): run `torchrun --nproc_per_node N -m gemcompile.cli train "
                             "--parallel ...`")
        if cfg.batch_size % world:
            error = ValueError(f"TrainConfig.batch_size = {cfg.batch_size} is not divisible by the world "
                               f"size {world}: batch_size is the global batch, split evenly over the ranks")
            error.same_on_every_rank = True  # every rank finds it: rank 0 says it
            raise error
        with torch.device("meta"):
            template = GemRef(gem_ref_config(cfg.size))
        plan = plan_for_model(template, cfg.parallel, world)  # ParallelPlanError before any collective
        init_distributed(cfg.device, cfg.parallel.collective_timeout_s)
        check_ranks_agree(configuration_fingerprint(cfg, plan.axes))  # the first collective: rank_agreement.py
        if dist.get_rank() != 0 and not cfg.quiet:
            cfg = dataclasses.replace(cfg, quiet=True)
        return cls(cfg, plan)

    def apply(self, model: nn.Module) -> _MetaPaddedFlops:
        plan = plan_for_model(model, self.cfg.parallel, self.world)  # = the template's, on the real model
        self.runtime = ParallelRuntime.setup(model, plan, self.device)
        if not self.cfg.quiet:
            from rich.console import Console

            Console().print(f"parallel plan: {self.runtime.describe()}", highlight=False)
        return _MetaPaddedFlops(model.cfg)

    def compile(self, gem_config) -> nn.Module:
        return compile_units(self.runtime, self.cfg.compile, gem_config, self.cfg.parallel)

    def build_optimizers(self, lr: float, embedding_lr: float,
                         sparse_tables: bool = False) -> list[torch.optim.Optimizer]:
        return self.runtime.build_optimizers(lr, embedding_lr, sparse_tables=sparse_tables)

    def local_batch(self, batch):
        return self.runtime.local_batch(batch)

    def loss(self, logits: Tensor, labels: Tensor, label_mask: Tensor) -> Tensor:
        return self.runtime.loss(logits, labels, label_mask)

    def finish_gradients(self, grad_clip: float | None) -> Tensor:
        self.runtime.finish_gradients()
        return self.runtime.clip_grad_norm_(grad_clip)

    def global_loss(self, loss: Tensor) -> float:
        return self.runtime.global_loss(loss)

    def gather_logits(self, logits: Tensor) -> Tensor:
        return self.runtime.gather(logits.detach().float())[0]

