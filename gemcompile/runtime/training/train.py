"""The training loop: GEM-ref on synthetic data, eager / torch.compile / gem_compile.

    from gemcompile.runtime.training.config import TrainConfig
    from gemcompile.runtime.training.train import train
    result = train(TrainConfig(size="tiny", steps=50, compile="eager"))

One step: batch = SyntheticData(...).batch(step) -> validate_batch (outside the compiled region) ->
model(**batch.features()) (compiled or not; bf16 under autocast when asked) -> masked_bce_loss outside
the model -> backward -> Adam on dense parameters, Adagrad on embedding tables (optimizers.py).
Reported (report.py): per-step loss, NE and AUC per task over a window of steps, steps/s and
samples/s, useful and padded FLOPs per step (flops.py) and MFU (None on the CPU). Checkpoints
(checkpoint.py) resume bit-exactly: the losses of a resumed run equal those of an uninterrupted one.

With ``parallel=ParallelConfig(enabled=True, ...)`` the same loop runs under torchrun, one process per
rank, with the 5D plan applied (parallel.py): every rank draws the same global batch and trains on its
slice; the logged loss and metrics are those of the global batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from gemcompile.models.data import GemBatch, SyntheticData
from gemcompile.models.gem import GemRef, GemRefConfig, gem_ref_config, masked_bce_loss
from gemcompile.runtime.training import checkpoint_owner
from gemcompile.runtime.training.checkpoint import (
    CheckpointChoice,
    CheckpointError,
    choose_checkpoint,
    load_checkpoint,
    on_rank0,
    save_checkpoint,
)
from gemcompile.runtime.training.checkpoint_files import check_checkpoint_dir, kill_point
from gemcompile.runtime.training.config import TrainConfig, gem_config
from gemcompile.runtime.training.flops import GemFlopFormula, PaddedFlopCounter, mfu
from gemcompile.runtime.training.gc_policy import compiled_state_frozen, freeze_compiled_state
from gemcompile.runtime.training.metrics import MetricWindow
from gemcompile.runtime.training.optimizers import build_optimizers
from gemcompile.runtime.training.parallel import ParallelTraining
from gemcompile.runtime.training.report import (
    TASK_NAMES,
    TrainReporter,
    TrainResult,
    WindowSummary,
    summarize_window,
)
from gemcompile.runtime.training.validate import validate_batch

__all__ = ["train"]


def gem_compile(model: nn.Module, **kwargs: Any) -> Any:
    """gemcompile.gem_compile, imported when a run compiles (a module attribute, so tests can replace it)."""
    from gemcompile.api import gem_compile as compile_with_passes

    return compile_with_passes(model, **kwargs)


def explain(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """gemcompile.explain, imported when a run asks for the report."""
    from gemcompile.explain import explain as explain_passes

    return explain_passes(model, *args, **kwargs)


def train(cfg: TrainConfig | None = None, **overrides: Any) -> TrainResult:
    """Train GEM-ref on synthetic data; `train(size="tiny", steps=50)` is shorthand for a TrainConfig."""
    if cfg is None:
        cfg = TrainConfig(**overrides)
    elif overrides:
        cfg = dataclasses.replace(cfg, **overrides)
    if not isinstance(cfg, TrainConfig):
        raise TypeError(f"train expects a TrainConfig, got {type(cfg).__name__}")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "TrainConfig.device = 'cuda' but no CUDA device is available (torch.cuda.is_available() "
            "is False); use device='cpu'"
        )
    _check_paths(cfg)
    with _deterministic(cfg.deterministic, cfg.device):
        return _train(cfg)


def _check_paths(cfg: TrainConfig) -> None:
    """The paths the run will write, checked before the model is built or a collective runs."""
    if cfg.checkpoint_dir is not None:
        problem = check_checkpoint_dir(cfg.checkpoint_dir)
        if problem is not None:
            raise CheckpointError(
                f"TrainConfig.checkpoint_dir = {cfg.checkpoint_dir!r} is unusable: {problem}")


@contextlib.contextmanager
def _deterministic(enabled: bool, device: str):
    if not enabled:
        yield
        return
    previous = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    if device == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS workspaces
    # warn_only: an op without a deterministic kernel warns instead of stopping the run.
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])


def _train(cfg: TrainConfig) -> TrainResult:
    try:
        return _train_owning(cfg)
    finally:
        checkpoint_owner.release(cfg.checkpoint_dir)  # the directory's lock, held since _start


def _train_owning(cfg: TrainConfig) -> TrainResult:
    run = _start(cfg)
    if run.resume_from is not None:
        _resume(run, TrainReporter(run.cfg, 0))
    reporter = TrainReporter(run.cfg, run.start_step)
    _compile(run, reporter)
    # Losses of the current, unfinished window (non-empty only when resuming mid-window).
    run.window_losses = run.losses[len(run.losses) - len(run.losses) % run.cfg.log_every :]
    run.model.train()
    with reporter, compiled_state_frozen():
        for step in range(run.start_step, run.cfg.steps):
            cpu_batch, batch, logits, loss_value = _train_step(run, step)
            _record_step(run, step, cpu_batch, batch, logits, loss_value, reporter)
            if step == run.start_step + 1:  # compiled by now (two batch shapes settle dynamic shapes)
                freeze_compiled_state()
    result = _result(run)
    reporter.summary(result)
    return result


@dataclass
class _TrainingRun:
    """One run's model, data and optimizers, and what it has measured so far."""

    cfg: TrainConfig
    """The run's config (quiet on every rank but 0 under torchrun)."""
    model_cfg: GemRefConfig
    data: SyntheticData
    device: torch.device
    model: nn.Module
    formula: GemFlopFormula
    padded_counter: Any
    """PaddedFlopCounter, or under torchrun its copy on a meta-device model."""
    optimizers: list[torch.optim.Optimizer]
    window: MetricWindow
    parallel: ParallelTraining | None = None
    """The run's side of the parallel plan under torchrun, else None."""
    resume_from: CheckpointChoice | None = None
    """With cfg.resume: the checkpoint chosen (and checked against cfg) before the model was built."""
    run_id: str | None = None
    """The id every checkpoint of this run records (checkpoint_owner.py); None without a directory."""
    named: bool = False
    """Whether run.json names run_id yet (written before the run's first checkpoint)."""
    runner: Any = None
    """The model as the loop calls it (compiled or not)."""
    start_step: int = 0
    losses: list[float] = field(default_factory=list)
    windows: list[WindowSummary] = field(default_factory=list)
    window_losses: list[float] = field(default_factory=list)
    checkpoints: list[str] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    """Wall time of every step of this run after its first."""
    compile_time: float = math.nan
    useful_total: float = 0.0
    padded_total: float = 0.0

    @property
    def world(self) -> int:
        return 1 if self.parallel is None else self.parallel.world


