"""A checkpoint folder on disk: written atomically, sealed by a manifest, verified before it is trusted.

A checkpoint `<dir>/step_00000020/` is written as `<dir>/.step_00000020.partial/` (DCP's files, then
`manifest.json` last: each file's size and sha256), fsynced, and only then renamed into place. A
folder that already holds that step (a fresh run pointed at an old run's directory) is swapped with
the new one in one atomic rename (Linux renameat2 RENAME_EXCHANGE; elsewhere two renames, between
which the step is absent and resume takes the one before), never rewritten in place. A kill at any
moment therefore leaves every `step_*` folder either complete or untouched; what a kill leaves behind
(`.step_*.partial`, `.step_*.old`) is hidden from resume and removed by the next save.

verify_checkpoint() checks a folder against its manifest (missing, truncated, resized or corrupted
files) and reads its DCP metadata; it answers in one line what is wrong. Folders written before
manifests existed (`.metadata` but no `manifest.json`) are checked structurally: the DCP metadata
must unpickle, every data file must be long enough for the byte ranges it lists, and every tensor item
(a torch.save archive) must pass its CRC32s.

kill_point() is a test hook: with GEMCOMPILE_TEST_KILL_AT=POINT[@RANK][,...] the process SIGKILLs
itself on reaching POINT (e.g. `save:4:rename`, `step:3`), so the fault tests kill at a named moment
instead of racing a timer.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import io
import json
import os
import re
import shutil
import signal
import sys
import time
import tempfile
import zipfile
from pathlib import Path

from torch.distributed.checkpoint import FileSystemReader

__all__ = [
    "MANIFEST",
    "CheckpointError",
    "check_checkpoint_dir",
    "commit_folder",
    "fsync_dir",
    "kill_point",
    "missing_shards",
    "partial_path",
    "remove_leftovers",
    "step_folders",
    "verify_files",
    "write_manifest",
]

MANIFEST = "manifest.json"
MANIFEST_FORMAT = "gemcompile-checkpoint/1"
KILL_ENV = "GEMCOMPILE_TEST_KILL_AT"

_STEP_DIR = re.compile(r"^step_(\d+)$")
_LEFTOVER = re.compile(r"^\.step_\d+\.(partial|old)$")
_SHARD = re.compile(r"^__(\d+)_\d+\.distcp$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or resumed from; the message is one line saying why."""

    same_on_every_rank: bool = False
    """True when every rank of a torchrun job raises this same error (rank 0 alone reports it)."""


def kill_point(point: str) -> None:
    """Test hook: SIGKILL this process when GEMCOMPILE_TEST_KILL_AT names `point` (for this rank:
    ``point@rank``); ``point@rank!stall`` makes it hang there instead (a rank that stops answering)."""
    wanted = os.environ.get(KILL_ENV)
    if not wanted:
        return
    rank = os.environ.get("RANK", "0")
    for item in wanted.split(","):
        item, _, action = item.strip().partition("!")
        name, _, only_rank = item.partition("@")
        if name == point and (not only_rank or only_rank == rank):
            sys.stdout.flush()
            sys.stderr.flush()
            if action == "stall":
                time.sleep(3600)
            os.kill(os.getpid(), signal.SIGKILL)


