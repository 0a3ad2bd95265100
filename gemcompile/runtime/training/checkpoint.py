"""Checkpoint save / resume with torch.distributed.checkpoint (DCP).

One checkpoint = one DCP directory `<checkpoint_dir>/step_00000020/` holding
  - "model": the original (uncompiled) module's state, from get_state_dict,
  - "optim": every optimizer's state keyed by parameter FQN, from get_state_dict,
  - "meta":  one opaque bytes blob (torch.save) with the step, the RNG states and caller extras
             (e.g. loss history, metric window, a config fingerprint).
Works in a single process without a process group (DCP's no_dist mode) and, unchanged, under
torch.distributed.

On disk (checkpoint_files.py): DCP writes into a hidden `.step_00000020.partial/`; rank 0 then seals it
with `manifest.json` (each file's size and sha256) and renames it into place, swapping atomically with
a folder of the same step if there is one. choose_checkpoint() takes the newest folder that verifies
against its manifest and whose state can be read, and says in one line per folder what is wrong with
each newer one; its step, RNG states and extras are read before any model is built, so a resume can be
refused (other settings) before anything is loaded.

What makes resume bit-exact: parameters, optimizer moments and step counters (the Adam bias
correction depends on the step), the CPU and CUDA RNG states (dropout, sampling), and the training
step (the synthetic data is a pure function of (seed, step), so nothing about the data needs saving).
"""

from __future__ import annotations

import contextlib
import errno
import io
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from gemcompile.runtime.training.checkpoint_files import (
    CheckpointError,
    commit_folder,
    kill_point,
    partial_path,
    remove_leftovers,
    step_folders,
    verify_files,
    write_manifest,
)

__all__ = [
    "CheckpointChoice",
    "CheckpointError",
    "CheckpointState",
    "checkpoint_path",
    "choose_checkpoint",
    "latest_checkpoint",
    "load_checkpoint",
    "on_rank0",
    "read_checkpoint_meta",
    "save_checkpoint",
    "unwrap_model",
    "verify_checkpoint",
]


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


FAILURES = (Exception, CheckpointException)
"""What a checkpoint read or write can raise: DCP reports any rank's failure (a full disk, an unreadable
file, Ctrl-C inside its write) as CheckpointException, which derives from BaseException, not Exception."""


def failure_cause(error: BaseException) -> BaseException:
    """The first rank's own exception inside a CheckpointException (the error itself otherwise)."""
    if isinstance(error, CheckpointException) and error.failures:
        cause = next(iter(error.failures.values()))
        return cause[0] if isinstance(cause, tuple) else cause
    return error


def on_rank0(fn):
    """fn() run by rank 0 alone, its result handed to every rank (in one process: just fn()). Every
    rank waits for it; when it raises, every rank raises the same CheckpointError."""
    if _no_dist():
        return fn()
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", fn())
        except FAILURES as e:
            e = failure_cause(e)
            # (the line one process prints: report_error names the type of unexpected errors only)
            said = isinstance(e, (CheckpointError, ValueError, TypeError, OSError))
            box[0] = ("error", str(e) if said else f"{type(e).__name__}: {e}")
    dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "error":
        error = CheckpointError(value)
        error.same_on_every_rank = True
        raise error
    return value


def read_checkpoint_meta(path: str | Path) -> dict[str, Any]:
    """The step, RNG states and extras of a checkpoint, without loading any model or optimizer state
    (reads locally, no collective)."""
    state = {"meta": b""}
    with _single_process_quiet():
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
    meta = torch.load(io.BytesIO(state["meta"]), weights_only=True)
    if not (isinstance(meta, dict) and isinstance(meta.get("step"), int)
            and isinstance(meta.get("extra"), dict) and "rng" in meta):
        raise ValueError("its meta record has no step, RNG state or extras")
    return meta


def verify_checkpoint(path: str | Path) -> str | None:
    """None when the checkpoint at `path` verifies (its files match its manifest and its state can be
    read), else what is wrong, in one line that names the file."""
    return _verify(Path(path))[0]


def _verify(path: Path) -> tuple[str | None, dict[str, Any] | None]:
    problem = verify_files(path)
    if problem is not None:
        return problem, None
    try:
        return None, read_checkpoint_meta(path)
    except FAILURES as e:
        e = failure_cause(e)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        return f"its state cannot be read ({type(e).__name__}: {first})", None


@dataclass
class CheckpointChoice:
    """What choose_checkpoint() found under a checkpoint directory."""

    path: Path | None = None
    """The newest checkpoint that verifies, or None."""
    meta: dict[str, Any] | None = None
    """Its step, RNG states and extras ("step", "rng", "extra"), read without loading the model."""
    skipped: list[str] = field(default_factory=list)
    """One line per newer checkpoint that did not verify: "<folder>: <file> <what is wrong>"."""
    other_runs: list[str] = field(default_factory=list)
    """The newer checkpoints that verify but were written by another run than the one asked for."""


def choose_checkpoint(checkpoint_dir: str | Path, run: str | None = None) -> CheckpointChoice:
    """The newest `step_*` checkpoint under `checkpoint_dir` that verifies (and, given `run`, was written
    by that run or records no run: checkpoint_owner.py); each newer one that does not verify is listed in
    `skipped`, each of another run in `other_runs`. Reads files only (call it on one rank and share the
    answer: on_rank0)."""
    choice = CheckpointChoice()
    for _, path in step_folders(checkpoint_dir):
        problem, meta = _verify(path)
        if problem is not None:
            choice.skipped.append(f"{path}: {problem}")
            continue
        if run is not None and meta["extra"].get("run") not in (None, run):
            choice.other_runs.append(str(path))
            continue
        choice.path, choice.meta = path, meta
        break
    return choice


