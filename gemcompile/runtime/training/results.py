"""The one writer of results JSON files: every benchmark (benchmarks/*.py, ``gemcompile bench e2e``) writes
through ``write_results`` / ``environment`` here, so every file says where and how it was measured.

The environment block (``payload["environment"]``) holds:

- ``gpu``, ``gpu_count``, ``capability``, ``sm_count``, ``gpu_memory_gib``, ``driver`` (None on a machine
  without a CUDA GPU; ``driver`` from ``nvidia-smi``, None when that is not available);
- ``torch``, ``triton``, ``cuda``, ``python``;
- ``git_commit`` and ``git_dirty`` (the environment variables ``GEMCOMPILE_GIT_COMMIT`` and
  ``GEMCOMPILE_GIT_DIRTY`` when set, else ``git`` in the source tree, else None) and ``source_digest``: a SHA-256 over the package's and the
  benchmarks' Python sources, which identifies the code that ran even without git;
- ``date_utc``, ``host``;
- ``argv`` (``sys.argv`` as a list) and ``command`` (the same, shell-quoted, with the interpreter);
- ``machine_shared``: ``"yes"``, ``"no"`` or ``"unknown"``. Nothing on a lent machine can see whether
  other work shares it, so the field is ``"unknown"`` unless the person running says so through
  ``GEMCOMPILE_MACHINE_SHARED=yes|no`` (its reason, if any, in ``GEMCOMPILE_MACHINE_NOTE``);
- ``load_average_1min`` where the platform has one;
- ``writer``: this module's name and ``WRITER_VERSION`` (the renderer tells files written here from
  older ones).

Files go to ``$OUT/<name>-<UTC stamp>.json`` when OUT is set (a GPU machine copies OUT back), else to the
given directory, else to ``benchmarks/results/``. A results file is never edited by hand afterwards: a
correction is a new run (or a new file written by a script, with its own command).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["WRITER", "WRITER_VERSION", "ENV_FIELDS", "environment", "results_path", "write_results",
           "rewrite_results", "machine_shared"]

WRITER = "gemcompile.runtime.training.results"
WRITER_VERSION = 1
REPO = Path(__file__).resolve().parents[3]
RESULTS_DIR = REPO / "benchmarks" / "results"

ENV_FIELDS = ("gpu", "driver", "torch", "triton", "cuda", "git_commit", "git_dirty", "source_digest", "date_utc",
              "host", "argv", "command", "machine_shared")
"""Fields every environment block written here has (a value may be None where it cannot be known)."""


def _run(cmd: list[str], cwd: Path | None = None) -> str | None:
    try:
        done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _git() -> tuple[str | None, bool | None]:
    if os.environ.get("GEMCOMPILE_GIT_COMMIT"):  # the person running knows better than a copied .git: the
        # GPU machine's copy of the tree carried a stale HEAD (65d3793 on 2026-12-01's runs, at 3f582a0)
        dirty = os.environ.get("GEMCOMPILE_GIT_DIRTY")
        return os.environ["GEMCOMPILE_GIT_COMMIT"], None if dirty is None else dirty.strip().lower() in ("1", "yes", "true")
    commit = _run(["git", "rev-parse", "HEAD"], REPO) if (REPO / ".git").exists() else None
    if commit:
        status = _run(["git", "status", "--porcelain", "--untracked-files=no"], REPO)
        return commit, None if status is None else bool(status)
    commit = os.environ.get("GEMCOMPILE_GIT_COMMIT") or None
    dirty = os.environ.get("GEMCOMPILE_GIT_DIRTY")
    return commit, None if dirty is None else dirty.strip().lower() in ("1", "yes", "true")


def source_digest(root: Path = REPO) -> str:
    """SHA-256 over gemcompile/**/*.py and benchmarks/*.py (path and bytes, sorted by path)."""
    h = hashlib.sha256()
    files = sorted([*(root / "gemcompile").rglob("*.py"), *(root / "benchmarks").glob("*.py")])
    for path in files:
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def machine_shared() -> str:
    value = os.environ.get("GEMCOMPILE_MACHINE_SHARED", "").strip().lower()
    if value in ("1", "yes", "true", "shared"):
        return "yes"
    if value in ("0", "no", "false", "alone"):
        return "no"
    return "unknown"


def _driver() -> str | None:
    out = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    return out.splitlines()[0].strip() if out else None


def environment(**extra: Any) -> dict[str, Any]:
    """The environment block of a results file (see the module docstring); ``extra`` is merged in."""
    import torch

    commit, dirty = _git()
    argv = list(sys.argv)
    env: dict[str, Any] = {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "argv": argv,
        "command": " ".join(shlex.quote(a) for a in [sys.executable, *argv]),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "host": platform.node(),
        "git_commit": commit,
        "git_dirty": dirty,
        "source_digest": source_digest(),
        "machine_shared": machine_shared(),
        "machine_note": os.environ.get("GEMCOMPILE_MACHINE_NOTE") or None,
        # the switches that change what runs (GEMCOMPILE_DIRECT_LAUNCH, ...), as the run had them
        "gemcompile_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("GEMCOMPILE_")},
        "writer": f"{WRITER} v{WRITER_VERSION}",
    }
    try:
        env["load_average_1min"] = os.getloadavg()[0]
    except (AttributeError, OSError):
        env["load_average_1min"] = None
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception as e:  # pragma: no cover - triton missing
        env["triton"] = f"unavailable: {type(e).__name__}"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        env.update(gpu=props.name, gpu_count=torch.cuda.device_count(), sm_count=props.multi_processor_count,
                   gpu_memory_gib=round(props.total_memory / 2**30, 1),
                   capability=".".join(map(str, torch.cuda.get_device_capability())), driver=_driver())
    else:
        env.update(gpu=None, driver=None)
    env.update(extra)
    return env


def results_path(name: str, out_dir: str | os.PathLike | None = None) -> Path:
    """$OUT wins over out_dir, which wins over benchmarks/results/; the name gets a UTC stamp."""
    base = Path(os.environ["OUT"]) if os.environ.get("OUT") else Path(out_dir) if out_dir else RESULTS_DIR
    base.mkdir(parents=True, exist_ok=True)
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    return base / f"{name}-{stamp}.json"


def rewrite_results(path: str | os.PathLike, payload: dict) -> Path:
    """(Re)write payload at path (atomically), with an environment block if it has none yet."""
    if not isinstance(payload.get("environment"), dict) or "writer" not in payload["environment"]:
        payload["environment"] = {**environment(), **(payload.get("environment") or {})}
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1, default=str) + "\n")
    os.replace(tmp, path)
    return path


def write_results(name: str, payload: dict, out_dir: str | os.PathLike | None = None) -> Path:
    """Write payload to a new stamped file (results_path) through the one writer; returns the path."""
    return rewrite_results(results_path(name, out_dir), payload)
