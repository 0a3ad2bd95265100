"""The training loop: GEM-ref on synthetic data, eager / torch.compile / gem_compile.

    from gemcompile.runtime.training.train import TrainConfig, train
    result = train(TrainConfig(size="tiny", steps=50, compile="eager"))

One step: batch = SyntheticData(...).batch(step) -> validate_batch (outside the compiled region) ->
model(**batch.features()) (compiled or not; bf16 under autocast when asked) -> masked_bce_loss outside
the model -> backward -> Adam on dense parameters, Adagrad on embedding tables. Reported: per-step
loss, NE and AUC per task over a window of steps, steps/s and samples/s, useful and padded FLOPs per
step (runtime/flops.py) and MFU (None on the CPU). Checkpoints (runtime/checkpoint.py) resume
bit-exactly: the losses of a resumed run equal those of an uninterrupted one.

With ``parallel=ParallelConfig(enabled=True, ...)`` the same loop runs under torchrun, one process per
rank, with the 5D plan applied (runtime/parallel.py): every rank draws the same global batch and trains
on its slice; the logged loss and metrics are those of the global batch.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from gemcompile.runtime.training.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint, unwrap_model
from gemcompile.runtime.training.flops import GemFlopFormula, PaddedFlopCounter, mfu
from gemcompile.runtime.training.metrics import MetricWindow
from gemcompile.runtime.training.validate import validate_batch

__all__ = [
    "DEFAULT_BATCH_SIZE",
    "TrainConfig",
    "TrainResult",
    "WindowSummary",
    "add_train_arguments",
    "build_optimizers",
    "run_train_from_args",
    "train",
]

SIZES = ("tiny", "small", "medium", "large")
COMPILE_MODES = ("eager", "inductor", "gem")
DEVICES = ("cpu", "cuda")
DTYPES = ("float32", "bfloat16")
LENGTH_DISTS = ("uniform", "heavy_tail")
TASK_NAMES = ("CTR", "CVR")

DEFAULT_BATCH_SIZE = {"tiny": 64, "small": 256, "medium": 256, "large": 512}
"""Batch size per size preset when TrainConfig.batch_size is None."""

# Fields that change the training trajectory: a checkpoint written under other values is refused.
_TRAJECTORY_FIELDS = ("size", "batch_size", "lr", "embedding_lr", "dtype", "fill", "length_dist", "seed",
                      "mxfp8", "mxfp8_min_dim", "grad_clip")
MXFP8_RECIPES = ("blockwise", "mxfp8", "mxfp8_emulated")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


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
    the final step is always saved."""

    save_every: int | None = None
    """Also save a checkpoint every save_every steps (needs checkpoint_dir)."""

    resume: bool = False
    """Continue from the latest complete checkpoint in checkpoint_dir (from step 0 if there is none)."""

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

    grad_clip: float | None = None
    """Clip the global gradient norm to this value (over every mesh when parallel); None = no clipping."""

    parallel: Any = None
    """A gemcompile.config.ParallelConfig (or a dict of its fields) with enabled=True: train with the 5D
    plan under torchrun (gloo on the CPU, NCCL on GPUs); batch_size is then the global batch. None or
    enabled=False: one process."""

    def __post_init__(self) -> None:
        def check(ok: bool, name: str, expected: str) -> None:
            if not ok:
                raise ValueError(
                    f"TrainConfig.{name} = {getattr(self, name)!r} is invalid: expected {expected}"
                )

        check(self.size in SIZES, "size", f"one of {', '.join(SIZES)}")
        check(_is_int(self.steps) and self.steps >= 1, "steps", "an int >= 1")
        if self.batch_size is None:
            object.__setattr__(self, "batch_size", DEFAULT_BATCH_SIZE[self.size])
        check(_is_int(self.batch_size) and self.batch_size >= 1, "batch_size", "an int >= 1 (or None)")
        check(_is_number(self.lr) and math.isfinite(self.lr) and self.lr > 0, "lr", "a finite float > 0")
        check(
            _is_number(self.embedding_lr) and math.isfinite(self.embedding_lr) and self.embedding_lr > 0,
            "embedding_lr",
            "a finite float > 0",
        )
        check(self.compile in COMPILE_MODES, "compile", f"one of {', '.join(COMPILE_MODES)}")
        check(self.device in DEVICES, "device", f"one of {', '.join(DEVICES)}")
        check(self.dtype in DTYPES, "dtype", f"one of {', '.join(DTYPES)}")
        check(_is_number(self.fill) and 0.0 < self.fill <= 1.0, "fill", "a float in (0, 1]")
        check(self.length_dist in LENGTH_DISTS, "length_dist", f"one of {', '.join(LENGTH_DISTS)}")
        check(_is_int(self.seed) and self.seed >= 0, "seed", "an int >= 0")
        check(_is_int(self.log_every) and self.log_every >= 1, "log_every", "an int >= 1")
        check(
            self.checkpoint_dir is None
            or (isinstance(self.checkpoint_dir, str) and self.checkpoint_dir != ""),
            "checkpoint_dir",
            "None or a directory path",
        )
        check(
            self.save_every is None or (_is_int(self.save_every) and self.save_every >= 1),
            "save_every",
            "None or an int >= 1",
        )
        check(isinstance(self.resume, bool), "resume", "a bool")
        check(isinstance(self.deterministic, bool), "deterministic", "a bool")
        check(isinstance(self.explain, bool), "explain", "a bool")
        check(isinstance(self.quiet, bool), "quiet", "a bool")
        check(self.grad_clip is None or (_is_number(self.grad_clip) and math.isfinite(self.grad_clip)
                                         and self.grad_clip > 0), "grad_clip", "None or a finite float > 0")
        from gemcompile.config import ParallelConfig

        if isinstance(self.parallel, dict):
            object.__setattr__(self, "parallel", ParallelConfig(**self.parallel))
        check(self.parallel is None or isinstance(self.parallel, ParallelConfig), "parallel",
              "None, a ParallelConfig or a dict of its fields")
        check(self.mxfp8 is None or self.mxfp8 in MXFP8_RECIPES, "mxfp8",
              f"None or one of {', '.join(MXFP8_RECIPES)}")
        check(self.mxfp8_min_dim is None or (_is_int(self.mxfp8_min_dim) and self.mxfp8_min_dim >= 1),
              "mxfp8_min_dim", "None or an int >= 1")
        if self.mxfp8 is not None and self.compile != "gem":
            raise ValueError(f"TrainConfig.mxfp8 = {self.mxfp8!r} needs compile='gem' (got compile="
                             f"{self.compile!r}): the FP8 casts are a gem_compile pass")
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
        return {name: getattr(self, name) for name in _TRAJECTORY_FIELDS}