def _start(cfg: TrainConfig) -> _TrainingRun:
    """The model, the data and the optimizers; under torchrun, the process group joined and the plan
    applied (checked against the model before any collective)."""
    model_cfg = gem_ref_config(cfg.size)
    data = SyntheticData(
        model_cfg.data_config(cfg.batch_size, fill=cfg.fill, length_dist=cfg.length_dist, seed=cfg.seed)
    )
    parallel = None
    if cfg.parallel is not None and cfg.parallel.enabled:
        parallel = ParallelTraining.start(cfg)  # joins the process group; quiet on ranks other than 0
        cfg = parallel.cfg
    run_id = resume_from = None
    if cfg.checkpoint_dir is not None:  # one writer per directory (checkpoint_owner.py)
        named = on_rank0(lambda: checkpoint_owner.claim(cfg.checkpoint_dir))
        if cfg.resume:  # before the model is built
            resume_from = _choose_resume_point(cfg, named)
            resumed = resume_from.meta["extra"].get("run") if resume_from.path is not None else None
            run_id = named or resumed
        # run.json names the run at its first save (_save), not here: a fresh run killed before it saved
        # leaves --resume to the run whose checkpoints the directory holds
        run_id = on_rank0(lambda: run_id or checkpoint_owner.new_run_id())
    device = torch.device(cfg.device) if parallel is None else parallel.device
    torch.manual_seed(cfg.seed)
    model = GemRef(model_cfg).to(device)
    formula = GemFlopFormula.from_model(model)
    if parallel is None:
        padded_counter = PaddedFlopCounter(model)
        optimizers = build_optimizers(model, cfg.lr, cfg.embedding_lr, sparse_embeddings=cfg.trains_tables_sparsely)
    else:
        padded_counter = parallel.apply(model)  # the model sharded; FLOPs counted on a meta-device copy
        optimizers = parallel.build_optimizers(cfg.lr, cfg.embedding_lr,
                                               sparse_tables=cfg.trains_tables_sparsely)
    window = MetricWindow(model_cfg.n_tasks, window=cfg.log_every)
    return _TrainingRun(cfg, model_cfg, data, device, model, formula, padded_counter, optimizers, window,
                        parallel, resume_from, run_id=run_id)