def step_folders(checkpoint_dir: str | Path) -> list[tuple[int, Path]]:
    """The `step_*` folders under checkpoint_dir, newest first (no check of their contents)."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return sorted(found, reverse=True)


def partial_path(final: Path) -> Path:
    """Where the checkpoint of `final` is written before it is renamed into place."""
    return final.parent / f".{final.name}.partial"


def remove_leftovers(checkpoint_dir: Path) -> None:
    """Remove what interrupted saves left (`.step_*.partial`, `.step_*.old`): a run saves one checkpoint
    at a time, so none of them is being written now."""
    if checkpoint_dir.is_dir():
        for p in checkpoint_dir.iterdir():
            if _LEFTOVER.match(p.name):
                _remove(p, ignore_errors=True)


def _remove(path: Path, ignore_errors: bool = False) -> None:
    """Remove a step folder, or a symlink to one (a run directory seeded with links to another run's steps):
    the link itself, never what it points to (rmtree refuses a link)."""
    if path.is_symlink():
        try:
            path.unlink()
        except OSError:
            if not ignore_errors:
                raise
    else:
        shutil.rmtree(path, ignore_errors=ignore_errors)


def fsync_dir(path: Path) -> None:
    """Make the entries of a directory durable (renames, new files); a no-op where unsupported."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def missing_shards(folder: Path, world_size: int) -> str | None:
    """What the DCP files of `folder` lack, or None: every file its .metadata lists (rank 0 writes it from
    all ranks' plans), and a file of each of the world_size ranks (DCP names them __<rank>_<n>.distcp and
    writes one per rank even when a rank holds nothing). A rank that wrote elsewhere, another
    --checkpoint-dir or a directory that is not shared between nodes, leaves its shard missing here."""
    present = {p.name for p in folder.iterdir() if p.is_file()}
    if ".metadata" not in present:
        return "DCP wrote no .metadata"
    try:
        listed = {info.relative_path for info in FileSystemReader(str(folder)).read_metadata().storage_data.values()}
    except Exception as e:  # a pickle of anything: any error means unreadable
        return f".metadata cannot be read ({type(e).__name__}: {_first_line(e)})"
    ranks = {int(m.group(1)) for name in present if (m := _SHARD.match(name))}
    absent = [r for r in range(world_size) if r not in ranks] if ranks else []  # no such names: another naming
    unlisted = sorted(listed - present)
    if not (absent or unlisted):
        return None
    what = [f"the shard of rank(s) {absent} (world size {world_size})"] if absent else []
    what += [f"{', '.join(unlisted)}, which its .metadata lists"] if unlisted else []
    return (f"it lacks {' and '.join(what)}: every rank must write into the same checkpoint directory (the same "
            "--checkpoint-dir, on a file system every node shares)")


def write_manifest(folder: Path, step: int, world_size: int) -> None:
    """Seal `folder`: record every file's size and sha256 in manifest.json (written last, fsynced). A
    CheckpointError, and no manifest, when a rank's shard is missing (missing_shards)."""
    problem = missing_shards(folder, world_size)
    if problem is not None:
        raise CheckpointError(f"cannot seal the checkpoint of step {step} in {folder.parent}: {problem}")
    files = {p.name: {"size": p.stat().st_size, "sha256": _sha256(p)}
             for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST}
    manifest = {"format": MANIFEST_FORMAT, "step": step, "world_size": world_size, "files": files}
    with open(folder / MANIFEST, "w") as fh:
        json.dump(manifest, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    fsync_dir(folder)


def _rename_exchange(a: Path, b: Path) -> bool:
    """Swap two directories in one atomic rename (Linux renameat2 RENAME_EXCHANGE); False where the
    platform or the file system cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(err, os.strerror(err), str(b))


def commit_folder(partial: Path, final: Path, step: int) -> None:
    """Put the sealed folder `partial` in place as `final`: a rename, or an atomic swap when `final`
    already exists (the old one is then removed). Never writes into `final`."""
    if not final.exists():
        os.rename(partial, final)
    elif _rename_exchange(partial, final):  # `partial` now holds the old checkpoint
        kill_point(f"save:{step}:swapped")
        _remove(partial)
    else:
        old = final.parent / f".{final.name}.old"
        _remove(old, ignore_errors=True)
        os.rename(final, old)
        kill_point(f"save:{step}:swapped")
        os.rename(partial, final)
        _remove(old)
    fsync_dir(final.parent)


def _read_manifest(folder: Path) -> tuple[dict | None, str | None]:
    """(the manifest's files, None), or (None, what is wrong with manifest.json)."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, UnicodeDecodeError) as e:
        return None, f"{MANIFEST} cannot be read ({type(e).__name__}: {e})"
    except json.JSONDecodeError as e:
        return None, f"{MANIFEST} is not valid JSON ({e})"
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        return None, f"{MANIFEST} is not a gemcompile checkpoint manifest (format {MANIFEST_FORMAT!r})"
    files = manifest.get("files")
    if not isinstance(files, dict) or not all(
            isinstance(v, dict) and isinstance(v.get("size"), int) and isinstance(v.get("sha256"), str)
            for v in files.values()):
        return None, f"{MANIFEST} has no valid list of files"
    step = manifest.get("step")
    m = _STEP_DIR.match(folder.name)
    if m and step != int(m.group(1)):
        return None, f"{MANIFEST} records step {step!r}, the folder's name says {int(m.group(1))}"
    return files, None


def _check_against_manifest(folder: Path, files: dict) -> str | None:
    if ".metadata" not in files:
        return f"{MANIFEST} lists no .metadata"
    for name, entry in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size < entry["size"]:
            return f"{name} is truncated ({size} of {entry['size']} bytes)"
        if size > entry["size"]:
            return f"{name} has {size} bytes, the manifest records {entry['size']}"
        if _sha256(path) != entry["sha256"]:
            return f"{name} is corrupt: its sha256 differs from the manifest's"
    return None


def _check_structure(folder: Path) -> str | None:
    """A checkpoint without a manifest: its DCP metadata must load, every data file must hold the byte ranges
    the metadata lists, and every tensor item must pass the CRC32s of its archive (flipped bits)."""
    if not (folder / ".metadata").is_file():
        return f"no {MANIFEST} and no .metadata: an interrupted save"
    try:
        metadata = FileSystemReader(str(folder)).read_metadata()
        storage = metadata.storage_data
        needed: dict[str, int] = {}
        for info in storage.values():
            end = int(info.offset) + int(info.length)
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    except Exception as e:  # a pickle of anything: any error means unreadable
        return f".metadata cannot be read ({type(e).__name__}: {_first_line(e)})"
    for name, end in sorted(needed.items()):
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size < end:
            return f"{name} is truncated ({path.stat().st_size} bytes, .metadata needs {end})"
    return _check_item_crcs(folder, storage.values())


def _check_item_crcs(folder: Path, items) -> str | None:
    """Each tensor item DCP wrote is a torch.save zip archive whose entries carry a CRC32: flipped bits in a
    checkpoint without a manifest fail it. (Items that are not archives, raw bytes, are not checked.)"""
    for info in sorted(items, key=lambda i: (i.relative_path, int(i.offset))):
        with open(folder / info.relative_path, "rb") as f:
            f.seek(int(info.offset))
            data = f.read(int(info.length))
        if data[:4] != b"PK\x03\x04":
            continue
        try:
            damaged = zipfile.ZipFile(io.BytesIO(data)).testzip()
        except (zipfile.BadZipFile, OSError, ValueError) as e:
            return f"{info.relative_path}: the item at byte {info.offset} is not a readable archive ({e})"
        if damaged is not None:
            return f"{info.relative_path}: {damaged} (the item at byte {info.offset}) fails its CRC32 check"
    return None


def verify_files(folder: str | Path) -> str | None:
    """What is wrong with the files of checkpoint `folder`, in one line that names the file, or None."""
    folder = Path(folder)
    if not (folder / MANIFEST).exists():
        return _check_structure(folder)
    files, problem = _read_manifest(folder)
    return problem if problem is not None else _check_against_manifest(folder, files)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def check_checkpoint_dir(path: str | Path) -> str | None:
    """Create `path` if needed and make sure checkpoints can be written in it: None, or what is wrong
    in one line. Runs before anything is built, so a bad path fails at once, not at the first save."""
    path = Path(path)
    for ancestor in (path, *path.parents):
        if ancestor.exists() or ancestor.is_symlink():
            if ancestor.is_symlink() and not ancestor.exists():  # dangling, or a loop
                what = "a symlink to nothing that exists (dangling, or a loop)"
                return f"it is {what}" if ancestor == path else f"{ancestor} is {what}"
            if not ancestor.is_dir():
                return "it is a file, not a directory" if ancestor == path else f"{ancestor} is a file"
            break
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return f"it cannot be created ({e.strerror or e})"
    try:
        fd, probe = tempfile.mkstemp(prefix=".gemcompile-write-test-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return f"it is not writable ({e.strerror or e})"
    return None
