"""benchmarks/gpu_tests.py's summary of pytest's JUnit XML: what a GPU test log may claim."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from gpu_tests import summarize  # noqa: E402

_XML = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.gpu.test_a_gpu" name="test_ok" time="1.0" />
<testcase classname="tests.gpu.test_a_gpu.TestGroup" name="test_fail" time="1.0"><failure message="x"/></testcase>
<testcase classname="tests.gpu.test_b_gpu" name="test_skip" time="0.0"><skipped message="no"/></testcase>
<testcase time="0.002" />
</testsuite></testsuites>"""


def test_summary_counts_per_file_and_never_counts_the_cut_test_as_passed(tmp_path):
    path = tmp_path / "log.xml"
    path.write_text(_XML)
    found = summarize(path)
    assert found["by_file"]["tests/gpu/test_a_gpu.py"] == {"tests": 2, "passed": 1, "failed": 1, "errors": 0,
                                                           "skipped": 0}
    assert found["by_file"]["tests/gpu/test_b_gpu.py"]["skipped"] == 1
    assert found["total"]["passed"] == 1 and found["total"]["tests"] == 3
    assert found["interrupted"] == 1
    assert found["failed_tests"] == ["tests/gpu/test_a_gpu.py::test_fail"]
