"""torchrun for the multi-process tests: gloo ranks on the CPU, one thread each, in a session of their own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_LAUNCHER_ENV = ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def torchrun(nproc: int, args: list[str], env: dict | None = None, timeout: int = 240) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run --standalone --nproc_per_node=nproc *args`` from the repository root,
    with this process's environment minus a launcher's variables, plus `env`. On timeout its ranks are killed
    with it, not left running."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    full_env = {**{k: v for k, v in os.environ.items() if k not in _LAUNCHER_ENV},
                "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env, cwd=ROOT,
                          start_new_session=True) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
