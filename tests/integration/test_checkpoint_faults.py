"""Training that survives any kill and says what is wrong before it starts (issue 27).

Faults, CPU, GEM-ref tiny, eager, 4 steps with a checkpoint every 2:
  - SIGKILL at seeded-random named points of a run and of a checkpoint write (GEMCOMPILE_TEST_KILL_AT:
    the child kills itself at the point, no timer races), and during an in-place re-write of an
    existing checkpoint; the killed run is a fork of this process (no second torch import);
  - damaged files (truncated, missing, bit-flipped data, empty / garbage / missing .metadata, garbage
    manifest, a pre-manifest folder with a 0-byte data file), in-process;
  - one gloo world-2 run (torchrun) killed in a save, resumed at world 2 past a corrupted checkpoint.
Each time the resumed run's losses equal the uninterrupted run's (every step, bit for bit in one
process), or the CLI says in one line why it cannot resume. Bad arguments and paths: exit 2, one line,
before the model is built.
"""

import dataclasses
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import traceback
from pathlib import Path

import pytest

import gemcompile.runtime.training.train as train_module
from gemcompile.cli import main
from gemcompile.runtime.training.checkpoint import checkpoint_path, choose_checkpoint
from gemcompile.runtime.training.checkpoint_files import KILL_ENV, MANIFEST
from gemcompile.runtime.training.checkpoint_owner import LOCK_FILE, RUN_FILE, DirectoryInUse, name_run, run_id
from gemcompile.runtime.training.config import TrainConfig
from gemcompile.runtime.training.train import train
from tests.integration.torchrun import torchrun

ROOT = Path(__file__).resolve().parents[2]
STEPS, EVERY, BATCH = 4, 2, 16
SAVE_PHASES = ("begin", "metadata", "manifest", "rename", "done")
"""Named points of a save, in order (checkpoint.py / checkpoint_files.py call kill_point at each)."""


def _cfg(directory, **overrides) -> TrainConfig:
    return TrainConfig(size="tiny", steps=STEPS, batch_size=BATCH, compile="eager",
                       checkpoint_dir=str(directory), save_every=EVERY, quiet=True, **overrides)


@pytest.fixture(scope="module", autouse=True)
def _one_flop_formula():
    """GemFlopFormula.from_model probes the model under FakeTensorMode (~1.5 s a run on 2 cores); the
    formula of tiny is the same for every run here and touches no state a checkpoint holds, so it is
    derived once (forked children inherit it)."""
    from gemcompile.runtime.training.flops import GemFlopFormula

    original, cache = GemFlopFormula.from_model.__func__, {}

    def cached(cls, model):
        if "tiny" not in cache:
            cache["tiny"] = original(cls, model)
        return cache["tiny"]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(GemFlopFormula, "from_model", classmethod(cached))
        yield


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run: its losses, and its checkpoints (step 2 and 4)."""
    directory = tmp_path_factory.mktemp("reference")
    return train(_cfg(directory)).losses, directory


def _killed(cfg: TrainConfig, point: str) -> None:
    """Run `cfg` in a forked child that SIGKILLs itself at `point`; check that it did."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.environ[KILL_ENV] = point
            train(cfg)
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(3)  # the kill point was never reached
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, f"{point}: child status {status}"


def _entries(directory) -> list[str]:
    """The checkpoint directory's entries besides the owner's lock and run id (checkpoint_owner.py)."""
    return sorted(p.name for p in Path(directory).iterdir() if p.name not in (LOCK_FILE, RUN_FILE))


def _committed_before(point: str) -> int:
    """The last checkpoint complete when a run is killed at `point` (0: none)."""
    kind, step, *phase = point.split(":")
    step = int(step)
    if kind == "step":  # after step `step`, before its checkpoint
        step -= 1
    elif phase[0] != "done":
        step -= 1
    return step - step % EVERY


def _assert_resumes_exactly(directory, expected_step, reference_losses):
    assert choose_checkpoint(directory).skipped == []  # every visible step folder is whole
    resumed = train(_cfg(directory, resume=True))
    assert resumed.start_step == expected_step
    assert resumed.losses == reference_losses  # restored steps and the retrained ones, bit for bit
    names = _entries(directory)
    if expected_step < STEPS:  # the resumed run saved: what the kill left behind is gone
        assert names == ["step_00000002", "step_00000004"]


