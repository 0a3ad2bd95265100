"""runtime/training/checkpoint.py and checkpoint_files.py: DCP save / load in one process, compiled
wrappers, RNG, latest checkpoint; atomic folders, manifests, and the one-line verdict on each kind of
damage."""

import json
import re

import pytest
import torch
from torch import nn

from gemcompile.runtime.training.checkpoint import (
    checkpoint_path,
    choose_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    unwrap_model,
    verify_checkpoint,
)
from gemcompile.runtime.training.checkpoint_files import (
    MANIFEST,
    CheckpointError,
    check_checkpoint_dir,
    partial_path,
    write_manifest,
)
from gemcompile.runtime.training.optimizers import build_optimizers


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = nn.EmbeddingBag(20, 4, mode="sum")
        self.mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, ids):
        return self.mlp(self.table(ids)).squeeze(-1)


def _step(model, optimizers, step):
    gen = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 20, (6, 3), generator=gen)
    loss = (model(ids) - torch.randn(6, generator=gen)).pow(2).mean()
    for o in optimizers:
        o.zero_grad(set_to_none=True)
    loss.backward()
    for o in optimizers:
        o.step()
    return loss.item()


def _fresh(seed=0):
    torch.manual_seed(seed)
    model = Small()
    return model, build_optimizers(model, lr=1e-2, embedding_lr=0.1)


def test_round_trip_resumes_bit_exactly(tmp_path):
    model, optimizers = _fresh()
    assert [type(o).__name__ for o in optimizers] == ["Adam", "Adagrad"]
    for step in range(3):
        _step(model, optimizers, step)
    path = save_checkpoint(tmp_path, 3, model, optimizers, extra={"losses": [1.0, 0.5], "note": "x"})
    assert path == checkpoint_path(tmp_path, 3) and (path / ".metadata").is_file()
    reference = [_step(model, optimizers, step) for step in range(3, 6)]

    other, other_optimizers = _fresh(seed=123)  # different init: everything must come from the checkpoint
    state = load_checkpoint(path, other, other_optimizers)
    assert state.step == 3 and state.extra == {"losses": [1.0, 0.5], "note": "x"}
    assert [_step(other, other_optimizers, step) for step in range(3, 6)] == reference
    for a, b in zip(model.parameters(), other.parameters()):
        assert torch.equal(a, b)


def test_compiled_wrapper_saves_the_original_module(tmp_path):
    model, optimizers = _fresh()
    compiled = torch.compile(model)  # never called: only the wrapper matters here
    assert unwrap_model(compiled) is model
    _step(model, optimizers, 0)
    path = save_checkpoint(tmp_path, 1, compiled, optimizers)
    plain, plain_optimizers = _fresh(seed=7)
    load_checkpoint(path, plain, plain_optimizers)  # keys have no "_orig_mod." prefix
    for a, b in zip(model.state_dict().values(), plain.state_dict().values()):
        assert torch.equal(a, b)


def test_rng_state_is_restored(tmp_path):
    model, optimizers = _fresh()
    torch.manual_seed(42)
    path = save_checkpoint(tmp_path, 0, model, optimizers)
    expected = torch.rand(3)
    torch.manual_seed(0)
    load_checkpoint(path, model, optimizers)
    assert torch.equal(torch.rand(3), expected)


def test_latest_checkpoint_skips_incomplete(tmp_path):
    assert latest_checkpoint(tmp_path / "missing") is None
    model, optimizers = _fresh()
    save_checkpoint(tmp_path, 2, model, optimizers)
    save_checkpoint(tmp_path, 10, model, optimizers)
    (tmp_path / "step_00000020").mkdir()  # an interrupted save: no .metadata
    (tmp_path / "notes").mkdir()
    assert latest_checkpoint(tmp_path) == checkpoint_path(tmp_path, 10)


def test_load_missing_checkpoint_is_clear(tmp_path):
    model, optimizers = _fresh()
    with pytest.raises(FileNotFoundError, match="no complete DCP checkpoint"):
        load_checkpoint(tmp_path / "step_00000001", model, optimizers)


def test_bad_arguments(tmp_path):
    model, optimizers = _fresh()
    with pytest.raises(ValueError, match="step must be an int >= 0"):
        save_checkpoint(tmp_path, -1, model, optimizers)
    with pytest.raises(TypeError, match="optimizers must be"):
        save_checkpoint(tmp_path, 1, model, [])


# --- on disk: atomic folders, manifests, verification (checkpoint_files.py) ---------------------------

def _saved(tmp_path, *steps):
    model, optimizers = _fresh()
    return [save_checkpoint(tmp_path, s, model, optimizers) for s in steps]


