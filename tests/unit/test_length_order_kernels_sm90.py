"""The per-step length kernels (lowering/common/length_order_triton.py: the longest-first rank and the key
bounds) compile for sm_90a without spilling: ptxas's -v log, on the CPU (no GPU needed).

The rank kernel compared a (BLOCK, BLOCK) tile of int64 keys: at BLOCK 128 it spilled (380 bytes a thread
with triton 3.9's ptxas, about 3 KB with triton 3.6's, issue 25). It now compares BLOCK rows against
BLOCK_J = 32 columns at a time. The compiles run in a child process without TRITON_INTERPRET (the test
process imports the kernels under the interpreter, tests/conftest.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton.backends.nvidia")

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, os, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

try:
    from triton.backends.nvidia.compiler import get_ptxas
    PTXAS = get_ptxas(90).path
except (ImportError, AttributeError, RuntimeError, TypeError):
    PTXAS = None
if not PTXAS or not os.path.exists(PTXAS):
    print("REPORT " + json.dumps({"skip": "no ptxas binary in this triton install"}))
    sys.exit(0)
from gemcompile.lowering.common import length_order_triton as lot


def spills(fn, sig, consts):
    attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(sig.values()) if t.startswith("*")}
    k = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 4, "num_stages": 1})
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(k.asm["ptx"])
        out = subprocess.run([PTXAS, "-v", "--gpu-name=sm_90a", src, "-o", os.path.join(d, "k.cubin")],
                             capture_output=True, text=True)
    return [line.strip() for line in (out.stdout + out.stderr).splitlines() if "spill" in line]


report = {}
for block in (16, 64, 128):  # the launcher's BLOCK: min(128, max(16, next_power_of_2(B)))
    report[f"rank_{block}"] = spills(
        lot._rank_kernel, {"Key": "*i64", "Order": "*i64", "B": "i32", "BLOCK": "constexpr", "BLOCK_J": "constexpr"},
        {"BLOCK": block, "BLOCK_J": min(block, 32)})
report["key_bounds_1024"] = spills(
    lot._key_bounds_kernel, {"Mask": "*u8", "Lengths": "*i64", "Bounds": "*i32", "Span": "*i32", "L": "i32",
                             "stride_mb": "i32", "stride_mn": "i32", "HAS_LENGTHS": "constexpr",
                             "BLOCK": "constexpr"}, {"HAS_LENGTHS": True, "BLOCK": 1024})
print("REPORT " + json.dumps(report))
"""


def test_length_order_kernels_do_not_spill_on_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("REPORT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    report = json.loads(lines[-1][len("REPORT "):])
    if "skip" in report:
        pytest.skip(report["skip"])
    assert set(report) == {"rank_16", "rank_64", "rank_128", "key_bounds_1024"}
    for name, spill_lines in report.items():
        assert spill_lines, f"{name}: ptxas printed no spill line"
        assert all(" 0 bytes spill stores, 0 bytes spill loads" in line for line in spill_lines), (name, spill_lines)