def _choose_resume_point(cfg: TrainConfig, run_id: str | None) -> CheckpointChoice:
    """The newest checkpoint of cfg.checkpoint_dir that verifies and belongs to this run (rank 0 verifies,
    every rank takes its answer), each newer one that does not reported in one line on stderr; a
    checkpoint written under other trajectory settings refused, and so is a directory whose only
    checkpoints are an earlier run's, all before any model state is built or loaded."""
    choice = on_rank0(lambda: choose_checkpoint(cfg.checkpoint_dir, run_id))
    for line in choice.skipped if _is_rank0() else ():  # on stderr even when quiet: never silent
        print(f"gemcompile: skipping checkpoint {line}", file=sys.stderr, flush=True)
    for path in choice.other_runs if _is_rank0() else ():
        print(f"gemcompile: skipping checkpoint {path}: written by an earlier run in this directory "
              f"(not the one {checkpoint_owner.RUN_FILE} names)", file=sys.stderr, flush=True)
    if choice.path is None and choice.other_runs:  # never start over on checkpoints another run wrote
        others, run_file = choice.other_runs, Path(cfg.checkpoint_dir) / checkpoint_owner.RUN_FILE
        _fail_everywhere(f"cannot resume: the {len(others)} checkpoint(s) in {cfg.checkpoint_dir} (newest "
                         f"{others[0]}) are an earlier run's, not the one {run_file} names, which has "
                         f"none; to continue the earlier run remove {run_file} and --resume again, to "
                         "start over (replacing them) run without --resume")
    if choice.path is None and choice.skipped:
        _fail_everywhere(f"cannot resume: none of the {len(choice.skipped)} checkpoints in "
                         f"{cfg.checkpoint_dir} verifies (each is reported above)")
    if choice.path is not None:
        saved = choice.meta["extra"].get("config", {})
        now = cfg.trajectory_fingerprint()
        mismatched = {k: (saved.get(k), v) for k, v in now.items() if saved.get(k) != v}
        if mismatched:
            detail = ", ".join(f"{k}: checkpoint {a!r} vs now {b!r}" for k, (a, b) in mismatched.items())
            _fail_everywhere(f"cannot resume from {choice.path}: it was written with other settings "
                             f"({detail})")
    return choice


def _is_rank0() -> bool:
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    return not distributed or torch.distributed.get_rank() == 0


def _fail_everywhere(message: str) -> None:
    """Raise the CheckpointError every rank raises alike (reported once, by rank 0)."""
    error = CheckpointError(message)
    error.same_on_every_rank = True
    raise error


def _resume(run: _TrainingRun, reporter: TrainReporter) -> None:
    """Load the checkpoint chosen by _choose_resume_point, if any, into the run."""
    cfg, path = run.cfg, run.resume_from.path
    if path is None:
        reporter.print(f"no checkpoint in {cfg.checkpoint_dir}: starting from step 0")
        return
    state = load_checkpoint(path, run.model, run.optimizers)  # either optimizer layout (parallel or not)
    run.start_step = state.step
    run.losses = list(state.extra["losses"])
    run.windows = [WindowSummary(**w) for w in state.extra["windows"]]
    run.window.load_bytes(state.extra["metric_window"])
    reporter.print(f"resumed from {path} at step {run.start_step}")
    if run.start_step >= cfg.steps:
        reporter.print(f"the checkpoint is at step {run.start_step} >= steps = {cfg.steps}: nothing to train")


def _compile(run: _TrainingRun, reporter: TrainReporter) -> None:
    """The model as the loop calls it; with cfg.explain, the passes' report printed first."""
    cfg = run.cfg
    if run.parallel is not None:
        run.runner = run.parallel.compile(gem_config(cfg))
    elif cfg.compile == "eager":
        run.runner = run.model
    elif cfg.compile == "inductor":
        run.runner = torch.compile(run.model)
    else:
        run.runner = gem_compile(run.model, config=gem_config(cfg))
    if cfg.explain and run.start_step < cfg.steps:
        example = run.data.batch(run.start_step).to(run.device)
        validate_batch(example, run.model_cfg)
        reporter.print(explain(run.model, **example.features(), config=gem_config(cfg)))


