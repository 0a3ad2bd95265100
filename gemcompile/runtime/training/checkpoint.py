"""Checkpoint save / resume with torch.distributed.checkpoint (DCP).

One checkpoint = one DCP directory `<checkpoint_dir>/step_00000020/` holding
  - "model": the original (uncompiled) module's state, from get_state_dict,
  - "optim": every optimizer's state keyed by parameter FQN, from get_state_dict,
  - "meta":  one opaque bytes blob (torch.save) with the step, the RNG states and caller extras
             (e.g. loss history, metric window, a config fingerprint).
Works in a single process without a process group (DCP's no_dist mode) and, unchanged, under
torch.distributed. DCP writes `.metadata` last, so a directory without it is an interrupted save and
is ignored by latest_checkpoint().

What makes resume bit-exact: parameters, optimizer moments and step counters (the Adam bias
correction depends on the step), the CPU and CUDA RNG states (dropout, sampling), and the training
step (the synthetic data is a pure function of (seed, step), so nothing about the data needs saving).
"""

from __future__ import annotations

import contextlib
import io
import re
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

__all__ = [
    "CheckpointState",
    "checkpoint_path",
    "latest_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
    "unwrap_model",
]

_STEP_DIR = re.compile(r"^step_(\d+)$")


def unwrap_model(model: nn.Module) -> nn.Module:
    """The original module behind torch.compile / gem_compile wrappers (state is saved from it, so a
    checkpoint written by a compiled run loads into an eager run and vice versa)."""
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        inner = getattr(model, "_orig_mod", None)  # torch.compile's OptimizedModule
        if isinstance(inner, nn.Module):
            model = inner
            continue
        break
    return model


def _as_optimizer_list(optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer]) -> list:
    if isinstance(optimizers, torch.optim.Optimizer):
        return [optimizers]
    optimizers = list(optimizers)
    if not optimizers or not all(isinstance(o, torch.optim.Optimizer) for o in optimizers):
        raise TypeError("optimizers must be a torch.optim.Optimizer or a non-empty iterable of them")
    return optimizers


def _no_dist() -> bool:
    return not (dist.is_available() and dist.is_initialized())


@contextlib.contextmanager
def _single_process_quiet():
    """DCP warns that it 'assumes a single process' even when no_dist=True asks for exactly that."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled", category=UserWarning)
        yield


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        cuda_states = state["cuda"]
        if len(cuda_states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda_states)


def _to_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def checkpoint_path(checkpoint_dir: str | Path, step: int) -> Path:
    """Directory of the checkpoint taken after `step` training steps."""
    return Path(checkpoint_dir) / f"step_{step:08d}"


def latest_checkpoint(checkpoint_dir: str | Path) -> Path | None:
    """The complete checkpoint with the highest step under `checkpoint_dir`, or None."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return None
    complete = [
        (int(m.group(1)), p)
        for p in root.iterdir()
        if (m := _STEP_DIR.match(p.name)) and (p / ".metadata").is_file()
    ]
    return max(complete)[1] if complete else None


@dataclass
class CheckpointState:
    """What load_checkpoint() returns besides restoring model / optimizer / RNG in place."""

    step: int
    """Number of training steps completed when the checkpoint was written."""
    extra: dict[str, Any] = field(default_factory=dict)
    """The caller's extras passed to save_checkpoint()."""
    path: Path | None = None
    """The checkpoint directory that was loaded."""


def save_checkpoint(
    checkpoint_dir: str | Path,
    step: int,
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    extra: Mapping[str, Any] | None = None,
    *,
    flatten_optimizer: bool = False,
) -> Path:
    """Write the checkpoint of `step` completed steps; returns its directory.

    `model` may be compiled (torch.compile or gem_compile): the original module's state is saved.
    `extra` holds small Python objects (lists, dicts, numbers, strings, bytes, tensors) saved as-is.
    `flatten_optimizer` keys the optimizer state and hyperparameters by parameter name (needed when ranks
    hold different parameters, e.g. expert parallelism; load with the same flag).
    """
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    module = unwrap_model(model)
    options = StateDictOptions(flatten_optimizer_state_dict=flatten_optimizer)
    model_state, optim_state = get_state_dict(module, _as_optimizer_list(optimizers), options=options)
    meta = {"step": step, "rng": _rng_state(), "extra": dict(extra or {})}
    path = checkpoint_path(checkpoint_dir, step)
    path.mkdir(parents=True, exist_ok=True)
    with _single_process_quiet():
        dcp.save(
            {"model": model_state, "optim": optim_state, "meta": _to_bytes(meta)},
            checkpoint_id=str(path),
            no_dist=_no_dist(),
        )
    return path


def load_checkpoint(
    path: str | Path,
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    restore_rng: bool = True,
    *,
    flatten_optimizer: bool = False,
) -> CheckpointState:
    """Load a checkpoint directory into `model` and `optimizers` (in place) and restore the RNG state.

    The optimizers must be built the same way as when saving (same parameter groups).
    """
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"no complete DCP checkpoint at {path} (missing .metadata)")
    module = unwrap_model(model)
    optimizer_list = _as_optimizer_list(optimizers)
    # get_state_dict gives templates with the right FQNs, shapes and dtypes; DCP loads into them (and
    # reshards DTensors saved at another world size).
    options = StateDictOptions(flatten_optimizer_state_dict=flatten_optimizer)
    model_state, optim_state = get_state_dict(module, optimizer_list, options=options)
    state = {"model": model_state, "optim": optim_state, "meta": b""}
    with _single_process_quiet():
        dcp.load(state, checkpoint_id=str(path), no_dist=_no_dist())
    set_state_dict(module, optimizer_list, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=options)
    meta = torch.load(io.BytesIO(state["meta"]), weights_only=True)
    if restore_rng:
        _set_rng_state(meta["rng"])
    return CheckpointState(step=int(meta["step"]), extra=dict(meta["extra"]), path=path)
