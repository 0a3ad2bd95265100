"""What a training run reports: TrainResult (with a WindowSummary per window of log_every steps), and
TrainReporter, which prints it: a rich progress bar on a terminal, plain log lines otherwise, a summary
table at the end, nothing when quiet."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from gemcompile.runtime.training.config import TrainConfig
from gemcompile.runtime.training.metrics import MetricWindow

__all__ = ["TASK_NAMES", "TrainReporter", "TrainResult", "WindowSummary", "summarize_window"]

TASK_NAMES = ("CTR", "CVR")


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


def summarize_window(first_step: int, last_step: int, losses: list[float],
                     window: MetricWindow) -> WindowSummary:
    """The window that ends now: its mean loss and the metric window's NE and AUC."""
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


def _fmt_flops(value: float | None) -> str:
    if value is None or math.isnan(value):  # (a resumed run with no step left measured none)
        return "n/a"
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if value >= scale:
            return f"{value / scale:.3f} {unit}"
    return f"{value:.0f} FLOP"


class TrainReporter:
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