@dataclass(frozen=True)
class WindowSummary:
    """Loss and per-task metrics over one window of steps."""

    first_step: int
    """First step of the window (1-based)."""
    last_step: int
    """Last step of the window (1-based, inclusive)."""
    loss: float
    """Mean training loss over the window."""
    ne: tuple[float, ...]
    """Normalized entropy per task (NaN when undefined)."""
    auc: tuple[float, ...]
    """AUC per task (NaN when a class is absent)."""


@dataclass
class TrainResult:
    """What train() returns."""

    config: TrainConfig
    losses: list[float]
    """Loss of every step 1..steps, index i = step i + 1 (a resumed run includes the restored ones)."""
    ne: tuple[float, ...]
    """Final NE per task, over the last log_every steps."""
    auc: tuple[float, ...]
    """Final AUC per task, over the last log_every steps."""
    windows: list[WindowSummary]
    """Metrics of every window of log_every steps (the last one may be shorter)."""
    start_step: int
    """Steps already done when this run started (0, or the resumed checkpoint's step)."""
    steps_per_s: float
    """Training steps per second, excluding the first step of this run (compilation)."""
    samples_per_s: float
    """Training samples per second, excluding the first step of this run."""
    compile_time_s: float
    """Wall time of the first step of this run: includes torch.compile / gem_compile compilation (for
    eager, just one step)."""
    useful_flops_per_step: float
    """Mean training FLOPs per step on valid tokens only (section-8 formula, 3 x forward)."""
    padded_flops_per_step: float
    """Mean training FLOPs per step the padded model executes (FlopCounterMode, 3 x forward)."""
    mfu: float | None
    """Useful FLOP/s over the device's BF16 dense peak; None on the CPU and unknown GPUs."""
    checkpoints: list[str] = field(default_factory=list)
    """Checkpoint directories written by this run."""
    task_names: tuple[str, ...] = TASK_NAMES

    @property
    def first_window(self) -> WindowSummary | None:
        return self.windows[0] if self.windows else None

    @property
    def last_window(self) -> WindowSummary | None:
        return self.windows[-1] if self.windows else None

    @property
    def padding_efficiency(self) -> float:
        """Useful / padded FLOPs."""
        return (
            self.useful_flops_per_step / self.padded_flops_per_step
            if self.padded_flops_per_step
            else math.nan
        )