def _autocast(cfg: TrainConfig) -> contextlib.AbstractContextManager:
    if cfg.dtype == "bfloat16":
        return torch.autocast(device_type=cfg.device, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _train_step(run: _TrainingRun, step: int) -> tuple[GemBatch, GemBatch, Tensor, float]:
    """One optimizer step on the batch of `step`, timed: (the batch on the CPU, on the device, this
    rank's logits, the loss of the global batch)."""
    cfg, parallel = run.cfg, run.parallel
    start = time.perf_counter()
    cpu_batch = run.data.batch(step)
    batch = cpu_batch.to(run.device)
    validate_batch(batch, run.model_cfg)
    step_batch = batch if parallel is None else parallel.local_batch(batch)  # this rank's samples
    for optimizer in run.optimizers:  # before the forward: old gradients never sit beside its activations
        optimizer.zero_grad(set_to_none=True)
    with _autocast(cfg):
        logits = run.runner(**step_batch.features())
    if parallel is None:
        loss = masked_bce_loss(logits.float(), batch.labels, batch.label_mask)
    else:  # world size x this rank's share of the global batch's loss
        loss = parallel.loss(logits.float(), step_batch.labels, step_batch.label_mask)
    loss.backward()
    if parallel is not None:
        parallel.finish_gradients(cfg.grad_clip)
    elif cfg.grad_clip is not None:
        torch.nn.utils.clip_grad_norm_(run.model.parameters(), cfg.grad_clip)
    for optimizer in run.optimizers:
        optimizer.step()
    # the step's one device sync besides validation
    loss_value = loss.item() if parallel is None else parallel.global_loss(loss)
    elapsed = time.perf_counter() - start
    if step == run.start_step:
        run.compile_time = elapsed
    else:
        run.step_times.append(elapsed)
    return cpu_batch, batch, logits, loss_value


def _record_step(run: _TrainingRun, step: int, cpu_batch: GemBatch, batch: GemBatch, logits: Tensor,
                 loss_value: float, reporter: TrainReporter) -> None:
    """Bookkeeping outside the timed region: loss, metrics window, FLOPs, progress, checkpoint."""
    cfg = run.cfg
    if not math.isfinite(loss_value):
        raise ValueError(f"training diverged: the loss of step {step + 1} is {loss_value}")
    run.losses.append(loss_value)
    run.window_losses.append(loss_value)
    if run.parallel is not None:  # the global batch's logits, in sample order
        logits = run.parallel.gather_logits(logits)
    run.window.update(logits.detach().float(), batch.labels, batch.label_mask)
    run.useful_total += run.formula.train_flops(cpu_batch.seq_lengths, cfg.batch_size)
    # The measuring forward must not shift the RNG streams (bit-exact resume).
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if run.device.type == "cuda" else []):
        run.padded_total += run.padded_counter.train_flops(batch.features())
    done = step + 1
    metrics = run.window.compute()
    if done % cfg.log_every == 0 or done == cfg.steps:
        run.windows.append(summarize_window(done - len(run.window_losses) + 1, done, run.window_losses,
                                            run.window))
        run.window_losses = []
    rate = (len(run.step_times) / sum(run.step_times)) if run.step_times else None
    reporter.step(done, loss_value, metrics.ne, rate)
    kill_point(f"step:{done}")  # test hook (checkpoint_files.kill_point)
    if cfg.checkpoint_dir is not None and (
        done == cfg.steps or (cfg.save_every is not None and done % cfg.save_every == 0)
    ):
        _save(run, done)


def _save(run: _TrainingRun, step: int) -> None:
    if not run.named:  # before the checkpoint: one that records this run is never left unnamed in run.json
        on_rank0(lambda: checkpoint_owner.name_run(run.cfg.checkpoint_dir, run.run_id))
        run.named = True
    extra = {
        "run": run.run_id,
        "config": run.cfg.trajectory_fingerprint(),
        "losses": list(run.losses),
        "windows": [dataclasses.asdict(w) for w in run.windows],
        "metric_window": run.window.to_bytes(),
    }
    # optimizer state keyed by parameter name in every run: a --parallel run resumes one process's
    # checkpoint and the reverse (group indices differ between the two)
    run.checkpoints.append(str(save_checkpoint(run.cfg.checkpoint_dir, step, run.model, run.optimizers, extra,
                                               flatten_optimizer=True)))


def _result(run: _TrainingRun) -> TrainResult:
    cfg = run.cfg
    steps_run = max(0, cfg.steps - run.start_step)
    if run.step_times:
        steps_per_s = len(run.step_times) / sum(run.step_times)
    elif steps_run > 0:
        steps_per_s = 1.0 / run.compile_time
    else:
        steps_per_s = math.nan
    useful = run.useful_total / steps_run if steps_run else math.nan
    padded = run.padded_total / steps_run if steps_run else math.nan
    final = run.window.compute()
    return TrainResult(
        config=cfg, losses=run.losses, ne=final.ne, auc=final.auc, windows=run.windows,
        start_step=run.start_step, steps_per_s=steps_per_s, samples_per_s=steps_per_s * cfg.batch_size,
        compile_time_s=run.compile_time, useful_flops_per_step=useful, padded_flops_per_step=padded,
        mfu=mfu(useful * steps_per_s / run.world, run.device) if steps_run else None,
        checkpoints=run.checkpoints, task_names=TASK_NAMES[: run.model_cfg.n_tasks],
    )
