"""Per-task training metrics: normalized entropy (NE) and exact AUC, plus a window accumulator.

Conventions (both computed in float64 on the CPU, over the valid labels of one task only):

- NE = mean BCE(sigmoid(logit), y) / H(p), with p the base rate (mean label) of the same valid labels
  and H(p) = -p log p - (1 - p) log(1 - p). NE < 1 means the model beats always predicting the base
  rate. NE is NaN when it is undefined: no valid label, or every valid label is the same (H(p) = 0).
- AUC = Mann-Whitney U / (n_pos * n_neg), ranks averaged over tied scores (so a tie between a
  positive and a negative counts 1/2). AUC is NaN when one class is absent from the window.

NaN (not None) is used for "undefined" so that every metric is a float and can be printed, averaged
with nan-aware functions, or compared with math.isnan.
"""

from __future__ import annotations

import io
import math
from collections import deque
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["MetricWindow", "WindowMetrics", "auc", "normalized_entropy"]


def _valid_pairs(
    scores: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    if scores.shape != labels.shape:
        raise ValueError(
            f"scores and labels must have the same shape, got {tuple(scores.shape)} and {tuple(labels.shape)}"
        )
    if mask is not None and mask.shape != labels.shape:
        raise ValueError(f"mask must have the labels' shape {tuple(labels.shape)}, got {tuple(mask.shape)}")
    scores = scores.detach().reshape(-1).to("cpu", torch.float64)
    labels = labels.detach().reshape(-1).to("cpu", torch.float64)
    if mask is not None:
        keep = mask.detach().reshape(-1).to("cpu", torch.bool)
        scores, labels = scores[keep], labels[keep]
    return scores, labels


def _binary_entropy(p: float) -> float:
    if p <= 0.0 or p >= 1.0:
        return 0.0
    return -(p * math.log(p) + (1.0 - p) * math.log(1.0 - p))


def normalized_entropy(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """NE of one task: mean BCE over valid labels / entropy of their base rate; NaN when undefined.

    logits, labels (0/1 floats) and the optional boolean mask share one shape (any shape, flattened).
    """
    logits, labels = _valid_pairs(logits, labels, mask)
    if labels.numel() == 0:
        return math.nan
    base_entropy = _binary_entropy(float(labels.mean()))
    if base_entropy == 0.0:
        return math.nan
    bce = F.binary_cross_entropy_with_logits(logits, labels, reduction="mean")
    return float(bce) / base_entropy


def auc(scores: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """Exact ROC AUC (Mann-Whitney, ties count 1/2) of one task; NaN when a class is absent.

    scores may be logits or probabilities (only their order matters); labels are 0/1 (> 0.5 = positive).
    """
    scores, labels = _valid_pairs(scores, labels, mask)
    positive = labels > 0.5
    n_pos = int(positive.sum())
    n_neg = labels.numel() - n_pos
    if n_pos == 0 or n_neg == 0:
        return math.nan
    sorted_scores, order = torch.sort(scores)
    _, counts = torch.unique_consecutive(sorted_scores, return_counts=True)
    # 1-based rank of a tie group = first position + (group size + 1) / 2 (the group's mean rank).
    group_start = torch.cumsum(counts, 0) - counts
    group_rank = group_start.to(torch.float64) + (counts.to(torch.float64) + 1.0) / 2.0
    ranks = torch.repeat_interleave(group_rank, counts)
    rank_sum_pos = float(ranks[positive[order]].sum())
    u_statistic = rank_sum_pos - n_pos * (n_pos + 1) / 2.0
    return u_statistic / (n_pos * n_neg)


@dataclass(frozen=True)
class WindowMetrics:
    """Metrics of one window of steps, one entry per task."""

    ne: tuple[float, ...]
    """Normalized entropy per task (NaN when undefined, see the module docstring)."""
    auc: tuple[float, ...]
    """AUC per task (NaN when the window has only one class for that task)."""
    n_labels: tuple[int, ...]
    """Number of valid labels per task in the window."""
    n_positive: tuple[int, ...]
    """Number of positive valid labels per task in the window."""


class MetricWindow:
    """Keeps the logits, labels and label masks of the last `window` steps (None = every step).

    update() copies detached tensors to the CPU (one small device-to-host copy per step); compute()
    returns NE and AUC per task over everything in the window.
    """

    def __init__(self, n_tasks: int, window: int | None = None):
        if not isinstance(n_tasks, int) or n_tasks < 1:
            raise ValueError(f"n_tasks must be an int >= 1, got {n_tasks!r}")
        if window is not None and (not isinstance(window, int) or window < 1):
            raise ValueError(f"window must be None or an int >= 1, got {window!r}")
        self.n_tasks = n_tasks
        self.window = window
        self._steps: deque[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = deque(maxlen=window)

    def __len__(self) -> int:
        return len(self._steps)

    def reset(self) -> None:
        self._steps.clear()

    def update(self, logits: torch.Tensor, labels: torch.Tensor, label_mask: torch.Tensor) -> None:
        """Add one step: logits, labels and label_mask of shape (B, n_tasks)."""
        for name, t in (("logits", logits), ("labels", labels), ("label_mask", label_mask)):
            if t.dim() != 2 or t.shape[1] != self.n_tasks:
                raise ValueError(f"{name} must be (B, {self.n_tasks}), got {tuple(t.shape)}")
        self._steps.append(
            (
                logits.detach().to("cpu", torch.float64),
                labels.detach().to("cpu", torch.float64),
                label_mask.detach().to("cpu", torch.bool),
            )
        )

    def compute(self) -> WindowMetrics:
        if not self._steps:
            nan = tuple(math.nan for _ in range(self.n_tasks))
            zero = tuple(0 for _ in range(self.n_tasks))
            return WindowMetrics(ne=nan, auc=nan, n_labels=zero, n_positive=zero)
        logits = torch.cat([s[0] for s in self._steps])
        labels = torch.cat([s[1] for s in self._steps])
        mask = torch.cat([s[2] for s in self._steps])
        ne, area, n_labels, n_pos = [], [], [], []
        for task in range(self.n_tasks):
            ne.append(normalized_entropy(logits[:, task], labels[:, task], mask[:, task]))
            area.append(auc(logits[:, task], labels[:, task], mask[:, task]))
            n_labels.append(int(mask[:, task].sum()))
            n_pos.append(int(((labels[:, task] > 0.5) & mask[:, task]).sum()))
        return WindowMetrics(ne=tuple(ne), auc=tuple(area), n_labels=tuple(n_labels), n_positive=tuple(n_pos))

    # Checkpointing: the window is stored as one opaque bytes blob so a resumed run reports the same
    # metrics as an uninterrupted one.
    def to_bytes(self) -> bytes:
        buffer = io.BytesIO()
        torch.save({"n_tasks": self.n_tasks, "window": self.window, "steps": list(self._steps)}, buffer)
        return buffer.getvalue()

    def load_bytes(self, blob: bytes) -> None:
        state = torch.load(io.BytesIO(blob), weights_only=True)
        if state["n_tasks"] != self.n_tasks:
            raise ValueError(
                f"checkpointed metric window has {state['n_tasks']} tasks, expected {self.n_tasks}"
            )
        self._steps = deque((tuple(s) for s in state["steps"]), maxlen=self.window)
