"""Ranks launched with different flags (a launcher that does not give every rank the same command line)
stop at start with one error line naming what differs, within seconds: before the check, rank 1 alone
with --emb-outer 2 waited in another collective than rank 0 until gloo's 30-minute timeout, and rank 1
alone with --seed 1 trained silently on a mix of seeds. Identical flags train as before
(test_parallel_training.py)."""

import time

from tests.integration.torchrun import torchrun

_WORKER = """\
import os, shlex, sys
from gemcompile.cli import main
extra = shlex.split(os.environ.get("EXTRA_ARGS_" + os.environ["RANK"], ""))
sys.exit(main(sys.argv[1:] + extra))
"""
"""`gemcompile train` with EXTRA_ARGS_<rank> appended on that rank alone."""


def test_ranks_with_different_flags_stop_at_start_with_one_clear_line(tmp_path):
    worker = tmp_path / "per_rank_args.py"
    worker.write_text(_WORKER)
    args = [str(worker), "train", "--parallel", "--size", "tiny", "--steps", "2", "--batch-size", "16",
            "--quiet", "--collective-timeout", "60", "--checkpoint-dir", str(tmp_path / "ck")]
    begin = time.monotonic()
    proc = torchrun(2, args, {"EXTRA_ARGS_1": "--seed 1 --emb-outer 2"}, timeout=150)
    elapsed = time.monotonic() - begin
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("gemcompile train: error:")]
    assert len(errors) == 1, proc.stderr[-4000:]  # said once, by rank 0
    line = errors[0]
    assert line.startswith("gemcompile train: error: ranks disagree on the configuration: "), line
    assert "seed is 0 on ranks [0] and 1 on ranks [1]" in line
    assert "emb_outer is 1 on ranks [0] and 2 on ranks [1]" in line
    assert line.endswith("every rank must be launched with the same flags")
    assert "exitcode  : 2" in proc.stderr  # a bad flag's exit status, on every rank
    assert elapsed < 60, elapsed  # before any other collective, not at the collective timeout
    assert not list((tmp_path / "ck").glob("step_*"))  # nothing trained, nothing saved