_RNG = random.Random(27)  # seeded: the same points on every CI run
KILL_POINTS = sorted(_RNG.sample([f"step:{n}" for n in range(1, STEPS)], 1) + _RNG.sample(
    [f"save:{s}:{phase}" for s in range(EVERY, STEPS + 1, EVERY) for phase in SAVE_PHASES], 3))
"""One point between training steps, three in checkpoint writes."""


@pytest.mark.parametrize("point", KILL_POINTS)
def test_killed_run_resumes_from_the_last_complete_checkpoint(point, reference, tmp_path):
    losses, _ = reference
    _killed(_cfg(tmp_path), point)
    _assert_resumes_exactly(tmp_path, _committed_before(point), losses)


@pytest.mark.parametrize("phase", ["metadata", "rename", "swapped"])
def test_killed_rewrite_of_an_existing_checkpoint_leaves_old_or_new_whole(phase, reference, tmp_path):
    """A fresh run pointed at a directory that already holds step 2 and 4, killed while it writes step 4
    again: step 4 is the old folder (untouched) or the new one, never a mix; an untouched old step 4 is
    another run's, so the resume takes the fresh run's step 2 (checkpoint_owner.py)."""
    losses, saved = reference
    for step in (2, 4):
        shutil.copytree(checkpoint_path(saved, step), checkpoint_path(tmp_path, step))
        (checkpoint_path(tmp_path, step) / "from_the_old_run").write_text("")
    _killed(_cfg(tmp_path), f"save:4:{phase}")
    step_4 = checkpoint_path(tmp_path, 4)
    if phase == "swapped" and not step_4.exists():  # no atomic swap here: two renames, killed between
        expected = 2
    else:
        assert (step_4 / "from_the_old_run").exists() == (phase != "swapped")
        expected = 4 if phase == "swapped" else 2
    assert not (checkpoint_path(tmp_path, 2) / "from_the_old_run").exists()  # step 2 rewritten (swapped)
    _assert_resumes_exactly(tmp_path, expected, losses)


def _flip_payload(path: Path) -> None:
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 64):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def _legacy_zero_byte_data(folder: Path) -> None:
    """The issue's in-place re-write killed mid-way: no manifest, old .metadata, a 0-byte data file."""
    (folder / MANIFEST).unlink()
    (folder / "__0_0.distcp").write_bytes(b"")


def _garbage(path: Path) -> None:
    path.write_bytes(random.Random(0).randbytes(path.stat().st_size))