# ---------------------------------------------------------------------------------------------------
# Pieces of the loop
# ---------------------------------------------------------------------------------------------------


def build_optimizers(model: nn.Module, lr: float, embedding_lr: float) -> list[torch.optim.Optimizer]:
    """Adam for dense parameters, Adagrad for embedding tables (nn.Embedding / nn.EmbeddingBag weights).

    Adagrad on embeddings is the recsys default: a row that is not in the batch has a zero gradient
    and Adagrad leaves it exactly unchanged, where Adam's momentum would keep moving every row of the
    table. Both are deterministic and checkpoint their full state, so resume is bit-exact.
    """
    module = unwrap_model(model)
    embedding_ids = {
        id(p)
        for m in module.modules()
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag))
        for p in m.parameters()
    }
    embeddings = [p for p in module.parameters() if id(p) in embedding_ids]
    dense = [p for p in module.parameters() if id(p) not in embedding_ids]
    optimizers: list[torch.optim.Optimizer] = [torch.optim.Adam(dense, lr=lr, fused=_fused_adam(dense))]
    if embeddings:
        optimizers.append(torch.optim.Adagrad(embeddings, lr=embedding_lr))
    return optimizers


def _fused_adam(params: list) -> bool | None:
    """Adam's fused kernel (one kernel per chunk of parameters) when every parameter is a CUDA tensor, else
    torch's default. The default on CUDA is foreach: several multi-tensor kernels per update, over 200
    launches a step on GEM-ref small (H200 kernel profile, e2e-small-fill0.5-20261130-143200.json) that
    the host pays for at every step. Adagrad keeps foreach: torch 2.11 refuses its fused kernel on CUDA,
    and only at the first step."""
    return True if params and all(p.is_cuda for p in params) else None


def gem_config(cfg: TrainConfig) -> Any:
    """The GemConfig a compile="gem" run uses (the mxfp8 section from TrainConfig.mxfp8*)."""
    from gemcompile import GemConfig  # lazy: the runtime does not need the compiler otherwise

    if cfg.mxfp8 is None:
        return GemConfig()
    sizes = {} if cfg.mxfp8_min_dim is None else dict.fromkeys(("min_m", "min_k", "min_n"), cfg.mxfp8_min_dim)
    return GemConfig(mxfp8={"enabled": True, "recipe": cfg.mxfp8, **sizes})


def _compile(model: nn.Module, cfg: TrainConfig) -> Any:
    if cfg.compile == "eager":
        return model
    if cfg.compile == "inductor":
        return torch.compile(model)
    from gemcompile import gem_compile

    return gem_compile(model, config=gem_config(cfg))