def test_a_checkpoint_is_sealed_by_a_manifest_and_leaves_nothing_behind(tmp_path):
    (path,) = _saved(tmp_path, 3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000003"]
    names = sorted(p.name for p in path.iterdir())
    assert names == [".metadata", "__0_0.distcp", MANIFEST]
    manifest = json.loads((path / MANIFEST).read_text())
    assert manifest["step"] == 3 and set(manifest["files"]) == {".metadata", "__0_0.distcp"}
    assert manifest["files"]["__0_0.distcp"]["size"] == (path / "__0_0.distcp").stat().st_size
    assert verify_checkpoint(path) is None


def test_an_existing_step_is_replaced_whole_never_rewritten_in_place(tmp_path):
    (path,) = _saved(tmp_path, 2)
    (path / "from_the_old_save").write_text("x")
    stale = partial_path(path)
    stale.mkdir()  # what a killed save leaves
    (stale / "__0_0.distcp").write_bytes(b"")
    (tmp_path / ".step_00000009.old").mkdir()
    _saved(tmp_path, 2)
    assert not (path / "from_the_old_save").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000002"]
    assert verify_checkpoint(path) is None


def test_a_step_that_is_a_symlink_to_another_runs_step_is_replaced_and_its_target_kept(tmp_path):
    """A run directory seeded with a link to another run's step: the save replaced it, then rmtree refused
    the swapped-out link and the run stopped with a save failure although the new checkpoint was in place."""
    (source,) = _saved(tmp_path / "other_run", 2)
    run = tmp_path / "run"
    run.mkdir()
    (run / source.name).symlink_to(source, target_is_directory=True)
    (run / ".step_00000007.partial").symlink_to(source, target_is_directory=True)  # (a leftover that is a link)
    (path,) = _saved(run, 2)
    assert not path.is_symlink() and verify_checkpoint(path) is None
    assert sorted(p.name for p in run.iterdir()) == ["step_00000002"]
    assert verify_checkpoint(source) is None  # (the other run's checkpoint is untouched)


def _flip(path, count=64):
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    for i in range(middle, middle + count):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, message", [
    (lambda p: (p / "__0_0.distcp").write_bytes((p / "__0_0.distcp").read_bytes()[:100]),
     r"^__0_0\.distcp is truncated \(100 of \d+ bytes\)$"),
    (lambda p: (p / "__0_0.distcp").unlink(), r"^__0_0\.distcp is missing$"),
    (lambda p: _flip(p / "__0_0.distcp"),
     r"^__0_0\.distcp is corrupt: its sha256 differs from the manifest's$"),
    (lambda p: (p / ".metadata").write_bytes(b""), r"^\.metadata is truncated \(0 of \d+ bytes\)$"),
    (lambda p: _flip(p / ".metadata", 8), r"^\.metadata is corrupt"),
    (lambda p: (p / "__0_0.distcp").write_bytes((p / "__0_0.distcp").read_bytes() + b"x"),
     r"^__0_0\.distcp has \d+ bytes, the manifest records \d+$"),
    (lambda p: (p / MANIFEST).write_text("{garbage"), r"^manifest\.json is not valid JSON"),
    (lambda p: (p / MANIFEST).write_text("[]"), r"^manifest\.json is not a gemcompile checkpoint manifest"),
    (lambda p: (p / MANIFEST).write_text((p / MANIFEST).read_text().replace('"step": 4', '"step": 5')),
     r"^manifest\.json records step 5, the folder's name says 4$"),
])
def test_damage_is_named_in_one_line_and_the_previous_checkpoint_is_chosen(tmp_path, damage, message):
    older, newer = _saved(tmp_path, 2, 4)
    damage(newer)
    problem = verify_checkpoint(newer)
    assert problem is not None and "\n" not in problem
    assert re.match(message, problem), problem
    choice = choose_checkpoint(tmp_path)
    assert choice.path == older and choice.meta["step"] == 2
    assert choice.skipped == [f"{newer}: {problem}"]


def test_a_checkpoint_without_manifest_is_checked_structurally(tmp_path):
    """Written before manifests: the DCP metadata must load and cover the data files' byte ranges."""
    older, newer = _saved(tmp_path, 2, 4)
    for path in (older, newer):
        (path / MANIFEST).unlink()
    assert choose_checkpoint(tmp_path).path == newer and choose_checkpoint(tmp_path).skipped == []
    (newer / "__0_0.distcp").write_bytes(b"")  # the in-place re-write: old .metadata, 0-byte data
    assert re.match(r"^__0_0\.distcp is truncated \(0 bytes, \.metadata needs \d+\)$",
                    verify_checkpoint(newer))
    (older / ".metadata").write_bytes(b"garbage")
    assert verify_checkpoint(older).startswith(".metadata cannot be read (UnpicklingError")
    (older / ".metadata").unlink()
    assert verify_checkpoint(older) == "no manifest.json and no .metadata: an interrupted save"
    assert choose_checkpoint(tmp_path).path is None and len(choose_checkpoint(tmp_path).skipped) == 2