DATA, METADATA = "__0_0.distcp", ".metadata"
DAMAGE = {  # what is done to the newest checkpoint's folder, what the skip line must say
    "truncated data": (lambda f: os.truncate(f / DATA, 1000), r"__0_0\.distcp is truncated \(1000 of"),
    "missing data": (lambda f: (f / DATA).unlink(), r"__0_0\.distcp is missing"),
    "bit-flipped data": (lambda f: _flip_payload(f / DATA), r"__0_0\.distcp is corrupt"),
    "empty metadata": (lambda f: (f / METADATA).write_bytes(b""), r"\.metadata is truncated \(0 of"),
    "garbage metadata": (lambda f: _garbage(f / METADATA), r"\.metadata is corrupt"),
    "missing metadata": (lambda f: (f / METADATA).unlink(), r"\.metadata is missing"),
    "garbage manifest": (lambda f: (f / MANIFEST).write_text("\x00garbage"), r"manifest\.json is not valid"),
    "pre-manifest, 0-byte data": (_legacy_zero_byte_data, r"__0_0\.distcp is truncated \(0 bytes"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_checkpoint_is_named_and_skipped(damage, reference, tmp_path, capsys):
    losses, saved = reference
    for step in (2, 4):
        shutil.copytree(checkpoint_path(saved, step), checkpoint_path(tmp_path, step))
    apply, message = DAMAGE[damage]
    apply(checkpoint_path(tmp_path, 4))
    resumed = train(_cfg(tmp_path, resume=True))
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert re.fullmatch(rf"gemcompile: skipping checkpoint {re.escape(str(checkpoint_path(tmp_path, 4)))}: "
                        rf"{message}.*", err[0]), err[0]
    assert resumed.start_step == 2 and resumed.losses == losses


@pytest.fixture
def no_model(monkeypatch):
    """Fails the test if the model is built (the errors must come before)."""
    def refuse(*args, **kwargs):
        raise AssertionError("the model was built before the error")

    monkeypatch.setattr(train_module, "GemRef", refuse)


def _cli_error(argv, capsys) -> str:
    code = main(["train", "--quiet", "--steps", str(STEPS), "--batch-size", str(BATCH), *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "Traceback" not in err[0], (code, err)
    assert err[0].startswith("gemcompile train: error: ")
    return err[0]


def test_no_checkpoint_verifies_is_one_error_line(reference, tmp_path, capsys, no_model):
    _, saved = reference
    for step in (2, 4):
        shutil.copytree(checkpoint_path(saved, step), checkpoint_path(tmp_path, step))
        os.truncate(checkpoint_path(tmp_path, step) / "__0_0.distcp", 10)
    code = main(["train", "--quiet", "--checkpoint-dir", str(tmp_path), "--resume"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 3, err  # one line per checkpoint skipped, one for the error
    assert all(line.startswith("gemcompile: skipping checkpoint ") for line in err[:2])
    assert err[2] == ("gemcompile train: error: cannot resume: none of the 2 checkpoints in "
                      f"{tmp_path} verifies (each is reported above)")


def test_resume_with_other_settings_is_refused_before_the_load(reference, tmp_path, capsys, no_model):
    _, saved = reference
    shutil.copytree(checkpoint_path(saved, 2), checkpoint_path(tmp_path, 2))
    line = _cli_error(["--size", "small", "--checkpoint-dir", str(tmp_path), "--resume"], capsys)
    assert line == (f"gemcompile train: error: cannot resume from {checkpoint_path(tmp_path, 2)}: it was "
                    "written with other settings (size: checkpoint 'tiny' vs now 'small')")


def _unwritable(tmp_path: Path) -> Path:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    if os.access(locked, os.W_OK):  # root writes anywhere: a place nobody can create a folder in
        return Path("/proc/gemcompile-no-such-dir/ckpt")
    return locked / "ckpt"


@pytest.mark.parametrize("case, reason", [
    ("a file", "it is a file, not a directory"),
    ("under a file", "is a file"),
    ("unwritable", "cannot be created|is not writable"),
])
def test_bad_checkpoint_dir_is_one_line_before_the_model_is_built(case, reason, tmp_path, capsys, no_model):
    afile = tmp_path / "afile"
    afile.write_text("")
    path = {"a file": afile, "under a file": afile / "ckpt"}.get(case) or _unwritable(tmp_path)
    line = _cli_error(["--checkpoint-dir", str(path)], capsys)
    expected = rf"TrainConfig\.checkpoint_dir = '{re.escape(str(path))}' is unusable: .*({reason})"
    assert re.search(expected, line), line


def test_debug_shows_the_traceback(tmp_path, no_model):
    (tmp_path / "afile").write_text("")
    with pytest.raises(ValueError, match="is a file, not a directory"):
        main(["train", "--quiet", "--debug", "--checkpoint-dir", str(tmp_path / "afile")])


def test_the_command_line_itself_exits_2_with_one_line(tmp_path):
    """A real process: nothing else on stderr (no warning, no traceback), before any training step."""
    (tmp_path / "afile").write_text("")
    proc = subprocess.run([sys.executable, "-m", "gemcompile.cli", "train", "--checkpoint-dir",
                           str(tmp_path / "afile" / "ckpt")], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    afile = tmp_path / "afile"
    assert proc.stderr.splitlines() == [f"gemcompile train: error: TrainConfig.checkpoint_dir = "
                                        f"'{afile / 'ckpt'}' is unusable: {afile} is a file"]


@pytest.mark.core  # kept in CI's fast tier (tests/slow_tier.py)
def test_world_2_killed_in_a_save_resumes_past_a_corrupted_checkpoint(reference, tmp_path):
    """gloo, 2 ranks, 3 steps, a checkpoint every step: rank 1 is killed as the step-3 save begins; the
    step-2 checkpoint is then bit-flipped. Rank 0 verifies, both ranks resume from step 1, and the losses
    equal single-process training (within 1e-5, as the other parallel tests)."""
    losses, _ = reference
    worker = str(ROOT / "tests" / "integration" / "parallel_worker.py")
    directory = tmp_path / "ckpt"
    spec = {"steps": 3, "batch_size": BATCH, "checkpoint_dir": str(directory), "save_every": 1}
    killed = torchrun(2, [worker, str(tmp_path / "killed.json"), json.dumps(spec)],
                      {KILL_ENV: "save:3:begin@1"})  # rank 1 only
    assert killed.returncode != 0 and not (tmp_path / "killed.json").exists()
    assert _entries(directory) == [".step_00000003.partial", "step_00000001", "step_00000002"]
    _flip_payload(checkpoint_path(directory, 2) / "__1_0.distcp")
    resumed = torchrun(2, [worker, str(tmp_path / "resumed.json"), json.dumps({**spec, "resume": True})], {})
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    skipped = [line for line in resumed.stderr.splitlines() if "skipping checkpoint" in line]
    assert skipped == [f"gemcompile: skipping checkpoint {checkpoint_path(directory, 2)}: __1_0.distcp is "
                       "corrupt: its sha256 differs from the manifest's"]  # once: rank 0 verifies for both
    run = json.loads((tmp_path / "resumed.json").read_text())
    assert run["start_step"] == 1
    for step, (a, b) in enumerate(zip(run["losses"], losses[:3], strict=True), 1):
        assert abs(a - b) <= 1e-5, f"step {step}: {a} vs {b}"


def test_a_fresh_run_resumes_its_own_steps_not_an_earlier_runs_later_ones(reference, tmp_path, capsys):
    """An earlier run saved steps 2-6 (other settings that do not change the trajectory: dense tables);
    a fresh run in the same directory saves 2 and is killed: --resume takes its step 2, not the earlier
    run's 6 (which would end the run with someone else's state), and says so."""
    losses, _ = reference
    train(dataclasses.replace(_cfg(tmp_path, sparse_tables=False), steps=6))
    _killed(_cfg(tmp_path), "step:3")
    resumed = train(_cfg(tmp_path, resume=True))
    assert resumed.start_step == 2 and resumed.losses == losses
    err = capsys.readouterr().err
    for step in (6, 4):  # 4: the earlier run's, until this resume saved its own
        assert (f"skipping checkpoint {checkpoint_path(tmp_path, step)}: written by an earlier run in this "
                "directory") in err
    assert choose_checkpoint(tmp_path, run_id(tmp_path)).path == checkpoint_path(tmp_path, 4)


def test_resume_never_trains_from_step_0_over_an_earlier_runs_checkpoints(reference, tmp_path, capsys):
    """A run saved steps 2 and 4; a fresh run in its directory was killed before it saved: it never named
    itself in run.json, so --resume continues the earlier run. Where run.json names a run without
    checkpoints there (killed between naming itself and its first save), --resume stops and says how to
    go on; it said "starting from step 0" and replaced the earlier run's step 4 with its own."""
    losses, saved = reference
    shutil.copytree(saved, tmp_path, dirs_exist_ok=True)
    _killed(_cfg(tmp_path), "step:1")
    resumed = train(_cfg(tmp_path, resume=True))
    assert resumed.start_step == STEPS and resumed.losses == losses
    name_run(tmp_path, "a-run-killed-before-its-first-checkpoint")
    step_4 = (checkpoint_path(tmp_path, 4) / MANIFEST).read_bytes()
    capsys.readouterr()
    assert main(["train", "--size", "tiny", "--batch-size", str(BATCH), "--steps", "6", "--save-every", "2",
                 "--checkpoint-dir", str(tmp_path), "--resume", "--quiet"]) == 2
    error = capsys.readouterr().err.splitlines()[-1]
    assert error.startswith(f"gemcompile train: error: cannot resume: the 2 checkpoint(s) in {tmp_path} "
                            f"(newest {checkpoint_path(tmp_path, 4)}) are an earlier run's")
    assert f"remove {tmp_path / RUN_FILE} and --resume again" in error and "without --resume" in error
    assert (checkpoint_path(tmp_path, 4) / MANIFEST).read_bytes() == step_4
    assert _entries(tmp_path) == ["step_00000002", "step_00000004"]


def test_a_second_run_on_a_directory_in_use_stops_before_touching_it(tmp_path):
    import fcntl

    held = os.open(tmp_path / LOCK_FILE, os.O_RDWR | os.O_CREAT)  # another run's lock, still going
    fcntl.flock(held, fcntl.LOCK_EX)
    try:
        with pytest.raises(DirectoryInUse, match="another run is writing checkpoints to"):
            train(_cfg(tmp_path))
        assert _entries(tmp_path) == []
    finally:
        os.close(held)
    assert train(_cfg(tmp_path)).start_step == 0  # free again