def latest_checkpoint(checkpoint_dir: str | Path) -> Path | None:
    """The newest checkpoint under `checkpoint_dir` that verifies, or None."""
    return choose_checkpoint(checkpoint_dir).path


class _KillPointWriter(FileSystemWriter):
    """DCP's file writer with the test hook between the data files and `.metadata`."""

    def __init__(self, path: Path, step: int) -> None:
        super().__init__(str(path))
        self._step = step

    def finish(self, metadata, results) -> None:
        kill_point(f"save:{self._step}:metadata")
        super().finish(metadata, results)


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
    hold different parameters, e.g. expert parallelism, and to resume across runs whose optimizers group
    the parameters differently; load_checkpoint reads which layout a checkpoint has).
    Written atomically: into a hidden folder sealed by a manifest, then renamed into place; the folder of
    a step that already exists is swapped whole, never rewritten in place.
    """
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    module = unwrap_model(model)
    options = StateDictOptions(flatten_optimizer_state_dict=flatten_optimizer)
    model_state, optim_state = get_state_dict(module, _as_optimizer_list(optimizers), options=options)
    meta = {"step": step, "rng": _rng_state(), "extra": dict(extra or {})}
    path = checkpoint_path(checkpoint_dir, step)
    partial = partial_path(path)
    world = 1 if _no_dist() else dist.get_world_size()

    def prepare() -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_leftovers(path.parent)
        partial.mkdir()

    def seal() -> None:
        kill_point(f"save:{step}:manifest")
        write_manifest(partial, step, world)
        kill_point(f"save:{step}:rename")
        commit_folder(partial, path, step)

    try:
        on_rank0(prepare)
        kill_point(f"save:{step}:begin")
        with _single_process_quiet():
            dcp.save(
                {"model": model_state, "optim": optim_state, "meta": _to_bytes(meta)},
                storage_writer=_KillPointWriter(partial, step),
                no_dist=_no_dist(),
            )
        on_rank0(seal)  # every rank waits until the checkpoint is in place
    except (OSError, RuntimeError, CheckpointException) as e:  # a full disk said only "[Errno 28] No space
        # left on device" (DCP wraps it in CheckpointException) or torch.save's "unexpected pos": say what and where
        cause = failure_cause(e)
        if type(cause) in (OSError, PermissionError, FileNotFoundError):
            reason, code = cause.strerror or str(cause), cause.errno
        elif isinstance(cause, RuntimeError) and "inline_container" in str(cause):
            first = (str(cause).strip().splitlines() or [""])[0]
            reason, code = f"a file was not written whole, a full disk? ({first})", errno.EIO
        else:  # others say what they are
            raise
        error = OSError(code, f"writing the checkpoint of step {step} into {path.parent} failed: {reason} "
                              "(the checkpoints before it are intact)")
        # DCP gathers every rank's failures into one exception that each rank raises, and on_rank0 hands its
        # error to every rank: the same line everywhere, said once under torchrun
        error.same_on_every_rank = isinstance(e, CheckpointException) or getattr(e, "same_on_every_rank", False)
        raise error from e
    kill_point(f"save:{step}:done")
    return path


def saved_flat_optimizer(path: str | Path) -> bool:
    """Whether the checkpoint keys its optimizer's hyperparameters by parameter name (saved with
    flatten_optimizer) rather than by group index, whose groups list their parameters ("...0.params")."""
    try:
        keys = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except FAILURES as e:
        e = failure_cause(e)
        raise CheckpointError(f"cannot read {Path(path) / '.metadata'}: {type(e).__name__}: {e}") from e
    groups = [k for k in keys if k.startswith("optim.param_groups.")]
    return bool(groups) and not any(k.endswith(".params") for k in groups)


def load_checkpoint(
    path: str | Path,
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    restore_rng: bool = True,
    *,
    flatten_optimizer: bool | None = None,
) -> CheckpointState:
    """Load a checkpoint directory into `model` and `optimizers` (in place) and restore the RNG state.

    The optimizers must be built the same way as when saving (same parameter groups). The files are not
    verified here (choose_checkpoint does that); a load that fails raises a one-line CheckpointError.
    `flatten_optimizer` None: the optimizer layout the checkpoint was saved with (a --parallel run saves
    it flattened, one process by group index), so either kind of run resumes the other's checkpoints.
    """
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"no complete DCP checkpoint at {path} (missing .metadata)")
    if flatten_optimizer is None:
        flatten_optimizer = saved_flat_optimizer(path)
    module = unwrap_model(model)
    optimizer_list = _as_optimizer_list(optimizers)
    # get_state_dict gives templates with the right FQNs, shapes and dtypes; DCP loads into them (and
    # reshards DTensors saved at another world size).
    options = StateDictOptions(flatten_optimizer_state_dict=flatten_optimizer)
    model_state, optim_state = get_state_dict(module, optimizer_list, options=options)
    state = {"model": model_state, "optim": optim_state, "meta": b""}
    try:
        with _single_process_quiet():
            dcp.load(state, checkpoint_id=str(path), no_dist=_no_dist())
    except FAILURES as e:
        e = failure_cause(e)
        first = (str(e).strip().splitlines() or [""])[0]
        raise CheckpointError(f"cannot load {path}: {type(e).__name__}: {first}") from e
    set_state_dict(module, optimizer_list, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=options)
    meta = torch.load(io.BytesIO(state["meta"]), weights_only=True)
    if restore_rng:
        _set_rng_state(meta["rng"])
    return CheckpointState(step=int(meta["step"]), extra=dict(meta["extra"]), path=path)
