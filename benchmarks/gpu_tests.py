"""Run the GPU tests (tests/gpu) and leave a log: pytest's JUnit XML and a summary JSON beside it.

    python benchmarks/gpu_tests.py [--out DIR] [--timeout-s 540] [-- PYTEST_ARGS...]
    python benchmarks/gpu_tests.py -- tests/gpu/test_block_attention_gpu.py -k float64   # a subset

Writes ``gpu-tests-<stamp>.xml`` (``pytest --junitxml``) and ``gpu-tests-<stamp>.json`` (counts per test
file and in total, read back from the XML, with the environment block of the one results writer) into
$OUT, else --out, else ``benchmarks/results/gpu-tests/``. The README's GPU test outcomes are rendered
from these files (benchmarks/render_report.py, block ``gpu-tests``); a count with no log behind it is
not stated. A run cut by --timeout-s gets SIGINT (pytest then writes the XML of the tests that finished) and is
marked ``complete: false``.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))
from harness import results_path, rewrite_results  # noqa: E402

REPO = _HERE.parent


def summarize(xml_path: Path) -> dict:
    """Counts per test file and in total from a JUnit XML file (pytest's)."""
    by_file: dict[str, dict[str, int]] = {}
    failed_tests: list[str] = []
    interrupted = 0
    for case in ET.parse(xml_path).iter("testcase"):
        if not case.get("name"):  # the test SIGINT cut: pytest writes a nameless entry, not a pass
            interrupted += 1
            continue
        module = case.get("classname") or case.get("name", "")  # a module skipped whole: its name
        parts = module.split(".")
        while parts and parts[-1][:1].isupper():  # a test class: Test... belongs to its module
            parts.pop()
        file = "/".join(parts) + ".py" if parts else case.get("file", "?")
        counts = by_file.setdefault(file, {"tests": 0, "passed": 0, "failed": 0, "errors": 0, "skipped": 0})
        counts["tests"] += 1
        kinds = {child.tag for child in case}
        if "failure" in kinds:
            counts["failed"] += 1
            failed_tests.append(f"{file}::{case.get('name')}")
        elif "error" in kinds:
            counts["errors"] += 1
            failed_tests.append(f"{file}::{case.get('name')} (error)")
        elif "skipped" in kinds:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    total = {k: sum(c[k] for c in by_file.values()) for k in ("tests", "passed", "failed", "errors", "skipped")}
    return {"by_file": dict(sorted(by_file.items())), "total": total, "failed_tests": failed_tests,
            "interrupted": interrupted}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="directory (default: $OUT, else benchmarks/results/gpu-tests/)")
    parser.add_argument("--timeout-s", type=float, default=540.0, help="stop pytest after this many seconds")
    args = parser.parse_args(own)
    out_dir = args.out or (None if os.environ.get("OUT") else str(_HERE / "results" / "gpu-tests"))
    json_path = results_path("gpu-tests", out_dir)
    xml_path = json_path.with_suffix(".xml")
    cmd = [sys.executable, "-m", "pytest", "-q", "-rA", f"--junitxml={xml_path}", *(extra or ["tests/gpu"])]
    print(" ".join(cmd), flush=True)
    started = time.time()
    proc = subprocess.Popen(cmd, cwd=REPO)
    try:
        returncode, complete = proc.wait(timeout=args.timeout_s), True
    except subprocess.TimeoutExpired:
        # SIGINT, as Ctrl-C: pytest stops and still writes its JUnit XML for the tests that finished (a kill
        # left no log: gpu-tests-20261202-023538.json); killed only if it does not stop within 60 s
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        returncode, complete = None, False
    payload = {"benchmark": "gpu_tests", "pytest_command": cmd, "pytest_returncode": returncode,
               "complete": complete, "wall_s": round(time.time() - started, 1), "junit_xml": xml_path.name}
    if xml_path.exists():
        payload.update(summarize(xml_path))
    else:
        payload["error"] = "pytest wrote no JUnit XML (cut before it finished)"
    rewrite_results(json_path, payload)
    print(f"log: {xml_path}\nsummary: {json_path}: {payload.get('total')}")
    return 0 if returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
