"""Which run owns a checkpoint directory: one writer at a time, and the run whose checkpoints --resume takes.

* **One writer.** A run that saves holds an exclusive ``flock`` on ``<dir>/.lock`` from its start to its
  end (the operating system drops it when the process dies, so a killed run never leaves it held). A
  second run pointed at the same directory stops at once with a message instead of deleting the first
  one's half-written folders (``remove_leftovers``) and swapping its steps for its own.
* **One run's checkpoints.** A fresh run writes a new id into ``<dir>/run.json`` before its first
  checkpoint; a resumed run keeps the id there (without ``run.json``, checkpoints copied in or written
  before ids: any checkpoint, and the run takes the id of the one it resumes). Every checkpoint records the
  id of the run that wrote it, and --resume takes only checkpoints of the id in ``run.json`` (or of none).
  A fresh run started in a directory where an earlier run saved later steps therefore resumes from its own
  newest step, not the earlier run's; one killed before it saved never named itself, so --resume continues
  the earlier run. Where ``run.json`` names a run with no checkpoint there and only an earlier run's are
  left, --resume stops and says so instead of training from step 0 over them.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import uuid
from pathlib import Path

RUN_FILE = "run.json"
LOCK_FILE = ".lock"

_HELD: dict[Path, int] = {}
"""Open lock files by directory: the lock lives as long as its descriptor."""


class DirectoryInUse(OSError):
    """Another run holds the checkpoint directory's lock."""


def claim(checkpoint_dir: str | Path) -> str | None:
    """Lock the directory for this process; returns the run id ``run.json`` names (None: it has none)."""
    root = Path(checkpoint_dir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    if root not in _HELD:
        fd = os.open(root / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            import fcntl

            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except ImportError:  # no flock (Windows): one writer is the user's to ensure
            pass
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise DirectoryInUse(f"another run is writing checkpoints to {root} (it holds {LOCK_FILE}); "
                                     "wait for it to end or use another checkpoint directory") from None
            raise
        _HELD[root] = fd
    return run_id(root)


def new_run_id() -> str:
    return uuid.uuid4().hex


def name_run(checkpoint_dir: str | Path, run: str | None) -> str:
    """Write ``run`` (a new id when None) into ``run.json``, atomically; returns it."""
    run = run or new_run_id()
    root = Path(checkpoint_dir)
    if run_id(root) != run:
        tmp = root / f".{RUN_FILE}.tmp"
        try:
            tmp.write_text(json.dumps({"run": run}))
            os.replace(tmp, root / RUN_FILE)
        except OSError as error:  # a full disk: say which file, leave no partial copy behind
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            raise OSError(f"writing {root / RUN_FILE} (which run owns the checkpoints) failed: "
                          f"{error.strerror or error}; no checkpoint of this run was written") from error
    return run


def release(checkpoint_dir: str | Path | None) -> None:
    """Drop this process's lock on the directory (a no-op when it holds none)."""
    if checkpoint_dir is None:
        return
    fd = _HELD.pop(Path(checkpoint_dir).resolve(), None)
    if fd is not None:
        os.close(fd)


def run_id(checkpoint_dir: str | Path) -> str | None:
    """The id in ``run.json``, or None when the directory has none (or it cannot be read)."""
    try:
        value = json.loads((Path(checkpoint_dir) / RUN_FILE).read_text()).get("run")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None