def test_flipped_bits_in_a_checkpoint_without_manifest_fail_the_items_crc(tmp_path):
    """Bits flipped inside a tensor of a folder without a manifest (the byte ranges intact) were resumed as
    good; each tensor item is a torch.save archive whose CRC32 names the damage."""
    older, newer = _saved(tmp_path, 2, 4)
    for path in (older, newer):
        (path / MANIFEST).unlink()
    from torch.distributed.checkpoint import FileSystemReader

    storage = FileSystemReader(str(newer)).read_metadata().storage_data.values()
    largest = max(storage, key=lambda info: info.length)  # the middle of its bytes is tensor data
    data = newer / largest.relative_path
    raw = bytearray(data.read_bytes())
    raw[largest.offset + largest.length // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    problem = verify_checkpoint(newer)
    assert problem is not None and "fails its CRC32 check" in problem and "\n" not in problem, problem
    assert verify_checkpoint(older) is None
    assert choose_checkpoint(tmp_path).path == older


def test_a_manifest_less_checkpoint_whose_data_cannot_be_unpickled_is_skipped(tmp_path):
    """DCP reports the failed read as CheckpointException, a BaseException: it is still one verdict, and the
    checkpoint before it is chosen."""
    older, newer = _saved(tmp_path, 2, 4)
    (newer / MANIFEST).unlink()
    data = newer / "__0_0.distcp"
    data.write_bytes(bytes(data.stat().st_size))  # zeros of the right length: the byte ranges still fit
    assert verify_checkpoint(newer).startswith("its state cannot be read (UnpicklingError")
    choice = choose_checkpoint(tmp_path)
    assert choice.path == older and len(choice.skipped) == 1 and newer.name in choice.skipped[0]


@pytest.mark.parametrize("cause,status,line", [
    (OSError(28, "No space left on device"), 2, "error: [Errno 28] No space left on device"),
    (KeyboardInterrupt(), 130, "interrupted"),
    (RuntimeError("boom"), 1, "error: RuntimeError: boom (run with --debug for the traceback)"),
])
def test_a_checkpoint_failure_is_reported_by_its_cause_in_one_line(cause, status, line, capsys):
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    from gemcompile.runtime.training.flags import report_error

    error = CheckpointException("CheckpointException ranks: {0}", {0: _wrap_exception(cause)})
    assert report_error("train", error, debug=False) == status
    assert capsys.readouterr().err == f"gemcompile train: {line}\n"
    if status != 130:  # --debug: the traceback of what DCP raised
        with pytest.raises(CheckpointException):
            report_error("train", error, debug=True)


def test_checkpoint_dir_problems_are_found_before_anything_runs(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("")
    assert check_checkpoint_dir(afile) == "it is a file, not a directory"
    assert check_checkpoint_dir(afile / "sub" / "ckpt") == f"{afile} is a file"
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    for link in ("dangling", "loop"):  # were called "a file"
        assert check_checkpoint_dir(tmp_path / link) == "it is a symlink to nothing that exists (dangling, or a loop)"
    assert check_checkpoint_dir(tmp_path / "new" / "ckpt") is None and (tmp_path / "new" / "ckpt").is_dir()
    assert list((tmp_path / "new" / "ckpt").iterdir()) == []  # the write probe is removed


@pytest.mark.parametrize("where", ["dcp_save", "file_system", "zip_writer"])
def test_a_full_disk_names_the_step_and_the_directory_and_keeps_the_earlier_checkpoint(tmp_path, monkeypatch,
                                                                                       where):
    """ENOSPC in the middle of a save: one error that says which step and where, the checkpoint before it
    still the latest, nothing half-written chosen. Raised by the file system under DCP, the error arrives
    wrapped in DCP's CheckpointException (a BaseException), or as torch.save's zip writer's RuntimeError."""
    import errno

    from torch.distributed.checkpoint import filesystem

    import gemcompile.runtime.training.checkpoint as checkpoint

    model, optimizers = _fresh()
    save_checkpoint(tmp_path, 1, model, optimizers)
    error = (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
             if where == "zip_writer" else OSError(errno.ENOSPC, "No space left on device"))

    def full(*args, **kwargs):
        raise error

    if where == "dcp_save":
        monkeypatch.setattr(checkpoint.dcp, "save", full)
    else:
        monkeypatch.setattr(filesystem.FileSystem, "create_stream", full)
    reason = "a file was not written whole" if where == "zip_writer" else "No space left on device"
    with pytest.raises(OSError, match=rf"checkpoint of step 2 into .* failed: {reason}") as info:
        save_checkpoint(tmp_path, 2, model, optimizers)
    assert info.value.errno == (errno.EIO if where == "zip_writer" else errno.ENOSPC)
    assert str(tmp_path) in str(info.value)
    # DCP's exception is gathered to every rank: under torchrun rank 0 alone says it (flags.report_error)
    assert getattr(info.value, "same_on_every_rank", False) == (where != "dcp_save")
    monkeypatch.undo()  # the disk has room again: reading works
    assert latest_checkpoint(tmp_path) == checkpoint_path(tmp_path, 1)


def _unsealed_copy(tmp_path, drop=()):
    """The DCP files of a one-process checkpoint, copied into a folder not yet sealed (less `drop`)."""
    import shutil

    (path,) = _saved(tmp_path / "saved", 1)
    folder = tmp_path / "run" / partial_path(checkpoint_path(tmp_path / "run", 1)).name
    folder.mkdir(parents=True)
    for name in (".metadata", "__0_0.distcp"):
        if name not in drop:
            shutil.copy(path / name, folder / name)
    return folder


def test_sealing_refuses_a_world_whose_ranks_did_not_all_write_here(tmp_path):
    """A rank that wrote its shard elsewhere (another --checkpoint-dir): rank 0's folder is not sealed as a
    world-2 checkpoint."""
    folder = _unsealed_copy(tmp_path)
    with pytest.raises(CheckpointError, match=r"cannot seal the checkpoint of step 1 in .*: it lacks the shard of "
                       r"rank\(s\) \[1\] \(world size 2\): every rank must write into the same checkpoint directory"):
        write_manifest(folder, 1, 2)
    assert not (folder / MANIFEST).exists()
    write_manifest(folder, 1, 1)  # the whole world of 1
    assert (folder / MANIFEST).exists()


def test_sealing_refuses_a_shard_the_metadata_lists_but_the_folder_lacks(tmp_path):
    folder = _unsealed_copy(tmp_path, drop=("__0_0.distcp",))
    with pytest.raises(CheckpointError, match=r"it lacks __0_0\.distcp, which its \.metadata lists"):
        write_manifest(folder, 1, 1)
    assert not (folder / MANIFEST).exists()


def test_a_save_missing_a_shard_is_an_error_and_keeps_the_earlier_checkpoint(tmp_path, monkeypatch):
    import gemcompile.runtime.training.checkpoint as checkpoint

    model, optimizers = _fresh()
    save_checkpoint(tmp_path, 1, model, optimizers)
    monkeypatch.setattr(checkpoint, "write_manifest", lambda folder, step, world: write_manifest(folder, step, 2))
    with pytest.raises(CheckpointError, match=r"cannot seal the checkpoint of step 2"):
        save_checkpoint(tmp_path, 2, model, optimizers)
    assert latest_checkpoint(tmp_path) == checkpoint_path(tmp_path, 1)
    assert not checkpoint_path(tmp_path, 2).exists()


def test_a_full_disk_when_naming_the_run_says_which_file_and_leaves_no_partial_copy(tmp_path, monkeypatch):
    """run.json is written before the first checkpoint: a failure there named no file ("[Errno 28] No space
    left on device") and left .run.json.tmp behind."""
    from gemcompile.runtime.training import checkpoint_owner

    def full(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint_owner.os, "replace", full)
    with pytest.raises(OSError, match=r"writing .*run\.json .*failed: No space left on device"):
        checkpoint_owner.name_run(tmp_path, None)
    assert list(tmp_path.iterdir()) == []


def test_an_error_handed_from_rank_0_reads_as_one_process_prints_it():
    """on_rank0 hands rank 0's error to every rank: a lock held by another run reads as in one process
    ("another run is writing ..."), an unexpected error keeps its type's name."""
    import torch.distributed as dist

    from gemcompile.runtime.training.checkpoint import CheckpointError, on_rank0
    from gemcompile.runtime.training.checkpoint_owner import DirectoryInUse

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        def locked():
            raise DirectoryInUse("another run is writing /tmp/ck")

        def broken():
            raise KeyError("state")

        with pytest.raises(CheckpointError, match=r"^another run is writing /tmp/ck$"):
            on_rank0(locked)
        with pytest.raises(CheckpointError, match=r"^KeyError: 'state'$"):
            on_rank0(broken)
    finally:
        dist.destroy_process_group()