def _autocast(cfg: TrainConfig) -> contextlib.AbstractContextManager:
    if cfg.dtype == "bfloat16":
        return torch.autocast(device_type=cfg.device, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _summarize_window(
    first_step: int, last_step: int, losses: list[float], window: MetricWindow
) -> WindowSummary:
    metrics = window.compute()
    return WindowSummary(
        first_step=first_step,
        last_step=last_step,
        loss=statistics.fmean(losses),
        ne=metrics.ne,
        auc=metrics.auc,
    )


def _fmt(value: float | None, spec: str = ".4f") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return format(value, spec)


def _fmt_flops(value: float) -> str:
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if value >= scale:
            return f"{value / scale:.3f} {unit}"
    return f"{value:.0f} FLOP"


class _Reporter:
    """rich progress bar on a terminal; plain log lines every log_every steps otherwise; silent if quiet."""

    def __init__(self, cfg: TrainConfig, start_step: int):
        from rich.console import Console

        self.cfg = cfg
        self.console = Console(quiet=cfg.quiet)
        self.progress = None
        if not cfg.quiet and self.console.is_terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.progress = Progress(
                TextColumn(f"[bold]train {cfg.size} ({cfg.compile})"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[steps_s]} steps/s"),
                TextColumn("{task.fields[samples_s]} samples/s"),
                TextColumn("loss {task.fields[loss]}"),
                TextColumn("NE {task.fields[ne]}"),
                TimeElapsedColumn(),
                console=self.console,
            )
            self.task = self.progress.add_task(
                "train", total=cfg.steps, completed=start_step, steps_s="-", samples_s="-", loss="-", ne="-"
            )

    def __enter__(self):
        if self.progress is not None:
            self.progress.start()
        return self

    def __exit__(self, *exc):
        if self.progress is not None:
            self.progress.stop()

    def print(self, *args, **kwargs) -> None:
        self.console.print(*args, **kwargs)

    def step(self, step: int, loss: float, ne: tuple[float, ...], steps_per_s: float | None) -> None:
        ne_text = "/".join(_fmt(v, ".3f") for v in ne)
        rate = "-" if steps_per_s is None else f"{steps_per_s:.2f}"
        samples = "-" if steps_per_s is None else f"{steps_per_s * self.cfg.batch_size:.0f}"
        if self.progress is not None:
            self.progress.update(
                self.task, completed=step, steps_s=rate, samples_s=samples, loss=f"{loss:.4f}", ne=ne_text
            )
        elif step % self.cfg.log_every == 0 or step == self.cfg.steps:
            self.console.print(
                f"step {step}/{self.cfg.steps}  loss {loss:.4f}  NE {ne_text}  "
                f"{rate} steps/s  {samples} samples/s",
                highlight=False,
            )

    def summary(self, result: TrainResult) -> None:
        if self.cfg.quiet:
            return
        from rich.table import Table

        table = Table(
            title=f"gemcompile train: {self.cfg.size}, {self.cfg.compile}, {self.cfg.device}, "
            f"{self.cfg.dtype}, batch {self.cfg.batch_size}",
            title_justify="left",
        )
        table.add_column("metric")
        table.add_column("first window", justify="right")
        table.add_column("last window", justify="right")
        first, last = result.first_window, result.last_window
        if first is not None and last is not None:
            table.add_row(
                "steps", f"{first.first_step}-{first.last_step}", f"{last.first_step}-{last.last_step}"
            )
            table.add_row("loss", _fmt(first.loss), _fmt(last.loss))
            for t, name in enumerate(result.task_names[: len(last.ne)]):
                table.add_row(f"NE {name}", _fmt(first.ne[t]), _fmt(last.ne[t]))
            for t, name in enumerate(result.task_names[: len(last.auc)]):
                table.add_row(f"AUC {name}", _fmt(first.auc[t]), _fmt(last.auc[t]))
        table.add_section()
        table.add_row("steps/s", "", _fmt(result.steps_per_s, ".2f"))
        table.add_row("samples/s", "", _fmt(result.samples_per_s, ".0f"))
        table.add_row("first step (compile) s", "", _fmt(result.compile_time_s, ".2f"))
        table.add_row("useful FLOPs / step", "", _fmt_flops(result.useful_flops_per_step))
        table.add_row("padded FLOPs / step", "", _fmt_flops(result.padded_flops_per_step))
        table.add_row("useful / padded", "", _fmt(result.padding_efficiency, ".3f"))
        table.add_row(
            "MFU (bf16 dense peak)",
            "",
            "n/a (no peak for this device)" if result.mfu is None else f"{100 * result.mfu:.2f}%",
        )
        self.console.print(table)


# ---------------------------------------------------------------------------------------------------
# train()
# ---------------------------------------------------------------------------------------------------


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
    with _deterministic(cfg.deterministic, cfg.device):
        return _train(cfg)


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
    from gemcompile.models.data import SyntheticData
    from gemcompile.models.gem import GemRef, gem_ref_config, masked_bce_loss

    model_cfg = gem_ref_config(cfg.size)
    data = SyntheticData(
        model_cfg.data_config(cfg.batch_size, fill=cfg.fill, length_dist=cfg.length_dist, seed=cfg.seed)
    )
    runtime = None
    if cfg.parallel is not None and cfg.parallel.enabled:
        from gemcompile.runtime.distributed.apply import ParallelTraining

        runtime = ParallelTraining.start(cfg)  # joins the process group; quiet on ranks other than 0
        cfg = runtime.cfg
    device = torch.device(cfg.device) if runtime is None else runtime.device
    torch.manual_seed(cfg.seed)
    model = GemRef(model_cfg).to(device)
    formula = GemFlopFormula.from_model(model)
    padded_counter = PaddedFlopCounter(model)
    if runtime is None:
        optimizers = build_optimizers(model, cfg.lr, cfg.embedding_lr)
    else:  # the plan is checked against the model before any collective; then the model is sharded
        padded_counter = runtime.apply(model)  # FLOPs counted on a meta-device copy
        optimizers = runtime.build_optimizers(cfg.lr, cfg.embedding_lr)
    n_tasks = model_cfg.n_tasks
    window = MetricWindow(n_tasks, window=cfg.log_every)

    losses: list[float] = []
    windows: list[WindowSummary] = []
    start_step = 0
    reporter = _Reporter(cfg, 0)
    if cfg.resume:
        path = latest_checkpoint(cfg.checkpoint_dir)
        if path is None:
            reporter.print(f"no checkpoint in {cfg.checkpoint_dir}: starting from step 0")
        else:
            state = load_checkpoint(path, model, optimizers, flatten_optimizer=runtime is not None)
            saved = state.extra.get("config", {})
            mismatched = {
                k: (saved.get(k), v) for k, v in cfg.trajectory_fingerprint().items() if saved.get(k) != v
            }
            if mismatched:
                detail = ", ".join(f"{k}: checkpoint {a!r} vs now {b!r}" for k, (a, b) in mismatched.items())
                raise ValueError(f"cannot resume from {path}: it was written with other settings ({detail})")
            start_step = state.step
            losses = list(state.extra["losses"])
            windows = [WindowSummary(**w) for w in state.extra["windows"]]
            window.load_bytes(state.extra["metric_window"])
            reporter.print(f"resumed from {path} at step {start_step}")
            if start_step >= cfg.steps:
                reporter.print(
                    f"the checkpoint is at step {start_step} >= steps = {cfg.steps}: nothing to train"
                )
    reporter = _Reporter(cfg, start_step)

    runner = _compile(model, cfg) if runtime is None else runtime.compile(gem_config(cfg))
    if cfg.explain and start_step < cfg.steps:
        from gemcompile import explain

        example = data.batch(start_step).to(device)
        validate_batch(example, model_cfg)
        reporter.print(explain(model, **example.features(), config=gem_config(cfg)))

    checkpoints: list[str] = []

    def save(step: int) -> None:
        extra = {
            "config": cfg.trajectory_fingerprint(),
            "losses": list(losses),
            "windows": [dataclasses.asdict(w) for w in windows],
            "metric_window": window.to_bytes(),
        }
        checkpoints.append(str(save_checkpoint(cfg.checkpoint_dir, step, model, optimizers, extra,
                                               flatten_optimizer=runtime is not None)))

    useful_total = padded_total = 0.0
    step_times: list[float] = []
    compile_time = math.nan
    # Losses of the current, unfinished window (non-empty only when resuming mid-window).
    window_losses = losses[len(losses) - len(losses) % cfg.log_every :]
    model.train()
    with reporter:
        for step in range(start_step, cfg.steps):
            start = time.perf_counter()
            cpu_batch = data.batch(step)
            batch = cpu_batch.to(device)
            validate_batch(batch, model_cfg)
            step_batch = batch if runtime is None else runtime.local_batch(batch)  # this rank's samples
            with _autocast(cfg):
                logits = runner(**step_batch.features())
            if runtime is None:
                loss = masked_bce_loss(logits.float(), batch.labels, batch.label_mask)
            else:  # world size x this rank's share of the global batch's loss
                loss = runtime.loss(logits.float(), step_batch.labels, step_batch.label_mask)
            for optimizer in optimizers:
                optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if runtime is not None:
                runtime.finish_gradients(cfg.grad_clip)
            elif cfg.grad_clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            for optimizer in optimizers:
                optimizer.step()
            # the step's one device sync besides validation
            loss_value = loss.item() if runtime is None else runtime.global_loss(loss)
            elapsed = time.perf_counter() - start
            if step == start_step:
                compile_time = elapsed
            else:
                step_times.append(elapsed)

            # Bookkeeping outside the timed region.
            if not math.isfinite(loss_value):
                raise ValueError(f"training diverged: the loss of step {step + 1} is {loss_value}")
            losses.append(loss_value)
            window_losses.append(loss_value)
            if runtime is not None:  # the global batch's logits, in sample order
                logits = runtime.gather_logits(logits)
            window.update(logits.detach().float(), batch.labels, batch.label_mask)
            useful_total += formula.train_flops(cpu_batch.seq_lengths, cfg.batch_size)
            # The measuring forward must not shift the RNG streams (bit-exact resume).
            with torch.random.fork_rng(
                devices=[torch.cuda.current_device()] if device.type == "cuda" else []
            ):
                padded_total += padded_counter.train_flops(batch.features())
            done = step + 1
            metrics = window.compute()
            if done % cfg.log_every == 0 or done == cfg.steps:
                windows.append(_summarize_window(done - len(window_losses) + 1, done, window_losses, window))
                window_losses = []
            rate = (len(step_times) / sum(step_times)) if step_times else None
            reporter.step(done, loss_value, metrics.ne, rate)
            if cfg.checkpoint_dir is not None and (
                done == cfg.steps or (cfg.save_every is not None and done % cfg.save_every == 0)
            ):
                save(done)

    steps_run = max(0, cfg.steps - start_step)
    if step_times:
        steps_per_s = len(step_times) / sum(step_times)
    elif steps_run > 0:
        steps_per_s = 1.0 / compile_time
    else:
        steps_per_s = math.nan
    useful = useful_total / steps_run if steps_run else math.nan
    padded = padded_total / steps_run if steps_run else math.nan
    final = window.compute()
    result = TrainResult(
        config=cfg,
        losses=losses,
        ne=final.ne,
        auc=final.auc,
        windows=windows,
        start_step=start_step,
        steps_per_s=steps_per_s,
        samples_per_s=steps_per_s * cfg.batch_size,
        compile_time_s=compile_time,
        useful_flops_per_step=useful,
        padded_flops_per_step=padded,
        mfu=mfu(useful * steps_per_s / (1 if runtime is None else runtime.world), device) if steps_run else None,
        checkpoints=checkpoints,
        task_names=TASK_NAMES[:n_tasks],
    )
    reporter.summary(result)
    return result


# ---------------------------------------------------------------------------------------------------
# Command line: `gemcompile train ...` (cli.py wires the subcommand to these two functions)
# ---------------------------------------------------------------------------------------------------


def add_train_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the `gemcompile train` flags to `parser` (defaults are TrainConfig's)."""
    defaults = TrainConfig()
    parser.add_argument("--size", choices=SIZES, default=defaults.size, help="model and data preset")
    parser.add_argument("--steps", type=int, default=defaults.steps, help="training steps")
    parser.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="samples per step (default per size: "
        + ", ".join(f"{k} {v}" for k, v in DEFAULT_BATCH_SIZE.items())
        + ")",
    )
    parser.add_argument("--lr", type=float, default=defaults.lr, help="Adam learning rate (dense parameters)")
    parser.add_argument(
        "--embedding-lr",
        type=float,
        default=defaults.embedding_lr,
        help="Adagrad learning rate (embedding tables)",
    )
    parser.add_argument(
        "--compile", choices=COMPILE_MODES, default=defaults.compile, help="how the model runs"
    )
    parser.add_argument("--device", choices=DEVICES, default=defaults.device)
    parser.add_argument(
        "--dtype", choices=DTYPES, default=defaults.dtype, help="bfloat16 = forward under torch.autocast"
    )
    parser.add_argument(
        "--fill", type=float, default=defaults.fill, help="mean length / padded length, in (0, 1]"
    )
    parser.add_argument("--length-dist", choices=LENGTH_DISTS, default=defaults.length_dist)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--log-every", type=int, default=defaults.log_every, help="steps per metrics window")
    parser.add_argument("--checkpoint-dir", default=None, help="directory of DCP checkpoints")
    parser.add_argument("--save-every", type=int, default=None, help="save a checkpoint every N steps")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    parser.add_argument(
        "--deterministic",
        action="store_true",
        help="torch.use_deterministic_algorithms (bit-exact resume under torch.compile)",
    )
    parser.add_argument(
        "--explain",
        action="store_true",
        help="print what gemcompile's passes rewrite before training (--compile gem)",
    )
    parser.add_argument("--quiet", action="store_true", help="print nothing")
    parser.add_argument("--mxfp8", choices=MXFP8_RECIPES, default=None, metavar="RECIPE",
                        help="block-scaled FP8 GEMMs with this recipe (" + ", ".join(MXFP8_RECIPES)
                        + "; --compile gem)")
    parser.add_argument("--mxfp8-min-dim", type=int, default=None, metavar="N",
                        help="with --mxfp8: quantize layers whose tokens, in and out features are all >= N "
                        "(default: the pass's 16384 tokens / 2048 features)")
    parser.add_argument("--grad-clip", type=float, default=None, metavar="NORM",
                        help="clip the global gradient norm (all meshes when --parallel)")
    from gemcompile.runtime.distributed.apply import add_parallel_arguments

    add_parallel_arguments(parser)
    return parser


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """TrainConfig from parsed `gemcompile train` flags (ValueError on a bad value)."""
    from gemcompile.runtime.distributed.apply import parallel_config_from_args

    return TrainConfig(
        size=args.size,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        embedding_lr=args.embedding_lr,
        compile=args.compile,
        device=args.device,
        dtype=args.dtype,
        fill=args.fill,
        length_dist=args.length_dist,
        seed=args.seed,
        log_every=args.log_every,
        checkpoint_dir=args.checkpoint_dir,
        save_every=args.save_every,
        resume=args.resume,
        deterministic=args.deterministic,
        explain=args.explain,
        quiet=args.quiet,
        mxfp8=args.mxfp8,
        mxfp8_min_dim=args.mxfp8_min_dim,
        grad_clip=getattr(args, "grad_clip", None),
        parallel=parallel_config_from_args(args),
    )


def run_train_from_args(args: argparse.Namespace) -> int:
    """Run `gemcompile train`; returns the exit status. A bad flag value or input is one error line on
    stderr (exit 2), never a traceback."""
    try:
        cfg = config_from_args(args)
    except ValueError as e:
        print(f"gemcompile train: error: {e}", file=sys.stderr)
        return 2
    try:
        train(cfg)
    except ValueError as e:
        print(f"gemcompile train: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("gemcompile train: interrupted", file=sys.stderr)
        return 130
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m gemcompile.runtime.training.train ...` (the same flags as `gemcompile train`)."""
    parser = add_train_arguments(
        argparse.ArgumentParser(prog="gemcompile train", description=__doc__.splitlines()[0])
    )
    return run_train_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
