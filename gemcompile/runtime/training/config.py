"""TrainConfig: one training run of GEM-ref, every field validated on construction.

The fields that change the training trajectory (TRAJECTORY_FIELDS) are stored with each checkpoint: a
run resumes only from a checkpoint written under the same values. gem_config() is the GemConfig a
compile="gem" run uses.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Literal

from gemcompile.config import GemConfig, ParallelConfig
from gemcompile.runtime.distributed.plan import SPARSE_ROW_SHARDINGS

__all__ = ["COMPILE_MODES", "DEFAULT_BATCH_SIZE", "DEVICES", "DTYPES", "LENGTH_DISTS", "MXFP8_RECIPES",
           "SIZES", "TRAJECTORY_FIELDS", "TrainConfig", "gem_config"]

SIZES = ("tiny", "small", "medium", "large")
COMPILE_MODES = ("eager", "inductor", "gem")
DEVICES = ("cpu", "cuda")
DTYPES = ("float32", "bfloat16")
LENGTH_DISTS = ("uniform", "heavy_tail")

DEFAULT_BATCH_SIZE = {"tiny": 64, "small": 256, "medium": 256, "large": 512}
"""Batch size per size preset when TrainConfig.batch_size is None."""

# Fields that change the training trajectory: a checkpoint written under other values is refused.
TRAJECTORY_FIELDS = ("size", "batch_size", "lr", "embedding_lr", "dtype", "fill", "length_dist", "seed",
                     "mxfp8", "mxfp8_min_dim", "grad_clip")
MXFP8_RECIPES = ("blockwise", "mxfp8", "mxfp8_emulated")


_COUNT = "an int in [1, 2**63)"
"""Counts (steps, batch size, intervals) end up in torch and deque sizes: a signed 64-bit int at most (2**63
stopped a run with "Overflow when unpacking long long" or an OverflowError instead of this line)."""


def _is_count(value) -> bool:
    return _is_int(value) and 1 <= value < 2**63


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_rate(value: Any) -> bool:
    """A learning rate: > 0 and at most _MAX_RATE."""
    return _is_number(value) and 0 < value <= _MAX_RATE


_MAX_RATE = 1e30
"""The optimizers keep their rates in float32 and scale them (Adam's first step by 1 / (1 - beta1) = 10):
1e38 passed a float32-range check and then overflowed in the first step."""


@dataclass(frozen=True)
class TrainConfig:
    """One training run. Every field is validated on construction (ValueError naming the field)."""

    size: Literal["tiny", "small", "medium", "large"] = "tiny"
    """Model and data preset (gemcompile.models.gem.gem_ref_config)."""

    steps: int = 50
    """Total training steps (a resumed run continues up to this step)."""

    batch_size: int | None = None
    """Samples per step; None = the size's default (tiny 64, small 256, large 512)."""

    lr: float = 1e-3
    """Adam learning rate of the dense parameters."""

    embedding_lr: float = 0.01
    """Adagrad learning rate of the embedding tables."""

    compile: Literal["eager", "inductor", "gem"] = "eager"
    """"eager": plain PyTorch; "inductor": torch.compile(model); "gem": gemcompile.gem_compile(model)."""

    device: Literal["cpu", "cuda"] = "cpu"
    """Where the model and the batches live."""

    dtype: Literal["float32", "bfloat16"] = "float32"
    """"bfloat16": the forward runs under torch.autocast(bfloat16); parameters and the loss stay float32."""

    fill: float = 0.5
    """Mean sequence length / padded length of the synthetic data, in (0, 1]."""

    length_dist: Literal["uniform", "heavy_tail"] = "uniform"
    """Distribution of the synthetic sequence lengths."""

    seed: int = 0
    """Seeds the model initialization and the synthetic data."""

    log_every: int = 10
    """Steps per metrics window: NE / AUC are computed over the last log_every steps, and a line is
    logged every log_every steps when stdout is not a terminal."""

    checkpoint_dir: str | None = None
    """Directory of DCP checkpoints (step_XXXXXXXX/ inside); None = no checkpoints. With a directory,
    the final step is always saved. train() creates it and checks that it can write there before the
    model is built."""

    save_every: int | None = None
    """Also save a checkpoint every save_every steps (needs checkpoint_dir)."""

    resume: bool = False
    """Continue from the newest checkpoint in checkpoint_dir that verifies against its manifest (from step
    0 if there is none; an error if there are checkpoints and none verifies, or all are an earlier run's:
    checkpoint_owner.py)."""

    deterministic: bool = False
    """torch.use_deterministic_algorithms(True) for the run (restored afterwards). Needed for bit-exact
    resume under compile="inductor"/"gem": Inductor's CPU scatter-adds (embedding backward) otherwise
    use atomic adds whose summation order varies run to run. Eager CPU training is deterministic
    without it."""

    explain: bool = False
    """Print gemcompile.explain's report (what the passes rewrite) before training; needs compile="gem"."""

    quiet: bool = False
    """Print nothing: no progress bar, no log lines, no summary table."""

    mxfp8: Literal["blockwise", "mxfp8", "mxfp8_emulated"] | None = None
    """Run qualifying GEMMs (forward, dgrad, wgrad) in block-scaled FP8 with this recipe: gemcompile's
    mxfp8 pass (GemConfig.mxfp8); needs compile="gem". None: no FP8."""

    mxfp8_min_dim: int | None = None
    """With mxfp8: the smallest tokens / in_features / out_features of a quantized layer (sets
    Mxfp8Config.min_m, min_k and min_n). None keeps the config's defaults, which leave layers under 2048
    wide or under 16384 tokens in high precision (where FP8 loses to bf16 on H200)."""

    memory_budget: float | None = None
    """Activation memory budget in (0, 1] for gem_compile's partitioner (GemConfig.memory.budget): lower saves
    fewer activations and recomputes more in the backward (exact: the trajectory does not change). None:
    the partitioner's default. Needs compile="gem"."""

    fp8_saved: bool = False
    """Save the inputs of the Linear layers' weight gradients in FP8 (GemConfig.memory.fp8_saved,
    passes/fp8_saved.py): less activation memory, weight gradients computed from the FP8 copy. Needs
    compile="gem". Not a trajectory field: a run may resume with it switched."""

    grad_clip: float | None = None
    """Clip the global gradient norm to this value (over every mesh when parallel); None = no clipping."""

    sparse_tables: bool | None = None
    """Train the embedding tables sparsely: lookups give row gradients and SparseAdagrad reads and writes
    only the looked-up rows (runtime/tables/sparse_adagrad.py; the update equals dense Adagrad's); under
    parallel, the sharded tables do so on their local shards (runtime/distributed/embedding.py) and the
    small tables, FSDP-managed dense weights, stay dense. None: on without grad_clip (clipping needs every
    gradient as a tensor) unless parallel with an embedding_sharding that cannot (none today:
    runtime/distributed/plan.py SPARSE_ROW_SHARDINGS); False: dense gradients and torch's Adagrad."""

    parallel: Any = None
    """A gemcompile.config.ParallelConfig (or a dict of its fields) with enabled=True: train with the 5D
    plan under torchrun (gloo on the CPU, NCCL on GPUs); batch_size is then the global batch. None or
    enabled=False: one process."""

    @property
    def trains_tables_sparsely(self) -> bool:
        """Whether the run's tables train sparsely (sparse_tables, with None resolved)."""
        if self.sparse_tables is not None:
            return self.sparse_tables
        return self.grad_clip is None and self._parallel_tables_can_be_sparse()

    def _parallel_tables_can_be_sparse(self) -> bool:
        """True for one process, or under parallel with an embedding sharding that trains sparsely."""
        if self.parallel is None or not self.parallel.enabled:
            return True
        return self.parallel.embedding_sharding in SPARSE_ROW_SHARDINGS

    def __post_init__(self) -> None:
        def check(ok: bool, name: str, expected: str) -> None:
            if not ok:
                error = ValueError(f"TrainConfig.{name} = {getattr(self, name)!r} is invalid: expected {expected}")
                error.same_on_every_rank = True  # the flags are every rank's: said once under torchrun
                raise error

        check(self.size in SIZES, "size", f"one of {', '.join(SIZES)}")
        check(_is_count(self.steps), "steps", _COUNT)
        if self.batch_size is None:
            object.__setattr__(self, "batch_size", DEFAULT_BATCH_SIZE[self.size])
        check(_is_count(self.batch_size), "batch_size", f"{_COUNT} (or None)")
        rate = f"a float > 0, at most {_MAX_RATE:g}"  # the optimizers keep (and scale) their rates in fp32
        check(_is_rate(self.lr), "lr", rate)
        check(_is_rate(self.embedding_lr), "embedding_lr", rate)
        check(self.compile in COMPILE_MODES, "compile", f"one of {', '.join(COMPILE_MODES)}")
        check(self.device in DEVICES, "device", f"one of {', '.join(DEVICES)}")
        check(self.dtype in DTYPES, "dtype", f"one of {', '.join(DTYPES)}")
        check(_is_number(self.fill) and 0.0 < self.fill <= 1.0, "fill", "a float in (0, 1]")
        check(self.length_dist in LENGTH_DISTS, "length_dist", f"one of {', '.join(LENGTH_DISTS)}")
        # torch seeds with a signed 64-bit int: 2**64 stopped the run with "Overflow when unpacking long long"
        check(_is_int(self.seed) and 0 <= self.seed < 2**63, "seed", "an int in [0, 2**63)")
        check(_is_count(self.log_every), "log_every", _COUNT)
        if isinstance(self.checkpoint_dir, os.PathLike):  # a pathlib.Path is a directory path too
            object.__setattr__(self, "checkpoint_dir", os.fspath(self.checkpoint_dir))
        check(
            self.checkpoint_dir is None
            or (isinstance(self.checkpoint_dir, str) and self.checkpoint_dir != ""),
            "checkpoint_dir",
            "None or a directory path",
        )
        check(
            self.save_every is None or _is_count(self.save_every),
            "save_every",
            f"None or {_COUNT}",
        )
        check(isinstance(self.resume, bool), "resume", "a bool")
        check(isinstance(self.deterministic, bool), "deterministic", "a bool")
        check(isinstance(self.explain, bool), "explain", "a bool")
        check(isinstance(self.quiet, bool), "quiet", "a bool")
        check(self.sparse_tables in (None, True, False), "sparse_tables", "None, True or False")
        check(not (self.sparse_tables and self.grad_clip is not None), "sparse_tables",
              "None or False with grad_clip (sparse tables have no gradient tensor to clip)")
        check(self.grad_clip is None or (_is_number(self.grad_clip) and math.isfinite(self.grad_clip)
                                         and self.grad_clip > 0), "grad_clip", "None or a finite float > 0")
        if isinstance(self.parallel, dict):
            object.__setattr__(self, "parallel", ParallelConfig(**self.parallel))
        check(self.parallel is None or isinstance(self.parallel, ParallelConfig), "parallel",
              "None, a ParallelConfig or a dict of its fields")
        check(not (self.sparse_tables and not self._parallel_tables_can_be_sparse()), "sparse_tables",
              f"None or False with parallel embedding_sharding other than {', '.join(SPARSE_ROW_SHARDINGS)} "
              "(its sharded tables keep dense gradients)")
        check(self.mxfp8 is None or self.mxfp8 in MXFP8_RECIPES, "mxfp8",
              f"None or one of {', '.join(MXFP8_RECIPES)}")
        check(self.mxfp8_min_dim is None or (_is_int(self.mxfp8_min_dim) and self.mxfp8_min_dim >= 1),
              "mxfp8_min_dim", "None or an int >= 1")
        if self.mxfp8 is not None and self.compile != "gem":
            raise ValueError(f"TrainConfig.mxfp8 = {self.mxfp8!r} needs compile='gem' (got compile="
                             f"{self.compile!r}): the FP8 casts are a gem_compile pass")
        check(self.memory_budget is None or (_is_number(self.memory_budget) and 0 < self.memory_budget <= 1),
              "memory_budget", "None or a number in (0, 1]")
        check(isinstance(self.fp8_saved, bool), "fp8_saved", "a bool")
        for name in ("memory_budget", "fp8_saved"):
            if getattr(self, name) not in (None, False) and self.compile != "gem":
                raise ValueError(f"TrainConfig.{name} = {getattr(self, name)!r} needs compile='gem' (got compile="
                                 f"{self.compile!r}): the partitioner's policy is gem_compile's")
        if self.mxfp8_min_dim is not None and self.mxfp8 is None:
            raise ValueError("TrainConfig.mxfp8_min_dim needs TrainConfig.mxfp8 (a recipe)")
        if self.save_every is not None and self.checkpoint_dir is None:
            raise ValueError("TrainConfig.save_every needs TrainConfig.checkpoint_dir (where to save)")
        if self.resume and self.checkpoint_dir is None:
            raise ValueError(
                "TrainConfig.resume = True needs TrainConfig.checkpoint_dir (where to resume from)"
            )
        if self.explain and self.compile != "gem":
            raise ValueError(
                f"TrainConfig.explain = True needs compile='gem' (got compile={self.compile!r}): "
                "the report describes what gem_compile rewrites"
            )

    def trajectory_fingerprint(self) -> dict[str, Any]:
        """The fields a resumed run must share with the checkpoint's run to continue it exactly."""
        return {name: getattr(self, name) for name in TRAJECTORY_FIELDS}


def gem_config(cfg: TrainConfig) -> GemConfig:
    """The GemConfig a compile="gem" run uses (the mxfp8 section from TrainConfig.mxfp8*, the memory section
    from memory_budget and fp8_saved)."""
    sections = {}
    if cfg.mxfp8 is not None:
        sizes = {} if cfg.mxfp8_min_dim is None else dict.fromkeys(("min_m", "min_k", "min_n"), cfg.mxfp8_min_dim)
        sections["mxfp8"] = {"enabled": True, "recipe": cfg.mxfp8, **sizes}
    memory = {k: v for k, v in (("budget", cfg.memory_budget), ("fp8_saved", cfg.fp8_saved)) if v not in (None, False)}
    if memory:
        sections["memory"] = memory
    return GemConfig(**sections)

